"""fx_offload's own lossless codec of bfloat16 weights for the host-to-device copy
(``compress="lossless"``): the codec of the CPU and of every GPU without nvCOMP; where
nvCOMP's library is installed, its ANS (:mod:`.ans`) codes a GPU's records instead.

One chunk of a layer's host block (:mod:`fx_offload.layout`) is stored as one record::

    record of a chunk of n bf16 words (each section at a multiple of 16 bytes)
    [ base | sign+mantissa          | codes               | escapes: where   | exponent ]
      16 B   n bytes, (s << 7) | m    n/2 bytes, 4 bits     E int32 indices    E bytes
                                      each (2 words a byte)

    word i = sign << 15 | (base + code_i) << 7 | mantissa   (code 15: the escape's exponent)

``base`` starts the window of 15 consecutive exponents that holds the most of the chunk's
words; the rare others (values many octaves below the layer's scale, padding, inf/NaN) are
escapes, listed apart.  The codes are of fixed width on purpose: a decode is a few integer
operations per pair of words with no lookup, so any GPU decodes them fast enough for copy
and decode to keep up with the link, and the CPU decodes them with torch ops.

The decode writes only inside its chunk whatever a record holds (an escape's position is
bounded, on the GPU and in the torch decode alike), so a corrupt record can at worst fill
its own chunk with wrong bytes, which the device check (:mod:`.record_check`) then
replaces.  A chunk that is not all bf16, or that would not shrink below ``WORTH`` of its
size, is stored raw and copied as it is.  Why the exponent alone is coded, the ratio, the
checks of every record and the staged decode: docs/compression.md (the two codecs; Checks).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..errors import OffloadError

log = logging.getLogger("fx_offload")

NAME = "fx_offload"         # the codec's name in report(model)
ESCAPE = 15                 # the code of a word whose exponent is in the escape list
HEADER = 16                 # bytes before the sections: the window's base exponent, zeros
ALIGN = 16                  # each section starts at a multiple of this
WORTH = 0.9                 # a record must be at most this fraction of the raw bytes
BLOCK = 2048                # pairs of words per Triton program
ROOM = 1024                 # words per escape entry a record keeps room for, at least


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class Record:
    """Where each section of one chunk's record lies, and its checksum."""

    words: int              # bf16 words of the chunk (its raw bytes / 2)
    escapes: int            # escape entries: room for at least the escaped words (room_for)
    checksum: int           # of the record's bytes (:func:`checksum`)

    @property
    def sm(self) -> int:
        return HEADER

    @property
    def codes(self) -> int:
        return self.sm + _up(self.words)

    @property
    def where(self) -> int:
        return self.codes + _up((self.words + 1) // 2)

    @property
    def exponents(self) -> int:
        return self.where + _up(4 * self.escapes)

    @property
    def nbytes(self) -> int:
        return self.exponents + _up(self.escapes)

    @property
    def raw_nbytes(self) -> int:
        return 2 * self.words


def checksum(record: torch.Tensor) -> int:
    """A sum of the record's 8-byte words (a record is a multiple of 16 bytes), each weighted
    by ``2 * (its position mod 2**16) + 1``, wrapping at 2**64: the weights are odd, so any
    change of one word shows, and they differ, so a swap of two words does too.  Computed
    where the record is; on a GPU :mod:`.record_check` computes it at every copy."""
    if record.numel() % 8:
        raise ValueError(f"a record of {record.numel()} bytes: not a multiple of 8")
    words = record.view(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65536
    return int((words * (weights * 2 + 1)).sum())


def room_for(escapes: int, words: int) -> int:
    """Escape entries a chunk's record keeps room for: twice what its first weights needed,
    and at least one per ``ROOM`` words, so that new weights of the same kind (an update)
    fit the same record, whose sizes a captured CUDA graph has fixed."""
    return max(2 * escapes, -(-words // ROOM))


def encode(raw: torch.Tensor, work_device: torch.device | None = None,
           fit: Record | None = None) -> tuple[torch.Tensor, Record] | None:
    """The record of the bf16 words in ``raw`` (flat uint8 bytes, an even count, on the
    host), as a CPU uint8 tensor and its :class:`Record`; None where it would not be worth
    it (it is at least ``WORTH`` of the raw size) or, given ``fit`` (the record it
    replaces), where it needs more escape entries than that one kept room for.
    ``work_device``: where to compute it (a GPU is much faster); the record is decoded
    there once and compared with ``raw``.
    Unused escape entries repeat word 0's exponent at word 0, which changes nothing."""
    if raw.numel() % 2:
        raise ValueError("a bf16 chunk has an even number of bytes")
    device = work_device or raw.device
    src = raw.to(device, non_blocking=False)
    low, high = src.view(-1, 2).unbind(1)       # little-endian: the word's low byte first
    exp = ((high & 0x7F) << 1) | (low >> 7)
    counts = torch.bincount(exp.int(), minlength=256 + ESCAPE)
    windows = counts.cumsum(0)[ESCAPE - 1:] - torch.cat([counts.new_zeros(1),
                                                         counts.cumsum(0)[:-ESCAPE]])
    base = int(torch.argmax(windows[:256]))         # 15 exponents base .. base + 14
    codes = (exp.int() - base).clamp_(min=-1).masked_fill_(exp.int() < base, ESCAPE)
    codes = codes.clamp_(max=ESCAPE).to(torch.uint8)
    where = torch.nonzero(codes == ESCAPE).flatten()
    n, needed = exp.numel(), where.numel()
    escapes = room_for(needed, n) if fit is None else fit.escapes
    rec = Record(n, escapes, 0)
    if needed > escapes or rec.nbytes > WORTH * rec.raw_nbytes:
        return None
    if escapes > needed:                    # the spare entries: word 0 as it is
        where = torch.cat([where, where.new_zeros(escapes - needed)])
    out = torch.zeros(rec.nbytes, dtype=torch.uint8, device=device)
    out[0] = base
    out[rec.sm:rec.sm + n] = (high & 0x80) | (low & 0x7F)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    out[rec.codes:rec.codes + (n + 1) // 2] = codes[0::2] | (codes[1::2] << 4)
    out[rec.where:rec.where + 4 * escapes] = where.to(torch.int32).view(torch.uint8)
    out[rec.exponents:rec.exponents + escapes] = exp[where]
    rec = Record(n, escapes, checksum(out))
    back = torch.empty_like(src)
    decode(out, rec, back)
    if not torch.equal(back, src):          # never a wrong record: say so, copy raw
        log.error("fx_offload: a compressed record did not decode to its bytes; that chunk "
                  "is copied uncompressed (please report this)")
        return None
    return out.cpu(), rec


def check(record: torch.Tensor, rec: Record, what: str) -> None:
    """Raise where ``record`` is not the record ``rec`` describes (corrupt host memory)."""
    if record.numel() < rec.nbytes or checksum(record[:rec.nbytes]) != rec.checksum:
        raise corrupt(what)


def corrupt(what: str, on_gpu: bool = False) -> OffloadError:
    """The error for a record of ``what`` found not to match its checksum (on the GPU: by the
    device check of a copy, which filled the chunk with NaN for that call)."""
    found = ("its checksum, verified on the GPU as it was copied, does not match what was "
             "written; the call that copied it computed with NaN in its place" if on_gpu else
             "its checksum or size does not match what was written")
    return OffloadError(
        f"the compressed host copy of {what} is corrupt ({found}): its weights cannot be "
        "trusted. fx_offload.restore(model) brings back the uncompressed weights, which are "
        "kept apart and are intact; compile again to compress them anew", where="fx_offload")


def check_sizes(record: torch.Tensor, rec, out: torch.Tensor) -> None:
    """Raise where ``record`` (of either codec) and ``out`` are not the sizes ``rec`` says."""
    if out.numel() != rec.raw_nbytes or record.numel() < rec.nbytes:
        raise OffloadError(
            f"a compressed record of {rec.raw_nbytes} bytes was asked to fill {out.numel()} "
            f"bytes from {record.numel()}: the record does not match its chunk", where="fx_offload")


def trusted(record: torch.Tensor, rec: Record, device: torch.device) -> None:
    """What a decode takes from device memory rather than from the record: nothing (the
    sizes are ``rec``'s, the positions of escapes bounded by the kernel)."""
    return None


def decode(record: torch.Tensor, rec: Record, out: torch.Tensor, table=None) -> None:
    """Write the chunk's raw bytes into ``out`` (uint8, ``rec.raw_nbytes``) from ``record``
    (uint8, on ``out``'s device), on the current stream; no host synchronisation on a GPU.
    ``table``: :func:`trusted`'s (unused)."""
    check_sizes(record, rec, out)
    if out.is_cuda and _triton() is not None:
        with torch.cuda.device(out.device):     # Triton launches on the current device
            _decode_triton(record, rec, out)
        return
    _decode_torch(record, rec, out)


def _decode_torch(record: torch.Tensor, rec: Record, out: torch.Tensor) -> None:
    n = rec.words
    sm = record[rec.sm:rec.sm + n]
    packed = record[rec.codes:rec.codes + (n + 1) // 2]
    codes = torch.stack((packed & 15, packed >> 4), dim=1).flatten()[:n]
    exp = codes + record[0]                 # uint8: wraps like the kernel's low 8 bits
    if rec.escapes:
        where = record[rec.where:rec.where + 4 * rec.escapes].view(torch.int32)
        where = where.clamp(0, n - 1)       # a corrupt record stays inside its chunk
        exp[where] = record[rec.exponents:rec.exponents + rec.escapes]
    low, high = out.view(-1, 2).unbind(1)
    low.copy_(((exp & 1) << 7) | (sm & 0x7F))
    high.copy_((sm & 0x80) | (exp >> 1))


# ---- the GPU decoder ------------------------------------------------------------------
_KERNELS = None


def _triton():
    """The two Triton kernels, compiled on first use; None without Triton."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS or None
    try:
        import triton
        import triton.language as tl
    except ImportError:             # a CPU build: decode with torch ops
        _KERNELS = ()
        return None

    @triton.jit
    def words(src, sm_pairs, code_pairs, out_pairs, pairs, BLOCK: tl.constexpr):
        # two words a step: 16 bits of sign+mantissa and one byte of codes in, 32 bits out
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = j < pairs
        base = tl.load(src).to(tl.int32)
        sm = tl.load(sm_pairs + j, mask=live, other=0).to(tl.int32)
        code = tl.load(code_pairs + j, mask=live, other=0).to(tl.int32)
        s0, s1 = sm & 0xFF, (sm >> 8) & 0xFF
        e0, e1 = (base + (code & 15)) & 0xFF, (base + (code >> 4)) & 0xFF
        w0 = ((s0 & 0x80) << 8) | (e0 << 7) | (s0 & 0x7F)
        w1 = ((s1 & 0x80) << 8) | (e1 << 7) | (s1 & 0x7F)
        tl.store(out_pairs + j, w0 | (w1 << 16), mask=live)

    @triton.jit
    def escapes(src, positions, out, e, exp_at, words, BLOCK: tl.constexpr):
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        where = tl.load(positions + j, mask=j < e, other=0)
        live = (j < e) & (where >= 0) & (where < words)     # a corrupt record stays inside
        exp = tl.load(src + exp_at + j, mask=live, other=0).to(tl.int32)
        w = tl.load(out + where, mask=live, other=0).to(tl.int32)
        w = (w & 0x807F) | (exp << 7)
        tl.store(out + where, w.to(tl.int16), mask=live)

    _KERNELS = (words, escapes)
    return _KERNELS


def _decode_triton(record: torch.Tensor, rec: Record, out: torch.Tensor) -> None:
    words, escapes = _KERNELS
    if rec.words % 2:                       # chunks are 512-byte multiples: never here
        _decode_torch(record, rec, out)
        return
    pairs = rec.words // 2
    words[(-(-pairs // BLOCK),)](record, record[rec.sm:rec.sm + 2 * pairs].view(torch.int16),
                                 record[rec.codes:rec.codes + pairs], out.view(torch.int32),
                                 pairs, BLOCK=BLOCK)
    if rec.escapes:
        positions = record[rec.where:rec.where + 4 * rec.escapes].view(torch.int32)
        escapes[(-(-rec.escapes // 1024),)](record, positions, out.view(torch.int16),
                                           rec.escapes, rec.exponents, rec.words, BLOCK=1024)
