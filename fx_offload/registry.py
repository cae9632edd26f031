"""Which models are offloaded: the process-wide lookups the ops, the backend and the API use.

* handle -> offload state: the compiled graph names its model's state by an integer handle
  (an op argument), so the ops find the state without holding the model;
* model -> offload state, or the planner's decision to offload nothing;
* parameter -> (offload state, layer index), so a model offloaded as part of another is
  recognised.

Entries hold the model, its parameters and its state weakly: registering keeps nothing alive.
A restored state's handle stays known, and its ops then do nothing.
"""
from __future__ import annotations

import itertools
import threading
import weakref

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import StateGoneError

_HANDLES: dict[int, "weakref.ref"] = {}
_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_PARAM = WeakIdKeyDictionary()            # Parameter -> (state, layer index)
_NOTHING_OFFLOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_RESTORED: set[int] = set()
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def new_handle() -> int:
    return next(_NEXT_HANDLE)


class _Restored:
    """Stands in for a restored state: a compiled graph of a restored model reads the
    parameters' own (restored) data, and its offload ops have nothing left to do."""

    def wait(self, layer):
        pass

    def start(self, layer, refill):
        pass

    def join(self):
        pass


def state_for_handle(handle: int):
    if handle in _RESTORED:
        return _Restored()
    ref = _HANDLES.get(handle)
    state = ref() if ref is not None else None
    if state is None:
        raise StateGoneError(
            f"offload state {handle} no longer exists (its model was garbage collected); "
            "compile the model again", where="fx_offload")
    return state


def state_for_model(model: nn.Module):
    """The offload state of ``model``, or None."""
    return _BY_MODEL.get(model)


def owner_of_param(param) -> "tuple[object, int] | None":
    """(offload state, layer index) of an offloaded parameter, or None."""
    return _BY_PARAM.get(param)


def nothing_offloaded(model: nn.Module):
    """The planner's :class:`~fx_offload.selection.choice.NothingOffloaded` for ``model``
    (its whole weights fit the budget), or None."""
    return _NOTHING_OFFLOADED.get(model)


def record_nothing_offloaded(model: nn.Module, decision) -> None:
    _NOTHING_OFFLOADED[model] = decision


def register(state, model: nn.Module | None) -> None:
    with _LOCK:
        _HANDLES[state.handle] = weakref.ref(state)
        if model is not None:
            _BY_MODEL[model] = state
        for layer, ps in state.params.items():
            for p in ps:
                _BY_PARAM[p.param] = (state, layer)


def unregister(state, model: nn.Module | None) -> None:
    """Forget ``state``; its handle is remembered as restored, so its ops do nothing."""
    with _LOCK:
        _HANDLES.pop(state.handle, None)
        _RESTORED.add(state.handle)
        if model is not None and _BY_MODEL.get(model) is state:
            del _BY_MODEL[model]
        for ps in state.params.values():
            for p in ps:
                if _BY_PARAM.get(p.param, (None,))[0] is state:
                    del _BY_PARAM[p.param]
