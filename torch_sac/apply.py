"""One line on a whole model: ``torch_sac.apply_sac(model, policy)``."""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as tc

from . import _compile
from ._engines import ENGINES, REGION
from ._policy_conversion import PolicyLike, as_op_policy
from ._blocks import find_blocks, select_blocks  # noqa: F401  (find_blocks: for callers)
from ._budget_types import RegionPlan, ReplayBudget, check_replay_budget, unpack_plan
from .contexts import checkpoint_when_compiling, create_selective_checkpoint_contexts
from .region import sac_context

__all__ = ["apply_sac", "SacHandle"]


def _is_per_module(policy):
    """A callable ``module -> policy`` (one positional parameter), as opposed
    to a policy callable ``policy(ctx, op, *args, **kwargs)``."""
    if not callable(policy) or isinstance(policy, (list, tuple)):
        return False
    try:
        params = list(inspect.signature(policy).parameters.values())
    except (TypeError, ValueError):  # built-ins implemented in C++
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(positional) == 1 and not variadic


class SacHandle:
    """What :func:`apply_sac` returns: per-module statistics and ``remove()``."""

    def __init__(self, names: dict[nn.Module, str], engine: str) -> None:
        self._names = names  # module -> qualified name
        self._engine = engine
        self._last = {}  # name -> the last region / forward context
        self._originals = {}  # module -> (had its own forward, that forward)

    @property
    def modules(self) -> list[str]:
        """Qualified names of the modules this handle checkpoints, in model order."""
        return list(self._names.values())

    def stats(self) -> dict[str, dict[str, Any]]:
        """``{"per_module": {name: stats}, "total": summed stats}`` of each
        module's last checkpointed forward (region stats for ``engine="region"``,
        the drop-in's context stats for ``engine="dropin"``)."""
        per_module = {name: ctx.stats() for name, ctx in self._last.items()}
        total = collections.Counter()
        for s in per_module.values():
            total.update({k: v for k, v in s.items() if isinstance(v, (int, float))})
        return {"per_module": per_module, "total": dict(total)}

    def op_details(self) -> dict[str, list[dict[str, Any]]]:
        """``{name: rows}``: each module's per-op rows of its last forward, as
        ``sac_context.op_details()`` gives them for both engines (a dict per
        op overload: ``op``, ``saved``, ``dropped``, ``saved_bytes``,
        ``dropped_bytes``, ``replayed``, ``replay_ns``, ``replays_by_call``,
        ``offloaded``, ``offloaded_bytes``, ``kept_anyway``,
        ``kept_anyway_bytes``, ``kept_why``;
        for ``engine="dropin"`` replays are the calls recompute re-ran)."""
        return {name: ctx.op_details() for name, ctx in self._last.items()}

    def remove(self) -> None:
        """Puts every module's own ``forward`` back; statistics are dropped."""
        for module, (had_own, forward) in self._originals.items():
            if had_own:
                module.forward = forward
            else:
                del module.forward
        self._originals.clear()
        self._last.clear()

    def _record(self, module, ctx):
        self._last[self._names[module]] = ctx


def apply_sac(
    model: nn.Module,
    policy: PolicyLike | Callable[[nn.Module], PolicyLike],
    modules: type | tuple[type, ...] | Callable[[nn.Module], bool] | None = None,
    engine: str = REGION,
    allow_cache_entry_mutation: bool = False,
    replay_budget: int | ReplayBudget | None = None,
) -> SacHandle:
    """Runs the forward of each selected module of ``model`` under selective
    activation checkpointing, in place; the counterpart of PyTorch's
    ``apply_activation_checkpointing``.

    Args:
        model (nn.Module): the model; modified in place (each selected
            module's ``forward`` is wrapped on the instance: no new modules,
            state-dict keys unchanged).
        policy: as for :class:`torch_sac.sac_context` (a built-in, a list of
            ops, a callable ``policy(ctx, op, *args, **kwargs)``), one for
            every module; or a callable ``module -> policy`` (one positional
            parameter), asked once per module; or a
            :class:`torch_sac.PeakPlan` of a step that starts by calling the
            model (``plan_peak(lambda: model(**batch).loss, ...)``): the
            model's forward then runs as the one region the plan was made
            for, its blocks keeping what the plan chose for each
            (``modules``, ``engine`` and ``replay_budget`` stay at their
            defaults: the plan has them).
        modules: which modules: ``None`` (default) finds the model's repeated
            blocks (Hugging Face ``GradientCheckpointingLayer``s; else the
            children of a ``ModuleList``/``ModuleDict``/``nn.Sequential`` that
            are all of one class, as torchtitan's ``layers``); an
            ``nn.Module`` class or tuple of classes; or a predicate
            ``module -> bool``. A selected module inside another one is left
            alone.
        engine (str): ``"region"`` (``sac_context``: backward replays in C++)
            or ``"dropin"`` (``torch.utils.checkpoint.checkpoint`` with
            torch_sac's contexts: backward re-runs the module's forward).
        allow_cache_entry_mutation (bool): as for ``sac_context``.
        replay_budget (int, optional): as for ``sac_context``, for each
            module's region (``engine="region"`` only). Useful when the
            selected module is large (the whole model, or a stage of it).

    Returns:
        :class:`SacHandle`: ``stats()``, ``op_details()`` per module of its
        last forward, and ``remove()``.

    Example:
        >>> handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
        >>> loss = model(x).sum(); loss.backward()
        >>> handle.stats()["total"]["dropped_bytes"]

    Caveats:
        * Nothing is checkpointed in eval mode or with grad disabled: the
          module's own forward runs.
        * Works before or after ``fully_shard`` (FSDP2 calls the wrapped
          forward inside its hooks) and under ``torch.compile``, where each
          module becomes PyTorch's compiled selective checkpointing with the
          same policy (statistics are then not collected).
        * Hugging Face models: do not also enable their own gradient
          checkpointing on the same layers.
    """
    if engine not in ENGINES:
        raise ValueError(f"torch_sac.apply_sac: engine must be one of {ENGINES}, got {engine!r}")
    if isinstance(policy, RegionPlan):
        if modules is not None or engine != REGION or replay_budget is not None:
            raise ValueError(
                "torch_sac.apply_sac: a PeakPlan is for one region around the model, as it was "
                "planned: pass it without modules=, engine= or replay_budget= (it has its own)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"torch_sac.apply_sac: model must be an nn.Module, got {type(model).__name__}"
            )
        op_policy, planned_budget = unpack_plan(policy, None)
        return _apply(model, [model], lambda m: op_policy, REGION, False, planned_budget)
    check_replay_budget(replay_budget, "apply_sac")
    if replay_budget is not None and engine != REGION:
        raise ValueError(
            "torch_sac.apply_sac: replay_budget needs engine='region' (the drop-in re-runs each "
            "module's forward once in backward, as torch.utils.checkpoint does)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"torch_sac.apply_sac: model must be an nn.Module, got {type(model).__name__}"
        )
    selected = select_blocks(model, modules)
    return _apply(model, selected, policy, engine, allow_cache_entry_mutation, replay_budget)


def _apply(model, selected, policy, engine, allow_cache_entry_mutation, replay_budget):
    """Wraps the forward of each module of ``selected`` (of ``model``)."""
    wanted = set(selected)
    names = {m: n or type(m).__name__ for n, m in model.named_modules() if m in wanted}
    handle = SacHandle({m: names[m] for m in selected}, engine)
    per_module = _is_per_module(policy)
    for module in selected:
        if "forward" in module.__dict__ and getattr(module.forward, "_torch_sac_wrapped", False):
            raise RuntimeError(
                f"torch_sac.apply_sac: {names[module]} is already checkpointed by torch_sac; "
                "call remove() on the earlier handle first"
            )
        chosen = policy(module) if per_module else policy
        op_policy = as_op_policy(chosen, "apply_sac")
        had_own = "forward" in module.__dict__
        handle._originals[module] = (had_own, module.__dict__.get("forward"))
        original = module.forward
        module.forward = _wrap(
            module, original, op_policy, engine, allow_cache_entry_mutation, replay_budget, handle
        )
    return handle


def _wrap(module, original, policy, engine, allow, replay_budget, handle):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not module.training or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            if replay_budget is not None:
                _compile.warn_replay_budget_ignored()
            return checkpoint_when_compiling(original, args, kwargs, policy, allow)
        if engine == REGION:
            with sac_context(
                policy, allow_cache_entry_mutation=allow, replay_budget=replay_budget
            ) as region:
                out = original(*args, **kwargs)
            handle._record(module, region)
            return out
        pair = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=allow)
        handle._record(module, pair[0])
        return tc.checkpoint(
            original, *args, use_reentrant=False, context_fn=lambda: pair, **kwargs
        )

    forward._torch_sac_wrapped = True
    return forward
