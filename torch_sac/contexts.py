"""A drop-in for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``."""

from __future__ import annotations

import functools
import gc
import inspect
import sys
import weakref
from types import TracebackType
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _C, _compat
from ._modes import handler_mode
from ._policy_conversion import PolicyLike, as_op_policy
from ._state import observers as _observers

__all__ = ["create_selective_checkpoint_contexts", "selective_policy_of_contexts"]


class SelectiveContext:
    """One of the two contexts: routes ops through a C++ handler while entered.

    The forward context tells this thread's observers (an active
    ``torch_sac.profile``) when it is entered and exited, as an outermost
    ``sac_context`` does. The recompute context tells the observers its
    forward context told, on whatever thread recompute runs, through
    ``_recompute_entered(forward)`` and ``_recompute_exited(forward)``.
    """

    def __init__(self, state, handler, on_enter=None, on_exit=None, forward=None):
        self._state = state
        self._mode = handler_mode(handler, on_enter, on_exit)
        # Set on the recompute context: torch.utils.checkpoint lets go of
        # the forward context after forward and keeps only this one.
        self._forward = forward
        # On the forward context: weak, so a graph kept alive does not keep
        # a finished profile alive.
        self._told = ()
        self._entered = False
        self._exit_watch = None
        self._generator_frame = None
        # (policy, allow_cache_entry_mutation) on a forward context not yet
        # entered: torch_sac.checkpoint runs a pair it is given in a region.
        self._made_from = None

    def __enter__(self) -> SelectiveContext:
        self._made_from = None
        self._mode.__enter__()
        self._entered = True
        if self._forward is None:
            observers = list(_observers())
            self._told = tuple(weakref.ref(o) for o in observers)
            for observer in observers:
                observer.region_entered(self)
            self._watch_checkpoint_frame(sys._getframe(1))
        else:
            for observer in self._forward._observers_told():
                observer._recompute_entered(self._forward)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if not self._entered:
            # Exited already, when torch's checkpoint() ended by an error
            # (torch <= 2.12); this is its generator being closed late.
            return False
        self._entered = False
        self._generator_frame = None
        if self._exit_watch is not None:
            _C.unwatch_frame_exit(self._exit_watch)
            self._exit_watch = None
        try:
            return self._mode.__exit__(exc_type, exc, tb)
        finally:
            if self._forward is None:
                for observer in self._observers_told():
                    observer.region_exited(self)
            else:
                for observer in self._forward._observers_told():
                    observer._recompute_exited(self._forward)

    def _watch_checkpoint_frame(self, frame):
        """torch <= 2.12: when torch's checkpoint() ends while this context is
        still entered (its function raised), close torch's generator then, as
        torch 2.13 does, instead of whenever the garbage collector does."""
        checkpoint_frame = _compat.checkpoint_frame_entering(frame)
        if checkpoint_frame is not None:
            self._generator_frame = frame
            self._exit_watch = _C.watch_frame_exit(checkpoint_frame, self._exit_after_error)

    def _exit_after_error(self):
        self._exit_watch = None
        frame, self._generator_frame = self._generator_frame, None
        if not self._entered:
            return
        # Closing the generator exits torch's own saved-tensor hooks too. An
        # error path only, so a scan for the generator object is affordable.
        for referrer in gc.get_referrers(frame):
            if inspect.isgenerator(referrer) and referrer.gi_frame is frame:
                referrer.close()
                break
        if self._entered:  # the generator was not found: exit this one alone
            self.__exit__(RuntimeError, None, None)

    def _observers_told(self):
        return [o for o in (ref() for ref in self._told) if o is not None]

    def stats(self) -> dict[str, int]:
        """Counters shared by both contexts of the pair.

        ``policy_calls`` (ops passed to the policy in forward), ``saved_ops``
        and ``saved_bytes`` (outputs cached in forward), ``replayed_ops``
        (ops re-run during recompute), ``cache_hits`` (cached outputs handed
        back during recompute), ``invalidated_ops`` (outputs cached, then
        written in place later in forward, so recomputed instead) and
        ``redirected_writes`` (in-place writes recompute made to a copy
        because forward had already made them, e.g. BatchNorm's running
        statistics) and ``replay_ns`` (time spent running the ops
        recompute re-ran, measured in C++ around each): the fields of
        ``torch_sac._C.dropin_stat_fields()``. ``recomputed_ops`` and
        ``recompute_ns``, the former names, are deprecated aliases kept for
        one release.
        """
        return self._state.stats()

    def op_summary(self) -> list[tuple[str, int, int, int]]:
        """Per op overload, in first-seen order: ``(op, saved, dropped, recomputed)``.

        ``saved`` calls had their outputs cached in forward, ``dropped`` calls
        were left to recompute, ``recomputed`` counts re-runs during recompute.
        Every call counts, views and in-place ops included (unlike
        :meth:`op_details`).
        """
        return self._state.op_summary()

    def op_details(self) -> list[dict[str, Any]]:
        """Per op overload, in first-seen order, in the format of
        :meth:`torch_sac.sac_context.op_details`: a dict with ``op``,
        ``saved`` and ``dropped`` (calls that made new tensors, whose outputs
        forward cached or left to recompute; views and in-place ops make none
        and count in neither), ``saved_bytes`` and ``dropped_bytes`` (the
        storage bytes of those new tensors), ``replayed`` and ``replay_ns``
        (calls recompute re-ran and their time) and ``replays_by_call`` (how
        often recompute re-ran each call, by call index).

        A call the policy saves but forward could not cache (a random op, an
        output written in place later in forward) counts as dropped: it is
        recomputed, where a region would have kept it.
        """
        return self._state.op_details()

    def saved_calls(self) -> list[tuple[torch._ops.OpOverload, int]]:
        """The calls whose outputs forward cached: ``[(op, call_index), ...]``.

        ``op`` is the OpOverload, ``call_index`` counts that op's calls in the
        region from 0 (ops in :data:`torch_sac.IGNORED_OPS` are not counted),
        as PyTorch's SAC keys its cache. Ordered by first call of each op,
        then by call index.
        """
        return self._state.saved_calls()


def create_selective_checkpoint_contexts(
    policy_fn_or_list: PolicyLike, allow_cache_entry_mutation: bool = False
) -> tuple[SelectiveContext, SelectiveContext]:
    """Contexts for selective activation checkpointing, run by torch_sac's C++ core.

    A drop-in for :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`:
    pass it (with ``functools.partial``) as ``context_fn`` to
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` or to
    ``checkpoint_wrapper``. Forward caches the outputs of ops the policy saves,
    keyed by (op, call index); recompute hands them back and re-runs the rest.

    Args:
        policy_fn_or_list: one of

            - a callable ``policy(ctx, op, *args, **kwargs)`` with PyTorch's
              signature (``ctx.op_output`` holds the op's output,
              ``ctx.is_recompute`` is always False), returning a
              :class:`torch_sac.Policy`, a
              :class:`torch.utils.checkpoint.CheckpointPolicy` or a bool;
            - a list of ops to save: OpOverloads, or OpOverloadPackets such as
              ``torch.ops.aten.mm`` matching every overload (PyTorch rejects
              packets);
            - a built-in from :mod:`torch_sac.policies`, decided in C++.
        allow_cache_entry_mutation (bool): by default a cached output mutated
            in place before backward raises, naming the op. ``True`` skips
            that check.

    Returns:
        ``(forward_context, recompute_context)``. Both have ``stats()``,
        ``op_summary()`` and ``op_details()``. Under an active
        :class:`torch_sac.profile` the pair is profiled like a
        ``sac_context`` region.

    Example:
        >>> ctx_fn = functools.partial(
        ...     torch_sac.create_selective_checkpoint_contexts,
        ...     [torch.ops.aten.mm, torch.ops.aten.addmm])
        >>> y = torch.utils.checkpoint.checkpoint(
        ...     fn, x, use_reentrant=False, context_fn=ctx_fn)

    Under ``torch.compile``, the contexts are PyTorch's own, answered by
    the policy's ``.to_torch()`` (see ``torch_sac.policies``): the
    compiled graph is partitioned by the same choices, and ``stats()`` is not
    available there.

    Caveats:
        The policy is called once per op in forward, after the op ran, and
        never during recompute. Ops in :data:`torch_sac.IGNORED_OPS` never
        reach it. With grad disabled or in inference mode nothing is recorded.
        A second backward through the region raises, as in PyTorch.
        ``*_CPU_OFFLOAD`` (``Policy.*_OFFLOAD``) offloads the outputs to host
        memory (:mod:`torch_sac.offload`), where PyTorch's eager SAC
        recomputes them.
    """
    if not isinstance(allow_cache_entry_mutation, bool):
        raise TypeError(
            "torch_sac.create_selective_checkpoint_contexts: "
            f"allow_cache_entry_mutation must be a bool, got {allow_cache_entry_mutation!r}"
        )
    policy = as_op_policy(policy_fn_or_list, "create_selective_checkpoint_contexts")
    if _compat.is_compiling():
        # torch.compile calls context_fn while AOTAutograd traces the region
        # and needs PyTorch's own modes there (it turns their decisions into
        # partitioner tags); the same policy answers them via to_torch().
        return _torch_checkpoint.create_selective_checkpoint_contexts(
            policy.to_torch(), allow_cache_entry_mutation=allow_cache_entry_mutation
        )
    state = _C.SelectiveCheckpoint(policy, allow_cache_entry_mutation)
    forward = SelectiveContext(
        state, state.caching, on_enter=state.begin_forward, on_exit=state.finish_forward
    )
    recompute = SelectiveContext(
        state,
        state.cached,
        on_enter=state.begin_recompute,
        on_exit=state.finish_recompute,
        forward=forward,
    )
    forward._made_from = (policy, allow_cache_entry_mutation)
    return forward, recompute


def selective_policy_of_contexts(contexts: object) -> tuple[Any, bool]:
    """``(policy, allow_cache_entry_mutation)`` of a pair of contexts made by
    torch_sac's or PyTorch's ``create_selective_checkpoint_contexts`` and not
    entered yet; ``(None, False)`` for anything else (PyTorch's modes
    subclassed, e.g. by xformers, included: a subclass may change what they
    do)."""
    if not isinstance(contexts, tuple) or len(contexts) != 2:
        return None, False
    forward, recompute = contexts
    if (
        isinstance(forward, SelectiveContext)
        and forward._made_from is not None
        and recompute._forward is forward
    ):
        return forward._made_from
    caching = getattr(_torch_checkpoint, "_CachingTorchDispatchMode", None)
    cached = getattr(_torch_checkpoint, "_CachedTorchDispatchMode", None)
    if caching is not None and type(forward) is caching and type(recompute) is cached:
        return forward.policy_fn, recompute.allow_cache_entry_mutation
    return None, False


def checkpoint_when_compiling(
    fn, args, kwargs, policy, allow_cache_entry_mutation, **torch_keywords
):
    """``torch_sac.checkpoint`` while Dynamo traces: PyTorch's checkpoint with
    torch_sac's contexts (PyTorch's SAC with ``policy.to_torch()`` under
    compile), given torch's keywords (``preserve_rng_state``, ...)."""
    context_fn = functools.partial(
        create_selective_checkpoint_contexts,
        policy,
        allow_cache_entry_mutation=allow_cache_entry_mutation,
    )
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=context_fn, **torch_keywords, **kwargs
    )


_SelectiveContext = SelectiveContext  # its former name
