"""Which nodes of a graph hold only values of the router's picks.

The routed wait copies the rows of the experts the router's top-k indices (``ids``) name,
and nothing else.  A read of an expert tensor is safe only where the rows it takes are
among those: its index holds values of ``ids`` (a view, a reordering, a selection of them),
or it is a grouped matmul whose groups are counted from them.  Anything else computed from
``ids`` may name other experts: a remap through a table (``expert_map[ids]``), a drop onto
a fixed expert (``where(ids > 5, 0, ids)``), arithmetic (``(ids + 1) % E``).  Such a read
takes rows no copy filled, so its chunk moves whole::

    ids = topk(scores, k)[1]                      picks
    flat = ids.reshape(-1)                        picks      (a view)
    order = sort(flat)                            values: picks; indices: positions, not picks
    sorted_ids = order[0]                         picks
    w[flat], index_select(w, 0, sorted_ids)       routed: rows of picked experts
    offs = cumsum(histc(sorted_ids.float(), bins=E, min=0, max=E - 1))
    grouped_mm(x, w.mT, offs=offs)                routed: experts no token picked have
                                                  empty groups
    w[clamp(flat, 0, E - 1)]                      routed: a top-k over E scores picks
                                                  in [0, E), which such a clamp keeps
    w[expert_map[flat]], w[where(flat > 5, 0, flat)]      not routed: other rows
    flat.add_(1); w[flat]                         not routed: an in-place change of the
                                                  picks (or of a view of them) ends them
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ..graph_inputs import storage_of, value_of

# one tensor argument in, its values (some of them, reordered, converted) out
_KEEPS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand",
          "expand_as", "permute", "transpose", "t", "contiguous", "clone", "detach", "alias",
          "_unsafe_view", "to", "_to_copy", "convert_element_type", "type", "int", "long",
          "short", "float", "double", "half", "bfloat16", "narrow", "select", "slice",
          "repeat", "flip", "roll", "masked_select", "index_select",
          "gather", "take", "getitem", "index", "msort", "ravel"}
# a tuple whose first output holds the input's values (the others: positions, counts)
_TUPLES = {"sort", "unique", "_unique2", "unique_consecutive", "topk", "kthvalue", "mode",
           "max", "min"}
_JOINS = {"cat", "stack", "concat", "concatenate", "where"}     # every value input a pick
_CLAMPS = {"clamp", "clip", "clamp_min", "clamp_max", "clamp_", "clip_", "clamp_min_",
           "clamp_max_"}
_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
             operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
             operator.ixor, operator.ilshift, operator.irshift, operator.setitem}
_COUNTS = {"histc", "bincount"}
_KEEP_COUNTS = {"cumsum", "to", "_to_copy", "convert_element_type", "type", "int", "long",
                "float", "view", "reshape", "contiguous", "clone", "_unsafe_view"}


def op_name(node: fx.Node) -> str:
    """The name of what ``node`` calls ("getitem", "view", "grouped_mm"), or ""."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return ""
    if node.target is operator.getitem:
        return "getitem"
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]           # aten's overload names: "view.default" -> "view"


def picked_values(ids: fx.Node, members, count: int | None = None) -> set[fx.Node]:
    """``ids`` and the nodes among ``members`` (in graph order) that hold only values
    ``ids`` holds; ``count``: the experts the top-k chose among (a clamp to ``[0, count)``
    keeps every pick), None if not known."""
    picks, tuples = {ids}, set()
    for node in members:
        name = op_name(node)
        first = node.args[0] if node.args else None
        changed = _mutated(node)
        if name in _CLAMPS and first in picks and _keeps_range(node, count):
            picks.add(node)         # clamp_ too: what it changes in place stays the picks
        elif changed is not None:
            # whatever the op writes, the picks it writes over (and their views) no
            # longer hold only picks; the values copied from them earlier still do
            storage = storage_of(changed)
            picks -= {p for p in picks if p is changed or
                      (storage is not None and storage_of(p) == storage)}
            tuples -= {t for t in tuples if t is changed}
        elif name == "getitem" and first in tuples:
            if node.args[1] == 0:
                picks.add(node)
        elif name in _KEEPS and first in picks and _exact(node, count):
            picks.add(node)
        elif name in _TUPLES and first in picks:
            tuples.add(node)
        elif name in _JOINS:
            values = node.args[1:] if name == "where" else (first or ())
            if name == "where" and len(node.args) != 3:
                continue
            if values and all(isinstance(v, fx.Node) and v in picks for v in values):
                picks.add(node)
    return picks


# the largest id each dtype holds exactly (a view as another dtype reinterprets the bits)
_EXACT_UP_TO = {torch.int8: 127, torch.uint8: 255, torch.int16: 2 ** 15 - 1,
                torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8, torch.float32: 2 ** 24,
                torch.bool: 1}


def _exact(node: fx.Node, count: int | None) -> bool:
    """``node`` (one of :data:`_KEEPS` over picks) holds the same ids: not a view of their
    bits as another dtype, nor a conversion to a dtype that cannot hold each of ``count``
    ids exactly (``ids.to(torch.int8)`` of 256 experts wraps)."""
    if op_name(node) in ("view", "view_as") and any(
            isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return True
    largest = _EXACT_UP_TO.get(value.dtype)
    return largest is None or (count is not None and count - 1 <= largest)


def _mutated(node: fx.Node) -> fx.Node | None:
    """The node whose value ``node`` changes in place (``x.add_(1)``, ``x += 1``,
    ``x[i] = v``, ``out=x``), or None."""
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_function" and node.target in _IN_PLACE:
        return first
    name = op_name(node)
    return first if name.endswith("_") and not name.startswith("_") else None


def _keeps_range(node: fx.Node, count: int | None) -> bool:
    """A clamp whose bounds let every value in ``[0, count)`` through unchanged."""
    if count is None:
        return False
    name = op_name(node).rstrip("_")
    if name == "clamp_min":
        names = ("min",)
    elif name == "clamp_max":
        names = ("max",)
    else:
        names = ("min", "max")
    bounds = dict(zip(names, node.args[1:]))
    bounds.update({k: v for k, v in node.kwargs.items() if k in names})
    low, high = bounds.get("min"), bounds.get("max")
    if not all(b is None or isinstance(b, int) for b in (low, high)):
        return False        # a tensor or a symbolic bound: not known here
    return (low is None or low <= 0) and (high is None or high >= count - 1) \
        and (low is not None or high is not None)


def counts_picks(offs: fx.Node, picks: set[fx.Node], count: int) -> bool:
    """``offs`` (a grouped matmul's group offsets) is a running sum of how many picks fell
    on each of the ``count`` experts: ``cumsum(histc(p, bins=count, min=0, max=count - 1))``
    or ``bincount(p, minlength=count)``, ``p`` in ``picks``, through conversions and views."""
    node = offs
    while isinstance(node, fx.Node) and op_name(node) in _KEEP_COUNTS:
        node = node.args[0] if node.args else None
    if not isinstance(node, fx.Node) or op_name(node) not in _COUNTS or not node.args:
        return False
    if node.args[0] not in picks:
        return False
    args = dict(zip(("bins", "min", "max") if op_name(node) == "histc" else ("weights",
                                                                         "minlength"),
                    node.args[1:]))
    args.update(node.kwargs)
    if op_name(node) == "bincount":
        return args.get("weights") is None and args.get("minlength") == count
    return args.get("bins", 100) == count and args.get("min", 0) == 0 \
        and args.get("max", 0) == count - 1


def rows_of(node: fx.Node) -> int | None:
    """The number of experts (rows) of an expert tensor node, if known."""
    value = value_of(node)
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else None
