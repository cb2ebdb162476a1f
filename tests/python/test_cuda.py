"""torch_sac on a CUDA device: exactness, streams, memory, distributed, compile.

Every test here is marked ``cuda`` (``pytest -m cuda``) and the module is
skipped when CUDA is not available. ``TORCH_SAC_TEST_DEVICE=cpu`` runs the
same test logic on the CPU instead (a dry run of this file on a machine
without a GPU); the parts that only exist on CUDA (streams, SDPA's fused
CUDA kernels, NCCL, the caching allocator) then skip themselves with a
reason, and the distributed tests use gloo instead of NCCL.

Exactness. Each checkpointed run is compared with the same model run without
checkpointing, same weights, inputs and seed:

* bitwise (``torch.equal``) where the kernels are deterministic run to run:
  fp32 matmuls with TF32 off (the ``numerics`` fixture turns it off),
  elementwise ops, softmax, LayerNorm, dropout (Philox from the CUDA
  generator), fp16/bf16 matmuls under autocast; the Hugging Face steps run
  under ``torch.use_deterministic_algorithms(True, warn_only=True)`` (the MoE's
  ``index_add_`` then takes its deterministic path) and fall back to a stated
  tolerance only if torch warned that some op has no deterministic
  implementation;
* to a stated tolerance where they are not: the backward kernels of SDPA's
  flash, memory-efficient and cuDNN backends accumulate dQ (and dK/dV) with
  atomics, and Inductor generates its own kernels.

Also checked: the CUDA generator's state after the step equals the
un-checkpointed run's (dropout replayed from the state forward drew from,
and the generator left where forward left it).

The whole file is meant to run in well under 90 s on one H100/H200: small
models (all activations below 1 MiB, so the caching allocator serves them
from its small pool, rounded to 512 bytes and independent of what it has
cached), two Inductor compiles, one in-process NCCL group of one rank.
"""

import contextlib
import datetime
import functools
import math
import os
import socket
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_sac
from conftest import save_matmuls_fn
from models import GPTBlock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEVICE = os.environ.get("TORCH_SAC_TEST_DEVICE", "cuda")
DEVICE_TYPE = torch.device(DEVICE).type
ON_CUDA = DEVICE_TYPE == "cuda"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(),
        reason="CUDA is not available (TORCH_SAC_TEST_DEVICE=cpu dry-runs this file on the CPU)",
    ),
]


def cuda_only(what):
    return pytest.mark.skipif(
        not ON_CUDA, reason=f"{what}: CUDA only (TORCH_SAC_TEST_DEVICE={DEVICE}: CPU dry run)"
    )


RUN_SEED = 0  # global seed before forward (dropout masks)
LOSS_SEED = 7  # loss weights (private CPU generator)
# Seconds a backward thread may take before the test fails: a hang limit,
# not a timing (each such backward takes well under a second, on the GPU
# machine and in the CPU dry run; helpers.HANG_LIMIT_S).
JOIN_TIMEOUT = 120
SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep: ~10-20 ms of one stream doing nothing

POLICIES = {
    "save_matmuls": torch_sac.policies.save_matmuls,
    "recompute_all": torch_sac.policies.recompute_all,
}
# Not in POLICIES (the matrix above): the offload tests' own (section 9).
HF_POLICIES = {**POLICIES, "offload_matmuls": torch_sac.policies.offload_matmuls}


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def numerics():
    """TF32 off (fp32 comparisons meaningful), cuDNN autotuning off, one CPU
    thread in the CPU dry run (deterministic CPU reductions); every flag and
    the CPU and CUDA RNG states are restored afterwards. (No test here runs a
    convolution, so cuDNN's own determinism switch is left alone: it is not
    needed, and SDPA's cuDNN backend must not be refused because of it.)"""
    saved = dict(
        matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
        cudnn_tf32=torch.backends.cudnn.allow_tf32,
        cudnn_det=torch.backends.cudnn.deterministic,
        cudnn_bench=torch.backends.cudnn.benchmark,
        det=torch.are_deterministic_algorithms_enabled(),
        det_warn=torch.is_deterministic_algorithms_warn_only_enabled(),
        threads=torch.get_num_threads(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    if not ON_CUDA:
        torch.set_num_threads(1)
    devices = [torch.cuda.current_device()] if ON_CUDA else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
            if ON_CUDA:
                torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cudnn.deterministic = saved["cudnn_det"]
        torch.backends.cudnn.benchmark = saved["cudnn_bench"]
        torch.use_deterministic_algorithms(saved["det"], warn_only=saved["det_warn"])
        torch.set_num_threads(saved["threads"])


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True, warn_only=True) for the block;
    yields the list of warnings torch gave for ops with no deterministic
    implementation (empty: every kernel that ran is deterministic)."""
    prev = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    nondeterministic = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield nondeterministic
        nondeterministic.extend(
            str(w.message).splitlines()[0] for w in caught if "deterministic" in str(w.message)
        )
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


# --------------------------------------------------------------------------
# Models and steps
# --------------------------------------------------------------------------


def seeded(build, seed=1234):
    """``build()`` with a fixed CPU seed (so the weights are the same on every
    device), moved to DEVICE, in train mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build()
    return module.to(DEVICE).train()


def randn(*shape, seed, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_(requires_grad)


class Net(nn.Module):
    """Linear, ``depth`` GPT blocks (attention written out with matmuls,
    masked_fill, softmax, dropout; in-place residual adds; dropout on both
    branches), Linear. ``wrap(block, h)`` runs one block checkpointed."""

    def __init__(self, d=64, heads=4, depth=3, seq=32, dropout=0.1, use_sdpa=False):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(
            GPTBlock(d, heads, dropout, use_sdpa, max_len=seq) for _ in range(depth)
        )
        self.head = nn.Linear(d, d)
        self.wrap = None

    def forward(self, x, wrap=None):
        wrap = wrap if wrap is not None else self.wrap
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if wrap is None else wrap(block, h)
        return self.head(h)


NET_SHAPE = (4, 32, 64)


def make_net(**kwargs):
    return seeded(lambda: Net(**kwargs))


def loss_weights(shape):
    g = torch.Generator().manual_seed(LOSS_SEED)
    return torch.randn(shape, generator=g).to(DEVICE)


def loss_of(out):
    return (out.float() * loss_weights(out.shape)).sum()


def rng_state():
    return torch.cuda.get_rng_state() if ON_CUDA else torch.get_rng_state()


class Recorder:
    """Wrappers running a block under one engine; keeps the regions and the
    drop-in's recompute contexts so a test can check that backward
    recomputed something."""

    def __init__(self, engine, policy):
        self.engine, self.policy = engine, policy
        self.regions, self.recompute_contexts = [], []

    def _context_fn(self):
        fwd, rec = torch_sac.create_selective_checkpoint_contexts(self.policy)
        self.recompute_contexts.append(rec)
        return fwd, rec

    def __call__(self, block, *args, **kwargs):
        if self.engine == "region":
            with torch_sac.sac_context(self.policy) as region:
                out = block(*args, **kwargs)
            self.regions.append(region)
            return out
        if self.engine == "checkpoint":
            return torch_sac.checkpoint(block, *args, policy=self.policy, **kwargs)
        if self.engine == "dropin":
            return tc.checkpoint(
                block, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs
            )
        raise AssertionError(self.engine)

    def recomputed(self):
        return sum(r.stats()["replayed_ops"] for r in self.regions) + sum(
            c.stats()["recomputed_ops"] for c in self.recompute_contexts
        )


def run_step(model, x, wrap=None, autocast=None, seed=RUN_SEED):
    """Forward (fixed seed) + backward of a weighted sum. Returns
    {name: tensor}: loss, input grad, every parameter grad, and the RNG state
    of the device's default generator after the step."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    ctx = (
        torch.autocast(DEVICE_TYPE, dtype=autocast)
        if autocast is not None
        else contextlib.nullcontext()
    )
    with ctx:
        out = model(x, wrap)
    loss = loss_of(out)
    loss.backward()
    res = {"loss": loss.detach(), "x.grad": x.grad}
    res.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()})
    res["rng"] = rng_state()
    return res


def assert_bitwise(got, ref, label):
    assert got.keys() == ref.keys(), f"{label}: {sorted(set(got) ^ set(ref))}"
    bad = []
    for k in ref:
        a, b = got[k], ref[k]
        if a is None or b is None:
            if (a is None) != (b is None):
                bad.append(f"{k}: None in one run only")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{k}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
        elif not torch.equal(a, b):
            diff = (
                ""
                if k == "rng"
                else f" (max abs diff {(a.double() - b.double()).abs().max().item():.3g})"
            )
            bad.append(f"{k}: not bitwise equal{diff}")
    assert not bad, f"{label}: {len(bad)} of {len(ref)} differ:\n  " + "\n  ".join(bad)


def assert_scaled_close(got, ref, label, tol, skip=("rng",)):
    """Elementwise ``|a - b| <= tol * |b| + tol * max|b|`` per tensor
    (``torch.allclose`` with ``rtol=tol`` and ``atol`` scaled to the tensor's
    magnitude, so that sums near zero are not held to a relative bound)."""
    assert got.keys() == ref.keys()
    bad = []
    for k in ref:
        if k in skip:
            continue
        a, b = got[k], ref[k]
        assert a is not None and b is not None, f"{label}: {k} missing"
        a, b = a.double(), b.double()
        scale = b.abs().max().item()
        if not torch.allclose(a, b, rtol=tol, atol=tol * scale + 1e-30):
            bad.append(f"{k}: max abs diff {(a - b).abs().max().item():.3g}, max |ref| {scale:.3g}")
    assert not bad, f"{label}: not close to tol {tol}:\n  " + "\n  ".join(bad)


# --------------------------------------------------------------------------
# 1. Exactness of the four front doors, with dropout
# --------------------------------------------------------------------------

_REFERENCE = {}


def net_reference():
    key = ("net", DEVICE)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_step(make_net(), randn(*NET_SHAPE, seed=1))
    return _REFERENCE[key]


def test_reference_is_deterministic():
    """Two un-checkpointed runs match bitwise: bitwise comparison is sound."""
    assert_bitwise(run_step(make_net(), randn(*NET_SHAPE, seed=1)), net_reference(), "plain rerun")


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("engine", ["region", "checkpoint", "dropin", "apply_sac"])
def test_gradients_bitwise_with_dropout(engine, policy_name):
    """Region, torch_sac.checkpoint, the drop-in contexts and apply_sac on
    three GPT blocks with dropout: loss, every gradient and the generator's
    state after the step bitwise equal to no checkpointing."""
    model = make_net()
    policy = POLICIES[policy_name]()
    x = randn(*NET_SHAPE, seed=1)
    if engine == "apply_sac":
        handle = torch_sac.apply_sac(model, policy)
        assert len(handle.modules) == 3
        got = run_step(model, x)
        recomputed = handle.stats()["total"]["replayed_ops"]
        handle.remove()
    else:
        rec = Recorder(engine, policy)
        got = run_step(model, x, rec)
        recomputed = rec.recomputed() if engine != "checkpoint" else None
    assert_bitwise(got, net_reference(), f"{engine}/{policy_name}")
    if recomputed is not None:
        assert recomputed > 0, "backward recomputed nothing: the blocks were not checkpointed"


class RandomChain(nn.Module):
    """Three regions of random ops (dropout, rand_like, bernoulli), with
    random draws outside the regions in between: a replay must draw from
    the state its op drew from in forward, not from the generator's state
    when backward runs."""

    def __init__(self, d=256):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def forward(self, x, wrap=None):
        h = x
        for _ in range(3):
            h = wrap(self.piece, h) if wrap is not None else self.piece(h)
            h = h + 0.01 * torch.randn_like(h)  # outside any region
        return h

    def piece(self, h):
        h = F.dropout(h @ self.w, 0.5, training=True)
        h = h * torch.rand_like(h)
        h = h * torch.bernoulli(torch.full_like(h, 0.7))
        return torch.tanh(h)


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_random_ops_replayed_from_the_generator(engine):
    model = seeded(RandomChain)
    x = randn(64, 256, seed=2)
    ref = run_step(model, x)
    rec = Recorder(engine, torch_sac.policies.recompute_all())
    got = run_step(model, x, rec)
    assert_bitwise(got, ref, f"random ops/{engine}")
    assert rec.recomputed() > 0
    if engine == "region":
        replayed = {
            row["op"]: row["replayed"] for region in rec.regions for row in region.op_details()
        }
        random_ops = [op for op in replayed if "dropout" in op or "bernoulli" in op]
        assert any(replayed[op] > 0 for op in random_ops), replayed


def test_dropout_mask_matches():
    """The mask itself: y = dropout(x) kept nowhere (recompute_all), y.sin()
    needs y in backward; x.grad = cos(y) * mask / (1 - p) must be zero
    exactly where forward dropped and equal to the plain run's."""
    x = randn(1024, 64, seed=3, requires_grad=True)
    torch.manual_seed(RUN_SEED)
    y = F.dropout(x, 0.5, training=True)
    y.sin().sum().backward()
    want, dropped = x.grad.clone(), (y == 0)
    x.grad = None
    torch.manual_seed(RUN_SEED)
    with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
        y2 = F.dropout(x, 0.5, training=True)
        z = y2.sin()
    torch.randn(1000, device=DEVICE)  # the generator moves on before backward
    z.sum().backward()
    assert torch.equal(y2, y)
    assert torch.equal(x.grad == 0, dropped), "the replayed dropout mask differs from forward's"
    assert torch.equal(x.grad, want)
    assert region.stats()["replayed_ops"] > 0


# --------------------------------------------------------------------------
# 2. SDPA with each CUDA backend forced
# --------------------------------------------------------------------------


class AttnMLP(nn.Module):
    """Pre-LN causal SDPA attention and a GELU MLP (head dim 64)."""

    def __init__(self, d=128, heads=2, dropout_p=0.0):
        super().__init__()
        self.heads, self.p = heads, dropout_p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, wrap=None):
        return wrap(self.block, x) if wrap is not None else self.block(x)

    def block(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


SDPA_BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
SDPA_OPS = {  # the ATen op each fused backend runs (MATH decomposes into bmm, softmax, ...)
    "FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention",
    "EFFICIENT_ATTENTION": "aten::_scaled_dot_product_efficient_attention",
    "CUDNN_ATTENTION": "aten::_scaled_dot_product_cudnn_attention",
}
# The fused backends' backward kernels accumulate dQ (and dK/dV) with atomics
# in an order that changes run to run; their fp16 results then differ from
# the un-checkpointed run's by a few fp16 ulps (2^-10 relative), amplified a
# little through the backward of the layers below. 1e-2 (of each value, plus
# 1e-2 of the tensor's largest entry) is ~10 ulps; a wrong replay (another
# dropout mask, a stale tensor) differs by O(1).
SDPA_FUSED_TOL = 1e-2


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_sdpa_backends(backend, policy_name, dropout_p):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend != "MATH" and not ON_CUDA:
        pytest.skip(
            f"SDPA's {backend} backend is a CUDA kernel (TORCH_SAC_TEST_DEVICE={DEVICE}: CPU dry run)"
        )
    dtype = torch.float16 if ON_CUDA else torch.float32  # flash and cuDNN need fp16/bf16
    model = seeded(lambda: AttnMLP(dropout_p=dropout_p)).to(dtype)
    x = randn(2, 64, 128, seed=4, dtype=dtype)
    forced = sdpa_kernel(getattr(SDPBackend, backend))
    try:
        with forced:
            ref = run_step(model, x)
    except RuntimeError as exc:
        if backend == "MATH":
            raise
        pytest.skip(
            f"SDPA {backend} refused these inputs on this device "
            f"({torch.cuda.get_device_name()}): {str(exc).splitlines()[0]}"
        )
    rec = Recorder("region", POLICIES[policy_name]())
    with sdpa_kernel(getattr(SDPBackend, backend)):
        got = run_step(model, x, rec)
    label = f"SDPA {backend}/{policy_name}/dropout {dropout_p}"
    # Forward runs the same kernels on the same inputs: the loss is bitwise
    # equal for every backend, and so is the generator's state after the step.
    assert torch.equal(got["loss"], ref["loss"]), f"{label}: loss {got['loss']} vs {ref['loss']}"
    assert torch.equal(got["rng"], ref["rng"]), f"{label}: generator state differs after the step"
    if backend == "MATH":
        assert_bitwise(got, ref, label)  # bmm, softmax, dropout: deterministic
    else:
        assert_scaled_close(got, ref, label, SDPA_FUSED_TOL)
    assert rec.recomputed() > 0
    rows = {row["op"].split(".")[0]: row for r in rec.regions for row in r.op_details()}
    if backend in SDPA_OPS:
        row = rows.get(SDPA_OPS[backend])
        assert row is not None, f"{label}: {SDPA_OPS[backend]} did not run: {sorted(rows)}"
        if policy_name == "recompute_all":
            assert row["replayed"] > 0, f"{label}: the attention kernel was never replayed: {row}"
        elif dropout_p == 0.0:
            assert row["saved"] > 0 and row["replayed"] == 0, (
                f"{label}: save_matmuls did not keep it: {row}"
            )


# --------------------------------------------------------------------------
# 3. Autocast
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine,policy_name",
    [
        ("region", "save_matmuls"),
        ("region", "recompute_all"),
        ("dropin", "save_matmuls"),
        ("apply_sac", "save_matmuls"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast(dtype, engine, policy_name):
    """Under autocast the region records the casts autocast inserted and
    replays them; matmuls in fp16/bf16 are deterministic: bitwise."""
    model = make_net()
    x = randn(*NET_SHAPE, seed=5)
    try:
        ref = run_step(model, x, autocast=dtype)
    except RuntimeError as exc:  # an autocast dtype this CPU build lacks
        if ON_CUDA:
            raise
        pytest.skip(f"autocast {dtype} on CPU: {exc}")
    policy = POLICIES[policy_name]()
    if engine == "apply_sac":
        handle = torch_sac.apply_sac(model, policy)
        got = run_step(model, x, autocast=dtype)
        recomputed = handle.stats()["total"]["replayed_ops"]
        handle.remove()
    else:
        rec = Recorder(engine, policy)
        got = run_step(model, x, rec, autocast=dtype)
        recomputed = rec.recomputed()
    assert got["loss"].dtype == torch.float32
    assert_bitwise(got, ref, f"autocast {dtype}/{engine}/{policy_name}")
    assert recomputed > 0


# --------------------------------------------------------------------------
# 4. Hugging Face: a Llama step and a Mixtral (MoE) step
# --------------------------------------------------------------------------

HF_VOCAB, HF_BATCH, HF_SEQ = 128, 2, 32
# Used only if torch warned that some kernel has no deterministic
# implementation (see deterministic_algorithms): fp32 atomics reorder sums,
# a few ulps (1e-7) amplified through two layers.
HF_FALLBACK_TOL = 1e-5


def _hf_common():
    return dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return seeded(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_common())))


def build_mixtral():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(
        **_hf_common(),
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
        experts_implementation="eager",
    )
    model = seeded(lambda: transformers.MixtralForCausalLM(cfg))
    # The loop over experts (not grouped_mm, whose kernels differ by release
    # and card), whatever this transformers release picked by default.
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager") and hasattr(
        model, "set_experts_implementation"
    ):
        model.set_experts_implementation("eager")
    return model


def hf_step(model):
    """One step of a causal LM on fixed tokens; SDPA's math backend (the
    fused backends' backward is not deterministic)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ids = torch.randint(
        0, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=torch.Generator().manual_seed(99)
    ).to(DEVICE)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(RUN_SEED)
    with sdpa_kernel(SDPBackend.MATH):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    res = {"loss": loss.detach()}
    res.update(
        {
            f"{n}.grad": None if p.grad is None else p.grad.clone()
            for n, p in model.named_parameters()
        }
    )
    res["rng"] = rng_state()
    return res


def check_hf(build, engine, policy_name, label):
    with deterministic_algorithms() as nondeterministic:
        ref = hf_step(build())
        model = build()
        handle = torch_sac.apply_sac(model, HF_POLICIES[policy_name](), engine=engine)
        assert len(handle.modules) == 2, handle.modules
        got = hf_step(model)
        stats = handle.stats()["total"]
        handle.remove()
    assert stats["policy_calls"] > 0
    if engine == "region":
        assert stats["replayed_ops"] > 0, "backward replayed nothing"
    if nondeterministic:
        # Stated fallback: not every kernel was deterministic (named here).
        assert_scaled_close(
            got,
            ref,
            f"{label} (nondeterministic kernels: {sorted(set(nondeterministic))})",
            HF_FALLBACK_TOL,
        )
    else:
        assert_bitwise(got, ref, label)


@pytest.mark.parametrize(
    "engine,policy_name",
    [("region", "save_matmuls"), ("region", "recompute_all"), ("dropin", "save_matmuls")],
)
def test_hf_llama_step(engine, policy_name):
    check_hf(build_llama, engine, policy_name, f"llama/{engine}/{policy_name}")


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_hf_moe_step(policy_name):
    """Mixtral: router top-k, data-dependent expert dispatch (nonzero,
    .item() on the hit experts), index_add_ into a tensor made in the
    region."""
    impl = getattr(build_mixtral().config, "_experts_implementation", None)
    check_hf(
        build_mixtral, "region", policy_name, f"mixtral (experts: {impl})/region/{policy_name}"
    )


def _op_row(region, name):
    return {r["op"]: r for r in region.op_details()}[name]


def test_grouped_mm_saved_by_save_matmuls():
    """MoE experts' grouped matmul (bf16 on CUDA, as transformers 5 runs
    them): saved by save_matmuls, never replayed, gradients bitwise."""
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(64, 32, generator=g).to(DEVICE, dtype)
    w0 = torch.randn(4, 32, 32, generator=g).to(DEVICE, dtype)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32, device=DEVICE)

    def step(region_policy):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ctx = torch_sac.sac_context(region_policy) if region_policy else contextlib.nullcontext()
        with ctx as region:
            out = torch._grouped_mm(x.tanh(), w, offs=offs).float().relu()
        out.pow(2).sum().backward()
        return region, {"x.grad": x.grad, "w.grad": w.grad}

    _, ref = step(None)
    region, got = step(torch_sac.policies.save_matmuls())
    assert_bitwise(got, ref, "grouped_mm")
    row = _op_row(region, "aten::_grouped_mm.default")
    assert (row["saved"], row["dropped"], row["replayed"]) == (1, 0, 0), row


def test_scaled_mm_saved_by_save_matmuls():
    """An FP8 matmul (torch._scaled_mm, which autograd cannot differentiate:
    training runs it on detached FP8 copies) whose output a later op saves:
    kept, not rebuilt."""
    if ON_CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 _scaled_mm needs compute capability 8.9 or later")
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(32, 64, generator=g).to(DEVICE).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=DEVICE)
    w0 = torch.randn(32, 32, generator=g).to(DEVICE)
    try:
        torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"_scaled_mm unsupported here: {str(e).splitlines()[0]}")

    def step(region_policy):
        w = w0.clone().requires_grad_()
        ctx = torch_sac.sac_context(region_policy) if region_policy else contextlib.nullcontext()
        with ctx as region:
            h = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16).float()
            out = (h * w).sin()
        out.sum().backward()
        return region, {"w.grad": w.grad}

    _, ref = step(None)
    region, got = step(torch_sac.policies.save_matmuls())
    assert_bitwise(got, ref, "scaled_mm")
    row = _op_row(region, "aten::_scaled_mm.default")
    assert (row["saved"], row["dropped"]) == (1, 0), row


# --------------------------------------------------------------------------
# 5. Streams and threads
# --------------------------------------------------------------------------


def poison_cached_blocks(streams, n=48, numel=64 * 1024):
    """Fills cached allocator blocks with NaN (on each stream's pool), so a
    tensor read before the kernel writing it has run reads NaN instead of
    the stale copy of the right values a previous run left there."""
    for s in streams:
        with torch.cuda.stream(s):
            junk = [torch.full((numel,), float("nan"), device=DEVICE) for _ in range(n)]
            del junk


def join(thread):
    thread.join(timeout=JOIN_TIMEOUT)
    assert not thread.is_alive(), f"backward thread did not finish within {JOIN_TIMEOUT} s"


@cuda_only("streams")
@pytest.mark.parametrize("engine", ["region", "checkpoint", "dropin"])
def test_forward_on_a_side_stream(engine):
    """Forward under ``torch.cuda.stream(s)`` (delayed by a sleep on s),
    backward from the default stream: the same as the plain run under the
    same streams."""
    model = make_net()
    x = randn(*NET_SHAPE, seed=6)

    def step(wrap):
        model.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_()
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        torch.manual_seed(RUN_SEED)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            loss = loss_of(model(xin, wrap))
        main.wait_stream(side)
        poison_cached_blocks([main, side])
        loss.backward()
        torch.cuda.synchronize()
        res = {"loss": loss.detach(), "x.grad": xin.grad}
        res.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()})
        return res

    ref = step(None)
    rec = Recorder(engine, torch_sac.policies.recompute_all())
    assert_bitwise(step(rec), ref, f"forward on a side stream/{engine}")


def backward_on_another_thread(loss):
    """``loss.backward()`` on a new thread (under a second stream of its own
    on CUDA); its error re-raised here."""
    errors = []

    def backward():
        try:
            if ON_CUDA:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.default_stream())
                with torch.cuda.stream(s):
                    loss.backward()
                torch.cuda.synchronize()
            else:
                loss.backward()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    t = threading.Thread(target=backward, daemon=True)
    t.start()
    join(t)
    assert not errors, f"backward on another thread raised: {errors[0]!r}"


@pytest.mark.parametrize("policy_name", ["recompute_all", "offload_matmuls"])
@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_backward_on_another_thread(engine, policy_name):
    """Forward on this thread, backward on another (its own current stream
    on CUDA: the default one, here under a second stream); with offloaded
    matmul outputs too (the reloads' events waited on by that stream)."""
    model = make_net()
    x = randn(*NET_SHAPE, seed=7)
    ref = run_step(model, x)
    model.zero_grad(set_to_none=True)
    xin = x.detach().requires_grad_()
    rec = Recorder(engine, HF_POLICIES[policy_name]())
    torch.manual_seed(RUN_SEED)
    with offload_everything() if policy_name == "offload_matmuls" else contextlib.nullcontext():
        loss = loss_of(model(xin, rec))
        backward_on_another_thread(loss)
    got = {"loss": loss.detach(), "x.grad": xin.grad}
    got.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()})
    got["rng"] = rng_state()
    assert_bitwise(got, ref, f"backward on another thread/{engine}")
    assert rec.recomputed() > 0


@cuda_only("streams")
@pytest.mark.parametrize("layout", ["split_forward", "backward_under_side_stream"])
def test_rebuilt_tensor_used_on_another_stream(layout):
    """A tensor rebuilt in backward and consumed on another stream.

    split_forward: one region whose first block runs on stream s1 and second
    on the default stream; the second block's backward (default stream)
    unpacks the first block's dropped output, rebuilt from ops recorded on
    s1; s1 is put to sleep just before backward, so a consumer that does
    not wait for the rebuild reads the NaNs left in the cached blocks.
    backward_under_side_stream: regions on the default stream, backward
    called under s2 while the default stream sleeps.
    Either way gradients equal the plain run under the same streams."""
    model = make_net(depth=2)
    x = randn(*NET_SHAPE, seed=8)
    main = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def step(policy):
        model.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_()
        torch.manual_seed(RUN_SEED)
        region = torch_sac.sac_context(policy) if policy is not None else contextlib.nullcontext()
        with region:
            if layout == "split_forward":
                s1.wait_stream(main)
                with torch.cuda.stream(s1):
                    h = model.blocks[0](model.inp(xin))
                main.wait_stream(s1)
                out = model.head(model.blocks[1](h))
            else:
                out = model(xin)
        loss = loss_of(out)
        del out
        poison_cached_blocks([main, s1, s2])
        if layout == "split_forward":
            with torch.cuda.stream(s1):
                torch.cuda._sleep(SLEEP_CYCLES)
            loss.backward()
        else:
            s2.wait_stream(main)
            torch.cuda._sleep(SLEEP_CYCLES)  # on the default stream
            with torch.cuda.stream(s2):
                loss.backward()
            main.wait_stream(s2)
        torch.cuda.synchronize()
        res = {"loss": loss.detach(), "x.grad": xin.grad}
        res.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()})
        return res, (region if policy is not None else None)

    ref, _ = step(None)
    got, region = step(torch_sac.policies.recompute_all())
    assert_bitwise(got, ref, f"rebuilt tensor on another stream/{layout}")
    assert region.stats()["replayed_ops"] > 0
    for k, v in got.items():
        assert torch.isfinite(v).all(), f"{layout}: {k} has NaN/inf (read before it was written?)"


# --------------------------------------------------------------------------
# 6. Memory (the caching allocator's statistics on CUDA)
# --------------------------------------------------------------------------


class Mem:
    """Allocated bytes and their peak above the start of a window: on CUDA
    torch.cuda.memory_allocated / max_memory_allocated after
    reset_peak_memory_stats (the caching allocator); in the CPU dry run
    torch_sac's counting allocator."""

    def __enter__(self):
        if ON_CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self._tracker = torch_sac.memory.track("cpu").__enter__()
            self.start = self._tracker.start
        return self

    def __exit__(self, *exc):
        if ON_CUDA:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self._tracker.__exit__(*exc)
            self.peak = self._tracker.peak
        return False

    def now(self):
        if ON_CUDA:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() - self.start
        return self._tracker.delta


def install_torch_sac_baseline(model):
    """PyTorch's own SAC (its create_selective_checkpoint_contexts, a
    policy_fn saving mm/addmm/bmm/baddbmm, convolutions and SDPA kernels)
    on each block."""
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, save_matmuls_fn)
    model.wrap = lambda block, h: tc.checkpoint(
        block, h, use_reentrant=False, context_fn=context_fn
    )


def activation_bytes(model, x):
    """Bytes allocated after forward (output and loss included) minus
    before, on the second of two steps (the first makes lazily created
    state: cuBLAS workspaces, ...)."""
    acts = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        xin = x.detach().requires_grad_()
        torch.manual_seed(RUN_SEED)
        with Mem() as m:
            loss = loss_of(model(xin))
            acts.append(m.now())
            loss.backward()
            del loss
    return acts[-1]


@pytest.mark.usefixtures("gc_disabled")
@pytest.mark.parametrize("engine", ["region", "dropin", "apply_sac"])
def test_activation_memory_at_most_pytorch_sac(engine):
    x = randn(*NET_SHAPE, seed=9)
    none = activation_bytes(make_net(), x)
    model = make_net()
    install_torch_sac_baseline(model)
    torch_sac_bytes = activation_bytes(model, x)
    model = make_net()
    policy = torch_sac.policies.save_matmuls()
    handle = None
    if engine == "apply_sac":
        handle = torch_sac.apply_sac(model, policy)
    else:
        model.wrap = Recorder(engine, policy)
    ours = activation_bytes(model, x)
    if handle is not None:
        handle.remove()
    numbers = f"{engine}: {ours} B, PyTorch SAC {torch_sac_bytes} B, no checkpointing {none} B"
    print("\n" + numbers)
    assert ours <= torch_sac_bytes, numbers
    assert ours < none, numbers


def chain_step(model, x, region_kwargs=None):
    """One step of the whole Net in one region (recompute_all) when
    region_kwargs is given; returns (grads, region, peak above start)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(RUN_SEED)
    region = None
    with Mem() as m:
        if region_kwargs is None:
            out = model(x)
        else:
            with torch_sac.sac_context(
                torch_sac.policies.recompute_all(), **region_kwargs
            ) as region:
                out = model(x)
        loss = out.float().logsumexp(-1).mean()
        del out
        loss.backward()
        del loss
    return {n: p.grad.clone() for n, p in model.named_parameters()}, region, m.peak


@pytest.mark.usefixtures("gc_disabled")
def test_replay_budget_within_its_bound():
    """As tests/python/test_replay_budget.py's whole-model case (same
    phrasing of the bound, no slack), measured by the caching allocator:
    the rebuilt tensors held stay within the budget, and what the budget
    keeps out of memory shows in the step's peak."""
    model = make_net(depth=8, seq=64)
    x = randn(4, 64, 64, seed=10)
    chain_step(model, x)  # warm-up
    want, _, plain_peak = chain_step(model, x)
    unbudgeted, region, unbudgeted_peak = chain_step(model, x, {})
    assert_bitwise(unbudgeted, want, "one region, no budget")
    full_memo = region.stats()["peak_memo_bytes"]
    budget = full_memo // 4
    got, region, peak = chain_step(model, x, {"replay_budget": budget})
    assert_bitwise(got, want, f"one region, replay_budget={budget}")
    stats = region.stats()
    numbers = (
        f"peak {peak} B (unbudgeted {unbudgeted_peak} B, plain {plain_peak} B), "
        f"memo {stats['peak_memo_bytes']} B of budget {budget} B"
    )
    print("\n" + numbers)
    assert stats["peak_memo_bytes"] <= budget, numbers
    assert stats["memos_skipped"] > 0
    assert peak < unbudgeted_peak - (full_memo - budget) // 2, numbers
    assert peak < plain_peak, numbers


@pytest.mark.usefixtures("gc_disabled")
def test_peak_plan_within_its_bound():
    """As tests/python/test_peak_plan.py's transformer case (the planner
    measures with torch_sac.memory.track on the model's device; the step is
    measured here with torch.cuda's own statistics, no slack, as on CPU)."""
    model = make_net(depth=6, seq=64)
    x = randn(4, 64, 64, seed=11)
    leaves = list(model.parameters())

    def loss():
        return model(x).float().pow(2).mean()

    def step(ctx=None):
        torch.manual_seed(RUN_SEED)
        with Mem() as m:
            with ctx if ctx is not None else contextlib.nullcontext():
                out = loss()
            got = torch.autograd.grad(out, leaves)
            del out
        return dict(enumerate(got)), m.peak

    step()  # warm-up
    want, plain_peak = step()
    peak = int(plain_peak * 0.6)
    plan = torch_sac.policies.budget(loss, peak_bytes=peak)
    numbers = f"plan {plan!r}, measured when planned {plan.measured_peak} B, budget {peak} B, plain {plain_peak} B"
    assert plan.measured_peak <= peak and plan.recomputed_ops > 0, numbers
    got, measured = step(torch_sac.sac_context(plan))
    print(f"\n{numbers}; measured now {measured} B")
    assert_bitwise(got, want, "peak plan")
    assert measured <= peak, f"{numbers}; measured now {measured} B"
    assert all(p.grad is None for p in leaves), "planning left gradients behind"


# --------------------------------------------------------------------------
# 7. DDP and FSDP2 on one rank (NCCL on CUDA; gloo in the CPU dry run)
# --------------------------------------------------------------------------


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    backend = "nccl" if ON_CUDA else "gloo"
    if ON_CUDA and not dist.is_nccl_available():
        pytest.skip("NCCL is not available in this torch build")
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    if ON_CUDA:
        torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        # One rank: no peer to wait for; a hang limit, not a timing.
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _local(t):
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def train_distributed(kind, policy_name, pg, steps=2):
    """``steps`` SGD steps of Net under DDP or FSDP2 (each block its own
    unit, then the root), a region per block when ``policy_name`` is set.
    Returns {step: grads} and the final parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    inner = make_net()
    rec = Recorder("region", POLICIES[policy_name]()) if policy_name else None
    if kind == "ddp":
        model = DistributedDataParallel(
            inner, device_ids=[torch.cuda.current_device()] if ON_CUDA else None, process_group=pg
        )
    else:
        mesh = DeviceMesh.from_group(pg, DEVICE_TYPE)
        for block in inner.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(inner, mesh=mesh)
    inner.wrap = rec
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {}
    for step in range(steps):
        x = randn(*NET_SHAPE, seed=100 + step, requires_grad=True)
        torch.manual_seed(RUN_SEED + step)
        loss = loss_of(model(x))
        loss.backward()
        grads = {n: _local(p.grad) for n, p in inner.named_parameters()}
        grads["x.grad"] = x.grad.detach().clone()
        grads["loss"] = loss.detach()
        out[f"step{step}"] = grads
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: _local(p) for n, p in inner.named_parameters()}
    if ON_CUDA:
        torch.cuda.synchronize()
    return out, params, rec


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_distributed_one_rank(process_group, kind, policy_name):
    ref, ref_params, _ = train_distributed(kind, None, process_group)
    got, params, rec = train_distributed(kind, policy_name, process_group)
    for step in ref:
        assert_bitwise(got[step], ref[step], f"{kind}/{policy_name} {step}")
    assert_bitwise(params, ref_params, f"{kind}/{policy_name} parameters after the steps")
    assert rec.recomputed() > 0


# --------------------------------------------------------------------------
# 8. torch.compile (Inductor)
# --------------------------------------------------------------------------

COMPILED_IN_REGION = "torch_sac: compiled code (torch.compile) ran inside a sac_context region"
# Inductor generates its own kernels (fused bias + GELU, its own reductions):
# fp32 results differ from eager ATen's in the last bits (test_compile.py
# uses 1e-5 on CPU; Triton's GELU/erf and the different summation order of
# the fused bias gradient on the GPU get 1e-4 of each value plus 1e-4 of the
# tensor's largest entry). Against the same compiled code outside a region:
# bitwise.
INDUCTOR_TOL = 1e-4


class MLPBlock(nn.Module):
    def __init__(self, d=64, hidden=256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x, wrap=None):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.fixture
def fresh_dynamo(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(torch_sac._compile, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield caught
        finally:
            torch._dynamo.reset()


def compile_step(block, x, fn):
    return run_step(_Call(block, fn), x)


class _Call(nn.Module):
    """Presents ``fn(x)`` as a module with ``block``'s parameters."""

    def __init__(self, block, fn):
        super().__init__()
        self.block, self.fn = block, fn

    def forward(self, x, wrap=None):
        return self.fn(x)


def test_checkpoint_inside_inductor_compiled_function(fresh_dynamo):
    block = seeded(MLPBlock)
    x = randn(8, 16, 64, seed=12)
    ref = compile_step(block, x, block)
    policy = (
        torch_sac.policies.save_matmuls()
    )  # made outside: Dynamo cannot trace the C++ constructor
    fn = torch.compile(
        lambda t: torch_sac.checkpoint(block, t, policy=policy), backend="inductor", fullgraph=True
    )
    got = compile_step(block, x, fn)
    assert_scaled_close(
        got, ref, "torch_sac.checkpoint in an Inductor-compiled function", INDUCTOR_TOL
    )
    assert not [w for w in fresh_dynamo if str(w.message).startswith(COMPILED_IN_REGION)]


def test_inductor_block_called_inside_a_region(fresh_dynamo):
    """Inductor's kernels are opaque to a region: it warns once, records
    none of their work, and the gradients are the compiled code's own."""
    block = seeded(MLPBlock)
    x = randn(8, 16, 64, seed=13)
    ref = compile_step(block, x, block)
    compiled = torch.compile(block, backend="inductor")
    outside = compile_step(block, x, compiled)
    assert_scaled_close(outside, ref, "Inductor outside a region vs eager", INDUCTOR_TOL)
    regions = []

    def in_region(t):
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
            regions.append(region)
            return compiled(t)

    first = compile_step(block, x, in_region)
    second = compile_step(block, x, in_region)
    assert_bitwise(first, outside, "Inductor block in a region vs outside")
    assert_bitwise(second, outside, "Inductor block in a region, second call")
    ours = [w for w in fresh_dynamo if str(w.message).startswith(COMPILED_IN_REGION)]
    assert len(ours) == 1, [str(w.message)[:80] for w in fresh_dynamo]
    for region in regions:
        assert region.stats()["dropped_ops"] == 0, region.stats()


# --------------------------------------------------------------------------
# 9. Offloading to host memory (torch_sac.offload)
# --------------------------------------------------------------------------

OFFLOAD_POLICIES = {
    "offload_matmuls": torch_sac.policies.offload_matmuls,
    "offload_everything": lambda: (lambda ctx, op, *a, **k: torch_sac.Policy.PREFER_OFFLOAD),
}


def offload_everything():
    """Every eligible tensor offloaded (no size threshold, nothing kept on
    the device at the end of forward); the CPU stand-in in the dry run."""
    return torch_sac.offload.using(
        min_bytes=0, keep_last_bytes=0, prefetch_bytes=64 << 20, cpu_stand_in=not ON_CUDA
    )


@pytest.fixture
def offloading():
    """offload_everything() for one test; afterwards no host range is in
    use: nothing leaked."""
    with offload_everything():
        yield
    import gc

    gc.collect()
    torch_sac.offload.synchronize()
    stats = torch_sac.offload.stats()
    assert stats["host_in_use_bytes"] == 0, f"host ranges left in use: {stats}"
    assert stats["copying_bytes"] == 0 and stats["prefetched_bytes"] == 0, stats


@pytest.mark.parametrize("policy_name", sorted(OFFLOAD_POLICIES))
@pytest.mark.parametrize("engine", ["region", "checkpoint", "dropin"])
def test_offload_gradients_bitwise_with_dropout(offloading, engine, policy_name):
    """Blocks with dropout and in-place residual adds, their outputs
    offloaded: gradients and the generator's state as without checkpointing,
    and the copies really ran."""
    before = torch_sac.offload.stats()
    got = run_step(
        make_net(), randn(*NET_SHAPE, seed=1), Recorder(engine, OFFLOAD_POLICIES[policy_name]())
    )
    after = torch_sac.offload.stats()
    assert_bitwise(got, net_reference(), f"offload/{engine}/{policy_name}")
    assert after["offloaded_bytes"] > before["offloaded_bytes"]
    assert after["reloaded_bytes"] > before["reloaded_bytes"]


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_offload_freed_memory_poisoned(offloading, engine):
    """Between forward and backward the allocator's free blocks (the
    offloaded tensors' among them) are filled with NaN on both streams: a
    copy that read a freed source, or a consumer that read a reload before
    its copy finished, would put NaN in the gradients."""
    model = make_net()
    x = randn(*NET_SHAPE, seed=1).requires_grad_()
    rec = Recorder(engine, torch_sac.policies.offload_matmuls())
    model.zero_grad(set_to_none=True)
    torch.manual_seed(RUN_SEED)
    loss = loss_of(model(x, rec))
    if ON_CUDA:
        poison_cached_blocks([torch.cuda.current_stream(), torch.cuda.Stream()])
    loss.backward()
    got = {"loss": loss.detach(), "x.grad": x.grad}
    got.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()})
    got["rng"] = rng_state()
    assert_bitwise(got, net_reference(), f"offload, poisoned/{engine}")


@cuda_only("copy streams")
def test_offload_large_copies_slower_than_compute(offloading):
    """Large activations with almost no compute between them: every copy is
    slower than the ops around it, so the consumer must wait on the copies'
    events (a missing wait reads garbage), and forward's sources must outlive
    their copies. Delays on the compute stream shift the copies further."""
    torch.manual_seed(0)
    n = 32 << 20  # 128 MiB per activation in fp32
    x = torch.randn(n, device=DEVICE, requires_grad=True)

    def chain(x):
        h = x
        for _ in range(4):
            h = torch.sin(h)  # saves its input: offloaded
            torch.cuda._sleep(SLEEP_CYCLES // 8)
        return h

    policy = lambda ctx, op, *a, **k: torch_sac.Policy.PREFER_OFFLOAD  # noqa: E731
    (want,) = torch.autograd.grad(chain(x).sum(), [x])
    with torch_sac.sac_context(policy):
        out = chain(x)
    poison_cached_blocks([torch.cuda.current_stream()], n=4, numel=n)
    (got,) = torch.autograd.grad(out.sum(), [x])
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@cuda_only("overlap")
def test_offload_overlaps_compute(offloading):
    """Matmul-heavy blocks (about 1 ms of compute between offloaded
    tensors of 8 MiB): every reload after the first is started ahead of its
    use and complete when used (late counts a reload the consumer found
    unfinished), with a prefetch window of a few tensors. Timed copies
    (timing events): compute waited for them about as long as for the
    first reload, a few copies' time at most, not for each of them."""
    torch.manual_seed(0)
    d = 2048
    ws = [torch.randn(d, d, device=DEVICE, requires_grad=True) / d**0.5 for _ in range(8)]
    x = torch.randn(1024, d, device=DEVICE, requires_grad=True)

    def blocks(h):
        for w in ws:
            for _ in range(4):
                h = torch.tanh(h @ w)
        return h

    with torch_sac.offload.using(prefetch_bytes=4 * 1024 * d * 4, time_copies=True):
        with torch_sac.sac_context(torch_sac.policies.offload_ops([torch.ops.aten.tanh])):
            out = blocks(x)
        torch_sac.offload.synchronize()
        before = torch_sac.offload.stats()
        out.sum().backward()
        torch.cuda.synchronize()
        torch_sac.offload.synchronize()
        after = torch_sac.offload.stats()
    reloaded = after["reloaded"] - before["reloaded"]
    late = after["late"] - before["late"]
    assert reloaded >= 16
    assert late <= max(2, reloaded // 10), (late, reloaded)
    h2d_ns = after["h2d_copy_ns"] - before["h2d_copy_ns"]
    waited_ns = after["waited_ns"] - before["waited_ns"]
    assert after["waits"] - before["waits"] >= reloaded and h2d_ns > 0
    assert waited_ns <= 3 * h2d_ns / reloaded, (waited_ns, h2d_ns, reloaded)
    assert after["d2h_copy_ns"] > 0


@cuda_only("the caching allocator's statistics")
def test_offload_frees_device_memory_and_reuses_the_pool(offloading):
    """Offloading tanh's outputs instead of saving them: the device holds
    their bytes less after forward (measured by the caching allocator); over
    three steps the host pool allocates its chunks once."""
    torch.manual_seed(0)
    w = torch.randn(1024, 1024, device=DEVICE, requires_grad=True)
    x = torch.randn(2048, 1024, device=DEVICE)
    step_bytes = 2048 * 1024 * 4

    def forward(policy):
        h = x
        with torch_sac.sac_context(policy):
            for _ in range(6):
                h = torch.tanh(h @ w)
        return h

    def held_after_forward(policy):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = forward(policy)
        torch_sac.offload.synchronize()  # copies done: sources released
        held = torch.cuda.memory_allocated() - start
        out.sum().backward()
        return held

    saved = held_after_forward(torch_sac.policies.save_ops([torch.ops.aten.tanh]))
    chunks = []
    for _ in range(3):
        offloaded = held_after_forward(torch_sac.policies.offload_ops([torch.ops.aten.tanh]))
        chunks.append(torch_sac.offload.stats()["host_chunks_allocated"])
    # The last tanh output is the region's output: alive either way.
    assert saved - offloaded >= 5 * step_bytes
    assert chunks[0] == chunks[-1], chunks


@pytest.mark.parametrize("engine", ["region", "dropin"])
def test_offload_hf_llama_step(offloading, engine):
    check_hf(build_llama, engine, "offload_matmuls", f"llama/{engine}/offload_matmuls")
