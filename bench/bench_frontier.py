"""The planner against the recipes users write by hand, at the same memory.

For a Hugging Face Llama and a GPT-2 from small configs (random weights,
nothing downloaded; 8 blocks of width 256, sequence 256, batch 2, fp32, one
thread), ``torch_sac.policies.frontier`` measures side by side, in
interleaved rounds, each in its own order (medians):

* the recipes: no checkpointing, ``torch.utils.checkpoint`` on every block
  and on every second block, segments of about sqrt(n) blocks
  (``checkpoint_sequential``), PyTorch's selective checkpointing saving the
  matmuls per block, ``torch_sac.checkpoint`` with ``save_matmuls`` per
  block;
* a plan (``plan_peak``'s chain solver) at each recipe's measured peak and
  at 0.6, 0.4 and 0.3 of no checkpointing's peak (below what the blocks
  reach, ``plan_peak``'s multiple recomputation).

Times are compared round by round (``Frontier.ratio``): per round the
ratio of two points' times, its median and a distribution-free interval
for that median (90 % or more from 5 rounds on; with 9 rounds the 2nd and
8th of the sorted ratios), so a slow stretch of the machine slows both sides of a
ratio and a judgement says when it is within the noise.

It prints the frontier's table, then per recipe the plan at its peak
(time ratio; target <= 1.03: met by the median, within noise where the
interval reaches 1.03, else MISSED), the plan at 0.3x (target <= 1.15x no
checkpointing's time), whether the plans are monotone (more memory allowed,
never slower: out of order where the median ratio is over 1.03 and the
interval's low end over 1), and the solver's time on 100 blocks x 10 options
(target < 1 s). ``--plot DIR`` writes ``frontier_<model>.png``.

    python bench/bench_frontier.py [--quick] [--rounds 9] [--plot docs/images]

CPU times are this machine's; GPU claims come from bench_gpu.py.
"""

import argparse
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import torch_sac  # noqa: E402
from torch_sac.planners.chain import ChainBlock, ChainOption, solve_chain  # noqa: E402

FRACTIONS = (0.6, 0.4, 0.3)
# A plan's time over the recipe's at the recipe's peak (and a plan's over
# the plan for less memory) that the targets allow.
TARGET = 1.03


def verdict(ratio):
    """Whether a plan/recipe ratio meets :data:`TARGET`: by its median, or
    only within the noise (the interval reaches it), or not."""
    if ratio.median <= TARGET:
        return "met"
    return "within noise" if ratio.low <= TARGET else "MISSED"


def build(kind, blocks, width, seq, batch):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=1000,
            hidden_size=width,
            intermediate_size=width * 11 // 4,
            num_hidden_layers=blocks,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
            use_cache=False,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=1000,
            n_positions=seq,
            n_embd=width,
            n_layer=blocks,
            n_head=4,
            attn_implementation="sdpa",
            use_cache=False,
        )
        model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, ids


def solver_seconds(blocks=100, options=10, repeats=3):
    """Median time of the chain solver on a random chain."""
    rng = random.Random(0)
    chain = []
    for _ in range(blocks):
        activation = rng.randint(1 << 20, 4 << 20)
        opts = [ChainOption("keep all", activation, 0.0)]
        for k in range(options - 2):
            kept = rng.randint(1 << 16, activation)
            opts.append(ChainOption(f"o{k}", kept, (1 - kept / activation) * 1e-3))
        opts.append(ChainOption("input", 1 << 16, 1e-3))
        chain.append(ChainBlock(tuple(opts), 1 << 16, activation, 1e-3, 1 << 18))
    times = []
    total = sum(b.activation for b in chain)
    for _ in range(repeats):
        start = time.perf_counter()
        solve_chain(chain, total // 3, 0, 0)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench(kind, args):
    model, ids = build(kind, args.blocks, args.width, args.seq, args.batch)

    def step():
        return model(input_ids=ids, labels=ids).loss

    start = time.perf_counter()
    f = torch_sac.policies.frontier(step, fractions=FRACTIONS, rounds=args.rounds)
    print(
        f"\n## {kind}: {args.blocks} blocks, width {args.width}, seq {args.seq}, batch "
        f"{args.batch}, fp32, {torch.get_num_threads()} thread(s); {time.perf_counter() - start:.0f} s"
    )
    print(f.table())
    none = f.none
    print(
        "\nplan at each recipe's peak (target: time <= 1.03x the recipe's; per-round ratio, "
        "median [interval])"
    )
    for p in f.points:
        if p.kind != "recipe":
            continue
        plan = f.plan_for(f"plan @ {p.label}")
        if plan is None:
            print(f"  {p.label:<34} no plan at {p.peak / none.peak:.2f}x (refused)")
            continue
        ratio = f.ratio(plan, p)
        print(
            f"  {p.label:<34} recipe {f.ratio(p, none).median:.3f}x at "
            f"{p.peak / none.peak:.2f}x; plan {f.ratio(plan, none).median:.3f}x at "
            f"{plan.peak / none.peak:.2f}x: {ratio} of the recipe's time: {verdict(ratio)}"
        )
    low = f.plan_for("plan @ 0.30x")
    if low is not None:
        print(
            f"plan at 0.30x: {f.ratio(low, none)} no checkpointing's time "
            f"(target <= 1.15x), peak {low.peak / none.peak:.2f}x ({low.label})"
        )
    else:
        print("plan at 0.30x: refused (below the least peak the planner measured)")
    # What no plan goes below: backward ends holding every parameter's
    # gradient (the parameters themselves are there before the step and
    # are not counted).
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    print(
        f"floor: the parameters' gradients, {grads / 2**20:.1f} MiB = {grads / none.peak:.2f}x "
        "no checkpointing's peak, are held by every plan"
    )
    # Out of order: a plan allowed more memory than the one before it is
    # slower by more than 3 % in the median round, and slower at all at the
    # low end of the interval (beyond the measurement's noise).
    plans = sorted((p for p in f.points if p.kind == "plan"), key=lambda p: p.target)
    pairs = [(a, b, f.ratio(b, a)) for a, b in zip(plans, plans[1:]) if b.target > a.target]
    worse = [
        f"{b.label} / {a.label}: {ratio}"
        for a, b, ratio in pairs
        if ratio.median > TARGET and ratio.low > 1
    ]
    closest = max((ratio for _, _, ratio in pairs), key=lambda r: r.median, default=None)
    print(
        f"monotone (more memory never slower beyond 3 % and the noise): {not worse}"
        + (f" {worse}" if worse else f"; the closest pair: {closest}")
    )
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        path = f.plot(
            os.path.join(args.plot, f"frontier_{kind}.png"),
            title=f"HF {kind}, {args.blocks} blocks, seq {args.seq}, fp32, CPU 1 thread",
        )
        print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default=None, help="directory for frontier_<model>.png")
    parser.add_argument("--quick", action="store_true", help="4 blocks, width 64, seq 64, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.width, args.seq, args.rounds = 4, 64, 64, 3
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, torch_sac adapter {torch_sac.adapter()}")
    print(f"chain solver, 100 blocks x 10 options: {solver_seconds() * 1e3:.0f} ms (target < 1 s)")
    for kind in args.models.split(","):
        bench(kind, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
