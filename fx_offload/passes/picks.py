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

import functools
import inspect
import math
import operator

import torch
from torch import fx

from ..graph_inputs import storage_of, value_of
from ..ops import OpCall

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
             operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
             operator.setitem}
_IN_PLACE_METHODS = {f"__{op.__name__}__" for op in _IN_PLACE}     # x.__imul__(2)
_WRITING_ARGUMENTS = {"inplace", "running_mean", "running_var", "max_norm"}
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
    qualified = getattr(node.target, "_qualified_op_name", None)   # "aten::view", an op's
    namespace = getattr(node.target, "namespace", None) or \
        (qualified.split("::")[0] if isinstance(qualified, str) else None)
    if namespace not in (None, "aten", "prims"):
        # a library's own op: whatever it is named, it is not torch's op of that name
        return f"{namespace}::{name.split('.')[0]}"
    return name.split(".")[0]           # aten's overload names: "view.default" -> "view"


class Picks(set):
    """The nodes holding only values of the router's ids (a set), and ``written``: the
    nodes the layer writes in place, with their storages (a count or an offset written
    after it was computed is not what it was)."""
    written: set


def picked_values(ids: fx.Node, members, count: int | None = None) -> Picks:
    """``ids`` and the nodes among ``members`` (in graph order) that hold only values
    ``ids`` holds; ``count``: the experts the top-k chose among (a clamp to ``[0, count)``
    keeps every pick), None if not known.  ``ids`` itself is left out if something writes
    it (the wait would gather by what it holds then)."""
    picks, tuples = Picks({ids}), set()
    picks.written = set()
    for node in members:
        name = op_name(node)
        first = node.args[0] if node.args else None
        written = _written(node)
        if name in _CLAMPS and first in picks and _keeps_range(node, count):
            picks.add(node)         # clamp_ too: what it changes in place stays the picks
        elif written:
            # whatever the op writes, the picks it writes over (and their views) no
            # longer hold only picks; the values copied from them earlier still do
            storages = {storage_of(w) for w in written} - {None}
            picks.written |= storages | set(written)
            picks -= {p for p in picks if p in written or storage_of(p) in storages}
            tuples -= set(written)
        elif name == "getitem" and first in tuples:
            if node.args[1] == 0:
                picks.add(node)
        elif name in _KEEPS and first in picks and _exact(node, count):
            picks.add(node)
        elif name in _TUPLES and first in picks:
            if isinstance(value_of(node), (tuple, list)):
                tuples.add(node)    # (values, positions)
            elif not any(isinstance(a, fx.Node) for a in (*node.args[1:],
                                                           *node.kwargs.values())):
                picks.add(node)     # max(ids): a reduction to one of them
            # max(ids, other) is elementwise: not the picks
        elif name in _JOINS:
            if name == "where":
                if len(node.args) != 3:
                    continue
                # where(cond, a, b); the method form: a.where(cond, b)
                values = (first, node.args[2]) if node.op == "call_method" else node.args[1:]
            else:
                values = first or ()
            if values and all(isinstance(v, fx.Node) and v in picks for v in values):
                picks.add(node)
    return picks


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node`` changes in place: ``x.add_(1)``, ``x += 1``,
    ``x.__imul__(2)``, ``x[i] = v``, ``torch._foreach_mul_([x], 2)``, ``out=`` (one tensor
    or several), and what an op's schema says it writes (``values=``/``indices=`` of aten's
    out variants, a custom op's ``mutates_args``)."""
    found: list[fx.Node] = []
    if OpCall.is_ours(node):
        return found        # our ops declare their activations written only to be ordered

    def add(value):
        if isinstance(value, fx.Node):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
    add(node.kwargs.get("out"))
    for position, arg in _schema_writes(node.target):
        add(node.args[position] if position < len(node.args) else node.kwargs.get(arg))
    name = op_name(node)
    if (node.op == "call_function" and node.target in _IN_PLACE) \
            or name in _IN_PLACE_METHODS or (name.endswith("_") and not name.endswith("__")):
        add(node.args[0] if node.args else None)
    bound = _bound(node)
    if bound.get("inplace") is True:            # F.relu(x, inplace=True), F.hardtanh(...)
        add(node.args[0] if node.args else None)
    for stat in ("running_mean", "running_var"):    # updated by a training batch norm
        add(bound.get(stat))
    if bound.get("max_norm") is not None:       # F.embedding renormalizes its weight
        add(bound.get("weight"))
    return found


def _bound(node: fx.Node) -> dict:
    """``node``'s arguments by name where its target is a Python function whose signature
    names an argument that makes it write (``torch.nn.functional``), else its keyword
    arguments."""
    signature = None
    if node.op == "call_function":
        try:
            signature = _writing_signature(node.target)
        except TypeError:       # an unhashable target
            pass
    if signature is not None:
        try:
            return dict(signature.bind(*node.args, **node.kwargs).arguments)
        except TypeError:
            pass
    return dict(node.kwargs)


@functools.lru_cache(maxsize=None)
def _writing_signature(target) -> inspect.Signature | None:
    """``target``'s signature if it has an argument that makes it write one of its inputs
    (``inplace``, a batch norm's running statistics, ``max_norm``); looked up once per
    target (it is slow: a builtin's is parsed from its text)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None             # their schema says what they write
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return signature if _WRITING_ARGUMENTS & set(signature.parameters) else None


@functools.lru_cache(maxsize=None)
def _schema_writes(target) -> list[tuple[int, str]]:
    """(position, name) of each argument an op overload (or any overload of a packet)
    declares written (``Tensor(a!)``); none for Python functions and methods."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        return []
    return [(i, a.name) for o in overloads for i, a in enumerate(o._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _exact_up_to(dtype: torch.dtype) -> int:
    """The largest id ``dtype`` holds exactly, with every smaller one; -1 where ids do not
    survive it (bool indexes as a mask; a float without mantissa bits)."""
    if dtype == torch.bool or dtype.is_complex:
        return -1
    if dtype.is_floating_point:
        mantissa = round(-math.log2(torch.finfo(dtype).eps))    # eps = 2 ** -mantissa bits
        return 2 ** (mantissa + 1) if mantissa > 0 else -1
    return torch.iinfo(dtype).max


def _exact(node: fx.Node, count: int | None) -> bool:
    """``node`` (one of :data:`_KEEPS` over picks) holds the same ids: not a view of their
    bits as another dtype, nor a conversion to a dtype that cannot hold each of ``count``
    ids exactly (``ids.to(torch.uint8)`` of 300 experts wraps; with ``count`` unknown, the
    dtype must hold every int32)."""
    if op_name(node) == "view" and any(
            isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return True
    try:
        largest = _exact_up_to(value.dtype)
    except (TypeError, RuntimeError):
        return False
    return largest >= (count - 1 if count is not None else 2 ** 31 - 1)


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


def counts_picks(offs: fx.Node, picks: Picks, count: int) -> bool:
    """``offs`` (a grouped matmul's group offsets) is a running sum of how many picks fell
    on each of the ``count`` experts: ``cumsum(histc(p, bins=count, min=0, max=count - 1))``
    or ``bincount(p, minlength=count)``, ``p`` in ``picks``, through conversions (to a
    dtype that holds any count a batch gives) and views.  One running sum: a second one
    would give experts nobody picked rows."""
    node, sums = offs, 0
    while isinstance(node, fx.Node) and op_name(node) in _KEEP_COUNTS | _COUNTS:
        value = value_of(node)
        if not isinstance(value, torch.Tensor) or value.dim() != 1 \
                or _exact_up_to(value.dtype) < 2 ** 24 \
                or node in picks.written or storage_of(node) in picks.written:
            return False        # reshaped, too narrow, or written after it was counted
        if op_name(node) in _COUNTS:
            break
        sums += op_name(node) == "cumsum"
        node = node.args[0] if node.args else None
    if sums != 1 or not isinstance(node, fx.Node) or op_name(node) not in _COUNTS \
            or not node.args:
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
