#include "csrc/python/python_key_adapter.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <unordered_map>

#include "csrc/python/python_call_view.h"

namespace py = pybind11;

namespace torch_sac::python {
namespace {

// The operator behind each OpOverload object seen so far. Keys hold a strong
// reference so a pointer is never reused by another object. Guarded by the GIL.
struct ResolvedOp {
  std::optional<c10::OperatorHandle> op; // unset: not a dispatcher operator
};
std::unordered_map<PyObject*, ResolvedOp>& resolved_ops() {
  static auto* ops = new std::unordered_map<PyObject*, ResolvedOp>();
  return *ops;
}

const ResolvedOp& resolve(PyObject* func) {
  auto& ops = resolved_ops();
  auto it = ops.find(func);
  if (it != ops.end()) {
    return it->second;
  }
  ResolvedOp resolved;
  py::handle f(func);
  // HigherOrderOperators and other callables have no schema: pass them through.
  if (py::hasattr(f, "_schema")) {
    py::object schema = f.attr("_schema");
    c10::OperatorName name(
        py::cast<std::string>(schema.attr("name")),
        py::cast<std::string>(schema.attr("overload_name")));
    resolved.op = c10::Dispatcher::singleton().findOp(name);
  }
  Py_INCREF(func);
  return ops.emplace(func, std::move(resolved)).first->second;
}

// Whether every type in `types` (a __torch_dispatch__ types tuple, not
// empty) is a traceable wrapper subclass (DTensor, a subclass with
// __tensor_flatten__): their inner tensors are plain, so the ops they run
// are for a region to record. Other subclasses (FakeTensor, which defers to
// an active mode and would hand the op back) are run by the handler as
// before. Guarded by the GIL; types are kept alive by the cache.
bool all_traceable_subclasses(PyObject* types) {
  static auto* traceable = new std::unordered_map<PyObject*, bool>();
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  if (n == 0) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* type = PyTuple_GET_ITEM(types, i);
    auto it = traceable->find(type);
    if (it == traceable->end()) {
      py::handle t(type);
      Py_INCREF(type);
      it = traceable
               ->emplace(
                   type,
                   py::hasattr(t, "__tensor_flatten__") && py::hasattr(t, "__tensor_unflatten__"))
               .first;
    }
    if (!it->second) {
      return false;
    }
  }
  return true;
}

// Instances of torch_sac._C.HandlerModeBase: the C part of the mode object.
struct HandlerModeObject {
  PyObject_HEAD std::shared_ptr<OpHandler>* handler; // owned; null until _set_handler
};

PyObject* torch_dispatch(PyObject* self, PyObject* const* argv, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      nargs == 3 || nargs == 4,
      "torch_sac: __torch_dispatch__ expects (func, types, args, kwargs), got ", nargs,
      " arguments");
  auto* mode = reinterpret_cast<HandlerModeObject*>(self);
  TORCH_CHECK(mode->handler, "torch_sac: this mode has no handler; call _set_handler first");
  PyObject* func = argv[0];
  PyObject* args = argv[2];
  PyObject* kwargs = nargs == 4 ? argv[3] : Py_None;
  const ResolvedOp& resolved = resolve(func);
  if (!resolved.op) {
    return PyObject_Call(func, args, kwargs == Py_None ? nullptr : kwargs);
  }
  const c10::OperatorHandle& op = *resolved.op;
  // Keeps the handler alive even if the mode is reset while the op runs.
  const std::shared_ptr<OpHandler> handler = *mode->handler;
  PyObject* types = argv[1];
  if (handler->defers_to_subclasses() && PyTuple_Check(types) && all_traceable_subclasses(types)) {
    // A subclass's op: torch runs its __torch_dispatch__ with this mode
    // still active, so the ops it runs on the inner tensors come back here.
    Py_RETURN_NOTIMPLEMENTED;
  }
  // Python numbers in Tensor slots (`x * 0.5`, `t.add_(1)`) become wrapped
  // numbers, as when torch itself calls an OpOverload from Python.
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(true);
  torch::jit::Stack stack = torch::jit::createStackForSchema(
      op.schema(), py::reinterpret_borrow<py::tuple>(args),
      kwargs == Py_None ? py::kwargs() : py::reinterpret_borrow<py::kwargs>(kwargs), std::nullopt);
  const PythonCallView view{func, args, kwargs};
  {
    // Handlers run without the GIL, as under the key adapter (torch's op
    // bindings release it): a region's mutex may be held by a backward
    // thread whose rebuild needs the GIL (copying a tensor Python owns takes
    // it), so waiting for that mutex with the GIL held would deadlock.
    // Python policies take the GIL back themselves.
    py::gil_scoped_release no_gil;
    handler->handle(
        op, &stack,
        [&](torch::jit::Stack* s) {
          // torch pops this mode while __torch_dispatch__ runs, so this call
          // reaches the next mode or the kernel.
          op.callBoxed(s);
        },
        &view);
  }
  return torch::jit::createPyObjectForStack(std::move(stack)).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* set_handler(PyObject* self, PyObject* arg) {
  HANDLE_TH_ERRORS
  auto handler = py::cast<std::shared_ptr<OpHandler>>(py::handle(arg));
  TORCH_CHECK_VALUE(handler, "torch_sac: _set_handler needs a handler, got None");
  auto* mode = reinterpret_cast<HandlerModeObject*>(self);
  delete mode->handler;
  mode->handler = new std::shared_ptr<OpHandler>(std::move(handler));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

void dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  auto* mode = reinterpret_cast<HandlerModeObject*>(self);
  delete mode->handler;
  mode->handler = nullptr;
  type->tp_free(self);
}

PyMethodDef mode_methods[] = {
    {"__torch_dispatch__",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&torch_dispatch)), METH_FASTCALL,
     "Runs the op through torch_sac's C++ handler."},
    {"_set_handler", &set_handler, METH_O, "Binds the C++ op handler."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot mode_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&dealloc)},
    {Py_tp_methods, mode_methods},
    {Py_tp_new, reinterpret_cast<void*>(&PyType_GenericNew)},
    {Py_tp_doc,
     const_cast<char*>("Base of torch_sac's TorchDispatchMode: __torch_dispatch__ in C.")},
    {0, nullptr}};

PyType_Spec mode_spec = {
    "torch_sac._C.HandlerModeBase", sizeof(HandlerModeObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, mode_slots};

} // namespace

void register_handler_mode_base(py::module_& m) {
  PyObject* type = PyType_FromSpec(&mode_spec);
  if (!type) {
    throw py::error_already_set();
  }
  m.add_object("HandlerModeBase", py::reinterpret_steal<py::object>(type));
}

std::optional<c10::OperatorHandle> operator_for(PyObject* func) {
  return resolve(func).op;
}

py::object overload_for(const c10::OperatorHandle& op) {
  static auto* cache = new std::unordered_map<c10::OperatorHandle, py::object>();
  auto it = cache->find(op);
  if (it != cache->end()) {
    return it->second;
  }
  const auto& name = op.operator_name();
  const auto sep = name.name.find("::");
  TORCH_INTERNAL_ASSERT(sep != std::string::npos, "unqualified op ", name.name);
  py::object packet = py::module_::import("torch")
                          .attr("ops")
                          .attr(name.name.substr(0, sep).c_str())
                          .attr(name.name.substr(sep + 2).c_str());
  py::object overload = packet.attr(
      name.overload_name.empty() ? "default" : name.overload_name.c_str());
  cache->emplace(op, overload);
  return overload;
}

} // namespace torch_sac::python
