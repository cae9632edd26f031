"""The planner's cost model: FLOPs and bytes of each layer, read from the traced graph.

Every call node is run once more on its fake values under ``FlopCounterMode``, with the
shape environment's guards suppressed, so nothing is specialized or guarded.  The counts are
written in one variable, the token count ``T`` (the product of the leading dimensions of the
model's first input), so each node's cost is a function of ``T``::

    node   flops(T)          weight bytes   activation bytes(T)   kernel?
    ----   ---------------   ------------   -------------------   -------
    mm     2*T*4096*14336    117440512      T*36864               yes
    view   0                 0              0                     no (aliases its input)
    silu   0                 0              T*28672               yes, fused with its run

A graph traced with static shapes is scaled linearly with ``T`` from the traced token count
(attention's quadratic term is then linear: trace with ``dynamic=True`` for exact counts).

A segment (the nodes before the first layer, one layer, the nodes after the last) takes,
on a GPU, ``max(sum over nodes of max(flops / rate(flops), bytes / memory_bandwidth),
kernels * launch_overhead)``, where ``rate`` is the device's measured FLOP rate for a
matrix multiply (or an attention kernel) of that size.  Kernels are the FLOP-counted nodes
plus one per run of other non-view nodes, as Inductor fuses such runs.  On the CPU the two
add up.  The counting and the rates: docs/planner.md (The planner: ``memory_budget``, steps
1, 2, 4).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Callable

import sympy
import torch
import torch.nn.functional as F
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from ..graph_inputs import GraphInputs, layers_of_nodes, storage_of, value_of
from .device_rates import DeviceRates
from .experts import top_k_per_layer

log = logging.getLogger("fx_offload")

T = sympy.Symbol("T", positive=True)
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_NO_RUN = {operator.getitem}


class OfTokens:
    """A cost as a function of the call's tokens ``T``: its expression, made a function on
    first use.  It pickles (the expression travels), where the function ``lambdify`` makes
    would not: a model planned under memory_budget carries its plan in its hooks, and
    ``torch.save(model)`` pickles them."""

    def __init__(self, expr: sympy.Expr):
        self.expr, self._fn = expr, None

    def __call__(self, tokens: float) -> float:
        if self._fn is None:
            if self.expr.free_symbols:
                self._fn = sympy.lambdify(T, self.expr, "math")
            else:
                value = float(self.expr)
                self._fn = lambda _t: value
        return self._fn(tokens)

    def __getstate__(self) -> dict:
        return {"expr": self.expr, "_fn": None}


@dataclasses.dataclass
class NodeCost:
    name: str
    flops: Callable[[float], float]
    weight_bytes: int
    act_bytes: Callable[[float], float]
    flop_counted: bool
    attention: bool = False


@dataclasses.dataclass
class SegmentCost:
    nodes: list[NodeCost]
    kernels: int

    def seconds(self, tokens: float, rates: DeviceRates, overlapped: bool) -> float:
        work = 0.0
        for node in self.nodes:
            moved = (node.weight_bytes + node.act_bytes(tokens)) / rates.memory_bandwidth
            flops = node.flops(tokens)
            work += max(flops / rates.rate(flops, node.attention), moved) if flops else moved
        launch = self.kernels * rates.launch_overhead
        return max(work, launch) if overlapped else work + launch

    def flops(self, tokens: float) -> float:
        return sum(n.flops(tokens) for n in self.nodes)


@dataclasses.dataclass
class GraphCosts:
    traced_tokens: int
    symbolic: bool
    pre: SegmentCost
    layers: dict[int, SegmentCost]
    post: SegmentCost
    flop_expr: dict[int, sympy.Expr]       # per layer, for display
    # layer -> k of its router's top-k (selection.experts.top_k_per_layer)
    top_k: dict[int, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        kind = "symbolic" if self.symbolic else f"static, scaled from {self.traced_tokens}"
        first = min(self.flop_expr)
        return f"layer {first}: {sympy.simplify(self.flop_expr[first])} FLOPs ({kind})"


def _value(node):
    return value_of(node) if isinstance(node, fx.Node) else node


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _expr(value) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def _nbytes(t: torch.Tensor) -> sympy.Expr:
    n = sympy.Integer(t.element_size())
    for size in t.shape:
        n = n * _expr(size)
    return n


def _fake_mode(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        for t in _tensors(_value(node)):
            mode = getattr(t, "fake_mode", None)
            if mode is not None:
                return mode
    return None


def _sdpa_flops(args, kwargs) -> sympy.Expr:
    q, k, v = (kwargs.get(n, a) for n, a in zip(("query", "key", "value"),
                                                 list(args) + [None] * 3))
    batch = sympy.Integer(1)
    for size in q.shape[:-2]:
        batch = batch * _expr(size)
    sq, d = _expr(q.shape[-2]), _expr(q.shape[-1])
    sk, dv = _expr(k.shape[-2]), _expr(v.shape[-1])
    flops = 2 * batch * sq * sk * (d + dv)
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return flops / 2 if causal else flops


def _run_flops(node: fx.Node, fake_mode) -> sympy.Expr:
    args = fx.node.map_aggregate(node.args, _value)
    kwargs = fx.node.map_aggregate(node.kwargs, _value)
    if node.target in _SDPA:
        return _sdpa_flops(args, kwargs)
    shape_env = getattr(fake_mode, "shape_env", None)
    with fake_mode, FlopCounterMode(display=False) as counter:
        if shape_env is not None:
            with shape_env.suppress_guards():
                _call(node, args, kwargs)
        else:
            _call(node, args, kwargs)
    return _expr(counter.get_total_flops())


def _call(node, args, kwargs):
    if node.op == "call_function":
        node.target(*args, **kwargs)
    else:
        getattr(args[0], node.target)(*args[1:], **kwargs)


def _runs(node: fx.Node) -> bool:
    """Nodes worth running for FLOPs: calls on tensors that do not mutate their inputs."""
    if node.op not in ("call_function", "call_method") or node.target in _NO_RUN:
        return False
    if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
        return False
    return any(isinstance(_value(a), torch.Tensor) for a in node.all_input_nodes)


def _token_input(gi: GraphInputs) -> torch.Tensor | None:
    for node in gi.placeholders:
        value = _value(node)
        if node not in gi.params and isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    return None


def _to_tokens(expr: sympy.Expr, hints: dict, scale_symbol, scale: sympy.Expr):
    """Substitute every size symbol by its traced value, except ``scale_symbol``, which
    becomes its traced value times ``T / traced tokens``."""
    subs = {s: (scale * hints[s] if s == scale_symbol else hints[s])
            for s in expr.free_symbols if s in hints}
    return expr.subs(subs)


def graph_costs(gm: fx.GraphModule, gi: GraphInputs, layer_paths: dict[str, int],
                whole_graph_layer: int | None = None) -> GraphCosts:
    """Costs of the graph's segments; ``layer_paths`` maps a layer's dotted path to its
    index.  ``whole_graph_layer``: the graph is that one layer's own frame."""
    fake_mode = _fake_mode(gm)
    shape_env = getattr(fake_mode, "shape_env", None)
    tok = _token_input(gi)
    dims = [] if tok is None else list(tok.shape[:-1] if tok.is_floating_point() else tok.shape)
    hints: dict[sympy.Symbol, int] = {}
    if shape_env is not None:
        hints = {s: _hint(shape_env, s) for s in _symbols_of(gm)}
    traced = 1
    for size in dims:
        traced *= _hint(shape_env, _expr(size)) if isinstance(size, torch.SymInt) else int(size)
    token_syms = [s for size in dims for s in sorted(_expr(size).free_symbols, key=str)
                  if s in hints]
    symbolic = bool(token_syms)
    scale_symbol = token_syms[-1] if symbolic else None
    scale = T / traced

    def as_function(expr: sympy.Expr, grows: bool) -> tuple[Callable, sympy.Expr]:
        if symbolic:
            e = _to_tokens(expr, hints, scale_symbol, scale)
        else:
            e = _to_tokens(expr, hints, None, scale)
            if grows:
                e = e * scale
        e = sympy.sympify(e)
        return OfTokens(e), e

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_layer_at = math.inf
    segment_of: dict[fx.Node, int | str] = {}
    membership = layers_of_nodes(gm, gi, layer_paths)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        layer = whole_graph_layer
        if layer is None and node in membership:
            layer = membership[node][0]
        if layer is not None:
            first_layer_at = min(first_layer_at, order[node])
        segment_of[node] = layer

    param_nodes = set(gi.params)
    nodes: dict = {}
    flop_expr: dict[int, sympy.Expr] = {}
    for node, layer in segment_of.items():
        key = layer if layer is not None else ("pre" if order[node] < first_layer_at else "post")
        outs = _tensors(_value(node))
        if not outs:
            continue
        ins = [a for a in node.all_input_nodes if isinstance(_value(a), torch.Tensor)]
        in_storages = {storage_of(_value(a)) for a in ins}
        is_view = all(storage_of(t) in in_storages for t in outs)
        flops = sympy.Integer(0)
        if _runs(node):
            try:
                flops = _run_flops(node, fake_mode)
            except Exception as err:  # an op the fake mode cannot rerun: count no FLOPs
                log.debug("fx_offload: no FLOP count for %s: %s", node.format_node(), err)
        if is_view and flops == 0:
            continue
        weight_bytes = sum(int(_nbytes(_value(a))) for a in ins if a in param_nodes)
        out_bytes = sum((_nbytes(t) for t in outs), sympy.Integer(0))
        counted = flops != 0
        if counted:   # a matmul reads its activations and writes its output
            act = out_bytes + sum((_nbytes(_value(a)) for a in ins if a not in param_nodes),
                                  sympy.Integer(0))
        else:         # fused elementwise work: each value written once (and read once)
            act = out_bytes
        flops_fn, flops_e = as_function(flops, grows=True)
        act_fn, _ = as_function(act, grows=True)
        nodes.setdefault(key, []).append(NodeCost(node.name, flops_fn, weight_bytes, act_fn,
                                                  counted, node.target in _SDPA))
        if isinstance(key, int):
            flop_expr[key] = flop_expr.get(key, sympy.Integer(0)) + flops_e

    def segment(key) -> SegmentCost:
        ns = nodes.get(key, [])
        kernels, in_run = 0, False
        for n in ns:
            if n.flop_counted:
                kernels, in_run = kernels + 1, False
            elif not in_run:
                kernels, in_run = kernels + 1, True
        return SegmentCost(ns, kernels)

    layers = {key: segment(key) for key in nodes if isinstance(key, int)}
    top_k = {} if whole_graph_layer is not None else top_k_per_layer(membership)
    return GraphCosts(traced, symbolic, segment("pre"), layers, segment("post"), flop_expr,
                      top_k)


def _hint(shape_env, expr) -> int:
    """The traced value of a size expression (torch 2.13 renamed the method)."""
    fn = getattr(shape_env, "optimization_hint", None) or shape_env.size_hint
    return int(fn(expr))


def _symbols_of(gm: fx.GraphModule) -> set:
    syms = set()
    for node in gm.graph.nodes:
        for t in _tensors(_value(node)):
            for size in t.shape:
                if isinstance(size, torch.SymInt):
                    syms |= _expr(size).free_symbols
    return syms
