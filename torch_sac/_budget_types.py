"""Replay budgets and plans, as the engines take them.

:class:`ReplayBudget`, the check every entry point runs on a
``replay_budget=`` argument, and :class:`RegionPlan`: what the engines
unpack a plan (a :class:`torch_sac.PeakPlan`) into, a forward policy and a
replay budget, without knowing the planner that made it. Imports nothing of
torch_sac.
"""

import collections
import numbers

__all__ = ["ReplayBudget", "RegionPlan", "check_replay_budget", "unpack_plan"]


class ReplayBudget(
    collections.namedtuple("ReplayBudget", ["bytes", "counts_saved", "checkpoint_share"])
):
    """A replay budget, for ``replay_budget=`` of :class:`sac_context`.

    ``ReplayBudget(bytes)`` is the same as ``replay_budget=bytes``: the region
    holds at most ``bytes`` of rebuilt tensors during backward. With
    ``counts_saved=True`` the outputs the policy kept in forward count too
    while they are alive (autograd frees each once backward is past it), so
    the room a kept checkpoint leaves goes to rebuilds. That is how a plan
    whose forward keeps the first sweep of an optimal reversal runs
    (:func:`torch_sac.policies.plan_peak`).
    ``checkpoint_share`` (in (0, 1], default 0.5): when the replay's cuts
    are of several sizes, the most of what is free that goes to
    checkpoints; the rest goes to the tensors backward needs next.
    """

    __slots__ = ()

    def __new__(
        cls, bytes: int, counts_saved: bool = False, checkpoint_share: float = 0.5
    ) -> "ReplayBudget":
        if isinstance(bytes, bool) or not isinstance(bytes, numbers.Integral):
            raise TypeError(f"torch_sac.ReplayBudget: bytes must be an int, got {bytes!r}")
        if bytes < 0:
            raise ValueError(f"torch_sac.ReplayBudget: bytes must be >= 0, got {bytes}")
        if not isinstance(counts_saved, bool):
            raise TypeError(
                f"torch_sac.ReplayBudget: counts_saved must be a bool, got {counts_saved!r}"
            )
        if (
            isinstance(checkpoint_share, bool)
            or not isinstance(checkpoint_share, numbers.Real)
            or not 0 < checkpoint_share <= 1
        ):
            raise ValueError(
                f"torch_sac.ReplayBudget: checkpoint_share must be in (0, 1], got {checkpoint_share!r}"
            )
        return super().__new__(cls, int(bytes), counts_saved, float(checkpoint_share))


def check_replay_budget(replay_budget, where):
    """None, or a :class:`ReplayBudget` from one or an int number of bytes >= 0."""
    if replay_budget is None or isinstance(replay_budget, ReplayBudget):
        return replay_budget
    if isinstance(replay_budget, bool) or not isinstance(replay_budget, numbers.Integral):
        raise TypeError(
            f"torch_sac.{where}: replay_budget must be an int number of bytes, a "
            f"torch_sac.ReplayBudget or None, got {replay_budget!r}"
        )
    if replay_budget < 0:
        raise ValueError(
            f"torch_sac.{where}: replay_budget must be >= 0 bytes, got {replay_budget}"
        )
    return ReplayBudget(int(replay_budget))


class RegionPlan:
    """Base class of plans that run as one region with a replay budget
    (:class:`torch_sac.PeakPlan`): ``policy()`` is the forward policy,
    ``replay_budget`` the budget backward runs with."""

    replay_budget = None

    def policy(self):
        raise NotImplementedError


def unpack_plan(policy, replay_budget):
    """A :class:`RegionPlan` (a :class:`~torch_sac.PeakPlan`) is its forward
    policy plus its replay budget (a budget given explicitly overrides the
    plan's); any other policy passes through."""
    if not isinstance(policy, RegionPlan):
        return policy, replay_budget
    return policy.policy(), policy.replay_budget if replay_budget is None else replay_budget
