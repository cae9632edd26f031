"""Weights read from a checkpoint one tensor at a time, straight into the memory that keeps
them, and models built without weights to receive them.

A model too big for the GPU is often too big to hold twice in host memory, so
:func:`fx_offload.place` never loads a whole state dict: each tensor is read from its file
into its final place::

    safetensors file ──read──▶ host block view        (an offloaded layer's weight)
                     ──read──▶ staging ──copy──▶ device tensor   (everything else)

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the bytes; reading a range with ``readinto``
into the destination's memory is the whole loader.  Page cache is the kernel's, not the
process's: peak resident memory is what the model keeps plus one staging tensor.  A mapping
of name to tensor is copied from instead.  The sources, the conversions and
:func:`empty_weights`: docs/usage.md (A model bigger than the GPU).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import math
import os
import threading
from typing import Iterator, Mapping

import torch
from torch import nn

from .errors import OffloadError

log = logging.getLogger("fx_offload")
WHERE = "fx_offload.place"
NAMES_SHOWN = 5                 # names an error quotes
_HEADER_LIMIT = 100 << 20       # a header larger than this is not a safetensors header
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are in a safetensors file."""
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int          # from the start of the file
    nbytes: int


class Checkpoint:
    """Named tensors to read, from safetensors files or from a mapping."""

    def __init__(self, entries: dict[str, Entry] | None = None,
                 mapping: Mapping[str, torch.Tensor] | None = None, where: str = ""):
        self._entries, self._mapping, self.where = entries, mapping, where
        self._files: dict[str, object] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    # ---- opening -----------------------------------------------------------------------
    @classmethod
    def open(cls, source) -> "Checkpoint":
        """A checkpoint from a path (file or ``save_pretrained`` folder) or a mapping."""
        if isinstance(source, Checkpoint):
            return source
        if isinstance(source, Mapping):
            bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)][:NAMES_SHOWN]
            if bad:
                raise OffloadError(f"checkpoint mapping values must be tensors; {bad} are not",
                                   where=WHERE)
            return cls(mapping=source, where="the mapping given")
        if not isinstance(source, (str, os.PathLike)):
            raise OffloadError(
                f"checkpoint must be a path (a .safetensors file or a folder written by "
                f"save_pretrained) or a mapping of name to tensor, not {type(source).__name__}",
                where=WHERE)
        path = os.fspath(source)
        if os.path.isdir(path):
            return cls(entries=_read_folder(path), where=path)
        if os.path.isfile(path):
            return cls(entries=_read_header(path), where=path)
        raise OffloadError(f"checkpoint {path!r} does not exist", where=WHERE)

    def __contains__(self, name: str) -> bool:
        source = self._entries if self._entries is not None else self._mapping
        return name in source

    def keys(self) -> list[str]:
        return list(self._entries if self._entries is not None else self._mapping)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if self._entries is not None:
            e = self._entries[name]
            return e.shape, e.dtype
        t = self._mapping[name]
        return tuple(t.shape), t.dtype

    # ---- reading -----------------------------------------------------------------------
    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Write tensor ``name`` into ``dest`` (same shape; any dtype and device: converted
        as ``copy_`` does)."""
        shape, dtype = self.spec(name)
        if tuple(dest.shape) != shape:   # checked by check_model; a guard for other callers
            raise OffloadError(f"{name} is {shape} in {self.where} but {tuple(dest.shape)} in "
                               "the model", where=WHERE)
        with torch.no_grad():
            if self._entries is None:
                dest.copy_(self._mapping[name])
            elif dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous():
                self._read_bytes(name, self._entries[name], dest)
            else:
                staging = torch.empty(shape, dtype=dtype)
                self._read_bytes(name, self._entries[name], staging)
                dest.copy_(staging)
        self.bytes_read += math.prod(shape) * dtype.itemsize

    def _read_bytes(self, name: str, entry: Entry, dest: torch.Tensor) -> None:
        if entry.nbytes == 0:
            return
        with self._lock:
            try:
                self._read_locked(entry, dest)
            except OSError as error:
                # the file was there when the checkpoint was opened: it moved, was removed
                # or became unreadable since (a shard still downloading, a disk unmounted)
                raise OffloadError(
                    f"reading {name} from {entry.file} failed ({error}); it was readable when "
                    f"{self.where} was opened. Check that every file of the checkpoint is in "
                    "place and readable, then place the model again", where=WHERE) from None

    def _read_locked(self, entry: Entry, dest: torch.Tensor) -> None:
        f = self._files.get(entry.file)
        if f is None:
            f = self._files[entry.file] = open(entry.file, "rb", buffering=0)
        view = memoryview((ctypes.c_char * entry.nbytes).from_address(dest.data_ptr()))
        view = view.cast("B")
        f.seek(entry.offset)
        done = 0
        while done < entry.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise OffloadError(f"{entry.file} ends before the bytes of a tensor; the "
                                   "file is truncated", where=WHERE)
            done += got

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_header(path: str) -> dict[str, Entry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(_HEADER_LIMIT, size - 8):
            raise OffloadError(f"{path} is not a safetensors file (no valid header); give a "
                               "safetensors file, a save_pretrained folder, or a state dict",
                               where=WHERE)
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise OffloadError(f"{path} is not a safetensors file ({err})", where=WHERE) \
                from None
    start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise OffloadError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, which "
                               "this torch cannot hold", where=WHERE)
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or start + end > size:
            raise OffloadError(f"{path}: tensor {name}'s byte range [{begin}, {end}) does not "
                               f"fit its shape {shape} and dtype, or the file", where=WHERE)
        entries[name] = Entry(path, dtype, shape, start + begin, nbytes)
    return entries


def _read_folder(path: str) -> dict[str, Entry]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        entries = {}
        for shard in sorted(set(weight_map.values())):
            _check_shard(index, path, shard, weight_map)
            for name, entry in _read_header(os.path.join(path, shard)).items():
                if weight_map.get(name) == shard:
                    entries[name] = entry
        missing = sorted(set(weight_map) - set(entries))[:NAMES_SHOWN]
        if missing:
            raise OffloadError(f"{index} names tensors its shards do not hold: {missing}",
                               where=WHERE)
        return entries
    if os.path.isfile(single):
        return _read_header(single)
    found = sorted(os.listdir(path))[:NAMES_SHOWN]
    raise OffloadError(
        f"{path} holds no model.safetensors or model.safetensors.index.json (found {found}); "
        "save the model with save_pretrained (safetensors), or give the file itself",
        where=WHERE)


def _check_shard(index: str, path: str, shard: str, weight_map: dict) -> None:
    """The shard ``index`` names is a file: checked before any tensor is read, so that a
    missing one leaves the model as it was."""
    if os.path.isfile(os.path.join(path, shard)):
        return
    held = sorted(name for name, s in weight_map.items() if s == shard)
    more = f" and {len(held) - NAMES_SHOWN} more" if len(held) > NAMES_SHOWN else ""
    raise OffloadError(
        f"{index} names the shard {shard!r}, which is not in {path}; it should hold "
        f"{len(held)} tensor(s) ({held[:NAMES_SHOWN]}{more}). Copy the shard into the folder "
        "(an interrupted download?), or save the model again; nothing was placed",
        where=WHERE)


# ---- the model's side ----------------------------------------------------------------
@dataclasses.dataclass
class Sources:
    """For each of a model's tensors (by identity), the checkpoint name it is read from."""
    names: dict[int, str]

    def name_of(self, t: torch.Tensor) -> str | None:
        return self.names.get(id(t))


def check_model(model: nn.Module, checkpoint: Checkpoint | None) -> Sources:
    """Match ``model``'s parameters and buffers with ``checkpoint`` before any memory moves:
    every tensor on the meta device must be in it, with its shape.  Returns where each
    tensor is read from; a tensor not in the checkpoint keeps its values."""
    saved = set(model.state_dict(keep_vars=True).keys())
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    found, missing, unsaved, wrong = {}, [], [], []
    for key, t in tensors.items():
        name = next((n for n in names[key] if checkpoint is not None and n in checkpoint), None)
        if name is None:
            if t.device.type == "meta":
                (missing if any(n in saved for n in names[key]) else unsaved).append(names[key][0])
            continue
        shape, _ = checkpoint.spec(name)
        if shape != tuple(t.shape):
            wrong.append(f"{name}: {shape} in the checkpoint, {tuple(t.shape)} in the model")
        found[key] = name
    if unsaved:
        raise OffloadError(
            f"buffers {unsaved[:NAMES_SHOWN]} are on the meta device and no checkpoint saves "
            "them (they are computed when the model is built); build the model under "
            "fx_offload.empty_weights(), which puts only parameters on the meta device",
            where=WHERE)
    if missing and checkpoint is None:
        raise OffloadError(
            f"{len(missing)} tensors are on the meta device ({missing[:NAMES_SHOWN]}...) and no "
            "checkpoint was given; pass checkpoint=<save_pretrained folder, .safetensors file or "
            "state dict>, or build the model with real weights", where=WHERE)
    per_expert = _experts_saved_apart(missing, checkpoint) if missing else None
    if per_expert:
        raise OffloadError(
            f"{checkpoint.where} keeps the experts of an MoE layer one tensor per expert (e.g. "
            f"{per_expert[1]!r}) where the model holds them fused in one tensor ({per_expert[0]!r}; "
            "Hugging Face saves fused experts that way and converts them when it loads); "
            "place() reads tensors by name and does not convert them: load the model with "
            "from_pretrained and place it without a checkpoint, or give checkpoint=<the "
            "loaded model's state_dict()>", where=WHERE)
    if missing:
        raise OffloadError(
            f"{len(missing)} tensors on the meta device are not in {checkpoint.where} (e.g. "
            f"{missing[:NAMES_SHOWN]}; it has e.g. {checkpoint.keys()[:NAMES_SHOWN]}); give the "
            "checkpoint of this model", where=WHERE)
    if wrong:
        raise OffloadError(f"shapes differ: {wrong[:NAMES_SHOWN]}; give the checkpoint of this "
                           "model (or a model built from its config)", where=WHERE)
    if checkpoint is not None:
        known = {n for ns in names.values() for n in ns}
        unused = [k for k in checkpoint.keys() if k not in known]
        if unused:
            log.warning("fx_offload: %d tensors of %s are not in the model and are not read "
                        "(e.g. %s)", len(unused), checkpoint.where, unused[:NAMES_SHOWN])
    return Sources(found)


def _experts_saved_apart(missing: list[str], checkpoint: Checkpoint) -> tuple[str, str] | None:
    """(a missing fused expert tensor, a checkpoint key of one of its experts) where the
    checkpoint holds, for a missing ``<prefix>.experts.<name>``, keys ``<prefix>.experts.<i>.``
    (one tensor per expert), else None."""
    for name in missing:
        prefix, dot, _ = name.rpartition(".")
        if not dot or not prefix.endswith("experts"):
            continue
        apart = next((k for k in checkpoint.keys() if k.startswith(prefix + ".")
                      and k[len(prefix) + 1:].split(".", 1)[0].isdigit()), None)
        if apart is not None:
            return name, apart
    return None


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no memory, no initialization
    cost) and whose buffers are real, ready for ``fx_offload.place(model, device,
    checkpoint=...)``.  Not thread-safe: it swaps ``nn.Module.register_parameter`` for the
    duration of the ``with`` block."""
    original = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad) \
                if isinstance(param, nn.Parameter) else param.to("meta")
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original
