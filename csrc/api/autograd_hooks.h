#pragma once
// How a SacContext reaches autograd's saved tensors in a C++-only program.
//
// Python's `saved_tensors_hooks` rest on at::SavedTensorDefaultHooks, which
// holds PyObjects only. The C++ extension point is the autograd engine:
// every SavedVariable asks Engine::get_default_engine() for
// get_default_saved_variable_hooks(), which the base Engine answers with
// nullptr. torch_sac's C++ API installs an Engine subclass as the default
// engine (torch::autograd::set_default_engine_stub) that answers with hooks
// forwarding to the region active on the calling thread, and with nullptr
// when none is.
//
// Never in a Python process: there PythonEngine is the default engine and
// must stay so (it runs Python hooks, anomaly mode, ...). The install refuses
// when the default engine is not the base engine, and the Python extension
// does not link this code at all.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>

namespace torch_sac::region {
class Region;
} // namespace torch_sac::region

namespace torch_sac::api {

// Makes torch_sac's engine the default autograd engine (idempotent).
// Raises when another engine (PythonEngine) is the default.
void install_region_autograd_hooks();

// True once torch_sac's engine is the default autograd engine.
bool region_autograd_hooks_installed();

// Defined by the context stack (sac_context.cpp): the region whose hooks
// autograd should use for a tensor saved on this thread now, or nullptr.
std::shared_ptr<region::Region> region_for_saved_tensors();

// RAII: while alive, every tensor autograd saves on this thread outside a
// region is shown to `observe` as it is packed, and autograd keeps it as it
// would without hooks (checking its version on unpack as autograd does).
// The budget profiler measures activation memory with it, as Python's does
// with saved_tensors_hooks. Nests; the innermost observer sees the tensors.
class SavedTensorObserver {
 public:
  explicit SavedTensorObserver(std::function<void(const at::Tensor&)> observe);
  ~SavedTensorObserver();
  SavedTensorObserver(const SavedTensorObserver&) = delete;
  SavedTensorObserver& operator=(const SavedTensorObserver&) = delete;

 private:
  std::function<void(const at::Tensor&)> observe_;
};

} // namespace torch_sac::api
