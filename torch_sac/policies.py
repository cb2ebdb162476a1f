"""Built-in policies, decided in C++ without calling into Python, and the
planners that make policies from a measured run.

Each built-in returns a policy object (``torch_sac._C.OpPolicy``) accepted
wherever torch_sac takes a policy. ``policy.to_torch()`` turns any of them
into a ``policy_fn`` for PyTorch's own
:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` (also
under ``torch.compile``) that makes the same choices.

The planners live in ``torch_sac.planners`` (a planner layer above the
engines, docs/design/layers.md); this front door exports them:
:func:`budget_for_region` (a :class:`BudgetPolicy` for one region),
:func:`budget_for_model` (a :class:`ModelBudget`, one plan per distinct
block) and :func:`plan_peak` (a :class:`torch_sac.PeakPlan` for a peak of
the whole step) and :func:`frontier` (the curve of peak against step time
of such plans, with the recipes users write by hand on the same axes). :func:`budget` is the older single entry point that
forwards to them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _C
from .planners import (
    BudgetPolicy,
    ModelBudget,
    budget,
    budget_for_model,
    budget_for_region,
    Frontier,
    FrontierPoint,
    TimeRatio,
    frontier,
    plan_peak,
)
from ._policy_conversion import op_patterns

# A torch op as the built-ins take it: an overload or a packet (every overload).
_Op = torch._ops.OpOverload | torch._ops.OpOverloadPacket

__all__ = [
    "save_ops",
    "save_all",
    "recompute_all",
    "save_matmuls",
    "offload_ops",
    "offload_matmuls",
    "every_nth",
    "save_by_name",
    "budget_for_region",
    "budget_for_model",
    "plan_peak",
    "frontier",
    "Frontier",
    "FrontierPoint",
    "TimeRatio",
    "budget",
    "BudgetPolicy",
    "ModelBudget",
    "MATMUL_OPS",
]

#: The ops :func:`save_matmuls` saves, by qualified name (``"aten::mm"``),
#: every overload of each: the matmul-class ops of torch 2.11 to 2.15 that
#: autograd sees (dense, batched, grouped, FP8/int8/int4, sparse), the
#: convolutions, the attention kernels and flash-attn's custom ops. A name
#: the installed torch lacks matches nothing.
MATMUL_OPS = tuple(_C.matmul_op_names())


def save_ops(ops: _Op | Iterable[_Op]) -> _C.OpPolicy:
    """Save the outputs of ``ops``, recompute everything else.

    Args:
        ops: OpOverloads (``torch.ops.aten.mm.default``) and/or
            OpOverloadPackets (``torch.ops.aten.mm``, matching every overload).

    Returns ``MUST_SAVE`` for the listed ops and ``PREFER_RECOMPUTE`` for the
    rest, as PyTorch does for a list of ops.
    """
    return _C.save_ops(op_patterns(ops, "save_ops"))


def save_all() -> _C.OpPolicy:
    """Save every op's outputs (``PREFER_SAVE``): no recompute, no memory saved."""
    return _C.save_all()


def recompute_all() -> _C.OpPolicy:
    """Recompute every op (``PREFER_RECOMPUTE``): plain activation checkpointing."""
    return _C.recompute_all()


def save_matmuls() -> _C.OpPolicy:
    """Save matrix multiplies, convolutions and attention; recompute the rest.

    Covers every op in :data:`MATMUL_OPS`: ``mm``, ``addmm``, ``bmm``,
    ``baddbmm``, the grouped matmuls of mixture-of-experts layers
    (``_grouped_mm``, ``_scaled_grouped_mm``), the FP8 and quantized
    matmuls (``_scaled_mm``, ``_int_mm``, ``_weight_int4pack_mm``, ...),
    the convolutions, the scaled-dot-product attention kernels (CPU, flash,
    efficient, cuDNN) and flash-attn's ops: the expensive ops whose outputs
    are worth their memory (torchtitan's op-level SAC). Under the drop-in
    engine (``create_selective_checkpoint_contexts``) attention with
    ``dropout_p > 0`` is recomputed all the same: a random op served from
    the cache would shift the random numbers of every op recomputed after it.
    """
    return _C.save_matmuls()


def offload_ops(ops: _Op | Iterable[_Op]) -> _C.OpPolicy:
    """Offload the outputs of ``ops`` to host memory, recompute everything else.

    Args:
        ops: OpOverloads and/or OpOverloadPackets, as for :func:`save_ops`.

    Returns ``PREFER_OFFLOAD`` for the listed ops and ``PREFER_RECOMPUTE``
    for the rest. Outputs that cannot be offloaded (CPU tensors, views, ones
    below :attr:`torch_sac.offload.OffloadOptions.min_bytes`) are saved on
    the device instead, so on a CPU model this is :func:`save_ops`. See
    :mod:`torch_sac.offload` for how the copies run.

    Example:
        >>> with torch_sac.sac_context(torch_sac.policies.offload_ops([torch.ops.aten.mm])):
        ...     y = model(x)
    """
    return _C.offload_ops(op_patterns(ops, "offload_ops"))


def offload_matmuls() -> _C.OpPolicy:
    """Offload the outputs of the ops :func:`save_matmuls` saves, recompute the rest.

    The expensive ops' outputs go to host memory instead of staying on the
    device; the cheap ops between them are recomputed from them in backward.
    Same fall-backs as :func:`offload_ops`.
    """
    return _C.offload_matmuls()


def every_nth(ops: _Op | Iterable[_Op], n: int) -> _C.OpPolicy:
    """Save every ``n``-th call of each op in ``ops``, recompute the rest.

    Calls are counted per op overload within one checkpointed region, starting
    at 0; calls 0, n, 2n, ... are saved. The index comes from the region, not
    from a counter in the policy, so recompute cannot shift it (the classic
    "save every other mm" bug).

    Example:
        >>> policy = torch_sac.policies.every_nth(torch.ops.aten.mm, n=2)
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"torch_sac.every_nth: n must be an int, got {n!r}")
    return _C.every_nth(op_patterns(ops, "every_nth"), n)


def save_by_name(*names: str | Iterable[str]) -> _C.OpPolicy:
    r"""Save the outputs of ops run inside the named scopes, recompute the rest.

    JAX's ``save_only_these_names`` for torch_sac: an op is saved
    (``MUST_SAVE``) when at least one scope opened with
    :func:`torch_sac.name` and listed here is open on the thread that runs
    it; any enclosing scope counts, not only the innermost. Every other op
    gets ``PREFER_RECOMPUTE``. The decision is made in C++ from the
    thread-local scope stack, with no Python call per op.

    Args:
        *names (str): scope names, or one list/tuple/set of them. No names
            saves nothing (like :func:`recompute_all`).

    Example:
        >>> # xdoctest: +SKIP
        >>> def block(x):
        >>>     with torch_sac.name("attn_out"):
        >>>         a = attention(x)
        >>>     return mlp(a)
        >>>
        >>> policy = torch_sac.policies.save_by_name("attn_out")
        >>> ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        >>> y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)

    .. note::
        Inside a listed scope, random ops (dropout, ``rand*``, ``bernoulli_``),
        ops that write to an argument (in-place, ``out=``) and ``empty*``
        allocations are still recomputed: serving a random op from the cache
        would shift the RNG stream of the random ops recomputed after it, and
        the others' cached outputs would always trip the mutation check.
        Every other op in the scope is saved, views and cheap pointwise ops
        included: put the scope tightly around the ops worth keeping.
    """
    if len(names) == 1 and isinstance(names[0], (list, tuple, set, frozenset)):
        names = tuple(names[0])
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"torch_sac.save_by_name: scope names must be str, got {n!r} "
                f"(type {type(n).__name__})"
            )
        if not n:
            raise ValueError("torch_sac.save_by_name: scope names must be non-empty strings")
    return _C.save_by_name(list(names))
