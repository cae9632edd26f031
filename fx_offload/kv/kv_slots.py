"""The device slots of a host KV cache: per cache shape, ``kv_slots`` zeroed buffers, each
one layer's keys and values, and each slot's buffer of the positions a step wrote.

``generate`` makes a static cache per prompt length (its ``max_cache_len``), so the buffers
of shapes no live cache has are dropped as a new shape's are made (:func:`.cache.prepare`):
not once a CUDA graph may have captured their addresses."""
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
        self.collected_for: frozenset = frozenset()     # shapes found live after a gc

    @staticmethod
    def key(keys: torch.Tensor, values: torch.Tensor) -> tuple:
        return tuple(keys.shape), tuple(values.shape), keys.dtype, keys.device

    def prune(self, live: set) -> int:
        """Drop the buffers of every shape not in ``live``; the bytes freed."""
        freed = 0
        for key in [k for k in self._flats if k not in live]:
            freed += sum(t.numel() * t.element_size() for t in self._flats.pop(key))
            del self._idx[key]
        return freed

    def views(self, slot: int, keys: torch.Tensor, values: torch.Tensor):
        """Slot ``slot`` for caches shaped like ``keys``/``values``: (keys, values) views into
        one zeroed device buffer (allocated on first use of the shape), and its positions
        buffer."""
        key = self.key(keys, values)
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
