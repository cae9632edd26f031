"""On a GPU, every compressed record is verified where it lands, in stream order and with no
host synchronisation (on the CPU, :func:`fx_offload.codecs.lossless.check` verifies a record
before its decode)::

    copy stream     H2D record -> staging[k]
    decode stream   decode(staging[k]) -> slot chunk   (sizes, addresses: trusted memory)
                    check, one launch: each program adds its block's share of the checksum
                    into tally[k]; the last to finish compares the total with sums[c] and,
                    where they differ, fills the chunk with 0xFFFF words (a bf16 NaN) and
                    sets flags[c] (page-locked); it leaves tally[k] zero
    next call       flags set -> OffloadError naming the chunk

The next call's entry raises it, reading the flags without waiting for the device
(:meth:`.compressed_layers.CompressedLayers.raise_if_corrupt`).  The check costs one read of
the record on the device and one kernel launch per chunk.  Why the call that copies a
corrupt record computes with NaN and the next one raises, and the cost measured:
docs/compression.md, "Checks".
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:         # the CPU build: records are checked on the host there
    triton = None

BLOCK = 4096                # int64 words of the record a program adds up
POISON = 8192               # int32 words the last program writes per step, where it must

if triton is not None:
    @triton.jit
    def _check(words, n, tally, expected, flag, out, n_out, BLOCK: tl.constexpr,
               POISON: tl.constexpr):
        # lossless.checksum's terms: word i times 2 * (i mod 65536) + 1, wrapping at 2**64
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(words + i, mask=i < n, other=0)
        tl.atomic_add(tally, tl.sum(w * ((i % 65536) * 2 + 1), axis=0))
        # acq_rel: every program's add comes before its count, so the last to count sees all
        if tl.atomic_add(tally + 1, 1) == tl.num_programs(0) - 1:
            total = tl.atomic_xchg(tally, 0)
            tl.atomic_xchg(tally + 1, 0)
            if total != tl.load(expected):
                tl.store(flag, 1)
                for start in range(0, n_out, POISON):
                    j = start + tl.arange(0, POISON)
                    tl.store(out + j, tl.full([POISON], -1, tl.int32), mask=j < n_out)


def available() -> bool:
    return triton is not None


def new_tally(device: torch.device) -> torch.Tensor:
    """What one check at a time adds up in (its total and its programs' count); each check
    leaves it zero."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def check(staged: torch.Tensor, tally: torch.Tensor, expected: torch.Tensor,
          flag: torch.Tensor, out: torch.Tensor) -> None:
    """After the decode of ``staged`` (a record on the GPU, a multiple of 8 bytes) into
    ``out`` (the slot chunk, uint8, a multiple of 4 bytes), on the current stream: where the
    record's checksum is not ``expected`` (an int64 on the device), fill ``out`` with 0xFF
    bytes and set ``flag`` (an int32 in page-locked host memory) to 1.  ``tally``:
    :func:`new_tally`'s, used by no other check at the same time."""
    words, dest = staged.view(torch.int64), out.view(torch.int32)
    grid = (triton.cdiv(words.numel(), BLOCK),)
    with torch.cuda.device(out.device):         # Triton launches on the current device
        _check[grid](words, words.numel(), tally, expected, flag, dest, dest.numel(),
                     BLOCK=BLOCK, POISON=POISON)
