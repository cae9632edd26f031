"""The memory of one offloaded model: host masters and device slots, and the copy between.

Masters hold the true weights of offloaded layers.  On CUDA each layer's masters are views
into one page-locked host block (:mod:`.host_memory`); on the CPU the original storage is the
master and nothing is copied (unless the weights come from a checkpoint: then into a plain
host block).  Each slot is one flat device buffer as large as the largest layer that uses
it, and each layer sees its parameters as views into its slot laid out as its host block::

    slot 0  [ layer 1: fc1.weight | fc1.bias | ... ]         one copy per chunk:
            [ layer 3 (an MoE layer): gate | experts... ]    block[a:b] -> slot[a:b]

so layers of different shapes may share a slot (a dense-then-MoE stack, several stacks),
and a layer moves in one copy per chunk (:mod:`fx_offload.layout`: its parameters in the
order its forward reads them, split where the pass waits and starts per chunk).

The slots are allocated first, then the host blocks one layer at a time; ``hand_over`` lets
each layer's parameters take their block as soon as it is filled, so the storage they held
is freed before the next block is allocated (host memory holds each weight once, plus one
layer).  A failure part-way leaves every parameter holding its values: the old storage, or
a block that holds the same.
"""
from __future__ import annotations

import os

import torch

from .host_memory import HostBlock, align_for, layout_of, views_into


class SlotBuffers:
    """Masters and slots for a :class:`~fx_offload.selection.Choice`."""

    # One copy per chunk from a packed host block into its slot, rather than one copy per
    # parameter (see docs/benchmarks.md for the measurement that chose the default).
    packed = os.environ.get("FX_OFFLOAD_PACKED", "1") != "0"

    def __init__(self, choice, hand_over=None, fill=None):
        """``hand_over(layer, masters)``: called as each layer's block is filled.
        ``fill(layer, views)``: writes a layer's values into its new block (read from a
        checkpoint) instead of copying them from the parameters, which may be on the meta
        device."""
        self.schedule, self.params, self.device = choice.schedule, choice.params, choice.device
        self.align = align_for(self.device)
        self.pinned = False
        self._blocks: dict[int, HostBlock] = {}
        layouts = {layer: layout_of(block_tensors(ps), self.align)
                   for layer, ps in self.params.items()}
        slot_of = self.schedule.slot_of
        sizes = [max(layouts[layer][1] for layer in self.params if slot_of[layer] == s)
                 for s in range(self.schedule.num_slots)]
        self.flat = [torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)
                     for n in sizes]
        self.views = {layer: views_into(self.flat[slot_of[layer]], layouts[layer][0])
                      for layer in self.params}
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        for layer, ps in self.params.items():
            self.masters[layer] = self._make_masters(layer, ps, fill)
            if hand_over is not None:
                hand_over(layer, self.masters[layer])

    @property
    def nbytes(self) -> int:
        """Device memory of the slots."""
        return sum(flat.numel() for flat in self.flat)

    def _make_masters(self, layer: int, ps, fill) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu" and fill is None:
            # the original storage becomes the master: nothing is copied
            return {key: t.detach() for key, t in block_tensors(ps).items()}
        block = HostBlock(block_tensors(ps),
                          fill=None if fill is None else lambda views: fill(layer, views),
                          pin=self.device.type != "cpu", align=self.align)
        self.pinned = block.pinned
        self._blocks[layer] = block
        return block.views

    def block_of(self, layer: int) -> torch.Tensor | None:
        """``layer``'s host block, flat bytes (None where its masters are the parameters'
        own storage: the CPU)."""
        block = self._blocks.get(layer)
        return None if block is None else block.buffer

    def copy_in(self, layer: int, chunk=None, non_blocking: bool = False) -> None:
        """Copy ``layer``'s masters into its slot (on the current stream): the bytes of one
        :class:`~fx_offload.layout.Chunk`, or all of them."""
        block = self._blocks.get(layer)
        if self.packed and block is not None:       # one copy per chunk
            start, end = (0, block.nbytes) if chunk is None else (chunk.start, chunk.end)
            flat = self.flat[self.schedule.slot_of[layer]]
            flat[start:end].copy_(block.buffer[start:end], non_blocking=non_blocking)
            return
        wanted = None if chunk is None else set(chunk.suffixes)
        with torch.no_grad():
            for p in self.params[layer]:
                if wanted is None or p.suffix in wanted:
                    for key in p.parts():
                        self.views[layer][key].copy_(self.masters[layer][key],
                                                     non_blocking=non_blocking)

    def release(self) -> None:
        """Unlock the host blocks; the slots and masters must not be used afterwards."""
        for block in self._blocks.values():
            block.release()
        self._blocks, self.flat, self.views, self.masters = {}, [], {}, {}


def block_tensors(ps) -> dict[str, torch.Tensor]:
    """A layer's offloaded parameters (``OffloadedParam``, in host-block order) as the plain
    tensors its host block and slot region hold, keyed as each parameter's parts."""
    return {key: t for p in ps for key, t in p.parts().items()}
