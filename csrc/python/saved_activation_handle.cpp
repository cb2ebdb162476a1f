#include "csrc/python/saved_activation_handle.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <new>
#include <optional>
#include <utility>

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

PyTypeObject* saved_type = nullptr;
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

PyObject* pack(PyObject* self, PyObject* tensor) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      THPVariable_Check(tensor), "torch_sac: a region's pack hook takes a tensor, got ",
      Py_TYPE(tensor)->tp_name);
  const at::Tensor& t = THPVariable_Unpack(tensor);
  region::Region& region = *reinterpret_cast<PackerObject*>(self)->region;
  std::optional<region::SavedActivation> saved = region.try_pack(t);
  if (!saved) {
    py::gil_scoped_release no_gil; // another thread holds the region
    saved.emplace(region.pack(t));
  }
  return wrap(std::move(*saved));
  END_HANDLE_TH_ERRORS
}

PyObject* unpack_saved(PyObject* /*module*/, PyObject* handle) {
  HANDLE_TH_ERRORS
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
