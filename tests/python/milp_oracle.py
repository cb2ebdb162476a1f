"""An exact oracle for multiple recomputation on small graphs: a mixed-integer
program solved by scipy's HiGHS, written independently of the engine.

The model is the one a region's replay budget bounds. Forward computes every
node once (free) and keeps some; then backward asks for nodes in a given
order (``demands``). Each request is a stage: the nodes computed in it need
their inputs held or computed in the same stage (node 0, the region's input,
is always there); after the stage at most ``slots`` nodes are held, the one
handed over included. The objective is the number of nodes recomputed.
Memory inside a stage (the working set of one replay) is not counted, as the
budget does not count it.

Variables, per stage t and node i: S[t, i] (held at the start of stage t;
S[0] is what forward keeps) and R[t, i] (computed in stage t)."""

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp


def min_recompute(deps, demands, slots):
    """Fewest recomputed nodes. ``deps[i]``: the inputs of node i (node 0 has
    none and is free); ``demands``: nodes in the order backward asks for
    them (consecutive repeats collapse: the node handed over is held until
    its last use)."""
    n = len(deps)
    stages = [d for k, d in enumerate(demands) if k == 0 or demands[k - 1] != d]
    t_count = len(stages)

    # Index of S[t, i] for t in 0..t_count (t_count: after the last stage)
    # and R[t, i] for t in 0..t_count-1; node 0 gets no variables.
    def s(t, i):
        return t * (n - 1) + (i - 1)

    r_base = (t_count + 1) * (n - 1)

    def r(t, i):
        return r_base + t * (n - 1) + (i - 1)

    count = r_base + t_count * (n - 1)
    rows, lower, upper = [], [], []

    def constrain(coefficients, lo, hi):
        row = np.zeros(count)
        for index, c in coefficients:
            row[index] += c
        rows.append(row)
        lower.append(lo)
        upper.append(hi)

    constrain([(s(0, i), 1) for i in range(1, n)], 0, slots)
    for t, demand in enumerate(stages):
        constrain([(s(t, demand), 1), (r(t, demand), 1)], 1, np.inf)
        for i in range(1, n):
            for j in deps[i]:
                if j != 0:
                    # R[t, i] <= S[t, j] + R[t, j]
                    constrain([(r(t, i), 1), (s(t, j), -1), (r(t, j), -1)], -np.inf, 0)
            # S[t+1, i] <= S[t, i] + R[t, i]
            constrain([(s(t + 1, i), 1), (s(t, i), -1), (r(t, i), -1)], -np.inf, 0)
        # Held after the stage, plus the node handed over unless kept.
        constrain(
            [(s(t + 1, i), 1) for i in range(1, n)] + [(s(t + 1, demand), -1)], -np.inf, slots - 1
        )
    objective = np.zeros(count)
    objective[r_base:] = 1
    result = milp(
        objective,
        constraints=LinearConstraint(np.array(rows), lower, upper),
        integrality=np.ones(count),
        bounds=Bounds(0, 1),
    )
    assert result.success, result.message
    return int(round(result.fun))


def chain_deps(length):
    """x_i = f(x_{i-1})."""
    return [[]] + [[i - 1] for i in range(1, length + 1)]
