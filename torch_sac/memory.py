"""Measuring tensor memory on CPU and CUDA.

CPU torch keeps no allocator statistics, so torch_sac counts CPU tensor memory
with an allocator of its own, installed in front of torch's CPU allocator
(``c10::SetCPUAllocator``). On CUDA the caching allocator's statistics are
used. See the "Measuring memory" section of ``docs/design.md`` for what is and
is not counted.
"""

from __future__ import annotations

import threading
from types import TracebackType

import torch

from . import _C

__all__ = [
    "MemoryTracker",
    "cpu_memory_stats",
    "install_counting_allocator",
    "is_counting_allocator_installed",
    "reset_peak",
    "track",
]


def install_counting_allocator() -> None:
    r"""Install torch_sac's counting CPU allocator (once; later calls do nothing).

    From then on every CPU tensor allocated through torch's CPU allocator is
    counted: :func:`cpu_memory_stats` reports the bytes live and their peak.
    The counting allocator wraps the allocator in effect and forwards every
    allocation and free to it.

    .. warning::
        The install is permanent for the process: there is no uninstall.
        Other code frees raw buffers through whichever CPU allocator is in
        effect at free time, so swapping allocators back and forth would lose
        counts. Measure with :func:`track` (or differences of
        :func:`cpu_memory_stats`) instead. The overhead is a small table
        update per allocation and per free.

    .. note::
        Tensors allocated before the install are not counted, not even when
        they are freed later; they stay valid and are freed by the allocator
        that made them. Install before starting threads that allocate (like
        ``c10::SetCPUAllocator``, the install is not synchronised with
        concurrent allocations).

    Raises:
        RuntimeError: if the current allocator was installed with a higher
            ``c10::SetCPUAllocator`` priority and cannot be replaced.
    """
    _C.install_counting_allocator()


def is_counting_allocator_installed() -> bool:
    """Whether :func:`install_counting_allocator` has run in this process."""
    return _C.counting_allocator_installed()


def cpu_memory_stats() -> dict[str, int]:
    r"""Statistics of the counting CPU allocator.

    Returns:
        A dict with

        * ``allocated``: bytes of CPU tensor memory live now (requested sizes,
          counted since :func:`install_counting_allocator`);
        * ``peak``: the most ``allocated`` has been since the install or the
          last :func:`reset_peak`;
        * ``num_allocs`` / ``num_frees``: allocations that returned memory,
          and how many of them have been freed.

    Raises:
        RuntimeError: if the counting allocator is not installed.

    Example::

        >>> torch_sac.memory.install_counting_allocator()
        >>> before = torch_sac.memory.cpu_memory_stats()["allocated"]
        >>> x = torch.empty(1024, dtype=torch.float32)
        >>> torch_sac.memory.cpu_memory_stats()["allocated"] - before
        4096
    """
    s = _C.cpu_memory_stats()
    return {
        "allocated": s.allocated,
        "peak": s.peak,
        "num_allocs": s.allocs,
        "num_frees": s.frees,
    }


def reset_peak() -> None:
    r"""Restart the CPU peak (``cpu_memory_stats()["peak"]``) at the bytes live now.

    Open :func:`track` windows are not affected: each keeps its own peak.

    Raises:
        RuntimeError: if the counting allocator is not installed.
    """
    _C.reset_cpu_peak()


class MemoryTracker:
    r"""Context manager measuring the tensor memory of a block of code.

    Usually made with :func:`track`. Inside and after the ``with`` block:

    * :attr:`delta`: bytes allocated on the device at exit minus at entry
      (negative if the block freed more than it kept);
    * :attr:`peak`: the highest allocated level during the block, above the
      level at entry (never negative);
    * :attr:`retained`: bytes allocated during the block that are still
      allocated (never negative; frees of memory allocated before the block,
      e.g. a ``zero_grad()`` inside it, do not lower it). CPU only: on CUDA
      it is ``max(delta, 0)``;
    * :attr:`start`: bytes allocated at entry.

    Inside the block both report the values so far; after it they are frozen.
    A tracker may be reused for another ``with`` block, not nested in itself.

    .. note::
        On CPU the first tracker installs the counting allocator (see
        :func:`install_counting_allocator`); CPU trackers nest and may overlap
        across threads without disturbing each other or
        ``cpu_memory_stats()["peak"]`` (at most 64 open at once). Memory
        allocated or freed by other threads during the block is included.

    .. warning::
        On CUDA the figures come from the caching allocator
        (``torch.cuda.memory_allocated`` / ``max_memory_allocated``), which
        rounds each block up (to 512 bytes at least), and entering resets the
        device's peak (``torch.cuda.reset_peak_memory_stats``). Trackers keep
        the peaks of enclosing trackers correct, but other code reading or
        resetting torch's CUDA peak during the block interferes with it.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a :class:`torch.device`
            or a CUDA device index. ``"cuda"`` means the current CUDA device.

    Raises:
        ValueError: for an unknown device or a device type other than CPU
            and CUDA.
        RuntimeError: for a CUDA device when CUDA is not available.
    """

    def __init__(self, device: str | int | torch.device = "cpu") -> None:
        self.device = resolve_device(device)
        self._window = None
        self._start = None
        self._delta = None
        self._peak = None
        self._retained = None

    def __enter__(self) -> MemoryTracker:
        if self._window is not None:
            raise RuntimeError(
                "torch_sac.memory.MemoryTracker: already active; use a new tracker to nest"
            )
        if self.device.type == "cpu":
            install_counting_allocator()
            self._window = _C.CpuPeakWindow()
        else:
            self._window = _CudaWindow(self.device.index)
        self._start = self._window.start
        self._delta = self._peak = self._retained = None
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        window, self._window = self._window, None
        window.close()
        self._delta = window.current - window.start
        self._peak = window.peak - window.start
        self._retained = self._retained_of(window)
        return False

    @staticmethod
    def _retained_of(window):
        retained = getattr(window, "retained", None)
        return retained if retained is not None else max(window.current - window.start, 0)

    @property
    def start(self) -> int:
        """Bytes allocated on the device when the block was entered."""
        self._check_started("start")
        return self._start

    @property
    def delta(self) -> int:
        """Bytes allocated at exit (or now, inside the block) minus at entry."""
        if self._window is not None:
            return self._window.current - self._window.start
        self._check_started("delta")
        return self._delta

    @property
    def retained(self) -> int:
        """Bytes allocated during the block (so far) that are still allocated."""
        if self._window is not None:
            return self._retained_of(self._window)
        self._check_started("retained")
        return self._retained

    @property
    def peak(self) -> int:
        """Highest allocated level during the block (so far), minus the level at entry."""
        if self._window is not None:
            return self._window.peak - self._window.start
        self._check_started("peak")
        return self._peak

    def _check_started(self, what):
        if self._start is None:
            raise RuntimeError(
                f"torch_sac.memory.MemoryTracker.{what}: nothing measured yet; "
                "use the tracker as `with torch_sac.memory.track(device) as m:`"
            )

    def __repr__(self) -> str:
        if self._start is None:
            return f"MemoryTracker(device={str(self.device)!r}, not started)"
        state = "active" if self._window is not None else "done"
        return f"MemoryTracker(device={str(self.device)!r}, {state}, delta={self.delta}, peak={self.peak})"


def track(device: str | int | torch.device = "cpu") -> MemoryTracker:
    r"""Measure the tensor memory a block of code keeps and peaks at.

    Returns a :class:`MemoryTracker`; see it for the details and caveats.

    Args:
        device: ``"cpu"`` (default), ``"cuda"``, ``"cuda:1"``, a
            :class:`torch.device` or a CUDA device index.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        >>> x = torch.randn(32, 64)
        >>> with torch_sac.memory.track("cpu") as m:
        ...     out = model(x)
        >>> m.delta   # activations autograd keeps for backward, plus `out`
        8192
        >>> m.peak    # the Linear output and the ReLU output were live at once
        16384
    """
    return MemoryTracker(device)


def resolve_device(device):
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"torch_sac.memory: device must be a str, torch.device or CUDA index, got {type(device).__name__}"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"torch_sac.memory: invalid CUDA device index {device}")
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"torch_sac.memory: unknown device {device!r}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(
            f"torch_sac.memory: measuring memory on {device.type!r} devices is not supported (only cpu and cuda)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch_sac.memory: cannot measure {device}: CUDA is not available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"torch_sac.memory: no CUDA device {index} (found {torch.cuda.device_count()})"
        )
    return torch.device("cuda", index)


# --------------------------------------------------------------------------
# CUDA: the caching allocator's statistics. Not exercised on the CPU-only CI
# except through a fake `cuda` module in tests/python/test_memory.py.
# --------------------------------------------------------------------------

_cuda_lock = threading.Lock()
_open_cuda_windows = {}  # device index -> open _CudaWindows


class _CudaWindow:
    """Allocated bytes and their peak on one CUDA device between open and close.

    torch keeps a single peak per device, so opening must reset it; first the
    peak reached so far is folded into the windows already open on the device,
    which keeps enclosing windows' peaks correct.
    """

    def __init__(self, index, cuda=torch.cuda):
        self._cuda, self._index = cuda, index
        self._closed = None
        with _cuda_lock:
            siblings = _open_cuda_windows.setdefault(index, [])
            reached = cuda.max_memory_allocated(index)
            for w in siblings:
                w._peak_before = max(w._peak_before, reached)
            cuda.reset_peak_memory_stats(index)
            self.start = cuda.memory_allocated(index)
            self._peak_before = self.start
            siblings.append(self)

    @property
    def current(self):
        if self._closed is not None:
            return self._closed[0]
        return self._cuda.memory_allocated(self._index)

    @property
    def peak(self):
        if self._closed is not None:
            return self._closed[1]
        return max(self._peak_before, self._cuda.max_memory_allocated(self._index))

    def close(self):
        if self._closed is None:
            self._closed = (self.current, self.peak)
            with _cuda_lock:
                _open_cuda_windows[self._index].remove(self)
