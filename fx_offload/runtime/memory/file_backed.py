"""The uncompressed weights of a compressed layer kept in a file rather than in host memory
(``compress="lossless"``, option ``uncompressed_weights``)::

    in memory:   page-locked  [ raw block: the parameters' views ] [ records ]   1.75x
    in a file:   page-locked  [ records ]                                        0.75x
                 file         [ raw block ] <- mapped privately: the parameters' views

The copies into the slots read only the records (a layer moves to a file only when every
chunk of it has one and no gather reads its raw rows), so the raw block is read only by
the user's own reads of the weights (``state_dict``, ``restore``, a parameter's values) and
by the encoder after an update.  The file is mapped copy-on-write: the parameters stay
plain tensors viewing it, the OS pages it in when they are read and may drop those pages
again, and a write lands in private memory (a forked process does not see it, as with
ordinary memory).  The file has no name (it is unlinked as it is made), so nothing is left
on disk when the process ends, however it ends.
"""
from __future__ import annotations

import logging
import mmap
import os
import tempfile

import torch

from ...errors import OffloadError
from ...options import UNCOMPRESSED_WEIGHTS

log = logging.getLogger("fx_offload")

_RAM_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
MARGIN = 1 << 30            # bytes a folder must keep free beyond a layer's block
LATER = object()            # the folder, not looked up yet (SlotBuffers.raw_folder)


def filesystem_of(folder: str) -> str:
    """The type of the filesystem holding ``folder`` (Linux's mount table), or ""."""
    path, best, kind = os.path.realpath(folder), "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def folder_for(option: str, model_name: str) -> str | None:
    """The folder the raw blocks of ``model_name``'s compressed layers go to, or None to
    keep them in host memory.  ``option``: ``"auto"`` (the temporary folder, where it is
    on a disk), ``"memory"``, or a folder, which must exist and take files."""
    if option == "memory" or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    folder = tempfile.gettempdir() if option == "auto" else option
    if option != "auto":
        if not os.path.isdir(folder):
            raise OffloadError(f"{UNCOMPRESSED_WEIGHTS}; {folder} is not a folder: create "
                               "it, or give another")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OffloadError(f"{UNCOMPRESSED_WEIGHTS}; {folder} cannot be written to: "
                               "give a folder you may write in")
    kind = filesystem_of(folder)
    if kind in _RAM_FILESYSTEMS:
        if option == "auto":
            log.info("fx_offload: the uncompressed weights of %s stay in host memory: the "
                     "temporary folder %s is in memory (%s); give uncompressed_weights=<a "
                     "folder on a disk> to keep them there", model_name, folder, kind)
            return None
        log.warning("fx_offload: uncompressed_weights=%r is on a %s filesystem, which is "
                    "memory: host memory will not shrink", folder, kind)
    return folder


def room_in(folder: str, nbytes: int) -> bool:
    """``folder``'s filesystem has room for ``nbytes`` more, and :data:`MARGIN`."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= nbytes + MARGIN


def to_file(buffer: torch.Tensor, folder: str) -> tuple[torch.Tensor, mmap.mmap]:
    """A flat uint8 tensor holding ``buffer``'s bytes, backed by a private mapping of a new
    unnamed file in ``folder``, read back and compared before it is returned; its pages
    are dropped from memory.  Raises ``OSError`` (no room, no such folder, a short write)
    with ``buffer`` untouched."""
    n = buffer.numel()
    with tempfile.TemporaryFile(dir=folder, prefix="fx_offload-") as f:
        fd = f.fileno()
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, n)        # no room: an error now, not SIGBUS later
        else:                                   # pragma: no cover - not Linux
            os.ftruncate(fd, n)
        shared = mmap.mmap(fd, n, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            torch.frombuffer(shared, dtype=torch.uint8).copy_(buffer)
            shared.flush()
        finally:
            shared.close()      # no tensor of it is left: the one above is gone
        mapped = mmap.mmap(fd, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        moved = torch.frombuffer(mapped, dtype=torch.uint8)
        if not torch.equal(moved, buffer):
            raise OSError(f"the file in {folder} did not read back as written")
        # The pages just read back: let them go (they are read from the file again when
        # used).  Only here: on a private mapping this would also drop the user's writes.
        if hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return moved, mapped
