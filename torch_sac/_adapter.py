"""Chooses which interception adapter this process uses.

The C++ handler is reached through one of two adapters (see docs/design.md):

- ``"key"``: a boxed dispatcher fallback on a dispatch key the installed torch
  leaves free (``DispatchKey::Fake``), switched on per thread. Fastest.
- ``"python"``: a TorchDispatchMode at the Python dispatch key whose
  ``__torch_dispatch__`` is a C function. Works with any torch.

``TORCH_SAC_ADAPTER=python`` forces the second, ``=key`` demands the first and
fails at import where it is unavailable; unset (or ``auto``) picks the key
adapter where it sits where a TorchDispatchMode would (below the Python key:
torch 2.13 and later) and the Python-key adapter elsewhere (torch 2.11 and
2.12, where ``DispatchKey::Fake`` sits above the Python key, so the key
adapter would see each op before the user's TorchDispatchModes do).
"""

import os

from . import _C

__all__ = ["adapter", "adapter_reason"]

_ENV = "TORCH_SAC_ADAPTER"


def _select():
    requested = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if requested not in ("auto", "key", "python"):
        raise ValueError(f"torch_sac: {_ENV}={requested!r} is not one of 'auto', 'key', 'python'")
    if requested == "python":
        return "python", f"{_ENV}=python"
    reason = _C.key_adapter_unavailable_reason()
    if reason:
        if requested == "key":
            raise RuntimeError(
                f"torch_sac: {_ENV}=key, but the dispatch-key adapter is "
                f"unavailable: {reason}. Unset {_ENV} or set it to 'python'."
            )
        return "python", f"the dispatch-key adapter is unavailable: {reason}"
    below_modes = _C.key_adapter_runs_below_modes()
    if requested == "auto" and not below_modes:
        return "python", (
            "on this torch DispatchKey::Fake sits above the Python key (torch <= 2.12), "
            "so the key adapter would intercept ops before TorchDispatchModes; "
            f"{_ENV}=key uses it anyway"
        )
    _C.install_key_adapter()
    if requested == "key":
        where = "below" if below_modes else "above (torch <= 2.12)"
        return "key", f"{_ENV}=key; it intercepts {where} TorchDispatchModes"
    return "key", "DispatchKey::Fake is free and sits below the Python key (torch >= 2.13)"


_ACTIVE, _REASON = _select()


def adapter() -> str:
    """Which adapter intercepts ops in this process: ``"key"`` or ``"python"``.

    ``adapter_reason()`` says why. Both adapters run the same C++ handler and
    give the same results; they differ in per-op overhead (the key adapter
    adds less) and in where ops are seen relative to TorchDispatchModes.
    """
    return _ACTIVE


def adapter_reason() -> str:
    """Why :func:`adapter` is the one in use, in one sentence."""
    return _REASON
