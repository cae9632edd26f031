"""Check the slot rule of the host KV cache on a rewritten graph, in graph order.

A slot holds one layer at a time: the layer whose fill was begun last (by ``kv_begin`` or
by the previous occupant's ``kv_update``).  The graph is refused where

* a fill is begun into a slot whose occupant has not had its update (its blocks would be
  overwritten before the attention reads them);
* a layer's update runs while its slot holds another layer not yet updated;
* a layer is filled or updated twice in one call (a fill after the layer's own update would
  read host blocks its write-back may not have written yet);
* a graph with updates does not end with ``kv_join`` after them (the next call's fills
  would read host blocks before this call's write-backs land).

The runtime orders each slot's refill after its occupant's write-back by an event, and the
ops' data flow orders every read after its update; this proves the order of the ops.
"""
from __future__ import annotations

from torch import fx

from . import kv_ops
from .reroute import KVPassError


def _fail(node: fx.Node, why: str):
    raise KVPassError(f"unsafe host KV schedule at {node.name}: {why}", where="kv_cache='host'")


def verify(graph: fx.Graph, runtime) -> None:
    occupant: dict[int, int] = {}       # slot -> layer filled into it, not yet updated
    filled, updated = set(), set()
    joined = True

    def fill(node, layer):
        slot = runtime.slot_of(layer)
        if layer in filled or layer in updated:
            _fail(node, f"layer {layer} is filled twice in one call")
        if slot in occupant:
            _fail(node, f"slot {slot} is refilled with layer {layer} while layer "
                        f"{occupant[slot]}, filled into it, has not been read")
        occupant[slot] = layer
        filled.add(layer)

    for node in graph.nodes:
        if node.target is kv_ops.BEGIN:
            for layer in node.args[5]:
                fill(node, int(layer))
        elif node.target is kv_ops.UPDATE:
            layer, target = int(node.args[8]), int(node.args[9])
            slot = runtime.slot_of(layer)
            if layer in updated:
                _fail(node, f"layer {layer} is updated twice in one call")
            if occupant.get(slot, layer) != layer:
                _fail(node, f"layer {layer}'s slot {slot} holds layer {occupant[slot]}, "
                            "not yet read")
            if layer not in filled:
                fill(node, layer)       # the update copies it itself
            del occupant[slot]
            updated.add(layer)
            joined = False
            if target >= 0:
                if runtime.slot_of(target) != slot:
                    _fail(node, f"layer {layer} refills slot {slot} with layer {target}, "
                                f"whose slot is {runtime.slot_of(target)}")
                fill(node, target)
        elif node.target is kv_ops.ATTEND:     # on the host: no slot, written in place
            layer = int(node.args[9])
            if layer in updated or layer in filled:
                _fail(node, f"layer {layer} is filled or updated beside its attention on the "
                            "host")
            updated.add(layer)
        elif node.target is kv_ops.JOIN:
            joined = True
    if occupant:
        slot, layer = next(iter(occupant.items()))
        _fail(next(n for n in reversed(graph.nodes) if n.op == "output"),
              f"layer {layer} is filled into slot {slot} but never read in this graph")
    if not joined:
        _fail(next(n for n in reversed(graph.nodes) if n.op == "output"),
              "the graph ends before kv_join: write-backs would still be in flight")
