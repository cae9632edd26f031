"""The entry refills begun by the model's call hook, outside the compiled graph (the state's
``hook_copies``, built from the choice and the state's slot contents; what it copies with is
passed to each method).  Begun from the hook, the copy of each slot's first layer ``l_s``
overlaps host work the graph cannot hide: Dynamo's guards, the compiled region's prelude
and, under CUDA graphs, the replay's launch::

    call k+1  call hook: copy l_s ... guards, prelude ... [graph: wait(l_s) ... reads l_s]

Under CUDA graphs the hook settles and forgets what it last knew of the slot and copies
each time, even where the slot is known to hold the layer (a call that stopped early, or a
replay, which left later layers there without our knowing).  A capture that found no hook
copy would take the slot's contents at capture time as given, and its replays would not
wait for the hook's later copies (``Pending.by_hook``).

The external events every replay waits for, the layers left to the graph, a capture of the
whole call and one that raised: docs/design.md, "What CUDA-graph capture needs", and "Slot
rotation" (the bullet "at the entry").
"""
from __future__ import annotations

import torch

from ..memory.streams import capturing


class HookCopies:
    """Entry refills begun by the call hook."""

    def __init__(self, choice, layout, contents):
        self.contents, self.layout = contents, layout
        self.refills = choice.schedule.entry_refills() if choice.hook_starts_entry else []
        self.events: dict[tuple[int, int], tuple] = {}
        # calls may be CUDA-graph replays: offloaded with reduce-overhead (also a copy
        # offloaded again at its first call, which runs the graph compiled for the original),
        # or set by the compiler when a model placed first gets a reduce-overhead graph
        self.under_cuda_graphs = choice.under_cuda_graphs

    def make_events(self) -> None:
        """Each hook-begun chunk's (fork, done) events, made once; ``done`` is external."""
        self.events = {(refill, c.index): (torch.cuda.Event(), torch.cuda.Event(external=True))
                       for _, refill in self.refills for c in self.layout[refill]}

    def begin_call(self, buffers, routed, circular, refill, tokens: int | None) -> None:
        """A call begins (its hook): choose where this call's circular prefetch starts
        (``"either"``), and begin the entry refills now (``refill(leaving, refilled)``), so
        the copy stream works while Dynamo's guards run; the graph's own start finds them
        begun.  Not inside a capture that takes in the whole call (a user's
        ``torch.cuda.graph``): there the graph's own start copies, as its replays run only
        what it recorded."""
        if routed.host is not None:     # before anything is enqueued in a capture
            routed.host.refuse_capture()
        buffers.begin_count()     # a new call: report's copied_bytes_last_call
        # a capture that raised: its copies never ran, and no wait on their events may be
        # recorded, outside a capture or inside the next (a user's retried capture)
        self.contents.forget_captured()
        if capturing():         # copies an earlier call's hook began are not this call's
            self._forget()
            if routed.host is not None:     # (what its capture records depends on it)
                routed.host.call_tokens(tokens)
            return
        routed.begin_call(tokens)      # many tokens: routed chunks prefetched whole
        circular.call_begins()
        for leaving, refilled in self.refills:
            refill(leaving, refilled)

    def missing(self, refill: int, compressed, routed) -> bool:
        """Under CUDA graphs, after the call's look at what the user changed: the entry
        refill of ``refill`` was replaced with a synchronous reload (the layer's weights
        changed), and is to be begun again, so that a capture in this call still finds a
        hook copy to wait for: every later replay's hook copies outside the graph."""
        if refill in compressed:
            return False        # the hook copies none of it (the graph's own start does)
        # a routed chunk the hook left to its wait (few experts picked) is not missing:
        # counting it would copy the rest of the layer again at every call
        return not all(self.contents.by_hook(refill, c) for c in self.contents.chunks(refill)
                       if not routed.gathers(refill, c))

    def settle(self, refill: int, compressed, wait_for) -> bool:
        """Before the hook copies ``refill`` under CUDA graphs: settle and forget what the
        slot was known to hold (``wait_for``: a pending copy's wait); False where the copy
        is left to the graph (a compressed layer: a replay's own compressed copies reuse
        the staging buffers without waiting for decodes begun outside it)."""
        chunks = self.contents.chunks(refill)       # copied whatever the slot holds
        self.contents.settle_over(refill, chunks, wait_for)
        for c in chunks:
            self.contents.forget(refill, c)
        return refill not in compressed

    def _forget(self) -> None:
        for _, refill in self.refills:
            for c in self.contents.chunks(refill):
                if self.contents.by_hook(refill, c):
                    self.contents.forget(refill, c)
