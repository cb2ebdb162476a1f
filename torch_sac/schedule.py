"""Replay schedules: what a region keeps in forward and after each rebuild in
backward, as a value to inspect, save, edit and run again.

A region records the schedule it ran (``sac_context.replay_schedule()``),
whether it chose it with a ``replay_budget`` or kept everything; a schedule
passed as ``sac_context(policy, replay_schedule=schedule)`` is run exactly,
and backward raises if it does not match. The format is described in
``docs/design.md`` ("Replay schedules").
"""

from __future__ import annotations

import collections
import json
import numbers
import os
from collections.abc import Iterable, Sequence
from typing import Any

from . import _C

__all__ = ["RebuildStep", "ReplaySchedule", "TensorKey"]

FORMAT = "torch_sac.replay_schedule/1"


class TensorKey(tuple):
    """A tensor the region can rebuild: ``(op, call_index, output)``: the op
    call that made its storage (``"aten::mm.default"``, its call index in
    the region as policies see it) and which of that op's tensor outputs."""

    __slots__ = ()

    def __new__(cls, op: str, call_index: int, output: int = 0) -> TensorKey:
        if not isinstance(op, str) or "::" not in op:
            raise ValueError(
                f"torch_sac.ReplaySchedule: an op is named like 'aten::mm.default', got {op!r}"
            )
        for name, value in (("call_index", call_index), ("output", output)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(
                    f"torch_sac.ReplaySchedule: {name} must be an int >= 0, got {value!r}"
                )
        if "." not in op.split("::", 1)[1]:
            op += ".default"
        return super().__new__(cls, (op, int(call_index), int(output)))

    @property
    def op(self) -> str:
        return self[0]

    @property
    def call_index(self) -> int:
        return self[1]

    @property
    def output(self) -> int:
        return self[2]

    def __repr__(self):
        return f"TensorKey({self.op!r}, {self.call_index}, {self.output})"


#: One rebuild of a schedule: the :class:`TensorKey` it is for, the keys of
#: the tensors it rebuilds on the way and keeps for later unpacks, and the
#: keys of tensors kept earlier that it lets go of once done (a replay budget
#: does, to stay within its bytes; a later unpack rebuilds them again).
RebuildStep = collections.namedtuple("RebuildStep", ["unpacked", "keep", "release"])


class ReplaySchedule:
    """A region's schedule.

    Attributes:
        saved: the op calls whose outputs forward keeps, ``[(op, call_index)]``.
        rebuilds: one :class:`RebuildStep` ``(unpacked, keep, release)`` per
            rebuild in backward, in order: the :class:`TensorKey` it is for,
            the keys of the tensors it rebuilds on the way that are kept for
            later unpacks (held until their last unpack or a release), and
            the keys it releases once done. Everything else it rebuilds is
            freed and rebuilt again when unpacked.

    Example:
        >>> with torch_sac.sac_context(policy, replay_budget=budget) as region:
        ...     y = model(x)
        >>> y.sum().backward()
        >>> schedule = region.replay_schedule()
        >>> schedule.save("schedule.json")
        >>> schedule = torch_sac.ReplaySchedule.load("schedule.json")
        >>> with torch_sac.sac_context(schedule.policy(), replay_schedule=schedule):
        ...     y = model(x)   # backward rebuilds and keeps exactly as scheduled
    """

    def __init__(
        self,
        rebuilds: Iterable[Sequence[Any]],
        saved: Iterable[tuple[str, int] | TensorKey] = (),
    ) -> None:
        self.saved = [(op, int(call)) for op, call in (as_call(c) for c in saved)]
        self.rebuilds = []
        for step in rebuilds:
            if not isinstance(step, (tuple, list)) or len(step) not in (2, 3):
                raise ValueError(
                    "torch_sac.ReplaySchedule: each rebuild is (unpacked key, [kept keys]) or "
                    f"(unpacked key, [kept keys], [released keys]), got {step!r}"
                )
            unpacked, keep, release = (*step, ()) if len(step) == 2 else step
            self.rebuilds.append(
                RebuildStep(
                    TensorKey(*unpacked),
                    [TensorKey(*k) for k in keep],
                    [TensorKey(*k) for k in release],
                )
            )

    def policy(self, offloaded: Sequence[tuple[str, int]] = ()) -> _C.SavedCallsPolicy:
        """A policy saving exactly :attr:`saved` (decided in C++); the calls
        in ``offloaded`` (a subset of them) are offloaded to host memory
        instead (``PREFER_OFFLOAD``)."""

        def spelled(calls):
            out = []
            for op, call in calls:
                name, overload = op.rsplit(".", 1)
                out.append((name, "" if overload == "default" else overload, call))
            return out

        moved = set(offloaded)
        label = f"schedule({len(self.saved)} saved calls"
        label += f", {len(moved)} offloaded)" if moved else ")"
        return _C.SavedCallsPolicy(
            spelled(c for c in self.saved if c not in moved), label, spelled(sorted(moved))
        )

    @property
    def recomputed(self) -> dict[TensorKey, int]:
        """How many rebuilds each tensor key was rebuilt in, as ``{key: count}``
        (a tensor rebuilt on the way of several rebuilds counts in each)."""
        counts = {}
        for step in self.rebuilds:
            counts[step.unpacked] = counts.get(step.unpacked, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "saved": [list(c) for c in self.saved],
            "rebuilds": [
                {
                    "unpacked": list(step.unpacked),
                    "keep": [list(k) for k in step.keep],
                    "release": [list(k) for k in step.release],
                }
                for step in self.rebuilds
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplaySchedule:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"torch_sac.ReplaySchedule.from_dict: not a {FORMAT} dict (format {found!r})"
            )
        return cls(
            [(r["unpacked"], r["keep"], r.get("release", ())) for r in data["rebuilds"]],
            data.get("saved", ()),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ReplaySchedule:
        return cls.from_dict(read_json(path))

    def _steps(self):
        """The rebuilds as the C++ region takes them."""
        return [
            (tuple(step.unpacked), [tuple(k) for k in step.keep], [tuple(k) for k in step.release])
            for step in self.rebuilds
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplaySchedule) and self.to_dict() == other.to_dict()

    def __repr__(self):
        kept = sum(len(step.keep) for step in self.rebuilds)
        released = sum(len(step.release) for step in self.rebuilds)
        return (
            f"<torch_sac.ReplaySchedule: {len(self.saved)} saved calls, "
            f"{len(self.rebuilds)} rebuilds keeping {kept} tensors"
            + (f", releasing {released}" if released else "")
            + ">"
        )


def as_call(c):
    """``(op, call_index)`` from a saved call, checked."""
    try:
        op, call = c
    except (TypeError, ValueError):
        raise ValueError(
            f"torch_sac.ReplaySchedule: a saved call is (op, call_index), got {c!r}"
        ) from None
    key = TensorKey(op, call)
    return key.op, key.call_index


def write_json(path, data):
    """A plan or schedule as indented JSON (readable diffs)."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def read_json(path):
    with open(path) as f:
        return json.load(f)
