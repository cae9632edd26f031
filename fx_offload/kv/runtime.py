"""The runtime of a host KV cache: slots, streams, and what one step does per layer.

The truth of a host layer's cache is its page-locked host tensors (the cache's own
``keys``/``values``, :mod:`.cache`).  Each host layer is given one of ``kv_slots`` device
slots, in turn; a slot holds one layer's keys and values at the cache's full shape.  One
step, for host layers ``A, B, C`` and two slots::

    compute stream            copy stream                 write-back stream
    begin: pos[A] = len(A)    fill A -> slot 0 (valid blocks)
           pos[B] = len(B)    fill B -> slot 1
    ...                                                   (layers before A)
    update A: wait fill A
      slot 0[idx] = k, v      (the step's tokens)
      idx0[:n] = idx          ------------------------->  slot 0[idx0] -> host A
      out = clone(slot 0)     (what attention reads)
      pos[C] = len(C)         wait A's write-back, then
                              fill C -> slot 0
    update B ...              ...
    update C: as A; C is slot 0's last layer, so it also begins the next call's fill of
              A into slot 0 (:mod:`.next_call`; B, alone in slot 1, stays current there)
    join: wait the write-back stream; begin the next call's fills no update began

so the slot is overwritten only after its layer's clone and write-back read it, and a host
block is read (by a later step's fill) only after the write-back that wrote it: the join
ends every call with the write-back stream waited for.  The update returns a fresh copy of
the slot rather than the slot itself: the compilers own what an op returns, and a slot
handed to them could be reused as scratch memory or read after its refill.  The copy costs
device memory bandwidth (twice the layer's cache, a fraction of a millisecond) on a step
the link's copies bound.  Positions beyond the valid tokens hold stale (finite) values
that the attention mask excludes: slots start zeroed and only ever receive cache values.
"""
from __future__ import annotations

import logging
import weakref

import torch

from . import copies
from .host_attention import HostAttention
from .next_call import BeforeReplay, NextCall
from .kv_slots import KVSlots

log = logging.getLogger("fx_offload")


class HostKV:
    """The host KV cache runtime of one model (``kv_cache="host"``)."""

    def __init__(self, model, handle: int, options):
        self.handle = handle
        self.model_name = type(model).__name__
        self.block = options.kv_block_size
        self.num_slots = options.kv_slots
        self.wanted = options.kv_layers          # None: every layer of the cache
        self.mode = options.kv_cache             # "host", or "auto"/"device" under a budget
        self.budget = options.memory_budget
        self.plan = None                         # .host_layers.KVPlan, made at the first cache
        self.layers: list[int] = []              # host layers, set by the first cache
        # data_ptr -> (layer, "keys"|"values"|"pos", weak reference to the tensor)
        self.owners: dict[int, tuple] = {}
        self.caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.slots: KVSlots | None = None        # made once the host layers are known
        self.pos: dict[int, torch.Tensor] = {}
        self.device: torch.device | None = None
        self.copy_stream = self.write_stream = None
        self.filled, self.written = {}, {}      # layer -> event: its fill, its write-back
        self.begun: set[int] = set()             # this call: fills begun
        self.written_now: set[int] = set()       # this call: write-backs begun
        self.fill = copies.fill                  # the two copies (a test may wrap them)
        self.write_back = copies.write_back
        self.fill_known = copies.fill_known
        self.hook = None                         # the model's call hooks (fx_offload.kv):
        self.after_hook = None                   # before and after each call
        self.figures: dict = {}                  # what report shows (note_call)
        self.pinned: dict[int, object] = {}      # address -> weakref of the host tensor
        self.lengths: dict[int, int] = {}        # from the hook: each layer's valid length
        self.call_lengths: dict[int, int] = {}   # the same, taken by this call's begin
        self.held: list = []                     # (event, host tensors) of write-backs
        self._written_hosts: list = []           # this call's written host tensors
        # the next call's first fills, begun as this one ends (not under CUDA graphs)
        self.next_call = NextCall(enabled=options.mode != "reduce-overhead")
        # under CUDA graphs: begun by the call hooks instead, and skipped by the replay's
        # fill kernels through one device flag per host layer (the last one always 0)
        self.before_replay = BeforeReplay(enabled=options.mode == "reduce-overhead")
        self.done: torch.Tensor | None = None
        self.ended = True                        # the last call reached its join
        # layers whose attention runs on the host (under CUDA graphs: recorded as host nodes)
        self.attention = HostAttention(graphs=options.mode == "reduce-overhead")
        # per graph, keyed by the tokens a call writes: layer -> "host" or "streamed: why"
        self.hosting: dict = {}

    def owner_of(self, t: torch.Tensor):
        """(layer, what) of a live host cache tensor of this runtime, else None (memory of
        a cache that is gone may hold another tensor now)."""
        entry = self.owners.get(t.data_ptr())
        if entry is None:
            return None
        live = entry[2]()
        if live is None or live.shape != t.shape or live.dtype != t.dtype:
            return None
        return entry[:2]

    # ------------------------------------------------------------------ layout
    def forget_dead(self) -> None:
        """Drop the owner entries of caches that are gone."""
        self.owners = {p: e for p, e in self.owners.items() if e[2]() is not None}
        self.pinned = {p: r for p, r in self.pinned.items() if r() is not None}

    def slot_of(self, layer: int) -> int:
        return self.layers.index(layer) % self.num_slots

    def use_device(self, device: torch.device) -> None:
        if self.device is not None:
            return
        self.device = device
        if device.type == "cuda":   # (a high priority made the kernel fill no faster:
            self.copy_stream = torch.cuda.Stream(device)    # docs/notes/, host KV cache)
            self.write_stream = torch.cuda.Stream(device)
            self.before_replay.use_device(self)

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The slots, index and length buffers for caches shaped like ``keys``/``values``,
        made from the call hook, outside any compiled call: memory allocated inside a
        CUDA-graph capture (or its warm-up) belongs to the graph's pool, which must hold
        only the graph's own tensors."""
        self.views(self.layers[0], keys, values)
        for layer in self.layers:
            if layer not in self.pos:
                self.pos[layer] = torch.zeros(1, dtype=torch.int64, device=keys.device)
        if self.done is None or self.done.numel() != len(self.layers) + 1 or \
                self.done.device != keys.device:
            self.done = torch.zeros(len(self.layers) + 1, dtype=torch.int32,
                                    device=keys.device)

    def done_flag(self, layer: int | None) -> torch.Tensor:
        """The device flag that tells ``layer``'s fill at a call's begin that its slot was
        filled ahead (:class:`.next_call.BeforeReplay`); for ``None``, a flag never set."""
        i = len(self.layers) if layer is None else self.layers.index(layer)
        return self.done[i:i + 1]

    def views(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """The slot of ``layer`` for caches shaped like ``keys``/``values``: its keys, values
        and positions buffers (:mod:`.kv_slots`)."""
        if self.slots is None:
            self.slots = KVSlots(self.model_name, min(self.num_slots, len(self.layers)))
        return self.slots.views(self.slot_of(layer), keys, values)

    def slot_bytes(self) -> int:
        return self.slots.nbytes() if self.slots is not None else 0

    # ------------------------------------------------------------------ a step
    def begin_call(self) -> None:
        """A new call: nothing begun yet.  Outside a capture, whatever a call that ended early
        (an exception) left in flight is waited for first."""
        self.begun.clear()
        self.written_now.clear()
        # the lengths the call hook read serve this call only (a call that skipped the hook,
        # model.forward called directly, reads them on the device)
        self.call_lengths, self.lengths = self.lengths, {}
        self.next_call.begin_call()
        self.before_replay.begin_call()
        self.attention.begin_call()
        ended, self.ended = self.ended, False
        if self.write_stream is not None and not torch.cuda.is_current_stream_capturing():
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.write_stream)
            if not ended:       # (after a join, the copy stream holds the fills begun ahead)
                current.wait_stream(self.copy_stream)
            # host tensors kept until their write-backs land (a cache dropped after a call
            # would return its page-locked memory while the device still writes it)
            self.held = [(done, kept) for done, kept in self.held if not done.query()]

    def start(self, layer: int, keys, values, pos, previous: int | None = None) -> None:
        """Begin copying ``layer``'s valid blocks into its slot (``pos``: the tokens its
        cache holds, a device tensor).  ``previous``: the layer leaving the slot, whose
        write-back reads it."""
        self.begun.add(layer)
        if previous is None and self.next_call.found(self, layer, keys, values):
            return                  # filled as the last call ended (.next_call)
        k_slot, v_slot, _ = self.views(layer, keys, values)
        mark = self.pos[layer]
        mark.copy_(pos.reshape(-1)[:1])          # in stream order: before this step's write
        # only a begin's fill can have been done ahead, by the call hook
        done = self.done_flag(layer if previous is None else None)
        if self.copy_stream is None:
            self.fill(keys, k_slot, mark, self.block, done)
            self.fill(values, v_slot, mark, self.block, done)
            return
        ready = torch.cuda.Event()
        ready.record()
        known = None if torch.cuda.is_current_stream_capturing() else \
            self.call_lengths.get(layer)
        known = None if known is None else copies.rounded(known, self.block, keys.shape[2])
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            if previous is None and layer in self.before_replay.events:
                # the hook's fill of this layer after the last call, into the slot this
                # fill writes; a replay waits for its latest (an external event)
                self.copy_stream.wait_event(self.before_replay.events[layer])
            if previous in self.written_now:
                self.copy_stream.wait_event(self.written[previous])
            if known is None or not self.fill_now(layer, keys, values, known):
                self.fill(keys, k_slot, mark, self.block, done)   # the length on the device
                self.fill(values, v_slot, mark, self.block, done)
            self.filled.setdefault(layer, torch.cuda.Event()).record(self.copy_stream)

    def fill_now(self, layer: int, keys, values, tokens: int) -> bool:
        """Copy the first ``tokens`` of each row of ``layer``'s host keys and values into its
        slot, on the current stream, the length known on the host: on a GPU by the copy
        engine (no SMs taken) from the page-locked tensors; False where those are unknown."""
        k_slot, v_slot, _ = self.views(layer, keys, values)
        if self.copy_stream is None:        # a CPU run: the cache is the host tensor
            for host, slot in ((keys, k_slot), (values, v_slot)):
                self.fill(host, slot, torch.tensor([tokens]), self.block, self.done_flag(None))
            return True
        pinned = [self.pinned.get(t.data_ptr()) for t in (keys, values)]
        pinned = [None if p is None else p() for p in pinned]
        if None in pinned:
            return False
        self.fill_known(pinned[0], k_slot, tokens)
        self.fill_known(pinned[1], v_slot, tokens)
        return True

    def _check_owner(self, layer: int, keys) -> None:
        if self.owner_of(keys) != (layer, "keys"):     # a graph reused for another cache
            raise RuntimeError(                       # layer, or the hook did not run
                f"fx_offload: host KV layer {layer}'s compiled step got a cache this model's "
                "call hook did not prepare: call the model (model(...), generate), not "
                "model.forward directly, so that the hook puts each cache on the host")

    def attend(self, layer: int, query, key, value, index, keys, values, mask, scale):
        """``layer``'s step with its attention on the host (:mod:`.host_attention`)."""
        self._check_owner(layer, keys)
        out = self.attention.run(self, layer, query, key, value, index, keys, values, mask,
                                 scale)
        self.next_call.note_attended(layer)
        return out

    def update(self, layer: int, target: int, key, value, index, keys, values, nxt):
        """``layer``'s step: wait for its slot, write the step's tokens into it and back to
        the host, return a copy of the slot, and begin ``target``'s fill (-1: none)."""
        self._check_owner(layer, keys)
        if layer not in self.begun:     # not prefetched: copy now (the first position
            self.start(layer, keys, values, index.min())   # written is the valid length)
        k_slot, v_slot, idx = self.views(layer, keys, values)
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.filled[layer])
        k_slot.index_copy_(2, index, key)
        v_slot.index_copy_(2, index, value)
        written = idx[:index.numel()]
        written.copy_(index.reshape(-1))
        if self.write_stream is None:
            self.write_back(k_slot, keys, written)
            self.write_back(v_slot, values, written)
        else:
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self.write_stream):
                self.write_stream.wait_event(ready)
                self.write_back(k_slot, keys, written)
                self.write_back(v_slot, values, written)
                self.written.setdefault(layer, torch.cuda.Event()).record(self.write_stream)
            self.written_now.add(layer)
            self._written_hosts += [keys, values]
        self.next_call.note_update(layer, keys, values, index.numel())
        out = k_slot.clone(), v_slot.clone()
        if target >= 0:
            self.start(target, *nxt, previous=layer)
        else:
            self.next_call.last_in_slot(self, layer)
            self.before_replay.slot_read(self, layer)
        return out

    def join(self) -> None:
        """The end of a call: every write-back has landed before anything reads the host;
        the next call's first fills begin (.next_call)."""
        if self.write_stream is not None and self.written_now:
            torch.cuda.current_stream(self.device).wait_stream(self.write_stream)
            if not torch.cuda.is_current_stream_capturing():
                done = torch.cuda.Event()
                done.record(self.write_stream)
                self.held.append((done, self._written_hosts))
        self._written_hosts = []
        if self.done is not None:   # (a replay's too: the flags serve one call)
            self.done.zero_()
        self.next_call.prefetch(self)
        self.before_replay.joined()
        self.ended = True


def note_call(kv, cache, tokens: int) -> None:
    """Keep what ``fx_offload.report`` shows of this call's cache: its host bytes, its valid
    tokens once the call has written its ``tokens``, and what a decode step at that length
    moves (the valid blocks in, one token out).  Counted on the host from the lengths the
    hook read, and kept until the next call: a cache ``generate`` makes is gone when a user
    asks."""
    first = cache.layers[kv.layers[0]]
    capacity = first.keys.shape[2]
    valid = min(kv.lengths[kv.layers[0]] + tokens, capacity)
    per_token = sum(t.numel() // capacity * t.element_size() for i in kv.layers
                    for t in (cache.layers[i].keys, cache.layers[i].values))
    kv.figures = dict(host_bytes=kv.caches.get(cache, 0), valid_tokens=valid,
                      copied_per_step=copies.rounded(valid, kv.block, capacity) * per_token,
                      written_per_step=per_token)


def summary(kv) -> dict:
    """What ``fx_offload.report`` shows: the slots, the plan, and the latest call's figures
    (:func:`note_call`)."""
    out = dict(layers=list(kv.layers), block=kv.block, slots=kv.num_slots,
               slot_bytes=kv.slot_bytes(), host_bytes=0, valid_tokens=0,
               copied_per_step=0, written_per_step=0,
               plan=kv.plan.describe() if kv.plan is not None and kv.budget is not None
               else None, attended=list(kv.attention.layers),
               attended_on_device=list(kv.attention.on_device),
               attended_read=kv.attention.read, attended_jobs=kv.attention.jobs_timed,
               hosting=dict(kv.hosting))
    out.update(kv.figures)
    if kv.layers and out["attended"]:    # those layers copied nothing in
        out["copied_per_step"] = out["copied_per_step"] * \
            (len(kv.layers) - len(out["attended"])) // len(kv.layers)
    return out
