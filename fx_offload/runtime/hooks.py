"""Hooks on an offloaded model's modules, so that paths outside the compiled graph stay right.

* a forward pre-hook on each offloaded layer waits for (or loads) the layer's weights, so an
  eager or graph-broken call of the layer never computes with another layer's slot contents;
* ``state_dict`` returns the masters (the true weights) for offloaded parameters, and
  ``load_state_dict`` writes offloaded entries into the masters and reloads the slots that
  hold them, so the next call, compiled or not, uses the new weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def install(state, model: nn.Module | None) -> list:
    """Install every hook; returns their handles (``.remove()`` undoes each)."""
    handles = [state.stack.modules[layer].register_forward_pre_hook(_eager_guard(state, layer))
               for layer in state.layers]
    if model is not None:
        handles += _state_dict_hooks(state, model)
    return handles


def _eager_guard(state, layer: int) -> Callable:
    """A forward pre-hook that waits for (or loads) the layer's weights.  It calls the op
    itself, so it is right both when it runs eagerly and when Dynamo traces it into a graph
    (where ``torch.compiler.is_compiling()`` would turn a Python check into a no-op).  The
    pass drops such a traced wait where it places the layer's own wait."""
    handle = state.handle

    def hook(module, args):
        acts = [a for a in args if isinstance(a, torch.Tensor)]
        torch.ops.fx_offload.wait_prefetch(acts, handle, layer)
        return None
    return hook


def _state_dict_hooks(state, model: nn.Module) -> list:
    by_name = {p.name: (layer, p) for layer, ps in state.params.items() for p in ps}

    def save_hook(module, state_dict, prefix, local_metadata):
        if state.restored:
            return state_dict
        for name, (layer, p) in by_name.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state.masters[layer][p.suffix]
        return state_dict

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs):
        if state.restored:
            return
        state.synchronize()
        touched = set()
        for name, (layer, p) in by_name.items():
            key = prefix + name
            if key not in state_dict:
                continue
            value = state_dict[key]
            master = state.masters[layer][p.suffix]
            if value.shape != master.shape:
                continue   # load_state_dict reports the size mismatch itself
            with torch.no_grad():
                master.copy_(value)
            # let the default loader copy the slot onto itself: a no-op, so it never writes
            # this layer's values into a slot another layer occupies
            state_dict[key] = p.param.detach()
            touched.add(layer)
        state.reload_slots(touched)

    return [model._register_state_dict_hook(save_hook),
            model._register_load_state_dict_pre_hook(load_pre_hook, with_module=True)]
