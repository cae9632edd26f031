"""Step 2 of the pass: insert the planned ops into the Dynamo graph.

For an offloaded layer ``L`` (slot ``s``) whose slot is refilled with layer ``T`` after it::

    x  = ...                                   # L's input activation(s)
    wait_prefetch([x], h, L)                   # before L's first weight read
    y  = linear(x, w_L)                        # w_L: a placeholder whose data is slot s
    ...                                        # the rest of L
    out = ...                                  # L's output(s)
    start_prefetch([out], [], h, L, T)         # after L's last node: slot s <- T
    ...                                        # later layers, resident or in other slots
    join_prefetch([result], [], h)             # before the graph's output

``x`` and ``out`` keep their values; the ops only declare them mutated so that no compiler
moves ``L``'s compute above the wait or below the start.  A layer whose weight reads depend
only on graph inputs first gets a clone of one (``x2 = clone(x)``), tied to the wait instead.
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops
from .plan import GraphPlan, LayerPlan


def _no_value(node: fx.Node) -> fx.Node:
    """Our ops return nothing; later passes read ``meta["val"]`` of every node."""
    node.meta["val"] = None
    node.meta["example_value"] = None
    return node


def _insert_clones(graph: fx.Graph, lp: LayerPlan) -> list[fx.Node]:
    members = set(lp.members) & _layer_nodes_between(lp)
    clones = []
    for source in lp.clone_inputs:
        with graph.inserting_before(lp.first_use):
            clone = graph.call_function(torch.clone, (source,))
        clone.meta["example_value"] = source.meta.get("example_value")
        clone.meta["val"] = source.meta.get("val", clone.meta["example_value"])
        for user in list(source.users):
            if user in members:
                user.replace_input_with(source, clone)
        clones.append(clone)
    return clones


def drop_traced_hook_waits(gm: fx.GraphModule, plan: GraphPlan) -> int:
    """Erase waits that Dynamo traced from the layers' pre-forward hooks for the layers this
    plan places its own wait for; the hook's wait would sit at the layer's entry and declare
    its inputs mutated.  Runs before the pass inserts any op, so every wait found is traced."""
    planned = {lp.layer for lp in plan.layers}
    dropped = 0
    for node in list(gm.graph.nodes):
        call = ops.OpCall.of(node)
        if call is not None and call.kind == "wait" and call.handle == plan.handle \
                and call.layer in planned:
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def apply_plan(gm: fx.GraphModule, plan: GraphPlan) -> None:
    graph = gm.graph
    drop_traced_hook_waits(gm, plan)
    for lp in plan.layers:
        clones = _insert_clones(graph, lp)
        with graph.inserting_before(lp.first_use):
            _no_value(graph.call_function(ops.WAIT, (lp.wait_acts + clones, plan.handle,
                                                     lp.layer)))
        if lp.refill is not None:
            with graph.inserting_after(lp.last_node):
                _no_value(graph.call_function(
                    ops.START, (lp.start_acts, lp.start_reads, plan.handle, lp.layer, lp.refill)))
    if plan.has_starts and plan.join_acts:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            _no_value(graph.call_function(ops.JOIN, (plan.join_acts, plan.join_reads,
                                                     plan.handle)))
    graph.lint()
    gm.recompile()


def _layer_nodes_between(lp: LayerPlan) -> set[fx.Node]:
    """Nodes from the first weight read to the layer's last node: the uses of a cloned input
    that must read the clone."""
    found, node = set(), lp.first_use
    while node is not None:
        found.add(node)
        if node is lp.last_node:
            break
        node = node.next
    return found
