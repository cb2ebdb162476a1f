"""``torch_sac.profile``: what selective checkpointing kept, dropped and cost.

See :class:`profile`. How it measures is described in the "Profiler" section
of ``docs/design.md``.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import weakref
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _C, memory, offload
from ._adapter import adapter
from ._engines import DROPIN, REGION
from ._op_profile import format_bytes

# The text table and the plots: _profile_report.py (format_flops is
# re-exported: torch_sac.profiler.format_flops, as before).
from ._profile_report import (
    agg_figure,
    format_flops,  # noqa: F401
    format_table,
    plot_kept_dropped,
    plot_timelines,
)
from ._state import observers as _observers
from .contexts import SelectiveContext

__all__ = ["profile", "plot_memory"]

# The format of to_dict()'s output. 2: a region's "engine" is "region" or
# "dropin" (1 said "sac_context" for "region"); from_dict reads both.
FORMAT = "torch_sac.profile/2"
_OLD_FORMATS = {"torch_sac.profile/1": {"sac_context": REGION}}

# Per-op counters read from the regions (sac_context.op_details(), and the
# drop-in forward context's op_details(), which has the same keys).
_OP_FIELDS = (
    "saved",
    "dropped",
    "saved_bytes",
    "dropped_bytes",
    "replayed",
    "replay_ns",
    "offloaded",
    "offloaded_bytes",
    "kept_anyway",
    "kept_anyway_bytes",
)
# The offload runtime's counters a profile reports (torch_sac.offload.stats()),
# as what changed during the profile; peaks since its start.
_OFFLOAD_DELTAS = (
    "offloaded_bytes",
    "reloaded_bytes",
    "prefetched",
    "late",
    "late_bytes",
    "kept_last_bytes",
    "d2h_ns",
    "h2d_ns",
    "d2h_copy_ns",
    "h2d_copy_ns",
    "waited_ns",
    "waits",
)
# Per-op copy times (torch_sac.offload.copy_times()) a profile's op rows
# carry, as what changed during the profile: the copies' device time both
# ways, and how long compute waited for them (exposed).
_COPY_FIELDS = ("copy_ns", "waited_ns")
_OFFLOAD_PEAKS = ("host_peak_bytes", "peak_copying_bytes", "peak_prefetched_bytes")
# Region counters summed into the totals: every counter of the region
# engine's stats (listed once, in csrc/core/stats.h, read here through
# _C.region_stat_fields()) except the levels, peaks and per-pass counts,
# which do not add up over regions. A counter added there is summed here.
_NOT_SUMMED = frozenset(
    {"memo_bytes", "peak_memo_bytes", "peak_held_bytes", "first_rebuild_replayed_ops"}
)
_REGION_FIELDS = tuple(name for name, _ in _C.region_stat_fields() if name not in _NOT_SUMMED)
# Region counters a drop-in pair has, as sums of its op_details() rows; the
# other fields (held copies, autograd's packing, recording time) have no
# drop-in counterpart and are 0.
_DROPIN_SUMS = {
    "saved_ops": "saved",
    "saved_bytes": "saved_bytes",
    "dropped_ops": "dropped",
    "dropped_bytes": "dropped_bytes",
    "replayed_ops": "replayed",
    "replay_ns": "replay_ns",
    "offloaded_ops": "offloaded",
    "offloaded_bytes": "offloaded_bytes",
}


def _op_name(func):
    """``aten::mm.default``: the spelling the region engine uses."""
    return f"{func._schema.name}.{func._overloadname or 'default'}"


def _dropin_stats(stats, details):
    """A drop-in pair's counters in the region fields the totals sum."""
    out = dict.fromkeys(_REGION_FIELDS, 0)
    out["policy_calls"] = stats["policy_calls"]
    for field, key in _DROPIN_SUMS.items():
        out[field] = sum(d[key] for d in details)
    out["offload_fallbacks"] = stats["offload_fallbacks"]
    return out


class _Sampler(TorchDispatchMode):
    """Sees every op dispatched on this thread while the profile is active
    (forward, backward, and torch.utils.checkpoint's recompute; not the
    region engine's replays, which run below the Python key, nor a drop-in
    recompute's cache hits, which its handler's mode above this one answers
    without passing them on). Per op: memory
    after it and its peak, FLOPs, and the forward/backward boundary."""

    def __init__(self, prof):
        super().__init__()
        self._prof = prof

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        prof = self._prof
        if prof._phase == "forward" and torch._C._current_autograd_node() is not None:
            prof._begin_backward_once("first backward op")
        out = func(*args, **kwargs)
        flops = prof._flops_of(func, args, kwargs, out)
        prof._op_done(func, flops)
        return out


class profile:
    r"""Profiles selective activation checkpointing over a block of code.

    For every :class:`torch_sac.sac_context` region (and
    :func:`torch_sac.checkpoint`) and every pair of drop-in contexts
    (:func:`torch_sac.create_selective_checkpoint_contexts` with
    ``torch.utils.checkpoint.checkpoint``, or ``apply_sac(engine="dropin")``)
    whose forward is entered on this thread while the profile is active,
    records per op overload the policy outcome (calls whose new outputs were
    saved or dropped), the bytes kept and dropped, how many times backward
    replayed (or recomputed) the op and how long that took. Around it,
    measures the whole step: activation memory (bytes live after forward
    minus before), the peak, forward, backward and replay time, FLOPs
    (forward, backward and replayed) and the recording overhead of the
    regions. Code that uses no region is profiled too (memory, time, FLOPs):
    run the same step without checkpointing under another profile and pass
    it as ``baseline`` to :meth:`plot`.

    Put one training step's forward and backward in the block. The end of
    forward is detected at the first op autograd's engine runs (or marked
    with :meth:`end_forward`). Results are read when the block exits:
    :meth:`table`, :meth:`to_dict`, :meth:`to_json`, :meth:`plot`,
    :attr:`totals`, :attr:`ops`.

    Args:
        device: where to measure memory: ``"cpu"`` (default; torch_sac's
            counting allocator, installed on first use) or a CUDA device
            (the caching allocator's statistics).
        timeline (bool): sample memory after every op (default ``True``),
            through a ``TorchDispatchMode`` on this thread, for the memory
            curve of :meth:`plot` and for the forward/backward split. It adds
            a few microseconds of Python per op to the step (not to the
            measured replay or recording times). ``False`` samples only at
            region boundaries; then call :meth:`end_forward` to get
            activation memory.
        flops (bool): count FLOPs with :mod:`torch.utils.flop_counter`'s
            formulas (needs ``timeline=True``; default: ``timeline``).
        label (str, optional): a name for tables and plots.

    Example::

        >>> with torch_sac.profile() as prof:
        ...     for block in model.blocks:
        ...         with torch_sac.sac_context(torch_sac.policies.save_matmuls()):
        ...             x = block(x)
        ...     loss = x.square().mean()
        ...     loss.backward()
        >>> print(prof.table())
        >>> prof.totals["activation_bytes"], prof.totals["replay_ns"]
        >>> prof.plot("sac.png", baseline=plain_prof)   # needs matplotlib

    What the numbers are:

    * ``saved``/``dropped``: calls whose *new* outputs the policy kept or
      dropped (views and in-place ops allocate nothing and count in neither);
      ``saved_bytes``/``dropped_bytes``: the storage bytes of those outputs.
      Dropped bytes are what the region does not hold for backward; only the
      part autograd would have saved is a saving.
    * ``activation_bytes``: bytes allocated during forward that are still
      allocated at its end (on CUDA: allocated at the end of forward minus at
      entry, at least 0). Memory freed in the block that was allocated before
      it (a ``zero_grad()``, an optimizer step) does not lower it. It includes the forward's outputs still referenced (the loss,
      and backward's gradient seed when the boundary is detected).
      ``peak_bytes``: the highest level during the block, above the level at
      entry.
    * ``most_replays`` (per op): the most times one call of it was replayed
      (above 1 under a ``replay_budget`` or ``replay_schedule``: multiple
      recomputation; the table then shows a "most per call" column, and
      :meth:`plot` draws the level forward left plus the replay budget).
    * ``replay_ns``: time backward spent replaying dropped ops, measured in
      C++ around each replayed op. ``record_ns``: time the regions spent
      recording ops in forward, outside the ops themselves (the interception
      overhead, not counting the adapter's own dispatch).
    * Drop-in contexts fill the same rows: ``saved``/``dropped`` as above
      (a call the policy saves that forward cannot cache, a random op or
      an output written in place later in forward, is dropped: it is
      recomputed), ``replayed`` the calls recompute re-ran and ``replay_ns``
      their time, measured in C++ around each (with ``timeline=True`` it
      includes this profile's per-op sampling, which recomputed ops pass
      through). Their totals are those sums and the policy calls; the
      fields without a drop-in meaning (``held_bytes``, ``packed_*``,
      ``unpacked_original``, ``record_ns``) are 0.
    * FLOPs follow :class:`torch.utils.flop_counter.FlopCounterMode`:
      matmuls, convolutions and attention; pointwise ops count 0.
      ``forward_flops``/``backward_flops`` count every op dispatched, except
      that the ops a drop-in's recompute re-runs count as its
      ``replay_flops``, not as backward: they are measured per op while its
      recompute context is open on the thread (cache hits run nothing and
      count nothing). Plain ``torch.utils.checkpoint`` (without torch_sac's
      contexts) re-runs forward unseen by the profile: those FLOPs land in
      ``backward_flops``. A region's replays run below the Python key,
      where no mode sees them, so their ``replay_flops`` are computed: per
      region and op, each forward call's FLOPs times the number of times the
      region replayed that call (``replay_flops_exact``). Should the profile
      and the region count an op's calls differently, it falls back to
      replays times their mean, with ``replay_flops_low``/``high`` the
      cheapest/costliest calls.

    Caveats:
        * Regions entered on other threads are not seen; the counting
          allocator counts every thread's CPU tensors. A drop-in's
          recompute is attributed to it on whichever thread backward runs
          it (on CPU, the thread that calls backward).
        * Run backward inside the block: region counters are read at exit,
          and the profile then lets go of the regions. A drop-in pair's
          counters are read when its forward and each recompute end (it is
          held only weakly, so its cached tensors are not kept alive).
        * Tensors allocated before the counting allocator was installed are
          not counted when freed, so the first profile in a process may see
          them as never freed (install it early:
          :func:`torch_sac.memory.install_counting_allocator`).
        * On CUDA the per-op curve samples ``memory_allocated`` (no per-op
          peak), peaks come from ``max_memory_allocated`` (reset at entry),
          and times are host times: synchronise to time kernels.
        * Under ``torch.compile`` the regions and contexts are PyTorch's and
          not profiled.
    """

    def __init__(
        self,
        device: str | int | torch.device = "cpu",
        *,
        timeline: bool = True,
        flops: bool | None = None,
        label: str | None = None,
    ) -> None:
        if not isinstance(timeline, bool):
            raise TypeError(f"torch_sac.profile: timeline must be a bool, got {timeline!r}")
        if flops is None:
            flops = timeline
        if not isinstance(flops, bool):
            raise TypeError(f"torch_sac.profile: flops must be a bool, got {flops!r}")
        if flops and not timeline:
            raise ValueError(
                "torch_sac.profile: counting FLOPs needs timeline=True "
                "(both see ops through the same dispatch mode); pass flops=False"
            )
        if label is not None and not isinstance(label, str):
            raise TypeError(f"torch_sac.profile: label must be a str, got {label!r}")
        self.device = memory.resolve_device(device)
        self._cpu = self.device.type == "cpu"
        self._timeline = timeline
        self._count_flops = flops
        self.label = label
        self._state = "new"  # new -> active -> done
        self._data = None
        self._offload_options = None  # the options before the profile (set while active)

    # ------------------------------------------------------------------
    # Running
    # ------------------------------------------------------------------

    def __enter__(self) -> profile:
        if self._state != "new":
            raise RuntimeError(
                "torch_sac.profile: a profile object records one block; make a new one"
            )
        if self._cpu:
            memory.install_counting_allocator()
        if self._timeline:
            # The first op through any TorchDispatchMode imports torch._dynamo
            # (about a second, once per process): do it outside the step.
            importlib.import_module("torch._dynamo")
        if self._count_flops:
            from torch.utils.flop_counter import flop_registry

            self._flop_registry = flop_registry
        self._regions = []  # per profiled region: a dict (see region_entered)
        self._open = []  # indices into _regions, innermost last
        self._dropins = weakref.WeakKeyDictionary()  # drop-in forward context -> index
        self._recomputing = threading.local()  # .open: drop-in indices, innermost last
        self._phase = "forward"
        self._forward_end = None  # (sample index, how)
        self._fwd_flops = self._bwd_flops = 0
        self._outside_calls = self._outside_flops = 0
        self._t = []  # sample times (ns since entry)
        self._bytes = []  # allocated after the op / at the event, minus at entry
        self._peaks = []  # highest level since the previous sample
        self._labels = []
        self._events = []  # (sample index, kind, region index or None)
        self._whole = memory.MemoryTracker(self.device)
        self._fwd = memory.MemoryTracker(self.device)
        self._bwd = memory.MemoryTracker(self.device)
        self._whole.__enter__()
        self._fwd.__enter__()
        self._start = self._whole.start
        # Copies are timed while the profile runs (timing events on a GPU).
        self._offload_options = offload.set_options(time_copies=True)
        self._offload_start = offload.stats()
        self._copy_times_start = offload.copy_times()
        offload.reset_peak_stats()
        self._host = []  # host memory of offloaded activations, per sample
        self._t0 = time.perf_counter_ns()
        self._t_forward_end = None
        self._lock = threading.Lock()
        self._phase_lock = threading.Lock()
        # CPU: a chain of peak windows, one open at a time, closed and
        # replaced at every sample, so each sample's peak covers everything
        # since the previous one (the op, and replays or autograd's own
        # allocations between ops).
        self._window = _C.CpuPeakWindow() if self._cpu else None
        self._sample("start")
        self._state = "active"
        _observers().append(self)
        self._mode = None
        if self._timeline:
            self._mode = _Sampler(self)
            try:
                self._mode.__enter__()
            except BaseException:
                self._abandon(close_window=True)
                raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._state != "active":
            return False
        t_end = time.perf_counter_ns()
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._abandon()
        self._sample("end", t=t_end, last=True)
        self._events.append((len(self._t) - 1, "end", None))
        self._data = self._build(t_end)
        self._regions = self._open = None  # let go of the regions
        self._state = "done"
        return False

    def _abandon(self, close_window=False):
        observers = _observers()
        if self in observers:
            observers.remove(self)
        if close_window and self._window is not None:
            self._window.close()
            self._window = None
        for tracker in (self._fwd, self._bwd, self._whole):
            if tracker._window is not None:
                tracker.__exit__(None, None, None)
        if self._offload_options is not None:
            offload.set_options(time_copies=self._offload_options.time_copies)
            self._offload_options = None
        self._state = "done"

    def end_forward(self) -> None:
        """Marks the end of forward now: activation memory is measured here.

        Optional with ``timeline=True``, where the first op autograd's engine
        runs marks it. Call it before ``backward()``; a second call, or one
        after backward started, raises.
        """
        if self._state != "active":
            raise RuntimeError("torch_sac.profile.end_forward: the profile is not active")
        with self._phase_lock:
            if self._phase != "forward":
                raise RuntimeError(
                    f"torch_sac.profile.end_forward: forward already ended ({self._forward_end[1]})"
                )
            self._begin_backward("end_forward()")

    # Hooks ---------------------------------------------------------------

    def _current(self):
        if self._cpu:
            return _C.cpu_memory_stats().allocated
        return torch.cuda.memory_allocated(self.device.index)

    def _sample(self, label, t=None, last=False):
        with self._lock:
            window = self._window
            if window is not None:
                window.close()
                allocated, peak = window.current, window.peak
                self._window = None if last else _C.CpuPeakWindow()
            else:
                allocated = peak = self._current()
            t = time.perf_counter_ns() if t is None else t
            self._t.append(t - self._t0)
            self._bytes.append(allocated - self._start)
            self._peaks.append(peak - self._start)
            self._host.append(_C.offload_host_in_use_bytes())
            self._labels.append(label)

    def _begin_backward_once(self, how):
        # Backward may run on several threads at once (CPU and CUDA nodes).
        with self._phase_lock:
            if self._phase == "forward":
                self._begin_backward(how)

    def _begin_backward(self, how):
        self._sample("forward end")
        self._forward_end = (len(self._t) - 1, how)
        self._events.append((len(self._t) - 1, "forward_end", None))
        self._t_forward_end = time.perf_counter_ns()
        self._fwd.__exit__(None, None, None)
        self._bwd.__enter__()
        self._phase = "backward"

    def region_entered(self, ctx: Any) -> None:
        index = len(self._regions)
        dropin = isinstance(ctx, SelectiveContext)
        self._regions.append(
            {
                "ctx": ctx,
                "engine": DROPIN if dropin else REGION,
                "ops": {},
                "recompute_flops": {},
                "counters": None,
                "enter": None,
                "exit": None,
                "replay_budget": None if dropin else ctx._replay_budget,
            }
        )
        if dropin:
            self._dropins[ctx] = index
        self._open.append(index)
        self._sample(f"region {index} enter")
        self._regions[index]["enter"] = len(self._t) - 1
        self._events.append((len(self._t) - 1, "region_enter", index))

    def region_exited(self, ctx: Any) -> None:
        for pos in range(len(self._open) - 1, -1, -1):
            index = self._open[pos]
            if self._regions[index]["ctx"] is ctx:
                del self._open[pos]
                self._sample(f"region {index} exit")
                self._regions[index]["exit"] = len(self._t) - 1
                self._events.append((len(self._t) - 1, "region_exit", index))
                if self._regions[index]["engine"] == DROPIN:
                    self._read_dropin(index, ctx)
                return

    # A drop-in pair's counters are read when its forward and each recompute
    # end instead of at exit: holding its contexts would keep cached outputs
    # that recompute never consumed alive until the profile ends.
    def _read_dropin(self, index, forward):
        self._regions[index]["counters"] = (forward.stats(), forward.op_details())
        self._regions[index]["ctx"] = None

    def _recompute_entered(self, forward):
        index = self._dropins.get(forward) if self._state == "active" else None
        if index is not None:
            if not hasattr(self._recomputing, "open"):
                self._recomputing.open = []
            self._recomputing.open.append(index)

    def _recompute_exited(self, forward):
        index = self._dropins.get(forward) if self._state == "active" else None
        if index is None:
            return
        open_ = getattr(self._recomputing, "open", [])
        for pos in range(len(open_) - 1, -1, -1):
            if open_[pos] == index:
                del open_[pos]
                break
        self._read_dropin(index, forward)

    def _flops_of(self, func, args, kwargs, out):
        if not self._count_flops:
            return 0
        formula = self._flop_registry.get(func._overloadpacket)
        if formula is None:
            return 0
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a shape the formula does not handle: count nothing
            return 0

    def _op_done(self, func, flops):
        self._sample(func)  # the op's name is formatted when the profile is built
        recomputing = getattr(self._recomputing, "open", None)
        if recomputing:
            # A drop-in recompute's op. With this sampler active the handler
            # is entered as the innermost mode (_modes._HandlerMode), so the
            # sampler sees only the ops it runs: cache hits never get here.
            if flops:
                counted = self._regions[recomputing[-1]]["recompute_flops"]
                name = _op_name(func)
                with self._lock:
                    counted[name] = counted.get(name, 0) + flops
            return
        if self._phase == "backward":
            with self._lock:
                self._bwd_flops += flops
            return
        self._fwd_flops += flops
        # Regions and the drop-in record ops under no_grad inside them too
        # (and number their calls): so does the profile, or its call lists
        # and the regions' would differ.
        recorded = not torch.is_inference_mode_enabled()
        if self._open and recorded:
            ops = self._regions[self._open[-1]]["ops"]
            ops.setdefault(_op_name(func), []).append(flops)
        else:
            self._outside_calls += 1
            self._outside_flops += flops

    # ------------------------------------------------------------------
    # Results
    # ------------------------------------------------------------------

    def _build(self, t_end):
        ops = {}
        regions = []
        totals = {k: 0 for k in _REGION_FIELDS}
        exact = True
        replay_low = replay_high = replay_est = 0.0
        region_fwd_flops = 0
        for index, r in enumerate(self._regions):
            dropin = r["engine"] == DROPIN
            stats, details = r["counters"] or (r["ctx"].stats(), r["ctx"].op_details())
            if dropin:
                stats = _dropin_stats(stats, details)
            for k in _REGION_FIELDS:
                totals[k] += stats[k]
            calls = r["ops"]
            # A drop-in's recompute FLOPs were measured per op; an op it ran
            # without itemising it (run while interception was paused) gets a
            # row of its own, so the rows still sum to the totals.
            measured = r["recompute_flops"]
            itemised = {d["op"] for d in details}
            details = list(details) + [
                {"op": op, **dict.fromkeys(_OP_FIELDS, 0)} for op in measured if op not in itemised
            ]
            region_flops = 0
            for d in details:
                row = ops.setdefault(d["op"], _empty_row(d["op"]))
                for k in _OP_FIELDS:
                    row[k] += d[k]
                row["kept_why"] = row["kept_why"] or d.get("kept_why", "")
                row["most_replays"] = max(row["most_replays"], max(d.get("replays_by_call") or [0]))
                flops = calls.get(d["op"], [])
                row["forward_calls"] += len(flops)
                row["forward_flops"] += sum(flops)
                region_flops += sum(flops)
                if dropin:
                    est = low = high = measured.get(d["op"], 0)
                    ok = True
                else:
                    est, low, high, ok = _replay_flops(
                        d["replayed"], flops, d.get("replays_by_call")
                    )
                row["replay_flops"] += est
                row["replay_flops_low"] += low
                row["replay_flops_high"] += high
                row["replay_flops_exact"] = row["replay_flops_exact"] and ok
                replay_est += est
                replay_low += low
                replay_high += high
                exact = exact and ok
            region_fwd_flops += region_flops
            enter, exit_ = r["enter"], r["exit"]
            regions.append(
                {
                    "index": index,
                    "engine": r["engine"],
                    "replay_budget": None
                    if r["replay_budget"] is None
                    else r["replay_budget"].bytes,
                    "replay_budget_counts_saved": (
                        r["replay_budget"] is not None and r["replay_budget"].counts_saved
                    ),
                    "enter_sample": enter,
                    "exit_sample": exit_,
                    "forward_delta_bytes": (
                        None if exit_ is None else self._bytes[exit_] - self._bytes[enter]
                    ),
                    "forward_flops": region_flops if self._count_flops else None,
                    "stats": {k: int(v) for k, v in stats.items()},
                }
            )
        offload.synchronize()  # every copy done, and its timing known
        for op, times in offload.copy_times().items():
            before = self._copy_times_start.get(op, dict.fromkeys(times, 0))
            copy_ns = sum(times[k] - before[k] for k in ("d2h_copy_ns", "h2d_copy_ns"))
            waited_ns = times["waited_ns"] - before["waited_ns"]
            if copy_ns or waited_ns:
                row = ops.setdefault(op, _empty_row(op))
                row["copy_ns"] += copy_ns
                row["waited_ns"] += waited_ns
        flop_keys = ("forward_flops", "replay_flops", "replay_flops_low", "replay_flops_high")
        rows = []
        for row in ops.values():
            for k in flop_keys:
                row[k] = _round(row[k]) if self._count_flops else None
            if not self._count_flops:
                row["replay_flops_exact"] = None
            rows.append(row)
        fwd_end = self._forward_end
        step_ns = t_end - self._t0
        forward_ns = (self._t_forward_end - self._t0) if fwd_end else step_ns
        totals.update(
            {
                "regions": len(regions),
                "activation_bytes": self._fwd.retained if fwd_end else None,
                "peak_bytes": self._whole.peak,
                "forward_peak_bytes": self._fwd.peak,
                "backward_peak_bytes": (
                    self._bwd.start - self._start + self._bwd.peak if fwd_end else None
                ),
                "end_bytes": self._whole.delta,
                "step_ns": step_ns,
                "forward_ns": forward_ns,
                "backward_ns": (t_end - self._t_forward_end) if fwd_end else None,
            }
        )
        now = offload.stats()
        moved = {k: now[k] - self._offload_start[k] for k in _OFFLOAD_DELTAS}
        # Copies in either direction (a profile around backward alone sees
        # only the reloads), or waits on them.
        copied = moved["offloaded_bytes"] or moved["reloaded_bytes"] or moved["waited_ns"]
        totals["offload"] = {**moved, **{k: now[k] for k in _OFFLOAD_PEAKS}} if copied else None
        if self._count_flops:
            totals.update(
                {
                    "forward_flops": self._fwd_flops,
                    "backward_flops": self._bwd_flops,
                    "region_forward_flops": region_fwd_flops,
                    "replay_flops": _round(replay_est),
                    "replay_flops_low": _round(replay_low),
                    "replay_flops_high": _round(replay_high),
                    "replay_flops_exact": exact,
                }
            )
        else:
            for k in (
                "forward_flops",
                "backward_flops",
                "region_forward_flops",
                "replay_flops",
                "replay_flops_low",
                "replay_flops_high",
                "replay_flops_exact",
            ):
                totals[k] = None
        labels = [label if isinstance(label, str) else _op_name(label) for label in self._labels]
        return {
            "format": FORMAT,
            "label": self.label,
            "device": str(self.device),
            "adapter": adapter(),
            "torch": torch.__version__,
            "timeline_sampling": "op" if self._timeline else "regions",
            "forward_end": (
                None if fwd_end is None else {"sample": fwd_end[0], "detected_by": fwd_end[1]}
            ),
            "totals": totals,
            "ops": rows,
            "regions": regions,
            "outside_regions": {
                "forward_calls": self._outside_calls if self._timeline else None,
                "forward_flops": self._outside_flops if self._count_flops else None,
            },
            "timeline": {
                "t_ns": list(self._t),
                "bytes": list(self._bytes),
                "peak_bytes": list(self._peaks),
                "host_bytes": list(self._host),
                "label": labels,
            },
            "events": [
                {"sample": i, "kind": kind, "region": region} for i, kind, region in self._events
            ],
        }

    def _results(self, what):
        if self._state == "new":
            raise RuntimeError(
                f"torch_sac.profile.{what}: nothing profiled yet; use "
                "`with torch_sac.profile() as prof:` around a forward and backward first"
            )
        if self._state == "active":
            raise RuntimeError(
                f"torch_sac.profile.{what}: the profile is still running; "
                "read it after the `with` block"
            )
        if self._data is None:
            raise RuntimeError(f"torch_sac.profile.{what}: the profile failed to start")
        return self._data

    @property
    def totals(self) -> dict[str, Any]:
        """The totals (a dict; see the class docstring and :meth:`to_dict`)."""
        return self._results("totals")["totals"]

    @property
    def ops(self) -> list[dict[str, Any]]:
        """A list of dicts, per op overload, summed over the regions."""
        return self._results("ops")["ops"]

    def to_dict(self) -> dict[str, Any]:
        """Everything measured, as plain JSON-serialisable data.

        Keys: ``totals``; ``ops`` (per op overload, summed over the regions:
        ``saved``, ``dropped``, ``saved_bytes``, ``dropped_bytes``,
        ``replayed``, ``replay_ns``, ``forward_calls``, ``forward_flops``,
        ``replay_flops`` [+ ``_low``, ``_high``, ``_exact``]); ``regions``
        (per region: ``engine``, ``"region"`` or ``"dropin"``, its
        ``stats()`` (a drop-in's mapped to the region fields), bytes it
        added in forward, FLOPs);
        ``outside_regions``; ``timeline`` (per sample: ``t_ns`` since entry,
        ``bytes`` allocated and ``peak_bytes`` reached during the op, both
        above the level at entry, ``label``: the op or the event);
        ``events`` (region enter/exit, forward end); ``forward_end``;
        ``device``, ``adapter``, ``torch``, ``label``, ``format``.
        :meth:`from_dict` makes a profile from it again.
        """
        return json.loads(json.dumps(self._results("to_dict")))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Writes :meth:`to_dict` to ``path`` as JSON."""
        data = self._results("to_json")
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> profile:
        """A finished profile from :meth:`to_dict`'s output (e.g. read back
        from :meth:`to_json`), for :meth:`table` and :meth:`plot`.

        Profiles written by earlier releases (format
        ``torch_sac.profile/1``, whose regions' ``engine`` says
        ``"sac_context"`` for the region engine) are read too, and come back
        in the current format."""
        if not isinstance(data, dict) or (
            data.get("format") != FORMAT and data.get("format") not in _OLD_FORMATS
        ):
            raise ValueError(
                f"torch_sac.profile.from_dict: not a {FORMAT} dict "
                f"(format {data.get('format') if isinstance(data, dict) else type(data).__name__!r})"
            )
        data = _upgraded(data)
        prof = cls.__new__(cls)
        prof.device = torch.device(data["device"])
        prof._cpu = prof.device.type == "cpu"
        prof._timeline = data["timeline_sampling"] == "op"
        prof._count_flops = data["totals"]["forward_flops"] is not None
        prof.label = data["label"]
        prof._state = "done"
        prof._data = json.loads(json.dumps(data))
        return prof

    def table(self, max_rows: int | None = None, sort_by: str = "bytes") -> str:
        """A text table: one row per op overload (summed over the regions), a
        total row, then memory, time and FLOP totals.

        Args:
            max_rows (int, optional): show at most this many op rows.
            sort_by (str): ``"bytes"`` (kept + dropped, default),
                ``"replay_ns"``, ``"replayed"`` or ``"order"`` (first seen).

        Ops that allocated nothing and were never replayed (views) are
        left out and counted in a note.
        """
        data = self._results("table")
        if sort_by not in ("bytes", "replay_ns", "replayed", "order"):
            raise ValueError(
                "torch_sac.profile.table: sort_by must be 'bytes', 'replay_ns', "
                f"'replayed' or 'order', got {sort_by!r}"
            )
        return format_table(data, max_rows, sort_by)

    def __repr__(self) -> str:
        if self._state != "done" or self._data is None:
            return f"<torch_sac.profile {self._state}>"
        t = self._data["totals"]
        return (
            f"<torch_sac.profile{' ' + self.label if self.label else ''}: {t['regions']} regions, activations "
            f"{format_bytes(t['activation_bytes'])}, peak {format_bytes(t['peak_bytes'])}, "
            f"replay {t['replay_ns'] / 1e6:.2f} ms>"
        )

    def plot(
        self,
        path: str | os.PathLike[str],
        baseline: profile | dict[str, profile] | None = None,
    ) -> str | os.PathLike[str]:
        """Saves a figure to ``path`` (PNG, SVG, PDF: by extension).

        Top: tensor memory over the step (above the level at entry) against
        time, with op-level peaks, forward/backward boundary and region
        spans; with ``baseline`` (another finished profile, e.g. the same
        step without checkpointing, or a dict ``{label: profile}``) the
        curves are drawn together. Bottom (when regions were profiled):
        bytes kept vs dropped per op overload.

        Needs matplotlib (uses the Agg backend; never opens a window).

        Raises:
            ImportError: matplotlib is not installed.
        """
        data = self._results("plot")
        curves = {}
        if baseline is not None:
            if isinstance(baseline, profile):
                baseline = {baseline.label or "baseline": baseline}
            if not isinstance(baseline, dict) or not all(
                isinstance(p, profile) for p in baseline.values()
            ):
                raise TypeError(
                    "torch_sac.profile.plot: baseline must be a torch_sac.profile or a "
                    "dict {label: torch_sac.profile}"
                )
            for name, p in baseline.items():
                curves[name] = p._results("plot")
        curves[self.label or "this profile"] = data
        with_ops = bool(data["ops"])
        fig = agg_figure(figsize=(10, 8.5 if with_ops else 4.5))
        axes = fig.subplots(2 if with_ops else 1, 1, squeeze=False)
        plot_timelines(axes[0][0], curves, highlight=self.label or "this profile")
        if with_ops:
            plot_kept_dropped(axes[1][0], data)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _empty_row(op):
    row = {"op": op, "kept_why": ""}
    row.update({k: 0 for k in _OP_FIELDS + _COPY_FIELDS})
    row.update(
        {
            "forward_calls": 0,
            "forward_flops": 0,
            "replay_flops": 0.0,
            "replay_flops_low": 0,
            "replay_flops_high": 0,
            "replay_flops_exact": True,
            "most_replays": 0,
        }
    )
    return row


def _round(x):
    return int(round(x))


def _replay_flops(replays, flops, replays_by_call=None):
    """(estimate, low, high, exact) FLOPs of ``replays`` replays of an op whose
    forward calls in the region cost ``flops`` each. With the region's replay
    count per call (in the same call order the profile saw) it is exact."""
    if replays == 0 or not flops or max(flops) == 0:
        return 0, 0, 0, True
    if replays_by_call is not None and len(replays_by_call) == len(flops):
        total = sum(f * n for f, n in zip(flops, replays_by_call))
        return total, total, total, True
    lo, hi = min(flops), max(flops)
    if lo == hi:
        return replays * lo, replays * lo, replays * lo, True
    ordered = sorted(flops)
    if replays <= len(ordered):
        low, high = sum(ordered[:replays]), sum(ordered[-replays:])
    else:  # replayed more often than called (retain_graph=True)
        low, high = replays * lo, replays * hi
    return replays * sum(flops) / len(flops), low, high, False


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` in the current :data:`FORMAT`: an older profile's engine
    names mapped to today's (a copy; a current one is returned as is)."""
    renames = _OLD_FORMATS.get(data.get("format"))
    if renames is None and all(
        "waited_ns" in r and "kept_anyway" in r for r in data.get("ops", [])
    ):
        return data
    # Written before offloading existed (nothing was offloaded), before
    # copies were timed (no copy time known), or before ops kept anyway were
    # itemised.
    defaults = {"offloaded": 0, "offloaded_bytes": 0, "copy_ns": 0, "waited_ns": 0}
    defaults.update(kept_anyway=0, kept_anyway_bytes=0, kept_why="")
    data = {
        **data,
        "ops": [{**defaults, **r} for r in data.get("ops", [])],
        "totals": {"offload": None, **data.get("totals", {})},
    }
    if renames is None:
        return data
    regions = [
        {**r, "engine": renames.get(r.get("engine"), r.get("engine"))}
        for r in data.get("regions", [])
    ]
    return {**data, "format": FORMAT, "regions": regions}


def plot_memory(
    profiles: dict[str, profile], path: str | os.PathLike[str], title: str | None = None
) -> str | os.PathLike[str]:
    """Saves the memory-over-time curves of several finished profiles,
    ``{label: profile}``, in one plot (e.g. one step under several policies).

    Needs matplotlib (Agg backend).
    """
    if not isinstance(profiles, dict) or not profiles:
        raise TypeError(
            "torch_sac.profiler.plot_memory: pass a non-empty dict {label: torch_sac.profile}"
        )
    fig = agg_figure(figsize=(10, 4.5))
    ax = fig.subplots()
    curves = {name: p._results("plot") for name, p in profiles.items()}
    plot_timelines(ax, curves, highlight=None)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
