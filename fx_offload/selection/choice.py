"""The decision selection hands to the pass and the runtime: :class:`Choice` (what is
offloaded and how), or :class:`NothingOffloaded` where the planner keeps every weight on the
device.  Built only by :func:`fx_offload.selection.decide.choose`; read by the pass, the
runtime (which know no option names) and the reports.  What the pass learns from the
graphs (the copy chunks, the routing) is not written here: :mod:`fx_offload.learned`."""
from __future__ import annotations

import dataclasses

import torch

from ..options import OffloadOptions
from ..schedule import Schedule
from .params import OffloadedParam, layer_bytes
from .stack import LayerStack


@dataclasses.dataclass(frozen=True, eq=False)
class Choice:
    """What is offloaded and how, for one model."""

    model_name: str
    options: OffloadOptions           # what was asked: to describe and compare, not to act on
    stack: LayerStack
    params: dict[int, list[OffloadedParam]]   # layer index -> its offloaded parameters
    schedule: Schedule
    device: torch.device
    planner: object = None            # budget.PlannerResult under memory_budget
    # the model's call hook begins the entry refills (fx_offload.schedule) before Dynamo's
    # guards run; the graph's own entry start then finds them begun (under CUDA graphs a
    # capture waits for the hook's copies through external events)
    hook_starts_entry: bool = False
    # compiled for CUDA graphs (reduce-overhead): the hooks' circular refills always copy,
    # so every capture finds one to wait for (fx_offload.runtime.copies.hook_copies)
    under_cuda_graphs: bool = False
    # "lossless": each chunk of bf16 weights crosses the link compressed (codecs.lossless)
    compress: str = "none"
    # where compressed layers' uncompressed weights live (runtime.memory.file_backed)
    uncompressed_weights: str = "auto"
    # layer -> {suffix: number of experts} of its expert tensors, under experts="routed"
    # (selection.experts); the pass routes a chunk of them where a graph reads only the rows
    # its router picked (what it found is fx_offload.learned.Learned.routing)
    experts: dict = dataclasses.field(default_factory=dict)
    # device bytes that keep each routed layer's most-picked experts (runtime.experts.expert_cache)
    expert_cache: int = 0
    # layer -> the suffixes of its dense MLP's (gate, up, down) weights, where host_compute
    # may run it on the host (selection.mlps); each gets a copy chunk of its own
    mlps: dict = dataclasses.field(default_factory=dict)
    # layer -> why its MLP-like module is none of those (selection.mlps.refused_mlps)
    mlps_refused: dict = dataclasses.field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return list(self.schedule.layers)

    @property
    def layer_bytes(self) -> dict[int, int]:
        return layer_bytes(self.params)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes.values())

    @property
    def slot_bytes(self) -> int:
        """Device memory the slots will take: each as large as the largest layer it holds
        (before the alignment of each tensor in it)."""
        return self.schedule.slot_bytes(self.layer_bytes)


@dataclasses.dataclass(frozen=True, eq=False)
class NothingOffloaded:
    """The planner's decision for a model whose whole weights fit its ``memory_budget``."""

    model_name: str
    options: OffloadOptions
    stack: LayerStack
    planner: object
