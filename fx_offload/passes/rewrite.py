"""Step 2 of the pass: insert the planned ops into the Dynamo graph.

For an offloaded layer ``L`` (slot ``s``, chunks 0 and 1) whose slot is refilled with
layer ``T`` (chunks 0 and 1, the same bytes) after it::

    x  = ...                                   # L's input activation(s)
    wait_prefetch([x], h, L, 0)                # before the first read of L's chunk 0
    a  = linear(x, w0_L)                       # w0_L: a placeholder whose data is in slot s
    start_prefetch([a], [], h, L, T, 0)        # after the last read of chunk 0: T's chunk 0
    wait_prefetch([a], h, L, 1)                # before the first read of L's chunk 1
    out = linear(a, w1_L)                      # (a chunk of expert tensors read only by
                                               # rows the router picked: wait_routed([a],
                                               # ids, h, L, 1), ids = topk(scores, k)[1])
    start_prefetch([out], [], h, L, T, 1)      # after the last read of chunk 1
    ...                                        # later layers, resident or in other slots
    join_prefetch([result], [], h)             # before the graph's output

In the graph that runs the first offloaded layer ``F`` (slot ``s``, whose last layer is
``E``), the call's entry refills come first::

    x   = placeholder                          # the smallest tensor input
    e   = empty_like(x)                        # an anchor the ops may declare mutated
    start_prefetch([e], [], h, E, F, -1)       # E (the previous call's) leaves, F comes in,
                                               # every chunk
    ...                                        # layers before F: the copy runs under them
    wait_prefetch([x1, e], h, F, 0)            # F's first wait: ordered after the starts

``x``, ``a`` and ``out`` keep their values; the ops only declare them mutated so that no
compiler moves a read of a chunk above its wait or below the start that overwrites it (a
start also reads every other read of what it overwrites).  A layer whose weight reads depend
only on graph inputs first gets a clone of one (``x2 = clone(x)``), tied to the wait instead.
"""
from __future__ import annotations

import torch
from torch import fx

from .. import ops
from ..graph_inputs import storage_of
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
    return drop_waits_of(gm, plan.handle, {lp.layer for lp in plan.layers})


def drop_waits_of(gm: fx.GraphModule, handle: int, layers=None) -> int:
    """Erase the waits of offload state ``handle`` (of its ``layers``; None: all of them)."""
    dropped = 0
    for node in list(gm.graph.nodes):
        call = ops.OpCall.of(node)
        if call is not None and call.kind == "wait" and call.handle == handle \
                and (layers is None or call.layer in layers):
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def _insert_entry_starts(graph: fx.Graph, plan: GraphPlan, where, acts: list[fx.Node]) -> None:
    """The refills a call begins with, in order, immediately after the node ``where``: one
    op each, copying all its chunks (nothing runs between them that the chunks could wait
    for, and one op costs the host less than one per chunk)."""
    for leaving, refill in plan.entry.starts:
        with graph.inserting_after(where):
            where = _no_value(graph.call_function(
                ops.START, (acts, [], plan.handle, leaving, refill, -1)))


def _entry_anchor(graph: fx.Graph, plan: GraphPlan) -> fx.Node | None:
    """The anchor the entry starts (and the waits they must precede) declare mutated: an
    empty tensor shaped like a graph input, placed after the last placeholder, with the
    starts after it.  Empty, it is no kernel: nothing a compiler could fuse it with (a
    clone of the input fused with the first layer's own reads of it, and the starts sank
    below that layer's compute), and nothing to copy."""
    source = plan.entry.source if plan.entry is not None else None
    if source is None:
        return None
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        anchor = graph.call_function(torch.empty_like, (source,))
    anchor.meta["example_value"] = source.meta.get("example_value")
    anchor.meta["val"] = source.meta.get("val", anchor.meta["example_value"])
    _insert_entry_starts(graph, plan, anchor, [anchor])
    return anchor


def apply_plan(gm: fx.GraphModule, plan: GraphPlan) -> None:
    graph = gm.graph
    drop_traced_hook_waits(gm, plan)
    entry_anchor = _entry_anchor(graph, plan)
    tied = set() if plan.entry is None else {id(w) for w in plan.entry.tied}
    for lp in plan.layers:
        tied_to: dict[int, list[fx.Node]] = {}          # id(wait) -> the values it declares
        for wait in lp.waits:
            clones = _insert_clones(graph, lp, wait)
            acts = wait.acts + clones
            if id(wait) in tied:
                if entry_anchor is None:    # no input to shape it: the starts go just before
                    _insert_entry_starts(graph, plan, wait.first_use.prev, acts)
                    tied.clear()            # the first of these waits, tied to its values
                else:
                    acts = acts + [entry_anchor]
            tied_to[id(wait)] = acts
            for chunk in wait.chunks:
                ids = lp.routed.get(chunk)
                with graph.inserting_before(wait.first_use):
                    _no_value(graph.call_function(
                        ops.WAIT, (acts, plan.handle, lp.layer, chunk)) if ids is None else
                        graph.call_function(
                            ops.WAIT_ROUTED, (acts, ids, plan.handle, lp.layer, chunk)))
        placed_after: dict[fx.Node, fx.Node] = {}     # keeps starts after one node in order
        for start in lp.starts:
            if start.behind is not None:    # after the wait's ops, before the read it guards
                acts = tied_to[id(start.behind)]
                taken = {storage_of(a) for a in acts}
                reads = [n for n in start.acts + start.reads if storage_of(n) not in taken]
                with graph.inserting_before(start.behind.first_use):
                    _no_value(graph.call_function(
                        ops.START, (acts, reads, plan.handle, lp.layer, lp.refill,
                                    start.chunk)))
                continue
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
