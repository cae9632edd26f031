"""What a training step keeps on the device besides the weights, which ``memory_budget`` sets
aside before it plans the weights (a model in training mode with parameters to train):

    gradients            one per trainable parameter, in its dtype
    optimizer state      AdamW's two moments, fp32, per trainable element (8 bytes)
    saved activations    every intermediate of the graph that needs a gradient

The last is read from the graph Dynamo traced (its nodes' fake values), each storage counted
once: an upper bound of what AOTAutograd saves for backward (its partitioner recomputes
some cheap ones), so a plan that fits this fits the step.  A checkpointed region is one node
whose outputs are all it keeps.  Offloading does not shrink any of these: they leave the
weights less room.  (An optimizer other than AdamW keeps another amount of state; SGD
without momentum keeps none, so the plan then leaves room unused, never too little.)
"""
from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

ADAM_STATE_BYTES = 8        # two fp32 moments per trainable element


def trains(model: nn.Module) -> bool:
    """``model`` is in training mode with a parameter to train."""
    return model.training and any(p.requires_grad for p in model.parameters())


def state_bytes(model: nn.Module) -> int:
    """Gradients and AdamW state of ``model``'s trainable parameters."""
    return sum(p.numel() * (p.element_size() + ADAM_STATE_BYTES)
               for p in model.parameters() if p.requires_grad)


def saved_bytes(gm: torch.fx.GraphModule | None) -> int:
    """Bytes of the intermediates of ``gm`` that need a gradient, each storage once."""
    if gm is None:
        return 0
    seen, total = set(), 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        for t in pytree.tree_leaves(value):
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                continue
            key = StorageWeakRef(t.untyped_storage())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def step_bytes(model: nn.Module, gm: torch.fx.GraphModule | None) -> int:
    """What a training step of ``model`` keeps on the device besides its weights (0 for a
    model not being trained)."""
    return state_bytes(model) + saved_bytes(gm) if trains(model) else 0
