"""Host master copies of offloaded weights: one page-locked block per layer.

``Tensor.pin_memory()`` goes through torch's caching host allocator, which rounds every
allocation up to a power of two: per-parameter masters of a Llama-like layer took 1.3x
their size in host memory on the GPU machine.  Here each layer's masters are views into one
plain host allocation that is page-locked in place with ``cudaHostRegister``, so the host
holds each weight once.  Where registering fails, ``pin_memory()`` is tried, then pageable
memory with one warning (copies are then slower, still correct).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("fx_offload")
_ALIGN = 512                      # bytes; keeps every view aligned for the copy engine
_FALLBACK_WARNED = False


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostBlock:
    """Contiguous host memory for the masters of one layer."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        global _FALLBACK_WARNED
        offsets, total = {}, 0
        for key, t in tensors.items():
            offsets[key] = total
            total += _round_up(_nbytes(t))
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        self.registered = False
        self.pinned = False
        try:
            rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
            torch.cuda.check_error(rc)
            self.registered = self.pinned = True
        except Exception as err:          # no CUDA runtime, or registering refused
            try:
                buffer = buffer.pin_memory()
                self.pinned = True
            except RuntimeError:
                if not _FALLBACK_WARNED:
                    _FALLBACK_WARNED = True
                    log.warning("fx_offload: pinned host memory unavailable (%s); copies fall "
                                "back to pageable memory and will be slower", err)
        self.buffer = buffer
        self.views = {}
        for key, t in tensors.items():
            start = offsets[key]
            flat = buffer[start:start + _nbytes(t)].view(t.dtype)
            view = flat.view(t.shape) if t.is_contiguous() else flat.as_strided(
                t.shape, t.stride())
            view.copy_(t.detach())
            self.views[key] = view

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def release(self) -> None:
        """Unlock the memory; the views must not be used for copies afterwards."""
        if self.registered:
            self.registered = False
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())

    def __del__(self):
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
