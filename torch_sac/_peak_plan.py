"""Plans for a peak: what forward keeps and what backward rebuilds, so that one
region's measured forward+backward peak stays under a budget with as little
recompute as possible (multiple recomputation).

The plans: a region whose backward runs under ``ReplayBudget(B,
counts_saved=True)`` and whose forward keeps what the *first* rebuild of a
recompute-everything region would keep under the same budget. Reversing a
chain with ``s`` slots, the optimal schedule (Revolve's recursion) starts
with a sweep from the input to the end that leaves checkpoints on the way;
here forward is that sweep, so it costs no recompute, and each later rebuild
continues the recursion with the room the checkpoints behind it leave. For a
chain of equal steps the recompute is then the optimum for ``B`` exactly
(tests/python/test_peak_plan.py checks it against an independent DP and an
exact MILP); for other graphs the region's per-rebuild choice is a heuristic
(replay_budget.h) whose gap the tests measure.

``B`` is found by measurement, not by a memory model: each candidate runs
once with the counting allocator, and the largest ``B`` whose measured peak
fits is kept. What the budget cannot control (parameters' gradients, the
working set of one replay, the outputs) is in every measured peak, so it is
accounted for without being modelled.
"""

import numbers
import time

import torch
from torch.utils._pytree import tree_leaves

from . import _C, memory
from ._op_profile import cuda_devices, format_bytes
from .region import ReplayBudget, in_region, sac_context
from .schedule import ReplaySchedule, _call, read_json, write_json

__all__ = ["PeakPlan", "plan_for_peak"]

FORMAT = "torch_sac.peak_plan/1"

# Candidate budgets measured at most (each is two runs of fn: the
# recompute-everything run that shows the first sweep, and the plan's run).
_MAX_CANDIDATES = 8
# Checkpoint shares of the spaced heuristic tried at the budget found, after
# the default 1/2 (replay_budget.h): fewer checkpoints, more of what
# backward needs next (measured on bench_recompute's TinyGPT chain: 1/8 to
# 1/32 recompute less at checkpoint_sequential's peak, 1/2 at half of it).
_OTHER_SHARES = (1 / 8, 1 / 32)
# Further first sweeps (of independent chains) forward may keep.
_MAX_EXTRA_SWEEPS = 4


class PeakPlan:
    """What forward keeps and how backward rebuilds under a peak budget.

    Made by :func:`torch_sac.policies.budget` with ``peak_bytes``; run it with
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
        recomputed_ops, recompute_seconds: replays in the planned run.
        forward_seconds: one forward without checkpointing, for scale.
        replays_by_op: ``{op: [replays of each call]}`` in the planned run.
        solver: ``"none needed"`` (fits without checkpointing),
            ``"optimal reversal"`` (one chain, whose first sweep covers every
            call backward replays, and every rebuild chose by the optimal
            reversal of a chain of equal steps), ``"reversal per rebuild"``
            (the same choices, but over several chains or sweeps) or
            ``"spaced heuristic"``.
        optimal: whether no schedule in this family recomputes fewer steps
            under ``replay_budget`` (true for the first two solvers; the
            bound is in steps of the chain, proven by Revolve's recursion).
        solve_seconds: time the region spent choosing what rebuilds keep.
        measure_seconds, runs: the measured runs that found the budget.

    Example:
        >>> def step():
        ...     return loss_fn(model(tokens))
        >>> plan = torch_sac.policies.budget(step, peak_bytes=8 << 30)
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
          drop-in contexts and ``apply_sac`` do not take it. Under
          ``torch.compile`` only its forward policy applies (a warning).
        * Planning runs ``fn`` forward and backward 11-30 times (BatchNorm
          running statistics move each time; the RNG state is restored).
    """

    def __init__(self, *, peak_bytes, measured_peak, no_checkpoint_peak, replay_budget, saved,
                 schedule, recomputed_ops, recompute_seconds, forward_seconds, replays_by_op,
                 solver, solve_seconds, measure_seconds, runs):
        self.peak_bytes = peak_bytes
        self.measured_peak = measured_peak
        self.no_checkpoint_peak = no_checkpoint_peak
        self.replay_budget = replay_budget
        self.saved = saved
        self.schedule = schedule
        self.recomputed_ops = recomputed_ops
        self.recompute_seconds = recompute_seconds
        self.forward_seconds = forward_seconds
        self.replays_by_op = replays_by_op
        self.solver = solver
        self.solve_seconds = solve_seconds
        self.measure_seconds = measure_seconds
        self.runs = runs

    @property
    def optimal(self):
        return self.solver in ("none needed", "optimal reversal")

    def policy(self):
        """The forward policy: saves exactly :attr:`saved` (decided in C++)."""
        if self.saved is None:
            return _C.save_all()
        return ReplaySchedule([], self.saved).policy()

    def summary(self):
        """The plan in a few numbers (a dict)."""
        return {
            "peak_bytes": self.peak_bytes,
            "measured_peak": self.measured_peak,
            "no_checkpoint_peak": self.no_checkpoint_peak,
            "replay_budget": None if self.replay_budget is None else self.replay_budget.bytes,
            "saved_calls": None if self.saved is None else len(self.saved),
            "recomputed_ops": self.recomputed_ops,
            "recompute_seconds": self.recompute_seconds,
            "forward_seconds": self.forward_seconds,
            "solver": self.solver,
            "optimal": self.optimal,
            "solve_seconds": self.solve_seconds,
            "measure_seconds": self.measure_seconds,
            "runs": self.runs,
        }

    def table(self, max_rows=20):
        """The plan as text: the peak against the budget, then per op how
        many calls forward keeps and how often backward recomputes them."""
        saved_by_op = {}
        for op, _ in self.saved or ():
            saved_by_op[op] = saved_by_op.get(op, 0) + 1
        ratio = (self.recompute_seconds / self.forward_seconds) if self.forward_seconds else 0.0
        lines = [
            f"peak plan: measured peak {format_bytes(self.measured_peak)} under "
            f"{format_bytes(self.peak_bytes)} (no checkpointing: "
            f"{format_bytes(self.no_checkpoint_peak)})",
            f"  backward holds at most {format_bytes(self.replay_budget.bytes)} of kept and "
            f"rebuilt tensors (checkpoint share {self.replay_budget.checkpoint_share:g})"
            if self.replay_budget else "  nothing dropped",
            f"  recompute: {self.recomputed_ops} op replays, {self.recompute_seconds * 1e3:.2f} ms "
            f"({ratio:.2f}x one forward)",
            f"  solver: {self.solver}{' (optimal)' if self.optimal else ''}; choices took "
            f"{self.solve_seconds * 1e3:.2f} ms; {self.runs} measured runs, "
            f"{self.measure_seconds:.2f} s",
        ]
        rows = []
        for op, replays in self.replays_by_op.items():
            rows.append((op, saved_by_op.get(op, 0), len(replays), sum(replays), max(replays, default=0)))
        rows.sort(key=lambda r: (-r[3], r[0]))
        if rows:
            lines.append(f"  {'op':<40} {'calls':>6} {'kept':>6} {'replays':>8} {'most/call':>10}")
            for op, kept, calls, replays, most in rows[:max_rows]:
                lines.append(f"  {op:<40} {calls:>6} {kept:>6} {replays:>8} {most:>10}")
            if len(rows) > max_rows:
                rest = rows[max_rows:]
                lines.append(f"  ... {len(rest)} more ops, {sum(r[3] for r in rest)} replays")
        return "\n".join(lines)

    def to_dict(self):
        return {
            "format": FORMAT,
            **{k: v for k, v in self.summary().items() if k not in ("saved_calls", "optimal")},
            "replay_budget": None if self.replay_budget is None else list(self.replay_budget),
            "saved": None if self.saved is None else [list(c) for c in self.saved],
            "schedule": self.schedule.to_dict(),
            "replays_by_op": self.replays_by_op,
        }

    @classmethod
    def from_dict(cls, data):
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"torch_sac.PeakPlan.from_dict: not a {FORMAT} dict (format {found!r})")
        names = ("peak_bytes", "measured_peak", "no_checkpoint_peak", "recomputed_ops",
                 "recompute_seconds", "forward_seconds", "replays_by_op", "solver",
                 "solve_seconds", "measure_seconds", "runs", "replay_budget", "saved", "schedule")
        missing = [k for k in names if k not in data]
        if missing:
            raise ValueError(f"torch_sac.PeakPlan.from_dict: the {FORMAT} dict lacks {missing}")
        budget, saved = data["replay_budget"], data["saved"]
        if budget is not None and not isinstance(budget, (list, tuple)):
            raise ValueError(
                "torch_sac.PeakPlan.from_dict: replay_budget must be null or "
                f"[bytes, counts_saved, checkpoint_share], got {budget!r}")
        if saved is not None and not isinstance(saved, (list, tuple)):
            raise ValueError(
                f"torch_sac.PeakPlan.from_dict: saved must be null or a list of [op, call_index], "
                f"got {saved!r}")
        return cls(**{k: data[k] for k in names[:11]},
                   replay_budget=None if budget is None else ReplayBudget(*budget),
                   saved=None if saved is None else [_call(c) for c in saved],
                   schedule=ReplaySchedule.from_dict(data["schedule"]))

    def save(self, path):
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path):
        return cls.from_dict(read_json(path))

    def __repr__(self):
        return (f"<torch_sac.PeakPlan: peak {format_bytes(self.measured_peak)} <= "
                f"{format_bytes(self.peak_bytes)}, {self.recomputed_ops} op replays, {self.solver}>")


class _Run:
    """One measured forward+backward of fn."""

    def __init__(self, peak, seconds, forward_seconds, output_device, stats=None, schedule=None,
                 details=()):
        self.peak = peak
        self.seconds = seconds
        self.forward_seconds = forward_seconds
        self.output_device = output_device
        self.stats = stats or {}
        self.schedule = schedule
        self.details = details

    @property
    def replayed(self):
        return self.stats.get("replayed_ops", 0)


def _graph_leaves(outputs):
    """The tensors gradients accumulate into, found from the outputs' graph:
    backward computes theirs with ``autograd.grad``, so planning leaves no
    ``.grad`` behind."""
    leaves, seen, stack = {}, set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _device_of(values):
    """The device of the first tensor in ``values`` (a pytree), or None."""
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor):
            return t.device
    return None


def _measure(fn, args, kwargs, where, device, policy=None, replay_budget=None):
    """One forward+backward of fn, its peak measured on ``device``."""
    rng_devices = sorted(set(cuda_devices((args, kwargs)))
                         | ({device.index or 0} if device.type == "cuda" else set()))
    region = None
    with torch.random.fork_rng(devices=rng_devices), torch.enable_grad(), \
            memory.track(device) as m:
        start = time.perf_counter()
        if policy is None:
            out = fn(*args, **kwargs)
        else:
            with sac_context(policy, replay_budget=replay_budget) as region:
                out = fn(*args, **kwargs)
        forward_seconds = time.perf_counter() - start
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        output_device = _device_of(outputs)
        if not outputs:
            raise ValueError(
                f"torch_sac.{where}: fn's outputs do not require grad, so there is no backward "
                "to plan; call it with inputs or parameters that require grad")
        del out
        if all(o.grad_fn is None for o in outputs):
            raise ValueError(
                f"torch_sac.{where}: fn returns only leaf tensors (no op ran on them), so there "
                "is no backward to plan")
        leaves = _graph_leaves(outputs)
        torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs],
                            allow_unused=True)
        del outputs
        seconds = time.perf_counter() - start
    if region is None:
        return _Run(m.peak, seconds, forward_seconds, output_device)
    return _Run(m.peak, seconds, forward_seconds, output_device, region.stats(),
                region.replay_schedule(), region.op_details())


def _first_sweep(schedule):
    """The calls whose outputs the first rebuild kept, and the one it was for."""
    if not schedule.rebuilds:
        return []
    first = schedule.rebuilds[0]
    return sorted({(k.op, k.call_index) for k in (first.unpacked, *first.keep)})


class _Candidate:
    """A measured plan: its run, the calls forward keeps, its budget, and
    the recompute-everything run whose first sweep it keeps."""

    def __init__(self, run, saved, budget, sweep):
        self.run, self.saved, self.budget, self.sweep = run, saved, budget, sweep


class _Planner:
    """The search behind :func:`plan_for_peak`; every run it makes is kept
    (for the plan's run count and time)."""

    def __init__(self, fn, args, kwargs, peak_bytes, where):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.peak_bytes, self.where = peak_bytes, where
        self.resolution = max(peak_bytes // 128, 1)
        self.measured = []
        # The arguments' device; a closure over a model on another device
        # shows its device in its outputs (plain_run measures again there).
        self.device = _device_of((args, kwargs)) or torch.device("cpu")

    def run(self, policy=None, budget=None):
        r = _measure(self.fn, self.args, self.kwargs, self.where, self.device, policy, budget)
        self.measured.append(r)
        return r

    def plain_run(self):
        """fn without checkpointing, measured on the device it runs on."""
        plain = self.run()
        if plain.output_device is not None and plain.output_device != self.device:
            self.device = plain.output_device
            plain = self.run()
        self.plain = plain
        return plain

    def fits(self, run):
        return run.peak <= self.peak_bytes

    def at_budget(self, budget):
        """The first sweep of a recompute-everything run under ``budget``,
        and the plan keeping it: (sweep run, plan run, kept calls)."""
        from .policies import recompute_all  # policies imports this module

        sweep = self.run(recompute_all(), budget)
        saved = _first_sweep(sweep.schedule)
        return sweep, self.run(ReplaySchedule([], saved).policy(), budget), saved

    def search_budget(self):
        """The best fitting candidate over budgets: the largest budget whose
        plan fits. The peak moves by about as much as the budget does (in
        steps of the tensors kept), so step by the gap until the budget is
        bracketed, then bisect. None if no budget tried fits."""
        best = None
        fits_at, fails_at = None, None
        budget = self.peak_bytes // 2
        for _ in range(_MAX_CANDIDATES):
            sweep, planned, saved = self.at_budget(ReplayBudget(budget, counts_saved=True))
            for run, kept in ((planned, saved), (sweep, [])):
                if self.fits(run) and (best is None or _better(run, best.run)):
                    best = _Candidate(run, kept, ReplayBudget(budget, counts_saved=True), sweep)
            if self.fits(planned):
                fits_at = budget if fits_at is None else max(fits_at, budget)
            else:
                fails_at = budget if fails_at is None else min(fails_at, budget)
            if fits_at is not None and fails_at is not None:
                if fails_at - fits_at <= self.resolution:
                    break
                budget = (fits_at + fails_at) // 2
            else:
                gap = self.peak_bytes - planned.peak
                if fits_at is not None and gap <= self.resolution:
                    break
                # The peak is flat until the budget holds one more tensor:
                # step by at least an eighth of the budget.
                step = max(abs(gap), budget // 8, self.resolution)
                budget = max(budget + (step if gap > 0 else -step), 0)
                if fails_at == 0:
                    break
        return best

    def try_shares(self, best):
        """The spaced heuristic's split between checkpoints and what
        backward needs next suits some programs and not others (a
        transformer at a loose budget wants fewer checkpoints, a tight one
        more): other shares at the same budget, one step down if one peaks
        over."""
        for share in _OTHER_SHARES:
            tried = best.budget.bytes
            for _ in range(2):
                budget = ReplayBudget(tried, counts_saved=True, checkpoint_share=share)
                sweep, planned, saved = self.at_budget(budget)
                if self.fits(planned):
                    if _better(planned, best.run):
                        best = _Candidate(planned, saved, budget, sweep)
                    break
                tried = max(tried - (planned.peak - self.peak_bytes) - self.resolution, 0)
        return best

    def extend_sweeps(self, best):
        """The first sweep covers the first chain backward rebuilds; with
        several (independent branches) the plan's own first rebuild is the
        next one's sweep: keep it in forward too while that fits and helps."""
        for _ in range(_MAX_EXTRA_SWEEPS):
            union = sorted(set(best.saved) | set(_first_sweep(best.run.schedule)))
            if len(union) == len(best.saved):
                break
            planned = self.run(ReplaySchedule([], union).policy(), best.budget)
            if not (self.fits(planned) and _better(planned, best.run)):
                break
            best = _Candidate(planned, union, best.budget, best.sweep)
        return best

    def floor(self):
        """Recompute everything, hold only the tensor handed over: the least
        peak of the family, or a clear error if even that does not fit."""
        from .policies import recompute_all

        budget = ReplayBudget(0, counts_saved=True)
        floor = self.run(recompute_all(), budget)
        if not self.fits(floor):
            raise ValueError(
                f"torch_sac.{self.where}: peak_bytes={self.peak_bytes} "
                f"({format_bytes(self.peak_bytes)}) is below the least peak a region reaches "
                f"here: {floor.peak} bytes ({format_bytes(floor.peak)}) recomputing everything "
                "and holding only the tensor handed over (without checkpointing: "
                f"{format_bytes(self.plain.peak)}). Raise peak_bytes, or shrink what the "
                "budget cannot control (batch size, gradients, the outputs).")
        return _Candidate(floor, [], budget, floor)


def plan_for_peak(fn, args, kwargs, peak_bytes, where):
    """Finds a :class:`PeakPlan` for ``fn(*args, **kwargs)`` under ``peak_bytes``."""
    if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, numbers.Integral) or peak_bytes <= 0:
        raise ValueError(f"torch_sac.{where}: peak_bytes must be an int > 0, got {peak_bytes!r}")
    if in_region():
        raise RuntimeError(
            f"torch_sac.{where}: peak_bytes plans measure fn as an outermost region, but a "
            "sac_context is open on this thread: plan outside it")
    planner = _Planner(fn, args, kwargs, int(peak_bytes), where)
    plain = planner.plain_run()
    if planner.fits(plain):
        # As the plan runs: in a region saving everything (regions inside
        # fn merge into it, and their replays count).
        kept = planner.run(_C.save_all())
        if planner.fits(kept):
            return _plan(planner, plain, _Candidate(kept, None, None, None), "none needed")
    best = planner.search_budget() or planner.floor()
    if best.budget.bytes > 0 and best.run.stats.get("spaced_choices", 0):
        best = planner.try_shares(best)
    if best.budget.bytes > 0 and not _first_sweep_covers(best.sweep):
        best = planner.extend_sweeps(best)
    return _plan(planner, plain, best, _solver(best.run, best.sweep))


def _solver(planned, sweep):
    """Which choice made the plan: the optimal reversal is proven optimal
    only when the first sweep covered every call backward replays (one
    chain); separate chains each reversed optimally are not (the budget is
    not split between them optimally)."""
    if planned.stats.get("spaced_choices", 0):
        return "spaced heuristic"
    return "optimal reversal" if _first_sweep_covers(sweep) else "reversal per rebuild"


def _first_sweep_covers(sweep):
    """Whether the first rebuild of ``sweep`` replayed every call backward
    replayed at all: the tape is one chain, and the forward keeping that
    sweep is the whole first sweep of its reversal."""
    replayed_calls = sum(1 for row in sweep.details for r in row.get("replays_by_call", ()) if r)
    return sweep.stats.get("first_rebuild_replayed_ops", 0) >= replayed_calls


def _better(a, b):
    """Less estimated replay cost (FLOPs, bytes, per-op overhead: the
    region's, deterministic), then fewer replays, is better."""
    return (a.stats.get("replayed_cost", 0), a.replayed) < (b.stats.get("replayed_cost", 0), b.replayed)


def _plan(planner, plain, best, solver):
    run = best.run
    replays = {row["op"]: list(row.get("replays_by_call", ())) for row in run.details}
    return PeakPlan(
        peak_bytes=planner.peak_bytes, measured_peak=run.peak, no_checkpoint_peak=plain.peak,
        replay_budget=best.budget, saved=best.saved,
        schedule=run.schedule if run.schedule is not None else ReplaySchedule([]),
        recomputed_ops=run.replayed, recompute_seconds=run.stats.get("replay_ns", 0) / 1e9,
        forward_seconds=plain.forward_seconds,
        replays_by_op={op: r for op, r in replays.items() if any(r)},
        solver=solver, solve_seconds=run.stats.get("budget_choice_ns", 0) / 1e9,
        measure_seconds=sum(r.seconds for r in planner.measured), runs=len(planner.measured))
