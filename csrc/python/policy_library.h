#pragma once
// Python bindings of the policy library (named scopes, save_by_name, the
// bridge behind OpPolicy.to_torch()). Kept apart from bindings.cpp.

#include <pybind11/pybind11.h>

namespace torch_sac::python {

// Adds the policy-library functions to torch_sac._C and methods to the
// OpPolicy and SelectiveCheckpoint classes, which must already be bound.
void register_policy_library(pybind11::module_& m);

} // namespace torch_sac::python
