"""Who holds the weights, call by call: the parameters hold the truth (their host blocks)
between calls and point at their slots during one.

:meth:`Ownership.enter` begins a call (the model's root hook, or an offloaded layer called on
its own): it waits for another thread's call to end, takes up what the user changed in the
offloaded parameters since the last call (after beginning the copies the schedule starts at
a call's entry), and points the parameters at their slots.
:meth:`Ownership.leave` points them back.  Mixed into :class:`~.state.OffloadState`, whose
``params``, ``buffers``, ``contents``, ``_load_now``, ``begin_entry_refills`` and
``after_take_up`` it uses.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch

from .. import registry
from ..errors import OffloadError
from .contents import capturing
from .fingerprint import Fingerprint
from .in_call import WritesInCall
from .interrupts import GUARD
from .turns import Turns
from .versions import ParamVersions


class ShapeChanged(Exception):
    """An offloaded parameter's dtype or shape changed (``.half()``, a reassignment): the
    slots no longer fit, and the model must be offloaded anew."""


class Ownership(ParamVersions, WritesInCall):
    """Call-by-call ownership of an offloaded model's weights (a mixin)."""

    def _init_ownership(self) -> None:
        self.swapped_in = False          # the parameters point at their slots
        self.entered = False             # a call has begun through the hooks
        self.structure_changed = ""      # what changed: a child module set inside an
        #   offloaded layer, an offloaded parameter set on another module
        self.watched: list[int] = []     # ids of the modules inside offloaded layers
        self.turns = Turns(self.model_name, *_weak_callbacks(self))
        # (layer, chunk) -> the layer's parameters' versions when that chunk was copied: a
        # slot may hold chunks of one layer copied at different times (a refill skips those
        # it holds), so each is checked on its own
        self._copied: dict[tuple[int, int], tuple] = {}
        self._handover: dict[str, tuple] = {}    # name -> (data_ptr, version) of the tensor
        #   a parameter held when the truth was copied from it; taken over without a copy
        self._dtensor_params: list | None = None  # (owner, attr) of DTensor parameters
        self._saved: dict = {}  # name -> the DTensor state_dict gives for it (versions)
        self._fingerprint: Fingerprint | None = None  # of the last full look, if one applies
        self._call_versions: dict[int, tuple] | None = None   # during a call: _versions's
        self._taken_up: set[int] = set()    # layers whose values the latest look copied in
        self._root_call = False             # the call in progress is the model's

    # ---- calls -------------------------------------------------------------------------
    def enter(self, root: bool, tokens: int | None = None) -> None:
        """A call of the model (``root``) or of one offloaded layer on its own begins: wait
        for another thread's call to end, take up what changed, point the parameters at
        their slots.  Raises :class:`ShapeChanged` where the slots no longer fit."""
        if self.restored:
            return
        turns, me = self.turns, threading.get_ident()
        if root:
            turns.interrupted = None     # a new call: an interrupt reached its caller
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
            if self.restored:            # restored while this call waited: a plain model
                raise _Restored
            with GUARD.holding():        # Ctrl-C waits until the parameters are pointed
                self._call_versions = {}
                self._root_call = root
                if root:    # first: the copy stream works while the rest runs; a layer
                    self.begin_entry_refills(tokens)   # changed: reloaded when taken up
                self.forget_write()
                self._take_up_changes()
                self.after_take_up(root)
                if self.buffers is not None:    # a record a copy found corrupt, unless
                    self.buffers.raise_if_corrupt()     # new weights encoded it anew
                self._point_at(truth=False)
                registry.begin_call(self)
                self.entered = True
                turns.depth = 1
        except BaseException as error:
            self._call_versions = None
            turns.give_back()
            GUARD.disarm(self._end_interrupted_call)
            if not isinstance(error, _Restored):
                raise

    def leave(self) -> None:
        """The call that :meth:`enter` began has ended (or raised): the parameters point at
        the truth again, and another thread may call."""
        turns = self.turns
        if turns.holder != threading.get_ident() or turns.kind != "call":
            return                       # an enter that failed, or another thread's call
        turns.depth -= 1
        if turns.depth > 0:
            return
        with GUARD.holding():            # Ctrl-C waits until the parameters are back
            try:
                self.forget_write()
                self._point_at(truth=True)
                if self._root_call and self.ahead is not None and not capturing():
                    self.ahead.end_call(self._versions)     # crosses while the host works
            finally:
                self._call_versions = None
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
        self._call_versions = None
        if self.swapped_in:
            self._point_at(truth=True)

    @property
    def holder(self) -> int | None:
        """The thread whose call holds the slots, if any."""
        return self.turns.holder

    def _point_at(self, truth: bool) -> None:
        with torch.no_grad():
            for layer, ps in self.params.items():
                views = self.buffers.masters[layer] if truth else self.buffers.views[layer]
                for p in ps:
                    p.point_at(views)
        self.rewrap()
        self.swapped_in = not truth

    @property
    def handing_over(self) -> bool:
        """Parameters still hold the storage the truth was copied from."""
        return bool(self._handover)

    def settle(self) -> None:
        """Outside a call: parameters still holding the storage the truth was copied from
        (the first call's) let it go and hold the truth."""
        if self._handover and not self.swapped_in and self.turns.holder is None:
            with self.holding_slots():
                self._take_up_changes()

    def truth_of(self, layer: int, p) -> torch.Tensor:
        """The true value of ``layer``'s offloaded parameter ``p``: its host block's."""
        return p.value_in(self.buffers.masters[layer])

    def _take_up_changes(self, restoring: bool = False) -> None:
        """What the user did to the offloaded parameters since the last call: new storage
        (``load_state_dict(assign=True)``, ``.data =``, ``.to(device)``) is copied into the
        host block; an in-place write (``copy_``, ``load_state_dict``, an init function)
        makes a slot holding that layer stale and (unless ``restoring``) is encoded again."""
        _check_stack(self)
        self._taken_up = set()
        if not restoring and self._fingerprint is not None and self._fingerprint.unchanged():
            return                  # the look below would find nothing: skip it
        self._fingerprint = None
        if self._call_versions is not None:
            self._call_versions = {}    # read anew below: the look may change parameters
        stale = set()
        moved = []          # (layer, p, current, its host views, copy the values?)
        for layer, ps in self.params.items():
            self.buffers.masters_left_block(layer)   # then the loop copies them back
            masters, views = self.buffers.masters[layer], self.buffers.views[layer]
            for p in ps:
                current = p.current()
                if p.host is not None and p.ptrs(p.host) != p.ptrs_in(masters):
                    current = p.host    # an inner tensor of the host twin was set anew
                _refuse_transformed(p, current)
                if not p.fits(current, masters):
                    raise ShapeChanged(p.name)
                if current is p.param and p.ptrs() in (p.ptrs_in(masters), p.ptrs_in(views)):
                    continue
                handed = self._handover.pop(p.name, None)
                copy = current is not p.param or handed != (p.ptrs(), p.versions())
                moved.append((layer, p, current, masters, copy))
        news = _new_values(self.buffers.masters, moved)
        if news:                            # rare: a copy in flight may read a host block
            self.synchronize()
        for layer, p, current, _, copy in moved:
            if current is not p.param and p.host is None:   # else its values were copied:
                registry.replace_param(self, layer, p.param, current)   # the twin stays
                p.param = current       # first: an old object only this held is let go,
        for layer, values in news.items():  # so its block is not taken as viewed by it
            self.buffers.take_values(layer, values)     # never over what a kept tensor
            stale.add(layer)                            # views (.new_values)
        for layer, p, current, _, copy in moved:
            masters = self.buffers.masters[layer]
            if p.host is not None:              # the twin views the host block again
                old = p.host
                if p.retwin(masters) is not old:
                    registry.replace_param(self, layer, old, p.host)
            p.point_at(masters)
        if moved:
            self.rewrap()
        if not restoring:   # compressed copies, cached experts follow (a restore drops them)
            stale |= self.buffers.recompress_changed(self._versions, moved, self.synchronize)
            self.routed.reload_changed(stale, self._versions)
        self._reload_stale(stale)
        self._taken_up = stale
        if Fingerprint.applies(self.params, bool(self._handover or self.dtensor_params)):
            self._fingerprint = Fingerprint(self.params)

    def holding_slots(self):
        """Hold the slots as a call does (for restore), unless this thread is in a call."""
        return _Hold(self, sys._getframe(1).f_code)     # the hold lasts while that runs


def _weak_callbacks(state):
    """The turns' two callbacks, holding ``state`` weakly: a state that referred to itself
    through them would outlive its model until a garbage collection, with its host blocks
    and slots (plain torch frees a dropped model at once)."""
    ref = weakref.ref(state)

    def end_left_call() -> None:
        alive = ref()
        if alive is not None:
            alive._end_left_call()

    def runs_model(module) -> bool:
        alive = ref()
        return alive is not None and _runs_model(alive, module)
    return end_left_call, runs_model


def _runs_model(state, module) -> bool:
    """``module`` is the model, a torch.compile wrapper of it, or one of its layers: a frame
    calling it is a call of this model (:mod:`.turns`)."""
    model = state.model_ref()
    return module is not None and (module is model or getattr(module, "_orig_mod", None)
                                   is model or any(module is m for m in state.stack.modules))


def _new_values(masters: dict, moved: list) -> dict[int, dict]:
    """Layer -> key in its host block -> the new value, of the ``moved`` entries whose
    values are taken up.  All are read before any host block changes: a parameter moved
    from one layer to another still views the host block it came from (then a copy)."""
    news: dict[int, dict] = {}
    if not any(copy for *_, copy in moved):
        return news
    blocks = {t.untyped_storage().data_ptr() for views in masters.values()
              for t in views.values()}
    for layer, p, current, _, copy in moved:
        if copy:
            news.setdefault(layer, {}).update(
                {key: t.detach().clone() if t.untyped_storage().data_ptr() in blocks
                 else t.detach() for key, t in p.parts(current).items()})
    return news


def _refuse_transformed(p, current) -> None:
    """A tensor of a ``torch.func`` transform (``vmap`` over ``stack_module_state``'s
    weights, ``grad``) held by an offloaded parameter: its per-sample weights cannot go
    through one slot."""
    if current is not None and torch._C._functorch.is_functorch_wrapped_tensor(current):
        raise OffloadError(
            f"{p.name} holds a tensor of a torch.func transform (vmap of functional_call, "
            "as over stack_module_state's weights, or grad): an offloaded layer computes "
            "with one set of weights in its slot. Call functional_call on a model that is "
            "not offloaded (fx_offload.restore(model), or a copy of it restored), or vmap "
            "over the inputs alone", where="fx_offload")


def _check_stack(state) -> None:
    """``state``'s layer list still holds the offloaded layers at their places (a layer
    replaced, inserted, deleted or reordered changes which weights each index reads), and no
    child module inside an offloaded layer was set (``layers[3].fc1 = new``)."""
    if state.structure_changed:
        raise ShapeChanged(state.structure_changed)
    model = state.model_ref()
    if model is None:
        return
    for path, layers in state.stack.sections():
        try:
            container = model.get_submodule(path) if path else model
        except AttributeError:
            raise ShapeChanged(f"the layer stack {path!r}") from None
        now = list(container)
        if len(now) != len(layers) or any(a is not b for a, b in zip(now, layers)):
            raise ShapeChanged(f"the layer stack {path!r}")


class _Hold:
    """:meth:`Ownership.holding_slots`'s context."""

    def __init__(self, state, code):
        self.state, self.code = state, code

    def __enter__(self):
        turns = self.state.turns
        if turns.left_here():               # a hold this thread left behind ends first
            turns.end_left(threading.get_ident())
        self.mine = turns.holder != threading.get_ident()
        if self.mine:
            turns.take(self.code)

    def __exit__(self, *exc):
        if self.mine:
            self.state.turns.give_back()


class _Restored(Exception):
    """The model was restored while a call waited for its turn."""

