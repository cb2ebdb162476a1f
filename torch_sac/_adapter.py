"""Chooses which interception adapter this process uses.

The C++ handler is reached through one of two adapters (see docs/design.md):

- ``"key"``: a boxed dispatcher fallback on a dispatch key the installed torch
  leaves free, switched on per thread. Fastest; available on torch 2.13.
- ``"python"``: a TorchDispatchMode at the Python dispatch key whose
  ``__torch_dispatch__`` is a C function. Works with any torch.

``TORCH_SAC_ADAPTER=python`` forces the second, ``=key`` demands the first and
fails at import where it is unavailable; unset (or ``auto``) picks the key
adapter when it can.
"""

import os

from . import _C

__all__ = ["adapter"]

_ENV = "TORCH_SAC_ADAPTER"


def _select() -> str:
    requested = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if requested not in ("auto", "key", "python"):
        raise ValueError(
            f"torch_sac: {_ENV}={requested!r} is not one of 'auto', 'key', 'python'"
        )
    if requested == "python":
        return "python"
    reason = _C.key_adapter_unavailable_reason()
    if reason:
        if requested == "key":
            raise RuntimeError(
                f"torch_sac: {_ENV}=key, but the dispatch-key adapter is "
                f"unavailable: {reason}. Unset {_ENV} or set it to 'python'."
            )
        return "python"
    _C.install_key_adapter()
    return "key"


_ACTIVE = _select()


def adapter() -> str:
    """Which adapter intercepts ops in this process: ``"key"`` or ``"python"``."""
    return _ACTIVE
