"""The two copies of a host KV cache, both driven from the device.

A layer's host cache ``[B, H, T, D]`` is page-locked host memory that the device reads and
writes through its mapped address; its slot is a device buffer of the same shape.  Each of
the ``B * H`` rows (one sequence, one head) holds its ``T`` tokens contiguously, so the
valid tokens of a row are one prefix of it::

    fill        host[r, :hi] -> slot[r, :hi]   hi = min(ceil(pos / block) * block, T)
    write_back  slot[r, idx] -> host[r, idx]   idx: the positions the step wrote

``pos`` (the tokens the cache held when the step began) and ``idx`` live on the device, in
buffers of the runtime's own: no length is read back to the host, so a step stays
capturable in a CUDA graph.  Each copy is one Triton kernel whose programs own a piece of
one row and return at once where it lies past ``hi``; the CPU path (tests, CPU runs) does
the same with ``.item()`` and ``index_copy_``.  Outside a CUDA-graph capture the fill runs
on the copy engine instead (:func:`fill_known`): the kernel reads the host memory through
SMs that the step's own compute also wants.  Where the lengths come from, in a capture and
outside one: docs/host_kv_cache.md, the paragraph "Lengths".
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:         # the CPU build of torch ships without Triton: the CPU path
    triton = None           # needs none

BLOCK = 4096                # words per program of the fill: 16 KiB in flight per program


if triton is not None:
    @triton.jit
    def _fill_prefix(src, dst, pos, done, row_words, token_words, block, tokens,
                     BLOCK: tl.constexpr):
        row = tl.program_id(1)
        start = tl.program_id(0) * BLOCK
        valid = tl.load(pos)
        hi = tl.minimum((valid + block - 1) // block * block, tokens) * token_words
        if start < hi and tl.load(done) == 0:
            offs = start + tl.arange(0, BLOCK)
            keep = offs < hi
            base = row.to(tl.int64) * row_words
            tl.store(dst + base + offs, tl.load(src + base + offs, mask=keep), mask=keep)

    @triton.jit
    def _put_tokens(src, dst, idx, tokens, token_words, WORDS: tl.constexpr):
        row = tl.program_id(1)
        at = tl.load(idx + tl.program_id(0))
        offs = tl.arange(0, WORDS)
        keep = offs < token_words
        base = (row.to(tl.int64) * tokens + at) * token_words
        tl.store(dst + base + offs, tl.load(src + base + offs, mask=keep), mask=keep)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` ``[B, H, T, D]`` as ``[B * H, T * D]`` words of 4 bytes where a token's bytes
    divide evenly, else bytes; and the words per token."""
    flat = t.reshape(t.shape[0] * t.shape[1], -1).view(torch.uint8)
    per_token = t.shape[3] * t.element_size()
    if per_token % 4 == 0:
        return flat.view(torch.int32), per_token // 4
    return flat, per_token


def rounded(valid: int, block: int, tokens: int) -> int:
    """The tokens a fill moves for ``valid`` cached tokens: whole blocks, at most ``T``."""
    return min(-(-valid // block) * block, tokens)


def fill(host: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, block: int,
         done: torch.Tensor) -> None:
    """Copy the blocks of ``host`` that hold the first ``pos`` tokens (a one-element device
    tensor) into ``slot``, on the current stream; nothing where ``done`` (a one-element
    device flag, read when the copy runs) is set: the slot was filled ahead
    (:class:`.next_call.BeforeReplay`)."""
    src, token_words = _rows(host)
    dst, _ = _rows(slot)
    tokens = host.shape[2]
    if slot.device.type != "cuda":
        if int(done.reshape(-1)[0]):
            return
        hi = rounded(int(pos.reshape(-1)[0]), block, tokens) * token_words
        dst[:, :hi] = src[:, :hi]
        return
    row_words = src.shape[1]
    grid = (triton.cdiv(row_words, BLOCK), src.shape[0])     # rows (B * H) on the short axis
    _fill_prefix[grid](src, dst, pos, done, row_words, token_words, block, tokens, BLOCK=BLOCK)


def fill_known(pinned: torch.Tensor, slot: torch.Tensor, tokens: int) -> None:
    """The fill when the host knows the length: the first ``tokens`` of each row of the
    page-locked ``pinned`` copied by the copy engine (one copy per row, one in all when
    the rows are whole), on the current stream."""
    if tokens <= 0:
        return
    if tokens == slot.shape[2] == pinned.shape[2]:
        slot.copy_(pinned, non_blocking=True)
        return
    src = pinned.reshape(-1, *pinned.shape[2:])
    dst = slot.reshape(-1, *slot.shape[2:])
    for row in range(src.shape[0]):
        dst[row, :tokens].copy_(src[row, :tokens], non_blocking=True)


def write_back(slot: torch.Tensor, host: torch.Tensor, idx: torch.Tensor) -> None:
    """Copy the tokens at positions ``idx`` (a device tensor) of every row of ``slot`` into
    ``host``, on the current stream."""
    if idx.numel() == 0:
        return
    if slot.device.type != "cuda":
        host.index_copy_(2, idx, slot.index_select(2, idx))
        return
    src, token_words = _rows(slot)
    dst, _ = _rows(host)
    grid = (idx.numel(), src.shape[0])     # a prefill's tokens exceed the y axis' 65535
    _put_tokens[grid](src, dst, idx, slot.shape[2], token_words,
                      WORDS=triton.next_power_of_2(token_words))
