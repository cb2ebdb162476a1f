"""Exact, or a clear error: one regression test per case that once gave a
silently wrong gradient, a crash or a hang.

Every engine (region, ``torch_sac.checkpoint``, the drop-in contexts) is run
against the same code without checkpointing: gradients bitwise equal on CPU,
or an error that names the op.
"""

import functools
import random

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.utils.flop_counter import FlopCounterMode

import torch_sac
from torch_sac import _compat
from conftest import assert_tensors_equal
from models import SizesDispatchingTensor

aten = torch.ops.aten
ENGINES = ["region", "contexts"]


def run(fn, inputs, engine=None, policy=None):
    """fn(*inputs) under ``engine`` (None: no checkpointing), backward of
    the sum of its output; returns (output, grads of the inputs)."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    torch.manual_seed(0)
    if engine is None:
        out = fn(*inputs)
    elif engine == "region":
        out = torch_sac.checkpoint(fn, *inputs, policy=policy)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        out = tc.checkpoint(fn, *inputs, use_reentrant=False, context_fn=ctx_fn)
    out.sum().backward()
    return out.detach(), [t.grad for t in inputs]


def assert_exact(fn, inputs, engine, policy, label=""):
    ref = run(fn, inputs)
    got = run(fn, inputs, engine, policy)
    assert_tensors_equal(got[0], ref[0], f"{label} output")
    for i, (g, r) in enumerate(zip(got[1], ref[1])):
        if r is None:
            assert g is None, f"{label} grad {i}"
        else:
            assert_tensors_equal(g, r, f"{label} grad {i}")


def nothing_installed():
    if torch_sac.adapter() == "key":
        assert torch_sac._C.key_handler_depth() == 0
    assert torch._C._len_torch_dispatch_stack() == 0


# --------------------------------------------------------------------------
# 1-2. Writes through an alias with its own version counter; SDPA's bias
# --------------------------------------------------------------------------


def scores_plus_mask(q, k, mask):
    s = torch.matmul(q, k.transpose(-1, -2))  # 4-D: bmm, then _unsafe_view
    s += mask  # writes bmm's storage through the alias
    return s.softmax(-1)


def qkm():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    return [q, k, mask]


@pytest.mark.parametrize("engine", ENGINES)
def test_write_through_unsafe_view_to_saved_bmm_is_exact(engine):
    assert_exact(scores_plus_mask, qkm(), engine, [aten.bmm.default], "unsafe_view write")


def test_write_after_forward_through_unsafe_view_raises():
    """A cached bmm output written after forward through the `_unsafe_view`
    alias forward returned (a version counter of its own) is seen."""

    def fn(q, k):
        s = torch.matmul(q, k.transpose(-1, -2))
        return s.exp(), s

    q, k, _ = qkm()
    ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, [aten.bmm.default])
    out, s = tc.checkpoint(fn, q, k, use_reentrant=False, context_fn=ctx_fn)
    with torch.no_grad():
        s.add_(1.0)
    with pytest.raises(RuntimeError, match=r"aten::bmm.*mutated in place"):
        out.sum().backward()
    nothing_installed()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["save_matmuls", "recompute_all"])
def test_sdpa_with_learned_bias_is_exact(engine, policy):
    """T5/ALiBi-style: a bias that requires grad makes SDPA's CPU math path
    add it in place into the bmm output."""

    def fn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    g = torch.Generator().manual_seed(2)
    qkv = [torch.randn(2, 2, 6, 8, generator=g, requires_grad=True) for _ in range(3)]
    bias = torch.randn(1, 2, 6, 6, generator=g, requires_grad=True)
    assert_exact(fn, qkv + [bias], engine, getattr(torch_sac.policies, policy)(), "sdpa bias")


# --------------------------------------------------------------------------
# 3. Process-wide state that changes an op's result
# --------------------------------------------------------------------------


def ones_times(x):
    return (x * torch.ones(x.shape)).sin()


@pytest.mark.parametrize("engine", ENGINES)
def test_factory_ops_rebuilt_in_the_forward_default_dtype(engine):
    """torch.ones without dtype= in forward; the default dtype changes before
    backward. The region replays under forward's default, the drop-in runs
    its recompute under it: exact, and the user's setting is back after."""
    x = torch.randn(8, requires_grad=True)
    ref = run(ones_times, [x])
    inputs = [x.detach().clone().requires_grad_()]
    policy = torch_sac.policies.recompute_all()
    if engine == "region":
        out = torch_sac.checkpoint(ones_times, *inputs, policy=policy)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        out = tc.checkpoint(ones_times, *inputs, use_reentrant=False, context_fn=ctx_fn)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out.sum().backward()
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert_tensors_equal(inputs[0].grad, ref[1][0], "grad after a default-dtype change")
    nothing_installed()


determinism_seen = []


@torch.library.custom_op("torch_sac_test::det_probe", mutates_args=())
def det_probe(x: torch.Tensor) -> torch.Tensor:
    determinism_seen.append(torch.are_deterministic_algorithms_enabled())
    return x * 2


det_probe.register_autograd(lambda ctx, g: g * 2)


@pytest.mark.parametrize("engine", ENGINES)
def test_replay_runs_under_the_forward_deterministic_setting(engine):
    """The replay (region) or recompute (drop-in) sees the deterministic-
    algorithms switch forward saw, not the one set before backward."""
    determinism_seen.clear()
    x = torch.randn(4, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    policy = torch_sac.policies.recompute_all()
    fn = lambda t: det_probe(t).sin()  # noqa: E731
    if engine == "region":
        out = torch_sac.checkpoint(fn, x, policy=policy)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    torch.use_deterministic_algorithms(not was)
    try:
        out.sum().backward()
        assert torch.are_deterministic_algorithms_enabled() == (not was), "not restored"
    finally:
        torch.use_deterministic_algorithms(was)
    assert determinism_seen == [was, was], determinism_seen


# --------------------------------------------------------------------------
# 4. Ops under no_grad inside a checkpointed region
# --------------------------------------------------------------------------


class ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x * 3.0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * 3.0 * (1 - y * y)


def custom_fn_block(x, w):
    return ScaledTanh.apply(x @ w).sum(-1)


@pytest.mark.parametrize("engine", ENGINES)
def test_custom_function_body_reaches_the_policy(engine):
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return torch_sac.Policy.PREFER_RECOMPUTE

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    assert_exact(custom_fn_block, [x, w], engine, policy, "custom Function")
    assert aten.tanh.default in seen and aten.mul.Tensor in seen, seen


def test_region_drops_tensors_a_custom_function_saves():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
        out = custom_fn_block(x, w)
    out.sum().backward()
    stats = region.stats()
    assert stats["packed_dropped"] >= 1, stats  # tanh's output, saved by ctx
    assert stats["replayed_ops"] >= 1, stats


calls_of_expensive = []


@torch.library.custom_op("torch_sac_test::expensive", mutates_args=())
def expensive(x: torch.Tensor) -> torch.Tensor:
    calls_of_expensive.append(1)
    return x.sin() * 2


expensive.register_autograd(
    lambda ctx, g: g * 2 * ctx.x.cos(),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


@pytest.mark.parametrize("engine", ["torch"] + ENGINES)
def test_saved_custom_op_runs_once(engine):
    """A custom op with its own autograd formula runs below autograd with
    grad off; a SAVE decision for it keeps it from running again."""

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.torch_sac_test.expensive.default:
            return torch_sac.Policy.MUST_SAVE
        return torch_sac.Policy.PREFER_RECOMPUTE

    def fn(x):
        return expensive(x.exp()).cos()

    x = torch.randn(6, requires_grad=True)
    calls_of_expensive.clear()
    if engine == "torch":
        torch_policy = lambda ctx, op, *a, **k: (  # noqa: E731
            tc.CheckpointPolicy.MUST_SAVE
            if op is torch.ops.torch_sac_test.expensive.default
            else tc.CheckpointPolicy.PREFER_RECOMPUTE
        )
        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, torch_policy)
        tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    else:
        run(fn, [x], engine, policy)
    assert len(calls_of_expensive) == 1


# --------------------------------------------------------------------------
# 5. Dispatch modes entered outside the checkpoint
# --------------------------------------------------------------------------


def two_matmuls(x, w):
    return (x @ w).relu() @ w


@pytest.mark.parametrize("which", ["torch", "torch_sac"])
def test_flop_counter_outside_sees_what_it_sees_under_torch(which):
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    make = (
        tc.create_selective_checkpoint_contexts
        if which == "torch"
        else torch_sac.create_selective_checkpoint_contexts
    )
    ctx_fn = functools.partial(make, [aten.mm.default])
    with FlopCounterMode(display=False) as counter:
        tc.checkpoint(two_matmuls, x, w, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    # Forward: 2 mm; backward: 4 mm; recompute: none (both mm cached).
    assert counter.get_total_flops() == 6 * 2 * 8 * 8 * 8
    nothing_installed()


def test_policy_sees_outputs_tagged_by_an_outer_mode():
    """A mode entered outside tags outputs; the policy reads the tag through
    ctx.op_output, as under PyTorch's SAC (innermost mode). PyTorch <= 2.11
    asks its policy before the op runs, without ctx.op_output, and again in
    recompute; torch_sac hands the output on every release, so there the
    control checks the same ops were asked about, in forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tagging(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                out.tagged_by_mode = True
            return out

    seen = {"torch": [], "torch_sac": []}

    def make_policy(which):
        def policy(ctx, op, *args, **kwargs):
            if not ctx.is_recompute:
                out = getattr(ctx, "op_output", None)
                seen[which].append((op, getattr(out, "tagged_by_mode", False)))
            return tc.CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    for which, make in (
        ("torch", tc.create_selective_checkpoint_contexts),
        ("torch_sac", torch_sac.create_selective_checkpoint_contexts),
    ):
        ctx_fn = functools.partial(make, make_policy(which))
        with Tagging():
            tc.checkpoint(
                two_matmuls, x, w, use_reentrant=False, context_fn=ctx_fn
            ).sum().backward()
    assert seen["torch_sac"] and all(tagged for _, tagged in seen["torch_sac"]), seen
    if _compat.sac_policy_sees_output():
        assert seen["torch_sac"] == seen["torch"], seen
    else:
        assert [op for op, _ in seen["torch_sac"]] == [op for op, _ in seen["torch"]], seen


# --------------------------------------------------------------------------
# 6. Kinds of tensors: exact, or NotImplementedError naming the op
# --------------------------------------------------------------------------


def _quantized(x):
    q = torch.quantize_per_tensor(x.detach() * 2, 0.1, 0, torch.qint8)
    return (q.dequantize() * x).sin()


def _nested(x):
    nt = torch.nested.nested_tensor([x[:2], x[2:]])
    return torch.cat([t.flatten() for t in nt.relu().unbind()]) * x.sum()


def _sparse_coo(x):
    return (x.to_sparse() * 2).to_dense().sin()


def _sparse_csr(x):
    return (x.detach().to_sparse_csr().to_dense() * x).cos()


def _complex(x):
    c = torch.complex(x, x * 2)
    return (c * c.conj()).real.sin()


def _int_and_bool(x):
    idx = x.argmax(-1, keepdim=True)
    mask = x > 0
    return x.gather(-1, idx).sin().sum() + (x * mask).exp().sum()


def _view_of_non_leaf(x):
    base = x * 2
    v = base[1:]
    v.mul_(2)  # in place on a view of a non-leaf base
    return base.sin()


KINDS = {
    "quantized": _quantized,
    "nested": _nested,
    "sparse_coo": _sparse_coo,
    "sparse_csr": _sparse_csr,
    "complex": _complex,
    "int_bool": _int_and_bool,
    "view_of_non_leaf": _view_of_non_leaf,
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["recompute_all", "save_all"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tensor_kinds_are_exact(kind, policy, engine):
    x = torch.randn(4, 3, requires_grad=True)
    assert_exact(KINDS[kind], [x], engine, getattr(torch_sac.policies, policy)(), kind)
    nothing_installed()


@pytest.mark.parametrize("engine", ENGINES)
def test_meta_tensors_run(engine):
    x = torch.randn(4, 3, device="meta", requires_grad=True)
    policy = torch_sac.policies.recompute_all()
    if engine == "region":
        out = torch_sac.checkpoint(lambda t: t.sin().exp(), x, policy=policy)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        out = tc.checkpoint(lambda t: t.sin().exp(), x, use_reentrant=False, context_fn=ctx_fn)
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad.device.type == "meta"
    nothing_installed()


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_subclass_in_a_region_is_exact(engine):
    """It once deadlocked: detaching the subclass re-entered the region."""

    def fn(t):
        return (t * t.sum()).view(-1).exp()

    x = torch.randn(4, 3)
    ref_in = x.clone().requires_grad_()
    fn(ref_in).sum().backward()
    w = SizesDispatchingTensor(x.clone()).requires_grad_()
    policy = torch_sac.policies.recompute_all()
    if engine == "region":
        out = torch_sac.checkpoint(fn, w, policy=policy)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        out = tc.checkpoint(fn, w, use_reentrant=False, context_fn=ctx_fn)
    out.sum().backward()
    assert_tensors_equal(w.grad.inner, ref_in.grad, "subclass grad")
    nothing_installed()


def test_replay_refuses_a_freed_outside_tensor():
    """FSDP2 frees unsharded parameters after forward (storage resized to 0):
    a replay that reads one raises naming the op, never reads freed memory."""
    x = torch.randn(16, requires_grad=True)
    gamma = torch.randn(16, requires_grad=True)
    out = torch_sac.checkpoint(
        lambda t: (t * gamma).sin(), x, policy=torch_sac.policies.recompute_all()
    )
    gamma.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"aten::mul.*freed or resized"):
        out.sum().backward()
    nothing_installed()


# --------------------------------------------------------------------------
# 8. The drop-in's recompute must run what forward ran
# --------------------------------------------------------------------------


def test_dropin_recompute_taking_another_path_raises():
    """Forward runs sin, recompute (another draw from Python's RNG) cos: the
    tensor exp saved would be rebuilt from other values."""

    def fn(x):
        h = x.sin() if chooser.random() < 0.5 else x.cos()
        return h.exp()

    chooser = random.Random(3)
    draws = [chooser.random() for _ in range(2)]
    assert (draws[0] < 0.5) != (draws[1] < 0.5)
    chooser = random.Random(3)
    x = torch.randn(8, requires_grad=True)
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.recompute_all()
    )
    out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    with pytest.raises(RuntimeError, match=r"recompute does not match forward: aten::cos") as err:
        out.sum().backward()
    assert "took another path than forward" in str(err.value)
    assert "region engine needs no re-run" in str(err.value)
    nothing_installed()


def test_dropin_recompute_with_other_shapes_names_the_cause():
    """Recompute computes on other shapes (state read by the function changed
    between forward and backward): the error says so, not "a cache"."""
    sizes = iter([4, 2])

    def fn(x):
        return x[: next(sizes)].exp()

    x = torch.randn(6, requires_grad=True)
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.recompute_all()
    )
    out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    with pytest.raises(RuntimeError, match="shapes or dtypes differ from forward's") as err:
        out.sum().backward()
    assert "grew" not in str(err.value)
    nothing_installed()


def test_dropin_recompute_after_a_cache_grew_names_the_cache():
    """A function that appends to a Python-level cache: recompute, which
    re-runs it, appends again and attends over twice the entries."""
    cache = {"kv": torch.empty(0)}

    def fn(x):
        cache["kv"] = torch.cat([cache["kv"], x.sin()])
        return cache["kv"].exp()

    x = torch.randn(3, requires_grad=True)
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.recompute_all()
    )
    out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    with pytest.raises(RuntimeError, match="grew along dim 0 from 3 to 6") as err:
        out.sum().backward()
    assert "use_cache=False" in str(err.value)
    nothing_installed()


def test_dropin_optimizer_step_inside_the_function_raises():
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.SGD([w], lr=0.1)

    def fn(x):
        y = (x @ w).sin()
        loss = y.pow(2).sum()
        w.grad = None
        loss.backward(retain_graph=True)  # an auxiliary loss...
        opt.step()  # ...and a step, inside the checkpoint
        return y

    x = torch.randn(4, 8, requires_grad=True)
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.recompute_all()
    )
    out = tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    with pytest.raises(RuntimeError, match="torch_sac"):
        out.sum().backward()
    nothing_installed()


# --------------------------------------------------------------------------
# 3 (cont.). functorch transforms inside a region
# --------------------------------------------------------------------------


def _vmapped(x, w):
    y = torch.func.vmap(lambda t: (t @ w).sin().exp())(x)
    g = torch.func.vmap(torch.func.vmap(lambda t: t * t))(x).cos()
    return y * g


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["recompute_all", "save_all"])
def test_vmap_inside_a_checkpoint_is_exact(engine, policy):
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    assert_exact(_vmapped, [x, w], engine, getattr(torch_sac.policies, policy)(), "vmap")
    nothing_installed()


def test_func_grad_inside_a_region_is_refused_by_pytorch():
    """torch.func.grad does not support saved-tensor hooks (PyTorch's own
    checkpoint and save_on_cpu meet the same error): a clear error, and
    nothing left installed."""
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        torch_sac.checkpoint(
            lambda t: torch.func.grad(lambda u: u.sin().sum())(t),
            x,
            policy=torch_sac.policies.recompute_all(),
        )
    nothing_installed()


# --------------------------------------------------------------------------
# Found by the fuzzer (tests/python/test_fuzz.py)
# --------------------------------------------------------------------------


def _random_then_dropout(x):
    noise = torch.rand_like(x)  # saved by save_all: must not be cached
    return F.dropout(x * noise, 0.25, training=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_random_ops_are_recomputed_so_later_masks_match(engine):
    """Recompute restores forward's RNG state; a random op served from the
    cache would not draw, and the dropout after it would draw another mask."""
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    assert_exact(_random_then_dropout, [x], engine, torch_sac.policies.save_all(), "rand+dropout")


def _read_then_write_outside(a, x):
    b = a + x  # dropped: its replay reads `a`...
    a.add_(1.0)  # ...which a recorded in-place op then overwrites
    return torch.sin(b)


def test_region_replays_a_read_of_an_outside_tensor_written_later_in_the_region():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(4, 4, dtype=torch.float64)
    ref_a, our_a = a.clone(), a.clone()
    xr = x.detach().clone().requires_grad_()
    _read_then_write_outside(ref_a, xr).sum().backward()
    xo = x.detach().clone().requires_grad_()
    out = torch_sac.checkpoint(
        _read_then_write_outside, our_a, xo, policy=torch_sac.policies.recompute_all()
    )
    out.sum().backward()
    assert_tensors_equal(xo.grad, xr.grad, "x.grad")
    assert_tensors_equal(our_a, ref_a, "a written once")
    nothing_installed()


def _read_then_foreach_write_outside(a, x):
    b = a + x  # dropped: its replay reads `a`...
    torch._foreach_add_([a], 1.0)  # ...which a tensor-list write then overwrites
    return torch.sin(b)


def test_region_replays_a_read_of_an_outside_tensor_written_by_a_list_op():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(4, 4, dtype=torch.float64)
    ref_a, our_a = a.clone(), a.clone()
    xr = x.detach().clone().requires_grad_()
    _read_then_foreach_write_outside(ref_a, xr).sum().backward()
    xo = x.detach().clone().requires_grad_()
    out = torch_sac.checkpoint(
        _read_then_foreach_write_outside, our_a, xo, policy=torch_sac.policies.recompute_all()
    )
    out.sum().backward()
    assert_tensors_equal(xo.grad, xr.grad, "x.grad")
    assert_tensors_equal(our_a, ref_a, "a written once")
    nothing_installed()
