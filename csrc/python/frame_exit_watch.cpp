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

// Runs and removes the watches of `frame` on this thread, innermost first. The
// frame may be ending by an exception: it is kept while callbacks run.
void fire(PyFrameObject* frame) {
  if (tls.watches.empty()) {
    return;
  }
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
    return;
  }
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
}

#if PY_VERSION_HEX >= 0x030C0000
// Python >= 3.12: sys.monitoring events of a tool id of torch_sac's own. The
// code object of each watched frame (torch's checkpoint()) gets a local
// PY_RETURN event, and PY_UNWIND, a global event CPython emits only when an
// exception unwinds a frame, is on: nothing else runs slower. Both stay on
// once set: switching events re-instruments code, which would cost more
// per checkpoint call than the events do. Events are per interpreter; the
// callback finds this thread's watches by the frame ending (PyEval_GetFrame()
// while the event runs) and returns at once when there are none.
struct Monitoring {
  py::object module; // sys.monitoring
  int tool = -1;     // -1: every id we may take is in use: the profile function instead
  std::vector<py::object> watched_code; // code objects with the local event on
};

Monitoring* monitoring = nullptr; // made on first use, under the GIL; never freed

PyObject* on_monitoring_event(PyObject* /*self*/, PyObject* const* /*args*/, Py_ssize_t /*n*/) {
  // Every unwinding frame of the process comes here: return before
  // PyEval_GetFrame() makes a frame object, unless this thread watches one.
  if (!tls.watches.empty()) {
    fire(PyEval_GetFrame());
  }
  Py_RETURN_NONE;
}

PyMethodDef monitoring_callback_def = {
    "torch_sac_frame_exit",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&on_monitoring_event)),
    METH_FASTCALL, "torch_sac's frame-exit watch (PY_RETURN and PY_UNWIND)."};

Monitoring& get_monitoring() {
  if (monitoring != nullptr) {
    return *monitoring;
  }
  monitoring = new Monitoring();
  py::object mon = py::module_::import("sys").attr("monitoring");
  monitoring->module = mon;
  // Ids 0, 1, 2 and 5 are the debugger's, coverage's, profilers' and
  // optimizers' by convention; take a free one of the others.
  for (int id : {4, 3}) {
    if (mon.attr("get_tool")(id).is_none()) {
      mon.attr("use_tool_id")(id, "torch_sac frame-exit watch");
      monitoring->tool = id;
      break;
    }
  }
  if (monitoring->tool >= 0) {
    py::object callback = py::reinterpret_steal<py::object>(
        PyCFunction_New(&monitoring_callback_def, nullptr));
    if (!callback) {
      throw py::error_already_set();
    }
    py::object events = mon.attr("events");
    mon.attr("register_callback")(monitoring->tool, events.attr("PY_RETURN"), callback);
    mon.attr("register_callback")(monitoring->tool, events.attr("PY_UNWIND"), callback);
    mon.attr("set_events")(monitoring->tool, events.attr("PY_UNWIND"));
  }
  return *monitoring;
}

// Watches frames by sys.monitoring when a tool id was free; `frame`'s code
// gets its local event on the first time.
bool monitor(PyObject* frame) {
  Monitoring& m = get_monitoring();
  if (m.tool < 0) {
    return false;
  }
  auto code = py::reinterpret_steal<py::object>(
      reinterpret_cast<PyObject*>(PyFrame_GetCode(reinterpret_cast<PyFrameObject*>(frame))));
  for (const py::object& watched : m.watched_code) {
    if (watched.ptr() == code.ptr()) {
      return true;
    }
  }
  // Another tool may have freed our id (sys.monitoring.free_tool_id): the
  // profile function from now on.
  if (m.module.attr("get_tool")(m.tool).is_none()) {
    m.tool = -1;
    return false;
  }
  m.module.attr("set_local_events")(m.tool, code, m.module.attr("events").attr("PY_RETURN"));
  m.watched_code.push_back(std::move(code));
  return true;
}

const char* backend() {
  return get_monitoring().tool >= 0 ? "sys.monitoring" : "profile function";
}
#else
bool monitor(PyObject* /*frame*/) {
  return false;
}

const char* backend() {
  return "profile function";
}
#endif

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
  fire(frame);
  uninstall();
  return 0;
}

int64_t watch_frame_exit(py::handle frame, py::object callback) {
  TORCH_CHECK_TYPE(PyFrame_Check(frame.ptr()), "torch_sac: watch_frame_exit needs a frame");
  TORCH_CHECK_TYPE(
      PyCallable_Check(callback.ptr()), "torch_sac: watch_frame_exit needs a callable");
  if (!monitor(frame.ptr())) {
    install();
  }
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
  m.def(
      "frame_exit_watch_backend", [] { return std::string(backend()); },
      "How watches see frames end: 'sys.monitoring' (Python >= 3.12, a tool id of "
      "torch_sac's own was free) or 'profile function'.");
}

} // namespace torch_sac::python
