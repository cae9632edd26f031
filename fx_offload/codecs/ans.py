"""nvCOMP's ANS codec for the records of ``compress="lossless"`` on a GPU, where nvCOMP's
library (the ``nvidia-libnvcomp-cu13`` wheel) is installed; :mod:`.lossless` is the codec
elsewhere.  Called through nvCOMP's batched C API (``ctypes``): its decode is kernel
launches on the stream it is given, with device arrays we own, so a CUDA graph can capture
it (nvCOMP's Python API keeps its arrays alive from a host callback, which a replayed graph
runs again on objects long freed).

A chunk (:mod:`fx_offload.layout`) is cut into ``PIECE``-byte pieces, each compressed on
its own by rANS over its bf16 words read as 16-bit floats (the exponent's skew is what it
codes); the record holds nvCOMP's pieces and the table its decode reads on the device::

    record of a chunk of n bytes in P = ceil(n / PIECE) pieces (int64 fields)
    [ P | PIECE | table: 4 rows of P                    | piece 0 | piece 1 | ... | room ]
      16 B        where each piece is in the record,     each at a multiple    1/128 + 64 B:
                  its bytes; where it goes in the chunk, of 16 bytes           new weights
                  its raw bytes                                                of the same
                                                                               kind fit

    decode (on the stream it is called on, no host synchronisation):
        from = record's address + table[0];  to = slot's address + table[2]   (two adds)
        nvcompBatchedANSDecompressAsync(from, table[1], table[3], ..., to, stream)

The record's size is fixed when it is first made (the staged copy and a captured graph move
that many bytes); the table says where the pieces end, so the room is never decoded.  The
checks are those of :mod:`.lossless`.  The two codecs' ratios and rates: docs/compression.md
(the two codecs) and docs/notes/2026-11-24-lossless-compression.md.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import logging
import os

import torch

from ..errors import OffloadError
from . import lossless

log = logging.getLogger("fx_offload")

NAME = "nvCOMP ANS"
ENV = "FX_OFFLOAD_LOSSLESS_CODEC"       # "auto" (the default), "nvcomp", "fx_offload"
PIECE = 1 << 16                         # bytes of a piece nvCOMP codes on its own
HEADER = 16
_FLOAT16 = 10                           # nvcompType_t NVCOMP_TYPE_FLOAT16
_ALIGN = 16                             # of pieces, table and temporary space: ANS's


@dataclasses.dataclass(frozen=True)
class AnsRecord:
    """One chunk's nvCOMP record: its sizes and checksum."""

    raw_nbytes: int
    pieces: int
    nbytes: int             # the record's size: header, table, pieces and room
    checksum: int


class _CompressOpts(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int),
                ("max_sub_chunk_count", ctypes.c_uint8), ("states_per_lane", ctypes.c_uint8),
                ("histogram_reduction_log2", ctypes.c_uint8), ("reserved", ctypes.c_char * 53)]


class _DecompressOpts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int),
                ("max_sub_chunk_count", ctypes.c_uint8), ("states_per_lane", ctypes.c_uint8),
                ("skip_validate", ctypes.c_uint8), ("reserved", ctypes.c_char * 53)]


@functools.cache
def _library():
    """nvCOMP's library, with the argument types of the functions used; None where it is not
    installed or does not load."""
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = os.path.join(list(spec.submodule_search_locations)[0], "lib64")
        lib = ctypes.CDLL(os.path.join(folder, "libnvcomp.so.6"), mode=ctypes.RTLD_LOCAL)
    except (ImportError, OSError) as err:
        log.debug("fx_offload: nvCOMP not loadable (%s); lossless records use our codec", err)
        return None
    size, ptr, p_size = ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    lib.nvcompBatchedANSCompressGetMaxOutputChunkSize.argtypes = [size, _CompressOpts, p_size]
    lib.nvcompBatchedANSCompressGetTempSize.argtypes = [size, size, _CompressOpts, p_size,
                                                        size, ptr]
    lib.nvcompBatchedANSCompressAsync.argtypes = [ptr, ptr, size, size, ptr, size, ptr, ptr,
                                                  _CompressOpts, ptr, ptr]
    lib.nvcompBatchedANSDecompressGetTempSize.argtypes = [size, size, _DecompressOpts, p_size,
                                                          size, ptr]
    lib.nvcompBatchedANSDecompressAsync.argtypes = [ptr, ptr, ptr, ptr, size, ptr, size, ptr,
                                                    _DecompressOpts, ptr, ptr]
    return lib


def _compress_opts() -> _CompressOpts:
    return _CompressOpts(type=0, data_type=_FLOAT16)        # nvcomp_rANS


@functools.cache
def _decompress_opts() -> _DecompressOpts:     # made once: every decode passes it
    return _DecompressOpts(backend=0, data_type=_FLOAT16)   # the default backend


def _call(name: str, *args) -> None:
    status = getattr(_library(), name)(*args)
    if status != 0:
        raise RuntimeError(f"nvCOMP's {name} returned status {status}")


def available(device: torch.device) -> bool:
    """Whether records for ``device`` are nvCOMP's: a GPU, nvCOMP's library loads, and
    ``FX_OFFLOAD_LOSSLESS_CODEC`` does not say ``fx_offload``."""
    wanted = os.environ.get(ENV, "auto")
    if wanted not in ("auto", "nvcomp", "fx_offload"):
        raise OffloadError(
            f"the environment variable {ENV}={wanted!r} chooses the codec of "
            "compress='lossless': give 'auto' (nvCOMP's ANS on a GPU where nvCOMP is "
            "installed, else fx_offload's), 'nvcomp' or 'fx_offload', or unset it",
            where="fx_offload")
    if wanted == "fx_offload" or device.type != "cuda":
        return False
    if _library() is None and wanted == "nvcomp":
        raise OffloadError(
            f"the environment variable {ENV}=nvcomp asks for nvCOMP's codec, but nvCOMP's "
            "library does not load: pip install nvidia-libnvcomp-cu13, or unset the variable "
            "(fx_offload's own codec is used then)", where="fx_offload")
    return _library() is not None


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _room(used: int) -> int:
    return _up(used + (used >> 7) + 64)


@functools.cache
def _decode_temp_bytes(pieces: int) -> int:
    temp = ctypes.c_size_t()
    _call("nvcompBatchedANSDecompressGetTempSize", pieces, PIECE, _decompress_opts(),
          ctypes.byref(temp), pieces * PIECE, None)
    return temp.value


def encode(raw: torch.Tensor, work_device: torch.device,
           fit: AnsRecord | None = None) -> tuple[torch.Tensor, AnsRecord] | None:
    """The record of the bf16 words in ``raw`` (flat uint8 bytes, an even count), made on the
    GPU ``work_device``, as a CPU uint8 tensor and its :class:`AnsRecord`; None where it is
    not worth it (at least ``lossless.WORTH`` of the raw size) or, given ``fit`` (the record
    it replaces), where it does not fit that record's size."""
    # nvCOMP launches on the current device: a model on cuda:1 while it is cuda:0 too
    with torch.cuda.device(work_device):
        return _encode(raw, work_device, fit)


def _encode(raw: torch.Tensor, work_device: torch.device,
            fit: AnsRecord | None) -> tuple[torch.Tensor, AnsRecord] | None:
    n = raw.numel()
    if n % 2:
        raise ValueError("a bf16 chunk has an even number of bytes")
    stream = torch.cuda.current_stream(work_device).cuda_stream
    src = raw.to(work_device)
    pieces = -(-n // PIECE)
    i64 = dict(dtype=torch.int64, device=work_device)
    raw_at = torch.arange(pieces, **i64) * PIECE
    raw_bytes = (n - raw_at).clamp_(max=PIECE)
    most = ctypes.c_size_t()
    _call("nvcompBatchedANSCompressGetMaxOutputChunkSize", PIECE, _compress_opts(),
          ctypes.byref(most))
    stride = _up(most.value)
    spaced = torch.zeros(pieces * stride, dtype=torch.uint8, device=work_device)
    temp = ctypes.c_size_t()
    _call("nvcompBatchedANSCompressGetTempSize", pieces, PIECE, _compress_opts(),
          ctypes.byref(temp), n, None)
    scratch = torch.empty(max(temp.value, 1), dtype=torch.uint8, device=work_device)
    packed_bytes = torch.zeros(pieces, **i64)
    statuses = torch.zeros(pieces, dtype=torch.int32, device=work_device)
    sources = raw_at + src.data_ptr()
    targets = torch.arange(pieces, **i64) * stride + spaced.data_ptr()
    _call("nvcompBatchedANSCompressAsync", sources.data_ptr(), raw_bytes.data_ptr(), PIECE,
          pieces, scratch.data_ptr(), temp.value, targets.data_ptr(), packed_bytes.data_ptr(),
          _compress_opts(), statuses.data_ptr(), stream)
    if int(statuses.abs().sum()):           # a sync: the sizes are needed on the host anyway
        log.error("fx_offload: nvCOMP could not compress a chunk; it is copied uncompressed")
        return None
    padded = (packed_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
    first = _up(HEADER + 32 * pieces)
    at = first + torch.cumsum(padded, 0) - padded
    used = first + int(padded.sum())
    nbytes = fit.nbytes if fit is not None else _room(used)
    if used > nbytes or nbytes > lossless.WORTH * n:
        return None
    out = torch.zeros(nbytes, dtype=torch.uint8, device=work_device)
    out[:HEADER].view(torch.int64).copy_(torch.tensor([pieces, PIECE]))
    table = torch.stack([at, packed_bytes, raw_at, raw_bytes])
    out[HEADER:HEADER + 32 * pieces].view(torch.int64).copy_(table.flatten())
    keep = torch.arange(stride, device=work_device)[None, :] < padded[:, None]
    out[first:used] = spaced.view(pieces, stride)[keep]
    rec = AnsRecord(n, pieces, nbytes, lossless.checksum(out))
    back = torch.empty_like(src)
    if not _decode(out, rec, back) or not torch.equal(back, src):
        log.error("fx_offload: an nvCOMP record did not decode to its bytes; that chunk is "
                  "copied uncompressed (please report this)")
        return None
    return out.cpu(), rec


def trusted(record: torch.Tensor, rec: AnsRecord, device: torch.device) -> torch.Tensor:
    """The record's table on ``device``, made when the record is: the decode reads where
    the pieces are from it, not from the staged record, so a record corrupted in host memory
    cannot send nvCOMP outside the record or its chunk (the device check then finds it)."""
    return _table(record, rec).to(device)


def _table(record: torch.Tensor, rec: AnsRecord) -> torch.Tensor:
    return record[HEADER:HEADER + 32 * rec.pieces].view(torch.int64).view(4, rec.pieces)


def decode(record: torch.Tensor, rec: AnsRecord, out: torch.Tensor,
           table: torch.Tensor | None = None) -> None:
    """Write the chunk's raw bytes into ``out`` (uint8 on a GPU, ``rec.raw_nbytes``) from
    ``record`` (on that GPU), on the current stream, with no host synchronisation.
    ``table``: :func:`trusted`'s, else the record's own is read."""
    with torch.cuda.device(out.device):         # as in encode
        _decode(record, rec, out, table, check=False)


def _decode(record: torch.Tensor, rec: AnsRecord, out: torch.Tensor,
            table: torch.Tensor | None = None, check: bool = True) -> bool:
    lossless.check_sizes(record, rec, out)
    p = rec.pieces
    table = _table(record, rec) if table is None else table
    sources = table[0] + record.data_ptr()      # kernels on this stream, as nvCOMP's is:
    targets = table[2] + out.data_ptr()         # freed tensors are reused after it only
    produced = torch.empty(p, dtype=torch.int64, device=out.device)
    statuses = torch.empty(p, dtype=torch.int32, device=out.device)
    temp_bytes = _decode_temp_bytes(p)
    scratch = torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=out.device)
    _call("nvcompBatchedANSDecompressAsync", sources.data_ptr(), table[1].data_ptr(),
          table[3].data_ptr(), produced.data_ptr(), p, scratch.data_ptr(), temp_bytes,
          targets.data_ptr(), _decompress_opts(), statuses.data_ptr(),
          torch.cuda.current_stream(out.device).cuda_stream)
    return not check or (not int(statuses.abs().sum()) and torch.equal(produced, table[3]))
