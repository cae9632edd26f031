"""Copy the rows of an expert tensor that a routing picked, driven from the device: after
the router the ids exist only there, so one Triton kernel reads the picked experts' rows of
the page-locked host tensor through its device address and writes them into the slot::

    mask[:] = 0 ; mask[ids] = 1                 # on the compute stream, after the router
    gather_rows(host[E, row], slot[E, row], mask)    # program (e, b): if mask[e], copy
                                                      # block b of row e across the link
                                                      # (or from the device's expert cache)

The CPU path uses ``index_copy_`` on the picked rows.  Why the device drives the copy, and
why the rows not picked may hold anything: docs/routed_experts.md, "At run time".
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:         # the CPU build of torch ships without Triton: the CPU path
    triton = None           # needs none; on a GPU, routed experts then move whole

BLOCK = 4096                # words of 4 bytes per program: 16 KiB in flight per program


if triton is not None:
    @triton.jit
    def _gather_rows(src, dst, mask, cache, where, row_words, CACHED: tl.constexpr,
                     BLOCK: tl.constexpr):
        expert = tl.program_id(0)
        if tl.load(mask + expert) != 0:
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            base = expert.to(tl.int64) * row_words
            keep = offs < row_words
            if CACHED:
                held = tl.load(where + expert)      # the expert's row in the device cache
                if held >= 0:
                    values = tl.load(cache + held.to(tl.int64) * row_words + offs, mask=keep)
                else:
                    values = tl.load(src + base + offs, mask=keep)
            else:
                values = tl.load(src + base + offs, mask=keep)
            tl.store(dst + base + offs, values, mask=keep)


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as int32 words where they divide evenly, else as bytes (one row per
    expert)."""
    flat = t.view(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def mark(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``mask`` (one entry per expert and one more) set to 1 where ``ids`` picks an expert,
    0 elsewhere; ids out of range (an expert-parallel sentinel) land on the extra entry,
    which no program reads."""
    num = mask.shape[0] - 1
    flat = ids.reshape(-1).to(torch.int64)
    mask.zero_()
    mask.index_fill_(0, torch.where((flat >= 0) & (flat < num), flat, num), 1)
    return mask


def gather_rows(host: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor,
                cache: torch.Tensor | None = None, where: torch.Tensor | None = None) -> None:
    """Copy the rows ``e`` of ``host`` (page-locked, or plain memory on a CPU run) with
    ``mask[e]`` set into the same rows of ``slot``, on the current stream; with ``cache``
    (device rows of some experts, :mod:`.expert_cache`), those with ``where[e] >= 0`` from
    ``cache[where[e]]`` instead."""
    src, dst = words(host), words(slot)
    held = None if cache is None else words(cache)
    if slot.device.type == "cpu":
        picked = mask[:-1].nonzero().reshape(-1)
        if held is not None:
            rows = where[picked]
            cached = rows >= 0
            dst.index_copy_(0, picked[cached], held.index_select(0, rows[cached]))
            picked = picked[~cached]
        dst.index_copy_(0, picked, src.index_select(0, picked))
        return
    row = src.shape[1]
    grid = (src.shape[0], triton.cdiv(row, BLOCK))
    with torch.cuda.device(slot.device):    # Triton launches on the current device
        _gather_rows[grid](src, dst, mask, src if held is None else held,
                           mask if where is None else where, row, CACHED=held is not None,
                           BLOCK=BLOCK)
