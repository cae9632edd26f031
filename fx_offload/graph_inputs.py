"""What the placeholders of a Dynamo graph are: the model they come from and parameter names.

Dynamo hands a backend the model's parameters as placeholders whose example inputs *are* the
``nn.Parameter`` objects, with a ``grapharg`` source such as
``L['self']._modules['layers']._modules['1']._modules['fc1']._parameters['weight']``.  The
source's innermost part names the frame local (or global) holding the model; the model is read
from the frame being compiled, and names come from ``named_parameters`` by identity, which is
exact whatever form the source takes.  ``grapharg`` only exists while the backend runs.
"""
from __future__ import annotations

import dataclasses
import sys

from torch import fx, nn


@dataclasses.dataclass
class GraphInputs:
    root: nn.Module | None
    frame_is_root_forward: bool               # hooks of ``root`` ran eagerly, outside the graph
    root_expr: str | None                     # "L['self']": how nn_module_stack paths begin
    params: dict[fx.Node, tuple[str, nn.Parameter]]  # parameter placeholder -> name, object
    placeholders: list[fx.Node]


def _source_name(source) -> str:
    name = source.name
    return name() if callable(name) else name


def _innermost(source):
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


def _frame():
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # pragma: no cover - depends on torch internals
        return None, None, None
    if tx is None:  # pragma: no cover
        return None, None, None
    return tx.f_locals, tx.f_globals, tx.f_code


def _resolve(source, f_locals, f_globals):
    inner = _innermost(source)
    local = getattr(inner, "local_name", None)
    if local is not None and f_locals is not None and local in f_locals:
        return f_locals[local], _source_name(inner)
    glob = getattr(inner, "global_name", None)
    if glob is not None and f_globals is not None and glob in f_globals:
        return f_globals[glob], _source_name(inner)
    return None, None


def read_graph_inputs(gm: fx.GraphModule, example_inputs) -> GraphInputs:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    f_locals, f_globals, f_code = _frame()
    roots: dict[int, tuple[nn.Module, str]] = {}
    param_nodes: list[tuple[fx.Node, nn.Parameter, object]] = []
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, nn.Parameter):
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        if source is None:
            continue
        obj, expr = _resolve(source, f_locals, f_globals)
        if isinstance(obj, nn.Module):
            roots.setdefault(id(obj), (obj, expr))
        param_nodes.append((node, value, obj))
    if not roots:
        return GraphInputs(None, False, None, {}, placeholders)
    if len(roots) > 1:
        raise ValueError(
            "prefetch_offload compiles one model per graph, but this graph reads parameters of "
            f"{len(roots)} models ({[type(m).__name__ for m, _ in roots.values()]}); compile "
            "each model separately")
    (root, expr), = roots.values()
    names = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params = {node: (names[id(p)], p) for node, p, _ in param_nodes if id(p) in names}
    return GraphInputs(root, _is_forward_frame(root, f_code), expr, params, placeholders)


def _is_forward_frame(root: nn.Module, f_code) -> bool:
    """True when Dynamo compiles ``root``'s own ``forward`` (or what follows a graph break in
    it): ``Module.__call__`` and its hooks then ran eagerly, outside the graph."""
    if f_code is None:
        return False
    forward = getattr(type(root).forward, "__code__", None)
    return f_code is forward or (
        forward is not None and f_code.co_name.startswith("torch_dynamo_resume_in_")
        and f_code.co_filename == forward.co_filename)


def find_parent_model(module: nn.Module, max_frames: int = 256):
    """The nearest caller whose local is a model with ``module`` in its layer stack, for a
    graph Dynamo compiled from one layer's own ``forward`` frame (a graph break around it)."""
    from .selection import _top_level_lists
    frame = sys._getframe(1)
    seen = set()
    for _ in range(max_frames):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if not isinstance(value, nn.Module) or value is module or id(value) in seen:
                continue
            seen.add(id(value))
            for _, stack in _top_level_lists(value):
                if any(layer is module for layer in stack):
                    return value
        frame = frame.f_back
    return None
