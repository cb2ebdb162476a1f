"""How a budget plan reads: its op calls (:class:`PlanItem`), the rows of its
table (:class:`PlanRow`: a call that allocates region memory with the views
and in-place ops using it folded in), and the text of
:meth:`BudgetPolicy.table` and :meth:`ModelBudget.table`."""

from __future__ import annotations

import torch

from .._op_profile import format_bytes

__all__ = ["PlanItem", "PlanRow"]


class PlanItem:
    """One op call of the profiled region and what the plan does with it."""

    __slots__ = ("op", "call_index", "cost", "bytes", "new_bytes", "saveable", "why_not", "saved")

    def __init__(
        self,
        op: torch._ops.OpOverload,
        call_index: int,
        cost: float,
        bytes: int,
        new_bytes: int,
        saveable: bool,
        why_not: str,
        saved: bool,
    ) -> None:
        self.op = op  # OpOverload
        self.call_index = call_index  # per op overload, within the region
        self.cost = cost  # recompute cost (seconds or FLOPs)
        self.bytes = bytes  # bytes of the region storages its outputs keep
        self.new_bytes = new_bytes  # of which it allocated itself (0: view / in-place)
        self.saveable = saveable
        self.why_not = why_not
        self.saved = saved  # MUST_SAVE in the plan

    @property
    def key(self) -> tuple[torch._ops.OpOverload, int]:
        return (self.op, self.call_index)

    def __repr__(self):
        return (
            f"PlanItem({self.op}, call={self.call_index}, cost={self.cost:.4g}, "
            f"bytes={self.bytes}, new_bytes={self.new_bytes}, saved={self.saved})"
        )


class PlanRow:
    """One row of :meth:`BudgetPolicy.table`: an op call that allocates region
    memory, with the calls that use only that memory folded into it.

    A view's outputs share its base's storage and an in-place op's output is
    its input, so saving either costs no memory beyond the storage's
    producer: they are folded into the producer's row, and the row's cost and
    value include theirs.
    """

    __slots__ = ("item", "folded", "cost", "value", "bytes")

    def __init__(
        self, item: PlanItem, folded: list[PlanItem], cost: float, value: float, bytes: int
    ) -> None:
        self.item = item  # PlanItem of the call that allocated the storage
        self.folded = folded  # PlanItems of the views / in-place ops using it
        self.cost = cost  # recompute cost of item and folded calls
        self.value = value  # of which saving could avoid (saveable calls)
        self.bytes = bytes  # bytes of the region storages the calls keep

    @property
    def calls(self) -> list[PlanItem]:
        return [self.item, *self.folded]

    @property
    def saved_calls(self) -> int:
        return sum(it.saved for it in self.calls)

    def __repr__(self):
        return (
            f"PlanRow({self.item.op}, call={self.item.call_index}, folded={len(self.folded)}, "
            f"cost={self.cost:.4g}, value={self.value:.4g}, bytes={self.bytes}, "
            f"saved_calls={self.saved_calls})"
        )


def fold_rows(profile, items):
    """The plan's rows, in region order, and the calls that keep no region
    storage (views of parameters or inputs, in-place ops on them, ops without
    tensor outputs).

    A call that allocates a storage heads a row; a call that allocates
    nothing joins the row that holds its first region storage. A storage
    first made by a call the plan does not see (an ignored op, or one run
    without grad) has no such row: the first call using it heads one.
    """
    storages = profile.storages
    groups = []  # per row: [(record, item) of its head, then of each folded call]
    group_of = {}  # storage index -> the group of the row holding it
    outside = []
    for r, it in zip(profile.records, items):
        internal = [s for s in r.storages if storages[s].internal]
        if not internal:
            outside.append(it)
            continue
        group = None if r.new_storages else group_of.get(internal[0])
        if group is None:
            group = []
            groups.append(group)
        group.append((r, it))
        for s in internal:
            group_of.setdefault(s, group)
    rows = []
    for group in groups:
        calls = [it for _, it in group]
        kept = {s for r, _ in group for s in r.storages if storages[s].internal}
        rows.append(
            PlanRow(
                item=calls[0],
                folded=calls[1:],
                cost=sum(it.cost for it in calls),
                value=sum(it.cost for it in calls if it.saveable),
                bytes=sum(storages[s].nbytes for s in kept),
            )
        )
    return rows, outside


def _packet_name(op):
    """'aten.transpose.int' -> 'transpose'; other namespaces stay: 'mylib.f'."""
    return op._opname if op.namespace == "aten" else f"{op.namespace}.{op._opname}"


def _op_name(op):
    """'aten.addmm.default' -> 'addmm', 'aten.transpose.int' -> 'transpose.int'."""
    name = _packet_name(op)
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _folded_names(items, width=44):
    """'view x5, transpose x4, split': the ops of ``items`` by name, most
    frequent first, cut to about ``width`` characters."""
    counts = {}
    for it in items:
        name = _packet_name(it.op)
        counts[name] = counts.get(name, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    text = ""
    for i, (name, count) in enumerate(ranked):
        part = name if count == 1 else f"{name} x{count}"
        if text and len(text) + len(part) + 2 > width:
            return f"{text}, +{sum(c for _, c in ranked[i:])} more"
        text = f"{text}, {part}" if text else part
    return text


def _decision(item):
    if item.saved:
        return "SAVE"
    if not item.saveable:
        return f"recompute ({item.why_not})"
    return "recompute"


def _render(header, rows):
    """Left-aligned columns under a dashed rule."""
    rows = [header, *rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_cost(c, cost):
    """A recompute cost as text: seconds (``cost="time"``) or FLOPs."""
    if cost == "time":
        scales = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
    else:
        scales = (
            ("TFLOP", 1e12),
            ("GFLOP", 1e9),
            ("MFLOP", 1e6),
            ("kFLOP", 1e3),
            ("FLOP", 1.0),
        )
    for unit, scale in scales:
        if abs(c) >= scale:
            break
    if unit == "FLOP":  # counted, not measured: no fraction
        return f"{c:.0f} FLOP"
    return f"{c / scale:.1f} {unit}"


def _share(policy, c):
    return f"{100.0 * c / policy.total_cost:.1f}%" if policy.total_cost else "-"


def bytes_of(policy, profile, items):
    """Bytes of the distinct region storages ``items`` keep."""
    index = {id(it): r for it, r in zip(policy.items, profile.records)}
    storages = profile.storages
    kept = {s for it in items for s in index[id(it)].storages if storages[s].internal}
    return sum(storages[s].nbytes for s in kept)


def plan_table(policy, profile, max_rows, fold):
    """The text of :meth:`BudgetPolicy.table` for ``policy``, planned from
    ``profile`` (its arguments already checked)."""
    lines = (
        _folded_lines(policy, profile, max_rows) if fold else _call_lines(policy, profile, max_rows)
    )
    return "\n".join(lines + _summary_lines(policy))


def _folded_lines(policy, profile, max_rows):
    shown = policy.rows[:max_rows]
    cells = []
    for row in shown:
        decision = _decision(row.item)
        saved_folded = sum(it.saved for it in row.folded)
        if saved_folded and not row.item.saved:
            # A view taken after its base's last in-place write can be
            # saved though the base cannot: it keeps the base's storage.
            decision += f"; SAVE {saved_folded} folded"
        cells.append(
            (
                _op_name(row.item.op),
                str(row.item.call_index),
                format_cost(row.cost, policy.cost),
                _share(policy, row.cost),
                format_bytes(row.bytes),
                decision,
                _folded_names(row.folded),
            )
        )
    lines = [
        f"{len(policy.items)} op calls in {len(policy.rows)} rows, most valuable first (value: the "
        "recompute cost saving the row avoids);",
        "views and in-place ops are folded into the op whose memory they use, their cost added "
        "to its row",
        *_render(("op", "call", "cost", "share", "bytes", "decision", "folded into it"), cells),
    ]
    hidden = policy.rows[len(shown) :]
    if hidden:
        line = _more_line(
            policy, profile, len(hidden), "rows", [it for row in hidden for it in row.calls]
        )
        unsaveable = [row for row in hidden if row.value == 0 and row.cost > 0]
        if unsaveable:
            # Sorted last, they may hold much of the cost: say so.
            cost = sum(row.cost for row in unsaveable)
            line += (
                f"; {len(unsaveable)} of them cannot be saved ({_share(policy, cost)} of the cost)"
            )
        lines.append(line)
    if policy.outside_calls:
        cost = sum(it.cost for it in policy.outside_calls)
        saved = sum(it.saved for it in policy.outside_calls)
        lines.append(
            f"{len(policy.outside_calls)} op calls keep no region memory (on parameters, buffers or "
            f"inputs), not shown: {_folded_names(policy.outside_calls)}; {_share(policy, cost)} of the "
            f"cost; {saved} saved (free)"
        )
    return lines


def _call_lines(policy, profile, max_rows):
    shown = policy.items[:max_rows]
    cells = [
        (
            str(i),
            _op_name(it.op),
            str(it.call_index),
            format_cost(it.cost, policy.cost),
            _share(policy, it.cost),
            format_bytes(it.bytes),
            format_bytes(it.new_bytes),
            _decision(it),
        )
        for i, it in enumerate(shown)
    ]
    lines = [
        f"{len(policy.items)} op calls, in region order",
        *_render(("#", "op", "call", "cost", "share", "keeps", "allocates", "decision"), cells),
    ]
    hidden = policy.items[len(shown) :]
    if hidden:
        lines.append(_more_line(policy, profile, len(hidden), "calls", hidden))
    return lines


def _more_line(policy, profile, count, what, items):
    cost = sum(it.cost for it in items)
    saved = sum(it.saved for it in items)
    return (
        f"... {count} more {what}: {_share(policy, cost)} of the cost, "
        f"{format_bytes(bytes_of(policy, profile, items))}"
        + (f", {saved} saved call{'s' if saved != 1 else ''}" if saved else "")
    )


def _summary_lines(policy):
    budget = format_bytes(policy.budget_bytes)
    if policy.fraction is not None:
        budget += f" ({policy.fraction:.0%} of activations)"
    measure = "measured time" if policy.cost == "time" else "FLOPs"
    if policy.optimal:
        solver = (f"{policy.solver}, optimal", "proven: no plan within the budget avoids more")
    else:
        gap = format_cost(policy.upper_bound - policy.avoided_cost, policy.cost)
        solver = (
            f"{policy.solver}, within {gap} of optimal",
            "at most this much more could be avoided (a proven bound)"
            + (f" ({policy.solver_note})" if policy.solver_note else ""),
        )
    terms = [
        ("budget", budget, "the most region memory the saved calls may keep"),
        (
            "saved",
            f"{format_bytes(policy.saved_bytes)}, {len(policy.chosen)} of {len(policy.items)} calls",
            "region memory the saved calls keep for backward (storages counted once)",
        ),
        (
            "activations",
            format_bytes(policy.activation_bytes),
            "what autograd keeps for backward without checkpointing",
        ),
        ("everything", format_bytes(policy.total_bytes), "what saving every call would keep"),
        (
            "avoided",
            f"{format_cost(policy.avoided_cost, policy.cost)} of {format_cost(policy.total_cost, policy.cost)} "
            f"({_share(policy, policy.avoided_cost)})",
            f"recompute cost of the saved calls, of all calls ({measure})",
        ),
        ("solver", *solver),
    ]
    name_w = max(len(t[0]) for t in terms)
    value_w = max(len(t[1]) for t in terms)
    return [f"{name:<{name_w}}  {value:<{value_w}}  {meaning}" for name, value, meaning in terms]


def model_table(budget, by_block, names, max_rows, fold):
    """The text of :meth:`ModelBudget.table`: ``by_block`` maps each block
    to its plan, ``names`` each module to its qualified name."""
    groups = {}
    for module, plan in by_block.items():
        groups.setdefault(id(plan), (plan, []))[1].append(module)
    lines = [
        f"{len(by_block)} blocks, {len(groups)} distinct plan{'s' if len(groups) != 1 else ''}; "
        f"saved {format_bytes(budget.saved_bytes)} of a {format_bytes(budget.budget_bytes)} budget, "
        "summed over blocks"
    ]
    for k, (plan, modules) in enumerate(groups.values(), 1):
        classes = ", ".join(sorted({type(m).__name__ for m in modules}))
        lines += [
            "",
            f"== plan {k} of {len(groups)}: {_name_ranges([names[m] for m in modules])} "
            f"({len(modules)} block{'s' if len(modules) != 1 else ''}, {classes})",
            plan.table(max_rows, fold),
        ]
    return "\n".join(lines)


def _name_ranges(names):
    """'layers.0', 'layers.1', 'layers.2', 'lm_head' -> 'layers.0-2, lm_head':
    runs of consecutive numbered siblings, in the given order."""
    runs = []  # [prefix, first, last] for numbered names, [name] otherwise
    for name in names:
        prefix, _, last = name.rpartition(".")
        if last.isdigit():
            number = int(last)
            if runs and len(runs[-1]) == 3 and runs[-1][0] == prefix and runs[-1][2] == number - 1:
                runs[-1][2] = number
                continue
            runs.append([prefix, number, number])
        else:
            runs.append([name])
    parts = []
    for run in runs:
        if len(run) == 1:
            parts.append(run[0])
        else:
            prefix, first, last = run
            dot = f"{prefix}." if prefix else ""
            parts.append(f"{dot}{first}" if first == last else f"{dot}{first}-{last}")
    return ", ".join(parts)
