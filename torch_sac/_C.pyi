# Type stub for torch_sac._C, the pybind11 extension built from csrc/python/.
#
# Written by hand from the bindings (csrc/python/bindings.cpp and the
# register_* functions of budget_bindings.cpp, frame_exit_watch.cpp,
# policy_library.cpp, python_key_adapter.cpp). Keep it in step with them:
# tests/python/test_c_stub.py checks that every name the module exports is
# here and the other way round, and that parameter names match the bound ones.
# Parameters bound without py::arg (pybind11 names them arg0, arg1, ...) can
# only be passed by position: they come before `/` here.
#
# _C is internal: the public API is torch_sac's Python modules.

from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, final

import torch
from torch.utils.checkpoint import CheckpointPolicy

# (qualified op name, call index, output index): a tensor of a region's tape,
# as in torch_sac.TensorKey.
_TensorKey = tuple[str, int, int]
# (unpacked, keep, release): one rebuild of a replay schedule, as in
# torch_sac.RebuildStep.
_RebuildStep = tuple[_TensorKey, Sequence[_TensorKey], Sequence[_TensorKey]]
# One op_details() row: op, saved, dropped, replayed, saved_bytes,
# dropped_bytes, replay_ns, offloaded, offloaded_bytes, kept_anyway,
# kept_anyway_bytes (int), replays_by_call (list[int]) and kept_why (str).
_OpDetailsRow = dict[str, Any]

# pyproject.toml's version, compiled in by CMake (TORCH_SAC_VERSION); the
# same as torch_sac.__version__.
__version__: str

# --- Policies --------------------------------------------------------------

class OpPolicy:
    """A C++ checkpoint policy (torch_sac::OpPolicy)."""

    def __repr__(self) -> str: ...
    # Added by policy_library.cpp; torch_sac/_torch_policy.py calls them.
    def _needs_call_index(self) -> bool: ...
    def _decide_torch(
        self,
        op: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        output: object,
        call_index: int,
        names: Sequence[str] | None,
    ) -> int: ...
    # Added in Python by torch_sac/_torch_policy.py when torch_sac is imported;
    # returns a torch_sac._torch_policy.TorchPolicy.
    def to_torch(self) -> Callable[..., CheckpointPolicy]: ...

class SavedCallsPolicy(OpPolicy):
    """Saves exactly the given (op, overload, call index) calls (budget plans),
    and offloads the ``offloaded`` ones (PREFER_OFFLOAD)."""

    def __init__(
        self,
        calls: Sequence[tuple[str, str, int]],
        label: str = "",
        offloaded: Sequence[tuple[str, str, int]] = (),
    ) -> None: ...
    @property
    def num_saved_calls(self) -> int: ...
    @property
    def num_offloaded_calls(self) -> int: ...

def register_policy_enums(sac_policy: object, torch_policy: object, /) -> None:
    """Records torch_sac.Policy and torch.utils.checkpoint.CheckpointPolicy."""

def python_policy(fn: Callable[..., object], /) -> OpPolicy:
    """Wraps ``fn(ctx, op, *args, **kwargs)`` (torch's policy_fn signature)."""

def save_ops(ops: Sequence[tuple[str, str | None]], /) -> OpPolicy:
    """(qualified name, overload or None for every overload) pairs."""

def every_nth(ops: Sequence[tuple[str, str | None]], n: int, /) -> OpPolicy: ...
def save_all() -> OpPolicy: ...
def recompute_all() -> OpPolicy: ...
def save_matmuls() -> OpPolicy: ...
def offload_ops(ops: Sequence[tuple[str, str | None]], /) -> OpPolicy:
    """PREFER_OFFLOAD for the listed ops, PREFER_RECOMPUTE for the rest."""

def offload_matmuls() -> OpPolicy: ...
def save_by_name(names: Sequence[str]) -> OpPolicy: ...
def matmul_op_names() -> list[str]:
    """The ops save_matmuls saves, as qualified names."""

# --- Ops never shown to a policy ---------------------------------------------

def ignored_op_names() -> list[tuple[str, str]]:
    """(qualified name, overload name) of every ignored op."""

def add_ignored_ops(names: Sequence[tuple[str, str]]) -> None:
    """Adds ("ns::name", overload) pairs to the ignored set; import time only."""

# --- Interception --------------------------------------------------------------

class OpHandler:
    """Receives every intercepted op (torch_sac::OpHandler); made in C++ only."""

@final
class CachingHandler(OpHandler):
    """The drop-in's forward handler (SelectiveCheckpoint.caching)."""

@final
class CachedHandler(OpHandler):
    """The drop-in's recompute handler (SelectiveCheckpoint.cached)."""

@final
class OpaqueCode:
    """While alive on a thread, handlers let ops through (compiled code runs)."""

    def __init__(self) -> None: ...

def interception_paused() -> bool: ...

# The dispatch-key adapter.
def key_adapter_unavailable_reason() -> str:
    """Empty when the key adapter works under the running torch."""

def install_key_adapter() -> None: ...
def key_adapter_runs_below_modes() -> bool: ...
def push_key_handler(handler: OpHandler, /) -> None: ...
def pop_key_handler(handler: OpHandler, /) -> None: ...
def key_handler_depth() -> int: ...

# The Python-key adapter.
class HandlerModeBase:
    """Base of torch_sac's TorchDispatchMode: __torch_dispatch__ in C."""

    # TorchDispatchMode's signature, which subclasses also inherit from; at
    # runtime the C method takes 3 or 4 arguments, by position only.
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs the op through torch_sac's C++ handler."""

    def _set_handler(self, handler: OpHandler, /) -> None:
        """Binds the C++ op handler."""

def built_with_torch() -> str:
    """The torch release (major.minor.patch) whose headers this module was built with."""

# --- Frame-exit watch ----------------------------------------------------------

def watch_frame_exit(frame: FrameType, callback: Callable[[], object]) -> int:
    """Calls callback() when ``frame`` (running on this thread) returns or is
    unwound by an exception; returns a token for unwatch_frame_exit."""

def unwatch_frame_exit(token: int) -> None:
    """Cancels a watch of this thread (no-op for an unknown token)."""

def frame_exit_watches() -> int:
    """Watches pending on this thread."""

def frame_exit_watch_backend() -> str:
    """How watches see frames end: 'sys.monitoring' (Python >= 3.12, a tool id
    of torch_sac's own was free) or 'profile function'."""

# --- The drop-in engine (create_selective_checkpoint_contexts, checkpoint) ------

@final
class SelectiveCheckpoint:
    def __init__(self, policy: OpPolicy, allow_cache_entry_mutation: bool) -> None: ...
    @property
    def caching(self) -> CachingHandler: ...
    @property
    def cached(self) -> CachedHandler: ...
    def begin_forward(self) -> None: ...
    def finish_forward(self) -> None: ...
    def begin_recompute(self) -> None: ...
    def finish_recompute(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def op_summary(self) -> list[tuple[str, int, int, int]]:
        """(op, saved, dropped, recomputed) per op overload."""

    def op_details(self) -> list[_OpDetailsRow]: ...
    # Added by policy_library.cpp: (OpOverload, call index) pairs forward cached.
    def saved_calls(self) -> list[tuple[object, int]]: ...

# --- The region engine (sac_context) ---------------------------------------------

@final
class SavedActivation:
    """What autograd's saved-tensor hooks hold for a region (Region.pack_hook())."""

@final
class Region(OpHandler):
    def __init__(
        self,
        policy: OpPolicy,
        allow_cache_entry_mutation: bool,
        replay_budget: int = -1,
        budget_counts_saved: bool = False,
        checkpoint_share: float = 0.5,
    ) -> None:
        """replay_budget -1: no budget."""

    def push_policy(self, policy: OpPolicy, /) -> None: ...
    def pop_policy(self) -> None: ...
    def close(self) -> None: ...
    def pack_hook(self) -> Callable[[torch.Tensor], SavedActivation]:
        """The saved-tensor pack hook of this region (a builtin, no pybind11 call per tensor)."""

    def set_storage_restorer(
        self,
        restore: Callable[[torch.Tensor], bool],
        done: Callable[[], object],
        /,
    ) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def kept_as_is(self) -> dict[str, tuple[int, int]]:
        """Saved tensors kept as they are, by kind: {kind: (tensors, bytes)}."""
    def set_replay_schedule(self, steps: Sequence[_RebuildStep], /) -> None: ...
    def saved_calls(self) -> list[tuple[str, int]]:
        """(qualified op name, call index) of every call forward saved."""

    def executed_schedule(
        self,
    ) -> list[tuple[_TensorKey, list[_TensorKey], list[_TensorKey]]]: ...
    def op_summary(self) -> list[tuple[str, int, int, int]]:
        """(op, saved, dropped, replayed) per op overload."""

    def op_details(self) -> list[_OpDetailsRow]: ...

def unpack_saved(saved: SavedActivation, /) -> torch.Tensor: ...

# The keys of SelectiveCheckpoint.stats() and Region.stats(), in dict order,
# each with what it counts (csrc/core/stats.h). The drop-in's list ends with
# its deprecated aliases (recomputed_ops, recompute_ns).
def dropin_stat_fields() -> list[tuple[str, str]]: ...
def region_stat_fields() -> list[tuple[str, str]]: ...

# --- Named scopes (torch_sac.name) -------------------------------------------------

def intern_name(name: str, /) -> int:
    """The id of a scope name (the same for the same string)."""

def push_name(id: int) -> int:
    """Opens a scope on this thread; returns the token pop_name needs."""

def pop_name(id: int, depth: int) -> None:
    """Closes the scope push_name opened; raises if closed out of order."""

def active_names() -> list[str]:
    """The scope names open on this thread, outermost first."""

# --- Offloading to host memory (torch_sac.offload) -------------------------------

def offload_options() -> dict[str, int | bool]: ...
def set_offload_options(
    host_limit_bytes: int,
    min_bytes: int,
    prefetch_bytes: int,
    keep_last_bytes: int,
    cpu_stand_in: bool,
    time_copies: bool,
) -> None:
    """Raises ValueError on a negative size (host_limit_bytes may be -1)."""

def offload_stats() -> dict[str, int]: ...
def offload_copy_times() -> dict[str, dict[str, int]]:
    """The timed copies and waits per op (the op that made the storage)."""

def offload_host_in_use_bytes() -> int: ...
def offload_reset_peaks() -> None: ...
def offload_synchronize(trim: bool) -> None:
    """Waits for every copy still running (releases the GIL)."""

# --- Memory measurement (torch_sac.memory) ---------------------------------------

def install_counting_allocator() -> None: ...
def counting_allocator_installed() -> bool: ...
@final
class CpuMemoryStats:
    @property
    def allocated(self) -> int: ...
    @property
    def peak(self) -> int: ...
    @property
    def allocs(self) -> int: ...
    @property
    def frees(self) -> int: ...

def cpu_memory_stats() -> CpuMemoryStats: ...
def reset_cpu_peak() -> None: ...
@final
class CpuPeakWindow:
    def __init__(self) -> None: ...
    @property
    def start(self) -> int: ...
    @property
    def peak(self) -> int: ...
    @property
    def current(self) -> int: ...
    @property
    def retained(self) -> int: ...
    @property
    def is_open(self) -> bool: ...
    def close(self) -> None: ...

# --- Budget planner (policies/budget_solver.h) -----------------------------------

def budget_solve(
    storage_bytes: Sequence[int],
    values: Sequence[float],
    item_storages: Sequence[Sequence[int]],
    capacity: int,
    solver: str = "auto",
    max_states: int = 2000000,
    max_enumeration_bits: int = 12,
) -> dict[str, Any]:
    """Set-union knapsack over op calls (see policies/budget_solver.h).

    Returns chosen (list[int]), bytes, value, upper_bound, optimal, method,
    groups, states, seconds and note.
    """
