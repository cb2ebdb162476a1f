"""Adversarial tests of three features: ``ReplayBudget(b, counts_saved=True)``,
peak plans (``policies.budget(fn, ..., peak_bytes=)``) and nested regions
that recompute their own tensors again.

Gradients are compared bitwise with plain autograd (CPU); BatchNorm running
statistics must move exactly once per forward; every run (planning
included) must leave no dispatch mode, region, ``.grad`` or RNG change
behind. The planner's input errors found here are fixed (their tests
assert the errors torch_sac now raises).
"""

import contextlib
import copy
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_sac
import torch_sac.region
from torch_sac.models import TinyGPT

from test_adversarial_replay import _leaves_grads, assert_same, on_threads

try:
    from hypothesis import HealthCheck, given, settings, strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False

P = torch_sac.policies
RA = P.recompute_all
aten = torch.ops.aten
budget = P.budget
RB = torch_sac.ReplayBudget

POLICIES = {
    "recompute_all": RA,
    "save_matmuls": P.save_matmuls,
    "save_all": P.save_all,
    "every2": lambda: P.every_nth([aten.tanh.default, aten.sin.default], 2),
}


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def assert_clean():
    assert torch_sac.region._stack() == [], "a region stayed on the stack"
    assert torch._C._len_torch_dispatch_stack() == 0, "a dispatch mode stayed installed"
    assert torch.is_grad_enabled()


def backward_on_a_thread(loss, **kwargs):
    """loss.backward() on another thread; its error, if any, is raised here."""
    with on_threads(lambda i: loss.backward(**kwargs)):
        pass


def backward(loss, how):
    """Backward as ``how`` says: "plain", "retain" (twice, retaining the graph
    the first time: gradients accumulate) or "thread" (on another thread)."""
    if how == "retain":
        loss.backward(retain_graph=True)
        loss.backward()
    elif how == "thread":
        backward_on_a_thread(loss)
    else:
        loss.backward()


def weighted(out):
    if isinstance(out, dict):
        return sum(weighted(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return sum(weighted(o) for o in out)
    g = torch.Generator().manual_seed(7)
    return (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()


def tanh_chain(n=10, width=32, batch=64, seed=0):
    torch.manual_seed(seed)
    layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])
    x = torch.randn(batch, width, requires_grad=True)
    leaves = list(layers.parameters()) + [x]

    def fwd(inp=None, scale=1.0):
        h = x if inp is None else inp
        for layer in layers:
            h = torch.tanh(layer(h))
        return h * scale

    return layers, x, leaves, fwd


def measured(fn, leaves, ctx=None, seed=1):
    """Gradients of weighted(fn()) w.r.t. leaves (autograd.grad) and the
    step's peak above its start."""
    torch.manual_seed(seed)
    region = None
    with torch_sac.memory.track() as m:
        if ctx is None:
            out = fn()
        else:
            with ctx as region:
                out = fn()
        got = torch.autograd.grad(weighted(out), leaves, allow_unused=True)
        del out
    return got, m.peak, region


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


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    assert_clean()


# --------------------------------------------------------------------------
# Peak plans on real-ish models
# --------------------------------------------------------------------------


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
    layers, x, leaves, fwd = tanh_chain(12, batch=256)
    want, peak, _ = measured(lambda: fwd(x, scale=2.0), leaves)
    plan = budget(fwd, x, scale=2.0, peak_bytes=int(peak * frac))
    assert plan.measured_peak <= plan.peak_bytes
    got, rerun, region = measured(lambda: fwd(x, scale=2.0), leaves, torch_sac.sac_context(plan))
    assert_same(got, want)
    assert rerun <= plan.peak_bytes
    assert region.stats()["replayed_ops"] == plan.recomputed_ops
    assert all(p.grad is None for p in leaves)


def test_plan_for_tuple_and_dict_outputs_some_not_requiring_grad():
    layers, x, leaves, fwd = tanh_chain(8, batch=128)

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
    layers, x, leaves, fwd = tanh_chain(9, batch=64)

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
    layers, x, leaves, fwd = tanh_chain(8)
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
    layers, x, leaves, fwd = tanh_chain(6)
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
    with pytest.raises(ValueError, match="peak_plan/1"):
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
    with pytest.raises(TypeError, match="runs as one region"):
        torch_sac.apply_sac(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), plan)
    assert_clean()


def test_planner_on_fn_returning_a_leaf_raises_a_clear_error():
    w = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(ValueError, match="torch_sac"):
        budget(lambda: w, peak_bytes=10)


def test_peak_plan_from_dict_with_missing_or_malformed_fields_raises_value_error():
    with pytest.raises(ValueError, match="peak_plan"):
        torch_sac.PeakPlan.from_dict({"format": "torch_sac.peak_plan/1"})
    layers, x, leaves, fwd = tanh_chain(4)
    d = budget(fwd, peak_bytes=1 << 40).to_dict()
    with pytest.raises(ValueError, match="replay_budget"):
        torch_sac.PeakPlan.from_dict({**d, "replay_budget": 5})


def test_planner_rejects_invalid_cost_with_peak_bytes():
    layers, x, leaves, fwd = tanh_chain(4)
    with pytest.raises(ValueError, match="cost"):
        budget(fwd, peak_bytes=1 << 40, cost="bogus")


def test_planner_accepts_numpy_integer_peak_bytes_like_replay_budget_does():
    np = pytest.importorskip("numpy")
    assert torch_sac.ReplayBudget(np.int64(5)).bytes == 5
    layers, x, leaves, fwd = tanh_chain(4)
    assert budget(fwd, peak_bytes=np.int64(1 << 40)).solver == "none needed"


def test_planner_inside_an_open_region_says_so():
    layers, x, leaves, fwd = tanh_chain(6)
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


# --------------------------------------------------------------------------
# Budgets that count saved outputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["save_all", "save_matmuls", "every2", "recompute_all"])
@pytest.mark.parametrize("nbytes", [0, 1, 4096, 1 << 30])
def test_counts_saved_budget_with_policies_that_save_a_lot(policy, nbytes):
    layers, x, leaves, fwd = tanh_chain(10, width=16, batch=16)
    size = 16 * 16 * 4
    want, _, _ = measured(fwd, leaves)
    rb = RB(nbytes, counts_saved=True)
    got, _, region = measured(
        fwd, leaves, torch_sac.sac_context(POLICIES[policy](), replay_budget=rb)
    )
    assert_same(got, want)
    s = region.stats()
    assert s["peak_memo_bytes"] <= max(nbytes, size)
    assert s["peak_held_bytes"] <= max(nbytes, s["saved_bytes"] + size)
    if policy == "save_all":
        assert s["replayed_ops"] == 0 and s["dropped_ops"] == 0
    assert s["memo_bytes"] == 0  # nothing held after backward
    # The same run repeats its schedule exactly.
    schedule = region.replay_schedule()
    pol = schedule.policy() if schedule.saved else POLICIES[policy]()
    got, _, _ = measured(fwd, leaves, torch_sac.sac_context(pol, replay_schedule=schedule))
    assert_same(got, want)


def test_counts_saved_budget_with_retain_graph_and_thread():
    layers, x, leaves, fwd = tanh_chain(12, width=16, batch=16)

    def grads(ctx, how):
        torch.manual_seed(0)
        with ctx:
            out = fwd()
        loss = weighted(out)
        if how == "retain":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            backward_on_a_thread(loss)
        g = [p.grad.clone() for p in leaves]
        for p in leaves:
            p.grad = None
        return g

    for how in ("retain", "thread"):
        want = grads(contextlib.nullcontext(), how)
        for nbytes in (0, 3000):
            ctx = torch_sac.sac_context(
                P.every_nth(aten.addmm.default, 3), replay_budget=RB(nbytes, True)
            )
            assert_same(grads(ctx, how), want, f"{how} {nbytes}")


def test_replay_budget_argument_errors():
    with pytest.raises(TypeError, match="bytes must be an int"):
        RB(1.5)
    with pytest.raises(TypeError, match="bytes must be an int"):
        RB(True)
    with pytest.raises(ValueError, match=">= 0"):
        RB(-1, True)
    with pytest.raises(TypeError, match="counts_saved"):
        RB(10, counts_saved="yes")
    with pytest.raises(TypeError, match="replay_budget"):
        torch_sac.sac_context(RA(), replay_budget="10")
    with pytest.raises(TypeError, match="replay_budget"):
        torch_sac.checkpoint(lambda: None, policy=RA(), replay_budget=[1])
    assert_clean()


# --------------------------------------------------------------------------
# Nested regions
# --------------------------------------------------------------------------


def nested_program(n=12, width=16, batch=8, seed=0):
    """Three levels deep, sibling inner regions, an inner region whose output
    is unused, dropout inside the innermost one."""
    torch.manual_seed(seed)
    lin = [nn.Linear(width, width) for _ in range(n)]
    x = torch.randn(batch, width, requires_grad=True)
    leaves = [p for m in lin for p in m.parameters()] + [x]

    def lay(i, h):
        return torch.tanh(lin[i](h))

    def fn(ctxs):
        h = lay(0, x)
        with ctxs("a"):
            h = lay(1, h)
            with ctxs("b"):
                h = lay(2, h)
                with ctxs("c"):
                    h = F.dropout(lay(3, h), 0.3)
                    h = lay(4, h)
                h = lay(5, h)
            with ctxs("d"):
                _unused = lay(6, h) * 2  # noqa: F841
            with ctxs("e"):
                h = h + lay(7, h)
            h = lay(8, h)
        return lay(9, h)

    return fn, leaves


def _grads(fn, leaves, how="plain"):
    torch.manual_seed(1)
    out = fn()
    backward(weighted(out), how)
    return _leaves_grads(leaves)


@pytest.mark.parametrize("outer", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("inner", ["recompute_all", "save_all", "every2"])
@pytest.mark.parametrize("rb", [None, 0, 2000, RB(0, True), RB(3000, True)], ids=str)
def test_nested_three_levels_siblings_unused_budgets_schedules_threads(outer, inner, rb):
    fn, leaves = nested_program()
    plain = lambda: fn(lambda name: contextlib.nullcontext())  # noqa: E731
    kw = {} if rb is None else {"replay_budget": rb}
    regions = []

    def under(ctx_outer):
        def run():
            with ctx_outer() as r:
                out = fn(lambda name: torch_sac.sac_context(POLICIES[inner]()))
            regions.append(r)
            return out

        return run

    for how in ("plain", "retain", "thread"):
        want = _grads(plain, leaves, how)
        assert_same(
            _grads(under(lambda: torch_sac.sac_context(POLICIES[outer](), **kw)), leaves, how),
            want,
            how,
        )
        assert_clean()
    s = regions[0].stats()
    assert s["memo_bytes"] == 0
    if rb is not None:
        assert s["peak_memo_bytes"] <= max(rb if isinstance(rb, int) else rb.bytes, 8 * 16 * 4)
    # The recorded schedule runs again exactly.
    schedule = regions[0].replay_schedule()
    pol = schedule.policy() if schedule.saved else POLICIES[outer]()
    assert_same(
        _grads(under(lambda: torch_sac.sac_context(pol, replay_schedule=schedule)), leaves),
        _grads(plain, leaves),
    )


def test_nested_inner_region_recomputes_like_nested_checkpoints():
    # pre -> inner region (4 tanh) -> post under an outer recompute_all: the
    # inner region's internals are replayed twice, its output (read by the
    # outer level) once; a sibling region whose output is unused replays
    # nothing it does not need.
    torch.manual_seed(0)
    lin = [nn.Linear(16, 16) for _ in range(7)]
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [p for m in lin for p in m.parameters()] + [x]

    def fn(nested):
        ctx = (lambda: torch_sac.sac_context(RA())) if nested else contextlib.nullcontext
        h = torch.tanh(lin[0](x))
        with ctx():
            for i in range(1, 5):
                h = torch.tanh(lin[i](h))
        with ctx():
            _ = torch.sin(lin[5](h))  # unused
        return torch.tanh(lin[6](h))

    want = _grads(lambda: fn(False), leaves)
    for nested in (False, True):
        with torch_sac.sac_context(RA()) as region:
            out = fn(nested)
        got = torch.autograd.grad(weighted(out), leaves, allow_unused=True)
        assert_same(got, want)
        (row,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
        assert row["replays_by_call"] == ([1, 2, 2, 2, 1, 0] if nested else [1, 1, 1, 1, 1, 0])
        sin = [r for r in region.op_details() if r["op"] == "aten::sin.default"]
        assert not sin or sum(sin[0].get("replays_by_call", [0])) == 0


def test_exception_inside_inner_regions_keeps_the_outer_region_exact():
    torch.manual_seed(0)
    lin = nn.ModuleList([nn.Linear(32, 32) for _ in range(10)])
    x = torch.randn(64, 32, requires_grad=True)
    leaves = list(lin.parameters()) + [x]

    def fn(with_regions):
        h = x
        for i, layer in enumerate(lin):
            try:
                ctx = (
                    torch_sac.sac_context(P.save_all() if i % 2 else RA())
                    if with_regions
                    else contextlib.nullcontext()
                )
                with ctx:
                    h = torch.tanh(layer(h))
                    if i in (3, 6):
                        raise KeyError("inner")
            except KeyError:
                pass
        return h

    want = _grads(lambda: fn(False), leaves)
    for rb in (None, RB(0, True), RB(5000, True)):
        kw = {} if rb is None else {"replay_budget": rb}

        def run():
            with torch_sac.sac_context(RA(), **kw):
                return fn(True)

        assert_same(_grads(run, leaves), want)
        assert_clean()


def test_apply_sac_inside_an_outer_region_with_budgets():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)]
            )

        def forward(self, h):
            for layer in self.layers:
                h = layer(h)
            return h

    torch.manual_seed(1)
    m = M()
    x = torch.randn(16, 32, requires_grad=True)
    leaves = list(m.parameters()) + [x]
    want = _grads(lambda: m(x), leaves)
    handle = torch_sac.apply_sac(m, RA())
    try:
        for rb in (None, 0, RB(0, True), RB(20000, True)):
            kw = {} if rb is None else {"replay_budget": rb}

            def run():
                with torch_sac.sac_context(P.save_matmuls(), **kw):
                    return m(x)

            assert_same(_grads(run, leaves), want, str(rb))
            assert_same(_grads(run, leaves, "thread"), want, f"thread {rb}")
    finally:
        handle.remove()
    # A budget on the inner (apply_sac) regions is refused when nested.
    handle = torch_sac.apply_sac(m, RA(), replay_budget=100)
    try:
        with torch_sac.sac_context(RA()):
            with pytest.raises(ValueError, match="nested"):
                m(x)
    finally:
        handle.remove()
    assert_clean()


def test_peak_plan_of_fn_with_nested_regions():
    fn, leaves = nested_program(width=32, batch=64)

    def body():
        return fn(lambda name: torch_sac.sac_context(RA() if name in "ace" else P.save_all()))

    want, peak, _ = measured(lambda: fn(lambda name: contextlib.nullcontext()), leaves)
    plan = budget(body, peak_bytes=int(peak * 0.7))
    assert plan.replay_budget is not None
    got, rerun, region = measured(body, leaves, torch_sac.sac_context(plan))
    assert_same(got, want)
    assert rerun <= plan.peak_bytes
    assert region.stats()["replayed_ops"] == plan.recomputed_ops


# --------------------------------------------------------------------------
# Random programs: nested regions, budgets, in-place ops, BatchNorm; and
# peak plans of them
# --------------------------------------------------------------------------

_KINDS = [
    "tanh",
    "sin",
    "sigmoid",
    "relu_",
    "dropout",
    "ln",
    "bn",
    "maxidx",
    "mul",
    "add",
    "matmul",
    "view",
    "enter",
    "exit",
    "unused",
    "inplace",
    "addinplace",
]


def random_program(ops, seed, inner_policies, batch=4, width=8):
    torch.manual_seed(seed)
    x = torch.randn(batch, width, requires_grad=True)
    ws = [torch.randn(width, width, requires_grad=True) for _ in range(2)]
    running = (torch.zeros(width), torch.ones(width))
    leaves = [x, *ws]

    def fn(regions=True):
        pool = [x * 1.0]
        with contextlib.ExitStack() as outer:
            open_ = []
            entered = 0
            for kind, i, j in ops:
                a, b = pool[i % len(pool)], pool[j % len(pool)]
                if kind == "enter":
                    if len(open_) < 4:
                        cm = contextlib.ExitStack()
                        if regions:
                            name = inner_policies[entered % len(inner_policies)]
                            cm.enter_context(torch_sac.sac_context(POLICIES[name]()))
                        entered += 1
                        outer.enter_context(cm)
                        open_.append(cm)
                    continue
                if kind == "exit":
                    if open_:
                        open_.pop().close()
                    continue
                if kind == "inplace":
                    a.mul_(1.25)
                    continue
                if kind == "addinplace":
                    a.add_(b * 0.5)
                    continue
                if kind == "unused":
                    _ = torch.tanh(a) * b
                    continue
                y = {
                    "tanh": lambda: torch.tanh(a),
                    "sin": lambda: torch.sin(a),
                    "sigmoid": lambda: torch.sigmoid(a),
                    "relu_": lambda: (a * 1.5).relu_(),
                    "dropout": lambda: F.dropout(a, 0.25, training=True),
                    "ln": lambda: F.layer_norm(a, (width,)),
                    "bn": lambda: F.batch_norm(a, *running, training=True),
                    "maxidx": lambda: a * a.max(dim=1, keepdim=True)[0]
                    + torch.gather(a, 1, a.max(dim=1, keepdim=True)[1]),
                    "mul": lambda: a * b,
                    "add": lambda: a + b,
                    "matmul": lambda: a @ ws[j % 2],
                    "view": lambda: a.t().reshape(batch, width) * 0.5,
                }[kind]()
                pool.append(y)
            out = pool[-1] + 0.1 * sum(pool[-3:])
            while open_:
                open_.pop().close()
        return out

    def reset():
        running[0].zero_()
        running[1].fill_(1.0)

    return fn, leaves, running, reset


def _run_program(fn, leaves, running, reset, outer=None, how="plain", track=False, **kw):
    reset()
    torch.manual_seed(3)
    region = None
    with torch_sac.memory.track() if track else contextlib.nullcontext() as m:
        if outer is None:
            out = fn(regions=False)
        else:
            with torch_sac.sac_context(outer, **kw) as region:
                out = fn()
        loss = weighted(out)
        del out
        backward(loss, how)
        del loss
    return _leaves_grads(leaves), [b.clone() for b in running], region, (m.peak if track else None)


if HAVE_HYPOTHESIS:
    _step = st.tuples(st.sampled_from(_KINDS), st.integers(0, 30), st.integers(0, 30))
    _BUDGETS = [None, 0, 1, 200, 1000, RB(0, True), RB(300, True), RB(2000, True)]

    @settings(
        max_examples=int(os.environ.get("ADV_PEAK_FUZZ_EXAMPLES", "300")),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        ops=st.lists(_step, min_size=1, max_size=30),
        seed=st.integers(0, 5),
        outer=st.sampled_from(sorted(POLICIES)),
        inner=st.lists(st.sampled_from(sorted(POLICIES)), min_size=1, max_size=3),
        rb=st.sampled_from(_BUDGETS),
        how=st.sampled_from(["plain", "retain", "thread"]),
    )
    def test_random_nested_programs_are_exact(ops, seed, outer, inner, rb, how):
        fn, leaves, running, reset = random_program(ops, seed, inner)
        kw = {} if rb is None else {"replay_budget": rb}
        try:
            want, want_bufs, _, _ = _run_program(fn, leaves, running, reset, how=how)
        except RuntimeError:
            # Plain autograd refuses (a saved tensor modified in place): the
            # region must refuse too, and leave nothing installed.
            with pytest.raises(RuntimeError):
                _run_program(fn, leaves, running, reset, POLICIES[outer](), how, **kw)
            for t in leaves:
                t.grad = None
            assert_clean()
            return
        got, bufs, region, _ = _run_program(
            fn, leaves, running, reset, POLICIES[outer](), how, **kw
        )
        assert_same(got, want)
        assert_same(bufs, want_bufs, "running stats")
        assert_clean()
        s = region.stats()
        assert s["memo_bytes"] == 0
        if rb is not None:
            nbytes = rb if isinstance(rb, int) else rb.bytes
            assert s["peak_memo_bytes"] <= max(nbytes, 4 * 8 * 4)
        schedule = region.replay_schedule()
        pol = schedule.policy() if schedule.saved else POLICIES[outer]()
        got, bufs, _, _ = _run_program(
            fn, leaves, running, reset, pol, how, replay_schedule=schedule
        )
        assert_same(got, want, "schedule rerun")
        assert_same(bufs, want_bufs, "running stats (schedule rerun)")

    @settings(
        max_examples=int(os.environ.get("ADV_PEAK_PLAN_EXAMPLES", "150")),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        ops=st.lists(_step, min_size=4, max_size=30),
        seed=st.integers(0, 5),
        inner=st.lists(st.sampled_from(sorted(POLICIES)), min_size=1, max_size=3),
        frac=st.sampled_from([0.5, 0.7, 0.85, 0.95]),
        regions=st.booleans(),
    )
    def test_random_peak_plans_fit_and_are_exact(ops, seed, inner, frac, regions):
        fn, leaves, running, reset = random_program(ops, seed, inner, batch=16, width=32)
        # The planned function is the whole step's forward, loss included, so
        # the plan's run is the program planned (same ops, same call indices).
        plain_step = lambda **_: weighted(fn(regions=False))  # noqa: E731
        step = lambda **_: weighted(fn(regions=regions))  # noqa: E731
        try:
            want, want_bufs, _, peak = _run_program(plain_step, leaves, running, reset, track=True)
        except RuntimeError:
            for t in leaves:
                t.grad = None
            return

        def planned():
            reset()
            return step()

        rng = torch.get_rng_state()
        try:
            plan = budget(planned, peak_bytes=max(1, int(peak * frac)))
        except ValueError as e:
            assert "below the least peak" in str(e), str(e)
            assert_clean()
            return
        assert torch.equal(rng, torch.get_rng_state())
        assert all(t.grad is None for t in leaves)
        assert plan.measured_peak <= plan.peak_bytes
        assert_clean()
        for p in (plan, torch_sac.PeakPlan.from_dict(plan.to_dict())):
            got, bufs, region, rerun = _run_program(step, leaves, running, reset, p, track=True)
            assert_same(got, want)
            assert_same(bufs, want_bufs, "running stats")
            assert rerun <= plan.peak_bytes
            assert region.stats()["replayed_ops"] == plan.recomputed_ops
