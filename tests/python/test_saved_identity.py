"""A saved tensor the region keeps comes back in backward as the object
autograd would return: a frozen ``nn.Parameter`` or tensor subclass keeps its
type and Python attributes (a QLoRA weight's ``quant_state``), as under plain
autograd and ``torch.utils.checkpoint``."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

import torch_sac


class QuantState:
    def __init__(self, scale):
        self.scale = scale


class Params4bit(nn.Parameter):
    """Like bitsandbytes' Params4bit: a frozen Parameter subclass carrying
    the state its kernels read in backward."""

    def __new__(cls, data, quant_state):
        p = super().__new__(cls, data, requires_grad=False)
        p.quant_state = quant_state
        return p


class Matmul4bit(torch.autograd.Function):
    """A QLoRA-style kernel: saves the frozen weight, reads its attribute in
    backward, and checks it got the very object back."""

    seen = []

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight_id = id(weight)
        return x @ (weight * weight.quant_state.scale).t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        Matmul4bit.seen.append((type(weight), id(weight) == ctx.weight_id))
        scale = weight.quant_state.scale  # AttributeError on a plain alias
        return grad @ (weight * scale), None


class QLoRALinear(nn.Module):
    def __init__(self, d, r=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = Params4bit(torch.randn(d, d, generator=g), QuantState(0.5))
        self.lora_a = nn.Parameter(torch.randn(r, d, generator=g) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d, r, generator=g) * 0.1)

    def forward(self, x):
        base = Matmul4bit.apply(x, self.weight)
        return base + (x @ self.lora_a.t()) @ self.lora_b.t()


def _block(layer, x):
    return torch.nn.functional.gelu(layer(x)).sin()


def _run(wrap):
    torch.manual_seed(0)
    layer = QLoRALinear(6)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    Matmul4bit.seen.clear()
    out = wrap(functools.partial(_block, layer), x)
    out.sum().backward()
    return Matmul4bit.seen[:], (x.grad, layer.lora_a.grad, layer.lora_b.grad)


WRAPPERS = {
    "region recompute_all": lambda f, x: _in_region(torch_sac.policies.recompute_all(), f, x),
    "region save_all": lambda f, x: _in_region(torch_sac.policies.save_all(), f, x),
    "region save_matmuls": lambda f, x: _in_region(torch_sac.policies.save_matmuls(), f, x),
    "torch_sac.checkpoint": lambda f, x: torch_sac.checkpoint(f, x, use_reentrant=False),
    "torch_sac.checkpoint policy": lambda f, x: torch_sac.checkpoint(
        f, x, use_reentrant=False, policy=torch_sac.policies.save_matmuls()
    ),
    "drop-in contexts": lambda f, x: tc.checkpoint(
        f,
        x,
        use_reentrant=False,
        context_fn=functools.partial(
            torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.save_matmuls()
        ),
    ),
}


def _in_region(policy, f, x):
    with torch_sac.sac_context(policy):
        return f(x)


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_frozen_parameter_subclass_comes_back_as_itself(name):
    ref_seen, ref_grads = _run(lambda f, x: f(x))
    assert ref_seen == [(Params4bit, True)], "plain autograd returns the same object"
    torch_seen, _ = _run(lambda f, x: tc.checkpoint(f, x, use_reentrant=False))
    assert torch_seen == [(Params4bit, True)], "torch.utils.checkpoint returns the same object"
    seen, grads = _run(WRAPPERS[name])
    assert seen == [(Params4bit, True)], f"{name}: got {seen}"
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)


def test_frozen_plain_tensor_keeps_its_python_attributes():
    """A tensor that does not require grad, saved inside the region by a
    custom Function, with an attribute set from Python."""
    frozen = torch.randn(3, 3)
    frozen.tag = "base"

    class ReadsTag(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(w)
            return x @ w

        @staticmethod
        def backward(ctx, grad):
            (w,) = ctx.saved_tensors
            assert w is frozen and w.tag == "base"
            return grad @ w.t(), None

    x = torch.randn(2, 3, requires_grad=True)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        y = ReadsTag.apply(x, frozen).exp()
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() @ frozen.t()))


@pytest.mark.parametrize("policy", ["recompute_all", "save_all"])
def test_a_kept_frozen_tensor_still_checks_its_version(policy):
    """Kept as itself, a saved tensor written in place before backward is
    still caught, as plain autograd catches it."""

    def step(wrap):
        w = torch.randn(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        y = wrap(lambda: (x @ w).exp())
        w.add_(1)
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(lambda f: f())

    def in_region(f):
        with torch_sac.sac_context(getattr(torch_sac.policies, policy)()):
            return f()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(in_region)
