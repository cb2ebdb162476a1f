"""The checkpointing decision a policy returns for each op."""

import enum

__all__ = ["Policy"]


class Policy(enum.Enum):
    """What to do with an op's outputs.

    - ``*_SAVE``: keep the outputs for backward.
    - ``*_RECOMPUTE``: drop them and rebuild them when backward needs them.
    - ``*_OFFLOAD``: keep them for backward in host memory: copied to a
      pinned host pool on a side stream in forward, brought back ahead of
      their use in backward (see :mod:`torch_sac.offload`). CUDA tensors
      only; ``PREFER_OFFLOAD`` saves a tensor that cannot be offloaded (a
      CPU tensor, a view, one below the size threshold), ``MUST_OFFLOAD``
      raises for it.

    ``MUST_*`` versus ``PREFER_*`` matters only when policies are stacked in
    nested regions: MUST beats PREFER, two different MUSTs raise, and between
    two PREFERs the innermost wins.

    The values equal those of :class:`torch.utils.checkpoint.CheckpointPolicy`
    (``*_OFFLOAD`` is its ``*_CPU_OFFLOAD``), and a policy may return either
    enum, or a bool (``True`` means
    ``MUST_SAVE``, ``False`` means ``PREFER_RECOMPUTE``, as in PyTorch).
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_OFFLOAD = 4
    PREFER_OFFLOAD = 5
