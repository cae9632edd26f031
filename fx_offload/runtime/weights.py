"""The public API on an offloaded model's weights: the true values, updates, restoring.

An offloaded parameter's ``.data`` is its slot, which holds whichever layer of that slot ran
or was prefetched last, so reading the parameter object directly (``named_parameters()``,
``parameters()``) shows slot contents.  The true values live in the host masters;
``state_dict()`` and ``load_state_dict()`` go there (:mod:`.hooks`), and so do
:func:`named_weights` and :func:`update_weights` (the in-place update path: a
reinforcement-learning weight sync, say).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import nn

from .. import registry
from ..errors import OffloadError


def _state(model: nn.Module, where: str):
    state = registry.state_for_model(model)
    if state is None:
        raise OffloadError(f"{type(registry.model_of(model)).__name__} has no offloaded "
                           "weights", where=where)
    return state


def restore(model: nn.Module) -> None:
    """Return every offloaded weight of ``model`` to its device, bitwise as it was; the model
    then runs eagerly as before.  A compiled callable of it stays correct (its ops do nothing).
    On a model whose ``memory_budget`` plan offloaded nothing it forgets that plan, so the
    model may be compiled again with other options."""
    model = registry.model_of(model)
    if registry.state_for_model(model) is None and registry.forget_nothing_offloaded(model):
        return
    _state(model, "fx_offload.restore").restore()


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter's true value: the host master for offloaded ones."""
    model = registry.model_of(model)
    state = registry.state_for_model(model)
    masters = {} if state is None else {
        p.name: state.masters[layer][p.suffix] for layer, ps in state.params.items() for p in ps}
    for name, param in model.named_parameters():
        yield name, masters.get(name, param)


def update_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (dotted name -> tensor) into the model, offloaded or not; the next
    call uses them.  Unknown names or shape mismatches raise before anything is written."""
    model = registry.model_of(model)
    where = "fx_offload.update_weights"
    state = _state(model, where)
    params = dict(model.named_parameters())
    for name, value in weights.items():
        if name not in params:
            raise OffloadError(f"{type(model).__name__} has no parameter {name!r}", where=where)
        if not isinstance(value, torch.Tensor):
            raise OffloadError(f"{name}: {type(value).__name__} is not a tensor", where=where)
        if tuple(value.shape) != tuple(params[name].shape):
            raise OffloadError(f"{name} has shape {tuple(params[name].shape)}, got "
                               f"{tuple(value.shape)}", where=where)
        if value.is_floating_point() != params[name].is_floating_point() or \
                value.is_complex() != params[name].is_complex():
            raise OffloadError(f"{name} is {params[name].dtype}, got {value.dtype}",
                               where=where)
    # Everything checked: write.  Between calls the parameters are the truth; an in-place
    # copy moves their version, so the next call reloads any slot holding them.
    with state.holding_slots(), torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
