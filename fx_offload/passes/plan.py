"""Step 1 of the pass: decide, for one Dynamo graph, where each offloaded layer's ops go.

Nothing here edits the graph; :mod:`~fx_offload.passes.rewrite` applies the plan.  A layer
moves chunk by chunk (:mod:`fx_offload.layout`); for every offloaded layer present in the
graph the plan holds:

* one :class:`ChunkWait` per chunk the graph reads, immediately before the chunk's first
  read (``first_use``), tied to the values live there that the reads are computed from
  (``acts``), or, where they depend on graph inputs alone (never declared mutated), to a
  clone of one (``clone_inputs``).  A chunk whose reads depend on weights alone shares
  the wait before it;
* where the slot is refilled, one :class:`ChunkStart` per chunk of the refill, immediately
  after the last read of this layer's chunks whose bytes it overwrites (``after``), or
  after the layer's last node where it overwrites nothing this graph reads;
* in the graph that runs the call's first offloaded layer, the :class:`EntryStarts`: the
  refills a call begins with, at the top of the graph, tied to an anchor to which the first
  wait of each layer they refill is tied too.

Layer membership comes from ``nn_module_stack``; weights of an offloaded layer read outside
it, or a layer output that aliases an offloaded weight, are refused with an error naming the
node.  Why each op is tied to what it is tied to, and where the entry refills go:
docs/design.md, "The inserted op pattern" (with "Why each op depends on what it does") and
"Slot rotation".
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx

from .. import dtensor
from ..errors import PlanError
from ..graph_inputs import GraphInputs, describe_node, layers_of_nodes, storage_of, value_of
from ..layout import chunk_of_suffix
from ..ops import OpCall
from ..selection.choice import Choice
from .routing import route

log = logging.getLogger("fx_offload")


@dataclasses.dataclass
class ChunkWait:
    chunks: list[int]                   # of the layer; more than one where reads share a wait
    first_use: fx.Node                  # the wait goes immediately before it
    acts: list[fx.Node]
    clone_inputs: list[fx.Node]


@dataclasses.dataclass
class ChunkStart:
    chunk: int                          # of the refill
    after: fx.Node                      # the start goes immediately after it
    acts: list[fx.Node]
    reads: list[fx.Node]
    behind: ChunkWait | None = None     # placed right after this routed wait instead, tied
    #                                     to its values, still reading acts and reads


@dataclasses.dataclass
class EntryStarts:
    starts: list[tuple[int, int]]       # (leaving layer, refill): one op copies every chunk
    source: fx.Node | None              # the graph input the anchor is shaped like; None: placed
    #                                     before the first wait of l_0, with its values
    tied: list[ChunkWait]               # the first wait of each refilled layer in this graph


@dataclasses.dataclass
class LayerPlan:
    layer: int
    slot: int
    refill: int | None                  # layer copied into this slot after this one
    weights: dict[fx.Node, int]         # placeholders of the offloaded weights -> chunk
    first_use: fx.Node
    last_node: fx.Node
    waits: list[ChunkWait]              # in graph order
    starts: list[ChunkStart]            # in chunk order
    members: list[fx.Node]              # the layer's nodes, in graph order
    routed: dict[int, fx.Node] = dataclasses.field(default_factory=dict)
    #                                     chunk of expert tensors -> its router's ids (routing)


@dataclasses.dataclass
class GraphPlan:
    handle: int
    layers: list[LayerPlan]
    join_acts: list[fx.Node]
    join_reads: list[fx.Node]
    entry: EntryStarts | None = None
    hosts: bool = False                 # holds host_experts / host_mlp ops (host_regions)

    @property
    def has_starts(self) -> bool:
        return self.entry is not None or any(lp.refill is not None for lp in self.layers)

    def refills(self) -> int:
        """Layers this graph starts copying in (at the call's entry or after a layer)."""
        entry = set() if self.entry is None else {r for _, r in self.entry.starts}
        return len(entry) + sum(lp.refill is not None for lp in self.layers)

    def weight_chunks(self) -> dict[fx.Node, tuple[int, int]]:
        """Offloaded weight placeholder -> (its layer, its chunk)."""
        return {w: (lp.layer, chunk) for lp in self.layers for w, chunk in lp.weights.items()}


def plan_graph(gm: fx.GraphModule, gi: GraphInputs, choice: Choice, learned,
               handle: int) -> GraphPlan:
    """Where the ops for ``choice``'s offloaded layers go in ``gm`` (the state's ``handle``
    names them); edits nothing but ``learned.routing`` (:class:`~fx_offload.learned.
    Learned`), whose ``layout`` (the chunks) must be arranged."""
    layout = learned.layout
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    chunk_of: dict[str, tuple[int, int]] = {}       # parameter name -> (layer, chunk)
    for layer, ps in choice.params.items():
        index = chunk_of_suffix(layout[layer])
        for p in ps:
            chunk_of[p.name] = (layer, index[p.suffix])
    weights: dict[int, dict[fx.Node, int]] = {}
    for node, (name, _) in gi.params.items():
        found = chunk_of.get(name)
        if found is not None:
            weights.setdefault(found[0], {})[node] = found[1]

    paths = {choice.stack.layer_path(layer): layer for layer in weights}
    membership = layers_of_nodes(gm, gi, paths)
    nodes_of: dict[int, list[fx.Node]] = {layer: [] for layer in weights}
    for node, layers in membership.items():
        for layer in layers:
            nodes_of[layer].append(node)

    input_storages = {s for n in gi.placeholders if n not in gi.params
                      for s in [storage_of(n)] if s is not None}
    weight_storages = {storage_of(n): n for ws in weights.values() for n in ws}
    weight_storages.pop(None, None)
    param_nodes = {node: name for node, (name, _) in gi.params.items()}    # -> its name
    plans = []
    for layer in sorted(weights):
        plan = _plan_layer(layer, weights[layer], nodes_of[layer], order, choice, layout,
                           param_nodes, input_storages, weight_storages)
        if plan is not None:
            plan.routed = route(layer, weights[layer], param_nodes, plan.members, choice,
                                learned)
            _starts_into_link_gaps(plan, order, choice, layout)
            plans.append(plan)

    _check_not_interleaved(plans, order, choice)
    entry = _entry_starts(plans, gi, choice) \
        if choice.schedule.starts_call([lp.layer for lp in plans]) else None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = [n for n in output.all_input_nodes if isinstance(value_of(n), torch.Tensor)]
    join_acts, join_reads = _split_mutable(outs, input_storages | set(weight_storages))
    return GraphPlan(handle, plans, join_acts, join_reads, entry)


def _entry_starts(plans: list[LayerPlan], gi: GraphInputs, choice: Choice) -> EntryStarts | None:
    """The entry refills, for the graph that runs the first offloaded layer."""
    refills = choice.schedule.entry_refills()
    if not refills:
        return None
    sizes = {n: _anchor_size(n, choice) for n in gi.placeholders if n not in gi.params}
    # the anchor holds no data: the smallest input's shape costs least memory
    source = min((n for n, size in sizes.items() if size is not None), key=sizes.get,
                 default=None)
    targets = {refill for _, refill in refills}
    tied = [lp.waits[0] for lp in plans if lp.layer in targets and lp.waits]
    return EntryStarts(refills, source, tied)


def _anchor_size(node: fx.Node, choice: Choice) -> int | None:
    """Elements of a graph input the entry starts may be tied to (an empty tensor shaped
    like it): a plain tensor of fixed size on the offload device; None for any other (an
    anchor on another device would keep a CUDA graph from being captured; a symbolic size
    is not compared)."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor) or dtensor.is_dtensor(value) \
            or value.device.type != choice.device.type:
        return None
    numel = value.numel()
    return numel if isinstance(numel, int) and numel > 0 else None


def _check_not_interleaved(plans: list[LayerPlan], order, choice: Choice) -> None:
    """Each offloaded layer runs once, from its first weight read to its last node, before
    the next offloaded layer begins; a layer run twice in one forward (or one whose compute
    encloses another offloaded layer) would need its slot across the other's refill."""
    ordered = sorted(plans, key=lambda lp: order[lp.first_use])
    for lp, nxt in zip(ordered, ordered[1:]):
        if order[nxt.first_use] < order[lp.last_node]:
            path = choice.stack.layer_path(lp.layer)
            raise PlanError(
                f"offloaded layer {path} runs again (or still runs) after offloaded layer "
                f"{choice.stack.layer_path(nxt.layer)} has begun ({describe_node(lp.last_node)} "
                "follows it): a layer called more than once per forward cannot give up its "
                "slot in between. Keep it resident: offload other layers (group_size / "
                "num_in_group, or a layers= stack without it)")


def _split_mutable(nodes, frozen_storages):
    """Nodes that may be declared mutated (one per storage, none aliasing a graph input or a
    weight) and the rest, which are only read."""
    acts, reads, seen = [], [], set()
    for node in nodes:
        storage = storage_of(node)
        if storage is None or storage in frozen_storages or storage in seen:
            reads.append(node)
        else:
            seen.add(storage)
            acts.append(node)
    return acts, reads


def _cover(users, candidates, externals, order) -> list[fx.Node]:
    """Few activations such that each of ``users`` is computed from one of them (greedy set
    cover; ties go to the earlier node).  Fewer declared mutations, fewer copies where the
    compiler does not re-inplace."""
    chosen, left = [], list(users)
    pool = sorted(candidates, key=order.__getitem__)
    seen_storage = set()
    while left and pool:
        best = max(pool, key=lambda a: (sum(a in externals[u] for u in left), -order[a]))
        if not any(best in externals[u] for u in left):
            break
        pool.remove(best)
        storage = storage_of(best)
        if storage is not None and storage in seen_storage:
            continue
        seen_storage.add(storage)
        chosen.append(best)
        left = [u for u in left if best not in externals[u]]
    return sorted(chosen, key=order.__getitem__)


def _plan_layer(layer, weights: dict[fx.Node, int], layer_nodes, order, choice, layout,
                param_nodes, input_storages, weight_storages) -> LayerPlan | None:
    name = choice.stack.layer_path(layer)
    users = sorted({u for w in weights for u in w.users}, key=order.__getitem__)
    # a layer whose routed experts are a host_experts op (host_regions) is planned even
    # where nothing else of it is offloaded: its slot's refills start after it
    hosted = sorted((n for n in layer_nodes if (c := OpCall.of(n)) is not None
                     and c.kind == "host"), key=order.__getitem__)
    if not users and not hosted:
        return None
    members = set(layer_nodes)
    for user in users:
        if user not in members:
            read = [param_nodes.get(a, a.name) for a in user.all_input_nodes if a in weights]
            raise PlanError(
                f"node {describe_node(user)} reads {', '.join(read)} of offloaded layer "
                f"{name} outside that layer's forward, where its slot may already hold another "
                "layer; exclude that parameter with offload_params or move the read into the "
                "layer")
    ordered = sorted(layer_nodes, key=order.__getitem__)
    last_node = ordered[-1]
    frozen = input_storages | set(weight_storages)
    by_chunk: dict[int, list[fx.Node]] = {}
    for w, chunk in weights.items():
        if w.users:
            by_chunk.setdefault(chunk, []).append(w)

    found = {chunk: _chunk_wait(chunk, ws, ordered, order, param_nodes, input_storages,
                                weight_storages, name)
             for chunk, ws in by_chunk.items()}
    waits = _share_waits(found, name) if found or not hosted else []
    outputs = [n for n in ordered
               if any(u not in members for u in n.users) and isinstance(value_of(n), torch.Tensor)]
    for out in outputs:
        w = weight_storages.get(storage_of(out))
        if w is not None:
            raise PlanError(
                f"{describe_node(out)} of offloaded layer {name} returns a view "
                f"of the offloaded weight {param_nodes.get(w, w.name)}, which would be read "
                "after its slot is refilled; exclude that parameter with offload_params")
    start_acts, start_reads = _split_mutable(outputs, input_storages)
    refill = choice.schedule.refill_in_call(layer)
    starts = []
    if refill is not None:
        if not start_acts:
            raise PlanError(
                f"offloaded layer {name} has no output of its own (each output "
                "aliases a graph input), so its start_prefetch cannot be ordered after it")
        readers = {chunk: _slot_readers(ws, members, order) for chunk, ws in by_chunk.items()}
        for node in hosted:     # a host op reads its chunks' slot bytes when it streams
            for chunk in OpCall.of(node).chunks:
                readers.setdefault(chunk, []).append(node)
        mine = layout[layer]
        for target in layout[refill]:
            overwritten = [r for c in mine if c.overlaps(target) for r in readers.get(c.index, ())]
            starts.append(_chunk_start(target.index, overwritten, order, frozen, last_node,
                                       start_acts, start_reads))
    first_use = min([w.first_use for w in waits] + hosted[:1], key=order.__getitem__)
    return LayerPlan(layer, choice.schedule.slot_of[layer], refill, weights, first_use,
                     last_node, waits, starts, ordered)


_METADATA = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype,
             torch.device, torch.Size)


def _starts_into_link_gaps(lp: LayerPlan, order, choice: Choice, layout) -> None:
    """Put the refill's starts that come before ``lp``'s first routed wait behind its routed
    waits instead: the first half of their bytes behind the first, the rest behind the last.

    A decode step's link carries each routed wait's gather, then idles while the gathered
    experts are computed on (the next gather waits for that compute, or for the next
    layer's router).  A copy started before the gathers only shares the link with them (a
    gather and a copy together take the sum of their times apart, measured on an H100), so
    its bytes cost nothing more in those idle gaps.  A later start is always safe; it must
    only not hold up the layer that reads it: with one slot the refill is the next layer,
    which would wait behind the last gap, so there everything goes behind the first."""
    waits = [w for w in lp.waits if any(c in lp.routed for c in w.chunks)]
    gaps = waits[:1] + waits[-1:] if choice.schedule.num_slots > 1 else waits[:-1][:1]
    if lp.refill is None or not gaps:
        return
    early = [s for s in lp.starts if order[s.after] < order[waits[0].first_use]]
    size = {c.index: c.end - c.start for c in layout[lp.refill]}
    half, moved = sum(size[s.chunk] for s in early) / 2, 0
    for start in early:
        start.behind = gaps[0] if moved < half else gaps[-1]
        moved += size[start.chunk]


def _slot_readers(ws, members, order) -> list[fx.Node]:
    """Nodes that read the bytes of the weights ``ws``: their users, and the users of views
    of them (``w.t()``, a split), in graph order."""
    storages = {storage_of(w) for w in ws} - {None}
    found, frontier = set(), list(ws)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            value = value_of(user)
            if user in found or user not in members or isinstance(value, _METADATA):
                continue            # a size or a dtype read from a weight reads no bytes
            found.add(user)
            if not isinstance(value, torch.Tensor) or storage_of(user) in storages:
                frontier.append(user)   # a view of the weight (or a tuple of them)
    return sorted(found, key=order.__getitem__)


def _chunk_start(chunk, overwritten, order, frozen, last_node, layer_acts, layer_reads):
    """The start of the refill's ``chunk``: after the last of the nodes ``overwritten``
    (the reads of the bytes it overwrites), tied to it and reading the rest of them."""
    tensors = [n for n in overwritten if isinstance(value_of(n), torch.Tensor)]
    if tensors:
        after = max(overwritten, key=order.__getitem__)
        acts, reads = _split_mutable([after], frozen) if after in tensors else ([], [])
        if acts:
            reads = [n for n in tensors if n is not after]
            return ChunkStart(chunk, after, acts, reads)
    # nothing this graph reads is overwritten, or the last read yields no value of its own
    return ChunkStart(chunk, last_node, list(layer_acts), list(layer_reads))


def _share_waits(found, name) -> list[ChunkWait]:
    """The waits in graph order; a chunk whose reads no activation feeds waits with the
    chunk waited for before it (earlier than needed, so still safe)."""
    waits: list[ChunkWait] = []
    orphans = []
    for chunk, wait in sorted(found.items(), key=lambda kv: kv[1][0]):
        position, first_use, acts, clones = wait
        if acts or clones:
            waits.append(ChunkWait([chunk], first_use, acts, clones))
        elif waits:
            waits[-1].chunks.append(chunk)
        else:
            orphans.append(chunk)
    if not waits:
        raise PlanError(
            f"offloaded layer {name} computes nothing from an activation "
            "(every weight read depends on weights alone), so no op can be ordered before its "
            "weight reads; do not offload this layer")
    if orphans:
        raise PlanError(
            f"offloaded layer {name} reads the weights of its copy chunk(s) {orphans} before "
            "any activation feeds them, so no wait can be ordered before those reads; do not "
            "offload this layer, or exclude those parameters with offload_params")
    return waits


def _chunk_wait(chunk, ws, ordered, order, param_nodes, input_storages, weight_storages,
                name):
    """(position, first read, acts, clone_inputs) of the wait for ``chunk``, whose weight
    placeholders are ``ws``."""
    users = sorted({u for w in ws for u in w.users}, key=order.__getitem__)
    first_use = users[0]
    reads_weight = set(users)

    # The values live at the wait that each later layer node is computed from: inputs of the
    # layer, or layer nodes computed before the chunk's first read (a norm's statistics, the
    # attention's output for the MLP's chunks).  The wait must be tied to values read *after*
    # it, or the compiler drops it as dead code.
    after = [n for n in ordered if order[n] >= order[first_use]]
    after_set = set(after)
    externals: dict[fx.Node, frozenset] = {}
    for node in after:
        acc = set()
        for arg in node.all_input_nodes:
            if arg in after_set:
                acc |= externals.get(arg, frozenset())
            elif arg not in param_nodes and isinstance(value_of(arg), torch.Tensor) \
                    and storage_of(arg) not in weight_storages:
                acc.add(arg)
        externals[node] = frozenset(acc)

    # Nodes computed from the weights: those that also depend on an activation are ordered
    # after the wait through it; the rest (dequantizing a weight, say) only by graph order.
    derived = set()
    for node in after:
        if node in reads_weight or any(a in derived for a in node.all_input_nodes):
            derived.add(node)
    weight_only = [u for u in after if u in derived and not externals[u]]
    anchored = [u for u in after if u in derived and externals[u]]
    # only values that exist at the wait can be tied to it (a value the parent computes in
    # the middle of the layer cannot)
    needed = {a for u in anchored for a in externals[u] if order[a] < order[first_use]}
    mutable = [a for a in needed if storage_of(a) not in input_storages]
    acts = _cover(anchored, mutable, externals, order)
    covered = {u for u in anchored if externals[u] & set(acts)}
    # What only graph inputs feed gets a clone of one of them: the clone is tied instead.
    inputs_only = [u for u in anchored if u not in covered]
    clone_inputs = _cover(inputs_only, sorted(needed - set(mutable), key=order.__getitem__),
                          externals, order)
    if weight_only:
        log.debug("fx_offload: layer %s chunk %d reads weights in %s without any activation; "
                  "their order after the wait rests on the graph order", name, chunk,
                  [n.name for n in weight_only])
    return order[first_use], first_use, acts, clone_inputs
