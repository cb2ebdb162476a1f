"""What a checkpoint segment of several blocks costs against checkpointing
each of its blocks, replaying the same calls: the measurement behind the
chain solver's segment price (``torch_sac.planners.chain.segment_seconds``,
``peak_search._SEGMENT_SLOWDOWN``).

For a Hugging Face Llama from a small config (random weights, nothing
downloaded) and torch_sac's TinyGPT with and without dropout, one region
around the whole step runs, side by side in interleaved rounds (each round
in an order of its own, medians): every block kept whole (the baseline),
every block keeping only its input (per-block checkpointing), and segments
of 2, 4 and 8 blocks (each keeping only its first block's input). Each
replays every block once in backward; a segment holds all its rebuilt
activations while its backward runs. Per row: the step's time, the time
it adds to keeping everything (per round, the median), that as a multiple
of what per-block checkpointing adds, the region's own replay clock, the
calls replayed and the peak. Last, the slowdown ``s`` that fits
``cost(k) = 1 + s * log2(k)`` best (least squares), against the planner's.

    python bench/bench_segments.py [--quick] [--rounds 7] [--device cuda]

A GPU session runs it with ``--device cuda`` to measure the GPU's value
(none is assumed there until then).
"""

import argparse
import math
import os
import random
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_sac  # noqa: E402
from bench_frontier import build as build_hf  # noqa: E402
from torch_sac.models import TinyGPT  # noqa: E402
from torch_sac.planners.peak_search import _SEGMENT_SLOWDOWN, Planner  # noqa: E402
from torch_sac.planners.step_state import StepState  # noqa: E402
from torch_sac.schedule import ReplaySchedule  # noqa: E402


def build(kind, args, device):
    """``(step, blocks)`` of one model, on ``device``: the Llama of
    ``bench_frontier.py`` (batch 2), or a TinyGPT of half the width and
    sequence (batch 4)."""
    if kind == "llama":
        model, ids = build_hf("llama", args.blocks, args.width, args.seq, 2)
        model, ids = model.to(device), ids.to(device)
        return (lambda: model(input_ids=ids, labels=ids).loss), list(model.model.layers)
    torch.manual_seed(0)
    dropout = 0.1 if kind == "tinygpt" else 0.0
    model = TinyGPT(256, args.width // 2, 4, args.blocks, dropout).to(device).train()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, args.seq // 2), generator=gen).to(device)

    def step():
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    return step, list(model.blocks)


def bench(kind, args, device):
    step, blocks = build(kind, args, device)
    state = StepState()
    state.find(step, (), {})
    try:
        planner = Planner(step, (), {}, 1 << 50, "bench_segments", state, blocks, False)
        planner.max_runs = math.inf
        planner.plain_run()
        chain = planner.step_blocks()
        lengths = [k for k in (2, 4, 8) if k <= len(blocks)]
        rows = {"keep all": chain.recipe("keep all"), "per block": chain.recipe("input")}
        rows.update({f"segments of {k}": chain.recipe("", k) for k in lengths})
        policies = {
            name: ReplaySchedule([], chain.saved_calls(c)).policy() for name, c in rows.items()
        }
        times = {name: [] for name in rows}
        last = {}
        order = list(rows)
        for r in range(args.rounds):
            random.Random(r).shuffle(order)
            for name in order:
                run = planner.run(policies[name])
                times[name].append(run.seconds)
                last[name] = run
    finally:
        state.restore()
    added = {name: [t - base for t, base in zip(times[name], times["keep all"])] for name in rows}
    print(
        f"\n## {kind} ({len(blocks)} blocks, {device}): medians of {args.rounds} interleaved rounds"
    )
    print(
        f"{'row':<16} {'step ms':>8} {'added ms':>9} {'x per block':>12} {'replay ms':>10} "
        f"{'replayed':>9} {'peak MiB':>9}"
    )
    fit = []
    for name in rows:
        per_round = [a / b for a, b in zip(added[name], added["per block"]) if b > 0]
        cost = statistics.median(per_round) if name != "keep all" and per_round else math.nan
        run = last[name]
        print(
            f"{name:<16} {statistics.median(times[name]) * 1e3:>8.1f} "
            f"{statistics.median(added[name]) * 1e3:>9.1f} {cost:>12.3f} "
            f"{run.stats.get('replay_ns', 0) / 1e6:>10.1f} {run.stats.get('replayed_ops', 0):>9} "
            f"{run.peak / 2**20:>9.1f}"
        )
        if name.startswith("segments of"):
            fit.append((int(name.rsplit(" ", 1)[1]), cost))
    slowdown = sum((c - 1) * math.log2(k) for k, c in fit) / sum(math.log2(k) ** 2 for k, _ in fit)
    print(
        f"fitted slowdown: {slowdown:.3f} (cost(k) = 1 + s log2 k; the planner assumes "
        f"{_SEGMENT_SLOWDOWN.get(device.type, 0.0)} on {device.type})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,tinygpt,tinygpt-no-dropout")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="4 blocks, width 64, seq 64, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.width, args.seq, args.rounds = 4, 64, 64, 3
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, torch_sac adapter {torch_sac.adapter()}, {device}")
    for kind in args.models.split(","):
        bench(kind, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
