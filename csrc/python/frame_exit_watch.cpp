#include "csrc/python/frame_exit_watch.h"

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
  // Identity only, not a reference: if the profile function is replaced
  // before the frame ends (sys.setprofile in the user's code), the watch
  // never fires, and the frame must still be freed as usual, so that the
  // garbage collector can close torch's generator (which removes the watch
  // through the context's exit). A watch is removed before its frame can be
  // freed, except for a generator leaked for good.
  PyObject* frame;
  py::object callback;
};

struct ThreadWatches {
  ~ThreadWatches() {
    // Runs at thread exit without the GIL: leak what is still pending rather
    // than touch reference counts.
    for (auto& watch : watches) {
      watch.callback.release();
    }
  }

  std::vector<Watch> watches;
  // The profile function this thread had before ours.
  Py_tracefunc previous_func = nullptr;
  PyObject* previous_obj = nullptr; // strong reference while installed
  bool installed = false;
};

thread_local ThreadWatches tls;
int64_t next_token = 1; // guarded by the GIL

int on_profile_event(PyObject* obj, PyFrameObject* frame, int what, PyObject* arg);

bool ours_is_set() {
  return PyThreadState_Get()->c_profilefunc == &on_profile_event;
}

void install() {
  if (tls.installed && ours_is_set()) {
    return;
  }
  // First watch, or ours was replaced since (sys.setprofile, a profiler, a
  // profile function that raised): chain to whatever is set now.
  PyThreadState* state = PyThreadState_Get();
  PyObject* stale = tls.previous_obj;
  tls.previous_func = state->c_profilefunc;
  tls.previous_obj = state->c_profileobj;
  Py_XINCREF(tls.previous_obj);
  Py_XDECREF(stale);
  // The previous object stays what sys.getprofile() returns, so code that
  // saves and restores it keeps the user's profile function.
  PyEval_SetProfile(&on_profile_event, tls.previous_obj);
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
  if (ours_is_set()) {
    PyEval_SetProfile(tls.previous_func, previous_obj);
  }
  Py_XDECREF(previous_obj);
  tls.previous_func = nullptr;
}

int on_profile_event(PyObject* /*obj*/, PyFrameObject* frame, int what, PyObject* arg) {
  if (tls.previous_func != nullptr && tls.previous_func(tls.previous_obj, frame, what, arg) != 0) {
    return -1;
  }
  if (what != PyTrace_RETURN || tls.watches.empty()) {
    return 0;
  }
  // Innermost first: watches are pushed as frames are entered.
  std::vector<py::object> fired;
  for (auto it = tls.watches.begin(); it != tls.watches.end();) {
    if (it->frame == reinterpret_cast<PyObject*>(frame)) {
      fired.push_back(std::move(it->callback));
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
  TORCH_CHECK_TYPE(
      PyCallable_Check(callback.ptr()), "torch_sac: watch_frame_exit needs a callable");
  install();
  const int64_t token = next_token++;
  tls.watches.push_back(Watch{token, frame.ptr(), std::move(callback)});
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
  m.def(
      "watch_frame_exit", &watch_frame_exit, py::arg("frame"), py::arg("callback"),
      "Calls callback() when `frame` (running on this thread) returns or is "
      "unwound by an exception; returns a token for unwatch_frame_exit.");
  m.def(
      "unwatch_frame_exit", &unwatch_frame_exit, py::arg("token"),
      "Cancels a watch of this thread (no-op for an unknown token).");
  m.def("frame_exit_watches", [] { return tls.watches.size(); }, "Watches pending on this thread.");
}

} // namespace torch_sac::python
