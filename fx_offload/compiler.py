"""The ``prefetch_offload`` Dynamo backend.

At each compile of a model's graph:

1. read the graph's placeholders: which model, which parameters (``graph_inputs``);
2. at the model's first compile, choose layers and parameters (``selection``) and build the
   offload state (``runtime``); later compiles of the same model reuse it;
3. plan the ops for the offloaded layers in this graph (``plan``), then insert them
   (``rewrite``);
4. compile the result with the inner compiler (``inner``);
5. only then, at the first compile, move the weights to host masters and point the
   parameters at their slots, so a failure in steps 1-4 leaves the model untouched.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping

import torch
from torch import fx

from . import runtime
from .graph_inputs import find_parent_model, read_graph_inputs
from .inner import compile_inner
from .options import OffloadOptions, format_budget, parse_options
from .plan import plan_graph
from .report import format_bytes
from .rewrite import apply_plan
from .selection import find_layer_stack, select_params
from .verify import slot_model_for, verify_graph

log = logging.getLogger("fx_offload")


def prefetch_offload(gm: fx.GraphModule, example_inputs, options: Mapping[str, Any] | None = None,
                     mode: str | None = None, **unexpected):
    """Dynamo backend: ``torch.compile(model, backend="prefetch_offload", options={...})``."""
    if unexpected:
        raise ValueError(f"prefetch_offload got unexpected arguments {sorted(unexpected)}")
    return compile_graph(gm, example_inputs, parse_options(options, mode=mode),
                         defaulted=not options)


class PrefetchOffloadBackend:
    """A configured backend: ``torch.compile(model, backend=fx_offload.backend(**options),
    mode="reduce-overhead")``.  Options are validated when it is made."""

    def __init__(self, **options: Any):
        self._raw = dict(options)
        self.options = parse_options(options)
        self.__name__ = "prefetch_offload"

    def __call__(self, gm, example_inputs, options=None, mode=None, **unexpected):
        if unexpected:
            raise ValueError(f"prefetch_offload got unexpected arguments {sorted(unexpected)}")
        if options:
            raise ValueError(
                "fx_offload.backend(...) is already configured; give its options to "
                "fx_offload.backend(...), not to torch.compile(options=...)")
        opts = self.options if mode is None else parse_options(self._raw, mode=mode)
        return compile_graph(gm, example_inputs, opts, defaulted=not self._raw)

    def __repr__(self) -> str:
        return f"fx_offload.backend({self.options.describe()})"


def backend(**options: Any) -> PrefetchOffloadBackend:
    """A backend object carrying ``options``; see :class:`PrefetchOffloadBackend`."""
    return PrefetchOffloadBackend(**options)


def _check_same_options(state, options: OffloadOptions) -> None:
    if state.options.placement_key() != options.placement_key():
        raise ValueError(
            f"prefetch_offload: {state.model_name} is already offloaded with "
            f"{state.options.describe()}; it cannot be compiled again with "
            f"{options.describe()}. Call fx_offload.restore(model) first, or use the same "
            "options")


def _state_for_graph(gm, gi, options: OffloadOptions):
    """(state, first compile of the model?, graph is one layer's own frame?); state None
    where the planner offloads nothing."""
    state = runtime.state_for_model(gi.root)
    if state is not None:
        _check_same_options(state, options)
        return state, False, False
    owners = {id(o[0]): o for _, p in gi.params.values()
              for o in [runtime.owner_of_param(p)] if o is not None}
    if owners:
        other, layer = next(iter(owners.values()))
        if gi.frame_is_root_forward and any(gi.root is m for m in other.stack.layers):
            _check_same_options(other, options)
            return other, False, True
        raise ValueError(
            f"prefetch_offload: parameters of this graph's {type(gi.root).__name__} are already "
            f"offloaded as part of layer {layer} of a {other.model_name}; compile that model "
            "itself, not a part of it, or call fx_offload.restore on it first")
    parent = find_parent_model(gi.root) if gi.frame_is_root_forward else None
    if parent is not None:
        state = runtime.state_for_model(parent)
        if state is not None:
            _check_same_options(state, options)
            return state, False, True
    model = parent if parent is not None else gi.root
    if model in _NOT_OFFLOADED:
        _check_same_options(_NOT_OFFLOADED[model], options)
        return None, False, False
    state = new_state(gm, gi, model, options, layer_frame=parent is not None)
    if isinstance(state, PlannedNothing):
        log.warning("fx_offload: memory_budget %s holds all %s of %s's weights: nothing is "
                    "offloaded", format_budget(state.planner.budget),
                    format_bytes(state.planner.weights_bytes), state.model_name)
        _NOT_OFFLOADED[model] = state
        return None, True, False
    return state, True, parent is not None


class PlannedNothing:
    """What a model whose whole weights fit its memory_budget keeps: the planner's result."""

    def __init__(self, model, options, planner, stack):
        self.model_name, self.options = type(model).__name__, options
        self.planner, self.stack = planner, stack

    def describe(self) -> str:
        return self.options.describe()


_NOT_OFFLOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def new_state(gm, gi, model, options: OffloadOptions, layer_frame: bool = False,
              check_owners: bool = True):
    """The offload state of ``model``: from the options, or under ``memory_budget`` from the
    planner, which weighs plans with this graph's costs; a :class:`PlannedNothing` when the
    planner keeps every weight on the device."""
    stack = find_layer_stack(model, options.layers)
    if not options.planned:
        return runtime.OffloadState(model, options, stack, select_params(model, stack, options),
                                    check_owners=check_owners)
    from . import planner
    from .costs import graph_costs
    from .device_rates import RATE_NAMES, rates_for
    device, dtype = _weights_device_and_dtype(stack)
    whole = next((i for i, m in enumerate(stack.layers) if m is gi.root), None) \
        if layer_frame else None
    costs = graph_costs(gm, gi, {stack.prefix(i): i for i in range(len(stack.layers))},
                        whole_graph_layer=whole)
    rates = rates_for(device, dtype, {n: getattr(options, n) for n in RATE_NAMES})
    result = planner.plan(model, stack, options, costs, rates, device)
    if not result.offloads:
        return PlannedNothing(model, options, result, stack)
    chosen = result.chosen.candidate
    params = select_params(model, stack, options, layers=chosen.layers, patterns=chosen.params)
    state = runtime.OffloadState(model, options, stack, params, check_owners=check_owners,
                                 num_slots=chosen.slots)
    state.planner = result
    return state


def _weights_device_and_dtype(stack):
    params = [p for layer in stack.layers for p in layer.parameters()]
    if not params:
        raise ValueError("prefetch_offload: the layers of the stack have no parameters")
    device = params[0].device
    if device.type == "meta":
        raise ValueError(
            "prefetch_offload cannot offload weights on the meta device: load real "
            "weights into the model before compiling it")
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return device, max(sizes, key=sizes.get)


_WARNED_LAYER_FRAMES: set[int] = set()


def _warn_layer_frame(state, gi) -> None:
    if state.handle in _WARNED_LAYER_FRAMES:
        return
    _WARNED_LAYER_FRAMES.add(state.handle)
    log.warning(
        "fx_offload: Dynamo compiled %s.forward on its own (a graph break in or between the "
        "layers of %s; recent graph breaks: %s). That graph is reused for every layer, so no "
        "prefetch can be placed in it: offloaded layers are loaded synchronously before each "
        "call instead (correct, but the copy is not hidden). Remove the graph break to get "
        "prefetching", type(gi.root).__name__, state.model_name, _recent_graph_breaks())


def _recent_graph_breaks() -> list[str]:
    from torch._dynamo.utils import counters
    return [str(reason).splitlines()[0][:200] for reason in list(counters["graph_break"])[-3:]]


def _check_grad_mode(gi, state) -> None:
    if not torch.is_grad_enabled():
        return
    offloaded = {p.name for ps in state.params.values() for p in ps}
    trained = [name for name, p in gi.params.values() if name in offloaded and p.requires_grad]
    if trained:
        raise RuntimeError(
            "prefetch_offload supports inference only: this graph was compiled with grad "
            f"enabled and reads offloaded parameters that require grad ({trained[:3]}...). "
            "Autograd would save slot contents for backward, which the next prefetch "
            "overwrites. Call the model under torch.no_grad() or torch.inference_mode(), or "
            "set requires_grad_(False) on its parameters")


def _trace_graph(name: str, gm: fx.GraphModule) -> None:
    """A structured-trace artifact (``TORCH_TRACE``), so tlparse shows the graph before and
    after the pass; the text is only built when tracing is on."""
    from torch._logging import trace_structured
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False, include_stride=True,
                                             include_device=True),
    )


def verify_plan(gm, plan, state) -> None:
    """Run the slot-safety verifier on a rewritten graph."""
    weight_layer = {w: lp.layer for lp in plan.layers for w in lp.weights}
    verify_graph(gm, weight_layer, slot_model_for(state, [lp.layer for lp in plan.layers]))


def compile_graph(gm: fx.GraphModule, example_inputs, options: OffloadOptions,
                  defaulted: bool = False):
    gi = read_graph_inputs(gm, example_inputs)
    if gi.root is None or not gi.params:
        log.debug("fx_offload: graph reads no model parameters; compiled without offloading")
        return compile_inner(gm, example_inputs, options)
    state, first, layer_frame = _state_for_graph(gm, gi, options)
    if state is None:
        return compile_inner(gm, example_inputs, options)
    _check_grad_mode(gi, state)
    if layer_frame:
        _warn_layer_frame(state, gi)
        compiled = compile_inner(gm, example_inputs, options)
        if first:
            state.materialize()
        return compiled
    _trace_graph("fx_offload_before", gm)
    plan = plan_graph(gm, gi, state)
    apply_plan(gm, plan)
    verify_plan(gm, plan, state)
    _trace_graph("fx_offload_after", gm)
    compiled = compile_inner(gm, example_inputs, options)
    if first:
        state.materialize()
    log.info(
        "fx_offload: %s graph with %d offloaded layer(s) %s (%d wait, %d start%s); model: %d of "
        "%d layers of %r offloaded, %s to host, %d slot(s) = %s on %s; %s%s",
        state.model_name, len(plan.layers), [lp.layer for lp in plan.layers], len(plan.layers),
        sum(lp.target is not None for lp in plan.layers),
        ", join" if plan.has_starts and plan.join_acts else "",
        len(state.layers), len(state.stack.layers), state.stack.path,
        format_bytes(state.offloaded_bytes), state.num_slots, format_bytes(state.buffer_bytes),
        state.device, options.describe(), " (defaults)" if defaulted else "")
    return compiled
