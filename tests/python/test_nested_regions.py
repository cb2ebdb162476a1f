"""Nested regions: regions inside regions (three levels deep, siblings,
unused inner outputs, inner errors), with replay budgets (also
``ReplayBudget(b, counts_saved=True)``), replay schedules, backward on
another thread or twice with ``retain_graph``, ``apply_sac`` inside an
outer region, and peak plans of functions that open regions; then random
programs of the same (hypothesis, derandomized). test_region.py holds the
basic nesting rules (MUST beats PREFER, the innermost PREFER wins, exits
out of order).

Gradients are compared bitwise with plain autograd (CPU); BatchNorm running
statistics must move exactly once per forward; every run must leave no
dispatch mode, region, ``.grad`` or RNG change behind.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_sac
from helpers import (
    POLICIES,
    assert_clean,
    assert_same,
    backward,
    derandomized,
    leaves_grads,
    measured,
    weighted,
)

try:
    from hypothesis import given, strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False

P = torch_sac.policies
RA = P.recompute_all
aten = torch.ops.aten
budget = P.budget
RB = torch_sac.ReplayBudget

pytestmark = pytest.mark.usefixtures("one_thread", "leaves_nothing")


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
    return leaves_grads(leaves)


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
    return leaves_grads(leaves), [b.clone() for b in running], region, (m.peak if track else None)


if HAVE_HYPOTHESIS:
    _step = st.tuples(st.sampled_from(_KINDS), st.integers(0, 30), st.integers(0, 30))
    _BUDGETS = [None, 0, 1, 200, 1000, RB(0, True), RB(300, True), RB(2000, True)]

    @pytest.mark.slow
    @derandomized("ADV_PEAK_FUZZ_EXAMPLES", 300)
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

    @pytest.mark.slow
    @derandomized("ADV_PEAK_PLAN_EXAMPLES", 150)
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
