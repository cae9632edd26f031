"""The entry refills begun by the model's call hook, outside the compiled graph (a mixin of
:class:`~.state.OffloadState`).

Where the circular prefetch starts at a call's entry (:mod:`fx_offload.schedule`), each
slot's first layer ``l_s`` comes back into the slot when the next call begins.  Begun from
the call hook rather than from the graph, the copy overlaps host work the graph cannot hide:
Dynamo's guards, the compiled region's prelude and, under CUDA graphs, the replay's launch::

    call k+1  call hook: copy l_s ... guards, prelude ... [graph: wait(l_s) ... reads l_s ...]

Under CUDA graphs the copies run outside the replayed graph, on events made with
``external=True``: the capture waits for them through event-wait nodes, so every replay
waits for the copy the hook began before it (``Pending.by_hook``).  A replay runs none of
our Python, so the runtime cannot tell what it left in the slots: under CUDA graphs the
hook settles and forgets what it last knew of the slot and copies each time, even where the
slot is known to hold the layer (a call that stopped early, or a replay, which left later
layers there without our knowing).  A capture that found no hook copy would take the slot's
contents at capture time as given, and its replays would not wait for the hook's later
copies.
"""
from __future__ import annotations

import torch

from . import slot_check
from .contents import capturing


class HookCopies:
    """Entry refills begun by the call hook."""

    def _init_hook_copies(self, choice) -> None:
        self._hook_refills = self.schedule.entry_refills() if choice.hook_starts_entry else []
        self._hook_events: dict[tuple[int, int], tuple] = {}
        # calls may be CUDA-graph replays: offloaded with reduce-overhead (also a copy
        # offloaded again at its first call, which runs the graph compiled for the original),
        # or set by the compiler when a model placed first gets a reduce-overhead graph
        self.under_cuda_graphs = choice.under_cuda_graphs
        self.check_slots = slot_check.enabled()     # read once per call (ops.wait_prefetch)

    def _make_hook_events(self) -> None:
        """Each hook-begun chunk's (fork, done) events, made once; ``done`` is external."""
        self._hook_events = {(refill, c.index): (torch.cuda.Event(),
                                                 torch.cuda.Event(external=True))
                             for _, refill in self._hook_refills
                             for c in self.choice.layout[refill]}

    def begin_entry_refills(self, tokens: int | None = None) -> None:
        """A call begins (its hook): choose where this call's circular prefetch starts
        (``"either"``), and begin the entry refills now, so the copy stream works while
        Dynamo's guards run; the graph's own start finds them begun.  Not inside a capture
        that takes in the whole call (a user's ``torch.cuda.graph``): there the graph's own
        start copies, as its replays run only what it recorded."""
        self.buffers.begin_count()     # a new call: report's copied_bytes_last_call
        self.check_slots = slot_check.enabled()
        # a capture that raised: its copies never ran, and no wait on their events may be
        # recorded, outside a capture or inside the next (a user's retried capture)
        self.contents.forget_captured()
        if capturing():         # copies an earlier call's hook began are not this call's
            self._forget_hook_copies()
            return
        self.routed.begin_call(tokens)      # many tokens: routed chunks prefetched whole
        self.circular.call_begins()
        for leaving, refill in self._hook_refills:
            self._hook_refill(leaving, refill)

    def after_take_up(self, root: bool) -> None:
        """The call's look at what the user changed has run (``root``: a call of the model,
        not of a layer on its own).  Under CUDA graphs, a hook copy it replaced with a
        synchronous reload (the layer's weights changed) is begun again, so that a capture
        in this call still finds one to wait for: every later replay's hook copies outside
        the graph.  The expert cache may choose anew which experts it keeps; the other
        chunks of routed layers begin to run ahead (:mod:`.ahead`)."""
        if self.ahead is not None:
            self.ahead.begin_call(fill=root and not capturing(), changed=self._changed_since)
        if root and not capturing():
            self.routed.between_calls(self._versions)
        if not (root and self.under_cuda_graphs) or self.copy_stream is None or capturing():
            return
        for leaving, refill in self._hook_refills:
            if refill in self.buffers.compressed:
                continue        # the hook copies none of it (the graph's own start does)
            # a routed chunk the hook left to its wait (few experts picked) is not missing:
            # counting it would copy the rest of the layer again at every call
            if not all(self.contents.by_hook(refill, c) for c in self.contents.chunks(refill)
                       if not self.routed.gathers(refill, c)):
                self._hook_refill(leaving, refill)

    def _hook_refill(self, leaving: int, refill: int) -> None:
        if self.under_cuda_graphs and self.copy_stream is not None:
            chunks = self.contents.chunks(refill)       # copied whatever the slot holds
            self.contents.settle_over(refill, chunks, self._wait_for)
            for c in chunks:
                self.contents.forget(refill, c)
            if refill in self.buffers.compressed:
                # left to the graph: a replay's own compressed copies reuse the staging
                # buffers without waiting for decodes begun outside it
                return
        self.start(leaving, refill, by_hook=True)

    def _forget_hook_copies(self) -> None:
        for _, refill in self._hook_refills:
            for c in self.contents.chunks(refill):
                if self.contents.by_hook(refill, c):
                    self.contents.forget(refill, c)
