"""Step 2 of the pass: insert the planned ops into the Dynamo graph.

For an offloaded layer ``L`` (slot ``s``, chunks 0 and 1) whose slot is refilled with
layer ``T`` (chunks 0 and 1, the same bytes) after it::

    x  = ...                                   # L's input activation(s)
    wait_prefetch([x], h, L, 0)                # before the first read of L's chunk 0
    a  = linear(x, w0_L)                       # w0_L: a placeholder whose data is in slot s
    start_prefetch([a], [], h, L, T, 0)        # after the last read of chunk 0: T's chunk 0
    wait_prefetch([a], h, L, 1)                # before the first read of L's chunk 1
    out = linear(a, w1_L)
    start_prefetch([out], [], h, L, T, 1)      # after the last read of chunk 1
    ...                                        # later layers, resident or in other slots
    join_prefetch([result], [], h)             # before the graph's output

``x``, ``a`` and ``out`` keep their values; the ops only declare them mutated so that no
compiler moves a read of a chunk above its wait or below the start that overwrites it (a
start also reads every other read of what it overwrites).  A layer whose weight reads depend
only on graph inputs first gets a clone of one (``x2 = clone(x)``), tied to the wait instead.
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops
from .plan import ChunkWait, GraphPlan, LayerPlan


def _no_value(node: fx.Node) -> fx.Node:
    """Our ops return nothing; later passes read ``meta["val"]`` of every node."""
    node.meta["val"] = None
    node.meta["example_value"] = None
    return node


def _insert_clones(graph: fx.Graph, lp: LayerPlan, wait: ChunkWait) -> list[fx.Node]:
    members = set(lp.members) & _layer_nodes_between(wait.first_use, lp.last_node)
    clones = []
    for source in wait.clone_inputs:
        with graph.inserting_before(wait.first_use):
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
        for wait in lp.waits:
            clones = _insert_clones(graph, lp, wait)
            for chunk in wait.chunks:
                with graph.inserting_before(wait.first_use):
                    _no_value(graph.call_function(
                        ops.WAIT, (wait.acts + clones, plan.handle, lp.layer, chunk)))
        placed_after: dict[fx.Node, fx.Node] = {}     # keeps starts after one node in order
        for start in lp.starts:
            anchor = placed_after.get(start.after, start.after)
            with graph.inserting_after(anchor):
                placed_after[start.after] = _no_value(graph.call_function(
                    ops.START, (start.acts, start.reads, plan.handle, lp.layer, lp.refill,
                                start.chunk)))
    if plan.has_starts and plan.join_acts:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            _no_value(graph.call_function(ops.JOIN, (plan.join_acts, plan.join_reads,
                                                     plan.handle)))
    graph.lint()
    gm.recompile()


def _layer_nodes_between(first: fx.Node, last: fx.Node) -> set[fx.Node]:
    """Nodes from a chunk's first weight read to the layer's last node: the uses of a cloned
    input that must read the clone."""
    found, node = set(), first
    while node is not None:
        found.add(node)
        if node is last:
            break
        node = node.next
    return found
