"""The ``prefetch_offload`` Dynamo backend: its three entry routes and, for each graph
Dynamo hands it, the compile sequence :func:`compile_graph`:

0. the host KV cache's layers rerouted through their slots (``kv``);
1. inputs: which model and which parameters the placeholders are (``graph_inputs``);
2. choice: at the model's first compile, what is offloaded (``selection.choose``) and a new
   integer handle for its ops; later compiles of the same model reuse its state's;
3. the pass: plan, rewrite and verify the ops (``passes.run_prefetch_pass``), from the
   choice and the handle alone; what it learns from the graph (the copy chunks, the
   routing) goes into the model's ``learned.Learned``, never into the choice;
4. state: at the first compile, the model's offload state (``runtime``), built from the
   choice, the handle and what the pass learned; the ops reach it through the handle;
5. inner compile: Inductor, ``aot_eager`` or ``eager`` (``inner``);
6. materialize: only now, at the first compile, move the weights to host masters and point
   the parameters at their slots, so a failure in steps 1-5 leaves the model untouched;
7. summary: one INFO line (``TORCH_LOGS=fx_offload``).

So the phases run one way: selection -> pass -> runtime.  The routes: docs/usage.md (Four
ways in); the sequence: docs/design.md (The pieces).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, Mapping

import torch
from torch import fx, nn

from . import registry
from .errors import OffloadError
from .graph_inputs import GraphInputs, compiled_frame, read_graph_inputs
from .inner import compile_inner
from .kv import run_kv_pass
from .learned import Learned
from .options import PLACEMENT_KEYS, OffloadOptions, check_host_compute_mode, parse_options
from .passes.prefetch import run_prefetch_pass
from .placement import activate, kept_whole
from .runtime.state import OffloadState
from .selection import NothingOffloaded, choose
from .selection.budget import sizes_of
from .selection.stack import (eager_experts_hint, find_enclosing_model, find_layer_stack,
                              find_outer_model, find_parent_model, top_level_lists)
from .text import format_bytes
from .training import check_grad_mode

log = logging.getLogger("fx_offload")


def prefetch_offload(gm: fx.GraphModule, example_inputs, options: Mapping[str, Any] | None = None,
                     mode: str | None = None, **unexpected):
    """Dynamo backend: ``torch.compile(model, backend="prefetch_offload", options={...})``."""
    if unexpected:
        raise OffloadError(f"got unexpected arguments {sorted(unexpected)}")
    opts = parse_options(options, mode=mode)
    return compile_graph(gm, example_inputs, opts, given=_given(options, mode))


def _given(options, mode=None) -> tuple[str, ...]:
    """The options the user set (one given as None is left at its default), torch.compile's
    ``mode`` among them."""
    given = tuple(k for k, v in (options or {}).items() if v is not None)
    return given + ("mode",) if mode is not None and "mode" not in given else given


class PrefetchOffloadBackend:
    """A configured backend: ``torch.compile(model, backend=fx_offload.backend(**options),
    mode="reduce-overhead")``.  Options are validated when it is made."""

    def __init__(self, **options: Any):
        self._raw = dict(options)
        self.options = parse_options(options)
        self.__name__ = "prefetch_offload"

    def __call__(self, gm, example_inputs, options=None, mode=None, **unexpected):
        if unexpected:
            raise OffloadError(f"got unexpected arguments {sorted(unexpected)}")
        if options:
            raise OffloadError(
                "fx_offload.backend(...) is already configured; give its options to "
                "fx_offload.backend(...), not to torch.compile(options=...)")
        opts = self.options if mode is None else parse_options(self._raw, mode=mode)
        return compile_graph(gm, example_inputs, opts, given=_given(self._raw, mode))

    def __repr__(self) -> str:
        return f"fx_offload.backend({self.options.describe()})"


def backend(**options: Any) -> PrefetchOffloadBackend:
    """A backend object carrying ``options``; see :class:`PrefetchOffloadBackend`."""
    return PrefetchOffloadBackend(**options)


def compile_graph(gm: fx.GraphModule, example_inputs, options: OffloadOptions,
                  given: tuple[str, ...] = ()):
    """``given``: the option names the user gave; placement options left out take what the
    model was offloaded with (by ``fx_offload.place``, say)."""
    placement_given = any(name in PLACEMENT_KEYS for name in given)
    # 0. the host KV cache's layers, rerouted through their slots (fx_offload.kv)
    run_kv_pass(gm, example_inputs, options)
    # 1. inputs
    gi = read_graph_inputs(gm, example_inputs)
    if gi.root is None or not gi.params:
        found = sum(isinstance(v, nn.Parameter) for v in example_inputs)
        if gi.root is None and found:       # parameters of a model it could not find
            log.warning("fx_offload: this graph reads %d parameter(s) of a model that the "
                        "compiled frame does not name, so nothing is offloaded; compile the "
                        "model itself: torch.compile(model, backend='prefetch_offload') or "
                        "fx_offload.compile_forward(model)", found)
        else:
            log.debug("fx_offload: graph reads no model parameters; compiled without "
                      "offloading")
        return compile_inner(gm, example_inputs, options)
    # 2. the choice, and the state of a model compiled before (a new model's state is
    # built after the pass: the pass needs only the choice and a handle)
    state, choice, model, layer_frame = _state_for_graph(gm, gi, options, not placement_given)
    if choice is None:
        return compile_inner(gm, example_inputs, options)
    first = state is None
    handle = registry.new_handle() if first else state.handle
    learned = Learned() if first else state.learned     # what the pass finds in the graphs
    if not first:
        state.turns.stop_if_interrupted()     # a compile in a call that Ctrl-C ended
        placed_with = getattr(state, "placed_with", None)   # set by fx_offload.place
        if placed_with and not set(placed_with) & set(given):
            # place(model, inner_backend=...): used by a compile that sets neither
            options = dataclasses.replace(options, **placed_with)
    placed = choice.options
    check_host_compute_mode(placed.host_compute, options.mode,     # placed with "always"
                            placed.kv_cache)
    backward = check_grad_mode(gi, choice, learned, handle, example_inputs, options,
                               layer_frame)
    host_compute = placed.host_compute_in(choice.device.type, options.mode)
    if backward is not None and host_compute != "never":
        # the host ops have no backward: a training graph streams their weights
        if host_compute == "always":
            raise OffloadError(
                f"{choice.model_name} was placed with host_compute='always', which computes "
                "routed experts and dense MLPs on the host in inference only; this graph "
                "trains (grad enabled, trainable parameters): use host_compute='auto' (a "
                "training graph streams them) or call it under torch.no_grad()")
        host_compute = "never"
    # 3. the pass (a graph of one layer's own frame is reused for every layer: no ops)
    plan = None
    if not layer_frame:
        plan = run_prefetch_pass(gm, gi, choice, learned, handle, host_compute,
                                 placed.mlps_on_host_in(choice.device.type, options.mode))
        if backward is not None:
            backward.set_plan(plan)
    # 4. the run-time state the ops reach through the handle (runtime.state)
    if first:
        state = OffloadState(model, choice, handle, learned)
    if options.mode == "reduce-overhead":   # its calls may be replays from now on
        state.hook_copies.under_cuda_graphs = True    # (runtime.copies.hook_copies)
    state.compiled_with = options           # the inner compiler report() names
    # 5. inner compile (it may ask Dynamo to trace the frame again: warn once it is done)
    compiled = compile_inner(gm, example_inputs, options, backward)
    if plan is not None and plan.hosts:     # its host ops must tell the model's first
        # call from another instance's (registry.state_for_host_op)
        compiled = registry.marks_first_run(compiled, handle)
    if layer_frame:
        _warn_layer_frame(state, gi)
        if first and top_level_lists(gi.root):   # it holds the layers, their hooks inside
            compiled = _traced_again_after_first_run(compiled, gi.code)
    # 6. materialize: host blocks, slots, hooks (the parameters keep their storage for the
    # rest of this call, whose graphs read them as they are, and let it go after the graph
    # that ends the call: the hooks that end a call do not run in the call they were
    # installed in)
    if first:
        activate(state, state.model_ref(), hand_over=False)
    if plan is not None and state.ownership.handover and \
            state.schedule.ends_call([lp.layer for lp in plan.layers]):
        compiled = _then_settle(compiled, state)
    # 7. summary
    if plan is not None:
        log.info(
            "fx_offload: %s graph with %d offloaded layer(s) %s (%d wait, %d start%s); model: "
            "%d of %d layers of %r offloaded, %s to host, %d slot(s) = %s on %s; %s",
            state.model_name, len(plan.layers), [lp.layer for lp in plan.layers],
            len(plan.layers), plan.refills(),
            ", join" if plan.has_starts and plan.join_acts else "",
            len(state.layers), len(state.stack.modules), state.stack.path,
            format_bytes(state.choice.offloaded_bytes), state.num_slots,
            format_bytes(state.buffer_bytes), state.device, _describe(state, options, given))
    return compiled


def _describe(state: OffloadState, options: OffloadOptions, given: tuple[str, ...]) -> str:
    """The options in force: placement options left out of the compile are those the model
    was placed with."""
    placed = state.choice.options
    if not any(name in PLACEMENT_KEYS for name in given) and \
            placed.placement_key() != options.placement_key():
        return (f"{placed.describe(placement_only=True)} (as placed), "
                f"inner_backend={options.inner_backend!r}")
    return options.describe() + ("" if given else " (defaults)")


def _traced_again_after_first_run(compiled, code):
    """A part of the model compiled on its own before the model was offloaded (a decoder
    whose causal LM's forward broke the graph in its first call) was traced with no layer
    hooks, and Dynamo does not guard on hooks added since: run as it is once (the weights
    still hold their storage in this call), then drop the frame's cached code so that its
    next call is traced again, with the hooks that load each layer.  (Other instances of
    the class trace that frame again too, once.)  A layer's own frame needs none of this:
    its hooks run outside it."""
    if code is None:
        return compiled
    ran = False

    def run(*args):
        nonlocal ran
        out = compiled(*args)
        if not ran:
            ran = True
            torch._dynamo.reset_code(code)
        return out
    return run


def _then_settle(compiled, state: OffloadState):
    # Dynamo keeps this graph for the class's code after the model is dropped: a weak
    # reference, so the state (its host blocks and slots) goes with the model
    state_ref = weakref.ref(state)

    def run(*args):
        out = compiled(*args)
        alive = state_ref()
        if alive is not None:
            alive.settle()
        return out
    return run


def _same_layers(kept: NothingOffloaded, model: nn.Module) -> bool:
    """``model``'s layers are those the plan that offloaded nothing (``kept``) was made for:
    the same modules, of the same sizes."""
    try:
        stack = find_layer_stack(model, kept.options.layers)
    except OffloadError:        # no stack to offload now: it stays plain
        return True
    # (compared in any order: the plan's follows the order the layers ran in)
    return sorted(map(id, stack.modules)) == sorted(map(id, kept.stack.modules)) and \
        sorted(sizes_of(stack)) == sorted(kept.planner.layer_sizes)


def _check_same_options(decided, options: OffloadOptions, defaulted: bool = False) -> None:
    """``decided``: the model's state or NothingOffloaded.  Options left out (``defaulted``)
    take what the model was offloaded with (by ``fx_offload.place``, say)."""
    asked = decided.choice.options if isinstance(decided, OffloadState) else decided.options
    if not defaulted and asked.placement_key() != options.placement_key():
        raise OffloadError(
            f"{decided.model_name} is already offloaded with {asked.describe()}; it cannot be "
            f"compiled again with {options.describe()}. Call fx_offload.restore(model) first, "
            "or use the same options")


def _state_for_graph(gm, gi: GraphInputs, options: OffloadOptions, defaulted: bool = False):
    """(the model's state, or None where it has none yet; the choice, None where nothing
    is offloaded; the model; the graph is one layer's own frame?)."""
    state = registry.state_for_model(gi.root)
    if state is not None:
        _check_same_options(state, options, defaulted)
        # (a function inside the model's call, compiled on its own: no path in its graph
        # begins at the model, so it runs as a layer's frame does)
        return state, state.choice, gi.root, gi.inside_call
    # a graph of one layer's own frame (a graph break in or around it, a user's exception
    # raised inside it) belongs to the model whose stack holds that layer
    holder = registry.state_with_layer(gi.root) if gi.frame_is_root_forward else None
    if holder is not None:
        _check_same_options(holder, options, defaulted)
        return holder, holder.choice, holder.model_ref(), True
    owners = {id(o[0]): o for _, p in gi.params.values()
              for o in [registry.owner_of_param(p)] if o is not None}
    if owners:
        other, layer = next(iter(owners.values()))
        if other.holder == threading.get_ident() or (
                gi.frame_is_root_forward and find_outer_model(gi.root) is other.model_ref()):
            # a part of the model compiled inside the model's own call (a graph break in
            # its forward, as transformers' output_hidden_states makes): as a layer's frame
            # (the model's first call holds no turn: its state was made inside it)
            _check_same_options(other, options, defaulted)
            return other, other.choice, other.model_ref(), True
        raise OffloadError(
            f"parameters of this graph's {type(gi.root).__name__} are already offloaded as "
            f"part of layer {layer} of a {other.model_name}; compile that model itself, not a "
            "part of it, or call fx_offload.restore on it first")
    parent = find_parent_model(gi.root) if gi.frame_is_root_forward else None
    if parent is None and gi.frame_is_root_forward:
        # a decoder compiled on its own inside its causal LM's call (a graph break in the
        # LM's forward): the LM owns the layers, as a graph without the break would have
        # made it, and this graph is loaded as a layer's frame is
        parent = find_outer_model(gi.root)
    if parent is not None:
        state = registry.state_for_model(parent)
        if state is not None:
            _check_same_options(state, options, defaulted)
            return state, state.choice, parent, True
    if parent is None and gi.frame_is_root_forward and not top_level_lists(gi.root):
        enclosing = find_enclosing_model(gi.root)
        if enclosing is not None:       # a norm or embedding of the model, on its own
            log.debug("fx_offload: %s of %s compiled on its own (a graph break around it): "
                      "none of its weights are offloaded", type(gi.root).__name__,
                      type(enclosing).__name__)
            return None, None, gi.root, False
    model = parent if parent is not None else gi.root
    kept = registry.nothing_offloaded(model)
    if kept is not None and _same_layers(kept, model):
        _check_same_options(kept, options, defaulted)
        return None, None, model, False
    if kept is not None:        # its layers changed since: planned anew from this graph
        registry.forget_nothing_offloaded(model)
    apart = parent is not None or gi.inside_call
    choice = choose(model, options, graph=(gm, gi), layer_frame=apart)
    if isinstance(choice, NothingOffloaded):
        kept_whole(model, choice, "")
        return None, None, model, False
    return None, choice, model, apart


# models warned about (weakly held): a state Dynamo's restart of a trace abandoned has a
# handle of its own, and the model must not be warned about twice
_WARNED_LAYER_FRAMES: weakref.WeakSet = weakref.WeakSet()
GRAPH_BREAKS_SHOWN = 3          # the most recent graph-break reasons a warning quotes
REASON_CHARS = 200              # of each reason's first line


def _warn_layer_frame(state, gi) -> None:
    model = state.model_ref()
    if model is None or model in _WARNED_LAYER_FRAMES:
        return
    _WARNED_LAYER_FRAMES.add(model)
    log.warning(
        "fx_offload: Dynamo compiled %s on its own (a graph break in or between the "
        "layers of %s; recent graph breaks: %s). No prefetch is placed in such a graph (a "
        "layer's is reused for every layer): offloaded layers are loaded synchronously before "
        "each call instead (correct, but the copy is not hidden). Remove the graph break to get "
        "prefetching%s", compiled_frame(gi), state.model_name, _recent_graph_breaks(),
        eager_experts_hint(state.model_ref()) if state.model_ref() is not None else "")


def _recent_graph_breaks() -> list[str] | str:
    from torch._dynamo.utils import counters
    found = [str(reason).splitlines()[0][:REASON_CHARS]
             for reason in list(counters["graph_break"])[-GRAPH_BREAKS_SHOWN:]]
    # an exception raised in the model while Dynamo traced it leaves no count
    return found or "none counted (an exception raised inside the model as Dynamo traced it " \
        "is one cause)"


def register_names() -> None:
    """Make ``backend="prefetch_offload"`` work when the package is used without being
    installed (installed, torch finds it lazily through the entry point, and registering it
    here too would make that lookup fail as a duplicate), and ``TORCH_LOGS=fx_offload`` turn
    on the summary lines, like torch's own loggers."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry as dynamo_registry
    if not entry_points(group="torch_dynamo_backends", name="prefetch_offload") and \
            "prefetch_offload" not in dynamo_registry._COMPILER_FNS:
        dynamo_registry.register_backend(name="prefetch_offload")(prefetch_offload)
    try:
        from torch._logging._internal import register_log
        register_log("fx_offload", "fx_offload")
    except Exception:  # pragma: no cover - torch's logging registry is internal
        pass
