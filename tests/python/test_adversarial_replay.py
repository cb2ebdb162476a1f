"""Adversarial tests of multiple recomputation (``replay_budget``), replay
schedules and the profiler's view of them.

Every gradient is compared bitwise with plain autograd (CPU, deterministic
ops); every error must leave nothing installed and the next normal run
must work. Tests that show a bug are ``xfail(strict=True)`` with the
precise symptom in ``reason``.
"""

import json
import os
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_sac
import torch_sac.region

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False

RECOMPUTE_ALL = torch_sac.policies.recompute_all
SAVE_MATMULS = torch_sac.policies.save_matmuls
aten = torch.ops.aten

BUDGETS = [0, 1, 700, 3000, None]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def _leaves_grads(leaves):
    out = []
    for t in leaves:
        out.append(None if t.grad is None else t.grad.clone())
        t.grad = None
    return out


def assert_same(got, want, what="gradient"):
    assert len(got) == len(want), f"{what}: {len(got)} vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            assert g is None and w is None, f"{what} {i}: {g is None} vs {w is None}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {i}: {g.shape} vs {w.shape}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().max().item()
            raise AssertionError(f"{what} {i}: not bitwise equal (max abs diff {diff:.3g})")


def assert_clean():
    assert torch_sac.region._stack() == [], "a region stayed on the stack"
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch.is_grad_enabled()


def check_peak(region, budget, sizes=None):
    """peak_memo_bytes <= max(budget, the largest single rebuilt tensor)."""
    if budget is None:
        return
    stats = region.stats()
    largest = max(sizes) if sizes else 0
    assert stats["peak_memo_bytes"] <= max(budget, largest), (
        f"peak_memo_bytes {stats['peak_memo_bytes']} > max(budget {budget}, largest {largest})")


def run(fn, leaves, *, budget=None, policy=None, region=True, backward=None, seed=0, schedule=None):
    """Seeds the global RNG, runs ``fn()`` (in a region when ``region``),
    then ``backward(out)`` (default: a weighted sum's backward). Returns
    (grads of ``leaves``, region or None, RNG state after)."""
    torch.manual_seed(seed)
    ctx = None
    if region:
        kwargs = {}
        if budget is not None:
            kwargs["replay_budget"] = budget
        if schedule is not None:
            kwargs["replay_schedule"] = schedule
        ctx = torch_sac.sac_context(policy if policy is not None else RECOMPUTE_ALL(), **kwargs)
        with ctx:
            out = fn()
    else:
        out = fn()
    if backward is None:
        weighted_loss(out).backward()
    else:
        backward(out)
    rng = torch.get_rng_state()
    return _leaves_grads(leaves), ctx, rng


def weighted_loss(out):
    if isinstance(out, (tuple, list)):
        return sum(weighted_loss(o) for o in out)
    g = torch.Generator().manual_seed(7)
    return (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()


def compare(fn, leaves, budget, policy=None, backward=None, sizes=None):
    want, _, rng_want = run(fn, leaves, region=False, backward=backward)
    got, region, rng_got = run(fn, leaves, budget=budget, policy=policy, backward=backward)
    assert_same(got, want)
    assert torch.equal(rng_got, rng_want), "global RNG state differs after the step"
    assert_clean()
    if sizes is not None:
        check_peak(region, budget, sizes)
    return region


def tanh_chain(n, width=16, batch=8, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(width, width) for _ in range(n)]
    x = torch.randn(batch, width, requires_grad=True)
    leaves = [p for layer in layers for p in layer.parameters()] + [x]

    def fn():
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        return h

    return fn, leaves, batch * width * 4


# --------------------------------------------------------------------------
# retain_graph, autograd.grad with subsets, threads, several regions
# --------------------------------------------------------------------------

@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("passes", [2, 3])
def test_retain_graph_repeated_backward(budget, passes):
    fn, leaves, size = tanh_chain(6)

    def backward(out):
        loss = weighted_loss(out)
        for i in range(passes):
            loss.backward(retain_graph=i < passes - 1)

    region = compare(fn, leaves, budget, backward=backward)
    if budget is not None and budget < size:
        assert region.stats()["memos_skipped"] > 0


@pytest.mark.parametrize("budget", [0, 700, None])
def test_autograd_grad_input_subsets_then_full(budget):
    """grad w.r.t. a subset, then another subset, then everything."""
    fn, leaves, size = tanh_chain(5)
    subsets = [leaves[:2], leaves[4:7], [leaves[-1]], leaves]

    def results(region):
        torch.manual_seed(0)
        if region:
            ctx = torch_sac.sac_context(RECOMPUTE_ALL(), **({} if budget is None else {"replay_budget": budget}))
            with ctx:
                out = fn()
        else:
            out = fn()
        loss = weighted_loss(out)
        res = []
        for i, subset in enumerate(subsets):
            res.extend(torch.autograd.grad(loss, subset, retain_graph=i < len(subsets) - 1))
        return res

    want = results(False)
    got = results(True)
    assert_same(got, want)
    assert_clean()


@pytest.mark.parametrize("budget", [0, 1000])
def test_backward_on_another_thread(budget):
    fn, leaves, size = tanh_chain(6)

    def backward(out):
        loss = weighted_loss(out)
        errors = []

        def work():
            try:
                loss.backward()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        t.join(30)
        assert not t.is_alive(), "backward hung on another thread"
        if errors:
            raise errors[0]

    compare(fn, leaves, budget, backward=backward)


def test_two_backwards_concurrently_on_two_threads_of_one_graph():
    """Two retained-graph backwards of one region's graph at once (two threads)."""
    fn, leaves, size = tanh_chain(6)
    torch.manual_seed(0)
    out = fn()
    loss = weighted_loss(out)
    want = torch.autograd.grad(loss, leaves, retain_graph=True)
    with torch_sac.sac_context(RECOMPUTE_ALL(), replay_budget=0):
        out = fn()
    loss = weighted_loss(out)
    results = [None, None]
    errors = []

    def work(i):
        try:
            results[i] = torch.autograd.grad(loss, leaves, retain_graph=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "hung"
    assert not errors, errors
    for r in results:
        assert_same(list(r), list(want))


@pytest.mark.parametrize("budgets", [(0, 0), (0, None), (700, 2000), (None, 1)])
def test_several_regions_each_with_a_budget(budgets):
    fn1, leaves1, _ = tanh_chain(4, seed=1)
    torch.manual_seed(2)
    layers2 = [nn.Linear(16, 16) for _ in range(4)]
    leaves = leaves1 + [p for layer in layers2 for p in layer.parameters()]

    def fn(region):
        def kw(b):
            return {} if b is None else {"replay_budget": b}
        if region:
            with torch_sac.sac_context(RECOMPUTE_ALL(), **kw(budgets[0])):
                h = fn1()
            h = h * 2  # outside any region
            with torch_sac.sac_context(RECOMPUTE_ALL(), **kw(budgets[1])):
                for layer in layers2:
                    h = torch.sin(layer(h)) + h
        else:
            h = fn1() * 2
            for layer in layers2:
                h = torch.sin(layer(h)) + h
        return h

    torch.manual_seed(0)
    weighted_loss(fn(False)).backward()
    want = _leaves_grads(leaves)
    torch.manual_seed(0)
    weighted_loss(fn(True)).backward()
    assert_same(_leaves_grads(leaves), want)
    assert_clean()


# --------------------------------------------------------------------------
# Outputs that are views or modified in place after the region
# --------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 500, None])
def test_region_output_is_a_view_modified_in_place_later(budget):
    torch.manual_seed(0)
    lin = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x, *lin.parameters()]

    def fn():
        with torch_sac.sac_context(RECOMPUTE_ALL(), **({} if budget is None else {"replay_budget": budget})):
            h = torch.sigmoid(lin(x))
            a, b = h[:, :16], h[:, 16:]   # views of a saved-by-sigmoid tensor
            c = torch.exp(a)             # exp saves its result
        # outside: modify the non-saved view in place -> bumps h's version,
        # which sigmoid saved: plain autograd raises too.
        return c, b

    def plain():
        h = torch.sigmoid(lin(x))
        a, b = h[:, :16], h[:, 16:]
        return torch.exp(a), b

    # With no in-place: exact.
    torch.manual_seed(0)
    c, b = plain()
    weighted_loss((c, b)).backward()
    want = _leaves_grads(leaves)
    torch.manual_seed(0)
    c, b = fn()
    weighted_loss((c, b)).backward()
    assert_same(_leaves_grads(leaves), want)

    # In place on the view of a dropped tensor: must raise as autograd does.
    c, b = plain()
    b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        weighted_loss((c, b)).backward()
    _leaves_grads(leaves)
    c, b = fn()
    b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        weighted_loss((c, b)).backward()
    _leaves_grads(leaves)
    assert_clean()


@pytest.mark.parametrize("budget", [0, None])
def test_region_output_modified_in_place_where_autograd_allows(budget):
    """relu output (saved) is not touched; the in-place op is on the
    region's output of an op whose backward does not need it (add)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x, *lin.parameters()]

    def body():
        h = torch.tanh(lin(x))
        return h + 1.0  # add saves nothing

    def plain():
        out = body()
        out.mul_(3)
        out.add_(torch.ones_like(out))
        return out

    def fn():
        with torch_sac.sac_context(RECOMPUTE_ALL(), **({} if budget is None else {"replay_budget": budget})):
            out = body()
        out.mul_(3)
        out.add_(torch.ones_like(out))
        return out

    want, _, _ = run(plain, leaves, region=False)
    got, _, _ = run(fn, leaves, region=False)
    assert_same(got, want)
    assert_clean()


# --------------------------------------------------------------------------
# Random ops, BatchNorm, in-place ops, multi-output ops
# --------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1, 2000, None])
def test_dropout_masks_identical_under_multiple_recomputation(budget):
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(6)]
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x] + [p for layer in layers for p in layer.parameters()]

    def fn():
        h = x
        for i, layer in enumerate(layers):
            h = F.dropout(torch.tanh(layer(h)), p=0.3, training=True)
            if i % 2:
                h = h + 0.1 * torch.rand_like(h)          # another random op
                h = h * torch.bernoulli(torch.full_like(h, 0.8))
        return h

    region = compare(fn, leaves, budget, sizes=[8 * 16 * 4])
    if budget == 0:
        # Some random op was replayed several times.
        details = {d["op"]: d for d in region.op_details()}
        most = max(max(d.get("replays_by_call") or [0]) for d in details.values())
        assert most > 1


@pytest.mark.parametrize("budget", [0, 2000, None])
@pytest.mark.parametrize("passes", [1, 2])
def test_batchnorm_running_stats_updated_once(budget, passes):
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh())])
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x, *net.parameters()]
    state0 = {k: v.clone() for k, v in net.state_dict().items()}

    def backward(out):
        loss = weighted_loss(out)
        for i in range(passes):
            loss.backward(retain_graph=i < passes - 1)

    want, _, _ = run(lambda: net(x), leaves, region=False, backward=backward)
    want_buffers = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(state0)
    got, region, _ = run(lambda: net(x), leaves, budget=budget, backward=backward)
    assert_same(got, want)
    for k, v in net.state_dict().items():
        assert torch.equal(v, want_buffers[k]), f"buffer {k} differs"
    if budget == 0:
        assert region.stats()["memos_skipped"] > 0
    assert_clean()


@pytest.mark.parametrize("budget", [0, 300, None])
def test_in_place_ops_inside_region(budget):
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x] + [p for layer in layers for p in layer.parameters()]
    bias = torch.randn(16)

    def fn():
        h = x * 1.0
        for layer in layers:
            y = layer(h)
            y.add_(bias)
            y.relu_()
            y.mul_(1.5)
            z = torch.sigmoid(y)
            z.add_(y)          # z saved by sigmoid: not in place on it... sigmoid saved result
            h = torch.tanh(z.clone()) + h
        return h

    # sigmoid saves its result and z.add_ modifies it: plain autograd must
    # raise; check both raise or both agree.
    try:
        want, _, _ = run(fn, leaves, region=False)
    except RuntimeError:
        _leaves_grads(leaves)
        with pytest.raises(RuntimeError, match="inplace"):
            run(fn, leaves, budget=budget)
        _leaves_grads(leaves)
        assert_clean()
        return
    got, _, _ = run(fn, leaves, budget=budget)
    assert_same(got, want)


@pytest.mark.parametrize("budget", [0, 300, 2000, None])
def test_in_place_ops_inside_region_valid(budget):
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(4)]
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x] + [p for layer in layers for p in layer.parameters()]
    bias = torch.randn(16)

    def fn():
        h = x * 1.0
        for layer in layers:
            y = layer(h)
            y.add_(bias)
            y.relu_()            # saves result
            y2 = y * 2           # saves nothing from y? mul by scalar
            y2.add_(1.0)
            y2.tanh_()           # tanh_ saves result
            h = y2 * h + h.sin()  # mul saves both
        return h

    compare(fn, leaves, budget, sizes=[8 * 16 * 4])


@pytest.mark.parametrize("budget", [0, 64, 700, None])
def test_multi_output_ops(budget):
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    ln = nn.LayerNorm(24)
    x = torch.randn(8, 16, requires_grad=True)
    leaves = [x, *lin.parameters(), *ln.parameters()]

    def fn():
        h = ln(torch.tanh(lin(x)))                 # mean/rstd
        a, b, c = h.split(8, dim=1)
        d, e = torch.chunk(torch.sin(h), 2, dim=1)
        m, idx = torch.max(torch.exp(a), dim=1)   # indices saved
        s, si = torch.sort(b * c, dim=1)
        v, mu = torch.var_mean(d * e, dim=0)
        tk, ti = torch.topk(torch.cos(h), 3, dim=1)
        u = torch.unbind(torch.sigmoid(c), dim=0)
        return m.sum() + s.pow(2).sum() + v.sum() * mu.sum() + tk.sum() + sum(t.prod() for t in u)

    compare(fn, leaves, budget, sizes=[8 * 24 * 4])


@pytest.mark.parametrize("budget", [0, 1000, None])
def test_save_matmuls_with_budget(budget):
    fn, leaves, size = tanh_chain(8)
    region = compare(fn, leaves, budget, policy=SAVE_MATMULS(), sizes=[size])
    assert region.stats()["saved_ops"] > 0


# --------------------------------------------------------------------------
# Custom Functions, nested torch.utils.checkpoint, double backward
# --------------------------------------------------------------------------

class SavesInputAndOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x @ w)
        z = y * x.sin()
        ctx.save_for_backward(x, w, y, z)
        return z

    @staticmethod
    def backward(ctx, gz):
        x, w, y, z = ctx.saved_tensors
        x2, w2, y2, z2 = ctx.saved_tensors  # read twice
        assert torch.equal(y, y2) and torch.equal(z, z2)
        gy = gz * x.sin()
        gx = gz * y * x.cos()
        ga = gy * (1 - y * y)
        gx = gx + ga @ w.t()
        gw = x.t() @ ga
        return gx, gw


@pytest.mark.parametrize("budget", [0, 500, None])
def test_custom_function_saving_tensors(budget):
    torch.manual_seed(0)
    x = torch.randn(8, 8, requires_grad=True)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(4)]
    leaves = [x, *ws]

    def fn():
        h = x
        for w in ws:
            h = SavesInputAndOutput.apply(torch.cos(h), w) + h
        return h

    compare(fn, leaves, budget, sizes=[8 * 8 * 4])


@pytest.mark.parametrize("budget", [0, 700, None])
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_inside_budgeted_region(budget, reentrant):
    fn0, leaves, size = tanh_chain(6)
    layers_fn = fn0

    def fn():
        h = tc.checkpoint(layers_fn, use_reentrant=reentrant)
        return torch.sin(h) * h

    if reentrant:
        # reentrant checkpoint needs an input requiring grad
        x = leaves[-1]

        def fn():  # noqa: F811
            h = tc.checkpoint(lambda t: torch.tanh(t * 2) * t, x, use_reentrant=True)
            return torch.sin(h) * h

    compare(fn, leaves, budget)


@pytest.mark.parametrize("budget", [0, 700, None])
@pytest.mark.parametrize("reentrant", [False, True])
def test_budgeted_region_inside_torch_checkpoint(budget, reentrant):
    fn0, leaves, size = tanh_chain(6)
    x = leaves[-1]
    kw = {} if budget is None else {"replay_budget": budget}

    def inner(t):
        with torch_sac.sac_context(RECOMPUTE_ALL(), **kw):
            h = fn0()
            return torch.sin(h) * t

    def plain():
        return torch.sin(fn0()) * x

    want, _, _ = run(plain, leaves, region=False)
    got, _, _ = run(lambda: tc.checkpoint(inner, x, use_reentrant=reentrant), leaves, region=False)
    assert_same(got, want)
    assert_clean()


@pytest.mark.parametrize("budget", [0, 700, None])
def test_double_backward(budget):
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(4, 8, requires_grad=True)
    leaves = [x, *lin1.parameters(), *lin2.parameters()]

    def fn():
        return lin2(torch.tanh(lin1(x)) ** 2).sin()

    def backward(out):
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (gx.pow(2).sum() + out.sum()).backward()

    compare(fn, leaves, budget, backward=backward)


@pytest.mark.parametrize("budget", [0, 700, None])
def test_double_backward_with_grad_computed_inside_region(budget):
    """Gradient penalty: torch.autograd.grad(create_graph=True) inside the
    region, so backward's own ops are recorded too."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 1)
    x = torch.randn(4, 8, requires_grad=True)
    leaves = [x, *lin1.parameters(), *lin2.parameters()]

    def fn():
        y = lin2(torch.tanh(lin1(x))).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return y + g.pow(2).sum() * torch.sigmoid(g).sum()

    compare(fn, leaves, budget)
