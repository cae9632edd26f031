"""The custom ops the pass inserts, in the ``fx_offload`` namespace, and the one reader of
their arguments.

Each op names the offload state by an integer handle and declares that it mutates the
activations it is tied to.  It never changes their values: the declared mutation is what
orders the op in every compiler.  AOTAutograd keeps a mutating op alive (an op that returns
nothing and mutates nothing is dead code), and every later reader of a mutated activation is
ordered after it, so Inductor cannot hoist a layer's compute above its wait or sink it below
its start.  Parameters are never declared mutated: that would make them mutated graph inputs
(CUDA graphs refused) and would hide from the compiler that slots alias across layers.

    wait_prefetch(acts, h, layer, chunk)   acts: values the reads of the chunk's weights are
                                           computed from; chunk -1: every chunk of the layer
    wait_routed(acts, ids, h, layer, chunk)
                                           the wait of a chunk of expert tensors whose reads
                                           take only the rows ``ids`` (the router's top-k)
                                           picked: only those rows need to be in the slot
    start_prefetch(acts, reads, h, layer, target, chunk)
                                           acts/reads: the last read of what target's chunk
                                           overwrites (or the layer's outputs); target: the
                                           layer that refills the slot (the schedule's refill)
    join_prefetch(acts, reads, h)          acts/reads: the graph's outputs

Other modules read these ops' arguments only through :meth:`OpCall.of`, which understands
both a direct call (positional arguments, a Dynamo graph) and the ``auto_functionalized``
form AOTAutograd turns it into (keyword arguments, an ATen graph).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from . import dtensor, registry


@torch.library.custom_op("fx_offload::wait_prefetch", mutates_args=("activations",))
def wait_prefetch(activations: list[torch.Tensor], handle: int, layer: int,
                  chunk: int = -1) -> None:
    """Block the compute stream until ``layer``'s ``chunk`` is in its slot."""
    registry.state_for_op(handle).wait(layer, chunk)


@wait_prefetch.register_fake
def _(activations, handle, layer, chunk=-1):
    return None


@torch.library.custom_op("fx_offload::wait_routed", mutates_args=("activations",))
def wait_routed(activations: list[torch.Tensor], ids: torch.Tensor, handle: int, layer: int,
                chunk: int) -> None:
    """Before ``layer`` reads the rows of its expert tensors in ``chunk`` that ``ids`` (its
    router's top-k) picked: make sure the slot holds those rows."""
    registry.state_for_op(handle).wait_routed(layer, chunk, ids)


@wait_routed.register_fake
def _(activations, ids, handle, layer, chunk):
    return None


@torch.library.custom_op("fx_offload::start_prefetch", mutates_args=("activations",))
def start_prefetch(activations: list[torch.Tensor], reads: list[torch.Tensor], handle: int,
                   layer: int, target: int, chunk: int = -1) -> None:
    """``layer`` is done with the bytes ``target``'s ``chunk`` overwrites: begin copying it
    into the slot."""
    registry.state_for_op(handle).start(layer, target, chunk)


@start_prefetch.register_fake
def _(activations, reads, handle, layer, target, chunk=-1):
    return None


@torch.library.custom_op("fx_offload::join_prefetch", mutates_args=("activations",))
def join_prefetch(activations: list[torch.Tensor], reads: list[torch.Tensor],
                  handle: int) -> None:
    """End of the forward: inside a CUDA-graph capture, join the copy stream back."""
    registry.state_for_op(handle).join()


@join_prefetch.register_fake
def _(activations, reads, handle):
    return None


WAIT = torch.ops.fx_offload.wait_prefetch.default
WAIT_ROUTED = torch.ops.fx_offload.wait_routed.default
START = torch.ops.fx_offload.start_prefetch.default
JOIN = torch.ops.fx_offload.join_prefetch.default
dtensor.register_op_handlers((WAIT, WAIT_ROUTED, START, JOIN))    # tensor-parallel activations
NAMES = {WAIT: "wait_prefetch", WAIT_ROUTED: "wait_routed", START: "start_prefetch",
         JOIN: "join_prefetch"}
_KIND = {WAIT: "wait", WAIT_ROUTED: "wait", START: "start", JOIN: "join"}
_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_OF_TARGET = {**{op: op for op in _KIND}, **{op.overloadpacket: op for op in _KIND}}


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One call of our ops in a graph, its arguments by name."""

    op: torch._ops.OpOverload
    kind: str                           # "wait", "start" or "join"
    handle: int
    layer: int | None = None            # wait, start
    refill: int | None = None           # start: the layer copied into the slot
    chunk: int = -1                     # wait: the layer's chunk; start: the refill's
    acts: object = ()                   # nodes declared mutated (direct calls only)
    reads: object = ()                  # nodes only read
    ids: object = None                  # wait_routed: the router's top-k ids

    @property
    def name(self) -> str:
        return NAMES[self.op]

    @staticmethod
    def of(node: fx.Node) -> "OpCall | None":
        """The call ``node`` makes of one of our ops, or None."""
        if node.op != "call_function":
            return None
        op = _OF_TARGET.get(node.target) if isinstance(node.target, _OP_TYPES) else None
        if op is not None:
            names = [a.name for a in op._schema.arguments]
            args = dict(zip(names, node.args))
            args.update(node.kwargs)
        elif node.args and isinstance(node.args[0], _OP_TYPES) and node.args[0] in _OF_TARGET:
            op, args = _OF_TARGET[node.args[0]], dict(node.kwargs)   # auto_functionalized
        else:
            return None
        return OpCall(op, _KIND[op], args.get("handle"), args.get("layer"),
                      args.get("target"), args.get("chunk", -1), args.get("activations", ()),
                      args.get("reads", ()), args.get("ids"))

    @staticmethod
    def is_ours(node: fx.Node) -> bool:
        return (node.op == "call_function" and isinstance(node.target, _OP_TYPES)
                and node.target in _OF_TARGET)
