"""The custom ops the pass inserts, in the ``fx_offload`` namespace.

Each op names the offload state by an integer handle and declares that it mutates the
activations it is tied to.  It never changes their values: the declared mutation is what
orders the op in every compiler.  AOTAutograd keeps a mutating op alive (an op that returns
nothing and mutates nothing is dead code), and every later reader of a mutated activation is
ordered after it, so Inductor cannot hoist a layer's compute above its wait or sink it below
its start.  Parameters are never declared mutated: that would make them mutated graph inputs
(CUDA graphs refused) and would hide from the compiler that slots alias across layers.

    wait_prefetch(acts, h, layer)          acts: the layer's inputs that feed weight reads
    start_prefetch(acts, reads, h, layer, target)
                                           acts/reads: the layer's outputs
    join_prefetch(acts, reads, h)          acts/reads: the graph's outputs
"""
from __future__ import annotations

import torch

from . import runtime


@torch.library.custom_op("fx_offload::wait_prefetch", mutates_args=("activations",))
def wait_prefetch(activations: list[torch.Tensor], handle: int, layer: int) -> None:
    """Block the compute stream until ``layer``'s weights are in its slot."""
    runtime.state_for_handle(handle).wait(layer)


@wait_prefetch.register_fake
def _(activations, handle, layer):
    return None


@torch.library.custom_op("fx_offload::start_prefetch", mutates_args=("activations",))
def start_prefetch(activations: list[torch.Tensor], reads: list[torch.Tensor], handle: int,
                   layer: int, target: int) -> None:
    """``layer`` is done with its slot: begin copying ``target``'s weights into it."""
    runtime.state_for_handle(handle).start(layer, target)


@start_prefetch.register_fake
def _(activations, reads, handle, layer, target):
    return None


@torch.library.custom_op("fx_offload::join_prefetch", mutates_args=("activations",))
def join_prefetch(activations: list[torch.Tensor], reads: list[torch.Tensor],
                  handle: int) -> None:
    """End of the forward: inside a CUDA-graph capture, join the copy stream back."""
    runtime.state_for_handle(handle).join()


@join_prefetch.register_fake
def _(activations, reads, handle):
    return None


WAIT = torch.ops.fx_offload.wait_prefetch.default
START = torch.ops.fx_offload.start_prefetch.default
JOIN = torch.ops.fx_offload.join_prefetch.default
