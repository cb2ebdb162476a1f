"""Shared helpers and fixtures for the torch_sac Python tests.

The suite runs once per interception adapter (scripts/run_tests.sh sets
TORCH_SAC_ADAPTER); nothing here assumes a particular adapter.
"""

import collections
import gc
import contextlib
import os
import sys

import pytest
import torch
import torch.utils.checkpoint as tc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))

if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    import torch_sac  # noqa: F401
except ImportError:  # running from elsewhere without an installed package
    sys.path.insert(0, REPO_ROOT)
    import torch_sac  # noqa: F401
from torch_sac import _compat  # noqa: E402

import helpers  # noqa: E402
from models import MODEL_BUILDERS, Stack  # noqa: E402

helpers.warm_up_first_backward()  # before any reference is computed

aten = torch.ops.aten

SAVE_POLICIES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

# A fixed seed for the global RNG before every run (dropout masks) and a fixed
# generator for the loss weights.
RUN_SEED = 0
LOSS_SEED = 7


# --------------------------------------------------------------------------
# Policy helpers
# --------------------------------------------------------------------------


def is_save(decision):
    """Normalise any accepted policy return value to 'save?' (True/False)."""
    if isinstance(decision, bool):
        return decision
    if isinstance(decision, CheckpointPolicy):
        return decision in SAVE_POLICIES
    if isinstance(decision, torch_sac.Policy):
        return decision in (torch_sac.Policy.MUST_SAVE, torch_sac.Policy.PREFER_SAVE)
    raise AssertionError(f"unexpected policy value {decision!r}")


_BATCH_NORM_KERNELS = (
    "aten::native_batch_norm",
    "aten::cudnn_batch_norm",
    "aten::miopen_batch_norm",
)


def mutates_args(op):
    """Whether the drop-in re-runs ``op`` in recompute whatever the policy
    says: ops that write their arguments, except batch-norm kernels (whose
    only writes go to running statistics from outside the region, and which
    return new tensors)."""
    schema = op._schema
    if schema.name in _BATCH_NORM_KERNELS:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def assert_drop_in_cached(saved, decided, invalidated, label):
    """The drop-in caches exactly the calls the policy saved, less ops that
    write their arguments and less the outputs written in place later in
    forward (``invalidated_ops``), which recompute runs again."""
    cacheable = {(op, i) for op, i in decided if not mutates_args(op)}
    assert set(saved) <= cacheable, f"{label}: cached calls the policy did not save"
    assert len(cacheable) - len(set(saved)) == invalidated, (
        f"{label}: {len(cacheable)} cacheable saved calls, {len(set(saved))} cached, "
        f"{invalidated} invalidated"
    )


def not_ignored(ops):
    return [op for op in ops if op not in torch_sac.IGNORED_OPS]


class RecordingPolicy:
    """Wraps a policy callable and records ``(op, decision)`` per forward call.

    Also counts what the contract checks for torch_sac: calls during recompute
    (``ctx.is_recompute``; torch_sac never makes them) and forward calls
    without ``ctx.op_output`` (torch_sac always sets it). PyTorch's own SAC
    makes both on torch <= 2.11 (see ``torch_sac._compat``): it asks before
    the op runs, and asks again in recompute; those recompute calls are passed
    to the inner policy (PyTorch needs the answers) but not recorded in
    ``calls``, which stays the forward's decisions.
    """

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        self.recompute_calls = 0
        self.missing_output = 0

    def __call__(self, ctx, op, *args, **kwargs):
        decision = self.inner(ctx, op, *args, **kwargs)
        if ctx.is_recompute:
            self.recompute_calls += 1
            return decision
        if getattr(ctx, "op_output", None) is None:
            self.missing_output += 1
        self.calls.append((op, decision))
        return decision

    @property
    def ops(self):
        return [op for op, _ in self.calls]

    def normalised(self):
        """(op, saved?) pairs, independent of the enum/bool flavour."""
        return [(op, is_save(d)) for op, d in self.calls]

    @property
    def n_saved(self):
        return sum(is_save(d) for _, d in self.calls)

    @property
    def n_saved_cacheable(self):
        """Saved calls of ops the drop-in may cache (see mutates_args)."""
        return sum(is_save(d) and not mutates_args(op) for op, d in self.calls)


def sac_ctx(op_output=None, is_recompute=False):
    """A ``SelectiveCheckpointContext`` as a policy is handed one. PyTorch
    >= 2.12 takes ``op_output`` in the constructor; on older releases (whose
    SAC asks before the op runs, without it) it is set as an attribute, as
    torch_sac's own contexts do there. ``op_output=None``: a context without
    the op's output, as PyTorch <= 2.11's SAC hands its policy."""
    if op_output is None:
        return tc.SelectiveCheckpointContext(is_recompute=is_recompute)
    if _compat.sac_policy_sees_output():
        return tc.SelectiveCheckpointContext(is_recompute=is_recompute, op_output=op_output)
    ctx = tc.SelectiveCheckpointContext(is_recompute=is_recompute)
    ctx.op_output = op_output
    return ctx


_TORCH_SAC_ASKS_IN_RECOMPUTE = []


def torch_sac_asks_policy_in_recompute():
    """Whether PyTorch's own SAC calls ``policy_fn`` during recompute too
    (``ctx.is_recompute=True``): torch <= 2.11 does, later releases look the
    forward's decisions up instead (see ``torch_sac._compat``). Measured once
    on a two-op region rather than read from the version."""
    if not _TORCH_SAC_ASKS_IN_RECOMPUTE:
        flags = []

        def policy(ctx, op, *args, **kwargs):
            flags.append(bool(ctx.is_recompute))
            return CheckpointPolicy.PREFER_RECOMPUTE

        x = torch.ones(2, requires_grad=True)
        ctx_fn = lambda: tc.create_selective_checkpoint_contexts(policy)  # noqa: E731
        tc.checkpoint(
            lambda t: t.sin().cos(), x, use_reentrant=False, context_fn=ctx_fn
        ).sum().backward()
        assert False in flags, "PyTorch's SAC never asked its policy in forward"
        _TORCH_SAC_ASKS_IN_RECOMPUTE.append(True in flags)
    return _TORCH_SAC_ASKS_IN_RECOMPUTE[0]


def list_policy_fn(ops):
    """PyTorch's own expansion of a list of ops into a callable."""
    ops = list(ops)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def save_all_fn(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def recompute_all_fn(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def mixed_policy_fn(ctx, op, *args, **kwargs):
    """A 'real' Python policy returning a mix of enum values and bools."""
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    if op is aten.convolution.default:
        return CheckpointPolicy.PREFER_SAVE
    if op is aten._softmax.default:
        return True
    if op is aten.gelu.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return False


def is_matmul_op(op):
    """What torch_sac.policies.save_matmuls() is documented to save: the ops
    in MATMUL_OPS (test_policy_library.py checks that list against the
    installed torch's ops)."""
    return op.name() in torch_sac.policies.MATMUL_OPS


def save_matmuls_fn(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if is_matmul_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def make_every_nth_fn(ops, n):
    """Stateful equivalent of torch_sac.policies.every_nth for PyTorch's SAC.

    Must be created fresh for every region. PyTorch >= 2.13 calls the policy
    only in forward; torch <= 2.11 also calls it once per op in recompute
    (``ctx.is_recompute=True``) and needs the same answers there, so forward
    and recompute calls are counted apart, as PyTorch's own tests do (good
    for one backward per region).
    """
    ops = list(ops)
    counts = {False: collections.Counter(), True: collections.Counter()}

    def policy(ctx, op, *args, **kwargs):
        if op not in ops:
            return CheckpointPolicy.PREFER_RECOMPUTE
        per_op = counts[bool(ctx.is_recompute)]
        idx = per_op[op]
        per_op[op] += 1
        return CheckpointPolicy.MUST_SAVE if idx % n == 0 else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# --------------------------------------------------------------------------
# Context factories
# --------------------------------------------------------------------------


def sac_ignored(op):
    """Ops neither SAC shows to a policy nor caches (PyTorch's set of the
    installed release, and torch_sac's)."""
    return op in tc.SAC_IGNORED_OPS or op in torch_sac.IGNORED_OPS


class _AboveRecompute(TorchDispatchMode):
    """Sees every op a recompute runs, before PyTorch's recompute mode."""

    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if sac_ignored(func):
            return func(*args, **kwargs)
        obs = self.observer
        idx = obs._counts[func]
        obs._counts[func] += 1
        obs._ran = False
        out = func(*args, **kwargs)
        (obs.recomputed_calls if obs._ran else obs.hit_calls).append((func, idx))
        return out


class _BelowRecompute(TorchDispatchMode):
    """Sees only the ops PyTorch's recompute mode runs again."""

    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not sac_ignored(func):
            self.observer._ran = True
        return func(*args, **({} if kwargs is None else kwargs))


class ObservedRecompute:
    """PyTorch's recompute context (its ``_CachedTorchDispatchMode``) between
    two plain dispatch modes, to see what it does without reading its storage
    (whose layout differs between releases): an op that reaches the mode above
    but not the one below was served from SAC's cache, one that reaches both
    was run again. Calls are numbered per op within each recompute pass, as
    SAC numbers them, so ``hit_calls`` lists the cached (op, call index)
    pairs. With early stop (the default) a recompute ends once backward has
    what it needs, so ops after that show in neither list; under
    ``tc.set_checkpoint_early_stop(False)`` ``hit_calls`` is exactly the set
    SAC saved in forward."""

    def __init__(self, mode):
        self.mode = mode
        self.hit_calls = []
        self.recomputed_calls = []
        self._counts = collections.Counter()
        self._ran = False
        self._stack = None

    @property
    def hits(self):
        return len(self.hit_calls)

    @property
    def recomputed(self):
        return len(self.recomputed_calls)

    def __enter__(self):
        self._counts = collections.Counter()  # a new recompute pass
        stack = contextlib.ExitStack()
        stack.enter_context(_BelowRecompute(self))
        stack.enter_context(self.mode)
        stack.enter_context(_AboveRecompute(self))
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


class ContextRecorder:
    """Collects the (forward_ctx, recompute_ctx) pairs a context_fn created."""

    def __init__(self):
        self.pairs = []

    def stats(self):
        """Summed stats over all regions: forward counters from the forward
        contexts, recompute counters from the recompute contexts."""
        total = collections.Counter()
        for fwd, rec in self.pairs:
            fs, rs = fwd.stats(), rec.stats()
            for k in ("policy_calls", "saved_ops", "saved_bytes", "invalidated_ops"):
                total[k] += fs[k]
            for k in ("recomputed_ops", "cache_hits", "redirected_writes"):
                total[k] += rs[k]
        return dict(total)


def sac_context_fn(policy_factory, allow_cache_entry_mutation=False, recorder=None):
    """A context_fn building torch_sac contexts; ``policy_factory()`` is called
    once per region so stateful policies start fresh."""

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts(
            policy_factory(), allow_cache_entry_mutation=allow_cache_entry_mutation
        )
        if recorder is not None:
            recorder.pairs.append(pair)
        return pair

    return context_fn


def torch_context_fn(policy_factory, allow_cache_entry_mutation=False, recorder=None):
    """Same for PyTorch's own SAC; its recompute is observed (ObservedRecompute)
    to count cache hits and re-run ops."""

    def context_fn():
        fwd, rec = tc.create_selective_checkpoint_contexts(
            policy_factory(), allow_cache_entry_mutation=allow_cache_entry_mutation
        )
        rec = ObservedRecompute(rec)
        if recorder is not None:
            recorder.pairs.append((fwd, rec))
        return fwd, rec

    return context_fn


# --------------------------------------------------------------------------
# Running models
# --------------------------------------------------------------------------

RunResult = collections.namedtuple("RunResult", "out param_grads input_grad buffers")


def forward(module, x, context_fn=None):
    """Forward through ``module``; with a context_fn, checkpoint it
    (non-reentrant), one region per block for a :class:`Stack`."""
    if context_fn is None:
        return module(x)
    if isinstance(module, Stack):
        h = x
        for block in module:
            h = tc.checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        return h
    return tc.checkpoint(module, x, use_reentrant=False, context_fn=context_fn)


def loss_of(out):
    g = torch.Generator().manual_seed(LOSS_SEED)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return (out * w).sum()


def run_model(builder, context_fn=None, seed=RUN_SEED, forward_fn=None):
    """Build a fresh model, run forward (+checkpoint) and backward with a fixed
    RNG seed. Returns output, param grads, input grad and buffers (BN stats)."""
    if isinstance(builder, str):
        builder = MODEL_BUILDERS[builder]
    module, make_input = builder()
    x = make_input()
    torch.manual_seed(seed)
    if forward_fn is None:
        out = forward(module, x, context_fn)
    else:
        out = forward_fn(module, x, context_fn)
    loss_of(out).backward()
    return collect(module, x, out)


def collect(module, x, out):
    """A RunResult of ``module`` after its backward from input ``x`` to ``out``."""
    return RunResult(
        out=out.detach().clone(),
        param_grads={
            n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()
        },
        input_grad=None if x.grad is None else x.grad.clone(),
        buffers={n: b.clone() for n, b in module.named_buffers()},
    )


def assert_tensors_equal(a, b, what):
    assert a is not None and b is not None, f"{what}: missing tensor ({a is None}, {b is None})"
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    )
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff:.3g})")


def assert_grads_equal(res, ref, label):
    """Bitwise equality of output, every parameter grad and the input grad."""
    assert_tensors_equal(res.out, ref.out, f"{label}: output")
    assert res.param_grads.keys() == ref.param_grads.keys()
    for name in ref.param_grads:
        assert_tensors_equal(
            res.param_grads[name], ref.param_grads[name], f"{label}: grad of {name}"
        )
    assert_tensors_equal(res.input_grad, ref.input_grad, f"{label}: input grad")


def assert_buffers_equal(res, ref, label):
    assert res.buffers.keys() == ref.buffers.keys()
    for name in ref.buffers:
        assert_tensors_equal(res.buffers[name], ref.buffers[name], f"{label}: buffer {name}")


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


def _dispatch_state():
    return (
        torch._C._len_torch_dispatch_stack(),
        str(torch._C._dispatch_tls_local_include_set()),
        str(torch._C._dispatch_tls_local_exclude_set()),
        torch.is_grad_enabled(),
        # saved-tensor hooks (regions, torch's checkpoint) and torch_sac's
        # frame-exit watches (torch <= 2.12's checkpoint, see contexts.py)
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        torch_sac._C.frame_exit_watches(),
        sys.getprofile() is not None,
    )


@pytest.fixture
def gc_disabled():
    """The cyclic garbage collector off for the test, after one collection:
    no garbage from elsewhere is freed inside a measured window, and a
    reference cycle is not rescued by the collector."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: CPU reductions are then
    deterministic (gradients compare bitwise, peaks repeat), and tiny
    kernels do not stall on OpenMP when the cores are busy with other work.
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def leaves_nothing():
    """After the test: no region left open, no dispatch mode installed, grad
    mode on (helpers.assert_clean)."""
    yield
    helpers.assert_clean()


@pytest.fixture(autouse=True)
def no_leaked_interceptor():
    """Every test must leave no dispatch mode / TLS key behind."""
    before = _dispatch_state()
    yield
    after = _dispatch_state()
    assert after == before, f"dispatch state leaked by the test: {before} -> {after}"


@pytest.fixture(params=sorted(MODEL_BUILDERS), ids=sorted(MODEL_BUILDERS))
def model_name(request):
    return request.param


@pytest.fixture(scope="session")
def reference_results():
    """Un-checkpointed reference results, computed once per model."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run_model(MODEL_BUILDERS[name])
        return cache[name]

    return get
