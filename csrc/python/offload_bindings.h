#pragma once
// Bindings for the offload runtime (csrc/core/offload/): its options and
// statistics, behind torch_sac.offload.

#include <pybind11/pybind11.h>

namespace torch_sac::python {

void register_offload(pybind11::module_& m);

} // namespace torch_sac::python
