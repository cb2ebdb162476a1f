"""Which modules of a model are its blocks: what ``apply_sac`` wraps and
what ``policies.budget_for_model`` plans per block. Knows nothing of the engines."""

import collections
import sys

import torch.nn as nn

__all__ = ["find_blocks", "select_blocks"]


def _gradient_checkpointing_layer():
    """Hugging Face's base class of decoder/encoder layers, if transformers
    is already imported (it is never imported here)."""
    module = sys.modules.get("transformers.modeling_layers")
    return getattr(module, "GradientCheckpointingLayer", None)


def _repeated_children(container):
    """The children of ``container`` of its most frequent class with
    parameters, if that class occurs at least twice (an ``nn.Sequential``
    may hold an embedding and a head around its blocks)."""
    by_class = collections.defaultdict(list)
    for child in container.children():
        if any(True for _ in child.parameters()):
            by_class[type(child)].append(child)
    if not by_class:
        return []
    blocks = max(by_class.values(), key=len)
    return blocks if len(blocks) >= 2 else []


def find_blocks(model, containers=(nn.ModuleList, nn.ModuleDict, nn.Sequential)):
    """The model's repeated blocks: Hugging Face ``GradientCheckpointingLayer``s
    if any, else the children of every ``ModuleList``/``ModuleDict``/
    ``nn.Sequential`` of the most frequent class with parameters among its
    children, when there are two or more (torchtitan's ``layers``
    ModuleDict). Outermost matches win: a block inside a selected block is
    not selected again."""
    hf_layer = _gradient_checkpointing_layer()
    candidates = []
    if hf_layer is not None:
        candidates = [m for m in model.modules() if isinstance(m, hf_layer)]
    if not candidates:
        for m in model.modules():
            if isinstance(m, containers):
                candidates += _repeated_children(m)
    return _outermost(model, candidates)


def _outermost(model, candidates):
    chosen = set(map(id, candidates))
    selected = []

    def visit(module, inside):
        picked = id(module) in chosen and not inside
        if picked:
            selected.append(module)
        for child in module.children():
            visit(child, inside or picked)

    visit(model, False)
    return selected


def select_blocks(model, modules):
    """The modules ``apply_sac(model, modules=...)`` checkpoints (``None``:
    :func:`find_blocks`), outermost first; raises if there are none."""
    if modules is None:
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(
                "torch_sac.apply_sac: found no repeated blocks in the model (no Hugging Face "
                "GradientCheckpointingLayer, no ModuleList/ModuleDict/Sequential holding two or "
                "more modules of one class); pass modules= a class, a tuple of classes or a "
                "predicate"
            )
        return blocks
    if isinstance(modules, type) or (
        isinstance(modules, tuple) and all(isinstance(c, type) for c in modules)
    ):
        predicate = lambda m: isinstance(m, modules)  # noqa: E731
    elif callable(modules):
        predicate = modules
    else:
        raise TypeError(
            "torch_sac.apply_sac: modules must be None, an nn.Module class, a tuple of "
            f"classes or a predicate module -> bool, got {modules!r}"
        )
    found = [m for m in model.modules() if m is not model and predicate(m)]
    if not found and predicate(model):
        found = [model]
    if not found:
        raise ValueError(f"torch_sac.apply_sac: no module of the model matches {modules!r}")
    return _outermost(model, found)
