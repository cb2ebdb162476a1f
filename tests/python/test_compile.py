"""torch_sac with torch.compile on CPU (see torch_sac/_compile.py).

Four situations, each checked against the un-checkpointed, un-compiled
block (bitwise where the compiled code runs the same ATen kernels, i.e. with
the ``aot_eager`` backend; with Inductor, which generates its own fused
kernels, to a tight tolerance and bitwise against the same compiled code run
outside torch_sac):

1. a compiled block called inside an eager ``sac_context`` region: with
   ``aot_eager`` the region records the compiled graph's ATen ops and
   checkpoints them; with Inductor it cannot see inside and warns once;
   a block compiled for the first time inside a region compiles normally
   (the compile's own ops are not recorded);
2. ``torch_sac.checkpoint`` inside a compiled function (PyTorch's compiled
   SAC with the policy's ``.to_torch()``), and the memory it saves;
3. ``sac_context`` inside a compiled function: refused under
   ``fullgraph=True``, a graph break (still exact) otherwise;
4. the drop-in ``create_selective_checkpoint_contexts`` as ``context_fn``
   of ``torch.utils.checkpoint.checkpoint`` inside a compiled function.

After every case nothing is left installed (``compile_case`` fixture).

Runs under both interception adapters (TORCH_SAC_ADAPTER=key / python).
Most cases use ``aot_eager``; the few Inductor cases compile C++ (a cold
Inductor compile of a small block takes seconds on this machine).
"""

import functools
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_sac
from torch_sac import policies

COMPILED_IN_REGION = "torch_sac: compiled code (torch.compile) ran inside a sac_context region"
REGION_IN_COMPILE = "sac_context cannot be used inside code that torch.compile traces"

# Inductor generates its own kernels (fused GELU, its own reductions), so its
# results differ from eager ATen in the last bits: compared to eager with
# this tolerance, and bitwise against the same compiled code.
INDUCTOR_TOL = dict(rtol=1e-5, atol=1e-5)

GRAD_SEED = 7

# torch.compile (dynamo, aot_eager, inductor): about 25 s on 2 cores.
pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Linear-GELU-Linear."""

    def __init__(self, d=64, hidden=256):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class AttnBlock(nn.Module):
    """Pre-LayerNorm causal self-attention with SDPA and a residual."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))


BLOCKS = {
    "mlp": (MLPBlock, (8, 16, 64)),
    "attn": (AttnBlock, (2, 16, 64)),
}

POLICIES = {
    "save_matmuls": policies.save_matmuls,
    "recompute_all": policies.recompute_all,
}


def make(name):
    cls, shape = BLOCKS[name]
    torch.manual_seed(0)
    block = cls()
    return block, torch.randn(shape)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def run(block, x, fn):
    """Forward ``fn(x)`` with a fresh leaf input, backward of a fixed
    weighted sum. Returns {name: tensor}: output, input grad, param grads."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(GRAD_SEED))
    (out * w).sum().backward()
    res = {"out": out.detach(), "x.grad": x.grad}
    res.update({f"{n}.grad": p.grad.clone() for n, p in block.named_parameters()})
    return res


def assert_exact(got, ref, label):
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] is not None, f"{label}: no {k}"
        if not torch.equal(got[k], ref[k]):
            diff = (got[k] - ref[k]).abs().max().item()
            raise AssertionError(f"{label}: {k} not bitwise equal (max abs diff {diff:.3g})")


def assert_close(got, ref, label):
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(
            got[k], ref[k], **INDUCTOR_TOL, msg=lambda m: f"{label}: {k}: {m}"
        )


def assert_nothing_installed():
    assert torch_sac._C.key_handler_depth() == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch_sac._C.interception_paused()  # no compile guard left held


def ours(caught):
    return [
        w
        for w in caught
        if issubclass(w.category, UserWarning) and str(w.message).startswith(COMPILED_IN_REGION)
    ]


def in_region(fn, policy, regions=None):
    """``fn`` run inside a fresh ``sac_context(policy)``; the contexts are
    appended to ``regions``."""

    def wrapped(x):
        with torch_sac.sac_context(policy) as region:
            if regions is not None:
                regions.append(region)
            return fn(x)

    return wrapped


def saved_activation_bytes(block, x, fn):
    """Bytes of the distinct storages autograd saves for backward during
    ``fn(x)`` (a compiled function saves what its partitioned forward
    returns for backward), not counting the parameters' and the input's."""
    x = x.detach().requires_grad_()
    outside = {p.untyped_storage().data_ptr() for p in block.parameters()}
    outside.add(x.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in outside:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    del out
    return sum(saved.values())


def forward_bytes(x, fn):
    """CPU bytes ``fn(x)`` leaves allocated after forward (its output and
    whatever is held for backward), counted by torch_sac's allocator. A first
    call outside the window compiles (and, under the key adapter, recompiles
    for the region's dispatch state)."""
    x = x.detach().requires_grad_()
    fn(x)
    gc.collect()
    gc.disable()
    try:
        with torch_sac.memory.track() as m:
            out = fn(x)
        delta = m.delta
        del out
    finally:
        gc.enable()
    return delta


@pytest.fixture(autouse=True)
def compile_case():
    """One thread, a fresh Dynamo before and after, and nothing left
    installed afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    assert_nothing_installed()


@pytest.fixture
def fresh_warning(monkeypatch):
    """torch_sac warns about compiled code in a region once per process:
    forget that it did, and record every warning."""
    monkeypatch.setattr(torch_sac._compile, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# --------------------------------------------------------------------------
# 1. A compiled block inside an eager region
# --------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("block_name", sorted(BLOCKS))
def test_aot_eager_block_in_region_is_checkpointed(block_name, policy_name, fresh_warning):
    """aot_eager runs the compiled graph as ATen ops: the region records and
    checkpoints them (drops, replays), bitwise exact, and keeps less memory
    than the same compiled block without a region."""
    block, x = make(block_name)
    ref = run(block, x, block)
    compiled = torch.compile(block, backend="aot_eager")
    regions = []
    got = run(block, x, in_region(compiled, POLICIES[policy_name](), regions))
    assert_exact(got, ref, f"{block_name}/{policy_name} in region")
    stats = regions[-1].stats()
    assert stats["dropped_ops"] > 0 and stats["replayed_ops"] > 0, stats
    assert ours(fresh_warning) == []

    plain = forward_bytes(x, compiled)
    checkpointed = forward_bytes(x, in_region(compiled, POLICIES[policy_name]()))
    print(
        f"\n{block_name}/{policy_name}: after forward {checkpointed} bytes in a region, "
        f"{plain} without"
    )
    assert 0 < checkpointed < plain, (checkpointed, plain)
    assert_nothing_installed()


def test_inductor_block_in_region_warns_once_and_is_exact(fresh_warning):
    """Inductor's kernels are opaque to the region: it warns once (not per
    call), records none of their work, and gradients are those of the same
    compiled code without a region."""
    block, x = make("mlp")
    ref = run(block, x, block)
    compiled = torch.compile(block, backend="inductor")
    outside = run(block, x, compiled)
    assert_close(outside, ref, "inductor outside a region vs eager")
    assert ours(fresh_warning) == []

    regions = []
    policy = policies.recompute_all()
    first = run(block, x, in_region(compiled, policy, regions))
    second = run(block, x, in_region(compiled, policy, regions))
    assert len(ours(fresh_warning)) == 1, [str(w.message)[:80] for w in fresh_warning]
    assert_exact(first, outside, "inductor in a region vs outside")
    assert_exact(second, outside, "inductor in a region (second call) vs outside")
    for region in regions:
        assert region.stats()["dropped_ops"] == 0, region.stats()
    assert_nothing_installed()


def test_compile_pause_survives_dynamo_reset():
    """torch._dynamo.reset() clears Dynamo's compile callbacks, torch_sac's
    pause among them; torch_sac registers it again."""
    handler = torch._dynamo.callback.callback_handler
    torch._dynamo.reset()
    assert torch_sac._compile._compile_started in handler.start_callbacks
    assert torch_sac._compile._compile_ended in handler.end_callbacks
    assert handler.start_callbacks.count(torch_sac._compile._compile_started) == 1


def test_aot_eager_first_compile_inside_region():
    """A block compiled for the first time inside a region (after a
    torch._dynamo.reset(), which the fixture just did): compiles, is exact,
    and the region records only what the compiled code runs, not the
    compile's own ops (fake tensors, tracing): the same as a later call."""
    block, x = make("mlp")
    ref = run(block, x, block)
    compiled = torch.compile(block, backend="aot_eager")
    regions = []
    policy = policies.recompute_all()
    first = run(block, x, in_region(compiled, policy, regions))
    second = run(block, x, in_region(compiled, policy, regions))
    assert_exact(first, ref, "first compile inside a region")
    assert_exact(second, ref, "second call inside a region")
    compiling, compiled_run = (r.stats() for r in regions)
    assert compiling["dropped_ops"] > 0
    for key in ("policy_calls", "saved_ops", "dropped_ops", "dropped_bytes", "replayed_ops"):
        assert compiling[key] == compiled_run[key], (key, compiling, compiled_run)


def test_inductor_first_compile_inside_region(fresh_warning):
    """Inductor compiled for the first time inside a region, with its caches
    off so that the whole compile (tracing, lowering, C++ build, which runs
    real ops) happens in the region: no error, no op of the compile
    recorded, and gradients as eager's to Inductor's tolerance."""
    block, x = make("mlp")
    ref = run(block, x, block)
    compiled = torch.compile(block, backend="inductor")
    regions = []
    policy = policies.recompute_all()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        first = run(block, x, in_region(compiled, policy, regions))
    second = run(block, x, in_region(compiled, policy, regions))
    assert_close(first, ref, "inductor compiled inside a region vs eager")
    assert_exact(second, first, "second call inside a region")
    # What a region sees of Inductor code is its runtime wrapper's output
    # views (kept, never dropped), the same whether the call compiled or not.
    compiling, compiled_run = (r.stats() for r in regions)
    assert compiling["dropped_ops"] == 0, regions[0].op_details()
    assert compiling["policy_calls"] == compiled_run["policy_calls"], (compiling, compiled_run)
    assert len(ours(fresh_warning)) == 1


@pytest.mark.xfail(
    torch_sac.adapter() == "key",
    strict=True,
    raises=AssertionError,
    reason="key adapter: the region's TLS dispatch key (DispatchKey::Fake) is part of the "
    "dispatch key set Dynamo guards on, so a function compiled outside a region is "
    "recompiled at its first call inside one (an Inductor compile costs seconds)",
)
def test_calling_compiled_block_in_region_does_not_recompile():
    """Minimal repro (key adapter)::

    f = torch.compile(lambda x: x.sin(), backend="aot_eager")
    x = torch.randn(3, requires_grad=True)
    f(x)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()):
        f(x)   # TORCH_LOGS=recompiles: "tensor 'x' dispatch key set mismatch ... Fake"
    """
    block, x = make("mlp")
    compiled = torch.compile(block, backend="aot_eager")
    x = x.requires_grad_()
    compiled(x)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch_sac.sac_context(policies.recompute_all()):
        compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


# --------------------------------------------------------------------------
# 2 and 4. torch_sac.checkpoint and the drop-in inside a compiled function
# --------------------------------------------------------------------------


def checkpointed(engine, block, policy):
    """The block checkpointed with ``policy`` by ``engine``, as a function
    of x to compile; ``policy=None``: not checkpointed."""
    if policy is None:
        return lambda x: block(x)
    if engine == "checkpoint":
        return lambda x: torch_sac.checkpoint(block, x, policy=policy)
    context_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
    return lambda x: tc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("block_name", sorted(BLOCKS))
@pytest.mark.parametrize("engine", ["checkpoint", "drop_in"])
def test_checkpoint_inside_compiled_function_is_exact(
    engine, block_name, policy_name, fullgraph, fresh_warning
):
    block, x = make(block_name)
    ref = run(block, x, block)
    fn = torch.compile(
        checkpointed(engine, block, POLICIES[policy_name]()),
        backend="aot_eager",
        fullgraph=fullgraph,
    )
    assert_exact(run(block, x, fn), ref, f"{engine} {block_name}/{policy_name} compiled")
    assert ours(fresh_warning) == []
    assert_nothing_installed()


def test_peak_plan_inside_compiled_function_runs_its_forward_half(fresh_warning):
    # Compiled, a plan's forward policy applies; its replay budget cannot
    # (compiled SAC recomputes each dropped op once), and a warning says so.
    torch.manual_seed(0)
    block = torch.nn.Sequential(*[MLPBlock() for _ in range(6)])
    x = torch.randn(64, 16, 64)  # activations well above the gradients
    ref = run(block, x, block)
    xin = x.clone().requires_grad_()
    plain = policies.budget(lambda: block(xin).sum(), peak_bytes=1 << 40).no_checkpoint_peak
    # Over the op chain: a plan with a replay budget (a plan over blocks
    # has none, and compiles whole).
    plan = policies.plan_peak(lambda: block(xin).sum(), peak_bytes=int(plain * 0.8), blocks=None)
    assert plan.replay_budget is not None and plan.saved
    fn = torch.compile(lambda x: torch_sac.checkpoint(block, x, policy=plan), backend="aot_eager")
    assert_exact(run(block, x, fn), ref, "peak plan compiled")
    assert any("replay_budget does not apply" in str(w.message) for w in fresh_warning)
    assert_nothing_installed()


@pytest.mark.parametrize("block_name", sorted(BLOCKS))
@pytest.mark.parametrize("engine", ["checkpoint", "drop_in"])
def test_checkpoint_inside_compiled_function_saves_memory(engine, block_name):
    """What the compiled graph saves for backward follows the policy:
    recompute_all < save_matmuls < no checkpoint, both in the bytes
    autograd is handed and in the bytes left allocated after forward.
    (For the attention block recompute_all still saves 5056 bytes: the CPU
    RNG state PyTorch's checkpoint stashes, SDPA counting as a random op.)"""
    block, x = make(block_name)
    saved, kept = {}, {}
    for name, make_policy in [
        ("none", None),
        ("save_matmuls", policies.save_matmuls),
        ("recompute_all", policies.recompute_all),
    ]:
        torch._dynamo.reset()
        fn = torch.compile(
            checkpointed(engine, block, make_policy and make_policy()),
            backend="aot_eager",
            fullgraph=True,
        )
        saved[name] = saved_activation_bytes(block, x, fn)
        kept[name] = forward_bytes(x, fn)
    print(f"\n{engine}/{block_name}: saved for backward {saved}, after forward {kept}")
    assert saved["recompute_all"] < saved["save_matmuls"] < saved["none"], saved
    assert kept["recompute_all"] < kept["save_matmuls"] < kept["none"], kept
    if block_name == "mlp":
        # fc1's output is the only matmul output backward needs; without
        # checkpointing the partitioner also keeps GELU's output; with
        # recompute_all nothing.
        h = 8 * 16 * 256 * 4
        assert saved == {"none": 2 * h, "save_matmuls": h, "recompute_all": 0}, saved


def test_checkpoint_inside_inductor_function_is_close():
    block, x = make("mlp")
    ref = run(block, x, block)
    fn = torch.compile(
        checkpointed("checkpoint", block, policies.save_matmuls()),
        backend="inductor",
        fullgraph=True,
    )
    assert_close(run(block, x, fn), ref, "torch_sac.checkpoint under inductor")


# --------------------------------------------------------------------------
# 3. sac_context inside a compiled function
# --------------------------------------------------------------------------


def region_inside(block, policy):
    def fn(x):
        with torch_sac.sac_context(policy):
            return block(x)

    return fn


def test_region_inside_fullgraph_raises():
    block, x = make("mlp")
    fn = torch.compile(
        region_inside(block, policies.recompute_all()), backend="aot_eager", fullgraph=True
    )
    with pytest.raises(RuntimeError, match=REGION_IN_COMPILE):
        fn(x.requires_grad_())
    assert_nothing_installed()
    assert torch_sac.region._stack() == []


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # the graph breaks
@pytest.mark.parametrize("block_name", sorted(BLOCKS))
def test_region_inside_compiled_function_graph_breaks(block_name):
    block, x = make(block_name)
    ref = run(block, x, block)
    fn = torch.compile(region_inside(block, policies.recompute_all()), backend="aot_eager")
    assert_exact(run(block, x, fn), ref, f"{block_name}: sac_context in a compiled function")
    assert_exact(run(block, x, fn), ref, f"{block_name}: again")
    assert torch_sac.region._stack() == []
