"""Plans for a measured forward+backward peak (``policies.budget(...,
peak_bytes=)``): forward keeps the first sweep of the optimal reversal,
backward runs under a budget that counts what forward kept.

Checked against PyTorch (gradients bitwise), the counting allocator (every
peak within the budget) and two exact oracles written independently of the
engine: the chain DP (chain_oracle.py) and a MILP solved by HiGHS
(milp_oracle.py), which also measures the heuristic's gap on graphs that are
not chains.

Then plans of real-ish steps (BatchNorm, dropout, in-place ops on views,
an optimizer, retain_graph, backward on another thread, kwargs, tuple and
dict outputs, checkpoints and regions inside the planned function, save and
load) and the planner's input errors: every run, planning included, must
leave no dispatch mode, region, ``.grad`` or RNG change behind."""

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_sac
from chain_oracle import min_steps
from helpers import (
    assert_bitwise,
    assert_clean,
    assert_same,
    backward_on_a_thread,
    measured,
    scaled_tanh_chain,
    tanh_chain,
    tanh_row,
    weighted,
)
from milp_oracle import chain_deps, min_recompute
from torch_sac.planners.peak_search import _first_sweep
from torch_sac.models import TinyGPT

P = torch_sac.policies
RA = P.recompute_all
budget = P.budget

pytestmark = pytest.mark.usefixtures("one_thread", "leaves_nothing")


def grads_of(forward, layers, x, ctx=None):
    """Gradients of sum(forward()), and the peak above the start."""
    leaves = [p for layer in layers for p in layer.parameters()] + [x]
    with torch_sac.memory.track() as m:
        if ctx is None:
            out = forward()
        else:
            with ctx as region:
                out = forward()
        got = torch.autograd.grad(out.sum(), leaves)
        del out
    return got, m.peak, (region if ctx is not None else None)


def tanh_replays(region):
    return tanh_row(region)["replayed"]


def run_first_sweep_plan(forward, budget_bytes, layers):
    """The plan the planner makes for a given budget: the first sweep of a
    recompute-everything region, kept by forward. Leaves the plan's
    gradients in .grad."""
    replay_budget = torch_sac.ReplayBudget(budget_bytes, counts_saved=True)
    with torch_sac.sac_context(
        torch_sac.policies.recompute_all(), replay_budget=replay_budget
    ) as r:
        out = forward()
    out.sum().backward()
    saved = _first_sweep(r.replay_schedule())
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    policy = torch_sac.ReplaySchedule([], saved).policy()
    with torch_sac.sac_context(policy, replay_budget=replay_budget) as region:
        out = forward()
    out.sum().backward()
    return region


@pytest.mark.adapter_independent
@pytest.mark.parametrize("length", [3, 5, 8])
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_milp_oracle_agrees_with_the_chain_dp(length, slots):
    # Forward is the first sweep: the optimum with forward free is the
    # reversal's optimum minus one sweep (what the plan relies on).
    assert (
        min_recompute(chain_deps(length), list(range(length, 0, -1)), slots)
        == min_steps(length, slots) - length
    )


@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("slots", [2, 3, 5, 8])
def test_first_sweep_plan_is_optimal_on_chains(n, slots):
    layers, x, forward, size = tanh_chain(n, batch=32)
    region = run_first_sweep_plan(forward, slots * size, layers)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    # The output is alive: backward asks for x_{n-1} first, n-1 steps.
    assert tanh_replays(region) == min_steps(n - 1, slots) - (n - 1)
    stats = region.stats()
    assert stats["spaced_choices"] == 0
    assert stats["peak_held_bytes"] <= slots * size


@pytest.mark.parametrize("n", [6, 9])
@pytest.mark.parametrize("slots", [2, 3, 4])
def test_first_sweep_plan_against_the_milp_on_chains(n, slots):
    layers, x, forward, size = tanh_chain(n, batch=32)
    region = run_first_sweep_plan(forward, slots * size, layers)
    assert tanh_replays(region) == min_recompute(
        chain_deps(n - 1), list(range(n - 1, 0, -1)), slots
    )


# Graphs that are not chains: step i also reads x_j for j in reads(i, n).
SKIP_GRAPHS = {
    "before_last": lambda i, n: [i - 2] if i >= 2 else [],
    "every_third": lambda i, n: [i - 3] if i >= 3 and i % 3 == 0 else [],
    "u_net": lambda i, n: [n - i] if i > n // 2 and n - i >= 1 else [],
}
# Replays of the engine (first-sweep plan, per-rebuild heuristic) and of the
# MILP's optimum, measured: (graph, n, slots) -> (engine, MILP). Costs are
# estimated, not timed, so these are reproducible. Chains of single tensors
# and the "before last" skips are solved optimally; long U-Net-like skips
# are not (cuts of mixed sizes; up to 3x): docs/design.md, "Peak plans".
SKIP_GAPS = {
    ("before_last", 8, 2): (9, 9),
    ("before_last", 10, 3): (8, 8),
    ("before_last", 10, 4): (5, 5),
    ("every_third", 8, 3): (4, 4),
    ("every_third", 10, 3): (8, 7),
    ("every_third", 10, 4): (6, 5),
    ("u_net", 8, 2): (8, 8),
    ("u_net", 8, 3): (10, 4),
    ("u_net", 10, 3): (9, 8),
    ("u_net", 10, 4): (15, 5),
}


@pytest.mark.parametrize("graph,n,slots", sorted(SKIP_GAPS))
def test_gap_to_the_milp_on_graphs_with_skips(graph, n, slots):
    reads = functools.partial(SKIP_GRAPHS[graph], n=n)
    layers, x, forward, size = tanh_chain(n, batch=32, reads=reads)
    forward().sum().backward()
    want = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    region = run_first_sweep_plan(forward, slots * size, layers)
    assert_bitwise([p.grad for layer in layers for p in layer.parameters()], want)
    assert region.stats()["peak_held_bytes"] <= slots * size
    engine = tanh_replays(region)
    deps = [[]] + [[i - 1] + reads(i) for i in range(1, n)]
    best = min_recompute(deps, list(range(n - 1, 0, -1)), slots)
    recorded_engine, recorded_best = SKIP_GAPS[(graph, n, slots)]
    assert best == recorded_best
    # The MILP bounds every schedule within the budget; the engine may get
    # better than recorded, never worse.
    assert best <= engine <= recorded_engine


@pytest.mark.parametrize("n,fraction", [(12, 0.8), (12, 0.65), (24, 0.8), (24, 0.5), (24, 0.4)])
def test_plan_fits_the_peak_and_is_bitwise(n, fraction):
    layers, x, forward, size = tanh_chain(n, batch=512)
    want, plain_peak, _ = grads_of(forward, layers, x)
    peak = int(plain_peak * fraction)
    plan = budget(forward, peak_bytes=peak)
    assert plan.measured_peak <= peak
    assert plan.solver == "optimal reversal" and plan.optimal
    got, measured, region = grads_of(forward, layers, x, torch_sac.sac_context(plan))
    assert_bitwise(got, want)
    assert measured <= peak
    # Forward kept the first sweep; the replays are the optimum for the
    # slots the budget holds.
    slots = plan.replay_budget.bytes // size
    assert tanh_replays(region) == min_steps(n - 1, slots) - (n - 1)
    assert region.stats()["peak_held_bytes"] <= plan.replay_budget.bytes


def test_a_larger_peak_never_recomputes_more():
    layers, x, forward, size = tanh_chain(16, batch=512)
    _, plain_peak, _ = grads_of(forward, layers, x)
    replays = [
        budget(forward, peak_bytes=int(plain_peak * f)).recomputed_ops for f in (0.4, 0.6, 0.8)
    ]
    assert replays == sorted(replays, reverse=True)
    assert replays[0] > replays[-1]


def test_plan_that_fits_without_checkpointing_saves_everything():
    layers, x, forward, size = tanh_chain(4, batch=512)
    plan = budget(forward, peak_bytes=1 << 40)
    assert plan.solver == "none needed" and plan.optimal
    assert plan.saved is None and plan.replay_budget is None and plan.recomputed_ops == 0
    want, _, _ = grads_of(forward, layers, x)
    got, _, region = grads_of(forward, layers, x, torch_sac.sac_context(plan))
    assert_bitwise(got, want)
    assert region.stats()["replayed_ops"] == 0


def test_plan_on_a_transformer_chain():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, depth=6, dropout=0.1)
    tokens = torch.randint(0, 64, (4, 64))
    leaves = list(model.parameters())

    def loss():
        return model(tokens).float().pow(2).mean()

    def step(ctx=None):
        torch.manual_seed(1)  # the same dropout masks in every step
        with torch_sac.memory.track() as m:
            if ctx is None:
                out = loss()
            else:
                with ctx:
                    out = loss()
            got = torch.autograd.grad(out, leaves)
            del out
        return got, m.peak

    want, plain_peak = step()
    peak = int(plain_peak * 0.6)
    plan = budget(loss, peak_bytes=peak)
    assert plan.measured_peak <= peak and plan.recomputed_ops > 0
    got, measured = step(torch_sac.sac_context(plan))
    assert_bitwise(got, want)
    assert measured <= peak
    assert all(p.grad is None for p in leaves), "planning left gradients behind"
    table = plan.table()
    assert "peak plan" in table and "aten::" in table


def test_plan_restores_the_rng_state():
    layers, x, forward, size = tanh_chain(6, batch=512)

    def dropped():
        return torch.nn.functional.dropout(forward(), 0.5)

    peak = int(grads_of(dropped, layers, x)[1] * 0.8)
    state = torch.get_rng_state()
    assert budget(dropped, peak_bytes=peak).recomputed_ops > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_save_and_load(tmp_path):
    layers, x, forward, size = tanh_chain(12, batch=512)
    _, plain_peak, _ = grads_of(forward, layers, x)
    plan = budget(forward, peak_bytes=int(plain_peak * 0.5))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = torch_sac.PeakPlan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.replay_budget == plan.replay_budget and loaded.saved == plan.saved
    want, _, _ = grads_of(forward, layers, x)
    got, _, region = grads_of(forward, layers, x, torch_sac.sac_context(loaded))
    assert_bitwise(got, want)
    assert region.stats()["replayed_ops"] == plan.recomputed_ops
    # The recorded schedule runs exactly too.
    got, _, _ = grads_of(
        forward,
        layers,
        x,
        torch_sac.sac_context(loaded.schedule.policy(), replay_schedule=loaded.schedule),
    )
    assert_bitwise(got, want)
    with pytest.raises(ValueError, match="peak_plan/5"):
        torch_sac.PeakPlan.from_dict({"format": "other"})


def test_a_plan_saved_in_format_1_loads_with_the_new_names():
    """Format 1 said recomputed_ops/recompute_seconds (the drop-in's former
    words); format 2 says replayed_ops/replay_seconds, as both engines'
    stats do. The old names stay readable as deprecated aliases."""
    layers, x, forward, size = tanh_chain(8, batch=512)
    plan = budget(forward, peak_bytes=int(grads_of(forward, layers, x)[1] * 0.7))
    data = plan.to_dict()
    assert data["format"] == "torch_sac.peak_plan/5" and "recomputed_ops" not in data
    # Format 5's: what the planning run kept and dropped, per block.
    measured = ("kept_ops", "kept_bytes", "dropped_ops", "dropped_bytes", "offloaded_bytes")
    four = {k: v for k, v in data.items() if k not in (*measured, "block_rows")}
    unmeasured = dict(data, **dict.fromkeys(measured), block_rows=None)
    old = dict(four, format="torch_sac.peak_plan/1")
    del old["blocks"]  # format 3's
    del old["offloaded"]  # format 4's
    old["recomputed_ops"] = old.pop("replayed_ops")
    old["recompute_seconds"] = old.pop("replay_seconds")
    loaded = torch_sac.PeakPlan.from_dict(old)
    assert loaded.replayed_ops == plan.replayed_ops == plan.recomputed_ops
    assert loaded.replay_seconds == plan.replay_seconds == plan.recompute_seconds
    assert loaded.to_dict() == unmeasured
    # Format 2: no blocks.
    two = dict(four, format="torch_sac.peak_plan/2")
    del two["blocks"], two["offloaded"]
    assert torch_sac.PeakPlan.from_dict(two).to_dict() == unmeasured
    # A plan of format 4 says what it knows: not "nothing dropped".
    text = torch_sac.PeakPlan.from_dict(dict(four, format="torch_sac.peak_plan/4")).table()
    assert "nothing dropped" not in text and f"keeps {len(plan.saved)} op calls" in text


def test_checkpoint_takes_a_plan():
    layers, x, forward, size = tanh_chain(8, batch=512)
    plan = budget(forward, peak_bytes=int(grads_of(forward, layers, x)[1] * 0.7))
    want, _, _ = grads_of(forward, layers, x)
    out = torch_sac.checkpoint(forward, policy=plan)
    got = torch.autograd.grad(out.sum(), [p for layer in layers for p in layer.parameters()] + [x])
    assert_bitwise(got, want)


def test_errors():
    layers, x, forward, size = tanh_chain(6, batch=512)
    with pytest.raises(ValueError, match="below the least peak"):
        budget(forward, peak_bytes=1024)
    with pytest.raises(ValueError, match="without bytes, fraction or modules"):
        budget(forward, peak_bytes=1 << 20, bytes=100)
    with pytest.raises(ValueError, match="peak_bytes must be an int > 0"):
        budget(forward, peak_bytes=0)
    with pytest.raises(ValueError, match="do not require grad"):
        budget(lambda: torch.ones(3), peak_bytes=1)
    plan = budget(forward, peak_bytes=1 << 40)
    with pytest.raises(TypeError, match="runs as one region"):
        torch_sac.create_selective_checkpoint_contexts(plan)
    with pytest.raises(TypeError, match="ReplayBudget"):
        torch_sac.sac_context(torch_sac.policies.recompute_all(), replay_budget=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        torch_sac.ReplayBudget(-1)
    with pytest.raises(TypeError, match="counts_saved"):
        torch_sac.ReplayBudget(10, counts_saved=1)
    for share in (0, 1.5, True):
        with pytest.raises(ValueError, match="checkpoint_share"):
            torch_sac.ReplayBudget(10, checkpoint_share=share)


def test_budget_counting_saved_outputs_bounds_them_too():
    # Forward keeps every 4th addmm output (4 tensors): a budget that counts
    # them leaves less room for rebuilt tensors, so backward recomputes more.
    layers, x, forward, size = tanh_chain(16, batch=32)
    want, _, _ = grads_of(forward, layers, x)
    stats = {}
    for counts_saved in (False, True):
        policy = torch_sac.policies.every_nth(torch.ops.aten.addmm, n=4)
        ctx = torch_sac.sac_context(
            policy, replay_budget=torch_sac.ReplayBudget(6 * size, counts_saved)
        )
        got, _, region = grads_of(forward, layers, x, ctx)
        assert_bitwise(got, want)
        stats[counts_saved] = region.stats()
    assert stats[True]["saved_bytes"] == 4 * size
    assert stats[True]["peak_held_bytes"] <= 6 * size
    assert stats[False]["peak_held_bytes"] == 0  # measured only when counted
    assert stats[True]["replayed_ops"] > stats[False]["replayed_ops"]


def test_saved_outputs_over_the_budget_leave_only_the_tensor_handed_over():
    # The kept outputs cannot be let go of: with more of them alive than the
    # budget, each rebuild keeps nothing but the tensor it hands over.
    layers, x, forward, size = tanh_chain(16, batch=32)
    want, _, _ = grads_of(forward, layers, x)
    policy = torch_sac.policies.every_nth(torch.ops.aten.addmm, n=4)
    ctx = torch_sac.sac_context(policy, replay_budget=torch_sac.ReplayBudget(2 * size, True))
    got, _, region = grads_of(forward, layers, x, ctx)
    assert_bitwise(got, want)
    stats = region.stats()
    assert stats["peak_memo_bytes"] == size
    assert stats["peak_held_bytes"] <= stats["saved_bytes"] + size


def test_checkpoint_share_changes_the_choice_not_the_gradients():
    # A chain with skips (cuts of two sizes: the spaced heuristic) under one
    # budget, three shares: gradients bitwise; the budget holds for each.
    reads = functools.partial(SKIP_GRAPHS["every_third"], n=16)
    layers, x, forward, size = tanh_chain(16, batch=32, reads=reads)
    want, _, _ = grads_of(forward, layers, x)
    replays = set()
    for share in (0.5, 1 / 8, 1 / 32):
        budget_ = torch_sac.ReplayBudget(6 * size, counts_saved=True, checkpoint_share=share)
        got, _, region = grads_of(
            forward,
            layers,
            x,
            torch_sac.sac_context(torch_sac.policies.recompute_all(), replay_budget=budget_),
        )
        assert_bitwise(got, want)
        assert region.stats()["peak_held_bytes"] <= 6 * size
        replays.add(region.stats()["replayed_ops"])
    assert len(replays) > 1, "the share made no difference: the test no longer covers it"


def test_independent_chains_are_not_claimed_optimal():
    # The first sweep covers one chain only: each rebuild may be an optimal
    # reversal, but the plan is not proven optimal (found by the adversarial
    # review: three chains reported optimal=True).
    chains = [tanh_chain(8, seed=s, batch=512) for s in range(3)]

    def forward():
        return sum(f() for _, _, f, _ in chains)

    leaves = [p for layers, x, _, _ in chains for layer in layers for p in layer.parameters()]
    with torch_sac.memory.track() as m:
        torch.autograd.grad(forward().sum(), leaves)
    plan = budget(forward, peak_bytes=int(m.peak * 0.7))
    assert plan.recomputed_ops > 0
    assert plan.solver != "optimal reversal" and not plan.optimal
    # With room for it, forward keeps the first sweeps of several chains
    # (tanh calls 0-7 are chain 0's, 8-15 chain 1's, 16-23 chain 2's).
    roomy = budget(forward, peak_bytes=int(m.peak * 0.9))
    chains_swept = {call // 8 for op, call in roomy.saved if op == "aten::tanh.default"}
    assert len(chains_swept) >= 2, roomy.saved
    assert roomy.measured_peak <= roomy.peak_bytes


# --------------------------------------------------------------------------
# Peak plans on real-ish models: BatchNorm, dropout, in-place ops and views,
# optimizer steps, retain_graph, threads, kwargs, structured outputs,
# checkpoints inside the planned function; the planner's input errors
# --------------------------------------------------------------------------


class Block(nn.Module):
    """Linear, BatchNorm, dropout, a wider linear sliced in two (views), an
    in-place ReLU on one slice, a transpose round trip, a residual add."""

    def __init__(self, w):
        super().__init__()
        self.lin = nn.Linear(w, w)
        self.bn = nn.BatchNorm1d(w)
        self.wide = nn.Linear(w, 2 * w)

    def forward(self, h):
        y = F.dropout(self.bn(self.lin(h)), 0.3, training=self.training)
        z = self.wide(y)
        a, b = z[:, : z.shape[1] // 2], z[:, z.shape[1] // 2 :]
        y = a.relu_() * torch.sigmoid(b)
        y = y.t().contiguous().t()
        return h + y


def bn_model(n=5, w=32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(w) for _ in range(n)])


def train_step(model, x, ctx=None, seed=5):
    """One forward+backward (``.backward()``, grads into .grad) with a fixed
    RNG; returns the grads, the state dict after, and the peak."""
    torch.manual_seed(seed)
    with torch_sac.memory.track() as m:
        if ctx is None:
            loss = model(x).pow(2).mean()
        else:
            with ctx:
                loss = model(x).pow(2).mean()
        loss.backward()
        del loss
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, copy.deepcopy(model.state_dict()), m.peak


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"state {k} differs"


@pytest.fixture(scope="module")
def bn_plan():
    """A plan for bn_model at 60% of its peak, planned from a saved state."""
    torch.set_num_threads(1)
    model = bn_model()
    x = torch.randn(128, 32)
    state0 = copy.deepcopy(model.state_dict())
    want, after_plain, peak = train_step(model, x)
    model.load_state_dict(state0)
    rng = torch.get_rng_state()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    seen = []  # num_batches_tracked after each BatchNorm forward while planning
    hooks = [
        m.register_forward_hook(lambda m, i, o: seen.append(m.num_batches_tracked.item()))
        for m in bns
    ]
    plan = budget(lambda: model(x).pow(2).mean(), peak_bytes=int(peak * 0.6))
    for h in hooks:
        h.remove()
    info = {
        "rng_same": torch.equal(rng, torch.get_rng_state()),
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
        "bn_batches": [m.num_batches_tracked.item() for m in bns],
        "bn_seen": seen,
        "state_same": all(torch.equal(v, state0[k]) for k, v in model.state_dict().items()),
        "dispatch": torch._C._len_torch_dispatch_stack(),
    }
    model.load_state_dict(state0)
    return model, x, state0, want, after_plain, plan, info


def test_planner_leaves_no_grad_no_mode_and_restores_the_rng(bn_plan):
    model, x, state0, want, after_plain, plan, info = bn_plan
    assert info["rng_same"]
    assert info["grads_left"] == []
    assert info["dispatch"] == 0
    # Documented: fn really runs in every measured run, and each forward
    # moves BatchNorm's statistics exactly once, from where they were before
    # planning (every run measures the same step); planning puts them back.
    assert info["bn_seen"] == [1] * (5 * plan.planning_runs)
    assert info["bn_batches"] == [0] * 5 and info["state_same"]
    assert plan.recomputed_ops > 0 and plan.measured_peak <= plan.peak_bytes


def test_plan_with_batchnorm_dropout_inplace_views_is_bitwise_and_updates_stats_once(bn_plan):
    model, x, state0, want, after_plain, plan, _ = bn_plan
    model.load_state_dict(state0)
    got, after, peak = train_step(model, x, torch_sac.sac_context(plan))
    assert_same(got, want)
    assert_state_equal(after, after_plain)  # running stats moved exactly once
    assert peak <= plan.peak_bytes


def test_plan_reused_over_training_steps_with_an_optimizer(bn_plan):
    model, x, state0, _, _, plan, _ = bn_plan

    def train(use_plan):
        model.load_state_dict(state0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(3):
            torch.manual_seed(100 + i)
            with torch_sac.sac_context(plan) if use_plan else contextlib.nullcontext():
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return copy.deepcopy(model.state_dict())

    assert_state_equal(train(True), train(False))


def test_plan_with_retain_graph_and_backward_on_another_thread(bn_plan):
    model, x, state0, _, _, plan, _ = bn_plan

    def step(ctx, how):
        model.load_state_dict(state0)
        torch.manual_seed(3)
        with ctx:
            loss = model(x).pow(2).mean()
        if how == "retain":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            backward_on_a_thread(loss)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    for how in ("retain", "thread"):
        assert_same(step(torch_sac.sac_context(plan), how), step(contextlib.nullcontext(), how))


def test_plan_in_eval_mode_and_with_other_batch_sizes(bn_plan):
    model, _, state0, _, _, plan, _ = bn_plan
    for train_mode, batch in ((True, 7), (True, 512), (False, 64)):
        model.load_state_dict(state0)
        model.train(train_mode)
        xb = torch.randn(batch, 32, generator=torch.Generator().manual_seed(batch))
        want, sd_want, _ = train_step(model, xb)
        model.load_state_dict(state0)
        got, sd_got, _ = train_step(model, xb, torch_sac.sac_context(plan))
        assert_same(got, want, f"batch {batch}")
        assert_state_equal(sd_got, sd_want)
    model.train(True)


def test_plan_save_load_round_trip_runs_exactly(bn_plan, tmp_path):
    model, x, state0, want, after_plain, plan, _ = bn_plan
    plan.save(tmp_path / "p.json")
    loaded = torch_sac.PeakPlan.load(tmp_path / "p.json")
    assert loaded.to_dict() == plan.to_dict()
    model.load_state_dict(state0)
    got, after, _ = train_step(model, x, torch_sac.sac_context(loaded))
    assert_same(got, want)
    assert_state_equal(after, after_plain)
    text = loaded.table()
    assert "peak plan" in text and "aten::" in text


@pytest.mark.parametrize("frac", [0.9, 0.6])
def test_plan_with_kwargs_and_rerun_peak_within_budget(frac):
    layers, x, leaves, fwd = scaled_tanh_chain(12, batch=256)
    want, peak, _ = measured(lambda: fwd(x, scale=2.0), leaves)
    plan = budget(fwd, x, scale=2.0, peak_bytes=int(peak * frac))
    assert plan.measured_peak <= plan.peak_bytes
    got, rerun, region = measured(lambda: fwd(x, scale=2.0), leaves, torch_sac.sac_context(plan))
    assert_same(got, want)
    assert rerun <= plan.peak_bytes
    assert region.stats()["replayed_ops"] == plan.recomputed_ops
    assert all(p.grad is None for p in leaves)


def test_plan_for_tuple_and_dict_outputs_some_not_requiring_grad():
    layers, x, leaves, fwd = scaled_tanh_chain(8, batch=128)

    def many():
        return (fwd(), fwd().detach(), {"k": fwd() * 3, "n": 4, "i": fwd().argmax(1)})

    def used():
        out = many()
        return out[0], out[2]["k"]

    want, peak, _ = measured(used, leaves)
    plan = budget(many, peak_bytes=int(peak * 0.8))

    got, _, _ = measured(used, leaves, torch_sac.sac_context(plan))
    assert_same(got, want)
    # checkpoint(policy=plan) returns the structure as is.
    out = torch_sac.checkpoint(many, policy=plan)
    assert isinstance(out[2], dict) and out[2]["n"] == 4 and not out[1].requires_grad
    assert_same(torch.autograd.grad(weighted((out[0], out[2]["k"])), leaves), want)


def test_plan_on_a_transformer_with_dropout_and_a_convnet_with_batchnorm():
    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                [
                    nn.Sequential(
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
                    )
                    for _ in range(5)
                ]
            )

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 32))
    image = torch.randn(4, 8, 12, 12)
    cases = [
        (
            TinyGPT(vocab=32, dim=32, heads=2, depth=4, dropout=0.1),
            lambda m: m(tokens).float().pow(2).mean(),
        ),
        (ConvNet(), lambda m: m(image).pow(2).mean()),
    ]
    for model, loss in cases:
        params = list(model.parameters())
        state0 = copy.deepcopy(model.state_dict())
        want, peak, _ = measured(lambda: loss(model), params)
        after_plain = copy.deepcopy(model.state_dict())
        for frac in (0.8, 0.5):
            try:
                plan = budget(lambda: loss(model), peak_bytes=int(peak * frac))
            except ValueError as e:
                assert "below the least peak" in str(e)
                continue
            model.load_state_dict(state0)
            got, rerun, _ = measured(lambda: loss(model), params, torch_sac.sac_context(plan))
            assert_same(got, want, f"{type(model).__name__} at {frac}")
            assert_state_equal(model.state_dict(), after_plain)
            assert rerun <= plan.peak_bytes
            assert all(p.grad is None for p in params)


def test_plan_with_checkpoints_and_regions_inside_fn():
    layers, x, leaves, fwd = scaled_tanh_chain(9, batch=64)

    def blk(i, h):
        return torch.tanh(layers[i](h))

    def body(kind):
        h = x
        for i in range(9):
            if i % 3 == 0 and kind == "nonreentrant":
                h = tc.checkpoint(blk, i, h, use_reentrant=False)
            elif i % 3 == 0 and kind == "dropin":
                h = tc.checkpoint(
                    blk,
                    i,
                    h,
                    use_reentrant=False,
                    context_fn=functools.partial(
                        torch_sac.create_selective_checkpoint_contexts, RA()
                    ),
                )
            elif i % 3 == 0 and kind == "region":
                h = torch_sac.checkpoint(blk, i, h, policy=P.save_all())
            else:
                h = blk(i, h)
        return h

    want, _, _ = measured(lambda: body("plain"), leaves)
    for kind in ("nonreentrant", "dropin", "region"):
        _, peak, _ = measured(lambda: body(kind), leaves)
        plan = budget(body, kind, peak_bytes=int(peak * 0.9))
        assert all(p.grad is None for p in leaves)
        got, _, _ = measured(lambda: body(kind), leaves, torch_sac.sac_context(plan))
        assert_same(got, want, kind)


def test_planner_error_in_fn_on_a_later_run_leaves_nothing():
    layers, x, leaves, fwd = scaled_tanh_chain(8)
    _, peak, _ = measured(fwd, leaves)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 3:  # inside a planning region (this plan takes 3 runs)
            raise KeyError("boom")
        return fwd()

    rng = torch.get_rng_state()
    with pytest.raises(KeyError, match="boom"):
        budget(flaky, peak_bytes=int(peak * 0.85))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in leaves)
    assert_clean()
    # The next plan works.
    assert budget(fwd, peak_bytes=int(peak * 0.85)).measured_peak <= int(peak * 0.85)


def test_planner_argument_errors_are_clear():
    layers, x, leaves, fwd = scaled_tanh_chain(6)
    for bad in (0, -5, 1e6, True, "1000", None.__class__):
        with pytest.raises((ValueError, TypeError), match="peak_bytes"):
            budget(fwd, peak_bytes=bad)
    with pytest.raises(TypeError, match="fn must be callable"):
        budget(3, peak_bytes=100)
    with pytest.raises(ValueError, match="do not require grad"):
        budget(lambda: fwd().detach(), peak_bytes=100)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="do not require grad"):
            budget(fwd, peak_bytes=100)
    with pytest.raises(ValueError, match="below the least peak"):
        budget(fwd, peak_bytes=64)
    with pytest.raises(ValueError, match="without bytes, fraction or modules"):
        budget(fwd, peak_bytes=1 << 20, fraction=0.5)
    with pytest.raises(ValueError, match="peak_plan/5"):
        torch_sac.PeakPlan.from_dict([1])
    d = budget(fwd, peak_bytes=1 << 40).to_dict()
    with pytest.raises(ValueError, match=">= 0"):
        torch_sac.PeakPlan.from_dict({**d, "replay_budget": [-4, True]})
    with pytest.raises(ValueError, match="aten::mm.default"):
        torch_sac.PeakPlan.from_dict({**d, "saved": [["nonsense", 1]]})
    # A plan nested in another region is refused (its budget applies only
    # to an outermost region), and leaves nothing installed.
    plan = budget(fwd, peak_bytes=int(measured(fwd, leaves)[1] * 0.9))
    assert plan.replay_budget is not None
    with torch_sac.sac_context(RA()):
        with pytest.raises(ValueError, match="nested"):
            with torch_sac.sac_context(plan):
                pass
    # The drop-in's contexts take policies, not a plan; apply_sac takes it
    # only as the one region around the model.
    with pytest.raises(TypeError, match="runs as one region"):
        torch_sac.create_selective_checkpoint_contexts(plan)
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="PeakPlan is for one region"):
        torch_sac.apply_sac(seq, plan, modules=nn.Linear)
    assert "forward" not in vars(seq) and all("forward" not in vars(m) for m in seq)
    assert_clean()


def test_planner_on_fn_returning_a_leaf_raises_a_clear_error():
    w = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(ValueError, match="torch_sac"):
        budget(lambda: w, peak_bytes=10)


def test_peak_plan_from_dict_with_missing_or_malformed_fields_raises_value_error():
    with pytest.raises(ValueError, match="peak_plan"):
        torch_sac.PeakPlan.from_dict({"format": "torch_sac.peak_plan/1"})
    layers, x, leaves, fwd = scaled_tanh_chain(4)
    d = budget(fwd, peak_bytes=1 << 40).to_dict()
    with pytest.raises(ValueError, match="replay_budget"):
        torch_sac.PeakPlan.from_dict({**d, "replay_budget": 5})


def test_planner_rejects_invalid_cost_with_peak_bytes():
    layers, x, leaves, fwd = scaled_tanh_chain(4)
    with pytest.raises(ValueError, match="cost"):
        budget(fwd, peak_bytes=1 << 40, cost="bogus")


def test_planner_accepts_numpy_integer_peak_bytes_like_replay_budget_does():
    np = pytest.importorskip("numpy")
    assert torch_sac.ReplayBudget(np.int64(5)).bytes == 5
    layers, x, leaves, fwd = scaled_tanh_chain(4)
    assert budget(fwd, peak_bytes=np.int64(1 << 40)).solver == "none needed"


def test_planner_inside_an_open_region_says_so():
    layers, x, leaves, fwd = scaled_tanh_chain(6)
    with torch_sac.sac_context(RA()):
        with pytest.raises(RuntimeError, match=r"policies\.budget.*plan outside it"):
            budget(fwd, peak_bytes=60000)


def test_none_needed_plan_counts_the_replays_of_regions_inside_fn():
    x = torch.randn(16, 32, requires_grad=True)

    def fn():
        with torch_sac.sac_context(RA()):
            return torch.sin(torch.tanh(x))

    plan = budget(fn, peak_bytes=1 << 30)
    assert plan.solver == "none needed"
    with torch_sac.sac_context(plan) as region:
        out = fn()
    out.sum().backward()
    assert region.stats()["replayed_ops"] == plan.recomputed_ops


def test_a_step_that_runs_its_own_backward_is_measured_with_it():
    # A step calling backward itself: that backward is the run's (its graph
    # is freed, planning runs none after it); one returning nothing to run
    # backward from, and running none, is refused clearly.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x = torch.randn(256, 32)

    def step():
        loss = model(x).sum()
        loss.backward()
        return loss

    plan = budget(step, peak_bytes=1 << 40)
    assert plan.solver == "none needed" and plan.measured_peak > 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="returned no tensor"):
        budget(lambda: None, peak_bytes=1 << 40)
