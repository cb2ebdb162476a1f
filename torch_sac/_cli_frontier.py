"""``python -m torch_sac frontier``: the trade-off curve of a TinyGPT training
step (peak memory against step time), plans and hand-written recipes
measured side by side by :func:`torch_sac.policies.frontier`; prints the
table and draws the figure."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import torch_sac
from torch_sac.models import TinyGPT

__all__ = ["add_model_arguments", "main"]


def add_model_arguments(p: argparse.ArgumentParser, *, blocks: int) -> None:
    """The TinyGPT and batch options both commands take."""
    p.add_argument(
        "--blocks", type=int, default=blocks, help=f"transformer blocks (default {blocks})"
    )
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout (default 0.1)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_sac frontier",
        description="Peak memory against step time for plans over a TinyGPT's blocks and the "
        "recipes users write by hand (torch_sac.policies.frontier).",
    )
    add_model_arguments(p, blocks=8)
    p.add_argument(
        "--fractions",
        default="0.8,0.6,0.5,0.4,0.3",
        help="peaks to plan for, as shares of no checkpointing's (default 0.8,0.6,0.5,0.4,0.3)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per point (default 3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="frontier.png", help="figure path (default frontier.png)")
    p.add_argument("--no-plot", action="store_true", help="draw no figure")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("blocks", "dim", "heads", "seq", "batch", "vocab", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.blocks < 2:
        parser.error("--blocks must be >= 2 (a chain of blocks)")
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--fractions must be numbers separated by commas, got {args.fractions!r}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.dim, args.heads, args.blocks, args.dropout)
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step():
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))

    try:
        f = torch_sac.policies.frontier(step, fractions=fractions, rounds=args.rounds)
    except ValueError as e:
        parser.error(str(e))
    print(
        f"TinyGPT: {args.blocks} blocks, width {args.dim}, seq {args.seq}, batch {args.batch}; "
        f"torch {torch.__version__}, {args.threads} thread(s)"
    )
    print(f.table())
    if not args.no_plot:
        print(f"plot: {f.plot(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
