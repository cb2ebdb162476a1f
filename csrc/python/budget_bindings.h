#pragma once
// Bindings for the budget planner: the C++ solver and the saved-calls policy.

#include <pybind11/pybind11.h>

namespace torch_sac::python {

void register_budget(pybind11::module_& m);

} // namespace torch_sac::python
