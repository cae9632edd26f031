"""Slot-safety verifier: proves, on a rewritten graph, that no offloaded weight is read from
a slot that does not hold it.

It reads only the graph (the inserted ops and which placeholders are offloaded weights), not
the plan that produced it, and simulates the slots in program order:

* at the graph's entry each slot holds what the schedule (:mod:`fx_offload.schedule`) leaves
  there: for the first graph of a call, the slot's first layer (circularly, from the previous
  call);
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

from ..errors import ScheduleError
from ..ops import OpCall
from ..schedule import Schedule


@dataclasses.dataclass
class SlotModel:
    """What the verifier needs to know about the schedule."""
    slot_of: dict[int, int]
    entry_owner: list[int]          # layer each slot holds when the graph starts
    exit_owner: list[int] | None    # layer each slot must hold at the end (None: unchecked)


def slot_model_for(schedule: Schedule, graph_layers: list[int]) -> SlotModel:
    """The slots around a graph holding the offloaded layers ``graph_layers``."""
    first = min(graph_layers) if graph_layers else None
    exit_owner = schedule.call_entry() if schedule.ends_call(graph_layers) else None
    return SlotModel(dict(schedule.slot_of), schedule.graph_entry(first), exit_owner)


def verify_graph(gm: fx.GraphModule, weight_layer: dict[fx.Node, int], model: SlotModel) -> None:
    """Raise :class:`ScheduleError` at the first unsafe node of ``gm``."""
    owner = list(model.entry_owner)
    readable: list[int | None] = [None] * len(owner)
    for node in gm.graph.nodes:
        call = OpCall.of(node)
        kind = None if call is None else call.kind
        if kind == "wait":
            layer = call.layer
            slot = model.slot_of[layer]
            if owner[slot] != layer:
                raise ScheduleError(
                    f"{node.format_node()}: wait for layer {layer}, but slot {slot} was last "
                    f"filled with layer {owner[slot]}; no start_prefetch of layer {layer} "
                    "precedes this wait")
            readable[slot] = layer
        elif kind == "start":
            layer, refill = call.layer, call.refill
            slot = model.slot_of[layer]
            if model.slot_of.get(refill) != slot:
                raise ScheduleError(
                    f"{node.format_node()}: start after layer {layer} (slot {slot}) prefetches "
                    f"layer {refill}, which lives in slot {model.slot_of.get(refill)}")
            owner[slot] = refill
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
