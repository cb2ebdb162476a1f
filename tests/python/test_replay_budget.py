"""The region's replay budget: at most ``replay_budget`` bytes of rebuilt
tensors held in backward, the rest rebuilt again when unpacked (multiple
recomputation), gradients unchanged.

Exactness is checked bitwise against plain autograd; the number of
recomputed steps against an exact dynamic program for chains
(chain_oracle.py), written independently of the engine."""

import contextlib

import pytest
import torch
import torch.nn as nn

import torch_sac
import torch_sac.memory
from chain_oracle import min_steps
from torch_sac.models import TinyGPT

RECOMPUTE_ALL = torch_sac.policies.recompute_all


def tanh_chain(n, width=64, batch=32, seed=0):
    """x_i = tanh(linear_i(x_{i-1})): each step saves one tensor of the same
    size (tanh's output, read by its own backward and the next addmm's)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(width, width) for _ in range(n)]
    x = torch.randn(batch, width, requires_grad=True)

    def forward():
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        return h

    return layers, x, forward, batch * width * 4


def grads(layers, x):
    out = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad.clone()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x.grad = None
    return out


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"gradient {i} differs"


def tanh_replays(region):
    (row,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
    return row


@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 8])
def test_chain_is_exact_within_budget_and_optimal(n, slots):
    layers, x, forward, size = tanh_chain(n)
    forward().sum().backward()
    want = grads(layers, x)
    budget = slots * size
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=budget) as region:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    stats = region.stats()
    assert 0 < stats["peak_memo_bytes"] <= budget
    row = tanh_replays(region)
    # The region's output is still alive: backward first asks for x_{n-1},
    # so the chain to reverse has n-1 steps.
    best = min_steps(n - 1, slots)
    # Equal steps: the region runs the optimal reversal (replay_budget.h).
    assert row["replayed"] == best
    if min_steps(n - 1, slots) > n - 1:
        # Some step had to be recomputed more than once.
        assert max(row["replays_by_call"]) > 1
        assert stats["memos_skipped"] > 0


def test_without_budget_every_step_replays_once():
    layers, x, forward, size = tanh_chain(12)
    with torch_sac.sac_context(RECOMPUTE_ALL()) as region:
        out = forward()
    out.sum().backward()
    assert tanh_replays(region)["replays_by_call"] == [1] * 11 + [0]
    assert region.stats()["memos_skipped"] == 0
    # The first unpack rebuilt and kept the whole chain.
    assert region.stats()["peak_memo_bytes"] >= 11 * size


def test_budget_large_enough_changes_nothing():
    layers, x, forward, size = tanh_chain(12)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=100 * size) as region:
        out = forward()
    out.sum().backward()
    assert tanh_replays(region)["replays_by_call"] == [1] * 11 + [0]
    assert region.stats()["memos_skipped"] == 0


def test_zero_budget_holds_only_the_tensor_handed_over():
    layers, x, forward, size = tanh_chain(10)
    forward().sum().backward()
    want = grads(layers, x)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=0) as region:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    assert region.stats()["peak_memo_bytes"] == size
    # Every unpack starts again from the region's input: 9 + 8 + ... + 1.
    assert tanh_replays(region)["replayed"] == min_steps(9, 1) == 45


def tiny_gpt(depth):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, depth=depth, dropout=0.1)
    tokens = torch.randint(0, 64, (4, 64))
    return model, tokens


def gpt_step(model, tokens, region_kwargs=None):
    """One step, the whole model in one region when region_kwargs is given;
    returns (grads, region, peak bytes of the step above its start)."""
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with torch_sac.memory.track() as mem:
        if region_kwargs is None:
            region = None
            logits = model(tokens)
        else:
            with torch_sac.sac_context(RECOMPUTE_ALL(), **region_kwargs) as region:
                logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        del logits
    return [p.grad.clone() for p in model.parameters()], region, mem.peak


def test_whole_model_in_one_region_runs_in_less_memory_and_exactly():
    torch_sac.memory.install_counting_allocator()
    model, tokens = tiny_gpt(depth=8)
    gpt_step(model, tokens)  # warm-up: first-call allocations
    want, _, plain_peak = gpt_step(model, tokens)
    unbudgeted, region, unbudgeted_peak = gpt_step(model, tokens, {})
    assert_bitwise(unbudgeted, want)
    full_memo = region.stats()["peak_memo_bytes"]
    budget = full_memo // 4
    got, region, peak = gpt_step(model, tokens, {"replay_budget": budget})
    assert_bitwise(got, want)
    stats = region.stats()
    assert stats["peak_memo_bytes"] <= budget
    assert stats["memos_skipped"] > 0
    # What the budget keeps out of memory shows in the step's peak.
    assert peak < unbudgeted_peak - (full_memo - budget) // 2
    assert peak < plain_peak


def test_second_backward_with_retain_graph_is_exact():
    layers, x, forward, size = tanh_chain(8)
    out = forward()
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    want = grads(layers, x)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=2 * size):
        out = forward()
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)


def test_checkpoint_takes_a_replay_budget():
    layers, x, forward, size = tanh_chain(8)
    forward().sum().backward()
    want = grads(layers, x)
    out = torch_sac.checkpoint(forward, policy=RECOMPUTE_ALL(), replay_budget=size)
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)


def test_saved_outputs_are_checkpoints_for_free():
    """Outputs the policy saves are held anyway: replays start there, and a
    budget does not change what is saved."""
    layers, x, forward, size = tanh_chain(12)
    forward().sum().backward()
    want = grads(layers, x)
    policy = torch_sac.policies.every_nth([torch.ops.aten.tanh.default], 4)
    with torch_sac.sac_context(policy, replay_budget=size) as region:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    assert max(tanh_replays(region)["replays_by_call"]) <= 3


@pytest.mark.parametrize(
    "bad, error",
    [
        (-1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("1MiB", TypeError),
    ],
)
def test_bad_replay_budget_raises(bad, error):
    with pytest.raises(error, match="replay_budget"):
        torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=bad)
    with pytest.raises(error, match="replay_budget"):
        torch_sac.checkpoint(torch.sin, torch.ones(2), policy=RECOMPUTE_ALL(), replay_budget=bad)


def test_budget_on_a_nested_region_raises_and_leaves_the_outer_one_working():
    layers, x, forward, size = tanh_chain(4)
    forward().sum().backward()
    want = grads(layers, x)
    with torch_sac.sac_context(RECOMPUTE_ALL()):
        with pytest.raises(ValueError, match="outermost region"):
            with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=0):
                pass
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)


def test_apply_sac_passes_the_budget_to_each_region():
    model, tokens = tiny_gpt(depth=2)
    want, _, _ = gpt_step(model, tokens)
    handle = torch_sac.apply_sac(
        model, RECOMPUTE_ALL(), modules=lambda m: m is model, replay_budget=0
    )
    try:
        got, _, _ = gpt_step(model, tokens)
    finally:
        stats = handle.stats()["total"]
        handle.remove()
    assert_bitwise(got, want)
    assert stats["memos_skipped"] > 0


def test_apply_sac_budget_needs_the_region_engine():
    model, _ = tiny_gpt(depth=2)
    with pytest.raises(ValueError, match="engine='region'"):
        torch_sac.apply_sac(model, RECOMPUTE_ALL(), engine="dropin", replay_budget=0)
    assert "forward" not in model.blocks[0].__dict__


# --------------------------------------------------------------------------
# Replay schedules
# --------------------------------------------------------------------------


def recorded_schedule(n=8, slots=2):
    layers, x, forward, size = tanh_chain(n)
    forward().sum().backward()
    want = grads(layers, x)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=slots * size) as region:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    return layers, x, forward, want, region


def test_recorded_schedule_runs_again_exactly(tmp_path):
    layers, x, forward, want, region = recorded_schedule()
    schedule = region.replay_schedule()
    assert schedule.saved == []
    # Rebuild #0 is for x_7 (the output x_8 is alive); later ones go back.
    assert schedule.rebuilds[0][0] == ("aten::tanh.default", 6, 0)
    unpacked = [step.unpacked.call_index for step in schedule.rebuilds]
    assert unpacked == sorted(unpacked, reverse=True)
    path = tmp_path / "schedule.json"
    schedule.save(path)
    loaded = torch_sac.ReplaySchedule.load(path)
    assert loaded == schedule
    with torch_sac.sac_context(loaded.policy(), replay_schedule=loaded) as again:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    assert again.replay_schedule() == schedule
    assert tanh_replays(again)["replays_by_call"] == tanh_replays(region)["replays_by_call"]


def test_schedule_keeps_the_forward_saves():
    layers, x, forward, size = tanh_chain(8)
    forward().sum().backward()
    want = grads(layers, x)
    policy = torch_sac.policies.every_nth([torch.ops.aten.tanh.default], 3)
    with torch_sac.sac_context(policy) as region:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    schedule = region.replay_schedule()
    assert schedule.saved == [("aten::tanh.default", i) for i in (0, 3, 6)]
    with torch_sac.sac_context(schedule.policy(), replay_schedule=schedule) as again:
        out = forward()
    out.sum().backward()
    assert_bitwise(grads(layers, x), want)
    assert again.stats()["saved_ops"] == 3


def test_schedule_for_another_program_raises_in_backward():
    _, _, _, _, region = recorded_schedule(n=8)
    schedule = region.replay_schedule()
    layers, x, forward, size = tanh_chain(10)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_schedule=schedule):
        out = forward()
    with pytest.raises(ValueError, match="replay schedule rebuild #0 is for aten::tanh.default"):
        out.sum().backward()


def test_schedule_keeping_a_tensor_the_rebuild_does_not_make_raises():
    layers, x, forward, size = tanh_chain(6)
    # The first rebuild is for x_5 (tanh call 4); it cannot keep x_5 itself.
    bad = torch_sac.ReplaySchedule([(("aten::tanh.default", 4, 0), [("aten::tanh.default", 4, 0)])])
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_schedule=bad):
        out = forward()
    with pytest.raises(ValueError, match="which this rebuild does not make"):
        out.sum().backward()


def test_schedule_too_short_raises():
    layers, x, forward, size = tanh_chain(6)
    short = torch_sac.ReplaySchedule([(("aten::tanh.default", 4, 0), [])])
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_schedule=short):
        out = forward()
    with pytest.raises(ValueError, match="has 1 rebuilds, but backward needs another"):
        out.sum().backward()


def test_schedule_argument_errors():
    schedule = torch_sac.ReplaySchedule([])
    with pytest.raises(ValueError, match="not both"):
        torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=0, replay_schedule=schedule)
    with pytest.raises(TypeError, match="ReplaySchedule"):
        torch_sac.sac_context(RECOMPUTE_ALL(), replay_schedule={"rebuilds": []})
    with pytest.raises(ValueError, match="format"):
        torch_sac.ReplaySchedule.from_dict({"rebuilds": []})
    with pytest.raises(ValueError, match="call_index"):
        torch_sac.TensorKey("aten::mm.default", -1)
    with pytest.raises(ValueError, match="aten::mm.default"):
        torch_sac.TensorKey("mm", 0)
    assert torch_sac.TensorKey("aten::tanh", 2) == ("aten::tanh.default", 2, 0)
    with torch_sac.sac_context(RECOMPUTE_ALL()):
        with pytest.raises(ValueError, match="outermost region"):
            with torch_sac.sac_context(RECOMPUTE_ALL(), replay_schedule=schedule):
                pass


def test_profile_shows_multiple_recomputation_and_the_budget_line(tmp_path):
    layers, x, forward, size = tanh_chain(10)
    with torch_sac.profile(label="budget") as prof:
        with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=2 * size) as region:
            out = forward()
        out.sum().backward()
    (row,) = [r for r in prof.ops if r["op"] == "aten::tanh.default"]
    assert row["most_replays"] == max(tanh_replays(region)["replays_by_call"]) > 1
    assert prof.to_dict()["regions"][0]["replay_budget"] == 2 * size
    table = prof.table()
    header = table.splitlines()[1]
    assert "most" in header
    tanh_line = next(line for line in table.splitlines() if line.startswith("aten::tanh.default"))
    assert f" {row['most_replays']} " in tanh_line
    pytest.importorskip("matplotlib")
    path = prof.plot(str(tmp_path / "budget.png"))
    assert (tmp_path / "budget.png").stat().st_size > 0 and path.endswith(".png")


def test_profile_table_has_no_most_column_without_multiple_recomputation():
    layers, x, forward, size = tanh_chain(6)
    with torch_sac.profile() as prof:
        with torch_sac.sac_context(RECOMPUTE_ALL()):
            out = forward()
        out.sum().backward()
    assert "most" not in prof.table().splitlines()[1]


def nested_model(seed=0):
    """pre -> sub-module (4 layers) -> post, each layer tanh(linear(h))."""
    torch.manual_seed(seed)
    pre, post = nn.Linear(32, 32), nn.Linear(32, 32)
    inner = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(16, 32, requires_grad=True)
    params = [*pre.parameters(), *inner.parameters(), *post.parameters(), x]

    def forward(inner_ctx=None):
        h = torch.tanh(pre(x))
        if inner_ctx is None:
            h = inner(h)
        else:
            with inner_ctx:
                h = inner(h)
        return torch.tanh(post(h))

    return forward, params


def test_nested_regions_recompute_inner_ops_again_and_the_profile_shows_it():
    # As with nested checkpoints: the outer region's rebuild runs the inner
    # region's ops but keeps only what the outer level reads (the
    # sub-module's output); the inner region's own tensors are rebuilt again
    # when its backward unpacks them.
    forward, params = nested_model()
    want = torch.autograd.grad(forward().sum(), params)
    peaks = {}
    for nested in (False, True):
        inner = torch_sac.sac_context(RECOMPUTE_ALL()) if nested else None
        with torch_sac.profile(label="nested") as prof:
            with torch_sac.sac_context(RECOMPUTE_ALL()) as region:
                out = forward(inner)
            got = torch.autograd.grad(out.sum(), params)
        assert_bitwise(got, want)
        (row,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
        peaks[nested] = region.stats()["peak_memo_bytes"]
        (prof_row,) = [r for r in prof.ops if r["op"] == "aten::tanh.default"]
        if nested:
            # tanh calls: 0 pre, 1-4 inner, 5 post (alive). The inner ones
            # but the last (the sub-module's output, read by post) twice.
            assert row["replays_by_call"] == [1, 2, 2, 2, 1, 0]
            assert prof_row["most_replays"] == 2
            assert "most" in prof.table().splitlines()[1]
        else:
            assert row["replays_by_call"] == [1, 1, 1, 1, 1, 0]
            assert prof_row["most_replays"] == 1
    assert peaks[True] < peaks[False]


@pytest.mark.parametrize("replay_budget", [0, torch_sac.ReplayBudget(0, counts_saved=True)])
def test_budgeted_region_runs_ops_on_nested_tensors_as_outside(replay_budget):
    # An op on nested tensors is not recorded for replay (the region keeps
    # what it saves); the budget's cost estimate read its sizes anyway and
    # raised "NestedTensorImpl doesn't support sizes" on bmm.
    def run(ctx):
        torch.manual_seed(0)
        a = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], requires_grad=True)
        b = torch.nested.nested_tensor([torch.randn(4, 5), torch.randn(4, 5)], requires_grad=True)
        with ctx:
            z = torch.bmm(a, b).sin()
        torch.nested.to_padded_tensor(z, 0).sum().backward()
        return [torch.nested.to_padded_tensor(t.grad, 0) for t in (a, b)]

    want = run(contextlib.nullcontext())
    assert_bitwise(run(torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=replay_budget)), want)
