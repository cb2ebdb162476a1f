#!/usr/bin/env python
"""Step time and activation memory: torch_sac's region engine against
PyTorch's checkpointing, side by side in one process.

Models (CPU, one intra-op thread so timings do not depend on core
contention):

* ``gpt``: 4 pre-LN transformer blocks (dim 128, 4 heads, seq 128, batch 4,
  attention written with matmuls + softmax, dropout 0.1);
* ``chain``: 4 blocks of 100 small elementwise steps (sin, mul, add, tanh on
  256 floats), where per-op costs dominate;
* ``conv``: 4 conv3x3-BatchNorm-ReLU(inplace) blocks (64 channels, 32x32,
  batch 8).

Every variant checkpoints each block separately:

* ``no checkpointing``          - the reference;
* ``torch checkpoint``          - ``torch.utils.checkpoint`` (recompute all);
* ``torch SAC, matmuls``        - PyTorch's SAC contexts saving matmuls /
  convolutions (the torchtitan-style policy, as a list of ops);
* ``torch_sac ctx, matmuls``    - torch_sac's drop-in contexts, same policy;
* ``torch_sac region, matmuls`` - ``torch_sac.sac_context`` around each block;
* ``torch_sac region, recompute_all`` - the region engine doing what
  ``torch.utils.checkpoint`` does, by replay instead of re-running Python.

Activation memory is measured with torch_sac's counting CPU allocator: bytes
still allocated after forward minus before (the loss, a scalar, aside);
"saved" is no checkpointing's activation memory minus the variant's; for the
region variants, "dropped" is the bytes of outputs the regions did not hold
(``sac_context.stats()["dropped_bytes"]``), which is not a saving: autograd
would not have kept all of them. Peak is the highest level during forward +
backward above the level before forward. Step time is the median over rounds (variants interleaved round
robin). Gradients of every variant are checked against the reference.

Usage::

    python bench/bench_region.py            # ~1-2 min
    python bench/bench_region.py --quick    # smoke run
"""

import argparse
import functools
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import torch_sac
import torch_sac.memory
from torch_sac.models import Block, ConvBNReLU

aten = torch.ops.aten
MATMUL_OPS = [
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
]


class ChainBlock(nn.Module):
    def forward(self, h):
        for _ in range(100):
            h = torch.tanh(torch.sin(h) * 1.01 + 0.1)
        return h


def build(name, quick):
    torch.manual_seed(0)
    if name == "chain":
        blocks = nn.ModuleList(ChainBlock() for _ in range(4))
        x = torch.randn(256)
    elif name == "gpt":
        blocks = nn.ModuleList(Block(dim=128, heads=4, dropout=0.1) for _ in range(4))
        x = torch.randn(2 if quick else 4, 64 if quick else 128, 128)
    else:
        blocks = nn.ModuleList(ConvBNReLU(64, 64) for _ in range(4))
        x = torch.randn(4 if quick else 8, 64, 32, 32)
    return blocks, x.requires_grad_(True)


# --------------------------------------------------------------------------
# Variants: how one block runs.
# --------------------------------------------------------------------------


def plain(block, x):
    return block(x)


def torch_checkpoint(block, x):
    return checkpoint(block, x, use_reentrant=False)


def torch_sac_matmuls(block, x):
    ctx = functools.partial(create_selective_checkpoint_contexts, MATMUL_OPS)
    return checkpoint(block, x, use_reentrant=False, context_fn=ctx)


def ours_contexts(block, x):
    ctx = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.save_matmuls()
    )
    return checkpoint(block, x, use_reentrant=False, context_fn=ctx)


# The regions of the current step (for their dropped bytes).
REGIONS = []


def ours_region(policy_factory):
    def run(block, x):
        with torch_sac.sac_context(policy_factory()) as region:
            out = block(x)
        REGIONS.append(region)
        return out

    return run


VARIANTS = {
    "no checkpointing": plain,
    "torch checkpoint": torch_checkpoint,
    "torch SAC, matmuls": torch_sac_matmuls,
    "torch_sac ctx, matmuls": ours_contexts,
    "torch_sac region, matmuls": ours_region(torch_sac.policies.save_matmuls),
    "torch_sac region, recompute_all": ours_region(torch_sac.policies.recompute_all),
}


def step(blocks, x, run_block, seed):
    """One forward + backward; returns (activation bytes, peak bytes, grads,
    bytes the regions dropped or None without regions)."""
    for p in blocks.parameters():
        p.grad = None
    x.grad = None
    REGIONS.clear()
    torch.manual_seed(seed)
    with torch_sac.memory.track() as whole:
        with torch_sac.memory.track() as fwd:
            h = x
            for block in blocks:
                h = run_block(block, h)
            loss = h.float().pow(2).mean()
            activation = fwd.delta - loss.untyped_storage().nbytes()
        loss.backward()
    del h, loss
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    dropped = sum(r.stats()["dropped_bytes"] for r in REGIONS) if REGIONS else None
    REGIONS.clear()
    return activation, whole.peak, grads, dropped


def measure(name, rounds, quick):
    blocks, x = build(name, quick)
    _, _, ref, _ = step(blocks, x, plain, seed=1)
    results = {
        v: {"time": [], "act": None, "peak": None, "exact": None, "dropped": None} for v in VARIANTS
    }
    for r in range(rounds + 1):  # round 0 warms up
        for vname, run_block in VARIANTS.items():
            start = time.perf_counter()
            act, peak, grads, dropped = step(blocks, x, run_block, seed=1)
            elapsed = time.perf_counter() - start
            res = results[vname]
            if r == 0:
                res["act"], res["peak"], res["dropped"] = act, peak, dropped
                res["exact"] = all(torch.equal(a, b) for a, b in zip(grads, ref))
            else:
                res["time"].append(elapsed)
    return results


def report(name, results):
    torch_sac_ref = results["torch SAC, matmuls"]
    ref_time = statistics.median(torch_sac_ref["time"])
    base = statistics.median(results["no checkpointing"]["time"])
    none_act = results["no checkpointing"]["act"]
    print(f"\n== {name}")
    header = (
        f"{'variant':<34} {'step ms':>8} {'vs none':>8} {'vs torch SAC':>13} "
        f"{'act KiB':>9} {'vs torch SAC':>13} {'saved KiB':>10} {'dropped KiB':>12} "
        f"{'peak KiB':>9} {'grads exact':>12}"
    )
    print(header)
    print("-" * len(header))
    for vname, res in results.items():
        t = statistics.median(res["time"])
        dropped = "-" if res["dropped"] is None else f"{res['dropped'] / 1024:.0f}"
        print(
            f"{vname:<34} {1e3 * t:>8.2f} {t / base:>7.2f}x {t / ref_time:>12.2f}x "
            f"{res['act'] / 1024:>9.0f} {res['act'] / max(torch_sac_ref['act'], 1):>12.2f}x "
            f"{(none_act - res['act']) / 1024:>10.0f} {dropped:>12} "
            f"{res['peak'] / 1024:>9.0f} {str(res['exact']):>12}"
        )
    print(
        "saved: no checkpointing's act minus the variant's; dropped: bytes of outputs the "
        "regions did not hold (not a saving)"
    )
    ours = results["torch_sac region, matmuls"]
    t_ours = statistics.median(ours["time"])
    print(
        f"targets, region vs torch SAC with the same policy: activation memory "
        f"{ours['act'] / torch_sac_ref['act']:.2f}x (<= 1: "
        f"{'met' if ours['act'] <= torch_sac_ref['act'] else 'NOT met'}), step time "
        f"{t_ours / ref_time:.2f}x (<= 1: {'met' if t_ours <= ref_time else 'NOT met'})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (3 if args.quick else 9)
    print(
        f"torch {torch.__version__}, torch_sac adapter {torch_sac.adapter()}, "
        f"1 thread, {rounds} rounds (medians)"
    )
    for name in ("gpt", "conv", "chain"):
        report(name, measure(name, rounds, args.quick))


if __name__ == "__main__":
    main()
