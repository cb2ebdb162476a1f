"""The built-in policy library: what each built-in saves on a GPT-style block,
named scopes and save_by_name, ``.to_torch()`` parity with PyTorch's own SAC
(eager and torch.compile), and errors.

Saved sets are compared as sets of (op, call index) per region: for torch_sac
from ``forward_context.saved_calls()``, for PyTorch from what its recompute
took from its cache (``conftest.ObservedRecompute``, with early stop off so
that recompute runs every op; PyTorch's storage layout differs between
releases), and for "what the name promises" from an independent recording of
the ops each region ran (a plain TorchDispatchMode used as the forward
context), with the named scopes tracked in Python.
"""

import collections
import contextlib
import functools
import math
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import torch_sac
from conftest import (
    REPO_ROOT,
    ObservedRecompute,
    assert_drop_in_cached,
    RUN_SEED,
    sac_ctx,
    torch_sac_asks_policy_in_recompute,
    aten,
    assert_grads_equal,
    assert_tensors_equal,
    is_matmul_op,
    run_model,
)
from models import GPTBlock, Stack, _input_factory, _seeded, build_gpt, build_gpt_sdpa

policies = torch_sac.policies


# --------------------------------------------------------------------------
# A GPT block with named scopes. The scopes are also tracked in Python
# (PY_SCOPES) so the expected saved set does not come from torch_sac itself.
# --------------------------------------------------------------------------

PY_SCOPES = []


@contextlib.contextmanager
def scope(name):
    PY_SCOPES.append(name)
    try:
        with torch_sac.name(name):
            yield
    finally:
        PY_SCOPES.pop()


class NamedGPTBlock(GPTBlock):
    """GPTBlock (attention written out) with scopes:
    attn > attn_core (scores, softmax, dropout, @v), attn_out (projection),
    mlp_up (fc + gelu)."""

    def attention(self, x):
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        with scope("attn"):
            q, k, v = self.qkv(x).split(C, dim=2)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, H, D).transpose(1, 2)
            v = v.view(B, T, H, D).transpose(1, 2)
            with scope("attn_core"):
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
                att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
                att = self.attn_drop(F.softmax(att, dim=-1))
                y = att @ v
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            with scope("attn_out"):
                return self.proj(y)

    def forward(self, x):
        a = self.resid_drop(self.attention(self.ln1(x)))
        a += x
        with scope("mlp_up"):
            h = F.gelu(self.fc(self.ln2(a)))
        m = self.mlp_drop(self.fc_out(h))
        m += a
        return m


def build_named_gpt():
    module = _seeded(lambda: Stack(NamedGPTBlock(), NamedGPTBlock()))()
    return module, _input_factory((2, 8, 16), seed=3)


BUILDERS = {"gpt": build_gpt, "gpt_sdpa": build_gpt_sdpa, "named_gpt": build_named_gpt}


# --------------------------------------------------------------------------
# Recording what each region ran, and what was saved
# --------------------------------------------------------------------------


class _RecordingMode(TorchDispatchMode):
    """Records (op, call index, open Python scopes) for every op a policy
    would see, counting calls per op as SAC does."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in torch_sac.IGNORED_OPS and func not in tc.SAC_IGNORED_OPS:
            self.calls.append((func, self.counts[func], tuple(PY_SCOPES)))
            self.counts[func] += 1
        return out


def recorded_calls(builder):
    """Per region: [(op, call index, scopes)] of the ops the region ran."""
    regions = []

    def context_fn():
        calls = []
        regions.append(calls)
        return _RecordingMode(calls), contextlib.nullcontext()

    run_model(builder, context_fn)
    return regions


def torch_sac_run(builder, policy, allow=False):
    """Runs with torch_sac's contexts; returns (result, cached calls per
    region, invalidated_ops per region)."""
    pairs = []

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts(
            policy, allow_cache_entry_mutation=allow
        )
        pairs.append(pair)
        return pair

    result = run_model(builder, context_fn)
    return (
        result,
        [set(fwd.saved_calls()) for fwd, _ in pairs],
        [fwd.stats()["invalidated_ops"] for fwd, _ in pairs],
    )


def torch_run(builder, policy_fn, allow=False):
    """Runs with PyTorch's own SAC; one policy_fn object shared by every
    region (functools.partial, as users write it). Returns (result, per
    region the (op, call index) calls PyTorch's recompute took from its
    cache). Without early stop each recompute runs to the end, so those are
    exactly the calls PyTorch saved in forward, and a recompute decision
    differing from forward's (PyTorch <= 2.11 asks the policy again in
    recompute) shows: a saved call re-run, or a cache entry taken for a call
    that was not saved."""
    observed = []

    def context_fn():
        fwd, rec = tc.create_selective_checkpoint_contexts(
            policy_fn, allow_cache_entry_mutation=allow
        )
        rec = ObservedRecompute(rec)
        observed.append(rec)
        return fwd, rec

    with tc.set_checkpoint_early_stop(False):
        result = run_model(builder, context_fn)
    return result, [set(rec.hit_calls) for rec in observed]


def promised(regions, predicate):
    """Per region, the (op, index) calls for which predicate(op, index, scopes)."""
    return [{(op, i) for op, i, s in calls if predicate(op, i, s)} for calls in regions]


_ALLOCATIONS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::empty_permuted",
    "aten::new_empty",
    "aten::new_empty_strided",
}


def saveable_in_scope(op):
    """save_by_name still recomputes random ops, ops writing to an argument
    (in-place, out=) and uninitialized allocations."""
    return (
        torch.Tag.nondeterministic_seeded not in op.tags
        and not op._schema.is_mutable
        and op.name() not in _ALLOCATIONS
    )


def in_scope(*names):
    return lambda op, i, s: any(n in s for n in names) and saveable_in_scope(op)


def fmt(saved_per_region):
    return [sorted((str(op), i) for op, i in s) for s in saved_per_region]


# The built-ins and what each one's name promises, as a predicate on
# (op, call index, open scopes). allow: the policy caches tensors the model
# later mutates in place (residual add_), which needs
# allow_cache_entry_mutation=True in PyTorch and in torch_sac.
MM_PACKETS = {"aten::mm", "aten::addmm"}


class Builtin:
    def __init__(self, name, make, promise, allow=False, builder="gpt"):
        self.name, self.make, self.promise = name, make, promise
        self.allow, self.builder = allow, builder

    def __repr__(self):
        return self.name


BUILTINS = [
    Builtin(
        "save_ops",
        lambda: policies.save_ops([aten.mm, aten.addmm]),
        lambda op, i, s: op.name() in MM_PACKETS,
    ),
    Builtin("recompute_all", policies.recompute_all, lambda op, i, s: False),
    Builtin("save_all", policies.save_all, lambda op, i, s: True, allow=True),
    Builtin("save_matmuls", policies.save_matmuls, lambda op, i, s: is_matmul_op(op)),
    Builtin(
        "save_matmuls_sdpa",
        policies.save_matmuls,
        lambda op, i, s: is_matmul_op(op),
        builder="gpt_sdpa",
    ),
    Builtin(
        "every_nth_addmm_2",
        lambda: policies.every_nth(aten.addmm, 2),
        lambda op, i, s: op is aten.addmm.default and i % 2 == 0,
    ),
    Builtin(
        "every_nth_mm_bmm_3",
        lambda: policies.every_nth([aten.bmm, aten.mm.default], 3),
        lambda op, i, s: op in (aten.bmm.default, aten.mm.default) and i % 3 == 0,
    ),
    Builtin(
        "save_by_name_attn_out",
        lambda: policies.save_by_name("attn_out"),
        in_scope("attn_out"),
        builder="named_gpt",
    ),
    Builtin(
        "save_by_name_enclosing",
        lambda: policies.save_by_name(["attn", "mlp_up"]),
        in_scope("attn", "mlp_up"),
        builder="named_gpt",
    ),
    Builtin(
        "save_by_name_inner",
        lambda: policies.save_by_name("attn_core"),
        in_scope("attn_core"),
        builder="named_gpt",
    ),
]
BUILTIN_IDS = [b.name for b in BUILTINS]

_REFERENCE = {}


def reference(builder_name):
    if builder_name not in _REFERENCE:
        _REFERENCE[builder_name] = run_model(BUILDERS[builder_name])
    return _REFERENCE[builder_name]


_RECORDED = {}


def recorded(builder_name):
    if builder_name not in _RECORDED:
        _RECORDED[builder_name] = recorded_calls(BUILDERS[builder_name])
    return _RECORDED[builder_name]


# --------------------------------------------------------------------------
# Each built-in saves what its name promises
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", BUILTINS, ids=BUILTIN_IDS)
def test_builtin_saves_what_its_name_promises(case):
    builder = BUILDERS[case.builder]
    result, saved, invalidated = torch_sac_run(builder, case.make(), case.allow)
    expected = promised(recorded(case.builder), case.promise)
    assert len(saved) == 2, "one region per block"
    for region, (ours, promise) in enumerate(zip(saved, expected)):
        assert_drop_in_cached(ours, promise, invalidated[region], f"region {region}")
    if case.name != "recompute_all":
        assert all(saved), "the policy saved nothing in some region"
    assert_grads_equal(result, reference(case.builder), f"torch_sac[{case}] vs plain")


def test_named_gpt_matches_unnamed_gpt():
    """Scopes change nothing but names: same ops, same gradients."""
    plain = [[(op, i) for op, i, _ in r] for r in recorded("gpt")]
    named = [[(op, i) for op, i, _ in r] for r in recorded("named_gpt")]
    assert plain == named
    assert_grads_equal(reference("named_gpt"), reference("gpt"), "named vs plain GPT")


def test_scopes_seen_by_the_recording_cover_the_model():
    """Harness sanity: the named scopes hold some ops and not all of them,
    and attn_core holds dropout's random op, its in-place scaling and its
    mask allocation, which save_by_name recomputes."""
    calls = [c for r in recorded("named_gpt") for c in r]
    for name in ("attn", "attn_core", "attn_out", "mlp_up"):
        assert any(name in s for _, _, s in calls), name
    assert any(not s for _, _, s in calls)
    assert all("attn" in s for _, _, s in calls if "attn_core" in s)
    core_ops = {op for op, _, s in calls if "attn_core" in s}
    assert any(not saveable_in_scope(op) for op in core_ops), core_ops
    assert any(torch.Tag.nondeterministic_seeded in op.tags for op in core_ops), core_ops


def test_save_by_name_recomputes_random_ops_in_scope():
    """A random op served from the cache would shift the RNG stream of the
    random ops recomputed after it (here: dropout outside the scope), and
    gradients would silently differ. save_by_name recomputes random ops."""

    def fn(x):
        with torch_sac.name("noise"):
            n = torch.rand(x.shape) * 2
        return F.dropout(x * n, 0.5)

    x = torch.randn(256, requires_grad=True)
    torch.manual_seed(RUN_SEED)
    fn(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    pair = []

    def context_fn():
        pair[:] = torch_sac.create_selective_checkpoint_contexts(policies.save_by_name("noise"))
        return tuple(pair)

    torch.manual_seed(RUN_SEED)
    tc.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert_tensors_equal(x.grad, ref, "save_by_name with a random op in scope")
    assert pair[0].saved_calls() == [(aten.mul.Tensor, 0)]


# --------------------------------------------------------------------------
# .to_torch(): the same choices under PyTorch's own SAC
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", BUILTINS, ids=BUILTIN_IDS)
def test_to_torch_saves_the_same_calls_and_gradients(case):
    builder = BUILDERS[case.builder]
    policy = case.make()
    ours, saved_ours, invalidated = torch_sac_run(builder, policy, case.allow)
    policy_fn = policy.to_torch()
    theirs, saved_theirs = torch_run(builder, policy_fn, case.allow)
    for region, (cached, decided) in enumerate(zip(saved_ours, saved_theirs)):
        assert_drop_in_cached(cached, decided, invalidated[region], f"region {region}")
    assert_grads_equal(theirs, ours, f"torch SAC[{case}.to_torch()] vs torch_sac")
    assert_grads_equal(theirs, reference(case.builder), f"torch SAC[{case}.to_torch()] vs plain")

    # The same policy_fn object again, for a second step: nothing carried over.
    again, saved_again = torch_run(builder, policy_fn, case.allow)
    assert fmt(saved_again) == fmt(saved_theirs)
    assert_grads_equal(again, ours, f"second step of {case}.to_torch()")


def test_to_torch_returns_checkpoint_policy_members():
    seen = []

    def spy(inner):
        def policy_fn(ctx, op, *args, **kwargs):
            value = inner(ctx, op, *args, **kwargs)
            seen.append(value)
            return value

        return policy_fn

    for policy in (policies.save_all(), policies.save_matmuls(), policies.every_nth(aten.mm, 2)):
        seen.clear()
        x, w = small_inputs()
        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, spy(policy.to_torch()))
        tc.checkpoint(mm_chain, x, w, use_reentrant=False, context_fn=ctx_fn).sum().backward()
        assert seen and all(type(v) is CheckpointPolicy for v in seen), seen


def test_every_nth_to_torch_counts_per_region_not_globally():
    """3 mm per region, 2 regions, one shared policy_fn: calls 0 and 2 of each
    region are saved. A global counter would save calls 0, 2 (region 1) and
    1 (region 2)."""
    policy_fn = policies.every_nth(aten.mm, 2).to_torch()
    observed = []

    def context_fn():
        fwd, rec = tc.create_selective_checkpoint_contexts(policy_fn)
        observed.append(ObservedRecompute(rec))
        return fwd, observed[-1]

    x, w = small_inputs()
    with tc.set_checkpoint_early_stop(False):  # recompute runs every op (see torch_run)
        h = tc.checkpoint(mm_chain, x, w, use_reentrant=False, context_fn=context_fn)
        tc.checkpoint(mm_chain, h, w, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert [sorted(i for op, i in rec.hit_calls if op is aten.mm.default) for rec in observed] == [
        [0, 2],
        [0, 2],
    ]
    assert [
        sorted(i for op, i in rec.recomputed_calls if op is aten.mm.default) for rec in observed
    ] == [[1], [1]]


def test_every_nth_to_torch_answers_recompute_as_forward():
    """Where PyTorch's SAC asks its policy again in recompute (torch <= 2.11),
    every recompute pass must get forward's answers: PyTorch takes the cached
    outputs of the calls answered SAVE there, in order. The .to_torch() policy
    counts recompute calls per pass (per backward), so a second backward with
    retain_graph=True asks about the same call indices as forward, not ones
    continuing the first recompute's count. (PyTorch then raises on that
    second backward, its storage being consumed; the answers up to there are
    what is checked.)"""
    if not torch_sac_asks_policy_in_recompute():
        pytest.skip(
            "this torch's SAC does not call policy_fn in recompute (as on torch 2.13): "
            "it looks forward's decisions up by call index"
        )
    answers = {False: [], True: []}
    inner = policies.every_nth(aten.mm, 3).to_torch()

    def spy(ctx, op, *args, **kwargs):
        value = inner(ctx, op, *args, **kwargs)
        if op is aten.mm.default:
            answers[bool(ctx.is_recompute)].append(value)
        return value

    def chain(x, w):  # 4 mm: every_nth(mm, 3) saves calls 0 and 3
        for _ in range(4):
            x = torch.mm(x, w).sin()
        return x

    x, w = small_inputs()
    ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, spy)
    out = tc.checkpoint(chain, x, w, use_reentrant=False, context_fn=ctx_fn).sum()
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert answers[False] == [S, R, R, S]
    grads = torch.autograd.grad(out, (x, w), retain_graph=True)
    assert answers[True] == answers[False]
    x_ref, w_ref = (t.detach().requires_grad_(True) for t in (x, w))
    for g, ref in zip(grads, torch.autograd.grad(chain(x_ref, w_ref).sum(), (x_ref, w_ref))):
        assert_tensors_equal(g, ref, "gradient through PyTorch's SAC")
    answers[True].clear()
    with pytest.raises(RuntimeError, match="backward an extra time"):
        torch.autograd.grad(out, (x, w))
    assert answers[True] == [S], "second recompute did not start at call index 0"


def test_to_torch_handed_back_to_torch_sac_is_the_policy():
    policy = policies.every_nth(aten.mm, 2)
    policy_fn = policy.to_torch()
    assert policy_fn.policy is policy
    assert "to_torch" in repr(policy_fn) and "every_nth" in repr(policy_fn)
    _, direct, _ = torch_sac_run(build_gpt, policy)
    _, via_fn, _ = torch_sac_run(build_gpt, policy_fn)
    assert fmt(direct) == fmt(via_fn)


def test_to_torch_wrapped_in_a_user_policy_fn():
    """A user's policy_fn may delegate to .to_torch() (composition)."""
    inner = policies.every_nth(aten.addmm, 2).to_torch()

    def user_policy(ctx, op, *args, **kwargs):
        if op is aten.gelu.default:
            return CheckpointPolicy.MUST_SAVE
        return inner(ctx, op, *args, **kwargs)

    _, saved = torch_run(build_gpt, user_policy)
    expected = promised(
        recorded("gpt"),
        lambda op, i, s: op is aten.gelu.default or (op is aten.addmm.default and i % 2 == 0),
    )
    assert fmt(saved) == fmt(expected)


# --------------------------------------------------------------------------
# Named scopes
# --------------------------------------------------------------------------


def mm_chain(x, w):
    """3 mm; the first inside scope 'a'."""
    with torch_sac.name("a"):
        y = torch.mm(x, w)
    y = torch.mm(y.sin(), w)
    return torch.mm(y.sin(), w).cos()


def small_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g).requires_grad_(True)
    w = torch.randn(4, 4, generator=g).requires_grad_(True)
    return x, w


def test_name_scopes_nest_and_unwind():
    assert torch_sac.scopes.active_names() == []
    with torch_sac.name("outer"):
        with torch_sac.name("inner"):
            assert torch_sac.scopes.active_names() == ["outer", "inner"]
        with torch_sac.name("outer"):
            assert torch_sac.scopes.active_names() == ["outer", "outer"]
    assert torch_sac.scopes.active_names() == []


def test_name_scope_unwinds_on_exception():
    with pytest.raises(KeyError):
        with torch_sac.name("a"):
            with torch_sac.name("b"):
                raise KeyError("boom")
    assert torch_sac.scopes.active_names() == []


def test_name_scope_object_reentrant():
    s = torch_sac.name("again")
    with s:
        with s:
            assert torch_sac.scopes.active_names() == ["again", "again"]
        assert torch_sac.scopes.active_names() == ["again"]
    assert torch_sac.scopes.active_names() == []
    assert repr(s) == "torch_sac.name('again')"


def test_name_as_decorator():
    @torch_sac.name("decorated")
    def f(x, w):
        assert torch_sac.scopes.active_names() == ["decorated"]
        return torch.mm(x, w)

    assert f.__name__ == "f"
    x, w = small_inputs()
    pair = []

    def context_fn():
        pair[:] = torch_sac.create_selective_checkpoint_contexts(policies.save_by_name("decorated"))
        return tuple(pair)

    tc.checkpoint(
        lambda x, w: f(x, w).sin(), x, w, use_reentrant=False, context_fn=context_fn
    ).sum().backward()
    assert pair[0].saved_calls() == [(aten.mm.default, 0)]
    assert torch_sac.scopes.active_names() == []


def test_name_scopes_are_per_thread():
    seen = []
    with torch_sac.name("main"):
        t = threading.Thread(target=lambda: seen.append(torch_sac.scopes.active_names()))
        t.start()
        t.join()
        assert torch_sac.scopes.active_names() == ["main"]
    assert seen == [[]]


def test_scope_closed_out_of_order_raises():
    a, b = torch_sac.name("a"), torch_sac.name("b")
    a.__enter__()
    b.__enter__()
    # Closing a while b (opened inside it) is open: both close, then it raises.
    with pytest.raises(RuntimeError, match=r"'a' was closed out of order.*'b'"):
        a.__exit__(None, None, None)
    assert torch_sac.scopes.active_names() == []
    # b is no longer open at its depth: raises, stack unchanged.
    with pytest.raises(RuntimeError, match=r"'b' was closed out of order"):
        b.__exit__(None, None, None)
    assert torch_sac.scopes.active_names() == []

    with torch_sac.name("outer"):
        c = torch_sac.name("c")
        c.__enter__()
        c.__exit__(None, None, None)
        with pytest.raises(RuntimeError, match=r"'c' was closed out of order.*'outer'"):
            c._depths.append(1)  # a stale token: depth 1 holds 'outer'
            c.__exit__(None, None, None)
        assert torch_sac.scopes.active_names() == ["outer"]
    assert torch_sac.scopes.active_names() == []


def test_save_by_name_scopes_outside_the_region_count():
    """Scopes are per thread, not per region: a scope opened around the
    checkpoint call holds every op of the region."""
    x, w = small_inputs()
    pair = []

    def context_fn():
        pair[:] = torch_sac.create_selective_checkpoint_contexts(policies.save_by_name("outside"))
        return tuple(pair)

    with torch_sac.name("outside"):
        tc.checkpoint(mm_chain, x, w, use_reentrant=False, context_fn=context_fn).sum().backward()
    saved = pair[0].saved_calls()
    assert [i for op, i in saved if op is aten.mm.default] == [0, 1, 2]


def test_save_by_name_calls_no_python_per_op():
    """The decision is made in C++: the number of Python calls inside
    torch_sac during forward does not grow with the number of ops."""

    def python_calls_in_torch_sac(n_ops):
        def fn(x):
            with torch_sac.name("a"):
                for _ in range(n_ops):
                    x = x.sin()
            return x

        calls = collections.Counter()

        def profiler(frame, event, arg):
            if event == "call" and "torch_sac" in frame.f_code.co_filename:
                calls[frame.f_code.co_name] += 1

        fwd, rec = torch_sac.create_selective_checkpoint_contexts(policies.save_by_name("a"))
        x = torch.randn(4, requires_grad=True)
        with fwd:
            sys.setprofile(profiler)
            try:
                fn(x)
            finally:
                sys.setprofile(None)
        assert fwd.stats()["saved_ops"] == n_ops
        return calls

    assert python_calls_in_torch_sac(2) == python_calls_in_torch_sac(20)


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


def _recording_backend():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = {}

    def fw_compiler(gm, example_inputs):
        graphs["fw"] = gm
        return gm

    def bw_compiler(gm, example_inputs):
        graphs["bw"] = gm
        return gm

    backend = aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, graphs


def saved_mm_ordinals(fw_graph):
    """Which forward mm nodes (by position among all forward mm) the
    partitioned forward graph saves for backward."""
    mms = [n for n in fw_graph.graph.nodes if n.target is aten.mm.default]
    output = next(n for n in fw_graph.graph.nodes if n.op == "output")
    saved = set(output.args[0][1:])
    return [i for i, n in enumerate(mms) if n in saved], len(mms)


def two_regions(ctx_fn):
    def f(x, w):
        h = tc.checkpoint(mm_chain, x, w, use_reentrant=False, context_fn=ctx_fn)
        return tc.checkpoint(mm_chain, h, w, use_reentrant=False, context_fn=ctx_fn)

    return f


def grads_of(f, x, w):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    f(x, w).sum().backward()
    return x.grad, w.grad


COMPILE_CASES = [
    # (policy, saved forward mm of the 6 (3 per region), mm 0 of each region named 'a')
    ("every_nth", lambda: policies.every_nth(aten.mm, 2), [0, 2, 3, 5]),
    ("save_by_name", lambda: policies.save_by_name("a"), [0, 3]),
    ("save_matmuls", policies.save_matmuls, [0, 1, 2, 3, 4, 5]),
    ("save_ops", lambda: policies.save_ops([aten.mm]), [0, 1, 2, 3, 4, 5]),
    ("recompute_all", policies.recompute_all, []),
]


def _via_torch(policy):
    return functools.partial(tc.create_selective_checkpoint_contexts, policy.to_torch())


def _via_torch_sac(policy):
    return functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)


@pytest.mark.slow
@pytest.mark.parametrize(
    "contexts", [_via_torch, _via_torch_sac], ids=["torch_to_torch", "torch_sac_dropin"]
)
@pytest.mark.parametrize("name,make,expected", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_policy_under_compile_aot_eager(name, make, expected, contexts):
    """PyTorch's SAC with policy.to_torch(), and torch_sac's drop-in (which
    hands torch.compile PyTorch's modes answered by to_torch()), partition
    the compiled graph by the policy's choices."""
    torch._dynamo.reset()
    f = two_regions(contexts(make()))
    backend, graphs = _recording_backend()
    x, w = small_inputs()
    compiled = torch.compile(f, backend=backend, fullgraph=True)  # torch_sac.name traces
    got = grads_of(compiled, x, w)
    ordinals, n_mm = saved_mm_ordinals(graphs["fw"])
    assert n_mm == 6
    assert ordinals == expected
    ref = grads_of(f, x, w)  # eager
    for a, b, what in zip(got, ref, ("x.grad", "w.grad")):
        torch.testing.assert_close(a, b, msg=f"compiled vs eager {what}")

    # A recompile traces again with fresh modes: same choice.
    torch._dynamo.reset()
    backend, graphs = _recording_backend()
    grads_of(torch.compile(f, backend=backend, fullgraph=True), x, w)
    assert saved_mm_ordinals(graphs["fw"])[0] == expected
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "policy",
    [
        [aten.mm],
        lambda ctx, op, *a, **k: torch_sac.Policy.MUST_SAVE if op is aten.mm.default else False,
    ],
    ids=["packet_list", "callable_returning_torch_sac_policy"],
)
def test_dropin_under_compile_accepts_lists_and_callables(policy):
    torch._dynamo.reset()
    f = two_regions(_via_torch_sac(policy))
    backend, graphs = _recording_backend()
    x, w = small_inputs()
    grads_of(torch.compile(f, backend=backend, fullgraph=True), x, w)
    assert saved_mm_ordinals(graphs["fw"]) == ([0, 1, 2, 3, 4, 5], 6)
    torch._dynamo.reset()


def test_compiled_every_nth_matches_torch_sac_eager():
    """torch_sac's eager saved set is the one compile produced above:
    calls 0 and 2 of each region."""
    policy = policies.every_nth(aten.mm, 2)
    pairs = []

    def context_fn():
        pairs.append(torch_sac.create_selective_checkpoint_contexts(policy))
        return pairs[-1]

    x, w = small_inputs()
    h = tc.checkpoint(mm_chain, x, w, use_reentrant=False, context_fn=context_fn)
    tc.checkpoint(mm_chain, h, w, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert [fwd.saved_calls() for fwd, _ in pairs] == [
        [(aten.mm.default, 0), (aten.mm.default, 2)]
    ] * 2


def test_to_torch_under_compile_inductor():
    """One end-to-end run with the default backend (inductor, CPU, needs a
    C++ compiler): gradients match eager."""
    torch._dynamo.reset()
    f = two_regions(_via_torch(policies.every_nth(aten.mm, 2)))
    x, w = small_inputs()
    got = grads_of(torch.compile(f, fullgraph=True), x, w)
    ref = grads_of(f, x, w)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_name_under_compile_is_an_fx_annotation():
    seen = {}

    def f(x):
        with torch_sac.name("traced"):
            return x.sin()

    def backend(gm, example_inputs):
        seen["custom"] = [
            n.meta.get("custom") for n in gm.graph.nodes if n.op in ("call_function", "call_method")
        ]
        return gm

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(3))
    torch._dynamo.reset()
    assert seen["custom"] == [{"torch_sac.name:traced": True}]
    assert torch_sac.scopes.active_names() == []


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
@pytest.mark.parametrize("bad", [3, None, b"attn", ["attn"]], ids=["int", "None", "bytes", "list"])
def test_name_rejects_non_str(bad):
    with pytest.raises(TypeError, match=repr(bad).replace("[", r"\[").replace("]", r"\]")):
        torch_sac.name(bad)


@pytest.mark.adapter_independent
def test_name_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        torch_sac.name("")


SAVE_BY_NAME_BAD = [
    ((3,), "3"),
    (("ok", 3.5), "3.5"),
    ((["ok", None],), "None"),
    (({"a": 1},), "{'a': 1}"),
]


@pytest.mark.adapter_independent
@pytest.mark.parametrize("args,bad", SAVE_BY_NAME_BAD, ids=["int", "float", "None_in_list", "dict"])
def test_save_by_name_rejects_non_str(args, bad):
    with pytest.raises(TypeError) as excinfo:
        policies.save_by_name(*args)
    assert bad in str(excinfo.value)


@pytest.mark.adapter_independent
def test_save_by_name_rejects_empty_name_and_accepts_no_names():
    with pytest.raises(ValueError, match="non-empty"):
        policies.save_by_name("attn", "")
    none = policies.save_by_name()
    assert repr(none) == "save_by_name()"
    assert repr(policies.save_by_name(["a", "b", "a"])) == "save_by_name('a', 'b')"


def test_every_nth_to_torch_outside_torch_sac_raises():
    policy_fn = policies.every_nth(aten.mm, 2).to_torch()
    for ctx in (sac_ctx(op_output=torch.zeros(2, 2)), sac_ctx(), sac_ctx(is_recompute=True)):
        with pytest.raises(RuntimeError, match="create_selective_checkpoint_contexts"):
            policy_fn(ctx, aten.mm.default, torch.zeros(2, 2), torch.zeros(2, 2))


def test_to_torch_without_call_index_works_when_called_directly():
    """Policies that need no call index answer a direct call too."""
    policy_fn = policies.save_matmuls().to_torch()
    a = torch.zeros(2, 2)
    # With the op's output (PyTorch >= 2.12 and torch_sac's contexts) and
    # without it (PyTorch <= 2.11 asks before the op ran): same answers.
    for ctx in (sac_ctx(op_output=a), sac_ctx()):
        assert policy_fn(ctx, aten.mm.default, a, a) is CheckpointPolicy.MUST_SAVE
        assert policy_fn(ctx, aten.sin.default, a) is CheckpointPolicy.PREFER_RECOMPUTE
        assert policy_fn(ctx, aten.detach.default, a) is CheckpointPolicy.PREFER_RECOMPUTE
        with torch_sac.name("n"):
            by_name = policies.save_by_name("n").to_torch()
            assert by_name(ctx, aten.sin.default, a) is CheckpointPolicy.MUST_SAVE
        assert by_name(ctx, aten.sin.default, a) is CheckpointPolicy.PREFER_RECOMPUTE


def test_to_torch_is_a_method_of_every_builtin():
    for make in (
        lambda: policies.save_ops([aten.mm]),
        policies.recompute_all,
        policies.save_all,
        policies.save_matmuls,
        lambda: policies.every_nth(aten.mm, 2),
        lambda: policies.save_by_name("x"),
    ):
        policy = make()
        fn = policy.to_torch()
        assert callable(fn) and fn.policy is policy


# --------------------------------------------------------------------------
# save_matmuls covers every matmul-class op of the installed torch
# --------------------------------------------------------------------------

# Ops whose names look like matmuls, convolutions or attention but are not
# worth saving as such, with the reason.
_NOT_MATMULS = {
    "aten::_convert_indices_from_coo_to_csr": "index conversion",
    "aten::_convert_indices_from_csr_to_coo": "index conversion",
    "aten::_convert_weight_to_int4pack": "weight layout conversion, once per weight",
    "aten::_convert_weight_to_int4pack_for_cpu": "weight layout conversion, once per weight",
    "aten::mkldnn_reorder_conv2d_weight": "weight layout conversion, once per weight",
    "aten::mkldnn_reorder_conv3d_weight": "weight layout conversion, once per weight",
    "aten::_cslt_sparse_mm_search": "picks an algorithm, returns an int",
    "aten::_flash_attention_forward_no_dropout_inplace": "writes its out argument: always recomputed",
    "aten::_cudnn_attention_forward_no_dropout_inplace": "writes its out argument: always recomputed",
}


def _matmul_like_ops_autograd_sees():
    """aten ops named like a matmul (a ``*mm`` word), convolution or
    attention, that have a kernel below autograd (composite-implicit ops
    decompose before torch_sac sees them); no backward or in-place ops."""
    found = set()
    for schema in torch._C._jit_get_all_schemas():
        namespace, base = schema.name.split("::")
        if namespace != "aten" or "backward" in base or base.endswith("_"):
            continue
        words = base.strip("_").split("_")
        if not any(
            w.endswith("mm") or w.startswith("conv") or w in ("attention", "attn") for w in words
        ):
            continue
        overload = schema.name + ("." + schema.overload_name if schema.overload_name else "")
        if torch._C._dispatch_has_kernel_for_dispatch_key(overload, "CompositeImplicitAutograd"):
            continue
        found.add(schema.name)
    return found


@pytest.mark.adapter_independent
def test_save_matmuls_lists_every_matmul_of_the_installed_torch():
    """A release that adds a matmul-class op fails here until the op is in
    builtin_policies.cpp's list (or in _NOT_MATMULS with its reason)."""
    missing = _matmul_like_ops_autograd_sees() - set(policies.MATMUL_OPS) - set(_NOT_MATMULS)
    assert not missing, f"save_matmuls() does not save {sorted(missing)}"
    assert not set(policies.MATMUL_OPS) & set(_NOT_MATMULS)
    for name in (
        "aten::_grouped_mm",
        "aten::_scaled_mm",
        "aten::_scaled_grouped_mm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_cudnn_attention",
        "flash_attn::_flash_attn_forward",
    ):
        assert name in policies.MATMUL_OPS


def test_save_matmuls_saves_grouped_mm_exactly():
    """MoE experts' grouped matmul (torch._grouped_mm, as transformers 5 runs
    them): saved by save_matmuls, gradients bitwise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 8, generator=g, requires_grad=True)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)

    def experts(x, w):
        return torch._grouped_mm(x.tanh(), w, offs=offs).relu().sum(1)

    experts(x, w).pow(2).sum().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with torch_sac.sac_context(policies.save_matmuls()) as region:
        out = experts(x, w)
    out.pow(2).sum().backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])
    rows = {r["op"]: r for r in region.op_details()}
    assert rows["aten::_grouped_mm.default"]["saved"] == 1
    assert rows["aten::_grouped_mm.default"]["dropped"] == 0


def test_save_matmuls_keeps_a_scaled_mm_output_a_later_op_saves():
    """FP8 _scaled_mm (not differentiable: training runs it on detached FP8
    copies) whose output mul saves: kept by save_matmuls, not rebuilt."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"CPU _scaled_mm unsupported by this torch: {str(e).splitlines()[0]}")
    w = torch.randn(16, 16, generator=g, requires_grad=True)

    def fn():
        return (torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16).float() * w).sin()

    fn().sum().backward()
    ref, w.grad = w.grad, None
    with torch_sac.sac_context(policies.save_matmuls()) as region:
        out = fn()
    out.sum().backward()
    assert torch.equal(w.grad, ref)
    row = {r["op"]: r for r in region.op_details()}["aten::_scaled_mm.default"]
    assert (row["saved"], row["dropped"]) == (1, 0), row


@pytest.mark.adapter_independent
def test_docs_list_every_op_save_matmuls_saves():
    with open(os.path.join(REPO_ROOT, "docs", "policies.md")) as f:
        page = f.read()
    missing = [name for name in policies.MATMUL_OPS if f"`{name}`" not in page]
    assert not missing, f"docs/policies.md does not list {missing}"
