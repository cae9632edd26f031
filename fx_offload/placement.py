"""Putting a model's weights where they live: the offloaded layers' in host blocks (the
truth), the rest on the device, the slots allocated; and the hooks on the model's root that
make each call hold the slots.

Two routes lead here.  :func:`place` is the one for a model bigger than the device: build or
load it on the host, ``fx_offload.place(model, "cuda", **options)`` puts each offloaded
layer straight into its host block (one copy, never on the device) and everything else on
the device, then ``torch.compile(model, backend="prefetch_offload")``.  Compiling a model
that already sits on the device places it at its first compile instead (the backend calls
:func:`activate`).

A model that carries the root hooks but has no live state (a ``copy.deepcopy`` of an
offloaded model, or one unpickled with ``torch.load``) is offloaded again at its first call
with the same options; so is one whose offloaded parameters changed dtype or shape
(``.half()``): the hooks take up what the user did instead of computing with stale slots.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from . import registry
from .errors import OffloadError
from .options import OffloadOptions, parse_options
from .runtime import hooks
from .runtime.state import OffloadState, ShapeChanged
from .selection import NothingOffloaded, choose
from .text import format_bytes

log = logging.getLogger("fx_offload")


def place(model: nn.Module, device: str | torch.device = "cuda", **options: Any) -> nn.Module:
    """Offload ``model`` onto ``device`` now: the chosen layers' weights go into page-locked
    host blocks one layer at a time (the model's host copy is freed as it goes), the other
    parameters and buffers to ``device``, and the slots are allocated there.  Options are the
    backend's (``group_size``, ``num_in_group``, ``prefetch_step``, ``offload_params``,
    ``layers``).  Then compile it: ``torch.compile(model, backend="prefetch_offload")``."""
    opts = parse_options(options)
    if opts.planned:
        raise OffloadError(
            "place() chooses the layers from group_size/num_in_group/prefetch_step; "
            "memory_budget needs the model's graph, which place() does not trace yet: give "
            "those options, or move the model to the device and compile it with "
            "memory_budget", where="fx_offload.place")
    if registry.state_for_model(model) is not None:
        raise OffloadError(f"{type(model).__name__} is already offloaded; call "
                           "fx_offload.restore(model) first", where="fx_offload.place")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    choice = choose(model, opts, device=device)
    state = OffloadState(model, choice)
    offloaded = {id(p.param) for ps in choice.params.values() for p in ps}
    activate(state, model, hand_over=True)
    _move_the_rest(model, offloaded, device)
    log.info("fx_offload: placed %s: %d of %d layers (%s) in %s host memory, the rest on %s",
             type(model).__name__, len(choice.layers), len(choice.stack.modules),
             format_bytes(choice.offloaded_bytes), "pinned" if state.pinned else "pageable",
             device)
    return model


def _move_the_rest(model: nn.Module, offloaded: set[int], device: torch.device) -> None:
    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) not in offloaded and p.device != device:
                    p.data = p.data.to(device)
            for name, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)


def activate(state: OffloadState, model: nn.Module, hand_over: bool) -> None:
    """Allocate and fill ``state``'s memory and hook it to ``model``."""
    state.materialize(hand_over)
    strip_hooks(model)
    spec = (state.choice.options, str(state.device))
    state.hooks = [model.register_forward_pre_hook(EnterCall(*spec)),
                   model.register_forward_hook(LeaveCall(), always_call=True)]
    state.hooks += hooks.install_layer_hooks(state)


def strip_hooks(model: nn.Module) -> None:
    """Remove our hooks from ``model``'s modules (those a copy brought along)."""
    ours = hooks.OURS + (EnterCall, LeaveCall)
    for module in model.modules():
        for hook_dict in (module._forward_pre_hooks, module._forward_hooks,
                          module._state_dict_hooks):
            for key in [k for k, h in hook_dict.items() if isinstance(h, ours)]:
                del hook_dict[key]
                module._forward_hooks_always_called.pop(key, None)


def _offload_again(model: nn.Module, options: OffloadOptions, device: str) -> OffloadState:
    choice = choose(model, options, device=torch.device(device))
    if isinstance(choice, NothingOffloaded):   # pragma: no cover - place() refuses budgets
        raise OffloadError("nothing to offload", where="fx_offload")
    state = OffloadState(model, choice)
    activate(state, model, hand_over=True)
    offloaded = {id(p.param) for ps in choice.params.values() for p in ps}
    _move_the_rest(model, offloaded, choice.device)
    return state


class EnterCall:
    """Forward pre-hook of an offloaded model's root: a call begins."""

    def __init__(self, options: OffloadOptions, device: str):
        self.options, self.device = options, device

    @torch._dynamo.disable
    def __call__(self, module, args):
        state = registry.state_for_model(module)
        if state is None:
            log.info("fx_offload: %s carries offload hooks but no offload state (a copy, or "
                     "unpickled): offloading it again", type(module).__name__)
            state = _offload_again(module, self.options, self.device)
        hooks.refuse_grad(state, args)
        try:
            state.enter(root=True)
        except ShapeChanged as changed:
            log.warning("fx_offload: %s of %s changed (dtype, shape, or place in the layer "
                        "stack); offloading the model again in its new form", changed,
                        type(module).__name__)
            state.detach()
            state = _offload_again(module, self.options, self.device)
            state.enter(root=True)
        return None


class LeaveCall:
    """Forward hook (always called) of an offloaded model's root: the call has ended."""

    @torch._dynamo.disable
    def __call__(self, module, args, output):
        state = registry.state_for_model(module)
        if state is not None:
            state.leave()
        return None
