#!/usr/bin/env python
"""Run a schedule solved elsewhere: an optimal (Revolve-style) reversal of a
chain, written as a torch_sac.ReplaySchedule and executed by one region.

The chain: x_i = tanh(x_{i-1} @ w_i), i = 1..n, one region around all of
it with ``recompute_all``: forward keeps nothing but the input. Backward
asks for x_{n-1}, ..., x_1 (x_n, the output, is still alive). With memory
for ``slots`` of them at a time, the fewest steps any schedule recomputes
is given by a dynamic program (the same recursion as Griewank's Revolve for
this cost model). This script builds the schedule that attains it, by hand:
for every rebuild, which x_i it keeps; runs it; and checks that the region
recomputed exactly that many steps, never held more than ``slots`` tensors,
and produced gradients bitwise equal to plain autograd. Exits non-zero if
any check fails.

    python examples/revolve_chain.py [--steps 16] [--slots 3]
"""

import argparse
import functools
import sys

import torch

import torch_sac


@functools.lru_cache(maxsize=None)
def best(length, slots):
    """(fewest steps, first checkpoint or None) to serve the requests of a
    chain of ``length`` steps from its base with ``slots`` tensors held at
    most, the one handed over included."""
    if length <= 0:
        return 0, None
    cost, choice = length + best(length - 1, slots)[0], None
    if slots >= 2:
        for p in range(1, length):
            c = p + best(length - p, slots - 1)[0] + best(p - 1, slots)[0]
            if c < cost:
                cost, choice = c, p
    return cost, choice


def first_sweep(base, length, slots):
    """What the rebuild of x_{base+length} keeps, and the rebuilds after it
    (as (unpacked index, kept indices)), for the optimal schedule."""
    _, p = best(length, slots)
    if p is None:
        return [], reversal(base, length - 1, slots)
    keep, rest = first_sweep(base + p, length - p, slots - 1)
    # x_{base+p} is kept: its own unpack needs no rebuild.
    return [base + p] + keep, rest + reversal(base, p - 1, slots)


def reversal(base, length, slots):
    """Every rebuild serving x_{base+length}, ..., x_{base+1} from x_base."""
    if length <= 0:
        return []
    keep, rest = first_sweep(base, length, slots)
    return [(base + length, keep)] + rest


def tanh_key(i):
    """x_i is the output of the i-th tanh call (call index i - 1)."""
    return ("aten::tanh.default", i - 1, 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--slots", type=int, default=3)
    args = parser.parse_args()
    n, slots = args.steps, args.slots

    torch.manual_seed(0)
    weights = [(torch.randn(32, 32) * 0.3).requires_grad_() for _ in range(n)]
    x = torch.randn(8, 32)

    def forward():
        h = x
        for w in weights:
            h = torch.tanh(h @ w)
        return h

    def grads():
        out = [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        return out

    forward().sum().backward()
    expected = grads()

    steps = reversal(0, n - 1, slots)
    schedule = torch_sac.ReplaySchedule(
        [(tanh_key(i), [tanh_key(k) for k in keep]) for i, keep in steps]
    )
    print(f"chain of {n} steps, {slots} tensors held at most: {len(steps)} rebuilds")
    for i, keep in steps:
        print(f"  rebuild x_{i:<3} keep {', '.join(f'x_{k}' for k in keep) or '-'}")

    with torch_sac.sac_context(
        torch_sac.policies.recompute_all(), replay_schedule=schedule
    ) as region:
        out = forward()
    out.sum().backward()
    got = grads()

    (tanh,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
    optimum = best(n - 1, slots)[0]
    step_bytes = x.numel() * x.element_size()
    held = region.stats()["peak_memo_bytes"] // step_bytes
    bitwise = all(torch.equal(a, b) for a, b in zip(got, expected))
    print(
        f"recomputed {tanh['replayed']} steps (optimum {optimum}); "
        f"per step: {tanh['replays_by_call']}"
    )
    print(
        f"held at most {held} rebuilt tensors (slots {slots}); "
        f"gradients {'bitwise equal to' if bitwise else 'DIFFERENT from'} plain autograd"
    )
    ok = tanh["replayed"] == optimum and held <= slots and bitwise
    ok = ok and region.replay_schedule() == schedule
    print("schedule executed exactly" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
