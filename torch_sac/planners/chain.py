"""The chain solver: per block of a step, which option (what the block keeps
in forward) and where checkpoint segments start, so that the modelled peak
fits and the modelled recompute time is least. A dynamic program over the
chain of blocks (Rotor's and Rockmate's family: heterogeneous blocks,
several options each), in measured bytes and measured seconds.

The model of one step (``block_options.py`` measures its terms):

* Forward keeps, per block, what its option keeps (``kept``); a block
  starting a segment of several blocks keeps only its input, and the
  blocks after it in the segment keep nothing (``checkpoint_sequential``).
* Backward of a segment ``[j..e]`` starts by rebuilding all of it: while
  the backward of its block ``i`` runs, memory holds what blocks before
  ``j`` keep, the full activations (``activation``, input included) of
  blocks ``j..i-1``, block ``i`` as its rebuild holds it (``rebuilt``: its
  activations and the replay's working set), the parameters' gradients
  (``grad``) of the blocks after ``i`` and half of block ``i``'s (made as
  its activations go); after it, the activations of ``j..i-1`` and the
  gradients of ``i`` and after. The segment's need is the most of these.
  A block that is a segment of its own holds less than its full
  activations where its option keeps part of them: backward rebuilds a
  dropped tensor when a node first unpacks it, and frees what it unpacked
  as it goes (``ChainOption.in_backward``, simulated from the profile by
  ``block_options.py``).
* Forward's end holds what every block keeps.
* Everything else (parameters, what runs outside the blocks, workspace,
  the outputs) is a constant of the step: ``forward_base`` at forward's end
  (calibrated on the run without checkpointing), ``base`` while the blocks'
  backward runs (the same less what the head keeps: it is freed by then).

Recompute: a block keeping option ``o`` replays ``o.seconds``; a segment of
``k`` blocks replays all of them, their ``full_seconds`` times
``1 + slowdown * log2(k)`` (:func:`segment_seconds`): on a CPU a long
segment replays, and its backward runs, with all its rebuilt activations
held, and both go slower than per-block rebuilds of the same calls.
Measured on this project's CPU (8-block HF Llama, TinyGPT with and without
dropout; time added to keeping everything, medians of 7 interleaved
rounds, ``bench/bench_segments.py``, two runs): segments of 2, 4 and 8
blocks cost 1.09-1.28x, 1.37-1.58x and 1.52-1.80x what checkpointing each
block costs, replaying the same calls; the slowdowns fitted per model and
run are 0.17-0.28, 0.22 on average.

Every recipe users write by hand is one point of this space: no
checkpointing (every block keeps everything), per-block checkpointing
(every block keeps its input), every k-th block, ``checkpoint_sequential``
(segments), per-block selective policies (an option). So the solution's
modelled time is never above theirs at their modelled peak.

Memory is counted in slots of ``(peak - base) / slots`` bytes, rounded up for
what is kept and needed (so a modelled fit is a fit), which makes the
program ``O(blocks^2 * slots)`` array steps (numpy).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

__all__ = [
    "BlockChoice",
    "ChainBlock",
    "ChainOption",
    "ChainSolution",
    "PlanInvariantError",
    "check_choices",
    "kept_bytes",
    "model_peak",
    "offloaded_bytes",
    "segment_seconds",
    "solve_chain",
]

# Memory slots of the program: the rounding loses at most one slot per
# block of the peak asked above ``base`` (0.25 % each).
SLOTS = 400


@dataclasses.dataclass(frozen=True)
class ChainOption:
    """What a block keeps when it ends its own segment: ``kept`` bytes on
    the device (its input included), ``seconds`` of replay in backward (and
    of copies to and from host memory that compute cannot hide), and
    ``offloaded`` bytes it keeps in host memory instead (what offloading
    holds on the device meanwhile depends on the whole plan:
    :func:`offloaded_bytes`), and ``in_backward``, the most of the block
    its own backward holds at once, its input included (None: all its
    activations, :attr:`ChainBlock.activation`)."""

    name: str
    kept: int
    seconds: float
    offloaded: int = 0
    in_backward: int | None = None


@dataclasses.dataclass(frozen=True)
class ChainBlock:
    """One block of the chain.

    Attributes:
        options: the block's options when it is a segment of its own.
        input_bytes: what it keeps when it starts a longer segment.
        activation: its full activations (what backward holds of it once
            rebuilt), its input included.
        full_seconds: replaying all of it.
        grad: bytes of its parameters' gradients.
        rebuilt: the most its backward holds when it keeps nothing but
            its input: its activations as the rebuild leaves them, and the
            rebuild's own working set (None: ``activation``).
    """

    options: tuple[ChainOption, ...]
    input_bytes: int
    activation: int
    full_seconds: float
    grad: int = 0
    rebuilt: int | None = None

    @property
    def rebuilt_bytes(self) -> int:
        return self.activation if self.rebuilt is None else self.rebuilt


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """A block's part of a solution: ``option`` (a :class:`ChainOption`'s
    name, or ``"segment start"`` / ``"in segment"``) and its segment."""

    option: str
    segment: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class ChainSolution:
    choices: tuple[BlockChoice, ...]
    seconds: float
    peak: int  # the modelled peak, base included


class PlanInvariantError(RuntimeError):
    """A plan over blocks that breaks the chain's invariants (an option a
    block does not offer, segments that do not cover the chain): a bug in
    torch_sac's planner, reported with the block it concerns."""

    def __init__(self, what):
        super().__init__(
            f"torch_sac planner bug: {what}. Please report it with the model; meanwhile "
            "plan_peak(..., blocks=None) plans without the block chain"
        )


def check_choices(blocks, choices, names=None):
    """Raises :class:`PlanInvariantError` unless ``choices`` (a list of
    :class:`BlockChoice`) is a plan of ``blocks``: one choice per block, the
    segments covering the chain in order without overlap, each block alone
    in its segment keeping an option it offers, and each longer segment
    starting with ``"segment start"`` followed by ``"in segment"``.
    ``names(j)`` names block ``j`` in the message."""
    name = names or (lambda j: f"block {j}")
    if len(choices) != len(blocks):
        raise PlanInvariantError(f"{len(choices)} choices for a chain of {len(blocks)} blocks")
    j = 0
    while j < len(blocks):
        start, end = choices[j].segment
        if start != j or not j <= end < len(blocks):
            raise PlanInvariantError(
                f"{name(j)} is in segment {choices[j].segment}, but the segments before it "
                f"end at block {j - 1}: segments must cover the chain's {len(blocks)} blocks in order"
            )
        if end == j:
            offered = [o.name for o in blocks[j].options]
            if choices[j].option not in offered:
                raise PlanInvariantError(
                    f"{name(j)} keeps option {choices[j].option!r}, which it does not offer "
                    f"(its options: {', '.join(offered) or 'none'})"
                )
        else:
            for i in range(j, end + 1):
                want = "segment start" if i == j else "in segment"
                if choices[i].option != want or choices[i].segment != (j, end):
                    raise PlanInvariantError(
                        f"{name(i)} is {choices[i].option!r} in segment {choices[i].segment}, "
                        f"expected {want!r} in segment {(j, end)}"
                    )
        j = end + 1


def _segment_need(blocks, grads_after, j, e, option=None):
    """The most a segment ``[j..e]`` holds above what blocks before it keep:
    during the backward of each block ``i`` in it, the activations of
    ``j..i-1``, block ``i`` as its rebuild holds it and the gradients of the
    blocks after ``i`` (and half of its own); as it ends, the activations
    of ``j..i-1`` and the gradients of ``i`` and after. A segment of one
    block keeping ``option`` holds what that option's backward holds."""
    if option is not None:
        return _own_need(blocks, grads_after, j, option)
    need, activation = 0, 0
    for i in range(j, e + 1):
        need = max(need, activation + grads_after[i])
        need = max(need, activation + blocks[i].rebuilt_bytes + _during(blocks, grads_after, i))
        activation += blocks[i].activation
    return need


def _own_need(blocks, grads_after, j, option):
    """:func:`_segment_need` of block ``j`` alone, keeping ``option``."""
    held = blocks[j].activation if option.in_backward is None else option.in_backward
    return max(grads_after[j], held + _during(blocks, grads_after, j))


def _during(blocks, grads_after, i):
    """The gradients held at the peak of block ``i``'s backward: those of
    the blocks after it, and half of its own (made as its activations are
    freed; measured on 8-block Llama and GPT-2 models: between a third and
    two thirds)."""
    return grads_after[i + 1] + blocks[i].grad // 2


def _grads_after(blocks):
    """``[g_i + g_(i+1) + ...]`` for each block, and 0 after the last."""
    return np.cumsum([b.grad for b in blocks][::-1])[::-1].tolist() + [0]


def _segments(blocks, choices):
    """``(j, e, option)`` for each segment ``[j..e]`` of ``choices``: the
    option it keeps, or None for a segment of several blocks (it keeps its
    first block's input). Raises :class:`PlanInvariantError` unless
    ``choices`` is a plan of ``blocks`` (:func:`check_choices`)."""
    check_choices(blocks, choices)
    options = {(j, o.name): o for j, b in enumerate(blocks) for o in b.options}
    j = 0
    while j < len(blocks):
        e = choices[j].segment[1]
        yield j, e, options[(j, choices[j].option)] if e == j else None
        j = e + 1


def kept_bytes(blocks, choices):
    """What forward keeps of the blocks under ``choices``."""
    return sum(
        blocks[j].input_bytes if option is None else option.kept
        for j, _, option in _segments(blocks, choices)
    )


def offloaded_bytes(blocks, choices):
    """What ``choices`` keep in host memory."""
    return sum(option.offloaded for _, _, option in _segments(blocks, choices) if option)


def model_peak(blocks, choices, base, forward_base):
    """The modelled peak of ``choices`` (a list of :class:`BlockChoice`)."""
    grads_after = _grads_after(blocks)
    kept_before, peak = 0, 0
    for j, e, option in _segments(blocks, choices):
        peak = max(peak, base + kept_before + _segment_need(blocks, grads_after, j, e, option))
        kept_before += blocks[j].input_bytes if option is None else option.kept
    return max(peak, forward_base + kept_before)


def segment_seconds(blocks, j, e, slowdown=0.0):
    """The modelled replay of a segment ``[j..e]`` of several blocks: their
    ``full_seconds``, times :func:`_segment_factor`."""
    return sum(b.full_seconds for b in blocks[j : e + 1]) * _segment_factor(e - j + 1, slowdown)


def _segment_factor(length, slowdown):
    """How much more than its blocks' forward a segment of ``length``
    blocks replays: ``1 + slowdown * log2(length)``."""
    return 1 + slowdown * math.log2(length)


def solve_chain(blocks, peak, base, forward_base, max_segment=None, slots=SLOTS, slowdown=0.0):
    """The least modelled recompute time whose modelled peak is at most
    ``peak``, or None when no choice fits.

    Args:
        blocks: the chain, a sequence of :class:`ChainBlock`.
        peak: the peak asked, bytes.
        base, forward_base: the step's constant bytes in backward and at
            forward's end.
        max_segment: the longest segment tried (default: all blocks).
        slots: memory slots of the program.
        slowdown: how much slower a segment of several blocks replays, per
            doubling of its length (:func:`segment_seconds`; 0: as its
            blocks' forward).
    """
    n = len(blocks)
    room = peak - base
    if n == 0 or room <= 0 or peak - forward_base < 0:
        return None
    quantum = room / slots

    def to_slots(b):
        # Rounded up exactly for bytes (ints): a float quotient loses the
        # last byte once the room is tens of GB, and a plan could then be
        # modelled a byte over the peak it was solved for.
        if b <= 0:
            return 0
        if isinstance(b, numbers.Integral) and isinstance(room, numbers.Integral):
            return -(-int(b) * slots // int(room))
        return math.ceil(b / quantum - 1e-9)

    max_segment = n if max_segment is None else max(1, min(max_segment, n))
    grads_after = _grads_after(blocks)
    memory = np.arange(slots + 1)
    # cost[j][m]: least recompute of blocks j.. with m slots left above
    # what blocks before j keep; inf where nothing fits.
    cost = np.full((n + 1, slots + 1), np.inf)
    end_room = to_slots(max(0, forward_base - base)) if forward_base > base else 0
    cost[n][end_room:] = 0.0
    # choice[j][m]: (segment end, option index or -1)
    choice_end = np.full((n + 1, slots + 1), -1, dtype=np.int64)
    choice_option = np.full((n + 1, slots + 1), -1, dtype=np.int64)
    for j in range(n - 1, -1, -1):
        best = cost[j]
        activation, held = 0, 0
        replay = 0.0
        for e in range(j, min(n, j + max_segment)):
            replay += blocks[e].full_seconds
            # The segment's most, at the backward of one of its blocks
            # (_segment_need): it only grows with e, so a longer segment
            # that does not fit is never tried (a block alone may still fit
            # with an option keeping part of it).
            held = max(held, activation + grads_after[e])
            held = max(held, activation + blocks[e].rebuilt_bytes + _during(blocks, grads_after, e))
            activation += blocks[e].activation
            need = to_slots(held)
            if e == j:
                alternatives = [
                    (k, o.seconds, to_slots(o.kept), to_slots(_own_need(blocks, grads_after, j, o)))
                    for k, o in enumerate(blocks[j].options)
                ]
            elif need > slots:
                break
            else:
                # The segment start replays all of itself too.
                seconds = replay * _segment_factor(e - j + 1, slowdown)
                alternatives = [(-1, seconds, to_slots(blocks[j].input_bytes), need)]
            for k, seconds, kept, option_need in alternatives:
                if kept > slots or option_need > slots:
                    continue
                # m slots left: this segment needs `option_need`, and leaves m - kept.
                rest = np.full(slots + 1, np.inf)
                rest[kept:] = cost[e + 1][: slots + 1 - kept]
                total = np.where(memory >= max(option_need, kept), seconds + rest, np.inf)
                better = total < best
                if better.any():
                    best = np.where(better, total, best)
                    choice_end[j][better] = e
                    choice_option[j][better] = k
        cost[j] = best
    if not math.isfinite(cost[0][slots]):
        return None
    choices, j, m = [], 0, slots
    while j < n:
        e, k = int(choice_end[j][m]), int(choice_option[j][m])
        if e == j:
            option = blocks[j].options[k]
            choices.append(BlockChoice(option.name, (j, j)))
            m -= to_slots(option.kept)
        else:
            choices.append(BlockChoice("segment start", (j, e)))
            choices += [BlockChoice("in segment", (j, e))] * (e - j)
            m -= to_slots(blocks[j].input_bytes)
        j = e + 1
    return ChainSolution(
        tuple(choices), float(cost[0][slots]), model_peak(blocks, choices, base, forward_base)
    )
