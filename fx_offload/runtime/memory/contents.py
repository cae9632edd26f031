"""What the bytes of each slot hold, chunk by chunk, and the copies in flight into them: the
runtime's record of the slot layout (:mod:`fx_offload.layout`), read by
:class:`~.state.OffloadState`'s ``wait``, ``start`` and ``join``.

Each slot maps ``(layer, chunk)`` to the copy that is filling those bytes (``None`` once it is
done or waited for).  Filling a chunk forgets every chunk of another layer whose bytes it
overlaps, so a wait finds its chunk only if nothing has overwritten it since it was filled.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Pending:
    # recorded on the copy stream after the copy; None: the copy has landed (a record kept
    # only for ``in_capture``: see :func:`landed`)
    event: torch.cuda.Event | None
    in_capture: bool            # recorded while the stream was being captured into a CUDA graph
    # begun by the model's call hook, outside any capture, on an event made with
    # ``external=True``: a capture waits for it through an event-wait node, so each replay
    # waits for the copy the hook began before it
    by_hook: bool = False


def landed(in_capture: bool) -> Pending | None:
    """What a slot records for a chunk whose bytes are in place (waited for, or loaded on the
    current stream): None; but inside a CUDA-graph capture, a record of the capture, since
    the capture only recorded what puts them there: a capture that raises never runs it, and
    its records are forgotten with its copies (:meth:`SlotContents.forget_captured`); one
    that ends lands them (:meth:`SlotContents.join`)."""
    return Pending(None, True) if in_capture else None


class SlotContents:
    """Per slot: ``(layer, chunk)`` whose bytes it holds -> its copy in flight, or None."""

    def __init__(self, layout: dict, slot_of: dict[int, int], num_slots: int):
        self.layout, self.slot_of = layout, slot_of
        self.held: list[dict[tuple[int, int], Pending | None]] = [{} for _ in range(num_slots)]

    def chunks(self, layer: int, chunk: int = -1):
        """``layer``'s chunk ``chunk``, or all of them (-1)."""
        chunks = self.layout[layer]
        return chunks if chunk < 0 else (chunks[chunk],)

    def slot(self, layer: int) -> dict:
        return self.held[self.slot_of[layer]]

    def holds(self, layer: int) -> bool:
        """Some chunk of ``layer`` is in (or on its way into) its slot."""
        return any(other == layer for other, _ in self.slot(layer))

    def fill(self, layer: int, chunk, pending: Pending | None) -> None:
        """``layer``'s ``chunk`` now fills its bytes; what they held before is gone."""
        held = self.slot(layer)
        for other, index in list(held):
            if other != layer and self.layout[other][index].overlaps(chunk):
                del held[(other, index)]
        held[(layer, chunk.index)] = pending

    def held_for(self, layer: int, chunk, capturing: bool) -> bool:
        """The slot holds (or is being filled with) ``layer``'s ``chunk``, by a copy a
        CUDA-graph capture under way recorded where one is (its replays cannot know what
        anything before it left in the slot)."""
        key = (layer, chunk.index)
        held = self.slot(layer)
        if key not in held:
            return False
        return not capturing or (held[key] is not None and
                                 (held[key].in_capture or held[key].by_hook))

    def by_hook(self, layer: int, chunk) -> bool:
        """The call hook began the copy of ``layer``'s ``chunk``, not yet waited for."""
        return getattr(self.slot(layer).get((layer, chunk.index)), "by_hook", False)

    def forget(self, layer: int, chunk) -> None:
        """The bytes of ``layer``'s ``chunk`` hold no whole chunk (some rows of it were
        copied, or none)."""
        held = self.slot(layer)
        for other, index in list(held):
            if self.layout[other][index].overlaps(chunk):
                del held[(other, index)]

    def settle_over(self, layer: int, chunks, wait_for) -> None:
        """Before bytes of ``layer``'s slot that ``chunks`` cover are written on the current
        stream: ``wait_for(pending)`` each copy in flight into them, and forget it."""
        held = self.slot(layer)
        for key, p in list(held.items()):
            if p is not None and any(self.layout[key[0]][key[1]].overlaps(c) for c in chunks):
                wait_for(p)
                held[key] = landed(p.in_capture)

    def pending(self) -> dict[tuple[int, int], Pending]:
        """(layer, chunk) -> its copy in flight (not yet waited for), or landed in the
        capture under way."""
        return {key: p for held in self.held for key, p in held.items() if p is not None}

    def forget_captured(self) -> None:
        """Outside any capture: copies recorded in a capture that was not joined (it raised)
        never ran, and their events may not be waited on here: their bytes hold nothing."""
        for held in self.held:
            for key, pending in list(held.items()):
                if pending is not None and pending.in_capture:
                    del held[key]

    def join(self, stream, captured: bool) -> None:
        """End of a forward: ``stream`` waits for every copy it began, then they count as
        landed.  ``captured``: the copies forked during a capture; joined inside the graph,
        whoever runs after a replay is ordered after the copy, and the event itself means
        nothing outside the capture.  Else the copies begun outside any capture."""
        for held in self.held:
            for key, pending in held.items():
                if pending is not None and pending.in_capture == captured:
                    if pending.event is not None:
                        stream.wait_event(pending.event)
                    held[key] = None
