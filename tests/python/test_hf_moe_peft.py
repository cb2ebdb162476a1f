"""torch_sac on Hugging Face mixture-of-experts models, PEFT LoRA and caches.

Same method as ``test_hf_models.py``: tiny configs, random weights, no
download (HF_HUB_OFFLINE=1), one training step in train mode without
checkpointing (the reference) and one with the decoder layers checkpointed;
loss and every parameter's gradient must match the reference bitwise
(``torch.equal``) on CPU with one thread. Engines:

* ``region``:       ``torch_sac.apply_sac(model, policy)`` (each decoder layer
  in a ``sac_context`` region: backward replays the recorded ops in C++)
* ``dropin``:       ``torch_sac.apply_sac(model, policy, engine="dropin")``
  (``torch.utils.checkpoint`` with torch_sac's contexts: backward re-runs the
  layer's Python forward)
* ``whole_region``: ``with torch_sac.sac_context(policy):`` around the
  model's whole forward (one region, no ``apply_sac``)

What is covered:

* MoE experts: transformers 5 runs the experts of Qwen3-MoE, OLMoE, Mixtral
  and GPT-OSS through ``aten::_grouped_mm`` (also on CPU). Under
  ``save_matmuls()`` the grouped matmuls are saved, not replayed
  (``op_details()``), and gradients are exact. GPT-OSS adds the expert bias
  in place on the grouped matmul's output (``out.add_(bias)`` in
  ``transformers.integrations.moe._grouped_linear``): a region keeps it, the
  drop-in cannot cache an output written in place later in forward and
  recomputes it (``invalidated_ops``), still exactly.
* PEFT LoRA (Llama, GPT-2) with LoRA dropout: LoRA gradients exact, frozen
  base weights keep ``grad is None``.
* ``use_cache=True`` in training: the drop-in re-runs the layer, which
  appends to the KV cache again; it must refuse with a message naming
  ``use_cache=False`` and the region engine, which runs exactly.
  HF Mamba's ``cache_params`` likewise.
* A DPO-like step: LoRA policy, reference log-probs from the same model with
  the adapter disabled under ``no_grad``, two checkpointed forwards (chosen,
  rejected) in one loss.
"""

import collections
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import torch_sac
from hf_tiny import (
    BATCH,
    INPUT_SEED,
    MODEL_SEED,
    RUN_SEED,
    SEQ,
    VOCAB,
    Step,
    assert_step_equal,
    gpt2_config,
    llama_config,
    param_grads,
    tokens,
)

peft = pytest.importorskip("peft")

# peft asks transformers' deprecated is_gradient_checkpointing.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]

GROUPED_MM = "aten::_grouped_mm.default"


def _tokens(seed=INPUT_SEED):
    """(BATCH, SEQ) token ids from ``seed``."""
    return tokens((BATCH, SEQ), torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _moe(config, model, **experts):
    """A builder of a tiny MoE causal LM: transformers' ``config`` and
    ``model`` classes (by name), _DECODER plus ``experts``."""
    return lambda: getattr(transformers, model)(
        getattr(transformers, config)(**experts, **_DECODER)
    )


MOE_MODELS = {
    "qwen3_moe": _moe(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "olmoe": _moe("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2),
    "mixtral": _moe(
        "MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2
    ),
    "gpt_oss": _moe(
        "GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, head_dim=8
    ),
}

# MoE models whose experts write the grouped matmul's output in place later in
# forward (expert bias: out.add_(bias)); the drop-in recomputes those calls.
GROUPED_OUTPUT_WRITTEN_IN_PLACE = {"gpt_oss"}


def build_llama():
    return transformers.LlamaForCausalLM(llama_config())


def build_gpt2():
    return transformers.GPT2LMHeadModel(gpt2_config())


def build_mamba():
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
    )
    return transformers.MambaForCausalLM(cfg)


# base model -> (builder, target modules, fan_in_fan_out: GPT-2's Conv1D)
LORA_TARGETS = {
    "llama": (build_llama, ["q_proj", "v_proj", "down_proj"], False),
    "gpt2": (build_gpt2, ["c_attn", "c_fc"], True),
}


def build_lora(base_name):
    build, targets, fan_in_fan_out = LORA_TARGETS[base_name]
    model = build()
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1, fan_in_fan_out=fan_in_fan_out
    )
    return peft.get_peft_model(model, cfg)


# --------------------------------------------------------------------------
# One training step
# --------------------------------------------------------------------------

ENGINES = ("region", "dropin", "whole_region")


def run_step(build, engine=None, policy=None, use_cache=False, ids=None):
    """Builds the model (seeded), checkpoints it with ``engine``, runs one
    forward/backward with ``labels=ids`` and returns loss and gradients."""
    torch.manual_seed(MODEL_SEED)
    model = build()
    model.train()
    ids = _tokens() if ids is None else ids
    policy = torch_sac.policies.save_matmuls() if policy is None else policy
    handle = region = None
    if engine in ("region", "dropin"):
        handle = torch_sac.apply_sac(model, policy, engine=engine)
    torch.manual_seed(RUN_SEED)
    if engine == "whole_region":
        with torch_sac.sac_context(policy) as region:
            loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
    else:
        assert engine in (None, "region", "dropin"), engine
        loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
    loss.backward()
    return Step(loss.detach().clone(), param_grads(model), torch.get_rng_state(), handle, region)


_REFERENCE = {}


def reference(key, build, **kwargs):
    if key not in _REFERENCE:
        _REFERENCE[key] = run_step(build, **kwargs)
    return _REFERENCE[key]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{func._schema.name}.{func._overloadname}"] += 1
        return func(*args, **(kwargs or {}))


def forward_op_counts(build):
    """Ops of one plain training-mode forward of a fresh model."""
    torch.manual_seed(MODEL_SEED)
    model = build()
    model.train()
    ids = _tokens()
    counter = OpCounter()
    with counter:
        model(input_ids=ids, labels=ids, use_cache=False)
    return counter.counts


def op_row(rows, op):
    found = [r for r in rows if r["op"] == op]
    assert len(found) <= 1, f"{op} appears {len(found)} times in op_details"
    return found[0] if found else None


# --------------------------------------------------------------------------
# 1. MoE: grouped matmuls saved, gradients exact
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_matmul_ops_include_grouped_mm():
    ops = getattr(torch_sac.policies, "MATMUL_OPS", None)
    if ops is None:
        pytest.skip(
            "torch_sac.policies.MATMUL_OPS is not there (yet): cannot check it lists aten::_grouped_mm"
        )
    assert "aten::_grouped_mm" in ops, f"aten::_grouped_mm missing from MATMUL_OPS {ops}"
    assert "aten::_scaled_grouped_mm" in ops


@pytest.mark.parametrize("model_name", list(MOE_MODELS))
def test_moe_experts_run_grouped_mm(model_name):
    """The premise of the MoE tests: transformers runs the experts through
    aten::_grouped_mm on CPU (not its Python fallback or a per-expert loop)."""
    counts = forward_op_counts(MOE_MODELS[model_name])
    assert counts[GROUPED_MM] > 0, (
        f"{model_name}: no {GROUPED_MM} in forward; matmul-like ops seen: "
        f"{ {k: v for k, v in counts.items() if 'mm' in k} }"
    )


@pytest.mark.parametrize("model_name", list(MOE_MODELS))
def test_moe_reference_is_deterministic(model_name):
    build = MOE_MODELS[model_name]
    assert_step_equal(run_step(build), reference(model_name, build), f"{model_name} plain rerun")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model_name", list(MOE_MODELS))
def test_moe_save_matmuls_exact(model_name, engine):
    build = MOE_MODELS[model_name]
    ref = reference(model_name, build)
    step = run_step(build, engine)
    assert_step_equal(step, ref, f"{model_name}/{engine}/save_matmuls")

    n_grouped = forward_op_counts(build)[GROUPED_MM]
    if engine == "whole_region":
        per_scope = {"model": step.region.op_details()}
        replayed = step.region.stats()["replayed_ops"]
    else:
        per_scope = step.handle.op_details()
        assert sorted(per_scope) == ["model.layers.0", "model.layers.1"], per_scope.keys()
        total = step.handle.stats()["total"]
        replayed = total["replayed_ops" if engine == "region" else "recomputed_ops"]
    assert replayed > 0, (
        f"{model_name}/{engine}: backward recomputed nothing: nothing was checkpointed"
    )

    saved = dropped = 0
    for scope, rows in per_scope.items():
        row = op_row(rows, GROUPED_MM)
        assert row is not None, (
            f"{model_name}/{engine}: no {GROUPED_MM} row for {scope}: {[r['op'] for r in rows]}"
        )
        saved += row["saved"]
        dropped += row["dropped"]
        if engine == "dropin" and model_name in GROUPED_OUTPUT_WRITTEN_IN_PLACE:
            # out.add_(bias) after the grouped matmul: the drop-in cannot hand
            # recompute a cached output that forward then wrote; it re-runs it.
            assert row["saved"] == 0 and row["dropped"] > 0, (scope, row)
            assert row["replayed"] == row["dropped"], (scope, row)
        else:
            assert row["saved"] > 0 and row["dropped"] == 0, (
                f"{model_name}/{engine}: {scope}: save_matmuls did not save every grouped matmul: {row}"
            )
            assert row["replayed"] == 0, (
                f"{model_name}/{engine}: {scope}: saved grouped matmuls replayed: {row}"
            )
    assert saved + dropped == n_grouped, (
        f"{model_name}/{engine}: {saved} saved + {dropped} dropped grouped matmuls, forward ran {n_grouped}"
    )
    if engine == "dropin" and model_name in GROUPED_OUTPUT_WRITTEN_IN_PLACE:
        assert step.handle.stats()["total"]["invalidated_ops"] >= dropped


@pytest.mark.parametrize("engine", ("region", "dropin"))
def test_moe_recompute_all_exact(engine):
    """Plain checkpointing of the MoE layers: the grouped matmuls are replayed."""
    build = MOE_MODELS["qwen3_moe"]
    step = run_step(build, engine, torch_sac.policies.recompute_all())
    assert_step_equal(step, reference("qwen3_moe", build), f"qwen3_moe/{engine}/recompute_all")
    for scope, rows in step.handle.op_details().items():
        row = op_row(rows, GROUPED_MM)
        assert row["saved"] == 0 and row["dropped"] > 0 and row["replayed"] == row["dropped"], (
            scope,
            row,
        )


# --------------------------------------------------------------------------
# 2. PEFT LoRA
# --------------------------------------------------------------------------


def _lora_build(base_name):
    return lambda: build_lora(base_name)


@pytest.mark.parametrize("engine", ("region", "dropin"))
@pytest.mark.parametrize("base_name", list(LORA_TARGETS))
def test_lora_exact(base_name, engine):
    build = _lora_build(base_name)
    ref = reference(f"lora_{base_name}", build)
    step = run_step(build, engine)
    assert_step_equal(step, ref, f"lora {base_name}/{engine}")

    lora = [n for n in step.grads if "lora_" in n]
    assert lora, "no LoRA parameters"
    for n in lora:
        assert step.grads[n] is not None, f"{n}: LoRA parameter has no grad"
    # lora_B starts at zero, so lora_A's grad is zero after one step; lora_B's is not.
    assert any(step.grads[n].abs().sum() > 0 for n in lora if "lora_B" in n)
    frozen = [n for n in step.grads if "lora_" not in n]
    assert frozen
    leaked = [n for n in frozen if step.grads[n] is not None]
    assert not leaked, f"frozen base weights got gradients: {leaked}"

    layers = step.handle.modules
    assert len(layers) == 2 and all(n.startswith("base_model.model.") for n in layers), layers
    stats = step.handle.stats()["total"]
    assert stats["replayed_ops" if engine == "region" else "recomputed_ops"] > 0


# --------------------------------------------------------------------------
# 3. use_cache=True in training
# --------------------------------------------------------------------------


def test_use_cache_dropin_refuses_with_fix():
    """Forward fills the KV cache; backward's recompute re-runs each layer,
    which appends to it again: the drop-in refuses in backward."""
    torch.manual_seed(MODEL_SEED)
    model = build_llama()
    model.train()
    torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), engine="dropin")
    ids = _tokens()
    torch.manual_seed(RUN_SEED)
    out = model(input_ids=ids, labels=ids, use_cache=True)
    assert out.past_key_values is not None, "use_cache=True made no cache: nothing to test"
    with pytest.raises(RuntimeError) as info:
        out.loss.backward()
    msg = str(info.value)
    assert "use_cache=False" in msg, (
        f"the drop-in's error does not name the fix use_cache=False: {msg!r}"
    )
    assert "region" in msg, f"the drop-in's error does not name the region engine: {msg!r}"
    assert "cache" in msg.replace("use_cache", ""), msg


def test_use_cache_dropin_refusal_leaves_no_state():
    """After the refused backward, the same process trains normally."""
    with pytest.raises(RuntimeError):
        run_step(build_llama, "dropin", use_cache=True)
    ref = reference("llama", build_llama)
    assert_step_equal(
        run_step(build_llama, "dropin"), ref, "llama/dropin after a refused use_cache run"
    )
    assert not torch_sac.region.in_region(), "a region is still open after the refused backward"


@pytest.mark.parametrize("engine", ("region", "whole_region"))
def test_use_cache_region_exact(engine):
    ref = reference("llama_cache", build_llama, use_cache=True)
    step = run_step(build_llama, engine, use_cache=True)
    assert_step_equal(step, ref, f"llama/{engine}/use_cache=True")


def test_mamba_use_cache_region_exact():
    ref = reference("mamba_cache", build_mamba, use_cache=True)
    assert_step_equal(
        run_step(build_mamba, "region", use_cache=True), ref, "mamba/region/use_cache=True"
    )


@pytest.mark.parametrize("engine", ("region", "dropin"))
def test_mamba_no_cache_exact(engine):
    ref = reference("mamba", build_mamba)
    assert_step_equal(run_step(build_mamba, engine), ref, f"mamba/{engine}/use_cache=False")


def _mamba_dropin_cache_error():
    with pytest.raises(RuntimeError) as info:
        run_step(build_mamba, "dropin", use_cache=True)
    return str(info.value)


def test_mamba_use_cache_dropin_refuses():
    """Mamba's cache_params (a DynamicCache of conv/ssm states) is filled in
    forward; recompute then takes the cached-state path (aten::cat of the
    conv state) that forward never ran: the drop-in refuses, pointing at the
    region engine."""
    msg = _mamba_dropin_cache_error()
    assert "recompute does not match forward" in msg, msg
    assert "region" in msg, msg


def test_mamba_use_cache_dropin_names_use_cache():
    """Mamba's cache changes which ops recompute runs (not their shapes):
    the refusal still names the Hugging Face fix."""
    msg = _mamba_dropin_cache_error()
    assert "use_cache=False" in msg, msg


# --------------------------------------------------------------------------
# 4. DPO-like step
# --------------------------------------------------------------------------


def _seq_logp(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def run_dpo(engine=None, beta=0.1):
    torch.manual_seed(MODEL_SEED)
    model = build_lora("llama")
    model.train()
    handle = None
    if engine is not None:
        handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls(), engine=engine)
    chosen, rejected = _tokens(seed=INPUT_SEED), _tokens(seed=INPUT_SEED + 1)
    torch.manual_seed(RUN_SEED)
    with torch.no_grad(), model.disable_adapter():
        ref_c, ref_r = _seq_logp(model, chosen), _seq_logp(model, rejected)
    pol_c, pol_r = _seq_logp(model, chosen), _seq_logp(model, rejected)
    loss = -F.logsigmoid(beta * ((pol_c - ref_c) - (pol_r - ref_r))).mean()
    loss.backward()
    return Step(loss.detach().clone(), param_grads(model), torch.get_rng_state(), handle)


@pytest.mark.parametrize("engine", ("region", "dropin"))
def test_dpo_step_exact(engine):
    ref = run_dpo()
    step = run_dpo(engine)
    assert_step_equal(step, ref, f"dpo/{engine}")
    assert any(g is not None and g.abs().sum() > 0 for n, g in step.grads.items() if "lora_B" in n)
    key = "replayed_ops" if engine == "region" else "recomputed_ops"
    assert step.handle.stats()["total"][key] > 0
