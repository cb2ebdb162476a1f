#include "csrc/python/saved_activation_handle.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <new>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_sac::python {
namespace {

// torch_sac._C.SavedActivation: one saved tensor, as autograd holds it.
struct SavedActivationObject {
  PyObject_HEAD region::SavedActivation saved; // constructed in wrap(), destroyed in dealloc
};

// The pack hook's bound object: the region it packs into.
struct PackerObject {
  PyObject_HEAD std::shared_ptr<region::Region> region; // constructed in pack_hook()
};

// torch_sac._C.SavedSubclass: a traceable wrapper subclass autograd saves
// (DTensor, a subclass with __tensor_flatten__), held as its inner tensors,
// each packed as any saved tensor (so the region may drop and rebuild them),
// and rebuilt with __tensor_unflatten__ when backward unpacks it.
struct SavedSubclassObject {
  PyObject_HEAD py::object cls; // constructed in pack_subclass(), destroyed in dealloc
  py::object ctx;
  py::object size;
  py::object stride;
  std::vector<std::pair<py::object, py::object>> inner; // (attribute, packed)
};

PyTypeObject* saved_type = nullptr;
PyTypeObject* saved_subclass_type = nullptr;
PyTypeObject* packer_type = nullptr;

void saved_dealloc(PyObject* self) {
  region::SavedActivation& saved = reinterpret_cast<SavedActivationObject*>(self)->saved;
  if (saved.region && !saved.region->try_forget(saved)) {
    py::gil_scoped_release no_gil; // a replay holds the region
    region::SavedActivation dying = std::move(saved);
  }
  saved.~SavedActivation();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type); // instances of heap types own a reference to their type
}

void saved_subclass_dealloc(PyObject* self) {
  auto* saved = reinterpret_cast<SavedSubclassObject*>(self);
  saved->cls.~object();
  saved->ctx.~object();
  saved->size.~object();
  saved->stride.~object();
  saved->inner.~vector();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

void packer_dealloc(PyObject* self) {
  {
    // The region may be destroyed here; it never needs the GIL to die.
    std::shared_ptr<region::Region> region = std::move(
        reinterpret_cast<PackerObject*>(self)->region);
    py::gil_scoped_release no_gil;
    region.reset();
  }
  reinterpret_cast<PackerObject*>(self)->region.~shared_ptr();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* wrap(region::SavedActivation saved) {
  PyObject* self = saved_type->tp_alloc(saved_type, 0);
  if (self == nullptr) {
    return nullptr; // ~SavedActivation tells the region, as if autograd had freed it
  }
  new (&reinterpret_cast<SavedActivationObject*>(self)->saved)
      region::SavedActivation(std::move(saved));
  return self;
}

// Whether autograd's saved `tensor` is a traceable wrapper subclass: a
// Python subclass whose type flattens into inner tensors and back.
bool is_traceable_subclass(PyObject* tensor, const at::Tensor& t) {
  if (!t.key_set().has(c10::DispatchKey::Python)) {
    return false;
  }
  py::handle type(reinterpret_cast<PyObject*>(Py_TYPE(tensor)));
  return py::hasattr(type, "__tensor_flatten__") && py::hasattr(type, "__tensor_unflatten__");
}

PyObject* pack(PyObject* self, PyObject* tensor);

py::tuple int_tuple(c10::IntArrayRef values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    out[i] = py::int_(values[i]);
  }
  return out;
}

// `tensor` as a SavedSubclass: its inner tensors packed by `packer`.
PyObject* pack_subclass(PyObject* packer, PyObject* tensor, const at::Tensor& t) {
  py::handle obj(tensor);
  py::tuple flat = obj.attr("__tensor_flatten__")();
  TORCH_CHECK_TYPE(
      flat.size() == 2, "torch_sac: ", Py_TYPE(tensor)->tp_name,
      ".__tensor_flatten__() must return (inner tensor attribute names, context)");
  std::vector<std::pair<py::object, py::object>> inner;
  for (py::handle name : py::iter(flat[0])) {
    py::object value = obj.attr(name);
    if (!THPVariable_Check(value.ptr())) {
      // Not a tensor (DTensor's device mesh, on recent torch): kept as is.
      inner.emplace_back(py::reinterpret_borrow<py::object>(name), std::move(value));
      continue;
    }
    PyObject* packed = pack(packer, value.ptr());
    if (packed == nullptr) {
      throw py::error_already_set();
    }
    inner.emplace_back(
        py::reinterpret_borrow<py::object>(name), py::reinterpret_steal<py::object>(packed));
  }
  PyObject* self = saved_subclass_type->tp_alloc(saved_subclass_type, 0);
  if (self == nullptr) {
    throw py::error_already_set();
  }
  auto* saved = reinterpret_cast<SavedSubclassObject*>(self);
  new (&saved->cls)
      py::object(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(tensor))));
  new (&saved->ctx) py::object(flat[1]);
  new (&saved->size) py::object(int_tuple(t.sizes()));
  new (&saved->stride) py::object(int_tuple(t.strides()));
  new (&saved->inner) std::vector<std::pair<py::object, py::object>>(std::move(inner));
  return self;
}

PyObject* pack(PyObject* self, PyObject* tensor) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      THPVariable_Check(tensor), "torch_sac: a region's pack hook takes a tensor, got ",
      Py_TYPE(tensor)->tp_name);
  const at::Tensor& t = THPVariable_Unpack(tensor);
  if (is_traceable_subclass(tensor, t)) {
    return pack_subclass(self, tensor, t);
  }
  region::Region& region = *reinterpret_cast<PackerObject*>(self)->region;
  std::optional<region::SavedActivation> saved = region.try_pack(t);
  if (!saved) {
    py::gil_scoped_release no_gil; // another thread holds the region
    saved.emplace(region.pack(t));
  }
  return wrap(std::move(*saved));
  END_HANDLE_TH_ERRORS
}

PyObject* unpack_saved(PyObject* module, PyObject* handle);

// The subclass a SavedSubclass stands for, from its inner tensors unpacked.
PyObject* unpack_subclass(PyObject* module, SavedSubclassObject* saved) {
  py::dict inner;
  for (const auto& [name, packed] : saved->inner) {
    if (Py_TYPE(packed.ptr()) != saved_type && Py_TYPE(packed.ptr()) != saved_subclass_type) {
      inner[name] = packed; // not a tensor
      continue;
    }
    PyObject* t = unpack_saved(module, packed.ptr());
    if (t == nullptr) {
      throw py::error_already_set();
    }
    inner[name] = py::reinterpret_steal<py::object>(t);
  }
  return saved->cls.attr("__tensor_unflatten__")(inner, saved->ctx, saved->size, saved->stride)
      .release()
      .ptr();
}

PyObject* unpack_saved(PyObject* module, PyObject* handle) {
  HANDLE_TH_ERRORS
  if (Py_TYPE(handle) == saved_subclass_type) {
    return unpack_subclass(module, reinterpret_cast<SavedSubclassObject*>(handle));
  }
  TORCH_CHECK_TYPE(
      Py_TYPE(handle) == saved_type,
      "torch_sac: unpack_saved takes what a region's pack hook returned, got ",
      Py_TYPE(handle)->tp_name);
  const region::SavedActivation& saved = reinterpret_cast<SavedActivationObject*>(handle)->saved;
  if (!saved.region) {
    return THPVariable_Wrap(region::unpack(saved)); // kept: no region to wait for
  }
  at::Tensor rebuilt;
  {
    py::gil_scoped_release no_gil;
    rebuilt = region::unpack(saved);
  }
  return THPVariable_Wrap(std::move(rebuilt));
  END_HANDLE_TH_ERRORS
}

PyMethodDef pack_def = {
    "pack", &pack, METH_O, "Packs a tensor autograd saves inside the region (the pack hook)."};

PyMethodDef module_defs[] = {
    {"unpack_saved", &unpack_saved, METH_O,
     "The tensor a torch_sac._C.SavedActivation stands for (the unpack hook)."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot saved_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&saved_dealloc)},
    {Py_tp_doc, const_cast<char*>("A tensor saved for backward inside a torch_sac region.")},
    {0, nullptr}};

PyType_Spec saved_spec = {
    "torch_sac._C.SavedActivation", sizeof(SavedActivationObject), 0,
    // Only pack() makes them: an instance made from Python would hold no
    // constructed SavedActivation.
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, saved_slots};

PyType_Slot saved_subclass_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&saved_subclass_dealloc)},
    {Py_tp_doc,
     const_cast<char*>("A tensor subclass saved for backward inside a torch_sac region, "
                       "as its inner tensors.")},
    {0, nullptr}};

PyType_Spec saved_subclass_spec = {
    "torch_sac._C.SavedSubclass", sizeof(SavedSubclassObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, saved_subclass_slots};

PyType_Slot packer_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&packer_dealloc)},
    {Py_tp_doc, const_cast<char*>("The region a torch_sac pack hook packs into.")},
    {0, nullptr}};

PyType_Spec packer_spec = {
    "torch_sac._C.RegionPacker", sizeof(PackerObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, packer_slots};

PyTypeObject* make_type(PyType_Spec* spec) {
  PyObject* type = PyType_FromSpec(spec);
  if (type == nullptr) {
    throw py::error_already_set();
  }
  return reinterpret_cast<PyTypeObject*>(type);
}

} // namespace

void register_saved_activation(py::module_& m) {
  saved_type = make_type(&saved_spec); // held for the process: the module owns a reference too
  saved_subclass_type = make_type(&saved_subclass_spec);
  packer_type = make_type(&packer_spec);
  m.add_object(
      "SavedActivation",
      py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(saved_type)));
  if (PyModule_AddFunctions(m.ptr(), module_defs) != 0) {
    throw py::error_already_set();
  }
}

py::object pack_hook(std::shared_ptr<region::Region> region) {
  TORCH_CHECK(region, "torch_sac: pack_hook needs a region");
  PyObject* packer = packer_type->tp_alloc(packer_type, 0);
  if (packer == nullptr) {
    throw py::error_already_set();
  }
  new (&reinterpret_cast<PackerObject*>(packer)->region)
      std::shared_ptr<region::Region>(std::move(region));
  auto owner = py::reinterpret_steal<py::object>(packer);
  PyObject* hook = PyCFunction_New(&pack_def, packer); // holds its own reference to packer
  if (hook == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(hook);
}

} // namespace torch_sac::python
