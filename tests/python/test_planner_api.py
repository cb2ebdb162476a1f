"""The explicit planners (``budget_for_region``, ``budget_for_model``,
``plan_peak``) and ``budget()``, which forwards to them: each returns its
type, agrees with ``budget()`` for the same inputs, and refuses misspelled
options and mistyped example arguments with a ``TypeError``."""

import importlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import torch_sac
from torch_sac.policies import (
    BudgetPolicy,
    ModelBudget,
    budget,
    budget_for_model,
    budget_for_region,
    plan_peak,
)


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x, scale=1.0):
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * scale


class Net(nn.Module):
    def __init__(self, depth=3, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x, scale=1.0):
        for layer in self.layers:
            x = layer(x, scale=scale)
        return x


def _net():
    torch.manual_seed(0)
    return Net()


def _x():
    return torch.randn(4, 8, 16, requires_grad=True)


def _keys(chosen):
    return [(str(op), i) for op, i in chosen]


# --------------------------------------------------------------------------
# Each planner returns its type, the same plan budget() makes
# --------------------------------------------------------------------------


def test_budget_for_region_returns_the_plan_budget_makes():
    block, x = Block(), _x()
    explicit = budget_for_region(block, (x,), fraction=0.5, cost="flops")
    compat = budget(block, x, fraction=0.5, cost="flops")
    assert type(explicit) is BudgetPolicy and type(compat) is BudgetPolicy
    assert explicit.chosen and _keys(explicit.chosen) == _keys(compat.chosen)
    assert explicit.saved_bytes == compat.saved_bytes
    assert explicit.budget_bytes == compat.budget_bytes


def test_budget_for_region_passes_example_kwargs_and_takes_a_list():
    block, x = Block(), _x()
    seen = []

    def fn(x, *, scale):
        seen.append(scale)
        return block(x, scale=scale)

    explicit = budget_for_region(fn, [x], {"scale": 2.0}, bytes=10**6, cost="flops")
    compat = budget(fn, x, scale=2.0, bytes=10**6, cost="flops")
    # Each planner runs fn twice: profiled, then naming the calls as the
    # engines see them.
    assert seen == [2.0] * 4
    assert _keys(explicit.chosen) == _keys(compat.chosen)


def test_budget_for_region_plans_a_model_with_blocks_as_one_region():
    """budget() would plan a model holding blocks per block; the explicit
    region planner never does."""
    model, x = _net(), _x()
    assert isinstance(budget(model, x, fraction=0.5, cost="flops"), ModelBudget)
    explicit = budget_for_region(model, (x,), fraction=0.5, cost="flops")
    assert type(explicit) is BudgetPolicy
    # The same as budget() on a function running the model: one region.
    compat = budget(lambda x: model(x), x, fraction=0.5, cost="flops")
    assert type(compat) is BudgetPolicy
    assert _keys(explicit.chosen) == _keys(compat.chosen)
    assert len(explicit.items) == len(compat.items) > 3 * 3


def test_budget_for_model_returns_the_plans_budget_makes():
    model, x = _net(), _x()
    explicit = budget_for_model(model, (x,), {"scale": 0.5}, fraction=0.5, cost="flops")
    compat = budget(model, x, scale=0.5, fraction=0.5, cost="flops")
    assert type(explicit) is ModelBudget and type(compat) is ModelBudget
    assert list(explicit.plans) == list(compat.plans) == ["layers.0", "layers.1", "layers.2"]
    for name, plan in explicit.plans.items():
        assert type(plan) is BudgetPolicy
        assert _keys(plan.chosen) == _keys(compat.plans[name].chosen)
    assert explicit.saved_bytes == compat.saved_bytes
    # It is apply_sac's policy, as budget()'s.
    handle = torch_sac.apply_sac(model, explicit)
    try:
        model(x).sum().backward()
        assert handle.stats()["total"]["saved_ops"] > 0
    finally:
        handle.remove()


def test_budget_for_model_takes_modules():
    model, x = _net(), _x()
    explicit = budget_for_model(model, (x,), modules=Block, bytes=10**6, cost="flops")
    compat = budget(model, x, modules=Block, bytes=10**6, cost="flops")
    assert list(explicit.plans) == list(compat.plans)


def test_budget_for_model_refuses_what_is_not_a_model_of_blocks():
    block, x = Block(), _x()
    with pytest.raises(TypeError, match="nn.Module.*budget_for_region"):
        budget_for_model(lambda x: block(x), (x,), fraction=0.5)
    with pytest.raises(ValueError, match="no repeated blocks.*budget_for_region"):
        budget_for_model(block, (x,), fraction=0.5)


def _step(model, x):
    return lambda: model(x).pow(2).mean()


def test_plan_peak_returns_the_plan_budget_makes():
    model, x = _net(), _x()
    step = _step(model, x)
    roomy = plan_peak(step, peak_bytes=1 << 40)
    assert type(roomy) is torch_sac.PeakPlan and roomy.solver == "none needed"
    target = int(roomy.no_checkpoint_peak * 0.7)
    explicit = plan_peak(step, peak_bytes=target)
    compat = budget(step, peak_bytes=target)
    assert type(explicit) is torch_sac.PeakPlan and type(compat) is torch_sac.PeakPlan
    # Both search alike; a plan over blocks weighs options by measured
    # time, so two searches may choose differently: both fit.
    assert explicit.measured_peak <= target and compat.measured_peak <= target
    # Over the op chain (no blocks: costs are estimated, not measured) the
    # same search makes the same plan.
    explicit = plan_peak(step, peak_bytes=target, blocks=None)
    again = plan_peak(step, peak_bytes=target, blocks=None)
    assert explicit.saved == again.saved and explicit.replay_budget == again.replay_budget
    assert explicit.solver == again.solver and explicit.replayed_ops == again.replayed_ops


def test_budget_forwards_peak_bytes_to_plan_peaks_search(monkeypatch):
    from torch_sac.planners import budget_plan

    calls = []

    def fake(fn, args, kwargs, peak_bytes, where, blocks="auto", offload=None):
        calls.append((fn, args, kwargs, peak_bytes, blocks))
        return "plan"

    monkeypatch.setattr(budget_plan, "plan_for_peak", fake)
    step = _step(_net(), _x())
    assert budget(step, peak_bytes=123) == "plan"
    assert plan_peak(step, peak_bytes=123) == "plan"
    assert calls[0][0] is step and calls[0][3] == 123 and calls[0][4] == "auto"
    assert calls[1][0] is step and calls[1][3] == 123 and calls[1][4] == "auto"


def test_plan_peak_passes_example_arguments():
    model, x = _net(), _x()

    def step(x, *, scale):
        return model(x, scale=scale).pow(2).mean()

    explicit = plan_peak(step, (x,), {"scale": 0.5}, peak_bytes=1 << 40)
    compat = budget(step, x, scale=0.5, peak_bytes=1 << 40)
    assert explicit.no_checkpoint_peak == compat.no_checkpoint_peak


# --------------------------------------------------------------------------
# Misspelled options and mistyped example arguments
# --------------------------------------------------------------------------


def test_explicit_planners_refuse_a_misspelled_option():
    block, model, x = Block(), _net(), _x()
    with pytest.raises(TypeError, match="unexpected keyword argument 'repeat'"):
        budget_for_region(block, (x,), fraction=0.5, repeat=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fractoin'"):
        budget_for_model(model, (x,), fractoin=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'peak'"):
        plan_peak(_step(model, x), peak=1 << 20)
    with pytest.raises(TypeError, match="peak_bytes"):
        plan_peak(_step(model, x))  # required


@pytest.mark.parametrize(
    "make, kwargs, explicit",
    [
        (lambda: Block(), {"fraction": 0.5, "repeat": 2}, "budget_for_region"),
        (lambda: Block(), {"fraction": 0.5, "solvr": "exact"}, "budget_for_region"),
        (lambda: _net(), {"fraction": 0.5, "module": Block}, "budget_for_model"),
        (lambda: _net(), {"fractions": 0.5}, "budget_for_model"),
        (lambda: (lambda x: x.sin().sum()), {"peak_bytes": 1 << 20, "cots": "flops"}, "plan_peak"),
    ],
)
def test_budget_refuses_a_misspelled_option(make, kwargs, explicit):
    """budget() used to pass repeat=2 on to fn, which failed deep inside the
    model; now it names the option meant and the planner to use."""
    fn, x = make(), _x()
    typo = next(k for k in kwargs if k not in ("fraction", "peak_bytes"))
    with pytest.raises(TypeError) as info:
        budget(fn, x, **kwargs)
    message = str(info.value)
    assert f"{typo}=" in message
    assert f"torch_sac.policies.{explicit}(" in message
    assert "example_kwargs=" in message


def test_budget_names_the_nearest_option():
    with pytest.raises(TypeError, match="did you mean repeats="):
        budget(Block(), _x(), fraction=0.5, repeat=2)
    with pytest.raises(TypeError, match="did you mean max_states="):
        budget(Block(), _x(), fraction=0.5, max_state=10)


def test_budget_refuses_a_keyword_fn_cannot_take():
    def fn(x):
        return x.sin()

    with pytest.raises(TypeError, match="fn does not take a keyword argument mask=.*nearest"):
        budget(fn, _x(), fraction=0.5, mask=None)


def test_budget_passes_keywords_fn_takes():
    seen = {}

    def by_name(x, repeat=1, fractions=None):
        """Takes keywords that look like options: never refused."""
        seen.update(repeat=repeat, fractions=fractions)
        return x.sin()

    budget(by_name, _x(), bytes=0, repeat=2, fractions=[1], cost="flops")
    assert seen == {"repeat": 2, "fractions": [1]}

    def any_keyword(x, **kwargs):
        seen.update(kwargs)
        return x.sin()

    budget(any_keyword, _x(), bytes=0, attention_mask="m", cost="flops")
    assert seen["attention_mask"] == "m"
    # ... but one close to an option is refused even with **kwargs.
    with pytest.raises(TypeError, match="did you mean repeats="):
        budget(any_keyword, _x(), bytes=0, repeat=2)


def test_budget_refuses_nothing_when_the_signature_cannot_be_inspected():
    seen = {}

    class Opaque:
        __signature__ = "not a signature"  # inspect.signature raises TypeError

        def __call__(self, x, **kwargs):
            seen.update(kwargs)
            return x.sin()

    budget(Opaque(), _x(), bytes=0, repeat=2, cost="flops")
    assert seen == {"repeat": 2}


@pytest.mark.parametrize(
    "planner, options",
    [
        (budget_for_region, {"fraction": 0.5}),
        (budget_for_model, {"fraction": 0.5}),
        (plan_peak, {"peak_bytes": 1 << 20}),
    ],
)
def test_example_arguments_must_be_a_sequence_and_a_dict(planner, options):
    fn, x = (_net() if planner is budget_for_model else Block()), _x()
    name = planner.__name__
    with pytest.raises(TypeError, match=f"{name}: example_args must be a tuple or list.*Tensor"):
        planner(fn, x, **options)
    with pytest.raises(TypeError, match=f"{name}: example_args must be a tuple or list"):
        planner(fn, {"x": x}, **options)
    with pytest.raises(TypeError, match=f"{name}: example_kwargs must be a dict.*list"):
        planner(fn, (x,), [("scale", 1.0)], **options)
    with pytest.raises(TypeError, match=f"{name}: fn must be callable"):
        planner(42, (x,), **options)


def test_budget_still_forwards_and_checks_as_before():
    block, model, x = Block(), _net(), _x()
    assert type(budget(block, x, fraction=0.5, cost="flops")) is BudgetPolicy
    assert type(budget(model, x, fraction=0.5, cost="flops")) is ModelBudget
    assert type(budget(_step(model, x), peak_bytes=1 << 40)) is torch_sac.PeakPlan
    with pytest.raises(TypeError, match="torch_sac.policies.budget: pass exactly one of"):
        budget(block, x)
    with pytest.raises(ValueError, match="peak_bytes plans fn as one region"):
        budget(_step(model, x), peak_bytes=1 << 20, fraction=0.5)
    with pytest.raises(ValueError, match="cost, solver, repeats and max_states"):
        budget(_step(model, x), peak_bytes=1 << 20, repeats=1)


def test_the_planners_are_exported_from_policies():
    for name in ("budget_for_region", "budget_for_model", "plan_peak", "budget"):
        assert name in torch_sac.policies.__all__
        assert getattr(torch_sac.policies, name).__module__ == "torch_sac.planners.budget_plan"


def test_the_planners_package_exports_what_the_front_doors_do():
    names = ("budget_for_region", "budget_for_model", "plan_peak", "budget")
    for name in names + ("BudgetPolicy", "ModelBudget"):
        assert getattr(torch_sac.planners, name) is getattr(torch_sac.policies, name)
    assert torch_sac.planners.PeakPlan is torch_sac.PeakPlan
    assert BudgetPolicy.__module__ == ModelBudget.__module__ == "torch_sac.planners.budget_plan"
    assert torch_sac.PeakPlan.__module__ == "torch_sac.planners.peak_plan"


def test_no_name_the_planners_export_hides_one_of_their_modules():
    # torch_sac/planners/__init__.py says why: ``import torch_sac.planners.X
    # as m`` would give the exported object, not the module.
    package = Path(torch_sac.planners.__file__).parent
    for path in sorted(package.glob("*.py")):
        if path.stem != "__init__":
            importlib.import_module(f"torch_sac.planners.{path.stem}")
            module = getattr(torch_sac.planners, path.stem)
            assert inspect.ismodule(module), f"torch_sac.planners.{path.stem} is {module!r}"
