"""Checkpointing a region of code in place: ``with torch_sac.sac_context(policy):``."""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Any

import torch

from . import _C, _compile, _fsdp, _state
from ._budget_types import ReplayBudget, check_replay_budget, unpack_plan
from ._modes import handler_mode
from ._policy_conversion import PolicyLike, as_op_policy
from .schedule import ReplaySchedule

__all__ = ["ReplayBudget", "sac_context"]

# Thread state lives in torch_sac._state; the old names stay here for callers.
_stack = _state.stack
in_region = _state.in_region
_observers = _state.observers


def _warn_kept(region):
    """One warning per region that kept saved tensors its policy would drop:
    of a kind it cannot rebuild, or made or written by ops it cannot replay.
    What would be dropped is not, and nothing else says so."""
    kinds = region.kept_as_is()
    ops = [r for r in region.op_details() if r["kept_anyway"]]
    if not kinds and not ops:
        return
    causes = []
    if kinds:
        which = ", ".join(f"{kind} ({n})" for kind, (n, _) in kinds.items())
        causes.append(
            f"{sum(n for n, _ in kinds.values())} tensors "
            f"({sum(b for _, b in kinds.values())} bytes) of a kind it cannot rebuild: {which} "
            "(make a tensor subclass traceable: __tensor_flatten__ and __tensor_unflatten__)"
        )
    if ops:
        which = ", ".join(
            f"{r['op']} ({r['kept_anyway']}, {r['kept_anyway_bytes']} bytes: {r['kept_why']})"
            for r in ops
        )
        whys = " ".join(r["kept_why"] for r in ops)
        fixes = [
            fix
            for cue, fix in (
                (
                    "collective",
                    "functional collectives (torch.distributed._functional_collectives), "
                    "or c10d's that fill a fresh buffer (all_gather_into_tensor, "
                    "reduce_scatter_tensor, all_to_all_single)",
                ),
                ("list of tensors", "out-of-place ops"),
            )
            if cue in whys
        ]
        causes.append(
            f"tensors made or written by ops it cannot replay: {which}"
            + (f" (use {' and '.join(fixes)})" if fixes else "")
        )
    warnings.warn(
        "torch_sac.sac_context: this region kept tensors autograd saved that its policy would "
        "recompute: " + "; ".join(causes) + ". Or checkpoint that code with "
        "torch.utils.checkpoint. sac_context.kept_as_is() and op_details() (kept_anyway, "
        "kept_why) list them.",
        stacklevel=3,
    )


class sac_context:
    """Selective activation checkpointing for the code inside a ``with`` block.

    Every op that runs in the block is recorded by torch_sac's C++
    interceptor and passed to ``policy``. Outputs the policy saves are kept
    for backward as usual; outputs it marks for recompute are not held by the
    region: when backward needs one, the recorded ops that rebuild it are
    replayed in C++, below autograd, with no Python code re-run.

    Args:
        policy: a callable ``policy(ctx, op, *args, **kwargs)`` with PyTorch's
            signature returning :class:`torch_sac.Policy`,
            :class:`torch.utils.checkpoint.CheckpointPolicy` or a bool; a
            list of ops to save (OpOverloads or OpOverloadPackets); a
            built-in from :mod:`torch_sac.policies`; or a
            :class:`~torch_sac.PeakPlan` (``policies.plan_peak(...,
            peak_bytes=...)``), which brings its replay budget too.
        allow_cache_entry_mutation (bool): an output the policy saved that a
            replay needs, modified in place after use, raises by default;
            ``True`` lets the replay use the modified value.
        replay_budget (int or torch_sac.ReplayBudget, optional): at most
            this many bytes of rebuilt tensors held by the region during
            backward (a :class:`ReplayBudget` with ``counts_saved=True``
            counts the live outputs the policy kept, too). By default a replay
            keeps every tensor it rebuilds that autograd will unpack later;
            with a budget it keeps evenly spaced checkpoints and the tensors
            needed next, and rebuilds the others again when they are
            unpacked (multiple recomputation). Gradients are unchanged. It
            lets one region around a whole model with ``recompute_all`` run
            backward in a few blocks' memory. Set it on the outermost region.
        replay_schedule (torch_sac.ReplaySchedule, optional): what each
            rebuild in backward keeps, exactly (see :meth:`replay_schedule`);
            backward raises if the rebuilds differ from the schedule's. Not
            with ``replay_budget``.

    Example:
        >>> policy = torch_sac.policies.save_matmuls()
        >>> h = x
        >>> for block in blocks:
        ...     with torch_sac.sac_context(policy) as region:
        ...         h = block(h)
        >>> loss(h).backward()
        >>> region.stats()["dropped_bytes"]   # of the last block's region

    Caveats:
        * Put one region around each block, as with
          :func:`torch.utils.checkpoint.checkpoint`, or set ``replay_budget``:
          a dropped tensor is rebuilt from the nearest tensors its region
          keeps, so without a budget one region around a whole model with
          ``recompute_all`` rebuilds, and holds, most of the forward at the
          first unpack.
        * Random ops replay with the random state they drew from in forward,
          so dropout masks match. An op that wrote to a tensor from outside
          the region (BatchNorm's running statistics) is replayed against a
          copy: the outside tensor is updated exactly once.
        * Nested regions stack their policies on the outermost region: MUST
          beats PREFER, the innermost PREFER wins, two different MUSTs raise.
          As with nested checkpoints, an inner region's tensors that the
          outer region's rebuilds run through are not kept for it: they are
          rebuilt again when the inner region's backward needs them.
        * Autograd's saved tensors inside the region go through the region's
          ``saved_tensors_hooks``; hooks a user enters *inside* the region
          (e.g. ``save_on_cpu``) take precedence for the tensors saved under
          them, hooks entered *outside* it do not see the region's tensors.
        * A region is thread-local; backward may run on any thread.
        * ``retain_graph=True``: a second backward replays again.
        * With grad disabled or in inference mode nothing is recorded.
    """

    def __init__(
        self,
        policy: PolicyLike,
        *,
        allow_cache_entry_mutation: bool = False,
        replay_budget: int | ReplayBudget | None = None,
        replay_schedule: ReplaySchedule | None = None,
    ) -> None:
        if torch.compiler.is_compiling():
            _compile.refuse_region_while_compiling()
        if not isinstance(allow_cache_entry_mutation, bool):
            raise TypeError(
                "torch_sac.sac_context: allow_cache_entry_mutation must be a bool, "
                f"got {allow_cache_entry_mutation!r}"
            )
        policy, planned_budget = unpack_plan(policy, replay_budget)
        if replay_schedule is None:  # a schedule says what to keep, not a plan's budget
            replay_budget = planned_budget
        self._policy = as_op_policy(policy, "sac_context")
        self._allow = allow_cache_entry_mutation
        self._replay_budget = check_replay_budget(replay_budget, "sac_context")
        if replay_schedule is not None and not isinstance(replay_schedule, ReplaySchedule):
            raise TypeError(
                "torch_sac.sac_context: replay_schedule must be a torch_sac.ReplaySchedule "
                f"(e.g. region.replay_schedule() or ReplaySchedule.load(path)), got {replay_schedule!r}"
            )
        if replay_schedule is not None and replay_budget is not None:
            raise ValueError(
                "torch_sac.sac_context: pass replay_budget or replay_schedule, not both: the "
                "schedule already says what each rebuild keeps"
            )
        self._replay_schedule = replay_schedule
        self._region = None
        self._owner = False
        self._exits = []
        self._torn_down = False

    def __enter__(self) -> sac_context:
        if self._region is not None:
            raise RuntimeError("torch_sac.sac_context: this context is already entered")
        stack = _state.stack()
        if stack:
            if self._replay_budget is not None or self._replay_schedule is not None:
                raise ValueError(
                    "torch_sac.sac_context: replay_budget or replay_schedule is set on a region "
                    "nested in another one; nested regions record into the outermost region, "
                    "whose backward applies: set it there"
                )
            self._region = stack[-1]._region
            self._region.push_policy(self._policy)
            self._exits = [self._region.pop_policy]
        else:
            budget = () if self._replay_budget is None else self._replay_budget
            self._region = _C.Region(self._policy, self._allow, *budget)
            if self._replay_schedule is not None:
                self._region.set_replay_schedule(self._replay_schedule._steps())
            self._owner = True
            hooks = torch.autograd.graph.saved_tensors_hooks(
                self._region.pack_hook(), _C.unpack_saved
            )
            mode = handler_mode(self._region)
            hooks.__enter__()
            try:
                mode.__enter__()
            except BaseException:
                hooks.__exit__(None, None, None)
                raise
            _state.region_opened()
            units = _fsdp.units_seen()
            # Undone in reverse order on exit.
            self._exits = [
                _state.region_closed,
                lambda: hooks.__exit__(None, None, None),
                lambda: mode.__exit__(None, None, None),
                self._region.close,
            ]
            if units is not None:
                region = self._region
                self._exits.insert(0, lambda: units.close(region))
        # The policy is only asked in forward; the region lets go of it on
        # exit, and so does this object (no reference cycle through a policy
        # that is a bound method of a module keeping its region).
        self._policy = None
        stack.append(self)
        if self._owner:
            for observer in list(_state.observers()):
                observer.region_entered(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._torn_down:
            return False  # already exited (an out-of-order exit undid it and raised)
        stack = _state.stack()
        if self not in stack:
            raise RuntimeError(
                "torch_sac.sac_context: exited on a thread that did not enter it, or "
                "never entered; regions must exit on the thread that entered them"
            )
        out_of_order = stack[-1] is not self
        # Whatever the order, nothing this region (and any region entered
        # after it) installed stays installed.
        error = None
        while stack:
            ctx = stack.pop()
            ctx._torn_down = True
            error = ctx._undo() or error
            if ctx is self:
                break
        if out_of_order:
            raise RuntimeError(
                "torch_sac.sac_context: regions must exit in the reverse order they "
                "were entered (a generator holding a region closed late?); the regions "
                "entered after this one were exited with it"
            ) from error
        if error is not None:
            raise error
        if self._owner and exc_type is None:
            _warn_kept(self._region)
        return False

    def _undo(self):
        """Runs this context's exit steps, all of them; returns the first error."""
        exits, self._exits = self._exits, []
        error = None
        for undo in reversed(exits):
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - finish undoing, then report
                error = error or e
        if self._owner:
            for observer in list(_state.observers()):
                observer.region_exited(self)
        return error

    def stats(self) -> dict[str, int]:
        """Counters of the (outermost) region this context recorded into.

        ``policy_calls``; ``saved_ops``/``saved_bytes`` and
        ``dropped_ops``/``dropped_bytes`` (ops whose new outputs the policy
        kept or dropped, and their storage bytes); ``held_bytes`` (copies of
        outside tensors the region overwrote, e.g. BatchNorm running stats);
        ``packed_kept``/``packed_dropped`` (tensors autograd saved, kept as is
        or replaced by a reference); ``unpacked_original`` (references served
        by a still-live original); ``replayed_ops`` and ``replay_ns``
        (backward replays and their time); ``record_ns`` (time spent
        recording ops in forward, outside the ops themselves);
        ``memo_bytes`` (rebuilt tensors held now for unpacks to come),
        ``peak_memo_bytes`` (the most held after a replay: at most
        ``replay_budget``), ``memos_skipped`` (rebuilt tensors the budget,
        or a nested region's scope, did not let the region keep, rebuilt
        again when unpacked). Under a budget: ``peak_held_bytes`` (with
        ``counts_saved``: the most of rebuilt tensors plus live kept
        outputs after a replay), ``budget_choice_ns`` (time spent choosing
        what to keep), ``spaced_choices`` (choices made by the spaced
        heuristic rather than the optimal reversal), ``replayed_cost`` (the
        replays' estimated cost, nominal ns), ``first_rebuild_replayed_ops``.
        """
        self._check_used("stats")
        return self._region.stats()

    def op_summary(self) -> list[tuple[str, int, int, int]]:
        """Per op overload, first-seen order: ``(op, saved, dropped, replayed)``."""
        self._check_used("op_summary")
        return self._region.op_summary()

    def kept_as_is(self) -> dict[str, tuple[int, int]]:
        """The tensors autograd saved in this region that the region kept as
        they are because it cannot rebuild their kind: ``{kind: (tensors,
        storage bytes)}``, e.g. ``{"a quantized tensor": (4, 8192)}``. A
        tensor subclass with ``__tensor_flatten__`` (DTensor) is not among
        them: the region drops and rebuilds its inner tensors."""
        self._check_used("kept_as_is")
        return dict(self._region.kept_as_is())

    def op_details(self) -> list[dict[str, Any]]:
        """Per op overload, first-seen order: a dict with ``op``, ``saved``,
        ``dropped`` (calls whose new outputs were kept or dropped),
        ``saved_bytes``, ``dropped_bytes`` (their storage bytes), ``replayed``
        and ``replay_ns`` (replays in backward and their time), and
        ``kept_anyway``, ``kept_anyway_bytes``, ``kept_why``: tensors autograd
        saved from what the op made or wrote that the region kept although
        the policy would recompute them, since it cannot replay the op, and
        why (a collective other than a functional one, a write to a list of
        tensors, a tensor kind it cannot rebuild)."""
        self._check_used("op_details")
        return self._region.op_details()

    def replay_schedule(self) -> ReplaySchedule:
        """The schedule this region ran: the op calls forward kept and, per
        rebuild of the last backward pass, the tensor it was for and the ones
        it kept (a :class:`torch_sac.ReplaySchedule`; ``sac_context(...,
        replay_schedule=...)`` runs it again)."""
        self._check_used("replay_schedule")
        return ReplaySchedule(self._region.executed_schedule(), self._region.saved_calls())

    def _check_used(self, what):
        if self._region is None:
            raise RuntimeError(f"torch_sac.sac_context.{what}: the context was never entered")
