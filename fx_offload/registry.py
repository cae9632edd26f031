"""Which models are offloaded: the process-wide lookups the ops, the backend and the API use.

* handle -> offload state: the compiled graph names its model's state by an integer handle
  (an op argument), so the ops find the state without holding the model;
* model -> offload state, or the planner's decision to offload nothing;
* parameter -> (offload state, layer index), so a model offloaded as part of another is
  recognised;
* token -> offload state: hooks (which are pickled and deep-copied with the model) name
  their state by a token unique across processes, and do nothing when it is not live.

Entries hold the model, its parameters and its state weakly: registering keeps nothing alive.
A restored state's handle stays known, and its ops then do nothing.
"""
from __future__ import annotations

import itertools
import logging
import threading
import uuid
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from . import dtensor
from .errors import OffloadError, StateGoneError

log = logging.getLogger("fx_offload")
_HANDLES: dict[int, "weakref.ref"] = {}
_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_PARAM: dict[int, tuple] = {}             # id of a Parameter -> (weakref to state, layer
#   index), checked against the state's own parameters when read (an id outlives its
#   object).  No weakref to the parameter: torch will not swap a tensor subclass that has
#   one, which nn.Module._apply (model.to, .half) does to quantized weights; and the state
#   holds its parameters, so a strong reference would keep both alive forever.
_BY_TOKEN: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_MODEL_OF_TOKEN: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_NOTHING_OFFLOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_RESTORED: dict[int, tuple] = {}              # handle -> (the schedule, the chunks) it had,
#   its host modules, and weak references to the storages of the slots it freed
_BY_SUBMODULE: dict[int, "weakref.ref"] = {}  # id of a module inside an offloaded layer ->
#   its state, told when a child module is set (``layer.fc1 = new``).  Ids, not the modules:
#   Dynamo finds objects through a global dict keyed by them and names them by that path.
_WATCH: list = []                             # the global module-registration hook, once
_ACTIVE = threading.local()                   # .calls: the states in a call on this thread
_OFFLOADING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> lock
_OFFLOADING_LOCK = threading.Lock()
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def new_handle() -> int:
    return next(_NEXT_HANDLE)


def new_token() -> str:
    return uuid.uuid4().hex


def state_for_token(token: str):
    """The live offload state a hook names, or None (a hook copied with its model, or
    unpickled in another process)."""
    return _BY_TOKEN.get(token)


def state_for_load(token: str):
    """The live state a load hook names: its own, or, where its model was offloaded anew
    since (a model offloaded anew keeps the old hooks until the new ones are on, so a load
    begun meanwhile meets one), the model's state once that offload has registered it."""
    state = _BY_TOKEN.get(token)
    model = _MODEL_OF_TOKEN.get(token) if state is None else None
    return state if model is None else settled_state(model)


class _Restored:
    """Stands in for a restored state: a compiled graph of a restored model reads the
    parameters' own (restored) data, and its offload ops have nothing left to do but the
    host ops, which compute with the modules they replaced (``hosts``: layer -> a weak
    reference to that module, kept at :func:`unregister`; None: a graph shared with a model
    that is not offloaded, whose modules the op cannot name)."""

    def __init__(self, hosts: dict | None = None):
        self.hosts = hosts

    @property
    def host_experts(self) -> "_Restored":
        return self

    def _module(self, layer: int):
        module = None if self.hosts is None or layer not in self.hosts else \
            self.hosts[layer]()
        if module is None:
            raise OffloadError(
                "a graph compiled with host_compute ops (an MLP or experts computed on the "
                "host, from the weights of the model it was compiled for) ran for another "
                "instance of its class that is not offloaded: Dynamo shares one compiled graph "
                "among the instances of a class, so the backend never saw this one (or it was "
                "restored). Offload this instance too before calling it "
                "(fx_offload.place(model, device, <the same options>)), or call "
                "torch._dynamo.reset() before compiling it, or compile with "
                "host_compute='never'", where="fx_offload")
        return module

    def run_mlp(self, layer, chunks, x):
        return torch.empty_like(x).copy_(self._module(layer)(x))

    def run(self, layer, chunks, x, ids, gates):
        return torch.empty_like(x).copy_(self._module(layer)(x, ids, gates))

    def wait(self, layer, chunk=-1):
        pass

    def wait_routed(self, layer, chunk, ids):
        pass

    def start(self, layer, refill, chunk=-1):
        pass

    def join(self):
        pass


class _OnDemand:
    """Runs a graph compiled for other offloaded layers in ``state``'s call: each wait of a
    layer ``state`` offloads loads it if its slot holds another (synchronously); the graph's
    prefetches, meant for other slots, are skipped.  Correct, not fast."""

    def __init__(self, state):
        self.state = state

    def wait(self, layer, chunk=-1):
        # the graph's chunks are another state's: load every chunk of the layer
        if layer in self.state.schedule.slot_of:
            self.state.wait(layer)

    def wait_routed(self, layer, chunk, ids):
        self.wait(layer)

    def start(self, layer, refill, chunk=-1):
        pass

    def join(self):
        pass


def state_for_handle(handle: int):
    if handle in _RESTORED:
        return _Restored(_RESTORED[handle][2])
    ref = _HANDLES.get(handle)
    state = ref() if ref is not None else None
    if state is None:
        raise StateGoneError(
            f"offload state {handle} no longer exists (its model was garbage collected); "
            "compile the model again", where="fx_offload")
    return state


def begin_call(state) -> None:
    calls = getattr(_ACTIVE, "calls", None)
    if calls is None:
        calls = _ACTIVE.calls = []
    calls.append(state)


def end_call(state) -> None:
    calls = getattr(_ACTIVE, "calls", [])
    if state in calls:
        calls.remove(state)


def state_for_op(handle: int):
    """The state an op of a graph compiled for ``handle`` acts on.  Dynamo shares one graph
    among instances of a model class (their parameters are the graph's inputs), so the graph
    may run in another model's call: its ops then act on that model's state, whose slots the
    parameters point at, if it offloads the same layers into as many slots; in a model that
    is not offloaded (its parameters hold their weights) they have nothing to do."""
    ref = _HANDLES.get(handle)
    compiled_for = ref() if ref is not None else None
    me = threading.get_ident()
    if compiled_for is not None and compiled_for.holder == me:
        return compiled_for     # its own model's call: the common case, first
    active = next((s for s in reversed(getattr(_ACTIVE, "calls", ()) or ())
                   if s.holder == me), None)
    if compiled_for is not None and not compiled_for.phase.called:
        # its model's first call (it runs before any hook), unless another model offloaded
        # alike is in its own call here: a copy made before the original's second call (its
        # hooks never ran yet) runs the graph Dynamo shares with it
        if active is None or active is compiled_for or not (
                active.schedule == compiled_for.schedule and
                active.learned.layout == compiled_for.learned.layout):
            return compiled_for
        return active
    if compiled_for is not None:
        compiled_for.turns.stop_if_interrupted()  # its call, ended by Ctrl-C, runs on
    # (an entry of a call whose hold another thread ended, runtime.turns, may be left)
    if active is None:
        # a state's own calls begin through its hooks on the calling thread, but for one
        # begun before another thread's first call put them on; else this is another
        # model's call, and that model is not offloaded
        if compiled_for is None:
            return state_for_handle(handle)
        if compiled_for.holder not in (None, me) and compiled_for.turns.runs_a_call_here():
            _refuse_unhooked_call(compiled_for)
        _warn_unhooked_call(compiled_for)
        return _Restored()
    schedule, chunks = ((compiled_for.schedule, compiled_for.learned.layout)
                        if compiled_for is not None else _RESTORED.get(handle, (None, None))[:2])
    if schedule == active.schedule and chunks == active.learned.layout:
        return active
    if schedule is not None and set(active.layers) <= set(schedule.layers):
        return _OnDemand(active)    # every layer it offloads has a wait in this graph
    if compiled_for is None and handle in _RESTORED:
        raise OffloadError(
            f"a callable compiled before fx_offload.restore ran {active.model_name} after it "
            f"was offloaded anew (now layers {active.layers} in {active.num_slots} slot(s)), "
            "which its graph has no waits for: call what torch.compile returned after the "
            "new offload, or torch._dynamo.reset() so that this callable compiles again",
            where="fx_offload")
    raise OffloadError(
        f"a graph compiled for another offloaded {active.model_name} (offload state {handle}, "
        f"layers {list(schedule.layers) if schedule else '?'}) ran in a call of this one "
        f"(layers {active.layers}, {active.num_slots} slot(s)): they are offloaded "
        "differently. Offload instances of one model class alike, or call "
        "torch._dynamo.reset() before compiling the other", where="fx_offload")


_FIRST_RUNS = threading.local()


def marks_first_run(compiled, handle: int):
    """``compiled`` (a graph with host ops, compiled for ``handle``'s state) marking its
    first run, the one inside the call that compiled it, for :func:`state_for_host_op`."""
    pending = [True]

    def run(*args):
        if not pending[0]:
            return compiled(*args)
        pending[0] = False
        running = _FIRST_RUNS.__dict__.setdefault("handles", [])
        running.append(handle)
        try:
            return compiled(*args)
        finally:
            running.remove(handle)
    return run


def state_for_host_op(handle: int):
    """:func:`state_for_op` for a host op, which computes from the host blocks of the model
    its graph was compiled for.  Before that model's hooks have ever run, its state serves
    the graph's first run, the model's own first call; any later run in that window is
    another instance's call (Dynamo shares the graph), which must not compute with this
    model's weights: it gets :class:`_Restored`, whose host ops refuse."""
    state = state_for_op(handle)
    phase = getattr(state, "phase", None)
    if phase is not None and not phase.called and \
            handle not in getattr(_FIRST_RUNS, "handles", ()) and \
            not state.turns.runs_a_call_here():     # (its own call, begun on another thread)
        _warn_shared_graph(state)
        return _Restored()
    return state


def model_arg(model, where: str) -> nn.Module:
    """What a public function taking a model was given, as :func:`model_of` finds it; the
    one error for anything else (None, a tensor, a state dict)."""
    module = model_of(model)
    if not isinstance(module, nn.Module):
        raise OffloadError(f"expected a model (an nn.Module, or what torch.compile returned "
                           f"for one), got {type(model).__name__}", where=where)
    return module


def model_of(obj):
    """The module behind what ``torch.compile`` returned: ``torch.compile(model)`` (an
    ``OptimizedModule``) or ``torch.compile(model.forward)``; anything else as it is."""
    inner = getattr(obj, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        return inner
    compiled = getattr(obj, "_torchdynamo_orig_callable", None)
    owner = getattr(compiled, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    # a forward Dynamo does not trace from (nn.Sequential's): torch.compile wrapped the
    # bound method in a function that holds it in a closure cell
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            owner = getattr(cell.cell_contents, "__self__", None)
        except ValueError:      # an empty cell
            continue
        if isinstance(owner, nn.Module):
            return owner
    return obj


_WARNED_SHARED: set[int] = set()


def _warn_shared_graph(compiled_for) -> None:
    if compiled_for.handle in _WARNED_SHARED:
        return
    _WARNED_SHARED.add(compiled_for.handle)
    log.warning(
        "fx_offload: a graph compiled for an offloaded %s ran for another %s that is not "
        "offloaded (Dynamo shares one graph among the instances of a class, so the backend "
        "never saw this one): its weights stay where they are. Offload it too with "
        "fx_offload.place(model, device, <the same options>) before calling it, or call "
        "torch._dynamo.reset() before compiling it", compiled_for.model_name,
        compiled_for.model_name)


def _warn_unhooked_call(state) -> None:
    """A graph of ``state``'s ran in a call that did not begin through its hooks: say what
    that call is (once; the frames are read only then)."""
    if state.handle in _WARNED_SHARED:
        return
    if state.turns.runs_a_call_here():
        _warn_call_before_hooks(state)
        return
    part = state.turns.part_called_here(state.stack.modules)
    if part is None:
        _warn_shared_graph(state)
        return
    _WARNED_SHARED.add(state.handle)
    log.warning(
        "fx_offload: %s, which holds the offloaded layers of %s (merge_and_unload() returns "
        "such a part), was called on its own through a graph of its own: its layers are not "
        "streamed, their weights are read where the parameters point (on the host between "
        "calls), and the call takes no turn. Call fx_offload.restore on the %s first to use "
        "the part as a plain model, or call the %s itself", type(part).__name__,
        state.model_name, state.model_name, state.model_name)


def _refuse_unhooked_call(state) -> None:
    """A call begun before the hooks were on reads the parameters where they point: while
    another thread's call holds the turn, that is its slots, so the output would be wrong."""
    raise OffloadError(
        f"a call of {state.model_name} began before another thread's first call offloaded "
        "it, and ran while another thread's call of the model held its slots: its weights "
        "would have been that call's. Make the model's first call on one thread before "
        "calling it from several")


def _warn_call_before_hooks(state) -> None:
    _WARNED_SHARED.add(state.handle)
    log.warning(
        "fx_offload: a call of %s began before another thread's first call offloaded it: "
        "it runs its graph as a plain model's (its copies skipped) and takes no turn, so its "
        "outputs are wrong where another thread's call of the model runs at the same time. "
        "Make the model's first call on one thread before calling it from several",
        state.model_name)


def live_state(state):
    """The state ``state``'s model has now: ``state`` was dropped (its model offloaded anew,
    or restored) while the caller waited for its turn; the new one, or None."""
    model = state.model_ref()
    return None if model is None else settled_state(model)


def settled_state(model: nn.Module):
    """:func:`state_for_model`, never in the gap of an offload anew (it waits for that to
    end), unless this thread holds the state's turn: the offload anew waits for that hold
    to end, so waiting for it would wait for ever (a weight update inside a call)."""
    state = state_for_model(model)
    if state is not None and state.turns.holder == threading.get_ident():
        return state
    with offloading(model):
        return state_for_model(model)


def offloading(model: nn.Module) -> threading.Lock:
    """The lock held while a call hook offloads ``model`` anew (its old state dropped, the
    new one not registered yet), and by whoever must see one state or the other
    (``restore``), never that gap.  One per model: a call of one model may offload another
    (called inside it) anew meanwhile."""
    model = model_of(model)
    with _OFFLOADING_LOCK:
        lock = _OFFLOADING.get(model)
        if lock is None:
            lock = _OFFLOADING[model] = threading.Lock()
        return lock


def state_for_model(model: nn.Module):
    """The offload state of ``model`` (or of the module a compiled wrapper holds), or None."""
    return _BY_MODEL.get(model_of(model))


def state_with_layer(module: nn.Module):
    """The live offload state whose layer stack holds ``module`` as one of its layers
    (offloaded or not) or inside one (a layer's norm, its MLP), or None: a graph of that
    module's own frame (after a graph break in or around it) belongs to that state's model.
    Read at compile time only."""
    for ref in list(_HANDLES.values()):
        state = ref()
        if state is not None and any(module is inner for layer in state.stack.modules
                                     for inner in layer.modules()):
            return state
    return None


def owner_of_param(param) -> "tuple[object, int] | None":
    """(offload state, layer index) of an offloaded parameter (or of a DTensor parameter
    whose local shard is offloaded), or None."""
    param = dtensor.local(param)
    state = _state_of_entry(param)
    return None if state is None else (state, _BY_PARAM[id(param)][1])


def part_of_offloaded(module: nn.Module, where: str):
    """An :class:`OffloadError` for ``module`` where it is a part of an offloaded model (it
    holds offloaded weights, as a layer does) but not the model itself; else None."""
    for param in module.parameters():
        owner = owner_of_param(param)
        if owner is not None and _BY_MODEL.get(model_of(module)) is not owner[0]:
            state, layer = owner
            return OffloadError(
                f"this {type(module).__name__} is a part of the offloaded "
                f"{state.model_name} (it holds offloaded weights of layer {layer}); pass "
                f"the model itself", where=where)
    return None


def nothing_offloaded(model: nn.Module):
    """The planner's :class:`~fx_offload.selection.choice.NothingOffloaded` for ``model``
    (its whole weights fit the budget), or None."""
    return _NOTHING_OFFLOADED.get(model_of(model))


def record_nothing_offloaded(model: nn.Module, decision) -> None:
    _NOTHING_OFFLOADED[model] = decision


def forget_nothing_offloaded(model: nn.Module) -> bool:
    """Drop the planner's nothing-offloaded record of ``model``; True if there was one."""
    return _NOTHING_OFFLOADED.pop(model_of(model), None) is not None


def register(state, model: nn.Module | None) -> None:
    with _LOCK:
        _HANDLES[state.handle] = weakref.ref(state)
        _BY_TOKEN[state.token] = state
        if model is not None:
            _BY_MODEL[model] = state
            _MODEL_OF_TOKEN[state.token] = model
        for layer, ps in state.params.items():
            for p in ps:
                for held in (p.param, p.host):      # a quantized weight's host twin too
                    if held is not None:
                        _BY_PARAM[id(held)] = (weakref.ref(state), layer)
            for module in state.stack.modules[layer].modules():
                _BY_SUBMODULE[id(module)] = weakref.ref(state)
                state.ownership.watched.append(id(module))
        # entries of states collected without being unregistered
        for key in [k for k, ref in _BY_SUBMODULE.items() if ref() is None]:
            del _BY_SUBMODULE[key]
        for key in [k for k, (ref, _) in _BY_PARAM.items() if ref() is None]:
            del _BY_PARAM[key]
        if not _WATCH:
            _WATCH.append(register_module_module_registration_hook(_child_set))
            _WATCH.append(register_module_parameter_registration_hook(_param_set))


def _child_set(module, name, child):
    """A child module was set on ``module`` (any module in the process): if it is inside an
    offloaded layer, that layer's parameters may have changed; the next call re-checks."""
    if torch.compiler.is_compiling():
        # A forward that builds a module list (transformers slices ``self.layers[:n]``) runs
        # this hook while Dynamo traces it: traced, its lookups of the registry (which the
        # backend fills between a trace and its restart) made Dynamo's restarted analysis
        # diverge. Users set modules outside the forward, where this runs.
        return
    ref = _BY_SUBMODULE.get(id(module))
    state = None if ref is None else ref()
    if state is not None and any(m is module for layer in state.params
                                 for m in state.stack.modules[layer].modules()):
        state.ownership.structure_changed = "a module inside an offloaded layer"


def _param_set(module, name, param):
    """A parameter was set on ``module`` (any module in the process): an offloaded one set
    on a module other than its own (a weight tied after offloading) would be read, by a
    layer the schedule does not load, from whatever its slot holds.  The next call offloads
    the model anew, and a shared parameter stays resident."""
    if param is None or torch.compiler.is_compiling():     # (as _child_set)
        return
    found = _BY_PARAM.get(id(param))
    state = None if found is None else found[0]()
    if state is not None and any((param is p.param or param is p.host) and p.owner is not module
                                 for p in state.params.get(found[1], ())):
        state.ownership.structure_changed = \
            f"{_name_of(state, param)} (now held by another module too)"


def _name_of(state, param) -> str:
    return next((p.name for ps in state.params.values() for p in ps
                 if param is p.param or param is p.host), "an offloaded parameter")


def _host_modules(state) -> dict:
    """Layer -> a weak reference to the module each host op of ``state``'s graphs replaced
    (a dense MLP, or a routed experts module)."""
    from .selection.mlps import mlp_path     # (selection imports this module)
    found = {}
    for layer, why in state.learned.hosting.items():
        if why != "host":
            continue
        names = state.choice.mlps.get(layer)
        if names is not None:
            module = state.choice.stack.modules[layer].get_submodule(mlp_path(names))
            found[layer] = weakref.ref(module)
            continue
        routed = {c for c, how in state.learned.routing.get(layer, {}).items() if how == "routed"}
        suffixes = {s for c in state.learned.layout.get(layer, ()) if c.index in routed
                    for s in c.suffixes}
        owner = next((p.owner for p in state.params[layer] if p.suffix in suffixes), None)
        if owner is not None:
            found[layer] = weakref.ref(owner)
    return found


def unregister(state, model: nn.Module | None, slots: tuple = ()) -> None:
    """Forget ``state``; its handle is remembered as restored, so its ops do nothing.
    ``slots``: the storages of the slots it freed (:func:`reads_freed_slots`)."""
    freed = tuple(StorageWeakRef(s) for s in slots)
    with _LOCK:
        _HANDLES.pop(state.handle, None)
        _BY_TOKEN.pop(state.token, None)
        _RESTORED[state.handle] = (state.schedule, dict(state.learned.layout),
                                   _host_modules(state), freed)
        if model is not None and _BY_MODEL.get(model) is state:
            del _BY_MODEL[model]
        for ps in state.params.values():
            for p in ps:
                for held in (p.param, p.host):
                    if held is not None and _state_of_entry(held) is state:
                        del _BY_PARAM[id(held)]
        for key in state.ownership.watched:
            if _BY_SUBMODULE.get(key, lambda: None)() is state:
                del _BY_SUBMODULE[key]
        state.ownership.watched.clear()


def reads_freed_slots(handle: int, tensors) -> bool:
    """True where ``handle``'s model was restored and one of ``tensors`` views a slot that
    restore freed (a backward of a forward from before it); a tensor of a storage alive
    now cannot be a freed one whose reference expired, so the test is exact."""
    entry = _RESTORED.get(handle)
    if entry is None:
        return False
    live = {ref for ref in entry[3] if not ref.expired()}
    return bool(live) and any(StorageWeakRef(t.untyped_storage()) in live
                              for t in tensors if isinstance(t, torch.Tensor))


def replace_param(state, layer: int, old, new) -> None:
    """``new`` took the place of the offloaded parameter ``old`` (``assign=True``)."""
    with _LOCK:
        if _state_of_entry(old) is state:
            del _BY_PARAM[id(old)]
        _BY_PARAM[id(new)] = (weakref.ref(state), layer)


def _state_of_entry(param):
    found = _BY_PARAM.get(id(param))
    state = None if found is None else found[0]()
    if state is None or not any(param is p.param or param is p.host
                                for p in state.params.get(found[1], ())):
        return None         # its state is gone, or the id is another object's now
    return state
