"""The compressed copies of a model's offloaded layers (``compress="lossless"``), as
:class:`~.slots.SlotBuffers` keeps them: one :class:`~.compressed.CompressedBlock` of records
per layer, made once its host block is filled, encoded again when the weights change, and
where the layer's raw block then lives (:mod:`.file_backed`)::

    make a layer:   host block (unpinned) -> records -> raw block to a file  (every chunk
                                                     or page-locked in place  has a record)
    weights change: host block -> records encoded again into the same sizes

:class:`CompressedLayers` is the slot buffers' ``compression``, built from the choice and
the buffers' host blocks (their own dict, which it reads); where a layer's block then lives
it returns to them (:meth:`CompressedLayers.place_raw`).
"""
from __future__ import annotations

import logging

import torch

from ...text import format_bytes
from ...codecs import lossless
from . import file_backed
from .compressed import CompressedBlock, StagedCopies

log = logging.getLogger("fx_offload")


class CompressedLayers:
    """Compressed copies of the offloaded layers (``enabled``: ``compress="lossless"``);
    ``blocks``: the slot buffers' layer -> host block, filled as they make them."""

    def __init__(self, choice, layout, blocks: dict, align: int, enabled: bool):
        self.blocks, self.align, self.enabled = blocks, align, enabled
        self.layout, self.device, self.params = layout, choice.device, choice.params
        self.experts, self.model_name = choice.experts, choice.model_name
        self.compressed: dict = {}          # layer -> CompressedBlock
        # compressed layers' uncompressed weights: in files there (runtime.memory.file_backed),
        # looked up when the first layer could go
        self.raw_folder = file_backed.LATER if enabled else None
        self.uncompressed_weights = choice.uncompressed_weights
        self.corrupt: torch.Tensor | None = None    # the device checks' flags (on a GPU)
        self.captured = False       # a CUDA graph captured a copy: record sizes are fixed
        self.encoded_at: dict[int, tuple] = {}  # layer -> its parameters' versions encoded

    def compress(self, layer: int, ps) -> None:
        """Encode ``layer``'s chunks of bf16 weights (``compress="lossless"``)."""
        dtypes = {p.suffix: {t.dtype for t in p.parts().values()} for p in ps}

        def compressible(chunk) -> bool:
            return all(dtypes[s] == {torch.bfloat16} for s in chunk.suffixes)
        self.compressed[layer] = CompressedBlock(
            f"layer {layer} of {self.model_name}", self.blocks[layer].buffer,
            self.layout[layer], compressible, self.device,
            pin=self.device.type != "cpu", align=self.align)

    def made(self):
        """Every layer is made: a warning where nothing could be compressed.  On a GPU,
        ``(staging, staged)``: the staging buffer of synchronous loads (copy and decode on
        the compute stream, in order) and those of the prefetches (copy and decode
        streams), the device checks' flags given out; else ``(None, None)``."""
        if self.enabled and not any(c.meta for c in self.compressed.values()):
            kinds = sorted({str(t.dtype).replace("torch.", "") for ps in self.params.values()
                            for p in ps for t in p.parts().values()})
            log.warning("fx_offload: compress='lossless' compresses bfloat16 weights only; the "
                        "offloaded weights of %s are %s: copied as they are", self.model_name,
                        ", ".join(kinds))
        most = max((c.staging_nbytes for c in self.compressed.values()), default=0)
        if not most or self.device.type != "cuda":
            return None, None
        staging = torch.empty(most, dtype=torch.uint8, device=self.device)
        staged = StagedCopies(self.device, most)
        self.give_flags()
        return staging, staged

    def give_flags(self) -> None:
        """One page-locked array of flags for the device checks of every layer's copies
        (``record_check``), so a call's start looks at all of them at once."""
        blocks = [p for _, p in sorted(self.compressed.items()) if p.sums is not None]
        if not blocks:
            return
        self.corrupt = torch.zeros(sum(p.sums.numel() for p in blocks), dtype=torch.int32,
                                   pin_memory=True)
        at = 0
        for packed in blocks:
            packed.flags = self.corrupt[at:at + packed.sums.numel()]
            at += packed.sums.numel()

    def raise_if_corrupt(self) -> None:
        """Raise where a device check found a record corrupt (the call that copied it
        returned NaN); every call raises so until the record is encoded again (new weights
        for its layer) or the model is restored."""
        if self.corrupt is None or not self.corrupt.numpy().any():     # no device wait
            return
        found = [(packed.name, packed.found_corrupt()) for packed in self.compressed.values()]
        raise lossless.corrupt(" and ".join(
            f"{name} (chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, chunks))})"
            for name, chunks in found if chunks), on_gpu=True)

    def place_raw(self, layer: int):
        """A compressed layer's host block (made unpinned): into a file where every chunk
        has a record and no gather reads its rows, else page-locked as any other.  Returns
        ``(masters, pinned)``: the layer's masters now and whether host memory is
        page-locked; None where the block stays as it is (the CPU)."""
        block, packed = self.blocks[layer], self.compressed[layer]
        if layer not in self.experts and packed.holds_all(self.layout[layer]) and \
                self._room_for(layer, block.nbytes):
            try:
                block.to_file(self.raw_folder)
                return block.views, packed.block is not None and packed.block.pinned
            except OSError as err:
                log.warning("fx_offload: the uncompressed weights of %s stay in host memory "
                            "from layer %d on: writing them to %s failed (%s)",
                            self.model_name, layer, self.raw_folder, err)
                self.raw_folder = None
        if self.device.type != "cpu":
            block.pin()
            return block.views, block.pinned
        return None

    def _room_for(self, layer: int, nbytes: int) -> bool:
        """``raw_folder`` (looked up at the first layer that could go) takes ``layer``'s
        block; where it has no room, no later layer goes either."""
        if self.raw_folder is file_backed.LATER:
            self.raw_folder = file_backed.folder_for(self.uncompressed_weights, self.model_name)
        if self.raw_folder is None:
            return False
        if file_backed.room_in(self.raw_folder, nbytes):
            return True
        log.warning("fx_offload: %s has no room for the uncompressed weights of %s (%s more, "
                    "and 1 GiB to spare): they stay in host memory from layer %d on; give "
                    "uncompressed_weights=<a folder with room>", self.raw_folder,
                    self.model_name, format_bytes(nbytes), layer)
        self.raw_folder = None
        return False

    @property
    def in_file_bytes(self) -> int:
        """Host-block bytes kept in files rather than in host memory."""
        return sum(b.nbytes for b in self.blocks.values() if b.in_file)

    def chunk_nbytes(self, layer: int, chunk) -> int:
        """Bytes the copy of ``layer``'s ``chunk`` moves across the link."""
        packed = self.compressed.get(layer)
        return chunk.end - chunk.start if packed is None else packed.chunk_nbytes(chunk)

    def call_bytes(self) -> dict[int, int]:
        """Layer -> bytes one copy of it moves, where compression changes it (else {})."""
        return {layer: sum(self.chunk_nbytes(layer, c) for c in self.layout[layer])
                for layer in self.params} if self.compressed else {}

    def codec_names(self) -> str:
        """The codecs of the layers' records (one, unless nvCOMP failed on some layers)."""
        return ", ".join(sorted({c.codec.NAME for c in self.compressed.values() if c.meta}))

    @property
    def compressed_host_bytes(self) -> int:
        return sum(c.host_nbytes for c in self.compressed.values())

    def copy_in(self, layer: int, chunks, flat: torch.Tensor, staging, count,
                non_blocking: bool) -> None:
        """Copy ``layer``'s ``chunks`` into its slot ``flat`` on the current stream, each
        copied and decoded there (through ``staging``, the synchronous loads' buffer, on a
        GPU) or copied raw where it has no record; ``count(nbytes)`` told of each."""
        packed, block = self.compressed[layer], self.blocks[layer]
        for c in chunks:
            count(self.chunk_nbytes(layer, c))
            if packed.holds(c):
                packed.copy_in(c, flat[c.start:c.end], staging, non_blocking)
            else:
                flat[c.start:c.end].copy_(block.buffer[c.start:c.end], non_blocking=non_blocking)

    def recompress_changed(self, versions, moved, synchronize) -> set[int]:
        """Encode again the compressed copies of layers whose weights changed since they
        were encoded (``versions(layer)`` moved, or new values were copied into their host
        blocks: ``moved``, entries ``(layer, ..., copied)``), after ``synchronize`` (a copy
        may be reading a record); returns them."""
        if not self.compressed:             # every call: nothing to do without compression
            return set()
        copied = {entry[0] for entry in moved if entry[-1]}
        changed = {layer for layer in self.compressed
                   if layer in copied or versions(layer) != self.encoded_at[layer]}
        if changed:
            synchronize()
        for layer in sorted(changed):
            self.recompress(layer)
            self.encoded_at[layer] = versions(layer)
        return changed

    def recompress(self, layer: int) -> None:
        """``layer``'s host block changed: its compressed copy follows (no copy in flight)."""
        packed, block = self.compressed.get(layer), self.blocks.get(layer)
        if packed is not None:
            packed.recompress(block.buffer, self.layout[layer], self.device, self.captured)
            if block.in_file and self.device.type == "cuda" and \
                    not packed.holds_all(self.layout[layer]):
                # a chunk now copied raw reads the file's pages: lock them where they are
                # (the parameters view them), or copy from pageable memory, slower
                block.lock_in_place()

    def release(self) -> None:
        """Free the compressed copies."""
        for packed in self.compressed.values():
            packed.release()
        self.compressed = {}
