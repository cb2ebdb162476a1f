"""Parity of torch_sac.create_selective_checkpoint_contexts with
(a) the un-checkpointed model and (b) PyTorch's own SAC, over a matrix of
models x policies.

Gradients are compared bitwise (torch.equal): everything runs on CPU where
these kernels are deterministic, and dropout masks are reproduced by seeding
the global RNG before every run (non-reentrant checkpoint restores the RNG
state for recompute).
"""

import pytest
import torch

import torch_sac
from conftest import (
    mutates_args,
    ContextRecorder,
    RecordingPolicy,
    aten,
    assert_buffers_equal,
    assert_grads_equal,
    list_policy_fn,
    make_every_nth_fn,
    mixed_policy_fn,
    recompute_all_fn,
    run_model,
    sac_context_fn,
    save_all_fn,
    torch_context_fn,
)
from models import MODEL_BUILDERS, Stack

MM_OPS = [aten.mm.default, aten.addmm.default]


class Case:
    """One policy, expressed three ways.

    sac():    what is passed to torch_sac (list, callable or built-in object);
              built once per test and shared by all regions.
    equiv():  an equivalent Python callable, created fresh per region (it may
              be stateful); used for PyTorch's SAC and for recording.
    allow:    allow_cache_entry_mutation. Saving *everything* caches tensors
              that the models later mutate in place (ReLU(inplace), residual
              add_, dropout's div_), which PyTorch rejects unless allowed.
    """

    def __init__(self, name, sac, equiv, allow=False):
        self.name, self.sac, self.equiv, self.allow = name, sac, equiv, allow

    def __repr__(self):
        return self.name


CASES = [
    Case("ops_list", lambda: list(MM_OPS), lambda: list_policy_fn(MM_OPS)),
    Case("callable", lambda: mixed_policy_fn, lambda: mixed_policy_fn),
    Case("save_all", lambda: torch_sac.policies.save_all(), lambda: save_all_fn, allow=True),
    Case("recompute_all", lambda: torch_sac.policies.recompute_all(), lambda: recompute_all_fn),
    Case(
        "every_other_mm",
        lambda: torch_sac.policies.every_nth(list(MM_OPS), 2),
        lambda: make_every_nth_fn(MM_OPS, 2),
    ),
]
CASE_IDS = [c.name for c in CASES]


def n_regions(model_name):
    module, _ = MODEL_BUILDERS[model_name]()
    return len(module) if isinstance(module, Stack) else 1


# --------------------------------------------------------------------------
# PyTorch SAC runs (cached: several tests compare against the same run)
# --------------------------------------------------------------------------

_TORCH_RUNS = {}


class TorchRun:
    def __init__(self, result, policies, recorder):
        self.result = result
        self.policies = policies  # one RecordingPolicy per region
        self.recorder = recorder

    @property
    def decisions(self):
        """Normalised (op, saved?) sequence over all regions, ignored ops removed."""
        seq = []
        for p in self.policies:
            seq += [(op, s) for op, s in p.normalised() if op not in torch_sac.IGNORED_OPS]
        return seq

    @property
    def cache_hits(self):
        return sum(rec.hits for _, rec in self.recorder.pairs)

    @property
    def recomputed(self):
        return sum(rec.recomputed for _, rec in self.recorder.pairs)


def torch_run(model_name, case):
    key = (model_name, case.name)
    if key not in _TORCH_RUNS:
        policies = []
        recorder = ContextRecorder()

        def factory():
            p = RecordingPolicy(case.equiv())
            policies.append(p)
            return p

        result = run_model(model_name, torch_context_fn(factory, case.allow, recorder))
        _TORCH_RUNS[key] = TorchRun(result, policies, recorder)
    return _TORCH_RUNS[key]


def fmt(seq):
    return [(str(op), s) for op, s in seq]


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_plain_and_torch_sac(model_name, case, reference_results):
    ref = reference_results(model_name)
    theirs = torch_run(model_name, case).result
    # Harness sanity: PyTorch's SAC itself reproduces the plain run bitwise.
    assert_grads_equal(theirs, ref, f"torch SAC[{case}] vs plain")

    policy = case.sac()
    recorder = ContextRecorder()
    ours = run_model(model_name, sac_context_fn(lambda: policy, case.allow, recorder))

    assert len(recorder.pairs) == n_regions(model_name), "context_fn not used once per region"
    assert_grads_equal(ours, ref, f"torch_sac[{case}] vs plain")
    assert_grads_equal(ours, theirs, f"torch_sac[{case}] vs torch SAC")
    # The region really intercepted ops.
    assert recorder.stats()["policy_calls"] > 0


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_policy_sees_same_ops_as_torch_sac(model_name, case, reference_results):
    theirs = torch_run(model_name, case)

    policies = []

    def factory():
        p = RecordingPolicy(case.equiv())
        policies.append(p)
        return p

    ours = run_model(model_name, sac_context_fn(factory, case.allow))

    assert len(policies) == n_regions(model_name)
    for p in policies:
        assert p.recompute_calls == 0, "policy called with ctx.is_recompute=True"
        assert p.missing_output == 0, "policy called without ctx.op_output"
        assert not [op for op in p.ops if op in torch_sac.IGNORED_OPS], (
            "ignored op passed to policy"
        )

    seq_ours = []
    for p in policies:
        seq_ours += p.normalised()
    seq_theirs = theirs.decisions
    assert len(seq_ours) > 0
    # Same ops, same order, same decisions (the policy is called once per op
    # in forward and never in recompute, so the sequences must be identical).
    assert fmt(seq_ours) == fmt(seq_theirs)
    assert_grads_equal(ours, reference_results(model_name), f"torch_sac[recorded {case}] vs plain")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_stats_match_torch_sac(model_name, case):
    theirs = torch_run(model_name, case)
    policy = case.sac()
    recorder = ContextRecorder()
    run_model(model_name, sac_context_fn(lambda: policy, case.allow, recorder))
    stats = recorder.stats()

    decisions = theirs.decisions
    # The drop-in does not cache ops that write their arguments, nor outputs
    # written in place later in forward (invalidated_ops): it recomputes
    # them where PyTorch hands back its cache (see mutates_args).
    cacheable = sum(s and not mutates_args(op) for op, s in decisions)
    assert stats["policy_calls"] == len(decisions)
    assert stats["saved_ops"] == cacheable - stats["invalidated_ops"]
    assert stats["cache_hits"] + stats["recomputed_ops"] == theirs.cache_hits + theirs.recomputed
    assert stats["cache_hits"] <= stats["saved_ops"]
    if not any(mutates_args(op) for op, s in decisions if s):
        assert (stats["cache_hits"], stats["recomputed_ops"]) == (
            theirs.cache_hits,
            theirs.recomputed,
        )
    assert (stats["saved_bytes"] > 0) == (stats["saved_ops"] > 0)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_batchnorm_buffers_updated_once(case):
    """The drop-in's recompute re-runs the user's forward, and BatchNorm's
    running-statistics update with it; torch_sac makes that update write to a
    copy, so the buffers end as without checkpointing, bit for bit (PyTorch's
    SAC updates them twice: num_batches_tracked ends at 2)."""
    theirs = torch_run("convbn", case).result
    policy = case.sac()
    ours = run_model("convbn", sac_context_fn(lambda: policy, case.allow))
    plain = run_model("convbn")
    assert_grads_equal(ours, theirs, f"torch_sac[{case}] vs torch SAC")
    assert_buffers_equal(ours, plain, f"torch_sac[{case}] BN buffers vs plain")
    assert int(ours.buffers["bn.num_batches_tracked"]) == 1


def test_dropout_is_exercised():
    """The GPT models really use the RNG (so the parity tests check that
    recompute reproduces dropout masks)."""
    a = run_model("gpt", seed=0)
    b = run_model("gpt", seed=1)
    assert not torch.equal(a.out, b.out)
    assert not torch.equal(a.input_grad, b.input_grad)


def test_every_nth_counts_per_region():
    """every_nth([mm, addmm], 2) saves call indices 0, 2 of addmm in each GPT
    block's region (4 Linear layers per block -> 2 saved per region)."""
    policy = torch_sac.policies.every_nth(list(MM_OPS), 2)
    recorder = ContextRecorder()
    ours = run_model("gpt", sac_context_fn(lambda: policy, False, recorder))
    assert len(recorder.pairs) == 2
    for fwd, _ in recorder.pairs:
        assert fwd.stats()["saved_ops"] == 2
    # Reusing the same policy object for a second step gives the same decisions.
    recorder2 = ContextRecorder()
    again = run_model("gpt", sac_context_fn(lambda: policy, False, recorder2))
    assert [f.stats()["saved_ops"] for f, _ in recorder2.pairs] == [2, 2]
    assert_grads_equal(again, ours, "every_nth second step")
