"""Offloading saved activations to host memory: the runtime's options and
what it did.

A policy offloads an op's outputs by returning
:attr:`torch_sac.Policy.MUST_OFFLOAD` or :attr:`~torch_sac.Policy.PREFER_OFFLOAD`
(PyTorch's ``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` mean
the same), or with :func:`torch_sac.policies.offload_matmuls` and
:func:`torch_sac.policies.offload_ops`. In every engine (``sac_context``,
``checkpoint``, ``create_selective_checkpoint_contexts``, the C++ API):

- forward copies the outputs device-to-host on a side stream, into a pinned
  host pool reused from step to step, and releases the device memory when
  the copy has completed; the most recently offloaded ``keep_last_bytes``
  stay on the device, because backward needs them first;
- backward brings each one back ahead of its first use, in forward's
  reverse order, up to ``prefetch_bytes`` in flight, and the consuming
  stream waits on the copy (the host never does);
- views share their base's copy; a tensor modified in place after it was
  offloaded raises autograd's error, as a saved tensor does.

What cannot be offloaded: CPU tensors, views whose base another op made,
tensors without strided storage, and (for ``PREFER_OFFLOAD``) tensors below
``min_bytes``. ``PREFER_OFFLOAD`` saves them on the device
(counted as ``offload_fallbacks`` in the engines' stats); ``MUST_OFFLOAD``
raises, naming the op and why.

The options hold for the whole process; set them before the forward::

    torch_sac.offload.set_options(host_limit_bytes=32 << 30)
    with torch_sac.offload.using(keep_last_bytes=0):  # for one block of code
        ...

``cpu_stand_in=True`` offloads CPU tensors too, into a host pool outside
the CPU allocator torch_sac counts (:mod:`torch_sac.memory`), with plain
copies: for tests and for checking what offloading saves without a GPU. It
does not make CPU training faster.

See docs/offload.md for when to offload and the measured tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator

import torch

from . import _C

__all__ = [
    "OffloadOptions",
    "options",
    "set_options",
    "using",
    "stats",
    "copy_times",
    "reset_peak_stats",
    "synchronize",
]


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """The offload runtime's options (see the module's docstring).

    Attributes:
        host_limit_bytes: host memory offloaded activations may take; ``-1``
            means no cap. Default: half of the machine's physical memory.
            Offloading past it raises ``torch.OutOfMemoryError`` naming the
            cap.
        min_bytes: ``PREFER_OFFLOAD`` saves tensors whose storage is smaller
            (default 1 MiB: a copy's fixed cost outweighs what it frees).
        prefetch_bytes: backward's lookahead, bytes brought back ahead of
            their first use and not yet used (default 256 MiB).
        keep_last_bytes: the most recently offloaded bytes stay on the device
            (default 64 MiB): backward uses them first, so no copy could be
            hidden behind compute.
        cpu_stand_in: offload CPU tensors into a stand-in host pool (tests).
        time_copies: time every copy and every wait of compute on one, with
            timing events on the device (a few microseconds per copy; the
            profiler turns it on). The CPU stand-in's copies are timed on
            the host clock either way. Read with :func:`copy_times` and the
            ``*_copy_ns`` / ``waited_ns`` keys of :func:`stats`.
    """

    host_limit_bytes: int
    min_bytes: int
    prefetch_bytes: int
    keep_last_bytes: int
    cpu_stand_in: bool
    time_copies: bool


def options() -> OffloadOptions:
    """The options in effect."""
    return OffloadOptions(**_C.offload_options())


def set_options(**changes) -> OffloadOptions:
    """Changes some options, for the whole process; returns the previous ones.

    Args:
        **changes: fields of :class:`OffloadOptions`.

    Raises:
        TypeError: an unknown option, or a value of the wrong type.
        ValueError: a negative size (``host_limit_bytes`` may be ``-1``).
    """
    previous = options()
    fields = {f.name: f.type for f in dataclasses.fields(OffloadOptions)}
    for name, value in changes.items():
        if name not in fields:
            raise TypeError(
                f"torch_sac.offload.set_options: unknown option {name!r}; "
                f"the options are {', '.join(fields)}"
            )
        wanted = bool if fields[name] in (bool, "bool") else int
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise TypeError(
                f"torch_sac.offload.set_options: {name} must be {wanted.__name__}, got {value!r}"
            )
    _C.set_offload_options(**{**dataclasses.asdict(previous), **changes})
    return previous


@contextlib.contextmanager
def using(**changes) -> Iterator[OffloadOptions]:
    """Sets options for a block of code, and puts the previous ones back.

    Example:
        >>> with torch_sac.offload.using(cpu_stand_in=True, min_bytes=0):
        ...     loss = model(x).sum()
        ...     loss.backward()
    """
    previous = set_options(**changes)
    try:
        yield options()
    finally:
        _C.set_offload_options(**dataclasses.asdict(previous))


def stats() -> dict[str, int]:
    """What the runtime did since the process started, and what it holds now.

    Keys: ``offloaded`` / ``offloaded_bytes`` (storages and bytes copied to
    host memory), ``deduplicated`` (offloads served by an existing copy: views),
    ``kept_last`` / ``kept_last_bytes`` (offloaded storages backward took from
    the device: the last ones), ``reloaded`` / ``reloaded_bytes`` (copies back),
    ``prefetched`` (of which started ahead of their use), ``late`` /
    ``late_bytes`` (reloads the consumer had to wait for: copied on demand, or
    started ahead but not complete at first use on a GPU), ``copying_bytes`` /
    ``peak_copying_bytes`` (device memory held for copies to the host still
    running), ``prefetched_bytes`` / ``peak_prefetched_bytes`` (device memory
    brought back ahead and not yet used), ``d2h_ns`` / ``h2d_ns`` (host time
    spent issuing copies; on the CPU stand-in, the copies themselves),
    ``d2h_copy_ns`` / ``h2d_copy_ns`` / ``waited_ns`` / ``waits`` (the timed
    copies' device time and how long compute waited for them, as
    :func:`copy_times` sums them), ``host_in_use_bytes`` /
    ``host_peak_bytes`` / ``host_reserved_bytes`` /
    ``host_peak_reserved_bytes`` / ``host_chunks_allocated`` (the host pool).
    Peaks count from the last :func:`reset_peak_stats`.
    """
    return dict(_C.offload_stats())


def copy_times() -> dict[str, dict[str, int]]:
    """The timed copies per op (the op whose outputs were offloaded, as
    ``"aten::mm.default"``), since the process started.

    Each value: ``d2h_copy_ns`` and ``h2d_copy_ns`` (device time of the
    copies to host memory and back), ``waited_ns`` (how long compute waited
    for them: a reload not complete when its consumer ran, a write waiting
    for a copy out; the *exposed* copy time) and ``waits`` (the waits
    timed). On a GPU only copies made while ``time_copies`` is on are timed
    (timing events on the copy stream and on the consumer's stream); on the
    CPU stand-in every copy is, and all of its time is waited, since it
    runs on the compute thread. Timings whose events have not completed yet
    are added later (:func:`synchronize` waits for them).

    Example:
        >>> with torch_sac.offload.using(time_copies=True):
        ...     train_step()
        >>> torch_sac.offload.synchronize()
        >>> torch_sac.offload.copy_times()["aten::mm.default"]["waited_ns"]
    """
    return {op: dict(times) for op, times in _C.offload_copy_times().items()}


def reset_peak_stats() -> None:
    """Restarts the peaks of :func:`stats` from what is held now."""
    _C.offload_reset_peaks()


def synchronize(trim: bool = False) -> None:
    """Waits for every copy still running (and, where copies are timed, for
    the timings of copies and waits to be known); with ``trim``, returns the
    host pool's unused chunks."""
    _C.offload_synchronize(trim)


def measure_bandwidth(device: torch.device | str, nbytes: int = 64 << 20, reps: int = 3) -> dict:
    """Measured copy bandwidth between ``device`` and host memory, what the
    planner prices offloading with (``plan_peak(..., offload=...)``).

    On a GPU: copies of ``nbytes`` between the device and pinned host
    memory, timed with CUDA events, the median of ``reps`` each way. On the
    CPU (the stand-in): plain copies between two host buffers, timed on the
    host clock. The figure is what this process gets now: far below the
    link's spec when several GPUs share it.

    Returns:
        ``{"d2h_bytes_per_s": float, "h2d_bytes_per_s": float}``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        d = torch.empty(nbytes, dtype=torch.uint8, device=device)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        d = torch.empty(nbytes, dtype=torch.uint8)
        h = torch.empty(nbytes, dtype=torch.uint8)
    out = {}
    for name, dst, src in (("d2h", h, d), ("h2d", d, h)):
        dst.copy_(src)  # warm-up: page faults, first-use setup
        seconds = []
        for _ in range(reps):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                seconds.append(time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = nbytes / max(statistics.median(seconds), 1e-9)
    return out
