"""Putting a model's weights where they live: the offloaded layers' in host blocks (the
truth), the rest on the device, the slots allocated; and the hooks on the model's root that
make each call hold the slots.

Two routes lead here.  :func:`place` is the one for a model bigger than the device: build it
without weights (``fx_offload.empty_weights()``) or on the host, ``fx_offload.place(model,
"cuda", checkpoint=folder, **options)`` puts each offloaded layer straight into its host
block (read from the checkpoint, or moved from the host copy; never on the device) and
everything else on the device, then ``torch.compile(model, backend="prefetch_offload")``.
Compiling a model that already sits on the device places it at its first compile instead
(the backend calls :func:`activate`).

A model that carries the root hooks but has no live state (a ``copy.deepcopy`` of an
offloaded model, or one unpickled with ``torch.load``) is offloaded again at its first call
with the same options; so is one whose offloaded parameters changed dtype or shape
(``.half()``): the hooks take up what the user did instead of computing with stale slots.
"""
from __future__ import annotations

import copy
import logging
import time
import weakref
from typing import Any

import torch
from torch import nn

from . import kv, layout, registry
from .checkpoint import Checkpoint, check_model
from .errors import OffloadError
from .learned import Learned
from .options import PLACEMENT_KEYS, OffloadOptions, parse_options
from .runtime import hooks
from .runtime.experts.host_experts import for_state
from .runtime.phase import Phase
from .runtime.state import OffloadState, ShapeChanged
from .selection import NothingOffloaded, budget, choose
from .selection.stack import find_layer_stack
from .selection.trace import plan_from_example
from .text import format_bytes

log = logging.getLogger("fx_offload")
# options of the compile that place takes: a later compile uses them unless it sets its own
COMPILE_KEYS = ("inner_backend", "mode")


def place(model: nn.Module, device: str | torch.device = "cuda", *, checkpoint=None,
          example_inputs=None, **options: Any) -> nn.Module:
    """Offload ``model`` onto ``device`` now: the chosen layers' weights go into page-locked
    host blocks one layer at a time, the other parameters and buffers to ``device``, and the
    slots are allocated there.  Then compile it: ``torch.compile(model,
    backend="prefetch_offload")``.

    ``checkpoint``: where the weights are (a ``save_pretrained`` folder, a ``.safetensors``
    file, or a mapping of name to tensor); each tensor is read straight into the memory that
    keeps it, so the model may be built on the meta device (:func:`empty_weights`).  Without
    it the weights are the model's own, on the host, and its host copy is freed as each
    block fills.  Options are the backend's: ``group_size``, ``num_in_group``,
    ``prefetch_step``, ``offload_params``, ``layers``, or ``memory_budget`` (with
    ``plan_tokens``), which weighs a trace of the model on ``example_inputs`` (a tuple of
    positional arguments or a dict of keyword arguments) made on the meta device.
    ``inner_backend`` and ``mode`` given here are those of a later compile that sets
    neither."""
    registry.model_arg(model, "fx_offload.place")
    try:
        opts = parse_options(options)
    except OffloadError as error:   # the options of this call: named as place's
        error.where = "fx_offload.place"
        raise
    later = sorted(k for k in set(options) - set(PLACEMENT_KEYS) - set(COMPILE_KEYS)
                   if options[k] is not None)
    if later:       # the host KV cache's options: compile_forward's, dropped here
        raise OffloadError(
            f"{', '.join(later)} {'is an option' if len(later) == 1 else 'are options'} of "
            "fx_offload.compile_forward, not of place: give "
            f"{'it' if len(later) == 1 else 'them'} there", where="fx_offload.place")
    if registry.state_for_model(model) is not None:
        raise OffloadError(f"{type(model).__name__} is already offloaded; call "
                           "fx_offload.restore(model) first", where="fx_offload.place")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise OffloadError(f"{device!r} is not a device torch knows ({err}); give 'cuda', "
                           "'cuda:1' or 'cpu'", where="fx_offload.place") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OffloadError("device 'cuda' (the default) asked for, but torch sees no CUDA "
                           "device here: place(model, 'cpu') runs the offload on the host, as "
                           "a simulation", where="fx_offload.place")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    source = None if checkpoint is None else Checkpoint.open(checkpoint)
    try:
        # what is made here outlives the caller's inference_mode: plain tensors, which later
        # calls under no_grad may write in place
        with torch.inference_mode(False):
            return _place(model, device, opts, source, example_inputs,
                          {k: getattr(opts, k) for k in COMPILE_KEYS
                           if options.get(k) is not None})
    finally:
        if source is not None:
            source.close()


def _place(model: nn.Module, device: torch.device, opts: OffloadOptions,
           source: Checkpoint | None, example_inputs, placed_with: dict) -> nn.Module:
    sources = check_model(model, source)
    planner, order = (plan_from_example(model, opts, example_inputs, device) if opts.planned
                      else (None, None))
    choice = choose(model, opts, device=device, planner=planner, order=order)
    progress = _Progress(model)
    if isinstance(choice, NothingOffloaded):
        _move_the_rest(model, set(), device, source, sources, progress)
        kept_whole(model, choice, f"; it is moved to {device}")
        return model
    state = OffloadState(model, choice)
    state.placed_with = placed_with
    fill = None if source is None else _filler(choice, source, sources)
    try:
        activate(state, model, hand_over=True, fill=fill, progress=progress)
        offloaded = {id(p.param) for ps in choice.params.values() for p in ps}
        _move_the_rest(model, offloaded, device, source, sources, progress)
    except BaseException:
        # Every parameter holds its value (its host block, its new device tensor, or what
        # it held before): forget the state, so that place() can simply be called again.
        state.detach()
        raise
    log.info("fx_offload: placed %s in %.1f s: %d of %d layers (%s) in %s host memory, the "
             "rest on %s%s", type(model).__name__, progress.seconds, len(choice.layers),
             len(choice.stack.modules), format_bytes(choice.offloaded_bytes),
             "pinned" if state.pinned else "pageable", device,
             "" if source is None else f", read from {source.where}")
    return model


def _filler(choice, source: Checkpoint, sources):
    """Writes a layer's values into its new host block: from the checkpoint, or from the
    parameter itself where the checkpoint does not have it."""
    quantized = [p.name for ps in choice.params.values() for p in ps
                 if p.inner and sources.name_of(p.param) is not None]
    if quantized:
        raise OffloadError(
            f"{quantized[:3]} are tensor subclasses (quantized weights) the checkpoint would "
            "fill: placing a quantized model from a checkpoint is not supported; load its "
            "weights, then place it without checkpoint=", where="fx_offload.place")

    def fill(layer, views):
        for p in choice.params[layer]:
            name = sources.name_of(p.param)
            if name is not None:
                source.read_into(name, views[p.suffix])
            else:
                for key, t in p.parts().items():
                    views[key].copy_(t.detach())
    return fill


def _move_the_rest(model: nn.Module, offloaded: set[int], device: torch.device,
                   source: Checkpoint | None = None, sources=None, progress=None) -> None:
    """Every parameter and buffer not offloaded to ``device``, read from ``source`` where
    it has them; a tensor on the meta device is replaced (everywhere it is held)."""
    replaced: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or id(t) in offloaded:
                        continue
                    if id(t) not in replaced:
                        replaced[id(t)] = _on_device(t, device, source, sources)
                        if progress is not None:
                            progress.moved(t)
                    new = replaced[id(t)]
                    if new is not t:
                        table[name] = new


def _on_device(t: torch.Tensor, device: torch.device, source, sources) -> torch.Tensor:
    """``t`` (kept where it can take new data) holding its value on ``device``."""
    name = None if sources is None else sources.name_of(t)
    if name is None and t.device == device:
        return t
    if name is None:
        value = t.data.to(device)
    else:
        value = torch.empty(t.shape, dtype=t.dtype, device=device)
        source.read_into(name, value)
    if t.device.type == "meta":       # a meta tensor cannot take another device's data
        return type(t)(value, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else value
    t.data = value
    return t


class _Progress:
    """An INFO line for each tenth of the bytes placed once placing has taken a few seconds
    (``place`` of a large model reads tens of GiB)."""

    STEPS = 10
    QUIET_S = 2.0           # a placement shorter than this prints no progress line

    def __init__(self, model: nn.Module):
        self.name = type(model).__name__
        seen, total = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        self.total, self.done, self.shown = max(total, 1), 0, 0
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def add(self, nbytes: int, what: str) -> None:
        self.done += nbytes
        step = self.done * self.STEPS // self.total
        if step > self.shown and self.seconds >= self.QUIET_S:
            self.shown = step
            log.info("fx_offload: placing %s: %d%% (%s of %s, %s) after %.1f s", self.name,
                     100 * self.done // self.total, format_bytes(self.done),
                     format_bytes(self.total), what, self.seconds)

    def moved(self, t: torch.Tensor) -> None:
        self.add(t.numel() * t.element_size(), "resident weights")

    def layer(self, layer: int, masters) -> None:
        self.add(sum(v.numel() * v.element_size() for v in masters.values()),
                 f"offloaded layer {layer}")


def activate(state: OffloadState, model: nn.Module, hand_over: bool, fill=None,
             progress: _Progress | None = None, keep_call_hooks: bool = False) -> None:
    """Allocate and fill ``state``'s memory and hook it to ``model`` (``keep_call_hooks``:
    the call hooks ``model`` has stay, see :func:`hooks.call_hooks`)."""
    state.materialize(hand_over, fill, None if progress is None else progress.layer)
    # host_compute: the host_experts ops' runtime, the state's one attribute for them
    state.host_experts = state.routed.host = for_state(state)
    kept = hooks.call_hooks(model) if keep_call_hooks else []
    hooks.strip_hooks(model, keep=kept)
    if not kept:
        spec = (state.choice.options, str(state.device), state.learned,
                state.choice.planner)
        kept = [model.register_forward_pre_hook(EnterCall(*spec), with_kwargs=True),
                model.register_forward_hook(LeaveCall(), always_call=True)]
    state.hooks = kept + hooks.install_layer_hooks(state)


def kept_whole(model: nn.Module, choice: NothingOffloaded, then: str, now: bool = False,
               ) -> None:
    """The planner offloads nothing of ``model`` (its ``memory_budget`` holds the whole
    weights): say so (``then``: what is done with it; ``now``: after its layers changed,
    its call hooks kept, see :class:`_Whole`) and record it for ``report`` and later
    compiles."""
    log.warning("fx_offload: memory_budget %s %sholds all %s of %s's weights: nothing is "
                "offloaded%s", format_bytes(choice.options.memory_budget, as_option=True),
                "now " if now else "", format_bytes(choice.planner.weights_bytes),
                choice.model_name, then)
    registry.record_nothing_offloaded(model, choice)
    if now:
        _WHOLE[model] = _Whole(choice)


class _Whole:
    """A model that was offloaded, and that ``memory_budget`` now holds whole (its weights
    shrank: ``.half()``, layers deleted).  Its call hooks stay: a graph Dynamo compiled for
    its offload may run again once the weights are as they were (``.float()``: the guards
    pass), and its ops would then run it as a plain model, over the budget.  The hooks plan
    again as a call begins where the weights' sizes changed (``changed``)."""

    def __init__(self, decision: NothingOffloaded):
        self.decision = decision
        self._held = [(m._parameters, name) for layer in decision.stack.modules
                      for m in layer.modules() for name in m._parameters]
        self._seen = self._now()

    def _now(self) -> list:
        # a comprehension over attributes: this runs as each call begins
        return [None if t is None else (t.dtype, t.shape)
                for owned, name in self._held for t in (owned.get(name),)]

    def changed(self) -> bool:
        """The weights' bytes differ from those the plan kept whole (a dtype or shape
        changed, and with it their size)."""
        now = self._now()
        if now == self._seen:
            return False
        if sorted(budget.sizes_of(self.decision.stack)) != \
                sorted(self.decision.planner.layer_sizes):
            return True
        self._seen = now        # another dtype of the same size (bfloat16 for float16)
        return False


_WHOLE: "weakref.WeakKeyDictionary[nn.Module, _Whole]" = weakref.WeakKeyDictionary()


def still_whole(model: nn.Module) -> bool:
    """``model`` is one :func:`kept_whole` left plain after an offload, whose weights are
    still the size it was planned for."""
    whole = _WHOLE.get(model)
    return whole is not None and registry.nothing_offloaded(model) is whole.decision and \
        not whole.changed()


@torch.inference_mode(False)    # its tensors outlive a call under inference_mode
def _offload_again(model: nn.Module, options: OffloadOptions, device: str,
                   like: Learned | None = None, planner=None,
                   before=None) -> OffloadState | None:
    # under memory_budget, the plan the model had where its layers are the same (in a new
    # dtype or shape), else planned again from that plan's costs (``before``: the layers
    # it planned; no graph here to plan from)
    if planner is not None:
        stack = find_layer_stack(model, options.layers)
        planner = budget.carried_over(model, stack, options, planner, before,
                                      torch.device(device), reserved=kv.reserved(model))
    choice = choose(model, options, device=torch.device(device), planner=planner)
    if isinstance(choice, NothingOffloaded):
        # the layers left fit the budget whole: a plain model on its device, as a first
        # compile of it would leave it, but for its call hooks (_Whole)
        _move_the_rest(model, set(), torch.device(device))
        hooks.strip_hooks(model, keep=hooks.call_hooks(model))
        kept_whole(model, choice, "", now=True)
        return None
    # what the model's graphs taught (``like``): a graph compiled for it (Dynamo shares one
    # among copies) then fits this state's slots, and its routed chunks and host-computed
    # experts stay so (else a copy would move its routed experts whole)
    learned = Learned()
    chunks = None if like is None else layout.chunk_names(like.layout)
    layout.arrange(choice, learned, like=chunks)
    if chunks is not None and layout.chunk_names(learned.layout) == chunks:
        learned.routing.update(copy.deepcopy(like.routing))
        learned.hosting.update(copy.deepcopy(like.hosting))
    state = OffloadState(model, choice, learned=learned)
    activate(state, model, hand_over=True, keep_call_hooks=True)
    offloaded = {id(p.param) for ps in choice.params.values() for p in ps}
    _move_the_rest(model, offloaded, choice.device)
    return state


class EnterCall(hooks.OurHook):
    """Forward pre-hook of an offloaded model's root: a call begins."""

    at_root = True

    def __init__(self, options: OffloadOptions, device: str, learned: Learned | None = None,
                 planner=None):
        # learned: the state's (a copy of the model gets a copy of it, as of the copy);
        # planner: under memory_budget, the plan a copy (or the model in a new dtype) keeps
        self.options, self.device, self.learned, self.planner = options, device, learned, planner

    @torch._dynamo.disable(reason=f"fx_offload: an offloaded model: {hooks.EXPORT_REFUSED}")
    def __call__(self, module, args, kwargs=None):
        if hooks.exporting():   # (a check per call, not a call per call)
            hooks.refuse_export(module)
        state = registry.state_for_model(module)
        tokens = call_tokens(args, kwargs or {})
        if state is None:
            if still_whole(module):
                return None             # memory_budget holds it whole, as planned
            state = self._offload_once(module, None)
            if state is None:
                return None             # its budget now holds it whole: a plain model
        hooks.refuse_grad(state, args)
        while True:
            try:
                state.enter(root=True, tokens=tokens)
            except ShapeChanged as changed:
                state = self._offload_once(module, state, changed)
                if state is None:
                    return None         # restored meanwhile: a plain model now
                continue
            if state.phase is not Phase.RESTORED:
                return None
            # dropped while this call waited for its turn: another thread's call offloads
            # the model anew (enter that state once it is made), or it was restored (a
            # plain model now)
            state = registry.live_state(state)
            if state is None:
                return None

    def _offload_once(self, module, old, changed=None) -> OffloadState | None:
        """Offload ``module`` anew (a copy's first call: ``old`` is None; a change that the
        slots cannot fit: ``old`` is its state), once: threads making such a call at the
        same time take turns, and each after the first finds the new state."""
        with registry.offloading(module):
            state = registry.state_for_model(module)
            if state is not None and state is not old:
                return state                # another thread's call offloaded it
            if old is None and registry.forget_nothing_offloaded(module):
                log.warning("fx_offload: the weights of %s changed size since memory_budget "
                            "held them whole (a dtype or a shape changed): planning again",
                            type(module).__name__)
            elif old is None:
                log.info("fx_offload: %s carries offload hooks but no offload state (a copy, "
                         "or unpickled): offloading it again", type(module).__name__)
            else:
                log.warning("fx_offload: %s of %s changed (dtype, shape, kind such as a "
                            "quantized weight, place in the layer stack, or the modules "
                            "holding it); offloading the model again in its new form",
                            changed, type(module).__name__)
                with old.holding_slots():   # no call of the old state runs meanwhile
                    if old.phase is Phase.RESTORED:
                        return None         # fx_offload.restore got there first
                    old.detach(anew=True)
            if old is None:
                return _offload_again(module, self.options, self.device, self.learned,
                                      self.planner)
            return _offload_again(module, self.options, self.device, old.learned,
                                  old.choice.planner, list(old.choice.stack.modules))


def call_tokens(args, kwargs) -> int | None:
    """Tokens a call of the model carries, as far as its first tensor argument says: an
    integer tensor (token ids) counts its elements, another its elements per last-dimension
    row.  It only guides how a call's expert tensors are prefetched (runtime.experts.routed)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim():
            if value.is_floating_point():
                return value.numel() // max(value.shape[-1], 1)
            return value.numel()
    return None


class LeaveCall(hooks.OurHook):
    """Forward hook (always called) of an offloaded model's root: the call has ended."""

    at_root = True

    @torch._dynamo.disable
    def __call__(self, module, args, output):
        state = registry.state_for_model(module)
        if state is not None:
            # (torch calls it with None where the forward raised)
            state.leave(completed=output is not None)
        return None
