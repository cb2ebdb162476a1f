"""The public Python API is annotated: every parameter and the return of
each function, class constructor and public method of what
``torch_sac.__all__`` and ``torch_sac.policies.__all__`` export (and of the
public modules' own ``__all__``s)."""

import importlib
import inspect

import pytest

# Reads signatures: nothing runs under an adapter.
pytestmark = pytest.mark.adapter_independent


MODULES = (
    "torch_sac",
    "torch_sac.policies",
    "torch_sac.region",
    "torch_sac.checkpointing",
    "torch_sac.contexts",
    "torch_sac.apply",
    "torch_sac.profiler",
    "torch_sac.memory",
    "torch_sac.scopes",
    "torch_sac.schedule",
    "torch_sac.planners",
)


def _exported():
    seen = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            seen.setdefault(f"{obj.__module__}.{getattr(obj, '__qualname__', name)}", obj)
    return seen


def _callables():
    """(qualified name, function) of every function and public method."""
    out = []
    for qualname, obj in sorted(_exported().items()):
        if not inspect.isclass(obj):
            out.append((qualname, obj))
            continue
        if not obj.__module__.startswith("torch_sac"):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_") and attr not in ("__init__", "__new__", "__call__"):
                continue
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            # Skip what the standard library writes (an Enum's or a
            # namedtuple's __new__).
            if inspect.isfunction(value) and value.__module__.startswith("torch_sac"):
                out.append((f"{qualname}.{attr}", value))
    return out


CALLABLES = _callables()


def test_the_api_has_functions_to_check():
    names = {n for n, _ in CALLABLES}
    for expected in (
        "torch_sac.planners.budget_plan.budget_for_region",
        "torch_sac.planners.budget_plan.BudgetPolicy.table",
        "torch_sac.planners.peak_plan.PeakPlan.load",
        "torch_sac.apply.apply_sac",
        "torch_sac.region.sac_context.__init__",
        "torch_sac.profiler.profile.to_dict",
    ):
        assert expected in names


@pytest.mark.parametrize("qualname, fn", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_annotated(qualname, fn):
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    assert not missing, f"{qualname}: parameters without annotations: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{qualname}: no return annotation"
