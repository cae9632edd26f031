"""Step 1 of the pass: decide, for one Dynamo graph, where each offloaded layer's ops go.

Nothing here edits the graph; :mod:`~fx_offload.passes.rewrite` applies the plan.  For every
offloaded layer present in the graph the plan holds:

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

import torch
from torch import fx

from ..errors import PlanError
from ..graph_inputs import GraphInputs, layers_of_nodes, storage_of, value_of
from ..selection.choice import Choice

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class LayerPlan:
    layer: int
    slot: int
    refill: int | None                  # layer copied into this slot after this one
    weights: list[fx.Node]              # placeholders of the offloaded weights
    first_use: fx.Node
    last_node: fx.Node
    wait_acts: list[fx.Node]
    clone_inputs: list[fx.Node]
    start_acts: list[fx.Node]
    start_reads: list[fx.Node]
    members: list[fx.Node]              # the layer's nodes, in graph order


@dataclasses.dataclass
class GraphPlan:
    handle: int
    layers: list[LayerPlan]
    join_acts: list[fx.Node]
    join_reads: list[fx.Node]

    @property
    def has_starts(self) -> bool:
        return any(lp.refill is not None for lp in self.layers)

    def weight_layers(self) -> dict[fx.Node, int]:
        """Offloaded weight placeholder -> its layer."""
        return {w: lp.layer for lp in self.layers for w in lp.weights}


def plan_graph(gm: fx.GraphModule, gi: GraphInputs, choice: Choice, handle: int) -> GraphPlan:
    """Where the ops for ``choice``'s offloaded layers go in ``gm`` (the state's ``handle``
    names them); edits nothing."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    offloaded = {p.name: layer for layer, ps in choice.params.items() for p in ps}
    weights: dict[int, list[fx.Node]] = {}
    for node, (name, _) in gi.params.items():
        layer = offloaded.get(name)
        if layer is not None:
            weights.setdefault(layer, []).append(node)

    paths = {choice.stack.layer_path(layer): layer for layer in weights}
    membership = layers_of_nodes(gm, gi, paths)
    nodes_of: dict[int, list[fx.Node]] = {layer: [] for layer in weights}
    for node, layers in membership.items():
        for layer in layers:
            nodes_of[layer].append(node)

    input_storages = {s for n in gi.placeholders if n not in gi.params
                      for s in [storage_of(n)] if s is not None}
    weight_storages = {storage_of(n): n for ws in weights.values() for n in ws}
    weight_storages.pop(None, None)
    param_nodes = set(gi.params)

    plans = []
    for layer in sorted(weights):
        plan = _plan_layer(layer, weights[layer], nodes_of[layer], order, choice,
                           param_nodes, input_storages, weight_storages)
        if plan is not None:
            plans.append(plan)

    _check_not_interleaved(plans, order, choice)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = [n for n in output.all_input_nodes if isinstance(value_of(n), torch.Tensor)]
    join_acts, join_reads = _split_mutable(outs, input_storages | set(weight_storages))
    return GraphPlan(handle, plans, join_acts, join_reads)


def _check_not_interleaved(plans: list[LayerPlan], order, choice: Choice) -> None:
    """Each offloaded layer runs once, from its first weight read to its last node, before
    the next offloaded layer begins; a layer run twice in one forward (or one whose compute
    encloses another offloaded layer) would need its slot across the other's refill."""
    ordered = sorted(plans, key=lambda lp: order[lp.first_use])
    for lp, nxt in zip(ordered, ordered[1:]):
        if order[nxt.first_use] < order[lp.last_node]:
            path = choice.stack.layer_path(lp.layer)
            raise PlanError(
                f"offloaded layer {path} runs again (or still runs) after offloaded layer "
                f"{choice.stack.layer_path(nxt.layer)} has begun ({lp.last_node.format_node()} "
                "follows it): a layer called more than once per forward cannot give up its "
                "slot in between. Keep it resident: offload other layers (group_size / "
                "num_in_group, or a layers= stack without it)")


def _split_mutable(nodes, frozen_storages):
    """Nodes that may be declared mutated (one per storage, none aliasing a graph input or a
    weight) and the rest, which are only read."""
    acts, reads, seen = [], [], set()
    for node in nodes:
        storage = storage_of(node)
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
        storage = storage_of(best)
        if storage is not None and storage in seen_storage:
            continue
        seen_storage.add(storage)
        chosen.append(best)
        left = [u for u in left if best not in externals[u]]
    return sorted(chosen, key=order.__getitem__)


def _plan_layer(layer, weight_nodes, layer_nodes, order, choice, param_nodes, input_storages,
                weight_storages) -> LayerPlan | None:
    name = choice.stack.layer_path(layer)
    users = sorted({u for w in weight_nodes for u in w.users}, key=order.__getitem__)
    if not users:
        return None
    members = set(layer_nodes)
    for user in users:
        if user not in members:
            raise PlanError(
                f"node {user.format_node()} reads a weight of offloaded layer "
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
            elif arg not in param_nodes and isinstance(value_of(arg), torch.Tensor):
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
    mutable = [a for a in needed if storage_of(a) not in input_storages]
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
            f"offloaded layer {name} computes nothing from an activation "
            "(every weight read depends on weights alone), so no op can be ordered before its "
            "weight reads; do not offload this layer")

    outputs = [n for n in ordered
               if any(u not in members for u in n.users) and isinstance(value_of(n), torch.Tensor)]
    for out in outputs:
        w = weight_storages.get(storage_of(out))
        if w is not None:
            raise PlanError(
                f"{out.format_node()} of offloaded layer {name} returns a view "
                f"of the offloaded weight {w.name}, which would be read after its slot is "
                "refilled; exclude that parameter with offload_params")
    start_acts, start_reads = _split_mutable(outputs, input_storages)
    refill = choice.schedule.refill_of[layer]
    if refill is not None and not start_acts:
        raise PlanError(
            f"offloaded layer {name} has no output of its own (each output "
            "aliases a graph input), so its start_prefetch cannot be ordered after it")
    return LayerPlan(layer, choice.schedule.slot_of[layer], refill, weight_nodes, first_use,
                     last_node, list(wait_acts), clone_inputs, start_acts, start_reads,
                     ordered)
