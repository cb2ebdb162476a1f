"""Trains a small GPT-style model with torch_sac and reports what SAC did.

    python -m torch_sac.demo [--steps N] [--policy save_matmuls|recompute_all|save_all]
                             [--engine region|dropin]

Each transformer block is checkpointed: with ``--engine region`` (default) it
runs inside ``torch_sac.sac_context`` and backward replays dropped ops in C++;
with ``--engine dropin`` it runs under ``torch.utils.checkpoint`` with
torch_sac's drop-in contexts (``--engine contexts``, its former name, still
works). After training, the script prints per op what
was saved, dropped and recomputed in the last step, and checks that the
gradients equal those of the same step without checkpointing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_sac
from torch_sac._engines import DROPIN, ENGINES, REGION
from torch_sac.models import TinyGPT

POLICIES = {
    "save_matmuls": torch_sac.policies.save_matmuls,
    "recompute_all": torch_sac.policies.recompute_all,
    "save_all": torch_sac.policies.save_all,
}


def _engine(name: str) -> str:
    """``--engine``'s value; ``contexts`` is the drop-in's former name."""
    return DROPIN if name == "contexts" else name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="save_matmuls")
    parser.add_argument("--engine", type=_engine, choices=ENGINES, default=REGION)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyGPT()
    reference = TinyGPT()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = POLICIES[args.policy]()
    print(
        f"torch {torch.__version__}, torch_sac adapter: {torch_sac.adapter()}, "
        f"engine: {args.engine}, policy: {policy!r}"
    )

    contexts = []

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts(policy)
        contexts.append(pair[0])
        return pair

    def wrap(block, x):
        if args.engine == DROPIN:
            return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        region = torch_sac.sac_context(policy)
        contexts.append(region)
        with region:
            return block(x)

    for step in range(args.steps):
        tokens = torch.randint(0, 64, (8, 16))
        contexts.clear()
        optimizer.zero_grad()
        torch.manual_seed(1000 + step)
        loss = F.cross_entropy(model(tokens, wrap).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        if step == args.steps - 1:
            torch.manual_seed(1000 + step)
            reference.zero_grad()
            ref_loss = F.cross_entropy(
                reference(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()
            )
            ref_loss.backward()
            same = all(
                torch.equal(p.grad, r.grad)
                for p, r in zip(model.parameters(), reference.parameters())
            )
        optimizer.step()
        reference.load_state_dict(model.state_dict())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    print(f"\nLast step, {len(contexts)} checkpointed blocks; per op over all blocks:")
    rows = {}
    for ctx in contexts:
        for op, saved, dropped, recomputed in ctx.op_summary():
            row = rows.setdefault(op, [0, 0, 0])
            row[0] += saved
            row[1] += dropped
            row[2] += recomputed
    print(f"  {'op':<44} {'saved':>6} {'dropped':>8} {'recomputed':>11}")
    # Region rows count ops that made new tensors (views and in-place ops show 0/0).
    for op, (saved, dropped, recomputed) in rows.items():
        print(f"  {op:<44} {saved:>6} {dropped:>8} {recomputed:>11}")
    totals = {k: sum(c.stats()[k] for c in contexts) for k in contexts[0].stats()}
    if args.engine == DROPIN:
        print(
            f"\n  ops seen by the policy: {totals['policy_calls']}, saved: {totals['saved_ops']} "
            f"({totals['saved_bytes'] / 1024:.1f} KiB cached), recomputed in backward: "
            f"{totals['replayed_ops']}, cache hits: {totals['cache_hits']}"
        )
    else:
        print(
            f"\n  ops seen by the policy: {totals['policy_calls']}; new outputs kept: "
            f"{totals['saved_ops']} ops, {totals['saved_bytes'] / 1024:.1f} KiB; dropped: "
            f"{totals['dropped_ops']} ops, {totals['dropped_bytes'] / 1024:.1f} KiB\n"
            f"  saved tensors autograd held as references: {totals['packed_dropped']} "
            f"(kept as usual: {totals['packed_kept']}); replayed in backward: "
            f"{totals['replayed_ops']} ops in {totals['replay_ns'] / 1e6:.2f} ms"
        )
    print(f"  gradients bitwise equal to the run without checkpointing: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
