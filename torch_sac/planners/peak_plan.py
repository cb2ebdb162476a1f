"""``PeakPlan``: a plan for a peak, what :func:`torch_sac.policies.plan_peak`
returns, and its JSON form. The search that finds one is in
``peak_search.py``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .. import _C
from .._budget_types import RegionPlan, ReplayBudget
from .._op_profile import format_bytes
from ..schedule import ReplaySchedule, as_call, read_json, write_json

__all__ = ["BlockRow", "PeakPlan"]

# The format of to_dict()'s output. 5: what the planning run kept, dropped
# and offloaded ("kept_ops", "kept_bytes", "dropped_ops", "dropped_bytes",
# "offloaded_bytes"), and "block_rows", a plan over blocks per block. 4: "offloaded", the saved calls kept in
# host memory (null: none). 3: "blocks", the option of each block of a plan
# over the step's blocks (null otherwise). 2: the replays are
# "replayed_ops" and "replay_seconds" (1 said "recomputed_ops" and
# "recompute_seconds", the drop-in's former words). from_dict reads all
# five (what formats before 5 lack is None: not measured).
FORMAT = "torch_sac.peak_plan/5"
_OLD_FORMATS = {
    "torch_sac.peak_plan/4": {},
    "torch_sac.peak_plan/1": {
        "recomputed_ops": "replayed_ops",
        "recompute_seconds": "replay_seconds",
    },
    "torch_sac.peak_plan/2": {},
    "torch_sac.peak_plan/3": {},
}


@dataclasses.dataclass(frozen=True)
class BlockRow:
    """What a plan over blocks does with one block of the step
    (:attr:`PeakPlan.block_rows`).

    Attributes:
        block: its place in the step's chain of blocks.
        module: its qualified name in the model (its class where the
            planner found no name).
        option: what it keeps (:attr:`PeakPlan.blocks`).
        calls: the op calls it runs in forward that a plan can keep.
        kept_calls: of them, those forward keeps.
        activation_bytes: what keeping all of them holds, its input
            included (modelled from the profile).
        kept_bytes: what the option keeps on the device, its input
            included (modelled).
        offloaded_bytes: what it keeps in host memory instead (modelled).
        replayed_ops: op replays of its calls in the planning run's
            backward (measured).
    """

    block: int
    module: str
    option: str
    calls: int
    kept_calls: int
    activation_bytes: int
    kept_bytes: int
    offloaded_bytes: int
    replayed_ops: int

    @property
    def dropped_bytes(self) -> int:
        """Of :attr:`activation_bytes`, what is neither kept on the device
        nor in host memory: backward rebuilds it (modelled)."""
        return max(0, self.activation_bytes - self.kept_bytes - self.offloaded_bytes)


class PeakPlan(RegionPlan):
    """What forward keeps and how backward rebuilds under a peak budget.

    Made by :func:`torch_sac.policies.plan_peak`; run it with
    ``with torch_sac.sac_context(plan):`` (or ``torch_sac.checkpoint(fn, x,
    policy=plan)``), which applies both its forward policy and its replay
    budget.

    Attributes:
        peak_bytes: the budget asked for.
        measured_peak: the forward+backward peak the plan ran at when planned
            (bytes allocated above the level before the call: activations,
            rebuilt tensors, gradients, the outputs).
        no_checkpoint_peak: the same without checkpointing.
        replay_budget: the :class:`torch_sac.ReplayBudget` backward runs
            with (``None``: nothing is dropped).
        saved: ``[(op, call_index)]`` forward keeps (``None``: every call).
        schedule: the :class:`torch_sac.ReplaySchedule` of the planned run
            (what each rebuild kept and released).
        replayed_ops, replay_seconds: replays in the planned run
            (``recomputed_ops`` and ``recompute_seconds``, the former names,
            are deprecated aliases).
        forward_seconds: one forward without checkpointing, for scale.
        replays_by_op: ``{op: [replays of each call]}`` in the planned run.
        solver: ``"none needed"`` (fits without checkpointing),
            ``"block chain"`` (an option per block of the step, or segments
            of blocks, chosen by the chain solver on measured bytes and
            seconds: :attr:`blocks`), ``"optimal reversal"`` (one chain, whose first sweep covers every
            call backward replays, and every rebuild chose by the optimal
            reversal of a chain of equal steps), ``"reversal per rebuild"``
            (the same choices, but over several chains or sweeps) or
            ``"spaced heuristic"``.
        optimal: whether no schedule in this family recomputes fewer steps
            under ``replay_budget`` (true for ``"none needed"`` and
            ``"optimal reversal"``; the bound is in steps of the chain,
            proven by Revolve's recursion).
        blocks: for a ``"block chain"`` plan, what each block of the step
            keeps, in call order: ``"keep all"``, ``"matmuls"``,
            ``"knapsack N%"`` (the budget planner's choice at N % of the
            block's activations), ``"input"`` (checkpointed),
            ``"offload matmuls"`` (the matmuls' outputs in host memory),
            ``"offload all"``, ``"keep all + offload hidden"``,
            ``"matmuls + offload hidden"``, ``"offloaded input"`` (see
            docs/offload.md), or
            ``"segment start"`` / ``"in segment"`` (several blocks
            checkpointed as one, as ``checkpoint_sequential``); else None.
        offloaded: of :attr:`saved`, the calls kept in host memory
            (``PREFER_OFFLOAD``; :mod:`torch_sac.offload`), or None.
        kept_ops, kept_bytes: the op calls forward kept in the planning
            run (in host memory or on the device), and the bytes of their
            outputs; ``None`` for a plan saved before they were recorded.
        dropped_ops, dropped_bytes: the op calls forward dropped there
            (backward rebuilds what it needs of them), and their bytes.
        offloaded_bytes: the bytes kept in host memory there.
        block_rows: for a ``"block chain"`` plan, a :class:`BlockRow` per
            block (what it keeps, drops and offloads; what backward
            replays of it); else None.
        solve_seconds: time the region spent choosing what rebuilds keep.
        measure_seconds: the time of the measured runs that found the plan.
        planning_runs: how many times planning called ``fn`` (forward and
            backward each time): at most 10
            (``torch_sac.planners.peak_search.MAX_PLANNING_RUNS``). ``runs`` is the
            same number.

    Example:
        >>> def step():
        ...     return loss_fn(model(tokens))
        >>> plan = torch_sac.policies.plan_peak(step, peak_bytes=8 << 30)
        >>> print(plan.table())
        >>> with torch_sac.sac_context(plan):
        ...     loss = step()
        >>> loss.backward()
        >>> plan.save("plan.json")  # torch_sac.PeakPlan.load("plan.json")

    Caveats:
        * A plan is for the program and shapes it measured: run the same
          code in the region (here the loss too). Op calls it did not see
          are recomputed; the budget still bounds what backward holds, but
          the peak is only checked for what was measured.
        * One outermost region: nested in another region it raises; the
          drop-in contexts do not take it. ``apply_sac(model, plan)`` runs
          the model's forward as that region (for a step that starts by
          calling the model). Under ``torch.compile`` only its forward
          policy applies (a warning when it has a replay budget).
        * Planning calls ``fn`` (forward and backward) at most 10 times
          (:attr:`planning_runs`). After each call it puts back what the
          call changed: the buffers of the modules ``fn`` calls (BatchNorm
          running statistics, ``num_batches_tracked``), the ``.grad`` of
          their parameters and of the tensors ``fn`` is passed or refers to
          (a step that calls ``backward`` accumulates into them), and the
          RNG state (CPU, and the CUDA devices in use). So every run
          measures the same step, and planning leaves the model as it was.
          Other state ``fn`` changes (an optimizer step, a Python counter)
          changes with every run.
        * A peak below the least measured raises ``ValueError`` with that
          least peak: planning with ``peak_bytes`` at or above it returns a
          plan.
    """

    def __init__(
        self,
        *,
        peak_bytes: int,
        measured_peak: int,
        no_checkpoint_peak: int,
        replay_budget: ReplayBudget | None,
        saved: list[tuple[str, int]] | None,
        schedule: ReplaySchedule,
        replayed_ops: int,
        replay_seconds: float,
        forward_seconds: float,
        replays_by_op: dict[str, list[int]],
        solver: str,
        solve_seconds: float,
        measure_seconds: float,
        runs: int,
        blocks: list[str] | None = None,
        offloaded: list[tuple[str, int]] | None = None,
        kept_ops: int | None = None,
        kept_bytes: int | None = None,
        dropped_ops: int | None = None,
        dropped_bytes: int | None = None,
        offloaded_bytes: int | None = None,
        block_rows: list[BlockRow] | None = None,
    ) -> None:
        self.peak_bytes = peak_bytes
        self.measured_peak = measured_peak
        self.no_checkpoint_peak = no_checkpoint_peak
        self.replay_budget = replay_budget
        self.saved = saved
        self.schedule = schedule
        self.replayed_ops = replayed_ops
        self.replay_seconds = replay_seconds
        self.forward_seconds = forward_seconds
        self.replays_by_op = replays_by_op
        self.solver = solver
        self.solve_seconds = solve_seconds
        self.measure_seconds = measure_seconds
        self.planning_runs = runs
        self.blocks = None if blocks is None else list(blocks)
        self.offloaded = None if not offloaded else list(offloaded)
        self.kept_ops = kept_ops
        self.kept_bytes = kept_bytes
        self.dropped_ops = dropped_ops
        self.dropped_bytes = dropped_bytes
        self.offloaded_bytes = offloaded_bytes
        self.block_rows = None if block_rows is None else list(block_rows)

    @property
    def recomputed_ops(self) -> int:
        """Deprecated alias of :attr:`replayed_ops` (kept for one release)."""
        return self.replayed_ops

    @property
    def recompute_seconds(self) -> float:
        """Deprecated alias of :attr:`replay_seconds` (kept for one release)."""
        return self.replay_seconds

    @property
    def runs(self) -> int:
        """:attr:`planning_runs` (its name in the plan's JSON)."""
        return self.planning_runs

    @property
    def optimal(self) -> bool:
        return self.solver in ("none needed", "optimal reversal")

    def policy(self) -> _C.OpPolicy:
        """The forward policy: saves exactly :attr:`saved`, offloading
        :attr:`offloaded` of them (decided in C++)."""
        if self.saved is None:
            return _C.save_all()
        return ReplaySchedule([], self.saved).policy(self.offloaded or ())

    def summary(self) -> dict[str, Any]:
        """The plan in a few numbers (a dict)."""
        return {
            "peak_bytes": self.peak_bytes,
            "measured_peak": self.measured_peak,
            "no_checkpoint_peak": self.no_checkpoint_peak,
            "replay_budget": None if self.replay_budget is None else self.replay_budget.bytes,
            "saved_calls": None if self.saved is None else len(self.saved),
            "offloaded_calls": len(self.offloaded or ()),
            "replayed_ops": self.replayed_ops,
            "replay_seconds": self.replay_seconds,
            "forward_seconds": self.forward_seconds,
            "solver": self.solver,
            "optimal": self.optimal,
            "solve_seconds": self.solve_seconds,
            "measure_seconds": self.measure_seconds,
            "runs": self.planning_runs,
            "blocks": None if self.blocks is None else list(self.blocks),
            "kept_ops": self.kept_ops,
            "kept_bytes": self.kept_bytes,
            "dropped_ops": self.dropped_ops,
            "dropped_bytes": self.dropped_bytes,
            "offloaded_bytes": self.offloaded_bytes,
        }

    def headline(self) -> str:
        """What the plan keeps, drops, offloads and replays, in one line
        (the first lines of :meth:`table`; the CLI's summary)."""
        if self.dropped_ops is None:  # a plan saved before format 5
            kept = (
                "forward keeps every op call"
                if self.saved is None
                else f"forward keeps {len(self.saved)} op calls"
            )
        elif not self.dropped_ops and not self.offloaded_bytes:
            kept = f"forward keeps all {self.kept_ops} op calls: nothing dropped"
        else:
            kept = (
                f"forward keeps {self.kept_ops} of {self.kept_ops + self.dropped_ops} op calls "
                f"({format_bytes(self.kept_bytes)})"
            )
            kept += (
                f", drops {self.dropped_ops} ({format_bytes(self.dropped_bytes)})"
                if self.dropped_ops
                else ", drops none"
            )
            if self.offloaded_bytes:
                kept += (
                    f", {len(self.offloaded or ())} of them offloaded to host memory "
                    f"({format_bytes(self.offloaded_bytes)})"
                )
        return f"{kept}; backward replays {self.replayed_ops} op calls"

    def table(self, max_rows: int = 20) -> str:
        """The plan as text: the measured peak against the target; what
        forward keeps, drops and offloads and what backward replays (in
        the planning run); for a plan over blocks, each block's part; then
        per op how many calls forward keeps and how often backward replays
        them."""
        ratio = (self.replay_seconds / self.forward_seconds) if self.forward_seconds else 0.0
        fits = "under" if self.measured_peak <= self.peak_bytes else "OVER"
        lines = [
            f"peak plan: measured peak {format_bytes(self.measured_peak)} {fits} the target "
            f"{format_bytes(self.peak_bytes)} (no checkpointing: "
            f"{format_bytes(self.no_checkpoint_peak)})",
            f"  {self.headline()}, {self.replay_seconds * 1e3:.2f} ms ({ratio:.2f}x one forward)",
        ]
        if self.replay_budget:
            lines.append(
                f"  backward holds at most {format_bytes(self.replay_budget.bytes)} of kept and "
                f"rebuilt tensors (checkpoint share {self.replay_budget.checkpoint_share:g})"
            )
        lines.append(
            f"  solver: {self.solver}{' (optimal)' if self.optimal else ''}; choices took "
            f"{self.solve_seconds * 1e3:.2f} ms; {self.planning_runs} planning runs, "
            f"{self.measure_seconds:.2f} s"
        )
        if self.blocks is not None:
            lines.append(f"  blocks: {block_runs(self.blocks)}")
        if self.block_rows:
            lines += _block_table(self.block_rows)
            outside = self.replayed_ops - sum(r.replayed_ops for r in self.block_rows)
            if outside:
                lines.append(f"  outside the blocks: {outside} op replays")
        saved_by_op = {}
        for op, _ in self.saved or ():
            saved_by_op[op] = saved_by_op.get(op, 0) + 1
        rows = []
        for op, replays in self.replays_by_op.items():
            rows.append(
                (op, saved_by_op.get(op, 0), len(replays), sum(replays), max(replays, default=0))
            )
        rows.sort(key=lambda r: (-r[3], r[0]))
        if rows:
            lines.append(f"  {'op':<40} {'calls':>6} {'kept':>6} {'replays':>8} {'most/call':>10}")
            for op, kept, calls, replays, most in rows[:max_rows]:
                lines.append(f"  {op:<40} {calls:>6} {kept:>6} {replays:>8} {most:>10}")
            if len(rows) > max_rows:
                rest = rows[max_rows:]
                lines.append(f"  ... {len(rest)} more ops, {sum(r[3] for r in rest)} replays")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            **{
                k: v
                for k, v in self.summary().items()
                if k not in ("saved_calls", "offloaded_calls", "optimal")
            },
            "offloaded": None if self.offloaded is None else [list(c) for c in self.offloaded],
            "block_rows": None
            if self.block_rows is None
            else [dataclasses.asdict(r) for r in self.block_rows],
            "replay_budget": None if self.replay_budget is None else list(self.replay_budget),
            "saved": None if self.saved is None else [list(c) for c in self.saved],
            "schedule": self.schedule.to_dict(),
            "replays_by_op": self.replays_by_op,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeakPlan:
        if isinstance(data, dict) and data.get("format") in _OLD_FORMATS:
            renamed = _OLD_FORMATS[data["format"]]
            data = {renamed.get(k, k): v for k, v in data.items()}
            data["format"] = FORMAT
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"torch_sac.PeakPlan.from_dict: not a {FORMAT} dict (format {found!r})"
            )
        names = (
            "peak_bytes",
            "measured_peak",
            "no_checkpoint_peak",
            "replayed_ops",
            "replay_seconds",
            "forward_seconds",
            "replays_by_op",
            "solver",
            "solve_seconds",
            "measure_seconds",
            "runs",
            "replay_budget",
            "saved",
            "schedule",
        )
        missing = [k for k in names if k not in data]
        if missing:
            raise ValueError(f"torch_sac.PeakPlan.from_dict: the {FORMAT} dict lacks {missing}")
        budget, saved = data["replay_budget"], data["saved"]
        if budget is not None and not isinstance(budget, (list, tuple)):
            raise ValueError(
                "torch_sac.PeakPlan.from_dict: replay_budget must be null or "
                f"[bytes, counts_saved, checkpoint_share], got {budget!r}"
            )
        if saved is not None and not isinstance(saved, (list, tuple)):
            raise ValueError(
                f"torch_sac.PeakPlan.from_dict: saved must be null or a list of [op, call_index], "
                f"got {saved!r}"
            )
        blocks = data.get("blocks")
        if blocks is not None and (
            not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks)
        ):
            raise ValueError(
                f"torch_sac.PeakPlan.from_dict: blocks must be null or a list of option names, "
                f"got {blocks!r}"
            )
        offloaded = data.get("offloaded")
        if offloaded is not None and not isinstance(offloaded, (list, tuple)):
            raise ValueError(
                "torch_sac.PeakPlan.from_dict: offloaded must be null or a list of "
                f"[op, call_index], got {offloaded!r}"
            )
        measured = {}
        for k in ("kept_ops", "kept_bytes", "dropped_ops", "dropped_bytes", "offloaded_bytes"):
            value = data.get(k)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(
                    f"torch_sac.PeakPlan.from_dict: {k} must be null or an int, got {value!r}"
                )
            measured[k] = value
        block_rows = data.get("block_rows")
        if block_rows is not None:
            fields = {f.name for f in dataclasses.fields(BlockRow)}
            if not isinstance(block_rows, list) or not all(
                isinstance(r, dict) and set(r) == fields for r in block_rows
            ):
                raise ValueError(
                    "torch_sac.PeakPlan.from_dict: block_rows must be null or a list of dicts "
                    f"with the keys {sorted(fields)}"
                )
            block_rows = [BlockRow(**r) for r in block_rows]
        return cls(
            **{k: data[k] for k in names[:11]},
            **measured,
            block_rows=block_rows,
            blocks=blocks,
            offloaded=None if offloaded is None else [as_call(c) for c in offloaded],
            replay_budget=None if budget is None else ReplayBudget(*budget),
            saved=None if saved is None else [as_call(c) for c in saved],
            schedule=ReplaySchedule.from_dict(data["schedule"]),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes :meth:`to_dict` as JSON (:meth:`load` reads it, and the
        formats before it)."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PeakPlan:
        return cls.from_dict(read_json(path))

    def __repr__(self) -> str:
        return (
            f"<torch_sac.PeakPlan: peak {format_bytes(self.measured_peak)} <= "
            f"{format_bytes(self.peak_bytes)}, {self.replayed_ops} op replays, {self.solver}>"
        )


def _block_table(rows):
    """The per-block lines of :meth:`PeakPlan.table`."""
    width = max(len("module"), *(len(r.module) for r in rows))
    option = max(len("keeps"), *(len(r.option) for r in rows))
    lines = [
        "  per block (bytes modelled from the profile, replays measured):",
        f"  {'block':>5} {'module':<{width}} {'keeps':<{option}} {'calls kept':>11} "
        f"{'activations':>11} {'kept':>10} {'dropped':>10} {'host':>10} {'replays':>8}",
    ]
    for r in rows:
        lines.append(
            f"  {r.block:>5} {r.module:<{width}} {r.option:<{option}} "
            f"{f'{r.kept_calls}/{r.calls}':>11} {format_bytes(r.activation_bytes):>11} "
            f"{format_bytes(r.kept_bytes):>10} {format_bytes(r.dropped_bytes):>10} "
            f"{format_bytes(r.offloaded_bytes):>10} {r.replayed_ops:>8}"
        )
    return lines


def block_runs(blocks):
    """Per-block options as runs: ``0-3 input, 4 matmuls, 5-7 segment``."""
    parts, start, n = [], 0, len(blocks)
    while start < n:
        name = blocks[start]
        end = start + 1
        if name == "segment start":
            while end < n and blocks[end] == "in segment":
                end += 1
            name = "segment"
        else:
            while end < n and blocks[end] == blocks[start]:
                end += 1
        where = f"{start}" if end - 1 == start else f"{start}-{end - 1}"
        parts.append(f"{where} {name}")
        start = end
    return ", ".join(parts)
