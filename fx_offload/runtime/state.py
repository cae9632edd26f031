"""Run-time state of one offloaded model: who holds the weights, which layer each slot holds,
the copies in flight.

Ownership.  The parameters hold the true weights: an offloaded parameter's ``.data`` is its
view into the layer's host block (page-locked on CUDA), one copy, and every PyTorch path
that touches parameters (``state_dict`` of any submodule, ``load_state_dict``, ``copy_``,
``deepcopy``, ``apply``, pickling) acts on the truth.  The slots are this state's private
cache.  Only while a call of the model runs (:meth:`OffloadState.enter` ... :meth:`leave`,
driven by the model's hooks) do the parameters point at their slots, so the compiled graph,
its guards and a CUDA graph captured from it always see the same device tensors at fixed
addresses, and the copies below change what those hold.  At the start of each call the
state takes up what the user changed since the last one: a parameter written in place
(autograd's version counter moved) has its slot reloaded; a parameter given new storage of
the same shape and dtype is copied into its host block.  Calls are serialized: one thread
at a time holds the slots.

The compiled graph reaches this state through an integer handle passed to the custom ops in
:mod:`fx_offload.ops`.  Which slot a layer lives in and which layer refills it come from the
schedule (:mod:`fx_offload.schedule`); a layer moves chunk by chunk (:mod:`fx_offload.layout`),
and the state keeps, per slot, which layer's chunks its bytes hold.

Correctness never depends on the schedule being followed: :meth:`OffloadState.wait` checks
that the slot holds the chunk asked for and loads it synchronously if anything (a partial
call, eager use of a layer, a graph break) left other bytes there.

On CUDA the copies run on one copy stream per device.  ``start`` records an event on the
compute stream and makes the copy stream wait for it before overwriting the chunk's bytes, so
the copy cannot begin before the kernels that read what they held; ``wait`` makes the
compute stream wait on the copy's done event.  Both events of every chunk are made once, when
the slots are, and recorded again on every call.  Both work inside CUDA-graph capture, where the
fork (event wait) pulls the copy into the capture; ``join`` ends a captured forward by joining
copies that were forked during the capture (and, for a model compiled for CUDA graphs, an
eager call too).  The call hook's entry refills (:mod:`.hook_copies`) run outside any
capture, on external events a capture can wait for.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
from torch import nn

from .. import layout, registry
from ..schedule import Schedule
from . import expert_cache, hooks
from .ahead import AheadStarts
from .circular import CircularStart
from .contents import Pending, SlotContents, landed
from .contents import capturing as _capturing
from .hook_copies import HookCopies
from .ownership import Ownership, ShapeChanged
from .routed import RoutedExperts, RoutedWait
from .slots import SlotBuffers

log = logging.getLogger("fx_offload")


class OffloadState(Ownership, RoutedWait, HookCopies, AheadStarts):
    """The slots of one model compiled with the backend, driven by the ops.  Built from a
    :class:`~fx_offload.selection.Choice`; it reads no option."""

    compiled_with = None    # the options of the latest compile (compiler), for report()

    def __init__(self, model: nn.Module, choice):
        self.handle = registry.new_handle()
        self.token = registry.new_token()   # names this state in hooks, across processes
        self.model_ref = weakref.ref(model)
        self.choice = choice
        self.model_name = choice.model_name
        self.stack, self.params = choice.stack, choice.params
        self.schedule, self.device = choice.schedule, choice.device
        self.layers: list[int] = list(self.schedule.layers)
        self.num_slots = self.schedule.num_slots
        self.buffers: SlotBuffers | None = None
        self.contents = SlotContents(choice.layout, self.schedule.slot_of, self.num_slots)
        self._events: dict[tuple[int, int], tuple] = {}   # (layer, chunk) -> (fork, done)
        self.copy_stream, self.materialized, self.restored, self.hooks = None, False, False, []
        self.stats = {"prefetches": 0, "sync_loads": 0}
        # the refills the call hook begins, worked out once rather than on every call
        self._init_hook_copies(choice)
        self.circular = CircularStart(self.schedule.circular, self.model_name)
        self._init_ownership()

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return 0 if self.buffers is None else self.buffers.nbytes

    @property
    def pinned(self) -> bool:
        return self.buffers is not None and self.buffers.pinned

    @property
    def masters(self) -> dict[int, dict[str, torch.Tensor]]:
        """Layer -> parameter name inside the layer -> its true value (host)."""
        return {} if self.buffers is None else self.buffers.masters

    # ---- setup and teardown ------------------------------------------------------------
    @torch.inference_mode(False)    # host blocks and slots outlive the call that made them
    def materialize(self, hand_over: bool, fill=None, placed=None) -> None:
        """Copy the offloaded weights into their host blocks (the truth from now on),
        allocate the slots and fill them for the first call.

        ``hand_over``: point the parameters at their host blocks now, freeing the storage
        they held.  Otherwise (the first compile, inside the first call, whose graph reads the
        parameters as they are) they keep it until the next call begins, which takes the
        host blocks over without a copy.  Everything is allocated before any parameter is
        touched, so a failure (out of host or device memory) leaves the model as it was.
        ``fill(layer, views)`` (``place`` from a checkpoint) writes the values instead; a
        parameter on the meta device is then replaced by one holding its block's view.
        ``placed(layer, masters)``: told as each layer's block is filled (progress)."""
        if self.materialized:
            return
        take = functools.partial(_hold_masters, self.params, placed)
        handover = {p.name: (p.ptrs(), p.versions()) for ps in self.params.values() for p in ps}
        layout.arrange(self.choice)     # a model placed before any graph: arranged now
        cache = expert_cache.make(self.choice)     # before anything touches a parameter
        buffers = SlotBuffers(self.choice, take if hand_over else None, fill)
        self.routed = RoutedExperts(self.choice, buffers, cache)
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            # made once: no event is created on the forward path
            self._events = {(layer, c.index): (torch.cuda.Event(), torch.cuda.Event())
                            for layer in self.layers for c in self.choice.layout[layer]}
            self._make_hook_events()
        self.buffers = buffers
        _make_twins(self.params, buffers.masters)
        self._handover = {p.name: handover[p.name] for layer, ps in self.params.items()
                          for p in ps if not hand_over and
                          handover[p.name][0] != p.ptrs_in(buffers.masters[layer])}
        if hand_over:
            self.rewrap()
        buffers.encoded_at = {layer: self._versions(layer) for layer in buffers.compressed}
        for layer in self.schedule.first_fill():
            self._load_now(layer)
        self.stats = {"prefetches": 0, "sync_loads": 0}
        registry.register(self, self.model_ref())
        self.materialized = True

    def restore(self) -> bool:
        """Return every offloaded weight to the device, bitwise, and detach; False where
        another thread's restore, or an offload anew, dropped this state first."""
        with self.holding_slots():
            if self.restored:
                return False
            self.synchronize()
            with contextlib.suppress(ShapeChanged):     # the user's new values stay
                self._take_up_changes(restoring=True)
            if self.swapped_in:
                self._point_at(truth=True)
            with torch.no_grad():
                for layer, ps in self.params.items():
                    for p in ps:
                        current = p.current()
                        if p.fits(current, self.masters[layer]) and \
                                p.ptrs(current) == p.ptrs_in(self.masters[layer]):
                            for t in p.parts(current).values():     # the CPU: itself
                                t.data = t.data.to(self.device)
            self.rewrap()
            self.swapped_in = False
            self.detach()
        return True

    def detach(self, anew: bool = False) -> None:
        """Forget the model: remove the hooks (``anew``: the model is being offloaded anew,
        whose :func:`placement.activate` replaces them), free the slots and host blocks."""
        self.synchronize()          # no copy may still read a host block or fill a slot
        _untwin_unchanged(self.params, self.masters)
        _remove_hooks(self.hooks, self.model_ref() if anew else None)
        self.hooks.clear()
        if self.buffers is not None:
            self.buffers.release()
            self.routed.release()
        self.restored = True
        registry.unregister(self, self.model_ref())

    def synchronize(self) -> None:
        """Wait for copies in flight (they read the masters about to be changed)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
            self.buffers.synchronize()      # decodes and the ring (with the copy stream)

    # ---- the operations the graph calls ------------------------------------------------
    def wait(self, layer: int, chunk: int = -1) -> None:
        """Before ``layer`` reads ``chunk``'s weights (-1: all): make sure its slot holds them."""
        if self.restored:
            return
        held = self.contents.slot(layer)
        for c in self.contents.chunks(layer, chunk):
            key = (layer, c.index)
            if key not in held:
                self._load_now(layer, c)
            elif held[key] is not None:
                self._wait_for(held[key])
                held[key] = landed(held[key].in_capture)

    def start(self, layer: int, refill: int, chunk: int = -1, by_hook: bool = False) -> None:
        """``layer`` has read the last of what ``refill``'s ``chunk`` (-1: all of them)
        overwrites in their slot: copy it in asynchronously (``by_hook``: the call hook's
        entry refills, begun outside the graph)."""
        if self.restored:
            return
        held, capturing = self.contents.slot(refill), _capturing()
        at_end = chunk >= 0 and Schedule.wraps(layer, refill)   # an entry start's chunk: -1
        if at_end and not self.circular.copies_at_end(capturing):
            return          # left to the next call's entry start (fx_offload.schedule)
        for c in self.contents.chunks(refill, chunk):
            # not overwritten since (a capture copies: its replays cannot know), or begun
            # by this call's hook, for which a capture waits (an external event)
            if (refill, c.index) in held and (not capturing or self.contents.by_hook(refill, c)):
                continue
            if self.routed.skips(refill, c, self.contents):
                continue    # a routed chunk: its wait_routed copies what the router picks
            if c.index == 0:
                self.stats["prefetches"] += 1       # refills begun, whole or in chunks
            self._copied[(refill, c.index)] = self._versions(refill)
            self.contents.forget(refill, c)     # until recorded: cut short, it names nothing
            if self.copy_stream is None:
                self.buffers.copy_in(refill, c)
                self.contents.fill(refill, c, None)
                continue
            fork, done = (self._hook_events if by_hook else self._events)[(refill, c.index)]
            fork.record(torch.cuda.current_stream(self.device))     # made once, recorded again
            self._copy_chunk(refill, c, fork, done, capturing)     # from the ring or the host
            self.contents.fill(refill, c, Pending(done, capturing, by_hook))
            if at_end:
                self.circular.began_at_end(done)

    def join(self) -> None:
        """End of a forward: inside a CUDA-graph capture, join every copy forked during it.
        Also in an eager call of a model compiled for CUDA graphs (a warm-up, a shape not
        captured yet): a replay that comes next reads each slot's first layer as its capture
        found it, without a wait for this call's copy of it (the circular prefetch at the
        end), so the call ends as a replay does, its copies landed.  Elsewhere they run on."""
        if self.copy_stream is None:
            return
        if (capturing := _capturing()) or self.under_cuda_graphs:
            self._join_copies(capturing)

    def _wait_for(self, pending: Pending) -> None:
        # A copy recorded before a capture began was completed by the synchronization that
        # starts every capture (a wait on it inside is refused); no event: it landed there.
        if pending.event is not None and (pending.in_capture or pending.by_hook or
                                          not _capturing()):
            torch.cuda.current_stream(self.device).wait_event(pending.event)

    def _load_now(self, layer: int, chunk=None) -> None:
        """Stream-ordered load of ``layer``'s ``chunk`` (None: all) into its slot."""
        chunks = self.contents.chunks(layer) if chunk is None else (chunk,)
        self.contents.settle_over(layer, chunks, self._wait_for)
        for c in chunks:
            self.contents.forget(layer, c)          # (as in start)
            self.buffers.copy_in(layer, c, non_blocking=self.copy_stream is not None)
            self.contents.fill(layer, c, landed(_capturing()))
            self._copied[(layer, c.index)] = self._versions(layer)
        self.stats["sync_loads"] += 1
        log.debug("fx_offload: loaded layer %d (chunk %s) synchronously", layer, chunk)


def _make_twins(params, masters) -> None:
    """The host twins of quantized weights (``OffloadedParam.twin``), made before the
    registry learns of the parameters."""
    for layer, ps in params.items():
        for p in ps:
            p.twin(masters[layer])


def _untwin_unchanged(params, masters) -> None:
    """Where a host twin still views its host block, its module holds the weight object the
    graph was compiled with again (its inner tensors view that block too), so the model
    offloaded anew (after a change of shape or dtype) keeps the object of the weight's
    device; a twin the user filled anew (``model.half()`` swaps its contents) stays."""
    for layer, ps in params.items():
        for p in ps:
            if p.host is not None and p.ptrs(p.host) == p.ptrs_in(masters[layer]):
                p.untwin()


def _hold_masters(params, placed, layer: int, masters) -> None:
    """Point ``layer``'s parameters at their host block's views; tell ``placed``."""
    with torch.no_grad():
        for p in params[layer]:
            if p.param.device.type == "meta" and not p.inner:   # no .data of another device
                real = type(p.param)(masters[p.suffix], requires_grad=p.param.requires_grad)
                p.owner._parameters[p.attr] = real
                p.param = real
            else:
                p.point_at(masters)
    if placed is not None:
        placed(layer, masters)


def _remove_hooks(handles, offloaded_anew: nn.Module | None) -> None:
    """Remove the hooks of ``handles``, but the call hooks on the root of a model being
    offloaded anew (``offloaded_anew``: they serve the new state, see
    :func:`hooks.call_hooks`): every layer's go, also those of a layer no longer in the
    model, which :func:`placement.activate` would not reach."""
    kept = set() if offloaded_anew is None else \
        {h.id for h in hooks.call_hooks(offloaded_anew)}
    for handle in handles:
        if handle.id not in kept:
            handle.remove()
