"""The trade-off curve of a step: peak memory against step time for plans
over the step's blocks at several peaks, with the recipes users write by
hand measured on the same axes (:func:`frontier`, :class:`Frontier`)."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .. import _C
from .._op_profile import format_bytes
from ..checkpointing import checkpoint as sac_checkpoint
from ..region import in_region
from ..schedule import ReplaySchedule
from .block_options import MATMULS, OFFLOAD_ALL
from .checks import check_blocks, check_callable, check_examples
from .peak_plan import block_runs
from .peak_search import Planner, at_the_chains_floor, plan_for_peak
from .step_state import StepState

__all__ = ["Frontier", "FrontierPoint", "TimeRatio", "frontier"]

# The peaks planned by default, as shares of no checkpointing's peak (with
# a plan at each recipe's peak too).
FRACTIONS = (0.8, 0.6, 0.5, 0.4, 0.35, 0.3)
# The least coverage of a ratio's interval (TimeRatio): the narrowest
# interval of order statistics that covers the median this often.
CONFIDENCE = 0.9


class TimeRatio(NamedTuple):
    """One point's step time over another's, from the rounds they ran in
    together (:meth:`Frontier.ratio`): per round the ratio of their two
    times, so that a slow stretch of the machine during one round slows
    both and cancels out.

    Attributes:
        median: the median of the per-round ratios.
        low, high: an interval that covers the true median ratio with
            probability at least ``confidence`` (distribution-free: order
            statistics of the per-round ratios; with few rounds, their
            whole range).
        rounds: how many rounds.
        confidence: the interval's coverage (binomial, exact).
    """

    median: float
    low: float
    high: float
    rounds: int
    confidence: float

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _median_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(low, high, coverage)``: the order statistics ``x(k)`` and
    ``x(n+1-k)`` of ``values`` for the largest ``k`` whose interval covers
    the median with probability at least :data:`CONFIDENCE` (a median is
    below ``x(k)`` only if at most ``k - 1`` values are under it: binomial
    with p = 1/2), else their whole range."""
    xs = sorted(values)
    n = len(xs)
    k, coverage = 1, 1 - 2 * 0.5**n
    for j in range(2, (n + 1) // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(j)) / 2**n
        if 1 - 2 * tail < CONFIDENCE:
            break
        k, coverage = j, 1 - 2 * tail
    return xs[k - 1], xs[n - k], coverage


class FrontierPoint:
    """One measured way to run the step.

    Attributes:
        label: what it is (``"plan @ 0.40x"``, ``"checkpoint per block"``).
        kind: ``"plan"``, ``"recipe"`` or ``"none"`` (no checkpointing).
        peak: measured peak, bytes (as :func:`~torch_sac.policies.plan_peak`
            measures it).
        seconds: median step time (forward and backward) over the rounds.
        target: for a plan, the peak it was planned for.
        also_for: for a plan, the labels of other targets whose plan is the
            same one (measured once, under the first target's label).
        blocks: for a plan, the option of each block.
        policy, budget: how a plan runs: the forward policy and replay
            budget of one ``sac_context`` around the step (None for a recipe).
        install: how a recipe runs: a context manager factory that wraps
            the blocks' forwards while it is entered (None: nothing to wrap).
    """

    def __init__(
        self,
        label: str,
        kind: str,
        *,
        install: Callable[[], Any] | None = None,
        target: int | None = None,
        blocks: list[str] | None = None,
        policy: Any = None,
        budget: Any = None,
    ) -> None:
        self.label, self.kind, self.target, self.blocks = label, kind, target, blocks
        self.policy, self.budget, self.install = policy, budget, install
        self.times = []
        self.peak = None
        self.also_for: list[str] = []

    @property
    def seconds(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "peak": self.peak,
            "seconds": self.seconds,
            "times": list(self.times),
            "target": self.target,
            "also_for": list(self.also_for),
            "blocks": self.blocks,
        }

    def __repr__(self):
        return (
            f"<FrontierPoint {self.label}: {format_bytes(self.peak)}, {self.seconds * 1e3:.1f} ms>"
        )


class Frontier:
    """What :func:`frontier` measured: :attr:`points` (no checkpointing
    first, then the recipes, then the plans), :meth:`pareto` (the points no
    other point beats in both peak and time), :meth:`ratio` (one point's
    time over another's, with an interval), :meth:`table`, :meth:`plot`."""

    def __init__(self, points: list[FrontierPoint], rounds: int) -> None:
        self.points = points
        self.rounds = rounds
        self.none = points[0]

    def plan_for(self, label: str) -> FrontierPoint | None:
        """The plan measured for the target ``label`` names (``"plan @
        0.30x"``, ``"plan @ checkpoint per block"``), also where that target
        got the same plan as an earlier one; None where it was refused."""
        for p in self.points:
            if p.kind != "plan":
                continue
            if p.label == label or p.label.startswith(label + " (") or label in p.also_for:
                return p
        return None

    def ratio(self, a: FrontierPoint | str, b: FrontierPoint | str) -> TimeRatio:
        """``a``'s step time over ``b``'s (points, or labels as for
        :meth:`plan_for` and recipes' own), round by round: a
        :class:`TimeRatio` with its median and an interval for it. Judge
        "slower" by the interval, not by the median of few rounds.

        Raises:
            KeyError: no point has that label (or that target was refused).
            ValueError: the two points did not run the same rounds.
        """
        a, b = self._point(a), self._point(b)
        if not a.times or len(a.times) != len(b.times):
            raise ValueError(
                f"torch_sac.Frontier.ratio: {a.label!r} and {b.label!r} ran {len(a.times)} and "
                f"{len(b.times)} rounds; the ratio needs the same rounds, at least one"
            )
        ratios = [x / y for x, y in zip(a.times, b.times)]
        low, high, coverage = _median_interval(ratios)
        return TimeRatio(statistics.median(ratios), low, high, len(ratios), coverage)

    def _point(self, point):
        if isinstance(point, FrontierPoint):
            return point
        found = self.plan_for(point) or next(
            (p for p in self.points if p.label == point and p.kind != "plan"), None
        )
        if found is None:
            raise KeyError(f"torch_sac.Frontier: no point {point!r} (labels: see .table())")
        return found

    def pareto(self) -> list[FrontierPoint]:
        """The points on the curve, by peak: each is faster than every point
        with a lower or equal peak."""
        front, best = [], math.inf
        for p in sorted(self.points, key=lambda p: (p.peak, p.seconds)):
            if p.seconds < best:
                front.append(p)
                best = p.seconds
        return front

    def table(self) -> str:
        """Each point: peak and time, and both as ratios to no checkpointing
        (the time's as :meth:`ratio`: per-round median and interval)."""
        front = {id(p) for p in self.pareto()}
        lines = [
            f"{'':2}{'point':<34} {'peak':>10} {'x none':>7} {'step ms':>9} {'x none':>7} "
            f"{'interval':>13}  blocks",
        ]
        coverage = None
        for p in sorted(self.points, key=lambda p: -p.peak):
            r = self.ratio(p, self.none)
            coverage = r.confidence
            lines.append(
                f"{'*' if id(p) in front else ' ':2}{p.label:<34} {format_bytes(p.peak):>10} "
                f"{p.peak / self.none.peak:>7.2f} {p.seconds * 1e3:>9.1f} "
                f"{r.median:>7.3f} {r.low:>6.3f}-{r.high:<6.3f}  {_blocks_text(p.blocks)}"
            )
        lines.append(
            f"(* on the curve; medians of {self.rounds} interleaved rounds; time x none per "
            f"round, its median and a {coverage:.0%} interval for it)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "points": [p.to_dict() for p in self.points]}

    def plot(self, path: str, title: str | None = None) -> str:
        """Draws peak (x) against step time (y), both as ratios to no
        checkpointing (the time's per round, as :meth:`ratio`): the plans
        as points, the recipes as labelled points, and the curve
        (:meth:`pareto`) as a line.
        Needs matplotlib (Agg backend, no window). Returns ``path``."""
        from .._profile_report import agg_figure

        fig = agg_figure(figsize=(7, 4.5))
        ax = fig.add_subplot(1, 1, 1)
        x = lambda p: p.peak / self.none.peak  # noqa: E731
        y = lambda p: self.ratio(p, self.none).median  # noqa: E731
        plans = [p for p in self.points if p.kind == "plan"]
        ax.plot([x(p) for p in plans], [y(p) for p in plans], "o", label="torch_sac plans")
        front = self.pareto()
        ax.plot([x(p) for p in front], [y(p) for p in front], "-", color="0.5", label="the curve")
        for p in self.points:
            if p.kind == "plan":
                continue
            ax.plot([x(p)], [y(p)], "s" if p.kind == "recipe" else "*", markersize=8)
            ax.annotate(
                p.label, (x(p), y(p)), textcoords="offset points", xytext=(5, 5), fontsize=7
            )
        ax.set_xlabel("peak / no checkpointing's peak")
        ax.set_ylabel("step time / no checkpointing's")
        ax.set_title(title or "peak memory against step time")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        return str(path)

    def __repr__(self):
        return f"<torch_sac.Frontier: {len(self.points)} points, {len(self.pareto())} on the curve>"


def _blocks_text(blocks):
    return "" if blocks is None else block_runs(blocks)


@contextlib.contextmanager
def _wrapped(blocks, wrap):
    """Each block's forward replaced by ``wrap(i)(forward)`` (where that is
    not None for its index ``i``), put back on exit: a forward set on the
    instance before (a user's wrapper, ``apply_sac``'s) is restored."""
    patched = []  # (block, its own forward attribute or None)
    try:
        for i, block in enumerate(blocks):
            wrapper = wrap(i)
            if wrapper is None:
                continue
            patched.append((block, vars(block).get("forward")))
            block.forward = functools.partial(wrapper, block.forward)
        yield
    finally:
        for block, own in patched:
            if own is None:
                del block.forward
            else:
                block.forward = own


def _torch_checkpoint(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _pytorch_matmul_policy(ctx, op, *args, **kwargs):
    """PyTorch's SAC recipe as users write it: a plain ``policy_fn`` saving
    the matmul-class ops (the same list as ``save_matmuls``)."""
    if op._schema.name in MATMULS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torch_sac_matmuls(forward, *args, **kwargs):
    return checkpoint(
        forward,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _pytorch_matmul_policy),
        **kwargs,
    )


def _own_matmuls(forward, *args, **kwargs):
    return sac_checkpoint(forward, *args, policy=_C.save_matmuls(), **kwargs)


def _own_offload_matmuls(forward, *args, **kwargs):
    return sac_checkpoint(forward, *args, policy=_C.offload_matmuls(), **kwargs)


def frontier(
    fn: Callable[..., Any],
    example_args: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    fractions: Sequence[float] = FRACTIONS,
    blocks: str | Sequence[torch.nn.Module] = "auto",
    recipes: bool = True,
    rounds: int = 3,
    offload: bool | None = None,
) -> Frontier:
    r"""Measures the trade-off between peak memory and step time of a step
    with repeated blocks: plans over its blocks (as
    :func:`~torch_sac.policies.plan_peak` makes them) at ``fractions`` of
    no checkpointing's peak and at each recipe's peak, and the recipes
    users write by hand, each run ``rounds`` times, interleaved.

    Recipes: no checkpointing; ``torch.utils.checkpoint`` on every block and
    on every second block; PyTorch's selective checkpointing saving the
    matmuls per block; ``torch_sac.checkpoint`` with ``save_matmuls`` per
    block; and, as one ``sac_context`` keeping block boundaries, segments of
    about sqrt(n) blocks (``checkpoint_sequential``).

    Args:
        fn: the step, as for :func:`~torch_sac.policies.plan_peak`.
        example_args, example_kwargs: its arguments.
        fractions: peaks to plan for, as shares of no checkpointing's peak.
        blocks: ``"auto"`` (the repeated blocks of the largest model ``fn``
            refers to) or a list of modules.
        recipes: measure the recipes too.
        rounds: timed rounds; each runs every point once, in an order of
            its own (medians are reported, and :meth:`Frontier.ratio`
            compares two points round by round).
        offload: whether plans may keep activations in host memory, as
            for :func:`~torch_sac.policies.plan_peak` (default: where the
            step runs on a GPU); then the recipes include
            ``torch_sac offload_matmuls per block`` and ``offload
            everything the blocks save`` (torchtune's recipe for the
            blocks; what runs outside them stays on the device) too.

    Returns:
        A :class:`Frontier`: ``print(f.table())``, ``f.plot("frontier.png")``.

    Raises:
        ValueError: the step has no repeated blocks (or they do not run as
            a chain), or an argument is out of range.

    Example:
        >>> f = torch_sac.policies.frontier(lambda: model(ids, labels=ids).loss)
        >>> print(f.table())
        >>> f.plot("frontier.png")
        >>> plan = torch_sac.policies.plan_peak(step, peak_bytes=f.pareto()[1].peak)

    Caveats:
        Times are wall-clock on this machine (on a GPU, synchronised per
        run): compare points of one call, not across machines. The planned
        points are found without the run limit of ``plan_peak`` (about two
        runs each); each point then runs ``rounds`` more times.
    """
    where = "policies.frontier"
    check_callable(fn, where)
    args, kwargs = check_examples(example_args, example_kwargs, where)
    blocks = check_blocks(blocks, where)
    if blocks is None:
        raise ValueError(f"torch_sac.{where}: blocks must be 'auto' or a list of modules")
    fractions = [float(f) for f in fractions]
    if not fractions or any(not (0 < f <= 1) for f in fractions):
        raise ValueError(f"torch_sac.{where}: fractions must be in (0, 1], got {fractions!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"torch_sac.{where}: rounds must be an int >= 1, got {rounds!r}")
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"torch_sac.{where}: offload must be None, True or False, got {offload!r}")
    if in_region():
        raise RuntimeError(f"torch_sac.{where}: a sac_context is open on this thread")
    state = StepState()
    try:
        state.find(fn, args, kwargs)
        return _measure_frontier(
            fn, args, kwargs, state, blocks, fractions, recipes, rounds, offload
        )
    finally:
        state.restore()


def _measure_frontier(fn, args, kwargs, state, blocks, fractions, recipes, rounds, offload):
    where = "policies.frontier"
    planner = Planner(fn, args, kwargs, 1, where, state, blocks, offload)
    planner.max_runs = math.inf
    plain = planner.plain_run()
    step = planner.step_blocks()
    if step is None:
        raise ValueError(
            f"torch_sac.{where}: the step cannot be planned over blocks ({planner.chain_note}); "
            "pass blocks= the modules it runs one after the other"
        )
    modules = step.modules
    n = len(step.chain)
    points = [FrontierPoint("no checkpointing", "none")]

    def region_point(label, kind, saved, offloaded=(), **extra):
        policy = ReplaySchedule([], saved).policy(offloaded or ())
        return FrontierPoint(label, kind, policy=policy, **extra)

    if recipes:
        every_block = lambda i: _torch_checkpoint  # noqa: E731
        points += [
            FrontierPoint(
                "checkpoint per block",
                "recipe",
                install=lambda: _wrapped(modules, every_block),
            ),
            FrontierPoint(
                "checkpoint every 2nd block",
                "recipe",
                install=lambda: _wrapped(
                    modules, lambda i: _torch_checkpoint if i % 2 == 0 else None
                ),
            ),
            FrontierPoint(
                "PyTorch SAC matmuls per block",
                "recipe",
                install=lambda: _wrapped(modules, lambda i: _torch_sac_matmuls),
            ),
            FrontierPoint(
                "torch_sac save_matmuls per block",
                "recipe",
                install=lambda: _wrapped(modules, lambda i: _own_matmuls),
            ),
        ]
        if step.offload is not None:
            points.append(
                FrontierPoint(
                    "torch_sac offload_matmuls per block",
                    "recipe",
                    install=lambda: _wrapped(modules, lambda i: _own_offload_matmuls),
                )
            )
            # torchtune's and save_on_cpu's recipe: everything the blocks save
            # goes to host memory (the plan space's option, per block).
            if all(OFFLOAD_ALL in {o.name for o in b.options} for b in step.chain):
                offload_all = step.recipe(OFFLOAD_ALL)
                points.append(
                    region_point(
                        "offload everything the blocks save",
                        "recipe",
                        step.saved_calls(offload_all),
                        step.offloaded_calls(offload_all),
                    )
                )
        k = max(2, round(math.sqrt(n)))
        points.append(
            region_point(f"segments of {k} blocks", "recipe", step.saved_calls(step.recipe("", k)))
        )
    # Every point runs once for its peak.
    for p in points:
        p.peak = _run_point(planner, p).peak
    targets = [(f"plan @ {f:.2f}x", int(f * plain.peak)) for f in fractions]
    targets += [(f"plan @ {p.label}", p.peak) for p in points[1:]]
    seen = {}
    for label, target in targets:
        candidate = planner.chain_for(step, target)
        if candidate is None or at_the_chains_floor(candidate.blocks):
            # What plan_peak returns there: below what the blocks reach its
            # multiple recomputation, and at their floor the better of that
            # and the plan over blocks (already a point when it wins).
            plan = _plan_peak(fn, args, kwargs, target, offload)
            if plan is not None and (candidate is None or plan.solver != "block chain"):
                point = FrontierPoint(
                    f"{label} ({plan.solver})",
                    "plan",
                    target=target,
                    blocks=plan.blocks,
                    policy=plan.policy(),
                    budget=plan.replay_budget,
                )
                point.peak = plan.measured_peak
                points.append(point)
            if candidate is None:
                continue
        key = (tuple(candidate.saved), tuple(candidate.offloaded or ()))
        if key in seen:
            seen[key].also_for.append(label)
            continue
        point = region_point(
            label,
            "plan",
            candidate.saved,
            candidate.offloaded,
            target=target,
            blocks=candidate.blocks,
        )
        point.peak = candidate.run.peak
        seen[key] = point
        points.append(point)
    # Each round in its own order (seeded: the same call measures the same
    # way), so that no point always runs after the same one.
    order = list(points)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for p in order:
            p.times.append(_run_point(planner, p).seconds)
    return Frontier(points, rounds)


def _plan_peak(fn, args, kwargs, target, offload=None):
    """What ``plan_peak`` returns for ``target``, or None where it refuses."""
    try:
        return plan_for_peak(fn, args, kwargs, target, "policies.frontier", offload=offload)
    except ValueError:  # below the least peak measured
        return None


def _run_point(planner, point):
    if point.policy is not None:
        return planner.run(point.policy, point.budget)
    with point.install() if point.install is not None else contextlib.nullcontext():
        return planner.run()
