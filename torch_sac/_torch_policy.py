"""``OpPolicy.to_torch()``: a torch_sac policy as a ``policy_fn`` for PyTorch's SAC.

The decision itself is made by the same C++ ``OpPolicy::decide`` torch_sac
uses; this module supplies what PyTorch's ``policy_fn(ctx, op, *args,
**kwargs)`` call does not carry:

* the call index (for ``every_nth``): PyTorch counts calls per op inside its
  forward mode (``_CachingTorchDispatchMode``), one mode object per
  checkpointed region, but does not pass the count. The policy_fn finds the
  mode calling it and keeps its own count per (mode, op), so counting starts
  at 0 in every region no matter how often the policy_fn object is reused,
  and a re-trace under torch.compile gets fresh modes and the same indices.
  PyTorch 2.13 calls the policy only in forward, once per op, right after the
  op ran and after its own counter advanced, so the counts agree with
  PyTorch's (op, call index) storage keys.
  PyTorch 2.11 (see ``_compat``) calls it before the op (no
  ``ctx.op_output``) and again for every op of each recompute, from its
  recompute mode with ``ctx.is_recompute=True``, and takes the cached outputs
  of the calls answered SAVE there in order; the answers must be forward's.
  Recompute calls are counted per (recompute mode, recompute pass), a pass
  being what PyTorch's checkpoint recomputes once for: the backward's graph
  task (or the current ``GraphExecGroup``). A recompute thus asks about the
  same (op, call index) as forward and gets the same answer, also on a second
  backward with ``retain_graph=True`` after an early-stopped recompute
  (which PyTorch 2.11 then serves from its consumed cache: it raises, or
  hands out an entry the first recompute left; 2.13 raises).
* the named scopes under torch.compile: the scopes then live in FX node
  metadata (``torch_sac.name`` becomes ``torch.fx.traceback.annotate``),
  which PyTorch makes current while it re-traces the region, so they are
  read from ``torch.fx.traceback.current_meta["custom"]``. Outside compile
  the C++ scope stack is used as is.
"""

import sys
import weakref

import torch
import torch.fx.traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from . import _C, _compat
from ._ignored_ops import IGNORED_OPS
from .scopes import ANNOTATION_PREFIX

__all__ = ["TorchPolicy"]

# CheckpointPolicy by value (torch_sac.Policy has the same values; the
# offload pair is *_CPU_OFFLOAD there).
_BY_VALUE = (
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD,
    CheckpointPolicy.PREFER_CPU_OFFLOAD,
)

# How far up the stack the calling dispatch mode may be (the policy_fn may be
# wrapped by a user's own policy_fn a few levels deep).
_MAX_FRAMES = 32


def _calling_mode(frame):
    """The TorchDispatchMode whose ``__torch_dispatch__`` is calling us."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "__torch_dispatch__":
            mode = frame.f_locals.get("self")
            if isinstance(mode, TorchDispatchMode):
                return mode
        frame = frame.f_back
    return None


def _recompute_pass():
    """What PyTorch's checkpoint recomputes a region once for: the current
    ``GraphExecGroup``, else the backward's graph task id (-1 outside a
    backward, where PyTorch recomputes for every unpack and the passes
    cannot be told apart)."""
    group = torch._C._get_graph_exec_group()
    return group if group is not None else torch._C._current_graph_task_id()


class _RecomputeCounts:
    """Calls per op in the current recompute pass of one recompute mode."""

    __slots__ = ("pass_id", "counts")

    def __init__(self, pass_id):
        self.pass_id = pass_id
        self.counts = {}


def _traced_names():
    """Scope names of the FX node being traced (torch.compile)."""
    custom = fx_traceback.current_meta.get("custom")
    if not custom:
        return []
    n = len(ANNOTATION_PREFIX)
    return [k[n:] for k in custom if isinstance(k, str) and k.startswith(ANNOTATION_PREFIX)]


class TorchPolicy:
    """A torch_sac policy with PyTorch's ``policy_fn`` signature.

    Created by :meth:`OpPolicy.to_torch`; see there.
    """

    __slots__ = ("_policy", "_needs_index", "_counts", "__weakref__")

    def __init__(self, policy):
        if not isinstance(policy, _C.OpPolicy):
            raise TypeError(
                f"torch_sac: to_torch() needs a torch_sac policy, got {policy!r} "
                f"(type {type(policy).__name__})"
            )
        self._policy = policy
        self._needs_index = policy._needs_call_index()
        # Per forward mode (= per region): {op: calls so far}.
        self._counts = weakref.WeakKeyDictionary()

    @property
    def policy(self):
        """The torch_sac policy this callable answers for."""
        return self._policy

    def __call__(self, ctx, op, *args, **kwargs):
        if op in IGNORED_OPS:
            # torch_sac never shows these to a policy (their count differs
            # between forward and recompute); never cache them.
            return CheckpointPolicy.PREFER_RECOMPUTE
        index = -1
        if self._needs_index:
            mode = _calling_mode(sys._getframe(1))
            if mode is None:
                raise RuntimeError(
                    f"torch_sac: {self!r} counts calls per checkpointed region "
                    "and must be called by PyTorch's selective checkpointing "
                    "(torch.utils.checkpoint.create_selective_checkpoint_contexts"
                    "), which calls it from its dispatch mode; it was called "
                    "from elsewhere. To use the policy with torch_sac, pass it "
                    "without .to_torch()."
                )
            counts = self._counts_for(mode, getattr(ctx, "is_recompute", False))
            index = counts.get(op, 0)
            counts[op] = index + 1
        names = _traced_names() if _compat.is_compiling() else None
        value = self._policy._decide_torch(
            op, args, kwargs, getattr(ctx, "op_output", None), index, names
        )
        return _BY_VALUE[value]

    def _counts_for(self, mode, is_recompute):
        """{op: calls so far} of ``mode``: per region in forward, per region
        and recompute pass in recompute (PyTorch <= 2.11 asks its policy in
        recompute too, from another mode object, once per pass)."""
        if not is_recompute:
            counts = self._counts.get(mode)
            if counts is None:
                counts = self._counts[mode] = {}
            return counts
        pass_id = _recompute_pass()
        entry = self._counts.get(mode)
        if entry is None or entry.pass_id != pass_id:
            entry = self._counts[mode] = _RecomputeCounts(pass_id)
        return entry.counts

    def __repr__(self):
        return f"{self._policy!r}.to_torch()"


def to_torch(self):
    r"""Return this policy as a ``policy_fn`` for PyTorch's own selective checkpointing.

    The result has PyTorch's signature ``policy_fn(ctx, op, *args, **kwargs)``
    and returns :class:`torch.utils.checkpoint.CheckpointPolicy`, so the same
    choice can be used with
    :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`,
    including under ``torch.compile``. Each op is decided by the same C++ code
    torch_sac uses, so both give the same saved (op, call index) set.

    The returned object may be shared by any number of regions (e.g. through
    ``functools.partial``): ``every_nth`` counts calls per region, keyed on
    PyTorch's forward dispatch mode (one per region), so it needs no reset and
    cannot drift. Ops in :data:`torch_sac.IGNORED_OPS` get
    ``PREFER_RECOMPUTE``; higher-order operators (no dispatcher schema) too.

    Returns:
        A callable ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``.
        Its ``.policy`` is this policy; torch_sac's own contexts accept it too.

    Example:
        >>> # xdoctest: +SKIP
        >>> policy = torch_sac.policies.every_nth(torch.ops.aten.mm, n=2)
        >>> ctx_fn = functools.partial(
        ...     torch.utils.checkpoint.create_selective_checkpoint_contexts,
        ...     policy.to_torch())
        >>> y = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=ctx_fn)
        >>> y = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(
        ...     fn, x, use_reentrant=False, context_fn=ctx_fn))(x)

    .. note::
        Under ``torch.compile`` the policy runs while AOTAutograd traces the
        region, on fake tensors, and its answers become
        ``node.meta["recompute"]`` tags for the partitioner. The partitioner
        honours ``MUST_SAVE`` and ``*_RECOMPUTE``; ``PREFER_SAVE``
        (:func:`~torch_sac.policies.save_all`) leaves the choice to its
        min-cut solver. Call indices count the ops of the traced graph,
        which may differ from eager (e.g. after functionalization), and scope
        names come from ``torch_sac.name`` calls inside the compiled code.
    """
    return TorchPolicy(self)


def install():
    """Adds :meth:`to_torch` to ``_C.OpPolicy`` (the package calls this on import)."""
    _C.OpPolicy.to_torch = to_torch
