"""Routed MoE experts computed where the runtime chooses, call by call: option
``host_compute`` (docs/host_compute.md).

For an offloaded MoE layer whose chunks of expert tensors are routed (:mod:`.routing`), the
nodes traced inside its experts module (``nn_module_stack``; transformers'
``Qwen3MoeExperts``, ``MixtralExperts``: ``forward(x (T, H), ids (T, k), gates (T, k)) ->
(T, H)``) become one op::

    ids = topk(softmax(router(x)), k)[1]        ids = topk(softmax(router(x)), k)[1]
    wait_routed([x], ids, h, L, c)
    ...  grouped_mm(x_g, w_L.mT, offs) ...  ->  y = host_experts(x, ids, gates, h, L, [c])
    y = ...                                     ...  (the layer's other chunks: as before)

Its kernel (:mod:`fx_offload.runtime.experts.host_experts`) either copies ``x``, ``ids`` and
``gates`` to the host, computes the experts there from the expert tensors' host block (read
in place: the weights are no input of the graph's op) and copies the result back, or streams:
the routed wait the graph had, then the experts module's own forward on the slot.  So the
graph is the same whichever way a call goes, and ``host_compute="auto"`` decides per call.
The chunks' wait leaves the graph (the op waits itself when it streams); the refills that
overwrite them start after the layer's outputs, which the op's result feeds.

The region is replaced only where it is clean: its inputs from outside are the router's ids,
one activation shaped like its output (``x``), one shaped like the ids (``gates``), the
routed chunks' weights and nothing else (other weights, a graph input); its nodes are read
outside it only through that one output (sizes computed from outside values alone stay in
the graph: the tracer shares them); it writes nothing outside it.  Otherwise the layer
streams as before and ``learned.hosting`` records why (``report`` and ``explain`` show it).
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops
from ..graph_inputs import GraphInputs, module_path, storage_of, value_of
from .picks import _written
from .plan import GraphPlan, LayerPlan


def host_regions(gm: fx.GraphModule, gi: GraphInputs, plan: GraphPlan, choice,
                 learned) -> int:
    """Replace each routed layer's experts in ``gm`` by one ``host_experts`` op where the
    region is clean; records per layer in ``learned.hosting``; returns how many it replaced
    (the graph is then to be planned again)."""
    replaced = 0
    for lp in plan.layers:
        if not lp.routed:
            why = [w for w in learned.routing.get(lp.layer, {}).values() if w != "routed"]
            if why:         # an MoE layer whose experts move whole: said, not silent
                learned.hosting[lp.layer] = f"streamed: its experts are not routed ({why[0]})"
            continue
        found = _region(lp, gi, choice, learned.layout)
        if isinstance(found, str):
            learned.hosting[lp.layer] = f"streamed: {found}"
            continue
        _replace(gm.graph, lp, plan.handle, *found)
        learned.hosting[lp.layer] = "host"
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


def _region(lp: LayerPlan, gi: GraphInputs, choice, layout):
    """(region nodes, output, x, ids, gates) of ``lp``'s experts module, or why not."""
    chunks = sorted(lp.routed)
    routers = {lp.routed[c] for c in chunks}
    if len(routers) != 1:
        return "its expert tensors are routed by more than one top-k"
    ids = routers.pop()
    suffixes = {s for c in chunks for s in layout[lp.layer][c].suffixes}
    owners = {p.suffix.rpartition(".")[0] for p in choice.params[lp.layer]
              if p.suffix in suffixes}
    if len(owners) != 1:
        return "its expert tensors belong to more than one module"
    path = choice.stack.layer_path(lp.layer) + "." + owners.pop()
    region = [n for n in lp.members
              if any(module_path(e[0], gi.root_expr) == path
                     for e in (n.meta.get("nn_module_stack") or {}).values())]
    inside = set(region)
    # Sizes computed from values made outside (T * k under dynamic shapes) may be shared with
    # later layers by the tracer: they stay in the graph, out of the region.
    for n in region:
        if not _is_tensor(n) and all(a not in inside for a in n.all_input_nodes):
            inside.discard(n)
    region = [n for n in region if n in inside]
    weights = {w for w, c in lp.weights.items() if c in lp.routed}
    readers = {u for w in weights for u in w.users}
    if not readers <= inside:
        return f"its expert tensors are read outside {path}"
    inputs = {a for n in region for a in n.all_input_nodes if a not in inside}
    tensors = [a for a in inputs - weights if _is_tensor(a)]
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    if len(outputs) != 1 or not _is_tensor(outputs[0]):
        return f"{path} has {len(outputs)} outputs read outside it, not one tensor"
    out = value_of(outputs[0])
    xs = [a for a in tensors if a is not ids and _like(value_of(a), out)]
    gates = [a for a in tensors if a is not ids and a not in xs
             and tuple(value_of(a).shape) == tuple(value_of(ids).shape)]
    if ids not in tensors or len(xs) != 1 or len(gates) != 1 or len(tensors) != 3:
        names = sorted(a.name for a in tensors)
        return (f"{path}'s inputs ({', '.join(names)}) are not one activation shaped like "
                "its output, the router's ids and their gate weights")
    if (inputs - weights - set(tensors)) & set(gi.params):
        return f"{path} reads weights other than its routed expert tensors"
    outside = {storage_of(a) for a in inputs} - {None}
    for n in region:
        if any(w not in inside or storage_of(w) in outside for w in _written(n)):
            return f"{n.name} in {path} writes a value computed outside it"
    order = {n: i for i, n in enumerate(lp.members)}
    last_input = max((order.get(a, -1) for a in (xs[0], ids, gates[0])))
    first_read = min(order.get(u, len(order)) for u in outputs[0].users if u not in inside)
    if last_input > first_read:
        return f"{path}'s output is read before all its inputs exist"
    return region, outputs[0], xs[0], ids, gates[0]


def _replace(graph: fx.Graph, lp: LayerPlan, handle: int, region, output, x, ids,
             gates) -> None:
    """The op in place of ``region``: after the last of its inputs, before anything reads
    its output; the region's nodes erased."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    after = max((x, ids, gates), key=order.__getitem__)
    with graph.inserting_after(after):
        node = graph.call_function(ops.HOST_EXPERTS,
                                   (x, ids, gates, handle, lp.layer, sorted(lp.routed)))
    for key in ("val", "example_value", "nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in output.meta:
            node.meta[key] = output.meta[key]
    output.replace_all_uses_with(node, delete_user_cb=lambda user: user not in region)
    for n in sorted(region, key=order.__getitem__, reverse=True):
        graph.erase_node(n)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(value_of(node), torch.Tensor)


def _like(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and a.device == b.device
