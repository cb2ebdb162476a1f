"""Named scopes: label regions of code so a policy can choose by name.

``with torch_sac.name("attn_out"): ...`` opens a scope on a C++ thread-local
stack; :func:`torch_sac.policies.save_by_name` saves the outputs of every op
that runs while a listed scope is open. Under ``torch.compile`` the scope
becomes an FX node annotation instead (see :func:`name`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx.traceback as fx_traceback

from . import _C

__all__ = ["name", "active_names"]

# Key prefix of the FX node annotation a scope becomes under torch.compile;
# torch_sac/_torch_policy.py reads it back.
ANNOTATION_PREFIX = "torch_sac.name:"

_IDS = {}  # scope name -> interned id (saves a C++ call per scope)


def _check_name(scope_name, where):
    if not isinstance(scope_name, str):
        raise TypeError(
            f"torch_sac.{where}: a scope name must be a str, got {scope_name!r} "
            f"(type {type(scope_name).__name__})"
        )
    if not scope_name:
        raise ValueError(f"torch_sac.{where}: a scope name must be a non-empty string")
    return scope_name


def _intern(scope_name):
    scope_id = _IDS.get(scope_name)
    if scope_id is None:
        scope_id = _IDS[scope_name] = _C.intern_name(scope_name)
    return scope_id


class _NameScope:
    """The eager scope: a push and a pop on the C++ name stack."""

    __slots__ = ("_name", "_id", "_depths")

    def __init__(self, scope_name):
        self._name = scope_name
        self._id = _intern(scope_name)
        self._depths = []  # one token per nested entry of this object

    def __enter__(self):
        self._depths.append(_C.push_name(self._id))
        return self

    def __exit__(self, exc_type, exc, tb):
        _C.pop_name(self._id, self._depths.pop())
        return False

    def __call__(self, fn):
        scope_name = self._name

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # A fresh scope per call, so the decorated function also works
            # under torch.compile (see name()).
            with name(scope_name):
                return fn(*args, **kwargs)

        return wrapper

    def __repr__(self):
        return f"torch_sac.name({self._name!r})"


def name(scope_name: str) -> contextlib.AbstractContextManager[object]:
    r"""Context manager (or decorator) naming the ops run inside it.

    Ops that run while the scope is open are "in" it, and in every scope that
    encloses it: :func:`torch_sac.policies.save_by_name` saves an op's outputs
    when *any* open scope is listed, not only the innermost. Scopes may nest
    and repeat; they are per thread.

    Use it with :func:`torch_sac.policies.save_by_name` (or its
    ``.to_torch()`` for PyTorch's own SAC) the way JAX's
    ``checkpoint_name`` is used with ``save_only_these_names``, except that
    a scope names the ops of a region of code rather than one value.

    Args:
        scope_name (str): the name; any non-empty string.

    Example:
        >>> # xdoctest: +SKIP
        >>> class Attention(nn.Module):
        >>>     def forward(self, x):
        >>>         q, k, v = self.qkv(x).chunk(3, dim=-1)
        >>>         with torch_sac.name("attn_core"):
        >>>             y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>>         return self.proj(y)
        >>>
        >>> policy = torch_sac.policies.save_by_name("attn_core")
        >>> ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        >>> y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=ctx_fn)

    .. note::
        Under ``torch.compile`` (Dynamo), call ``torch_sac.name(...)`` inside
        the compiled code: it then returns
        ``torch.fx.traceback.annotate({"torch_sac.name:<scope_name>": True})``,
        which Dynamo traces, and ``save_by_name(...).to_torch()`` reads the
        annotation when PyTorch's SAC traces the region. Scopes opened outside
        the compiled function are not seen by the compiled graph.
        A scope object created outside and entered inside compiled code causes
        a graph break.

    .. note::
        As a decorator (``@torch_sac.name("mlp")``), the scope is opened on
        every call of the decorated function.
    """
    _check_name(scope_name, "name")
    if torch.compiler.is_compiling():
        return fx_traceback.annotate({ANNOTATION_PREFIX + scope_name: True})
    return _NameScope(scope_name)


def active_names() -> list[str]:
    """The names of the scopes open on this thread, outermost first.

    Returns:
        list of str. Empty outside any scope.
    """
    return _C.active_names()
