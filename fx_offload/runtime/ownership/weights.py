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

from ... import dtensor, registry, subclass
from .. import hooks
from ...errors import OffloadError
from ..phase import Phase


_WRAPPED = "_orig_mod."


def _not_offloaded(model: nn.Module, where: str) -> OffloadError:
    return OffloadError(f"{type(registry.model_of(model)).__name__} has no offloaded "
                        "weights", where=where)


def restore(model: nn.Module) -> None:
    """Return every offloaded weight of ``model`` to its device, bitwise as it was; the model
    then runs eagerly as before.  A compiled callable of it stays correct (its ops do nothing).
    On a model whose ``memory_budget`` plan offloaded nothing it forgets that plan, so the
    model may be compiled again with other options."""
    model = registry.model_arg(model, "fx_offload.restore")
    state = registry.settled_state(model)  # a call offloading it anew: the state it makes
    if state is None:
        part = registry.part_of_offloaded(model, "fx_offload.restore")
        if part is not None:
            raise part
        if registry.forget_nothing_offloaded(model):
            for handle in hooks.call_hooks(model):  # of one left whole after an offload
                handle.remove()
            return
        if hooks.carries_hooks(model):
            raise OffloadError(
                f"this {type(model).__name__} is a copy of an offloaded model (deepcopy, "
                "pickle, torch.load) that has not been called yet: it holds its weights on "
                "the host and offloads itself, with the original's options, at its first "
                "call. For a plain model restore it after that call, or restore the "
                "original before copying it", where="fx_offload.restore")
        raise _not_offloaded(model, "fx_offload.restore")
    while state is not None and not state.restore():
        state = registry.live_state(state)  # offloaded anew while restore waited: that one


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter's true value: the host master for offloaded ones."""
    # checked as it is called, not at the first value read
    return _named_weights(registry.model_arg(model, "fx_offload.named_weights"))


def _named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    state = registry.state_for_model(model)
    masters = {} if state is None else {
        p.name: state.truth_of(layer, p) for layer, ps in state.params.items() for p in ps}
    for name, param in model.named_parameters():
        yield name, masters.get(name, param)


def update_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (dotted name -> tensor: parameters, tied names and buffers, as
    ``state_dict`` names them) into the model, offloaded or not; the next call uses them.
    Every entry is checked, and converted to its weight's dtype, before anything is
    written: a bad entry raises :class:`OffloadError` naming it and leaves every weight as
    it was."""
    where = "fx_offload.update_weights"
    model = registry.model_arg(model, where)
    state = registry.settled_state(model)  # a call offloading it anew: the state it makes
    if state is None:       # not offloaded (or not yet): its parameters are the weights
        part = registry.part_of_offloaded(model, where)
        if part is not None:
            raise part
    if not isinstance(weights, Mapping):
        raise OffloadError(f"weights must be a mapping of names to tensors (a state dict), "
                           f"got {type(weights).__name__}", where=where)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    # torch.compile's wrapper names its model's weights "_orig_mod.<name>" in its state dict
    staged = [_staged(name[len(_WRAPPED):] if isinstance(name, str) and name.startswith(
        _WRAPPED) and name not in targets else name, value, targets, model, where)
        for name, value in weights.items()]
    # Everything checked and converted: write.  Between calls the parameters are the
    # truth; an in-place copy moves their version, so the next call reloads any slot
    # holding them.  From inside a call (a forward hook) they point at the truth for the
    # write, and then the slots follow (.in_call).
    while state is not None:
        with state.holding_slots():
            if state.phase is not Phase.RESTORED:
                state.begin_write(staged)
                try:
                    _write(staged)
                finally:
                    state.end_write(staged)
                return
        # offloaded anew while this waited (the parameters may point at the new state's
        # slots in another thread's call): its turn, or none for a restored model
        state = registry.live_state(state)
    _write(staged)


@torch.no_grad()
def _write(staged) -> None:
    for target, value in staged:
        target.copy_(value)


def _staged(name, value, targets, model, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight ``name``, ``value`` checked against it and converted to its dtype); a
    failure here writes nothing."""
    if not isinstance(name, str) or name not in targets:
        raise OffloadError(f"{type(model).__name__} has no parameter or buffer {name!r}; "
                           "nothing was written", where=where)
    target = targets[name]
    if not isinstance(value, torch.Tensor):
        raise OffloadError(f"{name}: {type(value).__name__} is not a tensor; nothing was "
                           "written", where=where)
    sharded = dtensor.is_dtensor(target) or dtensor.is_dtensor(value)
    problem = _problem(target, value, sharded)
    if problem is not None:
        raise OffloadError(f"{name} {problem}; nothing was written", where=where)
    if subclass.is_subclass(target) and not sharded:    # the same kind: copied as it is
        return target, value.detach()
    try:
        value = value.detach().to(dtype=target.dtype)
        # a DTensor parameter: this rank's shard of a whole tensor (every rank gives the
        # same), taken here without communication
        return target, dtensor.placed_like(target, value) if sharded else value
    except Exception as error:      # out of memory, a tensor subclass that cannot convert
        raise OffloadError(f"{name} could not be converted to {target.dtype} ({error}); "
                           "nothing was written", where=where) from error


def _problem(target: torch.Tensor, value: torch.Tensor, sharded: bool) -> str | None:
    """Why ``value`` cannot be written into the weight ``target`` (``sharded``: either is a
    DTensor), or None."""
    kind = dtensor.mismatch(target, value) if sharded else subclass.mismatch(target, value)
    if kind is not None:
        return kind
    if value.is_meta:
        return "is on the meta device (it holds no data): load its values first"
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor: give a dense one (.to_dense())"
    if value.is_nested:
        return "is a nested tensor: give a dense one"
    if value.is_quantized:
        return "is a quantized tensor: give it dequantized (.dequantize())"
    if tuple(value.shape) != tuple(target.shape):
        return f"has shape {tuple(target.shape)}, got {tuple(value.shape)}" + (
            " (a DTensor: give the whole tensor, or a DTensor placed as it is)" if sharded
            else "")
    if value.is_floating_point() != target.is_floating_point() or \
            value.is_complex() != target.is_complex():
        return f"is {target.dtype}, got {value.dtype}"
    return None
