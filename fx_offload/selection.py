"""Which layers and which of their parameters are offloaded.

Decided once per model from the module tree (not from one graph), so that every graph of a
model split by graph breaks agrees on layer indices, slots and prefetch targets.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

from torch import nn

from .options import OffloadOptions

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class LayerStack:
    path: str                   # dotted path from the model root ("" for the root itself)
    layers: list[nn.Module]

    def prefix(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)


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
            raise ValueError(
                f"prefetch_offload option 'layers'={path!r}: the model has no submodule at that "
                f"path; candidates are {_candidate_paths(root) or 'none'}") from None
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            raise ValueError(
                f"prefetch_offload option 'layers'={path!r} names a {type(module).__name__}, "
                "not an nn.ModuleList or nn.Sequential of layers")
        if len(module) < 2:
            raise ValueError(
                f"prefetch_offload option 'layers'={path!r} has {len(module)} layer(s); "
                "offloading needs a stack of at least 2 layers")
        return LayerStack(path, list(module))

    candidates = _top_level_lists(root)
    if not candidates:
        raise ValueError(
            f"prefetch_offload found no stack of repeated layers in {type(root).__name__} (no "
            "nn.ModuleList or nn.Sequential of two or more same-type modules); pass the option "
            "'layers' with the dotted path of the layer list, e.g. layers='model.layers'. If the "
            "compiled graph is a single layer, a graph break inside the layer's forward may be "
            "the cause (see TORCH_LOGS=graph_breaks)")
    longest = max(len(m) for _, m in candidates)
    best = [(p, m) for p, m in candidates if len(m) == longest]
    if len(best) > 1:
        raise ValueError(
            f"prefetch_offload found several layer stacks of length {longest}: "
            f"{[p or '<root>' for p, _ in best]}; pass the option 'layers' to choose one")
    p, m = best[0]
    return LayerStack(p, list(m))


def _candidate_paths(root: nn.Module) -> list[str]:
    return [p or "<root>" for p, _ in _top_level_lists(root)]


def _top_level_lists(root: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if not _is_layer_list(module):
            continue
        if any(name.startswith(f"{p}." if p else "") for p, _ in found):
            continue  # a list inside the layers of an outer stack (experts of a MoE layer)
        found.append((name, module))
    return found


def matches_segments(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` contains one of ``patterns`` as whole dotted segments:
    ``w13_weight`` matches ``mlp.experts.w13_weight``, not ``mlp.experts.w13_weight_scale``."""
    segments = name.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        for start in range(len(segments) - len(want) + 1):
            if segments[start:start + len(want)] == want:
                return True
    return False


@dataclasses.dataclass
class OffloadedParam:
    name: str            # full dotted name from the model root
    suffix: str          # name inside its layer ("mlp.fc1.weight"), the slot key
    param: nn.Parameter


_OPTION = object()


def select_params(root: nn.Module, stack: LayerStack, options: OffloadOptions,
                  layers: Iterable[int] | None = None, patterns=_OPTION,
                  ) -> dict[int, list[OffloadedParam]]:
    """Layer index -> its offloaded parameters; layers left with none are skipped.

    ``layers`` (indices) and ``patterns`` (an ``offload_params`` value) override the options:
    the planner uses them for the plans it weighs and the one it picks."""
    if patterns is _OPTION:
        patterns = options.offload_params
    wanted = None if layers is None else set(layers)
    owners: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)

    chosen: dict[int, list[OffloadedParam]] = {}
    any_match = False
    for index, layer in enumerate(stack.layers):
        if not (options.offloads_layer(index) if wanted is None else index in wanted):
            continue
        prefix = stack.prefix(index)
        picked = []
        for suffix, p in layer.named_parameters(remove_duplicate=False):
            if patterns is not None and not matches_segments(suffix, patterns):
                continue
            any_match = True
            names = owners.get(id(p), [])
            if len(names) > 1:
                log.info("fx_offload: not offloading %s.%s: the parameter is shared with %s",
                         prefix, suffix, [n for n in names if n != f"{prefix}.{suffix}"])
                continue
            picked.append(OffloadedParam(f"{prefix}.{suffix}", suffix, p))
        if picked:
            chosen[index] = picked
        else:
            log.debug("fx_offload: layer %s has no parameter to offload; skipped", prefix)
    if patterns is not None and not any_match:
        sample = [n for n, _ in stack.layers[0].named_parameters()][:8]
        raise ValueError(
            f"prefetch_offload option 'offload_params'={list(patterns)} matches "
            f"no parameter of the selected layers; parameter names inside a layer look like "
            f"{sample}")
    return chosen


def rotation(layers: list[int], num_slots: int) -> tuple[dict[int, int], dict[int, int | None]]:
    """Slot of each offloaded layer and the layer its slot is refilled with after it runs:
    ``layers[i]`` lives in slot ``i % num_slots`` and is followed in that slot by
    ``layers[i + num_slots]``, or past the end by the first layer of the slot (for the next
    call); None where a slot holds one layer only."""
    n = len(layers)
    slot_of = {layer: i % num_slots for i, layer in enumerate(layers)}
    target_of: dict[int, int | None] = {}
    for i, layer in enumerate(layers):
        nxt = i + num_slots
        target = layers[nxt] if nxt < n else layers[i % num_slots]
        target_of[layer] = None if target == layer else target
    return slot_of, target_of
