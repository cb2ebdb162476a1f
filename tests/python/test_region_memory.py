"""Memory of the region engine (``torch_sac.sac_context``), measured in bytes
with torch_sac's counting CPU allocator and compared with plain autograd,
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and PyTorch's
own SAC (``create_selective_checkpoint_contexts``) on the same blocks.

What is measured (see ``Measurement``):

* ``act``: bytes live right after forward minus bytes live before it, with
  the model, its parameters and the input allocated before measuring, and the
  output's storage excluded (always);
* ``peak``: the highest level during forward + loss + backward, above the
  level before forward;
* ``after``: bytes live after backward (and after dropping the output) minus
  the level before forward minus the gradients (parameters and input).

Byte counts are exact (the counting allocator counts the requested size of
every CPU allocation through torch's CPU allocator); every tolerance below is
a named constant with its justification. Python's cyclic garbage collector is
paused in these tests so that garbage from elsewhere cannot be freed inside a
window. No test looks at wall time.

Not counted by the allocator, hence by nothing here: the tape's own C++ heap
(entries, boxed arguments, geometry, and one CPU generator clone per random
op recorded as dropped), nor torch's Python and autograd objects.

Runs under both interception adapters (TORCH_SAC_ADAPTER=key / python).
"""

import collections
import functools
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.multiprocessing.reductions import StorageWeakRef

import torch_sac
from conftest import RUN_SEED, aten, loss_of
from helpers import allocated, storage_bytes  # noqa: F401  (test_apply.py imports storage_bytes from here)
from models import MLP, ConvBN, GPTBlock, Stack, _input_factory, _seeded
from torch_sac import memory
from torch_sac._op_profile import profile_region
from torch_sac.memory import track
from torch_sac.models import ConvBNReLU

# torch.utils.checkpoint stashes the CPU RNG state (a uint8 tensor) once per
# checkpoint call (preserve_rng_state=True, the default): a cost the region
# does not have (it snapshots the generator per random op, in C++ heap).
RNG_STATE_BYTES = torch.get_rng_state().nbytes  # 5056 on torch 2.13

# save_all keeps exactly what plain autograd keeps. Measured: 0 bytes for
# every model and mode below, forward and peak. Why: with save_all no tape
# entry is replayable, so the tape records no arguments and holds nothing;
# BatchNorm's running-stat copies are made while recording but discarded when
# the entry is not replayable (stats()["held_bytes"] == 0); RNG snapshots are
# discarded likewise; saved tensors are packed as detached aliases sharing
# the original storages.
SAVE_ALL_TAPE_OVERHEAD_BYTES = 0

# Under TORCH_SAC_ADAPTER=python only: torch hands __torch_dispatch__ a Python
# float for a wrapped-number argument (`att * scale`), the adapter wraps it
# again into a fresh 0-dim float64 tensor (8 bytes) and the tape holds that
# copy to replay the dropped op, while autograd keeps the original. Under the
# key adapter the tape holds the very tensor autograd saved: 0 extra bytes.
PY_ADAPTER_NUMBER_BYTES = 8

# The ops save_matmuls() saves that these models run; torch's SAC gets the
# same list, and the region gets it too (as a list policy) next to the
# built-in.
MATMUL_OPS = [
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.convolution.default,
]

POLICIES = {
    "recompute_all": torch_sac.policies.recompute_all,
    "save_all": torch_sac.policies.save_all,
    "save_matmuls": torch_sac.policies.save_matmuls,
    "matmul_list": lambda: list(MATMUL_OPS),
}


@pytest.fixture(autouse=True, scope="module")
def counting_allocator():
    """Installs the allocator; pauses the cyclic GC for the whole module (one
    collection up front: a collection per test would cost more than the
    tests, and with the GC paused no garbage can be freed inside a window)."""
    memory.install_counting_allocator()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if enabled:
        gc.enable()
    gc.collect()


# One intra-op thread: speed only. On a machine whose cores are busy with
# other work, OpenMP's parallel regions stall the tiny kernels here (1,000
# steps went from 2 s to over 60 s); one thread avoids that. Every byte count
# asserted here measured the same with 1 and 2 threads.
pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------
# Models: each a Stack of blocks (one region / checkpoint per block in the
# per_block mode, one around the whole model in the whole mode)
# --------------------------------------------------------------------------


class PoolHead(nn.Module):
    def __init__(self, c, n_out):
        super().__init__()
        self.fc = nn.Linear(c, n_out)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ChainBlock(nn.Sequential):
    """Two Linear -> tanh layers."""

    def __init__(self, width):
        super().__init__(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())


Spec = collections.namedtuple("Spec", "build py_numbers")
# py_numbers: Python numbers the forward passes in Tensor slots of ops the
# recompute policies drop (see PY_ADAPTER_NUMBER_BYTES).

MODELS = {
    # 4 x (Linear -> ReLU -> Linear -> tanh)
    "mlp": Spec(
        lambda: (
            _seeded(lambda: Stack(*[MLP(32, 64, 32) for _ in range(4)]))(),
            _input_factory((16, 32), 11),
        ),
        py_numbers=0,
    ),
    # 4 pre-LN causal attention blocks with dropout and in-place residual adds
    "gpt": Spec(
        lambda: (
            _seeded(
                lambda: Stack(
                    *[GPTBlock(d_model=32, n_head=2, dropout=0.25, max_len=16) for _ in range(4)]
                )
            )(),
            _input_factory((4, 16, 32), 12),
        ),
        py_numbers=4,  # `att * (1 / sqrt(D))`, once per block
    ),
    # 3 x (Conv -> BatchNorm -> ReLU(inplace)), then pool + Linear
    "convbn": Spec(
        lambda: (
            _seeded(
                lambda: Stack(ConvBNReLU(3, 8), ConvBNReLU(8, 8), ConvBNReLU(8, 8), PoolHead(8, 4))
            )(),
            _input_factory((4, 3, 16, 16), 13),
        ),
        py_numbers=0,
    ),
    # A deep-ish chain whose activations (16 KiB each) dominate its gradients:
    # 8 blocks x 2 x (Linear(32, 32) -> tanh), batch 128.
    "chain": Spec(
        lambda: (
            _seeded(lambda: Stack(*[ChainBlock(32) for _ in range(8)]))(),
            _input_factory((128, 32), 14),
        ),
        py_numbers=0,
    ),
}
MODEL_NAMES = ["mlp", "gpt", "convbn"]
MODES = ["per_block", "whole"]


def bn_stats_bytes(module):
    """Bytes of all BatchNorm running_mean/running_var buffers."""
    return sum(
        m.running_mean.nbytes + m.running_var.nbytes
        for m in module.modules()
        if isinstance(m, nn.BatchNorm2d)
    )


def py_number_allowance(spec):
    return spec.py_numbers * PY_ADAPTER_NUMBER_BYTES if torch_sac.adapter() == "python" else 0


# --------------------------------------------------------------------------
# Running and measuring
# --------------------------------------------------------------------------


def run_forward(module, x, method, mode, policy_name, contexts):
    """Forward by ``method`` ("plain", "region", "checkpoint", "torch_sac"),
    one region / checkpoint per block (per_block) or around the model (whole)."""
    if method == "plain":
        return module(x)
    blocks = list(module) if mode == "per_block" else [module]
    h = x
    for block in blocks:
        if method == "region":
            with torch_sac.sac_context(POLICIES[policy_name]()) as ctx:
                h = block(h)
            contexts.append(ctx)
        elif method == "checkpoint":
            h = tc.checkpoint(block, h, use_reentrant=False)
        elif method == "torch_sac":
            context_fn = functools.partial(
                tc.create_selective_checkpoint_contexts, list(MATMUL_OPS)
            )
            h = tc.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        else:
            raise AssertionError(method)
    return h


Measurement = collections.namedtuple("Measurement", "act peak after held n_regions stats")

_CACHE = {}


def measure(model, method, mode="whole", policy_name=None):
    """One measured step (after an identical warm-up step) of ``model``."""
    key = (model, method, mode, policy_name, torch_sac.adapter())
    if key in _CACHE:
        return _CACHE[key]
    module, make_input = MODELS[model].build()
    x = make_input()
    params = list(module.parameters())

    def step(contexts):
        torch.manual_seed(RUN_SEED)
        with track() as m:
            out = run_forward(module, x, method, mode, policy_name, contexts)
            act = m.delta - storage_bytes([out])
            loss_of(out).backward()
            del out
        return act, m

    step([])  # warm-up: lazily created state of torch and the engine
    for p in params:
        p.grad = None
    x.grad = None

    contexts = []  # kept alive to the end: the tape must not depend on them
    act, m = step(contexts)
    grads = storage_bytes([p.grad for p in params] + [x.grad])
    stats = collections.Counter()
    for ctx in contexts:
        stats.update(ctx.stats())
    result = Measurement(
        act=act,
        peak=m.peak,
        after=m.delta - grads,
        held=stats["held_bytes"],
        n_regions=len(list(module)) if mode == "per_block" else 1,
        stats=dict(stats),
    )
    _CACHE[key] = result
    return result


# ==========================================================================
# 1. Activation memory after forward
# ==========================================================================


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_recompute_all_below_plain_and_at_most_torch_checkpoint(model, mode):
    plain = measure(model, "plain")
    region = measure(model, "region", mode, "recompute_all")
    torch_ckpt = measure(model, "checkpoint", mode)
    numbers = (plain.act, region.act, torch_ckpt.act, region.held)
    assert region.act < plain.act, numbers
    assert region.act <= torch_ckpt.act, numbers
    # Stronger, tensor by tensor: apart from torch's RNG stash (one per
    # checkpoint call), the region holds nothing torch's checkpoint does not,
    # except the BatchNorm running-stat copies it replays against (torch
    # re-runs BatchNorm on the real buffers instead, updating them twice) and,
    # under the python adapter, its own wrapped Python numbers.
    assert region.held == bn_stats_bytes(MODELS[model].build()[0])
    torch_tensors = torch_ckpt.act - torch_ckpt.n_regions * RNG_STATE_BYTES
    assert region.act - region.held - py_number_allowance(MODELS[model]) <= torch_tensors, numbers


def test_recompute_all_per_block_keeps_exactly_the_block_boundaries():
    """Per block, recompute_all keeps each block's input (the previous
    block's output, from outside the next region) and nothing else."""
    module, make_input = MODELS["mlp"].build()
    boundary = 16 * 32 * 4  # every block maps (16, 32) to (16, 32) float32
    region = measure("mlp", "region", "per_block", "recompute_all")
    assert region.act == (len(module) - 1) * boundary
    assert measure("mlp", "region", "whole", "recompute_all").act == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_save_all_holds_what_plain_autograd_holds(model, mode):
    plain = measure(model, "plain")
    region = measure(model, "region", mode, "save_all")
    assert region.held == 0
    assert region.stats["dropped_ops"] == 0 and region.stats["replayed_ops"] == 0
    assert region.act == plain.act + SAVE_ALL_TAPE_OVERHEAD_BYTES, (plain.act, region.act)
    # Nothing is replayed either: the peak is the plain run's (the transient
    # BatchNorm-stat copies made while recording lie below the backward peak).
    assert region.peak == plain.peak, (plain.peak, region.peak)


@pytest.mark.parametrize("policy_name", ["save_matmuls", "matmul_list"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_save_matmuls_at_most_torch_sac(model, mode, policy_name):
    region = measure(model, "region", mode, policy_name)
    torch_sac_run = measure(model, "torch_sac", mode)
    numbers = (region.act, torch_sac_run.act, region.held)
    assert region.act <= torch_sac_run.act, numbers
    # As above: the same tensors as torch's SAC cache, without its RNG stash,
    # plus the BatchNorm running-stat copies (and the python adapter's numbers).
    assert region.held == bn_stats_bytes(MODELS[model].build()[0])
    torch_tensors = torch_sac_run.act - torch_sac_run.n_regions * RNG_STATE_BYTES
    assert region.act - region.held - py_number_allowance(MODELS[model]) <= torch_tensors, numbers
    # The built-in and the explicit op list decide alike.
    if policy_name == "matmul_list":
        assert region.act == measure(model, "region", mode, "save_matmuls").act


# ==========================================================================
# 2. Everything is freed after backward / with the graph
# ==========================================================================


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_all", "save_matmuls"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_backward_frees_everything_but_the_grads(model, mode, policy_name):
    """After backward (the sac_context objects still referenced), bytes live
    are back to the level before forward plus the gradients: activations,
    rebuilt copies, the tape and what it held (BatchNorm-stat copies, saved
    outputs needed for replay) are all gone."""
    region = measure(model, "region", mode, policy_name)
    assert region.after == 0, region
    assert measure(model, "plain").after == 0


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("model", ["gpt", "convbn"])
def test_tape_freed_with_the_graph_while_context_is_kept(model, policy_name):
    """No backward at all: dropping the output frees the graph, and with it
    the tape and everything it held, although the context object lives on."""
    module, make_input = MODELS[model].build()
    x = make_input()
    loss_of(module(x)).backward()  # warm-up
    module.zero_grad(set_to_none=True)
    x.grad = None
    base = allocated()
    torch.manual_seed(RUN_SEED)
    with torch_sac.sac_context(POLICIES[policy_name]()) as ctx:
        out = module(x)
    kept = allocated() - base - storage_bytes([out])
    assert kept > 0
    del out
    assert allocated() == base
    stats = ctx.stats()  # still readable
    assert stats["held_bytes"] == bn_stats_bytes(module) and stats["dropped_ops"] > 0


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("model", ["gpt", "convbn"])
def test_retain_graph_backward_keeps_only_the_forward_level(model, policy_name):
    """With retain_graph=True the tape stays (a second backward replays
    again) but rebuilt copies live only one backward pass: after each retained
    backward, bytes live are the forward's plus the gradients."""
    module, make_input = MODELS[model].build()
    x = make_input()
    loss_of(module(x)).backward()  # warm-up
    module.zero_grad(set_to_none=True)
    x.grad = None
    base = allocated()
    torch.manual_seed(RUN_SEED)
    with torch_sac.sac_context(POLICIES[policy_name]()) as ctx:
        out = module(x)
    forward_level = allocated() - base
    levels, replayed = [], [0]
    for retain in (True, True, False):
        loss_of(out).backward(retain_graph=retain)
        grads = storage_bytes([p.grad for p in module.parameters()] + [x.grad])
        levels.append(allocated() - base - grads)
        replayed.append(ctx.stats()["replayed_ops"])
    per_pass = [b - a for a, b in zip(replayed, replayed[1:])]
    assert per_pass[0] > 0 and per_pass == per_pass[:1] * 3, per_pass  # each pass replays as much
    assert levels[:2] == [forward_level, forward_level]
    assert levels[2] == storage_bytes([out])  # the graph is gone, `out` is left
    del out
    assert allocated() - base == grads


# ==========================================================================
# 3. No growth over 1,000 training steps
# ==========================================================================

LEAK_MODELS = {
    # one attention block: three dropouts, in-place residual adds, layer norm
    "gpt_dropout": lambda: (
        _seeded(lambda: GPTBlock(d_model=8, n_head=2, dropout=0.25, max_len=4))(),
        _input_factory((2, 4, 8), 21),
    ),
    # Conv -> BatchNorm -> ReLU(inplace) -> pool -> Conv -> pool -> Linear
    "convbn": lambda: (_seeded(lambda: ConvBN(2, 4, 3))(), _input_factory((2, 2, 4, 4), 22)),
}
LEAK_STEPS = 1000
LEAK_WARMUP = 3  # the optimizer creates its momentum buffers in the first step


@pytest.mark.slow
@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("model", list(LEAK_MODELS))
def test_no_growth_over_1000_training_steps(model, policy_name):
    module, make_input = LEAK_MODELS[model]()
    x = make_input()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    policy = POLICIES[policy_name]()

    def step():
        with torch_sac.sac_context(policy):
            out = module(x)
        loss_of(out).backward()
        del out
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(LEAK_WARMUP):
        step()
    start = memory.cpu_memory_stats()
    levels, live_allocs, peaks = [], [], []
    for _ in range(LEAK_STEPS):
        with track() as m:
            step()
        s = memory.cpu_memory_stats()
        levels.append(s["allocated"] - start["allocated"])
        live_allocs.append(
            (s["num_allocs"] - s["num_frees"]) - (start["num_allocs"] - start["num_frees"])
        )
        peaks.append(m.peak)
    grown = [(i, d) for i, d in enumerate(levels) if d != 0]
    assert not grown, f"bytes live changed after steps (step, bytes): {grown[:5]}"
    assert set(live_allocs) == {0}, "the number of live allocations changed"
    assert min(peaks) == max(peaks) > 0  # every step allocates the same


# ==========================================================================
# 4. Peak during backward
# ==========================================================================


def test_recompute_all_per_block_backward_peak_below_plain():
    """Deep-ish chain, one recompute_all region per block: a replay rebuilds
    one block, so the peak (forward + backward) stays below plain autograd's
    and at most torch.utils.checkpoint's on the same blocks."""
    plain = measure("chain", "plain")
    region = measure("chain", "region", "per_block", "recompute_all")
    torch_ckpt = measure("chain", "checkpoint", "per_block")
    numbers = (plain.peak, region.peak, torch_ckpt.peak)
    assert region.peak < plain.peak, numbers
    assert region.peak <= torch_ckpt.peak, numbers


@pytest.mark.parametrize("model,mode", [("chain", "whole"), ("gpt", "per_block")])
def test_recompute_all_backward_peak_at_most_torch_checkpoint(model, mode):
    """Replay must not rebuild everything at once. A whole-chain region with
    recompute_all cannot beat plain autograd (every activation of the chain
    is pending for backward at the first unpack, and the engine memoises what
    is pending), but it must not exceed torch's checkpoint of the same code,
    which re-runs the chain once too."""
    region = measure(model, "region", mode, "recompute_all")
    torch_ckpt = measure(model, "checkpoint", mode)
    assert region.peak <= torch_ckpt.peak, (
        region.peak,
        torch_ckpt.peak,
        measure(model, "plain").peak,
    )


@pytest.mark.parametrize("mode", ["per_block", "whole"])
def test_save_matmuls_backward_peak_at_most_torch_sac(mode):
    """save_matmuls' step peak stays within torch's SAC with the same ops,
    per block and for one region around the whole chain (a kept matmul
    output goes once no replay can need it; a rebuild replays only what the
    unpacked tensor needs)."""
    region = measure("chain", "region", mode, "save_matmuls")
    torch_sac_run = measure("chain", "torch_sac", mode)
    assert region.peak <= torch_sac_run.peak, (region.peak, torch_sac_run.peak)


def test_saved_output_held_for_replay_dies_with_its_last_dropped_consumer():
    """mm is saved, tanh (which saves only its result) dropped: the region
    holds each mm output to replay its tanh. Once backward has run the last
    layer's TanhBackward (and freed its saved result), nothing can replay
    that tanh any more: its mm output must be gone before the next node."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(32, 32, generator=g).requires_grad_(True) for _ in range(4)]
    h = torch.randn(64, 32, generator=g)
    refs = []
    with torch_sac.sac_context([aten.mm.default]):
        for w in ws:
            m = torch.mm(h, w)
            refs.append(StorageWeakRef(m.untyped_storage()))
            h = m.tanh()
    del m
    tanh_node = h.grad_fn
    mm_node = tanh_node.next_functions[0][0]
    assert tanh_node.name() == "TanhBackward0" and mm_node.name() == "MmBackward0"
    seen = []
    mm_node.register_prehook(lambda grads: seen.append([r.expired() for r in refs]))
    h.sum().backward()
    assert all(r.expired() for r in refs)  # all gone after backward
    assert seen == [[False, False, False, True]], (
        f"mm outputs freed before the last layer's MmBackward0: {seen}"
    )


# ==========================================================================
# 5. One region per step, saving only the block boundaries (with dropout)
# ==========================================================================


class MaskedAttentionBlock(nn.Module):
    """GPT-2's layout: pre-LN, SDPA with a float attention mask and dropout,
    out-of-place residual adds, dropout on both branches. In training on the
    CPU, SDPA takes its math path, which adds the mask into the scores in
    place (``add_``) unless a Python dispatch mode is active, where it uses
    ``add`` (and ``view`` for ``_reshape_alias``)."""

    def __init__(self, d_model=32, n_head=2, p=0.1):
        super().__init__()
        self.n_head = n_head
        self.p = p
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (
            t.reshape(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        mask = torch.full((T, T), float("-inf")).triu(1)
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


N_MASKED_BLOCKS = 4


def masked_attention_stack():
    module = _seeded(lambda: Stack(*[MaskedAttentionBlock() for _ in range(N_MASKED_BLOCKS)]))()
    return module, _input_factory((4, 64, 32), 15)()


def block_output_calls_seen_by_region(module, x):
    """The op calls (region numbering) that made each block's output but the
    last: what a region keeping only the block boundaries saves. Read from a
    region whose policy records every call and saves nothing; the last call
    it saw when a block returns made that block's output."""
    seen, counts, ends = [], collections.Counter(), []

    def record(ctx, op, *args, **kwargs):
        name = str(op.name())
        seen.append((name, counts[name]))
        counts[name] += 1
        return False

    hooks = [b.register_forward_hook(lambda m, i, o: ends.append(seen[-1])) for b in module]
    try:
        with torch.random.fork_rng(), torch_sac.sac_context(record):
            module(x)
    finally:
        for h in hooks:
            h.remove()
    return ends[:-1]


def block_output_calls_from_profile(module, x):
    """The same calls as the budget planners number them: from
    profile_region's records (a Python TorchDispatchMode), each block's
    output being its last aten.add.Tensor call."""
    profile, _ = profile_region(module, (x,), repeats=0, count_flops=False)
    adds = [r.call_index for r in profile.records if r.op is aten.add.Tensor]
    per_block = len(adds) // N_MASKED_BLOCKS
    return [("aten::add.Tensor", adds[per_block * (k + 1) - 1]) for k in range(N_MASKED_BLOCKS - 1)]


def boundary_peaks(saved_calls):
    """Peak (bytes) of a training step of the masked-attention stack: one
    region saving ``saved_calls``, and torch.utils.checkpoint per block;
    each after a warm-up step. Also the gradients, against plain autograd's."""
    module, x = masked_attention_stack()
    params = list(module.parameters())

    def step(method):
        for p in params:
            p.grad = None
        x.grad = None
        torch.manual_seed(RUN_SEED)
        with track() as m:
            if method == "region":
                policy = torch_sac.ReplaySchedule([], saved_calls).policy()
                with torch_sac.sac_context(policy):
                    out = module(x)
            elif method == "checkpoint":
                out = x
                for block in module:
                    out = tc.checkpoint(block, out, use_reentrant=False)
            else:
                out = module(x)
            loss_of(out).backward()
            del out
        return m.peak, [p.grad.clone() for p in params] + [x.grad.clone()]

    peaks, grads = {}, {}
    for method in ("plain", "region", "checkpoint"):
        step(method)  # warm-up: lazily created state of torch and the engine
        peaks[method], grads[method] = step(method)
    return peaks, grads


def test_one_region_saving_block_boundaries_with_dropout_peaks_at_most_torch_checkpoint():
    """One region around the whole stack, its policy saving only each
    block's output (per-block checkpointing as one region), in training
    (dropout, SDPA's math path): a rebuild replays one block, and what it
    keeps for later unpacks goes with their last unpack, so the step's peak
    is at most torch.utils.checkpoint's per block, gradients bitwise equal."""
    module, x = masked_attention_stack()
    saved = block_output_calls_seen_by_region(module, x)
    peaks, grads = boundary_peaks(saved)
    assert peaks["region"] <= peaks["checkpoint"] < peaks["plain"], (saved, peaks)
    assert all(torch.equal(a, b) for a, b in zip(grads["region"], grads["plain"]))


@pytest.mark.xfail(
    torch_sac.adapter() == "key",
    strict=True,
    reason="profile_region numbers calls under a Python TorchDispatchMode, which "
    "switches ATen's composite code to its subclass paths (SDPA's math path: "
    "add instead of add_; reshape: view instead of _reshape_alias); the key "
    "adapter's region sees the other ops; the planners renumber "
    "(torch_sac/planners/region_numbering.py)",
)
def test_block_boundaries_from_the_profile_peak_at_most_torch_checkpoint():
    """The same boundaries in profile_region's raw call numbering (the
    planners renumber it: test_block_chain, test_budget). They must name the calls the region sees, or the region
    saves mid-block tensors: each rebuild then spans two blocks and keeps
    both for later unpacks (on an 8-block GPT-2: 90.5 MiB against 71.1 MiB
    for torch.utils.checkpoint per block)."""
    module, x = masked_attention_stack()
    from_profile = block_output_calls_from_profile(module, x)
    peaks, grads = boundary_peaks(from_profile)
    seen_by_region = block_output_calls_seen_by_region(module, x)
    assert all(torch.equal(a, b) for a, b in zip(grads["region"], grads["plain"]))
    assert peaks["region"] <= peaks["checkpoint"], (from_profile, seen_by_region, peaks)
    assert from_profile == seen_by_region


def test_budget_plans_name_calls_as_the_region_sees_them():
    """A budget plan of the masked-attention stack in training saves calls
    the region has (the planners renumber the profile's calls): with the
    whole budget it saves every call it can, and each is one the region sees."""
    from torch_sac.planners.region_numbering import op_name, region_call_names

    module, x = masked_attention_stack()
    plan = torch_sac.policies.budget_for_region(module, (x,), bytes=1 << 40, repeats=0)
    names = region_call_names(module, (x,), {})
    counts, seen = collections.Counter(), set()
    for n in names:
        seen.add((n, counts[n]))
        counts[n] += 1
    chosen = {(op_name(op), i) for op, i in plan.chosen}
    assert chosen and chosen <= seen, sorted(chosen - seen)[:5]
