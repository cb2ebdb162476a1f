"""The region engine (``torch_sac.sac_context`` / ``torch_sac.checkpoint``)
checked against PyTorch itself: the same code run without checkpointing.

Everything runs on CPU, where the kernels used here are deterministic, so
gradients, outputs, BatchNorm buffers and RNG states are compared bitwise
(``torch.equal``). The suite runs under both interception adapters
(TORCH_SAC_ADAPTER=key and =python); nothing here assumes either, except the
"no interceptor left behind" checks, which look at both.
"""

import contextlib
import functools
import gc
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode

import torch_sac
from conftest import (
    RUN_SEED,
    collect,
    assert_buffers_equal,
    assert_grads_equal,
    assert_tensors_equal,
    aten,
    loss_of,
    mixed_policy_fn,
)
from helpers import HANG_LIMIT_S
from models import REGION_MODEL_BUILDERS, Stack

P = torch_sac.Policy
MM_OPS = [aten.mm.default, aten.addmm.default]


# --------------------------------------------------------------------------
# Policies (each entry builds a fresh policy object)
# --------------------------------------------------------------------------

POLICIES = {
    "recompute_all": lambda: torch_sac.policies.recompute_all(),
    "save_all": lambda: torch_sac.policies.save_all(),
    "save_matmuls": lambda: torch_sac.policies.save_matmuls(),
    "every_other_mm": lambda: torch_sac.policies.every_nth([aten.mm, aten.addmm], 2),
    "callable": lambda: mixed_policy_fn,
    "ops_list": lambda: list(MM_OPS),
}
POLICY_NAMES = list(POLICIES)


def policy_of(name):
    return POLICIES[name]()


# --------------------------------------------------------------------------
# Running a model with and without a region
# --------------------------------------------------------------------------

# How the model is put in a region:
#   whole:      one sac_context around the whole forward
#   per_block:  one sac_context per block of a Stack
#   checkpoint: torch_sac.checkpoint(module, x, policy=...)
MODES = ("whole", "per_block", "checkpoint")


class Step:
    """One forward+backward: results, the global RNG state after it, and the
    contexts used (for stats)."""

    def __init__(self, result, rng_after, contexts):
        self.result = result
        self.rng_after = rng_after
        self.contexts = contexts

    def stats(self):
        total = {}
        for ctx in self.contexts:
            for k, v in ctx.stats().items():
                total[k] = total.get(k, 0) + v
        return total


def forward_in_region(module, x, policy, mode, allow=False, contexts=None):
    contexts = [] if contexts is None else contexts
    if policy is None:
        return module(x)
    if mode == "whole":
        with torch_sac.sac_context(policy, allow_cache_entry_mutation=allow) as ctx:
            out = module(x)
        contexts.append(ctx)
        return out
    if mode == "per_block":
        assert isinstance(module, Stack)
        h = x
        for block in module:
            with torch_sac.sac_context(policy, allow_cache_entry_mutation=allow) as ctx:
                h = block(h)
            contexts.append(ctx)
        return h
    if mode == "checkpoint":
        return torch_sac.checkpoint(module, x, policy=policy, allow_cache_entry_mutation=allow)
    raise AssertionError(mode)


def run_step(model, policy=None, mode="whole", allow=False, seed=RUN_SEED, wrap=None):
    """Fresh model, fixed global seed, forward (in a region unless policy is
    None), loss, backward. ``wrap`` is an optional context-manager factory
    put around forward+backward (autocast)."""
    builder = REGION_MODEL_BUILDERS[model] if isinstance(model, str) else model
    module, make_input = builder()
    x = make_input()
    torch.manual_seed(seed)
    contexts = []
    if wrap is None:
        out = forward_in_region(module, x, policy, mode, allow, contexts)
    else:
        with wrap():
            out = forward_in_region(module, x, policy, mode, allow, contexts)
    loss_of(out.float()).backward()
    return Step(collect(module, x, out), torch.get_rng_state(), contexts)


_REFERENCE = {}


def reference(model):
    """The un-checkpointed run of ``model`` (cached)."""
    if model not in _REFERENCE:
        _REFERENCE[model] = run_step(model)
    return _REFERENCE[model]


def assert_step_equal(step, ref, label):
    assert_grads_equal(step.result, ref.result, label)
    assert_buffers_equal(step.result, ref.result, label)
    assert torch.equal(step.rng_after, ref.rng_after), (
        f"{label}: global RNG state differs after the step"
    )


def interceptor_off():
    """No torch_sac interception is active on this thread."""
    if torch_sac.adapter() == "key":
        assert torch_sac._C.key_handler_depth() == 0
    assert _get_current_dispatch_mode() is None
    assert torch._C._len_torch_dispatch_stack() == 0


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_of(o)]
    return []


# --------------------------------------------------------------------------
# Small functions
# --------------------------------------------------------------------------


def small_inputs(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n, generator=g).requires_grad_(True)
    w = torch.randn(n, n, generator=g).requires_grad_(True)
    return x, w


def run_fn(fn, policy=None, seed=0, allow=False, n_inputs=2):
    """fn(x, w) in a region (unless policy is None), backward of a weighted
    sum of its outputs -> (outputs, x.grad, w.grad, ctx)."""
    x, w = small_inputs(seed)
    ctx = None
    if policy is None:
        out = fn(x, w)
    else:
        with torch_sac.sac_context(policy, allow_cache_entry_mutation=allow) as ctx:
            out = fn(x, w)
    outs = tensors_of(out)
    loss = sum(loss_of(o.float()) for o in outs if o.requires_grad)
    loss.backward()
    return [o.detach().clone() for o in outs], x.grad, w.grad, ctx


def assert_fn_equal(a, b, label):
    outs_a, gx_a, gw_a, _ = a
    outs_b, gx_b, gw_b, _ = b
    assert len(outs_a) == len(outs_b)
    for i, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        assert_tensors_equal(oa, ob, f"{label}: output {i}")
    assert_tensors_equal(gx_a, gx_b, f"{label}: x.grad")
    assert_tensors_equal(gw_a, gw_b, f"{label}: w.grad")


# ==========================================================================
# 1. Gradients over a model matrix x policies
# ==========================================================================

MATRIX = [
    ("mlp", "whole"),
    ("mlp", "checkpoint"),
    ("convbn", "whole"),
    ("gpt4", "whole"),
    ("gpt4", "per_block"),
    ("lstm_loop", "whole"),
    ("custom_fn", "whole"),
]


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("model,mode", MATRIX, ids=[f"{m}-{mode}" for m, mode in MATRIX])
def test_matches_uncheckpointed(model, mode, policy_name):
    ref = reference(model)
    step = run_step(model, policy_of(policy_name), mode)
    label = f"{model}/{mode}/{policy_name}"
    # Outputs (so dropout masks), parameter and input grads, BatchNorm buffers
    # (running stats updated exactly once) and the global RNG state afterwards.
    assert_step_equal(step, ref, label)
    if mode != "checkpoint":
        stats = step.stats()
        assert stats["policy_calls"] > 0
        if policy_name == "save_all":
            assert stats["dropped_ops"] == 0 and stats["replayed_ops"] == 0, stats
        else:
            assert stats["dropped_ops"] > 0, stats
        if policy_name == "recompute_all":
            assert stats["replayed_ops"] > 0, stats


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
def test_batchnorm_stats_updated_once_and_bn_replayed(policy_name):
    """BatchNorm's running stats and num_batches_tracked equal the plain run's
    after one step (and after a second step), while the BN output itself is
    dropped and rebuilt by replay."""

    def two_steps(policy):
        module, make_input = REGION_MODEL_BUILDERS["convbn"]()
        ctxs = []
        for step in range(2):
            x = make_input()
            out = forward_in_region(module, x, policy, "whole", contexts=ctxs)
            loss_of(out).backward()
        return module, ctxs

    plain, _ = two_steps(None)
    ours, ctxs = two_steps(policy_of(policy_name))
    for (name, b_ref), (_, b) in zip(plain.named_buffers(), ours.named_buffers()):
        assert_tensors_equal(b, b_ref, f"buffer {name}")
    assert ours.bn.num_batches_tracked.item() == 2
    for (name, p_ref), (_, p) in zip(plain.named_parameters(), ours.named_parameters()):
        assert_tensors_equal(p.grad, p_ref.grad, f"accumulated grad of {name}")
    for ctx in ctxs:
        rows = {op: (saved, dropped, replayed) for op, saved, dropped, replayed in ctx.op_summary()}
        bn = [op for op in rows if "batch_norm" in op]
        assert bn, rows
        assert any(rows[op][1] > 0 and rows[op][2] > 0 for op in bn), (
            f"BatchNorm output was not dropped and replayed: {rows}"
        )
        assert ctx.stats()["held_bytes"] > 0  # the copies of the running stats


# ==========================================================================
# 2. Random ops
# ==========================================================================


def random_fn(x, w, gen=None):
    """Random factory and in-place random ops whose values backward needs."""
    r = torch.rand(4, 4)
    a = torch.mm(x, w) * r  # mul saves r
    b = torch.randn_like(x) * a.sin()  # saves randn_like's output and sin's
    m = torch.empty(4, 4).bernoulli_(0.5)
    c = (b * m).tanh()
    n = torch.empty(4, 4).normal_(0.0, 2.0)
    d = c * n
    e = F.dropout(d, p=0.3, training=True)
    if gen is not None:
        gr = torch.rand(4, 4, generator=gen)
        gb = torch.empty(4, 4).bernoulli_(0.5, generator=gen)
        e = e * gr * gb
    return e.exp()


@pytest.mark.parametrize("with_generator", [False, True], ids=["global_rng", "explicit_generator"])
@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls", "callable", "save_all"])
def test_random_ops_replay_identically(policy_name, with_generator):
    def run(policy):
        gen = torch.Generator().manual_seed(11) if with_generator else None
        torch.manual_seed(5)
        res = run_fn(lambda x, w: random_fn(x, w, gen), policy)
        return res, torch.get_rng_state(), (gen.get_state() if gen is not None else None)

    ref, rng_ref, gen_ref = run(None)
    ours, rng_ours, gen_ours = run(policy_of(policy_name))
    assert_fn_equal(ours, ref, policy_name)
    assert torch.equal(rng_ours, rng_ref), "global RNG state differs after the step"
    if with_generator:
        assert torch.equal(gen_ours, gen_ref), "explicit generator state differs after the step"
    stats = ours[3].stats()
    if policy_name == "recompute_all":
        assert stats["replayed_ops"] > 0
        replayed = {op for op, _, _, n in ours[3].op_summary() if n > 0}
        for name in ("aten::rand", "aten::randn_like", "aten::bernoulli_", "aten::normal_"):
            assert any(op.startswith(name + ".") for op in replayed), (name, replayed)


def test_dropout_masks_survive_rng_use_between_forward_and_backward():
    """Replay draws from the state recorded in forward, not the current one:
    drawing random numbers between forward and backward changes nothing."""

    def run(policy, disturb):
        module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
        x = make_input()
        torch.manual_seed(RUN_SEED)
        out = forward_in_region(module, x, policy, "whole")
        if disturb:
            torch.rand(1000)
        loss_of(out).backward()
        return collect(module, x, out)

    ref = run(None, False)
    ours = run(policy_of("recompute_all"), True)
    assert_grads_equal(ours, ref, "recompute_all with RNG use before backward")


# ==========================================================================
# 3. Views, aliasing, in-place chains, .item(), factory ops
# ==========================================================================


def views_fn(x, w):
    h = torch.mm(x, w)
    s0, s1 = h.split(2, dim=1)
    c0, c1 = h.chunk(2, dim=0)
    u = h.unbind(0)
    t = h.t()
    v = h.view(-1)
    n = h.narrow(1, 1, 2)
    cat = torch.cat([s0.sin(), s1.cos(), c0.t().exp()[:, :2].t().reshape(4, 2)], 1)
    outs = [cat, c1.sigmoid(), u[1].tanh(), u[3] * u[0], t.sin(), v.exp(), n.cos()]
    return outs


def inplace_fn(x, w):
    y = x.sin()
    y.mul_(2)
    y.add_(1)
    e = y.exp()  # saves its result
    z = y * w  # saves y (at version 2) and w
    s = torch.mm(x, w).sin()
    sv = s[:, :2]  # a view of a region tensor...
    sv.mul_(3)  # ...written in place
    s2 = s.cos()  # saves s after the write through the view
    q = s.t()[1:] * 1.5
    q.add_(0.5)
    q2 = q.exp()
    return [e, z, s2, q2, sv * 2]


def item_and_factory_fn(x, w):
    h = torch.mm(x, w)
    k = h.abs().sum().item()  # .item() inside the region
    zeros = torch.zeros(4, 4)
    zeros[:, 0] = 1.0
    zeros[1].fill_(2.0)
    ar = torch.arange(4.0).view(1, 4)
    full = torch.full((4, 4), k / 100.0)
    ones = torch.ones_like(h)
    a = (h + ar) * zeros  # mul saves zeros
    b = (h * full).sin()
    c = (a + ones).tanh() * torch.eye(4)
    return [a.exp(), b, c]


def mutation_of_outside_fn(x, w):
    """Ops that write into tensors from outside the region (a buffer)."""
    buf = _OUTSIDE_BUFFER
    h = torch.mm(x, w).sin()
    buf.mul_(0.5).add_(h.detach().mean(0))
    return (h * 2).exp()


_OUTSIDE_BUFFER = torch.zeros(4)

VIEW_FNS = {
    "views": views_fn,
    "inplace": inplace_fn,
    "item_factory": item_and_factory_fn,
}


@pytest.mark.parametrize(
    "policy_name", ["recompute_all", "save_all", "save_matmuls", "callable", "every_other_mm"]
)
@pytest.mark.parametrize("fn_name", list(VIEW_FNS))
def test_views_inplace_item_factories(fn_name, policy_name):
    fn = VIEW_FNS[fn_name]
    ref = run_fn(fn)
    ours = run_fn(fn, policy_of(policy_name))
    assert_fn_equal(ours, ref, f"{fn_name}/{policy_name}")
    if policy_name == "recompute_all":
        assert ours[3].stats()["dropped_ops"] > 0


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
def test_write_to_outside_tensor_applied_once(policy_name):
    _OUTSIDE_BUFFER.fill_(1.0)
    ref = run_fn(mutation_of_outside_fn)
    buf_ref = _OUTSIDE_BUFFER.clone()
    _OUTSIDE_BUFFER.fill_(1.0)
    ours = run_fn(mutation_of_outside_fn, policy_of(policy_name))
    assert_fn_equal(ours, ref, policy_name)
    assert_tensors_equal(_OUTSIDE_BUFFER, buf_ref, "outside buffer")


def test_dropped_views_rebuilt_after_originals_die():
    """Views of a dropped tensor saved by autograd come back with the right
    geometry (offset, strides) when the originals are gone."""

    def fn(x, w):
        h = torch.mm(x, w).sin()
        a = h[1:, ::2]  # non-contiguous, offset view
        b = h.t()[2]
        return [a.exp(), (b * b).sum(0, keepdim=True), h.diagonal().cos()]

    ref = run_fn(fn)
    ours = run_fn(fn, policy_of("recompute_all"))
    assert_fn_equal(ours, ref, "views of dropped")
    s = ours[3].stats()
    assert s["replayed_ops"] > 0, s


# ==========================================================================
# 4. stats() and op_summary()
# ==========================================================================


def chain_fn(x, w):
    """mm, sin, mm, relu, exp: 5 ops, all needed by backward."""
    a = torch.mm(x, w)
    b = a.sin()
    c = torch.mm(b, w)
    return c.relu().exp()


CHAIN_OPS = ["aten::mm.default", "aten::sin.default", "aten::relu.default", "aten::exp.default"]


def test_stats_recompute_all():
    ref = run_fn(chain_fn)
    ours = run_fn(chain_fn, torch_sac.policies.recompute_all())
    assert_fn_equal(ours, ref, "recompute_all")
    s = ours[3].stats()
    assert set(s) >= {
        "policy_calls",
        "saved_ops",
        "saved_bytes",
        "dropped_ops",
        "dropped_bytes",
        "held_bytes",
        "packed_kept",
        "packed_dropped",
        "unpacked_original",
        "replayed_ops",
        "replay_ns",
    }
    assert all(type(v) is int for v in s.values()), s
    assert s["policy_calls"] == 5
    assert s["saved_ops"] == 0 and s["saved_bytes"] == 0
    assert s["dropped_ops"] == 5 and s["dropped_bytes"] == 5 * 16 * 4
    assert s["packed_dropped"] > 0
    # The intermediates are gone after forward (run_fn keeps only the
    # output), so backward replays them.
    assert s["replayed_ops"] > 0 and s["replay_ns"] > 0
    rows = ours[3].op_summary()
    assert [r[0] for r in rows] == CHAIN_OPS
    by_op = {op: (saved, dropped, replayed) for op, saved, dropped, replayed in rows}
    assert by_op["aten::mm.default"][:2] == (0, 2)
    assert by_op["aten::sin.default"][:2] == (0, 1)
    assert sum(r[3] for r in rows) == s["replayed_ops"]
    for row in rows:
        assert isinstance(row[0], str) and all(type(v) is int for v in row[1:])


def test_stats_save_all():
    ours = run_fn(chain_fn, torch_sac.policies.save_all())
    assert_fn_equal(ours, run_fn(chain_fn), "save_all")
    s = ours[3].stats()
    assert s["policy_calls"] == 5
    assert s["saved_ops"] == 5 and s["saved_bytes"] == 5 * 16 * 4
    assert s["dropped_ops"] == 0 and s["dropped_bytes"] == 0
    assert s["packed_dropped"] == 0 and s["replayed_ops"] == 0 and s["replay_ns"] == 0
    assert s["packed_kept"] > 0
    rows = ours[3].op_summary()
    assert [r[0] for r in rows] == CHAIN_OPS
    assert all(replayed == 0 and dropped == 0 for _, _, dropped, replayed in rows)
    assert dict((r[0], r[1]) for r in rows)["aten::mm.default"] == 2


def test_stats_save_matmuls():
    ours = run_fn(chain_fn, torch_sac.policies.save_matmuls())
    assert_fn_equal(ours, run_fn(chain_fn), "save_matmuls")
    s = ours[3].stats()
    assert (s["saved_ops"], s["dropped_ops"]) == (2, 3)
    rows = {r[0]: r[1:] for r in ours[3].op_summary()}
    assert rows["aten::mm.default"][:2] == (2, 0)
    assert rows["aten::mm.default"][2] == 0, "a saved op was replayed"
    assert rows["aten::sin.default"][:2] == (0, 1)


def test_live_original_is_used_instead_of_replay():
    """While the user still holds a dropped tensor, backward uses it."""
    x, w = small_inputs()
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        a = torch.mm(x, w)
        b = a.sin()  # saves a
        c = b.exp()  # saves its result c
    loss_of(c).backward()
    s = ctx.stats()
    assert s["unpacked_original"] == s["packed_dropped"] == 2
    assert s["replayed_ops"] == 0


def test_stats_before_enter_raises():
    ctx = torch_sac.sac_context(torch_sac.policies.recompute_all())
    with pytest.raises(RuntimeError, match="never entered"):
        ctx.stats()


# ==========================================================================
# 5. Nested regions
# ==========================================================================


def nested_fn(outer_ops, inner_policy):
    def fn(x, w):
        a = torch.mm(x, w).sin()
        with torch_sac.sac_context(inner_policy):
            b = torch.mm(a, w).cos()
            c = b.exp()
        return torch.mm(c, w).tanh()

    return fn


def summary(ctx):
    return {op: (saved, dropped) for op, saved, dropped, _ in ctx.op_summary()}


def test_nested_must_beats_prefer():
    outer = lambda ctx, op, *a, **k: P.MUST_SAVE if op is aten.mm.default else P.PREFER_RECOMPUTE
    fn = nested_fn(None, torch_sac.policies.recompute_all())  # inner: PREFER_RECOMPUTE
    ours = run_fn(fn, outer)
    assert_fn_equal(ours, run_fn(fn), "MUST_SAVE outer / PREFER_RECOMPUTE inner")
    rows = summary(ours[3])
    assert rows["aten::mm.default"] == (3, 0), rows  # outer MUST_SAVE wins inside too
    assert rows["aten::cos.default"] == (0, 1)

    # And the other way round: outer PREFER_SAVE, inner MUST_RECOMPUTE for mm.
    inner = lambda ctx, op, *a, **k: P.MUST_RECOMPUTE if op is aten.mm.default else P.PREFER_SAVE
    fn = nested_fn(None, inner)
    ours = run_fn(fn, torch_sac.policies.save_all())
    assert_fn_equal(ours, run_fn(fn), "PREFER_SAVE outer / MUST_RECOMPUTE inner")
    rows = summary(ours[3])
    assert rows["aten::mm.default"] == (2, 1), rows  # only the inner mm is dropped
    assert rows["aten::cos.default"] == (1, 0)


def test_nested_innermost_prefer_wins():
    fn = nested_fn(None, torch_sac.policies.recompute_all())
    ours = run_fn(fn, torch_sac.policies.save_all())
    assert_fn_equal(ours, run_fn(fn), "save_all outer / recompute_all inner")
    rows = summary(ours[3])
    assert rows["aten::mm.default"] == (2, 1), rows
    assert rows["aten::cos.default"] == (0, 1) and rows["aten::exp.default"] == (0, 1)
    assert rows["aten::sin.default"] == (1, 0) and rows["aten::tanh.default"] == (1, 0)

    fn = nested_fn(None, torch_sac.policies.save_all())
    ours = run_fn(fn, torch_sac.policies.recompute_all())
    assert_fn_equal(ours, run_fn(fn), "recompute_all outer / save_all inner")
    rows = summary(ours[3])
    assert rows["aten::mm.default"] == (1, 2), rows
    assert rows["aten::cos.default"] == (1, 0) and rows["aten::sin.default"] == (0, 1)


def test_nested_three_levels_and_checkpoint_inside():
    def fn(x, w):
        with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
            a = torch.mm(x, w).sin()
            with torch_sac.sac_context(torch_sac.policies.recompute_all()):
                b = torch_sac.checkpoint(
                    lambda t: torch.mm(t, w).cos(), a, policy=torch_sac.policies.save_all()
                )
        return (a * b).exp()

    ours = run_fn(fn, torch_sac.policies.recompute_all())
    assert_fn_equal(ours, run_fn(fn), "three levels")
    rows = summary(ours[3])
    assert rows["aten::mm.default"] == (2, 0)
    assert rows["aten::sin.default"] == (0, 1)
    assert rows["aten::cos.default"] == (1, 0)
    assert rows["aten::exp.default"] == (0, 1)


def test_nested_conflicting_musts_raise_naming_op():
    outer = lambda ctx, op, *a, **k: P.MUST_SAVE if op is aten.mm.default else P.PREFER_SAVE
    inner = lambda ctx, op, *a, **k: P.MUST_RECOMPUTE
    x, w = small_inputs()
    with pytest.raises(RuntimeError) as excinfo:
        with torch_sac.sac_context(outer):
            a = x.sin()
            with torch_sac.sac_context(inner):
                a.cos()  # MUST_RECOMPUTE vs PREFER_SAVE: fine
                torch.mm(a, w)  # MUST_RECOMPUTE vs MUST_SAVE: raises
    msg = str(excinfo.value)
    assert "aten::mm" in msg, msg
    assert "MUST_SAVE" in msg and "MUST_RECOMPUTE" in msg, msg
    interceptor_off()
    # Everything unwound: a new region works and is exact.
    assert_fn_equal(
        run_fn(chain_fn, torch_sac.policies.recompute_all()), run_fn(chain_fn), "after conflict"
    )


def test_nested_exit_out_of_order_raises():
    outer = torch_sac.sac_context(torch_sac.policies.recompute_all())
    inner = torch_sac.sac_context(torch_sac.policies.save_all())
    outer.__enter__()
    try:
        inner.__enter__()
        try:
            with pytest.raises(RuntimeError, match="reverse order"):
                outer.__exit__(None, None, None)
        finally:
            inner.__exit__(None, None, None)
    finally:
        outer.__exit__(None, None, None)
    interceptor_off()
    # A context object cannot be entered twice at once, and a region after
    # all this is exact.
    ctx = torch_sac.sac_context(torch_sac.policies.recompute_all())
    with ctx:
        with pytest.raises(RuntimeError, match="already entered"):
            ctx.__enter__()
    interceptor_off()
    assert_fn_equal(run_fn(chain_fn, torch_sac.policies.recompute_all()), run_fn(chain_fn), "after")


def test_out_of_order_exit_leaves_nothing_installed():
    """A generator holding a region, closed while a later region is open:
    the exit raises, and afterwards no region records and no policy is
    called (issue: the region stayed installed and recorded plain code)."""
    seen = RecordingCallable()

    def gen():
        with torch_sac.sac_context(seen):
            yield

    g = gen()
    next(g)
    later = torch_sac.sac_context(torch_sac.policies.recompute_all())
    later.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        g.close()
    later.__exit__(None, None, None)  # already undone: no second error
    interceptor_off()
    calls = len(seen.ops)
    x = torch.randn(4, requires_grad=True)
    (x.sin() * 2).sum().backward()
    assert len(seen.ops) == calls, "policy called after the region was exited"
    assert_fn_equal(run_fn(chain_fn, torch_sac.policies.recompute_all()), run_fn(chain_fn), "after")


@pytest.mark.parametrize("engine", ["region", "contexts"])
def test_policy_bound_to_module_keeping_its_region_is_collected(engine):
    """A module whose bound method is the policy and which keeps its region
    (for stats()) forms a cycle through the policy; it must be collectable."""
    import gc
    import weakref

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.kept = None

        def policy(self, ctx, op, *args, **kwargs):
            return torch_sac.Policy.PREFER_RECOMPUTE

        def forward(self, x):
            if engine == "region":
                with torch_sac.sac_context(self.policy) as region:
                    y = self.lin(x).relu()
                self.kept = region
                return y

            def context_fn():
                self.kept = torch_sac.create_selective_checkpoint_contexts(self.policy)
                return self.kept

            return torch.utils.checkpoint.checkpoint(
                lambda t: self.lin(t).relu(), x, use_reentrant=False, context_fn=context_fn
            )

    refs = []
    for _ in range(3):
        net = Net()
        net(torch.randn(2, 64, requires_grad=True)).sum().backward()
        refs.append(weakref.ref(net))
        del net
    gc.collect()
    assert all(r() is None for r in refs), "module leaked through its policy"
    interceptor_off()


def test_exit_on_another_thread_raises():
    ctx = torch_sac.sac_context(torch_sac.policies.recompute_all())
    ctx.__enter__()
    errors = []

    def other():
        try:
            ctx.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(e)

    try:
        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(HANG_LIMIT_S)
        assert not t.is_alive(), "the other thread's exit hung"
    finally:
        ctx.__exit__(None, None, None)
    assert len(errors) == 1 and "thread" in str(errors[0])
    interceptor_off()


@pytest.mark.parametrize(
    "outer_name,inner_name",
    [
        ("recompute_all", "save_matmuls"),
        ("save_all", "recompute_all"),
        ("every_other_mm", "callable"),
        ("save_matmuls", "save_all"),
    ],
)
def test_nested_per_block_regions_exact(outer_name, inner_name):
    """A region around the whole GPT stack and a region per block inside it."""

    def fwd(module, x):
        with torch_sac.sac_context(policy_of(outer_name)) as ctx:
            h = x
            for block in module:
                with torch_sac.sac_context(policy_of(inner_name)):
                    h = block(h)
        return h, ctx

    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    out, ctx = fwd(module, x)
    loss_of(out).backward()
    step = Step(collect(module, x, out), torch.get_rng_state(), [ctx])
    assert_step_equal(step, reference("gpt4"), f"outer {outer_name} / inner {inner_name}")


# ==========================================================================
# 6. Composition: torch.utils.checkpoint, save_on_cpu, autocast
# ==========================================================================


def block_fn(h, w):
    return torch.mm(h, w).sin().mul(2).tanh()


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls", "save_all"])
@pytest.mark.parametrize("inner", ["checkpoint", "checkpoint_torch_sac", "save_on_cpu"])
def test_torch_machinery_inside_region(inner, policy_name):
    def fn(x, w):
        a = torch.mm(x, w).exp()
        if inner == "checkpoint":
            b = tc.checkpoint(block_fn, a, w, use_reentrant=False)
        elif inner == "checkpoint_torch_sac":
            ctx_fn = lambda: torch_sac.create_selective_checkpoint_contexts([aten.mm.default])
            b = tc.checkpoint(block_fn, a, w, use_reentrant=False, context_fn=ctx_fn)
        else:
            with torch.autograd.graph.save_on_cpu():
                b = block_fn(a, w)
        return (b * a).cos()

    ref = run_fn(fn)
    ours = run_fn(fn, policy_of(policy_name))
    assert_fn_equal(ours, ref, f"{inner}/{policy_name}")


def test_region_inside_torch_checkpoint():
    def fn(x, w):
        return tc.checkpoint(
            lambda x, w: torch_sac.checkpoint(
                chain_fn, x, w, policy=torch_sac.policies.recompute_all()
            ),
            x,
            w,
            use_reentrant=False,
        )

    assert_fn_equal(run_fn(fn), run_fn(chain_fn), "sac region inside torch checkpoint")


@pytest.mark.parametrize(
    "model,mode", [("mlp", "whole"), ("gpt4", "per_block"), ("convbn", "whole")]
)
@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("placement", ["autocast_inside_region", "region_inside_autocast"])
def test_autocast(model, mode, policy_name, placement):
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    ref = run_step(model, wrap=autocast)
    assert ref.result.out.dtype == torch.bfloat16 or model == "convbn"
    if placement == "region_inside_autocast":
        step = run_step(model, policy_of(policy_name), mode, wrap=autocast)
    else:
        # The autocast context entered inside each region.
        builder = REGION_MODEL_BUILDERS[model]
        module, make_input = builder()
        x = make_input()
        torch.manual_seed(RUN_SEED)
        ctxs = []
        if mode == "whole":
            with torch_sac.sac_context(policy_of(policy_name)) as ctx, autocast():
                out = module(x)
            ctxs.append(ctx)
        else:
            out = x
            for block in module:
                with torch_sac.sac_context(policy_of(policy_name)) as ctx, autocast():
                    out = block(out)
                ctxs.append(ctx)
        loss_of(out.float()).backward()
        step = Step(collect(module, x, out), torch.get_rng_state(), ctxs)
    # Replay runs the very kernels forward ran (already cast), so even in
    # bfloat16 the results are bitwise those of the un-checkpointed run.
    assert_step_equal(step, ref, f"autocast {placement} {model}/{policy_name}")
    assert step.stats()["dropped_ops"] > 0
    if policy_name == "recompute_all":
        assert step.stats()["replayed_ops"] > 0


# ==========================================================================
# 7. Threads
# ==========================================================================


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
def test_backward_on_another_thread(policy_name):
    ref = reference("gpt4")
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    with torch_sac.sac_context(policy_of(policy_name)) as ctx:
        out = module(x)
    loss = loss_of(out)
    errors = []

    def backward():
        try:
            loss.backward()
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=backward, daemon=True)
    t.start()
    t.join(HANG_LIMIT_S)
    assert not t.is_alive(), "backward hung"
    assert not errors, errors
    step = Step(collect(module, x, out), torch.get_rng_state(), [ctx])
    assert_step_equal(step, ref, "backward on another thread")
    if policy_name == "recompute_all":
        assert ctx.stats()["replayed_ops"] > 0


def test_regions_on_two_threads_at_once():
    """Two threads, each in its own region, interleaved op by op: each region
    records only its own thread's ops, and both results are exact."""
    n_steps = 6
    barrier = threading.Barrier(2, timeout=HANG_LIMIT_S)
    results, errors = {}, []

    def worker(name, policy, seed):
        try:
            x, w = small_inputs(seed)
            with torch_sac.sac_context(policy) as ctx:
                h = x
                for _ in range(n_steps):
                    barrier.wait()  # both threads are inside their region
                    h = torch.mm(h, w).sin()
            loss_of(h).backward()
            results[name] = (ctx.stats(), h.detach(), x.grad.clone(), w.grad.clone())
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [
        threading.Thread(
            target=worker, args=("a", torch_sac.policies.recompute_all(), 1), daemon=True
        ),
        threading.Thread(target=worker, args=("b", RecordingCallable(), 2), daemon=True),
    ]
    for t in threads:
        t.start()
    # The main thread is outside any region while the workers run.
    x, w = small_inputs(9)
    torch.mm(x, w).sum()
    for t in threads:
        t.join(HANG_LIMIT_S)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    for name, seed in (("a", 1), ("b", 2)):
        stats, out, gx, gw = results[name]
        assert stats["policy_calls"] == 2 * n_steps, (name, stats)
        x, w = small_inputs(seed)
        h = x
        for _ in range(n_steps):
            h = torch.mm(h, w).sin()
        loss_of(h).backward()
        assert_tensors_equal(out, h.detach(), f"thread {name}: output")
        assert_tensors_equal(gx, x.grad, f"thread {name}: x.grad")
        assert_tensors_equal(gw, w.grad, f"thread {name}: w.grad")
    assert results["a"][0]["replayed_ops"] > 0


class RecordingCallable:
    """A Python policy saving every other op it sees, by call order."""

    def __init__(self):
        self.ops = []

    def __call__(self, ctx, op, *args, **kwargs):
        self.ops.append(op)
        return len(self.ops) % 2 == 0


# ==========================================================================
# 8. retain_graph and double backward
# ==========================================================================


@pytest.mark.parametrize(
    "policy_name", ["recompute_all", "save_matmuls", "every_other_mm", "save_all"]
)
@pytest.mark.parametrize("model", ["gpt4", "convbn", "lstm_loop"])
def test_retain_graph_second_backward_replays_again(model, policy_name):
    def run(policy):
        module, make_input = REGION_MODEL_BUILDERS[model]()
        x = make_input()
        torch.manual_seed(RUN_SEED)
        ctxs = []
        out = forward_in_region(module, x, policy, "whole", contexts=ctxs)
        loss = loss_of(out)
        loss.backward(retain_graph=True)
        first = collect(module, x, out)
        loss.backward()
        return first, collect(module, x, out), ctxs

    ref1, ref2, _ = run(None)
    ours1, ours2, ctxs = run(policy_of(policy_name))
    assert_grads_equal(ours1, ref1, "first backward")
    assert_grads_equal(ours2, ref2, "second backward")
    for name, g in ours2.param_grads.items():
        assert_tensors_equal(g, 2 * ours1.param_grads[name], f"{name}: 2x after two backwards")
    assert_buffers_equal(ours2, ref2, "buffers")
    if policy_name == "recompute_all":
        stats = ctxs[0].stats()
        replayed_once = stats["replayed_ops"]
        assert replayed_once > 0


def test_retain_graph_second_backward_exact_2x():
    x, w = small_inputs()
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        out = chain_fn(x, w)
    loss = loss_of(out)
    loss.backward(retain_graph=True)
    once = ctx.stats()["replayed_ops"]
    g1 = (x.grad.clone(), w.grad.clone())
    loss.backward()
    assert once > 0
    assert ctx.stats()["replayed_ops"] > once, "second backward did not replay"
    assert_tensors_equal(x.grad, 2 * g1[0], "x.grad")
    assert_tensors_equal(w.grad, 2 * g1[1], "w.grad")


def test_retain_graph_second_backward_costs_no_more_than_first():
    x = torch.randn(4, 4, requires_grad=True)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        h = x
        for _ in range(20):
            h = h.sin()
    loss = h.sum()
    loss.backward(retain_graph=True)
    first = ctx.stats()["replayed_ops"]
    loss.backward()
    second = ctx.stats()["replayed_ops"] - first
    assert first == 19
    assert second == first, f"first backward replayed {first} ops, the second {second}"


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls", "callable", "save_all"])
@pytest.mark.parametrize("model", ["mlp", "gpt4", "lstm_loop"])
def test_double_backward_gradient_penalty(model, policy_name):
    def run(policy):
        module, make_input = REGION_MODEL_BUILDERS[model]()
        x = make_input()
        torch.manual_seed(RUN_SEED)
        ctxs = []
        out = forward_in_region(module, x, policy, "whole", contexts=ctxs)
        (gx,) = torch.autograd.grad(loss_of(out), x, create_graph=True)
        penalty = gx.pow(2).sum() + out.pow(2).mean()
        penalty.backward()
        return collect(module, x, out), gx.detach().clone(), ctxs

    ref, gx_ref, _ = run(None)
    ours, gx_ours, ctxs = run(policy_of(policy_name))
    assert_tensors_equal(gx_ours, gx_ref, "first-order input grad")
    assert_grads_equal(ours, ref, f"gradient penalty {model}/{policy_name}")
    if policy_name == "recompute_all":
        assert ctxs[0].stats()["replayed_ops"] > 0


# ==========================================================================
# 9. Errors leave no state behind
# ==========================================================================


class PolicyBoom(Exception):
    pass


class RegionBoom(Exception):
    pass


def assert_fresh_region_works():
    interceptor_off()
    counting = RecordingCallable()
    ours = run_fn(chain_fn, counting)
    assert len(counting.ops) == 5
    assert_fn_equal(ours, run_fn(chain_fn), "a new region after the error")
    interceptor_off()


def assert_not_intercepted(policy_ops):
    """Plain forward+backward after the error: the old policy sees nothing."""
    before = len(policy_ops)
    x, w = small_inputs(1)
    chain_fn(x, w).sum().backward()
    assert len(policy_ops) == before


def test_policy_exception_propagates():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        if op is aten.sin.default:
            raise PolicyBoom("boom from policy")
        return P.PREFER_RECOMPUTE

    x, w = small_inputs()
    with pytest.raises(PolicyBoom, match="boom from policy"):
        with torch_sac.sac_context(policy):
            chain_fn(x, w)
    assert seen == [aten.mm.default, aten.sin.default]
    interceptor_off()
    assert_not_intercepted(seen)
    assert_fresh_region_works()


def test_policy_exception_via_checkpoint_function():
    def policy(ctx, op, *args, **kwargs):
        raise PolicyBoom("boom")

    x, w = small_inputs()
    with pytest.raises(PolicyBoom):
        torch_sac.checkpoint(chain_fn, x, w, policy=policy)
    assert_fresh_region_works()


def test_exception_inside_region():
    seen = RecordingCallable()
    x, w = small_inputs()
    with pytest.raises(RegionBoom):
        with torch_sac.sac_context(seen):
            torch.mm(x, w).sin()
            raise RegionBoom("boom from region")
    assert len(seen.ops) == 2
    interceptor_off()
    assert_not_intercepted(seen.ops)
    assert_fresh_region_works()


def test_exception_inside_nested_region():
    seen = RecordingCallable()
    x, w = small_inputs()
    with pytest.raises(RegionBoom):
        with torch_sac.sac_context(seen):
            with torch_sac.sac_context(torch_sac.policies.save_all()):
                torch.mm(x, w).sin()
                raise RegionBoom("boom")
    interceptor_off()
    assert_not_intercepted(seen.ops)
    assert_fresh_region_works()


class Garbage:
    def __repr__(self):
        return "<Garbage 42>"


@pytest.mark.parametrize(
    "bad", [None, "MUST_SAVE", 1, 2.5, Garbage()], ids=["None", "str", "int", "float", "object"]
)
def test_policy_returning_garbage_raises_value_error(bad):
    def policy(ctx, op, *args, **kwargs):
        return bad if op is aten.sin.default else P.PREFER_RECOMPUTE

    x, w = small_inputs()
    with pytest.raises(ValueError) as excinfo:
        with torch_sac.sac_context(policy):
            chain_fn(x, w)
    msg = str(excinfo.value)
    assert "aten::sin" in msg or "aten.sin" in msg, msg
    assert repr(bad) in msg, msg
    assert_fresh_region_works()


@pytest.mark.parametrize("bad", [42, "recompute", None])
def test_bad_policy_argument_raises_before_entering(bad):
    with pytest.raises(TypeError, match="policy"):
        torch_sac.sac_context(bad)
    with pytest.raises(TypeError):
        torch_sac.sac_context(torch_sac.policies.save_all(), allow_cache_entry_mutation="yes")
    interceptor_off()


def test_outside_tensor_modified_before_backward_raises():
    """A tensor from outside the region that a replayed op needs, modified in
    place before backward. Plain autograd would not need it here (add does
    not save its inputs): only the replay does, and it must refuse."""
    x, _ = small_inputs()
    c = torch.randn(4, 4)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        h = x + c  # dropped; replaying it needs c
        y = h.sin()  # saves h
    del h
    c.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as excinfo:
        y.sum().backward()
    assert "add" in str(excinfo.value)
    interceptor_off()


def test_outside_tensor_saved_by_autograd_modified_raises():
    """The same with a tensor autograd itself saves (mm saves both operands)."""
    x, w = small_inputs()
    w2 = w * 1.0
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        y = torch.mm(x, w2).sin()
    w2.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_dropped_tensor_modified_after_save_raises_like_autograd():
    """The region does not hide autograd's own version check for a dropped
    tensor that was modified after it was saved."""
    x, w = small_inputs()
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        a = torch.mm(x, w)
        b = a.sin()  # saves a (dropped)
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    # Plain autograd agrees.
    x, w = small_inputs()
    a = torch.mm(x, w)
    b = a.sin()
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()


def saved_then_mutated(allow):
    """mm is saved, exp (which only saves its result) is dropped; replaying
    exp needs mm's output, which is then modified in place."""
    x, w = small_inputs()
    policy = [aten.mm.default]
    with torch_sac.sac_context(policy, allow_cache_entry_mutation=allow) as ctx:
        h = torch.mm(x, w)
        y = h.exp()
        z = y.cos()  # saves y: dropped
    del y
    with torch.no_grad():
        h.mul_(2)  # plain autograd would not mind: nothing saved h
    z.sum().backward()
    return x, w, ctx


def test_saved_output_mutated_before_backward_raises():
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as excinfo:
        saved_then_mutated(allow=False)
    msg = str(excinfo.value)
    assert "aten::exp" in msg, msg
    assert "allow_cache_entry_mutation" in msg, msg
    interceptor_off()


def test_saved_output_mutated_allowed():
    x, w, ctx = saved_then_mutated(allow=True)
    assert ctx.stats()["replayed_ops"] > 0
    # The replay used the modified value: grads are those of cos(exp(2 * mm)) through exp's result.
    h = torch.mm(x.detach(), w.detach()) * 2
    y = h.exp()
    gy = -torch.sin(y)
    gh = gy * y
    assert torch.allclose(x.grad, gh @ w.detach().t())
    assert torch.allclose(w.grad, x.detach().t() @ gh)


# ==========================================================================
# 10. Grad disabled, inference mode
# ==========================================================================


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_grad_disabled_records_nothing(mode, where):
    """A region entered with grad off records nothing; inference mode inside
    a region records nothing either (its tensors can never be saved for
    backward). no_grad inside a region is recorded: see
    test_grad_disabled_part_of_region."""
    if (mode, where) == ("no_grad", "inside"):
        pytest.skip("recorded on purpose: test_grad_disabled_part_of_region")
    guard = torch.no_grad if mode == "no_grad" else torch.inference_mode
    seen = RecordingCallable()
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    with torch.no_grad():
        expected = module(x)
    torch.manual_seed(RUN_SEED)
    if where == "outside":
        with guard(), torch_sac.sac_context(seen) as ctx:
            out = module(x)
    else:
        with torch_sac.sac_context(seen) as ctx, guard():
            out = module(x)
    assert seen.ops == []
    s = ctx.stats()
    assert s["policy_calls"] == 0 and s["dropped_ops"] == 0 and s["saved_ops"] == 0, s
    assert_tensors_equal(out, expected, "output")
    interceptor_off()


def test_grad_disabled_part_of_region():
    """Ops under no_grad in a region entered with grad on are recorded and
    reach the policy, as in PyTorch's SAC (a no_grad result may feed ops
    backward needs); backward is exact."""

    def fn(x, w):
        with torch.no_grad():
            scale = torch.mm(x, w).abs().max()
        return (torch.mm(x, w) / scale).sin().exp()

    seen = RecordingCallable()
    ours = run_fn(fn, seen)
    assert_fn_equal(ours, run_fn(fn), "partly no_grad")
    assert [str(op) for op in seen.ops] == [
        "aten.mm.default",
        "aten.abs.default",
        "aten.max.default",
        "aten.mm.default",
        "aten.div.Tensor",
        "aten.sin.default",
        "aten.exp.default",
    ]


# ==========================================================================
# 11. Memory: what the region drops is gone, what it holds is freed with the graph
# ==========================================================================


def storage_ref(t):
    return StorageWeakRef(t.untyped_storage())


def test_dropped_intermediate_is_freed_after_forward():
    """With recompute_all, an intermediate autograd saved is not kept alive
    once the user drops it (without a region, the graph keeps it)."""

    def forward(policy):
        x, w = small_inputs()
        ctx = torch_sac.sac_context(policy) if policy is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            a = torch.mm(x, w)
            b = a.sin()  # saves a
            c = b.exp()  # saves its result c
            d = c.tanh()  # saves its result d
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        refs = [storage_ref(a), storage_ref(c)]
        del a, b, c
        gc.collect()
        return x, w, d, refs, ctx

    # Plain autograd keeps both saved intermediates alive.
    _, _, d, refs, _ = forward(None)
    assert not any(r.expired() for r in refs)
    del d

    x, w, d, refs, ctx = forward(torch_sac.policies.recompute_all())
    assert all(r.expired() for r in refs), "a dropped intermediate is still alive after forward"
    loss_of(d).backward()
    assert ctx.stats()["replayed_ops"] >= 3  # mm, sin and exp rebuilt
    x_ref, w_ref = small_inputs()
    loss_of(torch.mm(x_ref, w_ref).sin().exp().tanh()).backward()
    assert_tensors_equal(x.grad, x_ref.grad, "x.grad")
    assert_tensors_equal(w.grad, w_ref.grad, "w.grad")


def test_saved_output_is_kept():
    """save_all keeps what autograd saved, like plain autograd."""
    x, w = small_inputs()
    with torch_sac.sac_context(torch_sac.policies.save_all()):
        a = torch.mm(x, w)
        b = a.sin()
    ref = storage_ref(a)
    del a
    gc.collect()
    assert not ref.expired()
    del b
    gc.collect()
    assert ref.expired()


def held_by_region():
    """A region where a replay needs a tensor nothing else holds: mm is
    saved, exp (which saves only its result) is dropped, so only the region
    keeps mm's output, for replaying exp. Also the input x, which only the
    region holds (for replaying sin)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g)  # needs no grad: autograd saves nothing of it
    w = torch.randn(4, 4, generator=g).requires_grad_(True)
    ctx = torch_sac.sac_context([aten.mm.default])
    with ctx:
        s = x.sin()  # dropped, needs x to replay
        h = torch.mm(s, w)  # saved (autograd saves s: a reference)
        y = h.exp()  # dropped, needs h to replay
        out = y.cos()  # saves y: a reference
    refs = {"x": storage_ref(x), "mm output": storage_ref(h), "sin output": storage_ref(s)}
    del x, s, h, y
    gc.collect()
    return w, out, ctx, refs


_HELD_AFTER_GRAPH_FREED = (
    "engine: a kept sac_context object (as in the docstring's "
    "`region.stats()` after backward) keeps its _C.Region alive, and with it "
    "every tensor in the tape (ArgSlot.held: inputs from outside and SAVE "
    "outputs used by dropped ops, plus the BatchNorm running-stat copies) "
    "after the autograd graph was freed"
)


def test_region_holds_what_replay_needs_while_graph_lives():
    w, out, ctx, refs = held_by_region()
    assert refs["sin output"].expired(), "the dropped sin output is still alive"
    assert not refs["x"].expired() and not refs["mm output"].expired()
    out.sum().backward(retain_graph=True)  # replays sin and exp
    assert ctx.stats()["replayed_ops"] >= 2
    assert not refs["x"].expired() and not refs["mm output"].expired()


def test_region_state_freed_with_the_graph():
    w, out, ctx, refs = held_by_region()
    del out, ctx
    gc.collect()
    dead = {k: r.expired() for k, r in refs.items()}
    assert all(dead.values()), f"still alive after the graph and the context were freed: {dead}"


def test_region_state_freed_after_backward():
    """After a backward that frees the graph, the tensors the region held
    for replay are freed, and the stats stay readable."""
    w, out, ctx, refs = held_by_region()
    out.sum().backward()
    del out
    gc.collect()
    assert ctx.stats()["replayed_ops"] >= 2
    dead = {k: r.expired() for k, r in refs.items()}
    assert all(dead.values()), f"still alive after backward freed the graph: {dead}"


def test_region_state_freed_with_the_graph_while_context_is_kept():
    w, out, ctx, refs = held_by_region()
    del out
    gc.collect()
    dead = {k: r.expired() for k, r in refs.items()}
    assert ctx.stats()["policy_calls"] == 4
    assert all(dead.values()), f"still alive after the graph was freed: {dead}"


def _train_steps(n, policy_name, model="mlp"):
    module, make_input = REGION_MODEL_BUILDERS[model]()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    for _ in range(n):
        x = make_input()
        with torch_sac.sac_context(policy_of(policy_name)):
            out = module(x)
        loss_of(out).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls", "callable"])
def test_no_python_object_growth_over_many_steps(policy_name):
    _train_steps(20, policy_name)  # warm up caches (op handles, policy tables)
    gc.collect()
    before = len(gc.get_objects())
    _train_steps(300, policy_name)
    gc.collect()
    after = len(gc.get_objects())
    # The module and optimizer of the last run are gone again; allow a few
    # objects of slack for interpreter caches, never per-step growth.
    assert after - before < 100, f"{after - before} more gc-tracked objects after 300 steps"


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,policy_name", [("convbn", "save_matmuls"), ("lstm_loop", "recompute_all")]
)
def test_no_tensor_memory_growth_over_many_steps(model, policy_name):
    memory = pytest.importorskip("torch_sac.memory")
    if not hasattr(memory, "install_counting_allocator") or not hasattr(memory, "cpu_memory_stats"):
        pytest.skip("torch_sac.memory has no counting allocator API")
    memory.install_counting_allocator()
    module, make_input = REGION_MODEL_BUILDERS[model]()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def steps(n):
        for _ in range(n):
            x = make_input()
            with torch_sac.sac_context(policy_of(policy_name)):
                out = module(x)
            loss_of(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(5)
    gc.collect()
    before = memory.cpu_memory_stats()["allocated"]
    steps(100)
    gc.collect()
    after = memory.cpu_memory_stats()["allocated"]
    assert after <= before, f"{after - before} more bytes live after 100 steps"


# ==========================================================================
# 12. Built-in policies that look beyond the op: names and call indices
# ==========================================================================


def test_save_by_name_in_region():
    """Ops inside a named scope are kept, the rest replayed; gradients exact."""

    def block(x, w):
        with torch_sac.name("proj"):
            h = torch.mm(x, w).relu()
        return torch.mm(h.sin(), w).sum()

    def grads(policy):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 8, generator=g, requires_grad=True)
        w = torch.randn(8, 8, generator=g, requires_grad=True)
        if policy is None:
            out = block(x, w)
            ctx = None
        else:
            with torch_sac.sac_context(policy) as ctx:
                out = block(x, w)
        out.backward()
        return x.grad, w.grad, ctx

    ref = grads(None)
    gx, gw, ctx = grads(torch_sac.policies.save_by_name("proj"))
    assert_tensors_equal(gx, ref[0], "x.grad")
    assert_tensors_equal(gw, ref[1], "w.grad")
    rows = {op: (saved, dropped) for op, saved, dropped, _ in ctx.op_summary()}
    assert rows["aten::mm.default"] == (1, 1)  # the mm in the scope saved, the other dropped
    assert rows["aten::relu.default"] == (1, 0)
    assert rows["aten::sin.default"] == (0, 1)


def test_every_nth_counts_calls_in_the_region():
    policy = torch_sac.policies.every_nth([aten.mm], 2)
    x = torch.randn(4, 4, requires_grad=True)
    with torch_sac.sac_context(policy) as ctx:
        h = x
        for _ in range(5):
            h = torch.mm(h, x).tanh()
    h.sum().backward()
    rows = {op: (saved, dropped) for op, saved, dropped, _ in ctx.op_summary()}
    assert rows["aten::mm.default"] == (3, 2)  # calls 0, 2, 4


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
def test_step_peak_at_most_torch_checkpointing(policy_name):
    """A rebuild replays only what the dropped tensor needs, in tape order,
    freeing each intermediate after its last use: the backward peak is at
    most that of PyTorch re-running the block (checkpoint / SAC contexts),
    not the sum of every intermediate of the replayed chain. (The peak of the
    whole step, as the two keep different tensors at the start of backward.)"""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from torch_sac.models import Block

    memory = torch_sac.memory
    memory.install_counting_allocator()
    torch.manual_seed(0)
    block = Block(dim=64, heads=4, dropout=0.1)
    x = torch.randn(2, 64, 64, requires_grad=True)
    matmuls = [aten.mm.default, aten.addmm.default, aten.bmm.default]

    def torch_run():
        if policy_name == "recompute_all":
            return checkpoint(block, x, use_reentrant=False)
        ctx = functools.partial(create_selective_checkpoint_contexts, matmuls)
        return checkpoint(block, x, use_reentrant=False, context_fn=ctx)

    def region_run():
        with torch_sac.sac_context(policy_of(policy_name)):
            return block(x)

    def step_peak(run):
        torch.manual_seed(1)
        with memory.track() as step:
            loss = run().pow(2).mean()
            loss.backward()
            del loss
        block.zero_grad(set_to_none=True)
        x.grad = None
        return step.peak

    torch_peak, region_peak = step_peak(torch_run), step_peak(region_run)
    assert region_peak <= torch_peak, f"region {region_peak} B > torch {torch_peak} B"


def test_replayed_op_writing_a_saved_output_updates_it_once():
    """BatchNorm whose running stats were made (and kept) inside the region:
    replaying it for its dropped output works on a copy of the stats, so
    they are updated exactly once and the saved tensors stay unchanged."""

    def f(x, w):
        scale = w.sum().detach()
        running_mean = torch.zeros(4) * scale  # kept by the policy
        running_var = torch.ones(4) + 0 * scale  # kept by the policy
        y = F.batch_norm(x, running_mean, running_var, w, None, training=True)
        return y.sin().sum(), running_mean, running_var

    def policy(ctx, op, *args, **kwargs):
        keep = op in (aten.mul.Tensor, aten.add.Tensor)
        return torch_sac.Policy.MUST_SAVE if keep else torch_sac.Policy.PREFER_RECOMPUTE

    def run(region):
        torch.manual_seed(0)
        x = torch.randn(8, 4, requires_grad=True)
        w = torch.rand(4, requires_grad=True)
        if region:
            with torch_sac.sac_context(policy) as ctx:
                loss, mean, var = f(x, w)
        else:
            ctx = None
            loss, mean, var = f(x, w)
        loss.backward()
        return x.grad, w.grad, mean, var, ctx

    ref, ours = run(False), run(True)
    for a, b, what in zip(ref[:4], ours[:4], ("x.grad", "w.grad", "running_mean", "running_var")):
        assert_tensors_equal(b, a, what)
    assert ours[4].stats()["replayed_ops"] >= 1


# ==========================================================================
# 13. Found in review: each test would have caught the bug it names
# ==========================================================================


def test_unrecorded_write_right_after_a_recorded_write_is_seen():
    """A no_grad write right after a recorded in-place op (whose own version
    bump the region cannot see yet) must still mark the tensor as changed
    outside the tape; replaying without it gave a wrong gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g)
    w = torch.randn(4, 4, generator=g, requires_grad=True)

    def f():
        y = x @ w
        y.add_(1)  # recorded; saves nothing
        with torch.no_grad():
            y.mul_(2)  # not recorded
        return y.sin().sum()

    (ref,) = torch.autograd.grad(f(), w)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        loss = f()
    (ours,) = torch.autograd.grad(loss, w)
    assert_tensors_equal(ours, ref, "w.grad")


def test_random_ops_on_meta_tensors_record_nothing_random():
    lin = nn.Linear(4, 4, device="meta")
    x = torch.randn(2, 4, device="meta")
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        y = F.dropout(lin(x), 0.5, True)
    assert y.shape == (2, 4) and y.is_meta


def test_replay_that_makes_a_smaller_tensor_raises_instead_of_reading_past_it():
    """nonzero replayed after its (kept, then modified, mutation allowed)
    input changed makes fewer indices than forward did."""
    x = torch.randn(1000, requires_grad=True)

    def policy(ctx, op, *args, **kwargs):
        keep = op is aten.relu.default
        return torch_sac.Policy.MUST_SAVE if keep else torch_sac.Policy.PREFER_RECOMPUTE

    with torch_sac.sac_context(policy, allow_cache_entry_mutation=True):
        r = x.relu()
        idx = r.nonzero().squeeze(1)
        loss = (r[idx] ** 2).sum()
    with torch.no_grad():
        r.zero_()
    del idx
    with pytest.raises(RuntimeError, match="replay is not deterministic here"):
        torch.autograd.grad(loss, x)


def _square(reads):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, grad):
            # Each read unpacks again, in the same backward.
            reads_of_a = [ctx.saved_tensors[0] for _ in range(reads)]
            return grad * sum(reads_of_a) * (2 / reads)

    return Square


def test_reading_saved_tensors_twice_replays_no_more_than_once():
    def replays(reads):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 16, generator=g, requires_grad=True)
        w = torch.randn(16, 16, generator=g, requires_grad=True)
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
            h = x @ w
            loss = (_square(reads).apply(h) @ w).relu().sum()
        del h
        loss.backward()
        return ctx.stats()["replayed_ops"], x.grad

    once, grad_once = replays(1)
    twice, grad_twice = replays(2)
    assert once > 0 and twice == once
    assert_tensors_equal(grad_twice, grad_once, "x.grad")


class _ZeroesItsSavedTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * 3

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved_tensors
        a.mul_(0)  # writes to the rebuilt tensor it was handed
        return grad * 3


def test_backward_writing_to_an_unpacked_tensor_does_not_corrupt_other_nodes():
    """Plain autograd raises here; the region must at least never hand the
    overwritten copy to another node (it rebuilds a fresh one)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=g)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    a = x @ w
    (ref,) = torch.autograd.grad((a.sin() + a * 3).sum(), w)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        a = x @ w
        loss = (a.sin() + _ZeroesItsSavedTensor.apply(a)).sum()
    del a
    (ours,) = torch.autograd.grad(loss, w)
    assert_tensors_equal(ours, ref, "w.grad")


def test_in_place_write_to_an_outside_tensor_is_not_copied_when_it_cannot_replay():
    memory = torch_sac.memory
    memory.install_counting_allocator()
    x = torch.randn(4096, requires_grad=True) * 1  # from outside, not a leaf

    def peak(region):
        with memory.track() as m, region:
            for _ in range(10):
                x.add_(1)
        return m.peak

    plain = peak(contextlib.nullcontext())  # the wrapped `1`s
    ctx = torch_sac.sac_context(torch_sac.policies.recompute_all())
    # No copy of x (16 KiB); the Python-key adapter re-wraps each `1` (8 bytes).
    assert peak(ctx) <= plain + 8 * 10
    assert ctx.stats()["held_bytes"] == 0


@torch.library.custom_op("torch_sac_test::scaled_sin", mutates_args=())
def _scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale  # a Python kernel: replay runs Python


@_scaled_sin.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x) * ctx.scale, None


def _scaled_sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


_scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_setup)


@pytest.mark.parametrize("backward_thread", [False, True])
def test_custom_op_with_a_python_kernel_replays(backward_thread):
    """Replay of a dropped custom op runs its Python kernel with the region's
    lock held and the GIL taken: nothing may wait on the lock with the GIL."""
    x = torch.randn(64, requires_grad=True)

    def f():
        h = x.exp()
        return _scaled_sin(h, 0.5).tanh().sum()

    (ref,) = torch.autograd.grad(f(), x)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        loss = f()
    result = {}
    if backward_thread:
        t = threading.Thread(
            target=lambda: result.update(g=torch.autograd.grad(loss, x)[0]), daemon=True
        )
        t.start()
        t.join(timeout=HANG_LIMIT_S)
        assert not t.is_alive(), "backward hung"
        ours = result["g"]
    else:
        (ours,) = torch.autograd.grad(loss, x)
    assert_tensors_equal(ours, ref, "x.grad")
    assert ctx.stats()["replayed_ops"] > 0


def test_saved_tensor_hooks_refuse_what_they_did_not_make():
    """The pack and unpack hooks are plain C callables: wrong arguments raise
    TypeError naming what was expected, and nothing crashes."""
    region = torch_sac._C.Region(torch_sac.policies.recompute_all(), False)
    pack = region.pack_hook()
    with pytest.raises(TypeError, match="pack hook takes a tensor, got list"):
        pack([1, 2])
    with pytest.raises(TypeError, match="unpack_saved takes what a region's pack hook returned"):
        torch_sac._C.unpack_saved(torch.ones(2))
    x = torch.randn(3)
    saved = pack(x)
    assert isinstance(saved, torch_sac._C.SavedActivation)
    assert torch_sac._C.unpack_saved(saved) is not None
    assert torch.equal(torch_sac._C.unpack_saved(saved), x)  # kept: it was not made in the region


def test_pack_hook_keeps_its_region_alive():
    """The pack hook owns its region: a region dropped by Python while autograd
    still holds the hook (and what it packed) keeps working, and freeing the
    saved activations after the region object is gone tells nobody dead."""
    x = torch.randn(16, requires_grad=True)
    (ref,) = torch.autograd.grad(x.sin().exp().sum(), x)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        loss = x.sin().exp().sum()
    del ctx
    gc.collect()
    (ours,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert_tensors_equal(ours, ref, "x.grad")
    del loss  # frees every SavedActivation: each one forgets itself in its region
    gc.collect()


def test_saved_activation_types_cannot_be_made_from_python():
    """Only a pack hook makes them: an instance made from Python would hold
    nothing constructed (it crashed the interpreter when freed)."""
    with pytest.raises(TypeError):
        torch_sac._C.SavedActivation()
    region = torch_sac._C.Region(torch_sac.policies.recompute_all(), False)
    with pytest.raises(TypeError):
        type(region.pack_hook().__self__)()


_drop_during_replay = {"armed": False, "graphs": []}


@torch.library.custom_op("torch_sac_test::sin_dropping_graphs", mutates_args=())
def _sin_dropping_graphs(x: torch.Tensor) -> torch.Tensor:
    if _drop_during_replay["armed"]:
        _drop_during_replay["graphs"].clear()  # frees another graph of the same region
        gc.collect()
    return x.sin()


@_sin_dropping_graphs.register_fake
def _(x):
    return torch.empty_like(x)


_sin_dropping_graphs.register_autograd(
    lambda ctx, grad: grad * ctx.saved_tensors[0].cos(),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


def test_activations_freed_by_a_replayed_kernel_do_not_hang():
    """A replay holds the region's lock while it runs a Python kernel; a
    saved activation of the same region freed by that kernel (it drops a
    graph, or a garbage collection runs) is forgotten after the replay
    instead of waiting for the lock its own thread holds. Backward runs on
    a thread so that a hang fails the test instead of stopping the suite."""
    x = torch.randn(4, 4, requires_grad=True)
    (ref,) = torch.autograd.grad(_sin_dropping_graphs(x @ x).exp().sum(), x)
    _drop_during_replay["armed"] = False
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as ctx:
        loss = _sin_dropping_graphs(x @ x).exp().sum()
        _drop_during_replay["graphs"].append((x * 3).sin().exp().sum())
    _drop_during_replay["armed"] = True
    result = {}

    def backward():
        result["grad"] = torch.autograd.grad(loss, x)[0]

    try:
        t = threading.Thread(target=backward, daemon=True)
        t.start()
        t.join(timeout=HANG_LIMIT_S)
        assert not t.is_alive(), "backward hung"
    finally:
        _drop_during_replay["armed"] = False
    assert _drop_during_replay["graphs"] == []
    assert_tensors_equal(result["grad"], ref, "x.grad")
    assert ctx.stats()["replayed_ops"] > 0


# --------------------------------------------------------------------------
# Ops the region cannot replay: kept anyway, itemised, said once
# --------------------------------------------------------------------------

FOREACH = "aten::_foreach_mul_.Scalar"


def _writes_a_list(x):
    a, b = x * 2, x * 3
    torch._foreach_mul_([a, b], 2.0)  # a list write: not replayed
    return (a.sin() + b.cos() + (x * 4).tanh()).sum()


def test_what_ops_the_region_cannot_replay_made_is_kept_itemised_and_said_once():
    """The policy recomputes everything, but a, b were written by an op the
    region does not replay (a list write): sin and cos keep them. Exact;
    op_details names the op, the tensors and bytes kept and why; one
    warning for the region says so and what to do."""
    x = torch.randn(64, 64)
    ref = x.clone().requires_grad_()
    _writes_a_list(ref).backward()
    got = x.clone().requires_grad_()
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
            out = _writes_a_list(got)
    out.backward()
    assert torch.equal(got.grad, ref.grad)
    said = [str(w.message) for w in said if "cannot replay" in str(w.message)]
    assert len(said) == 1, said
    assert FOREACH in said[0] and "it writes a list of tensors" in said[0], said[0]
    assert "out-of-place ops" in said[0], said[0]
    rows = {r["op"]: r for r in region.op_details()}
    assert rows[FOREACH]["kept_anyway"] == 2  # a for sin, b for cos
    assert rows[FOREACH]["kept_anyway_bytes"] == 2 * x.nbytes
    assert rows[FOREACH]["kept_why"] == "it writes a list of tensors"
    others = [r for op, r in rows.items() if op != FOREACH]
    assert all(r["kept_anyway"] == 0 and r["kept_why"] == "" for r in others), others


def test_an_op_the_policy_keeps_is_not_kept_anyway(recwarn):
    """Nothing to say when the policy keeps what the op made: it is not
    kept against the policy's word."""
    x = torch.randn(64, 64, requires_grad=True)
    keep = torch_sac.policies.save_ops(
        [torch.ops.aten._foreach_mul_.Scalar, torch.ops.aten.mul.Tensor]
    )
    with torch_sac.sac_context(keep) as region:
        out = _writes_a_list(x)
    out.backward()
    assert all(r["kept_anyway"] == 0 for r in region.op_details())
    assert not [w for w in recwarn if "cannot replay" in str(w.message)]
