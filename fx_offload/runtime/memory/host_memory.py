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
import math

import torch

from ...copy_rules import ALIGN
from ...layout import layout_of, span

log = logging.getLogger("fx_offload")
_FALLBACK_WARNED = False


def _page_lock(buffer: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
    """(buffer, registered, pinned): ``buffer`` locked in place, or a pinned copy, or
    itself, pageable."""
    global _FALLBACK_WARNED
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        torch.cuda.check_error(rc)
        return buffer, True, True
    except Exception as err:          # no CUDA runtime, or registering refused
        try:
            return buffer.pin_memory(), False, True
        except RuntimeError:
            if not _FALLBACK_WARNED:
                _FALLBACK_WARNED = True
                log.warning("fx_offload: pinned host memory unavailable (%s); copies fall "
                            "back to pageable memory and will be slower", err)
            return buffer, False, False


def views_into(buffer: torch.Tensor, layout: tuple,
               own_storage: bool = False) -> dict[str, torch.Tensor]:
    """Tensors laid out in the flat uint8 ``buffer`` as ``layout`` says.  ``own_storage``:
    each on a storage of its own, a slice of the buffer's (which it keeps alive), so that
    ``torch.save`` of several of them (a layer's bf16 weight and fp32 norm, a quantized
    weight's int8 data and bf16 scale) does not find one storage viewed as several dtypes,
    which it refuses; a host block's views are what the parameters hold between calls."""
    views = {}
    storage = buffer.untyped_storage() if own_storage else None
    for key, offset, shape, stride, dtype in layout:
        n = span(shape, stride)     # past the gaps its strides leave
        if storage is not None:
            start = buffer.storage_offset() + offset
            views[key] = torch.empty(0, dtype=dtype).set_(
                storage[start:start + max(n, 1) * dtype.itemsize], 0, shape, stride)
            continue
        flat = buffer[offset:offset + n * dtype.itemsize].view(dtype)
        views[key] = flat.as_strided(shape, stride) if n else flat.view(shape)
    return views


def viewed_elsewhere(view: torch.Tensor) -> bool:
    """Some tensor besides ``view`` (a host block's view, which has a storage of its own:
    :func:`views_into`) holds its storage: a ``p.data`` or ``state_dict()`` value the user
    kept, a parameter object swapped out.  Writing the view would change what they hold,
    which a plain model never does when a parameter is given other storage.  Counted with
    the storage's use count, less what asking for it adds (measured on a fresh tensor); where
    torch does not say, every view counts as held elsewhere."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return True
    fresh = torch.empty(1)
    asked, probe = view.untyped_storage(), fresh.untyped_storage()   # held while counted
    return count(asked._cdata) > count(probe._cdata)     # the probe: one tensor, the asking


def _zero_gaps(buffer: torch.Tensor, layout: tuple, total: int) -> None:
    """Zero the alignment padding between tensors, and the whole span of a tensor whose
    strides leave gaps (before its values are written): never read, but copied with them,
    and compressed with them (``compress="lossless"``: random bytes there would be escapes)."""
    ends = [offset + (0 if span(shape, stride) > math.prod(shape) else
                      dtype.itemsize * math.prod(shape))
            for _, offset, shape, stride, dtype in layout]
    starts = [offset for _, offset, *_ in layout[1:]] + [total]
    for end, start in zip(ends, starts):
        if start > end:
            buffer[end:start].zero_()


class HostBlock:
    """Contiguous host memory for the masters of one layer."""

    def __init__(self, tensors: dict[str, torch.Tensor], fill=None, pin: bool = True,
                 align: int = ALIGN):
        """``tensors`` give the layout (meta tensors will do) and, unless ``fill(views)``
        writes the values, the values.  ``pin=False``: plain host memory (a CPU run)."""
        self.layout, total = layout_of(tensors, align)
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        _zero_gaps(buffer, self.layout, total)
        self.registered = self.pinned = False
        self.mapping = None             # the file mapping holding the block (file_backed)
        if pin:
            buffer, self.registered, self.pinned = _page_lock(buffer)
        self.buffer = buffer
        self.remake_views()
        if fill is not None:
            fill(self.views)
        else:
            for key, t in tensors.items():
                self.views[key].copy_(t.detach())

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def in_file(self) -> bool:
        return self.mapping is not None

    def pin(self) -> None:
        """Page-lock a block made with ``pin=False`` (in place, or as a pinned copy: take
        ``views`` anew)."""
        if not self.pinned:
            self.buffer, self.registered, self.pinned = _page_lock(self.buffer)
            self.remake_views()

    def lock_in_place(self) -> None:
        """Page-lock the block where it is, or leave it pageable (never a copy: the
        parameters view it)."""
        if self.pinned:
            return
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
            torch.cuda.check_error(rc)
            self.registered = self.pinned = True
        except Exception as err:      # copies from it are then slower, still right
            log.info("fx_offload: a host block stays pageable (%s)", err)

    def to_file(self, folder: str) -> None:
        """Move an unpinned block into a file in ``folder`` (:mod:`.file_backed`): take
        ``views`` anew.  Raises ``OSError`` with the block as it was."""
        from .file_backed import to_file
        self.buffer, self.mapping = to_file(self.buffer, folder)
        self.remake_views()

    def remake_views(self) -> None:
        """The tensors the layer's parameters view between calls, made anew over
        ``buffer`` (after it moved, or after something moved the old ones off it)."""
        self.views = views_into(self.buffer, self.layout, own_storage=True)

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
