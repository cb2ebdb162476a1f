"""The memory-budget planners and their plans: profile a region once, then
choose in C++ which op outputs to keep so the recompute cost avoided is as
large as possible (:class:`BudgetPolicy`, per block :class:`ModelBudget`);
:func:`plan_peak` forwards to the peak planner (``peak_search.py``).

How a plan reads (its items, rows and tables) is in ``budget_table.py``,
the planners' argument checks in ``checks.py``, the capture of a model's
block calls in ``block_calls.py``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .. import _C
from .._blocks import find_blocks
from .._op_profile import RegionProfile, format_bytes, profile_region
from .block_calls import block_calls, block_signature
from .budget_table import (
    PlanItem,
    PlanRow,
    bytes_of,
    fold_rows,
    format_cost,
    model_table,
    plan_table,
)
from .checks import (
    SOLVERS,
    check_blocks,
    check_budget,
    check_callable,
    check_choice,
    check_example_kwargs,
    check_examples,
    check_options,
)
from .peak_plan import PeakPlan
from .peak_search import plan_for_peak
from .ranks import agree_profile, least
from .region_numbering import region_call_names, renumber

__all__ = [
    "budget",
    "budget_for_model",
    "budget_for_region",
    "plan_peak",
    "BudgetPolicy",
    "ModelBudget",
    "PlanItem",
    "PlanRow",
]


class BudgetPolicy(_C.SavedCallsPolicy):
    """A memory-budget plan: saves the chosen op calls, recomputes the rest.

    Made by :func:`torch_sac.policies.budget_for_region` (and per block by
    :func:`~torch_sac.policies.budget_for_model`). Decided in C++ by
    (op overload, call index within the region), with no Python call per op;
    accepted wherever torch_sac takes a policy.

    Attributes:
        budget_bytes: the memory budget, in bytes.
        saved_bytes: bytes of the distinct storages the saved outputs keep
            alive (<= budget_bytes).
        activation_bytes: the region's un-checkpointed activation memory
            (distinct storages autograd saves for backward).
        total_bytes: what saving every op output would keep.
        avoided_cost, total_cost: recompute cost avoided by the plan, and of
            all op calls, in ``cost_unit``.
        cost: ``"time"`` or ``"flops"``; cost_unit: ``"s"`` or ``"FLOP"``.
        solver: ``"exact"`` or ``"greedy"``, the solver that made the plan.
        optimal: True when the plan is proven optimal for the cost model.
        upper_bound: proven upper bound on the best avoidable cost.
        solver_note: why ``auto`` fell back to greedy, if it did.
        solve_seconds: time spent in the C++ solver.
        chosen: list of ``(op, call_index)`` saved.
        items: every op call of the region as a :class:`PlanItem`, in
            region order.
        rows: the op calls that allocate region memory, each a
            :class:`PlanRow` with the views and in-place ops that use its
            memory folded in, by value (the recompute cost saving the row
            could avoid) descending: what :meth:`table` shows.
        outside_calls: the op calls (:class:`PlanItem`) that keep no region
            memory (views of parameters or inputs, in-place ops on them,
            ops without tensor outputs): nothing to save.
    """

    def __init__(
        self,
        profile: RegionProfile,
        cost: str,
        budget_bytes: int,
        solution: dict[str, Any],
        fraction: float | None = None,
    ) -> None:
        items = []
        for i, r in enumerate(profile.records):
            items.append(
                PlanItem(
                    op=r.op,
                    call_index=r.call_index,
                    cost=_cost_of(r, cost),
                    bytes=profile.item_bytes(r),
                    new_bytes=sum(profile.storages[s].nbytes for s in r.new_storages),
                    saveable=r.saveable,
                    why_not=r.why_not,
                    saved=False,
                )
            )
        candidates = solution["candidates"]
        for j in solution["chosen"]:
            items[candidates[j]].saved = True
        self.items = items
        rows, self.outside_calls = fold_rows(profile, items)
        # Stable: equal values keep region order.
        self.rows = sorted(rows, key=lambda row: (row.value, row.cost), reverse=True)
        self.chosen = [it.key for it in items if it.saved]
        self.cost = cost
        self.cost_unit = "s" if cost == "time" else "FLOP"
        self.budget_bytes = budget_bytes
        self.fraction = fraction
        self.saved_bytes = solution["bytes"]
        self.activation_bytes = profile.activation_bytes
        self.total_bytes = profile.total_bytes
        self.avoided_cost = solution["value"]
        self.total_cost = sum(it.cost for it in items)
        self.solver = solution["method"]
        self.optimal = solution["optimal"]
        self.upper_bound = solution["upper_bound"]
        self.solver_note = solution["note"]
        self.solve_seconds = solution["seconds"]
        self._profile = profile
        label = (
            f"budget({format_bytes(budget_bytes)}: saves {len(self.chosen)} of {len(items)} "
            f"op calls, {format_bytes(self.saved_bytes)}, {self.solver})"
        )
        calls = [(op._schema.name, op._schema.overload_name, idx) for op, idx in self.chosen]
        super().__init__(calls, label)

    def with_budget(
        self,
        *,
        bytes: int | None = None,
        fraction: float | None = None,
        solver: str = "auto",
        max_states: int | None = None,
    ) -> BudgetPolicy:
        """The plan for another budget, from the same profile (no new run of ``fn``)."""
        return _plan(
            self._profile,
            self.cost,
            bytes,
            fraction,
            solver,
            max_states,
            "BudgetPolicy.with_budget",
        )

    def is_saved(self, op: torch._ops.OpOverload, call_index: int) -> bool:
        """Whether the plan saves call ``call_index`` of ``op`` (an OpOverload)."""
        return (op, call_index) in set(self.chosen)

    def _fmt_cost(self, c):
        return format_cost(c, self.cost)

    def _bytes_of(self, items):
        """Bytes of the distinct region storages ``items`` keep."""
        return bytes_of(self, self._profile, items)

    def summary(self) -> str:
        """The plan in one line (as in ``repr``)."""
        pct = lambda a, b: f"{100.0 * a / b:.0f}%" if b else "-"  # noqa: E731
        return (
            f"budget {format_bytes(self.budget_bytes)}"
            + (f" ({self.fraction:.0%} of activations)" if self.fraction is not None else "")
            + f"; saves {len(self.chosen)}/{len(self.items)} op calls keeping "
            f"{format_bytes(self.saved_bytes)} (un-checkpointed activations "
            f"{format_bytes(self.activation_bytes)}, everything {format_bytes(self.total_bytes)}); "
            f"avoids {self._fmt_cost(self.avoided_cost)} of {self._fmt_cost(self.total_cost)} "
            f"recompute ({pct(self.avoided_cost, self.total_cost)}); solver {self.solver}"
            + (
                ", optimal"
                if self.optimal
                else f", within {self._fmt_cost(self.upper_bound - self.avoided_cost)} of optimal"
            )
            + (f" ({self.solver_note})" if self.solver_note else "")
        )

    def table(self, max_rows: int | None = 20, fold: bool = True) -> str:
        """The plan as text: the op calls most worth saving, then a summary
        that defines each of its terms in one line.

        With ``fold=True`` (default) a row is an op call that allocates
        region memory, with the calls that only use that memory folded into
        it: a view shares its base's storage and an in-place op writes its
        input's, so saving them costs no memory beyond that storage. The
        folded ops are named in the last column and their cost is added to
        the row's. Rows are sorted by value, the recompute cost saving the
        row would avoid (that of its calls that can be saved), so rows that
        cannot be saved come last; they are :attr:`rows`. Calls keeping no
        region memory (e.g. ``t`` of a weight) are counted in one line. The
        costs of the shown rows, of the hidden rows' line and of that line
        add up to the region's total.

        Columns: ``op`` (``aten.`` and a ``.default`` overload left out) and
        ``call`` (its call index in the region) name the call the policy
        decides on; ``cost`` is the recompute cost of the row's calls (time
        or FLOPs) and ``share`` its share of the total; ``bytes`` the region
        memory the row's calls keep, what saving it costs; ``decision``
        SAVE, or recompute with the reason when it cannot be saved.

        Args:
            max_rows (int, optional): rows to show (default 20); the others
                are summed up in one line. ``None`` shows them all.
            fold (bool): if ``False``, one row per op call in region order,
                as in :attr:`items`, with the bytes each keeps and allocates.
        """
        if max_rows is not None and (
            isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0
        ):
            raise ValueError(
                f"torch_sac.BudgetPolicy.table: max_rows must be an int >= 0 or None, "
                f"got {max_rows!r}"
            )
        return plan_table(self, self._profile, max_rows, fold)

    def __repr__(self) -> str:
        return f"<torch_sac BudgetPolicy: {self.summary()}>"


def _cost_of(record, cost):
    return record.seconds if cost == "time" else float(record.flops)


def _plan(profile, cost, bytes_, fraction, solver, max_states, where):
    fraction = check_budget(bytes_, fraction, where)
    check_choice(solver, SOLVERS, "solver", where)
    if fraction is not None:
        budget_bytes = int(fraction * profile.activation_bytes)
    else:
        budget_bytes = int(bytes_)
    budget_bytes = least(budget_bytes)  # the same plan on every rank (ranks.py)
    # Items: the op calls that can be saved. Storages from outside the region
    # cost nothing to keep.
    candidates = [i for i, r in enumerate(profile.records) if r.saveable]
    storage_bytes = [s.nbytes if s.internal else 0 for s in profile.storages]
    values = [_cost_of(profile.records[i], cost) for i in candidates]
    item_storages = [list(profile.records[i].storages) for i in candidates]
    kwargs = {}
    if max_states is not None:
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states <= 0:
            raise ValueError(
                f"torch_sac.{where}: max_states must be a positive int, got {max_states!r}"
            )
        kwargs["max_states"] = max_states
    solution = _C.budget_solve(storage_bytes, values, item_storages, budget_bytes, solver, **kwargs)
    solution["candidates"] = candidates
    return BudgetPolicy(profile, cost, budget_bytes, solution, fraction)


def _region_plan(
    fn, args, kwargs, bytes_, fraction, cost, solver, repeats, max_states, where
) -> BudgetPolicy:
    """Checks the options, then profiles ``fn(*args, **kwargs)`` as one
    region and plans it."""
    check_options(bytes_, fraction, cost, solver, repeats, where)
    return _profiled_plan(
        fn, args, kwargs, bytes_, fraction, cost, solver, repeats, max_states, where
    )


def _profiled_plan(
    fn, args, kwargs, bytes_, fraction, cost, solver, repeats, max_states, where
) -> BudgetPolicy:
    """Profiles ``fn(*args, **kwargs)`` as one region (options already
    checked) and plans it: one region's plan, or one block's in a model."""
    profile, _ = profile_region(
        fn,
        args,
        kwargs,
        repeats=repeats if cost == "time" else 0,
        count_flops=cost == "flops",
    )
    # Keyed as the engines see the calls (region_numbering.py); the same
    # numbers on every rank, so every rank makes the same plan (ranks.py).
    renumber(profile, region_call_names(fn, args, kwargs))
    agree_profile(profile, where)
    return _plan(profile, cost, bytes_, fraction, solver, max_states, where)


def budget_for_region(
    fn: Callable[..., Any],
    example_args: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    bytes: int | None = None,
    fraction: float | None = None,
    cost: str = "time",
    solver: str = "auto",
    repeats: int = 3,
    max_states: int | None = None,
) -> BudgetPolicy:
    r"""What one region (a block) keeps in forward within a memory budget.

    Runs ``fn(*example_args, **example_kwargs)`` twice (a profiling forward,
    grad enabled, then a forward in a region that names the calls as the
    engines see them) and records every op call a selective-checkpoint
    policy would see in that region, keyed by (op overload, call index
    within the region) exactly as
    :func:`torch_sac.create_selective_checkpoint_contexts` keys its cache. Each call's recompute cost is measured (``cost="time"``)
    or counted (``cost="flops"``), and its memory is the size of the storages
    its outputs keep alive. A C++ solver then picks the calls to save
    (MUST_SAVE) so that the cost avoided in recompute is as large as possible
    while the saved outputs fit in the budget; every other call is
    PREFER_RECOMPUTE. The returned policy is decided in C++ and never calls
    Python.

    ``fn`` is always planned as one region, even when it is an
    ``nn.Module`` holding blocks: :func:`budget_for_model` plans a model
    per block.

    Memory is accounted by storage, as the allocator sees it: a view or an
    in-place op's output shares its input's storage, so a storage counts once
    however many saved outputs keep it, a view of a saved output costs
    nothing extra, and a view saved without its base still keeps the whole
    base storage. Storages from outside the region (parameters, buffers, the
    region's inputs) cost nothing: they are alive anyway. An op whose output
    is mutated in place later in the region is never saved (the cache would
    hand back the mutated values).

    Args:
        fn: the region: the function or module you checkpoint, e.g. one
            transformer block.
        example_args (tuple or list): positional arguments for the profiling
            forward, shaped like the real ones (the plan is for these
            shapes). One tensor ``x`` is ``(x,)``.
        example_kwargs (dict, optional): keyword arguments for it.
        bytes (int): the budget: at most this many bytes of saved outputs.
        fraction (float): the budget as a fraction of the region's
            un-checkpointed activation memory (the distinct storages autograd
            saves for backward without checkpointing, measured in the
            profiling forward). Pass exactly one of ``bytes`` and
            ``fraction``.
        cost (str): ``"time"`` (default): each op's measured time, the median
            of the call and ``repeats`` replays of it (ops that mutate or draw
            random numbers are timed once); ``"flops"``: FLOPs from
            :mod:`torch.utils.flop_counter` (ops it does not count, e.g.
            pointwise ops, are worth 0 and never saved).
        solver (str): ``"auto"`` (default): exact, falling back to greedy for
            very large regions; ``"exact"``: optimal for the cost model, or
            raise; ``"greedy"``: value density with a fix-up, within
            ``max(OPT - v_max, OPT / 2)`` of the optimum (``v_max``: the most
            valuable single option). The plan says which ran and whether it
            is proven optimal.
        repeats (int): replays per op for ``cost="time"`` (default 3).
        max_states (int, optional): work limit of the exact solver.

    Returns:
        A :class:`BudgetPolicy`: pass it to :class:`torch_sac.sac_context`,
        :func:`torch_sac.create_selective_checkpoint_contexts` or
        :func:`torch_sac.apply_sac`. Its attributes describe the plan
        (``chosen``, ``saved_bytes``, ``budget_bytes``, ``activation_bytes``,
        ``avoided_cost``, ``solver``, ``optimal``, ...); ``table()`` shows
        it, the op calls worth the most first with views and in-place ops
        folded into the op whose memory they use, then a summary;
        ``with_budget(...)`` re-plans for another budget without profiling
        again.

    Raises:
        TypeError: ``fn`` is not callable, ``example_args`` is not a tuple or
            list, ``example_kwargs`` not a dict, not exactly one of
            ``bytes`` and ``fraction`` is given, or an option is misspelled
            (Python's own error: the options are keyword-only).
        ValueError: an option is out of range.

    Example:
        >>> block = model.layers[0]
        >>> policy = torch_sac.policies.budget_for_region(block, (x,), fraction=0.5)
        >>> print(policy.table())
        >>> for layer in model.layers:  # same structure: one plan for all
        ...     with torch_sac.sac_context(policy):
        ...         x = layer(x)

    .. warning::
        ``fn`` really runs twice while profiling: side effects such as
        BatchNorm running statistics happen (the global RNG state is
        restored). The plan is for the shapes, dtypes and control flow of the
        example inputs; op calls the plan did not see are recomputed. The
        budget bounds what the region's cache keeps; the region's inputs,
        which checkpointing always keeps, are not part of it. Timings of tiny
        ops are dominated by dispatch overhead: profile with realistic sizes.
    """
    where = "policies.budget_for_region"
    check_callable(fn, where)
    args, kwargs = check_examples(example_args, example_kwargs, where)
    return _region_plan(fn, args, kwargs, bytes, fraction, cost, solver, repeats, max_states, where)


def budget_for_model(
    model: torch.nn.Module,
    example_args: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    bytes: int | None = None,
    fraction: float | None = None,
    modules: type | tuple[type, ...] | Callable[[torch.nn.Module], bool] | None = None,
    cost: str = "time",
    solver: str = "auto",
    repeats: int = 3,
    max_states: int | None = None,
) -> ModelBudget:
    r"""One budget plan per distinct block of a model, from a real call.

    Calls ``model(*example_args, **example_kwargs)`` once and captures each
    block's real arguments (positional and keyword: masks, rotary
    embeddings, whatever the model passes). Then each distinct block (same
    class, parameter shapes and argument shapes) is planned once as by
    :func:`budget_for_region`, with the budget per block.

    Args:
        model (nn.Module): the model.
        example_args (tuple or list): positional arguments of the example
            call, e.g. ``(input_ids,)``.
        example_kwargs (dict, optional): its keyword arguments, e.g.
            ``{"attention_mask": mask}``.
        bytes (int): the budget of each block, in bytes of saved outputs.
        fraction (float): the budget of each block as a fraction of its
            un-checkpointed activation memory. Pass exactly one of ``bytes``
            and ``fraction``.
        modules: the blocks, as for :func:`torch_sac.apply_sac`: ``None``
            (default) finds them (Hugging Face layers, a ``ModuleList``,
            ``ModuleDict`` or ``nn.Sequential`` of blocks); an
            ``nn.Module`` class, a tuple of classes or a predicate
            ``module -> bool`` chooses them.
        cost (str): as for :func:`budget_for_region`.
        solver (str): as for :func:`budget_for_region`.
        repeats (int): as for :func:`budget_for_region`.
        max_states (int, optional): as for :func:`budget_for_region`.

    Returns:
        A :class:`ModelBudget`: pass it to :func:`torch_sac.apply_sac` as
        the policy. ``plans`` maps each block's name to its
        :class:`BudgetPolicy`; ``table()`` shows each distinct plan once.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, the example arguments
            or an option have the wrong type (a misspelled option too).
        ValueError: the model has no blocks (plan it as one region with
            :func:`budget_for_region`), or an option is out of range.
        RuntimeError: a block did not run in the example call.

    Example:
        >>> plan = torch_sac.policies.budget_for_model(
        ...     model, (input_ids,), {"attention_mask": mask}, fraction=0.5)
        >>> print(plan.table())  # each distinct plan once, under its blocks
        >>> handle = torch_sac.apply_sac(model, plan)

    .. warning::
        The model runs once, then each distinct block twice more while
        profiling (a profiled forward and one naming its calls as the
        engines see them); side effects happen as for :func:`budget_for_region` (the
        global RNG state is restored). The plans are for the example call's
        shapes.
    """
    where = "policies.budget_for_model"
    check_callable(model, where)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"torch_sac.{where}: model must be an nn.Module, got {type(model).__name__}; plan "
            "a function as one region with torch_sac.policies.budget_for_region"
        )
    args, kwargs = check_examples(example_args, example_kwargs, where)
    check_options(bytes, fraction, cost, solver, repeats, where)
    if modules is None and not find_blocks(model):
        raise ValueError(
            f"torch_sac.{where}: found no repeated blocks in the model (no Hugging Face "
            "GradientCheckpointingLayer, no ModuleList/ModuleDict/Sequential holding two or more "
            "modules of one class); pass modules= a class, a tuple of classes or a predicate, "
            "or plan the model as one region with torch_sac.policies.budget_for_region"
        )
    return _model_budget(
        model, args, kwargs, modules, cost, bytes, fraction, solver, repeats, max_states, where
    )


def plan_peak(
    fn: Callable[..., Any],
    example_args: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    peak_bytes: int,
    blocks: str | Sequence[torch.nn.Module] | None = "auto",
    offload: bool | None = None,
) -> PeakPlan:
    r"""A plan for one region around the whole step, within a peak memory.

    Plans for the measured peak of forward *and* backward. When the step
    runs repeated blocks (found as :func:`torch_sac.apply_sac` finds them),
    the plan chooses per block what it keeps (everything, the matmuls, the
    budget planner's choice at a share of its activations, only its input)
    and where several blocks are checkpointed as one, by a dynamic program
    over the chain of blocks whose cost is the measured time of what
    backward replays and whose memory is measured bytes (``plan.blocks``).
    Per-block checkpointing, every k-th block, ``checkpoint_sequential`` and
    selective checkpointing of the matmuls are each one point of that
    space. Below what the blocks reach (or without blocks) the plan uses
    multiple recomputation: it chooses what forward keeps and the replay
    budget backward rebuilds under, for ``fn`` as one region. ``fn`` runs
    forward and backward at most 10 times while planning
    (``plan.planning_runs``).

    Args:
        fn: the step: a function whose output backward starts from, e.g.
            ``lambda: loss_fn(model(tokens))``. Gradients go to
            ``autograd.grad``; a ``backward`` inside ``fn`` is undone.
        example_args (tuple or list): positional arguments for ``fn``.
        example_kwargs (dict, optional): keyword arguments for ``fn``.
        peak_bytes (int): the most the step may allocate above the level
            before the call (activations, rebuilt tensors, parameter
            gradients, outputs).
        blocks: ``"auto"`` (default) plans over the repeated blocks of the
            largest model ``fn`` refers to; a list of modules plans over
            those (each must run once per step, one after the other);
            ``None`` plans the step as one chain of op calls only.
        offload: whether a block may keep activations in host memory
            (its matmuls' outputs, everything it keeps, as much of either
            as the link hides behind its compute, or its input;
            ``plan.offloaded``; :mod:`torch_sac.offload`, docs/offload.md),
            chosen where the copies' time that compute cannot hide, on the
            bandwidth measured before planning, costs less than
            recomputing. ``None`` (default): where the step runs on a GPU.
            ``True`` on the CPU needs ``torch_sac.offload.using(cpu_stand_in=True)``
            (tests: its copies are synchronous, so they cost their whole time).

    Returns:
        A :class:`~torch_sac.PeakPlan`: run it with
        ``with torch_sac.sac_context(plan):`` (or
        ``torch_sac.checkpoint(fn, x, policy=plan)``), which applies both its
        forward policy and its replay budget; ``plan.table()`` shows it and
        ``plan.save(path)`` writes it as JSON.

    Raises:
        TypeError: ``fn`` is not callable or the example arguments have the
            wrong type.
        ValueError: ``peak_bytes`` is not an int > 0, or is below the least
            peak any measured plan reached (the message says that peak).
        RuntimeError: a ``sac_context`` is open on this thread, or ``fn``
            has no backward.

    Example:
        >>> def step():
        ...     return loss_fn(model(tokens))
        >>> plan = torch_sac.policies.plan_peak(step, peak_bytes=8 << 30)
        >>> print(plan.table())
        >>> with torch_sac.sac_context(plan):
        ...     loss = step()
        >>> loss.backward()

    .. warning::
        Each planning run puts back what it changed: module buffers
        (BatchNorm running statistics), parameters' ``.grad`` and the RNG
        state, so every run measures the same step and planning leaves the
        model as it was; other state ``fn`` changes (an optimizer step, a
        Python counter) changes with every run. See
        :class:`~torch_sac.PeakPlan` and docs/design/peak-plans.md.
    """
    where = "policies.plan_peak"
    check_callable(fn, where)
    args, kwargs = check_examples(example_args, example_kwargs, where)
    blocks = check_blocks(blocks, where)
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"torch_sac.{where}: offload must be None, True or False, got {offload!r}")
    return plan_for_peak(fn, args, kwargs, peak_bytes, where, blocks, offload)


def budget(
    fn: Callable[..., Any],
    *example_args: Any,
    bytes: int | None = None,
    fraction: float | None = None,
    peak_bytes: int | None = None,
    cost: str = "time",
    solver: str = "auto",
    repeats: int = 3,
    max_states: int | None = None,
    modules: type | tuple[type, ...] | Callable[[torch.nn.Module], bool] | None = None,
    **example_kwargs: Any,
) -> BudgetPolicy | ModelBudget | PeakPlan:
    r"""The three planners behind one name (kept for compatibility).

    Prefer the explicit planners: :func:`budget_for_region`,
    :func:`budget_for_model` and :func:`plan_peak`. ``budget`` forwards to
    the one its arguments select, with ``fn(*example_args,
    **example_kwargs)`` as the example call:

    * ``peak_bytes=``: :func:`plan_peak`, a :class:`~torch_sac.PeakPlan`
      (``bytes``, ``fraction``, ``modules``, ``cost``, ``solver``,
      ``repeats`` and ``max_states`` are refused with it);
    * ``fn`` an ``nn.Module`` with ``modules=`` or holding repeated blocks
      (Hugging Face layers, a ``ModuleList`` or ``ModuleDict`` of blocks):
      :func:`budget_for_model`, a :class:`ModelBudget`;
    * otherwise: :func:`budget_for_region`, a :class:`BudgetPolicy`
      (``modules`` is ignored).

    Args:
        fn: the region, the model or the step.
        \*example_args: positional arguments of the example call.
        bytes (int): as for :func:`budget_for_region`.
        fraction (float): as for :func:`budget_for_region`.
        peak_bytes (int): as for :func:`plan_peak`.
        cost (str): as for :func:`budget_for_region`.
        solver (str): as for :func:`budget_for_region`.
        repeats (int): as for :func:`budget_for_region`.
        max_states (int, optional): as for :func:`budget_for_region`.
        modules: as for :func:`budget_for_model`.
        \*\*example_kwargs: keyword arguments of the example call.

    Returns:
        A :class:`BudgetPolicy`, a :class:`ModelBudget` or a
        :class:`~torch_sac.PeakPlan`, as above.

    Raises:
        TypeError: as the planner it forwards to; also for a keyword of
            ``example_kwargs`` that looks like a misspelled option: one
            ``fn`` cannot take (its signature has no such parameter and no
            ``**kwargs``), or one close to an option's name (``repeat=``)
            that ``fn`` does not take by name. The message names the
            explicit planner to pass such a keyword with
            (``example_kwargs={...}``). Nothing is refused when ``fn``'s
            signature cannot be inspected.

    Example:
        >>> policy = torch_sac.policies.budget(block, x, fraction=0.5)
        >>> # the same as
        >>> policy = torch_sac.policies.budget_for_region(block, (x,), fraction=0.5)
    """
    where = "policies.budget"
    check_callable(fn, where)
    if peak_bytes is not None:
        explicit = "plan_peak"
    elif isinstance(fn, torch.nn.Module) and (modules is not None or _has_blocks(fn)):
        explicit = "budget_for_model"
    else:
        explicit = "budget_for_region"
    check_example_kwargs(fn, example_kwargs, explicit, where)
    if explicit == "plan_peak":
        if bytes is not None or fraction is not None or modules is not None:
            raise ValueError(
                f"torch_sac.{where}: peak_bytes plans fn as one region: pass it without bytes, "
                "fraction or modules"
            )
        if cost != "time" or solver != "auto" or repeats != 3 or max_states is not None:
            raise ValueError(
                f"torch_sac.{where}: cost, solver, repeats and max_states are for bytes/fraction "
                "plans; a peak_bytes plan measures peaks and weighs replays by the region's "
                "estimated cost"
            )
        return plan_for_peak(fn, example_args, example_kwargs, peak_bytes, where)
    if explicit == "budget_for_model":
        check_options(bytes, fraction, cost, solver, repeats, where)
        return _model_budget(
            fn,
            example_args,
            example_kwargs,
            modules,
            cost,
            bytes,
            fraction,
            solver,
            repeats,
            max_states,
            where,
        )
    return _region_plan(
        fn, example_args, example_kwargs, bytes, fraction, cost, solver, repeats, max_states, where
    )


def _has_blocks(model):
    """A model of blocks (Hugging Face layers, a ModuleList/ModuleDict of
    them), not a block: an ``nn.Sequential`` MLP inside a block does not
    make it a model."""
    return bool(find_blocks(model, containers=(torch.nn.ModuleList, torch.nn.ModuleDict)))


def _model_budget(
    model, args, kwargs, modules, cost, bytes_, fraction, solver, repeats, max_states, where
):
    plans = {}
    by_block = {}
    for block, block_args, block_kwargs in block_calls(model, args, kwargs, modules, where):
        key = block_signature(block, block_args, block_kwargs)
        if key not in plans:
            plans[key] = _profiled_plan(
                block,
                block_args,
                block_kwargs,
                bytes_,
                fraction,
                cost,
                solver,
                repeats,
                max_states,
                where,
            )
        by_block[block] = plans[key]
    names = {m: n for n, m in model.named_modules()}
    return ModelBudget(by_block, names)


class ModelBudget:
    """One budget plan per distinct block of a model: what
    :func:`torch_sac.policies.budget_for_model` returns.

    Pass it to :func:`torch_sac.apply_sac` as the policy (it is a callable
    ``module -> plan``); ``plans`` maps each block's name to its plan;
    ``table()`` shows each distinct plan once, with the blocks it serves.
    """

    def __init__(
        self, by_block: dict[torch.nn.Module, BudgetPolicy], names: dict[torch.nn.Module, str]
    ) -> None:
        self._by_block = by_block
        self._names = names

    def __call__(self, module: torch.nn.Module) -> BudgetPolicy:
        try:
            return self._by_block[module]
        except KeyError:
            raise KeyError(
                f"torch_sac: no budget plan for {self._names.get(module, module)!r}: it was not "
                "among the blocks planned"
            ) from None

    @property
    def plans(self) -> dict[str, BudgetPolicy]:
        return {self._names[m]: plan for m, plan in self._by_block.items()}

    @property
    def budget_bytes(self) -> int:
        """The most the plans let the blocks keep, summed over blocks."""
        return sum(plan.budget_bytes for plan in self._by_block.values())

    @property
    def saved_bytes(self) -> int:
        return sum(plan.saved_bytes for plan in self._by_block.values())

    def table(self, max_rows: int | None = 20, fold: bool = True) -> str:
        """The plans as text: a line for the whole model, then per distinct
        plan a header naming the blocks that share it and the plan's
        :meth:`BudgetPolicy.table` (``max_rows`` and ``fold`` as there)."""
        return model_table(self, self._by_block, self._names, max_rows, fold)

    def __repr__(self) -> str:
        distinct = len({id(p) for p in self._by_block.values()})
        return (
            f"ModelBudget({len(self._by_block)} blocks, {distinct} distinct plan(s), "
            f"saved {self.saved_bytes} of budget {self.budget_bytes} bytes)"
        )
