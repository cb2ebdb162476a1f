"""Profiling one forward of a region, for the budget planner.

:func:`profile_region` runs ``fn`` once under a Python ``TorchDispatchMode``
and records every op call a selective-checkpoint policy would see, keyed the
way torch_sac's contexts key their cache: (op overload, call index within the
region), ops in :data:`torch_sac.IGNORED_OPS` and ops run with grad disabled
left out. For each call it records the measured time, the FLOPs
(``torch.utils.flop_counter``), and which storages its outputs keep alive, so
that aliasing (views, in-place ops) is accounted for by storage.

:class:`LiveStorages` measures what a forward leaves allocated: the storages
created during it that are still alive afterwards (what autograd, or a
checkpoint's cache, holds for backward).

Profiling is not a hot path: this is plain Python.
"""

import collections
import dataclasses
import math
import statistics
import time
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

from ._ignored_ops import IGNORED_OPS

__all__ = [
    "BlockSpan",
    "OpRecord",
    "StorageRecord",
    "RegionProfile",
    "profile_region",
    "LiveStorages",
]


@dataclasses.dataclass
class StorageRecord:
    """A storage seen during the profiled forward."""

    nbytes: int
    #: Created inside the region (by an op's output). Storages from outside
    #: (parameters, buffers, the region's inputs) are alive anyway: keeping
    #: them costs the region nothing.
    internal: bool
    #: Index of the op call whose output first held it (None: from outside,
    #: or from an op that is not a policy item).
    owner: Optional[int] = None
    #: Saved for backward by autograd in the un-checkpointed forward.
    saved_by_autograd: bool = False
    #: Where autograd saved it, as positions in the records: ``k`` is
    #: between ``records[k - 1]`` (a node saving its output) and
    #: ``records[k]`` (one saving its input). Backward unpacks it near there,
    #: in reverse order.
    saved_at: tuple = ()


@dataclasses.dataclass
class OpRecord:
    """One op call a policy would decide on."""

    op: torch._ops.OpOverload
    call_index: int
    #: Measured time in seconds (median over the call and its replays).
    seconds: float
    #: FLOPs from torch.utils.flop_counter; 0 for ops it does not count.
    flops: int
    #: Indices into RegionProfile.storages held by the outputs (distinct).
    storages: tuple
    #: Those of them this call allocated (its outputs' new storages).
    new_storages: tuple
    #: False when saving it would hand back stale data: an output is mutated
    #: in place later in the region.
    saveable: bool = True
    why_not: str = ""
    #: Indices into RegionProfile.storages of its tensor arguments (distinct).
    inputs: tuple = ()


@dataclasses.dataclass
class BlockSpan:
    """One call of a module ``profile_region`` was asked to bracket."""

    #: Index of the module in ``blocks``.
    block: int
    #: The records of the call are ``records[start:end]``.
    start: int
    end: int
    #: Index into RegionProfile.storages of its first tensor argument's
    #: storage (None: no tensor argument).
    input_storage: Optional[int]


@dataclasses.dataclass
class RegionProfile:
    records: list
    storages: list
    #: Bytes of the distinct region storages autograd saves for backward in
    #: an un-checkpointed forward: the region's activation memory.
    activation_bytes: int
    #: Bytes of the distinct region storages the records' outputs hold: what
    #: saving every op would keep.
    total_bytes: int
    #: The calls of the modules passed as ``blocks``, in call order.
    spans: list = dataclasses.field(default_factory=list)

    def item_bytes(self, record):
        """Bytes of the region storages ``record``'s outputs keep alive."""
        return sum(self.storages[s].nbytes for s in record.storages if self.storages[s].internal)


def _storage_key(t):
    """(key, nbytes) of the storage behind ``t``."""
    try:
        st = t.untyped_storage()
        return st._cdata, st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        # Tensors without a storage (sparse, some subclasses): one of their own.
        return ("tensor", id(t)), t.numel() * t.element_size()


def plain_tensors(t):
    """The plain tensors behind ``t``: itself, or a traceable wrapper
    subclass's inner tensors (a DTensor's local shard), recursively."""
    if not is_traceable_wrapper_subclass_type(type(t)):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from plain_tensors(inner)


def _replayable(func):
    """Ops that can run again without side effects, for timing."""
    if func.namespace not in ("aten", "prims"):
        return False
    if func._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in func.tags


def _sync(tensors):
    for t in tensors:
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


class _ProfileMode(TorchDispatchMode):
    def __init__(self, ignored, repeats, count_flops):
        super().__init__()
        self.ignored = ignored
        self.repeats = repeats
        self.count_flops = count_flops
        self.counts = collections.Counter()
        self.records = []
        self.storages = []
        self.storage_index = {}
        # Keeps every tensor seen alive, so storage addresses are not reused
        # while profiling, and outputs can be checked for later mutation.
        self.keep = []
        self.output_versions = []  # per record: [(tensor, version after the op)]
        if count_flops:
            from torch.utils.flop_counter import flop_registry

            self.flop_registry = flop_registry

    def storage(self, t, internal, owner):
        key, nbytes = _storage_key(t)
        idx = self.storage_index.get(key)
        if idx is None:
            idx = len(self.storages)
            self.storage_index[key] = idx
            self.storages.append(StorageRecord(nbytes, internal, owner))
            self.keep.append(t)
        return idx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and all(is_traceable_wrapper_subclass_type(t) for t in types):
            # As the region: a traceable wrapper subclass (DTensor) runs its
            # own dispatch with this mode still active, and the ops it runs
            # on its inner tensors are the ones profiled and planned.
            return NotImplemented
        kwargs = kwargs or {}
        if torch._C._meta_in_tls_dispatch_include():
            # FakeTensorMode's meta kernels (DTensor's sharding
            # propagation): not the program's ops, as for the engines.
            return func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        # A storage an op reads before any op in the region produced it comes
        # from outside the region.
        read = tuple(dict.fromkeys(self.storage(t, internal=False, owner=None) for t in inputs))
        # Ops under no_grad inside the region count too: the region and the
        # drop-in record them and number their calls (a custom Function's
        # body, a torch.no_grad() block), so the plan's keys must as well.
        recorded = (
            func not in self.ignored
            and not torch.is_inference_mode_enabled()
            and not any(t.is_meta for t in inputs)
        )
        _sync(inputs)
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        _sync(inputs)
        elapsed = [time.perf_counter_ns() - t0]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        recorded = recorded and not any(t.is_meta for t in outputs)
        index = len(self.records) if recorded else None
        known = len(self.storages)
        storages = []
        for t in outputs:
            s = self.storage(t, internal=True, owner=index)
            if s not in storages:
                storages.append(s)
        if not recorded:
            return out
        new = tuple(s for s in storages if s >= known)
        if self.repeats and _replayable(func):
            for _ in range(self.repeats):
                _sync(inputs)
                t0 = time.perf_counter_ns()
                func(*args, **kwargs)
                _sync(inputs)
                elapsed.append(time.perf_counter_ns() - t0)
        flops = 0
        if self.count_flops and func._overloadpacket in self.flop_registry:
            try:
                flops = int(self.flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
            except Exception:  # a shape the counter does not handle: count nothing
                flops = 0
        call_index = self.counts[func]
        self.counts[func] += 1
        self.records.append(
            OpRecord(
                op=func,
                call_index=call_index,
                seconds=statistics.median(elapsed) * 1e-9,
                flops=flops,
                storages=tuple(storages),
                new_storages=new,
                inputs=read,
            )
        )
        # The version each output has once the op returns to autograd: a
        # view's counter becomes its base's (set above this dispatch level);
        # an in-place op's output is bumped there, so it always reads as
        # mutated, as the selective-checkpoint cache sees it too.
        input_versions = {}
        for t in inputs:
            input_versions.setdefault(_storage_key(t)[0], t._version)
        self.output_versions.append(
            [(t, input_versions.get(_storage_key(t)[0], t._version)) for t in outputs]
        )
        self.keep.extend(outputs)
        return out


def cuda_devices(values):
    """Indices of the CUDA devices of the tensors in ``values`` (a pytree),
    sorted: the devices whose RNG state a run on them may change."""
    return sorted(
        {
            t.device.index or 0
            for t in tree_leaves(values)
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"
        }
    )


def profile_region(fn, args, kwargs=None, *, repeats=3, count_flops=True, blocks=()):
    """Runs ``fn(*args, **kwargs)`` once, with grad enabled, and profiles it.

    The global RNG state (CPU and the CUDA devices of the arguments) is
    restored afterwards; other side effects of ``fn`` (BatchNorm running
    statistics, ...) happen once. The calls of the modules in ``blocks`` are
    bracketed (``RegionProfile.spans``). Returns ``(RegionProfile, output)``.
    """
    kwargs = kwargs or {}
    mode = _ProfileMode(IGNORED_OPS, repeats, count_flops)
    saved = []
    spans = []

    def pack(t):
        saved.append((len(mode.records), t))
        return t

    def enter(index):
        def hook(module, block_args, block_kwargs):
            first = next(
                (t for t in tree_leaves((block_args, block_kwargs)) if isinstance(t, torch.Tensor)),
                None,
            )
            storage = None if first is None else mode.storage(first, internal=False, owner=None)
            spans.append(BlockSpan(index, len(mode.records), -1, storage))

        return hook

    def leave(index):
        def hook(module, block_args, block_kwargs, output):
            open_span = next((s for s in reversed(spans) if s.block == index and s.end < 0), None)
            if open_span is not None:
                open_span.end = len(mode.records)

        return hook

    handles = []
    try:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(block.register_forward_hook(leave(i), with_kwargs=True))
        with torch.random.fork_rng(devices=cuda_devices((args, kwargs))), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with mode:
                    out = fn(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    for position, outer in saved:
        # A traceable wrapper subclass (DTensor) saves its inner tensors,
        # as the region packs it.
        for t in plain_tensors(outer):
            key, _ = _storage_key(t)
            idx = mode.storage_index.get(key)
            if idx is not None:
                mode.storages[idx].saved_by_autograd = True
                mode.storages[idx].saved_at += (position,)
    for record, versions in zip(mode.records, mode.output_versions):
        for t, version in versions:
            if t._version != version:
                record.saveable = False
                record.why_not = (
                    "in-place op"
                    if record.op._schema.is_mutable
                    else "output mutated in place later"
                )
                break
    storages = mode.storages
    activation = sum(s.nbytes for s in storages if s.internal and s.saved_by_autograd)
    held = set()
    for r in mode.records:
        held.update(s for s in r.storages if storages[s].internal)
    total = sum(storages[s].nbytes for s in held)
    return RegionProfile(mode.records, storages, activation, total, spans), out


class LiveStorages(TorchDispatchMode):
    """Measures the bytes a forward leaves allocated.

    While entered, remembers (weakly) every storage an op produces that did
    not exist before. ``live_bytes()`` is the size of those still alive:
    after a forward, what the autograd graph (or a checkpoint's cache) keeps
    for backward, plus the forward's outputs (``exclude`` them).

    Example:
        >>> with LiveStorages() as live:
        ...     out = model(x)
        >>> live.live_bytes(exclude=[out])
    """

    def __init__(self):
        super().__init__()
        # storage key -> (weak reference, nbytes, created while entered)
        self._storages = {}

    def _note(self, t, created):
        key, nbytes = _storage_key(t)
        known = self._storages.get(key)
        # A key whose storage died may come back for a new storage at the
        # same address.
        if known is None or known[0].expired():
            try:
                ref = StorageWeakRef(t.untyped_storage())
            except (RuntimeError, NotImplementedError, TypeError):
                return
            self._storages[key] = (ref, nbytes, created)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._note(t, created=False)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t, created=True)
        return out

    def live_bytes(self, exclude=()):
        """Bytes of the storages created while entered that are still alive,
        not counting the storages of the tensors in ``exclude``."""
        excluded = {_storage_key(t)[0] for t in exclude}
        return sum(
            nbytes
            for key, (ref, nbytes, created) in self._storages.items()
            if created and not ref.expired() and key not in excluded
        )


def format_bytes(n):
    """Human-readable bytes: 1536 -> '1.5 KiB'."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
