"""The layer stack: the ``nn.ModuleList``/``nn.Sequential`` of repeated layers whose members
may be offloaded.

Found once per model from the module tree (not from one graph), so that every graph of a
model split by graph breaks agrees on layer indices.  A layer is named by its *index* in the
stack (``3``) or by its *path* from the model root (``model.layers.3``).
"""
from __future__ import annotations

import dataclasses
import sys

from torch import nn

from ..errors import OffloadError


@dataclasses.dataclass
class LayerStack:
    path: str                   # dotted path from the model root ("" for the root itself)
    modules: list[nn.Module]    # the layers, by index

    def layer_path(self, index: int) -> str:
        """Dotted path of layer ``index`` from the model root."""
        return f"{self.path}.{index}" if self.path else str(index)

    def describe(self) -> str:
        return repr(self.path or "<root>")


def _is_layer_list(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    kinds = {type(child) for child in module}
    return len(kinds) == 1


def find_layer_stack(root: nn.Module, path: str | None) -> LayerStack:
    """The ``nn.ModuleList``/``nn.Sequential`` of repeated layers: ``path`` if given, else the
    longest list of same-type modules that is not nested inside another such list's layers."""
    if path is not None:
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
        return LayerStack(path, list(module))

    candidates = top_level_lists(root)
    if not candidates:
        raise OffloadError(
            f"found no stack of repeated layers in {type(root).__name__} (no "
            "nn.ModuleList or nn.Sequential of two or more same-type modules); pass the option "
            "'layers' with the dotted path of the layer list, e.g. layers='model.layers'. If the "
            "compiled graph is a single layer, a graph break inside the layer's forward may be "
            "the cause (see TORCH_LOGS=graph_breaks)")
    longest = max(len(m) for _, m in candidates)
    best = [(p, m) for p, m in candidates if len(m) == longest]
    if len(best) > 1:
        raise OffloadError(
            f"found several layer stacks of length {longest}: "
            f"{[p or '<root>' for p, _ in best]}; pass the option 'layers' to choose one")
    p, m = best[0]
    return LayerStack(p, list(m))


def _candidate_paths(root: nn.Module) -> list[str]:
    return [p or "<root>" for p, _ in top_level_lists(root)]


def top_level_lists(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every layer list of ``root`` that is not inside the layers of another (the experts
    of a MoE layer are not a stack), with its dotted path."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if not _is_layer_list(module):
            continue
        if any(name.startswith(f"{p}." if p else "") for p, _ in found):
            continue  # a list inside the layers of an outer stack (experts of a MoE layer)
        found.append((name, module))
    return found


MAX_CALLER_FRAMES = 256         # how far up the call stack a layer's model is looked for


def find_parent_model(module: nn.Module, max_frames: int = MAX_CALLER_FRAMES):
    """The nearest caller whose local is a model with ``module`` in its layer stack, for a
    graph Dynamo compiled from one layer's own ``forward`` frame (a graph break around it)."""
    frame = sys._getframe(1)
    seen = set()
    for _ in range(max_frames):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if not isinstance(value, nn.Module) or value is module or id(value) in seen:
                continue
            seen.add(id(value))
            for _, stack in top_level_lists(value):
                if any(layer is module for layer in stack):
                    return value
        frame = frame.f_back
    return None
