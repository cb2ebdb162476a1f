"""One plan on every rank: what the planners measure, agreed across the
ranks of the default process group before any decision reads it.

A step under tensor, sequence or data parallel runs collectives, so every
rank must run the same planning runs in the same order: a rank that
decided on one more run than its peers would wait in that run's first
collective for ever. The peak planners' searches decide on measured
numbers (peaks, the region's replay statistics and schedules, the
profile's op times), which differ between ranks (timings always, bytes
under uneven shards). So each measurement is agreed as it is made, and
every rank then takes the same decisions and ends with the same plan:

* a measured run (``peak_search._Run``): its peak and times are the most
  over the ranks (a plan fits on every rank), the region's statistics,
  schedule and per-op details are rank 0's;
* a profiled forward: each call's time is rank 0's, each storage's bytes
  the most over the ranks; ranks whose profiles differ in length ran
  different programs, and planning stops with an error;
* a plan over blocks chosen from the profile: rank 0's (the calls a
  block's option keeps are found from each rank's own profile, which can
  differ in small ways: measured on 2 gloo ranks, one rank once took a
  plan the other did not, and the next planning run waited for ever).

The peak asked for is the least any rank asks for (each rank measures its
own peak, and a share of it differs between ranks).

Outside ``torch.distributed`` (or with one rank) nothing changes and no
collective runs. Planning assumes every rank of the default group plans
the same step at the same time (tensor, sequence, data parallel, FSDP2);
under pipeline parallel, where stages run different steps, plan each stage
in a process group of its own or without collectives.
"""

from __future__ import annotations

import torch

from ..schedule import ReplaySchedule

__all__ = ["agree_profile", "agree_run", "least", "ranks", "rank0s"]


def ranks() -> int:
    """The ranks of the default process group (1 outside torch.distributed)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def _device():
    """Where the default group's collectives take their tensors."""
    backend = torch.distributed.get_backend()
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _most(values):
    """Each of ``values`` (ints or floats) as the most over the ranks."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [type(v)(x) for v, x in zip(values, t.tolist())]


def _rank0(obj):
    """Rank 0's ``obj`` (picklable), on every rank."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def least(value):
    """The least ``value`` (an int: a peak asked for) over the ranks: each
    rank measures its own peak without checkpointing, so ranks asking for
    a share of it ask for different peaks; they plan for the tightest."""
    if ranks() == 1:
        return value
    return -_most([-value])[0]


def rank0s(obj):
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` itself outside
    torch.distributed. For a decision made from numbers not agreed by
    :func:`agree_profile` (the model's view of the step: which calls a
    block's option keeps), so that every rank runs the same plan."""
    return obj if ranks() == 1 else _rank0(obj)


def agree_run(run):
    """``run`` (a ``peak_search._Run``) as every rank sees it: peak and
    times the most over the ranks, statistics, schedule and details rank
    0's. Returns ``run`` (changed in place)."""
    if ranks() == 1:
        return run
    numbers = [run.peak if run.peak is not None else -1, run.seconds, run.forward_seconds]
    peak, run.seconds, run.forward_seconds = _most(numbers)
    run.peak = None if run.peak is None else int(peak)
    schedule = None if run.schedule is None else run.schedule.to_dict()
    run.stats, schedule, run.details = _rank0((run.stats, schedule, run.details))
    run.schedule = None if schedule is None else ReplaySchedule.from_dict(schedule)
    return run


def agree_profile(profile, where):
    """``profile`` (a ``RegionProfile``) with each call's time rank 0's and
    each storage's bytes the most over the ranks. Raises ``RuntimeError``
    where the ranks profiled a different number of calls or storages."""
    if ranks() == 1:
        return profile
    sizes = [len(profile.records), len(profile.storages)]
    if _most(sizes) != sizes or _most([-s for s in sizes]) != [-s for s in sizes]:
        raise RuntimeError(
            f"torch_sac.{where}: the ranks of the default process group ran different programs "
            f"while planning (this rank profiled {sizes[0]} op calls); every rank must plan "
            "the same step at the same time, or plan without torch.distributed"
        )
    seconds = _rank0([r.seconds for r in profile.records])
    for record, s in zip(profile.records, seconds):
        record.seconds = s
    nbytes = _most([st.nbytes for st in profile.storages])
    for storage, n in zip(profile.storages, nbytes):
        storage.nbytes = n
    storages = profile.storages
    profile.activation_bytes = sum(s.nbytes for s in storages if s.internal and s.saved_by_autograd)
    held = {s for r in profile.records for s in r.storages if storages[s].internal}
    profile.total_bytes = sum(storages[s].nbytes for s in held)
    return profile
