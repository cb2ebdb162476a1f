#!/usr/bin/env python
"""Multiple recomputation under a replay budget, side by side with PyTorch's
checkpointing, in one process (CPU, counting allocator, one thread).

Part 1, chains of n blocks (n = 16, 32; MLP blocks and TinyGPT blocks), one
training step each (forward + backward), variants:

  (a) no checkpointing;
  (b) torch.utils.checkpoint around every block;
  (c) torch.utils.checkpoint.checkpoint_sequential with sqrt(n) segments;
  (d) one sac_context around the whole chain, recompute_all, with the
      largest replay budget whose step peaks at most at (c)'s peak (found by
      bisection on measured peaks);
  (e) the same at half of (c)'s peak (when the region with a zero budget
      fits under it);
  (f) torch_sac.policies.plan_peak(step, peak_bytes=...) at (c)'s peak and at
      half of it: the peak plan (forward keeps the first sweep of the
      optimal reversal, backward runs under a budget counting it), run as
      planned: one sac_context(plan) around the whole step.

Printed per variant: the step's peak tensor memory above its start (MiB),
relative to (c); recomputed FLOPs as a multiple of one forward (PyTorch:
forward + backward FLOPs minus (a)'s, so after torch.utils.checkpoint's
early stop; the region: its replays, from per-call replay counts); the median step time over rounds (variants interleaved round
robin); gradients bitwise equal to (a).

Part 2, the gap to the optimum: a chain x_i = tanh(linear_i(x_{i-1})) whose
steps each save one tensor of one size, in one region with a budget of k
such tensors; the tanh replays are compared with the fewest steps any
schedule needs (tests/python/chain_oracle.py, an exact dynamic program).

Part 3, the planner's solve time: chains of MLP blocks (16, 64, 256 blocks,
and ~2,000 op calls), a peak plan at 40% of the no-checkpointing peak: the
time the region spent choosing what rebuilds keep in the planned step (the
solve: the search over budgets is measured runs, printed separately).

Usage::

    python bench/bench_recompute.py           # ~2-4 min
    python bench/bench_recompute.py --quick   # smoke run
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import torch_sac
import torch_sac.memory
from torch_sac.models import Block

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from chain_oracle import min_steps  # noqa: E402

MiB = 2**20


class MLPBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def make_chain(kind, n, quick):
    torch.manual_seed(0)
    if kind == "mlp":
        dim = 128
        blocks = nn.Sequential(*[MLPBlock(dim) for _ in range(n)])
        x = torch.randn(256 if quick else 1024, dim)
    else:
        dim = 64
        blocks = nn.Sequential(*[Block(dim, 4, dropout=0.1) for _ in range(n)])
        x = torch.randn(2 if quick else 4, 64 if quick else 128, dim)
    return blocks, x


def run_variant(variant, blocks, x, budget=None):
    """One step; returns the output's loss (for the caller to keep nothing)."""
    xin = x.clone().requires_grad_()
    region = None
    n = len(blocks)
    if variant == "a":
        out = blocks(xin)
    elif variant == "b":
        out = xin
        for block in blocks:
            out = checkpoint(block, out, use_reentrant=False)
    elif variant == "c":
        out = checkpoint_sequential(blocks, round(math.sqrt(n)), xin, use_reentrant=False)
    elif variant == "f":
        with torch_sac.sac_context(budget) as region:  # a PeakPlan
            out = blocks(xin).square().mean()
        out.backward()
        return region
    else:
        with torch_sac.sac_context(
            torch_sac.policies.recompute_all(), replay_budget=budget
        ) as region:
            out = blocks(xin)
    out.square().mean().backward()
    return region


def peak_plan(blocks, x, target_peak):
    """A PeakPlan for the step under ``target_peak``, or the error's text.
    step() counts the input's copy, made before the planned region runs."""
    xin = x.clone().requires_grad_()
    torch.manual_seed(1)
    try:
        return torch_sac.policies.plan_peak(
            lambda: blocks(xin).square().mean(),
            peak_bytes=target_peak - x.numel() * x.element_size(),
        )
    except ValueError as e:
        return str(e)


def step(variant, blocks, x, budget=None, flops=False):
    """(peak bytes, backward FLOPs or None, region, grads) of one step."""
    blocks.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    counter = FlopCounterMode(display=False) if flops else None
    with torch_sac.memory.track() as mem:
        if counter is None:
            region = run_variant(variant, blocks, x, budget)
        else:
            with counter:
                region = run_variant(variant, blocks, x, budget)
    grads = [p.grad.clone() for p in blocks.parameters()]
    total = counter.get_total_flops() if counter is not None else None
    return mem.peak, total, region, grads


def largest_budget_within(blocks, x, target_peak):
    """The largest replay budget (to 1/64 of the unbudgeted memo peak) whose
    step peaks at most ``target_peak``; None when even 0 does not."""
    if step("d", blocks, x, budget=0)[0] > target_peak:
        return None
    high = step("d", blocks, x)[2].stats()["peak_memo_bytes"]
    low = 0
    while high - low > max(high // 64, 1):
        mid = (low + high) // 2
        if step("d", blocks, x, budget=mid)[0] <= target_peak:
            low = mid
        else:
            high = mid
    return low


def forward_flops(blocks, x):
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        blocks(x)
    return counter.get_total_flops()


def replayed_flops(region, blocks, x):
    """FLOPs of the region's replays: each forward call's FLOPs (counted
    by op and call index in an identical forward) times its replays."""
    per_call = {}

    class Calls(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = f"{func._schema.name}.{func._overloadname or 'default'}"
            formula = torch.utils.flop_counter.flop_registry.get(func._overloadpacket)
            f = int(formula(*args, **kwargs, out_val=out)) if formula else 0
            per_call.setdefault(name, []).append(f)
            return out

    torch.manual_seed(1)
    xin = x.clone().requires_grad_()
    with Calls():
        blocks(xin)
    total = 0
    for row in region.op_details():
        calls = per_call.get(row["op"], [])
        total += sum(f * r for f, r in zip(calls, row["replays_by_call"]))
    return total


def chains(args):
    print("Part 1: one step of a chain of n blocks (CPU, one thread)")
    header = (
        f"{'model':<8} {'n':>3}  {'variant':<44} {'peak MiB':>9} {'vs (c)':>7} "
        f"{'recompute':>10} {'step ms':>8}  grads"
    )
    print(header)
    print("-" * len(header))
    for kind in ("mlp", "gpt"):
        for n in args.sizes:
            blocks, x = make_chain(kind, n, args.quick)
            fwd = forward_flops(blocks, x)
            for v in ("a", "a", "c"):  # warm-up: first-call allocations
                step(v, blocks, x)
            bwd_a = step("a", blocks, x, flops=True)[1]
            ref = step("a", blocks, x)[3]
            peak_c = step("c", blocks, x)[0]
            variants = [
                ("a", "(a) no checkpointing", None),
                ("b", "(b) checkpoint per block", None),
                ("c", f"(c) checkpoint_sequential, {round(math.sqrt(n))} segments", None),
            ]
            for label, target in (("d", peak_c), ("e", peak_c // 2)):
                budget = largest_budget_within(blocks, x, target)
                if budget is None:
                    floor = step("d", blocks, x, budget=0)[0]
                    print(
                        f"{kind:<8} {n:>3}  ({label}) region at {target / MiB:.1f} MiB: below its "
                        f"floor of {floor / MiB:.1f} MiB with a zero budget, not run"
                    )
                    continue
                variants.append(
                    ("d", f"({label}) region recompute_all, budget {budget / MiB:.2f} MiB", budget)
                )
            for target, what in ((peak_c, "(c)'s peak"), (peak_c // 2, "half (c)'s peak")):
                plan = peak_plan(blocks, x, target)
                if isinstance(plan, str):
                    print(
                        f"{kind:<8} {n:>3}  (f) peak plan at {what}: {plan.split(': ', 1)[1][:90]}"
                    )
                    continue
                variants.append(("f", f"(f) peak plan at {what}", plan))
            times = {name: [] for _, name, _ in variants}
            for _ in range(args.rounds):
                for v, name, budget in variants:
                    t0 = time.perf_counter()
                    step(v, blocks, x, budget)
                    times[name].append(time.perf_counter() - t0)
            for v, name, budget in variants:
                # Peaks without FlopCounterMode, which holds tensors of its own.
                peak, _, region, grads = step(v, blocks, x, budget)
                if v in "df":
                    recompute = replayed_flops(region, blocks, x)
                else:
                    recompute = step(v, blocks, x, flops=True)[1] - bwd_a
                same = all(torch.equal(g, r) for g, r in zip(grads, ref))
                print(
                    f"{kind:<8} {n:>3}  {name:<44} {peak / MiB:>9.2f} {peak / peak_c:>6.2f}x "
                    f"{recompute / fwd:>9.2f}x {statistics.median(times[name]) * 1e3:>8.1f}  "
                    f"{'bitwise' if same else 'DIFFER'}"
                )
    print("peak: tensor memory over the step above its start (parameters' gradients included);")
    print("recompute: FLOPs recomputed in backward / FLOPs of one forward; step: median wall time")


def gap(args):
    print()
    print("Part 2: tanh-linear chain, one region, budget of k step tensors: replays vs optimum")
    header = f"{'n':>3} {'k':>3} {'replayed steps':>15} {'optimum':>8} {'ratio':>6}  {'memo peak / budget':>18}"
    print(header)
    print("-" * len(header))
    width, batch = 64, 32
    size = width * batch * 4
    worst = 0.0
    for n in args.sizes:
        torch.manual_seed(0)
        layers = [nn.Linear(width, width) for _ in range(n)]
        x = torch.randn(batch, width, requires_grad=True)
        for k in (1, 2, 3, 4, 6, 8, n // 2):
            with torch_sac.sac_context(
                torch_sac.policies.recompute_all(), replay_budget=k * size
            ) as region:
                h = x
                for layer in layers:
                    h = torch.tanh(layer(h))
            h.sum().backward()
            (row,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
            best = min_steps(n - 1, k)  # the output stays alive: n-1 steps to reverse
            ratio = row["replayed"] / best
            worst = max(worst, ratio)
            peak = region.stats()["peak_memo_bytes"]
            print(
                f"{n:>3} {k:>3} {row['replayed']:>15} {best:>8} {ratio:>6.2f}  {peak / (k * size):>18.2f}"
            )
    print(f"worst ratio to the optimum: {worst:.2f}")


def solve_times(args):
    print()
    print(
        "Part 3: the peak planner's solve time (MLP blocks, dim 16, plan at 40% of the "
        "no-checkpointing peak)"
    )
    header = (
        f"{'blocks':>6} {'op calls':>9} {'solve ms':>9} {'solver':<17} {'runs':>5} "
        f"{'planning s':>10} {'peak / budget':>13}"
    )
    print(header)
    print("-" * len(header))
    sizes = (16, 64) if args.quick else (16, 64, 256, 286)
    for n in sizes:
        torch.manual_seed(0)
        blocks = nn.Sequential(*[MLPBlock(16) for _ in range(n)])
        x = torch.randn(64, 16)
        xin = x.clone().requires_grad_()

        def fn():
            return blocks(xin).square().mean()

        plain = torch_sac.policies.plan_peak(fn, peak_bytes=1 << 40).no_checkpoint_peak
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
            fn()
        calls = region.stats()["policy_calls"]
        plan = torch_sac.policies.plan_peak(fn, peak_bytes=int(plain * 0.4))
        print(
            f"{n:>6} {calls:>9} {plan.solve_seconds * 1e3:>9.2f} {plan.solver:<17} "
            f"{plan.planning_runs:>5} {plan.measure_seconds:>10.2f} "
            f"{plan.measured_peak / plan.peak_bytes:>13.2f}"
        )
    print(
        "solve: time the region spent choosing what each rebuild keeps in the planned step; "
        "planning: the measured runs"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.sizes = (8, 16) if args.quick else (16, 32)
    args.rounds = 1 if args.quick else 5
    torch.set_num_threads(1)
    torch_sac.memory.install_counting_allocator()
    chains(args)
    gap(args)
    solve_times(args)


if __name__ == "__main__":
    main()
