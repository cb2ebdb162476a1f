"""Context managers that switch one C++ op handler on, per adapter."""

from torch.utils._python_dispatch import TorchDispatchMode

from . import _C
from ._adapter import adapter

__all__ = ["handler_mode"]


class _KeyAdapterMode:
    """Intercepts through the dispatch-key adapter while entered.

    Thread-local, like a TorchDispatchMode: other threads are not affected.
    """

    def __init__(self, handler, on_enter=None):
        self._handler = handler
        self._on_enter = on_enter

    def __enter__(self):
        if self._on_enter is not None:
            self._on_enter()
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

    def __init__(self, handler, on_enter=None):
        TorchDispatchMode.__init__(self)
        self._set_handler(handler)
        self._on_enter = on_enter

    def __enter__(self):
        if self._on_enter is not None:
            self._on_enter()
        return super().__enter__()


def handler_mode(handler, on_enter=None):
    """A context manager that routes this thread's ops through ``handler``.

    ``on_enter`` runs each time the context is entered, before interception
    starts.
    """
    cls = _KeyAdapterMode if adapter() == "key" else _PythonKeyMode
    return cls(handler, on_enter)
