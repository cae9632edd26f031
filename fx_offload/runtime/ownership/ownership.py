"""Who holds the weights, call by call: the parameters hold the truth (their host blocks)
between calls and point at their slots during one.

:class:`Ownership` is the state's ``ownership``, built from the offloaded parameters, the
layer stack and the model (weakly): it points the parameters at their host blocks or their
slots (:meth:`Ownership.point_at`) and looks at what the user changed in them since the last
call (:meth:`Ownership.look`), which the state's :meth:`~.state.OffloadState.enter` runs as
a call begins, before it points them at their slots; :meth:`~.state.OffloadState.leave`
points them back.  The slot buffers are passed to each method: they are made after the
ownership, when the state is materialized.
"""
from __future__ import annotations

import threading
import weakref

import torch

from ...errors import OffloadError
from .fingerprint import Fingerprint


class ShapeChanged(Exception):
    """An offloaded parameter's dtype or shape changed (``.half()``, a reassignment): the
    slots no longer fit, and the model must be offloaded anew."""


class Ownership:
    """Where an offloaded model's parameters point, and what the user changed in them
    (``versions``: the state's :class:`~.versions.ParamVersions`)."""

    def __init__(self, params: dict, stack, model_ref, versions):
        self.params, self.stack, self.model_ref, self.versions = \
            params, stack, model_ref, versions
        self.structure_changed = ""      # what changed: a child module set inside an
        #   offloaded layer, an offloaded parameter set on another module
        self.watched: list[int] = []     # ids of the modules inside offloaded layers
        self.handover: dict[str, tuple] = {}    # name -> (data_ptr, version) of the tensor
        #   a parameter held when the truth was copied from it; taken over without a copy
        self._fingerprint: Fingerprint | None = None  # of the last full look, if one applies

    def point_at(self, buffers, truth: bool) -> None:
        """The parameters point at their host blocks (``truth``) or their slots (the state
        records which in its phase, :mod:`.phase`)."""
        with torch.no_grad():
            for layer, ps in self.params.items():
                views = buffers.masters[layer] if truth else buffers.views[layer]
                for p in ps:
                    p.point_at(views)
        self.versions.rewrap()

    def look(self, buffers, synchronize, replace, restoring: bool = False):
        """What the user did to the offloaded parameters since the last call: new storage
        (``load_state_dict(assign=True)``, ``.data =``, ``.to(device)``) is copied into the
        host block (after ``synchronize``: a copy in flight may read it; ``replace(layer,
        old, new)`` tells the registry of a parameter object replaced).  Returns None where
        nothing can have changed, else ``(moved, stale)``: the parameters given new storage,
        entries ``(layer, p, current, masters, copied)``, and the layers whose host blocks
        took new values.  An in-place write (``copy_``, ``load_state_dict``, an init
        function) is left to the version counters."""
        self.check_stack()
        self.versions.taken_up = set()
        if not restoring and self._fingerprint is not None and self._fingerprint.unchanged():
            return None             # the look below would find nothing: skip it
        self._fingerprint = None
        if self.versions.memo is not None:
            self.versions.memo = {}     # read anew below: the look may change parameters
        stale = set()
        moved = []          # (layer, p, current, its host views, copy the values?)
        for layer, ps in self.params.items():
            buffers.masters_left_block(layer)   # then the loop copies them back
            masters, views = buffers.masters[layer], buffers.views[layer]
            for p in ps:
                current = p.current()
                if p.host is not None and p.ptrs(p.host) != p.ptrs_in(masters):
                    current = p.host    # an inner tensor of the host twin was set anew
                _refuse_transformed(p, current)
                if not p.fits(current, masters):
                    raise ShapeChanged(p.name)
                if current is p.param and p.ptrs() in (p.ptrs_in(masters), p.ptrs_in(views)):
                    continue
                handed = self.handover.pop(p.name, None)
                copy = current is not p.param or handed != (p.ptrs(), p.versions())
                moved.append((layer, p, current, masters, copy))
        news = _new_values(buffers.masters, moved)
        if news:                            # rare: a copy in flight may read a host block
            synchronize()
        for layer, p, current, _, copy in moved:
            if current is not p.param and p.host is None:   # else its values were copied:
                replace(layer, p.param, current)            # the twin stays
                p.param = current       # first: an old object only this held is let go,
        for layer, values in news.items():  # so its block is not taken as viewed by it
            buffers.take_values(layer, values)      # never over what a kept tensor
            stale.add(layer)                        # views (.new_values)
        for layer, p, current, _, copy in moved:
            masters = buffers.masters[layer]
            if p.host is not None:              # the twin views the host block again
                old = p.host
                if p.retwin(masters) is not old:
                    replace(layer, old, p.host)
            p.point_at(masters)
        if moved:
            self.versions.rewrap()
        return moved, stale

    def looked(self, stale: set[int]) -> None:
        """The look's layers taken up (``stale``) are reloaded where their slots held them:
        the next call may skip the look where nothing changed since."""
        self.versions.taken_up = stale
        if Fingerprint.applies(self.params,
                               bool(self.handover or self.versions.dtensor_params)):
            self._fingerprint = Fingerprint(self.params)

    def check_stack(self) -> None:
        """The layer list still holds the offloaded layers at their places (a layer
        replaced, inserted, deleted or reordered changes which weights each index reads),
        and no child module inside an offloaded layer was set (``layers[3].fc1 = new``)."""
        if self.structure_changed:
            raise ShapeChanged(self.structure_changed)
        model = self.model_ref()
        if model is None:
            return
        for path, layers in self.stack.sections():
            try:
                container = model.get_submodule(path) if path else model
            except AttributeError:
                raise ShapeChanged(f"the layer stack {path!r}") from None
            now = list(container)
            if len(now) != len(layers) or any(a is not b for a, b in zip(now, layers)):
                raise ShapeChanged(f"the layer stack {path!r}")


def weak_callbacks(state):
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


class Hold:
    """:meth:`~.state.OffloadState.holding_slots`'s context, on the state's ``turns``."""

    def __init__(self, turns, code):
        self.turns, self.code = turns, code

    def __enter__(self):
        turns = self.turns
        if turns.left_here():               # a hold this thread left behind ends first
            turns.end_left(threading.get_ident())
        self.mine = turns.holder != threading.get_ident()
        if self.mine:
            turns.take(self.code)

    def __exit__(self, *exc):
        if self.mine:
            self.turns.give_back()


class Restored(Exception):
    """The model was restored while a call waited for its turn."""
