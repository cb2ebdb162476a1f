"""torch_sac.profile: totals against the counting allocator and the regions'
own counters, per-op rows against totals, serialisation, the table and the
plot, misuse errors, replay FLOPs, and the memory bound of budget policies
measured with it (region engine and drop-in contexts)."""

import gc
import json
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_sac
from conftest import (
    RUN_SEED,
    ContextRecorder,
    aten,
    assert_grads_equal,
    forward,
    loss_of,
    run_model,
    sac_context_fn,
)
from models import MODEL_BUILDERS, REGION_MODEL_BUILDERS, Stack
from torch_sac.profiler import _OP_FIELDS, _REGION_FIELDS, plot_memory

torch_sac.memory.install_counting_allocator()


def allocated():
    return torch_sac.memory.cpu_memory_stats()["allocated"]


def policy_of(name):
    return {
        "recompute_all": torch_sac.policies.recompute_all,
        "save_matmuls": torch_sac.policies.save_matmuls,
        "save_all": torch_sac.policies.save_all,
    }[name]()


def blocks_of(module):
    return list(module) if isinstance(module, Stack) else [module]


def region_forward(module, x, policy, contexts=None):
    """One sac_context per block (per model if it is not a Stack)."""
    h = x
    for block in blocks_of(module):
        ctx = torch_sac.sac_context(policy)
        if contexts is not None:
            contexts.append(ctx)
        with ctx:
            h = block(h)
    return h


def step(builder, policy=None, engine="region", *, timeline=True, contexts=None, mark=True):
    """Fresh model, one profiled forward + backward; returns (profile, module, x)."""
    if isinstance(builder, str):
        builder = REGION_MODEL_BUILDERS.get(builder) or MODEL_BUILDERS[builder]
    module, make_input = builder()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    with torch_sac.profile(timeline=timeline, flops=timeline) as prof:
        if policy is None:
            out = module(x)
        elif engine == "region":
            out = region_forward(module, x, policy, contexts)
        else:
            out = forward(module, x, sac_context_fn(lambda: policy))
        loss = loss_of(out)
        del out
        if mark:
            prof.end_forward()
        loss.backward()
        del loss
    return prof, module, x


# --------------------------------------------------------------------------
# Totals against the allocator and the regions
# --------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["recompute_all", "save_matmuls"])
def test_totals_agree_with_allocator_and_regions(policy_name):
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    contexts = []
    torch.manual_seed(RUN_SEED)
    with torch_sac.memory.track() as whole:
        with torch_sac.profile() as prof:
            start = allocated()
            out = region_forward(module, x, policy_of(policy_name), contexts)
            loss = loss_of(out)
            del out
            at_forward_end = allocated()
            prof.end_forward()
            loss.backward()
            del loss
            at_exit = allocated()
    t = prof.totals
    assert t["activation_bytes"] == at_forward_end - start > 0
    assert t["peak_bytes"] == whole.peak
    assert t["end_bytes"] == at_exit - start == whole.delta
    assert t["forward_peak_bytes"] <= t["peak_bytes"]
    assert max(t["forward_peak_bytes"], t["backward_peak_bytes"]) == t["peak_bytes"]
    # The op-level samples never exceed the peak, and end where the step ends.
    tl = prof.to_dict()["timeline"]
    assert max(tl["peak_bytes"]) == t["peak_bytes"]
    assert tl["bytes"][-1] == t["end_bytes"]
    # Region counters: the sum of the regions' own stats().
    assert t["regions"] == len(contexts) == 4
    for k in _REGION_FIELDS:
        assert t[k] == sum(c.stats()[k] for c in contexts), k
    assert t["replayed_ops"] > 0 and t["replay_ns"] > 0 and t["record_ns"] > 0
    # Per-op rows sum to the totals.
    rows = prof.ops
    for field, total in [
        ("saved", "saved_ops"),
        ("dropped", "dropped_ops"),
        ("saved_bytes", "saved_bytes"),
        ("dropped_bytes", "dropped_bytes"),
        ("replayed", "replayed_ops"),
        ("replay_ns", "replay_ns"),
        ("replay_flops", "replay_flops"),
    ]:
        assert sum(r[field] for r in rows) == t[total], field
    assert sum(r["forward_flops"] for r in rows) == t["region_forward_flops"]
    assert t["forward_flops"] >= t["region_forward_flops"] > 0
    # Per op, the same as the regions' op_details() summed.
    expected = {}
    for c in contexts:
        for d in c.op_details():
            row = expected.setdefault(d["op"], dict.fromkeys(_OP_FIELDS, 0))
            for k in _OP_FIELDS:
                row[k] += d[k]
    assert {r["op"]: {k: r[k] for k in _OP_FIELDS} for r in rows} == expected


def test_profiling_changes_neither_gradients_nor_memory():
    ref = run_model(REGION_MODEL_BUILDERS["gpt4"])
    measured = []
    for timeline in (True, False):
        prof, module, x = step("gpt4", torch_sac.policies.save_matmuls(), timeline=timeline)
        res_grads = {n: p.grad for n, p in module.named_parameters()}
        for n, g in ref.param_grads.items():
            assert torch.equal(res_grads[n], g), n
        assert torch.equal(x.grad, ref.input_grad)
        measured.append((prof.totals["activation_bytes"], prof.totals["peak_bytes"]))
    # Sampling allocates no tensors of its own. But a Python scalar in a
    # tensor slot (the attention scale, `att * 0.25`) reaches a mode below
    # it as a Python float and is wrapped again as an 8-byte tensor: with the
    # sampler the region keeps that one for replay while autograd keeps the
    # original (GPTBlock has one such op per block); the peak can include
    # some of those 8-byte copies too.
    assert 0 <= measured[0][1] - measured[1][1] <= 4 * 8
    assert measured[0][0] - measured[1][0] in (0, 4 * 8)


def test_forward_end_detected_at_first_backward_op():
    marked, _, _ = step("gpt4", torch_sac.policies.recompute_all(), mark=True)
    auto, _, _ = step("gpt4", torch_sac.policies.recompute_all(), mark=False)
    assert auto.to_dict()["forward_end"]["detected_by"] == "first backward op"
    assert marked.to_dict()["forward_end"]["detected_by"] == "end_forward()"
    # backward() first allocates its gradient seed: a float scalar.
    assert auto.totals["activation_bytes"] == marked.totals["activation_bytes"] + 4
    assert auto.totals["peak_bytes"] == marked.totals["peak_bytes"]


def test_without_timeline_activation_needs_end_forward():
    prof, _, _ = step("mlp", torch_sac.policies.recompute_all(), timeline=False, mark=False)
    assert prof.totals["activation_bytes"] is None
    assert prof.totals["forward_flops"] is None
    assert "call end_forward()" in prof.table()
    prof2, _, _ = step("mlp", torch_sac.policies.recompute_all(), timeline=False, mark=True)
    assert prof2.totals["activation_bytes"] > 0
    assert prof2.to_dict()["timeline_sampling"] == "regions"


def test_baseline_without_regions():
    plain, _, _ = step("gpt4")
    sac, _, _ = step("gpt4", torch_sac.policies.recompute_all())
    assert plain.totals["regions"] == 0 and plain.ops == []
    assert sac.totals["activation_bytes"] < plain.totals["activation_bytes"]
    assert plain.totals["forward_flops"] == sac.totals["forward_flops"] > 0
    # Replays are not dispatched through Python: backward FLOPs match.
    assert plain.totals["backward_flops"] == sac.totals["backward_flops"]
    text = plain.table()
    assert "no sac_context region or drop-in context was entered" in text


def test_only_outermost_regions_entered_while_active_are_profiled():
    x = torch.randn(4, 4, requires_grad=True)
    outer_before = torch_sac.sac_context(torch_sac.policies.recompute_all())
    with outer_before:
        with torch_sac.profile() as prof:
            y = x.sin()
        y.sum().backward()
    assert prof.totals["regions"] == 0
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as outer:
            with torch_sac.sac_context(torch_sac.policies.save_all()):
                y = x.sin()
            z = y.exp()
        z.sum().backward()
    assert prof.totals["regions"] == 1
    assert prof.totals["policy_calls"] == outer.stats()["policy_calls"] == 2


# --------------------------------------------------------------------------
# Replay FLOPs
# --------------------------------------------------------------------------


def test_replay_flops_exact_when_calls_cost_the_same():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()):
            h = torch.mm(x, w).sin()
            out = torch.mm(h, w).sin()
        out.sum().backward()
    row = next(r for r in prof.ops if r["op"] == "aten::mm.default")
    assert row["forward_calls"] == 2 and row["forward_flops"] == 2 * (2 * 8 * 16 * 16)
    assert row["replayed"] == 2
    assert row["replay_flops_exact"] and row["replay_flops"] == 2 * (2 * 8 * 16 * 16)
    assert prof.totals["replay_flops_exact"]


def test_replay_flops_exact_when_calls_differ():
    """Two mms of different sizes; backward replays only the first (to
    rebuild the sin's input): replayed FLOPs are that mm's, 2*4*8*16, not
    the mean of the two calls."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g, requires_grad=True)
    w1 = torch.randn(8, 16, generator=g)
    w2 = torch.randn(16, 2, generator=g)
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()):
            out = torch.mm(torch.mm(x, w1).sin(), w2)
        out.sum().backward()
    row = next(r for r in prof.ops if r["op"] == "aten::mm.default")
    assert row["forward_calls"] == 2 and row["replayed"] == 1
    assert row["replay_flops_exact"]
    assert row["replay_flops"] == 2 * 4 * 8 * 16
    assert prof.totals["replay_flops"] == 2 * 4 * 8 * 16


def test_replay_flops_of_a_gpt_stack_are_exact():
    prof, _, _ = step("gpt4", torch_sac.policies.recompute_all())
    row = next(r for r in prof.ops if r["op"] == "aten::addmm.default")
    assert row["replayed"] > 0
    assert row["replay_flops_exact"]  # qkv, proj and the MLP differ in size
    t = prof.totals
    assert t["replay_flops_low"] == t["replay_flops"] == t["replay_flops_high"] > 0
    assert "~" not in prof.table()


# --------------------------------------------------------------------------
# Drop-in contexts (create_selective_checkpoint_contexts)
# --------------------------------------------------------------------------


def dropin_step(policy_factory, recorder=None):
    """gpt4, one drop-in pair per block, profiled; returns (profile, forward contexts)."""
    rec = recorder or ContextRecorder()
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    with torch_sac.profile() as prof:
        loss = loss_of(forward(module, x, sac_context_fn(policy_factory, recorder=rec)))
        loss.backward()
        del loss
    return prof, [fwd for fwd, _ in rec.pairs]


def rows_by_op(prof):
    return {r["op"]: r for r in prof.ops}


def assert_rows_sum_to_totals(prof):
    t = prof.totals
    for field, total in [
        ("saved", "saved_ops"),
        ("dropped", "dropped_ops"),
        ("saved_bytes", "saved_bytes"),
        ("dropped_bytes", "dropped_bytes"),
        ("replayed", "replayed_ops"),
        ("replay_ns", "replay_ns"),
        ("replay_flops", "replay_flops"),
        ("forward_flops", "region_forward_flops"),
    ]:
        assert sum(r[field] for r in prof.ops) == t[total], field


@pytest.mark.parametrize("policy_name", ["save_matmuls", "recompute_all"])
def test_dropin_rows_match_the_region_engine(policy_name):
    """The same policy on the same blocks: the drop-in's rows report the
    calls and bytes the region reports, and the FLOPs its recompute re-runs
    count as replay FLOPs, not as backward FLOPs."""
    plain, _, _ = step("gpt4")
    region, _, _ = step("gpt4", policy_of(policy_name))
    dropin, contexts = dropin_step(lambda: policy_of(policy_name))
    t, rt = dropin.totals, region.totals
    assert t["regions"] == len(contexts) == 4
    assert [r["engine"] for r in dropin.to_dict()["regions"]] == ["dropin"] * 4
    ours, theirs = rows_by_op(dropin), rows_by_op(region)
    assert set(ours) == set(theirs)
    for op, row in ours.items():
        for k in (
            "saved",
            "dropped",
            "saved_bytes",
            "dropped_bytes",
            "forward_calls",
            "forward_flops",
            "replay_flops",
        ):
            assert row[k] == theirs[op][k], (op, k)
        assert row["replay_flops_exact"]
    for k in (
        "saved_ops",
        "saved_bytes",
        "dropped_ops",
        "dropped_bytes",
        "policy_calls",
        "region_forward_flops",
        "forward_flops",
        "replay_flops",
    ):
        assert t[k] == rt[k], k
    assert t["dropped_bytes"] > 0 and t["forward_flops"] > 0
    # The drop-in's own counters: replays are its recomputes, and the fields
    # it has no counterpart for are 0.
    stats = [c.stats() for c in contexts]
    assert t["replayed_ops"] == sum(s["recomputed_ops"] for s in stats) > 0
    assert t["replay_ns"] == sum(s["recompute_ns"] for s in stats)
    assert t["policy_calls"] == sum(s["policy_calls"] for s in stats)
    for k in ("held_bytes", "packed_kept", "packed_dropped", "unpacked_original", "record_ns"):
        assert t[k] == 0, k
    assert_rows_sum_to_totals(dropin)
    # Recompute is not backward: backward FLOPs are those of the step
    # without checkpointing.
    assert t["backward_flops"] == plain.totals["backward_flops"] > 0
    if policy_name == "recompute_all":
        assert t["replay_flops"] == t["region_forward_flops"] == plain.totals["forward_flops"]
    else:
        # save_matmuls caches every FLOP-counted op: recompute passes
        # through the matmuls as cache hits, which run nothing.
        assert t["replay_flops"] == 0
        assert ours["aten::addmm.default"]["saved"] > 0
    text = dropin.table()
    assert "4 region(s) (engine: 4 dropin)" in text
    assert "autograd saved" not in text


def test_dropin_recompute_flops_are_those_of_the_dropped_matmul_calls():
    """save addmm, drop bmm: recompute re-runs every bmm call once (each
    feeds a tensor backward needs) and serves the addmms from the cache."""
    plain, _, _ = step("gpt4")
    prof, contexts = dropin_step(lambda: torch_sac.policies.save_ops([aten.addmm]))
    rows = rows_by_op(prof)
    bmm, addmm = rows["aten::bmm.default"], rows["aten::addmm.default"]
    by_call = [
        n
        for c in contexts
        for d in c.op_details()
        if d["op"] == "aten::bmm.default"
        for n in d["replays_by_call"]
    ]
    assert by_call == [1] * bmm["forward_calls"] and bmm["replayed"] == bmm["dropped"] == 8
    assert bmm["replay_flops"] == bmm["forward_flops"] > 0
    assert addmm["forward_flops"] > 0 and addmm["replayed"] == 0 and addmm["replay_flops"] == 0
    assert prof.totals["replay_flops"] == bmm["forward_flops"]
    assert prof.totals["backward_flops"] == plain.totals["backward_flops"]
    assert_rows_sum_to_totals(prof)


def test_plain_torch_checkpoint_recompute_counts_as_backward():
    """Without torch_sac's contexts the profile lists no region, and the
    re-run forward is counted in backward FLOPs."""
    plain, _, _ = step("gpt4")
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    with torch_sac.profile() as prof:
        loss_of(forward(module, x, torch.utils.checkpoint.noop_context_fn)).backward()
    t = prof.totals
    assert t["regions"] == 0 and prof.ops == [] and t["replay_flops"] == 0
    assert t["forward_flops"] == plain.totals["forward_flops"]
    assert t["backward_flops"] > plain.totals["backward_flops"]


def test_region_and_dropin_in_one_profile():
    plain = run_model(REGION_MODEL_BUILDERS["gpt4"])
    plain_prof, _, _ = step("gpt4")
    rec = ContextRecorder()
    regions = []
    policy = torch_sac.policies.recompute_all
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    torch.manual_seed(RUN_SEED)
    with torch_sac.profile() as prof:
        h = x
        for i, block in enumerate(module):
            if i % 2 == 0:
                with torch_sac.sac_context(policy()) as region:
                    h = block(h)
                regions.append(region)
            else:
                h = forward(block, h, sac_context_fn(policy, recorder=rec))
        loss = loss_of(h)
        del h
        loss.backward()
        del loss
    for n, p in module.named_parameters():
        assert torch.equal(p.grad, plain.param_grads[n]), n
    t = prof.totals
    assert [r["engine"] for r in prof.to_dict()["regions"]] == ["region", "dropin"] * 2
    assert "4 region(s) (engine: 2 region, 2 dropin)" in prof.table()
    dropins = [fwd for fwd, _ in rec.pairs]
    for k, field in (
        ("saved_ops", "saved"),
        ("dropped_ops", "dropped"),
        ("dropped_bytes", "dropped_bytes"),
    ):
        expected = sum(r.stats()[k] for r in regions) + sum(
            d[field] for fwd in dropins for d in fwd.op_details()
        )
        assert t[k] == expected, k
    assert t["policy_calls"] == (
        sum(r.stats()["policy_calls"] for r in regions)
        + sum(fwd.stats()["policy_calls"] for fwd in dropins)
    )
    assert t["record_ns"] == sum(r.stats()["record_ns"] for r in regions) > 0
    assert t["replay_flops"] == t["region_forward_flops"] == t["forward_flops"] > 0
    assert t["backward_flops"] == plain_prof.totals["backward_flops"]
    assert_rows_sum_to_totals(prof)


def test_profile_does_not_keep_dropin_contexts_alive():
    """Counters are read when forward and recompute end: the contexts, and
    the outputs they cached that recompute never consumed, go with the graph."""
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    x = make_input()
    rec = ContextRecorder()
    with torch_sac.profile() as prof:
        loss = loss_of(
            forward(module, x, sac_context_fn(torch_sac.policies.save_matmuls, recorder=rec))
        )
        loss.backward()
        del loss
        refs = [weakref.ref(fwd) for fwd, _ in rec.pairs]
        rec.pairs.clear()
        gc.collect()
        assert all(r() is None for r in refs)
    assert (
        prof.totals["regions"] == 4
        and prof.totals["saved_ops"] > 0
        and prof.totals["replayed_ops"] > 0
    )


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_apply_sac_op_details_and_profile_rows(engine):
    module, make_input = REGION_MODEL_BUILDERS["gpt4"]()
    handle = torch_sac.apply_sac(module, torch_sac.policies.save_matmuls(), engine=engine)
    torch.manual_seed(RUN_SEED)
    with torch_sac.profile() as prof:
        loss_of(module(make_input())).backward()
    details = handle.op_details()
    assert set(details) == set(handle.modules) and len(details) == 4
    summed = {}
    for rows in details.values():
        for d in rows:
            assert set(d) == {"op", "replays_by_call", "kept_why", *_OP_FIELDS}
            row = summed.setdefault(d["op"], dict.fromkeys(_OP_FIELDS, 0))
            for k in _OP_FIELDS:
                row[k] += d[k]
    assert {r["op"]: {k: r[k] for k in _OP_FIELDS} for r in prof.ops} == summed
    addmm = summed["aten::addmm.default"]
    assert addmm["saved"] == 16 and addmm["dropped"] == 0 and addmm["saved_bytes"] > 0
    assert prof.totals["regions"] == 4 and prof.totals["replayed_ops"] > 0


# --------------------------------------------------------------------------
# Output: dict, JSON, table, plot
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profiles():
    plain, _, _ = step("gpt4")
    plain.label = "no checkpointing"
    sac, _, _ = step("gpt4", torch_sac.policies.save_matmuls())
    return plain, sac


def test_to_dict_round_trips_through_json(profiles, tmp_path):
    _, prof = profiles
    d = prof.to_dict()
    assert json.loads(json.dumps(d)) == d
    path = tmp_path / "p.json"
    prof.to_json(path)
    loaded = json.loads(path.read_text())
    assert loaded == d
    again = torch_sac.profile.from_dict(loaded)
    assert again.to_dict() == d
    assert again.table() == prof.table()
    assert again.totals == prof.totals
    with pytest.raises(ValueError, match="not a torch_sac.profile"):
        torch_sac.profile.from_dict({"format": "something else"})


def test_table_lists_ops_and_totals(profiles):
    _, prof = profiles
    text = prof.table()
    for op in (
        "aten::addmm.default",
        "aten::bmm.default",
        "aten::_softmax.default",
        "aten::native_layer_norm.default",
    ):
        assert op in text
    assert "total" in text and "activations" in text and "replay" in text and "FLOPs" in text
    assert "4 region(s) (engine: 4 region)" in text
    short = prof.table(max_rows=2)
    assert "more op rows not shown" in short
    assert prof.table(sort_by="order").splitlines()[4].startswith("aten::native_layer_norm.default")
    with pytest.raises(ValueError, match="sort_by"):
        prof.table(sort_by="nope")


def test_plot_writes_png(profiles, tmp_path):
    plain, prof = profiles
    for name, kwargs in [("alone.png", {}), ("with_baseline.png", {"baseline": plain})]:
        path = tmp_path / name
        prof.plot(str(path), **kwargs)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    path = tmp_path / "no_regions.png"
    plain.plot(str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
    path = tmp_path / "several.png"
    plot_memory({"none": plain, "save_matmuls": prof}, str(path))
    assert path.stat().st_size > 10_000
    with pytest.raises(TypeError, match="baseline"):
        prof.plot(str(tmp_path / "x.png"), baseline="nope")


def test_plot_without_matplotlib_says_how_to_install(profiles, tmp_path, monkeypatch):
    _, prof = profiles
    for mod in list(sys.modules):
        if mod == "matplotlib" or mod.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        prof.plot(str(tmp_path / "x.png"))


# --------------------------------------------------------------------------
# Misuse
# --------------------------------------------------------------------------


def test_misuse_raises_clearly():
    prof = torch_sac.profile()
    for read in (prof.table, prof.to_dict, lambda: prof.totals, lambda: prof.plot("x.png")):
        with pytest.raises(RuntimeError, match="nothing profiled yet"):
            read()
    with pytest.raises(RuntimeError, match="not active"):
        prof.end_forward()
    with prof:
        with pytest.raises(RuntimeError, match="still running"):
            prof.table()
        prof.end_forward()
        with pytest.raises(RuntimeError, match="forward already ended"):
            prof.end_forward()
    with pytest.raises(RuntimeError, match="one block"):
        with prof:
            pass
    with pytest.raises(ValueError, match="flops=False"):
        torch_sac.profile(timeline=False, flops=True)
    assert torch_sac.profile(timeline=False)._count_flops is False
    with pytest.raises(TypeError, match="timeline"):
        torch_sac.profile(timeline="yes")
    with pytest.raises(ValueError, match="not supported"):
        torch_sac.profile("meta")


def test_exception_inside_leaves_no_state():
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with torch_sac.profile() as prof:
            with torch_sac.sac_context(torch_sac.policies.recompute_all()):
                x.sin()
                1 / 0
    assert prof.totals["regions"] == 1
    assert not torch_sac.region._observers()
    # The no_leaked_interceptor fixture checks the dispatch state.


def test_user_dispatch_mode_around_a_region_sees_only_user_ops():
    """A TorchDispatchMode entered before a region sees the region's ops once,
    not torch_sac's bookkeeping (with the Python-key adapter it sits below
    the region's mode); Python scalars in tensor slots work."""

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    def fn(x):
        return (x.sin() * 2.0 + 1).exp() / 3

    x = torch.randn(4, 4, requires_grad=True)
    fn(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    rec = Recorder()
    with rec:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()):
            y = fn(x)
    assert aten.detach.default not in rec.ops, rec.ops
    assert rec.ops == [
        aten.sin.default,
        aten.mul.Tensor,
        aten.add.Tensor,
        aten.exp.default,
        aten.div.Tensor,
    ]
    y.sum().backward()
    assert torch.equal(x.grad, ref)


# --------------------------------------------------------------------------
# Budget policies: measured activation memory against the budget
# --------------------------------------------------------------------------


def plan_for(builder, fraction):
    module, make_input = builder()
    first = blocks_of(module)[0]
    return torch_sac.policies.budget(first, make_input(), fraction=fraction, repeats=1)


@pytest.mark.parametrize("engine", ["region", "contexts"])
@pytest.mark.parametrize("model", ["gpt4", "convbn"])
def test_budget_bounds_measured_activation_memory(model, engine):
    """activations(budget b) <= activations(recompute_all) + regions * saved_bytes
    <= activations(recompute_all) + regions * b: checkpointing keeps the block
    inputs and what replay needs anyway, and each region keeps at most its
    plan's saved bytes on top. Gradients stay bitwise equal."""
    builder = REGION_MODEL_BUILDERS[model]
    regions = len(blocks_of(builder()[0]))
    base, _, _ = step(builder, torch_sac.policies.recompute_all(), engine)
    plain, _, _ = step(builder)
    ref = run_model(builder)
    plan = plan_for(builder, 0.5)
    previous = None
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        p = plan.with_budget(fraction=fraction)
        prof, module, x = step(builder, p, engine)
        act = prof.totals["activation_bytes"]
        bound = base.totals["activation_bytes"] + regions * p.saved_bytes
        assert p.saved_bytes <= p.budget_bytes
        assert act <= bound, (fraction, act, bound)
        assert act <= plain.totals["activation_bytes"] + regions * 5056  # torch's RNG stash
        # Not monotone in the budget in general: a bigger plan may save
        # outputs backward does not need (freed anyway) instead of ones it
        # needs (then dropped and not held).
        previous = act
        if engine == "region":
            res = run_model(builder, forward_fn=lambda m, x_, _c, p=p: region_forward(m, x_, p))
            assert_grads_equal(res, ref, f"{model} budget {fraction}")
    assert previous >= base.totals["activation_bytes"]


# --------------------------------------------------------------------------
# CUDA, through a fake torch.cuda (no GPU here)
# --------------------------------------------------------------------------


def test_cuda_path_with_a_fake_device(monkeypatch):
    from test_memory import FakeCuda

    cuda = FakeCuda()
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x = torch.randn(4, 4, requires_grad=True)
    with torch_sac.profile("cuda") as prof:
        with torch_sac.sac_context(torch_sac.policies.recompute_all()):
            cuda.alloc(4096)  # "activations"
            y = x.sin().sin()  # sampled ops; the first is replayed
            cuda.alloc(1024)
            cuda.free(1024)
        prof.end_forward()
        cuda.alloc(2048)  # backward's peak
        y.sum().backward()
        cuda.free(2048 + 4096)
    t = prof.totals
    assert prof.device == torch.device("cuda", 0)
    assert t["activation_bytes"] == 4096
    assert t["peak_bytes"] == 4096 + 2048
    assert t["forward_peak_bytes"] == 4096 + 1024
    assert t["end_bytes"] == 0
    assert t["regions"] == 1 and t["replayed_ops"] >= 1
    assert 4096 in prof.to_dict()["timeline"]["bytes"]


def _zero_grad_step(zero_grad_inside, set_to_none):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    )
    x = torch.randn(32, 256)
    model(x).sum().backward()  # gradients exist, as after a previous step
    if not zero_grad_inside:
        model.zero_grad(set_to_none=set_to_none)
    with torch_sac.profile() as prof:
        if zero_grad_inside:
            model.zero_grad(set_to_none=set_to_none)
        with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
            y = model(x)
        y.square().mean().backward()
    return prof.totals["activation_bytes"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_activation_memory_ignores_zero_grad_inside_the_block(set_to_none):
    """Freeing gradients allocated before the block (zero_grad inside it) does
    not lower activation memory; it is never negative."""
    inside = _zero_grad_step(True, set_to_none)
    outside = _zero_grad_step(False, set_to_none)
    assert inside == outside and inside > 0, (inside, outside)


def test_retained_counts_only_allocations_made_in_the_block():
    torch_sac.memory.install_counting_allocator()
    before = torch.empty(1 << 20, dtype=torch.uint8)
    with torch_sac.memory.track() as m:
        kept = torch.empty(4096, dtype=torch.uint8)
        temp = torch.empty(8192, dtype=torch.uint8)
        del before, temp
    assert m.retained == 4096, m.retained
    assert m.delta == 4096 - (1 << 20)
    del kept


def test_the_table_shows_what_ops_the_region_cannot_replay_kept():
    """Per op, the bytes kept against the policy's word and why: a column
    and a line per op; old profiles read back without them."""
    x = torch.randn(64, 64, requires_grad=True)
    prof = torch_sac.profile()
    with prof, pytest.warns(UserWarning, match="cannot replay"):
        with torch_sac.sac_context(torch_sac.policies.recompute_all()):
            a, b = x * 2, x * 3
            torch._foreach_mul_([a, b], 2.0)
            out = (a.sin() + b.cos()).sum()
        out.backward()
    row = next(r for r in prof.to_dict()["ops"] if r["op"] == "aten::_foreach_mul_.Scalar")
    assert row["kept_anyway"] == 2 and row["kept_anyway_bytes"] == 2 * x.nbytes
    assert row["kept_why"] == "it writes a list of tensors"
    text = prof.table()
    assert "kept anyway" in text
    assert (
        "kept anyway: aten::_foreach_mul_.Scalar: 2 saved tensors, 32.0 KiB, that the policy "
        "would recompute: it writes a list of tensors" in text
    )
    old = prof.to_dict()
    for r in old["ops"]:
        del r["kept_anyway"], r["kept_anyway_bytes"], r["kept_why"]
    again = torch_sac.profile.from_dict(old)
    assert "kept anyway" not in again.table()
