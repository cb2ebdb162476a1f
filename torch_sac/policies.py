"""Built-in policies, decided in C++ without calling into Python.

Each returns an object accepted wherever torch_sac takes a policy.
"""

from collections.abc import Iterable

import torch

from . import _C

__all__ = ["save_ops", "save_all", "recompute_all", "save_matmuls", "every_nth"]


def _op_patterns(ops, where):
    if isinstance(ops, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ops = [ops]
    if not isinstance(ops, Iterable) or isinstance(ops, (str, bytes)):
        raise TypeError(f"torch_sac.{where}: expected a list of ops, got {ops!r}")
    patterns = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            patterns.append((op._schema.name, op._schema.overload_name))
        elif isinstance(op, torch._ops.OpOverloadPacket):
            patterns.append((op._qualified_op_name, None))
        else:
            raise TypeError(
                f"torch_sac.{where}: {op!r} (type {type(op).__name__}) is not an "
                "op; pass OpOverloads such as torch.ops.aten.mm.default or "
                "packets such as torch.ops.aten.mm (matching every overload)"
            )
    return patterns


def save_ops(ops):
    """Save the outputs of ``ops``, recompute everything else.

    Args:
        ops: OpOverloads (``torch.ops.aten.mm.default``) and/or
            OpOverloadPackets (``torch.ops.aten.mm``, matching every overload).

    Returns ``MUST_SAVE`` for the listed ops and ``PREFER_RECOMPUTE`` for the
    rest, as PyTorch does for a list of ops.
    """
    return _C.save_ops(_op_patterns(ops, "save_ops"))


def save_all():
    """Save every op's outputs (``PREFER_SAVE``): no recompute, no memory saved."""
    return _C.save_all()


def recompute_all():
    """Recompute every op (``PREFER_RECOMPUTE``): plain activation checkpointing."""
    return _C.recompute_all()


def save_matmuls():
    """Save matrix multiplies, convolutions and attention; recompute the rest.

    Covers mm, addmm, bmm, baddbmm, the convolution ops and the
    scaled-dot-product attention kernels: the expensive ops whose outputs are
    worth their memory (torchtitan's op-level SAC).
    """
    return _C.save_matmuls()


def every_nth(ops, n):
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
    return _C.every_nth(_op_patterns(ops, "every_nth"), n)


# --- budget planner (branch budget) ---------------------------------------
from ._budget import BudgetPolicy, budget  # noqa: E402

__all__ += ["budget", "BudgetPolicy"]
# --- end budget planner -----------------------------------------------------
