"""Fine-tuning a Hugging Face Llama with torch_sac, three ways.

A small Llama built from a config with random weights (nothing is
downloaded), a few training steps each:

1. ``apply_sac(model, save_matmuls())``: every decoder layer in a region;
2. ``apply_sac(model, budget_for_model(model, (), {"input_ids": ids, ...},
   fraction=0.5))``: a plan made from one real call of the model, one per
   distinct layer;
3. Hugging Face's own route: ``model.activation_checkpointing_enable(...)``
   with torch_sac's contexts as ``context_fn`` (transformers 5.23 and later;
   earlier releases call it
   ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``, and
   this example uses whichever the installed transformers has).

Each prints the profile of its last step and checks its gradients against
the same steps without checkpointing.

    python examples/hf_llama_finetune.py
"""

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import torch_sac

transformers.logging.set_verbosity_error()
CONFIG = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
STEPS, BATCH, SEQ = 3, 4, 64


def build():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(CONFIG).train()


def batch(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g)
    return ids


def hf_checkpointing(model, policy):
    """Hugging Face's own checkpointing with torch_sac's contexts: the
    method's name and keyword changed in transformers 5.23 (the old name
    warns there, and the new one is missing before it)."""
    kwargs = {
        "use_reentrant": False,
        "context_fn": functools.partial(torch_sac.create_selective_checkpoint_contexts, policy),
    }
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train(model, label, prepare=lambda model: None):
    """STEPS optimizer steps; returns the gradients of the last one."""
    prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        ids = batch(step)
        opt.zero_grad(set_to_none=True)
        if step == STEPS - 1:
            with torch_sac.profile(label=label) as prof:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return grads, prof


def main():
    torch.set_num_threads(1)
    reference, plain = train(build(), "no checkpointing")
    base = plain.totals["activation_bytes"]
    print(
        f"no checkpointing: activations {base / 2**20:.2f} MiB, "
        f"peak {plain.totals['peak_bytes'] / 2**20:.2f} MiB"
    )

    runs = {
        "apply_sac save_matmuls": lambda m: torch_sac.apply_sac(
            m, torch_sac.policies.save_matmuls()
        ),
        "apply_sac budget 50%": lambda m: torch_sac.apply_sac(
            m,
            torch_sac.policies.budget_for_model(
                m, example_kwargs={"input_ids": batch(0), "use_cache": False}, fraction=0.5
            ),
        ),
        "Hugging Face checkpointing + contexts": lambda m: hf_checkpointing(
            m, torch_sac.policies.save_matmuls()
        ),
    }
    all_exact = True
    for label, prepare in runs.items():
        grads, prof = train(build(), label, prepare)
        exact = all(torch.equal(grads[n], reference[n]) for n in reference)
        all_exact = all_exact and exact
        t = prof.totals
        print(
            f"\n== {label}: gradients {'bitwise equal to' if exact else 'DIFFER from'} "
            "no checkpointing"
        )
        # What checkpointing saved against no checkpointing, measured: not the
        # bytes the regions dropped (some of those autograd would not keep).
        print(
            f"activations {t['activation_bytes'] / 2**20:.2f} MiB "
            f"({t['activation_bytes'] / base:.2f}x of no checkpointing, "
            f"{(base - t['activation_bytes']) / 2**20:.2f} MiB saved), "
            f"peak {t['peak_bytes'] / 2**20:.2f} MiB, replay {t['replay_ns'] / 1e6:.1f} ms"
        )
        if prof.totals["regions"]:
            print(prof.table(max_rows=6))
    if not all_exact:
        raise SystemExit("gradients differ")


if __name__ == "__main__":
    main()
