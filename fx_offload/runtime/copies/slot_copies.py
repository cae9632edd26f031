"""The copies into one model's slots that the graph's ops ask for: ``wait`` (the slot holds
the chunk, or it is loaded now), ``start`` (an asynchronous refill once the bytes it
overwrites were read), ``wait_routed`` (the picked rows of a routed chunk, :mod:`.routed`)
and ``join`` (the end of a captured forward).  :class:`SlotCopies` is the state's
``copies``, built from the choice and the state's slot contents, version counters, circular
start and call-hook copies; the slot buffers and routed experts are bound to it when the
state is materialized.  The state checks that it is not restored before it asks.

On CUDA the copies run on one copy stream per device.  ``start`` records an event on the
compute stream and makes the copy stream wait for it before overwriting the chunk's bytes, so
the copy cannot begin before the kernels that read what they held; ``wait`` makes the
compute stream wait on the copy's done event.  Both events of every chunk are made once, when
the slots are, and recorded again on every call.
"""
from __future__ import annotations

import logging
import threading

import torch

from ...schedule import Schedule
from ..experts.ahead import copy_chunk, join_copies
from ..memory.contents import Pending, landed
from ..memory.streams import current_stream
from ..memory.streams import capturing as _capturing

log = logging.getLogger("fx_offload")


class _InTrainingForward(threading.local):
    """Set while a forward that a backward will follow runs on this thread
    (``fx_offload.training.TrainingForward``): its circular prefetch is not begun.  Per
    thread, not per state: the graph may run in another model's call (``registry``)."""
    on = False


IN_TRAINING_FORWARD = _InTrainingForward()


class SlotCopies:
    """Waits, starts and loads of one model's slots."""

    def __init__(self, choice, layout, contents, versions, circular, hook_copies):
        self.layout, self.device = layout, choice.device
        self.layers = list(choice.schedule.layers)
        self.contents, self.versions = contents, versions
        self.circular, self.hook_copies = circular, hook_copies
        self.buffers = self.routed = self.copy_stream = None
        self.events: dict[tuple[int, int], tuple] = {}   # (layer, chunk) -> (fork, done)
        self.stats = {"prefetches": 0, "sync_loads": 0}
        # a backward runs (fx_offload.training): its refills go to earlier layers, the
        # reverse ring, and none of them is the circular prefetch
        self.backward = False

    @property
    def ahead(self):
        """The ring of :mod:`.ahead` of the slot buffers, or None."""
        return None if self.buffers is None else self.buffers.ahead

    def bind(self, buffers, routed) -> None:
        """The slot buffers and routed experts, made as the state is materialized; on CUDA
        the copy stream and every chunk's events, made once (none on the forward path)."""
        self.buffers, self.routed = buffers, routed
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            self.events = {(layer, c.index): (torch.cuda.Event(), torch.cuda.Event())
                           for layer in self.layers for c in self.layout[layer]}
            self.hook_copies.make_events()

    def wait(self, layer: int, chunk: int = -1) -> None:
        """Before ``layer`` reads ``chunk``'s weights (-1: all): make sure its slot holds them."""
        held = self.contents.slot(layer)
        for c in self.contents.chunks(layer, chunk):
            key = (layer, c.index)
            if key not in held:
                self.load_now(layer, c)
            elif held[key] is not None:
                self.wait_for(held[key])
                held[key] = landed(held[key].in_capture)

    def wait_routed(self, layer: int, chunk: int, ids: torch.Tensor, restored: bool) -> None:
        """Before ``layer`` reads the rows ``ids`` picks of its expert tensors in ``chunk``
        (:mod:`.routed`): the slot holds the chunk whole (waited for), or the picked rows
        (copied now); ``restored``: the state is, and the slots are not used."""
        c = self.contents.chunks(layer, chunk)[0]
        gathers = self.routed.observe(layer, c, ids)
        if restored:
            return None
        if self.contents.held_for(layer, c, _capturing()):
            return self.wait(layer, chunk)
        if not gathers:
            return self.load_now(layer, c)
        self.routed.gather_into(layer, c, ids, self.contents, self.wait_for)

    def start(self, layer: int, refill: int, chunk: int = -1, by_hook: bool = False) -> None:
        """``layer`` has read the last of what ``refill``'s ``chunk`` (-1: all of them)
        overwrites in their slot: copy it in asynchronously (``by_hook``: the call hook's
        entry refills, begun outside the graph)."""
        held, capturing = self.contents.slot(refill), _capturing()
        at_end = chunk >= 0 and not self.backward and Schedule.wraps(layer, refill)
        # (an entry start's chunk: -1)
        if at_end and IN_TRAINING_FORWARD.on:
            return          # the backward reads the slot's layer first (training.py)
        if at_end and not self.circular.copies_at_end(capturing):
            return          # left to the next call's entry start (fx_offload.schedule)
        for c in self.contents.chunks(refill, chunk):
            # not overwritten since (a capture copies: its replays cannot know), or begun
            # by this call's hook, for which a capture waits (an external event)
            if (refill, c.index) in held and (not capturing or self.contents.by_hook(refill, c)):
                continue
            if self.routed.skips(refill, c, self.contents):
                continue    # a routed chunk: its wait_routed copies what the router picks
            if c.index == 0:
                self.stats["prefetches"] += 1       # refills begun, whole or in chunks
            self.versions.note_copy(refill, c.index)
            self.contents.forget(refill, c)     # until recorded: cut short, it names nothing
            if self.copy_stream is None:
                self.buffers.copy_in(refill, c)
                self.contents.fill(refill, c, None)
                continue
            fork, done = (self.hook_copies.events if by_hook else self.events)[(refill, c.index)]
            fork.record(self._compute_stream())     # made once, recorded again
            copy_chunk(self.ahead, self.buffers, refill, c, self.copy_stream, fork, done,
                       capturing)       # from the ring or the host
            self.contents.fill(refill, c, Pending(done, capturing, by_hook))
            if at_end:
                self.circular.began_at_end(done)

    def hook_refill(self, leaving: int, refill: int) -> None:
        """The call hook's entry refill of ``refill`` (:mod:`.hook_copies`)."""
        if self.hook_copies.under_cuda_graphs and self.copy_stream is not None and \
                not self.hook_copies.settle(refill, self.buffers.compressed, self.wait_for):
            return
        self.start(leaving, refill, by_hook=True)

    def join(self) -> None:
        """End of a forward: inside a CUDA-graph capture, join every copy forked during it.
        Also in an eager call of a model compiled for CUDA graphs (a warm-up, a shape not
        captured yet): a replay that comes next reads each slot's first layer as its capture
        found it, without a wait for this call's copy of it (the circular prefetch at the
        end), so the call ends as a replay does, its copies landed.  Elsewhere they run on."""
        if self.copy_stream is None:
            return
        if (capturing := _capturing()) or self.hook_copies.under_cuda_graphs:
            join_copies(self.ahead, self.contents, self._compute_stream(),
                        capturing)

    def wait_for(self, pending: Pending) -> None:
        # A copy recorded before a capture began was completed by the synchronization that
        # starts every capture (a wait on it inside is refused); no event: it landed there.
        if pending.event is not None and (pending.in_capture or pending.by_hook or
                                          not _capturing()):
            self._compute_stream().wait_event(pending.event)

    def _compute_stream(self) -> torch.cuda.Stream:
        """The current stream of the slots' device (where the copy stream is: every caller
        has a copy's event, so the device is CUDA)."""
        return current_stream(self.copy_stream.device_index)

    def load_now(self, layer: int, chunk=None) -> None:
        """Stream-ordered load of ``layer``'s ``chunk`` (None: all) into its slot."""
        chunks = self.contents.chunks(layer) if chunk is None else (chunk,)
        self.contents.settle_over(layer, chunks, self.wait_for)
        for c in chunks:
            self.contents.forget(layer, c)          # (as in start)
            self.buffers.copy_in(layer, c, non_blocking=self.copy_stream is not None)
            self.contents.fill(layer, c, landed(_capturing()))
            self.versions.note_copy(layer, c.index)
        self.stats["sync_loads"] += 1
        log.debug("fx_offload: loaded layer %d (chunk %s) synchronously", layer, chunk)
