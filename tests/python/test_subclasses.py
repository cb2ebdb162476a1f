"""Regions checkpoint code on traceable wrapper subclasses (issue 39).

A traceable wrapper subclass (DTensor, torch's TwoTensor, or any subclass
with ``__tensor_flatten__``/``__tensor_unflatten__``) runs each op in its
``__torch_dispatch__`` on its inner, plain tensors. A region records those
inner ops (the subclass's own op is passed through: no entry, no policy
call), and autograd's saved subclass tensors are packed as their inner
tensors, each dropped or kept as any saved tensor, the wrapper rebuilt by
``__tensor_unflatten__`` when backward unpacks it. So a region drops and
replays what subclass code saves, under both adapters, with gradients
bitwise equal to the run without checkpointing.

Subclasses that do not flatten (no ``__tensor_flatten__``) keep running as
if outside the region: autograd keeps them whole.
"""

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map_only

import torch_sac
from helpers import run_isolated
from models import SizesDispatchingTensor

pytestmark = pytest.mark.usefixtures("one_thread")


class Tagged(torch.Tensor):
    """A traceable wrapper subclass of our own: one inner tensor and a
    non-tensor tag carried through every op (the shape of DTensor: a local
    tensor and its placement)."""

    @staticmethod
    def __new__(cls, inner, tag):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=inner.requires_grad,
        )

    def __init__(self, inner, tag):
        self.inner = inner
        self.tag = tag

    def __repr__(self):
        return f"Tagged({self.inner!r}, {self.tag!r})"

    def __tensor_flatten__(self):
        return ["inner"], self.tag

    @staticmethod
    def __tensor_unflatten__(inner_tensors, tag, outer_size, outer_stride):
        return Tagged(inner_tensors["inner"], tag)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        tags = [a.tag for a in args if isinstance(a, Tagged)]
        unwrapped = tree_map_only(Tagged, lambda t: t.inner, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        return tree_map_only(torch.Tensor, lambda t: Tagged(t, tags[0]), out)


def _tagged(t):
    return Tagged(t, "shard0")


def _two(t):
    return TwoTensor(t, t.clone())


WRAPS = {"tagged": _tagged, "two_tensor": _two}


def _inner(t):
    """The plain tensors behind ``t``, for comparing gradients."""
    if isinstance(t, Tagged):
        return [t.inner]
    if isinstance(t, TwoTensor):
        return [t.a, t.b]
    return [t]


def _mlp_step(wrap, engine, policy):
    """One forward+backward of a 3-layer MLP whose weights and input are
    wrapped; returns (loss, every gradient's inner tensors, region stats,
    activation bytes at the end of forward)."""
    torch.manual_seed(0)
    weights = [wrap(torch.randn(64, 64) / 8).requires_grad_() for _ in range(3)]
    x = wrap(torch.randn(32, 64))

    def fn(h):
        for w in weights:
            h = torch.nn.functional.gelu(h @ w).sin()
        return h

    region = None
    with torch_sac.memory.track() as m:
        if engine == "none":
            out = fn(x)
        elif engine == "region":
            with torch_sac.sac_context(policy) as region:
                out = fn(x)
        else:
            out = torch_sac.checkpoint(fn, x, policy=policy, use_reentrant=False)
        activations = m.delta
        loss = out.sum()
        loss.backward()
    grads = [g for w in weights for g in _inner(w.grad)]
    return loss, grads, (region.stats() if region is not None else None), activations


@pytest.mark.parametrize("kind", sorted(WRAPS))
@pytest.mark.parametrize("engine", ["region", "checkpoint"])
@pytest.mark.parametrize("policy_name", ["save_matmuls", "recompute_all"])
def test_subclass_code_is_checkpointed_and_exact(kind, engine, policy_name):
    torch_sac.memory.install_counting_allocator()
    policy = getattr(torch_sac.policies, policy_name)()
    want_loss, want, _, plain_activations = _mlp_step(WRAPS[kind], "none", policy)
    loss, got, stats, activations = _mlp_step(WRAPS[kind], engine, policy)
    assert all(torch.equal(a, b) for a, b in zip(_inner(loss), _inner(want_loss)))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    # Less is held after forward than without checkpointing: the inner
    # tensors of the saved subclass outputs were dropped.
    assert activations < plain_activations, (activations, plain_activations)
    if stats is not None:
        assert stats["packed_dropped"] > 0 and stats["replayed_ops"] > 0, stats
        assert stats["dropped_bytes"] > 0


def test_the_policy_sees_the_inner_ops_only():
    """The subclass's own op is passed through: the policy is called once
    per op the subclass runs on its inner tensors (two for TwoTensor), never
    with a subclass argument."""
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((str(op), [type(a) for a in args if isinstance(a, torch.Tensor)]))
        return False

    x = _two(torch.randn(4, 4)).requires_grad_()
    with torch_sac.sac_context(policy):
        loss = x.sin().cos().sum()
    loss.backward()
    assert [op for op, _ in seen] == ["aten.sin.default"] * 2 + ["aten.cos.default"] * 2 + [
        "aten.sum.default"
    ] * 2
    assert all(t is torch.Tensor for _, types in seen for t in types)


def test_a_subclass_that_does_not_flatten_is_kept_whole_exact_and_said():
    """Kept as autograd keeps it, exact, and never silent: one warning per
    region names the kind and the fix, and kept_as_is() lists it."""
    x = torch.randn(4, 3)
    ref = x.clone().requires_grad_()
    (ref * ref.sum()).exp().sum().backward()
    w = SizesDispatchingTensor(x.clone()).requires_grad_()
    with pytest.warns(
        UserWarning, match=r"kept tensors .* \d+ tensors .*__torch_dispatch__.*__tensor_flatten__"
    ):
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
            out = (w * w.sum()).exp().sum()
    out.backward()
    assert torch.equal(w.grad.inner, ref.grad)
    stats = region.stats()
    assert stats["packed_dropped"] == 0 and stats["kept_as_is"] > 0
    kinds = region.kept_as_is()
    assert list(kinds) == ["a tensor subclass with __torch_dispatch__"], kinds
    assert sum(n for n, _ in kinds.values()) == stats["kept_as_is"]


def test_a_traceable_subclass_is_not_kept_as_is(recwarn):
    x = _tagged(torch.randn(4, 3)).requires_grad_()
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
        out = x.sin().exp().sum()
    out.backward()
    assert region.kept_as_is() == {} and region.stats()["kept_as_is"] == 0
    assert not [w for w in recwarn if "kept" in str(w.message)]


def test_dtensor_on_one_rank_is_checkpointed_and_exact():
    """A DTensor program (one gloo rank) in a region: its local ops are
    recorded and dropped, the saved DTensors rebuilt around their replayed
    local tensors; gradients bitwise equal."""
    code = """
import os, torch, torch_sac, torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, distribute_tensor, Shard, Replicate
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])

def step(ctx):
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(32, 32), mesh, [Shard(0)]).requires_grad_()
    x = distribute_tensor(torch.randn(16, 32), mesh, [Replicate()]).requires_grad_()
    with ctx as region:
        y = torch.nn.functional.gelu(x @ w).sin() @ w
    y.sum().backward()
    return [w.grad.to_local(), x.grad.to_local()], region

import contextlib
want, _ = step(contextlib.nullcontext())
got, region = step(torch_sac.sac_context(torch_sac.policies.save_matmuls()))
assert all(torch.equal(g, w) for g, w in zip(got, want))
stats = region.stats()
assert stats["packed_dropped"] > 0 and stats["replayed_ops"] > 0, stats
print("ok", stats["dropped_ops"], stats["packed_dropped"])
dist.destroy_process_group()
"""
    run = run_isolated(code)
    assert run.status == "ok", run.stderr[-3000:]
    assert run.stdout.startswith("ok")
