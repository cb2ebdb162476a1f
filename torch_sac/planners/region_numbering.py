"""The planners' op calls named as the engines see them.

``profile_region`` numbers op calls under a Python ``TorchDispatchMode``,
and under a Python mode ATen's composite code takes other branches: CPU
attention in training (SDPA's math path) runs ``add`` and ``view`` there
where the engines, below the Python modes, see ``add_`` and
``_reshape_alias``. A plan keyed by the profile's ``(op, call_index)`` would
then save other calls than it chose (an 8-block GPT-2 saving mid-block
tensors peaked at 90.5 MiB where the renumbered plan peaks at 48.6). So
after profiling, the planners run the same forward once in a region whose
policy records the calls it sees (the region and the drop-in see the same
sequence), align the two sequences and rewrite the profile's call indices;
a profiled call the engines do not see cannot be saved.
"""

from __future__ import annotations

import difflib

import torch

from .._op_profile import RegionProfile, cuda_devices
from ..region import in_region, sac_context

__all__ = ["op_name", "region_call_names", "renumber"]


def op_name(op):
    """An OpOverload as policies and schedules name it (``aten::mm.default``)."""
    return f"{op._schema.name}.{op._schema.overload_name or 'default'}"


def region_call_names(fn, args, kwargs):
    """The op calls a region's policy sees in one forward of ``fn``, by name,
    in order; the RNG state is restored after it. None inside a region
    (it would merge into it)."""
    if in_region():
        return None
    names = []

    def record(ctx, op, *a, **k):
        name = op.name()
        names.append(name if "." in name.split("::")[-1] else name + ".default")
        return False

    with torch.random.fork_rng(devices=cuda_devices((args, kwargs))), torch.enable_grad():
        with sac_context(record):
            out = fn(*args, **kwargs)
        del out
    return names


def renumber(profile: RegionProfile, names) -> int:
    """Rewrites ``profile``'s call indices to those of ``names`` (a
    :func:`region_call_names` sequence) where the two sequences align; the
    calls left over are marked not saveable. Returns how many were left."""
    if names is None:
        return 0
    ours = [op_name(r.op) for r in profile.records]
    counts, theirs = {}, []
    for n in names:
        theirs.append(counts.get(n, 0))
        counts[n] = counts.get(n, 0) + 1
    matched = {}
    matcher = difflib.SequenceMatcher(None, ours, names, autojunk=False)
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            for d in range(i2 - i1):
                matched[i1 + d] = theirs[j1 + d]
    left = 0
    for i, record in enumerate(profile.records):
        if i in matched:
            record.call_index = matched[i]
        else:
            left += 1
            record.saveable = False
            record.why_not = "not seen by the engines (a composite op's other branch)"
    return left
