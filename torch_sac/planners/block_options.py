"""Per-block options of a step, measured once: what each block can keep in
forward, what that keeps (bytes) and what backward then replays (seconds),
from one profiled forward (``torch_sac._op_profile``) whose block calls are
bracketed. The chain solver (``chain.py``) chooses among them; a solution
becomes the op calls a region saves (:meth:`StepBlocks.saved_calls`).

Options of a block that is a checkpoint segment of its own (each keeps the
block's input, so backward can rebuild it):

* ``keep all``: every op call (no checkpointing of the block);
* ``matmuls``: the matmul-class ops (:data:`torch_sac.policies.MATMUL_OPS`),
  PyTorch's selective checkpointing recipe;
* ``knapsack N%``: the budget planner's solution (``_C.budget_solve``, value
  the calls' measured time) at N % of the block's activations;
* ``input``: nothing but the input (``torch.utils.checkpoint`` on the block);
* when the step can offload (:class:`OffloadModel`), options keeping some
  of what another option keeps in host memory instead of on the device:

  - ``offload matmuls``: the matmuls' outputs, the rest recomputed from
    them;
  - ``offload all``: everything the block keeps, its input included
    (torchtune's and ``save_on_cpu``'s recipe, per block);
  - ``keep all + offload hidden`` and ``matmuls + offload hidden``: of what
    those options keep (the input among it), the largest tensors whose
    copies the block's own compute hides (bytes up to the measured
    bandwidth times its forward time out, and times its backward time
    back), so that they cost no time: as much offload as the link carries;
  - ``recompute + offload hidden``: per tensor, save or recompute: the calls
    the budget planner finds most worth their bytes within what the link
    hides, all in host memory, the rest recomputed from the input;
  - ``offloaded input``: only the input, and that in host memory
    (fairscale's ``offload_to_cpu`` checkpointing): the least a block can
    keep.

  They keep the other option's bytes less those moved, plus those whose
  copy out the block's forward does not hide (still on the device while
  the copy stream catches up; counted as kept by the block, which also
  charges them through the later blocks' backward: conservative). What
  offloading holds on the device anyway (the prefetch window, the last
  ones offloaded) depends on the whole plan: the planner adds it to the
  step's constant (:meth:`OffloadModel.held_bytes`). Their time is the
  kept option's replay plus the copies' time that compute cannot hide
  (bytes over the measured bandwidth, less the block's forward time for
  the copy out and its backward time for the copy back, on a GPU; all of
  it on the CPU stand-in, whose copies are synchronous). Tensors below
  ``min_bytes`` stay on the device (``PREFER_OFFLOAD`` keeps them), so they
  are not counted as moved. Where the copies cost more than recomputing,
  the solver does not choose them.

A block that starts a longer segment keeps only its input; the blocks after
it in the segment keep nothing (``checkpoint_sequential``). What runs
outside the blocks (embeddings, the head, the loss) is always kept.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics

from .. import _C
from .._blocks import find_blocks
from .._op_profile import RegionProfile, plain_tensors
from .chain import BlockChoice, ChainBlock, ChainOption, PlanInvariantError, check_choices
from .peak_plan import BlockRow
from .region_numbering import op_name

__all__ = [
    "KNAPSACK_SHARES",
    "MATMULS",
    "OFFLOAD_ALL",
    "OFFLOAD_HIDDEN",
    "OFFLOAD_MATMULS",
    "OFFLOADED_INPUT",
    "NotAChain",
    "OffloadModel",
    "StepBlocks",
    "chain_spans",
    "find_step_blocks",
    "qualified_names",
]

# The knapsack options' budgets, as shares of a block's activations.
KNAPSACK_SHARES = (0.25, 0.5, 0.75)

#: The qualified names of the matmul-class ops (``save_matmuls``' list).
MATMULS = frozenset(_C.matmul_op_names())

#: The name of the option offloading a block's matmul outputs.
OFFLOAD_MATMULS = "offload matmuls"
#: The name of the option keeping everything, in host memory where it can.
OFFLOAD_ALL = "offload all"
#: The name of the option keeping only the block's input, in host memory.
OFFLOADED_INPUT = "offloaded input"
#: The suffix of the options offloading what the block's compute hides.
OFFLOAD_HIDDEN = " + offload hidden"


@dataclasses.dataclass(frozen=True)
class OffloadModel:
    """What offloading costs on the step's device: measured bandwidth
    (bytes per second, device to host and back), whether copies overlap
    compute (on a GPU's copy stream; not on the CPU stand-in), and
    ``torch_sac.offload``'s options that set what it holds on the device:
    the prefetch window, the bytes offloaded last that stay, and the size
    below which ``PREFER_OFFLOAD`` keeps a tensor on the device."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    overlaps: bool
    prefetch_bytes: int
    min_bytes: int = 0
    keep_last_bytes: int = 0

    def held_bytes(self, offloaded):
        """What a plan keeping ``offloaded`` bytes in host memory holds of
        them on the device anyway, ``(in backward, at forward's end)``: the
        last ones offloaded (``keep_last_bytes``) stay until backward uses
        them, and backward brings back up to ``prefetch_bytes`` ahead of
        their use. Counted at every block's backward, which is
        conservative: the window is full only while enough offloaded bytes
        remain before the block."""
        last = min(self.keep_last_bytes, offloaded)
        return last + min(self.prefetch_bytes, offloaded), last

    def hidden_bytes(self, forward_seconds):
        """The bytes a block whose forward takes ``forward_seconds`` can
        move out and back with no exposed copy time (0 where copies do not
        overlap compute)."""
        if not self.overlaps:
            return 0
        return int(
            min(self.d2h_bytes_per_s * forward_seconds, self.h2d_bytes_per_s * 2 * forward_seconds)
        )

    def lagging_bytes(self, nbytes, forward_seconds):
        """Of ``nbytes`` offloaded by a block whose forward takes
        ``forward_seconds``, those whose copy out its compute does not
        hide: the copy stream lags behind forward by them, so they stay on
        the device a while (the options count them as kept, which is
        conservative; 0 where copies are synchronous: the CPU stand-in)."""
        if not self.overlaps:
            return 0
        return max(0, int(nbytes - self.d2h_bytes_per_s * forward_seconds))

    def exposed_seconds(self, nbytes, forward_seconds):
        """The copies' time compute cannot hide, for ``nbytes`` moved out in
        a block whose forward takes ``forward_seconds`` (its backward about
        twice that) and back in its backward."""
        out, back = nbytes / self.d2h_bytes_per_s, nbytes / self.h2d_bytes_per_s
        if not self.overlaps:
            return out + back
        return max(0.0, out - forward_seconds) + max(0.0, back - 2 * forward_seconds)


def qualified_names(roots):
    """``{id(module): its qualified name}`` for the modules inside ``roots``
    (the first root's name for a module several hold)."""
    names = {}
    for root in roots:
        for name, m in root.named_modules():
            names.setdefault(id(m), name or type(m).__name__)
    return names


def find_step_blocks(modules):
    """The repeated blocks of the largest model among ``modules`` (those a
    step refers to), as :func:`~torch_sac._blocks.find_blocks` finds them for
    ``apply_sac``; ``[]`` when none has two or more."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    best = []
    for m in modules:
        if id(m) in inner:
            continue
        blocks = find_blocks(m)
        if len(blocks) > len(best):
            best = blocks
    return best if len(best) >= 2 else []


def _backward_held(profile: RegionProfile, span, held, boundaries) -> int:
    """The most of one block (``span``, its input excluded) that its own
    backward holds at once, when forward kept the storages ``held``: the
    region's rebuilds simulated on the profile.

    Backward unpacks each storage autograd saved near where forward saved
    it (``StorageRecord.saved_at``; a storage the calls after the block
    save, its output, first), in reverse order. One not kept is rebuilt at
    its first unpack, replaying the calls it depends on (their producers
    and the calls writing into them in place) back to what is kept; of what
    that replay makes, what backward will still unpack stays (memoised),
    the rest is freed as the replay goes (the largest such storage is
    counted on top). A storage goes after its last unpack; a kept one that
    only replays read once backward has passed the call that made it. The
    boundaries (blocks' inputs) are counted by the blocks reading them.
    Checked against measured peaks of Hugging Face Llama and GPT-2 blocks
    and of blocks with in-place ops, routing, custom Functions and tied
    weights (``tests/python/test_block_chain.py``); where it is off, the
    planner's measured runs correct it."""
    records, storages = profile.records, profile.storages

    def own(st):
        owner = storages[st].owner
        return (
            storages[st].internal
            and st not in boundaries
            and owner is not None
            and span.start <= owner < span.end
        )

    unpacked_at = {}  # storage -> positions where backward unpacks it
    writers = {}  # storage -> calls of the block writing into it in place
    for i in range(span.start, span.end):
        for st in records[i].new_storages:
            if own(st) and storages[st].saved_by_autograd:
                at = [p for p in storages[st].saved_at if p >= span.start]
                if at:
                    unpacked_at[st] = at
        if records[i].op._schema.is_mutable:
            for st in records[i].storages:
                if st not in records[i].new_storages:
                    writers.setdefault(st, []).append(i)
    by_position = {}
    for st, at in unpacked_at.items():
        for p in set(at):
            by_position.setdefault(p, []).append(st)

    def released_at(st):
        # The position once past which backward frees it (None: never, in
        # this block: made outside any call the profile records).
        if st in unpacked_at:
            return min(unpacked_at[st])
        return storages[st].owner

    live, releases = set(), []  # releases: a heap of (-position, storage)

    def hold(st):
        live.add(st)
        position = released_at(st)
        if position is not None:
            heapq.heappush(releases, (-position, st))
        return storages[st].nbytes

    live_bytes = sum(hold(st) for st in held)
    most = live_bytes
    for p in sorted(by_position, reverse=True):
        for st in by_position[p]:
            if st in live:
                continue
            calls = set()
            work = [storages[st].owner] + [w for w in writers.get(st, ()) if w < p]
            while work:
                c = work.pop()
                if c in calls:
                    continue
                calls.add(c)
                for x in records[c].inputs:
                    if own(x) and x not in live:
                        work.append(storages[x].owner)
                        work += [w for w in writers.get(x, ()) if w < c]
            largest_freed = 0
            for c in sorted(calls):
                for x in records[c].new_storages:
                    if x in live or not own(x):
                        continue
                    if x in unpacked_at and min(unpacked_at[x]) <= p:
                        live_bytes += hold(x)
                    else:
                        largest_freed = max(largest_freed, storages[x].nbytes)
            most = max(most, live_bytes + largest_freed)
        while releases and -releases[0][0] >= p:
            _, x = heapq.heappop(releases)
            if x in live:
                live.discard(x)
                live_bytes -= storages[x].nbytes
    return most


def alike_block_seconds(profile: RegionProfile, spans) -> list[float]:
    """Each call's measured time, for the calls of blocks that ran the
    same calls (op, FLOPs, bytes read and made, saveable, in order) the
    median of that call's times over those blocks.

    Why: one profiled forward times each call over a few back-to-back runs,
    so a slow stretch of the machine lands on consecutive calls; on the
    bench's 8-block Llama an option's replay time differed by up to 40 %
    between two profiles of the same block. Blocks doing the same work cost
    the same, and the median over them keeps such a stretch from making one
    block look dearer than its twins, so the chain solver's choice between
    blocks is not decided by noise."""
    records, storages = profile.records, profile.storages
    seconds = [r.seconds for r in records]

    def signature(span):
        # What a call's work depends on that the profile knows: its op,
        # FLOPs (a matmul's inner size), the bytes it reads and makes.
        return tuple(
            (
                records[i].op,
                records[i].flops,
                tuple(storages[st].nbytes for st in records[i].inputs),
                tuple(storages[st].nbytes for st in records[i].new_storages),
                records[i].saveable,
            )
            for i in range(span.start, span.end)
        )

    alike: dict[tuple, list] = {}
    for span in spans:
        alike.setdefault(signature(span), []).append(span)
    for group in alike.values():
        if len(group) < 2:
            continue
        for k in range(group[0].end - group[0].start):
            median = statistics.median(records[s.start + k].seconds for s in group)
            for s in group:
                seconds[s.start + k] = median
    return seconds


class NotAChain(Exception):
    """The profiled step is not a chain of its blocks (why in the message)."""


def chain_spans(profile, n):
    """The spans of ``n`` blocks in call order, or :class:`NotAChain` unless
    each block ran exactly once, one after the other."""
    spans = sorted(profile.spans, key=lambda s: s.start)
    ran = [s.block for s in spans]
    if sorted(ran) != list(range(n)):
        counts = {b: ran.count(b) for b in range(n) if ran.count(b) != 1}
        raise NotAChain(f"blocks not called exactly once in the step: {counts}")
    if ran != list(range(n)):
        raise NotAChain("the blocks did not run in the order the model lists them")
    if any(s.end < 0 for s in spans):
        raise NotAChain("a block did not return")
    for a, b in zip(spans, spans[1:]):
        if a.end > b.start:
            raise NotAChain("a block ran inside another")
    return spans


class StepBlocks:
    """The step's blocks as the chain solver sees them.

    Built from a :class:`~torch_sac._op_profile.RegionProfile` of one
    forward whose ``spans`` bracket the modules ``blocks``; raises :class:`NotAChain`
    unless each block ran exactly once, one after the other.

    Attributes:
        chain: the :class:`~torch_sac.planners.chain.ChainBlock` of each block.
        chain_on_device: the same without the options that offload.
        offload: the :class:`OffloadModel` (None: no option offloads).
        outside: record indices of the calls outside the blocks (always kept).
        head_bytes: what the calls after the last block keep for backward.
        seconds: per profiled call, the time the options are priced by
            (:func:`alike_block_seconds`).
        segment_slowdown: how much slower than its blocks' forward a
            segment of several blocks replays, per doubling of its length
            (``chain.segment_seconds``; set by the device the step runs on).
    """

    def __init__(
        self,
        profile: RegionProfile,
        blocks,
        offload: OffloadModel | None = None,
        segment_slowdown: float = 0.0,
    ):
        spans = chain_spans(profile, len(blocks))
        self.profile = profile
        self.segment_slowdown = segment_slowdown
        self.modules = list(blocks)
        self.spans = spans
        records, storages = profile.records, profile.storages
        self.seconds = alike_block_seconds(profile, spans)
        seconds_of = self.seconds
        # What keeping a storage costs the knapsack (outside ones are kept anyway).
        self._storage_bytes = [st.nbytes if st.internal else 0 for st in storages]
        owner_block = {}
        for s in spans:
            for i in range(s.start, s.end):
                owner_block[i] = s.block
        self.outside = [i for i in range(len(records)) if i not in owner_block]
        # What the calls after the last block keep for backward (the head,
        # the loss): freed before the blocks' backward starts.
        self.head_bytes = sum(
            storages[st].nbytes
            for st in {
                st
                for i in range(spans[-1].end, len(records))
                for st in records[i].new_storages
                if storages[st].internal and storages[st].saved_by_autograd
            }
        )
        # The storage each block reads as its input, and the call that made
        # it when that call is in the previous block (a boundary to keep).
        boundaries = set()
        self.input_calls = []
        input_bytes = []
        for s in spans:
            st = None if s.input_storage is None else storages[s.input_storage]
            owner = None if st is None else st.owner
            if st is not None and st.internal and owner is not None and owner in owner_block:
                boundaries.add(s.input_storage)
                self.input_calls.append(owner)
                input_bytes.append(st.nbytes)
            else:
                # Made outside the blocks (kept anyway) or outside the step.
                self.input_calls.append(None)
                input_bytes.append(0)
        self.offload = offload
        # Calls making a block's input stay on the device (see offloading()).
        boundary_calls = {i for i in self.input_calls if i is not None}
        # per block: [(ChainOption, saved record indices, offloaded record indices)]
        self.options = []
        # per block: {name of an option it does not list: the listed option
        # keeping the same} (see _distinct)
        self.aliases = []
        chain = []
        for s, in_bytes, input_call, module in zip(spans, input_bytes, self.input_calls, blocks):
            calls = [i for i in range(s.start, s.end) if records[i].saveable]
            # An offload option moving nothing is its base option.
            unmoved = {}

            def held(saved, span=s):
                # A saved call's storage stays if autograd saves it, or if a
                # call the region may replay reads it (the tape holds a
                # replay's inputs that it cannot rebuild): any call it does
                # not keep, but the one making the next block's input, which
                # that block keeps. A call that makes no new storage (a
                # view, an in-place op) is not replayed on its own.
                chosen = set(saved) | boundary_calls
                read_by_replayed = {
                    st
                    for i in range(span.start, span.end)
                    if i not in chosen and records[i].new_storages
                    for st in records[i].inputs
                }
                return {
                    st
                    for i in saved
                    for st in records[i].storages
                    if storages[st].internal
                    and (storages[st].saved_by_autograd or st in read_by_replayed)
                    and st not in boundaries
                }

            def kept(held_storages, in_bytes=in_bytes):
                return in_bytes + sum(storages[st].nbytes for st in held_storages)

            every = range(s.start, s.end)
            full_seconds = sum(seconds_of[i] for i in every)

            def option(name, saved, every=every, span=s, in_bytes=in_bytes):
                saved = sorted(saved)
                chosen = set(saved)
                seconds = sum(seconds_of[i] for i in every if i not in chosen)
                held_storages = held(saved)
                in_backward = in_bytes + _backward_held(profile, span, held_storages, boundaries)
                return (
                    ChainOption(name, kept(held_storages), seconds, in_backward=in_backward),
                    saved,
                    [],
                )

            def offloading(
                name,
                base,
                calls,
                share=None,
                with_input=False,
                full_seconds=full_seconds,
                input_call=input_call,
                in_bytes=in_bytes,
                unmoved=unmoved,
            ):
                """``base`` (an option) with the outputs of ``calls`` that
                it keeps (and ``with_input``, its input) in host memory: all
                of them, or (``share``) the largest ones up to that many
                bytes; None if none moves."""
                base_option, saved, _ = base
                held_now = held(saved)
                moves = []
                if with_input and input_call is not None and in_bytes >= max(1, offload.min_bytes):
                    # Made by the previous block's last call, which offloads
                    # it for this block.
                    moves.append((in_bytes, input_call))
                for i in calls:
                    own = [
                        st
                        for st in records[i].new_storages
                        if st in held_now and storages[st].nbytes >= offload.min_bytes
                    ]
                    # A call making the next block's input keeps it: that
                    # block counts it (and reads it first in backward).
                    if own and i not in boundary_calls:
                        moves.append((sum(storages[st].nbytes for st in own), i))
                if share is not None:
                    # The largest first; among equals the earliest, whose
                    # copy out has the most of the forward to hide behind
                    # and whose copy back the most of the backward.
                    moves.sort(key=lambda m: (-m[0], m[1]))
                    chosen, room = [], share
                    for nbytes, i in moves:
                        if nbytes <= room:
                            chosen.append((nbytes, i))
                            room -= nbytes
                    moves = chosen
                moved = sum(nbytes for nbytes, _ in moves)
                if not moved:
                    unmoved[name] = (base_option.name, tuple(saved))
                    return None
                return (
                    ChainOption(
                        name,
                        base_option.kept - moved + offload.lagging_bytes(moved, full_seconds),
                        base_option.seconds + offload.exposed_seconds(moved, full_seconds),
                        offloaded=moved,
                        # Backward brings them back before it unpacks them.
                        in_backward=base_option.in_backward,
                    ),
                    saved,
                    sorted(i for _, i in moves),
                )

            # Keeping everything keeps the calls whose outputs are written
            # later too (dropout's mask: empty_like, bernoulli_, div_): a
            # region keeps the storage itself, as saving everything does, so
            # no random mask is drawn again in backward. (Only policies that
            # cache a call's output at the call, PyTorch's SAC and the
            # drop-in, cannot; a plan runs as a region.)
            keep_all = option("keep all", every)
            matmuls = [i for i in calls if records[i].op._schema.name in MATMULS]
            with_matmuls = option("matmuls", matmuls)
            options = [keep_all, with_matmuls]
            if offload is not None:
                hidden = offload.hidden_bytes(full_seconds)
                options += [
                    # The matmuls' own outputs go to the host; what else
                    # they keep (an input, a boundary) stays.
                    offloading(OFFLOAD_MATMULS, with_matmuls, matmuls),
                    offloading(OFFLOAD_ALL, keep_all, every, with_input=True),
                ]
                if hidden:
                    options += [
                        offloading(
                            "keep all" + OFFLOAD_HIDDEN, keep_all, every, hidden, with_input=True
                        ),
                        offloading(
                            "matmuls" + OFFLOAD_HIDDEN,
                            with_matmuls,
                            matmuls,
                            hidden,
                            with_input=True,
                        ),
                        # Per tensor, save (in host memory) or recompute:
                        # the knapsack's calls most worth their bytes, within
                        # what the link hides; the rest recomputed.
                        offloading(
                            "recompute" + OFFLOAD_HIDDEN,
                            option("recompute", self._knapsack(calls, hidden)),
                            every,
                        ),
                    ]
            activation = keep_all[0].kept
            for share in KNAPSACK_SHARES:
                options.append(
                    option(f"knapsack {share:.0%}", self._knapsack(calls, int(share * activation)))
                )
            recompute_all = option("input", [])
            options.append(recompute_all)
            if offload is not None:
                # Its input too (fairscale's offload_to_cpu): this block
                # reads it back first thing in its backward.
                options.append(offloading(OFFLOADED_INPUT, recompute_all, [], with_input=True))
            # An offload option that moves nothing is None.
            options, aliases = _distinct([o for o in options if o is not None])
            for name, (base, saved) in unmoved.items():
                base = aliases.get(base, base)
                if not any(o.name == base for o, _, _ in options):
                    # Its base is not listed itself ("recompute"): the
                    # listed option keeping the same calls on the device.
                    base = next(
                        (
                            o.name
                            for o, kept, moved in options
                            if tuple(kept) == saved and not moved
                        ),
                        None,
                    )
                if base is not None:
                    aliases[name] = base
            self.options.append(options)
            self.aliases.append(aliases)
            chain.append(
                ChainBlock(
                    options=tuple(o for o, _, _ in options),
                    input_bytes=in_bytes,
                    activation=activation,
                    full_seconds=full_seconds,
                    # This rank's bytes: a DTensor parameter's local shard.
                    grad=sum(
                        t.numel() * t.element_size()
                        for p in module.parameters()
                        if p.requires_grad
                        for t in plain_tensors(p)
                    ),
                    rebuilt=recompute_all[0].in_backward,
                )
            )
        self.chain = chain
        # The chain without the offload options, and the most any choice
        # over the blocks can keep in host memory.
        self.chain_on_device = [
            dataclasses.replace(b, options=tuple(o for o in b.options if not o.offloaded))
            for b in chain
        ]
        self.offloadable = sum(max(o.offloaded for o in b.options) for b in chain)

    def _knapsack(self, calls, budget):
        """The calls the budget planner's solver saves within ``budget`` bytes
        of the block's storages, valued by their measured time."""
        if not calls:
            return []
        solution = _C.budget_solve(
            self._storage_bytes,
            [self.seconds[i] for i in calls],
            [list(self.profile.records[i].storages) for i in calls],
            budget,
            "auto",
        )
        return [calls[j] for j in solution["chosen"]]

    def saved_calls(self, choices: list[BlockChoice]) -> list[tuple[str, int]]:
        """The op calls a region keeps for ``choices`` (one per block):
        everything outside the blocks, each segment's input, and each
        single-block segment's option."""
        self.check(choices)
        records = self.profile.records
        saved = set(self.outside)  # everything, as "keep all" (above)
        for block, choice in enumerate(choices):
            if choice.option == "in segment":
                continue
            if self.input_calls[block] is not None:
                saved.add(self.input_calls[block])
            if choice.option != "segment start":
                saved.update(self._option(block, choice.option)[1])
        return sorted((op_name(records[i].op), records[i].call_index) for i in saved)

    def offloaded_calls(self, choices: list[BlockChoice]) -> list[tuple[str, int]]:
        """Of :meth:`saved_calls`, those whose outputs are kept in host
        memory (by the offload options chosen)."""
        self.check(choices)
        records = self.profile.records
        moved = set()
        for block, choice in enumerate(choices):
            if choice.option not in ("segment start", "in segment"):
                moved.update(self._option(block, choice.option)[2])
        return sorted((op_name(records[i].op), records[i].call_index) for i in moved)

    def option_names(self, block: int) -> list[str]:
        """The names of the options block ``block`` offers, in the order
        the solver tries them."""
        return [o.name for o, _, _ in self.options[block]]

    def resolve(self, block: int, name: str) -> str:
        """The name under which block ``block`` lists option ``name``: the
        name itself, or that of the option keeping the same calls (a block
        with no matmuls keeps its input under ``"matmuls"``; an offload
        option that moves nothing keeps what its base option keeps).
        Raises :class:`PlanInvariantError` for an option the block has no
        equivalent of."""
        if name in self.option_names(block):
            return name
        alias = self.aliases[block].get(name)
        if alias is None:
            raise PlanInvariantError(
                f"block {block} ({type(self.modules[block]).__name__}) has no option "
                f"{name!r} (its options: {', '.join(self.option_names(block))})"
            )
        return alias

    def _option(self, block, name):
        """``(ChainOption, saved, offloaded)`` of the block's option ``name``."""
        listed = self.resolve(block, name)
        return next(o for o in self.options[block] if o[0].name == listed)

    def check(self, choices: list[BlockChoice]) -> None:
        """Raises :class:`PlanInvariantError` unless ``choices`` is a plan
        of this step: every block's option one it offers, segments
        covering the chain (:func:`~torch_sac.planners.chain.check_choices`)."""
        check_choices(self.chain, choices, names=self._block_name)

    def _block_name(self, block):
        return f"block {block} ({type(self.modules[block]).__name__})"

    def rows(self, choices: list[BlockChoice], details, names=None) -> list[BlockRow]:
        """A :class:`~torch_sac.planners.peak_plan.BlockRow` per block for
        ``choices``: the bytes as modelled, the calls kept, and the replays
        of its calls that a run of the plan measured (``details``, the
        run's ``op_details()``). ``names``: ``{id(module): qualified name}``."""
        self.check(choices)
        records = self.profile.records
        replays = {row["op"]: row.get("replays_by_call") or () for row in details}
        saved = set(self.saved_calls(choices))
        rows = []
        for block, (choice, span) in enumerate(zip(choices, self.spans)):
            calls = [
                (op_name(records[i].op), records[i].call_index)
                for i in range(span.start, span.end)
                if records[i].saveable
            ]
            chain_block = self.chain[block]
            if choice.option == "segment start":
                kept, offloaded = chain_block.input_bytes, 0
            elif choice.option == "in segment":
                kept, offloaded = 0, 0
            else:
                option = self._option(block, choice.option)[0]
                kept, offloaded = option.kept, option.offloaded
            by_op = [replays.get(op, ()) for op, _ in calls]
            module = self.modules[block]
            rows.append(
                BlockRow(
                    block=block,
                    module=(names or {}).get(id(module), type(module).__name__),
                    option=choice.option,
                    calls=len(calls),
                    kept_calls=sum(1 for c in calls if c in saved),
                    activation_bytes=chain_block.activation,
                    kept_bytes=kept,
                    offloaded_bytes=offloaded,
                    replayed_ops=sum(r[i] for r, (_, i) in zip(by_op, calls) if 0 <= i < len(r)),
                )
            )
        return rows

    def recipe(self, name: str, every: int = 1) -> list[BlockChoice]:
        """The choices of a hand-written recipe: every block keeping option
        ``name`` (as the block lists it: :meth:`resolve`), or (``every`` >
        1) segments of ``every`` blocks."""
        n = len(self.chain)
        if every <= 1:
            return [BlockChoice(self.resolve(j, name), (j, j)) for j in range(n)]
        choices = []
        for j in range(0, n, every):
            e = min(n, j + every) - 1
            if e == j:
                choices.append(BlockChoice(self.resolve(j, "input"), (j, j)))
            else:
                choices.append(BlockChoice("segment start", (j, e)))
                choices += [BlockChoice("in segment", (j, e))] * (e - j)
        return choices


# Among options keeping the same calls, the name a plan shows: what the
# block then does, plainly (a block with no matmuls keeping "matmuls" keeps
# its input), else the first listed.
_PLAIN_NAMES = ("keep all", "input")


def _distinct(options):
    """Options saving and offloading the same calls once, and the names
    dropped: ``(options, {dropped name: the listed option's name})``. The
    one listed is where the first of them was, under a plain name
    (:data:`_PLAIN_NAMES`) when one of them has it."""
    groups = {}
    for option, saved, offloaded in options:
        groups.setdefault((tuple(saved), tuple(offloaded)), []).append((option, saved, offloaded))
    kept, aliases = [], {}
    for group in groups.values():
        names = [o.name for o, _, _ in group]
        plain = [n for n in _PLAIN_NAMES if n in names]
        name = plain[0] if plain else names[0]
        option, saved, offloaded = group[0]
        kept.append((dataclasses.replace(option, name=name), saved, offloaded))
        aliases.update({n: name for n in names if n != name})
    return kept, aliases
