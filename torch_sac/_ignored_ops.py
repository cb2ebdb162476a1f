"""The ops never passed to a policy (``torch_sac.IGNORED_OPS``).

Imported by the package right after ``_C`` loads: the installed torch's
``SAC_IGNORED_OPS`` joins torch_sac's own set here, before any region exists
(torch 2.15 adds prim.layout.default). A low module, so that the profilers
and ``OpPolicy.to_torch`` read the set without importing the package.
"""

import torch

from . import _C, _compat

__all__ = ["IGNORED_OPS"]

_C.add_ignored_ops(_compat.sac_ignored_ops())


def _ignored_ops():
    ops = set()
    for qualified, overload in _C.ignored_op_names():
        namespace, name = qualified.split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        ops.add(getattr(packet, overload or "default"))
    return frozenset(ops)


#: Ops never passed to a policy, namely metadata queries and detach, whose
#: count differs between forward and recompute. A superset of PyTorch's
#: ``torch.utils.checkpoint.SAC_IGNORED_OPS``.
IGNORED_OPS = _ignored_ops()
