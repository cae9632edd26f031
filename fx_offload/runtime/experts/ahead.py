"""The other chunks of routed MoE layers, fetched ahead into a small ring of device buffers.

:class:`AheadCopies` holds one model's ring: ``depth + 1`` buffers (``R``), each as large as
one layer's other chunks (attention, norms, router), filled ``depth`` layers ahead of their
copy into the slot.  :func:`copy_chunk` takes a start's bytes from the ring where a usable
fill holds them, else from the host as before::

    S = the other chunks of routed layers refilled within a call, in the order they are read
    call ends, or begins (hook, after the look at the user's changes): fill(0 .. depth-1)
    start of S[i] (same place in the graph as before: behind a layer's gather):
        slot[chunk] <- ring[i % R]                  copy stream, after the fork and fill(i)
        fill(i + depth) into ring[(i - 1) % R]      ahead stream, after the fork and after
                                                    S[i-1]'s copy read that buffer
    fill(j):  ring[j % R] <- host block[chunk S[j]]            crosses the link

A fill is usable only in the call that began it, and inside a CUDA-graph capture only if it
was recorded there or begun by the call hook (on an external event, which every replay
waits for: the hook fills before every call, so each replay reads a fill of its own call).
A fill begun as the last call ended is kept only where its layer's weights did not change
since (the call's look at the user's changes), so each fill used holds the weights the call
must see.

Why the ring and not a second slot, why one buffer more than ``depth``, the depth itself,
and why a capture of the whole call begins no fills: docs/routed_experts.md, "The other
chunks, fetched ahead".
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ...copy_rules import depth_wanted
from ..memory.streams import capturing

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class Fill:
    index: int              # into the sequence
    call: int               # the call that began it
    done: torch.cuda.Event
    in_capture: bool
    by_hook: bool
    versions: tuple | None = None   # of its layer, where begun between calls (end_call)


class AheadCopies:
    """The ring of one offloaded model; ``make`` returns None where it has nothing to do."""

    @classmethod
    def make(cls, choice, buffers) -> "AheadCopies | None":
        if choice.device.type != "cuda" or not buffers.packed or buffers.compress \
                or not choice.experts:
            return None
        sequence = _sequence(choice, buffers)
        layers = len({layer for layer, _ in sequence})
        depth = depth_wanted(layers)
        if depth <= 0 or layers <= 1:
            return None
        # capped by the layers, as memory_budget counts it (selection.budget._ahead_bytes)
        return cls(choice, buffers, sequence, min(depth, layers - 1))

    def __init__(self, choice, buffers, sequence, depth: int):
        self.buffers, self.sequence, self.depth = buffers, sequence, depth
        self.device = choice.device
        self.position = {(layer, c.index): i for i, (layer, c) in enumerate(sequence)}
        size = max(c.end - c.start for _, c in sequence)
        count = depth + 1
        self.ring = [torch.empty(size, dtype=torch.uint8, device=self.device)
                     for _ in range(count)]
        self.stream = torch.cuda.Stream(self.device)
        # made once (none on the forward path); the hook's fills are external, so that a
        # capture waits for them through event-wait nodes
        self._done = [torch.cuda.Event() for _ in range(count)]
        self._hook_done = [torch.cuda.Event(external=True) for _ in range(count)]
        self._freed = [torch.cuda.Event() for _ in range(count)]
        # where each buffer's latest copy into a slot was recorded: "outside" any capture,
        # "inside" the capture under way (forgotten as it ends), or None; a fill waits for
        # it only from the same side (a capture cannot wait for an event recorded outside
        # it, and a graph ends only after its copies)
        self._freed_where: list[str | None] = [None] * count
        self._fork = torch.cuda.Event()
        self.held: list[Fill | None] = [None] * count
        self._whole_call_captured = False     # the call under way began inside a capture
        self.call = 0
        self._between = 0           # bytes the fills begun as the last call ended copied
        log.debug("fx_offload: %d buffers of %d bytes fetch the other chunks of %d routed "
                  "layers %d ahead", count, size, len({layer for layer, _ in sequence}), depth)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.ring)

    def end_call(self, versions) -> None:
        """A call of the model has ended (outside any capture): begin the next call's first
        ``depth`` fills now, after its work, so they cross while the host prepares the next
        call (``versions(layer)``: the layer's version counters, recorded to tell at the
        next call whether its weights changed since)."""
        self._fork.record(torch.cuda.current_stream(self.device))
        self._between = 0
        for i in range(self.depth):
            self._fill(i, by_hook=True, call=self.call + 1)
            if (fill := self.held[i]) is not None:
                fill.versions = versions(self.sequence[i][0])
                self._between += self.sequence[i][1].end - self.sequence[i][1].start

    def begin_call(self, fill: bool, changed=None) -> None:
        """A call begins (after its look at what the user changed): fills of earlier calls
        are not used, but for those begun as the last call ended where ``changed(layer,
        versions)`` says the layer's weights did not change since; ``fill`` (a call of the
        model, outside any capture): begin the first ``depth`` fills not held so, after
        everything already queued on the current stream.  The bytes begun between the calls
        count as this call's.

        A capture that raised left its buffers marked as read inside it: no later capture
        may wait for those events, so the marks go.  Outside a capture the current stream
        waits for every copy out of the ring begun outside one (a call that raised may
        have left one running): a graph replayed next, whose fills wait for nothing
        outside it, then cannot overwrite a buffer still being read."""
        self._forget_frees_in_capture()
        self._whole_call_captured = capturing()
        if not self._whole_call_captured:
            current = torch.cuda.current_stream(self.device)
            for b, where in enumerate(self._freed_where):
                if where == "outside":
                    current.wait_event(self._freed[b])
        self.call += 1
        ready = [f if fill and f is not None and f.call == self.call and f.by_hook
                 and changed is not None
                 and not changed(self.sequence[f.index][0], f.versions) else None
                 for f in self.held]
        self.held = ready
        if self._between:
            self.buffers.count_copied(self._between)
            self._between = 0
        if not fill:
            return
        if any(f is None for f in ready):
            self._fork.record(torch.cuda.current_stream(self.device))
        for i in range(self.depth):
            if ready[i] is None:
                self._fill(i, by_hook=True)

    def serves(self, layer: int, chunk) -> int | None:
        """The position of ``layer``'s ``chunk`` in the sequence (None: not fetched ahead)."""
        return self.position.get((layer, chunk.index))

    def copy_into_slot(self, i: int, copy_stream, fork, done) -> bool:
        """At the start of ``sequence[i]``: copy it from the ring into its slot on
        ``copy_stream`` after ``fork`` and its fill, recording ``done``; False (nothing
        done) where no usable fill holds it."""
        b = i % len(self.ring)
        fill, inside = self.held[b], capturing()
        if fill is None or fill.index != i or fill.call != self.call or \
                not (fill.by_hook or fill.in_capture == inside):
            return False
        layer, chunk = self.sequence[i]
        flat = self.buffers.flat[self.buffers.schedule.slot_of[layer]]
        copy_stream.wait_event(fork)
        copy_stream.wait_event(fill.done)
        with torch.cuda.stream(copy_stream):
            n = chunk.end - chunk.start
            flat[chunk.start:chunk.end].copy_(self.ring[b][:n], non_blocking=True)
            done.record(copy_stream)
            self._freed[b].record(copy_stream)
        self._freed_where[b] = "inside" if inside else "outside"
        self.held[b] = None
        return True

    def consumed(self, i: int) -> None:
        """``sequence[i]``'s start has run: the buffer the start before it emptied takes the
        fill ``depth`` places on.  Not in a capture that took in the whole call (a user's
        ``torch.cuda.graph`` around it): its replays run none of the hooks, so its fills
        would race with the fills an eager call between two replays begins as it ends, and
        overwrite those that the next eager call takes as its own; there every start copies
        from the host."""
        if self._whole_call_captured and capturing():
            return
        j = i + self.depth
        if j < len(self.sequence):
            self._fill(j, by_hook=False)

    def _fill(self, j: int, by_hook: bool, call: int | None = None) -> None:
        """Begin ``fill(j)`` on the ahead stream, after the latest copy from its buffer
        where one may still read it: ``by_hook``, after the current stream's work as the
        hook recorded it; else after the current stream's work now (inside a capture this
        is what pulls the ahead stream into it)."""
        b = j % len(self.ring)
        layer, chunk = self.sequence[j]
        block = self.buffers.block_of(layer)
        if block is None or not self.buffers.pinned:    # a pageable copy would block the host
            self.held[b] = None
            return
        inside, stream = capturing(), self.stream
        if self._freed_where[b] == ("inside" if inside else "outside"):
            stream.wait_event(self._freed[b])       # a copy from the buffer may still read it
        if by_hook:
            stream.wait_event(self._fork)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        done = (self._hook_done if by_hook else self._done)[b]
        n = chunk.end - chunk.start
        with torch.cuda.stream(stream):
            self.ring[b][:n].copy_(block[chunk.start:chunk.end], non_blocking=True)
            done.record(stream)
        if call is None:        # begun between calls: counted as the next call begins
            self.buffers.count_copied(n)
        self.held[b] = Fill(j, self.call if call is None else call, done, inside, by_hook)

    def join(self, stream) -> None:
        """End of a graph inside a capture: ``stream`` waits for the fills recorded in it
        (a capture must join every stream it forked); they are not used after it (a later
        graph is captured on its own, and cannot wait for this one's events)."""
        for b, fill in enumerate(self.held):
            if fill is not None and fill.in_capture:
                stream.wait_event(fill.done)
                self.held[b] = None
        self._forget_frees_in_capture()

    def _forget_frees_in_capture(self) -> None:
        """The copies out of the ring recorded in a capture are not waited for after it
        (its graph ends after them; an aborted one never runs them)."""
        self._freed_where = [None if w == "inside" else w for w in self._freed_where]

    def synchronize(self) -> None:
        self.stream.synchronize()

    def release(self) -> None:
        """Free the ring (after its fills in flight); nothing is fetched ahead after."""
        self.synchronize()
        self.ring, self.held, self.depth = [], [], 0


def copy_chunk(ahead: AheadCopies | None, buffers, refill: int, chunk, copy_stream, fork,
               done, capturing: bool) -> None:
    """Begin the copy of ``refill``'s ``chunk`` into its slot: from the ring ``ahead`` where
    a usable fill holds it, else from the host (``buffers``); the ring then takes its next
    fill."""
    i = None if ahead is None else ahead.serves(refill, chunk)
    hit = i is not None and ahead.copy_into_slot(i, copy_stream, fork, done)
    if not hit:
        buffers.begin_copy(refill, chunk, copy_stream, fork, done, capturing)
    if i is not None:
        ahead.consumed(i)


def join_copies(ahead: AheadCopies | None, contents, stream, capturing: bool) -> None:
    """``stream`` waits for the copies begun in the capture under way (``capturing``), else
    for those begun outside any (``contents``); and, in a capture, for the ring's fills
    recorded in it."""
    contents.join(stream, captured=capturing)
    if capturing and ahead is not None:
        ahead.join(stream)


def _sequence(choice, buffers) -> list:
    """``(layer, chunk)`` of the chunks of layers with expert tensors that hold none of
    them, for layers refilled within a call (not a slot's first layer), in call order;
    compressed layers' chunks are decoded through their own staging and are left out."""
    schedule = choice.schedule
    refilled = {r for layer, r in schedule.refill_of.items()
                if r is not None and not schedule.wraps(layer, r)}
    found = []
    for layer in schedule.layers:
        experts = choice.experts.get(layer)
        if not experts or layer not in refilled or layer in buffers.compressed:
            continue
        found += [(layer, c) for c in buffers.layout[layer]
                  if not any(s in experts for s in c.suffixes)]
    return found
