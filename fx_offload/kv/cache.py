"""Put the chosen layers of a transformers ``StaticCache`` in page-locked host memory.

Runs in the model's call hook, before the compiled forward (and Dynamo's guards) see the
cache: a host layer's ``keys``/``values`` become page-locked host tensors, presented to
torch as device tensors through their mapped address (unified virtual addressing), so
that everything that reads or writes the cache outside the compiled graph (``reset()``,
``get_seq_length()``, an eager call, a user reading the cache) still sees the one true copy,
through the link.  Inside the compiled graph the pass reroutes the layer's writes and reads
through a device slot (:mod:`.runtime`).  Layers kept on the device are initialized as
transformers would at their first update, so no graph allocates a cache.
"""
from __future__ import annotations

import gc
import logging
import weakref

import torch

from ..errors import OffloadError
from ..text import format_bytes
from . import host_layers, kv_ops
from .host_layers import KVPlan
from .runtime import note_call

log = logging.getLogger("fx_offload")
WHERE = "kv_cache='host'"


class _Mapped:
    """A page-locked host tensor's bytes, offered to ``torch.as_tensor`` as device memory."""

    def __init__(self, host: torch.Tensor):
        self.host = host        # kept alive by the device tensor made from this object
        self.__cuda_array_interface__ = {
            "shape": (host.numel() * host.element_size(),), "typestr": "|u1",
            "data": (host.data_ptr(), False), "version": 3, "strides": None, "stream": None}


def host_tensor(shape, dtype, device: torch.device, pinned: dict | None = None) -> torch.Tensor:
    """A zeroed tensor in page-locked host memory that ``device`` reads and writes through
    the link (on a CPU run: a plain tensor).  ``pinned``: gets the host tensor itself (the
    copy engine's source), weakly, under its address."""
    if device.type != "cuda":
        return torch.zeros(shape, dtype=dtype)
    host = torch.zeros(shape, dtype=dtype, pin_memory=True)
    with torch.cuda.device(device):
        raw = torch.as_tensor(_Mapped(host), device=device)
    if raw.data_ptr() != host.data_ptr():       # pragma: no cover - a driver without UVA
        raise OffloadError("page-locked host memory is not mapped into the device's "
                           "address space here; kv_cache='host' needs unified addressing",
                           where=WHERE)
    if pinned is not None:
        pinned[host.data_ptr()] = weakref.ref(host)     # alive while the device view is
    return raw.view(dtype).view(shape)


def cache_argument(model, args, kwargs):
    """The ``past_key_values`` a forward call passes (keyword, or the fourth positional
    argument of a transformers causal LM's forward)."""
    if "past_key_values" in kwargs:
        return kwargs["past_key_values"]
    return args[3] if len(args) > 3 else None


def _inputs(args, kwargs):
    """The call's ``input_ids`` (or ``inputs_embeds``): batch by tokens."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if ids is None else ids


def new_tokens(args, kwargs) -> int | None:
    """The tokens a call writes into its cache: its input's sequence length (None where
    the call has no input_ids or inputs_embeds tensor)."""
    ids = _inputs(args, kwargs)
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None


def _dims(model, args, kwargs):
    """(batch, KV heads, key dim, value dim, dtype, device) of the cache a call needs."""
    ids = _inputs(args, kwargs)
    if not isinstance(ids, torch.Tensor):
        raise OffloadError("cannot tell the batch size of this call (no input_ids or "
                           "inputs_embeds tensor)", where=WHERE)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = getattr(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return ids.shape[0], kv_heads, head_dim, head_dim, dtype, ids.device


def _static_layers():
    try:
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
    except ImportError:         # pragma: no cover - transformers is optional
        StaticLayer = StaticSlidingWindowLayer = ()
    return StaticLayer, StaticSlidingWindowLayer


def is_static(cache) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(c, _static_layers()[0]) for c in layers)


def _check_cache(cache, wanted):
    """The cache's layers, or an error that says what to pass instead."""
    StaticLayer, StaticSlidingWindowLayer = _static_layers()
    layers = getattr(cache, "layers", None)
    if cache is None or not is_static(cache):
        kind = type(cache).__name__ if cache is not None else "no cache (past_key_values=None)"
        raise OffloadError(
            f"a static cache's blocks are kept on the host, but this call passes {kind}: "
            "pass cache_implementation='static' to generate(), or a transformers StaticCache "
            "as past_key_values (or use_cache=False), or compile without kv_cache",
            where=WHERE)
    sliding = [i for i, c in enumerate(layers) if isinstance(c, StaticSlidingWindowLayer)]
    if wanted is None:      # every layer the host cache can move
        chosen = [i for i in range(len(layers)) if i not in sliding]
        if not chosen:
            raise OffloadError("every layer of this cache is a sliding-window layer, which "
                               "is not moved to the host; compile without kv_cache",
                               where=WHERE)
        return layers, chosen
    chosen = list(wanted)
    bad = [i for i in chosen if not 0 <= i < len(layers)]
    if bad:
        raise OffloadError(f"kv_layers {bad} name no layer of this cache (it has "
                           f"{len(layers)} layers: 0 to {len(layers) - 1})", where=WHERE)
    if set(chosen) & set(sliding):
        raise OffloadError(f"cache layers {sorted(set(chosen) & set(sliding))} are "
                           "sliding-window layers, which are not moved to the host; leave "
                           "them out of kv_layers", where=WHERE)
    return layers, chosen


def _initialize(layer, keys, values, device) -> None:
    """What ``StaticLayer.lazy_initialization`` sets, with our tensors."""
    layer.dtype, layer.device = keys.dtype, device
    layer.batch_size, layer.num_heads = keys.shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.keys, layer.values = keys, values
    layer.cumulative_length = layer.cumulative_length.to(device)
    for t in (layer.keys, layer.values, layer.cumulative_length):
        torch._dynamo.mark_static_address(t)
    layer.is_initialized = True


def prepare(kv, model, args, kwargs) -> None:
    """Make this call's cache ready: its host layers in host memory, the rest initialized
    on the device.  A cache seen before keeps its host memory; a layer whose tensors were
    replaced (beam search's ``reorder_cache``) is put back on the host; a cache another
    model's runtime holds is taken over from it (:func:`release`)."""
    cache = cache_argument(model, args, kwargs)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(model, "config", None), "use_cache", True)
    if cache is None and not use_cache:
        return
    if cache is not None and cache in kv.caches:
        for i in kv.layers:
            layer = cache.layers[i]
            if kv.owner_of(layer.keys) != (i, "keys") or \
                    kv.owner_of(layer.values) != (i, "values"):
                log.debug("fx_offload: cache layer %d's tensors were replaced: back to the "
                          "host", i)
                _host_layer(kv, i, layer, tuple(layer.keys.shape), tuple(layer.values.shape),
                            layer.keys.dtype, kv.device)
        _read_lengths(kv, cache, args, kwargs)
        return
    if kv.mode != "host" and not is_static(cache):
        return      # (the budget counts a static cache only: another grows as it fills)
    if kv.mode == "host":
        layers, chosen = _check_cache(cache, kv.wanted)
    else:           # "auto" chooses among the layers that can move, "device" none
        sliding = _static_layers()[1]
        layers = cache.layers
        chosen = [i for i, c in enumerate(layers)
                  if kv.mode == "auto" and not isinstance(c, sliding)]
    batch, heads, dk, dv, dtype, device = _dims(model, args, kwargs)
    held = _take_over(kv, cache)        # a cache another model's runtime held
    sizes = {i: batch * heads * layer.max_cache_len * (dk + dv) * dtype.itemsize
             for i, layer in enumerate(layers)}
    if kv.plan is None:
        kv.plan = decide(kv, model, sizes, chosen, device)
        kv.layers = list(kv.plan.layers)
        if kv.budget is not None:
            log.info("fx_offload: %s %s", kv.model_name, kv.plan.describe())
    elif kv.mode == "host" and kv.layers != chosen:
        raise OffloadError(f"this cache's layers {chosen} differ from the first cache's "
                           f"{kv.layers}; give kv_layers", where=WHERE)
    else:
        host_layers.warn_if_over(kv, sizes)
    if not kv.layers:
        for i in held:
            _keep_on_device(layers[i], device)
        kv.caches[cache] = 0
        return      # the whole cache on the device, as transformers makes it
    chosen = kv.layers      # (under "auto" the plan's, fewer than the movable ones)
    kv.use_device(device)
    kv.forget_dead()
    total = 0
    for i, layer in enumerate(layers):
        shape_k = (batch, heads, layer.max_cache_len, dk)
        shape_v = (batch, heads, layer.max_cache_len, dv)
        if i in chosen:
            total += _host_layer(kv, i, layer, shape_k, shape_v, dtype, device, held.get(i))
        elif i in held:
            _keep_on_device(layer, device)
        elif not layer.is_initialized:
            layer.lazy_initialization(
                torch.empty(shape_k[:2] + (0, dk), dtype=dtype, device=device),
                torch.empty(shape_v[:2] + (0, dv), dtype=dtype, device=device))
    first = layers[chosen[0]]
    _drop_unused_slots(kv)
    kv.allocate(first.keys, first.values)
    kv.caches[cache] = total
    _read_lengths(kv, cache, args, kwargs)
    log.info("fx_offload: %s KV cache of %d layer(s) on the host: %s "
             "(%d tokens, batch %d, blocks of %d tokens)", kv.model_name, len(chosen),
             format_bytes(total), first.max_cache_len, batch, kv.block)


def decide(kv, model, sizes: dict[int, int], movable: list[int], device) -> "KVPlan":
    """The cache's plan (:mod:`.host_layers`): the layers asked for under ``kv_cache="host"``;
    under ``memory_budget`` the budget's share too, and under ``"auto"`` the layers."""
    from .. import registry
    from ..selection.budget import weights_bytes
    budget = kv.budget
    if budget is None:          # "host" without a budget: no share to count
        return host_layers.KVPlan(tuple(movable), sizes, kv.num_slots, None, 0, False)
    weights, planned = weights_bytes(model, device), False
    state, nothing = registry.state_for_model(model), registry.nothing_offloaded(model)
    planner = state.choice.planner if state is not None else \
        nothing.planner if nothing is not None else None
    if planner is not None:     # the weights were planned first: the cache gets the rest
        chosen = planner.chosen.candidate
        weights = planner.weights_bytes if chosen is None else chosen.weights_bytes
        planned = True
    if kv.mode == "auto":
        return host_layers.choose(sizes, movable, kv.num_slots, budget, weights, planned)
    layers = tuple(movable) if kv.mode == "host" else ()
    return host_layers.KVPlan(layers, sizes, kv.num_slots, budget, weights, planned)


def _drop_unused_slots(kv) -> None:
    """Return to the allocator the slots of shapes no live cache has (a ``generate`` per
    prompt length leaves one shape behind each time); not once a CUDA graph may hold their
    addresses (no begun-ahead fills either, then)."""
    if kv.slots is None or not kv.next_call.enabled:
        return
    live = _live_shapes(kv)
    if live and live != kv.slots.collected_for:
        # Dynamo's compile of the previous call leaves its tracer in reference cycles that
        # hold that call's cache (and its host blocks) until the next collection: without
        # one here, every prompt length's slots stayed on the device as often as not. Once
        # per set of shapes, so caches a user keeps do not cost a collection each call.
        gc.collect()
        live = kv.slots.collected_for = _live_shapes(kv)
    if kv.copy_stream is not None:      # the copies that may still use them come first
        current = torch.cuda.current_stream(kv.device)
        current.wait_stream(kv.copy_stream)
        current.wait_stream(kv.write_stream)
    freed = kv.slots.prune(live)
    if freed:
        log.info("fx_offload: %s KV slots of caches that are gone freed: %s", kv.model_name,
                 format_bytes(freed))


def _live_shapes(kv) -> frozenset:
    shapes = set()
    for cache in list(kv.caches.keys()):
        first = cache.layers[kv.layers[0]]
        shapes.add(kv.slots.key(first.keys, first.values))
    return frozenset(shapes)


def _host_layer(kv, i, layer, shape_k, shape_v, dtype, device, held=None) -> int:
    """Put cache layer ``i`` in host memory (its tokens, where it holds some, kept); the
    bytes it takes.  ``held``: the layer is another runtime's host layer, whose tensors
    (``held``: its records of their page-locked memory) are taken as they are."""
    if held is not None and (tuple(layer.keys.shape), tuple(layer.values.shape),
                             layer.keys.dtype, layer.keys.device) == \
            (shape_k, shape_v, dtype, device):
        keys, values = layer.keys, layer.values
        kv.pinned.update(held)
    else:
        keys = host_tensor(shape_k, dtype, device, kv.pinned)
        values = host_tensor(shape_v, dtype, device, kv.pinned)
        if layer.is_initialized:        # a cache that holds tokens already: keep them
            keys.copy_(layer.keys)
            values.copy_(layer.values)
    _initialize(layer, keys, values, device)
    for t, what in ((keys, "keys"), (values, "values"), (layer.cumulative_length, "pos")):
        kv.owners[t.data_ptr()] = (i, what, weakref.ref(t))
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


def _keep_on_device(layer, device) -> None:
    """Another model's host layer that this one keeps on the device: a device copy of it
    (read through the link at every step otherwise)."""
    _initialize(layer, layer.keys.clone(), layer.values.clone(), device)


def _take_over(kv, cache) -> dict[int, dict]:
    """The host layers of ``cache`` that another model's runtime holds (a cache handed on
    from one model to another), which that runtime gives up to ``kv``."""
    held = {}
    for other in kv_ops.runtimes():
        if other is not kv and cache in other.caches:
            held.update(release(other, cache))
    return held


def release(kv, cache) -> dict[int, dict]:
    """Give ``cache`` up to another model's runtime: ``kv`` forgets its tensors and the fills
    it began ahead (they may hold the cache's blocks), so that its model, called with the
    cache again, takes it back as a new cache; its graphs refuse the cache until then (the
    update's owner check).  Returns {host layer: the page-locked memory's records}."""
    del kv.caches[cache]
    if kv.copy_stream is not None and not torch.cuda.is_current_stream_capturing():
        current = torch.cuda.current_stream(kv.device)  # its copies that read or write the
        current.wait_stream(kv.copy_stream)             # cache come before the new owner's
        current.wait_stream(kv.write_stream)
    kv.next_call.filled = {}
    kv.before_replay.begun = {}
    held = {}
    for i in kv.layers:
        layer = cache.layers[i]
        mine = [t for t, what in ((layer.keys, "keys"), (layer.values, "values"),
                                  (layer.cumulative_length, "pos"))
                if kv.owner_of(t) == (i, what)]
        for t in mine:
            kv.owners.pop(t.data_ptr())
        if len(mine) == 3:
            held[i] = {t.data_ptr(): kv.pinned.pop(t.data_ptr()) for t in mine[:2]
                       if t.data_ptr() in kv.pinned}
    return held


def _read_lengths(kv, cache, args, kwargs) -> None:
    """Each host layer's valid length, read back once per call (outside CUDA graphs the
    fills then run on the copy engine, whose copies need their sizes on the host, and the
    fills begun ahead are checked against it; a replay runs the captured fill kernel, which
    reads the length on the device).  ``generate`` waits for each step's token before the
    next call, so the read finds the device idle."""
    if kv.device is None or not kv.layers:
        kv.lengths = {}
        return
    lengths = torch.stack([cache.layers[i].cumulative_length.reshape(()) for i in kv.layers])
    kv.lengths = dict(zip(kv.layers, lengths.tolist()))
    tokens = new_tokens(args, kwargs)
    if tokens is not None:
        note_call(kv, cache, tokens)
