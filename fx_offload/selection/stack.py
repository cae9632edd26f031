"""The layer stack: the ``nn.ModuleList``/``nn.Sequential`` of repeated layers whose members
may be offloaded.

Found once per model from the module tree (not from one graph), so that every graph of a
model split by graph breaks agrees on layer indices.  A layer is named by its *index* in the
stack (``3``) or by its *path* from the model root (``model.layers.3``).
"""
from __future__ import annotations

import dataclasses
import logging
import sys

from torch import nn

from ..errors import OffloadError
from ..graph_inputs import MAX_CALLER_FRAMES, caller_module, layers_of_nodes

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class LayerStack:
    """One layer list, or several whose layers run one list after the other (an encoder and
    a decoder, Flux's double- and single-stream blocks): indices run across them in that
    order, so they share one circular schedule."""
    paths: tuple[str, ...]      # dotted paths from the model root ("" for the root itself)
    modules: list[nn.Module]    # the layers, by index: list after list
    sizes: tuple[int, ...]      # how many layers each list has

    @classmethod
    def of(cls, lists: list[tuple[str, nn.Module]]) -> "LayerStack":
        return cls(tuple(p for p, _ in lists), [m for _, ms in lists for m in ms],
                   tuple(len(ms) for _, ms in lists))

    @property
    def path(self) -> str:
        """The list's path; several lists' paths joined (for messages)."""
        return self.paths[0] if len(self.paths) == 1 else " + ".join(
            p or "<root>" for p in self.paths)

    def layer_path(self, index: int) -> str:
        """Dotted path of layer ``index`` from the model root."""
        path, local = self._locate(index)
        return f"{path}.{local}" if path else str(local)

    def list_of(self, index: int) -> str:
        """Path of the layer list that holds layer ``index``."""
        return self._locate(index)[0]

    def _locate(self, index: int) -> tuple[str, int]:
        """(path of the list holding layer ``index``, its index in that list)."""
        for path, size in zip(self.paths, self.sizes):
            if index < size:
                return path, index
            index -= size
        raise IndexError(index)

    def sections(self) -> list[tuple[str, list[nn.Module]]]:
        """(path, its layers) of each list."""
        out, start = [], 0
        for path, size in zip(self.paths, self.sizes):
            out.append((path, self.modules[start:start + size]))
            start += size
        return out

    def describe(self) -> str:
        return repr(self.path or "<root>")


def _is_layer_list(module: nn.Module) -> bool:
    """A list of two or more layers of one class, subclasses of it allowed (a layer that
    overrides ``forward`` for a few inputs is still a layer of the stack)."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    kinds = {type(child) for child in module}
    return any(all(issubclass(other, kind) for other in kinds) for kind in kinds)


def eager_experts_hint(root: nn.Module) -> str:
    """transformers' ``eager`` experts loop (a Python loop over the experts a batch hit)
    breaks the graph inside every MoE layer; say which implementations compile whole."""
    for module in root.modules():
        config = getattr(module, "config", None)
        if "expert" in type(module).__name__.lower() and \
                getattr(config, "_experts_implementation", None) == "eager":
            return (f"; {type(module).__name__} computes its experts with transformers' "
                    "'eager' loop, which breaks the graph inside each layer: build the model "
                    "with experts_implementation='grouped_mm' (the default where it can run) "
                    "or 'batched_mm'")
    return ""


def find_layer_stack(root: nn.Module, path: str | tuple[str, ...] | None) -> LayerStack:
    """The ``nn.ModuleList``/``nn.Sequential`` of repeated layers: ``path`` (or several
    paths) if given, else the longest list of modules of one class that is not nested inside
    another such list's layers; several lists of that length are taken together, in the
    order the model registers them."""
    if path is not None:
        paths = (path,) if isinstance(path, str) else tuple(path)
        for a in paths:
            for b in paths:
                if a != b and (a == "" or b.startswith(f"{a}.")):
                    raise OffloadError(f"option 'layers': {b!r} is inside {a or '<root>'!r}; "
                                       "give layer lists that do not contain one another")
        if len(set(paths)) != len(paths):
            raise OffloadError(f"option 'layers' names a list twice: {list(paths)}")
        return LayerStack.of([(p, _layer_list(root, p)) for p in paths])

    candidates = top_level_lists(root)
    if not candidates:
        raise OffloadError(
            f"found no stack of repeated layers in {type(root).__name__} (no "
            "nn.ModuleList or nn.Sequential of two or more modules of one class); pass the option "
            "'layers' with the dotted path of the layer list, e.g. layers='model.layers'. If the "
            "compiled graph is a single layer, a graph break inside the layer's forward may be "
            "the cause (see TORCH_LOGS=graph_breaks)" + eager_experts_hint(root))
    longest = max(len(m) for _, m in candidates)
    best = [(p, m) for p, m in candidates if len(m) == longest]
    if len(best) > 1:
        log.info("fx_offload: found %d layer stacks of length %d, offloaded together in one "
                 "schedule: %s (give the option 'layers' to choose)", len(best), longest,
                 [p or "<root>" for p, _ in best])
    return LayerStack.of([(p, list(m)) for p, m in best])


def _layer_list(root: nn.Module, path: str) -> list[nn.Module]:
    if not isinstance(path, str):
        raise OffloadError(f"option 'layers' takes dotted paths, got {path!r}")
    try:
        module = root.get_submodule(path) if path else root
    except AttributeError:
        raise OffloadError(
            f"option 'layers'={path!r}: the model has no submodule at that "
            f"path; candidates are {_candidate_paths(root) or 'none'}") from None
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise OffloadError(
            f"option 'layers'={path!r} names a {type(module).__name__}, "
            "not an nn.ModuleList or nn.Sequential of layers")
    if len(module) < 2:
        raise OffloadError(
            f"option 'layers'={path!r} has {len(module)} layer(s); "
            "offloading needs a stack of at least 2 layers")
    return list(module)


def first_runs(stack: LayerStack, gm, gi) -> dict[str, int]:
    """Each layer list's path -> the position, in graph ``gm``, of the first node traced in
    one of its layers (read as the pass reads layers: ``layers_of_nodes``)."""
    paths = {stack.layer_path(i): i for i in range(len(stack.modules))}
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first: dict[str, int] = {}
    for node, layers in layers_of_nodes(gm, gi, paths).items():
        for layer in layers:
            first.setdefault(stack.list_of(layer), position[node])
    return first


def in_run_order(stack: LayerStack, first: dict[str, int]) -> LayerStack:
    """``stack`` with its lists ordered by ``first`` (a list's path -> the position of the
    first graph node traced inside one of its layers, :func:`first_runs`); lists the graph
    does not use keep their place after those it does."""
    if len(stack.paths) < 2:
        return stack
    sections = stack.sections()
    order = sorted(range(len(sections)),
                   key=lambda i: (first.get(sections[i][0], sys.maxsize), i))
    if order == list(range(len(sections))):
        return stack
    ordered = [sections[i] for i in order]
    log.info("fx_offload: layer lists in the order they run: %s", [p for p, _ in ordered])
    return LayerStack.of(ordered)


def _candidate_paths(root: nn.Module) -> list[str]:
    return [p or "<root>" for p, _ in top_level_lists(root)]


def top_level_lists(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every layer list of ``root`` that is not inside the layers of another (the experts
    of a MoE layer are not a stack), with its dotted path.  A list whose layers are not
    alike (no parameter layout shared by half of them) but each hold a layer list at one
    path (ConvNeXt's stages, each of its own width, each with its ``blocks``) is looked into
    instead: the lists at that path are the stacks."""
    found: list[tuple[str, nn.Module]] = []
    opened: dict[str, set[str]] = {}    # unlike list's path -> inner list paths in a layer
    for name, module in root.named_modules():
        if not _is_layer_list(module):
            continue
        if any(name.startswith(f"{p}." if p else "") for p, _ in found):
            continue  # a list inside the layers of an outer stack (experts of a MoE layer)
        outer = next((p for p in opened if name.startswith(f"{p}." if p else "")), None)
        if outer is not None:
            _, _, inner = name[len(outer) + 1 if outer else 0:].partition(".")
            if inner not in opened[outer]:
                continue
        else:
            inner_paths = _common_inner_lists(module)
            if inner_paths:
                log.debug("fx_offload: %r holds layers of different layouts; its stacks are "
                          "the lists %s inside them", name or "<root>", sorted(inner_paths))
                opened[name] = inner_paths
                continue
        found.append((name, module))
    return found


def _common_inner_lists(layers: nn.Module) -> set[str]:
    """For a list whose layers are not alike (no parameter layout, names and shapes, shared
    by at least half of them): the paths at which every layer holds a layer list.  Empty for
    a list of alike layers (SD3's different last block, DeepSeek's first dense layers leave a
    stack alike) and for one whose layers hold no common list (hybrid layers with experts in
    some of them stay one stack)."""
    layouts: dict[tuple, int] = {}
    for layer in layers:
        layout = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
        layouts[layout] = layouts.get(layout, 0) + 1
    if 2 * max(layouts.values()) >= len(layers):
        return set()
    common = None
    for layer in layers:
        paths = {n for n, m in layer.named_modules() if n and _is_layer_list(m)}
        common = paths if common is None else common & paths
    return common or set()


def find_parent_model(module: nn.Module, max_frames: int = MAX_CALLER_FRAMES):
    """The outermost caller whose ``self`` is a model with ``module`` in its layer stack, for
    a graph Dynamo compiled from one layer's own ``forward`` frame (a graph break around it):
    the model a graph without the break would have had as its root (a causal LM, not the
    decoder inside it whose stack is the same).  Reads the locals of module-call frames only
    (see ``graph_inputs._MODULE_CALL_FRAMES``)."""
    return caller_module(module, lambda value: any(
        layer is module for _, stack in top_level_lists(value) for layer in stack), max_frames,
        outermost=True)


def find_enclosing_model(module: nn.Module, max_frames: int = MAX_CALLER_FRAMES):
    """The nearest caller whose ``self`` is a model with a layer stack and ``module`` among its
    submodules outside that stack: for a graph Dynamo compiled from such a module's own frame
    (the model's forward fell back to eager around a graph break), which reads no layer's
    weights."""
    def holds(value):
        return bool(top_level_lists(value)) and any(m is module for m in value.modules())
    return caller_module(module, holds, max_frames, outermost=False)


def find_outer_model(module: nn.Module, max_frames: int = MAX_CALLER_FRAMES):
    """The outermost caller inside the same compiled call whose ``self`` is a model sharing
    one of ``module``'s layer stacks: for a graph Dynamo compiled from a model's own frame
    because the forward around it fell back to eager (a graph break in the outer forward,
    as transformers' ``output_hidden_states`` makes), the model a graph without the break
    would have had as its root (the causal LM around its decoder).  None where ``module`` is
    what ``torch.compile`` wrapped: a module calling the compiled model is not it."""
    mine = {id(stack) for _, stack in top_level_lists(module)}
    if not mine:
        return None
    return caller_module(module, lambda value: any(
        id(stack) in mine for _, stack in top_level_lists(value)), max_frames,
        outermost=True, within_call=True)
