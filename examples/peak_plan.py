#!/usr/bin/env python
"""Train a model whose step must fit a peak-memory budget, with one region
around the whole step and no block boundaries chosen by hand.

``torch_sac.policies.plan_peak(step, peak_bytes=...)`` measures the step and
plans what forward keeps and how backward rebuilds (multiple recomputation)
so that the step's forward+backward peak fits. The script plans a TinyGPT
step at a fraction of its no-checkpointing peak, prints the plan, saves and
loads it, trains a few SGD steps with it next to a copy trained without
checkpointing, and checks that the losses and parameters are bitwise equal
and that every step's measured peak fits. Exits non-zero if a check fails.

    python examples/peak_plan.py [--depth 12] [--fraction 0.3]
"""

import argparse
import copy
import os
import sys
import tempfile

import torch

import torch_sac
import torch_sac.memory
from torch_sac.models import TinyGPT


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.3,
        help="peak budget as a fraction of the step's peak without checkpointing",
    )
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, depth=args.depth, dropout=0.1)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (4, 128))
    targets = torch.randint(0, 128, (4, 128))

    def loss_of(m):
        return torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())

    # The budget: a fraction of what the step peaks at without checkpointing.
    no_checkpointing = torch_sac.policies.plan_peak(lambda: loss_of(model), peak_bytes=1 << 40)
    peak_bytes = int(no_checkpointing.no_checkpoint_peak * args.fraction)
    plan = torch_sac.policies.plan_peak(lambda: loss_of(model), peak_bytes=peak_bytes)
    print(plan.table(max_rows=8))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        plan.save(path)
        plan = torch_sac.PeakPlan.load(path)

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    ok = True
    for step in range(args.steps):
        torch.manual_seed(100 + step)  # the same dropout masks for both models
        with torch_sac.memory.track() as mem:
            with torch_sac.sac_context(plan) as region:
                loss = loss_of(model)
            loss.backward()
            del loss
        torch.manual_seed(100 + step)
        ref_loss = loss_of(reference)
        ref_loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        stats = region.stats()
        fits = mem.peak <= peak_bytes
        ok = ok and same and fits
        print(
            f"step {step}: loss {ref_loss.item():.4f}, peak {mem.peak / 2**20:.2f} MiB "
            f"(budget {peak_bytes / 2**20:.2f} MiB, {'fits' if fits else 'OVER'}), "
            f"{stats['replayed_ops']} op replays, parameters "
            f"{'bitwise equal to no checkpointing' if same else 'DIFFER'}"
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
