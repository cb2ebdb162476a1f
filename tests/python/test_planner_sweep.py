"""``plan_peak`` and ``budget_for_model`` on every kind of model the suite
builds (issue 38): a plan that fits and is exact, or a clear refusal.

For each model (tiny configs, random weights, nothing downloaded) one
training step is run without checkpointing: its loss and every gradient are
the reference, and its peak (``torch_sac.memory.track``) the scale. Then
``torch_sac.policies.plan_peak(step, peak_bytes=...)`` plans for 0.8, 0.6
and 0.4 of that peak, and must either

* return a plan with ``plan.measured_peak <= peak_bytes`` under which the
  same step (same weights, inputs and global seed before forward: the
  models have dropout 0.1 in train mode) peaks within ``peak_bytes`` again
  and gives the loss, every gradient and the RNG state after it bitwise
  equal (``torch.equal``) to the reference, or
* raise a ``ValueError`` starting ``torch_sac.policies.plan_peak:`` (a
  refusal). Where it states the least peak measured, that peak is above
  the target, and planning for it returns such a plan (as ``PeakPlan``'s
  caveats promise).

Anything else (a ``KeyError``, ``IndexError``, ``AssertionError``, a plan
over its target, a gradient off by one ulp) fails. ``budget_for_model`` at
``fraction=0.5`` likewise: a plan, under which ``apply_sac`` runs the step
bitwise as the reference, or a ``ValueError``/``TypeError`` naming
``torch_sac.policies.``.

Each test prints its outcome in one line (``pytest -rP`` shows them) and
records it as the ``outcome`` property (in ``--junitxml``). Models are built
once per module and shared by the fractions; every run starts from the
same buffers, no gradients and the same seed, so the tests do not depend on
their order.

The models: the Hugging Face ones of test_hf_models.py (GPT-2, Llama, BERT,
T5; GPT-2 and T5 with SDPA and with attention written out) and
test_hf_moe_peft.py (Qwen3-MoE, OLMoE, Mixtral, GPT-OSS, Mamba, LoRA on
Llama and GPT-2), Whisper (conv front-end, encoder-decoder), Wav2Vec2 and
Wav2Vec2-Conformer for CTC (a conv feature encoder on audio that does not
require grad: issue 38's KeyError, at 0.4), ViT, the demo's TinyGPT as
``python -m torch_sac`` builds it, and the small models of models.py (MLP,
Conv+BatchNorm, GPT blocks, an LSTM loop, a custom autograd.Function).
"""

import os
import re
from typing import Callable, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import torch_sac  # noqa: E402
from hf_tiny import (  # noqa: E402
    BATCH,
    INPUT_SEED,
    MODEL_SEED,
    RUN_SEED,
    VOCAB,
    Step,
    assert_step_equal,
    param_grads,
    tokens,
)
from helpers import weighted  # noqa: E402
from models import MODEL_BUILDERS, REGION_MODEL_BUILDERS  # noqa: E402

import test_hf_models  # noqa: E402
import test_hf_moe_peft  # noqa: E402  (skips this module too without peft)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread", "leaves_nothing"),
    # peft asks transformers' deprecated is_gradient_checkpointing.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

FRACTIONS = (0.8, 0.6, 0.4)
BUDGET_FRACTION = 0.5

PLAN_PEAK_ERROR = "torch_sac.policies.plan_peak:"
LEAST_PEAK = re.compile(r"is below the least peak measured here: (\d+) bytes")


# --------------------------------------------------------------------------
# Models: each a Case (the model, its example call and the step's loss)
# --------------------------------------------------------------------------


class Case(NamedTuple):
    """A model and one training step of it: ``step()`` returns the loss;
    ``args``/``kwargs`` are the model's call (budget_for_model's example);
    ``inputs`` are tensors besides the parameters whose gradient counts."""

    model: torch.nn.Module
    step: Callable[[], torch.Tensor]
    args: tuple
    kwargs: dict
    inputs: tuple = ()


def hf_case(model, batch):
    """A Hugging Face model called with ``batch`` (labels included): the
    step's loss is the model's."""
    return Case(model, lambda: model(**batch).loss, (), batch)


def from_hf_models(name):
    """A builder of test_hf_models.MODELS (model, batch, layers)."""

    def build():
        model, batch, _ = test_hf_models.MODELS[name]()
        return hf_case(model, batch)

    return build


# Tokens of the causal LMs built here: activations large enough against the
# parameters' gradients for checkpointing to pay (as test_block_chain's), so
# that plans, not only refusals, are checked at 0.6 and 0.4.
LM_TOKENS = (4, 32)


def causal_lm(build):
    """A causal LM of test_hf_moe_peft (MoE, Mamba, LoRA) on LM_TOKENS tokens."""

    def build_case():
        model = build()
        ids = tokens(LM_TOKENS, torch.Generator().manual_seed(INPUT_SEED))
        return hf_case(model, dict(input_ids=ids, labels=ids, use_cache=False))

    return build_case


def build_whisper():
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=32,
        max_target_positions=32,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        use_cache=False,
    )
    model = transformers.WhisperForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(INPUT_SEED)
    # The conv front-end halves the frames: 2 * max_source_positions of them.
    batch_size, target_length = LM_TOKENS[0], 16
    features = torch.randn(batch_size, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
    batch = dict(input_features=features, labels=tokens((batch_size, target_length), g))
    return hf_case(model, batch)


# Wav2Vec2 and its Conformer: the conv feature encoder runs on raw audio that
# does not require grad. No SpecAugment (mask_time_prob=0: its masks come
# from numpy's RNG, which no seed here reaches) and no layer drop.
_WAV2VEC2 = dict(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    activation_dropout=0.1,
    feat_proj_dropout=0.1,
    layerdrop=0.0,
    mask_time_prob=0.0,
    ctc_loss_reduction="mean",
    pad_token_id=0,
)


def audio_batch():
    g = torch.Generator().manual_seed(INPUT_SEED)
    return dict(
        input_values=torch.randn(BATCH, 800, generator=g),
        labels=torch.randint(1, 32, (BATCH, 6), generator=g),
    )


def build_wav2vec2_conformer():
    """The model of issue 38 (its config, a seeded batch)."""
    cfg = transformers.Wav2Vec2ConformerConfig(
        conv_depthwise_kernel_size=3, position_embeddings_type="rotary", **_WAV2VEC2
    )
    return hf_case(transformers.Wav2Vec2ConformerForCTC(cfg), audio_batch())


def build_wav2vec2():
    cfg = transformers.Wav2Vec2Config(**_WAV2VEC2)
    return hf_case(transformers.Wav2Vec2ForCTC(cfg), audio_batch())


def build_vit():
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=3,
    )
    model = transformers.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(INPUT_SEED)
    batch = dict(
        pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g),
        labels=torch.randint(0, 3, (BATCH,), generator=g),
    )
    return hf_case(model, batch)


def build_tiny_gpt():
    """The demo's model and step, built as ``python -m torch_sac`` builds
    them (``torch_sac.cli._Setup``), at a smaller size than its defaults."""
    from torch_sac import cli

    args = cli._parser().parse_args(
        ["--blocks", "4", "--dim", "32", "--heads", "4", "--seq", "32", "--batch", "4"]
    )
    setup = cli._Setup(args)
    return Case(setup.model, setup.loss, (setup.tokens,), {})


def small_model(build):
    """A model of models.py (its own seeded weights and input requiring
    grad) with helpers.weighted as the loss."""

    def build_case():
        module, make_input = build()
        x = make_input()
        return Case(module, lambda: weighted(module(x)), (x,), {}, (x,))

    return build_case


MODELS = {
    # Hugging Face, dense (test_hf_models.MODELS: GPT-2, Llama, BERT, T5; GPT-2
    # and T5 with SDPA and with attention written out).
    **{name: from_hf_models(name) for name in test_hf_models.MODELS},
    # Mixture of experts (Qwen3-MoE, OLMoE, Mixtral, GPT-OSS), state space,
    # LoRA (test_hf_moe_peft).
    **{name: causal_lm(build) for name, build in test_hf_moe_peft.MOE_MODELS.items()},
    "mamba": causal_lm(test_hf_moe_peft.build_mamba),
    **{
        f"lora_{base}": causal_lm(lambda base=base: test_hf_moe_peft.build_lora(base))
        for base in ("llama", "gpt2")
    },
    # Encoder-decoder with an audio front-end, audio, vision.
    "whisper": build_whisper,
    "wav2vec2_conformer": build_wav2vec2_conformer,
    "wav2vec2": build_wav2vec2,
    "vit": build_vit,
    # The demo's model.
    "tiny_gpt": build_tiny_gpt,
    # models.py: MLP, Conv+BatchNorm, GPT blocks (with and without SDPA), an
    # LSTM loop, a custom autograd.Function.
    **{
        f"small_{name}": small_model(build)
        for name, build in {**MODEL_BUILDERS, **REGION_MODEL_BUILDERS}.items()
    },
}


# --------------------------------------------------------------------------
# Running a step
# --------------------------------------------------------------------------


class Built(NamedTuple):
    case: Case
    buffers: dict  # name -> a copy, as built
    reference: Step  # the step without checkpointing
    peak: int  # its peak, bytes above the level before it


_BUILT = {}


def reset(case, buffers):
    """The model as built: its buffers (BatchNorm statistics), no .grad."""
    with torch.no_grad():
        for name, b in case.model.named_buffers():
            b.copy_(buffers[name])
    case.model.zero_grad(set_to_none=True)
    for x in case.inputs:
        x.grad = None


def run(case, buffers, ctx=None):
    """One step from the built state and RUN_SEED, under ``ctx`` (a region)
    or plainly: (Step, its peak). Gradients are reset after it."""
    reset(case, buffers)
    torch.manual_seed(RUN_SEED)
    with torch_sac.memory.track() as m:
        if ctx is None:
            loss = case.step()
        else:
            with ctx:
                loss = case.step()
        loss.backward()
    grads = param_grads(case.model)
    for i, x in enumerate(case.inputs):
        grads[f"<input {i}>"] = None if x.grad is None else x.grad.clone()
    step = Step(loss.detach().clone(), grads, torch.get_rng_state())
    del loss
    reset(case, buffers)
    return step, m.peak


def built(name):
    """The model ``name``, built once (seeded), with its reference step and
    peak: a first plain run warms it up, the second is measured and must
    match the first bitwise (so comparing bitwise below is sound)."""
    if name not in _BUILT:
        torch_sac.memory.install_counting_allocator()
        torch.manual_seed(MODEL_SEED)
        case = MODELS[name]()
        case.model.train()
        buffers = {n: b.detach().clone() for n, b in case.model.named_buffers()}
        first, _ = run(case, buffers)
        reference, peak = run(case, buffers)
        assert_step_equal(reference, first, f"{name}: plain rerun")
        _BUILT[name] = Built(case, buffers, reference, peak)
    return _BUILT[name]


def outcome(record_property, line):
    print(line)
    record_property("outcome", line)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


def plan_for(b, target):
    """plan_peak on the built model's step for ``target`` bytes, from the
    built state and RUN_SEED."""
    reset(b.case, b.buffers)
    torch.manual_seed(RUN_SEED)
    return torch_sac.policies.plan_peak(b.case.step, peak_bytes=target)


def check_plan(name, b, plan, target, label):
    """The plan fits ``target`` (as planned and when run again) and its step
    is bitwise the reference's; returns the rerun's peak."""
    assert plan.measured_peak <= target, f"{name}: plan over its target\n{plan.table()}"
    step, peak = run(b.case, b.buffers, torch_sac.sac_context(plan))
    assert_step_equal(step, b.reference, f"{name} under plan_peak {label}")
    assert peak <= target, f"{name}: the plan peaked at {peak} > {target} when run again"
    return peak


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", list(MODELS))
def test_plan_peak_fits_and_is_bitwise_or_refuses(name, fraction, record_property):
    b = built(name)
    target = int(b.peak * fraction)
    try:
        plan = plan_for(b, target)
    except ValueError as e:
        message = str(e)
        assert message.startswith(PLAN_PEAK_ERROR), f"{name}: unclear ValueError: {message}"
        least = LEAST_PEAK.search(message)
        if least is None:
            outcome(record_property, f"{name} @ {fraction}: refused: {message}")
            return
        # The least peak it states is above the target, and planning for it
        # returns a plan (PeakPlan's caveats).
        least = int(least.group(1))
        assert least > target, f"{name}: refused a target it reached: {message}"
        check_plan(name, b, plan_for(b, least), least, "at the least peak it stated")
        outcome(
            record_property,
            f"{name} @ {fraction}: refused: least peak {least / b.peak:.2f} of plain "
            "(planned there: fits, bitwise)",
        )
        return
    peak = check_plan(name, b, plan, target, f"at {fraction}")
    blocks = "" if plan.blocks is None else f", {len(plan.blocks)} blocks"
    outcome(
        record_property,
        f"{name} @ {fraction}: plan ({plan.solver}, measured {plan.measured_peak / b.peak:.2f}"
        f"/{fraction} of plain, rerun {peak / b.peak:.2f}{blocks}, "
        f"{plan.replayed_ops} replayed ops)",
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_budget_for_model_plans_exactly_or_refuses(name, record_property):
    b = built(name)
    case = b.case
    reset(case, b.buffers)
    torch.manual_seed(RUN_SEED)
    try:
        plan = torch_sac.policies.budget_for_model(
            case.model, case.args, case.kwargs, fraction=BUDGET_FRACTION
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        assert message.startswith("torch_sac.policies."), f"{name}: unclear {e!r}"
        outcome(record_property, f"{name} budget_for_model: refused: {message[:120]}")
        return
    assert isinstance(plan, torch_sac.policies.ModelBudget)
    handle = torch_sac.apply_sac(case.model, plan)
    try:
        step, _ = run(case, b.buffers)
    finally:
        handle.remove()
    assert_step_equal(step, b.reference, f"{name} under budget_for_model")
    outcome(
        record_property,
        f"{name} budget_for_model: plan ({len(plan.plans)} blocks, "
        f"{plan.saved_bytes}/{plan.budget_bytes} bytes saved/budget)",
    )
