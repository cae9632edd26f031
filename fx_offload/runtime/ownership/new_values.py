"""New values of an offloaded layer's parameters (given other storage or another object)
become its true weights without writing over storage that something else still views.

A plain model never writes a tensor's storage when a parameter is given another one: a
``backup = p.data`` kept across ``p.data = ema`` and ``p.data = backup`` (an EMA or SWA
evaluation), or the parameter objects that ``torch.func.functional_call`` swaps out and
back, keep their values.  So the host block is written in place only where nothing but its
own views holds the storage of what changes; elsewhere the layer's values go to a fresh host
block (copy on write) and the old one is left to whoever holds it, freed with their last
reference.  On the CPU, where a layer's masters are the parameters' own storage, the new
storage simply becomes the master: nothing is copied.  :func:`taken` works out a layer's
masters and host block; :meth:`~.slots.SlotBuffers.take_values` keeps them.
"""
from __future__ import annotations

import torch

from ..memory.host_memory import HostBlock, viewed_elsewhere


def taken(masters: dict[str, torch.Tensor], block: HostBlock | None,
          values: dict[str, torch.Tensor], pin: bool, align: int):
    """A layer's masters and host block once ``values`` (key in the host block -> a tensor
    holding it, none of them viewing these ``masters``) are its true values: ``(masters,
    block)``, the same block (written in place, or None: the CPU, where the parameters' own
    storage is the master) or a new one (``pin``: page-locked).  No copy may be reading the
    masters."""
    if block is None:
        return {**masters, **{key: _adopted(value, masters[key])
                              for key, value in values.items()}}, None
    if not any(viewed_elsewhere(masters[key]) for key in values):
        for key, value in values.items():
            masters[key].copy_(value)
        return masters, block
    fresh = {key: values.get(key, view) for key, view in masters.items()}
    made = HostBlock(masters, fill=lambda views: _fill(views, fresh), pin=pin, align=align)
    return made.views, made     # the old block: freed with the last view held of it


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
