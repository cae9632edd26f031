"""Routed MoE experts and dense gated MLPs computed where the runtime chooses, call by call:
option ``host_compute`` (docs/host_compute.md).  Each region becomes one op, whose weights
are no input of it.

For an offloaded MoE layer whose chunks of expert tensors are routed (:mod:`.routing`), the
nodes traced inside its experts module (``nn_module_stack``) become one op::

    ids = topk(softmax(router(x)), k)[1]        ids = topk(softmax(router(x)), k)[1]
    wait_routed([x], ids, h, L, c)
    ...  grouped_mm(x_g, w_L.mT, offs) ...  ->  y = host_experts(x, ids, gates, h, L, [c])
    y = ...                                     ...  (the layer's other chunks: as before)

A dense MLP (:mod:`fx_offload.selection.mlps`: its three weights chunks of their own)
becomes one op the same way::

    wait_prefetch([h], handle, L, c_gate) ...
    g = linear(h, w_gate); u = linear(h, w_up)
    y = linear(silu(g) * u, w_down)          ->  y = host_mlp(h, handle, L, [c_g, c_u, c_d])

The chunks' waits leave the graph (the op waits itself when it streams); the refills that
overwrite them start after the op, their last reader (:mod:`.plan` counts it as one), and,
for a call that computes an MLP on the host, at once
(:meth:`fx_offload.runtime.experts.host_mlps.HostMlps.run`).

A region is replaced only where it is clean; otherwise the layer streams as before and
``learned.hosting`` records why (``report`` and ``explain`` show it).  The experts' region:
its inputs from outside are the router's ids, one activation shaped like its output (``x``),
one shaped like the ids (``gates``), the routed chunks' weights and nothing else (other
weights, a graph input); its nodes are read outside it only through that one output (sizes
computed from outside values alone stay in the graph: the tracer shares them); it writes
nothing outside it.  The MLP: the nodes traced in the module are exactly those five, read
from one input shaped like the output, none read outside but ``y``.  What each op does at
run time, computed or streamed (:mod:`fx_offload.runtime.experts.host_experts`):
docs/host_compute.md, "Routed experts on the host" and "Dense MLPs on the host".
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops
from ..graph_inputs import GraphInputs, module_path, storage_of, value_of
from ..selection.mlps import mlp_path
from .picks import _written
from .plan import GraphPlan, LayerPlan


def host_regions(gm: fx.GraphModule, gi: GraphInputs, plan: GraphPlan, choice,
                 learned, mlps: bool = True) -> int:
    """Replace each routed layer's experts in ``gm`` by one ``host_experts`` op where the
    region is clean, and each dense MLP of ``choice.mlps`` by a ``host_mlp`` op where
    ``mlps`` (not in a graph for CUDA graphs: their capture streams); records per layer in
    ``learned.hosting``; returns how many it replaced (the graph is then to be planned
    again)."""
    replaced = 0
    learned.hosting.update({layer: why for layer, why in choice.mlps_refused.items()
                            if layer not in learned.hosting})
    for lp in plan.layers:
        if lp.layer in choice.mlps:
            if not mlps:
                learned.hosting[lp.layer] = "streamed: a dense MLP in a graph for CUDA graphs"
                continue
            found = _mlp_region(lp, gi, choice, learned.layout)
            if isinstance(found, str):
                learned.hosting[lp.layer] = f"streamed: {found}"
                continue
            region, output, x, chunks = found
            _replace(gm.graph, (x,), ops.HOST_MLP, (x, plan.handle, lp.layer, chunks),
                     region, output)
            learned.hosting[lp.layer] = "host"
            replaced += 1
            continue
        if not lp.routed:
            why = [w for w in learned.routing.get(lp.layer, {}).values() if w != "routed"]
            if why:         # an MoE layer whose experts move whole: said, not silent
                learned.hosting[lp.layer] = f"streamed: its experts are not routed ({why[0]})"
            continue
        found = _region(lp, gi, choice, learned.layout)
        if isinstance(found, str):
            learned.hosting[lp.layer] = f"streamed: {found}"
            continue
        region, output, x, ids, gates = found
        _replace(gm.graph, (x, ids, gates), ops.HOST_EXPERTS,
                 (x, ids, gates, plan.handle, lp.layer, sorted(lp.routed)), region, output)
        learned.hosting[lp.layer] = "host"
        replaced += 1
    if replaced:
        gm.graph.lint()
        gm.recompile()
    return replaced


def _mlp_region(lp: LayerPlan, gi: GraphInputs, choice, layout):
    """(region nodes, output, x, chunks) of ``lp``'s dense MLP, or why not: the nodes traced
    in the module compute ``down(silu(gate(x)) * up(x))`` from one input and nothing else."""
    names = choice.mlps[lp.layer]
    of_suffix = {s: c.index for c in layout[lp.layer] for s in c.suffixes}
    chunks = sorted({of_suffix[s] for s in names})
    if {s for c in chunks for s in layout[lp.layer][c].suffixes} != set(names):
        return "its MLP weights share a copy chunk with other weights"
    path = choice.stack.layer_path(lp.layer) + "." + mlp_path(names)
    region = [n for n in _in_module(lp, gi, path) if _is_tensor(n)]
    inside = set(region)
    role_of = {id(p.param): names.index(p.suffix) for p in choice.params[lp.layer]
               if p.suffix in names}
    roles = {role_of.get(id(gi.params[w][1])): w for w, c in lp.weights.items()
             if c in chunks and w in gi.params}
    if set(roles) != {0, 1, 2} or any(not set(w.users) <= inside for w in roles.values()):
        return f"its MLP weights are read outside {path}"
    readers = [next(iter(roles[i].users)) if len(roles[i].users) == 1 else None
               for i in range(3)]
    if None in readers:
        return f"{path} reads one of its weights more than once"
    gate, up, down = readers
    x = _linear_of(gate, roles[0])
    product = _linear_of(down, roles[2])
    if x is None or _linear_of(up, roles[1]) is not x or product is None:
        return f"{path} is not three bias-free linears"
    factors = list(product.args[:2]) if _named(product, "mul") else []
    silu = next((f for f in factors if isinstance(f, fx.Node) and _named(f, "silu")), None)
    if silu is None or len(product.args) != 2 or set(factors) != {silu, up} or \
            silu.args[:1] != (gate,) or set(region) != {gate, up, silu, product, down}:
        return f"{path} does not compute down(silu(gate(x)) * up(x)) alone"
    if any(u not in inside for n in (gate, up, silu, product) for u in n.users):
        return f"{path}'s intermediate values are read outside it"
    if x in inside or not _like(value_of(x), value_of(down)):
        return f"{path}'s input is not one activation shaped like its output"
    return region, down, x, chunks


def _in_module(lp: LayerPlan, gi: GraphInputs, path: str) -> list:
    return [n for n in lp.members
            if any(module_path(e[0], gi.root_expr) == path
                   for e in (n.meta.get("nn_module_stack") or {}).values())]


def _linear_of(node: fx.Node, weight: fx.Node):
    """``x`` where ``node`` is ``linear(x, weight)`` without a bias, else None."""
    if not _named(node, "linear") or len(node.args) < 2 or node.args[1] is not weight:
        return None
    if (len(node.args) > 2 and node.args[2] is not None) or \
            node.kwargs.get("bias") is not None:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _named(node: fx.Node, name: str) -> bool:
    """``node`` calls a function or method of that name (``torch._C._nn.linear``,
    ``F.silu``, ``operator.mul``, ``Tensor.mul``)."""
    if node.op == "call_method":
        return node.target in (name, f"__{name}__")
    target = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return target in (name, f"__{name}__", f"{name}_") and not node.kwargs.get("inplace")


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
    region = _in_module(lp, gi, path)
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


def _replace(graph: fx.Graph, inputs, op, args, region, output) -> None:
    """``op(*args)`` in place of ``region``: after the last of its ``inputs``, before
    anything reads its output; the region's nodes erased."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    after = max(inputs, key=order.__getitem__)
    with graph.inserting_after(after):
        node = graph.call_function(op, args)
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
