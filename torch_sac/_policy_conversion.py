"""Turns what users pass as a policy into a C++ OpPolicy."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

import torch

from . import _C
from ._budget_types import RegionPlan
from ._torch_policy import TorchPolicy

__all__ = ["PolicyLike", "as_op_policy", "op_patterns"]

#: What torch_sac takes as a policy (for type hints): a built-in or planned
#: policy (an ``OpPolicy``), a plan that brings a replay budget (a
#: ``PeakPlan``), a list of ops to save, or a callable
#: ``policy(ctx, op, *args, **kwargs)``.
PolicyLike = Union[
    _C.OpPolicy,
    RegionPlan,
    Sequence[Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]],
    Callable[..., Any],
]


def op_patterns(ops, where):
    """``[(qualified_name, overload or None)]`` for a list of ops, as
    ``_C.save_ops`` takes them."""
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
            # ValueError, as PyTorch's create_selective_checkpoint_contexts raises.
            raise ValueError(
                f"torch_sac.{where}: {op!r} (type {type(op).__name__}) is not an "
                "op; pass OpOverloads such as torch.ops.aten.mm.default or "
                "packets such as torch.ops.aten.mm (matching every overload)"
            )
    return patterns


def as_op_policy(policy, where):
    """A C++ policy from a built-in policy, a list of ops or a callable."""
    if isinstance(policy, _C.OpPolicy):
        return policy
    if isinstance(policy, TorchPolicy):
        # policy.to_torch() handed back to torch_sac: use the policy itself.
        return policy.policy
    if isinstance(policy, (list, tuple)):
        return _C.save_ops(op_patterns(list(policy), "save_ops"))
    if callable(policy):
        return _C.python_policy(policy)
    if isinstance(policy, RegionPlan):  # a torch_sac.PeakPlan
        raise TypeError(
            f"torch_sac.{where}: a PeakPlan runs as one region, with its replay budget: pass it "
            "to torch_sac.sac_context or torch_sac.checkpoint (plan.policy() is only its "
            "forward half)"
        )
    raise TypeError(
        f"torch_sac.{where}: a policy must be a callable "
        "policy(ctx, op, *args, **kwargs), a list of ops or a "
        f"torch_sac.policies built-in, got {policy!r} (type {type(policy).__name__})"
    )
