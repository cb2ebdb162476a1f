"""Thread state shared by the engines: the regions open on this thread, the
observers told about them, and the counts of torch_sac contexts open (which
the compile hooks read).

The lowest layer of the package, with ``_C``: it imports nothing of torch_sac.
"""

import threading

__all__ = [
    "stack",
    "in_region",
    "observers",
    "regions_open",
    "contexts_open",
    "region_opened",
    "region_closed",
    "context_opened",
    "context_closed",
]

# Regions entered on this thread, outermost first. Regions are thread-local,
# like the interceptor and autograd's saved-tensor hooks they switch on.
_active = threading.local()


def stack():
    """The ``sac_context`` objects entered on this thread, outermost first."""
    if not hasattr(_active, "regions"):
        _active.regions = []
    return _active.regions


def in_region():
    """Whether a sac_context is open on this thread."""
    return bool(stack())


def observers():
    """Objects told when an outermost region, or the forward context of a
    drop-in pair (``create_selective_checkpoint_contexts``), starts and ends on
    this thread (``torch_sac.profile`` registers itself here while it is
    active). Each has ``region_entered(ctx)`` and ``region_exited(ctx)``,
    and ``_recompute_entered(forward_ctx)`` and ``_recompute_exited(forward_ctx)``,
    which a drop-in's recompute context calls on the observers its forward
    context told, on the thread recompute runs on."""
    if not hasattr(_active, "observers"):
        _active.observers = []
    return _active.observers


# torch_sac contexts open on this thread: regions, and all contexts
# (regions and the drop-in's), kept by torch_sac.region and torch_sac._modes,
# read by torch_sac._compile's guard around compiled code.
_open = threading.local()


def regions_open():
    return getattr(_open, "regions", 0)


def contexts_open():
    return getattr(_open, "contexts", 0)


def region_opened():
    _open.regions = regions_open() + 1


def region_closed():
    _open.regions = regions_open() - 1


def context_opened():
    _open.contexts = contexts_open() + 1


def context_closed():
    _open.contexts = contexts_open() - 1
