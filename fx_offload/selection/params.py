"""Which parameters of the chosen layers are offloaded (all, or those ``offload_params``
names; a parameter shared with anything else stays resident)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import torch
from torch import nn

from .. import dtensor
from ..errors import OffloadError
from ..schedule import Schedule
from .stack import LayerStack

log = logging.getLogger("fx_offload")
NAMES_SHOWN = 8                 # parameter names an error quotes as examples


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
    suffix: str          # name inside its layer ("mlp.fc1.weight"), its key in the slot
    param: nn.Parameter
    owner: nn.Module     # the module whose attribute it is
    attr: str            # its attribute name there ("weight")

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    def current(self) -> nn.Parameter | None:
        """The parameter the owner holds now (``load_state_dict(assign=True)`` or an
        assignment may have put another one there); a DTensor's local shard."""
        return dtensor.local(self.owner._parameters.get(self.attr))


def layer_bytes(params: dict[int, list[OffloadedParam]]) -> dict[int, int]:
    """Offloaded bytes of each layer."""
    return {layer: sum(p.nbytes for p in ps) for layer, ps in params.items()}


def select_params(root: nn.Module, stack: LayerStack, layers: Iterable[int],
                  patterns: tuple[str, ...] | None) -> dict[int, list[OffloadedParam]]:
    """Layer index -> its offloaded parameters among ``layers``: those matching ``patterns``
    (an ``offload_params`` value; None: all); layers left with none are skipped."""
    wanted = set(layers)
    owners: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)

    chosen: dict[int, list[OffloadedParam]] = {}
    any_match = False
    for index, layer in enumerate(stack.modules):
        if index not in wanted:
            continue
        path = stack.layer_path(index)
        picked = []
        for suffix, p in layer.named_parameters(remove_duplicate=False):
            if patterns is not None and not matches_segments(suffix, patterns):
                continue
            any_match = True
            names = owners.get(id(p), [])
            if len(names) > 1:
                log.info("fx_offload: not offloading %s.%s: the parameter is shared with %s",
                         path, suffix, [n for n in names if n != f"{path}.{suffix}"])
                continue
            where, _, attr = suffix.rpartition(".")
            owner = layer.get_submodule(where) if where else layer
            # a DTensor parameter (tensor parallelism): this rank's shard is what moves
            picked.append(OffloadedParam(f"{path}.{suffix}", suffix, dtensor.local(p), owner,
                                         attr))
        if picked:
            chosen[index] = picked
        else:
            log.debug("fx_offload: layer %s has no parameter to offload; skipped", path)
    _refuse_tensor_subclasses(chosen)
    if patterns is not None and not any_match:
        sample = [n for n, _ in stack.modules[0].named_parameters()][:NAMES_SHOWN]
        raise OffloadError(
            f"option 'offload_params'={list(patterns)} matches no parameter of the selected "
            f"layers; parameter names inside a layer look like {sample}")
    return chosen


def _refuse_tensor_subclasses(chosen: dict[int, list[OffloadedParam]]) -> None:
    """A parameter that is a tensor subclass (a torchao quantized weight, say) keeps its
    bytes in inner tensors that the host blocks and slots do not hold yet: refused by name,
    before anything moves, rather than failing inside the subclass's own code."""
    found = [(p.name, type(p.param.data)) for ps in chosen.values() for p in ps
             if type(p.param.data) is not torch.Tensor]
    if not found:
        return
    kinds = sorted({f"{cls.__module__}.{cls.__qualname__}" for _, cls in found})
    raise OffloadError(
        f"{len(found)} parameter(s) of the chosen layers are tensor subclasses ({kinds}), "
        f"e.g. {[name for name, _ in found][:NAMES_SHOWN]}: offloading their packed data is "
        "not supported yet. Keep them resident with offload_params naming the other "
        "parameters (or layers= a stack without them), or offload the model unquantized")
