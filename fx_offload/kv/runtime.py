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
    join: wait the write-back stream

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

log = logging.getLogger("fx_offload")


class HostKV:
    """The host KV cache runtime of one model (``kv_cache="host"``)."""

    def __init__(self, model, handle: int, options):
        self.handle = handle
        self.model_name = type(model).__name__
        self.block = options.kv_block_size
        self.num_slots = options.kv_slots
        self.wanted = options.kv_layers          # None: every layer of the cache
        self.layers: list[int] = []              # host layers, set by the first cache
        # data_ptr -> (layer, "keys"|"values"|"pos", weak reference to the tensor)
        self.owners: dict[int, tuple] = {}
        self.caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._slots: dict[tuple, list[torch.Tensor]] = {}
        self._idx: dict[tuple, list[torch.Tensor]] = {}
        self.pos: dict[int, torch.Tensor] = {}
        self.device: torch.device | None = None
        self.copy_stream = self.write_stream = None
        self.filled: dict[int, torch.cuda.Event] = {}
        self.written: dict[int, torch.cuda.Event] = {}
        self.begun: set[int] = set()             # this call: fills begun
        self.written_now: set[int] = set()       # this call: write-backs begun
        self.fill = copies.fill                  # the two copies (a test may wrap them)
        self.write_back = copies.write_back
        self.fill_known = copies.fill_known
        self.hook = None                         # the model's call hook (fx_offload.kv)
        self.latest = None                       # a weak reference to the latest cache
        self.pinned: dict[int, object] = {}      # address -> weakref of the host tensor
        self.lengths: dict[int, int] = {}        # from the hook: each layer's valid length
        self.call_lengths: dict[int, int] = {}   # the same, taken by this call's begin
        self.held: list = []                     # (event, host tensors) of write-backs
        self._written_hosts: list = []           # this call's written host tensors

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
            self.copy_stream = torch.cuda.Stream(device)    # docs/benchmarks.md)
            self.write_stream = torch.cuda.Stream(device)

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The slots, index and length buffers for caches shaped like ``keys``/``values``,
        made from the call hook, outside any compiled call: memory allocated inside a
        CUDA-graph capture (or its warm-up) belongs to the graph's pool, which must hold
        only the graph's own tensors."""
        self.views(self.layers[0], keys, values)
        for layer in self.layers:
            if layer not in self.pos:
                self.pos[layer] = torch.zeros(1, dtype=torch.int64, device=keys.device)

    def views(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """The slot of ``layer`` for caches shaped like ``keys``/``values``: (keys, values)
        views into one zeroed device buffer (allocated on first use of the shape)."""
        key = (tuple(keys.shape), tuple(values.shape), keys.dtype, keys.device)
        flats = self._slots.get(key)
        if flats is None:
            size = keys.numel() + values.numel()
            flats = [torch.zeros(size, dtype=keys.dtype, device=keys.device)
                     for _ in range(min(self.num_slots, len(self.layers)))]
            self._slots[key] = flats
            self._idx[key] = [torch.zeros(keys.shape[2], dtype=torch.int64, device=keys.device)
                              for _ in flats]
            log.info("fx_offload: %s KV slots: %d x %.1f MiB on %s", self.model_name,
                     len(flats), size * keys.element_size() / 2**20, keys.device)
        flat = flats[self.slot_of(layer)]
        n = keys.numel()
        return flat[:n].view(keys.shape), flat[n:].view(values.shape), \
            self._idx[key][self.slot_of(layer)]

    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for flats in self._slots.values()
                   for t in flats)

    # ------------------------------------------------------------------ a step
    def begin_call(self) -> None:
        """A new call: nothing begun yet.  Outside a capture, whatever a call that ended early
        (an exception) left in flight is waited for first."""
        self.begun.clear()
        self.written_now.clear()
        # the lengths the call hook read serve this call only (a call that skipped the hook,
        # model.forward called directly, reads them on the device)
        self.call_lengths, self.lengths = self.lengths, {}
        if self.write_stream is not None and not torch.cuda.is_current_stream_capturing():
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.write_stream)
            current.wait_stream(self.copy_stream)
            # host tensors of earlier calls, kept until their write-backs have landed (a
            # cache dropped right after a call would otherwise return its page-locked
            # memory to torch's allocator while the device still writes it)
            self.held = [(done, kept) for done, kept in self.held if not done.query()]

    def start(self, layer: int, keys, values, pos, previous: int | None = None) -> None:
        """Begin copying ``layer``'s valid blocks into its slot (``pos``: the tokens its
        cache holds, a device tensor).  ``previous``: the layer leaving the slot, whose
        write-back reads it."""
        k_slot, v_slot, _ = self.views(layer, keys, values)
        mark = self.pos[layer]
        mark.copy_(pos.reshape(-1)[:1])          # in stream order: before this step's write
        if self.copy_stream is None:
            self.fill(keys, k_slot, mark, self.block)
            self.fill(values, v_slot, mark, self.block)
        else:
            ready = torch.cuda.Event()
            ready.record()
            known = None if torch.cuda.is_current_stream_capturing() else \
                self.call_lengths.get(layer)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                if previous in self.written_now:
                    self.copy_stream.wait_event(self.written[previous])
                for host, slot in ((keys, k_slot), (values, v_slot)):
                    pinned = self.pinned.get(host.data_ptr())
                    pinned = pinned() if pinned is not None else None
                    if known is None or pinned is None:     # the length on the device
                        self.fill(host, slot, mark, self.block)
                    else:       # known on the host: the copy engine, no SMs taken
                        self.fill_known(pinned, slot, copies.rounded(known, self.block,
                                                                     slot.shape[2]))
                self.filled.setdefault(layer, torch.cuda.Event()).record(self.copy_stream)
        self.begun.add(layer)

    def update(self, layer: int, target: int, key, value, index, keys, values, nxt):
        """``layer``'s step: wait for its slot, write the step's tokens into it and back to
        the host, return a copy of the slot, and begin ``target``'s fill (-1: none)."""
        if self.owner_of(keys) != (layer, "keys"):     # a graph reused for another cache
            raise RuntimeError(                       # layer, or the hook did not run
                f"fx_offload: host KV layer {layer}'s compiled step got a cache this model's "
                "call hook did not prepare: call the model (model(...), generate), not "
                "model.forward directly, so that the hook puts each cache on the host")
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
        out = k_slot.clone(), v_slot.clone()
        if target >= 0:
            self.start(target, *nxt, previous=layer)
        return out

    def join(self) -> None:
        """The end of a call: every write-back has landed before anything reads the host."""
        if self.write_stream is not None and self.written_now:
            torch.cuda.current_stream(self.device).wait_stream(self.write_stream)
            if not torch.cuda.is_current_stream_capturing():
                done = torch.cuda.Event()
                done.record(self.write_stream)
                self.held.append((done, self._written_hosts))
        self._written_hosts = []


def summary(kv) -> dict:
    """What ``fx_offload.report`` shows: the latest cache's host bytes, its valid tokens,
    and what a decode step at that length moves (the valid blocks in, one token out)."""
    cache = kv.latest() if kv.latest is not None else None
    out = dict(layers=list(kv.layers), block=kv.block, slots=kv.num_slots,
               slot_bytes=kv.slot_bytes(), host_bytes=0, valid_tokens=0,
               copied_per_step=0, written_per_step=0)
    if cache is None or not kv.layers:
        return out
    per_token = []
    for i in kv.layers:
        layer = cache.layers[i]
        per_token.append(sum(t[:, :, :1].numel() * t.element_size()
                             for t in (layer.keys, layer.values)))
    valid = int(cache.layers[kv.layers[0]].cumulative_length)
    tokens = cache.layers[kv.layers[0]].keys.shape[2]
    out.update(host_bytes=kv.caches.get(cache, 0), valid_tokens=valid,
               copied_per_step=copies.rounded(valid, kv.block, tokens) * sum(per_token),
               written_per_step=sum(per_token))
    return out
