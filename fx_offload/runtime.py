"""Run-time state of one offloaded model: host masters, static slot buffers, copy schedule.

The compiled graph reaches this state through an integer handle passed to the custom ops in
``ops.py``.  Slots have fixed addresses: an offloaded parameter's ``.data`` *is* its slot
tensor, so a compiled graph (and a CUDA graph captured from it) always reads the same memory,
and the copies below change what that memory holds.

Slot rotation.  Offloaded layers ``l_0 .. l_{n-1}`` with ``k = prefetch_step`` slots: ``l_i``
lives in slot ``i % k``.  After ``l_i`` has run, its slot is refilled with the next layer that
uses the same slot, ``l_{i+k}``, or, past the end, the first one, ``l_{i % k}``, for the next
call.  A slot used by one layer only is never refilled.

Correctness never depends on the schedule being followed: :meth:`OffloadState.wait` checks
which layer a slot holds and loads the right one synchronously if anything (a partial call,
eager use of a layer, a graph break) left the slot holding another layer.

On CUDA the copies run on one copy stream per device.  ``start`` records an event on the
compute stream and makes the copy stream wait for it before overwriting the slot, so the
copy cannot begin before the kernels that read the slot's previous layer; ``wait`` makes the
compute stream wait on the copy's done event.  Both work inside CUDA-graph capture, where the
fork (event wait) pulls the copy into the capture; ``join`` ends a captured forward by joining
copies that were forked during the capture.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import logging
import threading
import weakref
from typing import Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .host_memory import HostBlock, views_into
from .options import OffloadOptions
from .selection import LayerStack, OffloadedParam, rotation

log = logging.getLogger("fx_offload")

_HANDLES: dict[int, "weakref.ref[OffloadState]"] = {}
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, OffloadState]" = weakref.WeakKeyDictionary()
_BY_PARAM = WeakIdKeyDictionary()     # Parameter -> (OffloadState, layer index)
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


_RESTORED: set[int] = set()      # handles of restored states: their ops do nothing


class _Restored:
    """Stands in for a restored state: a compiled graph of a restored model reads the
    parameters' own (restored) data, and its offload ops have nothing left to do."""

    def wait(self, layer):
        pass

    def start(self, layer, target):
        pass

    def join(self):
        pass


def state_for_handle(handle: int) -> "OffloadState | _Restored":
    if handle in _RESTORED:
        return _Restored()
    ref = _HANDLES.get(handle)
    state = ref() if ref is not None else None
    if state is None:
        raise RuntimeError(
            f"fx_offload: offload state {handle} no longer exists (its model was garbage "
            "collected); compile the model again")
    return state


def state_for_model(model: nn.Module) -> "OffloadState | None":
    return _BY_MODEL.get(model)


def owner_of_param(param: torch.Tensor) -> "tuple[OffloadState, int] | None":
    return _BY_PARAM.get(param)


@dataclasses.dataclass
class _Pending:
    event: "torch.cuda.Event"
    in_capture: bool        # recorded while the stream was being captured into a CUDA graph


class OffloadState:
    """Masters, slots and the prefetch schedule for one model compiled with the backend."""

    # One copy per layer from a packed host block into a packed slot, rather than one copy
    # per parameter (see docs/benchmarks.md for the measurement that chose the default).
    packed = os.environ.get("FX_OFFLOAD_PACKED", "1") != "0"

    def __init__(self, model: nn.Module, options: OffloadOptions, stack: LayerStack,
                 params: dict[int, list[OffloadedParam]], check_owners: bool = True,
                 num_slots: int | None = None):
        self.handle = next(_NEXT_HANDLE)
        self.model_ref = weakref.ref(model)
        self.model_name = type(model).__name__
        self.options = options
        self.stack = stack
        self.layers: list[int] = sorted(params)
        n = len(self.layers)
        if n == 0:
            raise ValueError(
                "prefetch_offload selected no layer to offload with "
                f"group_size={options.group_size}, num_in_group={options.num_in_group} on a "
                f"stack of {len(stack.layers)} layers at {stack.path or '<root>'!r}")
        num_slots = options.prefetch_step if num_slots is None else num_slots
        if num_slots > n:
            raise ValueError(
                f"prefetch_offload option 'prefetch_step' ({options.prefetch_step}) is larger "
                f"than the number of offloaded layers ({n}: layers {self.layers}); use "
                f"prefetch_step <= {n}, or offload more layers (group_size/num_in_group)")
        for layer, ps in params.items() if check_owners else ():
            for p in ps:
                owner = _BY_PARAM.get(p.param)
                if owner is not None:
                    raise ValueError(
                        f"prefetch_offload: {p.name} is already offloaded (layer {owner[1]} of a "
                        f"{owner[0].model_name}); a model is offloaded once. Call "
                        "fx_offload.restore(model) before compiling it again differently")
        self.num_slots = num_slots
        self.params = params
        self.slot_of, self.target_of = rotation(self.layers, num_slots)
        self.planner = None     # the planner's choice and runner-ups, under memory_budget
        devices = {p.param.device for ps in params.values() for p in ps}
        if len(devices) != 1:
            raise ValueError(
                "prefetch_offload needs the offloaded layers' weights on one device, found "
                f"{sorted(str(d) for d in devices)}; move the model to one device first")
        self.device: torch.device = devices.pop()
        if self.device.type == "meta":
            raise ValueError(
                "prefetch_offload cannot offload weights on the meta device: load real "
                "weights into the model before compiling it")
        if self.device.type == "cpu":
            accel = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
            if accel:
                raise ValueError(
                    "prefetch_offload: the weights of the layers to offload are already on the "
                    f"host (cpu) while the rest of the model is on {accel}; move the whole "
                    "model to the GPU (model.to('cuda')) and let the backend offload them")
            if _cuda_available():
                log.warning(
                    "fx_offload: %s is on the CPU although CUDA is available: offloading "
                    "weights that are already in host memory saves nothing (it runs as a CPU "
                    "simulation); move the model to the GPU first", type(model).__name__)
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        self.slots: list[dict[str, torch.Tensor]] = []
        self.owner: list[int | None] = [None] * self.num_slots
        self.pending: dict[int, _Pending] = {}
        self.copy_stream = None
        self.materialized = False
        self.restored = False
        self.pinned = False
        self._hooks: list = []
        self._host_blocks: list[HostBlock] = []
        self._block_of: dict[int, HostBlock] = {}
        self.slot_flat: list[torch.Tensor] | None = None
        self.stats = {"prefetches": 0, "sync_loads": 0}

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def offloaded_bytes(self) -> int:
        return sum(p.param.numel() * p.param.element_size()
                   for ps in self.params.values() for p in ps)

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def slot_key(self, p: OffloadedParam) -> str:
        return p.suffix

    def slot_specs(self) -> list[dict[str, torch.Tensor]]:
        """Per slot: slot key -> a parameter whose shape, stride and dtype the slot takes."""
        specs: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_slots)]
        for layer, ps in self.params.items():
            spec = specs[self.slot_of[layer]]
            for p in ps:
                key = self.slot_key(p)
                have = spec.get(key)
                if have is None:
                    spec[key] = p.param
                elif have.shape != p.param.shape or have.dtype != p.param.dtype:
                    raise ValueError(
                        f"prefetch_offload: {p.name} ({tuple(p.param.shape)}, {p.param.dtype}) "
                        f"shares slot {self.slot_of[layer]} with a parameter of the same name "
                        f"but shape {tuple(have.shape)}, {have.dtype}; offloaded layers must "
                        "have matching parameters (restrict them with offload_params)")
        return specs

    @property
    def planned_buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for spec in self.slot_specs()
                   for t in spec.values())

    def register(self) -> None:
        with _LOCK:
            _HANDLES[self.handle] = weakref.ref(self)
            model = self.model_ref()
            if model is not None:
                _BY_MODEL[model] = self
            for layer, ps in self.params.items():
                for p in ps:
                    _BY_PARAM[p.param] = (self, layer)

    def unregister(self) -> None:
        with _LOCK:
            _HANDLES.pop(self.handle, None)
            model = self.model_ref()
            if model is not None and _BY_MODEL.get(model) is self:
                del _BY_MODEL[model]
            for ps in self.params.values():
                for p in ps:
                    if _BY_PARAM.get(p.param, (None,))[0] is self:
                        del _BY_PARAM[p.param]

    # ---- setup and teardown ------------------------------------------------------------
    def materialize(self) -> None:
        """Move offloaded weights to host masters and point the parameters at their slots.

        Everything is allocated before any parameter is touched, so a failure (out of host
        or device memory) leaves the model as it was."""
        if self.materialized:
            return
        masters = {layer: self._make_masters(layer, ps) for layer, ps in self.params.items()}
        slot_specs = self.slot_specs()
        packed = self._packed_slots()
        if packed is not None:
            self.slot_flat, slots = packed
        else:
            slots = [{key: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                               device=self.device)
                      for key, t in spec.items()} for spec in slot_specs]
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
        # From here on nothing allocates: swap the parameters over.
        self.masters, self.slots = masters, slots
        with torch.no_grad():
            for layer, ps in self.params.items():
                slot = self.slots[self.slot_of[layer]]
                for p in ps:
                    p.param.data = slot[self.slot_key(p)]
        for s in range(self.num_slots):
            self._load_now(self.layers[s])
        self.stats = {"prefetches": 0, "sync_loads": 0}
        self._install_eager_guards()
        self.materialized = True
        self.register()

    def _make_masters(self, layer: int, ps: list[OffloadedParam]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            # the original storage becomes the master: nothing is copied
            return {p.suffix: p.param.detach() for p in ps}
        block = HostBlock({p.suffix: p.param for p in ps})
        self.pinned = block.pinned
        self._host_blocks.append(block)
        self._block_of[layer] = block
        return block.views

    def _packed_slots(self):
        """One flat device buffer per slot with every layer of the slot laid out as its host
        block, so a layer moves in one copy; None where layouts differ or not on CUDA."""
        if not self.packed or self.device.type != "cuda" or not self._block_of:
            return None
        layouts = {}
        for layer in self.layers:
            layout = self._block_of[layer].layout
            if layouts.setdefault(self.slot_of[layer], layout) != layout:
                return None
        flats = [torch.empty(self._block_of[self.layers[s]].nbytes, dtype=torch.uint8,
                             device=self.device) for s in range(self.num_slots)]
        return flats, [views_into(flats[s], layouts[s]) for s in range(self.num_slots)]

    def _install_eager_guards(self) -> None:
        """Make eager (uncompiled) calls of an offloaded layer load its weights first, so the
        model never silently computes with another layer's slot contents."""
        model = self.model_ref()
        if model is None:
            return
        for layer in self.layers:
            module = self.stack.layers[layer]
            self._hooks.append(module.register_forward_pre_hook(_eager_guard(self, layer)))
        from . import weights
        self._hooks.extend(weights.install(self, model))

    def reload_slots(self, layers) -> None:
        """After masters of ``layers`` changed: reload the slots that hold (or are being
        filled with) one of them, so no stale copy is used."""
        for slot, owner in enumerate(self.owner):
            if owner in layers:
                self._load_now(owner)

    def restore(self) -> None:
        """Return every offloaded weight to its original device, bitwise, and detach."""
        if self.restored:
            return
        self.synchronize()
        with torch.no_grad():
            for layer, ps in self.params.items():
                for p in ps:
                    master = self.masters[layer][p.suffix]
                    p.param.data = master if self.device.type == "cpu" else master.to(
                        self.device)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.slots = []
        self.masters = {}
        for block in self._host_blocks:
            block.release()
        self._host_blocks = []
        self._block_of = {}
        self.slot_flat = None
        self.restored = True
        self.unregister()
        _RESTORED.add(self.handle)
        log.info("fx_offload: restored %d offloaded layer(s) of %s to %s",
                 len(self.layers), self.model_name, self.device)

    def synchronize(self) -> None:
        """Wait for copies in flight (they read the masters about to be changed)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    # ---- the operations the graph calls ------------------------------------------------
    def wait(self, layer: int) -> None:
        """Before ``layer`` reads its weights: make sure its slot holds them."""
        if self.restored:
            return
        slot = self.slot_of[layer]
        pending = self.pending.pop(layer, None)
        if self.owner[slot] != layer:
            self._load_now(layer)
            return
        if pending is not None:
            stream = torch.cuda.current_stream(self.device)
            if pending.in_capture or not _capturing():
                stream.wait_event(pending.event)
            # A copy recorded before the capture began was completed by the synchronization
            # that starts every capture; waiting on it inside the capture is not allowed.

    def start(self, layer: int, target: int) -> None:
        """After ``layer`` has run: refill its slot with ``target`` asynchronously."""
        if self.restored:
            return
        slot = self.slot_of[layer]
        if self.owner[slot] == target:
            return
        self.stats["prefetches"] += 1
        self.owner[slot] = target
        if self.copy_stream is None:
            self._copy_in(target)
            return
        compute = torch.cuda.current_stream(self.device)
        capturing = _capturing()
        fork = torch.cuda.Event()
        fork.record(compute)
        self.copy_stream.wait_event(fork)
        with torch.cuda.stream(self.copy_stream):
            self._copy_in(target, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.pending[target] = _Pending(done, capturing)

    def join(self) -> None:
        """End of a forward: inside a CUDA-graph capture, join every copy forked during it."""
        if self.copy_stream is None or not self.pending:
            return
        stream = torch.cuda.current_stream(self.device)
        if not _capturing():
            return       # eager: let the copies run on into the next call
        for layer, pending in list(self.pending.items()):
            if pending.in_capture:
                stream.wait_event(pending.event)
                # Joined inside the graph: whoever runs after a replay is ordered after the
                # copy, and the event itself means nothing outside the capture.
                del self.pending[layer]

    # ---- copies ------------------------------------------------------------------------
    def _copy_in(self, layer: int, non_blocking: bool = False) -> None:
        if self.slot_flat is not None:        # one copy for the whole layer
            self.slot_flat[self.slot_of[layer]].copy_(self._block_of[layer].buffer,
                                                      non_blocking=non_blocking)
            return
        slot = self.slots[self.slot_of[layer]]
        master = self.masters[layer]
        with torch.no_grad():
            for p in self.params[layer]:
                slot[self.slot_key(p)].copy_(master[p.suffix], non_blocking=non_blocking)

    def _load_now(self, layer: int) -> None:
        """Synchronous (stream-ordered) load of ``layer`` into its slot."""
        slot = self.slot_of[layer]
        if self.copy_stream is not None:
            stream = torch.cuda.current_stream(self.device)
            for other, pending in list(self.pending.items()):
                if self.slot_of[other] == slot:
                    if pending.in_capture or not _capturing():
                        stream.wait_event(pending.event)
                    del self.pending[other]
        self._copy_in(layer, non_blocking=self.copy_stream is not None)
        self.owner[slot] = layer
        self.stats["sync_loads"] += 1
        log.debug("fx_offload: loaded layer %d into slot %d synchronously", layer, slot)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _eager_guard(state: OffloadState, layer: int) -> Callable:
    """A forward pre-hook that waits for (or loads) the layer's weights.  It calls the op
    itself, so it is right both when it runs eagerly and when Dynamo traces it into a graph
    (where ``torch.compiler.is_compiling()`` would turn a Python check into a no-op).  The
    pass drops such a traced wait where it places the layer's own wait."""
    handle = state.handle

    def hook(module, args):
        acts = [a for a in args if isinstance(a, torch.Tensor)]
        torch.ops.fx_offload.wait_prefetch(acts, handle, layer)
        return None
    return hook
