"""The memory of one offloaded model: host masters and device slots, and the copy between.

Masters hold the true weights of offloaded layers.  On CUDA each layer's masters are views
into one page-locked host block (:mod:`.host_memory`); on the CPU the original storage is the
master and nothing is copied.  Slots are device tensors of fixed address, one per slot
entry; where every layer of a slot has one byte layout, a slot is one flat buffer laid out
as the layers' host blocks, so a layer moves in one copy.

The slots are allocated first, then the host blocks one layer at a time; ``hand_over`` lets
each layer's parameters take their block as soon as it is filled, so the storage they held
is freed before the next block is allocated (host memory holds each weight once, plus one
layer).  A failure part-way leaves every parameter holding its values: the old storage, or
a block that holds the same.
"""
from __future__ import annotations

import os

import torch

from .host_memory import HostBlock, layout_of, views_into


class SlotBuffers:
    """Masters and slots for a :class:`~fx_offload.selection.Choice`."""

    # One copy per layer from a packed host block into a packed slot, rather than one copy
    # per parameter (see docs/benchmarks.md for the measurement that chose the default).
    packed = os.environ.get("FX_OFFLOAD_PACKED", "1") != "0"

    def __init__(self, choice, hand_over=None, fill=None):
        """``hand_over(layer, masters)``: called as each layer's block is filled.
        ``fill(layer, views)``: writes a layer's values into its new block (read from a
        checkpoint) instead of copying them from the parameters, which may be on the meta
        device."""
        self.schedule, self.params, self.device = choice.schedule, choice.params, choice.device
        self.pinned = False
        self._blocks: dict[int, HostBlock] = {}
        self.flat: list[torch.Tensor] | None = None
        layouts = {layer: layout_of({p.suffix: p.param for p in ps})
                   for layer, ps in self.params.items()}
        packed = self._packed_slots(layouts)
        if packed is not None:
            self.flat, self.slots = packed
        else:
            self.slots = [{key: torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype,
                                                    device=self.device)
                           for key, spec in slot.items()} for slot in choice.slot_specs]
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        for layer, ps in self.params.items():
            self.masters[layer] = self._make_masters(layer, ps, fill)
            if hand_over is not None:
                hand_over(layer, self.masters[layer])

    @property
    def nbytes(self) -> int:
        """Device memory of the slots."""
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def _make_masters(self, layer: int, ps, fill) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu" and fill is None:
            # the original storage becomes the master: nothing is copied
            return {p.suffix: p.param.detach() for p in ps}
        block = HostBlock({p.suffix: p.param for p in ps},
                          fill=None if fill is None else lambda views: fill(layer, views),
                          pin=self.device.type != "cpu")
        self.pinned = block.pinned
        self._blocks[layer] = block
        return block.views

    def _packed_slots(self, layer_layouts):
        """One flat device buffer per slot with every layer of the slot laid out as its host
        block; None where layouts differ or not on CUDA."""
        if not self.packed or self.device.type != "cuda":
            return None
        schedule, layouts = self.schedule, {}
        for layer in schedule.layers:
            layout = layer_layouts[layer]
            if layouts.setdefault(schedule.slot_of[layer], layout) != layout:
                return None
        flats = [torch.empty(max(layouts[s][1], 1), dtype=torch.uint8, device=self.device)
                 for s in range(schedule.num_slots)]
        return flats, [views_into(flats[s], layouts[s][0]) for s in range(schedule.num_slots)]

    def slot_tensor(self, layer: int, suffix: str) -> torch.Tensor:
        """The slot tensor a parameter of ``layer`` reads."""
        return self.slots[self.schedule.slot_of[layer]][suffix]

    def copy_in(self, layer: int, non_blocking: bool = False) -> None:
        """Copy ``layer``'s masters into its slot (on the current stream)."""
        slot = self.schedule.slot_of[layer]
        if self.flat is not None:        # one copy for the whole layer
            self.flat[slot].copy_(self._blocks[layer].buffer, non_blocking=non_blocking)
            return
        with torch.no_grad():
            for p in self.params[layer]:
                self.slots[slot][p.suffix].copy_(self.masters[layer][p.suffix],
                                                 non_blocking=non_blocking)

    def release(self) -> None:
        """Unlock the host blocks; the slots and masters must not be used afterwards."""
        for block in self._blocks.values():
            block.release()
        self._blocks, self.slots, self.masters, self.flat = {}, [], {}, None
