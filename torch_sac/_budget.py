"""The memory-budget policy: profile a region once, then choose in C++ which op
outputs to keep so the recompute cost avoided is as large as possible."""

import math
import numbers

import torch

from . import _C
from ._op_profile import format_bytes, profile_region

__all__ = ["budget", "BudgetPolicy", "ModelBudget", "PlanItem"]

_COSTS = ("time", "flops")
_SOLVERS = ("auto", "exact", "greedy")


class PlanItem:
    """One op call of the profiled region and what the plan does with it."""

    __slots__ = ("op", "call_index", "cost", "bytes", "new_bytes", "saveable", "why_not", "saved")

    def __init__(self, op, call_index, cost, bytes, new_bytes, saveable, why_not, saved):
        self.op = op                  # OpOverload
        self.call_index = call_index  # per op overload, within the region
        self.cost = cost              # recompute cost (seconds or FLOPs)
        self.bytes = bytes            # bytes of the region storages its outputs keep
        self.new_bytes = new_bytes    # of which it allocated itself (0: view / in-place)
        self.saveable = saveable
        self.why_not = why_not
        self.saved = saved            # MUST_SAVE in the plan

    @property
    def key(self):
        return (self.op, self.call_index)

    def __repr__(self):
        return (
            f"PlanItem({self.op}, call={self.call_index}, cost={self.cost:.4g}, "
            f"bytes={self.bytes}, new_bytes={self.new_bytes}, saved={self.saved})"
        )


def _check_budget(bytes_, fraction, where):
    if (bytes_ is None) == (fraction is None):
        raise TypeError(f"torch_sac.{where}: pass exactly one of bytes= or fraction=")
    if bytes_ is not None:
        if isinstance(bytes_, bool) or not isinstance(bytes_, numbers.Integral):
            raise TypeError(f"torch_sac.{where}: bytes must be an int, got {bytes_!r}")
        if bytes_ < 0:
            raise ValueError(f"torch_sac.{where}: bytes must be >= 0, got {bytes_}")
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"torch_sac.{where}: fraction must be a number, got {fraction!r}")
    if not math.isfinite(fraction) or fraction < 0:
        raise ValueError(f"torch_sac.{where}: fraction must be finite and >= 0, got {fraction}")
    return float(fraction)


def _check_choice(value, choices, name, where):
    if value not in choices:
        raise ValueError(
            f"torch_sac.{where}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )


class BudgetPolicy(_C.SavedCallsPolicy):
    """A memory-budget plan: saves the chosen op calls, recomputes the rest.

    Made by :func:`torch_sac.policies.budget`. Decided in C++ by
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
        items: every op call of the region as a :class:`PlanItem`.
    """

    def __init__(self, profile, cost, budget_bytes, solution, fraction=None):
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

    def with_budget(self, *, bytes=None, fraction=None, solver="auto", max_states=None):
        """The plan for another budget, from the same profile (no new run of ``fn``)."""
        return _plan(self._profile, self.cost, bytes, fraction, solver, max_states, "BudgetPolicy.with_budget")

    def is_saved(self, op, call_index):
        """Whether the plan saves call ``call_index`` of ``op`` (an OpOverload)."""
        return (op, call_index) in set(self.chosen)

    def _fmt_cost(self, c):
        if self.cost == "time":
            return f"{c * 1e6:.1f} us"
        return f"{c / 1e6:.3g} MFLOP"

    def summary(self):
        pct = lambda a, b: f"{100.0 * a / b:.0f}%" if b else "-"  # noqa: E731
        return (
            f"budget {format_bytes(self.budget_bytes)}"
            + (f" ({self.fraction:.0%} of activations)" if self.fraction is not None else "")
            + f"; saves {len(self.chosen)}/{len(self.items)} op calls keeping "
            f"{format_bytes(self.saved_bytes)} (un-checkpointed activations "
            f"{format_bytes(self.activation_bytes)}, everything {format_bytes(self.total_bytes)}); "
            f"avoids {self._fmt_cost(self.avoided_cost)} of {self._fmt_cost(self.total_cost)} "
            f"recompute ({pct(self.avoided_cost, self.total_cost)}); solver {self.solver}"
            + (", optimal" if self.optimal else f", within {self._fmt_cost(self.upper_bound - self.avoided_cost)} of optimal")
            + (f" ({self.solver_note})" if self.solver_note else "")
        )

    def table(self, max_rows=None):
        """The plan as a text table: one row per op call, then the summary."""
        rows = [("#", "op", "call", "cost", "keeps", "allocates", "decision")]
        for i, it in enumerate(self.items[: max_rows if max_rows is not None else len(self.items)]):
            if it.saved:
                decision = "SAVE"
            elif not it.saveable:
                decision = "recompute (" + it.why_not + ")"
            else:
                decision = "recompute"
            rows.append(
                (
                    str(i),
                    str(it.op),
                    str(it.call_index),
                    self._fmt_cost(it.cost),
                    format_bytes(it.bytes),
                    format_bytes(it.new_bytes),
                    decision,
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if max_rows is not None and len(self.items) > max_rows:
            lines.append(f"... {len(self.items) - max_rows} more")
        lines.append(self.summary())
        return "\n".join(lines)

    def __repr__(self):
        return f"<torch_sac BudgetPolicy: {self.summary()}>"


def _cost_of(record, cost):
    return record.seconds if cost == "time" else float(record.flops)


def _plan(profile, cost, bytes_, fraction, solver, max_states, where):
    fraction = _check_budget(bytes_, fraction, where)
    _check_choice(solver, _SOLVERS, "solver", where)
    if fraction is not None:
        budget_bytes = int(fraction * profile.activation_bytes)
    else:
        budget_bytes = int(bytes_)
    # Items: the op calls that can be saved. Storages from outside the region
    # cost nothing to keep.
    candidates = [i for i, r in enumerate(profile.records) if r.saveable]
    storage_bytes = [s.nbytes if s.internal else 0 for s in profile.storages]
    values = [_cost_of(profile.records[i], cost) for i in candidates]
    item_storages = [list(profile.records[i].storages) for i in candidates]
    kwargs = {}
    if max_states is not None:
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states <= 0:
            raise ValueError(f"torch_sac.{where}: max_states must be a positive int, got {max_states!r}")
        kwargs["max_states"] = max_states
    solution = _C.budget_solve(storage_bytes, values, item_storages, budget_bytes, solver, **kwargs)
    solution["candidates"] = candidates
    return BudgetPolicy(profile, cost, budget_bytes, solution, fraction)


def budget(fn, *example_args, bytes=None, fraction=None, cost="time", solver="auto", repeats=3,
           max_states=None, modules=None, **example_kwargs):
    r"""A policy that keeps as much recompute away as a memory budget allows.

    Runs ``fn(*example_args)`` once (a profiling forward, grad enabled) and
    records every op call a selective-checkpoint policy would see in that
    region, keyed by (op overload, call index within the region) exactly as
    :func:`torch_sac.create_selective_checkpoint_contexts` keys its cache.
    Each call's recompute cost is measured (``cost="time"``) or counted
    (``cost="flops"``), and its memory is the size of the storages its
    outputs keep alive. A C++ solver then picks the calls to save (MUST_SAVE)
    so that the cost avoided in recompute is as large as possible while the
    saved outputs fit in the budget; every other call is PREFER_RECOMPUTE.
    The returned policy is decided in C++ and never calls Python.

    Memory is accounted by storage, as the allocator sees it: a view or an
    in-place op's output shares its input's storage, so a storage counts once
    however many saved outputs keep it, a view of a saved output costs
    nothing extra, and a view saved without its base still keeps the whole
    base storage. Storages from outside the region (parameters, buffers, the
    region's inputs) cost nothing: they are alive anyway. An op whose output
    is mutated in place later in the region is never saved (the cache would
    hand back the mutated values).

    Args:
        fn: the region: the function you checkpoint, e.g. one transformer
            block. Pass keyword arguments with ``functools.partial``.
        \*example_args: inputs for the profiling forward, shaped like the real
            ones (the plan is for these shapes).
        bytes (int): the budget: at most this many bytes of saved outputs.
        fraction (float): the budget as a fraction of the region's
            un-checkpointed activation memory (the distinct storages autograd
            saves for backward without checkpointing, measured in the
            profiling forward). Pass exactly one of ``bytes`` and ``fraction``.
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
        modules: plan for a whole model: when ``fn`` is an ``nn.Module``
            holding repeated blocks (Hugging Face layers, a ``ModuleList``
            or ``ModuleDict`` of blocks, or chosen by ``modules=`` as for
            :func:`torch_sac.apply_sac`), ``fn`` is
            called once with the example arguments and each block's real
            arguments (positional and keyword: masks, rotary embeddings) are
            captured; one plan is made per distinct block (class, parameter
            shapes, argument shapes) and a :class:`ModelBudget` is returned,
            which :func:`torch_sac.apply_sac` takes as its policy.
        \*\*example_kwargs: keyword arguments of the call.

    Returns:
        A :class:`~torch_sac._budget.BudgetPolicy`: pass it to
        :func:`torch_sac.create_selective_checkpoint_contexts`. Its attributes
        describe the plan (``chosen``, ``saved_bytes``, ``budget_bytes``,
        ``activation_bytes``, ``avoided_cost``, ``solver``, ``optimal``, ...);
        ``table()`` prints it; ``with_budget(...)`` re-plans for another
        budget without profiling again.

    Example:
        >>> block = model.layers[0]
        >>> policy = torch_sac.policies.budget(block, x, fraction=0.5)
        >>> print(policy.table())
        >>> ctx_fn = functools.partial(
        ...     torch_sac.create_selective_checkpoint_contexts, policy)
        >>> for layer in model.layers:  # same structure: one plan for all
        ...     x = torch.utils.checkpoint.checkpoint(
        ...         layer, x, use_reentrant=False, context_fn=ctx_fn)

    .. warning::
        ``fn`` really runs once while profiling: side effects such as
        BatchNorm running statistics happen (the global RNG state is
        restored). The plan is for the shapes, dtypes and control flow of the
        example inputs; op calls the plan did not see are recomputed. The
        budget bounds what the region's cache keeps; the region's inputs,
        which checkpointing always keeps, are not part of it. Timings of tiny
        ops are dominated by dispatch overhead: profile with realistic sizes.
    """
    where = "policies.budget"
    if not callable(fn):
        raise TypeError(f"torch_sac.{where}: fn must be callable, got {fn!r} (type {type(fn).__name__})")
    _check_budget(bytes, fraction, where)
    _check_choice(cost, _COSTS, "cost", where)
    _check_choice(solver, _SOLVERS, "solver", where)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"torch_sac.{where}: repeats must be an int >= 0, got {repeats!r}")
    if isinstance(fn, torch.nn.Module) and (modules is not None or _has_blocks(fn)):
        return _model_budget(fn, example_args, example_kwargs, modules, cost, bytes, fraction,
                             solver, repeats, max_states, where)
    profile, _ = profile_region(fn, example_args, example_kwargs,
                                repeats=repeats if cost == "time" else 0,
                                count_flops=cost == "flops")
    return _plan(profile, cost, bytes, fraction, solver, max_states, where)


def _has_blocks(model):
    """A model of blocks (Hugging Face layers, a ModuleList/ModuleDict of
    them), not a block: an ``nn.Sequential`` MLP inside a block does not
    make it a model."""
    from .apply import find_blocks

    return bool(find_blocks(model, containers=(torch.nn.ModuleList, torch.nn.ModuleDict)))


def _signature(module, args, kwargs):
    """What makes two block calls plannable by one plan: the class, the
    parameters' shapes and dtypes, and the arguments' shapes and dtypes (or
    values, for non-tensors)."""
    def describe(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype, v.requires_grad)
        if isinstance(v, (tuple, list)):
            return tuple(describe(x) for x in v)
        return ("value", repr(v))

    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (type(module), params, describe(args),
            tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(v.requires_grad)
    if isinstance(v, tuple):
        return tuple(_detached(x) for x in v)
    if isinstance(v, list):
        return [_detached(x) for x in v]
    return v


def _model_budget(model, args, kwargs, modules, cost, bytes_, fraction, solver, repeats,
                  max_states, where):
    from .apply import _select

    blocks = _select(model, modules)
    calls = {}

    def capture(module, block_args, block_kwargs):
        if module not in calls:
            calls[module] = (_detached(block_args), _detached(block_kwargs))

    handles = [b.register_forward_pre_hook(capture, with_kwargs=True) for b in blocks]
    try:
        with torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [b for b in blocks if b not in calls]
    if missing:
        raise RuntimeError(
            f"torch_sac.{where}: {len(missing)} of the model's {len(blocks)} blocks did not run "
            "in the example call; pass example arguments that run every block")
    plans = {}
    by_block = {}
    for block in blocks:
        block_args, block_kwargs = calls[block]
        key = _signature(block, block_args, block_kwargs)
        if key not in plans:
            profile, _ = profile_region(block, block_args, block_kwargs,
                                        repeats=repeats if cost == "time" else 0,
                                        count_flops=cost == "flops")
            plans[key] = _plan(profile, cost, bytes_, fraction, solver, max_states, where)
        by_block[block] = plans[key]
    names = {m: n for n, m in model.named_modules()}
    return ModelBudget(by_block, names)


class ModelBudget:
    """One budget plan per distinct block of a model: what
    ``torch_sac.policies.budget(model, *args, fraction=...)`` returns.

    Pass it to :func:`torch_sac.apply_sac` as the policy (it is a callable
    ``module -> plan``); ``plans`` maps each block's name to its plan;
    ``table()`` prints each distinct plan once.
    """

    def __init__(self, by_block, names):
        self._by_block = by_block
        self._names = names

    def __call__(self, module):
        try:
            return self._by_block[module]
        except KeyError:
            raise KeyError(
                f"torch_sac: no budget plan for {self._names.get(module, module)!r}: it was not "
                "among the blocks planned") from None

    @property
    def plans(self):
        return {self._names[m]: plan for m, plan in self._by_block.items()}

    @property
    def budget_bytes(self):
        """Summed over blocks: the most the plans let the blocks keep."""
        return sum(plan.budget_bytes for plan in self._by_block.values())

    @property
    def saved_bytes(self):
        return sum(plan.saved_bytes for plan in self._by_block.values())

    def table(self, max_rows=None):
        groups = {}
        for module, plan in self._by_block.items():
            groups.setdefault(id(plan), (plan, []))[1].append(self._names[module])
        parts = []
        for plan, names in groups.values():
            parts.append(f"== blocks {', '.join(names)}\n{plan.table(max_rows)}")
        return "\n\n".join(parts)

    def __repr__(self):
        distinct = len({id(p) for p in self._by_block.values()})
        return (f"ModelBudget({len(self._by_block)} blocks, {distinct} distinct plan(s), "
                f"saved {self.saved_bytes} of budget {self.budget_bytes} bytes)")
