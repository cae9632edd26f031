"""Training a frozen offloaded base: the backward streams the frozen weights a second time.

By the time backward runs, the forward's refills have put other layers into the slots
whose weights AOTAutograd saved for it (as the forward's graph inputs, or views of them),
and the call that pointed the parameters at their slots has ended.  So the backward graph
gets ops of its own: the same ``wait_prefetch`` / ``start_prefetch`` the forward has, in
the order backward reads the layers (reverse), into the same slots, chunk by chunk, and a
pair that makes backward a call of the model::

    forward graph (as for inference)      backward graph (this module adds the ops)
    wait(L0) ... L0 ... start(L0 -> L2)   d = empty(0)           the chain our ops mutate
    wait(L1) ... L1 ... start(L1 -> L3)   backward_enter([d])    params -> slots
    wait(L2) ... L2 ... start(L2 -> L0)   start([d], L3 -> L3)   each slot's first layer:
    wait(L3) ... L3 ... start(L3 -> L1)   start([d], L2 -> L2)   whatever it does not hold
                                          ... the head's backward ...
                                          wait([d, g], L3 c2) ... reads of c2 ...
                                          start([d], L3 -> L1 c2)
                                          wait([d, g'], L3 c1) ... reads of c1 ...
                                          start([d], L3 -> L1 c1)  ... c0 likewise
                                          wait([d, g], L2 c2) ... (L2 -> L0, the same way)
                                          wait([d, g], L1 c2) ... reads ...
                                          wait([d, g], L0 c2) ... reads ...
                                          backward_leave([d], grads)    params -> host

(two slots, three chunks a layer; ``g``: the values the chunk's first reads take besides
its weights, live at the wait.)  Backward reads a layer's chunks in about the reverse of
the forward's order (the MLP's first), so each chunk of the slot's next layer is begun once
the bytes it overwrites were last read, and waited for before its own first read: the link
works through the leaving layer's backward instead of waiting for its end.  A chunk whose
reads are not all computed from what its first read takes (k's gradient comes out of the
attention backward beside q's; a checkpointed layer's recomputation starts from its saved
input) is tied to the values before its wait that those reads are computed from.  Each
slot's first layer in backward is begun at the top of the graph, and copies only where the
slot does not hold it already (what the forward left there depends on where its circular
prefetch ran).

Which backward inputs are offloaded weights: the forward compiler reads, from its graph's
placeholders (one per input Dynamo passed, in order), the offloaded weights and the views
of them; the partitioner names each backward input after the forward node it saves, so a
backward input of such a name is that weight (of layer L, chunk c), or a view of it.  A
storage held by one chunk's weights alone identifies them too; a graph traced inside a call
(a recompile for a new sequence length) sees the parameters in their slots, where layers
sharing a slot share storage and offsets, so there the names tell them apart.
Reads are followed through views (which read nothing until their consumer does).  Every
op mutates ``d`` (and a wait, its chunk's ``g``), so Inductor keeps them in program order
and orders every read of the chunk's weights after its wait; every start reads the outputs
of the reads of the bytes it overwrites.  The verifier
(``passes.verify``) then proves the backward's schedule from slots holding nothing known at
entry.

``backward_enter`` makes the backward a call of the model as the forward's hooks do
(``OffloadState.enter``: the turn, what the user changed taken up, the parameters pointed
at their slots, since the saved weights may be the parameter objects themselves);
``backward_leave`` ends it, or, where the backward raises before its last op,
:class:`EndsOnError` around the compiled backward.  A backward after
``fx_offload.restore`` is refused (views of freed slots may be among its saved tensors).
The compilers: ``aot_eager``'s own (our ops called in place, then run as they are),
Inductor's ``compile_fx_inner`` behind ``compile_fx``'s ``inner_compile``.  What trains
and what is refused, and why: docs/training.md, "How the backward gets the weights" and
"What works and what is refused".
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import registry
from .errors import GradModeError, OffloadError, ScheduleError
from .graph_inputs import compiled_frame
from .ops import START, WAIT
from .passes.verify import SlotModel, verify_graph
from .runtime.copies.slot_copies import IN_TRAINING_FORWARD
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
    # (a restored model's handle finds a stand-in with no phase: the forward ran after
    # restore, or EndsOnError would have refused, and saved the parameters' own weights)
    if getattr(state, "phase", Phase.RESTORED) is Phase.RESTORED:
        return
    try:
        state.enter(root=False)
        state.copies.backward = True
    except ShapeChanged as changed:
        raise OffloadError(
            f"backward: offloaded parameter {changed} changed shape or dtype since the "
            "forward; the forward saved it as it was. Run backward before changing the "
            "model's weights") from None


def _backward_leave(activations, reads, handle):
    state = registry.state_for_handle(handle)
    if getattr(state, "phase", Phase.RESTORED) is not Phase.RESTORED:
        state.copies.backward = False
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
            f"{compiled_frame(gi)} on its own (a graph break in or between the "
            "layers, or in the model's forward around them: TORCH_LOGS=graph_breaks shows "
            "where; a Hugging Face model training with gradient checkpointing breaks at its "
            "embeddings' require-grad hook: call model.disable_input_require_grads(), and "
            "torch._dynamo.reset() if the model was called before), where "
            "no backward prefetch can be placed. Remove the graph break, or call the model "
            "under torch.no_grad(). A break in the model's first call only (a Hugging Face "
            "MoE with output_router_logits=True: transformers' output capturing takes a "
            "lock there) is gone from the second: call torch._dynamo.reset() and the model "
            "again, or call the model once before compiling it")
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
        f"offloaded parameters require grad ({names[:3]}...). Offloaded with grad enabled, "
        "only frozen weights are offloaded and those that require grad stay on the device: "
        "to train these, call fx_offload.restore(model), then the compiled model again "
        "(grad enabled, model.train()); not to train them, freeze them "
        "(requires_grad_(False)) before the first compile. For inference, call the model "
        "under torch.no_grad() or torch.inference_mode()")


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
        self.names: dict[str, tuple[int, int]] = {}     # forward node -> (layer, chunk)
        self.storages: dict = {}            # fake storage -> (layer, chunk), where one only
        self.saved = 0                      # forward outputs that are (views of) them

    def set_plan(self, plan) -> None:
        """The forward's plan names which placeholders are weights of which chunk."""
        index = {n: i for i, n in enumerate(self.gi.placeholders)}
        self.weight_chunks = {index[w]: at for w, at in plan.weight_chunks().items()}

    def forward(self, fw: fx.GraphModule) -> None:
        """The forward graph AOTAutograd made: its placeholders are Dynamo's inputs.

        A saved weight is found in the backward by name: the partitioner names each
        backward input after the forward node it saves (the weight's placeholder, or a view
        of it).  By storage too, where a storage holds one chunk's weights only: a graph
        traced inside a call (a recompile for an input that does not require grad) sees
        the parameters in their slots, where layers sharing a slot share storage and
        offsets, so the storage cannot tell them apart."""
        inputs = [n for n in fw.graph.nodes if n.op == "placeholder"]
        if len(inputs) != len(self.gi.placeholders):
            raise OffloadError(
                f"training: the forward graph has {len(inputs)} inputs where Dynamo passed "
                f"{len(self.gi.placeholders)}, so its offloaded weights cannot be told apart; "
                "call the model under torch.no_grad(), or keep the layers resident")
        self.names, held = {}, {}
        for i, at in self.weight_chunks.items():
            todo = [inputs[i]]
            while todo:
                node = todo.pop()
                self.names[node.name] = at
                todo.extend(u for u in node.users if _is_view(u) or (
                    u.target is operator.getitem and _is_view(node)))
            val = inputs[i].meta.get("val")
            if isinstance(val, torch.Tensor):
                held.setdefault(StorageWeakRef(val.untyped_storage()), set()).add(at)
        self.storages = {ref: next(iter(ats)) for ref, ats in held.items() if len(ats) == 1}
        # what the forward saves of them (its outputs): the backward must find as many
        output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
        self.saved = len(self._matched(output.all_input_nodes))

    def _matched(self, nodes) -> dict[fx.Node, tuple[int, int]]:
        found = _holding(nodes, self.storages)
        found.update((n, self.names[n.name]) for n in dict.fromkeys(nodes)
                     if n.name in self.names)
        return found

    def weights_of(self, bw: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
        """Backward input -> (layer, chunk) of the offloaded weight whose bytes it holds."""
        found = self._matched([n for n in bw.graph.nodes if n.op == "placeholder"])
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
        reads = _reads_by_chunk(bw, weights)
        schedule = self.choice.schedule
        chunks = {layer: self.learned.layout[layer] for layer in reads}
        place_backward_ops(bw, reads, set(weights), schedule.slot_of, chunks, self.handle)
        verify_graph(bw, weights, SlotModel(dict(schedule.slot_of), chunks,
                                            [None] * schedule.num_slots, None))
        log.debug("fx_offload: backward streams layers %s", list(reads))

    # ---- the compilers -----------------------------------------------------------------
    def aot_eager(self, gm, example_inputs, fw_nop):
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._dynamo.backends.registry import lookup_backend

        def fw(g, inputs):
            self.forward(g)
            return TrainingForward(fw_nop(g, inputs))

        def bw(g, inputs):
            self.backward(g)
            return EndsOnError(boxed_nop(g, inputs), self.handle)
        with _no_autograd_cache():
            return lookup_backend("aot_eager")(gm, example_inputs, fw_compiler=fw,
                                               bw_compiler=bw)

    def inductor(self, gm, example_inputs, patches):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g, inputs, **kwargs):
            if kwargs.get("is_backward"):
                self.backward(g)
                return EndsOnError(compile_fx_inner(g, inputs, **kwargs), self.handle)
            self.forward(g)
            return TrainingForward(compile_fx_inner(g, inputs, **kwargs))
        with _no_autograd_cache():
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)


class EndsOnError:
    """A compiled backward that ends the call its ``backward_enter`` began where it raises
    (its ``backward_leave``, the graph's last op, does not run then): the parameters point
    at their true weights again, and another thread may call, as after a forward that
    raised.  After ``fx_offload.restore`` it refuses a backward that reads slots restore
    freed (its forward ran before); one whose forward ran after reads the parameters' own
    weights, and its ops do nothing.  Called boxed, as the compiled graph it wraps; any
    other attribute is that graph's."""

    def __init__(self, compiled, handle: int):
        self.compiled, self.handle = compiled, handle
        self._boxed_call = True     # (on the instance: Dynamo's wrapper copies its __dict__)

    def __call__(self, args):
        if registry.reads_freed_slots(self.handle, args):
            raise OffloadError(RESTORED)    # its forward ran before restore
        try:
            return self.compiled(args)
        except BaseException:
            _backward_leave(None, None, self.handle)
            raise

    def __getattr__(self, name):
        return getattr(self.compiled, name)


class TrainingForward:
    """A compiled forward that a backward will follow: while it runs, its circular prefetch
    (the start after a slot's last layer, of the next call's first) is not begun.  The
    backward reads the layers in reverse, so it needs first what that copy would evict, and
    it ends with the next forward's first layers in their slots: the copy would be made
    twice over for nothing (two layers a step with one slot, where the caller lets the
    copies run on between calls).  A forward that no backward follows leaves it to the next
    call's entry refill.  Called boxed, as the compiled graph it wraps."""

    def __init__(self, compiled):
        self.compiled = compiled
        self._boxed_call = True     # (on the instance: Dynamo's wrapper copies its __dict__)

    def __call__(self, args):
        was, IN_TRAINING_FORWARD.on = IN_TRAINING_FORWARD.on, True
        try:
            return self.compiled(args)
        finally:
            IN_TRAINING_FORWARD.on = was

    def __getattr__(self, name):
        return getattr(self.compiled, name)


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


def _reads_by_chunk(bw: fx.GraphModule, weights) -> dict[int, dict[int, list[fx.Node]]]:
    """Layer -> chunk -> the nodes reading that chunk's weights, through views, in program
    order; layers in the order backward first reads them, each layer's chunks too."""
    found: dict[tuple[int, int], set[fx.Node]] = {}
    for w, at in weights.items():
        todo = list(w.users)
        while todo:
            user = todo.pop()
            found.setdefault(at, set()).add(user)
            if _is_view(user):
                todo.extend(user.users)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    by_chunk = sorted(((at, sorted(users, key=order.__getitem__)) for at, users in found.items()),
                      key=lambda item: order[item[1][0]])
    reads: dict[int, dict[int, list[fx.Node]]] = {}
    for (layer, chunk), nodes in by_chunk:
        reads.setdefault(layer, {})[chunk] = nodes
    return reads


def place_backward_ops(bw: fx.GraphModule, reads: dict[int, dict[int, list[fx.Node]]],
                       weights: set, slot_of: dict[int, int], layout: dict[int, list],
                       handle: int) -> None:
    """The ops of the module docstring around ``reads`` (:func:`_reads_by_chunk`; layers in
    the order backward reads them; ``weights``: the inputs that are offloaded weights;
    ``layout``: each layer's chunks).

    Backward reads a layer's chunks in about the reverse of the forward's order (the MLP's
    before the attention's), so the slot is refilled chunk by chunk: each chunk of the next
    layer is begun once the leaving layer's last read of the bytes it overwrites is done,
    and waited for before its own first read.  A whole-layer refill would leave the link
    idle for the leaving layer's whole backward (with one slot: every layer's)."""
    graph = bw.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    flat = {layer: sorted({n for ns in chunks.values() for n in ns}, key=order.__getitem__)
            for layer, chunks in reads.items()}
    weights = weights | {n for ns in flat.values() for n in ns if _is_view(n)}
    device = _device_of(next(iter(flat.values()))[0])
    layers = list(reads)
    # At the top: the forward has read the slots already.  Each slot's first layer is begun
    # (a copy only where the forward left the slot holding another layer) before the
    # backward of the head, so the copy overlaps it.
    top = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(top):
        chain = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                    {"device": device})
        chain.meta["val"] = torch.empty(0, device="meta")
        _call(graph, ENTER, ([chain], handle))
        seen_slots: set[int] = set()
        for layer in layers:
            if slot_of[layer] not in seen_slots:
                seen_slots.add(slot_of[layer])
                _call(graph, START, ([chain], [], handle, layer, layer, -1))
    for i, layer in enumerate(layers):
        _place_waits(graph, chain, layer, reads[layer], weights, handle)
        refill = next((other for other in layers[i + 1:]
                       if slot_of[other] == slot_of[layer]), None)
        if refill is not None:
            _place_starts(graph, chain, layer, refill, reads[layer], flat[layer],
                          layout, handle)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads = [a for a in output.all_input_nodes if _is_tensor(a)]
    with graph.inserting_before(output):
        _call(graph, LEAVE, ([chain], grads, handle))
    graph.lint()
    bw.recompile()


def _place_waits(graph, chain, layer, chunks, weights, handle) -> None:
    """A wait for each of ``layer``'s chunks before its first read, tied to the values its
    reads are computed from (:func:`_ties`), which it declares mutated: every compiler then
    orders the reads after it.  A read computed from weights alone can be tied to
    nothing: refused."""
    order = {n: k for k, n in enumerate(graph.nodes)}
    for chunk, reading in chunks.items():
        at = min(reading, key=order.__getitem__)
        acts = _ties(graph, reading, at, weights, order)
        loose = _loose(graph, reading, acts, at)
        # a read of weights alone (Gemma's norm recomputes 1 + weight in backward): the
        # wait is tied to those weights themselves, which it then declares mutated
        acts += list(dict.fromkeys(_base(a) for n in loose for a in n.all_input_nodes
                                   if a in weights))
        loose = _loose(graph, reading, acts, at)
        if loose:
            raise ScheduleError(
                f"backward: {loose[0].format_node()} reads a weight of layer {layer} but "
                "takes nothing the layer's backward wait can be tied to, so a compiler could "
                "run it before the wait; call the model under torch.no_grad(), or keep the "
                "layer resident")
        with graph.inserting_before(at):
            _call(graph, WAIT, ([chain, *acts], handle, layer, chunk))


def _base(node: fx.Node) -> fx.Node:
    """The graph input a chain of views starts from."""
    while _is_view(node):
        node = node.args[0]
    return node


def _ties(graph, reading, at, weights, order) -> list[fx.Node]:
    """The values a wait placed before ``at`` (the first of the reads ``reading``) is tied
    to: the reads' inputs computed before it, and, for a read none of whose inputs come
    from those, the values before the wait that its inputs are computed from (k's
    gradient, which comes out of the attention backward beside q's; a checkpointed
    layer's recomputation from its saved input)."""
    def before(nodes):
        return [a for a in nodes if a not in weights and order[a] < order[at] and _is_tensor(a)]
    acts = list(dict.fromkeys(before(a for n in reading for a in n.all_input_nodes)))
    for read in _loose(graph, reading, acts, at):
        todo, seen = list(read.all_input_nodes), set()
        while todo:
            node = todo.pop()
            if node in seen or node in weights:
                continue
            seen.add(node)
            if order[node] < order[at]:
                if _is_tensor(node):
                    acts.append(node)
                continue
            todo.extend(node.all_input_nodes)
    return list(dict.fromkeys(acts))


def _place_starts(graph, chain, layer, refill, chunks, nodes, layout, handle) -> None:
    """A start for each of ``refill``'s chunks after ``layer``'s last read of the bytes it
    overwrites (after the layer's last read where backward reads none of them), reading
    those reads' outputs so that every compiler orders it after them.  Begun in the order
    the bytes come free; chunks freed together in the order ``layer`` first read them,
    which is the order the refill's backward will want them."""
    order = {n: k for k, n in enumerate(graph.nodes)}
    rank = {chunk: k for k, chunk in enumerate(chunks)}
    starts = []
    for target in layout[refill]:
        overwritten = [n for c in layout[layer] if c.overlaps(target)
                       for n in chunks.get(c.index, ())] or nodes
        after = max(overwritten, key=order.__getitem__)
        firsts = [rank[c.index] for c in layout[layer] if c.overlaps(target) and c.index in rank]
        starts.append((order[after], min(firsts, default=len(rank)), after, target.index,
                       [n for n in overwritten if not _is_view(n) and _is_tensor(n)]))
    last_after = at = None
    for _, _, after, chunk, outs in sorted(starts, key=lambda s: s[:2]):
        if after is not last_after:     # (several after one read: one after the other)
            last_after = at = after
        with graph.inserting_after(at):
            at = _call(graph, START, ([chain], outs, handle, layer, refill, chunk))


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


def _loose(graph: fx.Graph, nodes: list[fx.Node], acts, first) -> list[fx.Node]:
    """Those of the reads ``nodes`` (``first``, the first, which the wait goes before) that
    compute (not a view) from nothing the wait is tied to (``acts``), directly or through
    what is computed from them after the wait: a compiler, which orders by data, could run
    them before the wait."""
    tied = _downstream(graph, acts, first)
    return [n for n in nodes if not _is_view(n) and n not in tied]
