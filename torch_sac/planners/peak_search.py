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

The peak is not monotone in ``B``, and recomputing everything under
``B = 0`` is not the least peak: its first rebuild replays the whole forward
from the inputs, so that replay's working set (the intermediates a long
replay holds at once) comes on top of what backward holds. Keeping the
checkpoints of a small budget's first sweep shortens every replay, and
backward under a zero budget then holds nothing more (the kept checkpoints
are counted, so no rebuilt tensor is kept): on a small Hugging Face Mamba
1,661,456 bytes, against 1,887,000 recomputing everything
(tests/python/test_peak_plan_bounds.py). So no floor is assumed: a refusal
states the least peak measured, and planning for that peak returns the
plan that measured it (until a plan fits, the search does not depend on
the peak asked).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import numbers
import time

import torch
from torch.utils._pytree import tree_leaves

from .. import _C, memory, offload
from .._op_profile import cuda_devices, format_bytes, profile_region
from ..region import ReplayBudget, in_region, sac_context
from ..schedule import ReplaySchedule
from .block_options import (
    NotAChain,
    OffloadModel,
    StepBlocks,
    chain_spans,
    find_step_blocks,
    qualified_names,
)
from .chain import kept_bytes, model_peak, offloaded_bytes, solve_chain
from .peak_plan import PeakPlan
from .ranks import agree_profile, agree_run, least, rank0s
from .region_numbering import region_call_names, renumber
from .step_state import StepState

__all__ = ["plan_for_peak"]

# Calls of fn a plan takes at most, all included (the run without
# checkpointing, the budget search, the other checkpoint share, further
# sweeps): each runs forward and backward. A budget costs two (the
# recompute-everything run that shows the first sweep, and the plan's run),
# so this is the run without checkpointing and four budgets, plus one run
# for a further sweep. (Measured on the tests' tanh chains, TinyGPT steps
# and a small Mamba at 0.2-0.9 of their peak: the old unbounded search took
# 5-27 runs; these plans' estimated replay cost is 1.05x the old ones' on
# average, 1.7x at worst, and they reach every peak the old ones did.)
MAX_PLANNING_RUNS = 10
# The first budget tried, as a share of the peak without checkpointing;
# budgets halve from there until one fits.
_FIRST_BUDGET = 1 / 4
# The search stops once the largest budget that fits and the least that
# does not are this close (a share of peak_bytes).
_RESOLUTION = 1 / 32
# The checkpoint share of the spaced heuristic tried at the budget found,
# after the default 1/2 (replay_budget.h): fewer checkpoints, more of what
# backward needs next (on TinyGPT steps it recomputes up to 1.7x less from
# about 0.4 of the peak up; 1/2 is better below; 1/32, tried too before,
# was at most 4% better).
_OTHER_SHARE = 1 / 8
# Room kept for the other share while the search refines: two runs.
_SHARE_RUNS = 2
# Runs of plans the chain solver chose (chain_for): the first, and the same
# solver aimed by the error the previous one measured (over or under).
_CHAIN_RUNS = 3
# chain_for stops once a plan fits this close under the peak (a share of
# it); a plan further under aims the next one higher. Finer than the op-chain
# search's resolution: the chain model is within 1-2 % on the benches'
# models, so a tenth of a block's activations still buys replay time.
_CHAIN_RESOLUTION = 1 / 64
# The model's error measured on one plan aims the next this much (a share
# of the peak) lower still: the error differs a little from plan to plan.
_CHAIN_MARGIN = 1 / 256
# The per-block checkpointing run is tried when the chain solver finds no
# plan but its modelled peak is within this share of peak_bytes over it
# (the model's error on the tests' models and the bench's: under 5 %).
_CHAIN_SLACK = 0.1
# How much slower a segment of several blocks replays than its blocks'
# forward, per doubling of its length (chain.py's segment_seconds), by the
# device the step runs on: measured on the CPU (bench/bench_segments.py:
# 0.17-0.28 fitted on three models in two runs, 0.22 on average; segments
# of 2, 4 and 8 blocks cost 1.09-1.28x, 1.37-1.58x and 1.52-1.80x per-block
# checkpointing's replay of the same calls); not measured on a GPU yet, so
# none assumed there (bench/bench_segments.py --device cuda measures it).
_SEGMENT_SLOWDOWN = {"cpu": 0.22}
# What the search measures until a plan fits (search): budgets, halving,
# then the least plans keeping the two sweeps that peaked least
# (least_plan). Nine runs at most with the two before (the run without
# checkpointing, the one saving everything), so the same list is measured
# whatever the peak asked.
_BEFORE_A_FIT = ("budget", "budget", "budget", "least", "least")


class _Run:
    """One measured forward+backward of fn."""

    def __init__(
        self, peak, seconds, forward_seconds, output_device, stats=None, schedule=None, details=()
    ):
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
    """The tensors gradients accumulate into, found from the outputs' graph
    (for :class:`StepState` to put their ``.grad`` back)."""
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


@contextlib.contextmanager
def _gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _measure(fn, args, kwargs, where, device, policy=None, replay_budget=None, state=None):
    """One forward+backward of fn, its peak measured on ``device``; the RNG
    state of the CPU and of the CUDA devices in use is restored after it.
    When ``state.ran_backward()`` says fn ran its own backward (a gradient
    it tracks was made), that backward is the run's."""
    rng_devices = set(cuda_devices((args, kwargs)))
    if device.type == "cuda":
        rng_devices.add(device.index or 0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng_devices.update(range(torch.cuda.device_count()))
    rng_devices = sorted(rng_devices)
    region = None
    # No garbage collection during the run: a collection in the middle frees
    # tensors counted in the starting level and lowers the measured peak, so
    # two runs of the same plan would measure different peaks and a least peak
    # stated by one could miss in the next. (No full collection before it
    # either: with a large heap that costs more than a small step.)
    with (
        _gc_paused(),
        torch.random.fork_rng(devices=rng_devices),
        torch.enable_grad(),
        memory.track(device) as m,
    ):
        _synchronize(device)
        start = time.perf_counter()
        if policy is None:
            out = fn(*args, **kwargs)
        else:
            with sac_context(policy, replay_budget=replay_budget) as region:
                out = fn(*args, **kwargs)
        _synchronize(device)
        forward_seconds = time.perf_counter() - start
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        output_device = _device_of(outputs)
        if state is not None and state.ran_backward():
            outputs = []  # fn's own backward ran: nothing more to run
            output_device = output_device or _device_of(out)
        elif not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            raise ValueError(
                f"torch_sac.{where}: fn returned no tensor (got {type(out).__name__}) and ran no "
                "backward: return the loss (planning runs backward from it), or call backward "
                "in fn"
            )
        elif not outputs:
            raise ValueError(
                f"torch_sac.{where}: fn's outputs do not require grad, so there is no backward "
                "to plan; call it with inputs or parameters that require grad"
            )
        del out
        if outputs and all(o.grad_fn is None for o in outputs):
            raise ValueError(
                f"torch_sac.{where}: fn returns only leaf tensors (no op ran on them), so there "
                "is no backward to plan"
            )
        if outputs:
            # Into .grad, as a training step's backward: what runs when a
            # gradient accumulates runs as in training (FSDP2 reduce-scatters
            # a block's gradients and frees the unsharded ones; under
            # autograd.grad it kept them, and plans under FSDP2 + TP measured
            # 1.1 MiB, 8%, under their peak in use). StepState puts .grad back.
            own = StepState() if state is None else state
            for leaf in _graph_leaves(outputs):
                own.add_tensor(leaf)
            try:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            finally:
                if state is None:
                    own.restore()
        del outputs
        _synchronize(device)
        seconds = time.perf_counter() - start
    if region is None:
        return _Run(m.peak, seconds, forward_seconds, output_device)
    return _Run(
        m.peak,
        seconds,
        forward_seconds,
        output_device,
        region.stats(),
        region.replay_schedule(),
        region.op_details(),
    )


def _synchronize(device):
    """Waits for ``device``'s queued work, so the host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_sweep(schedule):
    """The calls whose outputs the first rebuild kept, and the one it was for."""
    if not schedule.rebuilds:
        return []
    first = schedule.rebuilds[0]
    return sorted({(k.op, k.call_index) for k in (first.unpacked, *first.keep)})


class _Candidate:
    """A measured plan: its run, the calls forward keeps, its budget, and
    the recompute-everything run whose first sweep it keeps (under the same
    budget: ``optimal`` may hold, see :func:`_solver`); a plan of the chain
    solver has its ``blocks`` (the option of each block) instead."""

    def __init__(self, run, saved, budget, sweep, optimal=True, choices=None, offloaded=None):
        self.run, self.saved, self.budget, self.sweep = run, saved, budget, sweep
        self.optimal = optimal
        self.choices = choices  # a plan over blocks: its BlockChoice per block
        self.blocks = None if choices is None else [c.option for c in choices]
        self.offloaded = offloaded  # of ``saved``, the calls kept in host memory


class Planner:
    """The search behind :func:`plan_for_peak`. Every run it makes is kept
    (for the plan's run count and time), every plan it measured is a
    candidate, and it calls fn at most :data:`MAX_PLANNING_RUNS` times."""

    def __init__(self, fn, args, kwargs, peak_bytes, where, state, blocks="auto", offload=None):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.blocks = blocks
        self.offload = offload  # None: where the step runs on a GPU; True; False
        self.chain_note = None  # why the chain solver made no plan
        self.step = None  # the step's blocks (StepBlocks), once profiled
        self.max_runs = MAX_PLANNING_RUNS
        self.peak_bytes, self.where, self.state = peak_bytes, where, state
        self.resolution = max(int(peak_bytes * _RESOLUTION), 1)
        self.measured = []
        self.candidates = []
        self.chain_overs = []  # plans over blocks measured above the peak
        # The arguments' device, else that of the modules and tensors fn
        # refers to; a step whose outputs show another device is measured
        # again there (plain_run).
        self.device = _device_of((args, kwargs)) or _device_of(state.keep) or torch.device("cpu")

    def runs_left(self):
        return self.max_runs - len(self.measured)

    def run(self, policy=None, budget=None):
        with self.state.run():
            r = _measure(
                self.fn,
                self.args,
                self.kwargs,
                self.where,
                self.device,
                policy,
                budget,
                self.state,
            )
        # The same numbers on every rank, so every rank decides alike (ranks.py).
        agree_run(r)
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

    def step_blocks(self):
        """The step's blocks profiled as a chain (:class:`StepBlocks`), or
        None (no repeated blocks, or not a chain: ``chain_note`` says why).
        One run: a forward, profiled."""
        if self.blocks is None:
            return None
        blocks = find_step_blocks(self.state.roots) if self.blocks == "auto" else self.blocks
        if not blocks:
            self.chain_note = "no repeated blocks found"
            return None
        # The profile only: its output (and the graph it holds) goes at once.
        profile = self.forward_run(
            lambda: profile_region(self.fn, self.args, self.kwargs, blocks=blocks)[0]
        )
        try:
            chain_spans(profile, len(blocks))
        except NotAChain as e:
            if self.blocks != "auto":
                raise ValueError(
                    f"torch_sac.{self.where}: the blocks= given cannot be planned as a chain: "
                    f"{e}; pass the modules the step runs once each, one after the other, in "
                    "that order (or blocks='auto', or None to plan the op chain)"
                ) from None
            self.chain_note = str(e)
            return None
        # The profile's calls as the region numbers them (one more forward),
        # and its numbers the same on every rank (ranks.py).
        renumber(
            profile, self.forward_run(lambda: region_call_names(self.fn, self.args, self.kwargs))
        )
        agree_profile(profile, self.where)
        self.step = StepBlocks(
            profile,
            blocks,
            self.offload_model(),
            segment_slowdown=_SEGMENT_SLOWDOWN.get(self.device.type, 0.0),
        )
        return self.step

    def offload_model(self):
        """The cost of offloading on the step's device (measured bandwidth),
        or None where the plan may not offload: ``offload=False``, or
        ``None`` and the step does not run on a GPU."""
        if self.offload is False:
            return None
        options = offload.options()
        usable = self.device.type == "cuda" or (self.device.type == "cpu" and options.cpu_stand_in)
        if self.offload is None and self.device.type != "cuda":
            return None
        if not usable:
            raise ValueError(
                f"torch_sac.{self.where}: offload=True, but the step runs on {self.device}: "
                "offloading moves CUDA tensors to host memory (for tests on the CPU, enter "
                "torch_sac.offload.using(cpu_stand_in=True) first)"
            )
        bandwidth = offload.measure_bandwidth(self.device)
        return OffloadModel(
            d2h_bytes_per_s=bandwidth["d2h_bytes_per_s"],
            h2d_bytes_per_s=bandwidth["h2d_bytes_per_s"],
            overlaps=self.device.type == "cuda",
            prefetch_bytes=options.prefetch_bytes,
            min_bytes=options.min_bytes,
            keep_last_bytes=options.keep_last_bytes,
        )

    def forward_run(self, call):
        """``call()``, a forward of fn that is not a measured step (the
        profile, the naming of calls): counted among the runs, the step's
        state put back after it."""
        start = time.perf_counter()
        with self.state.run(), _gc_paused():
            result = call()
        self.measured.append(agree_run(_Run(None, time.perf_counter() - start, 0.0, None)))
        return result

    def chain_search(self):
        """A plan over the step's blocks, or None (:meth:`chain_for`)."""
        step = self.step_blocks()
        if step is None:
            return None
        return self.chain_for(step, self.peak_bytes)

    def chain_for(self, step, peak_bytes):
        """A plan over the step's blocks (``block_options.py``, ``chain.py``):
        per block an option, or segments of blocks, chosen for the least
        modelled recompute time under ``peak_bytes``, then measured; the
        model's error measured on each plan aims the next one (lower after
        a plan over the peak, higher after one well under it). Returns the
        fitting candidate of least modelled time, or None (``chain_note``
        says why)."""
        chain = step.chain
        # The constants of the model: at forward's end, what the run without
        # checkpointing measured above what its blocks keep; in the blocks'
        # backward, that less what the head keeps (freed by then).
        forward_base = self.plain.peak - kept_bytes(chain, step.recipe("keep all"))
        base = forward_base - step.head_bytes
        resolution = max(int(peak_bytes * _CHAIN_RESOLUTION), 1)
        margin = int(peak_bytes * _CHAIN_MARGIN)
        errors, tried, best, best_seconds = [], [], None, math.inf
        self.chain_note = None
        for _ in range(_CHAIN_RUNS):
            if self.runs_left() < 1:
                break
            # The model's error on the plans measured, signed (measured less
            # modelled): the largest aims the next plan, lower after one over
            # its model, higher while every one was under (the model is
            # conservative). The largest, so a plan under its model never
            # aims the next one back above a plan that went over.
            error = max(errors) + margin if errors else 0
            solution = solve_blocks(step, peak_bytes - error, base, forward_base)
            if solution is not None:
                plan = (list(solution.choices), solution.seconds, solution.peak)
            elif tried:
                plan = None
            else:
                per_block = step.recipe("input")
                modelled = model_peak(chain, per_block, base, forward_base)
                plan = (per_block, sum(b.full_seconds for b in chain), modelled)
                if modelled > peak_bytes * (1 + _CHAIN_SLACK):
                    plan = "above"
            if isinstance(plan, tuple):
                plan += (step.saved_calls(plan[0]), step.offloaded_calls(plan[0]))
            # Rank 0's decision on every rank (ranks.py).
            plan = rank0s(plan)
            if plan is None:
                break
            if plan == "above":
                self.chain_note = "the chain's modelled least peak is above peak_bytes"
                break
            choices, seconds, modelled, saved, offloaded = plan
            if (saved, offloaded) in tried:
                break
            tried.append((saved, offloaded))
            candidate = self.run_chain_plan(choices, saved, offloaded)
            run = candidate.run
            if run.peak <= peak_bytes:
                if seconds < best_seconds:
                    best_seconds, best = seconds, candidate
                if peak_bytes - run.peak <= resolution:
                    break
            else:
                # Not a plan for this peak, but its peak may be the least
                # measured, which a refusal states (refuse()).
                self.chain_overs.append(candidate)
            errors.append(run.peak - modelled)
        if best is not None:
            return best
        if self.chain_note is None:
            self.chain_note = f"{len(tried)} chain plans measured over peak_bytes"
        return None

    def best(self):
        """The fitting candidate with the least estimated replay cost (the
        first measured among equals), or None."""
        fitting = [c for c in self.candidates if self.fits(c.run)]
        return min(fitting, key=lambda c: _cost(c.run)) if fitting else None

    def least(self):
        """The plan with the least measured peak, plans over blocks measured
        above the peak included."""
        return min(self.candidates + self.chain_overs, key=lambda c: c.run.peak)

    def measure_chains_floor(self):
        """Before a refusal, where the step has blocks and runs are left:
        the plan over blocks keeping only their inputs (per-block
        checkpointing, the least the blocks reach), when no plan measured
        keeps that little. Without it a refusal could state the least of
        the op-chain plans only, above what the blocks reach (FSDP2 + TP:
        17.8 MiB stated where the floor measured 15.6 MiB)."""
        step = self.step
        if step is None or self.runs_left() < 1:
            return
        if any(
            at_the_chains_floor(c.blocks) for c in self.chain_overs + self.candidates if c.blocks
        ):
            return
        choices = rank0s(step.recipe("input"))  # the same plan on every rank (ranks.py)
        saved, offloaded = step.saved_calls(choices), step.offloaded_calls(choices)
        self.chain_overs.append(self.run_chain_plan(choices, saved, offloaded))

    def run_chain_plan(self, choices, saved, offloaded):
        """One run of a plan over blocks: forward keeps ``saved`` (of them,
        ``offloaded`` in host memory); its candidate."""
        run = self.run(ReplaySchedule([], saved).policy(offloaded))
        return _Candidate(
            run, saved, None, None, optimal=False, choices=choices, offloaded=offloaded or None
        )

    def at_budget(self, budget):
        """Measures the plan for ``budget`` (two runs): the first sweep of a
        recompute-everything run under it, then forward keeping that sweep.
        Both are candidates. Returns the least of their peaks."""
        sweep = self.run(_C.recompute_all(), budget)
        saved = _first_sweep(sweep.schedule)
        planned = self.run(ReplaySchedule([], saved).policy(), budget)
        self.candidates += [
            _Candidate(sweep, [], budget, sweep),
            _Candidate(planned, saved, budget, sweep),
        ]
        return min(sweep.peak, planned.peak)

    def search(self):
        """Measures budgets until the largest that fits is found, then the
        other checkpoint share; what fits is among the candidates.

        Until a plan fits: budgets of a quarter of the peak without
        checkpointing, an eighth, a sixteenth; then the least plans keeping
        the checkpoints of the two sweeps that peaked least (least_plan).
        These depend on measured peaks only, not on peak_bytes, so planning
        for the least peak a refusal states measures the same plans up to
        the one that peaked there, and returns it.

        Once one fits, the budget is refined between the largest that fits
        and the least that peaks over: bisecting first, then by the secant
        of their peaks (the peak grows about as the budget does, in steps
        of a kept tensor; with none over yet, by the gap to peak_bytes),
        until the two are within 1/32 of peak_bytes or the runs are spent.
        Two runs are kept for the other checkpoint share when the best plan
        used the spaced heuristic."""
        fit = over = None  # (budget bytes, least peak measured at it)
        budget = int(self.plain.peak * _FIRST_BUDGET)
        for step in _BEFORE_A_FIT:
            if self.best() is not None or self.runs_left() < (2 if step == "budget" else 1):
                break
            if step == "least":
                self.least_plan()
                continue
            if over is not None and over[0] == 0:
                continue  # a tiny step measured a budget of 0: halving changes nothing
            peak = self.at_budget(ReplayBudget(budget, counts_saved=True))
            if peak <= self.peak_bytes:
                fit = (budget, peak)
            else:
                over = (budget, peak)
            budget //= 2
        tried_share = refined = False
        while fit is not None and self.runs_left() >= 2:
            done = (
                over[0] - fit[0] <= self.resolution
                if over is not None
                else self.peak_bytes - fit[1] <= self.resolution
            )
            best = self.best()
            # The spaced heuristic's split between checkpoints and what
            # backward needs next suits some programs and not others (a
            # transformer at a loose budget wants fewer checkpoints, a tight
            # one more): the other share at the best budget, once refining
            # is done, or before the runs run out when the budget is loose
            # (at least the first one tried; below, the last runs refine: on
            # TinyGPT at 0.25 of its peak, 1.3x the old search's replay cost
            # instead of 2.0x).
            loose = best.budget.bytes >= self.plain.peak * _FIRST_BUDGET
            if (
                not tried_share
                and best.budget.bytes > 0
                and best.run.stats.get("spaced_choices", 0)
                and (done or (loose and self.runs_left() < 2 + _SHARE_RUNS))
            ):
                tried_share = True
                self.at_budget(
                    ReplayBudget(
                        best.budget.bytes, counts_saved=True, checkpoint_share=_OTHER_SHARE
                    )
                )
                continue
            if done:
                break
            budget = self.next_budget(fit, over, refined)
            refined = True
            peak = self.at_budget(ReplayBudget(budget, counts_saved=True))
            if peak <= self.peak_bytes:
                fit = max(fit, (budget, peak))
            elif over is None or budget < over[0]:
                over = (budget, peak)

    def least_plan(self):
        """Forward keeps the first sweep of the budget that peaked least
        (of those whose least plan is not measured yet), and backward holds
        nothing more: a zero budget that counts the kept checkpoints, so
        each rebuild keeps only the tensor it hands over. The checkpoints
        shorten every replay (a smaller working set than recomputing
        everything from the inputs) and nothing rebuilt is held: often the
        least peak of all, for one run."""
        zero = ReplayBudget(0, counts_saved=True)
        measured = [c.saved for c in self.candidates if c.budget == zero]
        swept = sorted(
            (c for c in self.candidates if c.budget is not None and c.budget.bytes),
            key=lambda c: c.run.peak,
        )
        for c in swept:
            saved = _first_sweep(c.sweep.schedule)
            if saved not in measured:
                planned = self.run(ReplaySchedule([], saved).policy(), zero)
                self.candidates.append(_Candidate(planned, saved, zero, c.sweep, optimal=False))
                return

    def next_budget(self, fit, over, refined):
        """The next budget between the largest that fits and the least over
        (``refined``: after a budget chosen here)."""
        if over is None:
            return fit[0] + max(self.peak_bytes - fit[1], self.resolution)
        guess = (fit[0] + over[0]) / 2
        # The bracket the halving budgets leave is an octave wide, and the
        # peak is a staircase in it (a kept tensor more or less): bisect it
        # first, then follow the secant, aimed a resolution below
        # peak_bytes so that a stair above the line still fits (measured on
        # the tests' steps: 1.1x less recompute on average than the secant
        # alone, up to 3.9x on a tanh chain; TinyGPT-32 at
        # checkpoint_sequential's peak went from 0.82x of it to 0.97x).
        if refined and over[1] > fit[1]:
            slope = (over[1] - fit[1]) / (over[0] - fit[0])
            guess = fit[0] + (self.peak_bytes - self.resolution - fit[1]) / slope
        margin = (over[0] - fit[0]) / 10  # in the bracket, not on its ends
        return int(min(max(guess, fit[0] + margin), over[0] - margin))

    def extend_sweeps(self, best):
        """The first sweep covers the first chain backward rebuilds; with
        several (independent branches) the plan's own first rebuild is the
        next one's sweep: keep it in forward too while that fits and helps
        (one run each, while runs are left)."""
        while self.runs_left() >= 1:
            union = sorted(set(best.saved) | set(_first_sweep(best.run.schedule)))
            if len(union) == len(best.saved):
                break
            planned = self.run(ReplaySchedule([], union).policy(), best.budget)
            candidate = _Candidate(planned, union, best.budget, best.sweep)
            self.candidates.append(candidate)
            if not (self.fits(planned) and _cost(planned) < _cost(best.run)):
                break
            best = candidate
        return best

    def refuse(self):
        """No plan fits: say so with the least peak measured, which planning
        for that peak reaches again (search)."""
        self.measure_chains_floor()
        least = self.least()
        if least.blocks is not None:
            how = (
                "keeping each block's input only"
                if at_the_chains_floor(least.blocks)
                else "a plan over blocks ("
                + ", ".join(f"{n} {o}" for o, n in collections.Counter(least.blocks).items())
                + ")"
            )
        elif least.budget is None:
            how = "saving everything"
        else:
            how = (
                f"forward keeping {len(least.saved)} op calls"
                if least.saved
                else "recomputing everything"
            )
            how += (
                f", backward holding at most {format_bytes(least.budget.bytes)}"
                if least.budget.bytes
                else ", backward holding nothing more"
            )
        raise ValueError(
            f"torch_sac.{self.where}: peak_bytes={self.peak_bytes} "
            f"({format_bytes(self.peak_bytes)}) is below the least peak measured here: "
            f"{least.run.peak} bytes ({format_bytes(least.run.peak)}), {how} (the least of "
            f"{len(self.candidates) + len(self.chain_overs)} plans measured in "
            f"{len(self.measured)} runs of fn; "
            f"without checkpointing: {format_bytes(self.plain.peak)}). Plan for "
            f"peak_bytes >= {least.run.peak}, or shrink what no plan controls (batch size, "
            "parameters' gradients, the outputs)."
        )


def plan_for_peak(fn, args, kwargs, peak_bytes, where, blocks="auto", offload=None):
    """Finds a :class:`PeakPlan` for ``fn(*args, **kwargs)`` under ``peak_bytes``."""
    if (
        isinstance(peak_bytes, bool)
        or not isinstance(peak_bytes, numbers.Integral)
        or peak_bytes <= 0
    ):
        raise ValueError(f"torch_sac.{where}: peak_bytes must be an int > 0, got {peak_bytes!r}")
    if in_region():
        raise RuntimeError(
            f"torch_sac.{where}: peak_bytes plans measure fn as an outermost region, but a "
            "sac_context is open on this thread: plan outside it"
        )
    # The same peak on every rank (ranks.py).
    peak_bytes = least(int(peak_bytes))
    state = StepState()
    try:
        state.find(fn, args, kwargs)
        return _find_plan(Planner(fn, args, kwargs, peak_bytes, where, state, blocks, offload))
    finally:
        state.restore()


def _find_plan(planner):
    plain = planner.plain_run()
    if planner.fits(plain):
        # As the plan runs: in a region saving everything (regions inside
        # fn merge into it, and their replays count).
        kept = planner.run(_C.save_all())
        candidate = _Candidate(kept, None, None, None)
        planner.candidates.append(candidate)
        if planner.fits(kept):
            return _plan(planner, plain, candidate, "none needed")
    chained = planner.chain_search()
    if chained is not None and not at_the_chains_floor(chained.blocks):
        return _plan(planner, plain, chained, "block chain")
    # Without a plan over blocks, or with one that replays every block
    # (only inputs kept, the least the blocks reach): multiple recomputation
    # over the op chain, which keeps some of a block's tensors where the
    # blocks keep none (on an 8-block Llama at per-block checkpointing's
    # peak: 0.95x its peak at 0.96x its time).
    planner.search()
    best = planner.best()
    if best is not None and best.budget.bytes > 0 and not _first_sweep_covers(best.sweep):
        best = planner.extend_sweeps(best)
    if chained is not None and (best is None or _replay_ns(chained) <= _replay_ns(best)):
        return _plan(planner, plain, chained, "block chain")
    if best is None:
        planner.refuse()
    return _plan(planner, plain, best, _solver(best))


# The most chain solves solve_blocks makes for the offloading plans (each
# about 20 ms for 100 blocks of 10 options).
_OFFLOAD_SOLVES = 8


def at_the_chains_floor(blocks):
    """Whether a plan over blocks keeps nothing but inputs."""
    return all(b in ("input", "offloaded input", "segment start", "in segment") for b in blocks)


def solve_blocks(step, peak, base, forward_base):
    """The chain solver's solution for ``step`` (:class:`StepBlocks`), with
    what offloading holds on the device counted: the least modelled time of
    the plan keeping everything on the device and of the plans that may
    offload. What offloading holds anyway (``OffloadModel.held_bytes``) grows
    with the bytes a plan offloads, which the solution decides; so plans
    are solved assuming at most ``A`` bytes offloaded, for ``A`` from the
    most any plan offloads down by halves (distinct held bytes only), and a
    solution offloading no more than its ``A`` is modelled conservatively."""
    slowdown = step.segment_slowdown
    best = solve_chain(step.chain_on_device, peak, base, forward_base, slowdown=slowdown)
    if step.offload is None or not step.offloadable:
        return best
    smallest = min(o.offloaded for b in step.chain for o in b.options if o.offloaded)
    assumed, solved = step.offloadable, set()
    while assumed >= smallest and len(solved) < _OFFLOAD_SOLVES:
        held = step.offload.held_bytes(assumed)
        if held not in solved:
            solved.add(held)
            held_in_backward, held_at_forward_end = held
            solution = solve_chain(
                step.chain,
                peak,
                base + held_in_backward,
                forward_base + held_at_forward_end,
                slowdown=slowdown,
            )
            if (
                solution is not None
                and offloaded_bytes(step.chain, solution.choices) <= assumed
                and (best is None or solution.seconds < best.seconds)
            ):
                best = solution
        assumed //= 2
    return best


def _replay_ns(candidate):
    """The replay time its planning run measured (the same measure for both
    kinds of plan: the region's own clock around its replays)."""
    return candidate.run.stats.get("replay_ns", 0)


def _solver(best):
    """Which choice made the plan: the optimal reversal is proven optimal
    only when the first sweep covered every call backward replays (one
    chain), under the budget the sweep ran with; separate chains each
    reversed optimally are not (the budget is not split between them
    optimally), nor is a sweep kept under a smaller budget (least_plan)."""
    if best.run.stats.get("spaced_choices", 0):
        return "spaced heuristic"
    if best.optimal and _first_sweep_covers(best.sweep):
        return "optimal reversal"
    return "reversal per rebuild"


def _first_sweep_covers(sweep):
    """Whether the first rebuild of ``sweep`` replayed every call backward
    replayed at all: the tape is one chain, and the forward keeping that
    sweep is the whole first sweep of its reversal."""
    replayed_calls = sum(1 for row in sweep.details for r in row.get("replays_by_call", ()) if r)
    return sweep.stats.get("first_rebuild_replayed_ops", 0) >= replayed_calls


def _cost(run):
    """Less estimated replay cost (FLOPs, bytes, per-op overhead: the
    region's, deterministic), then fewer replays, is better."""
    return run.stats.get("replayed_cost", 0), run.replayed


def _plan(planner, plain, best, solver):
    run = best.run
    replays = {row["op"]: list(row.get("replays_by_call", ())) for row in run.details}
    block_rows = None
    if best.choices is not None:
        names = qualified_names(planner.state.roots)
        block_rows = planner.step.rows(best.choices, run.details, names)
    stats = run.stats
    return PeakPlan(
        peak_bytes=planner.peak_bytes,
        measured_peak=run.peak,
        no_checkpoint_peak=plain.peak,
        replay_budget=best.budget,
        saved=best.saved,
        schedule=run.schedule if run.schedule is not None else ReplaySchedule([]),
        replayed_ops=run.replayed,
        replay_seconds=run.stats.get("replay_ns", 0) / 1e9,
        forward_seconds=plain.forward_seconds,
        replays_by_op={op: r for op, r in replays.items() if any(r)},
        solver=solver,
        solve_seconds=run.stats.get("budget_choice_ns", 0) / 1e9,
        measure_seconds=sum(r.seconds for r in planner.measured),
        runs=len(planner.measured),
        blocks=best.blocks,
        offloaded=best.offloaded,
        kept_ops=stats.get("saved_ops"),
        kept_bytes=stats.get("saved_bytes"),
        dropped_ops=stats.get("dropped_ops"),
        dropped_bytes=stats.get("dropped_bytes"),
        offloaded_bytes=stats.get("offloaded_bytes"),
        block_rows=block_rows,
    )
