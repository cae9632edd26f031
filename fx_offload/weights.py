"""The true weights of an offloaded model: reading them, saving them, updating them.

An offloaded parameter's ``.data`` is its slot, which holds whichever layer of that slot ran
or was prefetched last, so reading the parameter object directly (``named_parameters()``,
``parameters()``) shows slot contents.  The true values live in the host masters.  This
module makes the standard paths go there:

* ``model.state_dict()`` (and so ``torch.save(model.state_dict())`` and checkpoint savers
  built on it) returns the masters for offloaded parameters (on the host);
* ``model.load_state_dict(sd)`` writes offloaded entries into the masters and reloads the
  slots, so the next call, compiled or not, uses the new weights;
* :func:`named_weights` yields every weight's true value; :func:`update_weights` is the
  in-place update path (a reinforcement-learning weight sync, say).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import nn


def install(state, model: nn.Module) -> list:
    """Hooks on ``model`` that route state_dict and load_state_dict to the masters."""
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


def _state(model: nn.Module):
    from . import runtime
    state = runtime.state_for_model(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no offloaded weights")
    return state


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter's true value: the host master for offloaded ones."""
    from . import runtime
    state = runtime.state_for_model(model)
    masters = {} if state is None else {
        p.name: state.masters[layer][p.suffix] for layer, ps in state.params.items() for p in ps}
    for name, param in model.named_parameters():
        yield name, masters.get(name, param)


def update_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (dotted name -> tensor) into the model, offloaded or not; the next
    call uses them.  Unknown names or shape mismatches raise before anything is written."""
    state = _state(model)
    params = dict(model.named_parameters())
    offloaded = {p.name: (layer, p) for layer, ps in state.params.items() for p in ps}
    for name, value in weights.items():
        if name not in params:
            raise ValueError(f"fx_offload.update_weights: {type(model).__name__} has no "
                             f"parameter {name!r}")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"fx_offload.update_weights: {name} has shape "
                             f"{tuple(params[name].shape)}, got {tuple(value.shape)}")
    touched = set()
    state.synchronize()
    with torch.no_grad():
        for name, value in weights.items():
            if name in offloaded:
                layer, p = offloaded[name]
                state.masters[layer][p.suffix].copy_(value)
                touched.add(layer)
            else:
                params[name].copy_(value)
    state.reload_slots(touched)
