#include "frame_exit_watch.h"

#include <Python.h>
#include <c10/util/Exception.h>
#include <frameobject.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace torch_sac::python {
namespace {

struct Watch {
  int64_t token;
  // Held: if the profile function is replaced before the frame ends, the
  // watch stays pending, and a new frame at the same address must not match.
  py::object frame;
  py::object callback;
};

struct ThreadWatches {
  ~ThreadWatches() {
    // Runs at thread exit without the GIL: leak what is still pending rather
    // than touch reference counts (only left when the frames never ended
    // under this profile function).
    for (auto& watch : watches) {
      watch.frame.release();
      watch.callback.release();
    }
  }

  std::vector<Watch> watches;
  // The profile function this thread had before the first watch.
  Py_tracefunc previous_func = nullptr;
  PyObject* previous_obj = nullptr; // strong reference while installed
  bool installed = false;
};

thread_local ThreadWatches tls;
int64_t next_token = 1; // guarded by the GIL

int on_profile_event(PyObject* obj, PyFrameObject* frame, int what, PyObject* arg);

void install() {
  if (tls.installed) {
    return;
  }
  PyThreadState* state = PyThreadState_Get();
  tls.previous_func = state->c_profilefunc;
  tls.previous_obj = state->c_profileobj;
  Py_XINCREF(tls.previous_obj);
  PyEval_SetProfile(&on_profile_event, nullptr);
  tls.installed = true;
}

void uninstall() {
  if (!tls.installed || !tls.watches.empty()) {
    return;
  }
  tls.installed = false;
  PyObject* previous_obj = tls.previous_obj;
  tls.previous_obj = nullptr;
  // Put the previous profile function back only if ours is still the one
  // set: code that set its own in the meantime (sys.setprofile) keeps it.
  if (PyThreadState_Get()->c_profilefunc == &on_profile_event) {
    PyEval_SetProfile(tls.previous_func, previous_obj);
  }
  Py_XDECREF(previous_obj);
  tls.previous_func = nullptr;
}

int on_profile_event(PyObject* /*obj*/, PyFrameObject* frame, int what, PyObject* arg) {
  if (tls.previous_func != nullptr &&
      tls.previous_func(tls.previous_obj, frame, what, arg) != 0) {
    return -1;
  }
  if (what != PyTrace_RETURN || tls.watches.empty()) {
    return 0;
  }
  // Innermost first: watches are pushed as frames are entered.
  std::vector<py::object> fired;
  std::vector<py::object> frames; // released after the loop, not inside it
  for (auto it = tls.watches.begin(); it != tls.watches.end();) {
    if (it->frame.ptr() == reinterpret_cast<PyObject*>(frame)) {
      fired.push_back(std::move(it->callback));
      frames.push_back(std::move(it->frame));
      it = tls.watches.erase(it);
    } else {
      ++it;
    }
  }
  if (fired.empty()) {
    return 0;
  }
  // The frame may be ending by an exception: keep it while callbacks run.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  for (auto it = fired.rbegin(); it != fired.rend(); ++it) {
    PyObject* result = PyObject_CallNoArgs(it->ptr());
    if (result == nullptr) {
      PyErr_WriteUnraisable(it->ptr());
    }
    Py_XDECREF(result);
  }
  PyErr_Restore(type, value, traceback);
  uninstall();
  return 0;
}

int64_t watch_frame_exit(py::handle frame, py::object callback) {
  TORCH_CHECK_TYPE(PyFrame_Check(frame.ptr()), "torch_sac: watch_frame_exit needs a frame");
  TORCH_CHECK_TYPE(PyCallable_Check(callback.ptr()), "torch_sac: watch_frame_exit needs a callable");
  install();
  const int64_t token = next_token++;
  tls.watches.push_back(Watch{token, py::reinterpret_borrow<py::object>(frame), std::move(callback)});
  return token;
}

void unwatch_frame_exit(int64_t token) {
  for (auto it = tls.watches.begin(); it != tls.watches.end(); ++it) {
    if (it->token == token) {
      tls.watches.erase(it);
      break;
    }
  }
  uninstall();
}

} // namespace

void register_frame_exit_watch(py::module_& m) {
  m.def("watch_frame_exit", &watch_frame_exit, py::arg("frame"), py::arg("callback"),
        "Calls callback() when `frame` (running on this thread) returns or is "
        "unwound by an exception; returns a token for unwatch_frame_exit.");
  m.def("unwatch_frame_exit", &unwatch_frame_exit, py::arg("token"),
        "Cancels a watch of this thread (no-op for an unknown token).");
  m.def("frame_exit_watches", [] { return tls.watches.size(); },
        "Watches pending on this thread.");
}

} // namespace torch_sac::python
