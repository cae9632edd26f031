"""The pass of the host KV cache: reroute each host layer's cache through its slot.

A transformers static cache layer, traced by Dynamo, writes the step's keys and values into
the cache (graph inputs ``K``, ``V``; ``P`` its valid length) and the attention reads the
whole cache::

    idx = arange(n) + P                        idx = arange(n) + P
    P.add_(n)                                  P.add_(n)
    K.index_copy_(2, idx, k)          ==>      kv = kv_update(a, k, v, idx, K, V, [K2, V2, P2],
    V.index_copy_(2, idx, v)                                  h, L, L2)
    attn(q, K[...], V[...])                    attn(q, kv[0][...], kv[1][...])

or, for a layer whose attention runs on the host (:mod:`.host_attention`), both writes and
the attention become one ``kv_attend``, and the layer takes no slot;

and at the top of the graph and before its output::

    a = empty_like(x)                          # x: the smallest tensor input; an anchor
    kv_begin(a, [K, ...], [V, ...], [P, ...], h, [L, ...])    # each slot's first layer
    ...
    kv_join([out], h)                          # out: the graph's outputs

``L2`` is the next host layer of the graph in ``L``'s slot (its keys, values and length
``K2, V2, P2``), whose fill the update begins once ``L`` is done with the slot.  The update
returns fresh tensors, so the compilers order every read of the layer's cache after it by
data flow alone; ``kv_begin`` declares the anchor mutated and every update reads it, so the
fills it begins stay at the top.  The graph inputs ``K``/``V`` are read by the ops only:
no node of the rewritten graph reads the host cache.  ``verify`` checks the slot rule on the
result: a slot is refilled only after its layer's update, and a host layer is read (filled)
at most once per call, before its own update writes it.
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

from ..errors import OffloadError
from ..graph_inputs import storage_of, value_of
from . import host_attention, kv_ops

log = logging.getLogger("fx_offload")
_INDEX_COPY = {torch.Tensor.index_copy_, torch.ops.aten.index_copy_.default}
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


class KVPassError(OffloadError):
    """The graph writes or reads a host cache layer in a way the pass cannot reroute."""


@dataclasses.dataclass
class KVLayer:
    layer: int
    keys: fx.Node
    values: fx.Node
    pos: fx.Node | None
    writes: tuple[fx.Node, fx.Node] = None     # the index_copy_ of keys, of values
    target: int = -1                           # the next layer of this graph in the slot


def _is_index_copy(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "index_copy_") or \
        (node.op == "call_function" and node.target in _INDEX_COPY)


def find_layers(gm: fx.GraphModule, example_inputs, runtimes) -> tuple[object, list[KVLayer]]:
    """(the runtime, its host layers this graph writes, in graph order); (None, []) when
    no placeholder is a host cache."""
    found: dict[tuple, dict[str, fx.Node]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor):
            continue
        for runtime in runtimes:
            owner = runtime.owner_of(value)
            if owner is not None and value.numel() > 0:
                found.setdefault((runtime, owner[0]), {})[owner[1]] = node
    if not found:
        return None, []
    kept = {r for r, _ in found}
    if len(kept) > 1:
        raise KVPassError("one graph reads the host KV caches of two models; compile each "
                          "model on its own", where="kv_cache='host'")
    runtime = next(iter(kept))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    layers = []
    for (_, layer), nodes in found.items():
        if "keys" not in nodes or "values" not in nodes:
            continue                    # a cache's length alone (a mask's offset)
        kl = KVLayer(layer, nodes["keys"], nodes["values"], nodes.get("pos"))
        kl.writes = (_the_write(kl.keys, kl), _the_write(kl.values, kl))
        if kl.writes[0].args[2] is not kl.writes[1].args[2]:
            raise KVPassError(f"cache layer {layer} writes its keys and values at different "
                              "positions; the pass reroutes one index_copy_ of each at the "
                              "same positions", where="kv_cache='host'")
        layers.append(kl)
    layers.sort(key=lambda kl: order[max(kl.writes, key=order.__getitem__)])
    return runtime, layers


def _the_write(node: fx.Node, kl: KVLayer) -> fx.Node:
    writes = [u for u in node.users if _is_index_copy(u) and u.args[0] is node]
    dims = [w.args[1] if len(w.args) > 1 else w.kwargs.get("dim") for w in writes]
    if len(writes) != 1 or dims[0] not in (2, -2):
        others = sorted(u.name for u in node.users)
        raise KVPassError(
            f"cache layer {kl.layer}'s {node.name} is written by {others}; the pass "
            "reroutes one index_copy_ along the token dimension per step (transformers' "
            "StaticLayer.update) and nothing else", where="kv_cache='host'")
    return writes[0]


def _fake_like(node: fx.Node):
    fake = value_of(node)
    with fake.fake_mode:
        return torch.empty_like(fake, memory_format=torch.contiguous_format)


def _set_value(node: fx.Node, value) -> fx.Node:
    node.meta["val"] = value
    node.meta["example_value"] = value
    return node


def _assign_targets(runtime, layers: list[KVLayer]) -> list[KVLayer]:
    """Each layer's refill target: the next layer of this graph in its slot; and the
    slots' first layers (begun at the top of the graph)."""
    first: dict[int, KVLayer] = {}
    last: dict[int, KVLayer] = {}
    for kl in layers:
        slot = runtime.slot_of(kl.layer)
        if slot in last and kl.pos is not None:
            last[slot].target = kl.layer
        first.setdefault(slot, kl)
        last[slot] = kl
    return [kl for kl in first.values() if kl.pos is not None]


def apply(gm: fx.GraphModule, runtime, layers: list[KVLayer],
          attended: dict | None = None) -> None:
    """``attended``: layer -> :class:`.host_attention.Found`, the layers whose attention
    runs on the host (one ``kv_attend`` each; they take no slot)."""
    graph = gm.graph
    attended = attended or {}
    hosted = [kl for kl in layers if kl.layer in attended]
    layers = [kl for kl in layers if kl.layer not in attended]
    begun = _assign_targets(runtime, layers)
    by_layer = {kl.layer: kl for kl in layers}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(value_of(n), torch.Tensor)]
    source = min(tensors, key=lambda n: value_of(n).numel())
    with graph.inserting_after(placeholders[-1]):
        anchor = _set_value(graph.call_function(torch.empty_like, (source,)),
                            value_of(source))
    with graph.inserting_after(anchor):
        _set_value(graph.call_function(kv_ops.BEGIN, (
            anchor, [kl.keys for kl in begun], [kl.values for kl in begun],
            [kl.pos for kl in begun], runtime.handle, [kl.layer for kl in begun])), None)
    last_update = None
    for kl in hosted:
        last_update = host_attention.rewrite(graph, kl, attended[kl.layer], anchor,
                                             runtime.handle, kv_ops.ATTEND)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for kl in layers:
        wk, wv = kl.writes
        later = max(kl.writes, key=order.__getitem__)
        nxt = by_layer.get(kl.target)
        nxt_args = [] if nxt is None else [nxt.keys, nxt.values, nxt.pos]
        with graph.inserting_after(later):
            update = graph.call_function(kv_ops.UPDATE, (
                anchor, wk.args[3], wv.args[3], wk.args[2], kl.keys, kl.values, nxt_args,
                runtime.handle, kl.layer, kl.target))
        outs = (_fake_like(kl.keys), _fake_like(kl.values))
        _set_value(update, outs)
        with graph.inserting_after(update):
            out_k = _set_value(graph.call_function(operator.getitem, (update, 0)), outs[0])
        with graph.inserting_after(out_k):
            out_v = _set_value(graph.call_function(operator.getitem, (update, 1)), outs[1])
        for new in (update, out_k, out_v):
            new.meta.update({k: wk.meta[k] for k in _KEPT_META if k in wk.meta})
        for source_node, out, write in ((kl.keys, out_k, wk), (kl.values, out_v, wv)):
            write.replace_all_uses_with(out)
            graph.erase_node(write)
            for user in list(source_node.users):
                if user in (update, out_k, out_v) or user.target in (kv_ops.BEGIN, kv_ops.UPDATE):
                    continue
                if order.get(user, len(order)) < order[later]:
                    raise KVPassError(
                        f"{user.name} reads cache layer {kl.layer} before the step writes "
                        "it; the pass reroutes reads that follow the write",
                        where="kv_cache='host'")
                user.replace_input_with(source_node, out)
        last_update = out_k
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    frozen = {storage_of(n) for n in placeholders}
    acts = [n for n in output.all_input_nodes if isinstance(value_of(n), torch.Tensor)
            and storage_of(n) not in frozen]
    seen, tied = set(), []
    for n in acts:                      # one per storage
        if storage_of(n) not in seen:
            seen.add(storage_of(n))
            tied.append(n)
    if tied:
        with graph.inserting_before(output):
            _set_value(graph.call_function(kv_ops.JOIN, (tied, runtime.handle)), None)
    else:   # no output of its own to tie to: right after the last update, tied to its keys,
        # which the attention reads after it (an op tied to nothing later is dead code)
        with graph.inserting_after(last_update if last_update.target is kv_ops.ATTEND
                                   else last_update.next):
            _set_value(graph.call_function(kv_ops.JOIN, ([last_update], runtime.handle)), None)
    graph.lint()
    gm.recompile()
