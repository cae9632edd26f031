"""A normalized, readable text form of a graph, for goldens, ``inspect`` and ``explain``.

Normalized so that it changes only when the graph does: no file paths, line numbers,
addresses, object ids or handle numbers; no device (tensors print as ``f32[4, 32]``);
symbolic sizes renumbered ``s0, s1, ...`` in order of appearance; parameters and buffers by
their dotted names; the inserted ops on lines starting ``>>>`` and offloaded weights marked
``[L1 s0]`` (layer 1, slot 0) wherever they are read.
"""
from __future__ import annotations

import operator
import re

import torch
from torch import fx

from ..graph_inputs import value_of
from ..ops import OpCall

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "b8",
           torch.uint8: "u8", torch.int8: "i8"}
_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)")
_SYMBOL = re.compile(r"\b[su]\d+\b")


def source_display_name(node: fx.Node) -> str | None:
    """``L['self']._modules['rotary']._buffers['inv_freq']`` -> ``rotary.inv_freq``;
    ``L['input_ids']`` -> ``input_ids``."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name() if callable(source.name) else source.name
    root = re.match(r"^[LG]\['([^']+)'\]", name)
    if not root:
        return None
    rest = name[root.end():]
    parts = [a or b for a, b in _SOURCE_PART.findall(rest)]
    if not parts:
        return root.group(1)
    return ".".join(parts)


class _Symbols:
    def __init__(self):
        self.names: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        def sub(match):
            return self.names.setdefault(match.group(0), f"s{len(self.names)}")
        return _SYMBOL.sub(sub, text)


def _type_str(value, symbols: _Symbols) -> str:
    if isinstance(value, torch.Tensor):
        dims = ", ".join(symbols(str(d)) for d in value.shape)
        return f"{_DTYPES.get(value.dtype, str(value.dtype))}[{dims}]"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({symbols(str(value))})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_type_str(v, symbols) for v in value) + ")"
    return ""


def _target_str(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}" + (
            f".{target._overloadname}" if target._overloadname != "default" else "")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", str(target))
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch._C._nn") or module == "torch.nn.functional":
        return f"F.{name}"
    if module.startswith("torch") or name.startswith("_VariableFunctionsClass."):
        # torch functions print by their public name: torch.rsqrt, not where they live
        return f"torch.{getattr(target, '__name__', name)}"
    return f"{module}.{name}" if module else name


def format_graph(gm: fx.GraphModule, weight_layer: dict[fx.Node, tuple] | None = None,
                 input_names: list[str] | None = None,
                 input_tags: list[tuple[int, int, int] | None] | None = None) -> str:
    """``weight_layer``: offloaded weight placeholder -> (layer, slot, chunk).  ``input_names`` and
    ``input_tags`` name and tag placeholders by position instead (an ATen graph's placeholders
    are the Dynamo graph's, in order)."""
    weight_layer = dict(weight_layer or {})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if input_tags:
        for node, tag in zip(placeholders, input_tags):
            if tag is not None:
                weight_layer[node] = tag
    given = dict(zip(placeholders, input_names or []))
    symbols = _Symbols()
    names: dict[fx.Node, str] = {}
    lines = []

    def arg_str(a) -> str:
        if isinstance(a, fx.Node):
            tag = weight_layer.get(a)
            name = names.get(a, a.name)
            return f"{name}[L{tag[0]} s{tag[1]} c{tag[2]}]" if tag else name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg_str(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}: {arg_str(v)}" for k, v in a.items()) + "}"
        if isinstance(a, torch.dtype):
            return _DTYPES.get(a, str(a))
        if isinstance(a, torch.device):
            return "<device>"
        if isinstance(a, (torch.SymInt, torch.SymFloat)):
            return symbols(str(a))
        if isinstance(a, torch._ops.OpOverload) or callable(a):
            fake = fx.Node.__new__(fx.Node)
            fake.op, fake.target = "call_function", a
            return _target_str(fake)
        return symbols(repr(a))

    taken = {n.name for n in gm.graph.nodes if n.op != "placeholder"}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            display = given.get(node) or source_display_name(node) or node.name
            if display in taken:      # an input named like a computed value keeps its FX name
                display = node.name
            names[node] = display
            tag = weight_layer.get(node)
            mark = (f"  # offloaded: layer {tag[0]}, slot {tag[1]}, chunk {tag[2]}"
                    if tag else "")
            lines.append(f"input {display}: {_type_str(value_of(node), symbols)}{mark}")
        elif node.op == "output":
            lines.append(f"return {arg_str(node.args[0])}")
        elif node.op == "get_attr":
            lines.append(f"{node.name} = get_attr {node.target}")
        elif OpCall.is_ours(node):
            lines.append(_format_ours(OpCall.of(node), arg_str, node))
        elif (call := OpCall.of(node)) is not None:      # auto_functionalized(our op, ...)
            kwargs = ", ".join(f"{k}={'h' if k == 'handle' else arg_str(v)}"
                               for k, v in node.kwargs.items())
            lines.append(f">>> {node.name} = {_target_str(node)}({call.name}, {kwargs})")
        else:
            args = [arg_str(a) for a in node.args]
            args += [f"{k}={arg_str(v)}" for k, v in node.kwargs.items()]
            typ = _type_str(value_of(node), symbols)
            lines.append(f"{node.name}{': ' + typ if typ else ''} = "
                         f"{_target_str(node)}({', '.join(args)})")
    return "\n".join(lines) + "\n"


def _format_ours(call: OpCall, arg_str, node) -> str:
    if call.kind == "host" and len(node.args) == 4:       # host_mlp(x, h, layer, chunks)
        return (f">>> {arg_str(node)} = {call.name}(layer {call.layer} chunks "
                f"{list(call.chunks)}, {arg_str(node.args[0])})")
    if call.kind == "host":
        x, ids, gates = node.args[:3]
        return (f">>> {arg_str(node)} = {call.name}(layer {call.layer} chunks "
                f"{list(call.chunks)}, {arg_str(x)}, experts {arg_str(ids)}, gates "
                f"{arg_str(gates)})")
    if call.kind == "wait":
        picked = "" if call.ids is None else f", experts {arg_str([call.ids])}"
        return (f">>> {call.name}(layer {call.layer}{_chunk(call)}{picked}) ties "
                f"{arg_str(call.acts)}")
    extra = f", reads {arg_str(call.reads)}" if call.reads else ""
    if call.kind == "start":
        return (f">>> {call.name}(layer {call.layer} -> prefetch layer {call.refill}"
                f"{_chunk(call)}) ties {arg_str(call.acts)}{extra}")
    return f">>> {call.name}() ties {arg_str(call.acts)}{extra}"


def _chunk(call: OpCall) -> str:
    return "" if call.chunk < 0 else f" chunk {call.chunk}"
