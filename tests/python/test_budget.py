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
from models import MODEL_BUILDERS, GPTBlock, Stack
from torch_sac.planners.budget_table import _name_ranges, _op_name
from torch_sac._op_profile import LiveStorages, format_bytes, profile_region

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


@pytest.mark.slow
@pytest.mark.adapter_independent
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


@pytest.mark.slow
@pytest.mark.adapter_independent
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


@pytest.mark.slow
@pytest.mark.adapter_independent
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


@pytest.mark.adapter_independent
def test_solver_value_is_monotone_in_the_budget():
    rng = np.random.default_rng(3)
    for _ in range(10):
        storage_bytes, values, item_storages = op_graph_instance(rng, 150)
        total = sum(storage_bytes)
        previous = -1.0
        for k in range(21):
            sol = torch_sac._C.budget_solve(
                storage_bytes, values, item_storages, total * k // 20, "auto"
            )
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
        fn2,
        x2,
        use_reentrant=False,
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
    for op in (
        aten.view.default,
        aten.transpose.int,
        aten.split.Tensor,
        aten.expand.default,
        aten.t.default,
    ):
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
    assert "addmm" in table and "SAVE" in table and "exact, optimal" in table
    # Unfolded: a title, the header and its rule, one line per call, the summary.
    per_call = gpt_plan.table(max_rows=None, fold=False).splitlines()
    assert len(per_call) == 3 + len(gpt_plan.items) + len(SUMMARY_TERMS)
    assert [line.split()[1] for line in per_call[3 : 3 + len(gpt_plan.items)]] == [
        _op_name(it.op) for it in gpt_plan.items
    ]
    assert "BudgetPolicy" in repr(gpt_plan) and "\n" not in gpt_plan.summary()
    first = gpt_plan.chosen[0]
    assert gpt_plan.is_saved(*first)
    greedy = gpt_plan.with_budget(fraction=0.5, solver="greedy")
    assert greedy.solver == "greedy" and greedy.avoided_cost <= gpt_plan.avoided_cost * (1 + 1e-9)


# --------------------------------------------------------------------------
# The plan's table
# --------------------------------------------------------------------------

SUMMARY_TERMS = ("budget", "saved", "activations", "everything", "avoided", "solver")
TITLE_LINES = 4  # two lines saying what a row is, the header, its rule


def table_rows(table, count):
    """(op, call) of the first ``count`` rows of a folded table."""
    return [
        tuple(line.split()[:2]) for line in table.splitlines()[TITLE_LINES : TITLE_LINES + count]
    ]


def is_view_or_in_place(op):
    return op.is_view or op._schema.is_mutable


def test_table_folds_views_and_in_place_ops_into_their_storage(gpt_plan):
    profile = gpt_plan._profile
    record_of = {id(it): r for it, r in zip(gpt_plan.items, profile.records)}
    rows = gpt_plan.rows
    # Every call is in exactly one row or among the calls on outside storage.
    placed = [id(it) for row in rows for it in row.calls] + [
        id(it) for it in gpt_plan.outside_calls
    ]
    assert sorted(placed) == sorted(id(it) for it in gpt_plan.items)
    for row in rows:
        # A row is headed by the call that allocated its storage...
        head = record_of[id(row.item)]
        assert head.new_storages and not is_view_or_in_place(row.item.op), row
        # ... and folds calls that allocate nothing and use that storage.
        for it in row.folded:
            r = record_of[id(it)]
            assert not r.new_storages and it.new_bytes == 0
            assert set(r.storages) & set(head.new_storages), (row, it)
        assert row.cost == pytest.approx(sum(it.cost for it in row.calls))
        assert row.value == pytest.approx(sum(it.cost for it in row.calls if it.saveable))
        assert row.bytes == gpt_plan._bytes_of(row.calls) == row.item.bytes
    for it in gpt_plan.outside_calls:
        assert not any(profile.storages[s].internal for s in record_of[id(it)].storages)
    # torch 2.15's nn.Linear may flatten a 3-D input from outside the region
    # with aten._unsafe_view (a call on outside storage) where earlier
    # releases use a view that the region does not see as a call of its own.
    outside_ops = {it.op for it in gpt_plan.outside_calls}
    assert {aten.t.default, aten.slice.Tensor} <= outside_ops
    assert outside_ops <= {aten.t.default, aten.slice.Tensor, aten._unsafe_view.default}
    # The qkv projection carries its split, the heads' views and transposes;
    # dropout's mask its bernoulli_ and div_; a residual's branch its add_.
    by_head = {(row.item.op, row.item.call_index): row for row in rows}
    qkv = by_head[(aten.addmm.default, 0)]
    # torch 2.15's nn.Linear reshapes its 3-D output with _unsafe_view, where
    # earlier releases use view.
    as_view = {aten._unsafe_view.default: aten.view.default}
    assert {as_view.get(it.op, it.op) for it in qkv.folded} == {
        aten.split.Tensor,
        aten.view.default,
        aten.transpose.int,
        aten.expand.default,
    }
    assert len(qkv.folded) == 12
    mask = by_head[(aten.empty_like.default, 0)]
    assert [it.op for it in mask.folded] == [aten.bernoulli_.float, aten.div_.Scalar]
    assert any(it.op is aten.add_.Tensor for row in rows for it in row.folded)
    # The folded costs add up to the region's.
    total = sum(row.cost for row in rows) + sum(it.cost for it in gpt_plan.outside_calls)
    assert total == pytest.approx(gpt_plan.total_cost)
    # The text: no view or in-place op heads a line; the folded ones are named.
    table = gpt_plan.table(max_rows=None)
    shown = table_rows(table, len(rows))
    assert shown == [(_op_name(row.item.op), str(row.item.call_index)) for row in rows]
    assert not {op for op, _ in shown} & {
        "view",
        "t",
        "transpose.int",
        "split.Tensor",
        "expand",
        "_unsafe_view",
        "add_.Tensor",
        "bernoulli_.float",
    }
    if any(it.op is aten._unsafe_view.default for it in qkv.folded):  # torch 2.15
        assert all(
            part in table for part in ("view x3", "_unsafe_view", "transpose x4", "expand x3")
        )
    else:
        assert "view x4, transpose x4, expand x3, split" in table
    assert "bernoulli_, div_" in table
    outside = f"{len(gpt_plan.outside_calls)} op calls keep no region memory"
    assert outside in table and "t x4, slice x2" in table


def test_table_shows_the_most_valuable_rows(gpt_plan):
    rows = gpt_plan.rows
    assert all(a.value >= b.value for a, b in zip(rows, rows[1:]))
    assert rows[0].value > rows[-1].value == 0  # dropout masks cannot be saved
    max_rows = 5
    assert len(rows) > max_rows
    table = gpt_plan.table(max_rows=max_rows)
    lines = table.splitlines()
    assert table_rows(table, max_rows) == [
        (_op_name(row.item.op), str(row.item.call_index)) for row in rows[:max_rows]
    ]
    more = lines[TITLE_LINES + max_rows]
    hidden = rows[max_rows:]
    hidden_cost = sum(row.cost for row in hidden)
    assert more.startswith(
        f"... {len(hidden)} more rows: {100 * hidden_cost / gpt_plan.total_cost:.1f}% of the cost, "
    )
    # Every saved call is in a shown row, counted in that line, or among the
    # (free) calls on outside storage.
    hidden_saved = sum(row.saved_calls for row in hidden)
    shown_saved = sum(row.saved_calls for row in rows[:max_rows])
    outside_saved = sum(it.saved for it in gpt_plan.outside_calls)
    assert (f"{hidden_saved} saved call" in more) == (hidden_saved > 0)
    assert f"{outside_saved} saved (free)" in lines[TITLE_LINES + max_rows + 1]
    assert shown_saved + hidden_saved + outside_saved == len(gpt_plan.chosen)
    unsaveable = [row for row in hidden if row.value == 0 < row.cost]
    assert f"{len(unsaveable)} of them cannot be saved" in more
    # The default shows at most 20 rows; None shows them all.
    assert not any(line.startswith("... ") for line in gpt_plan.table(max_rows=None).splitlines())
    default = gpt_plan.table().splitlines()
    assert len(default) <= TITLE_LINES + 20 + 2 + len(SUMMARY_TERMS)
    with pytest.raises(ValueError, match="max_rows"):
        gpt_plan.table(max_rows=-1)


def test_table_decisions_are_the_heads(gpt_plan):
    lines = gpt_plan.table(max_rows=None).splitlines()
    header = lines[TITLE_LINES - 2]
    start, end = header.index("decision"), header.index("folded into it")
    for row, line in zip(gpt_plan.rows, lines[TITLE_LINES:]):
        decision = line[start:end].strip()
        assert decision.startswith("SAVE") == row.item.saved, (row, line)
        if row.item.saved:
            # Saving the storage lets every saveable call on it be saved too.
            assert all(it.saved for it in row.calls if it.saveable and it.cost > 0)
        elif not row.item.saveable:
            assert decision.startswith(f"recompute ({row.item.why_not})")


def test_table_summary_defines_its_terms(gpt_plan):
    for plan in (gpt_plan, gpt_plan.with_budget(bytes=3000, solver="greedy")):
        lines = plan.table().splitlines()[-len(SUMMARY_TERMS) :]
        assert [line.split()[0] for line in lines] == list(SUMMARY_TERMS)
        summary = dict(zip(SUMMARY_TERMS, lines))
        assert format_bytes(plan.budget_bytes) in summary["budget"]
        assert (
            f"{format_bytes(plan.saved_bytes)}, {len(plan.chosen)} of {len(plan.items)} calls"
            in summary["saved"]
        )
        assert format_bytes(plan.activation_bytes) in summary["activations"]
        assert format_bytes(plan.total_bytes) in summary["everything"]
        assert plan._fmt_cost(plan.avoided_cost) in summary["avoided"]
        assert plan.solver in summary["solver"]
        assert ("optimal" in summary["solver"]) and (
            plan.optimal
            or f"within {plan._fmt_cost(plan.upper_bound - plan.avoided_cost)}" in summary["solver"]
        )
        # One line each: the term, its value, then what it means, aligned.
        meaning_at = {len(line) - len(line.split("  ")[-1].lstrip()) for line in lines}
        assert len(meaning_at) == 1
        assert all(len(line.split("  ")[-1].split()) >= 4 for line in lines)
    assert "(50% of activations)" in gpt_plan.table()


def test_table_of_a_view_saved_without_its_mutated_base():
    def fn(x):
        y = x * 2
        y.mul_(5)
        return y.view(-1).sin()

    plan = torch_sac.policies.budget(fn, torch.randn(4, requires_grad=True), bytes=10**6, repeats=0)
    (row,) = [row for row in plan.rows if row.folded]
    assert row.item.op is aten.mul.Tensor and not row.item.saved
    assert [it.op for it in row.folded] == [aten.mul_.Tensor, aten.view.default]
    assert "recompute (output mutated in place later); SAVE 1 folded" in plan.table()


class ShorterTail(torch.nn.Module):
    """Four GPT blocks; the last two see half the sequence, so they need
    another plan than the first two."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(GPTBlock() for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i != 2 else x[:, : x.shape[1] // 2])
        return x


def test_model_budget_table_shows_each_distinct_plan_once():
    model = ShorterTail()
    plan = torch_sac.policies.budget(
        model, torch.randn(2, 8, 16, requires_grad=True), fraction=0.5, repeats=0
    )
    plans = plan.plans
    assert plans["layers.0"] is plans["layers.1"] is not plans["layers.2"] is plans["layers.3"]
    table = plan.table(max_rows=6)
    assert table.splitlines()[0] == (
        f"4 blocks, 2 distinct plans; saved {format_bytes(plan.saved_bytes)} of a "
        f"{format_bytes(plan.budget_bytes)} budget, summed over blocks"
    )
    first, second = table.split("\n\n")[1:]
    assert first.startswith("== plan 1 of 2: layers.0-1 (2 blocks, GPTBlock)\n")
    assert second.startswith("== plan 2 of 2: layers.2-3 (2 blocks, GPTBlock)\n")
    assert first.split("\n", 1)[1] == plans["layers.0"].table(max_rows=6)
    assert second.split("\n", 1)[1] == plans["layers.2"].table(max_rows=6)
    assert plan.table(fold=False).count("in region order") == 2


@pytest.mark.adapter_independent
def test_block_names_are_shown_as_ranges():
    assert _name_ranges(["layers.0", "layers.1", "layers.2", "lm_head"]) == "layers.0-2, lm_head"
    assert _name_ranges(["h.0", "h.2", "h.3", "g.4", "5", "6"]) == "h.0, h.2-3, g.4, 5-6"


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


@pytest.mark.adapter_independent
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
    torch.utils.checkpoint.checkpoint(
        fn, x1, use_reentrant=False, context_fn=ctx_fn
    ).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    fn(x2).sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_plan_numbers_no_grad_calls_as_the_region_does():
    """A no_grad op inside the region is a call the region numbers: the
    plan's (op, call index) keys must count it too (they skipped it, so a
    plan meant for the second mm saved the first)."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        with torch.no_grad():
            scale = x @ x.t()  # mm call 0, under no_grad
        return torch.tanh((x @ w) * scale.mean())  # mm call 1

    x = torch.randn(8, 8, requires_grad=True)
    plan = torch_sac.policies.budget(fn, x, fraction=1.0, cost="flops")
    mm = torch.ops.aten.mm.default
    assert [it.call_index for it in plan.items if it.op == mm] == [0, 1]
    recorder = []

    def spy(ctx, op, *args, **kwargs):
        if op == mm:
            recorder.append(plan.is_saved(op, len(recorder)))
        return torch_sac.Policy.PREFER_RECOMPUTE

    with torch_sac.sac_context(spy):
        fn(x)
    assert len(recorder) == 2
