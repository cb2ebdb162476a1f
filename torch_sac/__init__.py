"""torch_sac: selective activation checkpointing at the dispatcher level.

See README.md for usage. ``adapter()`` tells which interception adapter this
process uses.
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.utils.checkpoint as _torch_checkpoint

from . import _compat

try:
    from ._build_info import BUILT_WITH_TORCH as _BUILT_WITH_TORCH
except ImportError:  # built without setup.py (a bare CMake build): _C says below
    _BUILT_WITH_TORCH = None
if _BUILT_WITH_TORCH is not None:
    # Before loading _C: under another torch it may not even load.
    _compat.check_built_with(_BUILT_WITH_TORCH)

from . import _C  # noqa: E402

__version__ = _C.__version__  # pyproject.toml's, compiled in by CMake
_compat.check_built_with(_C.built_with_torch())
# The installed torch's SAC_IGNORED_OPS joins torch_sac's own set before any
# region exists (torch 2.15 adds prim.layout.default).
_C.add_ignored_ops(_compat.sac_ignored_ops())

from . import _compile, memory, policies  # noqa: E402
from ._adapter import adapter, adapter_reason
from .apply import apply_sac
from .contexts import create_selective_checkpoint_contexts
from .policy import Policy
from .profiler import profile
from ._peak_plan import PeakPlan
from .checkpointing import checkpoint, checkpoint_sequential
from .region import ReplayBudget, sac_context
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
    "adapter_reason",
    "apply_sac",
    "checkpoint",
    "checkpoint_sequential",
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


#: Ops never passed to a policy, namely metadata queries and detach, whose
#: count differs between forward and recompute. A superset of PyTorch's
#: ``torch.utils.checkpoint.SAC_IGNORED_OPS``.
IGNORED_OPS = _ignored_ops()

_C.register_policy_enums(Policy, _torch_checkpoint.CheckpointPolicy)
_compile.install()
