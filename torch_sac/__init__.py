"""torch_sac: selective activation checkpointing at the dispatcher level.

See README.md for usage. ``adapter()`` tells which interception adapter this
process uses.

Modules import only modules of lower layers (docs/design/layers.md;
``scripts/check_import_cycles.py`` checks the graph has no cycle):

1. state: ``_C``, ``_compat``, ``_adapter``, ``policy``, ``_state``,
   ``_ignored_ops``, ``_budget_types``, ``_engines``, ``_build_info``
2. utilities: ``_modes``, ``_compile``, ``_fsdp``, ``scopes``, ``memory``,
   ``offload``, ``schedule``, ``_op_profile``, ``_profile_report``, ``_blocks``,
   ``models``
3. policy conversion: ``_torch_policy``, ``_policy_conversion``
4. engines: ``contexts`` (the drop-in), ``region``, ``checkpointing``
5. planners: the package ``planners`` (``budget_for_region``,
   ``budget_for_model``, ``plan_peak``; its modules in its docstring)
6. front doors: ``policies`` (the built-in policies and the planners),
   ``apply``, ``profiler``, ``_cli_report``, ``cli``, ``demo``, this package
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.utils.checkpoint as _torch_checkpoint

from . import _compat

# Before any of the user's ops: see _compat (oneMKL's first-call race).
_compat.settle_mkl_vml_dispatch()

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
# Adds the installed torch's SAC_IGNORED_OPS to torch_sac's own set before any
# region exists, and computes IGNORED_OPS.
from ._ignored_ops import IGNORED_OPS  # noqa: E402

from . import _compile, _torch_policy, memory, offload, policies  # noqa: E402
from ._adapter import adapter, adapter_reason
from .apply import apply_sac
from .contexts import create_selective_checkpoint_contexts
from .policy import Policy
from .profiler import profile
from .planners import PeakPlan
from .checkpointing import checkpoint, checkpoint_sequential
from .region import ReplayBudget, sac_context
from .schedule import RebuildStep, ReplaySchedule, TensorKey
from .scopes import name

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
    "offload",
    "policies",
    "profile",
    "sac_context",
]


_C.register_policy_enums(Policy, _torch_checkpoint.CheckpointPolicy)
# Side effects of importing torch_sac, explicit here: OpPolicy.to_torch, and
# the compile hooks (a patch of Inductor's CompiledFxGraph.__call__ and Dynamo's
# compile callbacks, applied when torch imports those modules).
_torch_policy.install()
_compile.install()
