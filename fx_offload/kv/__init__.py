"""A transformers static KV cache kept in page-locked host memory (``kv_cache="host"``).

``compile_forward(model, kv_cache="host", ...)`` installs a call hook that puts the chosen
layers of each static cache the model is called with in host memory (:mod:`.cache`); the
backend's KV pass reroutes those layers' writes and reads through device slots
(:mod:`.reroute`, checked by :mod:`.verify_reroute`); at run time each step fills a slot with the
layer's valid blocks ahead of its attention and writes the step's tokens back
(:mod:`.runtime`, copies driven from the device: :mod:`.copies`), and as each call ends
begins the next call's first fills (:mod:`.next_call`).  Under ``memory_budget`` the hook also
plans the cache's share of the budget and, under ``kv_cache="auto"``, its host layers
(:mod:`.host_layers`).
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch._dynamo.utils import counters

from .. import registry
from ..errors import OffloadError
from ..passes.frame import pass_frame
from . import cache, host_attention, kv_ops, reroute, verify_reroute
from .runtime import HostKV, summary

log = logging.getLogger("fx_offload")
_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

__all__ = ["HostKV", "summary", "install", "uninstall", "runtime_of", "run_kv_pass",
           "reserved"]


def runtime_of(model) -> HostKV | None:
    return _BY_MODEL.get(model)


def reserved(model) -> int:
    """The device bytes of ``model``'s KV cache under its plan (:mod:`.host_layers`), which the
    weight planner leaves it out of ``memory_budget`` (0: no cache planned yet, or the
    weights planned first)."""
    runtime = _BY_MODEL.get(model)
    plan = None if runtime is None else runtime.plan
    return 0 if plan is None or plan.weights_planned else plan.device_bytes


def install(model, options) -> HostKV:
    """The model's host KV runtime and its call hook (once per model)."""
    runtime = _BY_MODEL.get(model)
    if runtime is not None:
        if (runtime.block, runtime.num_slots, runtime.wanted, runtime.mode, runtime.budget) \
                == (options.kv_block_size, options.kv_slots, options.kv_layers,
                    options.kv_cache, options.memory_budget):
            return runtime
        uninstall(model)    # other KV options: a new runtime takes each cache over
    runtime = HostKV(model, registry.new_handle(), options)
    kv_ops.register(runtime)
    _BY_MODEL[model] = runtime
    ref = weakref.ref(runtime)

    @torch._dynamo.disable
    def prepare_cache(module, args, kwargs):
        live = ref()
        if live is not None:
            live.attention.call_began()     # (a replay runs none of the runtime's Python)
            with torch.inference_mode(False):   # host layers and slots outlive the call
                cache.prepare(live, module, args, kwargs)
                if live.before_replay.enabled:
                    live.before_replay.before_call(live, cache.cache_argument(module, args,
                                                                             kwargs),
                                                   cache.new_tokens(args, kwargs))

    @torch._dynamo.disable
    def after_call(module, args, kwargs, output):
        live = ref()
        if live is not None and live.before_replay.enabled:
            with torch.inference_mode(False):
                live.before_replay.after_call(live, cache.cache_argument(module, args,
                                                                         kwargs))

    runtime.hook = model.register_forward_pre_hook(prepare_cache, with_kwargs=True)
    runtime.after_hook = model.register_forward_hook(after_call, with_kwargs=True)
    return runtime


def uninstall(model) -> None:
    """Compiled again without ``kv_cache="host"``: the call hook goes (caches already on the
    host stay there, correct and read through the link)."""
    runtime = _BY_MODEL.pop(model, None)
    if runtime is not None and runtime.hook is not None:
        runtime.hook.remove()
        runtime.after_hook.remove()


def _writes_a_cache(gm) -> bool:
    """The graph writes a cache the hook did not prepare: one passed in (a placeholder) or
    one transformers allocates inside the graph (a lazily initialized layer)."""
    return any(reroute._is_index_copy(n) for n in gm.graph.nodes)


def run_kv_pass(gm, example_inputs, options) -> list[int]:
    """Reroute the host cache layers this graph writes; returns them (none: nothing to do)."""
    if options.kv_cache == "device":
        return []
    runtime, layers = reroute.find_layers(gm, example_inputs, list(_BY_MODEL.values()))
    if not layers:
        if options.kv_cache == "host" and _writes_a_cache(gm):
            raise OffloadError(
                "this graph writes a cache that was not put on the host. Compile with "
                "fx_offload.compile_forward(model, kv_cache='host', ...), whose call hook "
                "prepares each static cache before the compiled forward sees it, and call "
                "the model (model(...), generate), not model.forward directly",
                where="kv_cache='host'")
        return []
    found = {kl.layer: host_attention.find(kl) for kl in layers}
    chosen = host_attention.choose(options, runtime, found)
    runtime.attention.rows = host_attention.rows_for(options.host_compute)
    runtime.hosting[host_attention.call_tokens(gm)] = chosen
    hosted = {layer: found[layer] for layer, where in chosen.items() if where == "host"}
    with pass_frame("fx_offload_kv", gm, "kv_pass_us"):
        reroute.apply(gm, runtime, layers, hosted)
        verify_reroute.verify(gm.graph, runtime)
    counters["fx_offload"]["kv_layers"] += len(layers)
    log.info("fx_offload: %s graph reroutes the host KV cache of layer(s) %s through %d "
             "slot(s); attention on the host: %s", runtime.model_name,
             [kl.layer for kl in layers if kl.layer not in hosted],
             min(runtime.num_slots, len(runtime.layers)), sorted(hosted) or "none")
    return [kl.layer for kl in layers]

