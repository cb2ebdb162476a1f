"""The names of torch_sac's two engines, used wherever one is named.

``"region"``: :class:`torch_sac.sac_context` (also :func:`torch_sac.checkpoint`
and ``apply_sac(engine="region")``): forward records, backward replays what
the policy dropped, in C++. ``"dropin"``: the pair of contexts of
:func:`torch_sac.create_selective_checkpoint_contexts` under
``torch.utils.checkpoint.checkpoint``. ``apply_sac(engine=...)``,
``python -m torch_sac.demo --engine`` and the profiler's ``"engine"`` field
use these names. Imports nothing.
"""

__all__ = ["DROPIN", "ENGINES", "REGION"]

REGION = "region"
DROPIN = "dropin"
ENGINES = (REGION, DROPIN)
