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
import operator
import os
import re
import sys

import torch
from torch import fx, nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.multiprocessing.reductions import StorageWeakRef

from . import dtensor
from .errors import OffloadError


@dataclasses.dataclass
class GraphInputs:
    root: nn.Module | None
    # hooks of ``root`` ran eagerly, outside the graph (its forward's frame, or one its
    # call runs around)
    frame_is_root_forward: bool
    root_expr: str | None                     # "L['self']": how nn_module_stack paths begin
    params: dict[fx.Node, tuple[str, nn.Parameter]]  # parameter placeholder -> name, object
    placeholders: list[fx.Node]
    code: object = None                       # the code object of the frame Dynamo traced
    inside_call: bool = False                 # a function ``root``'s call runs, not its forward


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
    glob = getattr(inner, "global_name", None)
    if local is not None and f_locals is not None and local in f_locals:
        obj = f_locals[local]
    elif glob is not None and f_globals is not None and glob in f_globals:
        obj = f_globals[glob]
    else:
        return None, None
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, nn.Module) and not isinstance(obj, nn.Module):
        # a bound method the frame holds (``torch.compile(model.forward)`` of a module whose
        # own forward Dynamo does not trace from, nn.Sequential's): its module is the model
        above = source
        while above is not None and getattr(above, "base", None) is not inner:
            above = getattr(above, "base", None)
        if getattr(above, "member", None) == "__self__":
            return owner, _source_name(above)
    return obj, _source_name(inner)


def _held_as_parameter(node: fx.Node) -> bool:
    """The placeholder was read as ``module._parameters[name]`` (whatever its type)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return getattr(source, "index", None) is not None and \
        getattr(getattr(source, "base", None), "member", None) == "_parameters"


MAX_CALLER_FRAMES = 256         # how far up the call stack a layer's model is looked for
# Frames of a module's call: their locals hold the calling model as ``self`` and die with the
# call.  Only these are read: on Python before 3.13 reading a frame's ``f_locals`` stores a
# snapshot of its locals in the frame, which would keep a user's ``del model`` from freeing
# the model until that user's function returns.
_MODULE_CALL_FRAMES = ("forward", "_call_impl", "_wrapped_call_impl")
_RESUME_PREFIX = "torch_dynamo_resume_in_"      # the rest of a forward after a graph break
# torch.compile's wrapper around what it compiles (named so in torch 2.11 and 2.13)
_COMPILE_ENTRY_FRAMES = ("compile_wrapper", "_fn")
_COMPILE_ENTRY_FILE = os.path.join("_dynamo", "eval_frame.py")


def caller_module(module: nn.Module, wanted, max_frames: int, outermost: bool,
                  within_call: bool = False):
    """The nearest (or outermost) module ``wanted`` accepts among the ``self`` locals of the
    module-call frames above the function calling this one's caller; the outermost stops at
    the call ``torch.compile`` wrapped (a module calling the compiled model is not it), and
    ``within_call`` stops there even before one is found."""
    frame = sys._getframe(2)
    seen = set()
    found = None
    for _ in range(max_frames):
        if frame is None:
            break
        name = frame.f_code.co_name
        if (found is not None or within_call) and name in _COMPILE_ENTRY_FRAMES and \
                frame.f_code.co_filename.endswith(_COMPILE_ENTRY_FILE):
            break
        if name in _MODULE_CALL_FRAMES or name.startswith(_RESUME_PREFIX):
            for value in list(frame.f_locals.values()):
                if not isinstance(value, nn.Module) or value is module or \
                        id(value) in seen or isinstance(value, OptimizedModule):
                    continue        # (torch.compile's wrapper: the model it wraps is found)
                seen.add(id(value))
                if wanted(value):
                    if not outermost:
                        return value
                    found = value
        frame = frame.f_back
    return found


def read_graph_inputs(gm: fx.GraphModule, example_inputs) -> GraphInputs:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    f_locals, f_globals, f_code = _frame()
    roots: dict[int, tuple[nn.Module, str]] = {}
    param_nodes: list[tuple[fx.Node, nn.Parameter, object]] = []
    for node, value in zip(placeholders, example_inputs):
        # a parameter, or a plain tensor a module holds as one (``functional_call`` swaps a
        # state dict's tensors in): read through the module's ``_parameters``
        if not isinstance(value, nn.Parameter) and not _held_as_parameter(node):
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
        return GraphInputs(None, False, None, {}, placeholders, f_code)
    root, expr, in_call = _one_model(list(roots.values()))
    names = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params = {node: (names[id(p)], p) for node, p, _ in param_nodes if id(p) in names}
    return GraphInputs(root, in_call or _is_forward_frame(root, f_code), expr, params,
                       placeholders, f_code, in_call)


def compiled_frame(gi: GraphInputs) -> str:
    """The frame Dynamo compiled, as messages name it: ``LlamaDecoderLayer.forward``, or a
    function inside a module's call, ``DoraLinearLayer.forward (inside Linear.forward)``."""
    name = f"{type(gi.root).__name__}.forward"
    if not gi.inside_call or gi.code is None:
        return name
    function = getattr(gi.code, "co_qualname", gi.code.co_name)
    resumed = re.fullmatch(rf"{_RESUME_PREFIX}(.+)_at_\d+", function)
    return f"{resumed.group(1) if resumed else function} (inside {name})"


def _one_model(roots: list[tuple[nn.Module, str]]) -> tuple[nn.Module, str | None, bool]:
    """(the model, its expression in the frame, the frame runs inside that model's call)
    for the modules the frame holds parameters of.  Several are one model where one of them
    holds the others, or where a module whose call runs around the frame holds them all: a
    function a layer calls with its submodules as arguments (PEFT's DoRA passes ``lora_A``,
    ``lora_B`` and ``base_layer``), compiled on its own after a graph break in it.  That
    module's hooks ran eagerly, as for a frame of its own forward; no path in the frame
    begins at it."""
    if len(roots) == 1:
        return roots[0][0], roots[0][1], False
    def holds_all(value):
        held = {id(m) for m in value.modules()}
        return all(id(m) in held for m, _ in roots)
    for module, expr in roots:
        if holds_all(module):
            return module, expr, False
    caller = caller_module(roots[0][0], holds_all, MAX_CALLER_FRAMES, outermost=False)
    if caller is None:
        raise OffloadError(
            "compiles one model per graph, but this graph reads parameters of "
            f"{len(roots)} models ({[type(m).__name__ for m, _ in roots]}); compile "
            "each model separately")
    return caller, None, True


def _is_forward_frame(root: nn.Module, f_code) -> bool:
    """True when Dynamo compiles ``root``'s own ``forward`` (or a base class's ``forward``
    it calls through ``super()``, or what follows a graph break in either):
    ``Module.__call__`` and its hooks then ran eagerly, outside the graph."""
    if f_code is None:
        return False
    for cls in type(root).__mro__:
        forward = vars(cls).get("forward")
        # a forward wrapped by a decorator (transformers' layers wrap theirs for gradient
        # checkpointing) is compiled as the wrapper or as what it wraps
        while forward is not None:
            code = getattr(forward, "__code__", None)
            if code is not None and (
                    f_code is code or (f_code.co_name.startswith("torch_dynamo_resume_in_")
                                       and f_code.co_filename == code.co_filename)):
                return True
            forward = getattr(forward, "__wrapped__", None)
    return False


def describe_node(node: fx.Node) -> str:
    """A node as a user can find it: its name, its op and the line of the model's code that
    made it (Dynamo's stack trace), not FX's repr of its arguments."""
    target = node.target
    op = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "(.+)", line (\d+)', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{found.group(1).rsplit('/', 1)[-1]}:{found.group(2)}"
            return f"{node.name} ({op}, at {where}" + (f": `{code}`)" if code else ")")
    return f"{node.name} ({op})"


def value_of(node: fx.Node):
    """The example value a node carries: ``example_value`` in a Dynamo graph, ``val`` in an
    ATen graph (nodes the pass inserts carry both)."""
    return node.meta.get("example_value", node.meta.get("val"))


def storage_of(value):
    """A weak reference to the storage of a node's (or a tensor's) value, to tell aliases;
    None for values without one."""
    if isinstance(value, fx.Node):
        value = value_of(value)
    if isinstance(value, torch.Tensor):
        # a DTensor's storage is its wrapper's own: from_local(x) would not alias x
        value = dtensor.local(value)
        try:
            return StorageWeakRef(value.untyped_storage())
        except Exception:  # pragma: no cover - tensors without storage (sparse, nested)
            return None
    return None


_INDEX = re.compile(r"\[\s*'?([^'\]]+)'?\s*\]")


# Dynamo spells a submodule through the module's dicts where the model's class defines
# ``__getattr__`` (diffusers' ModelMixin, PEFT's wrappers): ``L['self'].__dict__['_modules']
# ['blocks'].0``.  These segments are never module names.
_DICT_SEGMENTS = {"__dict__", "_modules"}


def module_path(stack_path: str, root_expr: str | None) -> str | None:
    """``L['self'].layers.1.mlp`` (or ``L['self'].__dict__['_modules']['layers'].1.mlp``)
    -> ``layers.1.mlp`` (relative to the graph's model)."""
    if root_expr is None or not stack_path.startswith(root_expr):
        return None
    rest = _INDEX.sub(r".\1", stack_path[len(root_expr):])
    return ".".join(s for s in rest.split(".") if s and s not in _DICT_SEGMENTS)


def layers_of_nodes(gm: fx.GraphModule, gi: GraphInputs, layer_paths: dict[str, int],
                    ) -> dict[fx.Node, list[int]]:
    """Call node -> the layers (indices, from ``layer_paths``: dotted path -> index) whose
    ``forward`` it was traced in, read from ``nn_module_stack``; nodes of no layer are left
    out."""
    membership: dict[fx.Node, list[int]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        found = []
        for stack in [node.meta.get("nn_module_stack")] + _subgraph_stacks(gm, node):
            for entry in (stack or {}).values():
                layer = layer_paths.get(module_path(entry[0], gi.root_expr))
                if layer is not None and layer not in found:
                    found.append(layer)
        if not found and node.target is operator.getitem and \
                isinstance(node.args[0], fx.Node) and _calls_subgraph(node.args[0]):
            found = membership.get(node.args[0], [])    # an output of such an op's body
        if found:
            membership[node] = found
    return membership


def _calls_subgraph(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _subgraph_stacks(gm: fx.GraphModule, node: fx.Node) -> list:
    """The ``nn_module_stack`` of each node inside the subgraphs a higher-order op such as
    activation checkpointing's ``tag_activation_checkpoint`` calls: the op itself was traced
    in the caller's frame, its body in the layer's."""
    if not _calls_subgraph(node):
        return []
    stacks = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(gm, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                stacks += [n.meta.get("nn_module_stack") for n in sub.graph.nodes]
    return stacks
