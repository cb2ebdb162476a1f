"""torch_sac: selective activation checkpointing at the dispatcher level.

See README.md for usage. ``adapter()`` tells which interception adapter this
process uses.
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.utils.checkpoint as _torch_checkpoint

from . import _C, _compile, memory, policies
from ._adapter import adapter
from .apply import apply_sac
from .contexts import create_selective_checkpoint_contexts
from .policy import Policy
from .profiler import profile
from ._peak_plan import PeakPlan
from .region import ReplayBudget, checkpoint, sac_context
from .schedule import RebuildStep, ReplaySchedule, TensorKey
from .scopes import name
from . import _torch_policy  # noqa: F401  (adds OpPolicy.to_torch)

__all__ = [
    "IGNORED_OPS",
    "PeakPlan",
    "Policy",
    "RebuildStep",
    "ReplayBudget",
    "ReplaySchedule",
    "TensorKey",
    "adapter",
    "apply_sac",
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "memory",
    "name",
    "policies",
    "profile",
    "sac_context",
]


def _ignored_ops():
    ops = set()
    for qualified, overload in _C.ignored_op_names():
        namespace, name = qualified.split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        ops.add(getattr(packet, overload or "default"))
    return frozenset(ops)


#: Ops never passed to a policy: metadata queries and detach, whose count
#: differs between forward and recompute. A superset of PyTorch's
#: ``torch.utils.checkpoint.SAC_IGNORED_OPS``.
IGNORED_OPS = _ignored_ops()

_C.register_policy_enums(Policy, _torch_checkpoint.CheckpointPolicy)
_compile.install()
