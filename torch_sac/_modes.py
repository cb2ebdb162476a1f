"""Context managers that switch one C++ op handler on, per adapter."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _C, _state
from ._adapter import adapter

__all__ = ["handler_mode"]


class _KeyAdapterMode:
    """Intercepts through the dispatch-key adapter while entered.

    Thread-local, like a TorchDispatchMode: other threads are not affected.
    """

    def __init__(self, handler):
        self._handler = handler

    def __enter__(self):
        _C.push_key_handler(self._handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        _C.pop_key_handler(self._handler)
        return False


class _PythonKeyMode(_C.HandlerModeBase, TorchDispatchMode):
    """Intercepts at the Python dispatch key while entered.

    ``__torch_dispatch__`` comes from ``_C.HandlerModeBase``: a C method that
    runs the handler, so no Python frame runs per op.
    """

    def __init__(self, handler):
        TorchDispatchMode.__init__(self)
        self._set_handler(handler)

    @classmethod
    def ignore_compile_internals(cls):
        # As PyTorch's own SAC modes: torch.compile may trace and run compiled
        # code while this mode is active; the handler stands aside while
        # tracing (fake/proxy modes) and while compiled code runs.
        return True


class _HandlerMode:
    """Routes this thread's ops through a C++ handler while entered.

    The adapter is chosen at each entry. The key adapter's dispatch key sits
    below the Python key, so TorchDispatchModes already active on this thread
    (``FlopCounterMode``, a user's mode) would see every op before torch_sac
    does, including ops a recompute answers from the cache. With such modes
    active the handler is entered as a TorchDispatchMode instead, innermost,
    exactly where PyTorch's own SAC modes sit.
    """

    def __init__(self, handler, on_enter=None, on_exit=None):
        self._handler = handler
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._active = None

    def __enter__(self):
        if self._active is not None:
            raise RuntimeError("torch_sac: this checkpoint context is already entered")
        use_key = adapter() == "key" and torch._C._len_torch_dispatch_stack() == 0
        mode = (_KeyAdapterMode if use_key else _PythonKeyMode)(self._handler)
        if self._on_enter is not None:
            self._on_enter()
        mode.__enter__()
        self._active = mode
        _state.context_opened()
        return self

    def __exit__(self, exc_type, exc, tb):
        mode, self._active = self._active, None
        try:
            if mode is not None:
                _state.context_closed()
                mode.__exit__(exc_type, exc, tb)
        finally:
            if self._on_exit is not None:
                self._on_exit()
        return False

    @property
    def entered_as(self):
        """``"key"`` or ``"python"`` while entered, else None."""
        if self._active is None:
            return None
        return "key" if isinstance(self._active, _KeyAdapterMode) else "python"


def handler_mode(handler, on_enter=None, on_exit=None):
    """A context manager that routes this thread's ops through ``handler``.

    ``on_enter`` runs each time the context is entered, before interception
    starts; ``on_exit`` after it stops.
    """
    return _HandlerMode(handler, on_enter, on_exit)
