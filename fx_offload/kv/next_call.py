"""The next call's first fills, begun as a call ends: :class:`NextCall` for eager calls,
:class:`BeforeReplay` for the call hooks around the replays of ``mode="reduce-overhead"``.

The update of each slot's last layer in a call begins the fill of the slot's first layer
for the next call, queued on the copy stream behind the fills still to come, so the link
runs on from the call's last fill into the next call's first::

    compute stream            copy stream                 write-back stream
    update C (slot 0's last)  fill D -> slot 1            C's tokens -> host
                              wait C's update and write-back, A's write-back
                              fill A -> slot 0 (len(A) + the call's tokens, in blocks)
    update D (slot 1's last)  fill B -> slot 1 (likewise)
    join: wait write-backs    keeps A's and B's fills if every host layer was updated
    (the caller, between calls: the link works)
    begin: A, B found filled  (no copy)

A slot that holds one layer only holds that layer's next prefix already (the update wrote
the step's tokens into it): nothing is copied.  Where a slot's last layer began no fill (a
graph that does not update it), the join begins it, after the call's reads and write-backs.
A call that raises leaves its begun fills unkept: the next call fills again, after waiting
for them.  Not inside a graph: a replay's captured fill would not be ordered after a fill
begun outside it, nor would the replay of another graph see what the slot holds.

Under CUDA graphs each first layer's fill by the hook ends on an external event of its own,
so a replay's first layer waits for its own fill alone, and the next layer's refill is
queued behind the hook's fills while they still run.  Each fill also begins on an external
event: the one the update of its slot's last layer records in the graph, behind that
update's read of the slot and the call's write-backs so far, so the fill overlaps the
replay's last layers instead of waiting for its end::

    replay (compute / write-back)             copy stream (the hook's, after the launch)
    update C (slot 0's last) ... write-backs   wait free[0]
    record free[0]                             fill A -> slot 0   (while D is filled,
    update D (slot 1's last) ... write-backs   wait free[1]        attended, written back)
    record free[1]                             fill B -> slot 1
    join

A capture that recorded not every slot's event (a graph without a slot's last layer) would
leave its replays an older record: from then on the fills wait for whole replays.

The gap this closes, the check that a begun fill still holds (why the runtime's records of
the host tensors and the version counters are compared), and what the hooks do around a
replay: docs/host_kv_cache.md, the paragraph "The link's busy time per step", and "Under
CUDA graphs".
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ..runtime.memory.streams import capturing
from . import copies

log = logging.getLogger("fx_offload")


@dataclasses.dataclass(frozen=True)
class Filled:
    """What a begun-ahead fill put in a layer's slot."""
    keys: int           # the host tensors' addresses
    values: int
    versions: tuple[int, int]
    tokens: int         # the prefix covered (whole blocks)
    slot: int           # the slot buffer's address
    # the runtime's records of the host tensors (weak references, compared by identity): a
    # layer put back on the host (beam search's reorder_cache) may get the freed memory's
    # address again, with a fresh version counter that can match the old one
    owners: tuple = dataclasses.field(default=(), compare=False)


def _filled(runtime, keys, values, tokens: int, slot) -> Filled:
    owners = tuple(runtime.owners.get(t.data_ptr(), (None,) * 3)[2] for t in (keys, values))
    return Filled(keys.data_ptr(), values.data_ptr(), (keys._version, values._version),
                  tokens, slot.data_ptr(), owners)


class NextCall:
    """The begun-ahead fills of one host KV runtime."""

    def __init__(self, enabled: bool):
        self.enabled = enabled              # off for good once a capture is seen
        self.updated: dict[int, tuple] = {}     # since the last join: layer -> (keys,
        self.pending: dict[int, Filled] = {}    # values, tokens written); fills begun
        self.filled: dict[int, Filled] = {}     # this call, and kept by its join;
        self.taken: dict[int, Filled] = {}      # the latter, taken by this call's begin
        self.skipped = 0                    # fills found done at a begin (tests, logging)

    def begin_call(self) -> None:
        if capturing():
            self.enabled = False
            self.filled = {}
        self.taken, self.filled, self.pending = self.filled, {}, {}

    def note_update(self, layer: int, keys, values, tokens: int) -> None:
        self.updated[layer] = (keys, values, tokens)

    def note_attended(self, layer: int) -> None:
        """``layer``'s attention ran on the host: it took no slot, and none is filled for it
        (the next call of the same shape attends on the host too)."""
        self.updated[layer] = None

    def found(self, runtime, layer: int, keys, values) -> bool:
        """True when ``layer``'s slot already holds what this call's begin would fill."""
        got = self.taken.pop(layer, None)
        if got is None or capturing():
            return False
        known = runtime.call_lengths.get(layer)
        now = _filled(runtime, keys, values, got.tokens, runtime.views(layer, keys, values)[0])
        same_owners = all(a is b and a is not None and a() is not None
                          for a, b in zip(now.owners, got.owners))
        if known is None or known > got.tokens or now != got or not same_owners:
            log.debug("fx_offload: host KV layer %d: the fill begun ahead is stale; filled "
                      "again", layer)
            return False
        self.skipped += 1
        return True

    def last_in_slot(self, runtime, layer: int) -> None:
        """``layer`` was its slot's last this call (its update begins no fill): begin the fill
        of the slot's first layer for the next call now, queued behind the fills still to
        come on the copy stream, so the link does not wait for the end of the call.  Where
        the slot holds one layer only, it holds that layer's next-call prefix already."""
        first = runtime.layers[runtime.slot_of(layer)]
        got, known = self.updated.get(first), runtime.call_lengths.get(first)
        if not self.enabled or capturing() or got is None or known is None:
            return                                  # (None: attended on the host)
        keys, values, written = got
        tokens = known + written                    # what the slot holds, if it is first's
        stream = runtime.copy_stream
        if first != layer:
            tokens = copies.rounded(tokens, runtime.block, keys.shape[2])
            if stream is None:
                runtime.fill_now(first, keys, values, tokens)
            else:
                slot_read = torch.cuda.Event()
                slot_read.record()
                with torch.cuda.stream(stream):
                    stream.wait_event(slot_read)    # the layer's update has read the slot
                    for done in (layer, first):     # their tokens are back on the host
                        if done in runtime.written_now:
                            stream.wait_event(runtime.written[done])
                    if not runtime.fill_now(first, keys, values, tokens):
                        return
                    runtime.filled.setdefault(first, torch.cuda.Event()).record(stream)
        self.pending[first] = _filled(runtime, keys, values, tokens,
                                      runtime.views(first, keys, values)[0])

    def prefetch(self, runtime) -> None:
        """At a join: keep the fills begun for the next call where this call updated every
        host layer, and begin those of the slots whose last layer did not begin one."""
        updated, self.updated = self.updated, {}
        pending, self.pending = self.pending, {}
        self.filled = {}
        if not self.enabled or capturing() or any(l not in updated for l in runtime.layers):
            return
        firsts = runtime.layers[:min(runtime.num_slots, len(runtime.layers))]
        self.filled = {l: pending[l] for l in firsts if l in pending}
        todo = [l for l in firsts if l not in pending and updated[l] is not None]
        if not todo or any(runtime.call_lengths.get(l) is None for l in todo):
            return
        stream = runtime.copy_stream
        if stream is not None:
            joined = torch.cuda.Event()
            joined.record()
            stream.wait_event(joined)               # every read of the slots
            stream.wait_stream(runtime.write_stream)     # every write-back of the host
        for layer in todo:
            keys, values, written = updated[layer]
            tokens = copies.rounded(runtime.call_lengths[layer] + written, runtime.block,
                                    keys.shape[2])
            k_slot, v_slot, _ = runtime.views(layer, keys, values)
            if stream is None:
                runtime.fill_now(layer, keys, values, tokens)
            else:
                with torch.cuda.stream(stream):
                    runtime.fill_now(layer, keys, values, tokens)
                    runtime.filled.setdefault(layer, torch.cuda.Event()).record(stream)
            self.filled[layer] = _filled(runtime, keys, values, tokens, k_slot)


class BeforeReplay:
    """The next call's first fills begun by the call hooks, around the replays of
    ``mode="reduce-overhead"`` (whose graphs run none of the runtime's Python)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.begun: dict[int, Filled] = {}  # layer -> what the hook after a call filled
        self.events: dict[int, torch.cuda.Event] = {}   # layer -> the end of its fill
        self.lengths: dict[int, int] = {}   # read by the hook before the call
        self.tokens: int | None = None      # the call's new tokens
        self.taken = 0                      # fills found done before a call (tests, logging)
        # slot -> an external event a call records once its slot's last layer has read the
        # slot and its tokens are back on the host, so that the hook's fill for the next
        # call waits for that alone, not for the whole replay; trusted while every capture
        # seen recorded all of them between its begin and its join
        self.free: dict[int, torch.cuda.Event] = {}
        self.recorded: set[int] = set()     # slots recorded since the call began
        self.every_capture_records = True
        self.early = 0                      # hook fills that waited for their slot alone

    def use_device(self, runtime) -> None:
        """Made once, before any capture: the events that end the hook's fills are
        external, so that a captured begin fill waits for the latest of its layer's at
        each replay (the begin's own fill, skipped or not, writes the same slot), the
        replay's other work for none of them."""
        if self.enabled and not self.events:
            with torch.cuda.device(runtime.device):
                self.events = {layer: torch.cuda.Event(external=True)
                               for layer in runtime.layers[:runtime.num_slots]}
                self.free = {slot: torch.cuda.Event(external=True)
                             for slot in range(min(runtime.num_slots, len(runtime.layers)))}

    def begin_call(self) -> None:
        self.recorded = set()

    def slot_read(self, runtime, layer: int) -> None:
        """``layer`` was its slot's last this call, and its update has queued its last read
        of the slot (the copy it returns) and its write-back: record the slot's event on
        the write stream behind both (and behind every earlier write-back of the call)."""
        if not self.free or runtime.write_stream is None:
            return
        slot = runtime.slot_of(layer)
        read = torch.cuda.Event()
        read.record()
        runtime.write_stream.wait_event(read)
        self.free[slot].record(runtime.write_stream)
        self.recorded.add(slot)

    def joined(self) -> None:
        """A call's join: a capture that did not record every slot's event makes them
        untrusted for good (its replays would leave an older record to wait for)."""
        if capturing() and self.free and self.recorded != set(self.free):
            log.debug("fx_offload: a captured call recorded slots %s of %s; the hook's fills "
                      "wait for whole replays", sorted(self.recorded), sorted(self.free))
            self.every_capture_records = False

    def before_call(self, runtime, cache, tokens: int | None) -> None:
        """The hook before a call, its lengths read: flag the fills begun after the last
        call that still hold what this call's begin would fill."""
        if not self.enabled or runtime.done is None or capturing():
            return
        runtime.done.zero_()    # (a call that raised before its join left flags set)
        self.lengths, self.tokens = dict(runtime.lengths), tokens
        begun, self.begun = self.begun, {}
        if not begun:
            return
        if cache is None or cache not in runtime.caches:
            begun = {}      # (another cache this call: all stale)
        for layer, got in begun.items():
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            now = _filled(runtime, keys, values, got.tokens,
                          runtime.views(layer, keys, values)[0])
            known = self.lengths.get(layer)
            same_owners = all(a is b and a is not None and a() is not None
                              for a, b in zip(now.owners, got.owners))
            if known is None or known > got.tokens or now != got or not same_owners:
                log.debug("fx_offload: host KV layer %d: the fill begun after the last "
                          "call is stale; the replay fills it", layer)
                continue
            runtime.done_flag(layer).fill_(1)
            self.taken += 1

    def after_call(self, runtime, cache) -> None:
        """The hook after a call (its replay queued): begin the first slots' fills for the
        next call, behind the call's reads of the slots and its write-backs (each behind its
        slot's event, where the call recorded every slot's; else behind the whole call)."""
        lengths, tokens, self.lengths, self.tokens = self.lengths, self.tokens, {}, None
        if not self.enabled or tokens is None or capturing() or not runtime.layers or \
                cache not in runtime.caches:
            return
        firsts = runtime.layers[:min(runtime.num_slots, len(runtime.layers))]
        if any(lengths.get(layer) is None for layer in firsts):
            return
        # a layer whose attention a call of this size ran on the host reads no slot: the
        # next (a decode step after a decode step) does the same, and a fill would only
        # take the link and the host's memory from its job
        hosted = runtime.hosting.get(tokens, {})
        firsts = [layer for layer in firsts if hosted.get(layer) != "host"]
        stream = runtime.copy_stream
        # each fill waits for its slot's last read in the call and the call's write-backs
        # before it (the slot's event), where the call recorded them; else for the replay
        early = stream is not None and self.every_capture_records and bool(self.free) and \
            self.recorded == set(self.free) and "host" not in hosted.values()
        if stream is not None and not early:
            called = torch.cuda.Event()
            called.record()
            stream.wait_event(called)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer in firsts:
                if early:
                    stream.wait_event(self.free[runtime.slot_of(layer)])
                    self.early += 1
                keys, values = cache.layers[layer].keys, cache.layers[layer].values
                filled = copies.rounded(lengths[layer] + tokens, runtime.block, keys.shape[2])
                if not runtime.fill_now(layer, keys, values, filled):
                    return
                if stream is not None:
                    self.events[layer].record(stream)
                self.begun[layer] = _filled(runtime, keys, values, filled,
                                            runtime.views(layer, keys, values)[0])
