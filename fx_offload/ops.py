"""The custom ops the pass inserts, in the ``fx_offload`` namespace, and the one reader of
their arguments.

Each op names the offload state by an integer handle and declares that it mutates the
activations it is tied to.  It never changes their values: the declared mutation is what
orders the op in every compiler.  AOTAutograd keeps a mutating op alive (an op that returns
nothing and mutates nothing is dead code), and every later reader of a mutated activation is
ordered after it, so Inductor cannot hoist a layer's compute above its wait or sink it below
its start.  Parameters are never declared mutated: that would make them mutated graph inputs
(CUDA graphs refused) and would hide from the compiler that slots alias across layers.
The ops::

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
    y = host_experts(x, ids, gates, h, layer, chunks)
                                           a routed MoE layer's experts (their expert
                                           tensors: ``chunks``), computed where the runtime
                                           chooses per call: on the host from the weights'
                                           host block, or on the device after a routed wait
                                           (:mod:`fx_offload.passes.host_regions`)
    y = host_mlp(x, h, layer, chunks)      a dense MLP (its three weights: ``chunks``), the
                                           same way: on the host, or on the device after its
                                           chunks' wait.  These two are the only ops that
                                           return a value and declare no mutation

Other modules read these ops' arguments only through :meth:`OpCall.of`, which understands
both a direct call (positional arguments, a Dynamo graph) and the ``auto_functionalized``
form AOTAutograd turns it into (keyword arguments, an ATen graph).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from . import dtensor, registry
from .runtime.memory import slot_check


# Defined with torch.library's low-level API, a Python kernel for every backend: a call goes
# from the dispatcher straight to it.  (``torch.library.custom_op`` wraps each call in three
# Python layers, autograd, version-counter bumps and argument defaults: 18 us a call against
# 2.5 us on a CPU, and a decode step calls these ops some 40 to 500 times.  Nothing needs the
# bumps: the declared mutation is for the compilers, which read it from the schema, and in
# training the ops run inside AOTAutograd's compiled graphs, which autograd does not track.)
_LIB = torch.library.Library("fx_offload", "DEF")
_SCHEMAS = {
    "wait_prefetch": "(Tensor(a0!)[] activations, SymInt handle, SymInt layer, "
                     "SymInt chunk=-1) -> ()",
    "wait_routed": "(Tensor(a0!)[] activations, Tensor ids, SymInt handle, SymInt layer, "
                   "SymInt chunk) -> ()",
    "start_prefetch": "(Tensor(a0!)[] activations, Tensor[] reads, SymInt handle, "
                      "SymInt layer, SymInt target, SymInt chunk=-1) -> ()",
    "join_prefetch": "(Tensor(a0!)[] activations, Tensor[] reads, SymInt handle) -> ()",
    "host_experts": "(Tensor x, Tensor ids, Tensor gates, SymInt handle, SymInt layer, "
                    "SymInt[] chunks) -> Tensor",
    "host_mlp": "(Tensor x, SymInt handle, SymInt layer, SymInt[] chunks) -> Tensor",
}


def _define(kernel, fake=lambda *args, **kwargs: None):
    """Define ``kernel``'s op (its name, its schema above): the kernel runs on every
    backend; under fake tensors ``fake`` runs (by default the op does nothing)."""
    name = kernel.__name__
    _LIB.define(name + _SCHEMAS[name])
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fx_offload::{name}", fake, lib=_LIB)
    return kernel


@_define
def wait_prefetch(activations, handle, layer, chunk=-1):
    """Block the compute stream until ``layer``'s ``chunk`` is in its slot."""
    state = registry.state_for_op(handle)
    state.wait(layer, chunk)
    if getattr(state, "check_slots", False):    # FX_OFFLOAD_CHECK_SLOTS=1: a debugging aid
        slot_check.after_wait(state, layer, chunk)


@_define
def wait_routed(activations, ids, handle, layer, chunk):
    """Before ``layer`` reads the rows of its expert tensors in ``chunk`` that ``ids`` (its
    router's top-k) picked: make sure the slot holds those rows."""
    state = registry.state_for_op(handle)
    state.wait_routed(layer, chunk, ids)
    if getattr(state, "check_slots", False):
        slot_check.after_wait(state, layer, chunk, ids)


@_define
def start_prefetch(activations, reads, handle, layer, target, chunk=-1):
    """``layer`` is done with the bytes ``target``'s ``chunk`` overwrites: begin copying it
    into the slot."""
    registry.state_for_op(handle).start(layer, target, chunk)


@_define
def join_prefetch(activations, reads, handle):
    """End of the forward: inside a CUDA-graph capture, join the copy stream back (and in
    an eager call of a model compiled for CUDA graphs: ``OffloadState.join``)."""
    registry.state_for_op(handle).join()


def host_experts(x, ids, gates, handle, layer, chunks):
    """``layer``'s routed experts on ``x`` (its tokens' rows), ``ids`` and ``gates`` (its
    router's picks and their weights): a new tensor shaped and typed like ``x``."""
    return registry.state_for_host_op(handle).host_experts.run(layer, chunks, x, ids, gates)


_define(host_experts, fake=lambda x, ids, gates, handle, layer, chunks: torch.empty_like(x))


def host_mlp(x, handle, layer, chunks):
    """``layer``'s dense MLP on ``x``: a new tensor shaped and typed like ``x``."""
    return registry.state_for_host_op(handle).host_experts.run_mlp(layer, chunks, x)


_define(host_mlp, fake=lambda x, handle, layer, chunks: torch.empty_like(x))
WAIT = torch.ops.fx_offload.wait_prefetch.default
WAIT_ROUTED = torch.ops.fx_offload.wait_routed.default
START = torch.ops.fx_offload.start_prefetch.default
JOIN = torch.ops.fx_offload.join_prefetch.default
HOST_EXPERTS = torch.ops.fx_offload.host_experts.default
HOST_MLP = torch.ops.fx_offload.host_mlp.default
dtensor.register_op_handlers((WAIT, WAIT_ROUTED, START, JOIN))    # tensor-parallel activations
NAMES = {WAIT: "wait_prefetch", WAIT_ROUTED: "wait_routed", START: "start_prefetch",
         JOIN: "join_prefetch", HOST_EXPERTS: "host_experts", HOST_MLP: "host_mlp"}
_KIND = {WAIT: "wait", WAIT_ROUTED: "wait", START: "start", JOIN: "join",
         HOST_EXPERTS: "host", HOST_MLP: "host"}
_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_OF_TARGET = {**{op: op for op in _KIND}, **{op.overloadpacket: op for op in _KIND}}


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One call of our ops in a graph, its arguments by name."""

    op: torch._ops.OpOverload
    kind: str                           # "wait", "start", "join" or "host"
    handle: int
    layer: int | None = None            # wait, start
    refill: int | None = None           # start: the layer copied into the slot
    chunk: int = -1                     # wait: the layer's chunk; start: the refill's
    acts: object = ()                   # nodes declared mutated (direct calls only)
    reads: object = ()                  # nodes only read
    ids: object = None                  # wait_routed, host_experts: the router's top-k ids
    chunks: tuple = ()                  # host_experts, host_mlp: the chunks it computes from

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
                      args.get("reads", ()), args.get("ids"), tuple(args.get("chunks", ())))

    @staticmethod
    def is_ours(node: fx.Node) -> bool:
        return (node.op == "call_function" and isinstance(node.target, _OP_TYPES)
                and node.target in _OF_TARGET)
