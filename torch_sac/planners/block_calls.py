"""The arguments a model's blocks are called with: one call of the model,
its blocks' real arguments captured (positional and keyword), and what
makes two block calls plannable by one plan. For
:func:`torch_sac.policies.budget_for_model`."""

import torch

from .._blocks import select_blocks

__all__ = ["block_calls", "block_signature"]


def block_calls(model, args, kwargs, modules, where):
    """Calls ``model(*args, **kwargs)`` once (the RNG state restored after
    it) and returns ``[(block, block_args, block_kwargs)]``: each block
    :func:`~torch_sac._blocks.select_blocks` chooses, outermost first, with
    detached copies of the arguments of its first call. Raises
    ``RuntimeError`` when a block did not run."""
    blocks = select_blocks(model, modules)
    calls = {}

    def capture(module, block_args, block_kwargs):
        if module not in calls:
            calls[module] = (_detached(block_args), _detached(block_kwargs))

    handles = [b.register_forward_pre_hook(capture, with_kwargs=True) for b in blocks]
    try:
        with torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [b for b in blocks if b not in calls]
    if missing:
        raise RuntimeError(
            f"torch_sac.{where}: {len(missing)} of the model's {len(blocks)} blocks did not run "
            "in the example call; pass example arguments that run every block"
        )
    return [(block, *calls[block]) for block in blocks]


def block_signature(module, args, kwargs):
    """What makes two block calls plannable by one plan: the class, the
    parameters' shapes and dtypes, and the arguments' shapes and dtypes (or
    values, for non-tensors)."""

    def describe(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype, v.requires_grad)
        if isinstance(v, (tuple, list)):
            return tuple(describe(x) for x in v)
        return ("value", repr(v))

    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (
        type(module),
        params,
        describe(args),
        tuple(sorted((k, describe(v)) for k, v in kwargs.items())),
    )


def _detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(v.requires_grad)
    if isinstance(v, tuple):
        return tuple(_detached(x) for x in v)
    if isinstance(v, list):
        return [_detached(x) for x in v]
    return v
