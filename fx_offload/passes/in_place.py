"""Our ops called in place in the ATen graph that ``inner_backend="aot_eager"`` runs.

AOTAutograd functionalizes every op that declares a mutation (ours declare one on the
activations they are tied to, for ordering: ``fx_offload.ops``), and Inductor's reinplacing
pass turns the functional form back into the call.  ``aot_eager`` has no such pass: its
graph calls ``auto_functionalized_v2``, which at every call clones each declared-mutated
activation and runs Python.  Our ops never change a value, so the functional form's results
are its inputs, bitwise, and the call can be made as it is::

    before                                               after
    r = auto_functionalized_v2(fx_offload.wait_prefetch,  fx_offload.wait_prefetch(
            handle=h, layer=L, chunk=c,                       [a, b], h, L, c)
            _activations_base_index=[0, 1], ...,
            _all_bases=[a, b])
    a2 = r[1]; b2 = r[2]                                  (a2 -> a, b2 -> b)
    ... = mm(a2, w)                                       ... = mm(a, w)

The op keeps its place in the node list, which is the order ``aot_eager`` runs the nodes in,
so every read that came after the functional form's results still comes after the op.
(No graph input is ever declared mutated: the rewrite ties a wait to a clone of one,
passes/README.md, so there is no copy-back to drop.)  What it saves: docs/design.md (Why
each op depends on what it does, the ``aot_eager`` paragraph).
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from ..ops import NAMES

log = logging.getLogger("fx_offload")

_FUNCTIONAL = torch.ops.higher_order.auto_functionalized_v2


def call_in_place(gm: fx.GraphModule) -> int:
    """Replace each functional form of our ops in ``gm`` (an ATen graph from AOTAutograd)
    by a direct call; returns how many."""
    graph, done = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _FUNCTIONAL or \
                node.args[0] not in NAMES:
            continue
        op, kwargs = node.args[0], dict(node.kwargs)
        bases = list(kwargs["_all_bases"])
        # the functional form returns (the op's result, None for ours, *the bases' values)
        first = max(1, len(op._schema.returns))
        if not all(user.target is operator.getitem and isinstance(user.args[1], int)
                   and first <= user.args[1] < first + len(bases) for user in node.users):
            log.debug("fx_offload: %s left in its functional form: other uses of its "
                      "results (%s)", node, list(node.users))
            continue                    # still right, only slower
        args = {a.name: kwargs[a.name] for a in op._schema.arguments
                if a.name != "activations" and a.name in kwargs}
        with graph.inserting_before(node):
            call = graph.call_function(op, (bases,), args)
        call.meta["val"] = None
        for user in list(node.users):
            user.replace_all_uses_with(bases[user.args[1] - first])
            graph.erase_node(user)
        graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
        log.debug("fx_offload: %d calls of our ops made in place for aot_eager", done)
    return done
