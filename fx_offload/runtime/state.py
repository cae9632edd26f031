"""Run-time state of one offloaded model: who holds the weights, which layer each slot
holds, the copies in flight.

The parameters hold the true weights (an offloaded parameter's ``.data`` is its view into
the layer's host block, one copy); the slots are this state's private cache.  Only while a
call of the model runs (:meth:`OffloadState.enter` ... :meth:`leave`, driven by the model's
hooks) do the parameters point at their slots, so the compiled graph, its guards and a CUDA
graph captured from it always see the same device tensors at fixed addresses.  The compiled
graph reaches this state through an integer handle passed to the custom ops in
:mod:`fx_offload.ops`.  The state keeps, per slot, which layer's chunks its bytes hold,
and :meth:`OffloadState.wait` loads a chunk synchronously where they hold other bytes:
correctness never depends on the schedule being followed.

The state is composed, not inherited: it runs a call's steps in one order (:meth:`enter`,
:meth:`leave`) and forwards the ops, over parts each built from what it needs (the choice,
the parameters, the slot contents) and handed the rest as arguments, never reaching back
into the state: ``versions`` (:mod:`.versions`), ``ownership`` (:mod:`.ownership`),
``writes`` (:mod:`.in_call`), ``hook_copies`` (:mod:`.hook_copies`), ``copies``
(:mod:`.slot_copies`), ``turns`` (:mod:`.turns`: one thread at a time holds the slots),
``contents`` (:mod:`.contents`), ``circular`` (:mod:`.circular`); once materialized,
``buffers`` (:mod:`.slots`) and ``routed`` (:mod:`.routed`).  Where it is in its life is
one value, ``phase`` (:mod:`.phase`: planned, materialized, on slots, on truth, restored),
and each move is checked.

The user's changes taken up at each call, and the threads: docs/ownership.md (Who owns the
weights; The state's parts).  The copy stream's events, and what CUDA-graph capture needs
of them: docs/design.md (Copies on CUDA; What CUDA-graph capture needs).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref

import torch
from torch import nn

from .. import layout, registry
from ..learned import Learned
from . import hooks
from .experts import expert_cache
from .memory import slot_check
from .copies.circular import CircularStart
from .copies.slot_copies import SlotCopies
from .memory.contents import SlotContents
from .memory.streams import capturing as _capturing
from .copies.hook_copies import HookCopies
from .ownership.in_call import WritesInCall
from .interrupts import GUARD
from .ownership.ownership import Hold, Ownership, Restored, ShapeChanged, weak_callbacks
from .phase import Phase
from .experts.routed import RoutedExperts
from .memory.slots import SlotBuffers
from .turns import Turns
from .ownership.versions import ParamVersions

log = logging.getLogger("fx_offload")


class OffloadState:
    """The slots of one model compiled with the backend, driven by the ops.  Built from a
    :class:`~fx_offload.selection.Choice`; it reads no option.  Its parts, each built from
    what it needs: ``versions`` (:class:`~.versions.ParamVersions`), ``writes``
    (:class:`~.in_call.WritesInCall`), ``ownership`` (:class:`~.ownership.Ownership`),
    ``hook_copies`` (:class:`~.hook_copies.HookCopies`), ``contents``, ``circular``,
    ``turns``; once materialized ``buffers`` (:class:`~.slots.SlotBuffers`, whose ring is
    ``ahead``) and ``routed`` (:class:`~.routed.RoutedExperts`).  The state runs the steps
    of a call (:meth:`enter`, :meth:`leave`) and the ops' waits and starts over them."""

    compiled_with = None    # the options of the latest compile (compiler), for report()

    def __init__(self, model: nn.Module, choice, handle: int | None = None,
                 learned: Learned | None = None):
        # the handle the pass gave the graph's ops (compiler), or a new one (place); what
        # the pass learned from the graphs (a model placed before any graph: its layout is
        # arranged at materialization)
        self.handle = registry.new_handle() if handle is None else handle
        self.token = registry.new_token()   # names this state in hooks, across processes
        self.model_ref = weakref.ref(model)
        self.choice = choice
        self.learned = Learned() if learned is None else learned
        self.model_name = choice.model_name
        self.stack, self.params = choice.stack, choice.params
        self.schedule, self.device = choice.schedule, choice.device
        self.layers: list[int] = list(self.schedule.layers)
        self.num_slots = self.schedule.num_slots
        self.buffers: SlotBuffers | None = None
        self.contents = SlotContents(self.learned.layout, self.schedule.slot_of,
                                     self.num_slots)
        self.phase, self.hooks = Phase.PLANNED, []   # (.phase: the moves it may make)
        self.check_slots = slot_check.enabled()     # read once per call (ops.wait_prefetch)
        self.versions = ParamVersions(self.params)
        self.writes = WritesInCall(self.versions)
        self.ownership = Ownership(self.params, self.stack, self.model_ref, self.versions)
        # the refills the call hook begins, worked out once rather than on every call
        self.hook_copies = HookCopies(choice, self.learned.layout, self.contents)
        # the entry hides a copy only behind a resident layer run before the first offloaded
        self.circular = CircularStart(self.schedule.circular, self.model_name,
                                      entry_hides=bool(self.layers) and self.layers[0] > 0)
        self.copies = SlotCopies(choice, self.learned.layout, self.contents, self.versions,
                                 self.circular, self.hook_copies)
        self.turns = Turns(self.model_name, *weak_callbacks(self))
        self._root_call = False             # the call in progress is the model's

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

    @property
    def ahead(self):
        """The ring of :mod:`.ahead` of the slot buffers, or None."""
        return self.copies.ahead

    @property
    def copy_stream(self):
        return self.copies.copy_stream

    @property
    def stats(self) -> dict[str, int]:
        """Refills begun (``prefetches``) and synchronous loads since materialized."""
        return self.copies.stats

    @property
    def holder(self) -> int | None:
        """The thread whose call holds the slots, if any."""
        return self.turns.holder

    def truth_of(self, layer: int, p) -> torch.Tensor:
        """The true value of ``layer``'s offloaded parameter ``p``: its host block's."""
        return p.value_in(self.buffers.masters[layer])

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
        if self.phase is not Phase.PLANNED:
            return
        take = functools.partial(_hold_masters, self.params, placed)
        handover = {p.name: (p.ptrs(), p.versions()) for ps in self.params.values() for p in ps}
        layout.arrange(self.choice, self.learned)   # placed before any graph: arranged now
        cache = expert_cache.make(self.choice)     # before anything touches a parameter
        buffers = SlotBuffers(self.choice, self.learned.layout, take if hand_over else None,
                              fill)
        self.routed = RoutedExperts(self.choice, self.learned.routing, buffers, cache)
        self.copies.bind(buffers, self.routed)
        self.buffers = buffers
        _make_twins(self.params, buffers.masters)
        self.ownership.handover = {
            p.name: handover[p.name] for layer, ps in self.params.items() for p in ps
            if not hand_over and handover[p.name][0] != p.ptrs_in(buffers.masters[layer])}
        if hand_over:
            self.versions.rewrap()
        buffers.compression.encoded_at = {layer: self.versions.of(layer)
                                          for layer in buffers.compressed}
        for layer in self.schedule.first_fill():
            self.copies.load_now(layer)
        self.copies.stats = {"prefetches": 0, "sync_loads": 0}
        registry.register(self, self.model_ref())
        self.phase = self.phase.to(Phase.MATERIALIZED, self.model_name)

    def restore(self) -> bool:
        """Return every offloaded weight to the device, bitwise, and detach; False where
        another thread's restore, or an offload anew, dropped this state first."""
        with self.holding_slots():
            if self.phase is Phase.RESTORED:
                return False
            self.synchronize()
            with contextlib.suppress(ShapeChanged):     # the user's new values stay
                self._take_up_changes(restoring=True)
            if self.phase is Phase.ON_SLOTS:
                self._point_at(truth=True)
            _to_device(self.params, self.masters, self.device)
            self.versions.rewrap()
            self.detach()
        return True

    def detach(self, anew: bool = False) -> None:
        """Forget the model: remove the hooks (``anew``: the model is being offloaded anew,
        whose :func:`placement.activate` replaces them), free the slots and host blocks."""
        self.synchronize()          # no copy may still read a host block or fill a slot
        _untwin_unchanged(self.params, self.masters)
        _remove_hooks(self.hooks, self.model_ref() if anew else None)
        self.hooks.clear()
        slots = ()
        if self.buffers is not None:    # (a backward saved views of them: training.py)
            slots = tuple(flat.untyped_storage() for flat in self.buffers.flat)
            self.buffers.release()
            self.routed.release()
        self.phase = self.phase.to(Phase.RESTORED, self.model_name)
        registry.unregister(self, self.model_ref(), slots)

    def synchronize(self) -> None:
        """Wait for copies in flight and host jobs the streams still hold (they read the
        masters about to be changed)."""
        if getattr(self, "host_experts", None) is not None:
            self.host_experts.synchronize()
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
            self.buffers.synchronize()      # decodes and the ring (with the copy stream)

    # ---- a call, step by step ----------------------------------------------------------
    def enter(self, root: bool, tokens: int | None = None) -> None:
        """A call of the model (``root``) or of one offloaded layer on its own begins: wait
        for another thread's call to end, take up what changed, point the parameters at
        their slots.  Raises :class:`ShapeChanged` where the slots no longer fit."""
        if self.phase is Phase.RESTORED:
            return
        turns, me = self.turns, threading.get_ident()
        if root:
            turns.interrupted = None     # a new call: an interrupt reached its caller
            self.copies.backward = False    # (a backward that raised did not say it ended)
        if turns.holder == me and turns.kind == "call":
            if not root:
                turns.depth += 1         # a layer inside this thread's call
                return
            # This thread is still in a call: a BaseException raised by code (Ctrl-C's
            # signal ends the call at once, .interrupts) skipped the hooks that end one
            # (they run on Exception only).  The weights are intact; start afresh.
            registry.end_call(self)
        elif turns.holder == me:
            turns.give_back()            # a load's hold that its post-hook did not end
        GUARD.arm(self._end_interrupted_call)
        try:
            if turns.holder != me:
                turns.take("call")
            if self.phase is Phase.RESTORED:    # restored while this call waited:
                raise Restored                  # a plain model
            with GUARD.holding():        # Ctrl-C waits until the parameters are pointed
                self.versions.memo = {}
                self._root_call = root
                if root:    # first: the copy stream works while the rest runs; a layer
                    self.begin_entry_refills(tokens)   # changed: reloaded when taken up
                self.writes.forget()
                self._take_up_changes()
                self._after_take_up(root)
                if self.buffers is not None:    # a record a copy found corrupt, unless
                    self.buffers.compression.raise_if_corrupt()     # new weights encoded it anew
                self._point_at(truth=False)
                registry.begin_call(self)
                turns.depth = 1
        except BaseException as error:
            self.versions.memo = None
            turns.give_back()
            GUARD.disarm(self._end_interrupted_call)
            if not isinstance(error, Restored):
                raise

    def begin_entry_refills(self, tokens: int | None = None) -> None:
        """A call begins (its hook): :meth:`.HookCopies.begin_call`."""
        self.check_slots = slot_check.enabled()
        self.hook_copies.begin_call(self.buffers, self.routed, self.circular,
                                    self.copies.hook_refill, tokens)

    def _take_up_changes(self, restoring: bool = False) -> None:
        """What the user did to the offloaded parameters since the last call
        (:meth:`.Ownership.look`): a slot holding a layer changed is reloaded, and (unless
        ``restoring``) its compressed copy encoded again and its cached experts copied."""
        with _no_compile_meanwhile():       # the look may point parameters anew
            found = self.ownership.look(self.buffers, self.synchronize,
                                        functools.partial(registry.replace_param, self),
                                        restoring)
        if found is None:
            return
        moved, stale = found
        if not restoring:   # compressed copies, cached experts follow (a restore drops them)
            stale |= self.buffers.compression.recompress_changed(self.versions.of, moved,
                                                                 self.synchronize)
            self.routed.reload_changed(stale, self.versions.of)
        self.versions.reload_stale(stale, self.contents, self.copies.load_now)
        self.ownership.looked(stale)

    def _after_take_up(self, root: bool) -> None:
        """The call's look at what the user changed has run (``root``: a call of the model,
        not of a layer on its own).  The other chunks of routed layers begin to run ahead
        (:mod:`.ahead`); the expert cache may choose anew which experts it keeps; under CUDA
        graphs, an entry refill the look replaced with a synchronous reload is begun again
        (:meth:`.HookCopies.missing`)."""
        capturing = _capturing()
        if self.ahead is not None:
            self.ahead.begin_call(fill=root and not capturing,
                                  changed=self.versions.changed_since)
        if root and not capturing:
            self.routed.between_calls(self.versions.of)
        if not (root and self.hook_copies.under_cuda_graphs) or self.copy_stream is None \
                or capturing:
            return
        for leaving, refill in self.hook_copies.refills:
            if self.hook_copies.missing(refill, self.buffers.compressed, self.routed):
                self.copies.hook_refill(leaving, refill)

    def leave(self, completed: bool = False) -> None:
        """The call that :meth:`enter` began has ended (``completed``: it returned) or
        raised: the parameters point at the truth again, and another thread may call."""
        turns = self.turns
        if turns.holder != threading.get_ident() or turns.kind != "call":
            return                       # an enter that failed, or another thread's call
        turns.depth -= 1
        if turns.depth > 0:
            return
        with GUARD.holding():            # Ctrl-C waits until the parameters are back
            try:
                self.writes.forget()
                self._point_at(truth=True)
                if self._root_call and self.ahead is not None and not _capturing():
                    self.ahead.end_call(self.versions.of)   # crosses while the host works
                host = getattr(self, "host_experts", None)     # (set by placement)
                if self._root_call and host is not None and not _capturing():
                    host.end_call(completed)    # a timed call of host_compute="auto"
            finally:
                self.versions.memo = None
                registry.end_call(self)
                turns.give_back()
                GUARD.disarm(self._end_interrupted_call)

    def _end_interrupted_call(self) -> None:
        """Ctrl-C stopped this thread's call (:mod:`.interrupts`): end it as the hook that
        torch skips would have."""
        if self.turns.holder == threading.get_ident() and self.turns.kind == "call":
            self.turns.note_interrupted()
            self.turns.depth = 1
            self.leave()

    def _end_left_call(self) -> None:
        """A hold left behind (:mod:`.turns`) ends: the parameters on the truth again."""
        self.versions.memo = None
        if self.phase is Phase.ON_SLOTS:
            self._point_at(truth=True)

    def _point_at(self, truth: bool) -> None:
        """The parameters point at their host blocks (``truth``) or their slots."""
        after = self.phase.to(Phase.ON_TRUTH if truth else Phase.ON_SLOTS, self.model_name)
        with _no_compile_meanwhile():
            self.ownership.point_at(self.buffers, truth)    # (a move refused: none pointed)
        self.phase = after

    def settle(self) -> None:
        """Outside a call: parameters still holding the storage the truth was copied from
        (the first call's) let it go and hold the truth."""
        if self.ownership.handover and self.phase is not Phase.ON_SLOTS and \
                self.turns.holder is None:
            with self.holding_slots():
                self._take_up_changes()

    def holding_slots(self):
        """Hold the slots as a call does (for restore), unless this thread is in a call."""
        return Hold(self.turns, sys._getframe(1).f_code)    # the hold lasts while that runs

    # ---- writes of the weights inside a call (.in_call) --------------------------------
    def in_own_call(self) -> bool:
        """This thread's call holds the slots, the parameters pointing at them."""
        turns = self.turns
        return self.phase is Phase.ON_SLOTS and turns.holder == threading.get_ident() and \
            turns.kind == "call"

    @torch._dynamo.disable         # from a hook Dynamo traces: run as it is, not traced
    def begin_write(self, writer) -> None:
        """``writer`` is about to write the weights: inside this thread's call, point the
        parameters at the truth until :meth:`end_write` of the same ``writer``."""
        if self.in_own_call() and self.writes.begin(writer):
            self._point_at(truth=True)

    @torch._dynamo.disable
    def end_write(self, writer) -> None:
        """The write ``writer`` began is done: the parameters point at the slots again, and
        what the slots hold of layers it changed is loaded anew."""
        if not self.writes.end(writer):
            return
        self._point_at(truth=False)
        written = self.writes.written()
        if not written:
            return
        written |= self.buffers.compression.recompress_changed(self.versions.of, (),
                                                               self.synchronize)
        self.routed.reload_changed(written, self.versions.of)
        self.versions.reload_stale(written, self.contents, self.copies.load_now)

    # ---- the operations the graph calls (.copies) ------------------------------------
    def wait(self, layer: int, chunk: int = -1) -> None:
        """Before ``layer`` reads ``chunk``'s weights (-1: all): make sure its slot holds them."""
        if self.phase is not Phase.RESTORED:
            self.copies.wait(layer, chunk)

    def wait_routed(self, layer: int, chunk: int, ids: torch.Tensor) -> None:
        """Before ``layer`` reads the rows ``ids`` picks of its expert tensors in ``chunk``."""
        self.copies.wait_routed(layer, chunk, ids, self.phase is Phase.RESTORED)

    def start(self, layer: int, refill: int, chunk: int = -1) -> None:
        """``layer`` has read the last of what ``refill``'s ``chunk`` overwrites."""
        if self.phase is not Phase.RESTORED:
            self.copies.start(layer, refill, chunk)

    def join(self) -> None:
        """End of a forward (:meth:`.SlotCopies.join`)."""
        self.copies.join()


def _to_device(params, masters, device) -> None:
    """The parameters holding their true values (host blocks) hold them on ``device``."""
    with torch.no_grad():
        for layer, ps in params.items():
            for p in ps:
                current = p.current()
                if p.fits(current, masters[layer]) and \
                        p.ptrs(current) == p.ptrs_in(masters[layer]):
                    for t in p.parts(current).values():     # the CPU: itself
                        t.data = t.data.to(device)


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


_COMPILE_LOCK = None       # Dynamo's, looked up at the first call (_no_compile_meanwhile)


def _no_compile_meanwhile():
    """Dynamo's compile lock, held while this thread points the parameters anew (their
    ``.data``: slot or host block, with other storage offsets).  A compile holds it from
    Dynamo's trace to the end of the backend, and reads each parameter's sizes, strides and
    storage offset twice: Dynamo fakeifies it, and AOT autograd fakeifies it again against
    the symbols that trace cached.  A compile on another thread that holds no turn (its call
    began before another thread's first call put the hooks on, and Dynamo compiled it again
    after that one) must not see them pointed anew in between: ``BackendCompilerFailed:
    AssertionError: int(sym)=2048 != hint=0``.  Uncontended, one acquire; a call's pointing
    waits for a compile running on another thread.  Looked up once: it is taken twice a
    call."""
    global _COMPILE_LOCK
    if _COMPILE_LOCK is None:
        from torch._dynamo import convert_frame
        _COMPILE_LOCK = getattr(convert_frame, "compile_lock", None) or contextlib.nullcontext()
    return _COMPILE_LOCK


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
