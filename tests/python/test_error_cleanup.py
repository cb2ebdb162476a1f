"""A forward that raises leaves nothing installed, on every torch release.

torch.utils.checkpoint of torch <= 2.12 neither resumes nor closes the
generator that entered context_fn's contexts when the checkpointed function
raises; torch_sac's forward context closes it itself when torch's
checkpoint() frame ends (torch_sac/contexts.py). Each test here keeps the
exception (and so its traceback and torch's generator) alive while it checks
that nothing is left, as pytest, Jupyter (sys.last_traceback) or a logger
holding the error would.
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


class Boom(Exception):
    pass


def raising(x):
    y = torch.relu(x @ x)
    y = y * 2
    raise Boom("raised inside the checkpointed forward")


def _contexts():
    return functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.save_matmuls()
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

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join(timeout=60)
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
