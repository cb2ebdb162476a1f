"""The optimal number of steps to reverse a chain under a memory bound:
an exact dynamic program, written independently of torch_sac's replay
budget to check it (tests/python/test_replay_budget.py) and to print the gap
(bench/bench_recompute.py).

The chain: x_0 -> x_1 -> ... -> x_l, one step each, all x_i the same size.
x_0 is always available. Backward asks for x_l, x_{l-1}, ..., x_1 in that
order; each is handed over and released before the next request. At most
``slots`` tensors of the chain are held at any request, the one handed over
included (``slots >= 1``). A step recomputes one x_i from x_{i-1}.
"""

import functools


@functools.lru_cache(maxsize=None)
def min_steps(length, slots):
    """Fewest steps to serve the requests of a chain of ``length`` steps."""
    if length <= 0:
        return 0
    if slots < 1:
        raise ValueError("slots must be >= 1: the tensor handed over is held")
    # Keep nothing on the way to x_l: l steps, then the rest from x_0 again.
    best = length + min_steps(length - 1, slots)
    if slots >= 2:
        # Keep x_p on the way: serve x_l..x_{p+1} from it with one slot
        # fewer, x_p is then free, and x_{p-1}..x_1 start from x_0 again.
        for p in range(1, length):
            best = min(best, p + min_steps(length - p, slots - 1) + min_steps(p - 1, slots))
    return best
