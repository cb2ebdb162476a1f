"""torch_sac.policies.budget: the C++ solver against an exact MILP oracle, the
profile's aliasing accounting, the budget bound (planned and measured), and
gradients under the budget policy against the un-checkpointed run."""

import functools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

import torch_sac
from conftest import (
    RecordingPolicy,
    aten,
    assert_grads_equal,
    recompute_all_fn,
    run_model,
    sac_context_fn,
)
from models import MODEL_BUILDERS, Stack
from torch_sac._op_profile import LiveStorages, profile_region

REL = 1e-7


# --------------------------------------------------------------------------
# The solver against an exact MILP (HiGHS)
# --------------------------------------------------------------------------

def milp_optimum(storage_bytes, values, item_storages, capacity):
    """max sum v_i x_i  s.t.  sum b_s y_s <= C,  x_i <= y_s for s in S_i,  binary."""
    n, m = len(values), len(storage_bytes)
    c = np.concatenate([-np.asarray(values, float), np.zeros(m)])
    rows, cols, data = [0] * m, list(range(n, n + m)), [float(b) for b in storage_bytes]
    r = 1
    for i, st in enumerate(item_storages):
        for s in set(st):
            rows += [r, r]
            cols += [i, n + s]
            data += [1.0, -1.0]
            r += 1
    a = coo_matrix((data, (rows, cols)), shape=(r, n + m)).tocsr()
    ub = np.zeros(r)
    ub[0] = capacity
    res = milp(
        c,
        constraints=LinearConstraint(a, np.full(r, -np.inf), ub),
        integrality=np.ones(n + m),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0},
    )
    assert res.success, res.message
    return -res.fun


def evaluate(storage_bytes, values, item_storages, chosen):
    storages = set()
    for i in chosen:
        storages.update(item_storages[i])
    return sum(storage_bytes[s] for s in storages), sum(values[i] for i in chosen)


def op_graph_instance(rng, n):
    """A random instance shaped like a region's op calls: allocating ops (one
    storage, sometimes 2-3 like layer_norm or dropout), views and in-place
    ops aliasing a storage of an earlier op, ops on storage from outside the
    region (0 bytes), ops without tensor outputs, some worth nothing."""
    storage_bytes = [0]
    values, item_storages, owners = [], [], []
    for _ in range(n):
        u = rng.random()
        if u < 0.5 or not owners:
            k = 1 if rng.random() < 0.8 else int(rng.integers(2, 4))
            st = []
            for _ in range(k):
                if rng.random() < 0.7:
                    storage_bytes.append(int(rng.choice([64, 1024, 4096, 12288, 16384])))
                else:
                    storage_bytes.append(int(rng.integers(1, 20000)))
                st.append(len(storage_bytes) - 1)
            owners.append(st)
            item_storages.append(st)
            values.append(float(rng.random() * storage_bytes[st[0]] / 1000 + rng.random()))
        elif u < 0.9:
            owner = owners[int(rng.integers(0, len(owners)))]
            item_storages.append([owner[int(rng.integers(0, len(owner)))]])
            values.append(float(rng.random() * (0.05 if rng.random() < 0.7 else 3.0)))
        elif u < 0.95:
            item_storages.append([0])
            values.append(float(rng.random()))
        else:
            item_storages.append([])
            values.append(float(rng.random()))
        if rng.random() < 0.05:
            values[-1] = 0.0
    return storage_bytes, values, item_storages


def independent_instance(rng, n, correlated):
    storage_bytes = rng.integers(1, 5000, n).tolist()
    if correlated:
        values = [max(0.0, b + float(rng.uniform(-500, 500))) for b in storage_bytes]
    else:
        values = rng.random(n).tolist()
    return storage_bytes, values, [[i] for i in range(n)]


def random_instances(seed, count):
    rng = np.random.default_rng(seed)
    for k in range(count):
        n = int(rng.integers(3, 200))
        kind = k % 3
        if kind == 0:
            inst = op_graph_instance(rng, n)
        else:
            inst = independent_instance(rng, n, correlated=kind == 2)
        total = sum(inst[0])
        yield inst + (int(total * rng.uniform(0.0, 0.9)),)


def test_exact_solver_matches_milp():
    n_checked = 0
    for storage_bytes, values, item_storages, cap in random_instances(seed=0, count=90):
        sol = torch_sac._C.budget_solve(storage_bytes, values, item_storages, cap, "exact")
        opt = milp_optimum(storage_bytes, values, item_storages, cap)
        assert sol["method"] == "exact" and sol["optimal"]
        assert sol["value"] == pytest.approx(opt, rel=REL, abs=1e-12)
        bytes_, value = evaluate(storage_bytes, values, item_storages, sol["chosen"])
        assert bytes_ == sol["bytes"] <= cap
        assert value == pytest.approx(sol["value"], rel=1e-12, abs=1e-12)
        n_checked += 1
    assert n_checked == 90


def test_arbitrary_sharing_is_exact_or_says_so():
    """Items sharing storages at random (giant alias components, unlike real
    op graphs): either proven optimal and equal to the MILP, or flagged not
    optimal with a valid upper bound."""
    rng = np.random.default_rng(1)
    flagged = 0
    for _ in range(30):
        n = int(rng.integers(5, 80))
        m = max(1, 2 * n // 3)
        storage_bytes = rng.integers(1, 10**4, m).tolist()
        item_storages = [rng.integers(0, m, rng.integers(1, 4)).tolist() for _ in range(n)]
        values = rng.random(n).tolist()
        cap = int(sum(storage_bytes) * rng.uniform(0.05, 0.8))
        sol = torch_sac._C.budget_solve(storage_bytes, values, item_storages, cap, "auto")
        opt = milp_optimum(storage_bytes, values, item_storages, cap)
        bytes_, value = evaluate(storage_bytes, values, item_storages, sol["chosen"])
        assert bytes_ == sol["bytes"] <= cap
        assert value <= opt * (1 + REL) + 1e-12
        assert sol["upper_bound"] >= opt * (1 - REL)
        if sol["optimal"]:
            assert value == pytest.approx(opt, rel=REL)
        else:
            flagged += 1
            assert "approximated" in sol["note"]
    assert flagged > 0  # the family does exercise the fallback


def max_component_value(values, item_storages):
    """Largest total value of one alias component (bounds the greedy's v_max)."""
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for st in item_storages:
        for s in st[1:]:
            parent[find(s)] = find(st[0])
    totals, best = {}, 0.0
    for v, st in zip(values, item_storages):
        if st:
            r = find(st[0])
            totals[r] = totals.get(r, 0.0) + v
        best = max(best, v)
    return max([best, *totals.values()])


def test_greedy_is_feasible_and_within_its_bound():
    for storage_bytes, values, item_storages, cap in random_instances(seed=2, count=60):
        sol = torch_sac._C.budget_solve(storage_bytes, values, item_storages, cap, "greedy")
        opt = milp_optimum(storage_bytes, values, item_storages, cap)
        assert sol["method"] == "greedy"
        bytes_, value = evaluate(storage_bytes, values, item_storages, sol["chosen"])
        assert bytes_ == sol["bytes"] <= cap
        tol = REL * max(1.0, opt)
        assert value <= opt + tol
        assert value >= opt / 2 - tol
        assert value >= opt - max_component_value(values, item_storages) - tol
        assert sol["upper_bound"] >= opt - tol  # the LP bound certifies the gap


def test_solver_value_is_monotone_in_the_budget():
    rng = np.random.default_rng(3)
    for _ in range(10):
        storage_bytes, values, item_storages = op_graph_instance(rng, 150)
        total = sum(storage_bytes)
        previous = -1.0
        for k in range(21):
            sol = torch_sac._C.budget_solve(storage_bytes, values, item_storages, total * k // 20, "auto")
            assert sol["value"] >= previous * (1 - 1e-12)
            previous = sol["value"]


# --------------------------------------------------------------------------
# Profiles and plans on the test models
# --------------------------------------------------------------------------

def region_of(model_name):
    """A fresh model's first region and an example input for it."""
    module, make_input = MODEL_BUILDERS[model_name]()
    fn = module[0] if isinstance(module, Stack) else module
    return fn, make_input()


def plan_for(model_name, **kwargs):
    fn, x = region_of(model_name)
    kwargs.setdefault("repeats", 1)
    return torch_sac.policies.budget(fn, x, **kwargs)


@pytest.fixture(scope="module")
def gpt_plan():
    return plan_for("gpt", fraction=0.5)


def test_profile_items_are_the_calls_the_contexts_see(model_name):
    """The plan's (op, call index) keys are the ones the policy is asked about."""
    fn, x = region_of(model_name)
    profile, _ = profile_region(fn, (x,), repeats=0)
    recorder = RecordingPolicy(recompute_all_fn)
    fn2, x2 = region_of(model_name)
    torch.utils.checkpoint.checkpoint(
        fn2, x2, use_reentrant=False,
        context_fn=functools.partial(torch_sac.create_selective_checkpoint_contexts, recorder),
    )
    assert [r.op for r in profile.records] == recorder.ops
    seen = {}
    for r in profile.records:
        assert r.call_index == seen.get(r.op, 0)
        seen[r.op] = r.call_index + 1
    assert not any(r.op in torch_sac.IGNORED_OPS for r in profile.records)


def test_aliasing_is_accounted_by_storage(gpt_plan):
    items = gpt_plan.items
    by_op = lambda op: [it for it in items if it.op is op]  # noqa: E731
    # Views and in-place ops allocate nothing; a view of a parameter keeps
    # nothing the region pays for.
    for op in (aten.view.default, aten.transpose.int, aten.split.Tensor, aten.expand.default, aten.t.default):
        assert by_op(op) and all(it.new_bytes == 0 for it in by_op(op)), op
    assert all(it.bytes == 0 for it in by_op(aten.t.default))
    for op in (aten.add_.Tensor, aten.div_.Scalar, aten.bernoulli_.float):
        assert all(it.new_bytes == 0 and not it.saveable and not it.saved for it in by_op(op)), op
    # split's three views and the views of them keep qkv's storage, once.
    addmm0 = next(it for it in items if it.op is aten.addmm.default)
    split = by_op(aten.split.Tensor)[0]
    assert split.bytes == addmm0.bytes == addmm0.new_bytes == 2 * 8 * 48 * 4
    # layer_norm keeps its output, mean and rstd.
    ln = by_op(aten.native_layer_norm.default)[0]
    assert ln.new_bytes == 2 * 8 * 16 * 4 + 2 * (2 * 8 * 4)
    # The plan's bytes are those of the distinct storages of what it saves.
    profile = gpt_plan._profile
    storages = set()
    for i, it in enumerate(items):
        if it.saved:
            storages.update(s for s in profile.records[i].storages if profile.storages[s].internal)
    assert gpt_plan.saved_bytes == sum(profile.storages[s].nbytes for s in storages)
    assert gpt_plan.saved_bytes <= gpt_plan.budget_bytes


def test_outputs_mutated_later_are_never_saved(gpt_plan):
    # Dropout's output gets the residual added in place: saving it would hand
    # back the sum.
    mul_outputs = [it for it in gpt_plan.items if it.op is aten.mul.Tensor]
    assert any(not it.saveable and "mutated" in it.why_not for it in mul_outputs)
    everything = gpt_plan.with_budget(bytes=10**9)
    assert all(it.saved == (it.saveable and it.cost > 0) for it in everything.items)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_bytes_kept_never_exceed_the_budget(fraction, gpt_plan):
    plan = gpt_plan.with_budget(fraction=fraction)
    assert plan.budget_bytes == int(fraction * plan.activation_bytes)
    assert plan.saved_bytes <= plan.budget_bytes
    # Measured: what the checkpointed region leaves alive after forward, apart
    # from its output.
    fn, x = region_of("gpt")
    ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, plan)
    torch.manual_seed(0)
    with LiveStorages() as live:
        out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
    assert live.live_bytes(exclude=[out, x]) <= plan.saved_bytes <= plan.budget_bytes
    out.sum().backward()


def test_full_budget_keeps_about_what_autograd_keeps(gpt_plan):
    plan = gpt_plan.with_budget(fraction=1.0)
    fn, x = region_of("gpt")
    torch.manual_seed(0)
    with LiveStorages() as live:
        out = fn(x)
    plain = live.live_bytes(exclude=[out, x])
    assert plain == plan.activation_bytes  # same measure, two ways
    assert plan.saved_bytes <= plain


@pytest.mark.parametrize("cost", ["time", "flops"])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_gradients_equal_the_unchecked_run(model_name, cost, fraction, reference_results):
    plan = plan_for(model_name, fraction=fraction, cost=cost)
    res = run_model(model_name, sac_context_fn(lambda: plan))
    assert_grads_equal(res, reference_results(model_name), f"{model_name} budget {cost} {fraction}")


def test_plan_drives_the_contexts(gpt_plan):
    pair = torch_sac.create_selective_checkpoint_contexts(gpt_plan)
    fn, x = region_of("gpt")
    torch.manual_seed(0)
    out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=lambda: pair)
    out.sum().backward()
    fwd, _ = pair
    assert fwd.stats()["saved_ops"] == len(gpt_plan.chosen) == gpt_plan.num_saved_calls
    expected = {}
    for op, _ in gpt_plan.chosen:
        expected[str(op)] = expected.get(str(op), 0) + 1
    saved = {name.replace("::", "."): s for name, s, _, _ in fwd.op_summary() if s}
    assert saved == expected


def test_larger_budget_never_avoids_less(gpt_plan):
    previous = -1.0
    for k in range(0, 41):
        plan = gpt_plan.with_budget(fraction=k / 20)
        assert plan.avoided_cost >= previous * (1 - 1e-12)
        assert plan.saved_bytes <= plan.budget_bytes
        previous = plan.avoided_cost
    assert previous > 0


def test_flops_cost_uses_the_flop_counter():
    plan = plan_for("gpt", fraction=1.0, cost="flops")
    assert plan.cost_unit == "FLOP"
    fn, x = region_of("gpt")
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(x)
    assert plan.total_cost == counter.get_total_flops() > 0
    for it in plan.items:
        if it.saved:
            assert it.cost > 0 and it.op in (aten.addmm.default, aten.bmm.default, aten.mm.default)


def test_plan_describes_itself(gpt_plan):
    assert isinstance(gpt_plan, torch_sac._C.OpPolicy)
    assert isinstance(gpt_plan, torch_sac.policies.BudgetPolicy)
    assert gpt_plan.solver == "exact" and gpt_plan.optimal
    assert gpt_plan.upper_bound == pytest.approx(gpt_plan.avoided_cost)
    assert 0 < gpt_plan.avoided_cost <= gpt_plan.total_cost
    assert gpt_plan.avoided_cost == pytest.approx(sum(it.cost for it in gpt_plan.items if it.saved))
    assert gpt_plan.activation_bytes > 0 and gpt_plan.total_bytes >= gpt_plan.activation_bytes
    table = gpt_plan.table()
    assert "aten.addmm.default" in table and "SAVE" in table and "solver exact" in table
    assert len(table.splitlines()) == len(gpt_plan.items) + 3
    assert "BudgetPolicy" in repr(gpt_plan)
    first = gpt_plan.chosen[0]
    assert gpt_plan.is_saved(*first)
    greedy = gpt_plan.with_budget(fraction=0.5, solver="greedy")
    assert greedy.solver == "greedy" and greedy.avoided_cost <= gpt_plan.avoided_cost * (1 + 1e-9)


def test_profiling_restores_the_rng_and_leaves_no_state():
    fn, x = region_of("gpt")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    torch_sac.policies.budget(fn, x, fraction=0.5, repeats=0)
    assert torch.equal(torch.rand(3), expected)


def test_bad_input_raises_clearly():
    fn, x = region_of("mlp")
    budget = torch_sac.policies.budget
    with pytest.raises(TypeError, match="exactly one of bytes= or fraction="):
        budget(fn, x)
    with pytest.raises(TypeError, match="exactly one of bytes= or fraction="):
        budget(fn, x, bytes=10, fraction=0.5)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        budget(fn, x, bytes=-1)
    with pytest.raises(TypeError, match="bytes must be an int"):
        budget(fn, x, bytes=1.5)
    with pytest.raises(TypeError, match="fraction must be a number"):
        budget(fn, x, fraction="half")
    with pytest.raises(ValueError, match="fraction must be finite"):
        budget(fn, x, fraction=math.nan)
    with pytest.raises(ValueError, match="fraction must be finite"):
        budget(fn, x, fraction=-0.1)
    with pytest.raises(ValueError, match="cost must be one of"):
        budget(fn, x, fraction=0.5, cost="energy")
    with pytest.raises(ValueError, match="solver must be one of"):
        budget(fn, x, fraction=0.5, solver="milp")
    with pytest.raises(ValueError, match="repeats"):
        budget(fn, x, fraction=0.5, repeats=-1)
    with pytest.raises(TypeError, match="fn must be callable"):
        budget(42, x, fraction=0.5)
    with pytest.raises(ValueError, match="max_states"):
        budget(fn, x, fraction=0.5, max_states=0)
    with pytest.raises(ValueError):
        torch_sac._C.budget_solve([10], [1.0], [[3]], 10, "auto")  # storage out of range
    with pytest.raises(ValueError):
        torch_sac._C.budget_solve([10], [-1.0], [[0]], 10, "auto")

    def broken(x):
        raise KeyError("inside the region")

    with pytest.raises(KeyError, match="inside the region"):
        budget(broken, x, fraction=0.5)


def test_exact_solver_gives_up_clearly():
    rng = np.random.default_rng(9)
    storage_bytes, values, item_storages = independent_instance(rng, 300, correlated=True)
    cap = sum(storage_bytes) // 2
    with pytest.raises(RuntimeError, match="gave up"):
        torch_sac._C.budget_solve(storage_bytes, values, item_storages, cap, "exact", max_states=5)
    sol = torch_sac._C.budget_solve(storage_bytes, values, item_storages, cap, "auto", max_states=5)
    assert sol["method"] == "greedy" and "gave up" in sol["note"]
    assert sol["bytes"] <= cap


def test_a_view_whose_base_is_mutated_later_is_not_saved():
    """Saving such a view would hand the mutated values back to recompute and
    silently corrupt gradients (the cache's version check cannot see it: the
    view's version counter is replaced by its base's after it is cached)."""

    def fn(x):
        y = x * 2
        v = y.view(-1)
        z = v * 3
        y.mul_(5)
        return z.sin() + y.view(-1)

    x = torch.randn(4, requires_grad=True)
    plan = torch_sac.policies.budget(fn, x, bytes=10**6, repeats=0)
    view0 = next(it for it in plan.items if it.op is aten.view.default and it.call_index == 0)
    assert not view0.saveable and "mutated" in view0.why_not and not view0.saved
    ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, plan)
    x1 = x.detach().clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(fn, x1, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    fn(x2).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
