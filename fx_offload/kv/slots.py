"""The device slots of a host KV cache: per cache shape, ``kv_slots`` zeroed buffers, each
one layer's keys and values, and each slot's buffer of the positions a step wrote."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("fx_offload")


class KVSlots:
    def __init__(self, model_name: str, count: int):
        self.model_name = model_name
        self.count = count
        self._flats: dict[tuple, list[torch.Tensor]] = {}
        self._idx: dict[tuple, list[torch.Tensor]] = {}

    def views(self, slot: int, keys: torch.Tensor, values: torch.Tensor):
        """Slot ``slot`` for caches shaped like ``keys``/``values``: (keys, values) views into
        one zeroed device buffer (allocated on first use of the shape), and its positions
        buffer."""
        key = (tuple(keys.shape), tuple(values.shape), keys.dtype, keys.device)
        flats = self._flats.get(key)
        if flats is None:
            size = keys.numel() + values.numel()
            flats = [torch.zeros(size, dtype=keys.dtype, device=keys.device)
                     for _ in range(self.count)]
            self._flats[key] = flats
            self._idx[key] = [torch.zeros(keys.shape[2], dtype=torch.int64, device=keys.device)
                              for _ in flats]
            log.info("fx_offload: %s KV slots: %d x %.1f MiB on %s", self.model_name,
                     len(flats), size * keys.element_size() / 2**20, keys.device)
        flat = flats[slot]
        n = keys.numel()
        return flat[:n].view(keys.shape), flat[n:].view(values.shape), self._idx[key][slot]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for flats in self._flats.values()
                   for t in flats)
