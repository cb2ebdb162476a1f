"""Offloading to host memory (the OFFLOAD outcome), on the CPU stand-in.

``torch_sac.offload.using(cpu_stand_in=True)`` offloads CPU tensors into a
host pool outside the CPU allocator torch_sac counts, with the same
bookkeeping as on CUDA (staging, dedupe by storage, prefetch in reverse
order, version checks, the host cap); only the copies are synchronous. So
these tests check, without a GPU: gradients bitwise equal to the
un-checkpointed run's in every engine, offloaded bytes leaving the device's
count, fall-backs and errors, and nothing left in the host pool afterwards.
The streams, events and pinned memory are tested in test_cuda.py
(``cuda`` marker) and by scripts/gpu_check.sh.
"""

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc
from torch.utils.checkpoint import CheckpointPolicy

import torch_sac
from helpers import assert_clean, assert_same, tanh_chain, weighted
from models import MODEL_BUILDERS
from torch_sac import Policy

aten = torch.ops.aten
ENGINES = ["region", "checkpoint", "dropin"]
# Everything eligible is offloaded at once: no size threshold, nothing kept
# on the device at the end of forward, a prefetch window larger than any
# model here.
STAND_IN = dict(cpu_stand_in=True, min_bytes=0, keep_last_bytes=0, prefetch_bytes=1 << 30)


@pytest.fixture
def stand_in():
    """The CPU stand-in for one test; afterwards nothing offloaded is alive
    (the host pool holds no range: nothing leaked)."""
    with torch_sac.offload.using(**STAND_IN) as options:
        yield options
    gc.collect()
    torch_sac.offload.synchronize()
    stats = torch_sac.offload.stats()
    assert stats["host_in_use_bytes"] == 0, f"host ranges left in use: {stats}"
    assert stats["prefetched_bytes"] == 0 and stats["copying_bytes"] == 0, stats
    assert_clean()


def run(engine, fn, *args, policy):
    """``fn(*args)`` checkpointed by ``engine`` with ``policy``."""
    if engine == "region":
        with torch_sac.sac_context(policy):
            return fn(*args)
    if engine == "checkpoint":
        return torch_sac.checkpoint(fn, *args, policy=policy, use_reentrant=False)
    context_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
    return tc.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


def grads_of(fn, leaves, engine=None, policy=None, seed=0):
    torch.manual_seed(seed)
    out = fn() if engine is None else run(engine, fn, policy=policy)
    return list(torch.autograd.grad(weighted(out), leaves))


def offload_op(*ops, must=False):
    """A torch-signature policy offloading ``ops``, recomputing the rest."""
    listed = Policy.MUST_OFFLOAD if must else Policy.PREFER_OFFLOAD

    def policy(ctx, op, *args, **kwargs):
        return listed if op in ops else Policy.PREFER_RECOMPUTE

    return policy


# --------------------------------------------------------------------------
# Exactness, every engine, every way of saying "offload"
# --------------------------------------------------------------------------

POLICIES = {
    "offload_matmuls": torch_sac.policies.offload_matmuls,
    "offload_ops_tanh": lambda: torch_sac.policies.offload_ops([aten.tanh]),
    "callable_prefer": lambda: offload_op(aten.addmm.default, aten.tanh.default),
    "callable_must": lambda: offload_op(aten.addmm.default, must=True),
    "torch_enum": lambda: (
        lambda ctx, op, *a, **k: (
            CheckpointPolicy.MUST_CPU_OFFLOAD
            if op is aten.tanh.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )
    ),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_tanh_chain_bitwise(stand_in, engine, name):
    chain = tanh_chain(6)
    want = grads_of(chain.forward, chain.leaves)
    before = torch_sac.offload.stats()["offloaded"]
    got = grads_of(chain.forward, chain.leaves, engine, POLICIES[name]())
    assert_same(got, want)
    assert torch_sac.offload.stats()["offloaded"] > before, "nothing was offloaded"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", ["mlp", "convbn", "gpt", "gpt_sdpa"])
def test_models_bitwise(stand_in, engine, model):
    """Models with in-place residual adds on offloaded outputs (GPT), BatchNorm
    and SDPA: gradients and buffers as without checkpointing."""
    module, make_input = MODEL_BUILDERS[model]()
    x = make_input()
    leaves = [*module.parameters(), x]
    buffers = [b.clone() for b in module.buffers()]
    want = grads_of(lambda: module(x), leaves)
    plain_buffers = [b.clone() for b in module.buffers()]
    for b, saved in zip(module.buffers(), buffers):
        b.copy_(saved)
    got = grads_of(lambda: module(x), leaves, engine, torch_sac.policies.offload_matmuls())
    assert_same(got, want)
    assert_same(list(module.buffers()), plain_buffers, "buffer")


@pytest.mark.parametrize("engine", ENGINES)
def test_retain_graph_backward_twice(stand_in, engine):
    """The region engine reloads again in a second backward; the drop-in
    raises as PyTorch's SAC does."""
    chain = tanh_chain(4)
    out = run(engine, chain.forward, policy=torch_sac.policies.offload_matmuls())
    loss = weighted(out)
    first = torch.autograd.grad(loss, chain.leaves, retain_graph=True)
    if engine == "dropin":
        with pytest.raises(RuntimeError, match="backward an extra time"):
            torch.autograd.grad(loss, chain.leaves)
        return
    second = torch.autograd.grad(loss, chain.leaves)
    assert_same(list(second), list(first))


@pytest.mark.parametrize("engine", ENGINES)
def test_several_forwards_then_one_backward(stand_in, engine):
    chain = tanh_chain(4)
    want = grads_of(lambda: chain.forward() + chain.forward(chain.x * 2), chain.leaves)
    policy = torch_sac.policies.offload_matmuls()
    a = run(engine, chain.forward, policy=policy)
    b = run(engine, lambda: chain.forward(chain.x * 2), policy=policy)
    got = list(torch.autograd.grad(weighted(a + b), chain.leaves))
    assert_same(got, want)


def test_backward_on_another_thread(stand_in):
    from helpers import backward_on_a_thread

    chain = tanh_chain(4)
    want = grads_of(chain.forward, chain.leaves)
    with torch_sac.sac_context(torch_sac.policies.offload_matmuls()):
        out = chain.forward()
    backward_on_a_thread(weighted(out))
    got = [p.grad for p in chain.leaves]
    assert_same(got, want)


# --------------------------------------------------------------------------
# Memory: offloaded bytes leave the device
# --------------------------------------------------------------------------


def activation_bytes(fn, ctx):
    """Bytes the counting CPU allocator holds after forward, above before."""
    gc.collect()
    start = torch_sac.memory.cpu_memory_stats()["allocated"]
    with ctx:
        out = fn()
    held = torch_sac.memory.cpu_memory_stats()["allocated"] - start
    return held, out


def test_offloaded_bytes_leave_the_device_count(stand_in):
    """Saving tanh's outputs vs offloading them: the device holds exactly
    the offloaded bytes less, and the host pool holds them."""
    torch_sac.memory.install_counting_allocator()
    chain = tanh_chain(8, width=128, batch=64)
    saved, out_saved = activation_bytes(
        chain.forward, torch_sac.sac_context(torch_sac.policies.save_ops([aten.tanh]))
    )
    del out_saved
    host_before = torch_sac.offload.stats()["host_in_use_bytes"]
    offloaded, out = activation_bytes(
        chain.forward, torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh]))
    )
    host = torch_sac.offload.stats()["host_in_use_bytes"] - host_before
    # The last tanh output is the region's output: alive either way, so it
    # is not freed by offloading. Every other one is.
    expected = 7 * chain.step_bytes
    assert saved - offloaded == expected
    assert host == 8 * chain.step_bytes  # the pool's ranges (512-byte aligned)
    loss = weighted(out)
    loss.backward()
    del out, loss
    gc.collect()
    assert torch_sac.offload.stats()["host_in_use_bytes"] == host_before


def test_keep_last_bytes_stay_on_the_device(stand_in):
    chain = tanh_chain(8, width=128, batch=64)
    before = torch_sac.offload.stats()
    with torch_sac.offload.using(keep_last_bytes=3 * chain.step_bytes):
        with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
            out = chain.forward()
        weighted(out).backward()
    after = torch_sac.offload.stats()
    assert after["kept_last"] - before["kept_last"] == 3
    assert after["offloaded_bytes"] - before["offloaded_bytes"] == 5 * chain.step_bytes


def test_prefetch_in_reverse_order_within_the_window(stand_in):
    """With a window of two tensors, each reload brings the next ones back
    ahead of their use: none is late (the first one backward needs is the
    region's output, still alive: no copy at all)."""
    chain = tanh_chain(8, width=128, batch=64)
    with torch_sac.offload.using(prefetch_bytes=2 * chain.step_bytes):
        with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
            out = chain.forward()
        del chain.x.grad
        before = torch_sac.offload.stats()
        torch_sac.offload.reset_peak_stats()
        weighted(out).backward()
        after = torch_sac.offload.stats()
    assert after["late"] - before["late"] == 0
    assert after["prefetched"] - before["prefetched"] == 7
    assert after["reloaded"] - before["reloaded"] == 7
    assert after["peak_prefetched_bytes"] <= 2 * chain.step_bytes


def test_views_share_one_copy(stand_in):
    """Autograd saves views of one offloaded storage: one copy, one range."""
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def fn():
        h = x @ w  # offloaded
        a, b = h[:, :16], h[:, 16:]
        return (a.sin() * b.cos()).sum()  # sin and cos save their views of h

    want = torch.autograd.grad(fn(), [x, w])
    before = torch_sac.offload.stats()
    with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.mm])) as region:
        loss = fn()
    after = torch_sac.offload.stats()
    # sin and cos save their views (packed) and their replays read them
    # (held): four tensors, one copy.
    assert after["offloaded"] - before["offloaded"] == 1
    assert after["deduplicated"] - before["deduplicated"] == 3
    assert region.stats()["packed_offloaded"] == 2
    assert region.stats()["held_offloaded"] == 2
    assert_same(list(torch.autograd.grad(loss, [x, w])), list(want))


# --------------------------------------------------------------------------
# Fall-backs, errors, nothing left behind
# --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_prefer_falls_back_to_save_on_cpu(engine):
    """Without the stand-in a CPU tensor cannot be offloaded: PREFER_OFFLOAD
    saves it (counted), gradients exact, nothing in the host pool."""
    chain = tanh_chain(4)
    want = grads_of(chain.forward, chain.leaves)
    before = torch_sac.offload.stats()
    if engine == "region":
        torch.manual_seed(0)
        with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])) as region:
            out = chain.forward()
        got = list(torch.autograd.grad(weighted(out), chain.leaves))
        assert region.stats()["offload_fallbacks"] > 0
        assert region.stats()["packed_offloaded"] == 0
    else:
        got = grads_of(
            chain.forward, chain.leaves, engine, torch_sac.policies.offload_ops([aten.tanh])
        )
    assert_same(got, want)
    assert torch_sac.offload.stats()["offloaded"] == before["offloaded"]


def test_dropin_fallbacks_counted():
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.offload_ops([aten.tanh])
    )
    contexts = []

    def recording():
        pair = ctx_fn()
        contexts.append(pair[0])
        return pair

    chain = tanh_chain(3)
    out = tc.checkpoint(chain.forward, use_reentrant=False, context_fn=recording)
    weighted(out).backward()
    assert contexts[0].stats()["offload_fallbacks"] == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_must_offload_a_cpu_tensor_raises(engine):
    chain = tanh_chain(3)
    with pytest.raises(ValueError, match=r"MUST_OFFLOAD for aten::tanh.*CPU tensor"):
        run(engine, chain.forward, policy=offload_op(aten.tanh.default, must=True))
    assert_clean()
    # The interceptor is off and the next region works.
    got = grads_of(chain.forward, chain.leaves, engine, torch_sac.policies.recompute_all())
    assert_same(got, grads_of(chain.forward, chain.leaves))


@pytest.mark.parametrize("engine", ENGINES)
def test_must_offload_a_view_raises(stand_in, engine):
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(ValueError, match=r"MUST_OFFLOAD for aten::t.*view"):
        run(engine, lambda: (x.t() * 2).sum(), policy=offload_op(aten.t.default, must=True))
    assert_clean()


@pytest.mark.parametrize("engine", ENGINES)
def test_in_place_write_after_offload_raises(stand_in, engine):
    """A saved tensor modified after it was offloaded: autograd's error, as
    for a saved tensor (the host copy is never silently stale)."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn():
        return (x @ w).tanh()  # tanh saves its output

    out = run(engine, fn, policy=torch_sac.policies.offload_ops([aten.tanh]))
    with torch.no_grad():
        out.mul_(2)
    # The drop-in's own check comes first there (as PyTorch's SAC raises).
    with pytest.raises(RuntimeError, match="modified by an inplace operation|mutated in place"):
        out.sum().backward()


def test_write_inside_the_region_after_offload_keeps_exact(stand_in):
    """A recorded in-place write to an offloaded storage that a replay reads:
    the host copy holds the value the reader saw."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn():
        h = x @ w  # offloaded, read by mul (recomputed, saves nothing) ...
        s = h * 2
        h.mul_(3)  # ... then written in place (cos saves the new value)
        return (s.exp() + h.cos()).sum()

    want = torch.autograd.grad(fn(), [x, w])
    with torch_sac.sac_context(offload_op(aten.mm.default)):
        loss = fn()
    assert_same(list(torch.autograd.grad(loss, [x, w])), list(want))


def test_host_cap_raises_and_leaks_nothing(stand_in):
    chain = tanh_chain(8, width=128, batch=64)
    with torch_sac.offload.using(host_limit_bytes=3 * chain.step_bytes):
        with pytest.raises(torch.OutOfMemoryError, match="past its cap"):
            with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
                chain.forward()
    assert_clean()
    gc.collect()
    assert torch_sac.offload.stats()["host_in_use_bytes"] == 0


def test_options_checked():
    with pytest.raises(TypeError, match="unknown option 'host_limit'"):
        torch_sac.offload.set_options(host_limit=1)
    with pytest.raises(TypeError, match="min_bytes must be int"):
        torch_sac.offload.set_options(min_bytes=1.5)
    with pytest.raises(ValueError, match="must be >= 0"):
        torch_sac.offload.set_options(prefetch_bytes=-1)
    with pytest.raises(ValueError, match="host_limit_bytes must be positive or -1"):
        torch_sac.offload.set_options(host_limit_bytes=0)
    before = torch_sac.offload.options()
    with torch_sac.offload.using(min_bytes=7) as inside:
        assert inside.min_bytes == 7
    assert torch_sac.offload.options() == before


# --------------------------------------------------------------------------
# Policies and conversions
# --------------------------------------------------------------------------


def test_policy_values_match_torch():
    assert Policy.MUST_OFFLOAD.value == CheckpointPolicy.MUST_CPU_OFFLOAD.value
    assert Policy.PREFER_OFFLOAD.value == CheckpointPolicy.PREFER_CPU_OFFLOAD.value


def test_to_torch_maps_offload():
    fn = torch_sac.policies.offload_matmuls().to_torch()

    class Ctx:
        is_recompute = False

    x = torch.randn(2, 2)
    assert fn(Ctx(), aten.mm.default, x, x) is CheckpointPolicy.PREFER_CPU_OFFLOAD
    assert fn(Ctx(), aten.sin.default, x) is CheckpointPolicy.PREFER_RECOMPUTE


def test_describe():
    assert repr(torch_sac.policies.offload_matmuls()) == "offload_matmuls()"
    assert "offload_ops(" in repr(torch_sac.policies.offload_ops([aten.mm]))


@pytest.mark.parametrize(
    "outer, inner, want",
    [
        (Policy.MUST_OFFLOAD, Policy.PREFER_SAVE, "offloaded"),
        (Policy.PREFER_OFFLOAD, Policy.PREFER_SAVE, "saved"),
        (Policy.PREFER_SAVE, Policy.PREFER_OFFLOAD, "offloaded"),
        (Policy.MUST_SAVE, Policy.PREFER_OFFLOAD, "saved"),
    ],
)
def test_nested_regions_combine(stand_in, outer, inner, want):
    def constant(value):
        return (
            lambda ctx, op, *a, **k: value if op is aten.tanh.default else Policy.PREFER_RECOMPUTE
        )

    x = torch.randn(4, 4, requires_grad=True)
    (want_grad,) = torch.autograd.grad(x.tanh().sum(), [x])
    with torch_sac.sac_context(constant(outer)) as region:
        with torch_sac.sac_context(constant(inner)):
            y = x.tanh()
    row = [r for r in region.op_details() if r["op"] == "aten::tanh.default"][0]
    assert (row["offloaded"], row["saved"]) == ((1, 0) if want == "offloaded" else (0, 1))
    y.sum().backward()
    assert torch.equal(x.grad, want_grad)


def test_nested_must_conflict_raises(stand_in):
    x = torch.randn(4, 4, requires_grad=True)
    must = lambda value: lambda ctx, op, *a, **k: value  # noqa: E731
    with pytest.raises(RuntimeError, match="MUST_OFFLOAD.*MUST_SAVE|MUST_SAVE.*MUST_OFFLOAD"):
        with torch_sac.sac_context(must(Policy.MUST_OFFLOAD)):
            with torch_sac.sac_context(must(Policy.MUST_SAVE)):
                x.tanh()
    assert_clean()


def test_op_details_and_stats_count_offloads(stand_in):
    chain = tanh_chain(3)
    with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])) as region:
        out = chain.forward()
    row = [r for r in region.op_details() if r["op"] == "aten::tanh.default"][0]
    assert row["offloaded"] == 3 and row["saved"] == 0
    assert row["offloaded_bytes"] == 3 * chain.step_bytes
    stats = region.stats()
    assert stats["offloaded_ops"] == 3 and stats["offloaded_bytes"] == 3 * chain.step_bytes
    weighted(out).backward()


def test_linear_module_model(stand_in):
    """nn.Sequential of Linear/GELU/LayerNorm (Hugging Face-like MLP), with
    torch_sac.checkpoint per block."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        for _ in range(3)
    )
    x = torch.randn(4, 10, 32, requires_grad=True)
    leaves = [*blocks.parameters(), x]

    def fwd(ckpt):
        h = x
        for b in blocks:
            h = h + (ckpt(b, h) if ckpt else b(h))
        return h

    want = grads_of(lambda: fwd(None), leaves)
    for engine in ENGINES:
        got = grads_of(
            lambda: fwd(
                lambda b, h: run(engine, b, h, policy=torch_sac.policies.offload_matmuls())
            ),
            leaves,
        )
        assert_same(got, want, engine)


# --------------------------------------------------------------------------
# Seen: the profile
# --------------------------------------------------------------------------


def profiled_offload_step(chain):
    """A profile of one step of ``chain`` with its tanh outputs offloaded."""
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
            out = chain.forward()
        weighted(out).backward()
        del out
    return prof


def test_profile_reports_offloads(stand_in, tmp_path):
    chain = tanh_chain(6, width=128, batch=64)
    prof = profiled_offload_step(chain)
    data = prof.to_dict()
    (row,) = [r for r in data["ops"] if r["op"] == "aten::tanh.default"]
    assert row["offloaded"] == 6 and row["offloaded_bytes"] == 6 * chain.step_bytes
    off = data["totals"]["offload"]
    assert off["offloaded_bytes"] == 6 * chain.step_bytes  # keep_last_bytes=0
    assert off["host_peak_bytes"] >= 5 * chain.step_bytes
    # Host memory on the timeline: up in forward, back to 0 by the end.
    host = data["timeline"]["host_bytes"]
    assert max(host) >= 5 * chain.step_bytes and host[-1] == 0
    table = prof.table()
    assert "offload:" in table and "offloaded" in table.splitlines()[1]
    # A profile read back, and one written before offloading existed.
    assert "offload:" in torch_sac.profile.from_dict(data).table()
    # Copies timed per op (on the stand-in, all of their time is waited).
    assert row["copy_ns"] > 0 and row["waited_ns"] == row["copy_ns"]
    assert off["d2h_copy_ns"] + off["h2d_copy_ns"] == off["waited_ns"] == row["waited_ns"]
    header = table.splitlines()[1].split()
    assert "copies" in header and "waited" in header
    assert "compute waited" in table
    old = {
        **data,
        "ops": [
            {k: v for k, v in r.items() if not k.startswith("offloaded") and k[-3:] != "_ns"}
            | {"replay_ns": r["replay_ns"]}
            for r in data["ops"]
        ],
    }
    old["totals"] = {k: v for k, v in data["totals"].items() if k != "offload"}
    assert "offload:" not in torch_sac.profile.from_dict(old).table()
    pytest.importorskip("matplotlib")
    prof.plot(str(tmp_path / "offload.png"))
    assert (tmp_path / "offload.png").stat().st_size > 0


def test_profile_read_from_before_copy_times(stand_in):
    """A profile written before copies were timed reads back with no copy
    time: its rows get 0, its offload line no copy figures."""
    data = profiled_offload_step(tanh_chain(3, width=128, batch=64)).to_dict()
    timed = ("copy_ns", "waited_ns")
    data["ops"] = [{k: v for k, v in r.items() if k not in timed} for r in data["ops"]]
    data["totals"]["offload"] = {
        k: v
        for k, v in data["totals"]["offload"].items()
        if k not in ("d2h_copy_ns", "h2d_copy_ns", "waited_ns", "waits")
    }
    read = torch_sac.profile.from_dict(data)
    assert all(r["copy_ns"] == 0 and r["waited_ns"] == 0 for r in read.to_dict()["ops"])
    table = read.table()
    assert "offload:" in table and "compute waited" not in table


def test_profile_around_backward_alone_reports_its_copies(stand_in):
    """A profile of backward only sees reloads, not offloads: their copy
    time is still reported, per op and in the offload line."""
    chain = tanh_chain(3, width=128, batch=64)
    with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
        out = chain.forward()
    with torch_sac.profile() as prof:
        weighted(out).backward()
    del out
    data = prof.to_dict()
    off = data["totals"]["offload"]
    assert off is not None and off["offloaded_bytes"] == 0 and off["reloaded_bytes"] > 0
    (row,) = [r for r in data["ops"] if r["op"] == "aten::tanh.default"]
    assert row["copy_ns"] > 0 and row["waited_ns"] == row["copy_ns"]
    table = prof.table()
    assert "aten::tanh.default" in table and "compute waited" in table


def test_copy_times_per_op(stand_in):
    """Every copy of the stand-in is timed, under the op that made the
    storage, and waited for (it runs on the compute thread); the totals in
    stats() are the sums over ops."""
    chain = tanh_chain(4, width=128, batch=64)
    before, stats_before = torch_sac.offload.copy_times(), torch_sac.offload.stats()
    with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
        out = chain.forward()
    weighted(out).backward()
    del out
    torch_sac.offload.synchronize()
    after, stats_after = torch_sac.offload.copy_times(), torch_sac.offload.stats()
    zero = dict.fromkeys(("d2h_copy_ns", "h2d_copy_ns", "waited_ns", "waits"), 0)
    moved = {
        op: {k: t[k] - before.get(op, zero)[k] for k in zero}
        for op, t in after.items()
        if t != before.get(op)
    }
    assert set(moved) == {"aten::tanh.default"}, moved
    tanh = moved["aten::tanh.default"]
    copies = (stats_after["offloaded"] - stats_before["offloaded"]) + (
        stats_after["reloaded"] - stats_before["reloaded"]
    )
    # 4 out, 3 back: the last output is the region's, alive in backward.
    assert tanh["waits"] == copies == 7
    assert tanh["d2h_copy_ns"] > 0 and tanh["h2d_copy_ns"] > 0
    assert tanh["waited_ns"] == tanh["d2h_copy_ns"] + tanh["h2d_copy_ns"]
    for k in zero:
        assert stats_after[k] - stats_before[k] == tanh[k], k


def test_profile_times_copies_and_restores_the_option(stand_in):
    """A profile turns copy timing on while it runs, and puts the option
    back afterwards, even when the block raised."""
    assert torch_sac.offload.options().time_copies is False
    with pytest.raises(RuntimeError, match="boom"):
        with torch_sac.profile():
            assert torch_sac.offload.options().time_copies is True
            raise RuntimeError("boom")
    assert torch_sac.offload.options().time_copies is False
    with torch_sac.offload.using(time_copies=True):
        with torch_sac.profile():
            pass
        assert torch_sac.offload.options().time_copies is True
    with pytest.raises(TypeError, match="time_copies must be bool"):
        torch_sac.offload.set_options(time_copies=1)


def test_profile_without_offload_has_no_offload_line():
    chain = tanh_chain(3)
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
            out = chain.forward()
        weighted(out).backward()
    assert prof.to_dict()["totals"]["offload"] is None
    assert "offload:" not in prof.table()


# --------------------------------------------------------------------------
# Found by review (each failed before its fix)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("write", ["foreach", "inference_mode"])
def test_write_the_region_does_not_record_gets_a_new_copy(stand_in, write):
    """A write the region records no mutation for (a list write, one under
    inference mode) between two offloads of one storage: the second is a new
    copy, not the first one's stale bytes."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn():
        h = x @ w  # offloaded
        a = h.sin()  # saves h (state 0); a is not used by the loss
        if write == "foreach":
            with torch.no_grad():
                torch._foreach_add_([h], 1.0)
        else:
            with torch.inference_mode():
                h.mul_(2)
        return a, h.cos()  # cos saves the new h

    _, b = fn()
    want = torch.autograd.grad(b.sum(), [x, w])
    with torch_sac.sac_context(offload_op(aten.mm.default, must=True)):
        a, b = fn()
    assert_same(list(torch.autograd.grad(b.sum(), [x, w])), list(want))


def test_dropin_host_cap_leaves_the_call_to_recompute(stand_in):
    """The host cap raised inside the drop-in's caching (a user catching it
    and retrying): the call is recomputed, not half cached."""
    x = torch.randn(16, 16, requires_grad=True)
    y = torch.randn(16, 16, requires_grad=True)

    def fn():
        try:
            h = x + y
        except torch.OutOfMemoryError:
            torch_sac.offload.set_options(host_limit_bytes=-1)
            h = x + y
        return h.sin().sum()

    policy = offload_op(aten.add.Tensor, must=True)
    want = torch.autograd.grad(fn(), [x, y])
    with torch_sac.offload.using(host_limit_bytes=256):
        context_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        loss = tc.checkpoint(fn, use_reentrant=False, context_fn=context_fn)
        got = torch.autograd.grad(loss, [x, y])
    assert_same(list(got), list(want))


def test_prefetch_window_slides_past_another_graph(stand_in):
    """A graph kept alive without backward does not hold the prefetch window
    for the next steps: their reloads are all started ahead."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 64, requires_grad=True) for _ in range(6)]

    def fn(x):
        for w in weights:
            x = (x @ w).tanh()
        return x

    step = 32 * 64 * 4
    policy = torch_sac.policies.offload_ops([aten.tanh])
    with torch_sac.offload.using(prefetch_bytes=3 * step):
        with torch_sac.sac_context(policy):
            kept = fn(torch.randn(32, 64))  # noqa: F841 (alive, never backwarded)
        for _ in range(2):
            with torch_sac.sac_context(policy):
                out = fn(torch.randn(32, 64))
            before = torch_sac.offload.stats()
            out.sum().backward()
            after = torch_sac.offload.stats()
            assert after["late"] == before["late"]
            assert after["prefetched_bytes"] <= 3 * step


def test_no_copy_back_for_originals_kept_alive(stand_in):
    torch.manual_seed(0)
    weights = [torch.randn(64, 64, requires_grad=True) for _ in range(6)]
    x = torch.randn(32, 64, requires_grad=True)
    with torch_sac.sac_context(torch_sac.policies.offload_ops([aten.tanh])):
        hs, h = [], x
        for w in weights:
            h = (h @ w).tanh()
            hs.append(h)
    before = torch_sac.offload.stats()
    torch_sac.offload.reset_peak_stats()
    sum(h.sum() for h in hs).backward()
    after = torch_sac.offload.stats()
    assert after["reloaded"] == before["reloaded"]
    assert after["peak_prefetched_bytes"] == 0


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_allow_cache_entry_mutation_reads_the_host_copy(stand_in, engine):
    """allow_cache_entry_mutation=True and an offloaded output modified after
    forward: no error, and the replay reads forward's value (the host copy),
    so the gradients are those of the run without checkpointing."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def fn():
        h = x @ w
        return (h * 2).exp().sum(), h  # exp's output dropped: replaying h * 2 reads h

    loss, h = fn()
    with torch.no_grad():
        h.mul_(3)
    want = torch.autograd.grad(loss, [x, w])
    policy = offload_op(aten.mm.default, must=True)
    if engine == "region":
        with torch_sac.sac_context(policy, allow_cache_entry_mutation=True):
            loss, h = fn()
    else:
        context_fn = functools.partial(
            torch_sac.create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation=True
        )
        loss, h = tc.checkpoint(fn, use_reentrant=False, context_fn=context_fn)
    with torch.no_grad():
        h.mul_(3)
    assert_same(list(torch.autograd.grad(loss, [x, w])), list(want))


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_must_offload_unsafe_view_raises(stand_in, engine):
    """`_unsafe_view` declares no alias but returns its input's storage."""
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    policy = offload_op(aten._unsafe_view.default, must=True)
    with pytest.raises(ValueError, match=r"MUST_OFFLOAD for aten::_unsafe_view.*view of an input"):
        run(
            "region" if engine == "region" else "dropin",
            lambda: torch.matmul(x, w).sum(),
            policy=policy,
        )
    assert_clean()


# --------------------------------------------------------------------------
# Planned: plan_peak chooses offload per block where it pays
# --------------------------------------------------------------------------


class _MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.b(torch.tanh(self.a(x))))


class _MLPNet(nn.Module):
    """Blocks whose matmuls cost far more to recompute than their outputs
    cost to copy."""

    def __init__(self, d=256, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(_MLPBlock(d) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def plan_stand_in(stand_in):
    """The stand-in with a prefetch window of two activations: backward
    brings back at most that ahead, so offloading lowers its peak (a window
    as large as everything offloaded brings all of it back at once, and the
    planner rightly does not offload)."""
    with torch_sac.offload.using(prefetch_bytes=2 << 20):
        yield


@pytest.fixture
def mlp_step():
    torch_sac.memory.install_counting_allocator()
    torch.manual_seed(0)
    model = _MLPNet()
    x = torch.randn(1024, 256)
    leaves = list(model.parameters())

    def loss():
        return model(x).pow(2).mean()

    def grads(ctx=None):
        with torch_sac.memory.track() as m:
            with ctx or contextlib.nullcontext():
                out = loss()
            got = torch.autograd.grad(out, leaves)
            del out
        return list(got), m.peak

    return loss, grads


def test_plan_peak_offloads_where_it_pays(plan_stand_in, mlp_step):
    loss, grads = mlp_step
    want, plain = grads()
    target = int(plain * 0.7)
    plan = torch_sac.policies.plan_peak(loss, peak_bytes=target, offload=True)
    assert plan.offloaded, plan.table()
    assert any("offload" in option for option in plan.blocks), plan.blocks
    assert "offloaded to host memory" in plan.table()
    before = torch_sac.offload.stats()["offloaded"]
    got, peak = grads(torch_sac.sac_context(plan))
    assert_same(got, want)
    assert peak <= target
    assert torch_sac.offload.stats()["offloaded"] > before


def _step_blocks(loss, model):
    """The planner's view of ``loss``'s blocks under ``model`` (an
    OffloadModel), as plan_peak builds it."""
    from torch_sac.planners.peak_search import Planner
    from torch_sac.planners.step_state import StepState

    state = StepState()
    state.find(loss, (), {})
    planner = Planner(loss, (), {}, 1, "test", state, "auto", True)
    planner.offload_model = lambda: model
    planner.plain_run()
    return planner.step_blocks()


def random_choices(step, rng):
    """A random point of ``step``'s plan space (a StepBlocks): per block an
    option, or (one time in five) a segment of several blocks."""
    from torch_sac.planners.chain import BlockChoice

    n = len(step.chain)
    choices, j = [], 0
    while j < n:
        if rng.random() < 0.2 and j < n - 1:
            e = rng.randrange(j + 1, n)
            choices.append(BlockChoice("segment start", (j, e)))
            choices += [BlockChoice("in segment", (j, e))] * (e - j)
            j = e + 1
        else:
            choices.append(BlockChoice(rng.choice(step.chain[j].options).name, (j, j)))
            j += 1
    return choices


class _HidesActivations:
    """OffloadModel's terms for tests: a link so fast that no copy costs
    time or lags, and blocks whose compute hides ``hidden`` bytes of copies
    (whatever their measured time, so the test does not depend on the
    machine's load)."""

    def __new__(cls, hidden):
        from torch_sac.planners.block_options import OffloadModel

        class Model(OffloadModel):
            def hidden_bytes(self, forward_seconds):
                return hidden

        return Model(1e15, 1e15, overlaps=True, prefetch_bytes=1 << 30)


def test_offload_options_per_tensor_what_compute_hides(stand_in, mlp_step):
    """Priced as on a GPU (copies overlap compute), where each block's
    compute hides 1.5 activations of copies: the "offload hidden" options
    move the one tensor that fits, the earliest (the block's input, made by
    the previous block), at no time over the option they start from;
    "offload all" moves every tensor the block keeps, its input included."""
    from torch_sac.planners.block_options import OFFLOAD_ALL, OffloadModel

    loss, _ = mlp_step
    act = 1024 * 256 * 4
    model = _HidesActivations(int(1.5 * act))
    step = _step_blocks(loss, model)
    records = step.profile.records
    for j, (block, options) in enumerate(zip(step.chain, step.options)):
        by_name = {o.name: (o, saved, offloaded) for o, saved, offloaded in options}
        keep_all, _, _ = by_name["keep all"]
        everything, _, all_calls = by_name[OFFLOAD_ALL]
        # A block keeps its input and its two tanh's outputs (autograd needs
        # no addmm output); the last one also its output, which the loss
        # saves. The first block's input is the step's: not offloadable.
        assert keep_all.kept - block.input_bytes == (3 if j == len(step.chain) - 1 else 2) * act
        assert block.input_bytes == (0 if j == 0 else act)
        assert everything.kept == 0 and everything.seconds == 0.0
        names = [records[i].op._schema.name for i in all_calls]
        assert names.count("aten::tanh") == 2
        if j > 0:
            assert all_calls[0] == step.input_calls[j] and names[0] == "aten::add"
        hidden, _, offloaded = by_name["keep all + offload hidden"]
        assert keep_all.kept - hidden.kept == act and offloaded == all_calls[:1]
        assert hidden.seconds == keep_all.seconds == 0.0
        assert hidden.offloaded == act
    # Save or recompute per tensor: the block's calls most worth their
    # measured time within 2.5 activations (the budget planner's knapsack:
    # two of its four 1 MiB outputs) in host memory, the rest recomputed;
    # the device keeps what checkpointing the block keeps.
    step = _step_blocks(loss, _HidesActivations(int(2.5 * act)))
    records = step.profile.records
    for span, options in zip(step.spans, step.options):
        by_name = {o.name: (o, saved, offloaded) for o, saved, offloaded in options}
        recompute_all, _, _ = by_name["input"]
        mixed, saved, offloaded = by_name["recompute + offload hidden"]
        calls = [i for i in range(span.start, span.end) if records[i].saveable]
        chosen = step._knapsack(calls, int(2.5 * act))
        # All of the chosen calls' outputs go to host memory, but the one
        # that is the next block's input (that block counts it).
        assert saved == sorted(chosen) and offloaded and set(offloaded) <= set(chosen)
        assert all(i not in step.input_calls for i in offloaded)
        assert mixed.kept == recompute_all.kept and mixed.offloaded == len(offloaded) * act
        assert mixed.seconds < recompute_all.seconds
    # Copies that never overlap compute (the stand-in as it is): none
    # hidden, and every byte whose copy out is not hidden stays a while.
    slow = OffloadModel(1e6, 1e6, overlaps=False, prefetch_bytes=1 << 30)
    fast = OffloadModel(1e6, 1e6, overlaps=True, prefetch_bytes=1 << 30)
    assert slow.hidden_bytes(1.0) == 0 and fast.hidden_bytes(1.0) == int(1e6)
    assert slow.lagging_bytes(3e6, 1.0) == 0 and fast.lagging_bytes(3e6, 1.0) == int(2e6)
    assert fast.exposed_seconds(3e6, 1.0) == pytest.approx(2.0 + 1.0)


def test_any_mix_of_block_options_is_bitwise(stand_in, mlp_step):
    """Random choices over the whole plan space with offload (every option,
    segments of several blocks, offloaded inputs next to offloading or
    recomputing neighbours) run as the plan would: gradients bitwise."""
    import random

    from torch_sac.schedule import ReplaySchedule

    loss, grads = mlp_step
    want, _ = grads()
    act = 1024 * 256 * 4
    step = _step_blocks(loss, _HidesActivations(int(1.5 * act)))
    rng = random.Random(0)
    seen = set()
    for _ in range(24):
        choices = random_choices(step, rng)
        seen.update(c.option for c in choices)
        policy = ReplaySchedule([], step.saved_calls(choices)).policy(step.offloaded_calls(choices))
        got, _ = grads(torch_sac.sac_context(policy))
        assert_same(got, want, f"choices {[c.option for c in choices]}")
    offloading = {
        "offload all",
        "offloaded input",
        "offload matmuls",
        "keep all + offload hidden",
        "matmuls + offload hidden",
        "recompute + offload hidden",
    }
    assert offloading <= seen, seen


def test_plan_peak_offloads_nothing_where_copies_cost_more(plan_stand_in, mlp_step, monkeypatch):
    """A host link so slow that every copy costs more than recomputing: the
    planner is free to offload nothing, and does."""
    loss, grads = mlp_step
    want, plain = grads()
    monkeypatch.setattr(
        torch_sac.offload,
        "measure_bandwidth",
        lambda device: {"d2h_bytes_per_s": 1e5, "h2d_bytes_per_s": 1e5},
    )
    plan = torch_sac.policies.plan_peak(loss, peak_bytes=int(plain * 0.7), offload=True)
    assert not plan.offloaded
    assert "offload matmuls" not in (plan.blocks or [])
    got, _ = grads(torch_sac.sac_context(plan))
    assert_same(got, want)


def test_plan_peak_offload_defaults_and_errors(mlp_step):
    loss, grads = mlp_step
    _, plain = grads()
    # On the CPU the default plans no offload, even with the stand-in on.
    with torch_sac.offload.using(**STAND_IN):
        plan = torch_sac.policies.plan_peak(loss, peak_bytes=int(plain * 0.7))
    assert not plan.offloaded
    with pytest.raises(ValueError, match="offload=True, but the step runs on cpu"):
        torch_sac.policies.plan_peak(loss, peak_bytes=int(plain * 0.7), offload=True)
    with pytest.raises(TypeError, match="offload must be None, True or False"):
        torch_sac.policies.plan_peak(loss, peak_bytes=int(plain * 0.7), offload="yes")
    assert_clean()


def test_plan_with_offload_saves_and_loads(plan_stand_in, mlp_step, tmp_path):
    loss, grads = mlp_step
    want, plain = grads()
    plan = torch_sac.policies.plan_peak(loss, peak_bytes=int(plain * 0.7), offload=True)
    plan.save(tmp_path / "plan.json")
    back = torch_sac.PeakPlan.load(tmp_path / "plan.json")
    assert back.offloaded == plan.offloaded and back.blocks == plan.blocks
    # Whether offloading wins is measured (a loaded machine once chose a
    # plan without it: offloaded is None then).
    assert back.policy().num_offloaded_calls == len(plan.offloaded or ())
    got, _ = grads(torch_sac.sac_context(back))
    assert_same(got, want)
    # A plan written before offloading existed (format 3) loads with none.
    data = plan.to_dict()
    data["format"] = "torch_sac.peak_plan/3"
    del data["offloaded"]
    assert torch_sac.PeakPlan.from_dict(data).offloaded is None


def test_saved_calls_policy_offloads_the_listed_calls():
    policy = torch_sac._C.SavedCallsPolicy(
        [("aten::mm", "", 0)], "", offloaded=[("aten::mm", "", 1)]
    )
    assert policy.num_saved_calls == 2 and policy.num_offloaded_calls == 1
    with pytest.raises(ValueError, match="both as saved and as offloaded"):
        torch_sac._C.SavedCallsPolicy([("aten::mm", "", 0)], "", offloaded=[("aten::mm", "", 0)])


def test_write_in_another_region_after_offload_keeps_the_replay_exact(stand_in):
    """Found by the fuzzer: a replay input offloaded by one region, written
    in place (no_grad) in the next region, which sees the write and orders
    it after the copy: the replay reads the host copy, as plain autograd
    (which saved exp's output) needs no error here."""
    from models import ScaledTanhFn

    g = torch.Generator().manual_seed(0)
    v2 = torch.randn((2, 3, 4), generator=g, dtype=torch.float64).requires_grad_()
    offload_bmm = offload_op(aten.bmm.default)

    def program(region):
        with region():
            v4 = torch.bmm(v2, v2.transpose(1, 2))
            v5 = torch.exp(v4)  # exp's output dropped: its replay reads v4
            v7 = ScaledTanhFn.apply(v5, v5)
        with region():
            with torch.no_grad():
                v4.add_(1.0)
            return (v4 + v7).sum()

    (want,) = torch.autograd.grad(program(contextlib.nullcontext), [v2])
    (got,) = torch.autograd.grad(program(lambda: torch_sac.sac_context(offload_bmm)), [v2])
    assert_same([got], [want])


def test_frontier_with_offload(plan_stand_in, mlp_step):
    """frontier(offload=True): the offload recipe is measured beside the
    others, and plans may offload (at 0.7x here they do)."""
    loss, _ = mlp_step
    curve = torch_sac.policies.frontier(loss, fractions=(0.7,), rounds=1, offload=True)
    labels = [p.label for p in curve.points]
    assert "torch_sac offload_matmuls per block" in labels
    assert "offload everything the blocks save" in labels
    planned = [p for p in curve.points if p.kind == "plan" and p.blocks]
    assert any("offload" in option for p in planned for option in p.blocks), curve.table()
    with pytest.raises(TypeError, match="offload must be None, True or False"):
        torch_sac.policies.frontier(loss, offload=1)


@pytest.mark.parametrize("engine", ENGINES)
def test_list_outputs_are_offloaded(stand_in, engine):
    """A list output's tensors (``_foreach_exp``, whose backward saves them)
    go to host memory in every engine, and come back in their places."""
    xs = [torch.randn(4, 5, requires_grad=True) for _ in range(3)]

    def fn():
        return sum(y.sum() for y in torch._foreach_exp([x * 2 for x in xs]))

    want = torch.autograd.grad(fn(), xs)
    policy = offload_op(aten._foreach_exp.default, must=True)
    before = torch_sac.offload.stats()["offloaded"]
    got = torch.autograd.grad(run(engine, fn, policy=policy), xs)
    assert_same(list(got), list(want))
    assert torch_sac.offload.stats()["offloaded"] - before == 3
