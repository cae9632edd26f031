"""Slot-safety verifier: proves, on a rewritten graph, that no offloaded weight is read from
slot bytes that do not hold it.

It reads only the graph (the inserted ops and which placeholders are offloaded weights of
which chunk), the schedule and the layers' chunks (:mod:`fx_offload.layout`), not the plan
that produced it, and simulates the slots byte range by byte range in program order:

* at the graph's entry each slot holds every chunk of what the schedule
  (:mod:`fx_offload.schedule`) leaves there: for the graph that runs the call's first
  offloaded layer, what the previous call left (the slot's first layer, or with the circular
  prefetch at the entry its last, which the entry refills overwrite);
* ``wait(L, c)`` is legal only if the last fill of the bytes of ``L``'s chunk ``c`` was for
  that chunk (a start of it, or the entry state); it makes the chunk readable;
* a read of a weight of ``L``'s chunk ``c`` is legal only while that chunk is readable:
  after its wait and before a start overwrites any of its bytes;
* ``wait_routed(L, c, ids)`` fills only the rows ``ids`` picks: every read of the chunk's
  tensors must take rows by values computed from ``ids`` (:mod:`.routing`);
* ``start(L -> T, d)`` fills ``T``'s chunk ``d`` in ``slot(L)``; ``T`` must belong to that
  slot; every chunk whose bytes it overlaps is gone (no longer readable, nor waitable);
* ``host_experts(x, ids, gates, L, chunks)`` reads no slot when it computes on the host,
  but when it streams it waits for ``L``'s ``chunks`` itself: it is legal only where the
  last fill of their bytes was for them, and the graph reads those chunks' weights nowhere
  else (the op is their only reader: there is no wait for a read to follow);
* a graph that ends the model's forward must leave every slot holding every chunk of what
  ``Schedule.call_exit`` says a call ends with: the next call's entry assumes it, or (at
  the entry) refills over it.

Violations raise :class:`ScheduleError` naming the node, the layer, the chunk and the slot.
The rules in words, for users: docs/inspecting.md (Slot-safety verifier).
"""
from __future__ import annotations

import dataclasses

from torch import fx

from ..errors import ScheduleError
from ..ops import OpCall
from .picks import picked_values, rows_of
from .routing import unrouted_read
from ..schedule import Schedule


@dataclasses.dataclass
class SlotModel:
    """What the verifier needs to know about the schedule."""
    slot_of: dict[int, int]
    chunks: dict[int, list]         # layer -> its chunks (fx_offload.layout.Chunk)
    entry_owner: list[int | None]   # layer each slot holds when the graph starts (None:
    #                                 nothing known, as at a backward's start)
    exit_owner: list[int] | None    # layer each slot must hold at the end (None: unchecked)


def slot_model_for(schedule: Schedule, chunks: dict[int, list],
                   graph_layers: list[int]) -> SlotModel:
    """The slots around a graph holding the offloaded layers ``graph_layers``."""
    first = min(graph_layers) if graph_layers else None
    exit_owner = schedule.call_exit() if schedule.ends_call(graph_layers) else None
    return SlotModel(dict(schedule.slot_of), chunks, schedule.graph_entry(first), exit_owner)


def verify_graph(gm: fx.GraphModule, weight_chunk: dict[fx.Node, tuple[int, int]],
                 model: SlotModel) -> None:
    """Raise :class:`ScheduleError` at the first unsafe node of ``gm``.  ``weight_chunk``:
    offloaded weight placeholder -> (its layer, its chunk)."""
    # per slot: (layer, chunk) whose bytes it holds -> readable (waited for since filled)
    held: list[dict[tuple[int, int], bool]] = [
        {} if layer is None else {(layer, c.index): False for c in model.chunks[layer]}
        for layer in model.entry_owner]
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    routers: dict = {}      # (ids, experts, last read) -> their picks (_check_routed)

    def chunks_of(layer, chunk):
        return model.chunks[layer] if chunk < 0 else [model.chunks[layer][chunk]]

    def holder_of(slot, layer, chunk):
        """What last filled the bytes of ``layer``'s ``chunk``, in words."""
        for (other, index) in held[slot]:
            if model.chunks[other][index].overlaps(model.chunks[layer][chunk]):
                return f"layer {other} chunk {index}"
        return "nothing"

    for node in gm.graph.nodes:
        call = OpCall.of(node)
        kind = None if call is None else call.kind
        if kind == "wait":
            layer = call.layer
            slot = model.slot_of[layer]
            for c in chunks_of(layer, call.chunk):
                if (layer, c.index) not in held[slot]:
                    raise ScheduleError(
                        f"{node.format_node()}: wait for layer {layer} chunk {c.index}, but "
                        f"slot {slot}'s bytes for it were last filled with "
                        f"{holder_of(slot, layer, c.index)}; no start_prefetch of layer "
                        f"{layer} chunk {c.index} precedes this wait")
                held[slot][(layer, c.index)] = True
            if call.ids is not None:
                _check_routed(node, call, weight_chunk, nodes, position, routers)
        elif kind == "host":
            _check_host(node, call, weight_chunk, held[model.slot_of[call.layer]])
        elif kind == "start":
            layer, refill = call.layer, call.refill
            slot = model.slot_of[layer]
            if model.slot_of.get(refill) != slot:
                raise ScheduleError(
                    f"{node.format_node()}: start after layer {layer} (slot {slot}) prefetches "
                    f"layer {refill}, which lives in slot {model.slot_of.get(refill)}")
            for c in chunks_of(refill, call.chunk):
                for other, index in list(held[slot]):
                    if model.chunks[other][index].overlaps(c):
                        del held[slot][(other, index)]
                held[slot][(refill, c.index)] = False
        else:
            for arg in node.all_input_nodes:
                found = weight_chunk.get(arg)
                if found is None:
                    continue
                layer, chunk = found
                slot = model.slot_of[layer]
                readable = held[slot].get((layer, chunk))
                if not readable:
                    state = ("no wait_prefetch for it precedes this read" if readable is False
                             else "its bytes are being refilled with "
                             f"{holder_of(slot, layer, chunk)}")
                    raise ScheduleError(
                        f"{node.format_node()}: reads {arg.name} of layer {layer} chunk "
                        f"{chunk} from slot {slot}, but {state}")
    if model.exit_owner is not None:
        bad = [s for s, layer in enumerate(model.exit_owner)
               if any((layer, c.index) not in held[s] for c in model.chunks[layer])]
        if bad:
            raise ScheduleError(
                f"graph ends with slot(s) {bad} not holding all of layer(s) "
                f"{[model.exit_owner[s] for s in bad]}, which is what the next call begins "
                "with: a circular prefetch is missing, or one runs where the schedule does "
                "not put it")


def _check_host(node: fx.Node, call: OpCall, weight_chunk, held) -> None:
    """A ``host_experts`` op finds its chunks' bytes filled for them, and is their only
    reader."""
    for chunk in call.chunks:
        if (call.layer, chunk) not in held:
            raise ScheduleError(
                f"{node.format_node()}: computes layer {call.layer}'s experts (chunk {chunk}), "
                "but a refill of another layer has begun over that chunk's slot bytes before "
                "it: streamed, it would wait for a copy that is gone")
        for w, at in weight_chunk.items():
            if at == (call.layer, chunk) and w.users:
                raise ScheduleError(
                    f"{next(iter(w.users)).format_node()}: reads {w.name} (layer "
                    f"{call.layer} chunk {chunk}), whose experts {node.format_node()} "
                    "computes: nothing waits for that chunk")


def _check_routed(node: fx.Node, call: OpCall, weight_chunk, nodes: list[fx.Node],
                  position: dict[fx.Node, int], routers: dict) -> None:
    """Every read of the expert tensors a ``wait_routed`` waits for takes rows its ids pick
    (``routers``: (ids node, experts, position of the last read) -> the nodes holding only
    the ids' values, found from the ids to the last read of those tensors: what comes
    later cannot change which rows they took)."""
    ws = [w for w, at in weight_chunk.items() if at == (call.layer, call.chunk)]
    last = max((position[r] for w in ws for u in w.users for r in (u, *u.users)),
               default=position[node])
    layer, chunk = call.layer, call.chunk
    for w in ws:
        key = (call.ids, rows_of(w), last)
        if key not in routers:
            routers[key] = picked_values(call.ids, nodes[position[call.ids]:last + 1],
                                         rows_of(w))
        picks = routers[key]
        if call.ids not in picks:
            raise ScheduleError(
                f"{node.format_node()} gathers the experts {call.ids.name} names, but the "
                "graph writes those ids in place: the gather would copy other rows than the "
                "reads take")
        bad = unrouted_read(w, picks)
        if bad is not None:
            raise ScheduleError(
                f"{bad.format_node()}: reads rows of {w.name} (layer {layer} chunk {chunk}) "
                f"other than its router's picks, but {node.format_node()} fills only the "
                "experts its router picked; the other rows hold whatever the slot held")
