"""One offloaded layer's compressed host copy (``compress="lossless"``).
:class:`CompressedBlock` holds the records of its chunks (by :mod:`fx_offload.codecs`) in
one page-locked block, beside the raw host block that stays the truth; a chunk not all
bf16, or not worth it, has no record and is copied raw.  :class:`StagedCopies` copies a
record into one of two staging buffers on the device and decodes it into the slot::

    compute   ... layer reads slot | fork ....................... wait(done) | next reads
    copy      H2D rec k -> staging[k] | staged[k]   H2D rec k+1 -> staging[k+1] ...
    decode              wait(staged[k], fork) decode -> slot, check | free[k], done

A synchronous load copies and decodes on the compute stream through a staging buffer of
its own.  The check after each decode on a GPU is :mod:`.record_check`.

Why a decode stream of its own, why record sizes are fixed when first made, and why no
reader of the weights decodes: docs/compression.md, the paragraph "A prefetch copies the
record", and "Checks".
"""
from __future__ import annotations

import logging

import torch

from ...errors import OffloadError
from ...codecs import codec_for, lossless
from . import record_check
from .host_memory import HostBlock

log = logging.getLogger("fx_offload")



class CompressedBlock:
    """The records of one layer's chunks; a chunk without one is copied raw."""

    def __init__(self, name: str, raw: torch.Tensor, chunks, compressible, device,
                 pin: bool, align: int):
        """``raw``: the layer's host block (flat uint8); ``compressible(chunk)``: the chunk
        holds bf16 words only.  Encoded on ``device`` where it is a GPU."""
        self.name = name
        self.codec = codec_for(device)
        work = device if device.type == "cuda" else None
        try:
            records, self.meta = self._encode_all(raw, chunks, compressible, work)
        except Exception as err:
            if self.codec is lossless:
                raise
            # nvCOMP failing on this machine (a driver it does not support, say): ours
            log.warning("fx_offload: nvCOMP failed to encode %s (%s: %s); its records use "
                        "fx_offload's own codec", name, type(err).__name__, err)
            self.codec = lossless
            records, self.meta = self._encode_all(raw, chunks, compressible, work)
        self.block = HostBlock(records, pin=pin, align=align) if records else None
        self.broken: str | None = None      # why its records cannot be used (recompress)
        # on a GPU, for the device check of each copy (record_check): the checksums and
        # what the decode must not read from a staged record, on the device; the flags the
        # check sets, in page-locked memory (SlotBuffers gives them: one array for all)
        on_gpu = work is not None and record_check.available()
        last = max((c.index for c in chunks), default=-1) + 1
        self.sums = torch.tensor([self.meta[i].checksum if i in self.meta else 0
                                  for i in range(last)], dtype=torch.int64,
                                 device=device) if on_gpu else None
        tables = {i: self.codec.trusted(self.block.views[str(i)], rec, device)
                  for i, rec in self.meta.items()} if on_gpu else {}
        self.tables = {i: t for i, t in tables.items() if t is not None}
        self.flags: torch.Tensor | None = None

    def _encode_all(self, raw: torch.Tensor, chunks, compressible, work) -> tuple[dict, dict]:
        """(chunk index as a string -> its record, chunk index -> what the record holds)."""
        records, meta = {}, {}
        for c in chunks:
            made = self.codec.encode(raw[c.start:c.end], work) if compressible(c) else None
            if made is not None:
                records[str(c.index)], meta[c.index] = made
        return records, meta

    @property
    def host_nbytes(self) -> int:
        """Host memory the records take."""
        return 0 if self.block is None else self.block.nbytes

    def chunk_nbytes(self, chunk) -> int:
        """Bytes the copy of ``chunk`` moves across the link: its record's, or its own."""
        rec = self.meta.get(chunk.index)
        return chunk.end - chunk.start if rec is None else rec.nbytes

    @property
    def staging_nbytes(self) -> int:
        return max((r.nbytes for r in self.meta.values()), default=0)

    def holds(self, chunk) -> bool:
        return chunk.index in self.meta

    def holds_all(self, chunks) -> bool:
        """Every one of ``chunks`` is copied from a record (none from the raw block)."""
        return all(c.index in self.meta for c in chunks)

    def copy_in(self, chunk, dest: torch.Tensor, staging: torch.Tensor | None,
                non_blocking: bool) -> None:
        """Fill ``dest`` (the chunk's bytes in its slot) from its record, on the current
        stream: through ``staging`` on a GPU, straight from the host record on the CPU
        (there each record's checksum is checked before it is read)."""
        if self.broken:
            raise OffloadError(self.broken, where="fx_offload")
        rec, record = self.meta[chunk.index], self.record_of(chunk)
        if staging is None:
            lossless.check(record, rec, f"{self.name} chunk {chunk.index}")
            self.codec.decode(record, rec, dest)
            return
        staged = staging[:rec.nbytes]
        staged.copy_(record, non_blocking=non_blocking)
        self.decode_checked(chunk, staged, record_check.new_tally(dest.device), dest)

    def decode_checked(self, chunk, staged: torch.Tensor, tally: torch.Tensor,
                       dest: torch.Tensor) -> None:
        """Decode the record of ``chunk`` staged on the GPU into ``dest``, on the current
        stream, then verify its checksum there (:mod:`.record_check`, adding up in
        ``tally``)."""
        i = chunk.index
        self.codec.decode(staged, self.meta[i], dest, self.tables.get(i))
        if self.sums is not None and self.flags is not None:
            record_check.check(staged, tally, self.sums[i:i + 1], self.flags[i:i + 1], dest)

    def found_corrupt(self) -> list[int]:
        """Chunks whose records the device check found corrupt (read without waiting: a
        copy still in flight is seen by a later look)."""
        if self.flags is None:
            return []
        return torch.nonzero(self.flags).flatten().tolist()

    def record_of(self, chunk) -> torch.Tensor:
        return self.block.views[str(chunk.index)]

    def recompress(self, raw: torch.Tensor, chunks, device, captured: bool) -> None:
        """The host block's chunks changed (an update): encode them again into the same
        records.  No copy may be reading the records (the caller synchronizes).  A chunk
        whose new weights need more room than its record kept is copied raw from now on,
        unless a CUDA graph has captured its decode (``captured``): its replays would decode
        the old record's sizes, so the model refuses to run until it is compiled again."""
        work = device if device.type == "cuda" else None
        for c in chunks:
            rec = self.meta.get(c.index)
            if rec is None:
                continue                    # copied raw: reads the host block itself
            made = self.codec.encode(raw[c.start:c.end], work, fit=rec)
            if made is None and not captured:
                del self.meta[c.index]
                log.info("fx_offload: the new weights of %s chunk %d compress to more than "
                         "its compressed copy kept room for (their exponents spread wider): "
                         "copied uncompressed from now on", self.name, c.index)
                continue
            if made is None:
                self.broken = (
                    f"the new weights of {self.name} (chunk {c.index}) do not fit the "
                    "compressed copy a CUDA graph captured (their exponents spread wider than "
                    "it kept room for). The weights themselves were taken (state_dict shows "
                    "them); to run with them, fx_offload.restore(model) and compile again, or "
                    "use compress='none'")
                raise OffloadError(self.broken, where="fx_offload")
            record, self.meta[c.index] = made
            self.record_of(c).copy_(record)
            if self.sums is not None:       # the graph's check reads the new ones
                self.sums[c.index] = self.meta[c.index].checksum
                if c.index in self.tables:
                    self.tables[c.index].copy_(self.codec.trusted(record, self.meta[c.index],
                                                                  device))
        if self.flags is not None:
            self.flags.zero_()              # encoded anew from the intact raw block
        self.broken = None
        log.debug("fx_offload: %s compressed again", self.name)

    def release(self) -> None:
        if self.block is not None:
            self.block.release()


class StagedCopies:
    """Prefetches of compressed chunks: the record to a staging buffer on the copy stream,
    its decode into the slot on a decode stream (both streams and all events made once)."""

    COUNT = 2                   # staging buffers the copy stream fills in turn

    def __init__(self, device, nbytes: int):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                        for _ in range(self.COUNT)]
        self.decode_stream = torch.cuda.Stream(device)
        self.staged = [torch.cuda.Event() for _ in range(self.COUNT)]
        # each buffer's record_check tally, used in the same stream order as the buffer
        self.tallies = [record_check.new_tally(device) for _ in range(self.COUNT)]
        self.free = [torch.cuda.Event() for _ in range(self.COUNT)]
        # where each buffer's ``free`` was last recorded: None (never), in a capture (True)
        self._free_in_capture: list[bool | None] = [None] * self.COUNT
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def copy(self, packed: CompressedBlock, chunk, dest: torch.Tensor, copy_stream, fork,
             done, capturing: bool) -> None:
        """Begin the copy of ``chunk``'s record and its decode into ``dest`` once ``fork``
        (recorded on the compute stream after the last read of those bytes) is reached;
        ``done`` is recorded after the decode."""
        if packed.broken:
            raise OffloadError(packed.broken, where="fx_offload")
        k = self._next
        self._next = (k + 1) % self.COUNT
        rec = packed.meta[chunk.index]
        staged = self.buffers[k][:rec.nbytes]
        # The buffer's last decode must be over before it is overwritten.  Inside a capture
        # only what this capture recorded may be waited on: the copy stream joins through
        # the fork, then follows the decode stream if it is in this capture too (the
        # synchronization that begins every capture finished the decodes before it, and
        # under CUDA graphs no decode is begun outside the graph: the call hook leaves a
        # compressed layer's entry refill to the graph, runtime.copies.hook_copies).  After
        # a capture, a replay may still be decoding from the buffer: the fork, recorded on
        # the stream the replay runs on, comes after it.
        last = self._free_in_capture[k]
        if capturing or last:
            copy_stream.wait_event(fork)
        if capturing:
            if self.capturing():
                copy_stream.wait_stream(self.decode_stream)
        elif last is False:
            copy_stream.wait_event(self.free[k])
        with torch.cuda.stream(copy_stream):
            staged.copy_(packed.record_of(chunk), non_blocking=True)
            self.staged[k].record(copy_stream)
        decode = self.decode_stream
        decode.wait_event(self.staged[k])
        decode.wait_event(fork)
        with torch.cuda.stream(decode):
            packed.decode_checked(chunk, staged, self.tallies[k], dest)
            self.free[k].record(decode)
            done.record(decode)
        self._free_in_capture[k] = capturing

    def capturing(self) -> bool:
        """The decode stream takes part in the capture under way."""
        with torch.cuda.stream(self.decode_stream):
            return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        self.decode_stream.synchronize()
