"""Selection, once per model: which layers and parameters are offloaded, into how many slots.

:func:`choose` is the one place a decision is made, from the options (``group_size`` /
``num_in_group`` / ``prefetch_step``) or, under ``memory_budget``, by the planner weighing the
first graph's costs.  It checks everything that can be checked before any memory moves.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .. import registry
from ..errors import META_REFUSED, OffloadError
from .. import kv
from ..options import OffloadOptions
from ..schedule import Schedule
from ..text import format_bytes
from . import budget
from .choice import Choice, NothingOffloaded
from .experts import expert_tensors
from .mlps import dense_mlps, refused_mlps
from .params import select_params, trains_adapters
from .stack import LayerStack, find_layer_stack, first_runs, in_run_order

log = logging.getLogger("fx_offload")


def choose(model: nn.Module, options: OffloadOptions, graph=None, layer_frame: bool = False,
           check_owners: bool = True, device: torch.device | None = None,
           planner: "budget.PlannerResult | None" = None,
           order: tuple[str, ...] | None = None) -> Choice | NothingOffloaded:
    """Decide what of ``model`` is offloaded.  ``graph`` is ``(gm, graph_inputs)`` of the
    first graph, whose costs the planner weighs; ``layer_frame``: that graph is one layer's
    own frame.  ``check_owners``: refuse parameters another offloaded model holds.
    ``device``: where the model will run (``place``, whose weights may be on the meta
    device, to be read from a checkpoint); by default, where its offloaded weights are now.
    ``planner``: the planner's result already reached (``place`` traces its own graph), with
    ``order``: the layer lists' paths in the order that trace ran them."""
    stack = find_layer_stack(model, order if order is not None else options.layers)
    if graph is not None and not layer_frame:
        stack = in_run_order(stack, first_runs(stack, *graph))
    if options.planned:
        if planner is None:
            planner = budget.plan_for(model, stack, options, graph, layer_frame,
                                      reserved=kv.reserved(model))
        if not planner.offloads:
            return NothingOffloaded(type(model).__name__, options, stack, planner)
        chosen = planner.chosen.candidate
        layers, patterns, num_slots = chosen.layers, chosen.params, chosen.num_slots
    else:
        layers = [i for i in range(len(stack.modules)) if options.offloads_layer(i)]
        patterns, num_slots = options.offload_params, options.prefetch_step
    params = select_params(model, stack, layers, patterns)
    _check_count(params, num_slots, options, stack, layers)
    if check_owners:
        _check_not_offloaded_elsewhere(params, model)
    device = _offload_device(model, params) if device is None else device
    schedule = Schedule(params, num_slots, options.circular_start)
    experts = expert_tensors(params) if options.experts == "routed" else {}
    hosts = options.mlps_on_host_in(device.type, options.mode)
    mlps = dense_mlps(params, experts) if hosts else {}
    choice = Choice(type(model).__name__, options, stack, params, schedule, device, planner,
                    hook_starts_entry=options.hook_starts_entry, compress=options.compress,
                    uncompressed_weights=options.uncompressed_weights,
                    under_cuda_graphs=options.mode == "reduce-overhead",
                    experts=experts, expert_cache=_expert_cache(options, planner),
                    mlps=mlps, mlps_refused=refused_mlps(params, experts, mlps, stack)
                    if hosts else {})
    if planner is not None or not _warn_if_little_saved(choice):
        _say_layers_alone(choice)
    return choice


def _expert_cache(options: OffloadOptions, planner) -> int:
    """Device bytes for the routed layers' most-picked experts: as asked, or under
    ``"auto"`` what the plan leaves of ``memory_budget`` (the device memory the user gave
    for weights; the cached experts are weights).  Without a budget, none: memory the user
    did not give may be the KV cache's or the activations'.  Under host_compute="always"
    none: no call streams the experts."""
    if options.experts != "routed" or options.host_compute == "always":
        return 0
    if options.expert_cache != "auto":
        return options.expert_cache
    return 0 if planner is None else max(planner.budget - planner.chosen.candidate.weights_bytes,
                                         0)


LITTLE_SAVED = 0.1      # of the offloaded bytes: less saved than this earns a warning


def _warn_if_little_saved(choice: Choice) -> bool:
    """Warn where the slots hold nearly all the offloaded bytes; whether it did."""
    offloaded, slots = choice.offloaded_bytes, choice.slot_bytes
    if offloaded - slots > LITTLE_SAVED * offloaded:
        return False
    n, k = len(choice.layers), choice.schedule.num_slots
    lower = f"lower prefetch_step ({k} now) or " if k > 1 else ""
    log.warning(
        "fx_offload: %s: %d offloaded layer(s) in %d slot(s) save %s of the %s offloaded "
        "(the slots hold nearly all of it): %soffload more layers (group_size/num_in_group), "
        "or give memory_budget and let the planner choose", choice.model_name, n, k,
        format_bytes(max(offloaded - slots, 0)), format_bytes(offloaded), lower)
    return True


def _say_layers_alone(choice: Choice) -> None:
    """A layer alone in its slot (fewer offloaded layers than twice the slots) is copied in
    once and kept: it saves no device memory, and a write that no version counter sees
    (through ``.data``) never reaches it, as no later copy does.  A warning where the user
    chose the slots (unless :func:`_warn_if_little_saved` said the slots save little,
    with its own advice), an INFO line where the planner did."""
    schedule = choice.schedule
    alone = [layer for layer, refill in schedule.refill_of.items() if refill is None]
    if not alone:
        return
    n, k = len(schedule.layers), schedule.num_slots
    planned = choice.planner is not None
    advice = "" if planned else \
        f"; prefetch_step={n // 2} or less puts every offloaded layer in a slot it shares"
    log.log(logging.INFO if planned else logging.WARNING,
            "fx_offload: %s: layer(s) %s alone in their slot (%d offloaded, %d slot(s)%s): "
            "each is copied in once and kept there, so it saves no device memory, and a write "
            "through .data never reaches it (write the parameter itself, or use "
            "fx_offload.update_weights)%s", choice.model_name, alone, n, k,
            ", the planner's choice" if planned else "", advice)


def _check_count(params, num_slots: int, options: OffloadOptions, stack: LayerStack,
                 picked) -> None:
    layers = sorted(params)
    if not layers:
        n = len(stack.modules)
        if not picked:
            why = (f"the last num_in_group of each group of group_size layers are offloaded, "
                   f"and no group is complete: use group_size <= {n}")
        elif all(p.requires_grad for i in picked for p in stack.modules[i].parameters()) \
                and trains_adapters(stack):
            why = (f"every parameter of layers {list(picked)} requires grad (trained), so they "
                   "stay on the device: freeze the weights to offload (requires_grad_(False)), "
                   "or choose other layers")
        else:
            why = (f"layers {list(picked)} hold no parameter of their own to offload (none, "
                   "or each shared with another module)")
        raise OffloadError(
            f"selected no layer to offload with group_size={options.group_size}, "
            f"num_in_group={options.num_in_group} on a stack of {n} layers at "
            f"{stack.path or '<root>'!r}: {why}")
    if num_slots > len(layers):
        raise OffloadError(
            f"option 'prefetch_step' ({num_slots}) is larger than the number of offloaded "
            f"layers ({len(layers)}: layers {layers}); use prefetch_step <= {len(layers)}, or "
            "offload more layers (group_size/num_in_group)")


def _check_not_offloaded_elsewhere(params, model: nn.Module) -> None:
    for ps in params.values():
        for p in ps:
            owner = registry.owner_of_param(p.param)
            if owner is None:
                continue
            other = owner[0].model_ref()
            if other is not None and other is not model and (
                    any(m is model for m in other.modules()) or
                    any(m is other for m in model.modules())):
                # two models, one inside the other, claim the same layers: the inner one
                # compiled on its own, or apart after a graph break in the outer forward
                raise OffloadError(
                    f"{owner[0].model_name} and this {type(model).__name__}, one module "
                    "inside the other, both hold these layers, and the "
                    f"{owner[0].model_name} is already offloaded; a model is offloaded once. "
                    "If it was compiled on its own, compile only one of the two (call "
                    "fx_offload.restore on it first); else Dynamo compiled it apart after a "
                    "graph break in the outer forward outside the layers (TORCH_LOGS="
                    "graph_breaks shows where; a Hugging Face model training with gradient "
                    "checkpointing breaks at its embeddings' require-grad hook: call "
                    "model.disable_input_require_grads(), and torch._dynamo.reset() if the "
                    "model was called before): remove the graph break")
            raise OffloadError(
                f"{p.name} is already offloaded (layer {owner[1]} of a "
                f"{owner[0].model_name}); a model is offloaded once. Call "
                "fx_offload.restore(model) before compiling it again differently")


def _offload_device(model: nn.Module, params) -> torch.device:
    """The one device the offloaded weights are on; refuses what cannot be offloaded."""
    devices = {p.param.device for ps in params.values() for p in ps}
    if len(devices) != 1:
        raise OffloadError(
            "needs the offloaded layers' weights on one device, found "
            f"{sorted(str(d) for d in devices)}; move the model to one device first")
    device = devices.pop()
    if device.type == "meta":
        raise OffloadError(META_REFUSED)
    if device.type == "cpu":
        accel = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
        if accel:
            raise OffloadError(
                "the weights of the layers to offload are already on the host (cpu) while the "
                f"rest of the model is on {accel}; move the whole model to the GPU "
                "(model.to('cuda')) and let the backend offload them")
        if _cuda_available():
            log.warning(
                "fx_offload: %s is on the CPU although CUDA is available: offloading weights "
                "that are already in host memory saves nothing (it runs as a CPU simulation); "
                "move the model to the GPU first", type(model).__name__)
    return device


def _cuda_available() -> bool:
    return torch.cuda.is_available()
