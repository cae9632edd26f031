"""The ``host_mlp`` op at run time: a dense layer's gated MLP computed on the host from its
weights' host views, or streamed, call by call (option ``host_compute``).

On the host the op is the routed-experts job of :mod:`.host_experts` with one expert that
every token picks with weight 1, queued on the stream the same way; streamed, it waits for
the MLP's three chunks and runs the module's own ``forward`` on the slot.  A hosted MLP's
slot bytes are free at once, so the op begins the refills over them before its job::

    compute stream:  host_mlp(x)  -> the refills over this MLP's chunks begin (copy stream)
                                  -> the host job (host_experts._StreamJobs), y
    copy stream:     the next occupant's chunks cross the link meanwhile

Under ``"auto"`` ``m`` of a call's hosted MLPs stream, ``m`` from the rule
(:func:`~fx_offload.host_compute.split.mlps_streamed`), checked by the trial when no layer
has experts on the host (then the experts' plan is the one timed); which ones from
:func:`~fx_offload.host_compute.split.streamed_mlps` (whole rounds of slots).
"""
from __future__ import annotations

import weakref

import torch

from ...host_compute import native, split
from ...selection.mlps import mlp_path
from ..memory.streams import capturing
from ..phase import Phase
from .host_weights import HostWeights, laid_out_as


class HostMlps:
    """The ``host_mlp`` ops of one model: where each dense MLP runs in this call.  Part of
    its :class:`~.host_experts.HostExperts` (``owner``), whose stream jobs, timer, rates and
    record of where each layer ran it shares."""

    def __init__(self, owner):
        # a proxy: the owner holds this object, and its stream jobs' page-locked buffers are
        # freed when the model's state goes, not at the next garbage collection
        self._owner = weakref.proxy(owner)
        self._entries: dict = {}    # layer -> its HostWeights (remade when the masters change)
        self.hosted: list[int] = []     # the layers whose MLP is a host_mlp op, in order
        self._plan: tuple[int | None, int] | None = None    # (tokens, m) of this call
        self._units: dict = {}      # (tokens, device) -> the ids and gates of one expert
        self._streamed: dict = {}   # (m, hosted count) -> the layers whose MLPs stream
        self._predictions: dict = {}    # (tokens, hosted count) -> _predicted's

    @property
    def _state(self):
        return self._owner.state

    def begin_call(self, tokens: int | None, timed: bool) -> tuple[int, int] | None:
        """A call of ``tokens`` tokens begins: its plan, ``timed``: by the trial (else the
        rule's).  The (tokens, plan) the owner times, or None."""
        self._plan = None
        self.hosted = self._hosted()
        owner = self._owner
        if owner.mode != "auto" or not tokens or not self.hosted:
            return None
        plan, *seconds = self._predicted(tokens)
        device, count, call = self._state.device, len(self.hosted), None
        if capturing():         # the op streams in a capture: so do the prefetches
            plan = count
        elif timed and device.type == "cuda":
            # the rule's host rate is the probe's, on experts; an MLP's rows are wider
            # and the chain between layers costs more: one or two more streamed are tried
            plan = owner.timer.begin(tokens, count, plan, seconds,
                                     torch.cuda.current_stream(device),
                                     near=[min(plan + 1, count), min(plan + 2, count)],
                                     unit="MLPs")
            call = (tokens, plan)
        self._plan = (tokens, plan)
        return call

    def skips(self, layer: int, chunk, names) -> bool:
        """The prefetch of ``layer``'s ``chunk`` copies nothing: it holds only weights of
        the MLP (``names``), which is predicted to run on the host in this call."""
        return set(chunk.suffixes) <= set(names) and self._on_host(layer, None)

    def run(self, layer: int, chunks, x: torch.Tensor) -> torch.Tensor:
        """The ``host_mlp`` op's kernel: ``layer``'s dense MLP on ``x``, here or there."""
        owner, state = self._owner, self._state
        entry = self.entry(layer)
        if state.phase is Phase.RESTORED:
            return laid_out_as(x, entry.module(x))
        tokens = x.numel() // max(x.shape[-1], 1)
        if (capturing() and owner.mode == "auto") or not self._on_host(layer, tokens):
            for chunk in chunks:
                state.wait(layer, chunk)
            owner.ran[layer] = "device"
            return laid_out_as(x, entry.module(x))
        owner.refuse_capture()
        owner.ran[layer] = "host"
        flat = x.reshape(tokens, x.shape[-1])
        key = (tokens, x.device)
        if key not in self._units:      # every token picks the one expert with weight 1
            self._units[key] = (torch.zeros(tokens, 1, dtype=torch.int64, device=x.device),
                                torch.ones(tokens, 1, dtype=torch.float32, device=x.device))
        ids, gates = self._units[key]
        self._start_over(layer, chunks)
        if x.device.type == "cuda" and entry.queueable and native.library() is not None:
            out = owner.queue(entry, layer, flat, ids, gates)
        else:
            out = owner.on_host(entry, flat, ids, gates)
        return laid_out_as(x, out.view(x.shape))

    def _start_over(self, layer: int, chunks) -> None:
        """Begin now the refills of the slot bytes only this MLP's ``chunks`` hold: the host
        reads the MLP from host memory, so the link fills them with the next occupant's
        weights while the host computes (the graph's own starts, after the op's result,
        then find them begun).  The copies still wait for every kernel queued before."""
        state = self._state
        refill = state.schedule.refill_in_call(layer)
        if refill is None:
            return
        mine = state.learned.layout[layer]
        for target in state.learned.layout[refill]:
            under = [c for c in mine if c.overlaps(target)]
            if under and all(c.index in chunks for c in under):
                state.start(layer, refill, target.index)

    def _hosted(self) -> list[int]:
        """The layers whose dense MLP is a ``host_mlp`` op, in order."""
        hosting = self._state.learned.hosting
        return [layer for layer in sorted(self._state.choice.mlps)
                if hosting.get(layer) == "host"]

    def _on_host(self, layer: int, tokens: int | None) -> bool:
        """``layer``'s MLP computes on the host in this call (``tokens``: the op's; None: a
        prefetch asking, which never predicts a call not begun).  Weights the host kernel
        cannot read as they are (given non-contiguous storage since) stream."""
        owner = self._owner
        if not self.entry(layer).queueable:
            return False
        if owner.mode == "always":
            return True
        if layer not in self.hosted:
            self.hosted = self._hosted()
        plan = self._plan
        if tokens is not None and (plan is None or plan[0] != tokens):
            owner.discard_timing()      # miscounted tokens: this call is not timed
            plan = self._plan = (tokens, self._predicted(tokens)[0])
        if plan is None or layer not in self.hosted:
            return False
        key = (plan[1], len(self.hosted))
        streamed = self._streamed.get(key)
        if streamed is None:
            schedule = self._state.schedule
            streamed = self._streamed[key] = split.streamed_mlps(
                plan[1], self.hosted, schedule.layers, schedule.num_slots)
        return layer not in streamed

    def _predicted(self, tokens: int):
        """(the rule's ``m``, the call's predicted seconds with ``m``, ``0``, all streamed):
        ``m`` of the hosted MLPs stream, the link carrying them and every other offloaded
        chunk while the host computes the rest."""
        key = (tokens, len(self.hosted))
        found = self._predictions.get(key)
        if found is not None:
            return found
        hosted, layout = self.hosted, self._state.learned.layout
        mlps = self._state.choice.mlps
        each = [sum(c.end - c.start for c in layout[layer] if set(c.suffixes) <= set(mlps[layer]))
                for layer in hosted]
        total = sum(c.end - c.start for chunks in layout.values() for c in chunks)
        size = sum(each) / max(len(each), 1)
        shape = (tokens, len(hosted), size, self.entry(hosted[0]).element_size if hosted else 2,
                 total - sum(each), self._owner.rates())
        best = split.mlps_streamed(*shape)
        found = self._predictions[key] = (best, *(split.mlps_seconds(m, *shape)
                                                  for m in (best, 0, len(hosted))))
        return found

    def entry(self, layer: int):
        """``layer``'s MLP as the host job reads it (made anew when its masters change)."""
        entry = self._entries.get(layer)
        if entry is None or not entry.reads(self._state.masters[layer]):
            state = self._state
            names = state.choice.mlps[layer]
            module = state.choice.stack.modules[layer].get_submodule(mlp_path(names))
            entry = self._entries[layer] = HostWeights(module, [], state.masters[layer], 1,
                                                       mlp=names)
        return entry

