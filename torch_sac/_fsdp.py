"""FSDP2 units whose parameters a region's replay reads.

FSDP2 (``fully_shard``, ``reshard_after_forward=True``) frees each unit's
unsharded parameters after its forward (their storage is resized to 0) and
gathers them again when that unit's own backward starts. A region spanning
several units, or one whose block holds nested units, replays ops of a unit
before that unit's backward: the parameters it reads are freed then. The
region remembers the units whose forward ran inside it and, when a replay
finds a freed parameter, has its unit gather it again (``unshard()``), on
every rank in the same order since every rank replays the same backward.

The unsharded parameter keeps its StorageImpl across reshard and unshard
(``_fsdp_param.py``: freed by ``storage.resize_(0)``, brought back by
``resize_``): it is found by storage. A unit whose backward is already over
(POST_BACKWARD) is resharded again right after the replay; others stay
unsharded until their own post-backward reshards them, so no extra
all-gather is paid.
"""

import sys
import threading
import weakref

import torch

from . import _compat

__all__ = ["units_seen"]

_FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"


class _UnitsSeen:
    """The FSDP2 units that run forward on this thread while a region is open."""

    def __init__(self, fsdp_module_cls):
        self._cls = fsdp_module_cls
        self._thread = threading.get_ident()
        self._units = []
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        if torch.compiler.is_compiling():
            return  # traced code: not a unit running in this region
        if isinstance(module, self._cls) and threading.get_ident() == self._thread:
            self._units.append(weakref.ref(module))

    def close(self, region):
        """Stops watching; gives ``region`` a way to bring parameters back."""
        self._handle.remove()
        if self._units:
            restorer = _Restorer(self._units)
            region.set_storage_restorer(restorer.restore, restorer.done)


class _Restorer:
    def __init__(self, units):
        self._units = units  # weak: the region must not keep the model alive
        self._reshard_after = []

    def restore(self, tensor):
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        key = tensor.untyped_storage()._cdata
        for ref in self._units:
            unit = ref()
            if unit is None:
                continue
            for group in _compat.fsdp_param_groups(unit._get_fsdp_state()):
                for param in group.fsdp_params:
                    outputs = getattr(param, "all_gather_outputs", None) or ()
                    if any(out.untyped_storage()._cdata == key for out in outputs):
                        finished = group._training_state == TrainingState.POST_BACKWARD
                        unit.unshard()
                        if finished:
                            self._reshard_after.append(unit)
                        return True
        return False

    def done(self):
        units, self._reshard_after = self._reshard_after, []
        for unit in units:
            unit.reshard()


def units_seen():
    """Starts watching for FSDP2 units, or None when FSDP2 is not in use:
    ``fully_shard`` makes a subclass of ``FSDPModule`` per module class it
    shards, so none means no unit exists (and no global hook is needed)."""
    module = sys.modules.get(_FULLY_SHARD_MODULE)
    if module is None or not module.FSDPModule.__subclasses__():
        return None
    return _UnitsSeen(module.FSDPModule)
