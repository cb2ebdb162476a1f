#pragma once
// The Python object autograd's saved-tensor hooks hold for a region.
//
// Lock order: the region's mutex is never taken while this thread holds the
// GIL. A rebuild holds the mutex while replaying, and replaying a custom op
// with a Python kernel takes the GIL; a thread that held the GIL and waited
// for the mutex (freeing a saved activation, packing, reading stats) could
// deadlock against it when backward runs on two threads. So every entry
// point into a Region from Python releases the GIL before it waits for the
// region (the hot ones, pack and this destructor, which Python runs with
// the GIL held, first try without waiting).

#include <pybind11/pybind11.h>

#include <utility>

#include "csrc/core/region/region.h"

namespace torch_sac::python {

struct SavedActivationHandle {
  explicit SavedActivationHandle(region::SavedActivation s) : saved(std::move(s)) {}
  SavedActivationHandle(SavedActivationHandle&&) noexcept = default;
  SavedActivationHandle& operator=(SavedActivationHandle&&) noexcept = default;
  ~SavedActivationHandle() {
    if (saved.region && !saved.region->try_forget(saved)) {
      pybind11::gil_scoped_release no_gil; // a replay holds the region
      region::SavedActivation dying = std::move(saved);
    }
  }
  region::SavedActivation saved;
};

} // namespace torch_sac::python
