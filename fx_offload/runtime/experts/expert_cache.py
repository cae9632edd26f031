"""A device-resident cache of each routed MoE layer's most-picked experts (option
``expert_cache``, bytes): :class:`ExpertCache` holds their device rows and, per layer,
``where`` (expert -> its row, -1 for none) and the pick counts.  A picked expert held there
is copied into the slot from device memory, so it does not cross the link; the gather
(:mod:`.gather`) takes each picked row from one place or the other::

    gather_rows(host, slot, mask, cache, where)  # program (e, b): if mask[e], block b of
                                                 # row e from cache[where[e]] where that is
                                                 # >= 0, else from host[e] (across the link)
    counts[L] += mask                            # how often each expert was picked

How many experts each layer keeps, which ones and when they are chosen again
(``FIRST_REFRESHES``, ``REFRESH_EVERY``), why the tensors are made before the host blocks
and any capture, and how a change of the weights reaches the cached rows:
docs/routed_experts.md, "The expert cache".
"""
from __future__ import annotations

import logging

import torch

from ...errors import OffloadError
from ...text import format_bytes

log = logging.getLogger("fx_offload")
FIRST_REFRESHES = (4, 8, 16, 32, 64)    # calls after which the cached experts are chosen
REFRESH_EVERY = 64                      # and then every this many calls


class ExpertCache:
    """The cached experts of one model's routed layers: their device rows, and per layer
    ``where`` (expert -> its row, -1 for none) and the pick counts."""

    def __init__(self, choice, budget: int, asked: bool = True):
        """``budget``: device bytes; ``asked``: given as the option (else what
        ``memory_budget`` left, and too little for one expert is no news).  Made before
        the host blocks, from the parameters' shapes (expert tensors are plain ones), so
        that running out of device memory here leaves every parameter untouched."""
        # per layer, the expert tensors of its largest expert count (a scale of another
        # count is left to the host)
        suffixes = {layer: tuple(s for s, n in tensors.items() if n == max(tensors.values()))
                    for layer, tensors in choice.experts.items()}
        counts = {layer: max(tensors.values()) for layer, tensors in choice.experts.items()}
        like = {layer: {p.suffix: p.param for p in choice.params[layer] if p.suffix in ss}
                for layer, ss in suffixes.items()}
        one = sum(t[0].numel() * t.element_size() for ts in like.values() for t in ts.values())
        self.rows = min([budget // max(one, 1)] + list(counts.values()))
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.where: dict[int, torch.Tensor] = {}
        self.held: dict[int, list[int]] = {}        # layer -> expert of each row (-1: none)
        self._copied_at: dict[int, tuple] = {}      # layer -> its versions when copied
        self.read: set[int] = set()                 # layers a gather was given rows of
        self.calls = 0
        if not self.rows:
            say = log.warning if asked else log.info
            say("fx_offload: %s: expert_cache (%s) holds less than one expert of each routed "
                "MoE layer (%s): nothing is cached; give it at least %s", choice.model_name,
                format_bytes(budget), format_bytes(one), format_bytes(one))
            self._counts = None
            return
        self.device = device = choice.device
        widest = max(counts.values())
        self._counts = torch.zeros((len(counts), widest), dtype=torch.int32, device=device)
        self.counts = {layer: self._counts[i, :n] for i, (layer, n) in
                       enumerate(sorted(counts.items()))}
        try:
            self.tensors = {layer: {s: _rows(self.rows, t, device) for s, t in ts.items()}
                            for layer, ts in like.items()}
        except torch.OutOfMemoryError as error:
            raise OffloadError(
                f"option 'expert_cache' ({format_bytes(budget, as_option=True)}) does not fit "
                f"on {device} beside the slots: {error}. Lower it (one expert of each routed "
                f"layer takes {format_bytes(one)})") from None
        for layer in suffixes:
            # one entry more than experts, as the gather's mask has (out-of-range ids)
            self.where[layer] = torch.full((counts[layer] + 1,), -1, dtype=torch.int32,
                                           device=device)
            self.held[layer] = [-1] * self.rows
        log.info("fx_offload: %s: expert_cache keeps %d expert(s) of each of %d routed "
                 "layer(s) on the device (%s)", choice.model_name, self.rows, len(counts),
                 format_bytes(self.nbytes))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.tensors.values() for t in ts.values())

    def source(self, layer: int, suffix: str):
        """``(cache rows, where)`` of ``layer``'s expert tensor ``suffix``, or ``(None,
        None)`` where it is not cached."""
        rows = self.tensors.get(layer, {}).get(suffix)
        if rows is None:
            return None, None
        self.read.add(layer)        # a captured graph may hold these addresses: kept
        return rows, self.where[layer]

    def hits(self, layer: int, mask: torch.Tensor, count: int) -> torch.Tensor:
        """Count the experts ``mask`` picks of ``layer`` (for the next refresh); the
        number of them the cache holds, on the device."""
        self.counts[layer].add_(mask[:count])
        return (mask[:count] * (self.where[layer][:count] >= 0)).sum()

    def between_calls(self, masters, versions, routing) -> None:
        """A call begins (outside any CUDA graph, after its look at what the user changed):
        free the rows of layers no gather has read (a CUDA graph captured with them would
        read them at their addresses) that a graph moves whole (``routing``, the pass's)
        or, at a refresh, that no graph routes (a layer compiled on its own frame); at a
        refresh, cache the most-picked experts."""
        self.calls += 1
        due = self.calls in FIRST_REFRESHES or (self.calls > FIRST_REFRESHES[-1] and
                                                self.calls % REFRESH_EVERY == 0)
        for layer in [layer for layer in self.tensors if layer not in self.read and
                      (layer in routing or due) and
                      "routed" not in routing.get(layer, {}).values()]:
            log.info("fx_offload: layer %d's experts move whole: the expert cache keeps "
                     "none of them", layer)
            self._drop(layer)
        if not self.tensors or not due:
            return
        self._settle()
        counts = self._counts.tolist()
        for i, layer in enumerate(sorted(self.counts)):
            if layer in self.tensors:
                picked = counts[i][:self.counts[layer].numel()]
                best = sorted(range(len(picked)), key=lambda e: -picked[e])  # room: unpicked too
                self._cache(layer, set(best[:self.rows]), masters[layer], versions(layer))
        self._counts.floor_divide_(2)
        log.debug("fx_offload: expert_cache refreshed after %d calls", self.calls)

    def reload_changed(self, layers: set[int], masters, versions) -> None:
        """Copy the cached rows of every layer in ``layers`` (their weights changed) or
        whose version counters moved since its rows were copied."""
        changed = [layer for layer, held in self.held.items() if any(e >= 0 for e in held)
                   and (layer in layers or self._copied_at.get(layer) != versions(layer))]
        if changed:
            self._settle()
        for layer in changed:
            log.debug("fx_offload: layer %d changed: its cached experts copied again", layer)
            held = self.held[layer]
            self._fill(layer, [(r, e) for r, e in enumerate(held) if e >= 0], masters[layer],
                       versions(layer))

    def _cache(self, layer: int, wanted: set[int], masters, version) -> None:
        """Hold the experts ``wanted`` of ``layer``: newcomers take the rows of those not
        wanted any more, or empty ones.  Those kept are copied again too: a write that
        moves no version counter (through ``.data``) reaches them here at the latest."""
        held = self.held[layer]
        free = [r for r, e in enumerate(held) if e not in wanted]
        new = sorted(wanted - set(held))
        kept = [(r, e) for r, e in enumerate(held) if e in wanted]
        self._fill(layer, kept + list(zip(free, new)), masters, version)

    def _fill(self, layer: int, rows, masters, version) -> None:
        """Copy expert ``e`` from the host into row ``r`` for each ``(r, e)`` of ``rows``,
        on the current stream (after the work begun before it, before the replays after).
        A row is unpublished while it is written and counts as held only once its copy is
        done, so an error part-way leaves no ``where`` entry naming a row it did not
        fill."""
        held, out = self.held[layer], {r for r, _ in rows}
        self._publish(layer, [-1 if r in out else e for r, e in enumerate(held)])
        for r in out:       # once where[] names none of them (not before: it might not)
            held[r] = -1
        for r, e in rows:
            self._copy_expert(layer, r, e, masters)
            held[r] = e
        try:
            self._publish(layer, held)
        except BaseException:
            for r in out:   # where[] still names none of them: neither does held
                held[r] = -1
            raise
        self._copied_at[layer] = version

    @torch.no_grad()
    def _copy_expert(self, layer: int, row: int, expert: int, masters) -> None:
        for suffix, t in self.tensors[layer].items():
            t[row].copy_(masters[suffix][expert])

    def _publish(self, layer: int, held: list[int]) -> None:
        """``where`` of ``layer`` from what its rows hold (``held``: the expert of each)."""
        where = [-1] * self.where[layer].numel()
        for r, e in enumerate(held):
            if e >= 0:
                where[e] = r
        self.where[layer].copy_(torch.tensor(where, dtype=torch.int32))

    def _settle(self) -> None:
        """Wait for the device: a gather of a call on another stream may still read rows
        about to be overwritten (and the counts are read)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _drop(self, layer: int) -> None:
        for table in (self.tensors, self.where, self.held, self._copied_at):
            table.pop(layer, None)

    def held_now(self) -> int:
        """Experts held, over all layers."""
        return sum(e >= 0 for held in self.held.values() for e in held)

    def release(self) -> None:
        self.tensors, self.where, self.held, self._counts = {}, {}, {}, None


def _rows(count: int, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Room on ``device`` for ``count`` experts of the expert tensor ``like`` (which may be
    on the meta device)."""
    return torch.empty((count,) + like.shape[1:], dtype=like.dtype, device=device)


def make(choice) -> ExpertCache | None:
    """The expert cache ``choice`` asks for, or None."""
    if not (choice.experts and choice.expert_cache):
        return None
    return ExpertCache(choice, choice.expert_cache, choice.options.expert_cache != "auto")
