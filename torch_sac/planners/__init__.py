"""The planners: make a plan (a policy, or a policy and a replay budget) from
measured runs of a function or a model. Users reach them through
:mod:`torch_sac.policies` (:func:`~torch_sac.policies.budget_for_region`,
:func:`~torch_sac.policies.budget_for_model`,
:func:`~torch_sac.policies.plan_peak`, :func:`~torch_sac.policies.budget`)
and :class:`torch_sac.PeakPlan`.

The parts, each a module of this package (docs/design/layers.md):

* ``budget_plan``: the bytes/fraction planners (``budget_for_region``,
  ``budget_for_model``), their plans ``BudgetPolicy`` and ``ModelBudget``
  and the solver call; ``plan_peak``, which forwards to ``peak_search``, and
  ``budget``, which forwards to the three;
* ``budget_table``: how a budget plan reads (``PlanItem``, ``PlanRow``,
  the text of ``table()``);
* ``peak_plan``: ``PeakPlan``, the peak planner's result, and its JSON form;
* ``peak_search``: the search behind ``plan_peak`` (measured runs: first
  the plan over the step's blocks, then budgets and candidates);
* ``region_numbering``: a profile's op calls renamed as the engines see
  them (a Python dispatch mode makes some composite ops take other
  branches);
* ``block_options``: the step's blocks profiled once, and per block its
  options (what it keeps, those bytes, the seconds backward replays);
* ``chain``: the chain solver, a dynamic program choosing an option per
  block and segments of blocks for a peak;
* ``tradeoff``: the trade-off curve (``frontier``, ``Frontier``): plans at
  several peaks and the recipes users write, measured side by side;
* ``step_state``: what a planning run changes (buffers, ``.grad``), saved
  and put back;
* ``block_calls``: one call of a model capturing each block's arguments;
* ``checks``: the planners' argument checks;
* ``ranks``: what the planners measure, agreed across the ranks of a
  process group, so that every rank makes the same planning runs and the
  same plan.

The profiling they start from is ``torch_sac._op_profile``, a utility below
the engines that the profiler and the CLI use too. The planners run regions,
so this package sits above the engines; the engines take a ``PeakPlan``
without importing it (it subclasses ``torch_sac._budget_types.RegionPlan``).

No module of the package is named after a name the package exports: the
exported name would replace the module as the package's attribute, and
``import torch_sac.planners.X as m`` (or ``monkeypatch.setattr`` with a
dotted path) would reach the function instead of the module. So the module of
``budget`` is ``budget_plan``.
"""

from .budget_plan import (
    BudgetPolicy,
    ModelBudget,
    budget,
    budget_for_model,
    budget_for_region,
    plan_peak,
)
from .budget_table import PlanItem, PlanRow
from .tradeoff import Frontier, FrontierPoint, TimeRatio, frontier
from .peak_plan import PeakPlan

__all__ = [
    "budget",
    "budget_for_model",
    "budget_for_region",
    "plan_peak",
    "frontier",
    "Frontier",
    "FrontierPoint",
    "TimeRatio",
    "BudgetPolicy",
    "ModelBudget",
    "PeakPlan",
    "PlanItem",
    "PlanRow",
]
