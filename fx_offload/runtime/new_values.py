"""New values of an offloaded layer's parameters (given other storage or another object)
become its true weights without writing over storage that something else still views.

A plain model never writes a tensor's storage when a parameter is given another one: a
``backup = p.data`` kept across ``p.data = ema`` and ``p.data = backup`` (an EMA or SWA
evaluation), or the parameter objects that ``torch.func.functional_call`` swaps out and
back, keep their values.  So the host block is written in place only where nothing but its
own views holds the storage of what changes; elsewhere the layer's values go to a fresh host
block (copy on write) and the old one is left to whoever holds it, freed with their last
reference.  On the CPU, where a layer's masters are the parameters' own storage, the new
storage simply becomes the master: nothing is copied.  A mixin of
:class:`~.slots.SlotBuffers`, whose ``masters``, ``_blocks``, ``compressed``, ``device``,
``align`` and ``_place_raw`` it uses.
"""
from __future__ import annotations

import torch

from .host_memory import HostBlock, viewed_elsewhere


class NewValues:
    """Taking new values into a layer's masters (a mixin)."""

    @torch.inference_mode(False)    # masters outlive the call that takes them up
    @torch.no_grad()
    def take_values(self, layer: int, values: dict[str, torch.Tensor]) -> None:
        """``values`` (key in the host block -> a tensor holding it, none of them viewing
        this layer's masters) are ``layer``'s true values from now on; ``masters[layer]``
        may then be a new dict of tensors.  No copy may be reading the masters."""
        masters = self.masters[layer]
        block = self._blocks.get(layer)
        if block is None:               # the CPU: the parameters' own storage is the master
            self.masters[layer] = {**masters, **{key: _adopted(value, masters[key])
                                                 for key, value in values.items()}}
            return
        if not any(viewed_elsewhere(masters[key]) for key in values):
            for key, value in values.items():
                masters[key].copy_(value)
            return
        fresh = {key: values.get(key, view) for key, view in masters.items()}
        made = HostBlock(masters, fill=lambda views: _fill(views, fresh),
                         pin=self.device.type != "cpu" and not self.compress, align=self.align)
        self._blocks[layer] = made      # the old one: freed with the last view held of it
        self.masters[layer] = made.views
        if not self.compress:
            self.pinned = made.pinned
        elif layer in self.compressed:
            self._place_raw(layer)      # into a file, or page-locked, as the first one was


def _adopted(value: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``value`` as a CPU layer's master: its own storage where it can be (a tensor of the
    master's device, not an inference tensor, which later writes outside inference mode
    could not change), else a copy."""
    if value.device == master.device and not value.is_inference():
        return value.detach()
    return torch.empty_like(master).copy_(value)


def _fill(views: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    for key, view in views.items():
        view.copy_(values[key])
