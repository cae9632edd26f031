"""Slot-safety verifier: proves, on a rewritten graph, that no offloaded weight is read from
a slot that does not hold it.

It reads only the graph (the inserted ops and which placeholders are offloaded weights), not
the plan that produced it, and simulates the slots in program order:

* at the graph's entry each slot holds what the global schedule leaves there: for the first
  graph of a call, the slot's first layer (circularly, from the previous call);
* ``wait(L)`` is legal only if the last fill of ``slot(L)`` was for ``L`` (a start targeting
  ``L``, or the entry state); it makes ``L`` readable;
* a read of ``L``'s weights is legal only while ``L`` is the readable layer of its slot: after
  its wait and before the next start that refills the slot;
* ``start(L -> T)`` refills ``slot(L)``; ``T`` must belong to that slot; ``L`` is no longer
  readable.
* a graph that ends the model's forward must leave every slot holding its first layer, which
  is what the next call's entry assumes.
Violations raise :class:`ScheduleError` naming the node, the layer and the slot.
"""
from __future__ import annotations

import dataclasses

from torch import fx

from . import ops


class ScheduleError(ValueError):
    pass


@dataclasses.dataclass
class SlotModel:
    """What the verifier needs to know about the offload state."""
    slot_of: dict[int, int]
    entry_owner: list[int]          # layer each slot holds when the graph starts
    exit_owner: list[int] | None    # layer each slot must hold at the end (None: unchecked)


def slot_model_for(state, graph_layers: list[int]) -> SlotModel:
    """Entry state of a graph whose first offloaded layer is ``graph_layers[0]``: every
    start of an earlier offloaded layer has run (earlier graphs of the same call)."""
    owner = [state.layers[s] for s in range(state.num_slots)]
    first = min(graph_layers) if graph_layers else None
    for layer in state.layers:
        if first is None or layer >= first:
            break
        target = state.target_of[layer]
        if target is not None:
            owner[state.slot_of[layer]] = target
    ends_call = bool(graph_layers) and max(graph_layers) == state.layers[-1]
    initial = [state.layers[s] for s in range(state.num_slots)]
    return SlotModel(dict(state.slot_of), owner, initial if ends_call else None)


def _op(node: fx.Node):
    if node.op != "call_function":
        return None
    if node.target in (ops.WAIT, ops.WAIT.overloadpacket):
        return "wait"
    if node.target in (ops.START, ops.START.overloadpacket):
        return "start"
    return None


def verify_graph(gm: fx.GraphModule, weight_layer: dict[fx.Node, int], model: SlotModel) -> None:
    """Raise :class:`ScheduleError` at the first unsafe node of ``gm``."""
    owner = list(model.entry_owner)
    readable: list[int | None] = [None] * len(owner)
    for node in gm.graph.nodes:
        kind = _op(node)
        if kind == "wait":
            layer = node.args[2]
            slot = model.slot_of[layer]
            if owner[slot] != layer:
                raise ScheduleError(
                    f"{node.format_node()}: wait for layer {layer}, but slot {slot} was last "
                    f"filled with layer {owner[slot]}; no start_prefetch of layer {layer} "
                    "precedes this wait")
            readable[slot] = layer
        elif kind == "start":
            layer, target = node.args[3], node.args[4]
            slot = model.slot_of[layer]
            if model.slot_of.get(target) != slot:
                raise ScheduleError(
                    f"{node.format_node()}: start after layer {layer} (slot {slot}) prefetches "
                    f"layer {target}, which lives in slot {model.slot_of.get(target)}")
            owner[slot] = target
            readable[slot] = None
        else:
            for arg in node.all_input_nodes:
                layer = weight_layer.get(arg)
                if layer is None:
                    continue
                slot = model.slot_of[layer]
                if readable[slot] != layer:
                    state = ("it is being refilled with layer "
                             f"{owner[slot]}" if owner[slot] != layer
                             else "no wait_prefetch for it precedes this read")
                    raise ScheduleError(
                        f"{node.format_node()}: reads {arg.name} of layer {layer} from slot "
                        f"{slot}, but {state}")
    if model.exit_owner is not None and owner != model.exit_owner:
        bad = [s for s, (a, b) in enumerate(zip(owner, model.exit_owner)) if a != b]
        raise ScheduleError(
            f"graph ends with slot(s) {bad} holding layer(s) {[owner[s] for s in bad]}, but "
            f"the next call starts by reading layer(s) {[model.exit_owner[s] for s in bad]} "
            "from them: a circular prefetch is missing")
