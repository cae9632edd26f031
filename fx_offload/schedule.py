"""The slot rule, written once: which slot each offloaded layer lives in, which layer refills
a slot after each layer, when each refill starts, and what the slots hold where a call or a
graph begins and ends.

Offloaded layers ``l_0 .. l_{n-1}`` (ascending, the order a forward runs them) share
``k = num_slots`` slots circularly::

    slot(l_i)   = i % k
    refill(l_i) = l_{i+k}                     the next layer of the same slot, or past the
                  l_{i % k}                   end the slot's first layer, for the next call;
                  None                        where the slot holds l_i alone (never refilled)

A refill within the call (``l_{i+k}``) is copied in once the layer leaving the slot has read
what each chunk overwrites: ``start_prefetch`` after those reads, ``wait_prefetch`` before the
refilled layer's first read of each chunk.  A refill that wraps (``l_s``, for the next call:
the circular prefetch) starts at the end, at the entry, or at either, chosen call by call
(``circular``, from the option ``circular_prefetch``)::

    "end"       after last(s)'s reads, like the refills within the call.  Every call begins
                and ends with slot s holding l_s.  The copy overlaps this call's last layers
                and whatever the host does until the next call: best where calls run back to
                back or the loop waits for its outputs alone.
    "entry"     at the top of the graph that runs l_0, before any compute.  Every call begins
                and ends with slot s holding last(s).  Nothing is left copying when a call
                ends, and the copy stream works from the call's first node: best where the
                loop synchronizes the device after each call, and inside a CUDA graph, whose
                end waits for every copy it began.  The model's call hook begins them first
                (before Dynamo's guards); the graph's start then finds them begun.  Under
                CUDA graphs the hook's copies run outside the replayed graph, which waits for
                them through external events (runtime.copies.hook_copies).
    "either"    the graphs hold both starts and the runtime uses one per call: the start at
                the end copies while the caller is seen not to wait for those copies (they are
                still running when the next call begins), and stays idle otherwise, leaving
                the slot to the entry start, which copies only where the slot does not hold
                l_s already.  A call ends with slot s holding l_s (copying) or last(s); the
                graphs assume last(s), which the entry start makes safe either way.  Inside a
                capture the end start stays idle: a CUDA graph behaves as at the entry.

A graph that starts mid-call (after a graph break) finds the entry refills and the refills of
every earlier layer started.  The runtime's first fill puts ``l_s`` in slot ``s`` either way,
so a first call's entry refills find nothing to copy.

The runtime's first fill, the pass (plan and verifier), the planner's simulation, ``report``
and ``explain`` all read this; a change of refill order or distance is made here alone.
"""
from __future__ import annotations

from typing import Iterable, Mapping


CIRCULAR = ("end", "entry", "either")


class Schedule:
    """The slot rule for one set of offloaded layers and a slot count; ``circular``: where
    the circular prefetch starts (``"end"``, ``"entry"`` or ``"either"``, see above)."""

    def __init__(self, layers: Iterable[int], num_slots: int, circular: str = "end"):
        if circular not in CIRCULAR:
            raise ValueError(f"circular must be one of {CIRCULAR}, got {circular!r}")
        self.layers: tuple[int, ...] = tuple(sorted(layers))
        self.num_slots = num_slots
        self.circular = circular
        n = len(self.layers)
        self.slot_of: dict[int, int] = {layer: i % num_slots
                                        for i, layer in enumerate(self.layers)}
        self.refill_of: dict[int, int | None] = {}
        for i, layer in enumerate(self.layers):
            nxt = i + num_slots
            refill = self.layers[nxt] if nxt < n else self.layers[i % num_slots]
            self.refill_of[layer] = None if refill == layer else refill

    @property
    def at_entry(self) -> bool:
        """The graph that runs ``l_0`` starts the entry refills."""
        return self.circular != "end"

    @property
    def at_end(self) -> bool:
        """Each slot's last layer starts the refill of its first, for the next call."""
        return self.circular != "entry"

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return self.layers, self.num_slots, self.circular

    def __repr__(self) -> str:
        return (f"Schedule(layers={list(self.layers)}, num_slots={self.num_slots}, "
                f"circular={self.circular!r})")

    def first_fill(self) -> list[int]:
        """Layer each slot holds for a call to read first: its first layer."""
        return [self.layers[s] for s in range(self.num_slots)]

    def call_entry(self) -> list[int]:
        """Layer each slot is taken to hold when a call begins: its first layer, or where
        the entry refills run its last (the same where the slot holds one layer alone).
        Under ``"either"`` the slot may hold its first layer already, copied by the
        previous call's end: the entry refill then copies nothing."""
        return self._last_of_slots() if self.at_entry else self.first_fill()

    def call_exit(self) -> list[int]:
        """Layer each slot holds (or is being filled with) when a call ends: its first
        layer where the end starts its refill, else its last."""
        return self.first_fill() if self.at_end else self._last_of_slots()

    def _last_of_slots(self) -> list[int]:
        last: dict[int, int] = {}
        for layer in self.layers:
            last[self.slot_of[layer]] = layer
        return [last[s] for s in range(self.num_slots)]

    def refill_in_call(self, layer: int) -> int | None:
        """The refill started after ``layer`` (once it has read what each chunk overwrites);
        None where there is none, or where it is started at the next call's entry alone."""
        refill = self.refill_of[layer]
        if refill is None or (not self.at_end and self.wraps(layer, refill)):
            return None
        return refill

    @staticmethod
    def wraps(layer: int, refill: int) -> bool:
        """A refill of ``layer``'s slot that takes the slot's first layer back in for the
        next call (the circular prefetch), not a later layer of this call."""
        return refill < layer

    def entry_refills(self) -> list[tuple[int, int]]:
        """``(leaving, refill)`` for each slot refilled when a call begins (none at the
        end): its last layer leaves, its first comes in.  In slot order, the order
        ``l_0 .. l_{k-1}`` are read."""
        if not self.at_entry:
            return []
        return sorted(((layer, refill) for layer, refill in self.refill_of.items()
                       if refill is not None and self.wraps(layer, refill)),
                      key=lambda lr: lr[1])

    def starts_call(self, graph_layers: Iterable[int]) -> bool:
        """True when a graph holding ``graph_layers`` runs the call's first offloaded layer,
        and so starts the entry refills (if any)."""
        return self.layers[0] in set(graph_layers)

    def graph_entry(self, first_layer: int | None) -> list[int]:
        """Layer each slot holds when a graph whose first offloaded layer is ``first_layer``
        begins: where it is not the call's first, the entry refills and every refill of an
        earlier offloaded layer (an earlier graph of the same call) have been started."""
        owner = self.call_entry()
        if first_layer is None or first_layer <= self.layers[0]:
            return owner
        for _, refill in self.entry_refills():
            owner[self.slot_of[refill]] = refill
        for layer in self.layers:
            if layer >= first_layer:
                break
            refill = self.refill_in_call(layer)
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
