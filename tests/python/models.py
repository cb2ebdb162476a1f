"""Tiny, deterministic model builders for the torch_sac test suite.

Every builder returns ``(module, make_input)``:

* ``module`` is an ``nn.Module`` in train mode whose parameters were
  initialised from a fixed seed, so two calls of the same builder give
  bit-identical modules (one fresh copy per run keeps BatchNorm running
  statistics and gradients independent between runs).
* ``make_input()`` returns a fresh leaf input tensor with
  ``requires_grad=True``, generated from a private ``torch.Generator`` so it
  never touches the global RNG.

A module that is a :class:`Stack` is meant to be checkpointed one child at a
time (one checkpoint region per block), everything else as a single region.

All models are a few hundred parameters and run in well under a millisecond
on CPU.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Stack",
    "MLP",
    "ConvBN",
    "GPTBlock",
    "build_mlp",
    "build_convbn",
    "build_gpt",
    "build_gpt_sdpa",
    "MODEL_BUILDERS",
    "LSTMLoop",
    "ScaledTanhFn",
    "CustomFnNet",
    "build_gpt4",
    "build_lstm_loop",
    "build_custom_fn",
    "REGION_MODEL_BUILDERS",
    "SizesDispatchingTensor",
]

_PARAM_SEED = 1234


def _input_factory(shape, seed):
    def make_input():
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).requires_grad_(True)

    return make_input


class Stack(nn.Sequential):
    """A sequence of blocks, each of which gets its own checkpoint region."""


class MLP(nn.Module):
    """Linear -> ReLU -> Linear -> tanh."""

    def __init__(self, d_in=8, d_hidden=16, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return torch.tanh(self.fc2(F.relu(self.fc1(x))))


class ConvBN(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU(inplace) -> MaxPool -> Conv2d -> avg-pool -> Linear."""

    def __init__(self, c_in=3, c_mid=8, n_out=4):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_mid, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_mid)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(c_mid, c_mid, 3, padding=1, bias=False)
        self.head = nn.Linear(c_mid, n_out)

    def forward(self, x):
        h = self.act(self.bn(self.conv1(x)))
        h = self.pool(h)
        h = F.adaptive_avg_pool2d(self.conv2(h), 1).flatten(1)
        return self.head(h)


class GPTBlock(nn.Module):
    """Pre-LN transformer block with causal self-attention.

    ``use_sdpa=False`` writes attention out with matmuls, masked_fill, softmax
    and dropout on the attention probabilities; ``use_sdpa=True`` uses
    ``F.scaled_dot_product_attention(is_causal=True)``.  Residual connections
    are in-place adds onto the (dropout) branch output.
    """

    def __init__(self, d_model=16, n_head=2, dropout=0.25, use_sdpa=False, max_len=16):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.use_sdpa = use_sdpa
        self.p = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.mlp_drop = nn.Dropout(dropout)
        self.register_buffer(
            "causal_mask",
            torch.ones(max_len, max_len, dtype=torch.bool).triu(1),
            persistent=False,
        )

    def attention(self, x):
        B, T, C = x.shape
        H = self.n_head
        D = C // H
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, H, D).transpose(1, 2)
        v = v.view(B, T, H, D).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
            att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_drop(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)

    def forward(self, x):
        a = self.resid_drop(self.attention(self.ln1(x)))
        a += x  # in-place residual add
        m = self.mlp_drop(self.fc_out(F.gelu(self.fc(self.ln2(a)))))
        m += a  # in-place residual add
        return m


def _seeded(fn):
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_PARAM_SEED)
            module = fn()
        return module.train()

    return build


def build_mlp():
    module = _seeded(MLP)()
    return module, _input_factory((4, 8), seed=1)


def build_convbn():
    module = _seeded(ConvBN)()
    return module, _input_factory((4, 3, 8, 8), seed=2)


def build_gpt():
    module = _seeded(lambda: Stack(GPTBlock(use_sdpa=False), GPTBlock(use_sdpa=False)))()
    return module, _input_factory((2, 8, 16), seed=3)


def build_gpt_sdpa():
    module = _seeded(lambda: Stack(GPTBlock(use_sdpa=True), GPTBlock(use_sdpa=True)))()
    return module, _input_factory((2, 8, 16), seed=4)


MODEL_BUILDERS = {
    "mlp": build_mlp,
    "convbn": build_convbn,
    "gpt": build_gpt,
    "gpt_sdpa": build_gpt_sdpa,
}


# --------------------------------------------------------------------------
# Extra models for the region engine tests (tests/python/test_region.py).
# Kept out of MODEL_BUILDERS so the drop-in parity matrix is unchanged.
# --------------------------------------------------------------------------


class LSTMLoop(nn.Module):
    """An LSTM written as a Python loop of cell steps that reuse one set of
    weights: every step's matmuls, chunks and pointwise ops hit the same
    parameters, and the hidden state starts as a factory op (``new_zeros``)."""

    def __init__(self, d_in=6, d_hidden=8, n_out=3):
        super().__init__()
        self.d_hidden = d_hidden
        self.w_ih = nn.Linear(d_in, 4 * d_hidden)
        self.w_hh = nn.Linear(d_hidden, 4 * d_hidden, bias=False)
        self.head = nn.Linear(d_hidden, n_out)

    def forward(self, x):  # (B, T, d_in)
        B, T, _ = x.shape
        h = x.new_zeros(B, self.d_hidden)
        c = x.new_zeros(B, self.d_hidden)
        outs = []
        for t in range(T):
            gates = self.w_ih(x[:, t]) + self.w_hh(h)
            i, f, g, o = gates.chunk(4, 1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            outs.append(h)
        return self.head(torch.stack(outs, 1))


class ScaledTanhFn(torch.autograd.Function):
    """A custom autograd.Function: ``tanh(x * w)`` with a hand-written
    backward that uses its saved input, weight and output."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x * w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, y = ctx.saved_tensors
        d = gy * (1 - y * y)
        # Broadcasting either way (the fuzzer passes any two shapes).
        return (d * w).sum_to_size(x.shape), (d * x).sum_to_size(w.shape)


class CustomFnNet(nn.Module):
    """Linear -> ReLU -> ScaledTanhFn -> Linear -> sin."""

    def __init__(self, d_in=8, d_hidden=12, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d_hidden))
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = ScaledTanhFn.apply(h, self.scale)
        return self.fc2(h).sin()


def build_gpt4():
    """Four causal-attention blocks with dropout (no SDPA)."""
    module = _seeded(lambda: Stack(*[GPTBlock(use_sdpa=False) for _ in range(4)]))()
    return module, _input_factory((2, 8, 16), seed=5)


def build_lstm_loop():
    module = _seeded(LSTMLoop)()
    return module, _input_factory((3, 5, 6), seed=6)


def build_custom_fn():
    module = _seeded(CustomFnNet)()
    return module, _input_factory((4, 8), seed=7)


#: Builders used by the region engine tests only.
REGION_MODEL_BUILDERS = {
    "mlp": build_mlp,
    "convbn": build_convbn,
    "gpt4": build_gpt4,
    "lstm_loop": build_lstm_loop,
    "custom_fn": build_custom_fn,
}


class SizesDispatchingTensor(torch.Tensor):
    """A wrapper subclass with ``__torch_dispatch__`` whose sizes are
    dispatched (``"sizes"`` policy), so metadata ops such as
    ``aten.sym_size`` reach ``__torch_dispatch__`` too."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            inner.stride(),
            None,
            None,
            inner.dtype,
            inner.layout,
            inner.device,
            False,
            inner.requires_grad,
            "sizes",
        )

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        from torch.utils._pytree import tree_map_only

        unwrapped = tree_map_only(cls, lambda t: t.inner, args)
        return tree_map_only(torch.Tensor, cls, func(*unwrapped, **(kwargs or {})))
