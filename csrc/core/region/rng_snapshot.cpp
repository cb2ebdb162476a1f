#include "csrc/core/region/rng_snapshot.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

#include <mutex>

namespace torch_sac::region {
namespace {

// The device an op draws on: its `device` argument when given (factories,
// and `randn_like(x, device=...)`, which draws on the new device), else its
// first tensor argument's, else CPU.
c10::Device op_device(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  for (size_t i = 0; i < schema.arguments().size() && i < args.size(); ++i) {
    if (schema.arguments()[i].name() == "device" && args[i].isDevice()) {
      return args[i].toDevice();
    }
  }
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) {
      return v.toTensor().device();
    }
  }
  return c10::Device(c10::kCPU);
}

// Devices without a random generator (meta: shape inference) draw nothing.
bool has_generator(c10::Device device) {
  return device.is_cpu() || device.is_cuda() || device.is_xpu() || device.is_mps() ||
      device.is_privateuseone() || device.is_hpu() || device.type() == c10::DeviceType::MTIA;
}

// Generators are handles: copies share the state they point to.
at::Generator clone_locked(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.clone();
}

} // namespace

std::optional<RngSnapshot> RngSnapshot::capture(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> args) {
  RngSnapshot snap;
  const auto& schema = op.schema();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& type = schema.arguments()[i].type();
    const bool generator_slot = type->kind() == c10::TypeKind::GeneratorType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->containedType(0)->kind() == c10::TypeKind::GeneratorType);
    if (generator_slot) {
      snap.generator_arg_ = i;
      if (i < args.size() && args[i].isGenerator()) {
        snap.state_ = clone_locked(args[i].toGenerator());
        return snap;
      }
    }
  }
  const c10::Device device = op_device(schema, args);
  if (!has_generator(device)) {
    return std::nullopt;
  }
  snap.default_generator_ = at::globalContext().defaultGenerator(device);
  snap.state_ = clone_locked(snap.default_generator_);
  return snap;
}

void RngSnapshot::replay(torch::jit::Stack& args, c10::function_ref<void()> run) const {
  if (generator_arg_) {
    args[*generator_arg_] = clone_locked(state_);
    run();
    return;
  }
  // Kernels lock the generator while drawing, so it cannot stay locked while
  // the op runs; like torch.utils.checkpoint's RNG fork, a concurrent user of
  // the same default generator is not isolated from this swap.
  at::Generator generator = default_generator_;
  const at::Tensor replayed = clone_locked(state_).get_state();
  at::Tensor current;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    current = generator.get_state();
    generator.set_state(replayed);
  }
  auto restore = [&] {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(current);
  };
  try {
    run();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

} // namespace torch_sac::region
