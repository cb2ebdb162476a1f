"""Tiny Hugging Face models for the tests, and one training step compared bitwise.

Random weights from small configs, nothing downloaded (HF_HUB_OFFLINE=1).
Used by test_hf_models.py (its ``(model, batch, layers)`` builders),
test_hf_moe_peft.py (the same configs, models only), test_apply.py and
test_replay_budget.py (through test_hf_models).

A step's result is a :class:`Step` (loss, every parameter's gradient, the
global RNG state after it); :func:`assert_step_equal` compares two of them
bitwise (``torch.equal``): on CPU with one intra-op thread (conftest's
``one_thread`` fixture) every kernel these models use is deterministic.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

BATCH, SEQ, VOCAB = 2, 12, 100
MODEL_SEED = 1234  # weights
INPUT_SEED = 99  # token ids / labels (private generator)
RUN_SEED = 0  # global RNG before forward (dropout masks)


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def tokens(shape, g, low=2):
    """Token ids in [low, VOCAB) from the generator ``g``."""
    return torch.randint(low, VOCAB, shape, generator=g)


def padding_mask():
    """Second sequence right-padded by 3 tokens."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return mask


def causal_lm_batch():
    """input_ids (labels too) from INPUT_SEED and the padding mask."""
    g = torch.Generator().manual_seed(INPUT_SEED)
    ids = tokens((BATCH, SEQ), g)
    return dict(input_ids=ids, attention_mask=padding_mask(), labels=ids)


# --------------------------------------------------------------------------
# Configs (the caller seeds MODEL_SEED before building the model)
# --------------------------------------------------------------------------


def gpt2_config(attn="sdpa", **extra):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        attn_pdrop=0.1,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_implementation=attn,
        **extra,
    )


def llama_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
        **extra,
    )


# --------------------------------------------------------------------------
# Models with a batch and the layers to checkpoint: (model, batch kwargs, layers)
# --------------------------------------------------------------------------


def build_gpt2(attn="sdpa"):
    model = transformers.GPT2LMHeadModel(gpt2_config(attn, use_cache=False))
    return model, causal_lm_batch(), list(model.transformer.h)


def build_llama():
    model = transformers.LlamaForCausalLM(llama_config(use_cache=False))
    return model, causal_lm_batch(), list(model.model.layers)


def build_t5(attn="sdpa"):
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
        attn_implementation=attn,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(INPUT_SEED)
    batch = dict(
        input_ids=tokens((BATCH, SEQ), g),
        attention_mask=padding_mask(),
        labels=tokens((BATCH, SEQ - 4), g),
    )
    return model, batch, list(model.encoder.block) + list(model.decoder.block)


def build_bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation="sdpa",
    )
    model = transformers.BertForMaskedLM(cfg)
    g = torch.Generator().manual_seed(INPUT_SEED)
    ids = tokens((BATCH, SEQ), g)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    ids = ids.clone()
    ids[:, ::3] = 1  # [MASK]
    batch = dict(input_ids=ids, attention_mask=padding_mask(), labels=labels)
    return model, batch, list(model.bert.encoder.layer)


# --------------------------------------------------------------------------
# One training step, compared bitwise
# --------------------------------------------------------------------------


class Step:
    """What one training step left: loss, {name: grad or None}, the global
    RNG state after it; ``handle`` (apply_sac's) and ``region`` (a
    sac_context) where the step made one."""

    def __init__(self, loss, grads, rng_after, handle=None, region=None):
        self.loss = loss
        self.grads = grads
        self.rng_after = rng_after
        self.handle = handle
        self.region = region


def param_grads(model):
    """{name: a copy of .grad, or None} of every parameter."""
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_step_equal(step, ref, label):
    """Loss, every gradient (None where the reference's is None) and the RNG
    state after the step bitwise equal to the reference's."""
    assert torch.equal(step.loss, ref.loss), (
        f"{label}: loss {step.loss.item()!r} vs {ref.loss.item()!r} (diff {max_diff(step.loss, ref.loss):.3g})"
    )
    assert step.grads.keys() == ref.grads.keys()
    bad = []
    for name, g_ref in ref.grads.items():
        g = step.grads[name]
        if g is None or g_ref is None:
            if (g is None) != (g_ref is None):
                bad.append(f"{name}: grad is None in {'run' if g is None else 'reference'} only")
            continue
        if not torch.equal(g, g_ref):
            bad.append(
                f"{name}: max abs diff {max_diff(g, g_ref):.3g} (ref max {g_ref.abs().max().item():.3g})"
            )
    assert not bad, f"{label}: {len(bad)}/{len(ref.grads)} gradients differ:\n  " + "\n  ".join(bad)
    assert torch.equal(step.rng_after, ref.rng_after), (
        f"{label}: global RNG state differs after the step"
    )
