#pragma once
// The universal adapter: a TorchDispatchMode (at the Python dispatch key)
// whose __torch_dispatch__ is a C fastcall function running an OpHandler.

#include <pybind11/pybind11.h>

#include <memory>

#include "csrc/core/interceptor.h"

namespace torch_sac::python {

// A builtin function `(func, types, args, kwargs)` bound to `handler`, meant to
// be set as a TorchDispatchMode instance's __torch_dispatch__.
pybind11::object make_torch_dispatch(std::shared_ptr<OpHandler> handler);

// The OpOverload object for an operator (torch.ops.ns.name.overload), cached.
pybind11::object overload_for(const c10::OperatorHandle& op);

} // namespace torch_sac::python
