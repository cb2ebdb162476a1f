#pragma once
// Runs a callback when a given Python frame of this thread ends, by return or
// by an exception unwinding it.
//
// Why: torch.utils.checkpoint of torch <= 2.12 enters its context_fn's
// contexts inside a generator and, when the checkpointed function raises,
// neither resumes nor closes that generator: the contexts stay entered until
// the garbage collector closes it, later, maybe on another thread. torch_sac's
// forward context watches the checkpoint() frame that entered it and exits
// itself when that frame ends while it is still entered (torch >= 2.13 throws
// the error into the generator instead; torch_sac/_compat.py).
//
// Python >= 3.12: sys.monitoring events under a tool id of torch_sac's own
// (4 or 3, whichever is free): a local PY_RETURN event on the watched frame's
// code object (torch's checkpoint()) and the global PY_UNWIND event, which
// CPython emits only when an exception unwinds a frame. Nothing else runs
// slower, and profilers and debuggers (their own tool ids, or
// sys.setprofile) are left alone.
//
// Python < 3.12, or no free tool id: a C-level profile function
// (PyEval_SetProfile) is installed on this thread only while a watch is
// pending. It calls the profile function that was set before it (cProfile,
// a debugger's), which sys.getprofile() still returns, and puts it back
// afterwards. Code that replaces it meanwhile wins: the watch then does not
// fire, and torch's generator is closed when the garbage collector frees it,
// as without the watch. While installed, CPython runs the thread's Python
// code on its slower tracing path (measured +7-9% on small CPU models'
// steps, torch 2.11).

#include <pybind11/pybind11.h>

namespace torch_sac::python {

// Adds _C.watch_frame_exit(frame, callback) -> token,
// _C.unwatch_frame_exit(token), _C.frame_exit_watches() and
// _C.frame_exit_watch_backend().
void register_frame_exit_watch(pybind11::module_& m);

} // namespace torch_sac::python
