"""``torch_sac.checkpoint`` and ``checkpoint_sequential`` as drop-ins for
``torch.utils.checkpoint``'s: the signature, each torch keyword (honoured,
accepted or refused with the keyword named), ``context_fn``, the decorator
form. Gradients are compared bitwise with the un-checkpointed run."""

import contextlib
import functools
import inspect

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

import torch_sac
from torch_sac import _compat

aten = torch.ops.aten


def _block(x, w, scale=1.0):
    h = torch.nn.functional.dropout(torch.mm(x, w).relu(), p=0.3, training=True)
    return (h * scale).sin().cumsum(0)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g, requires_grad=True)
    w = torch.randn(5, 5, generator=g, requires_grad=True)
    return x, w


def _grads(run, seed=0):
    x, w = _inputs(seed)
    torch.manual_seed(123)
    out = run(x, w)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, w.grad


def _assert_exact(run, label):
    ref = _grads(lambda x, w: _block(x, w, scale=2.0))
    got = _grads(run)
    for a, b, what in zip(got, ref, ("output", "x.grad", "w.grad")):
        assert torch.equal(a, b), f"{label}: {what} differs from the un-checkpointed run"


def _regions(prof):
    return prof.to_dict()["regions"]


class _CountCalls:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------------------
# Signature
# ---------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_signature_has_torchs_keywords_with_torchs_defaults():
    ours = inspect.signature(torch_sac.checkpoint).parameters
    for name, p in inspect.signature(tc.checkpoint).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert any(q.kind == p.kind for q in ours.values()), name
            continue
        if name == "function":  # optional from torch 2.14 on (the decorator form)
            assert ours[name].kind is p.kind
            continue
        assert name in ours, f"torch_sac.checkpoint lacks torch's keyword {name!r}"
        assert ours[name].default is p.default or ours[name].default == p.default, (
            f"{name}: default {ours[name].default!r}, torch's is {p.default!r}"
        )
    # preserve_rng_state is a **kwargs entry before torch 2.14, a keyword after.
    assert ours["preserve_rng_state"].default is True
    for name in ("policy", "allow_cache_entry_mutation", "replay_budget"):
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.adapter_independent
def test_checkpoint_sequential_signature_matches_torchs():
    ours = list(inspect.signature(torch_sac.checkpoint_sequential).parameters)
    theirs = list(inspect.signature(tc.checkpoint_sequential).parameters)
    assert ours == theirs


# ---------------------------------------------------------------------------
# The literal replacement
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keywords",
    [
        dict(use_reentrant=False),
        dict(),
        dict(use_reentrant=None, preserve_rng_state=True),
        dict(use_reentrant=False, preserve_rng_state=False),
        dict(use_reentrant=False, determinism_check="none"),
        dict(use_reentrant=False, determinism_check="default", debug=True),
        dict(use_reentrant=False, early_stop=False),
        dict(use_reentrant=False, context_fn=tc.noop_context_fn),
    ],
    ids=lambda k: ",".join(f"{a}={b!r}" for a, b in k.items()) or "none",
)
def test_torch_keywords_are_exact(keywords):
    """With no policy: plain checkpointing, exact with dropout (the region
    replays with forward's random state, whatever preserve_rng_state says)."""
    _assert_exact(
        lambda x, w: torch_sac.checkpoint(_block, x, w, scale=2.0, **keywords), str(keywords)
    )


def test_function_keywords_reach_the_function():
    seen = {}

    def fn(x, *, factor, note=None):
        seen["note"] = note
        return x * factor

    x = torch.randn(3, requires_grad=True)
    y = torch_sac.checkpoint(fn, x, use_reentrant=False, factor=3.0, note="hi")
    y.sum().backward()
    assert seen["note"] == "hi"
    assert torch.equal(x.grad, torch.full((3,), 3.0))


def test_no_policy_runs_the_function_once():
    """torch's checkpoint runs the function again in backward; the region does not."""
    x, w = _inputs()
    ours = _CountCalls(_block)
    torch_sac.checkpoint(ours, x, w, use_reentrant=False).sum().backward()
    assert ours.calls == 1
    theirs = _CountCalls(_block)
    x, w = _inputs()
    tc.checkpoint(theirs, x, w, use_reentrant=False).sum().backward()
    assert theirs.calls == 2


def test_no_policy_drops_what_recompute_all_drops():
    x, w = _inputs()
    with torch_sac.profile() as prof:
        torch_sac.checkpoint(_block, x, w, use_reentrant=False).sum().backward()
    regions = _regions(prof)
    assert len(regions) == 1 and regions[0]["engine"] == "region"
    assert regions[0]["stats"]["saved_ops"] == 0 and regions[0]["stats"]["dropped_ops"] > 0


# ---------------------------------------------------------------------------
# Refusals and bad values
# ---------------------------------------------------------------------------


def test_use_reentrant_true_is_refused_naming_the_keyword_and_alternative():
    x, w = _inputs()
    with pytest.raises(
        ValueError, match=r"use_reentrant=True.*use_reentrant=False.*torch\.utils\.checkpoint"
    ):
        torch_sac.checkpoint(_block, x, w, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        torch_sac.checkpoint_sequential([nn.ReLU(), nn.ReLU()], 2, x, use_reentrant=True)


@pytest.mark.parametrize(
    "keyword,value,error",
    [
        ("use_reentrant", "no", TypeError),
        ("determinism_check", "strict", ValueError),
        ("debug", 1, TypeError),
        ("early_stop", None, TypeError),
        ("preserve_rng_state", "yes", TypeError),
        ("respect_saved_tensors_hooks", 0, TypeError),
        ("allow_cache_entry_mutation", 1, TypeError),
        ("replay_budget", -1, ValueError),
    ],
)
def test_bad_values_name_the_keyword(keyword, value, error):
    x, w = _inputs()
    with pytest.raises(error, match=keyword):
        torch_sac.checkpoint(_block, x, w, **{keyword: value})


def test_policy_and_context_fn_together_are_refused():
    ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, [aten.mm])
    x, w = _inputs()
    with pytest.raises(ValueError, match="policy or context_fn"):
        torch_sac.checkpoint(_block, x, w, policy=torch_sac.policies.save_all(), context_fn=ctx_fn)


def test_respect_saved_tensors_hooks_true_refused_with_a_selective_policy():
    x, w = _inputs()
    with pytest.raises(ValueError, match=r"respect_saved_tensors_hooks=True.*inside"):
        torch_sac.checkpoint(
            _block,
            x,
            w,
            use_reentrant=False,
            respect_saved_tensors_hooks=True,
            policy=torch_sac.policies.save_matmuls(),
        )
    # Plain checkpointing keeps no tensors of its own: accepted, as in torch.
    _assert_exact(
        lambda x, w: torch_sac.checkpoint(
            _block, x, w, scale=2.0, use_reentrant=False, respect_saved_tensors_hooks=True
        ),
        "respect_saved_tensors_hooks=True, no policy",
    )


def test_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        torch_sac.checkpoint(3, torch.ones(1))


# ---------------------------------------------------------------------------
# context_fn
# ---------------------------------------------------------------------------


def _ctx_fns():
    save_mm = [aten.mm.default]
    return {
        "torch_sac partial": functools.partial(
            torch_sac.create_selective_checkpoint_contexts, save_mm
        ),
        "torch partial": functools.partial(tc.create_selective_checkpoint_contexts, save_mm),
        "torch partial, keywords": functools.partial(
            tc.create_selective_checkpoint_contexts,
            policy_fn_or_list=save_mm,
            allow_cache_entry_mutation=True,
        ),
        "torch_sac lambda": lambda: torch_sac.create_selective_checkpoint_contexts(save_mm),
        "torch lambda, policy_fn": lambda: tc.create_selective_checkpoint_contexts(
            lambda ctx, op, *a, **k: tc.CheckpointPolicy.MUST_SAVE
            if op is aten.mm.default
            else tc.CheckpointPolicy.PREFER_RECOMPUTE
        ),
    }


@pytest.mark.parametrize("name", list(_ctx_fns()))
def test_selective_context_fn_runs_its_policy_in_a_region(name):
    ctx_fn = _ctx_fns()[name]
    counted = _CountCalls(_block)
    x, w = _inputs()
    with torch_sac.profile() as prof:
        torch_sac.checkpoint(counted, x, w, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    assert counted.calls == 1, "a selective context_fn runs in a region: no re-run"
    (region,) = _regions(prof)
    assert region["engine"] == "region"
    assert region["stats"]["saved_ops"] == 1, f"{name}: the mm alone is saved, got {region}"
    _assert_exact(
        lambda x, w: torch_sac.checkpoint(
            _block, x, w, scale=2.0, use_reentrant=False, context_fn=ctx_fn
        ),
        name,
    )


class _CountingContext(contextlib.AbstractContextManager):
    def __init__(self):
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return False


def test_other_context_fn_is_run_by_torchs_checkpoint():
    fwd, rec = _CountingContext(), _CountingContext()
    made = []

    def ctx_fn():
        made.append(1)
        return fwd, rec

    counted = _CountCalls(_block)
    x, w = _inputs()
    torch_sac.checkpoint(counted, x, w, use_reentrant=False, context_fn=ctx_fn).sum().backward()
    assert len(made) == 1, "context_fn is called once per checkpoint, as by torch"
    assert (fwd.entered, rec.entered) == (1, 1)
    assert counted.calls == 2, "torch's checkpoint re-runs the function under the recompute context"
    _assert_exact(
        lambda x, w: torch_sac.checkpoint(
            _block,
            x,
            w,
            scale=2.0,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()),
        ),
        "foreign context_fn",
    )


def test_other_context_fn_with_replay_budget_is_refused():
    x, w = _inputs()
    with pytest.raises(ValueError, match="replay_budget"):
        torch_sac.checkpoint(
            _block,
            x,
            w,
            use_reentrant=False,
            replay_budget=0,
            context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()),
        )


def test_subclassed_torch_modes_are_not_taken_apart():
    """A subclass of PyTorch's SAC modes (xformers has one) may change what
    they do: torch runs it."""

    class Caching(tc._CachingTorchDispatchMode):
        pass

    made = {}

    def ctx_fn():
        fwd, rec = tc.create_selective_checkpoint_contexts([aten.mm.default])
        made["fwd"] = Caching(fwd.policy_fn, fwd.storage)
        return made["fwd"], rec

    assert torch_sac.checkpointing._selective_policy(ctx_fn)[0] is None


# ---------------------------------------------------------------------------
# Decorator form (torch 2.14+'s, on every release here)
# ---------------------------------------------------------------------------


def test_decorator_form():
    @torch_sac.checkpoint(use_reentrant=False)
    def block(x, w, scale=1.0):
        return _block(x, w, scale)

    assert block.__name__ == "block"
    _assert_exact(lambda x, w: block(x, w, scale=2.0), "decorator")


def test_decorator_form_on_a_method_and_with_a_policy():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        @torch_sac.checkpoint(use_reentrant=False, policy=torch_sac.policies.save_matmuls())
        def forward(self, x):
            return self.lin(x).tanh()

    torch.manual_seed(0)
    m = Model()
    x = torch.randn(3, 5)
    m(x).sum().backward()
    got = m.lin.weight.grad.clone()
    m.zero_grad()
    Model.forward.__wrapped__(m, x).sum().backward()
    assert torch.equal(got, m.lin.weight.grad)


def test_decorator_form_refuses_function_keywords():
    with pytest.raises(ValueError, match="unexpected: scale"):
        torch_sac.checkpoint(use_reentrant=False, scale=2.0)


# ---------------------------------------------------------------------------
# checkpoint_sequential
# ---------------------------------------------------------------------------


def _sequential(n=6, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(n):
        layers += [nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()]
    return nn.Sequential(*layers)


def _sequential_grads(run, seed=0):
    model = _sequential(seed=seed)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)
    out = run(model, x)
    out.sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("segments", [1, 2, 3, 18])
@pytest.mark.parametrize(
    "keywords",
    [
        dict(),
        dict(policy=torch_sac.policies.save_matmuls()),
        dict(preserve_rng_state=False),
        dict(replay_budget=0),
    ],
    ids=["plain", "save_matmuls", "no_rng", "replay_budget"],
)
def test_checkpoint_sequential_is_exact(segments, keywords):
    ref = _sequential_grads(lambda m, x: m(x))
    got = _sequential_grads(
        lambda m, x: torch_sac.checkpoint_sequential(
            m, segments, x, use_reentrant=False, **keywords
        )
    )
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_checkpoint_sequential_checkpoints_all_segments_but_the_last():
    model = _sequential(n=4)
    x = torch.randn(4, 8, requires_grad=True)
    with torch_sac.profile() as prof:
        torch_sac.checkpoint_sequential(list(model), 4, x, use_reentrant=False).sum().backward()
    assert len(_regions(prof)) == 3


@pytest.mark.parametrize(
    "segments,error", [(0, ValueError), (13, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_checkpoint_sequential_bad_segments(segments, error):
    with pytest.raises(error, match="segments"):
        torch_sac.checkpoint_sequential(
            _sequential(n=4), segments, torch.randn(2, 8), use_reentrant=False
        )


def test_checkpoint_sequential_unexpected_keyword():
    with pytest.raises(ValueError, match="unexpected keyword arguments: scale"):
        torch_sac.checkpoint_sequential(
            _sequential(n=2), 2, torch.randn(2, 8), use_reentrant=False, scale=2.0
        )


@pytest.mark.adapter_independent
def test_respect_saved_tensors_hooks_flag_matches_the_installed_torch():
    has = "respect_saved_tensors_hooks" in inspect.signature(tc.checkpoint).parameters
    assert _compat.CHECKPOINT_TAKES_RESPECT_SAVED_TENSORS_HOOKS is has


@pytest.mark.parametrize(
    "keywords,error,match",
    [
        (dict(use_reentrant=True), ValueError, "use_reentrant"),
        (dict(determinism_check="x"), ValueError, "determinism_check"),
        (dict(policy="save everything"), TypeError, "policy|checkpoint_sequential"),
        (dict(replay_budget=-1), ValueError, "replay_budget"),
    ],
)
def test_checkpoint_sequential_checks_keywords_with_one_segment(keywords, error, match):
    """One segment checkpoints nothing; bad keywords still raise."""
    with pytest.raises(error, match=match):
        torch_sac.checkpoint_sequential(
            [nn.ReLU()], 1, torch.randn(2, requires_grad=True), **keywords
        )
