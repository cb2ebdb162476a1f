"""A forward that raises leaves nothing installed, on every torch release.

torch.utils.checkpoint of torch <= 2.12 neither resumes nor closes the
generator that entered context_fn's contexts when the checkpointed function
raises; torch_sac's forward context closes it itself when torch's
checkpoint() frame ends (torch_sac/contexts.py). Each test here keeps the
exception (and so its traceback and torch's generator) alive while it checks
that nothing is left, as pytest, Jupyter (sys.last_traceback) or a logger
holding the error would.

Then the harder cases: nested checkpoints that catch an inner error and go
on, errors in recompute, BaseExceptions, tracers, threads, policies that
fail, repeated errors; and code inside the forward that replaces the
profile function torch_sac's exit watch (torch <= 2.12) relies on. Every
test must behave as on torch >= 2.13, where torch closes its generator
itself.
"""

import cProfile
import functools
import gc
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

import torch_sac
from conftest import _dispatch_state
from helpers import HANG_LIMIT_S
from torch_sac.contexts import _SelectiveContext


class Boom(Exception):
    pass


def raising(x):
    y = torch.relu(x @ x)
    y = y * 2
    raise Boom("raised inside the checkpointed forward")


def _contexts(policy=None):
    return functools.partial(
        torch_sac.create_selective_checkpoint_contexts, policy or torch_sac.policies.save_matmuls()
    )


def _torch_checkpoint(x):
    return tc.checkpoint(raising, x, use_reentrant=False, context_fn=_contexts())


def _region(x):
    with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
        return raising(x)


def _sac_checkpoint(x):
    return torch_sac.checkpoint(raising, x, policy=torch_sac.policies.save_matmuls())


class _Raising(nn.Module):
    def forward(self, x):
        return raising(x)


def _apply_dropin(x):
    model = nn.Sequential(_Raising())
    torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), modules=_Raising, engine="dropin")
    return model(x)


def _apply_region(x):
    model = nn.Sequential(_Raising())
    torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), modules=_Raising)
    return model(x)


ENTRY_POINTS = {
    "torch_checkpoint_with_contexts": _torch_checkpoint,
    "region": _region,
    "torch_sac_checkpoint": _sac_checkpoint,
    "apply_sac_dropin": _apply_dropin,
    "apply_sac_region": _apply_region,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_error_in_forward_leaves_nothing_while_the_error_is_kept(entry):
    before = _dispatch_state()
    x = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(Boom) as kept:
        ENTRY_POINTS[entry](x)
    # The traceback (and torch's generator in it) is still alive here.
    assert kept.value.__traceback__ is not None
    assert _dispatch_state() == before
    # The thread works as before: a checkpointed step is exact.
    ref_x = x.detach().clone().requires_grad_()
    (ref_x @ ref_x).relu().sum().backward()
    y = tc.checkpoint(lambda t: (t @ t).relu(), x, use_reentrant=False, context_fn=_contexts())
    y.sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    assert _dispatch_state() == before


def test_error_under_a_profile_function_keeps_it():
    """The exit watch (torch <= 2.12) chains to a profile function set before
    it, which goes on seeing calls, and puts it back afterwards."""
    seen = []

    def profile_function(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    x = torch.randn(4, 4, requires_grad=True)
    sys.setprofile(profile_function)
    try:
        with pytest.raises(Boom):
            _torch_checkpoint(x)
        assert sys.getprofile() is profile_function
        assert "raising" in seen  # passed on while the watch was installed
        seen.clear()
        torch_sac.policies.save_matmuls()  # any Python call after the error
        assert "save_matmuls" in seen
    finally:
        sys.setprofile(None)


def test_error_under_cprofile_keeps_profiling():
    """cProfile (a legacy profile function before Python 3.12, sys.monitoring
    since) still records calls after an error inside the checkpoint."""
    profiler = cProfile.Profile()
    x = torch.randn(4, 4, requires_grad=True)
    profiler.enable()
    try:
        before = sys.getprofile()
        with pytest.raises(Boom):
            _torch_checkpoint(x)
        assert sys.getprofile() is before
        torch_sac.policies.save_matmuls()
    finally:
        profiler.disable()
    profiler.create_stats()
    names = {func for (_, _, func) in profiler.stats}
    assert "raising" in names and "save_matmuls" in names


def test_generator_closed_late_on_another_thread_is_harmless():
    """Should torch's generator still be closed later (garbage collection on
    another thread), the contexts are already out and nothing happens."""
    x = torch.randn(4, 4, requires_grad=True)
    errors = []
    with pytest.raises(Boom) as kept:
        _torch_checkpoint(x)
    error = kept.value

    def drop():
        try:
            nonlocal error
            error = None
            kept._excinfo = None
            gc.collect()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    thread.join(timeout=HANG_LIMIT_S)
    assert not thread.is_alive()
    assert errors == []


def test_profile_function_set_inside_the_forward_is_kept():
    """A profile function set while the watch is installed (sys.setprofile
    inside the checkpointed function) stays set when the forward ends."""

    def profile_function(frame, event, arg):
        pass

    calls = []

    def fn(t):
        if not calls:  # forward only: backward's recompute runs fn again
            sys.setprofile(profile_function)
        calls.append(1)
        return (t @ t).sin()

    x = torch.randn(4, 4, requires_grad=True)
    try:
        y = tc.checkpoint(fn, x, use_reentrant=False, context_fn=_contexts())
        assert sys.getprofile() is profile_function
    finally:
        sys.setprofile(None)
    assert torch_sac._C.frame_exit_watches() == 0
    y.sum().backward()


def test_normal_checkpoint_leaves_no_watch():
    x = torch.randn(4, 4, requires_grad=True)
    y = tc.checkpoint(lambda t: (t @ t).sin(), x, use_reentrant=False, context_fn=_contexts())
    assert torch_sac._C.frame_exit_watches() == 0
    assert sys.getprofile() is None
    y.sum().backward()


# --------------------------------------------------------------------------
# Nested checkpoints, errors in recompute, BaseExceptions, tracers, threads,
# failing policies, repeated errors, profile functions replaced in forward
# --------------------------------------------------------------------------


def _ckpt(fn, *args, policy=None):
    return tc.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts(policy))


def body(t):
    return torch.relu(t @ t) * 2


def _grad(fn, x):
    ref = x.detach().clone().requires_grad_()
    fn(ref).sum().backward()
    return ref.grad


def _release_stuck_contexts():
    """Test hygiene only: exits forward contexts whose exit watch never fired,
    so a failing test does not poison the tests after it."""
    for obj in gc.get_objects():
        if isinstance(obj, _SelectiveContext) and obj._entered and obj._exit_watch is not None:
            torch_sac._C.unwatch_frame_exit(obj._exit_watch)
            obj._exit_after_error()


def test_nested_inner_error_caught_by_outer_forward_grads_exact():
    def inner_raises(t):
        body(t)
        raise Boom("inner")

    def outer(t):
        with pytest.raises(Boom):
            _ckpt(inner_raises, t)
        return body(_ckpt(body, t)).sin()

    x = torch.randn(6, 6, requires_grad=True)
    before = _dispatch_state()
    y = _ckpt(outer, x)
    assert _dispatch_state() == before
    y.sum().backward()
    assert torch.equal(x.grad, _grad(lambda t: body(body(t)).sin(), x))


def test_nested_error_in_region_and_sac_checkpoint_inside_checkpoint():
    def in_region(t):
        with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
            body(t)
            raise Boom("region")

    def in_sac_checkpoint(t):
        def fn(u):
            body(u)
            raise Boom("torch_sac.checkpoint")

        return torch_sac.checkpoint(fn, t, policy=torch_sac.policies.save_matmuls())

    def outer(t):
        for f in (in_region, in_sac_checkpoint):
            with pytest.raises(Boom):
                _ckpt(f, t)
            with pytest.raises(Boom):
                f(t)
        return body(t).sin()

    x = torch.randn(6, 6, requires_grad=True)
    _ckpt(outer, x).sum().backward()
    assert torch.equal(x.grad, _grad(lambda t: body(t).sin(), x))


def test_recursive_checkpoints_error_caught_midway():
    def rec(t, depth):
        if depth == 0:
            body(t)
            raise Boom("deepest")
        try:
            return _ckpt(rec, t, depth - 1)
        except Boom:
            if depth == 2:
                return body(t).cos()
            raise

    x = torch.randn(5, 5, requires_grad=True)
    _ckpt(rec, x, 4).sum().backward()
    assert torch.equal(x.grad, _grad(lambda t: body(t).cos(), x))
    assert torch_sac._C.frame_exit_watches() == 0


def test_suspended_generator_inside_forward():
    def gen(t):
        for i in range(3):
            yield body(t) + i

    def fn(t):
        sum(gen(t))
        g = gen(t)
        next(g)
        raise Boom("with a suspended generator")

    before = _dispatch_state()
    with pytest.raises(Boom) as kept:
        _ckpt(fn, torch.randn(5, 5, requires_grad=True))
    assert kept.value.__traceback__ is not None
    assert _dispatch_state() == before


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_error_during_recompute(nested):
    calls = []

    def fn(t):
        calls.append(1)
        if len(calls) == 2:  # the recompute in backward (before early stop)
            t @ t
            raise Boom("recompute")
        return body(t)

    def run(x):
        if nested:
            return _ckpt(lambda t: _ckpt(fn, t).sin(), x)
        return _ckpt(fn, x).sin()

    before = _dispatch_state()
    x = torch.randn(5, 5, requires_grad=True)
    y = run(x)
    with pytest.raises(Boom) as kept:
        y.sum().backward()
    assert kept.value.__traceback__ is not None
    assert _dispatch_state() == before
    x.grad = None
    run(x).sum().backward()
    assert torch.equal(x.grad, _grad(lambda t: body(t).sin(), x))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit, StopIteration])
def test_base_exceptions_leave_nothing(exc):
    def fn(t):
        body(t)
        raise exc("raised")

    before = _dispatch_state()
    expected = (
        RuntimeError if exc is StopIteration else exc
    )  # PEP 479 does not apply; torch re-raises as is
    with pytest.raises(BaseException) as kept:
        _ckpt(fn, torch.randn(5, 5, requires_grad=True))
    assert isinstance(kept.value, (exc, expected))
    assert _dispatch_state() == before


def test_error_under_settrace_tracer():
    events = []

    def tracer(frame, event, arg):
        events.append(event)
        return tracer

    before = _dispatch_state()
    sys.settrace(tracer)
    try:
        with pytest.raises(ZeroDivisionError):
            _ckpt(lambda t: (body(t), 1 / 0), torch.randn(5, 5, requires_grad=True))
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert "call" in events and "exception" in events
    assert _dispatch_state() == before


def test_policy_raising_is_reported_and_leaves_nothing():
    def policy(ctx, op, *args, **kwargs):
        raise ValueError("policy says no")

    before = _dispatch_state()
    with pytest.raises(ValueError, match="policy says no"):
        _ckpt(body, torch.randn(5, 5, requires_grad=True), policy=policy)
    assert _dispatch_state() == before


def test_policy_returning_garbage_is_reported_and_leaves_nothing():
    before = _dispatch_state()
    with pytest.raises(Exception, match=r"returned 'garbage'.*aten::mm"):
        _ckpt(body, torch.randn(5, 5, requires_grad=True), policy=lambda *a, **k: "garbage")
    assert _dispatch_state() == before


def test_dropin_model_raising_then_training_step():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if not torch.isfinite(x).all():
                raise Boom("non-finite input")
            return y.relu()

    model = nn.Sequential(Block(), Block())
    torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), modules=Block, engine="dropin")
    before = _dispatch_state()
    with pytest.raises(Boom):
        model(torch.full((2, 4), float("nan")))
    assert _dispatch_state() == before
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_error_on_one_thread_while_another_checkpoints():
    stop = threading.Event()
    errors = []

    def worker():
        try:
            x = torch.randn(16, 16, requires_grad=True)
            while not stop.is_set():
                x.grad = None
                _ckpt(body, x).sum().backward()
                assert torch.equal(x.grad, _grad(body, x))
                assert sys.getprofile() is None
                assert torch_sac._C.frame_exit_watches() == 0
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    before = _dispatch_state()
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    kept = []
    try:
        for _ in range(50):
            with pytest.raises(ZeroDivisionError) as info:
                _ckpt(lambda t: (body(t), 1 / 0), torch.randn(16, 16, requires_grad=True))
            kept.append(info.value)
            assert _dispatch_state() == before
    finally:
        stop.set()
        thread.join(timeout=HANG_LIMIT_S)
    assert not thread.is_alive()
    assert errors == []


def test_repeated_errors_do_not_leak():
    x = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        body(t)
        raise Boom("again")

    def once():
        with pytest.raises(Boom):
            _ckpt(fn, x)

    for _ in range(30):  # warm-up: torch's lazy caches
        once()
    gc.collect()
    n0 = len(gc.get_objects())
    for _ in range(200):
        once()
        assert torch_sac._C.frame_exit_watches() == 0
    gc.collect()
    assert len(gc.get_objects()) - n0 < 100
    assert not any(isinstance(o, _SelectiveContext) and o._entered for o in gc.get_objects())


def test_user_profile_function_kept_across_normal_checkpoint():
    def profile_function(frame, event, arg):
        pass

    x = torch.randn(5, 5, requires_grad=True)
    sys.setprofile(profile_function)
    try:
        y = _ckpt(body, x)
        assert sys.getprofile() is profile_function
        y.sum().backward()
        assert sys.getprofile() is profile_function
    finally:
        sys.setprofile(None)
    _ckpt(body, x)
    assert sys.getprofile() is None


# --- the forward replaces the profile function, then raises -----------------
# torch <= 2.12: the exit watch never fires, and the pending watch holds
# torch's checkpoint() frame (so its generator), which the garbage collector
# then never closes: the contexts and torch's saved-tensor hooks stay on the
# thread for good, and every later error on the thread leaks the same way.


def _reset_by_setprofile_none(t):
    sys.setprofile(None)


def _reset_by_save_and_restore(t):
    old = sys.getprofile()  # what a library swapping in its own profiler does
    sys.setprofile(lambda *a: None)
    sys.setprofile(old)


_PROFILER = cProfile.Profile()


def _reset_by_cprofile(t):
    _PROFILER.enable()  # Python 3.11: a legacy profile function


PROFILE_RESETS = {
    "setprofile_none": _reset_by_setprofile_none,
    "save_and_restore": _reset_by_save_and_restore,
    "cprofile_enable": _reset_by_cprofile,
}


@pytest.mark.slow
@pytest.mark.parametrize("reset", sorted(PROFILE_RESETS))
def test_profile_function_replaced_inside_raising_forward(reset):
    def fn(t):
        PROFILE_RESETS[reset](t)
        body(t)
        raise Boom("after the profile function changed")

    before = _dispatch_state()
    try:
        with pytest.raises(Boom):
            _ckpt(fn, torch.randn(5, 5, requires_grad=True))
        _PROFILER.disable()
        sys.setprofile(None)
        gc.collect()  # nothing holds the error any more
        assert _dispatch_state() == before
        # An un-checkpointed step on the thread is untouched by the failed
        # checkpoint's saved-tensor hooks.
        w = torch.randn(8, 8, requires_grad=True)
        (w @ w).sum().backward()
        # A later plain error on the thread is cleaned up too.
        with pytest.raises(Boom):
            _ckpt(
                lambda t: (body(t), (_ for _ in ()).throw(Boom("later")))[0],
                torch.randn(5, 5, requires_grad=True),
            )
        gc.collect()
        assert _dispatch_state() == before
    finally:
        _PROFILER.disable()
        sys.setprofile(None)
        _release_stuck_contexts()
        gc.collect()


def test_user_profile_function_raising_inside_raising_forward():
    def profile_function(frame, event, arg):
        if event == "return" and frame.f_code.co_name == "fn":
            raise ValueError("the profile function failed")

    def fn(t):
        body(t)
        raise Boom("x")

    before = _dispatch_state()
    try:
        sys.setprofile(profile_function)
        try:
            with pytest.raises((Boom, ValueError)):
                _ckpt(fn, torch.randn(5, 5, requires_grad=True))
        finally:
            sys.setprofile(None)
        gc.collect()
        assert _dispatch_state() == before
    finally:
        _release_stuck_contexts()
        gc.collect()


def test_profile_function_saved_and_restored_inside_forward_is_kept():
    """sys.getprofile() inside the forward returns the user's profile
    function, so code that saves and restores it keeps it (torch <= 2.12:
    None while the exit watch is installed, and the user's profile function
    is gone after the checkpoint)."""

    def profile_function(frame, event, arg):
        pass

    seen = []

    def fn(t):
        old = sys.getprofile()
        seen.append(old)
        sys.setprofile(None)
        sys.setprofile(old)
        return body(t)

    sys.setprofile(profile_function)
    try:
        _ckpt(fn, torch.randn(5, 5, requires_grad=True))
        after = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert seen[0] is profile_function
    assert after is profile_function


# --------------------------------------------------------------------------
# The watch itself, on every Python: sys.monitoring events on Python >= 3.12,
# the profile function before. torch.utils.checkpoint uses it only on
# torch <= 2.12; these call it directly.
# --------------------------------------------------------------------------


def _watched(fired, action, name="watched"):
    """Watches its own frame, then returns or raises as `action` says."""
    frame = sys._getframe()
    torch_sac._C.watch_frame_exit(frame, lambda: fired.append(name))
    inner_result = []

    def inner():
        inner_result.append(1)  # other frames returning do not fire the watch
        return 2

    inner()
    assert fired == []
    if action == "raise":
        raise Boom("unwinds the watched frame")
    if action == "recurse":
        # The same code object running again, nested: each frame fires its own.
        _watched(fired, "return", name="nested")
        assert fired == ["nested"]
    return inner_result


@pytest.mark.parametrize("action", ["return", "raise", "recurse"])
def test_frame_exit_watch_fires_once_when_its_frame_ends(action):
    fired = []
    if action == "raise":
        with pytest.raises(Boom):
            _watched(fired, action)
    else:
        _watched(fired, action)
    assert fired[-1] == "watched" and fired.count("watched") == 1
    assert torch_sac._C.frame_exit_watches() == 0
    again = []
    _watched(again, "return")  # and again: the events stay usable
    assert again == ["watched"]


def test_frame_exit_watch_backend():
    """Python >= 3.12 watches with sys.monitoring (no profile function is
    installed, so the forward runs at full speed); older Pythons with the
    profile function."""
    expected = "sys.monitoring" if sys.version_info >= (3, 12) else "profile function"
    assert torch_sac._C.frame_exit_watch_backend() == expected
    seen_profile = []

    def check():
        frame = sys._getframe()
        token = torch_sac._C.watch_frame_exit(frame, lambda: None)
        seen_profile.append(sys.getprofile())
        torch_sac._C.unwatch_frame_exit(token)

    check()
    assert seen_profile == [None]
    assert torch_sac._C.frame_exit_watches() == 0


def test_frame_exit_watch_unwatched_does_not_fire_and_other_threads_are_apart():
    fired = []

    def unwatched():
        token = torch_sac._C.watch_frame_exit(sys._getframe(), lambda: fired.append("x"))
        torch_sac._C.unwatch_frame_exit(token)

    unwatched()
    assert fired == []
    # A watch on this thread is not fired by the same code returning on another.
    started, release = threading.Event(), threading.Event()

    def waits(record):
        torch_sac._C.watch_frame_exit(sys._getframe(), lambda: fired.append(record))
        started.set()
        release.wait(HANG_LIMIT_S)

    thread = threading.Thread(target=waits, args=("thread",), daemon=True)
    thread.start()
    assert started.wait(HANG_LIMIT_S)
    started.clear()
    release.set()
    waits("main")  # same code, this thread: fires "main" only
    thread.join(HANG_LIMIT_S)
    assert sorted(fired) == ["main", "thread"]
    assert torch_sac._C.frame_exit_watches() == 0
