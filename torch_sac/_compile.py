"""torch_sac and torch.compile.

Three situations, each handled so that compiling is never a silent no-op:

* ``torch_sac.checkpoint`` inside code being compiled becomes PyTorch's own
  selective checkpointing, ``torch.utils.checkpoint.checkpoint`` with
  torch_sac's contexts, which under compile hand PyTorch's modes the policy's
  ``.to_torch()``: the partitioner saves what the policy says.
* ``sac_context`` inside code being compiled cannot be traced (a region
  records ops as they run; compiled code does not run them one by one): it
  raises, saying to use ``torch_sac.checkpoint`` there.
* Compiled code called inside an eager region runs as one opaque step: its
  generated kernels write tensors without dispatcher ops, so the region must
  not record (and could not replay) what runs inside it. The region lets it
  through (``_C.OpaqueCode``) and warns once that it is not checkpointed.
  Inside the drop-in's contexts it runs opaque too, in forward and in
  recompute, which re-runs it whole (as PyTorch's checkpoint would).
  While Dynamo or AOTAutograd trace, the C++ handlers stand aside on their
  own (fake and proxy modes, ``interception_paused``); while Dynamo compiles
  (Inductor runs real ops too: autotuning, constant folding) they are paused
  through Dynamo's compile callbacks.
"""

import functools
import importlib.abc
import importlib.util
import sys
import threading
import warnings

from . import _C
from ._state import contexts_open, regions_open

__all__ = ["refuse_region_while_compiling", "warn_replay_budget_ignored", "install"]

_INDUCTOR_MODULE = "torch._inductor.output_code"
_DYNAMO_CALLBACKS_MODULE = "torch._dynamo.callback"

# The counts of torch_sac contexts open on this thread live in torch_sac._state
# (kept by torch_sac.region and torch_sac._modes); the guard below reads them.


REPLAY_BUDGET_WHILE_COMPILING = (
    "torch_sac: replay_budget does not apply inside code that torch.compile traces: the "
    "region becomes PyTorch's compiled selective checkpointing, which recomputes each "
    "dropped op once. Run the region eagerly for a replay budget."
)


def warn_replay_budget_ignored():
    # Dynamo traces warnings.warn as a graph break-free side effect.
    warnings.warn(REPLAY_BUDGET_WHILE_COMPILING, stacklevel=3)


REGION_WHILE_COMPILING = (
    "torch_sac.sac_context cannot be used inside code that torch.compile traces: a region "
    "records ops as they run, and compiled code does not run them one by one. Inside "
    "compiled code, write torch_sac.checkpoint(fn, *args, policy=policy) instead: it "
    "compiles to PyTorch's selective activation checkpointing with the same policy. "
    "(A sac_context around a call of a compiled function works, but does not see inside it.)"
)


def refuse_region_while_compiling():
    raise RuntimeError(REGION_WHILE_COMPILING)


_warned = False

COMPILED_CODE_IN_REGION = (
    "torch_sac: compiled code (torch.compile) ran inside a sac_context region. The region "
    "cannot see inside compiled code, so the activations that code saves are kept as "
    "autograd keeps them: no memory is saved there. To checkpoint compiled code "
    "selectively, call torch_sac.checkpoint(fn, *args, policy=policy) inside the "
    "compiled function, where it becomes PyTorch's compiled selective checkpointing."
)


def _guarded_call(original):
    @functools.wraps(original)
    def __call__(self, inputs):
        if contexts_open() == 0:
            return original(self, inputs)
        global _warned
        # The drop-in re-runs compiled code whole in recompute, as PyTorch's
        # checkpoint does: only a region loses something worth a warning.
        if regions_open() > 0 and not _warned:
            _warned = True
            warnings.warn(COMPILED_CODE_IN_REGION, stacklevel=2)
        guard = _C.OpaqueCode()
        try:
            return original(self, inputs)
        finally:
            del guard

    __call__._torch_sac_guarded = True
    return __call__


def _guard_compiled_graphs(module):
    cls = module.CompiledFxGraph
    if not getattr(cls.__call__, "_torch_sac_guarded", False):
        cls.__call__ = _guarded_call(cls.__call__)


_compiling = threading.local()


def _compile_started(args):
    _compiling.guard = _C.OpaqueCode()


def _compile_ended(args):
    _compiling.guard = None


def _register_pause(handler):
    if _compile_started not in handler.start_callbacks:
        handler.register_start_callback(_compile_started)
        handler.register_end_callback(_compile_ended)


def _pause_while_compiling(module):
    handler = module.callback_handler
    _register_pause(handler)
    # torch._dynamo.reset() clears every compile callback: register again
    # after it, or compiles after a reset would be recorded by a region.
    if not getattr(handler.clear, "_torch_sac_keeps_pause", False):
        clear = handler.clear

        def clear_keeping_pause():
            try:
                clear()
            finally:
                _register_pause(handler)

        clear_keeping_pause._torch_sac_keeps_pause = True
        handler.clear = clear_keeping_pause


_PATCHES = {
    _INDUCTOR_MODULE: _guard_compiled_graphs,
    _DYNAMO_CALLBACKS_MODULE: _pause_while_compiling,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches torch's compiler modules when first imported (importing them
    eagerly would cost seconds at ``import torch_sac``)."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, _PATCHES[name])
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


def install():
    """Applies the patches now to modules already imported, and on import to
    the others."""
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
