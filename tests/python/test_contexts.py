"""Behaviour of torch_sac.create_selective_checkpoint_contexts beyond gradient
parity: policy return values, errors, ignored ops, op packets, cache mutation,
double backward, grad-disabled modes, checkpoint_wrapper, the adapter switch,
built-in policies and stats()."""

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.checkpoint as tc
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy

import torch_sac
from conftest import (
    REPO_ROOT,
    ContextRecorder,
    RecordingPolicy,
    assert_grads_equal,
    assert_tensors_equal,
    aten,
    is_save,
    list_policy_fn,
    make_every_nth_fn,
    mixed_policy_fn,
    recompute_all_fn,
    run_model,
    sac_context_fn,
    save_all_fn,
    save_matmuls_fn,
)
from helpers import PROGRAM_LIMIT_S
from models import MODEL_BUILDERS, Stack

P = torch_sac.Policy
STAT_KEYS = ("policy_calls", "saved_ops", "recomputed_ops", "cache_hits", "saved_bytes")


# --------------------------------------------------------------------------
# A tiny function and helpers
# --------------------------------------------------------------------------


def small_fn(x, w):
    """Ops seen below autograd: mm, sin, mm, relu (4 policy calls)."""
    a = torch.mm(x, w)
    b = a.sin()
    c = torch.mm(b, w)
    return c.relu()


SMALL_FN_OPS = [aten.mm.default, aten.sin.default, aten.mm.default, aten.relu.default]


def small_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 4, generator=g).requires_grad_(True)
    w = torch.randn(4, 4, generator=g).requires_grad_(True)
    return x, w


def run_fn(fn, context_fn=None, seed=0, backward=True, use_checkpoint=True):
    """Forward (+checkpoint) and backward of fn on small inputs -> (out, x.grad, w.grad)."""
    x, w = small_inputs(seed)
    if context_fn is None or not use_checkpoint:
        out = fn(x, w)
    else:
        out = tc.checkpoint(fn, x, w, use_reentrant=False, context_fn=context_fn)
    if backward:
        out.sum().backward()
    return out.detach(), x.grad, w.grad


def assert_fn_grads_equal(a, b, label):
    for name, ta, tb in zip(("output", "x.grad", "w.grad"), a, b):
        assert_tensors_equal(ta, tb, f"{label}: {name}")


def sac_ctx(policy, allow=False, recorder=None):
    return sac_context_fn(lambda: policy, allow, recorder)


def torch_ctx(policy, allow=False):
    return functools.partial(
        tc.create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation=allow
    )


class Counting:
    """A policy counting its calls, saving nothing."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ctx, op, *args, **kwargs):
        self.calls += 1
        return CheckpointPolicy.PREFER_RECOMPUTE


def assert_interception_still_sane():
    """After an error: plain ops work and a fresh region sees exactly the
    ops it should (no stale interceptor double-counting or swallowing ops)."""
    x, w = small_inputs(3)
    plain = torch.mm(x, w).sin()
    assert plain.shape == (4, 4)
    counting = Counting()
    out = run_fn(small_fn, sac_ctx(counting))
    assert counting.calls == len(SMALL_FN_OPS)
    assert_fn_grads_equal(out, run_fn(small_fn), "region after error")


def name_mentions_op(msg, packet_name):
    return f"aten::{packet_name}" in msg or f"aten.{packet_name}" in msg


# --------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_policy_enum_members():
    members = [P.MUST_SAVE, P.PREFER_SAVE, P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE]
    assert len(set(members)) == 4
    for m, name in zip(members, ("MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE")):
        assert m is getattr(P, name)
        assert m.name == name


@pytest.mark.adapter_independent
def test_ignored_ops_superset_of_torch():
    ignored = torch_sac.IGNORED_OPS
    assert isinstance(ignored, frozenset)
    assert set(tc.SAC_IGNORED_OPS) <= ignored
    assert all(isinstance(op, torch._ops.OpOverload) for op in ignored)
    assert aten.mm.default not in ignored


def test_contexts_have_stats():
    fwd, rec = torch_sac.create_selective_checkpoint_contexts([aten.mm.default])
    for ctx in (fwd, rec):
        s = ctx.stats()
        assert isinstance(s, dict)
        for k in STAT_KEYS:
            assert type(s[k]) is int, (k, s[k])
            assert s[k] == 0, f"fresh context has {k}={s[k]}"


# --------------------------------------------------------------------------
# Policy return values
# --------------------------------------------------------------------------

RETURN_VALUES = [
    P.MUST_SAVE,
    P.PREFER_SAVE,
    P.MUST_RECOMPUTE,
    P.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE,
    True,
    False,
]
RETURN_IDS = [f"{type(v).__name__}.{getattr(v, 'name', v)}" for v in RETURN_VALUES]


@pytest.mark.parametrize("value", RETURN_VALUES, ids=RETURN_IDS)
def test_policy_return_types_are_converted(value):
    save = is_save(value)
    recorder = ContextRecorder()
    ours = run_fn(small_fn, sac_ctx(lambda ctx, op, *a, **k: value, recorder=recorder))
    assert_fn_grads_equal(ours, run_fn(small_fn), f"return {value!r}")
    stats = recorder.stats()
    n = len(SMALL_FN_OPS)
    assert stats["policy_calls"] == n
    assert stats["saved_ops"] == (n if save else 0)
    if save:
        assert stats["cache_hits"] > 0 and stats["recomputed_ops"] == 0
    else:
        assert stats["cache_hits"] == 0 and stats["recomputed_ops"] > 0


class BadPolicyValue:
    def __repr__(self):
        return "<BadPolicyValue 42>"


BAD_VALUES = [None, "MUST_SAVE", 1, 2.5, BadPolicyValue()]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["None", "str", "int", "float", "object"])
def test_bad_policy_return_raises_value_error(bad):
    def policy(ctx, op, *args, **kwargs):
        return bad if op is aten.mm.default else P.PREFER_RECOMPUTE

    with pytest.raises(ValueError) as excinfo:
        run_fn(small_fn, sac_ctx(policy))
    msg = str(excinfo.value)
    assert name_mentions_op(msg, "mm"), msg
    assert repr(bad) in msg, msg
    assert_interception_still_sane()


@pytest.mark.parametrize("engine", ["contexts", "region"])
@pytest.mark.parametrize("expr", ["matmul", "mul"])
def test_bad_policy_message_survives_binary_operators(engine, expr):
    """`x @ w` and `x * 2` turn a TypeError raised inside them into
    "unsupported operand type(s)"; the policy's message must reach the user."""

    def policy(ctx, op, *args, **kwargs):
        return "garbage"

    def fn(x, w):
        return (x @ w) if expr == "matmul" else (x * 2)

    x, w = small_inputs()
    with pytest.raises(ValueError, match="the policy returned 'garbage'"):
        if engine == "contexts":
            tc.checkpoint(fn, x, w, use_reentrant=False, context_fn=sac_ctx(policy))
        else:
            torch_sac.checkpoint(fn, x, w, policy=policy)
    assert_interception_still_sane()


class PolicyBoom(Exception):
    pass


class RegionBoom(Exception):
    pass


def test_policy_exception_propagates_and_leaves_no_interceptor():
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        if op is aten.sin.default:
            raise PolicyBoom("boom from policy")
        return P.MUST_SAVE

    recorder = ContextRecorder()
    with pytest.raises(PolicyBoom, match="boom from policy") as excinfo:
        run_fn(small_fn, sac_ctx(policy, recorder=recorder))
    assert excinfo.type is PolicyBoom
    assert calls == [aten.mm.default, aten.sin.default]

    # Plain ops afterwards are not intercepted by the failed region.
    fwd, rec = recorder.pairs[0]
    before = fwd.stats()["policy_calls"]
    x, w = small_inputs(1)
    (torch.mm(x, w).sin() * 2).sum().backward()
    assert fwd.stats()["policy_calls"] == before
    assert calls == [aten.mm.default, aten.sin.default]
    assert_interception_still_sane()


def test_exception_inside_region_leaves_no_interceptor():
    counting = Counting()

    def fn(x, w):
        torch.mm(x, w).sin()
        raise RegionBoom("boom from region")

    with pytest.raises(RegionBoom):
        run_fn(fn, sac_ctx(counting))
    assert counting.calls == 2
    x, w = small_inputs(1)
    torch.mm(x, w).relu().sum().backward()
    assert counting.calls == 2
    assert_interception_still_sane()


# --------------------------------------------------------------------------
# Python scalars in Tensor positions (wrapped numbers)
# --------------------------------------------------------------------------


def scalar_fn(x, w):
    """`a * 0.5` and `b.add_(1)` pass Python numbers where the schema says
    Tensor (aten::mul.Tensor / aten::add_.Tensor get wrapped-number tensors)."""
    a = torch.mm(x, w) * 0.5
    b = a.sin()
    b.add_(1)
    return (b * 2).tanh()


@pytest.mark.parametrize("save", [True, False], ids=["save_all", "recompute_all"])
def test_wrapped_number_arguments(save):
    policy = torch_sac.policies.save_all() if save else torch_sac.policies.recompute_all()
    ref = run_fn(scalar_fn)
    theirs = run_fn(scalar_fn, torch_ctx(save_all_fn if save else recompute_all_fn, allow=save))
    ours = run_fn(scalar_fn, sac_ctx(policy, allow=save))
    assert_fn_grads_equal(theirs, ref, "torch SAC vs plain")
    assert_fn_grads_equal(ours, ref, "torch_sac vs plain")
    # An in-place add of a Python int on a buffer, as nn.BatchNorm does.
    counter = torch.zeros((), dtype=torch.long)

    def fn(x, w):
        counter.add_(1)
        return torch.mm(x, w).sin()

    run_fn(fn, sac_ctx(policy, allow=save))
    assert counter.item() >= 1


# --------------------------------------------------------------------------
# What the policy sees
# --------------------------------------------------------------------------


def test_policy_called_once_per_op_in_forward_only():
    rec = RecordingPolicy(lambda ctx, op, *a, **k: P.PREFER_RECOMPUTE)
    x, w = small_inputs()
    out = tc.checkpoint(small_fn, x, w, use_reentrant=False, context_fn=sac_ctx(rec))
    assert rec.ops == SMALL_FN_OPS
    out.sum().backward()  # recomputes everything
    assert rec.ops == SMALL_FN_OPS, "policy was called during recompute"
    assert rec.recompute_calls == 0
    assert x.grad is not None and w.grad is not None


def test_policy_ctx_fields():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((op, ctx.is_recompute, args, ctx.op_output))
        return P.MUST_SAVE if op is aten.mm.default else P.PREFER_RECOMPUTE

    run_fn(small_fn, sac_ctx(policy))
    assert [s[0] for s in seen] == SMALL_FN_OPS
    for op, is_recompute, args, out in seen:
        assert is_recompute is False
        assert isinstance(out, torch.Tensor)
        # The policy runs after the op: op_output is the op's result.
        expected = op(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
        assert torch.equal(out.detach(), expected), op


def test_ignored_ops_never_reach_policy():
    def fn(x, w):
        a = x.sin()
        d1 = a.detach()
        d2 = aten.detach.default(a)
        _ = (a.size(), a.stride(), a.dim(), a.numel(), a.is_contiguous())
        return torch.mm(a * d1, w) + d2

    def run(create, policy):
        rec = RecordingPolicy(policy)
        x, w = small_inputs()
        out = tc.checkpoint(
            fn, x, w, use_reentrant=False, context_fn=functools.partial(create, rec)
        )
        out.sum().backward()
        return rec, x.grad

    ours, g_ours = run(
        torch_sac.create_selective_checkpoint_contexts, list_policy_fn([aten.sin.default])
    )
    theirs, g_theirs = run(
        tc.create_selective_checkpoint_contexts, list_policy_fn([aten.sin.default])
    )
    assert not [op for op in ours.ops if op in torch_sac.IGNORED_OPS or op in tc.SAC_IGNORED_OPS]
    assert aten.detach.default not in ours.ops
    assert aten.sin.default in ours.ops and aten.mm.default in ours.ops
    assert ours.ops == [op for op in theirs.ops if op not in torch_sac.IGNORED_OPS]
    assert_tensors_equal(g_ours, g_theirs, "x.grad")


# --------------------------------------------------------------------------
# Lists of ops, packets, argument validation
# --------------------------------------------------------------------------


def add_fn(x, w):
    a = aten.add.Tensor(x, w)
    b = aten.add.Scalar(a, 2.0)
    return aten.mul.Tensor(b, b)


@pytest.mark.parametrize(
    "ops, n_saved",
    [
        ([aten.add], 2),
        ([aten.add.Tensor], 1),
        ([aten.add.Scalar], 1),
        ([aten.add, aten.mul], 3),
        ([aten.mul.Tensor], 1),
        ([aten.add.out, aten.mm.default], 0),
    ],
    ids=["packet", "Tensor", "Scalar", "packet+mul", "mul", "other_overloads"],
)
def test_list_packets_match_all_overloads(ops, n_saved):
    recorder = ContextRecorder()
    ours = run_fn(add_fn, sac_ctx(list(ops), recorder=recorder))
    assert_fn_grads_equal(ours, run_fn(add_fn), f"list {ops}")
    stats = recorder.stats()
    assert stats["policy_calls"] == 3
    assert stats["saved_ops"] == n_saved


def test_packet_list_equals_overload_list_on_gpt():
    counts = []
    for ops in ([aten.mm, aten.addmm], [aten.mm.default, aten.addmm.default]):
        recorder = ContextRecorder()
        run_model("gpt", sac_context_fn(lambda: list(ops), False, recorder))
        counts.append(recorder.stats()["saved_ops"])
    assert counts[0] == counts[1] == 8


def test_torch_rejects_packets_but_torch_sac_accepts():
    with pytest.raises(ValueError):
        tc.create_selective_checkpoint_contexts([aten.mm])
    fwd, rec = torch_sac.create_selective_checkpoint_contexts([aten.mm])
    assert fwd.stats()["policy_calls"] == 0 and rec.stats()["cache_hits"] == 0


@pytest.mark.parametrize("arg", [42, "aten::mm", None, 3.0], ids=["int", "str", "None", "float"])
def test_non_callable_non_list_policy_raises(arg):
    with pytest.raises(TypeError):
        torch_sac.create_selective_checkpoint_contexts(arg)


@pytest.mark.parametrize(
    "ops",
    [[aten.mm.default, "aten::add"], [torch.mm], [42], [aten.mm.default, None]],
    ids=["str", "python_fn", "int", "None"],
)
def test_list_with_non_op_raises(ops):
    with pytest.raises(ValueError, match="is not an op"):
        torch_sac.create_selective_checkpoint_contexts(ops)


# --------------------------------------------------------------------------
# Cache mutation
# --------------------------------------------------------------------------


def mutating_fn(x, w):
    a = torch.mm(x, w)
    a.add_(1.0)  # mutates the (cached) mm output
    return a.sin()  # sin saves `a` -> backward needs recompute up to here


def test_cache_entry_mutated_in_forward_is_recomputed():
    """An output cached, then written in place later in forward, is no longer
    served from the cache: recompute runs it again (exact, where PyTorch's
    SAC raises)."""
    with pytest.raises(RuntimeError, match="mutated"):
        run_fn(mutating_fn, torch_ctx([aten.mm.default]))
    contexts = []

    def ctx_fn():
        pair = torch_sac.create_selective_checkpoint_contexts([aten.mm.default])
        contexts.append(pair[0])
        return pair

    assert_fn_grads_equal(run_fn(mutating_fn, ctx_fn), run_fn(mutating_fn), "mutated in forward")
    stats = contexts[0].stats()
    assert stats["invalidated_ops"] == 1 and stats["saved_ops"] == 0 and stats["cache_hits"] == 0, (
        stats
    )
    assert_interception_still_sane()


def returns_cached_fn(x, w):
    a = torch.mm(x, w)
    return a.sin(), a


@pytest.mark.parametrize("alias", ["same", "view", "detach"])
def test_mutated_cache_entry_after_forward_raises_like_torch(alias):
    """A cached output written in place after forward, through the tensor
    itself or any alias forward saw, raises at recompute naming the op."""

    def run(ctx_fn):
        x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        out, a = tc.checkpoint(returns_cached_fn, x, w, use_reentrant=False, context_fn=ctx_fn)
        with torch.no_grad():
            {"same": a, "view": a.view(-1), "detach": a.detach()}[alias].add_(1.0)
        out.sum().backward()

    with pytest.raises(RuntimeError, match="mutated"):
        run(torch_ctx([aten.mm.default]))
    with pytest.raises(RuntimeError) as excinfo:
        run(sac_ctx([aten.mm.default]))
    msg = str(excinfo.value)
    assert name_mentions_op(msg, "mm"), msg
    assert "allow_cache_entry_mutation" in msg, msg
    assert_interception_still_sane()


def test_allow_cache_entry_mutation_matches_torch():
    ops = [aten.mm.default, aten.add_.Tensor]
    ref = run_fn(mutating_fn)
    theirs = run_fn(mutating_fn, torch_ctx(ops, allow=True))
    ours = run_fn(mutating_fn, sac_ctx(list(ops), allow=True))
    assert_fn_grads_equal(theirs, ref, "torch allow=True vs plain")
    assert_fn_grads_equal(ours, theirs, "torch_sac allow=True vs torch")


def test_save_all_on_models_with_in_place_ops():
    """save_all saves tensors that ReLU(inplace), residual add_ and dropout
    later write in forward: those are recomputed instead, exactly, with or
    without allow_cache_entry_mutation (PyTorch's SAC raises without it)."""
    for name in ("convbn", "gpt"):
        ref = run_model(name)
        for allow in (True, False):
            recorder = ContextRecorder()
            ours = run_model(name, sac_context_fn(torch_sac.policies.save_all, allow, recorder))
            assert_grads_equal(ours, ref, f"{name} save_all allow={allow}")
            if name == "gpt":  # residual add_ onto a saved dropout output
                assert recorder.stats()["invalidated_ops"] > 0


# --------------------------------------------------------------------------
# Identity of cached outputs
# --------------------------------------------------------------------------


def identity_run(ctx):
    """Runs a region twice-executed by checkpoint (forward, recompute) and
    returns the argmax (int64, not a view) and sin (float) outputs each time."""
    seen = {"idx": [], "sin": []}

    def fn(x):
        idx = x.argmax(dim=-1, keepdim=True)
        y = x.sin()
        seen["idx"].append(idx)
        seen["sin"].append(y)
        return y.gather(-1, idx)  # gather saves idx, sin saves x

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx).sum().backward()
    assert len(seen["idx"]) == 2, "the region was not recomputed"
    return seen


def test_non_differentiable_cached_output_is_same_object():
    """A cached tensor of non-differentiable dtype that is not a view comes
    back from recompute as the same object (older PyTorch SAC did this; 2.13
    detaches everything, which is why only values are compared with it); a
    float one comes back as a new alias with the same values."""
    ops = [aten.argmax.default, aten.sin.default]
    ours = identity_run(sac_ctx(list(ops)))
    assert ours["idx"][1] is ours["idx"][0]
    assert ours["sin"][1] is not ours["sin"][0]
    assert torch.equal(ours["sin"][1], ours["sin"][0])
    theirs = identity_run(torch_ctx(ops))
    assert torch.equal(theirs["idx"][1], ours["idx"][1])
    assert torch.equal(theirs["sin"][1], ours["sin"][1])


# --------------------------------------------------------------------------
# Backward twice
# --------------------------------------------------------------------------


def mm_sin(x, w):
    return torch.mm(x, w).sin()


@pytest.mark.parametrize("impl", ["torch", "torch_sac"])
def test_second_backward_needing_cache_raises(impl):
    ctx = torch_ctx([aten.mm.default]) if impl == "torch" else sac_ctx([aten.mm.default])
    x, w = small_inputs()
    out = tc.checkpoint(mm_sin, x, w, use_reentrant=False, context_fn=ctx)
    loss = out.sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    assert_tensors_equal(first, run_fn(mm_sin)[1], "first backward x.grad")
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        loss.backward()


def test_second_backward_recompute_only():
    """Nothing cached: PyTorch replays again. torch_sac must replay too (grads
    accumulate to exactly twice) or raise a clear error, never a wrong grad."""

    def twice(ctx):
        x, w = small_inputs()
        loss = tc.checkpoint(mm_sin, x, w, use_reentrant=False, context_fn=ctx).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return x.grad, w.grad

    theirs = twice(torch_ctx(recompute_all_fn))
    try:
        ours = twice(sac_ctx(torch_sac.policies.recompute_all()))
    except RuntimeError as e:
        assert "backward" in str(e)
    else:
        assert_tensors_equal(ours[0], theirs[0], "x.grad after two backwards")
        assert_tensors_equal(ours[1], theirs[1], "w.grad after two backwards")


# --------------------------------------------------------------------------
# Grad disabled / inference mode
# --------------------------------------------------------------------------

GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", sorted(GRAD_MODES), ids=sorted(GRAD_MODES))
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_forward_context_under_grad_disabled_records_nothing(mode, model):
    grad_mode = GRAD_MODES[mode]
    module, make_input = MODEL_BUILDERS[model]()
    x = make_input()
    with grad_mode():
        torch.manual_seed(0)
        expected = module(x)

    counting = Counting()
    fwd, rec = torch_sac.create_selective_checkpoint_contexts(counting)
    with grad_mode():
        with fwd:
            torch.manual_seed(0)
            got = module(x)
    assert torch.equal(got, expected)
    assert counting.calls == 0
    s = fwd.stats()
    assert s["policy_calls"] == 0 and s["saved_ops"] == 0 and s["saved_bytes"] == 0
    assert rec.stats()["cache_hits"] == 0


def test_checkpoint_under_no_grad():
    counting = Counting()
    x, w = small_inputs()
    with torch.no_grad():
        expected = small_fn(x, w)
        got = tc.checkpoint(small_fn, x, w, use_reentrant=False, context_fn=sac_ctx(counting))
    assert torch.equal(got, expected)
    assert not got.requires_grad
    assert counting.calls == 0


# --------------------------------------------------------------------------
# checkpoint_wrapper
# --------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "convbn", "gpt"])
def test_checkpoint_wrapper(model):
    recorder = ContextRecorder()
    cf = sac_context_fn(lambda: [aten.mm.default, aten.addmm.default], False, recorder)

    def wrapped_forward(module, x, _unused):
        if isinstance(module, Stack):
            wrapped = Stack(*[checkpoint_wrapper(b, context_fn=cf) for b in module])
        else:
            wrapped = checkpoint_wrapper(module, context_fn=cf)
        return wrapped(x)

    ref = run_model(model)
    ours = run_model(model, forward_fn=wrapped_forward)
    assert_grads_equal(ours, ref, f"checkpoint_wrapper({model})")
    module, _ = MODEL_BUILDERS[model]()
    assert len(recorder.pairs) == (len(module) if isinstance(module, Stack) else 1)
    stats = recorder.stats()
    assert stats["policy_calls"] > 0 and stats["saved_ops"] > 0
    assert stats["cache_hits"] + stats["recomputed_ops"] > 0


# --------------------------------------------------------------------------
# Adapter selection
# --------------------------------------------------------------------------


def test_adapter_reports_active_adapter():
    active = torch_sac.adapter()
    assert active in ("key", "python")
    env = os.environ.get("TORCH_SAC_ADAPTER")
    if env in ("key", "python"):
        assert active == env
    else:  # unset or "auto": the release decides (test_releases.py checks how)
        assert torch_sac.adapter_reason()


_ADAPTER_SCRIPT = textwrap.dedent(
    """
    import functools, torch, torch_sac
    import torch.utils.checkpoint as tc
    print("ADAPTER", torch_sac.adapter())
    calls = []
    def policy(ctx, op, *a, **k):
        calls.append(str(op))
        return op is torch.ops.aten.mm.default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g, requires_grad=True)
    w = torch.randn(4, 4, generator=g, requires_grad=True)
    fn = lambda x, w: torch.mm(x, w).sin()
    out = tc.checkpoint(fn, x, w, use_reentrant=False,
        context_fn=functools.partial(torch_sac.create_selective_checkpoint_contexts, policy))
    out.sum().backward()
    gx = x.grad.clone(); x.grad = None
    fn(x, w).sum().backward()
    print("CALLS", ",".join(calls))
    print("GRAD_OK", torch.equal(gx, x.grad))
    """
)


def _run_adapter_subprocess(value):
    env = dict(os.environ)
    env.pop("TORCH_SAC_ADAPTER", None)
    if value is not None:
        env["TORCH_SAC_ADAPTER"] = value
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", _ADAPTER_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )


def _check_adapter_output(proc, expected_adapter):
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["ADAPTER"] == expected_adapter
    assert lines["CALLS"] == "aten.mm.default,aten.sin.default"
    assert lines["GRAD_OK"] == "True"


@pytest.mark.slow
@pytest.mark.adapter_independent
def test_adapter_env_python_forces_python_adapter():
    _check_adapter_output(_run_adapter_subprocess("python"), "python")


@pytest.mark.slow
@pytest.mark.adapter_independent
def test_adapter_env_key():
    proc = _run_adapter_subprocess("key")
    # Whether the key adapter can be used at all; the default may pick the
    # Python one although it can (torch <= 2.12, where it would run above
    # TorchDispatchModes), so torch_sac.adapter() does not tell.
    unavailable = torch_sac._C.key_adapter_unavailable_reason()
    if torch_sac.adapter() == "key" or not unavailable:
        _check_adapter_output(proc, "key")
    else:
        # Demanding an unavailable key adapter must fail loudly, with the
        # reason, rather than silently fall back.
        assert proc.returncode != 0, proc.stdout
        assert "TORCH_SAC_ADAPTER" in proc.stderr and unavailable in proc.stderr, proc.stderr[
            -3000:
        ]


@pytest.mark.slow
@pytest.mark.adapter_independent
def test_adapter_default():
    proc = _run_adapter_subprocess(None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default = [
        line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("ADAPTER ")
    ][0]
    assert default in ("key", "python")
    if not os.environ.get("TORCH_SAC_ADAPTER"):
        assert default == torch_sac.adapter()
    _check_adapter_output(proc, default)


# --------------------------------------------------------------------------
# Built-in policies vs equivalent Python callables
# --------------------------------------------------------------------------


def _packet_list_fn(packets):
    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op.overloadpacket in packets
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return policy


BUILTIN_CASES = {
    "save_ops_overloads": (
        lambda: torch_sac.policies.save_ops([aten.mm.default, aten.addmm.default]),
        lambda: list_policy_fn([aten.mm.default, aten.addmm.default]),
        False,
    ),
    "save_ops_packets": (
        lambda: torch_sac.policies.save_ops([aten.mm, aten.addmm]),
        lambda: _packet_list_fn([aten.mm, aten.addmm]),
        False,
    ),
    "save_all": (torch_sac.policies.save_all, lambda: save_all_fn, True),
    "recompute_all": (torch_sac.policies.recompute_all, lambda: recompute_all_fn, False),
    "save_matmuls": (torch_sac.policies.save_matmuls, lambda: save_matmuls_fn, False),
    "every_2nd_mm": (
        lambda: torch_sac.policies.every_nth([aten.mm.default, aten.addmm.default], 2),
        lambda: make_every_nth_fn([aten.mm.default, aten.addmm.default], 2),
        False,
    ),
    "every_3rd_addmm_bmm": (
        lambda: torch_sac.policies.every_nth([aten.addmm.default, aten.bmm.default], 3),
        lambda: make_every_nth_fn([aten.addmm.default, aten.bmm.default], 3),
        False,
    ),
}


@pytest.mark.parametrize("model", sorted(MODEL_BUILDERS))
@pytest.mark.parametrize("case", sorted(BUILTIN_CASES))
def test_builtin_policy_matches_python_callable(case, model):
    make_builtin, make_fn, allow = BUILTIN_CASES[case]
    builtin = make_builtin()
    rec_builtin = ContextRecorder()
    res_builtin = run_model(model, sac_context_fn(lambda: builtin, allow, rec_builtin))

    rec_fn = ContextRecorder()
    policies = []

    def factory():
        p = RecordingPolicy(make_fn())
        policies.append(p)
        return p

    res_fn = run_model(model, sac_context_fn(factory, allow, rec_fn))

    per_region_builtin = [f.stats()["saved_ops"] for f, _ in rec_builtin.pairs]
    per_region_fn = [f.stats()["saved_ops"] for f, _ in rec_fn.pairs]
    invalidated = [f.stats()["invalidated_ops"] for f, _ in rec_fn.pairs]
    assert (
        per_region_builtin
        == per_region_fn
        == [p.n_saved_cacheable - n for p, n in zip(policies, invalidated)]
    )
    sb, sf = rec_builtin.stats(), rec_fn.stats()
    for k in ("policy_calls", "saved_ops", "cache_hits", "recomputed_ops", "saved_bytes"):
        assert sb[k] == sf[k], (k, sb[k], sf[k])
    assert_grads_equal(res_builtin, res_fn, f"builtin {case} vs callable")
    assert_grads_equal(res_builtin, run_model(model), f"builtin {case} vs plain")


def test_save_matmuls_saves_attention_and_convolution():
    for model, op in (
        ("gpt_sdpa", "scaled_dot_product"),
        ("convbn", "convolution"),
        ("gpt", "bmm"),
    ):
        policies = []

        def factory():
            p = RecordingPolicy(save_matmuls_fn)
            policies.append(p)
            return p

        run_model(model, sac_context_fn(factory))
        saved = {o.name() for p in policies for o, d in p.calls if is_save(d)}
        assert any(op in n for n in saved), (model, saved)
        recorder = ContextRecorder()
        run_model(model, sac_context_fn(torch_sac.policies.save_matmuls, False, recorder))
        assert recorder.stats()["saved_ops"] == sum(p.n_saved for p in policies)


# --------------------------------------------------------------------------
# stats() consistency
# --------------------------------------------------------------------------


def _nbytes(out):
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (list, tuple)):
        return sum(_nbytes(o) for o in out)
    return 0


def test_stats_consistent_with_decisions():
    module, make_input = MODEL_BUILDERS["gpt"]()
    x = make_input()
    pairs, policies, saved_bytes = [], [], []

    def policy_factory():
        def policy(ctx, op, *args, **kwargs):
            d = mixed_policy_fn(ctx, op, *args, **kwargs)
            if is_save(d):
                saved_bytes[-1] += _nbytes(ctx.op_output)
            return d

        p = RecordingPolicy(policy)
        policies.append(p)
        saved_bytes.append(0)
        return p

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts(policy_factory())
        pairs.append(pair)
        return pair

    torch.manual_seed(0)
    h = x
    for block in module:
        h = tc.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)

    assert len(pairs) == 2
    for (fwd, rec), p, nbytes in zip(pairs, policies, saved_bytes):
        fs, rs = fwd.stats(), rec.stats()
        for s in (fs, rs):
            assert all(type(s[k]) is int for k in STAT_KEYS), s
        assert fs["policy_calls"] == len(p.calls) > 0
        assert fs["saved_ops"] == p.n_saved > 0
        assert fs["saved_bytes"] == nbytes > 0
        assert rs["cache_hits"] == 0 and rs["recomputed_ops"] == 0, (
            "recompute counters before backward"
        )

    h.sum().backward()
    for (fwd, rec), p in zip(pairs, policies):
        fs, rs = fwd.stats(), rec.stats()
        assert fs["policy_calls"] == len(p.calls), "policy_calls changed during backward"
        assert 0 < rs["cache_hits"] <= fs["saved_ops"]
        assert 0 < rs["recomputed_ops"] <= fs["policy_calls"] - fs["saved_ops"]
    assert x.grad is not None


@pytest.mark.parametrize("which", ["save_all", "recompute_all"])
def test_stats_extremes(which):
    recorder = ContextRecorder()
    if which == "save_all":
        cf = sac_context_fn(torch_sac.policies.save_all, True, recorder)
    else:
        cf = sac_context_fn(torch_sac.policies.recompute_all, False, recorder)
    run_model("mlp", cf)
    s = recorder.stats()
    assert s["policy_calls"] > 0
    if which == "save_all":
        assert s["saved_ops"] == s["policy_calls"]
        assert s["saved_bytes"] > 0
        assert s["recomputed_ops"] == 0 and 0 < s["cache_hits"] <= s["saved_ops"]
    else:
        assert s["saved_ops"] == 0 and s["saved_bytes"] == 0 and s["cache_hits"] == 0
        assert 0 < s["recomputed_ops"] <= s["policy_calls"]


def test_op_details_count_new_tensors_as_a_region_does():
    """op_details() counts calls that made new tensors with their storage
    bytes (views, `_unsafe_view` and in-place ops make none); op_summary()
    counts every call. Replays are the calls recompute re-ran, per call."""

    def fn(x, w):
        h = (x @ w).sin()  # view, mm, _unsafe_view, then a new tensor
        h.mul_(2)  # in place
        return (h.view(12, 4) @ w).sum()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 4, generator=g, requires_grad=True)
    w = torch.randn(4, 4, generator=g, requires_grad=True)
    fwd, rec = torch_sac.create_selective_checkpoint_contexts([aten.mm])
    tc.checkpoint(fn, x, w, use_reentrant=False, context_fn=lambda: (fwd, rec)).backward()
    details = {d["op"]: d for d in fwd.op_details()}
    assert details == {d["op"]: d for d in rec.op_details()}
    summary = {op: (saved, dropped) for op, saved, dropped, _ in fwd.op_summary()}
    mm = details["aten::mm.default"]
    assert (mm["saved"], mm["dropped"], mm["saved_bytes"], mm["dropped_bytes"]) == (
        2,
        0,
        2 * 12 * 4 * 4,
        0,
    )
    assert mm["replayed"] == 0 and mm["replays_by_call"] == [0, 0]
    sin = details["aten::sin.default"]
    assert (sin["saved"], sin["dropped"], sin["dropped_bytes"]) == (0, 1, 12 * 4 * 4)
    assert sin["replayed"] == 1 and sin["replays_by_call"] == [1]
    for op in ("aten::_unsafe_view.default", "aten::view.default", "aten::mul_.Tensor"):
        assert (details[op]["saved"], details[op]["dropped"], details[op]["dropped_bytes"]) == (
            0,
            0,
            0,
        ), op
        assert summary[op][1] > 0, op
    stats = fwd.stats()
    assert stats["recomputed_ops"] == sum(d["replayed"] for d in details.values()) > 0
    assert stats["recompute_ns"] == sum(d["replay_ns"] for d in details.values())


def test_policy_sees_python_numbers_as_pytorch_sac_passes_them():
    """`x * 2.5` and `x + 3`: the policy gets the Python number, as
    PyTorch's SAC passes it from __torch_dispatch__, under both adapters and
    in a sac_context region."""

    def record(seen):
        def policy(ctx, op, *args, **kwargs):
            if op in (torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor):
                seen.append((op, tuple(type(a).__name__ for a in args), args[1]))
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def fn(x):
        return ((x * 2.5) + 3).sin()

    x = torch.randn(4, requires_grad=True)
    theirs, ours, region = [], [], []
    tc.checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=functools.partial(tc.create_selective_checkpoint_contexts, record(theirs)),
    )
    tc.checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=functools.partial(torch_sac.create_selective_checkpoint_contexts, record(ours)),
    )
    with torch_sac.sac_context(record(region)):
        fn(x)
    assert theirs == [
        (torch.ops.aten.mul.Tensor, ("Tensor", "float"), 2.5),
        (torch.ops.aten.add.Tensor, ("Tensor", "int"), 3),
    ]
    assert ours == theirs
    assert region == theirs
