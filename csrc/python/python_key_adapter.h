#pragma once
// The universal adapter: a TorchDispatchMode (at the Python dispatch key)
// whose __torch_dispatch__ is a C fastcall function running an OpHandler.

#include <pybind11/pybind11.h>

#include <memory>

#include "csrc/core/interceptor.h"

namespace torch_sac::python {

// Adds torch_sac._C.HandlerModeBase: a base class whose __torch_dispatch__ is
// a C fastcall method running the OpHandler bound by `_set_handler(handler)`.
// torch_sac's TorchDispatchMode derives from it and from TorchDispatchMode
// (torch requires __torch_dispatch__ to be a method bound to the mode).
void register_handler_mode_base(pybind11::module_& m);

// The OpOverload object for an operator (torch.ops.ns.name.overload), cached.
pybind11::object overload_for(const c10::OperatorHandle& op);

// The dispatcher operator behind an OpOverload object (cached per object);
// unset for callables that are not dispatcher operators (HigherOrderOperators).
std::optional<c10::OperatorHandle> operator_for(PyObject* func);

} // namespace torch_sac::python
