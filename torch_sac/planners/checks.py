"""The checks of the planners' arguments (``torch_sac.policies.budget_for_region``,
``budget_for_model``, ``plan_peak`` and ``budget``): each raises the
``TypeError`` or ``ValueError`` the planners document, naming the planner."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from typing import Any, Callable

import torch

__all__ = [
    "COSTS",
    "SOLVERS",
    "check_blocks",
    "check_budget",
    "check_callable",
    "check_choice",
    "check_example_kwargs",
    "check_examples",
    "check_options",
]

COSTS = ("time", "flops")
SOLVERS = ("auto", "exact", "greedy")


def check_budget(bytes_, fraction, where):
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


def check_choice(value, choices, name, where):
    if value not in choices:
        raise ValueError(
            f"torch_sac.{where}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )


# The planners' options: the keyword-only parameters of budget_for_region,
# budget_for_model and plan_peak, all of which budget() takes. budget() uses
# them to tell a misspelled option from a keyword argument of fn.
_OPTIONS = (
    "bytes",
    "fraction",
    "peak_bytes",
    "cost",
    "solver",
    "repeats",
    "max_states",
    "modules",
)


def check_blocks(blocks: object, where: str) -> str | list[torch.nn.Module] | None:
    """``plan_peak``'s ``blocks=``: ``"auto"``, None or modules (a list)."""
    if blocks is None or (isinstance(blocks, str) and blocks == "auto"):
        return blocks
    if isinstance(blocks, torch.nn.Module) or not isinstance(blocks, (list, tuple)):
        raise TypeError(
            f"torch_sac.{where}: blocks must be 'auto', None or a list of modules, got {blocks!r}"
        )
    blocks = list(blocks)
    bad = [b for b in blocks if not isinstance(b, torch.nn.Module)]
    if bad or len(blocks) < 2 or len({id(b) for b in blocks}) != len(blocks):
        raise ValueError(
            f"torch_sac.{where}: blocks must list two or more distinct modules"
            + (f"; {bad[0]!r} is not an nn.Module" if bad else "")
        )
    return blocks


def check_callable(fn: object, where: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"torch_sac.{where}: fn must be callable, got {fn!r} (type {type(fn).__name__})"
        )


def check_examples(
    example_args: object, example_kwargs: object, where: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``example_args`` as a tuple and ``example_kwargs`` as a dict, or a
    ``TypeError`` naming the keyword that has the wrong type."""
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(
            f"torch_sac.{where}: example_args must be a tuple or list of fn's positional "
            f"arguments, got {type(example_args).__name__} (one tensor x: example_args=(x,))"
        )
    if example_kwargs is None:
        example_kwargs = {}
    elif not isinstance(example_kwargs, dict):
        raise TypeError(
            f"torch_sac.{where}: example_kwargs must be a dict of fn's keyword arguments or "
            f"None, got {type(example_kwargs).__name__}"
        )
    return tuple(example_args), dict(example_kwargs)


def check_options(
    bytes_: int | None,
    fraction: float | None,
    cost: str,
    solver: str,
    repeats: int,
    where: str,
) -> None:
    """The checks of a bytes/fraction plan's options (``max_states`` is
    checked when the solver runs)."""
    check_budget(bytes_, fraction, where)
    check_choice(cost, COSTS, "cost", where)
    check_choice(solver, SOLVERS, "solver", where)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"torch_sac.{where}: repeats must be an int >= 0, got {repeats!r}")


def _signature_parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    """The parameters of what ``fn(...)`` calls (``forward`` for a module),
    or None when its signature cannot be inspected."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return dict(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # built-ins, some C++ callables
        return None


def check_example_kwargs(
    fn: Callable[..., Any], example_kwargs: dict[str, Any], explicit: str, where: str
) -> None:
    """Raises ``TypeError`` for a keyword budget() would pass on to ``fn``
    that is a misspelled option: one ``fn`` cannot take, or one close to an
    option's name that ``fn`` does not take by name. Nothing is rejected
    when ``fn``'s signature cannot be inspected."""
    if not example_kwargs:
        return
    params = _signature_parameters(fn)
    if params is None:
        return
    by_name = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key in example_kwargs:
        if key in by_name:
            continue
        close = difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.8)
        if not close and takes_any:
            continue
        nearest = (close or difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.0) or ["?"])[0]
        if close:
            what = f"{key}= is not an option; did you mean {nearest}=?"
        else:
            what = (
                f"fn does not take a keyword argument {key}=, and {key}= is not an option "
                f"(the nearest is {nearest}=)."
            )
        raise TypeError(
            f"torch_sac.{where}: {what} budget() passes the keywords it does not know on to "
            f"fn. To pass {key}= to fn, use torch_sac.policies.{explicit}(fn, example_args=..., "
            f"example_kwargs={{{key!r}: ...}}), whose options are keyword-only."
        )
