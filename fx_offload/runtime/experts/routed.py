"""Routed expert chunks at run time (:class:`RoutedExperts`): a chunk of an MoE layer's
expert tensors that the pass proved is read only through its router's picks
(:mod:`fx_offload.passes.routing`) moves only the picked experts, copied by the device
after the router runs (:mod:`.gather`), in a call whose expected share of experts picked is
at most :data:`WHOLE_ABOVE`; in a call that picks more, the chunk is prefetched whole.

A chunk whose slot holds it whole (prefetched before the tokens were known) is only waited
for.  Inside a CUDA-graph capture a chunk held from before the capture is gathered again: a
replay cannot know what the slot will hold then.

How the share is predicted at a call's entry and corrected at each routed wait, why a
gathered chunk is recorded as not held, and why outputs never depend on the prediction:
docs/routed_experts.md, "At run time" and "Prefill".
"""
from __future__ import annotations

import logging

import torch

from ...copy_rules import WHOLE_ABOVE, expected_share
from . import gather
from .expert_cache import ExpertCache

log = logging.getLogger("fx_offload")


class RoutedExperts:
    """The routed chunks of one model, the device-side copies of their picked rows, and the
    per-call choice between gathering and whole-chunk prefetch."""

    def __init__(self, choice, routing, buffers, cache: ExpertCache | None = None):
        # routing: layer -> {chunk: "routed" or why not}, as the pass found it (Learned)
        self.routing, self.experts = routing, choice.experts
        self.buffers = buffers
        self.share: float | None = None     # of the latest call's routed waits
        self.picks: tuple[int, int] | None = None   # (experts, top-k) of the latest one
        # made here, not in a call: memory a CUDA-graph capture allocates and keeps is
        # refused by its pool; one mask per expert count (one entry more: out-of-range ids)
        counts = {n for tensors in choice.experts.values() for n in tensors.values()}
        self._masks = {n: torch.zeros(n + 1, dtype=torch.int32, device=choice.device)
                       for n in counts}
        # bytes gathered since the call began, counted on the device (a replayed CUDA graph
        # counts too); read by report
        self.gathered = torch.zeros((), dtype=torch.int64, device=choice.device) \
            if choice.experts else None
        # experts gathered per layer in the call (0: none, or the chunk was whole), for report
        self._row_of = {layer: i for i, layer in enumerate(sorted(choice.experts))}
        self.picked = torch.zeros(len(self._row_of), dtype=torch.int64, device=choice.device)
        # of those, found in the device's expert cache (option expert_cache): not copied
        # across the link, and their bytes not in ``gathered`` but here
        self.hit = torch.zeros_like(self.picked)
        self.cached_bytes = torch.zeros_like(self.gathered) if choice.experts else None
        self.usable = choice.device.type == "cpu" or \
            bool(buffers.pinned and gather.triton is not None)
        if choice.experts and not self.usable:
            why = "Triton is not installed" if buffers.pinned else \
                "its host memory is not page-locked"
            log.warning("fx_offload: %s: %s, so the device cannot read expert rows from the "
                        "host: its expert tensors move whole", choice.model_name, why)
        self.cache = cache if self.usable else None     # (expert_cache.make)
        self.host = None        # host_compute: the state's HostExperts (.host_experts)

    def routes(self, layer: int, chunk) -> bool:
        """``layer``'s ``chunk`` is routed (some graph waits for it with ``wait_routed``)."""
        return self.usable and self.routing.get(layer, {}).get(chunk.index) == "routed"

    def gathers(self, layer: int, chunk) -> bool:
        """``layer``'s ``chunk`` is routed and the latest call picked few of its experts:
        its wait gathers the picked rows, and a prefetch of it copies nothing."""
        return self.share is not None and self.share <= WHOLE_ABOVE \
            and self.routes(layer, chunk)

    def skips(self, layer: int, chunk, contents) -> bool:
        """The prefetch of ``layer``'s ``chunk`` copies nothing (True; ``contents`` records
        its bytes as holding no whole chunk): :meth:`gathers`, or its experts are predicted
        to run on the host in this call (``host_experts``)."""
        skip = self.gathers(layer, chunk) or \
            (self.host is not None and self.host.skips(layer, chunk))
        if skip:
            contents.forget(layer, chunk)
        return skip

    def observe(self, layer: int, chunk, ids: torch.Tensor) -> bool:
        """At a routed wait: note how many experts this call picks (for the prefetches
        that follow); True if, with nothing held, the picked rows are to be gathered rather
        than the chunk loaded whole (many tokens)."""
        k = ids.shape[-1] if ids.dim() else 1
        self.picks = (self._count(layer, chunk), k)
        self.share = expected_share(*self.picks, ids.numel() // max(k, 1))
        return self.usable and self.share <= WHOLE_ABOVE

    def gather(self, layer: int, chunk, ids: torch.Tensor) -> None:
        """Copy the rows ``ids`` picks of ``layer``'s ``chunk`` into its slot, on the
        current stream."""
        count = self._count(layer, chunk)
        mask = self._masks[count]
        gather.mark(mask, ids.to(mask.device))
        masters, views = self.buffers.masters[layer], self.buffers.views[layer]
        row = cached = 0
        for suffix in chunk.suffixes:
            rows, where = (None, None) if self.cache is None else \
                self.cache.source(layer, suffix)
            gather.gather_rows(masters[suffix], views[suffix], mask, rows, where)
            size = views[suffix][0].numel() * views[suffix].element_size()
            row += size
            cached += 0 if rows is None else size
        picked = mask[:count].sum()
        self.picked[self._row_of[layer]] = picked
        if cached:
            hit = self.cache.hits(layer, mask, count)
            self.hit[self._row_of[layer]] = hit
            self.gathered.add_(picked * row - hit * cached)
            self.cached_bytes.add_(hit * cached)
        else:
            self.gathered.add_(picked * row)

    def cache_rows(self, layer: int) -> torch.Tensor | None:
        """``where`` of ``layer`` in the expert cache (expert -> its row, -1 for none), or
        None where the cache keeps none of its experts."""
        cache = self.cache
        return cache.where[layer] if cache is not None and layer in cache.tensors else None

    def count_picks(self, layer: int, ids: torch.Tensor) -> None:
        """Count for the expert cache the experts ``ids`` picks of ``layer`` that no gather
        sees (those computed on the host, :mod:`~fx_offload.host_compute.split`), once an
        expert as a gather counts them."""
        count = max(self.experts[layer].values())
        mask = gather.mark(self._masks[count], ids.to(self._masks[count].device))
        self.cache.counts[layer].add_(mask[:count])

    def gather_into(self, layer: int, chunk, ids: torch.Tensor, contents, wait_for) -> None:
        """:meth:`gather` into a slot whose ``contents`` say it holds other bytes: copies
        pending into them are waited for (``wait_for``) first."""
        contents.settle_over(layer, (chunk,), wait_for)
        # forgotten first: a gather that fails part-way has overwritten what they held
        contents.forget(layer, chunk)
        self.gather(layer, chunk, ids)

    def begin_call(self, tokens: int | None) -> None:
        """A call of ``tokens`` tokens begins (outside a CUDA graph): count its gathered
        bytes from zero, and predict from its size whether its routed chunks are to be
        prefetched whole (a prompt after decode steps: the entry refills then copy them)."""
        if self.host is not None:
            self.host.begin_call(tokens)
        if self.gathered is None:
            return
        self.gathered.zero_()
        self.cached_bytes.zero_()
        self.picked.zero_()
        self.hit.zero_()
        if tokens and self.picks:
            self.share = expected_share(*self.picks, tokens)

    def gathered_last_call(self) -> dict[int, tuple[int, int]]:
        """Layer -> (experts its routed waits gathered in the latest call, of them found in
        the expert cache) (reads the device)."""
        counts, hits = self.picked.tolist(), self.hit.tolist()
        return {layer: (counts[i], hits[i]) for layer, i in self._row_of.items()}

    def between_calls(self, versions) -> None:
        """A call begins, its look at what the user changed done: the expert cache may
        choose anew which experts it keeps."""
        if self.cache is not None:
            self.cache.between_calls(self.buffers.masters, versions, self.routing)

    def reload_changed(self, layers: set[int], versions) -> None:
        """Cached experts of layers whose weights changed are copied again."""
        if self.cache is not None:
            self.cache.reload_changed(layers, self.buffers.masters, versions)

    def release(self) -> None:
        """Free the expert cache's device memory (the model is restored or detached)."""
        if self.cache is not None:
            self.cache.release()

    def _count(self, layer: int, chunk) -> int:
        return self.experts[layer][chunk.suffixes[0]]
