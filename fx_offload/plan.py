"""Step 1 of the pass: decide, for one Dynamo graph, where each offloaded layer's ops go.

Nothing here edits the graph; :mod:`fx_offload.rewrite` applies the plan.  For every offloaded
layer present in the graph the plan holds:

* ``first_use``: the first node that reads one of the layer's offloaded weights; the wait goes
  immediately before it;
* ``wait_acts``: the layer's input activations from which its weight-reading nodes are
  computed; the wait declares them mutated, so every such node is ordered after it.  A graph
  input is never declared mutated (that would make it a mutated input of the compiled graph);
  where a weight read depends on graph inputs alone, the plan clones one (``clone_inputs``);
* ``last_node``: the layer's last node; the start goes immediately after it and declares the
  layer's outputs (``start_acts``) mutated and reads the rest (``start_reads``), so it follows
  everything the layer computes and precedes everything computed from the layer's results.

Layer membership comes from ``nn_module_stack``; weights of an offloaded layer read outside
it, or a layer output that aliases an offloaded weight, are refused with an error naming the
node, because either would be read after the slot is refilled.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from .graph_inputs import GraphInputs
from .runtime import OffloadState

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class LayerPlan:
    layer: int
    slot: int
    target: int | None                  # layer prefetched into this slot after this one
    weights: list[fx.Node]              # placeholders of the offloaded weights
    first_use: fx.Node
    last_node: fx.Node
    wait_acts: list[fx.Node]
    clone_inputs: list[fx.Node]
    start_acts: list[fx.Node]
    start_reads: list[fx.Node]
    weight_only: list[fx.Node]          # weight reads that depend on no activation
    members: list[fx.Node]              # the layer's nodes, in graph order


@dataclasses.dataclass
class GraphPlan:
    handle: int
    layers: list[LayerPlan]
    join_acts: list[fx.Node]
    join_reads: list[fx.Node]
    other_params: int                   # parameter placeholders left resident

    @property
    def has_starts(self) -> bool:
        return any(lp.target is not None for lp in self.layers)


class PlanError(ValueError):
    pass


def _value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _storage(node: fx.Node):
    value = _value(node)
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage())
        except Exception:  # pragma: no cover - tensors without storage (sparse, nested)
            return None
    return None


_INDEX = re.compile(r"\[\s*'?([^'\]]+)'?\s*\]")


def module_path(stack_path: str, root_expr: str | None) -> str | None:
    """``L['self'].layers.1.mlp`` -> ``layers.1.mlp`` (relative to the graph's model)."""
    if root_expr is None or not stack_path.startswith(root_expr):
        return None
    rest = _INDEX.sub(r".\1", stack_path[len(root_expr):])
    return rest.lstrip(".")


def _layer_of_nodes(gm: fx.GraphModule, gi: GraphInputs, prefixes: dict[str, int],
                    ) -> dict[fx.Node, set[int]]:
    membership: dict[fx.Node, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        found = set()
        for entry in stack.values():
            path = module_path(entry[0], gi.root_expr)
            if path in prefixes:
                found.add(prefixes[path])
        if found:
            membership[node] = found
    return membership


def plan_graph(gm: fx.GraphModule, gi: GraphInputs, state: OffloadState) -> GraphPlan:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    offloaded = {p.name: layer for layer, ps in state.params.items() for p in ps}
    weights: dict[int, list[fx.Node]] = {}
    other_params = 0
    for node, (name, _) in gi.params.items():
        layer = offloaded.get(name)
        if layer is None:
            other_params += 1
        else:
            weights.setdefault(layer, []).append(node)

    prefixes = {state.stack.prefix(layer): layer for layer in weights}
    membership = _layer_of_nodes(gm, gi, prefixes)
    nodes_of: dict[int, list[fx.Node]] = {layer: [] for layer in weights}
    for node, layers in membership.items():
        for layer in layers:
            nodes_of[layer].append(node)

    input_storages = {s for n in gi.placeholders if n not in gi.params
                      for s in [_storage(n)] if s is not None}
    weight_storages = {_storage(n): n for ws in weights.values() for n in ws}
    weight_storages.pop(None, None)
    param_nodes = set(gi.params)

    plans = []
    for layer in sorted(weights):
        plan = _plan_layer(layer, weights[layer], nodes_of[layer], order, state,
                           param_nodes, input_storages, weight_storages)
        if plan is not None:
            plans.append(plan)

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = [n for n in output.all_input_nodes if isinstance(_value(n), torch.Tensor)]
    join_acts, join_reads = _split_mutable(outs, input_storages | set(weight_storages))
    return GraphPlan(state.handle, plans, join_acts, join_reads, other_params)


def _split_mutable(nodes, frozen_storages):
    """Nodes that may be declared mutated (one per storage, none aliasing a graph input or a
    weight) and the rest, which are only read."""
    acts, reads, seen = [], [], set()
    for node in nodes:
        storage = _storage(node)
        if storage is None or storage in frozen_storages or storage in seen:
            reads.append(node)
        else:
            seen.add(storage)
            acts.append(node)
    return acts, reads


def _cover(users, candidates, externals, order) -> list[fx.Node]:
    """Few activations such that each of ``users`` is computed from one of them (greedy set
    cover; ties go to the earlier node).  Fewer declared mutations, fewer copies where the
    compiler does not re-inplace."""
    chosen, left = [], list(users)
    pool = sorted(candidates, key=order.__getitem__)
    seen_storage = set()
    while left and pool:
        best = max(pool, key=lambda a: (sum(a in externals[u] for u in left), -order[a]))
        if not any(best in externals[u] for u in left):
            break
        pool.remove(best)
        storage = _storage(best)
        if storage is not None and storage in seen_storage:
            continue
        seen_storage.add(storage)
        chosen.append(best)
        left = [u for u in left if best not in externals[u]]
    return sorted(chosen, key=order.__getitem__)


def _plan_layer(layer, weight_nodes, layer_nodes, order, state, param_nodes, input_storages,
                weight_storages) -> LayerPlan | None:
    name = state.stack.prefix(layer)
    users = sorted({u for w in weight_nodes for u in w.users}, key=order.__getitem__)
    if not users:
        return None
    members = set(layer_nodes)
    for user in users:
        if user not in members:
            raise PlanError(
                f"prefetch_offload: node {user.format_node()} reads a weight of offloaded layer "
                f"{name} outside that layer's forward, where its slot may already hold another "
                "layer; exclude that parameter with offload_params or move the read into the "
                "layer")
    ordered = sorted(layer_nodes, key=order.__getitem__)
    first_use, last_node = users[0], ordered[-1]
    reads_weight = set(users)

    # The values live at the wait that each later layer node is computed from: inputs of the
    # layer, or layer nodes computed before its first weight read (a norm's statistics).  The
    # wait must be tied to values read *after* it, or the compiler drops it as dead code.
    after = [n for n in ordered if order[n] >= order[first_use]]
    after_set = set(after)
    externals: dict[fx.Node, frozenset] = {}
    for node in after:
        acc = set()
        for arg in node.all_input_nodes:
            if arg in after_set:
                acc |= externals.get(arg, frozenset())
            elif arg not in param_nodes and isinstance(_value(arg), torch.Tensor):
                acc.add(arg)
        externals[node] = frozenset(acc)

    # Nodes computed from the weights: those that also depend on an activation are ordered
    # after the wait through it; the rest (dequantizing a weight, say) only by graph order.
    derived = set()
    for node in after:
        if node in reads_weight or any(a in derived for a in node.all_input_nodes):
            derived.add(node)
    weight_only = [u for u in after if u in derived and not externals[u]]
    anchored = [u for u in after if u in derived and externals[u]]
    # only values that exist at the wait can be tied to it (a value the parent computes in
    # the middle of the layer cannot)
    needed = {a for u in anchored for a in externals[u] if order[a] < order[first_use]}
    mutable = [a for a in needed if _storage(a) not in input_storages]
    wait_acts = _cover(anchored, mutable, externals, order)
    covered = {u for u in anchored if externals[u] & set(wait_acts)}
    # What only graph inputs feed gets a clone of one of them: the clone is tied instead.
    inputs_only = [u for u in anchored if u not in covered]
    clone_inputs = _cover(inputs_only, sorted(needed - set(mutable), key=order.__getitem__),
                          externals, order)
    if weight_only:
        log.debug("fx_offload: layer %s reads weights in %s without any activation; their "
                  "order after the wait rests on the graph order", name,
                  [n.name for n in weight_only])
    if not wait_acts and not clone_inputs:
        raise PlanError(
            f"prefetch_offload: offloaded layer {name} computes nothing from an activation "
            "(every weight read depends on weights alone), so no op can be ordered before its "
            "weight reads; do not offload this layer")

    outputs = [n for n in ordered
               if any(u not in members for u in n.users) and isinstance(_value(n), torch.Tensor)]
    for out in outputs:
        w = weight_storages.get(_storage(out))
        if w is not None:
            raise PlanError(
                f"prefetch_offload: {out.format_node()} of offloaded layer {name} returns a view "
                f"of the offloaded weight {w.name}, which would be read after its slot is "
                "refilled; exclude that parameter with offload_params")
    start_acts, start_reads = _split_mutable(outputs, input_storages)
    target = state.target_of[layer]
    if target is not None and not start_acts:
        raise PlanError(
            f"prefetch_offload: offloaded layer {name} has no output of its own (each output "
            "aliases a graph input), so its start_prefetch cannot be ordered after it")
    return LayerPlan(layer, state.slot_of[layer], target, weight_nodes, first_use, last_node,
                     list(wait_acts), clone_inputs, start_acts, start_reads, weight_only, ordered)
