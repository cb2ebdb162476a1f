#include "csrc/api/autograd_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "csrc/core/detached_alias.h"
#include "csrc/core/region/region.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::api {
namespace {

using torch::autograd::Engine;
using torch::autograd::SavedVariableHooks;

// One saved tensor of a region, as autograd's SavedVariable holds it. Pack
// and unpack are the region's, as `saved_tensors_hooks(region.pack,
// unpack_saved)` does in Python; destroying it (autograd freed the node)
// tells the region through ~SavedActivation.
class RegionSavedVariableHooks final : public SavedVariableHooks {
 public:
  explicit RegionSavedVariableHooks(std::shared_ptr<region::Region> region)
      : region_(std::move(region)) {}

  void call_pack_hook(const at::Tensor& tensor) override {
    saved_ = region_->pack(tensor);
    // A dropped activation keeps its region itself; a kept one needs none.
    region_.reset();
  }

  at::Tensor call_unpack_hook() override {
    return region::unpack(saved_);
  }

 private:
  std::shared_ptr<region::Region> region_;
  region::SavedActivation saved_;
};

using Observe = std::function<void(const at::Tensor&)>;

// SavedTensorObservers alive on this thread, innermost last.
thread_local std::vector<const Observe*> tls_observers;

// A saved tensor shown to an observer, then held as autograd holds it.
class ObservedSavedVariableHooks final : public SavedVariableHooks {
 public:
  explicit ObservedSavedVariableHooks(const Observe* observe) : observe_(observe) {}

  void call_pack_hook(const at::Tensor& tensor) override {
    // Autograd packs right after asking for the hooks, on the same thread,
    // while the observer is alive; it may be gone by the time of unpack.
    (*observe_)(tensor);
    observe_ = nullptr;
    // As the region's pack holds it: an op's output holds its node, which
    // holds these hooks, so no autograd metadata (no reference cycle).
    saved_ = held_for_backward(tensor);
    version_counter_ = tensor.unsafeGetTensorImpl()->version_counter();
    version_ = current_version(version_counter_);
  }

  at::Tensor call_unpack_hook() override {
    // Autograd skips its own version check when hooks hold the tensor.
    const uint32_t now = current_version(version_counter_);
    TORCH_CHECK(
        now == version_,
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: a tensor of shape ",
        saved_.sizes(), " is at version ", now, "; expected version ", version_,
        " instead. (torch_sac: it was saved for backward "
        "while torch_sac::policies::budget profiled the region.)");
    return saved_;
  }

 private:
  const Observe* observe_;
  at::Tensor saved_;
  c10::VariableVersion version_counter_;
  uint32_t version_ = 0;
};

// The base engine plus default saved-variable hooks while a region (or a
// SavedTensorObserver) is active on the thread saving the tensor.
// Everything else is the base engine's.
class RegionAwareEngine final : public Engine {
 public:
  static Engine& get() {
    // Never destroyed: autograd's worker threads may still use it during
    // static destruction, whose order against libtorch's is unspecified.
    static RegionAwareEngine* engine = new RegionAwareEngine();
    return *engine;
  }

  std::unique_ptr<SavedVariableHooks> get_default_saved_variable_hooks() override {
    std::shared_ptr<region::Region> region = region_for_saved_tensors();
    if (region) {
      return std::make_unique<RegionSavedVariableHooks>(std::move(region));
    }
    if (!tls_observers.empty()) {
      return std::make_unique<ObservedSavedVariableHooks>(tls_observers.back());
    }
    return nullptr;
  }

 private:
  RegionAwareEngine() = default;
};

std::mutex install_mutex;
bool installed = false;

// Installs at load time, before any backward can run. Engine starts its
// device threads once per process, for whichever engine runs a backward
// first; an engine made the default after another ran a CUDA backward would
// have no device queues. Refused silently here (a Python process, where
// PythonEngine is the default); SacContext reports it.
[[maybe_unused]] const bool installed_at_load = [] {
  try {
    install_region_autograd_hooks();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}();

} // namespace

void install_region_autograd_hooks() {
  std::lock_guard<std::mutex> lock(install_mutex);
  Engine& current = Engine::get_default_engine();
  if (installed && &current == &RegionAwareEngine::get()) {
    return;
  }
  // Also when installed but replaced since (libtorch_python initialised after
  // this library loaded): regions would record, but autograd would never ask
  // for their hooks.
  TORCH_CHECK(
      &current == &Engine::get_base_engine(),
      "torch_sac: the C++ API (torch_sac::SacContext) needs autograd's base engine as the "
      "default engine, to give it torch_sac's saved-tensor hooks, but another engine is "
      "installed (PythonEngine: this is a Python process). In Python use torch_sac's Python "
      "API (torch_sac.sac_context), which uses torch.autograd.graph.saved_tensors_hooks.");
  torch::autograd::set_default_engine_stub(&RegionAwareEngine::get);
  installed = true;
}

SavedTensorObserver::SavedTensorObserver(Observe observe) : observe_(std::move(observe)) {
  tls_observers.push_back(&observe_);
}

SavedTensorObserver::~SavedTensorObserver() {
  tls_observers.erase(std::find(tls_observers.begin(), tls_observers.end(), &observe_));
}

bool region_autograd_hooks_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return installed && &Engine::get_default_engine() == &RegionAwareEngine::get();
}

} // namespace torch_sac::api
