"""The slot rule, written once: which slot each offloaded layer lives in, which layer refills
a slot after each layer, and what the slots hold where a call or a graph begins and ends.

Offloaded layers ``l_0 .. l_{n-1}`` (ascending, the order a forward runs them) share
``k = num_slots`` slots circularly::

    slot(l_i)   = i % k
    refill(l_i) = l_{i+k}                     the next layer of the same slot, or past the
                  l_{i % k}                   end the slot's first layer, for the next call;
                  None                        where the slot holds l_i alone (never refilled)

A slot's refill is copied in once the layer leaving it has run: ``start_prefetch`` after the
layer's last node, ``wait_prefetch`` before the refilled layer's first weight read.  Every call
begins and ends with slot ``s`` holding ``l_s``; a graph that starts mid-call (after a graph
break) finds the refills of every earlier layer done.

The runtime's first fill, the pass (plan and verifier), the planner's simulation, ``report``
and ``explain`` all read this; a change of refill order or distance is made here alone.
"""
from __future__ import annotations

from typing import Iterable, Mapping


class Schedule:
    """The slot rule for one set of offloaded layers and a slot count."""

    def __init__(self, layers: Iterable[int], num_slots: int):
        self.layers: tuple[int, ...] = tuple(sorted(layers))
        self.num_slots = num_slots
        n = len(self.layers)
        self.slot_of: dict[int, int] = {layer: i % num_slots
                                        for i, layer in enumerate(self.layers)}
        self.refill_of: dict[int, int | None] = {}
        for i, layer in enumerate(self.layers):
            nxt = i + num_slots
            refill = self.layers[nxt] if nxt < n else self.layers[i % num_slots]
            self.refill_of[layer] = None if refill == layer else refill

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and (self.layers, self.num_slots) == (
            other.layers, other.num_slots)

    def __hash__(self) -> int:
        return hash((self.layers, self.num_slots))

    def __repr__(self) -> str:
        return f"Schedule(layers={list(self.layers)}, num_slots={self.num_slots})"

    def call_entry(self) -> list[int]:
        """Layer each slot holds when a call begins, and must hold again when it ends."""
        return [self.layers[s] for s in range(self.num_slots)]

    def graph_entry(self, first_layer: int | None) -> list[int]:
        """Layer each slot holds when a graph whose first offloaded layer is ``first_layer``
        begins: every refill of an earlier offloaded layer (an earlier graph of the same
        call) has been started."""
        owner = self.call_entry()
        for layer in self.layers:
            if first_layer is None or layer >= first_layer:
                break
            refill = self.refill_of[layer]
            if refill is not None:
                owner[self.slot_of[layer]] = refill
        return owner

    def ends_call(self, graph_layers: Iterable[int]) -> bool:
        """True when a graph holding ``graph_layers`` runs the call's last offloaded layer."""
        graph_layers = list(graph_layers)
        return bool(graph_layers) and max(graph_layers) == self.layers[-1]

    def refilled_layers(self) -> list[int]:
        """Layers copied in during every call (a layer alone in its slot never is)."""
        return [r for r in self.refill_of.values() if r is not None]

    def moved_bytes(self, layer_bytes: Mapping[int, int]) -> int:
        """Bytes copied host-to-device per call."""
        return sum(layer_bytes[r] for r in self.refilled_layers())

    def slot_bytes(self, layer_bytes: Mapping[int, int]) -> int:
        """Device memory of the slots: each as large as the largest layer it holds."""
        return sum(max(layer_bytes[layer] for layer in self.layers if self.slot_of[layer] == s)
                   for s in range(self.num_slots))
