#pragma once
// The region's saved-tensor hooks as autograd calls them from Python.
//
// Autograd calls the pack hook once per tensor a node saves inside a region,
// and frees what it returned when the node dies. Both are plain CPython
// objects: pybind11's dispatch, argument casting and instance registry cost
// about 0.8 us per saved tensor there (docs/adapters.md, "Where the time
// goes").
//
// Lock order: the region's mutex is never taken while this thread holds the
// GIL. A rebuild holds the mutex while replaying, and replaying a custom op
// with a Python kernel takes the GIL; a thread that held the GIL and waited
// for the mutex (freeing a saved activation, packing, reading stats) could
// deadlock against it when backward runs on two threads. So every entry
// point into a Region from Python releases the GIL before it waits for the
// region (the hot ones, pack and freeing a saved activation, which Python
// runs with the GIL held, first try without waiting).

#include <pybind11/pybind11.h>

#include <memory>

#include "csrc/core/region/region.h"

namespace torch_sac::python {

// Adds torch_sac._C.SavedActivation (what autograd holds for each saved
// tensor) and torch_sac._C.unpack_saved (the unpack hook).
void register_saved_activation(pybind11::module_& m);

// The pack hook of `region`: a builtin callable taking the tensor autograd
// saves and returning a torch_sac._C.SavedActivation.
pybind11::object pack_hook(std::shared_ptr<region::Region> region);

} // namespace torch_sac::python
