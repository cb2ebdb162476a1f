#pragma once
// What the Python-key adapter hands policies through OpCall::adapter_view:
// the Python objects __torch_dispatch__ received, so a Python policy need not
// rebuild them from the IValue stack.

#include <Python.h>

namespace torch_sac::python {

struct PythonCallView {
  PyObject* func;   // the OpOverload
  PyObject* args;   // tuple
  PyObject* kwargs; // dict, or None
};

} // namespace torch_sac::python
