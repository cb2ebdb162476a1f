#include "csrc/core/region/c10d_objects.h"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#ifdef USE_DISTRIBUTED
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#endif

namespace torch_sac::region {
namespace {

// The c10d object of class `name` held by `value`, or null. Checked by the
// class's TorchScript name rather than by C++ type identity, which need not
// match across the shared libraries that register the class.
template <typename T>
c10::intrusive_ptr<T> c10d_object(const c10::IValue& value, const char* name) {
  if (!value.isObject() || !value.isCustomClass()) {
    return {};
  }
  const auto& object = value.toObjectRef();
  const auto qualified = object.type()->name();
  if (!qualified || qualified->qualifiedName() != name || object.slots().size() != 1) {
    return {};
  }
  return c10::static_intrusive_pointer_cast<T>(object.getSlot(0).toCapsule());
}

} // namespace

#ifdef USE_DISTRIBUTED

std::string c10d_group_name(const c10::IValue& pg) {
  const auto group = c10d_object<c10d::ProcessGroup>(
      pg, "__torch__.torch.classes.c10d.ProcessGroup");
  return group ? group->getGroupName() : std::string();
}

void wait_c10d_works(const torch::jit::Stack& outputs) {
  for (const c10::IValue& out : outputs) {
    if (const auto work = c10d_object<c10d::Work>(out, "__torch__.torch.classes.c10d.Work")) {
      work->wait();
    }
  }
}

#else

std::string c10d_group_name(const c10::IValue& /*pg*/) {
  return {};
}

void wait_c10d_works(const torch::jit::Stack& outputs) {
  for (const c10::IValue& out : outputs) {
    TORCH_CHECK(
        !out.isCustomClass(),
        "torch_sac: replaying a c10d collective needs a torch built with "
        "torch.distributed");
  }
}

#endif

} // namespace torch_sac::region
