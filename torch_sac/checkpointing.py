"""``torch_sac.checkpoint`` and ``torch_sac.checkpoint_sequential``: the front
door of :mod:`torch.utils.checkpoint`, with the region engine behind it."""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, Callable, Iterable

import torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _C, _compat, _compile
from ._policy_conversion import PolicyLike, as_op_policy
from ._budget_types import ReplayBudget, check_replay_budget, unpack_plan
from .contexts import (
    checkpoint_when_compiling,
    create_selective_checkpoint_contexts,
    selective_policy_of_contexts,
)
from .region import sac_context

__all__ = ["checkpoint", "checkpoint_sequential"]

_DETERMINISM_CHECKS = ("default", "none")

# The keywords checkpoint() takes besides the function's own: what
# checkpoint_sequential passes on, and what the decorator form keeps.
_CHECKPOINT_KEYWORDS = (
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "preserve_rng_state",
    "respect_saved_tensors_hooks",
    "policy",
    "allow_cache_entry_mutation",
    "replay_budget",
)


def _check_bool(value, keyword, where):
    if not isinstance(value, bool):
        raise TypeError(f"torch_sac.{where}: {keyword} must be a bool, got {value!r}")


def _check_torch_keywords(
    use_reentrant,
    determinism_check,
    debug,
    early_stop,
    preserve_rng_state,
    respect_saved_tensors_hooks,
    where,
):
    if use_reentrant is not None:
        _check_bool(use_reentrant, "use_reentrant", where)
    if use_reentrant:
        raise ValueError(
            f"torch_sac.{where}: use_reentrant=True is not supported: torch_sac's checkpoint "
            "is non-reentrant (forward records the ops it runs, backward replays the dropped "
            "ones; nothing re-enters autograd). Pass use_reentrant=False (or leave it out), "
            "or call torch.utils.checkpoint.checkpoint for the reentrant variant."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"torch_sac.{where}: determinism_check must be one of {list(_DETERMINISM_CHECKS)}, "
            f"got {determinism_check!r}"
        )
    _check_bool(debug, "debug", where)
    _check_bool(early_stop, "early_stop", where)
    _check_bool(preserve_rng_state, "preserve_rng_state", where)
    if respect_saved_tensors_hooks is not None:
        _check_bool(respect_saved_tensors_hooks, "respect_saved_tensors_hooks", where)


def _selective_policy(context_fn):
    """``(policy, allow_cache_entry_mutation, contexts)`` for a ``context_fn``
    that makes selective-checkpoint contexts (torch_sac's or PyTorch's
    ``create_selective_checkpoint_contexts``), which a region runs; ``policy``
    is None for any other ``context_fn``, whose ``contexts`` (made by calling
    it once) only PyTorch's checkpoint can run."""
    if isinstance(context_fn, functools.partial) and context_fn.func in (
        create_selective_checkpoint_contexts,
        _torch_checkpoint.create_selective_checkpoint_contexts,
    ):
        # The list or callable as the user wrote it: a list of ops becomes
        # torch_sac's C++ save_ops, not PyTorch's closure over it.
        bound = inspect.signature(context_fn.func).bind(*context_fn.args, **context_fn.keywords)
        bound.apply_defaults()
        return (
            bound.arguments["policy_fn_or_list"],
            bound.arguments["allow_cache_entry_mutation"],
            None,
        )
    contexts = context_fn()
    policy, allow = selective_policy_of_contexts(contexts)
    return policy, allow, contexts


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] = _torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    policy: PolicyLike | None = None,
    allow_cache_entry_mutation: bool = False,
    replay_budget: int | ReplayBudget | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoints ``function(*args, **kwargs)``: a drop-in for
    :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``).

    The call runs inside a :class:`torch_sac.sac_context` region: forward
    records the ops it runs and keeps the outputs ``policy`` saves; backward
    rebuilds the dropped ones by replaying the recorded ops in C++.
    ``function`` runs once, in forward, and never again in backward.

    Args:
        function: the function to checkpoint. Left out (with no ``args``),
            the call returns a decorator that checkpoints the function it
            wraps with these keywords, as in PyTorch 2.14+.
        *args: passed to ``function``.
        **kwargs: passed to ``function``.
        use_reentrant (bool, optional): ``None`` or ``False``. ``True``
            raises ``ValueError``: the region is non-reentrant.
        context_fn: as in PyTorch. A ``context_fn`` made from torch_sac's or
            PyTorch's ``create_selective_checkpoint_contexts`` (a
            ``functools.partial`` of it, or any callable returning its
            contexts) runs its policy in the region. Any other
            ``context_fn`` is run by PyTorch's non-reentrant checkpoint,
            which re-runs ``function`` in backward under its contexts.
        determinism_check (str): ``"default"`` or ``"none"``, as in PyTorch.
            A region's replay reruns the ops forward recorded, with
            forward's inputs and random state, so there is nothing to check.
        debug (bool): accepted; a region has no recompute trace to print.
        early_stop (bool): accepted; a replay runs only the ops that rebuild
            the tensor backward unpacks, which is what ``True`` asks for.
        preserve_rng_state (bool): accepted; replays always use forward's
            random state (``False`` only lets PyTorch skip saving it).
        respect_saved_tensors_hooks (bool, optional): ``None`` or ``False``
            with a selective policy (hooks entered outside the region do not
            see the tensors it keeps; enter them inside ``function``).
            Plain checkpointing keeps no tensors of its own, so any value is
            accepted there, as in PyTorch.
        policy: what to save, as for :class:`torch_sac.sac_context` (a
            callable, a list of ops, a built-in from
            :mod:`torch_sac.policies` or a :class:`~torch_sac.PeakPlan`).
            ``None`` (and no selective ``context_fn``): recompute everything,
            plain activation checkpointing.
        allow_cache_entry_mutation (bool): as for :class:`sac_context`.
        replay_budget (int or torch_sac.ReplayBudget, optional): as for
            :class:`sac_context`.

    Returns:
        What ``function`` returns.

    Example:
        >>> # xdoctest: +SKIP
        >>> y = torch_sac.checkpoint(block, x, use_reentrant=False)    # as torch's
        >>> y = torch_sac.checkpoint(block, x, policy=torch_sac.policies.save_matmuls())

    Under ``torch.compile`` (``function`` is traced), this is PyTorch's
    checkpoint with torch_sac's contexts: PyTorch's compiled selective
    checkpointing with the same policy, which recomputes each dropped op
    once (a ``replay_budget`` does not apply there; it warns).

    Caveats:
        * Python code in ``function`` runs once: side effects in it (a
          counter, a print, a hook) happen once per forward, not again in
          backward as with PyTorch's checkpoint.
        * See ``docs/migrating.md`` for the differences from
          :func:`torch.utils.checkpoint.checkpoint`, keyword by keyword.
    """
    where = "checkpoint"
    _check_torch_keywords(
        use_reentrant,
        determinism_check,
        debug,
        early_stop,
        preserve_rng_state,
        respect_saved_tensors_hooks,
        where,
    )
    if function is None and not args:
        if kwargs:
            raise ValueError(
                "torch_sac.checkpoint: as a decorator (no function given) it takes only "
                f"checkpoint's keywords; unexpected: {', '.join(kwargs)}"
            )
        options = dict(
            use_reentrant=use_reentrant,
            context_fn=context_fn,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            preserve_rng_state=preserve_rng_state,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
            policy=policy,
            allow_cache_entry_mutation=allow_cache_entry_mutation,
            replay_budget=replay_budget,
        )
        check_replay_budget(replay_budget, where)
        return functools.partial(_checkpointed, options=options)
    if not callable(function):
        raise TypeError(f"torch_sac.checkpoint: function must be callable, got {function!r}")
    check_replay_budget(replay_budget, where)
    contexts = None
    if context_fn is not _torch_checkpoint.noop_context_fn:
        if policy is not None:
            raise ValueError(
                "torch_sac.checkpoint: pass policy or context_fn, not both: a context_fn from "
                "create_selective_checkpoint_contexts already carries its policy"
            )
        policy, allow_cache_entry_mutation, contexts = _selective_policy(context_fn)
    if contexts is not None and policy is None:
        return _run_by_torch(
            function,
            args,
            kwargs,
            contexts,
            replay_budget,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            preserve_rng_state=preserve_rng_state,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
        )
    if policy is None:
        policy = _C.recompute_all()
    elif respect_saved_tensors_hooks:
        raise ValueError(
            "torch_sac.checkpoint: respect_saved_tensors_hooks=True is not supported with a "
            "selective policy: saved_tensors_hooks entered outside the checkpointed function "
            "(save_on_cpu) do not see the tensors the region keeps. Enter the hooks inside "
            "the function (they take precedence for the tensors saved under them), or use "
            "torch.utils.checkpoint.checkpoint."
        )
    if torch.compiler.is_compiling():
        policy, replay_budget = unpack_plan(policy, replay_budget)
        if replay_budget is not None:
            _compile.warn_replay_budget_ignored()
        return checkpoint_when_compiling(
            function,
            args,
            kwargs,
            policy,
            allow_cache_entry_mutation,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
        )
    with sac_context(
        policy, allow_cache_entry_mutation=allow_cache_entry_mutation, replay_budget=replay_budget
    ):
        return function(*args, **kwargs)


def _checkpointed(function, options):
    """The decorator form of :func:`checkpoint`."""
    if not callable(function):
        raise TypeError(f"torch_sac.checkpoint: can only decorate a callable, got {function!r}")

    @functools.wraps(function)
    def run(*args, **kwargs):
        return checkpoint(function, *args, **options, **kwargs)

    return run


def _run_by_torch(
    function,
    args,
    kwargs,
    contexts,
    replay_budget,
    *,
    respect_saved_tensors_hooks,
    **torch_keywords,
):
    """A ``context_fn`` that is not selective checkpointing: PyTorch's
    checkpoint runs it (and re-runs ``function`` in backward)."""
    if replay_budget is not None:
        raise ValueError(
            "torch_sac.checkpoint: replay_budget needs a region, and this context_fn is not "
            "one torch_sac can run in a region (only create_selective_checkpoint_contexts "
            "is): drop replay_budget, or pass the policy as policy="
        )
    if respect_saved_tensors_hooks is not None:
        if _compat.CHECKPOINT_TAKES_RESPECT_SAVED_TENSORS_HOOKS:
            torch_keywords["respect_saved_tensors_hooks"] = respect_saved_tensors_hooks
        elif respect_saved_tensors_hooks:
            raise ValueError(
                "torch_sac.checkpoint: respect_saved_tensors_hooks=True with this context_fn "
                f"needs torch 2.14 or later (this is {_compat.TORCH_RELEASE})"
            )
    return _torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: contexts,
        **torch_keywords,
        **kwargs,
    )


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoints a sequence of modules or functions in segments: a drop-in
    for :func:`torch.utils.checkpoint.checkpoint_sequential`.

    ``functions`` is split into ``segments`` runs of equal length (the last
    takes the remainder); each run but the last is checkpointed with
    :func:`torch_sac.checkpoint`, the last runs as usual, so backward starts
    with its activations at hand.

    Args:
        functions: a :class:`torch.nn.Sequential` (its children) or a list
            of modules or functions, each taking the previous one's output.
        segments (int): how many runs to split ``functions`` into, at least
            1 and at most ``len(functions)``.
        input: the first function's input.
        use_reentrant (bool, optional): as for :func:`checkpoint`.
        **kwargs: :func:`checkpoint`'s keywords (``policy``,
            ``preserve_rng_state``, ``replay_budget``, ...), applied to every
            checkpointed run.

    Returns:
        The last function's output.

    Example:
        >>> # xdoctest: +SKIP
        >>> model = nn.Sequential(*blocks)
        >>> out = torch_sac.checkpoint_sequential(model, 4, x, use_reentrant=False)
    """
    unexpected = [k for k in kwargs if k not in _CHECKPOINT_KEYWORDS]
    if unexpected:
        raise ValueError(
            "torch_sac.checkpoint_sequential: unexpected keyword arguments: "
            f"{', '.join(unexpected)} (it passes only checkpoint's keywords on: "
            f"{', '.join(k for k in _CHECKPOINT_KEYWORDS if k != 'use_reentrant')})"
        )
    # Checked here, not only by the checkpoint() calls below: with one
    # segment there are none, and a bad keyword would pass unnoticed.
    _check_torch_keywords(
        use_reentrant,
        kwargs.get("determinism_check", "default"),
        kwargs.get("debug", False),
        kwargs.get("early_stop", True),
        kwargs.get("preserve_rng_state", True),
        kwargs.get("respect_saved_tensors_hooks"),
        "checkpoint_sequential",
    )
    check_replay_budget(kwargs.get("replay_budget"), "checkpoint_sequential")
    if kwargs.get("policy") is not None:
        as_op_policy(unpack_plan(kwargs["policy"], None)[0], "checkpoint_sequential")
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    else:
        functions = list(functions)
    if isinstance(segments, bool) or not isinstance(segments, numbers.Integral):
        raise TypeError(
            f"torch_sac.checkpoint_sequential: segments must be an int, got {segments!r}"
        )
    if not 1 <= segments <= len(functions):
        raise ValueError(
            "torch_sac.checkpoint_sequential: segments must be between 1 and the number of "
            f"functions ({len(functions)}), got {segments}"
        )

    def run(start, end):
        def forward(x):
            for f in functions[start:end]:
                x = f(x)
            return x

        return forward

    size = len(functions) // segments
    for start in range(0, size * (segments - 1), size):
        input = checkpoint(run(start, start + size), input, use_reentrant=use_reentrant, **kwargs)
    last = size * (segments - 1)
    return run(last, len(functions))(input)
