"""Turns what users pass as a policy into a C++ OpPolicy."""

from . import _C
from ._torch_policy import TorchPolicy
from .policies import save_ops

__all__ = ["as_op_policy"]


def as_op_policy(policy, where):
    """A C++ policy from a built-in policy, a list of ops or a callable."""
    if isinstance(policy, _C.OpPolicy):
        return policy
    if isinstance(policy, TorchPolicy):
        # policy.to_torch() handed back to torch_sac: use the policy itself.
        return policy.policy
    if isinstance(policy, (list, tuple)):
        return save_ops(list(policy))
    if callable(policy):
        return _C.python_policy(policy)
    from ._peak_plan import PeakPlan  # it runs regions, which convert policies

    if isinstance(policy, PeakPlan):
        raise TypeError(
            f"torch_sac.{where}: a PeakPlan runs as one region, with its replay budget: pass it "
            "to torch_sac.sac_context or torch_sac.checkpoint (plan.policy() is only its "
            "forward half)")
    raise TypeError(
        f"torch_sac.{where}: a policy must be a callable "
        "policy(ctx, op, *args, **kwargs), a list of ops or a "
        f"torch_sac.policies built-in, got {policy!r} (type {type(policy).__name__})"
    )
