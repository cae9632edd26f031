"""The memory of one offloaded model: host masters and device slots, and the copy between
(:class:`SlotBuffers`).

Masters hold the true weights of offloaded layers.  On the CPU the original storage is the
master and nothing is copied, unless the weights come from a checkpoint or are compressed:
then into a plain host block.  Each layer sees its parameters as views into its slot laid
out as its host block, and moves in one copy per chunk (:mod:`fx_offload.layout`)::

    slot 0  [ layer 1: fc1.weight | fc1.bias | ... ]         one copy per chunk:
            [ layer 3 (an MoE layer): gate | experts... ]    block[a:b] -> slot[a:b]

The slots are allocated first, then the host blocks one layer at a time; ``hand_over`` lets
each layer's parameters take their block as soon as it is filled, so the storage they held
is freed before the next block is allocated (host memory holds each weight once, plus one
layer).  A failure part-way leaves every parameter holding its values: the old storage, or
a block that holds the same.

Page-locked blocks (:mod:`.host_memory`), slots shared by layers of different shapes, the
packed copy: docs/design.md, "Copies on CUDA"; a compressed layer's raw block in a file
(:mod:`.compressed_layers`, :mod:`.file_backed`): docs/compression.md, "Where the raw block
lives".
"""
from __future__ import annotations

import logging
import os

import torch

from ..experts.ahead import AheadCopies
from .compressed_layers import CompressedLayers
from ...layout import align_for, block_tensors, in_layout_order, layout_of
from .host_memory import HostBlock, views_into
from .streams import on_stream
from ..ownership.new_values import taken

log = logging.getLogger("fx_offload")


class SlotBuffers:
    """Masters and slots for a :class:`~fx_offload.selection.Choice`; its compressed copies
    are ``compression`` (:class:`~.compressed_layers.CompressedLayers`)."""

    # One copy per chunk from a packed host block into its slot, not one per parameter (the
    # measurement that chose it: docs/notes/2026-11-22-dense-decoder-grid.md).
    packed = os.environ.get("FX_OFFLOAD_PACKED", "1") != "0"

    def __init__(self, choice, layout, hand_over=None, fill=None):
        """``layout``: layer -> its copy chunks (:mod:`fx_offload.layout`).
        ``hand_over(layer, masters)``: called as each layer's block is filled.
        ``fill(layer, views)``: writes a layer's values into its new block (read from a
        checkpoint) instead of copying them from the parameters, which may be on the meta
        device."""
        self.schedule, self.device = choice.schedule, choice.device
        # each layer's parameters in its host block's order
        self.params = {layer: in_layout_order(ps, layout[layer])
                       for layer, ps in choice.params.items()}
        self.align = align_for(self.device)
        self.pinned = False
        self._blocks: dict[int, HostBlock] = {}
        layouts = {layer: layout_of(block_tensors(ps), self.align)
                   for layer, ps in self.params.items()}
        slot_of = self.schedule.slot_of
        sizes = [max(layouts[layer][1] for layer in self.params if slot_of[layer] == s)
                 for s in range(self.schedule.num_slots)]
        self.flat = [torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)
                     for n in sizes]
        self.views = {layer: views_into(self.flat[slot_of[layer]], layouts[layer][0])
                      for layer in self.params}
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        self.layout, self.model_name = layout, choice.model_name
        self.compress = choice.compress == "lossless" and self.packed
        self.compression = CompressedLayers(choice, layout, self._blocks, self.align,
                                            self.compress)
        self.ahead = AheadCopies.make(choice, self)     # before any parameter is handed over
        for layer, ps in self.params.items():
            self.masters[layer] = self._make_masters(layer, ps, fill)
            if self.compress:
                self.compression.compress(layer, ps)
                self._place_raw(layer)
            if hand_over is not None:
                hand_over(layer, self.masters[layer])
        self.staging, self.staged = self.compression.made()     # (None on the CPU)
        self.copied = 0             # bytes copied across the link since the latest call began,
        # by copies the host ran; those recorded in a CUDA graph count here instead, on the
        # device, as each replay runs them (made here: not in a capture's memory pool)
        self.replayed = torch.zeros((), dtype=torch.int64, device=self.device) \
            if self.device.type == "cuda" else None

    @property
    def compressed(self) -> dict:
        """Layer -> its :class:`~.compressed.CompressedBlock` (compressed layers only)."""
        return self.compression.compressed

    @torch.inference_mode(False)    # masters outlive the call that takes them up
    @torch.no_grad()
    def take_values(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        """``values`` (key in the host block -> a tensor holding it, none of them viewing
        this layer's masters) are ``layer``'s true values from now on (:mod:`.new_values`);
        ``masters[layer]`` may then be a new dict of tensors."""
        old = self._blocks.get(layer)
        self.masters[layer], block = taken(
            self.masters[layer], old, values,
            pin=self.device.type != "cpu" and not self.compress, align=self.align)
        if block is old:
            return
        self._blocks[layer] = block
        if not self.compress:
            self.pinned = block.pinned
        elif layer in self.compressed:
            self._place_raw(layer)      # into a file, or page-locked, as the first one was

    def _place_raw(self, layer: int) -> None:
        placed = self.compression.place_raw(layer)
        if placed is not None:
            self.masters[layer], self.pinned = placed

    def begin_count(self) -> None:
        """A call begins: count its copies from zero (in a capture that takes in the whole
        call, each replay then counts from zero too)."""
        self.copied = 0
        if self.replayed is not None:
            self.replayed.zero_()

    def copied_bytes(self) -> int:
        """Bytes copied across the link since the latest call began (reads the device)."""
        return self.copied + (0 if self.replayed is None else int(self.replayed))

    def count_copied(self, nbytes: int) -> None:
        if self.replayed is not None and torch.cuda.is_current_stream_capturing():
            self.replayed.add_(nbytes)      # a replay runs no Python: the graph counts
        else:
            self.copied += nbytes

    @property
    def nbytes(self) -> int:
        """Device memory of the slots, compressed copies' staging buffers and the ring."""
        staged = 0 if self.staging is None else self.staging.numel() + self.staged.nbytes
        ring = 0 if self.ahead is None else self.ahead.nbytes
        return sum(flat.numel() for flat in self.flat) + staged + ring

    def _make_masters(self, layer: int, ps, fill) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu" and fill is None and not self.compress:
            # the original storage becomes the master: nothing is copied
            return {key: t.detach() for key, t in block_tensors(ps).items()}
        # compressed: page-locked only once _place_raw knows it stays in memory
        block = HostBlock(block_tensors(ps),
                          fill=None if fill is None else lambda views: fill(layer, views),
                          pin=self.device.type != "cpu" and not self.compress,
                          align=self.align)
        if not self.compress:
            self.pinned = block.pinned
        self._blocks[layer] = block
        return block.views

    def block_of(self, layer: int) -> torch.Tensor | None:
        """``layer``'s host block, flat bytes (None where its masters are the parameters'
        own storage: the CPU)."""
        block = self._blocks.get(layer)
        return None if block is None else block.buffer

    def masters_left_block(self, layer: int) -> bool:
        """``share_memory_()`` (which pickling a model for another process does too) moved
        the storage of ``layer``'s masters out of its host block, and the parameters viewing
        it along: the copies would read stale bytes.  Then the masters view the block again
        (the caller copies the parameters' values into it) and True."""
        block = self._blocks.get(layer)
        if block is None:
            return False
        low = block.buffer.data_ptr()
        if all(low <= t.data_ptr() < low + block.nbytes or not t.numel()
               for t in self.masters[layer].values()):
            return False
        log.info("fx_offload: the weights of layer %d of %s were moved out of their host "
                 "block (share_memory_?): copied back into it", layer, self.model_name)
        block.remake_views()
        self.masters[layer] = block.views
        return True

    def begin_copy(self, layer: int, chunk, copy_stream, fork, done, capturing: bool) -> None:
        """Begin the copy of ``layer``'s ``chunk`` on ``copy_stream`` once ``fork`` (recorded
        on the compute stream after the last read of the bytes it overwrites) is reached;
        ``done`` is recorded when the chunk is in its slot.  A compressed chunk: its record,
        then its decode on the decode stream (:class:`.compressed.StagedCopies`)."""
        self.compression.captured = self.compression.captured or capturing
        packed = self.compressed.get(layer)
        if self.staged is not None and packed is not None and packed.holds(chunk):
            flat = self.flat[self.schedule.slot_of[layer]]
            self.staged.copy(packed, chunk, flat[chunk.start:chunk.end], copy_stream, fork,
                             done, capturing)
            self.count_copied(packed.chunk_nbytes(chunk))
            return
        copy_stream.wait_event(fork)
        # after decodes in flight into the same bytes (in a capture: only if the decode
        # stream is in it; an event from outside a capture cannot be waited on inside it)
        if self.staged is not None and (not capturing or self.staged.capturing()):
            copy_stream.wait_stream(self.staged.decode_stream)
        with on_stream(copy_stream):
            self.copy_in(layer, chunk, non_blocking=True)
            done.record(copy_stream)

    def synchronize(self) -> None:
        """Wait for decodes and the ring's fills in flight (copies: the caller)."""
        if self.staged is not None:
            self.staged.synchronize()
        if self.ahead is not None:
            self.ahead.synchronize()

    def copy_in(self, layer: int, chunk=None, non_blocking: bool = False) -> None:
        """Copy ``layer``'s masters into its slot (on the current stream): the bytes of one
        :class:`~fx_offload.layout.Chunk`, or all of them.  A compressed chunk is copied and
        decoded on this stream, through the synchronous loads' staging buffer on a GPU."""
        block = self._blocks.get(layer)
        if layer in self.compressed:
            chunks = self.layout[layer] if chunk is None else (chunk,)
            self.compression.copy_in(layer, chunks, self.flat[self.schedule.slot_of[layer]],
                                     self.staging, self.count_copied, non_blocking)
            return
        if self.packed and block is not None:       # one copy per chunk
            start, end = (0, block.nbytes) if chunk is None else (chunk.start, chunk.end)
            self.count_copied(end - start)
            flat = self.flat[self.schedule.slot_of[layer]]
            flat[start:end].copy_(block.buffer[start:end], non_blocking=non_blocking)
            return
        wanted = None if chunk is None else set(chunk.suffixes)
        with torch.no_grad():
            for p in self.params[layer]:
                if wanted is None or p.suffix in wanted:
                    self.count_copied(p.nbytes)
                    for key in p.parts():
                        self.views[layer][key].copy_(self.masters[layer][key],
                                                     non_blocking=non_blocking)

    def release(self) -> None:
        """Unlock the host blocks; the slots and masters must not be used afterwards."""
        if self.ahead is not None:     # first: its fills read the host blocks
            self.ahead.release()
            self.ahead = None
        for block in self._blocks.values():
            block.release()
        self.compression.release()
        self._blocks, self.flat, self.views, self.masters = {}, [], {}, {}
