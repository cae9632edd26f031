"""Training a frozen offloaded base: the backward streams the frozen weights a second time.

By the time backward runs, the forward's refills have put other layers into the slots
whose weights AOTAutograd saved for it (as the forward's graph inputs, or views of them),
and the call that pointed the parameters at their slots has ended.  So the backward graph
gets ops of its own: the same ``wait_prefetch`` / ``start_prefetch`` the forward has, in
the order backward reads the layers (reverse), into the same slots, and a pair that makes
backward a call of the model::

    forward graph (as for inference)      backward graph (this module adds the ops)
    wait(L0) ... L0 ... start(L0 -> L2)   d = empty(0)           the chain our ops mutate
    wait(L1) ... L1 ... start(L1 -> L3)   backward_enter([d])    params -> slots
    wait(L2) ... L2 ... start(L2 -> L0)   start([d], L3 -> L3)   whatever the slot holds
    wait(L3) ... L3 ... start(L3 -> L1)   wait([d, g3], L3) ... reads ... start(L3 -> L1)
                                          start([d], L2 -> L2)
                                          wait([d, g2], L2) ... reads ... start(L2 -> L0)
                                          wait([d, g1], L1) ... reads
                                          wait([d, g0], L0) ... reads
                                          backward_leave([d], grads)    params -> host

(two slots; ``g``: the values the layer's first reads take besides its weights, live at the
wait.)  Each slot's first wait in backward is preceded by a start of that layer itself,
which copies only where the slot does not hold it already (what the forward left there
depends on where its circular prefetch ran).

Which backward inputs are offloaded weights: the forward compiler reads, from its graph's
placeholders (one per input Dynamo passed, in order), the fake tensors of the offloaded
weights; a backward input is a weight of layer L if its fake tensor shares that storage (the
weight itself, or a view the partitioner chose to save).  Reads are followed through views
(which read nothing until their consumer does).  Every op mutates ``d`` (and a wait, its
layer's ``g``), so Inductor keeps them in program order and orders every read of the layer's
weights after its wait; every start reads the outputs of its layer's reads.  The verifier
(``passes.verify``) then proves the backward's schedule from slots holding nothing known at
entry.

``backward_enter`` makes the backward a call of the model as the forward's hooks do
(``OffloadState.enter``: the turn, what the user changed taken up, the parameters pointed
at their slots, since the saved weights may be the parameter objects themselves);
``backward_leave`` ends it.  A backward after ``fx_offload.restore`` is refused (views of
freed slots may be among its saved tensors).  The compilers: ``aot_eager``'s own (our ops
called in place, then run as they are), Inductor's ``compile_fx_inner`` behind
``compile_fx``'s ``inner_compile``.  What trains and what is refused, and why:
docs/training.md, "How the backward gets the weights" and "What works and what is refused".
"""
from __future__ import annotations

import logging

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import registry
from .errors import GradModeError, OffloadError, ScheduleError
from .ops import START, WAIT
from .passes.verify import SlotModel, verify_graph
from .runtime.ownership.ownership import ShapeChanged
from .runtime.phase import Phase

log = logging.getLogger("fx_offload")

_LIB = torch.library.Library("fx_offload", "FRAGMENT")
_LIB.define("backward_enter(Tensor(a0!)[] activations, SymInt handle) -> ()")
_LIB.define("backward_leave(Tensor(a0!)[] activations, Tensor[] reads, SymInt handle) -> ()")

RESTORED = ("backward after fx_offload.restore(model): the forward saved offloaded weights "
            "for it from slots that restore freed. Run backward before restoring, or the "
            "forward again after it; the model's weights are unchanged")


def _backward_enter(activations, handle):
    # the state the graph was compiled for (no call of the model is active to find it by)
    state = registry.state_for_handle(handle)
    # (a restored model's handle finds a stand-in with no phase)
    if getattr(state, "phase", Phase.RESTORED) is Phase.RESTORED:
        raise OffloadError(RESTORED)
    try:
        state.enter(root=False)
    except ShapeChanged as changed:
        raise OffloadError(
            f"backward: offloaded parameter {changed} changed shape or dtype since the "
            "forward; the forward saved it as it was. Run backward before changing the "
            "model's weights") from None


def _backward_leave(activations, reads, handle):
    state = registry.state_for_handle(handle)
    if getattr(state, "phase", Phase.RESTORED) is not Phase.RESTORED:
        state.leave()


_LIB.impl("backward_enter", _backward_enter, "CompositeExplicitAutograd")
_LIB.impl("backward_leave", _backward_leave, "CompositeExplicitAutograd")
for _name in ("backward_enter", "backward_leave"):
    torch.library.register_fake(f"fx_offload::{_name}", lambda *args, **kwargs: None, lib=_LIB)
ENTER = torch.ops.fx_offload.backward_enter.default
LEAVE = torch.ops.fx_offload.backward_leave.default


def check_grad_mode(gi, choice, learned, handle: int, example_inputs, options,
                    layer_frame: bool):
    """With grad enabled: the :class:`BackwardOps` for this graph's compile, or None where
    no backward needs the offloaded weights.  Refused: an offloaded weight that requires
    grad (a slot cannot hold its gradient's update), a graph of one layer's own frame, and
    ``inner_backend="eager"`` (no backward graph to place ops in)."""
    layer_of = {p.name: layer for layer, ps in choice.params.items() for p in ps}
    offloaded = set(layer_of)
    _refuse_checkpointing(gi, layer_of)
    if not torch.is_grad_enabled():
        return None
    if layer_frame and any(isinstance(v, torch.Tensor) and v.requires_grad
                           for v in example_inputs):
        # (its parameters are named from the layer, not the model: checked here)
        raise GradModeError(
            "trains only a model whose layers run in its own graph: Dynamo compiled "
            f"{type(gi.root).__name__}.forward on its own (a graph break in or between the "
            "layers, or in the model's forward around them: TORCH_LOGS=graph_breaks shows "
            "where; a Hugging Face model training with gradient checkpointing breaks at its "
            "embeddings' require-grad hook: call model.disable_input_require_grads(), and "
            "torch._dynamo.reset() if the model was called before), where "
            "no backward prefetch can be placed. Remove the graph break, or call the model "
            "under torch.no_grad()")
    reads = [name for name, _ in gi.params.values() if name in offloaded]
    if not reads:
        return None
    trained = [name for name, p in gi.params.values() if name in offloaded and p.requires_grad]
    if trained:
        raise trained_offloaded_error("this graph was compiled", trained)
    if options.inner_backend == "eager":
        raise GradModeError(
            "trains only with inner_backend 'aot_eager' or 'inductor': with 'eager' there is "
            "no backward graph to stream the frozen weights into. Compile with another "
            "inner_backend, or call the model under torch.no_grad()")
    return BackwardOps(choice, learned, handle, gi)


def _refuse_checkpointing(gi, layer_of: dict[str, int]) -> None:
    """A checkpointed region (``torch.utils.checkpoint``: one ``tag_activation_checkpoint``
    node in Dynamo's graph, planned as a member of the layer its body was traced in) is
    waited for before and refilled after as a whole, forward and backward (where its
    recomputation and its gradients read the layer's weights together).  A region over
    several offloaded layers would need all of them in their slots at once: refused."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    for node in next(iter(gi.params)).graph.nodes:
        if node.op != "call_function" or node.target is not hop:
            continue
        read = sorted({layer_of[gi.params[a][0]] for a in node.all_input_nodes
                       if a in gi.params and gi.params[a][0] in layer_of})
        if len(read) > 1:
            raise OffloadError(
                f"one activation-checkpointed region reads the offloaded weights of layers "
                f"{read}; a region is waited for and refilled as a whole, so it may read one "
                "offloaded layer's weights at most. Checkpoint each layer on its own (as "
                "model.gradient_checkpointing_enable() does for a Hugging Face model), or turn "
                "checkpointing off for these layers")


def trained_offloaded_error(what: str, names: list[str]) -> GradModeError:
    """Grad enabled while offloaded parameters require grad (``what``: the compile or the
    call that met them)."""
    return GradModeError(
        f"trains only parameters that are not offloaded: {what} with grad enabled, and "
        f"offloaded parameters require grad ({names[:3]}...). Freeze them "
        "(requires_grad_(False)) before the first compile: only frozen weights are then "
        "offloaded and the trainable ones stay on the device (after a compile, call "
        "fx_offload.restore(model) first). For inference, call the model under "
        "torch.no_grad() or torch.inference_mode()")


def _is_view(node: fx.Node) -> bool:
    """An ATen op whose result aliases its first input (it reads nothing by itself)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and bool(schema.returns) and \
        schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write


class BackwardOps:
    """Places the backward's ops for one Dynamo graph: reads the forward graph's offloaded
    inputs (:meth:`forward`), edits and verifies the backward graph (:meth:`backward`)."""

    def __init__(self, choice, learned, handle: int, gi):
        # learned: the model's Learned, whose layout the forward's pass arranged
        self.choice, self.learned, self.handle = choice, learned, handle
        self.gi = gi
        self.weight_chunks: dict[int, tuple[int, int]] = {}  # input index -> (layer, chunk)
        self.storages: dict = {}            # fake storage -> (layer, chunk)
        self.saved = 0                      # forward outputs that are (views of) them

    def set_plan(self, plan) -> None:
        """The forward's plan names which placeholders are weights of which chunk."""
        index = {n: i for i, n in enumerate(self.gi.placeholders)}
        self.weight_chunks = {index[w]: at for w, at in plan.weight_chunks().items()}

    def forward(self, fw: fx.GraphModule) -> None:
        """The forward graph AOTAutograd made: its placeholders are Dynamo's inputs."""
        inputs = [n for n in fw.graph.nodes if n.op == "placeholder"]
        if len(inputs) != len(self.gi.placeholders):
            raise OffloadError(
                f"training: the forward graph has {len(inputs)} inputs where Dynamo passed "
                f"{len(self.gi.placeholders)}, so its offloaded weights cannot be told apart; "
                "call the model under torch.no_grad(), or keep the layers resident")
        self.storages = {}
        for i, at in self.weight_chunks.items():
            val = inputs[i].meta.get("val")
            if isinstance(val, torch.Tensor):
                self.storages[StorageWeakRef(val.untyped_storage())] = at
        # what the forward saves of them (its outputs): the backward must find as many
        output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
        self.saved = len(_holding(output.all_input_nodes, self.storages))

    def weights_of(self, bw: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
        """Backward input -> (layer, chunk) of the offloaded weight whose bytes it holds."""
        found = _holding([n for n in bw.graph.nodes if n.op == "placeholder"], self.storages)
        if len(found) < self.saved:     # a backward reading slots unwaited: never silently
            raise OffloadError(
                f"training: the forward saves {self.saved} offloaded weight(s) for backward, "
                f"but only {len(found)} of the backward graph's inputs could be matched to "
                "them, so the backward could read slots holding other layers. Call the model "
                "under torch.no_grad(), or keep the layers resident")
        return found

    def backward(self, bw: fx.GraphModule) -> None:
        """Insert the backward's ops into ``bw`` (an ATen graph) and verify them."""
        weights = self.weights_of(bw)
        if not weights:
            return
        reads = _reads_by_layer(bw, weights)
        schedule = self.choice.schedule
        place_backward_ops(bw, reads, set(weights), schedule.slot_of, self.handle)
        chunks = {layer: self.learned.layout[layer] for layer in reads}
        verify_graph(bw, weights, SlotModel(dict(schedule.slot_of), chunks,
                                            [None] * schedule.num_slots, None))
        log.debug("fx_offload: backward streams layers %s", list(reads))

    # ---- the compilers -----------------------------------------------------------------
    def aot_eager(self, gm, example_inputs, fw_nop):
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._dynamo.backends.registry import lookup_backend

        def fw(g, inputs):
            self.forward(g)
            return fw_nop(g, inputs)

        def bw(g, inputs):
            self.backward(g)
            return boxed_nop(g, inputs)
        with _no_autograd_cache():
            return lookup_backend("aot_eager")(gm, example_inputs, fw_compiler=fw,
                                               bw_compiler=bw)

    def inductor(self, gm, example_inputs, patches):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g, inputs, **kwargs):
            if kwargs.get("is_backward"):
                self.backward(g)
            else:
                self.forward(g)
            return compile_fx_inner(g, inputs, **kwargs)
        with _no_autograd_cache():
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)


def _no_autograd_cache():
    """A cached backward would skip the pass that reads the forward's weights.  (The
    backward is compiled at the first ``backward()``: compiled with the forward, torch 2.13
    refuses a second backward through a retained graph.)"""
    return torch._functorch.config.patch(enable_autograd_cache=False)


def _holding(nodes, storages: dict) -> dict[fx.Node, tuple[int, int]]:
    """Those of ``nodes`` whose value views one of ``storages`` -> what that storage holds."""
    found = {}
    for n in dict.fromkeys(nodes):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            at = storages.get(StorageWeakRef(val.untyped_storage()))
            if at is not None:
                found[n] = at
    return found


def _reads_by_layer(bw: fx.GraphModule, weights) -> dict[int, list[fx.Node]]:
    """Layer -> the nodes reading its weights, through views, in program order; layers in
    the order backward first reads them."""
    found: dict[int, set[fx.Node]] = {}
    for w, (layer, _) in weights.items():
        todo = list(w.users)
        while todo:
            user = todo.pop()
            found.setdefault(layer, set()).add(user)
            if _is_view(user):
                todo.extend(user.users)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    by_layer = {layer: sorted(users, key=order.__getitem__) for layer, users in found.items()}
    return dict(sorted(by_layer.items(), key=lambda item: order[item[1][0]]))


def place_backward_ops(bw: fx.GraphModule, reads: dict[int, list[fx.Node]], weights: set,
                       slot_of: dict[int, int], handle: int) -> None:
    """The ops of the module docstring around ``reads`` (layer -> its reading nodes, layers
    in the order backward reads them; ``weights``: the inputs that are offloaded weights)."""
    graph = bw.graph
    weights = weights | {n for ns in reads.values() for n in ns if _is_view(n)}
    first = next(iter(reads.values()))[0]
    device = _device_of(first)
    with graph.inserting_before(first):
        chain = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                    {"device": device})
        chain.meta["val"] = torch.empty(0, device="meta")
        _call(graph, ENTER, ([chain], handle))
    layers = list(reads)
    seen_slots: set[int] = set()
    for i, layer in enumerate(layers):
        nodes = reads[layer]
        order = {n: k for k, n in enumerate(graph.nodes)}
        at = nodes[0]
        acts = [a for n in nodes for a in n.all_input_nodes
                if a not in weights and order[a] < order[at] and _is_tensor(a)]
        acts = list(dict.fromkeys(acts))
        with graph.inserting_before(at):
            if slot_of[layer] not in seen_slots:    # the slot's first layer in backward
                seen_slots.add(slot_of[layer])
                _call(graph, START, ([chain], [], handle, layer, layer, -1))
            _call(graph, WAIT, ([chain, *acts], handle, layer, -1))
        _check_tied(graph, layer, nodes, acts, at)
        refill = next((other for other in layers[i + 1:]
                       if slot_of[other] == slot_of[layer]), None)
        if refill is not None:
            outs = [n for n in nodes if not _is_view(n) and _is_tensor(n)]
            with graph.inserting_after(nodes[-1]):
                _call(graph, START, ([chain], outs, handle, layer, refill, -1))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads = [a for a in output.all_input_nodes if _is_tensor(a)]
    with graph.inserting_before(output):
        _call(graph, LEAVE, ([chain], grads, handle))
    graph.lint()
    bw.recompile()


def _call(graph: fx.Graph, op, args) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = None
    return node


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _device_of(node: fx.Node) -> torch.device:
    for n in (node, *node.all_input_nodes):
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _downstream(graph: fx.Graph, acts, at) -> set:
    """``acts`` and the nodes from ``at`` on computed from them."""
    tied, after = set(acts), False
    for n in graph.nodes:
        after = after or n is at
        if after and any(a in tied for a in n.all_input_nodes):
            tied.add(n)
    return tied


def _check_tied(graph: fx.Graph, layer: int, nodes: list[fx.Node], acts, first) -> None:
    """(``first``: the layer's first read, which the wait went before: itself checked.)
    Every read of ``layer``'s weights that computes (not a view) takes, directly or
    through what it is computed from after the wait, a value the wait is tied to: so
    Inductor, which orders by data, orders it after the wait too."""
    tied = _downstream(graph, acts, first)
    loose = [n for n in nodes if not _is_view(n) and n not in tied]
    if loose:
        raise ScheduleError(
            f"backward: {loose[0].format_node()} reads a weight of layer {layer} but takes "
            "nothing the layer's backward wait is tied to, so a compiler could run it before "
            "the wait; call the model under torch.no_grad(), or keep the layer resident")
