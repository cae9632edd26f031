"""Which chunks of expert tensors a graph reads only through its router's picks: those
get a ``wait_routed`` instead of a ``wait_prefetch``, and only the picked experts cross the
link.

A chunk of an MoE layer made only of expert tensors (:mod:`fx_offload.selection.experts`) is
routed when, in this graph, the layer computes exactly one top-k over as many scores as the
tensors have experts (its indices, ``ids``, are what ``wait_routed`` is given), and every
read of the chunk's bytes takes rows the ids name (:mod:`.picks` says which nodes hold only
values of ``ids``)::

    ids = topk(scores[T, E], k)[1]
    w[idx]                        # idx holds values of ids   (eager loop, batched_mm)
    index_select(w, 0, idx)
    grouped_mm(x, w.mT, offs=o)   # o counts the ids per expert: rows of experts no
                                  # token picked are read by no group  (grouped_mm)

Nothing else may read the tensor's values (its shape may be read).  Any other read would
read rows no copy filled, so the chunk then moves whole, and :func:`route` records why in
``learned.routing`` (``report`` and ``explain`` show it).  The verifier re-checks the same
rule on the rewritten graph (:func:`unrouted_read`).  Which reads keep the picks and which
end them: docs/routed_experts.md (What is routed).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ..graph_inputs import value_of
from ..ops import OpCall
from .picks import Picks, counts_picks, op_name, picked_values, rows_of

_TOPK = {torch.topk, torch.ops.aten.topk.default}
_SELECT = {torch.index_select, torch.ops.aten.index_select.default}
_INDEX = {operator.getitem, torch.ops.aten.index.Tensor} | _SELECT
# torch's grouped matmuls, and transformers' fallback for other dtypes (its custom op:
# group g multiplies rows offs[g-1]:offs[g] by weight[g], an empty group reads nothing)
_GROUPED_MM = {"_grouped_mm", "grouped_mm", "transformers::grouped_mm_fallback"}
_VIEWS = {"transpose", "mT", "permute"}        # views a grouped mm reads its weight as
_METADATA = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype,
             torch.device, torch.Size)


def route(layer: int, weights: dict[fx.Node, int], names: dict[fx.Node, str],
          members: list[fx.Node], choice, learned) -> dict[int, fx.Node]:
    """Chunk -> the ids node of its ``wait_routed``, for ``layer``'s chunks of expert tensors
    this graph reads only through its router's picks; records in ``learned.routing[layer]``
    each such chunk's outcome ("routed" or why not)."""
    experts = choice.experts.get(layer)
    if not experts:
        return {}
    prefix = choice.stack.layer_path(layer) + "."
    outcome = learned.routing.setdefault(layer, {})
    routed, routers = {}, {}        # expert count -> (ids, why not, nodes computed from ids)
    for chunk in learned.layout[layer]:
        counts = {experts.get(s) for s in chunk.suffixes}
        if None in counts or len(counts) != 1:
            continue            # not made of expert tensors alone
        ws = [w for w, c in weights.items() if c == chunk.index and w.users]
        if not ws:
            continue
        count = counts.pop()
        if count not in routers:        # one router per layer: looked for once
            ids, why = _router_ids(members, count)
            picks = None if ids is None else picked_values(ids, members, count)
            routers[count] = (ids, why, picks)
        ids, why, picks = routers[count]
        if ids is not None and ids not in picks:
            why = f"the layer writes its router's ids ({ids.name}) in place"
        elif ids is not None:
            bad = next((r for w in ws for r in [unrouted_read(w, picks)] if r), None)
            if bad is not None:
                why = (f"{bad.name} ({op_name(bad)}) reads rows of "
                       f"{names[bad_weight(bad, ws)].removeprefix(prefix)} other than its "
                       "router's picks")
        outcome[chunk.index] = "routed" if why is None else why
        if why is None:
            routed[chunk.index] = ids
    return routed


def bad_weight(node: fx.Node, ws) -> fx.Node:
    """The weight among ``ws`` that ``node`` (a read found by :func:`unrouted_read`) reads."""
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        if n in ws:
            return n
        seen.add(n)
        frontier += [a for a in n.all_input_nodes if a not in seen]
    return ws[0]


def _router_ids(members: list[fx.Node], count: int) -> tuple[fx.Node | None, str | None]:
    """The indices of the layer's one top-k over ``count`` scores, or why there is none."""
    found = []
    for node in members:
        is_topk = (node.op == "call_function" and node.target in _TOPK) or \
            (node.op == "call_method" and node.target == "topk")
        scores = value_of(node.args[0]) if is_topk and node.args else None
        if isinstance(scores, torch.Tensor) and scores.dim() and scores.shape[-1] == count:
            found += [u for u in node.users
                      if u.op == "call_function" and u.target is operator.getitem
                      and u.args[1] == 1]
    if len(found) == 1:
        return found[0], None
    if not found:
        return None, f"no top-k over the {count} experts' scores in this graph"
    return None, f"{len(found)} top-k over the {count} experts' scores in this graph"


def unrouted_read(w: fx.Node, picks: Picks) -> fx.Node | None:
    """The first node that reads the values of expert tensor ``w`` other than by rows the
    router picked (``picks``: the nodes holding only values of its ids, :mod:`.picks`);
    None if there is none."""
    count = rows_of(w)
    for user in w.users:
        if isinstance(value_of(user), _METADATA) or OpCall.is_ours(user):
            continue            # a shape read from the weight reads no rows; our ops none
        if _picks_rows(user, w, picks):
            continue
        if _is_view(user, w) and all(_grouped(u, user, picks, count) or OpCall.is_ours(u)
                                     for u in user.users):
            continue
        if _grouped(user, w, picks, count):
            continue
        return user
    return None


def _picks_rows(user: fx.Node, w: fx.Node, picks) -> bool:
    """``user`` takes rows of ``w`` (its first dimension) by an index in ``picks``."""
    if user.op != "call_function" or user.target not in _INDEX or len(user.args) < 2 \
            or user.args[0] is not w:
        return False
    if user.target in _SELECT:
        if user.args[1] not in (0, -value_of(w).dim()) or len(user.args) < 3:
            return False
        index = user.args[2]
    else:
        index = user.args[1]
    first = index[0] if isinstance(index, (list, tuple)) and index else index
    return isinstance(first, fx.Node) and first in picks


def _is_view(user: fx.Node, w: fx.Node) -> bool:
    """``user`` is a view of the expert tensor ``w`` that keeps the experts its first
    dimension (``w.mT``, ``w.transpose(-2, -1)``, ``w.permute(0, 2, 1)``): a grouped matmul
    reads expert ``e``'s group from row ``e`` of it."""
    if user.args[:1] != (w,) or op_name(user) not in _VIEWS:
        return False
    value = value_of(w)
    if not isinstance(value, torch.Tensor) or value.dim() < 3:
        return False
    name, dims = op_name(user), list(user.args[1:])
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = list(dims[0])        # permute([0, 2, 1])
    if not all(isinstance(d, int) for d in dims):
        return False
    dims = [d % value.dim() for d in dims]
    if name == "transpose":
        return len(dims) == 2 and 0 not in dims
    if name == "permute":
        return len(dims) == value.dim() and dims[0] == 0
    return True                     # mT: the last two dimensions


def _grouped(user: fx.Node, w: fx.Node, picks, count: int | None) -> bool:
    """``user`` is a grouped matmul taking ``w`` as its per-expert weight, with group offsets
    counted from the router's picks over its ``count`` experts (so an expert no token
    picked is in no group)."""
    if user.op != "call_function" or op_name(user) not in _GROUPED_MM:
        return False        # another library's op of that name may read anything
    # the per-group weight is the second operand, experts first: [E, K, N]
    second = user.kwargs.get("mat_b", user.args[1] if len(user.args) > 1 else None)
    value = value_of(w)
    offs = user.kwargs.get("offs", user.args[2] if len(user.args) > 2 else None)
    return second is w and isinstance(value, torch.Tensor) and value.dim() == 3 \
        and isinstance(offs, fx.Node) and count is not None \
        and counts_picks(offs, picks, count)
