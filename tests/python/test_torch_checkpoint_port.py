"""PyTorch's own non-reentrant activation-checkpoint tests, ported to torch_sac.

Sources (pytorch/pytorch), non-reentrant variants only:

* ``test/test_autograd.py`` (commit 5c322af): the ``TestAutograd``
  checkpoint tests (``test_checkpointing_non_reentrant_*``,
  ``test_checkpointing_without_reentrant_*``, ``test_checkpoint_*``,
  ``test_access_saved_tensor_twice_without_recomputation_works``) and the
  whole ``TestNestedCheckpoint`` class;
* ``test/test_utils.py``, class ``TestCheckpoint`` (the non-reentrant
  variants; tests whose original runs only ``use_reentrant=True`` are ported
  as their non-reentrant counterpart, as the docstring says);
* ``test/distributed/_composable/test_checkpoint.py`` (commit 2aa5db9), the
  CPU cases, re-stated for a function-level checkpoint (the composable
  ``checkpoint(module)`` becomes a checkpointed call of the module).

Each test is re-written here (same scenario, same assertions, the
original's numbers) and says which original it ports. Every scenario runs
under up to three engines:

* ``torch``: ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``,
  the control: a failure there means the port is wrong, not torch_sac;
* ``ckpt``: ``torch_sac.checkpoint(fn, ..., use_reentrant=False)`` with
  torch's keywords, the literal replacement (no policy: plain activation
  checkpointing by the region engine);
* ``region``: ``with torch_sac.sac_context(torch_sac.policies.recompute_all()):``
  around the call, where the scenario is "a function, forward+backward"
  (checkpoint options such as ``early_stop`` do not apply to a region and
  are not passed to it).

Gradients are compared with the un-checkpointed run bitwise (CPU).

Differences on purpose. torch_sac's engines never run the checkpointed
Python function again in backward: dropped tensors are rebuilt by replaying
the recorded ops in C++. Where an original counts how many times the
function runs, relies on a side effect of the re-run (an exception raised
only in recompute, a function that computes something else the second
time), or on a knob that only shapes the re-run (``early_stop``,
``determinism_check``, ``debug``, ``preserve_rng_state``, ``GraphExecGroup``),
the control asserts PyTorch's number and torch_sac's engines assert
torch_sac's behaviour (the function runs once; random ops always replay
with forward's RNG state; gradients equal the un-checkpointed run). The
docstring of each such test says so. Unexpected failures are
``xfail(strict=True)`` with the reason; the docstring carries a minimal
repro.
"""

import collections
import contextlib
import copy
import functools
import inspect
import random
import re
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc
from torch.autograd import Function
from torch.utils._python_dispatch import TorchDispatchMode

import torch_sac
from conftest import aten, assert_tensors_equal

ENGINES = ["torch", "ckpt", "region"]
CKPT_ENGINES = ["torch", "ckpt"]  # engines with checkpoint()'s signature


def _recompute_all():
    return torch_sac.policies.recompute_all()


def run(engine, fn, *args, ckpt=None, **kwargs):
    """``fn(*args, **kwargs)`` checkpointed by ``engine``; ``ckpt`` holds the
    checkpoint keywords (``early_stop``, ``context_fn``, ...), which the
    region engine has no counterpart for and does not get."""
    ckpt = {} if ckpt is None else dict(ckpt)
    if engine == "torch":
        return tc.checkpoint(fn, *args, use_reentrant=False, **ckpt, **kwargs)
    if engine == "ckpt":
        return torch_sac.checkpoint(fn, *args, use_reentrant=False, **ckpt, **kwargs)
    assert engine == "region", engine
    with torch_sac.sac_context(_recompute_all()):
        return fn(*args, **kwargs)


def wrap(engine, fn, **ckpt):
    """``fn`` checkpointed by ``engine`` at every call."""
    return lambda *args, **kwargs: run(engine, fn, *args, ckpt=ckpt, **kwargs)


def sequential(engine, functions, segments, input, **kwargs):
    """``checkpoint_sequential`` by ``engine``; for the region engine one
    region per segment but the last, as ``checkpoint_sequential`` splits."""
    if engine == "torch":
        return tc.checkpoint_sequential(functions, segments, input, use_reentrant=False, **kwargs)
    if engine == "ckpt":
        return torch_sac.checkpoint_sequential(
            functions, segments, input, use_reentrant=False, **kwargs
        )
    assert engine == "region", engine
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        with torch_sac.sac_context(_recompute_all()):
            for j in range(start, end + 1):
                input = functions[j](input)
    for j in range(end + 1, len(functions)):
        input = functions[j](input)
    return input


def reruns_python(engine):
    """Whether ``engine`` runs the checkpointed Python function again in
    backward (only PyTorch's checkpoint does)."""
    return engine == "torch"


def leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def assert_param_grads_equal(m_ckpt, m_ref, label):
    pairs = list(zip(m_ckpt.named_parameters(), m_ref.named_parameters()))
    assert pairs
    for (name, p), (_, q) in pairs:
        assert_tensors_equal(p.grad, q.grad, f"{label}: grad of {name}")


def seeded(seed, build):
    torch.manual_seed(seed)
    return build()


# ==========================================================================
# test_autograd.py, TestAutograd
# ==========================================================================


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_non_reentrant_autocast_cpu(engine):
    """Port of ``test_checkpointing_non_reentrant_autocast_cpu``: three mm's
    under CPU autocast (bfloat16) run in bfloat16 in forward and in what
    backward rebuilds (no dtype mismatch in autograd); with autocast off
    they stay float32. Gradients equal the un-checkpointed run under the
    same autocast. PyTorch re-runs the function in backward; torch_sac's
    engines do not (two dtype records: the plain run and forward)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(3, 3, generator=g) for _ in range(3)]
    for enabled in (True, False):
        dtypes = []

        def foo(x, y, z):
            x = torch.mm(x, y)
            y = torch.mm(x, z)
            z = torch.mm(z, z)
            dtypes.append(z.dtype)
            return z

        ref_in = [leaf(t) for t in base]
        ck_in = [leaf(t) for t in base]
        with torch.autocast(device_type="cpu", enabled=enabled, dtype=torch.bfloat16):
            ref = foo(*ref_in).sum()
            out = run(engine, foo, *ck_in).sum()
        ref.backward()
        out.backward()
        expected = torch.bfloat16 if enabled else torch.float32
        # PyTorch's early-stopping recompute may end before the last record.
        assert set(dtypes) == {expected}
        if not reruns_python(engine):
            assert len(dtypes) == 2
        assert_tensors_equal(out.detach(), ref.detach(), f"autocast={enabled}: output")
        for i, (a, b) in enumerate(zip(ck_in, ref_in)):
            # only z reaches the output: x and y get no gradient either way
            if i < 2:
                assert a.grad is None and b.grad is None
            else:
                assert_tensors_equal(a.grad, b.grad, f"autocast={enabled}: grad of input {i}")


UNPACKED_TWICE = "Unpack is being triggered for a tensor that was already unpacked once"


def _saves_five_function(second_access):
    class MyFunc(Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            first = ctx.saved_tensors
            try:
                second_access.append((first, ctx.saved_tensors))
            except RuntimeError as e:
                second_access.append(e)
            x, y, z, _, _ = first
            return x, y, z

    def foo(x, y, z):
        x = x * y * z
        y = y * y * z
        z = z * z
        return MyFunc.apply(x, y, z)

    return foo


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_custom_function_works(engine):
    """Port of ``test_checkpointing_without_reentrant_custom_function_works``:
    a custom Function inside the checkpoint saves five tensors, three of
    them recomputed; its backward reads ``ctx.saved_tensors`` twice.
    PyTorch raises on the second read ("Unpack is being triggered for a
    tensor that was already unpacked once"), the control asserts it.
    Difference on purpose: torch_sac's engines serve the second read too,
    with the same values, as un-checkpointed autograd does (a saved
    activation unpacked again is rebuilt again, docs/design.md "What stays
    alive");
    gradients equal the un-checkpointed run."""
    vals = (1.0, 2.0, 3.0)
    ref_access, ck_access = [], []
    ref_in = [torch.tensor(v, requires_grad=True) for v in vals]
    ck_in = [torch.tensor(v, requires_grad=True) for v in vals]
    _saves_five_function(ref_access)(*ref_in).sum().backward()
    run(engine, _saves_five_function(ck_access), *ck_in).sum().backward()

    assert len(ref_access) == 1 and not isinstance(ref_access[0], Exception)
    assert len(ck_access) == 1
    if engine == "torch":
        assert isinstance(ck_access[0], RuntimeError)
        assert UNPACKED_TWICE in str(ck_access[0])
    else:
        assert not isinstance(ck_access[0], Exception), ck_access[0]
        first, second = ck_access[0]
        for i, (a, b, r) in enumerate(zip(first, second, ref_access[0][0])):
            assert_tensors_equal(a, r, f"saved tensor {i}, first read")
            assert_tensors_equal(b, r, f"saved tensor {i}, second read")
    for i, (a, b) in enumerate(zip(ck_in, ref_in)):
        assert_tensors_equal(a.grad, b.grad, f"grad of input {i}")


class VerboseTorchDispatchMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.operators = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators.append(func.__name__)
        return func(*args, **({} if kwargs is None else kwargs))


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_checkpointing_without_reentrant_with_context_fn_forward(engine):
    """Port of ``test_checkpointing_without_reentrant_with_context_fn``
    (first part): a ``context_fn`` whose forward context is a dispatch mode
    sees the forward's one op, ``exp``. torch_sac honours a context_fn that
    is not a selective-checkpoint one by running PyTorch's checkpoint with
    it, so it sees the same."""
    x = torch.tensor(1.0, requires_grad=True)
    mode = VerboseTorchDispatchMode()
    out = run(
        engine, lambda t: t.exp(), x, ckpt=dict(context_fn=lambda: (mode, contextlib.nullcontext()))
    )
    assert mode.operators == ["exp.default"]
    out.backward()
    assert_tensors_equal(x.grad, x.detach().exp(), "x.grad")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_checkpointing_without_reentrant_with_context_fn_recompute(engine):
    """Port of ``test_checkpointing_without_reentrant_with_context_fn``
    (second part): a ``context_fn`` whose recompute context is a dispatch
    mode sees recompute's ``exp`` and ``detach``; with torch_sac the
    context_fn runs PyTorch's checkpoint (the recompute engine), so the
    same ops, and the function does run again there."""
    x = torch.tensor(1.0, requires_grad=True)
    mode = VerboseTorchDispatchMode()
    out = run(
        engine, lambda t: t.exp(), x, ckpt=dict(context_fn=lambda: (contextlib.nullcontext(), mode))
    )
    assert mode.operators == []
    out.backward()
    assert mode.operators == ["exp.default", "detach.default"]
    assert_tensors_equal(x.grad, x.detach().exp(), "x.grad")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_checkpointing_with_context_fn_use_reentrant_true_raises(engine):
    """Port of ``test_checkpointing_without_reentrant_with_context_fn``
    (last part): ``use_reentrant=True`` with a ``context_fn`` raises.
    PyTorch says context_fn is "only supported when use_reentrant=False";
    torch_sac has no reentrant variant and raises a ``ValueError`` naming
    the ``use_reentrant`` keyword, whatever the other arguments."""
    x = torch.tensor(1.0, requires_grad=True)
    context_fn = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731
    if engine == "torch":
        with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
            tc.checkpoint(lambda t: t.sin(), x, use_reentrant=True, context_fn=context_fn)
    else:
        with pytest.raises(ValueError, match="use_reentrant"):
            torch_sac.checkpoint(lambda t: t.sin(), x, use_reentrant=True, context_fn=context_fn)


def _with_kwarg(a, blah=None):
    out = a.sin()
    return out if blah is None else out * blah


def test_checkpoint_warns_if_use_reentrant_not_passed_explicitly():
    """Port of ``test_checkpoint_warns_if_use_reentrant_not_passed_explcitly``.
    PyTorch (control) warns when ``use_reentrant`` is left out and then
    takes the reentrant variant. Difference on purpose: torch_sac has one
    variant (``use_reentrant=None`` means non-reentrant) and does not warn;
    the non-reentrant semantics show in keyword arguments reaching the
    function (the reentrant variant rejects them)."""
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc.checkpoint(lambda x: x, a, use_reentrant=False)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly"):
        tc.checkpoint(lambda x: x, a)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_sac.checkpoint(lambda x: x, a, use_reentrant=False)
        out = torch_sac.checkpoint(_with_kwarg, a, blah=b)
    out.sum().backward()
    a_ref, b_ref = leaf(a), leaf(b)
    _with_kwarg(a_ref, blah=b_ref).sum().backward()
    assert_tensors_equal(a.grad, a_ref.grad, "a.grad")
    assert_tensors_equal(b.grad, b_ref.grad, "b.grad")


def _three_linears():
    torch.manual_seed(3)
    return [nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)]


def test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explicitly():
    """Port of
    ``test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly``:
    as above for ``checkpoint_sequential`` (PyTorch warns; torch_sac does
    not, and runs non-reentrant: gradients equal the plain run)."""
    a = torch.randn(3, requires_grad=True)
    modules = _three_linears()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc.checkpoint_sequential(modules, 3, a, use_reentrant=False)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly"):
        tc.checkpoint_sequential(modules, 3, a)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_sac.checkpoint_sequential(modules, 3, a, use_reentrant=False)
        out = torch_sac.checkpoint_sequential(modules, 3, a)
    out.sum().backward()
    a_ref = leaf(a)
    h = a_ref
    for m in _three_linears():
        h = m(h)
    h.sum().backward()
    assert_tensors_equal(a.grad, a_ref.grad, "a.grad")


def _sin_cos_twice(counter):
    def fn(x):
        counter[0] += 1
        y = x.sin().cos()
        z = y.sin().cos()
        return y, z

    return fn


def _partial_grads(y, z):
    """Two disjoint backward calls: z -> y, then y -> x."""
    (grad_y,) = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
    return grad_y


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_graph_execution_group(engine):
    """Port of ``test_checkpoint_graph_execution_group`` (first part): two
    disjoint ``autograd.grad`` calls through one checkpoint. PyTorch
    re-runs the function once per backward call (3 runs), or once for both
    under ``GraphExecGroup`` (2 runs); the control asserts those counts.
    Difference on purpose: torch_sac's engines run the function once
    whatever the grouping (no Python re-run). Gradients equal the
    un-checkpointed run in every case."""
    x0 = torch.randn(3, 3)
    ref_counter = [0]
    x_ref = leaf(x0)
    y, z = _sin_cos_twice(ref_counter)(x_ref)
    (ref_grad,) = torch.autograd.grad(y, inputs=(x_ref,), grad_outputs=(_partial_grads(y, z),))

    for use_group in (True, False):
        counter = [0]
        x = leaf(x0)
        y, z = run(engine, _sin_cos_twice(counter), x)
        ctx = tc.GraphExecGroup() if use_group else contextlib.nullcontext()
        with ctx:
            grad_y = _partial_grads(y, z)
            (grad_x,) = torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
        if reruns_python(engine):
            assert counter[0] == (2 if use_group else 3)
        else:
            assert counter[0] == 1
        assert_tensors_equal(grad_x, ref_grad, f"group={use_group}: grad of x")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_graph_execution_group_overlapping(engine):
    """Port of ``test_checkpoint_graph_execution_group`` (second part): two
    backward calls through the same graph (``retain_graph=True``) under one
    ``GraphExecGroup``. PyTorch raises "Performing two backward calls that
    overlap" (control). Difference on purpose: ``GraphExecGroup`` only
    groups PyTorch's recomputations; a region replays again for a second
    backward (README, "retain_graph=True replays again"): both run and the
    gradient is exactly twice the un-checkpointed one."""

    def fn(x):
        return x.sin().cos()

    x = torch.randn(3, 3, requires_grad=True)
    out = run(engine, fn, x)
    with tc.GraphExecGroup():
        out.sum().backward(retain_graph=True)
        if engine == "torch":
            with pytest.raises(RuntimeError, match="Performing two backward calls that overlap"):
                out.sum().backward()
            return
        out.sum().backward()
    x_ref = leaf(x)
    fn(x_ref).sum().backward()
    assert_tensors_equal(x.grad, 2 * x_ref.grad, "x.grad after two backward calls")


def _save_3_tensors(x):
    return x.sin().exp().sin()


def _save_2_tensors(x):
    return x.sin().exp()


def _save_2_tensors_alt(x):
    return x.sin() * torch.tensor([1.0, 2.0])


def _non_det_fn(orig_fn, recompute_fn, counter):
    def fn(x):
        counter[0] += 1
        return orig_fn(x) if counter[0] == 1 else recompute_fn(x)

    return fn


NULL = contextlib.nullcontext

# (case, forward fn, recompute fn, checkpoint kwargs, context, PyTorch's error)
NON_DET_CASES = [
    (
        "fewer_saved",
        _save_3_tensors,
        _save_2_tensors,
        {},
        NULL,
        "A different number of tensors was saved",
    ),
    (
        "more_saved_no_early_stop",
        _save_2_tensors,
        _save_3_tensors,
        {},
        lambda: tc.set_checkpoint_early_stop(False),
        "trying to save more tensors during recomputation",
    ),
    ("more_saved_early_stop", _save_2_tensors, _save_3_tensors, {}, NULL, None),
    ("metadata", _save_2_tensors, _save_2_tensors_alt, {}, NULL, "tensors have different metadata"),
    (
        "debug",
        _save_2_tensors,
        _save_2_tensors_alt,
        {"debug": True},
        NULL,
        "You are seeing this error because you passed `debug=True` to checkpoint",
    ),
    (
        "debug_global_on",
        _save_2_tensors,
        _save_2_tensors_alt,
        {"debug": False},
        lambda: tc.set_checkpoint_debug_enabled(True),
        "You are seeing this error because you passed `debug=True` to checkpoint",
    ),
    (
        "debug_global_off",
        _save_2_tensors,
        _save_2_tensors_alt,
        {"debug": True},
        lambda: tc.set_checkpoint_debug_enabled(False),
        "Recomputed values for the following tensors have different",
    ),
]


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_detects_non_determinism(engine):
    """Port of ``test_checkpoint_detects_non_determinism``: a function that
    computes something else the second time it runs. PyTorch's recompute
    notices (fewer or more saved tensors, other metadata; the ``debug``
    messages, by argument and by ``set_checkpoint_debug_enabled``), which
    the control asserts case by case. Difference on purpose: torch_sac
    never runs the function a second time, so there is nothing to detect:
    every case runs backward without error, with the gradient of what
    forward computed (``debug``, the global debug switch and early stop
    accepted, with no effect)."""
    a0 = torch.randn(1)
    for case, orig_fn, recompute_fn, kwargs, context, error in NON_DET_CASES:
        counter = [0]
        fn = _non_det_fn(orig_fn, recompute_fn, counter)
        a = leaf(a0)
        if engine == "torch" and error is not None:
            with pytest.raises(RuntimeError, match=re.escape(error)):
                with context():
                    run(engine, fn, a, ckpt=kwargs).backward()
            continue
        with context():
            out = run(engine, fn, a, ckpt=kwargs)
            out.backward()
        assert counter[0] == (2 if reruns_python(engine) else 1), case
        if engine != "torch":
            a_ref = leaf(a0)
            orig_fn(a_ref).backward()
            assert_tensors_equal(a.grad, a_ref.grad, f"{case}: grad of a")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_checkpoint_determinism_check_values(engine):
    """``determinism_check`` as PyTorch's checkpoint takes it (used by the
    composable ``test_checkpoint_kwargs``): "default" and "none" are
    accepted (torch_sac: with no effect, gradients exact), anything else
    raises ``ValueError`` naming the argument, before the function runs."""
    x = torch.randn(4, requires_grad=True)
    for mode in ("default", "none"):
        x.grad = None
        run(engine, torch.sin, x, ckpt=dict(determinism_check=mode)).sum().backward()
        assert_tensors_equal(x.grad, x.detach().cos(), f"determinism_check={mode!r}: x.grad")
    ran = []
    with pytest.raises(ValueError, match="determinism_check"):
        run(engine, lambda t: ran.append(1) or t.sin(), x, ckpt=dict(determinism_check="bogus"))
    assert ran == []


@pytest.mark.parametrize("engine", ENGINES)
def test_access_saved_tensor_twice_without_recomputation_works(engine):
    """Port of ``test_access_saved_tensor_twice_without_recomputation_works``:
    reading ``grad_fn._saved_result`` of a checkpoint's output outside
    backward. PyTorch re-runs the function at each read and again in
    backward (counts 2, 3, 4), the control asserts them. Difference on
    purpose: torch_sac's engines run it once (count 1 throughout); each read
    gives the right value; after backward the saved tensor is freed and a
    read raises, as in PyTorch."""
    count = [0]

    def foo(a):
        count[0] += 1
        b = a * a
        c = a * b  # noqa: F841 - as the original: ops whose results are unused
        return torch.exp(a)

    a = torch.randn(5, requires_grad=True)
    d = run(engine, foo, a)
    assert count[0] == 1
    expected_counts = (2, 3, 4) if reruns_python(engine) else (1, 1, 1)
    assert_tensors_equal(d.grad_fn._saved_result, a.detach().exp(), "first read")
    assert count[0] == expected_counts[0]
    assert_tensors_equal(d.grad_fn._saved_result, a.detach().exp(), "second read")
    assert count[0] == expected_counts[1]
    d.sum().backward()
    assert count[0] == expected_counts[2]
    with pytest.raises(
        RuntimeError, match="or directly access saved tensors after they have already been freed"
    ):
        d.grad_fn._saved_result
    assert_tensors_equal(a.grad, a.detach().exp(), "a.grad")


class _Holder(nn.Module):
    """Module holder whose forward takes its input by keyword (``data=``)."""

    def __init__(self, mod):
        super().__init__()
        self.module = mod

    def forward(self, data):
        return self.module(data)


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant(engine, input_requires_grad):
    """Port of ``test_checkpointing_without_reentrant`` (both
    ``input_requires_grad``): a Linear-ReLU-Linear proxy network
    checkpointed per input, called with its input as a keyword argument;
    the mean of the stacked outputs is backpropagated, and parameter
    gradients equal those of an un-checkpointed copy (bitwise here).
    200 inputs instead of the original's 2000 (a slowTest there)."""
    num_inp, nz_inp, nz_bottleneck = 200, 10, 1000
    torch.manual_seed(0)
    module = _Holder(
        nn.Sequential(nn.Linear(nz_inp, nz_bottleneck), nn.ReLU(), nn.Linear(nz_bottleneck, nz_inp))
    )
    module_copy = copy.deepcopy(module)
    feats, feats_ref = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(num_inp):
        data = torch.empty(1, nz_inp).uniform_(generator=g)
        data.requires_grad = input_requires_grad
        feats.append(run(engine, module, data=data))
        feats_ref.append(module_copy(data))
    torch.stack(feats).mean().backward()
    torch.stack(feats_ref).mean().backward()
    assert_param_grads_equal(module, module_copy, engine)


class _NoGradModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)
        self.lin2 = nn.Linear(2, 2, bias=False)

    def forward(self, x):
        with torch.no_grad():
            return self.lin2(self.linear(x))


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_detached_tensor(engine):
    """Port of ``test_checkpointing_without_reentrant_detached_tensor``
    (``use_reentrant=False``): the checkpointed module runs under
    ``no_grad``, so its output does not require grad; that is not an error
    (only the reentrant variant raises); three rounds of ``out += a`` and
    backward accumulate exactly 3 into ``a.grad``."""
    module = _NoGradModule()
    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        out = run(engine, module, a)
        assert not out.requires_grad
        out += a
        out.sum().backward()
    assert_tensors_equal(a.grad, torch.full((2, 2), 3.0), "a.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_saved_object_identity(engine):
    """Port of ``test_checkpointing_without_reentrant_saved_object_identity``:
    a custom Function saves an input that does not require grad; its
    backward gets that very tensor object back (``is``), without
    checkpoint and with it (torch_sac: kept saved tensors that need no grad
    come back as themselves)."""
    seen = []

    class Test(Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, x):
            (y,) = ctx.saved_tensors
            seen.append(y)
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    assert seen.pop() is b
    run(engine, Test.apply, a, b).backward()
    assert seen.pop() is b


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_correct_grad(engine):
    """Port of ``test_checkpointing_without_reentrant_correct_grad``: the
    gradient of a checkpointed ``exp`` through ``backward()`` and through
    ``autograd.grad`` equals the un-checkpointed one."""
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    b_grad = a.grad
    a.grad = None
    run(engine, torch.exp, a).sum().backward()
    c_grad = a.grad
    a.grad = None
    (d_grad,) = torch.autograd.grad(run(engine, torch.exp, a).sum(), (a,))
    assert_tensors_equal(c_grad, b_grad, "backward()")
    assert_tensors_equal(d_grad, b_grad, "autograd.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_dataparallel(engine):
    """Port of ``test_checkpointing_without_reentrant_dataparallel`` (CPU:
    ``DataParallel`` with no GPU runs the module in place): the input
    gradient through a checkpointed ``DataParallel(Linear)`` equals the
    un-checkpointed one."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2, bias=False)
    a = torch.randn(2, 2, requires_grad=True)
    copy.deepcopy(model)(a).sum().backward()
    b_grad = a.grad
    a.grad = None
    module = nn.DataParallel(copy.deepcopy(model))
    run(engine, module, a).sum().backward()
    assert_tensors_equal(a.grad, b_grad, "a.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_parameter_used_in_an_out(engine):
    """Port of ``test_checkpointing_without_reentrant_parameter_used_in_an_out``:
    a weight used outside and inside the checkpoint gets its gradient hook
    called once; the gradient equals the un-checkpointed one."""
    w = torch.randn(10, 10, requires_grad=True)
    count = [0]

    def hook(grad):
        count[0] += 1

    w.register_hook(hook)
    x = torch.rand(10, 10, requires_grad=True)
    h = w * x
    out = run(engine, lambda t: w * t, h)
    out.sum().backward()
    assert count[0] == 1

    w_ref, x_ref = leaf(w), leaf(x)
    (w_ref * (w_ref * x_ref)).sum().backward()
    assert_tensors_equal(w.grad, w_ref.grad, "w.grad")
    assert_tensors_equal(x.grad, x_ref.grad, "x.grad")


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 5, bias=False)

    def forward(self, dict_input):
        return {"result": self.layer(dict_input["tensor"])}


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_arbitrary_input_output(engine):
    """Port of ``test_checkpointing_without_reentrant_arbitrary_input_output``:
    a module taking and returning a dict; output and parameter gradients
    equal the un-checkpointed copy's."""
    torch.manual_seed(0)
    model = _DictModel()
    model_ckpt = copy.deepcopy(model)
    inp = {"tensor": torch.randn(5, 5)}
    out_ref = model(inp)["result"].sum()
    out = run(engine, model_ckpt, inp)["result"].sum()
    assert_tensors_equal(out.detach(), out_ref.detach(), "output")
    out_ref.backward()
    out.backward()
    assert_param_grads_equal(model_ckpt, model, engine)


def _cpu_bytes():
    return torch_sac.memory.cpu_memory_stats()


class _MemModel(nn.Module):
    def __init__(self, n, engine):
        super().__init__()
        self.engine = engine
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
            for _ in range(n)
        )
        # grads allocated up front: what grows is activations
        for p in self.parameters():
            p.grad = torch.ones_like(p)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) if self.engine is None else run(self.engine, layer, x)
        return x


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_memory_savings(engine):
    """Port of ``test_checkpointing_without_reentrant_memory_savings`` (CUDA
    there; CPU here, with torch_sac's counting allocator): 8 blocks of three
    Linear(256) layers on a 100x256 input, each block checkpointed; the
    peak memory of forward+backward is below the un-checkpointed model's.
    Gradients are exact too."""
    torch_sac.memory.install_counting_allocator()
    x = torch.randn(100, 256)
    peaks, grads = {}, {}
    for name, eng in (("plain", None), ("ckpt", engine)):
        model = seeded(0, lambda: _MemModel(8, eng))
        xi = leaf(x)
        start = _cpu_bytes()["allocated"]
        torch_sac.memory.reset_peak()
        model(xi).sum().backward()
        peaks[name] = _cpu_bytes()["peak"] - start
        grads[name] = [xi.grad] + [p.grad for p in model.parameters()]
    assert peaks["ckpt"] < peaks["plain"], peaks
    for i, (a, b) in enumerate(zip(grads["ckpt"], grads["plain"])):
        assert_tensors_equal(a, b, f"grad {i}")


N_MM = 512  # as the original: one N x N float32 tensor = 1 MiB
MM_UNIT_FLOPS = 2 * N_MM**3  # one N x N matmul
MM_UNIT_BYTES = N_MM * N_MM * 4


def _mm_cos_sin(x, y):
    return torch.mm(x.cos(), y).sin().sum()


@pytest.mark.parametrize("engine", ENGINES)
def test_flops_and_mem_plain_checkpoint(engine):
    """Port of the plain-checkpoint part of ``test_flops_and_mem``
    (``TestSelectiveActivationCheckpoint``; CUDA memory there, CPU here via
    ``torch_sac.profile``): ``mm(cos(x), y).sin().sum()`` for 512x512
    inputs. Without checkpoint forward keeps 2 MiB of activations and
    backward runs 2 matmuls; checkpointed it keeps none (the original's
    0.0 MiB, to 0.01) and backward costs 3 matmuls: PyTorch re-runs the
    matmul in backward, torch_sac replays it (``replay_flops``). Gradients
    are exact."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(N_MM, N_MM, generator=g)
    y0 = torch.randn(N_MM, N_MM, generator=g)

    def measure(step):
        x, y = leaf(x0), leaf(y0)
        step(x, y).backward()  # as the original: one step first
        x.grad = y.grad = None
        with torch_sac.profile() as prof:
            out = step(x, y)
            out.backward()
        return prof.totals, (x.grad, y.grad)

    plain, ref_grads = measure(_mm_cos_sin)
    assert plain["activation_bytes"] / MM_UNIT_BYTES == pytest.approx(2.0, abs=0.01)
    assert plain["backward_flops"] / MM_UNIT_FLOPS == 2.0

    totals, grads = measure(lambda x, y: run(engine, _mm_cos_sin, x, y))
    assert totals["activation_bytes"] / MM_UNIT_BYTES == pytest.approx(0.0, abs=0.01)
    bw = (totals["backward_flops"] + totals["replay_flops"]) / MM_UNIT_FLOPS
    assert bw == 3.0
    if not reruns_python(engine):
        assert totals["replay_flops"] / MM_UNIT_FLOPS == 1.0
        assert totals["dropped_ops"] > 0 and totals["replayed_ops"] > 0
    for name, a, b in zip("xy", grads, ref_grads):
        assert_tensors_equal(a, b, f"grad of {name}")


# ==========================================================================
# test_autograd.py, TestNestedCheckpoint
# ==========================================================================


def grad_of(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def sum_of(fn):
    return lambda x: fn(x).sum()


def nested_cases(fn, c):
    """(un-checkpointed function, its versions wrapped in checkpoints in
    various ways), as ``TestNestedCheckpoint.get_tests``."""
    g = grad_of
    return (
        (fn, (c(fn), c(c(fn)))),
        (g(fn), (g(c(fn)), g(c(c(fn))))),
        (g(g(fn)), (g(c(g(fn))), c(g(g(c(fn)))), g(c(g(c(fn)))))),
        (g(g(g(fn))), (g(c(g(g(c(fn))))), g(c(g(c(g(c(fn)))))))),
    )


def _iter_graph(roots):
    seen = set()
    q = collections.deque()
    for node in roots:
        if node is not None:
            seen.add(node)
            q.append(node)
    while q:
        node = q.popleft()
        for fn, _ in node.next_functions:
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            q.append(fn)
        yield node


class _Handle:
    def __init__(self, node_name):
        self.node_name = node_name


def nodes_still_alive(fn):
    """``check_graph_dies``: tag every node of ``fn``'s graph with an
    object and drop the output; names of nodes whose tag is still alive."""

    def scope():
        a = torch.randn((), requires_grad=True)
        out = fn(a)
        refs = []
        for node in _iter_graph([out.grad_fn]):
            handle = _Handle(node.name())
            refs.append(weakref.ref(handle))
            node.metadata["blah"] = handle
        return refs

    refs = scope()
    return [r().node_name for r in refs if r() is not None]


def _nested_f(x):
    return x.sin().exp().sin()


def _nested_g(x):
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    torch.autograd.grad(a, x)
    torch.autograd.grad(b, x)
    return x.sin()


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint(engine, gc_disabled):
    """Port of ``test_nested_checkpoint`` (both ``early_stop``): functions
    wrapped in nested checkpoints and in up to three levels of
    ``autograd.grad(create_graph=True)`` give the un-checkpointed values
    (bitwise here; the original: allclose), and every graph dies with its
    output (checked with the cyclic collector off). ``_nested_g`` runs
    backward inside the checkpointed function."""
    c = functools.partial(wrap, engine)
    for early_stop in (True, False):
        with tc.set_checkpoint_early_stop(early_stop):
            x = torch.randn((), requires_grad=True)
            for fn in (_nested_f, _nested_g):
                for depth, (expected_fn, actual_fns) in enumerate(nested_cases(fn, c)):
                    expected = expected_fn(x)
                    for i, actual_fn in enumerate(actual_fns):
                        label = f"early_stop={early_stop} {fn.__name__} depth {depth} variant {i}"
                        assert_tensors_equal(actual_fn(x), expected, label)
                        assert nodes_still_alive(actual_fn) == [], label


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_two_children(engine, gc_disabled):
    """Port of ``test_nested_checkpoint_two_children`` (both
    ``early_stop``): a checkpoint holding two child checkpoints, under two
    levels of grad-of-sum, checkpointed again at both levels; values equal
    the un-checkpointed ones and the graphs die."""
    c = functools.partial(wrap, engine)

    def f(x):
        return x.sin().exp().sin()

    def g(x):
        return x.cos().sin().exp()

    def hc(x):
        return c(g)(c(f)(x))

    def h(x):
        return g(f(x))

    for early_stop in (True, False):
        with tc.set_checkpoint_early_stop(early_stop):
            a = torch.randn(3, 3, requires_grad=True)
            expected = grad_of(sum_of(grad_of(sum_of(h))))(a)
            actual = grad_of(sum_of(grad_of(sum_of(c(hc)))))(a)
            assert_tensors_equal(actual, expected, f"early_stop={early_stop}: outer")
            actual = grad_of(sum_of(c(grad_of(sum_of(c(hc))))))(a)
            assert_tensors_equal(actual, expected, f"early_stop={early_stop}: both levels")
            assert nodes_still_alive(grad_of(c(hc))) == []
            assert nodes_still_alive(grad_of(sum_of(grad_of(sum_of(c(hc)))))) == []
            assert nodes_still_alive(grad_of(sum_of(c(grad_of(sum_of(c(hc))))))) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_non_tensor_inputs_and_outputs(engine):
    """Port of ``test_nested_checkpoint_non_tensor_inputs_and_outputs``
    (both ``early_stop``): an int and a function among the arguments, an
    int and a str among the outputs; gradients equal the plain run's."""

    def fn(k, a, b, f):
        return f(k * a * b.exp()), 1, "abcd"

    def f(x):
        return x.sin()

    for early_stop in (True, False):
        a = torch.tensor(2.0, requires_grad=True)
        b = torch.tensor(3.0, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            out, one, abcd = run(engine, fn, 3, a, b, f)
        assert (one, abcd) == (1, "abcd")
        actual = torch.autograd.grad(out, (a, b))
        expected = torch.autograd.grad(fn(3, a, b, f)[0], (a, b))
        for name, x, y in zip("ab", actual, expected):
            assert_tensors_equal(x, y, f"early_stop={early_stop}: grad of {name}")


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_kwargs(engine):
    """Port of ``test_nested_checkpoint_kwargs`` (both ``early_stop``): a
    tensor passed by keyword gets its gradient through the checkpoint."""

    def fn(a, blah=None):
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    for early_stop in (True, False):
        a = torch.tensor(2.0, requires_grad=True)
        b = torch.tensor(3.0, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            actual = torch.autograd.grad(run(engine, fn, a, blah=b), (a, b))
            expected = torch.autograd.grad(fn(a, blah=b), (a, b))
        for name, x, y in zip("ab", actual, expected):
            assert_tensors_equal(x, y, f"early_stop={early_stop}: grad of {name}")


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_same_graph(engine):
    """Port of ``test_nested_checkpoint_same_graph`` (both ``early_stop``):
    a hook registered on a node of the checkpoint's forward graph runs
    once in backward (backward runs on the original graph)."""

    def fn(a):
        return a.sin().cos().sin()

    for early_stop in (True, False):
        counter = [0]
        a = torch.tensor(1.0, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            out = run(engine, fn, a)
        out.grad_fn.next_functions[0][0].register_hook(
            lambda *_: counter.__setitem__(0, counter[0] + 1)
        )
        out.backward()
        assert counter[0] == 1
        a_ref = leaf(a)
        fn(a_ref).backward()
        assert_tensors_equal(a.grad, a_ref.grad, f"early_stop={early_stop}: a.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_reentrant_backwards(engine):
    """Port of ``test_nested_checkpoint_reentrant_backwards`` (both
    ``early_stop``): a hook on the output's node runs a second backward,
    from an intermediate output of the same checkpoint, while the first is
    in progress. It runs; ``a.grad`` (both backward calls accumulated)
    equals the same scenario without checkpoint (the original only checks
    that it runs)."""

    def fn(a):
        x = a.sin().cos()
        return x, x.sin()

    def scenario(forward, a):
        x, out = forward(a)
        out.grad_fn.register_hook(lambda *_: x.backward(retain_graph=True))
        out.backward(retain_graph=True)
        return a.grad

    for early_stop in (True, False):
        a = torch.tensor(1.0, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            got = scenario(lambda t: run(engine, fn, t), a)
        expected = scenario(fn, torch.tensor(1.0, requires_grad=True))
        assert_tensors_equal(got, expected, f"early_stop={early_stop}: a.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_set_early_stop(engine):
    """Port of ``test_nested_checkpoint_set_early_stop``: a function whose
    last op (``clone``, a Python wrapper that counts) saves nothing. With
    PyTorch (control) early stop decides whether recompute reaches it: the
    count is 1 or 2 by the ``early_stop`` argument, the
    ``set_checkpoint_early_stop`` context (entered at forward) and their
    precedence, as the original asserts. Difference on purpose: torch_sac
    re-runs no Python, so the count is 1 in every configuration (the
    keyword and the context are accepted); gradients are exact."""
    # (early_stop= keyword or None, context value or None, PyTorch's count)
    configs = [
        (None, None, 1),  # the default: early stop on
        (False, None, 2),
        (True, None, 1),
        (None, False, 2),  # the context manager
        (None, True, 1),
        (False, (False, True), 1),  # nested contexts: innermost wins
        (True, False, 2),  # precedence: the context wins
        (False, True, 1),
    ]
    for early_stop, context, torch_count in configs:
        counter = [0]

        def clone(x):
            counter[0] += 1
            return x.clone()

        def fn(x):
            return clone(x.sin().cos())

        ckpt = {} if early_stop is None else {"early_stop": early_stop}
        a = torch.tensor(1.0, requires_grad=True)
        with contextlib.ExitStack() as stack:
            for value in (context,) if isinstance(context, bool) else (context or ()):
                stack.enter_context(tc.set_checkpoint_early_stop(value))
            out = run(engine, fn, a, ckpt=ckpt)
        out.backward()
        expected = torch_count if reruns_python(engine) else 1
        assert counter[0] == expected, (early_stop, context)
        a_ref = leaf(a)
        a_ref.sin().cos().clone().backward()
        assert_tensors_equal(a.grad, a_ref.grad, "a.grad")


class SinCounterMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.sin.default:
            self.count += 1
        return func(*args, **({} if kwargs is None else kwargs))


@pytest.mark.parametrize("engine", ENGINES)
def test_nested_checkpoint_set_early_stop_no_recompution_needed(engine):
    """Port of ``test_nested_checkpoint_set_early_stop_no_recompution_needed``.
    Case 1, ``sin`` saves only its input: PyTorch (control) re-runs the
    Python function either way (count 2) and early stop keeps ``sin``
    itself from running again (dispatch count 1, or 2 without early stop).
    Case 2, ``clone`` saves nothing: nothing is unpacked, the function runs
    once. Difference on purpose: torch_sac runs the function once and
    ``sin`` once in every case (nothing to rebuild: the input is live)."""
    for early_stop in (True, False):
        counter = [0]

        def fn(x):
            counter[0] += 1
            return x.sin()

        a = torch.tensor(1.0, requires_grad=True)
        with SinCounterMode() as mode:
            with tc.set_checkpoint_early_stop(early_stop):
                out = run(engine, fn, a)
            out.backward()
        if reruns_python(engine):
            assert (counter[0], mode.count) == (2, 1 if early_stop else 2)
        else:
            assert (counter[0], mode.count) == (1, 1)
        assert_tensors_equal(a.grad, a.detach().cos(), "a.grad")

        counter = [0]

        def fn2(x):
            counter[0] += 1
            return x.clone()

        a = torch.tensor(1.0, requires_grad=True)
        with tc.set_checkpoint_early_stop(early_stop):
            out = run(engine, fn2, a)
        out.backward()
        assert counter[0] == 1
        assert_tensors_equal(a.grad, torch.tensor(1.0), "a.grad (clone)")


# ==========================================================================
# test_utils.py, TestCheckpoint (non-reentrant)
# ==========================================================================


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU()
    )


def check_checkpoint_sequential(engine, model, module_lists_to_compare, num_chunks, input):
    """``_check_checkpoint_sequential``: for each module list, the output,
    input gradient and parameter gradients of ``checkpoint_sequential``
    equal the un-checkpointed model's (bitwise here)."""
    out = model(input)
    out_ref = out.detach().clone()
    model.zero_grad()
    out.sum().backward()
    grads_ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    input_grad_ref = input.grad.detach().clone()
    for i, modules in enumerate(module_lists_to_compare):
        detached = leaf(input)
        out = sequential(engine, modules, num_chunks, detached)
        assert_tensors_equal(out.detach(), out_ref, f"list {i}: output")
        model.zero_grad()
        out.sum().backward()
        assert_tensors_equal(detached.grad, input_grad_ref, f"list {i}: input grad")
        for name, p in model.named_parameters():
            assert_tensors_equal(p.grad, grads_ref[name], f"list {i}: grad of {name}")


class _CountingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = 0

    def forward(self, input_var):
        self.counter += 1
        return input_var * torch.tensor(2.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_trigger(engine):
    """Port of ``test_checkpoint_trigger`` (``use_reentrant=False``): ten
    counting modules in two segments each run once in forward; in backward
    PyTorch (control) re-runs the checkpointed first half (counts 2) and
    not the last segment (1). Difference on purpose: torch_sac re-runs no
    Python: every count stays 1. The input gradient is exact (2**10)."""
    modules = [_CountingNet() for _ in range(10)]
    input_var = torch.randn(3, 4, requires_grad=True)
    out = sequential(engine, modules, 2, input_var)
    assert [m.counter for m in modules] == [1] * 10
    out.sum().backward()
    first = 2 if reruns_python(engine) else 1
    assert [m.counter for m in modules] == [first] * 5 + [1] * 5
    assert_tensors_equal(input_var.grad, torch.full((3, 4), 1024.0), "input grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_valid(engine):
    """Port of ``test_checkpoint_valid`` (the ``use_reentrant=False``
    half): ``checkpoint_sequential`` works with
    ``autograd.grad(create_graph=True)``; output and gradients equal the
    un-checkpointed model's."""
    model = _mlp()
    input_var = torch.randn(1, 100, requires_grad=True)
    modules = list(model.children())
    out = model(input_var)
    grads_ref = torch.autograd.grad(
        outputs=[out], grad_outputs=[torch.ones(1, 5)], inputs=[input_var], create_graph=True
    )
    out_ckpt = sequential(engine, modules, 2, input_var)
    assert_tensors_equal(out_ckpt.detach(), out.detach(), "output")
    grads = torch.autograd.grad(
        outputs=[out_ckpt], grad_outputs=[torch.ones(1, 5)], inputs=[input_var], create_graph=True
    )
    assert_tensors_equal(grads[0].detach(), grads_ref[0].detach(), "input grad")
    assert grads[0].requires_grad == grads_ref[0].requires_grad


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint(engine):
    """Port of ``test_checkpoint`` (``use_reentrant=False``): an MLP run by
    ``checkpoint_sequential`` in two chunks, given as a list of modules and
    as the ``nn.Sequential`` itself, matches the un-checkpointed model."""
    model = _mlp()
    check_checkpoint_sequential(
        engine, model, [list(model.children()), model], 2, torch.randn(1, 100, requires_grad=True)
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_module_list(engine):
    """Port of ``test_checkpoint_module_list`` (``use_reentrant=False``):
    as ``test_checkpoint`` with the layers in an ``nn.ModuleList`` (given as
    a list and as the ModuleList)."""

    class ModuleListNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.module_list = nn.ModuleList(list(_mlp().children()))

        def forward(self, input):
            for layer in self.module_list:
                input = layer(input)
            return input

    model = ModuleListNet()
    check_checkpoint_sequential(
        engine,
        model,
        [list(model.module_list.children()), model.module_list],
        2,
        torch.randn(1, 100, requires_grad=True),
    )


def test_checkpoint_sequential_deprecated_multiple_args():
    """Port of ``test_checkpoint_sequential_deprecated_multiple_args``:
    ``checkpoint_sequential`` takes one input; a second positional tensor
    ends in a ``TypeError`` (in PyTorch it lands in ``use_reentrant`` and
    the module then misses its second argument), for both."""

    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    model = nn.Sequential(Two())
    a = torch.randn(1, 100, requires_grad=True)
    b = torch.randn(1, 100, requires_grad=True)
    with pytest.raises(TypeError):
        tc.checkpoint_sequential(model, 1, a, b)
    with pytest.raises(TypeError):
        torch_sac.checkpoint_sequential(model, 1, a, b)


def test_checkpoint_sequential_deprecated_no_args():
    """Port of ``test_checkpoint_sequential_deprecated_no_args``: no input
    is a ``TypeError``, for both."""

    class Noop(nn.Module):
        def forward(self):
            pass

    model = nn.Sequential(Noop())
    with pytest.raises(TypeError):
        tc.checkpoint_sequential(model, 1)
    with pytest.raises(TypeError):
        torch_sac.checkpoint_sequential(model, 1)


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_rng_cpu(engine):
    """Non-reentrant port of ``test_checkpoint_rng_cpu`` (whose original runs
    ``use_reentrant=True``): dropout before and inside the checkpoint; with
    the same starting RNG state the input gradient equals the
    un-checkpointed run's (the recomputed mask is forward's). Two rounds of
    the original's five."""
    for _ in range(2):
        inp = torch.randn(20000, device="cpu").requires_grad_()
        phase1 = nn.Dropout()
        phase2 = nn.Dropout()

        def run_fn(input):
            return phase2(input)

        state = torch.get_rng_state()
        out = run(engine, run_fn, phase1(inp))
        out.sum().backward()
        grad_with = inp.grad
        torch.set_rng_state(state)
        inp.grad = None
        run_fn(phase1(inp)).sum().backward()
        assert_tensors_equal(grad_with, inp.grad, "input grad")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_checkpoint_not_preserve_rng_state_and_without_reentrant(engine):
    """Port of ``test_checkpoint_not_preserve_rng_state_and_without_reentrant``
    (CUDA there, CPU here): dropout checkpointed with
    ``preserve_rng_state=False`` runs forward and backward without error.
    torch_sac also gives the un-checkpointed gradient (random ops always
    replay with forward's RNG state, whatever the flag); PyTorch redraws
    the mask, so its gradient is not compared."""
    inp = torch.randn(2000).requires_grad_()
    layer = nn.Dropout()
    torch.manual_seed(0)
    out = run(engine, layer, inp, ckpt=dict(preserve_rng_state=False))
    torch.manual_seed(1)
    out.sum().backward()
    if engine == "ckpt":
        ref = leaf(inp)
        torch.manual_seed(0)
        layer(ref).sum().backward()
        assert_tensors_equal(inp.grad, ref.grad, "input grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_non_tensor(engine):
    """Non-reentrant port of ``test_checkpoint_non_tensor``: ``None`` among
    the arguments."""

    def run_fn(tensor1, tensor2):
        if tensor2 is None:
            return tensor1
        return tensor1 + tensor2

    input_var = torch.randn(1, 100, requires_grad=True)
    out = run(engine, run_fn, input_var, None)
    out.sum().backward()
    assert_tensors_equal(input_var.grad, torch.ones(1, 100), "input grad")


def _mixed_outputs(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_non_tensor_inputs_outputs(engine):
    """Non-reentrant port of ``test_checkpoint_non_tensor_inputs_outputs``:
    an int among the inputs, non-tensors among the outputs (returned as
    they are), in-place ops on intermediates; three backward calls
    (``retain_graph=True``) accumulate the un-checkpointed gradients
    bitwise. The original's last assertion (a second backward through the
    reentrant variant's wrapper of ``t1`` raises) has no non-reentrant
    counterpart: the returned ``t1`` is the input itself."""
    t1 = torch.rand(10, requires_grad=True)
    t2 = torch.rand(10, requires_grad=True)
    t3 = torch.rand(10)
    scale = random.Random(0).randint(0, 10)
    res = run(engine, _mixed_outputs, t1, t2, scale, t3)
    assert res[0] == scale
    assert_tensors_equal(res[1].detach(), (t1 + t2 * t3).detach() * scale, "res[1]")
    assert res[2] is None and res[3] is True and res[5] == "bar"
    assert_tensors_equal(res[4].detach(), (t1 * t2 + t3).detach() * scale, "res[4]")
    assert res[6] is t1
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    t1_grad, t2_grad = t1.grad, t2.grad
    t1.grad = t2.grad = None
    ref = _mixed_outputs(t1, t2, scale, t3)
    torch.autograd.backward([ref[1].sum(), ref[4].sum(), ref[6].sum()])
    assert_tensors_equal(t1_grad, t1.grad, "t1.grad")
    assert_tensors_equal(t2_grad, t2.grad, "t2.grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_no_tensors(engine):
    """Non-reentrant port of ``test_checkpoint_no_tensors``: a function of
    Python floats only returns its values unchanged."""
    rnd = random.Random(1)
    t1, t2, t3 = rnd.random(), rnd.random(), rnd.random()
    scale = rnd.randint(0, 10)
    res = run(engine, _mixed_outputs, t1, t2, scale, t3)
    assert res == (scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1)


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_partial_grad(engine):
    """Non-reentrant port of ``test_checkpoint_partial_grad``: an output
    that does not require grad next to one that does is fine; an output
    that does not require grad at all (its input does not; the one that
    does is unused) is not an error at checkpoint time (the reentrant
    variant raises there), and backward from it raises autograd's usual
    error."""

    def run_fn(tensor1, tensor2):
        return tensor1, tensor2

    input_var = torch.randn(1, 4, requires_grad=True)
    input_var2 = torch.randn(1, 4, requires_grad=False)
    out = run(engine, run_fn, input_var, input_var2)
    out[0].sum().backward()
    assert_tensors_equal(input_var.grad, torch.ones(1, 4), "input grad")

    def run_fn2(tensor1, tensor2):
        return tensor1

    input_var = torch.randn(1, 4, requires_grad=False)
    input_var2 = torch.randn(1, 4, requires_grad=True)
    out = run(engine, run_fn2, input_var, input_var2)
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        out.sum().backward()


def _early_free_stats(run_backward):
    """Bytes live at three points of backward (hooks on a chain of four
    squarings), as ``test_checkpointing_without_reentrant_early_free``."""
    stats = []

    def track(x, idx):
        def hook(_unused):
            assert len(stats) == idx
            stats.append(_cpu_bytes()["allocated"])

        x.register_hook(hook)

    def test_fn(x):
        x = x**2
        track(x, 2)
        x = x**2
        track(x, 1)
        x = x**2
        track(x, 0)
        x = x**2
        return x.sum()

    run_backward(test_fn)
    return stats


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointing_without_reentrant_early_free(engine):
    """Port of ``test_checkpointing_without_reentrant_early_free``
    (test_utils.py; CUDA there, CPU here with the counting allocator): in a
    plain backward saved buffers are freed step by step, with
    ``retain_graph=True`` they stay; with a checkpoint they are freed step
    by step in both cases, the same amounts as the plain backward. On CPU
    the bytes are exact (no 512-byte rounding): torch_sac's engines give
    the plain backward's numbers exactly; PyTorch's (control) are offset by
    what its checkpoint holds (RNG state), so its steps are compared."""
    torch_sac.memory.install_counting_allocator()
    x = torch.zeros(10, requires_grad=True)
    x.grad = torch.zeros_like(x)
    plain = _early_free_stats(lambda fn: fn(x).backward())
    retained = _early_free_stats(lambda fn: fn(x).backward(retain_graph=True))
    assert plain[0] > plain[1] > plain[2]
    assert retained[0] == retained[1] == retained[2]

    def steps(stats):
        return [a - b for a, b in zip(stats, stats[1:])]

    for retain in (False, True):
        stats = _early_free_stats(lambda fn: run(engine, fn, x).backward(retain_graph=retain))
        assert stats[0] > stats[1] > stats[2], (retain, stats)
        if reruns_python(engine):
            assert steps(stats) == steps(plain), (retain, stats, plain)
        else:
            assert stats == plain, (retain, stats, plain)


# ==========================================================================
# test/distributed/_composable/test_checkpoint.py (CPU cases), function-level
# ==========================================================================


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(100, 100), nn.ReLU())
        self.engine = None

    def forward(self, x):
        h = self.l1(x)
        return self.seq(h) if self.engine is None else run(self.engine, self.seq, h)


class RandomModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(100, 100))

    def forward(self, x):
        y = torch.matmul(self.p, torch.randn(100, 100, device=self.p.device))
        return torch.matmul(x, y)


class MultiOutputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(100, 100))
        self.w2 = nn.Parameter(torch.randn(100, 100))

    def forward(self, x):
        z = x @ self.w1
        z = nn.functional.relu(z)
        z = z @ self.w2
        return z.sin(), z.cos()


class MultiInputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(100, 100))

    def forward(self, xs):
        assert len(xs) == 2, f"Expects 2 args but got {len(xs)}"
        x, y = xs
        z = (x + y) @ self.w
        return nn.functional.relu(z)


class Checkpointed(nn.Module):
    """The composable ``checkpoint(module)`` as a function-level one."""

    def __init__(self, mod, engine, **ckpt):
        super().__init__()
        self.mod = mod
        self.engine = engine
        self.ckpt = ckpt

    def forward(self, *args):
        return run(self.engine, self.mod, *args, ckpt=self.ckpt)


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_tensor_only_cpu(engine):
    """Port of composable ``test_tensor_only_cpu`` (non-reentrant):
    ``ToyModel`` with its ``seq`` checkpointed; parameter and input
    gradients equal the un-checkpointed copy's."""
    net1 = seeded(0, ToyModel)
    net2 = copy.deepcopy(net1)
    net2.engine = engine
    x = torch.randn(20, 100)
    x1, x2 = leaf(x), leaf(x)
    net1(x1).sum().backward()
    net2(x2).sum().backward()
    assert_param_grads_equal(net2, net1, engine)
    assert_tensors_equal(x2.grad, x1.grad, "input grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_random_cpu(engine):
    """Port of composable ``test_random_cpu``: a model drawing a random
    matrix in forward, checkpointed whole; from the same RNG state the
    gradients equal the un-checkpointed copy's."""
    net1 = seeded(0, RandomModel)
    net2 = Checkpointed(copy.deepcopy(net1), engine)
    x1 = torch.randn(20, 100, requires_grad=True)
    x2 = leaf(x1)
    state = torch.get_rng_state()
    net1(x1).sum().backward()
    torch.set_rng_state(state)
    net2(x2).sum().backward()
    assert_param_grads_equal(net2.mod, net1, engine)
    assert_tensors_equal(x2.grad, x1.grad, "input grad")


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_multi_args(engine):
    """Port of composable ``test_multi_args`` (non-reentrant): checkpointed
    modules returning a tuple, whose outputs feed a module taking a tuple;
    gradients equal the un-checkpointed copy's."""
    net1 = seeded(
        0,
        lambda: nn.Sequential(
            MultiOutputModel(), MultiInputModel(), MultiOutputModel(), MultiInputModel()
        ),
    )
    net2 = copy.deepcopy(net1)
    net2[0] = Checkpointed(net2[0], engine)
    net2[2] = Checkpointed(net2[2], engine)
    x1 = torch.randn(20, 100, requires_grad=True)
    x2 = leaf(x1)
    net1(x1).sum().backward()
    net2(x2).sum().backward()
    for (n, p1), p2 in zip(net1.named_parameters(), net2.parameters()):
        assert_tensors_equal(p2.grad, p1.grad, f"grad of {n}")
    assert_tensors_equal(x2.grad, x1.grad, "input grad")


class _RaisingModel(nn.Module):
    def __init__(self, raise_in_recomp):
        super().__init__()
        self.fwd_count = 0
        self.raise_in_recomp = raise_in_recomp
        self.a = nn.Linear(2, 2)

    def forward(self, x):
        if self.raise_in_recomp and self.fwd_count == 1:
            raise RuntimeError("foo")
        if not self.raise_in_recomp:
            raise RuntimeError("foo")
        self.fwd_count += 1
        return self.a(x)


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_clears_state_on_error_in_forward(engine):
    """Port of composable ``test_clears_state_on_error_in_forward``.
    A module that raises the second time it runs: PyTorch (control) raises
    "foo" in backward (recompute). Difference on purpose: torch_sac never
    runs it again, so backward succeeds with the un-checkpointed
    gradients. A module raising in its first forward raises through every
    engine, and nothing stays installed (the autouse fixture checks; the
    composable original checks its state is cleared); a checkpoint after
    the error works."""
    m = seeded(0, lambda: _RaisingModel(raise_in_recomp=True))
    ref = copy.deepcopy(m)
    inp = torch.randn(1, 2)
    out = run(engine, m, inp).sum()
    if reruns_python(engine):
        with pytest.raises(RuntimeError, match="foo"):
            out.backward()
    else:
        out.backward()
        assert m.fwd_count == 1
        ref(inp).sum().backward()
        assert_param_grads_equal(m, ref, engine)

    m = _RaisingModel(raise_in_recomp=False)
    with pytest.raises(RuntimeError, match="foo"):
        run(engine, m, torch.randn(1, 2))
    x = torch.randn(3, requires_grad=True)
    run(engine, torch.sin, x).sum().backward()
    assert_tensors_equal(x.grad, x.detach().cos(), "x.grad after the error")


class _KwargsModel(nn.Module):
    def __init__(self, raise_exp, change_shape_in_recomp):
        super().__init__()
        self.fwd_count = 0
        self.raise_exp = raise_exp
        self.change_shape_in_recomp = change_shape_in_recomp
        self.a = nn.Linear(2, 2)

    def forward(self, x):
        if self.raise_exp and self.fwd_count == 0:
            raise RuntimeError("foo")
        if self.raise_exp and self.fwd_count == 1:
            raise RuntimeError("bar")
        if self.change_shape_in_recomp and self.fwd_count == 1:
            x.relu_()
        random_tensor = torch.randn(1, 2)
        x = self.a(x + random_tensor)
        self.fwd_count += 1
        return x


def test_composable_checkpoint_kwargs_use_reentrant_true():
    """Port of composable ``test_checkpoint_kwargs`` (first assertion):
    ``use_reentrant=True`` is refused (composable: ``NotImplementedError``);
    torch_sac's ``checkpoint`` and ``checkpoint_sequential`` raise a
    ``ValueError`` naming the keyword, before running anything."""
    m = seeded(0, lambda: _KwargsModel(False, False))
    x = torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant"):
        torch_sac.checkpoint(m, x, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant"):
        torch_sac.checkpoint_sequential([m, m], 2, x, use_reentrant=True)
    assert m.fwd_count == 0


def test_checkpoint_sequential_use_reentrant_true_one_segment():
    """``use_reentrant=True`` is refused by ``checkpoint_sequential``
    whatever ``segments`` is (as the composable ``test_checkpoint_kwargs``
    refuses it up front), a bad ``determinism_check`` too."""
    m = seeded(0, lambda: _KwargsModel(False, False))
    x = torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant"):
        torch_sac.checkpoint_sequential([m], 1, x, use_reentrant=True)
    with pytest.raises(ValueError, match="determinism_check"):
        torch_sac.checkpoint_sequential([m], 1, x, determinism_check="bogus")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_composable_checkpoint_kwargs_unexpected_keyword(engine):
    """Port of composable ``test_checkpoint_kwargs`` (unexpected keyword):
    the composable API rejects ``foo="bar"`` itself; the function-level
    non-reentrant checkpoint passes unknown keywords to the function, whose
    ``TypeError`` names it, for torch and torch_sac alike."""
    m = seeded(0, lambda: _KwargsModel(False, False))
    with pytest.raises(TypeError, match="foo"):
        run(engine, m, torch.randn(1, 2, requires_grad=True), foo="bar")


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_composable_checkpoint_kwargs_context_fn(engine):
    """Port of composable ``test_checkpoint_kwargs`` (context functions): a
    forward context and a recompute context that each lift the model's
    "raise" switch. With both, forward and backward run and both contexts
    were used; with only the recompute one, forward raises "foo"; with
    only the forward one, recompute raises "bar". torch_sac runs a custom
    (not selective-checkpoint) context_fn through PyTorch's checkpoint, so
    the same holds."""
    handled = {"fwd": False, "recomp": False}

    @contextlib.contextmanager
    def lifted(mod, which):
        try:
            mod.raise_exp = False
            yield
        finally:
            handled[which] = True
            mod.raise_exp = True

    m = seeded(0, lambda: _KwargsModel(True, False))
    m1, m2, m3 = (copy.deepcopy(m) for _ in range(3))
    x = torch.randn(1, 2, requires_grad=True)

    run(
        engine,
        m1,
        x.clone(),
        ckpt=dict(context_fn=lambda: (lifted(m1, "fwd"), lifted(m1, "recomp"))),
    ).sum().backward()
    assert handled == {"fwd": True, "recomp": True}

    with pytest.raises(RuntimeError, match="foo"):
        run(
            engine,
            m2,
            x.clone(),
            ckpt=dict(context_fn=lambda: (contextlib.nullcontext(), lifted(m2, "recomp"))),
        )

    handled["fwd"] = False
    with pytest.raises(RuntimeError, match="bar"):
        run(
            engine,
            m3,
            x.clone(),
            ckpt=dict(context_fn=lambda: (lifted(m3, "fwd"), contextlib.nullcontext())),
        ).sum().backward()
    assert handled["fwd"]


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_checkpoint_kwargs_determinism_check(engine):
    """Port of composable ``test_checkpoint_kwargs`` (determinism check): a
    model that writes its input in place the second time it runs. PyTorch
    (control): with ``determinism_check="none"`` backward fails in autograd,
    with "default" it raises ``CheckpointError``. Difference on purpose:
    torch_sac does not run the model again, so both settings run backward
    without error, with the un-checkpointed gradients (same seed: the model
    draws a random tensor)."""
    m = seeded(0, lambda: _KwargsModel(False, True))
    x = torch.randn(1, 2, requires_grad=True)
    for mode in ("none", "default"):
        mi, ref = copy.deepcopy(m), copy.deepcopy(m)
        torch.manual_seed(7)
        out = run(engine, mi, x.clone(), ckpt=dict(determinism_check=mode)).sum()
        if reruns_python(engine):
            error = RuntimeError if mode == "none" else tc.CheckpointError
            with pytest.raises(error):
                out.backward()
            continue
        out.backward()
        torch.manual_seed(7)
        ref(x.clone()).sum().backward()
        assert mi.fwd_count == 1
        assert_param_grads_equal(mi, ref, f"determinism_check={mode!r}")


@pytest.mark.parametrize("engine", ENGINES)
def test_composable_checkpoint_kwargs_preserve_rng_state(engine):
    """Port of composable ``test_checkpoint_kwargs`` (RNG state): seed 42
    before forward, 41 before backward; the model draws a random tensor.
    PyTorch (control): ``preserve_rng_state=True`` gives the
    un-checkpointed gradients, ``False`` at least one other. Difference on
    purpose: torch_sac replays random ops with forward's RNG state whatever
    the flag, so both equal the un-checkpointed gradients."""
    m6 = seeded(0, lambda: _KwargsModel(False, False))
    x = torch.randn(1, 2, requires_grad=True)
    grads = {}
    for name, preserve in (("plain", None), ("no_preserve", False), ("preserve", True)):
        mi = copy.deepcopy(m6)
        torch.manual_seed(42)
        if preserve is None:
            loss = mi(x.clone()).sum()
        else:
            loss = run(engine, mi, x.clone(), ckpt=dict(preserve_rng_state=preserve)).sum()
        torch.manual_seed(41)
        loss.backward()
        grads[name] = [p.grad for p in mi.parameters()]
    for a, b in zip(grads["preserve"], grads["plain"]):
        assert_tensors_equal(a, b, "preserve_rng_state=True")
    if reruns_python(engine):
        assert any(not torch.equal(a, b) for a, b in zip(grads["no_preserve"], grads["plain"]))
    else:
        for a, b in zip(grads["no_preserve"], grads["plain"]):
            assert_tensors_equal(a, b, "preserve_rng_state=False")


# ==========================================================================
# torch_sac.checkpoint as a replacement of torch.utils.checkpoint.checkpoint
# ==========================================================================


def test_signature_takes_torch_keywords():
    """``torch_sac.checkpoint`` and ``checkpoint_sequential`` take every
    parameter of PyTorch's, with PyTorch's defaults (``context_fn``: a no-op
    pair of contexts), so the replacement is literal."""
    ours = inspect.signature(torch_sac.checkpoint).parameters
    theirs = inspect.signature(tc.checkpoint).parameters
    for name in ("use_reentrant", "context_fn", "determinism_check", "debug", "early_stop"):
        assert name in ours, name
        if name != "context_fn":
            assert ours[name].default == theirs[name].default, name
    assert ours["preserve_rng_state"].default is True
    fwd, rec = ours["context_fn"].default()
    with fwd, rec:
        pass
    seq = inspect.signature(torch_sac.checkpoint_sequential).parameters
    assert list(seq)[:4] == ["functions", "segments", "input", "use_reentrant"]
    assert seq["use_reentrant"].default is None


@pytest.mark.parametrize("form", ["partial", "lambda"])
@pytest.mark.parametrize("create", ["torch", "torch_sac"])
def test_selective_context_fn_runs_the_region(create, form):
    """``context_fn`` built from ``create_selective_checkpoint_contexts``
    (PyTorch's or torch_sac's, as a ``functools.partial`` as in
    ``test_flops_and_mem``'s ``fn_sac``, or a lambda):
    ``torch_sac.checkpoint`` runs that policy on the region engine, so the
    function runs once, and gradients are exact."""
    factory = (
        tc.create_selective_checkpoint_contexts
        if create == "torch"
        else torch_sac.create_selective_checkpoint_contexts
    )
    count = [0]

    def fn(x, y):
        count[0] += 1
        return torch.mm(x.cos(), y).sin().sum()

    g = torch.Generator().manual_seed(0)
    x0, y0 = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    x, y = leaf(x0), leaf(y0)
    if form == "partial":
        context_fn = functools.partial(factory, [aten.mm.default])
    else:
        context_fn = lambda: factory([aten.mm.default])  # noqa: E731
    out = torch_sac.checkpoint(fn, x, y, use_reentrant=False, context_fn=context_fn)
    out.backward()
    assert count[0] == 1
    xr, yr = leaf(x0), leaf(y0)
    fn(xr, yr).backward()
    assert_tensors_equal(x.grad, xr.grad, "x.grad")
    assert_tensors_equal(y.grad, yr.grad, "y.grad")
