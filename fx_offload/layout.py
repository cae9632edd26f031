"""The packed slot layout: each offloaded layer's parameters in the order its forward first
reads them, split into copy chunks.

A layer's host block and its region of the slot share one layout, so a chunk is one
contiguous copy.  For a Llama-like layer (the default ``copy_chunks=8``: a chunk grows until
it holds an eighth of the layer)::

    slot  [ in_norm q k v o | post_norm gate | up | down ]
            chunk 0           chunk 1          2    3

An expert tensor, and each weight of a dense MLP the host may compute (``Choice.mlps``), is
a chunk of its own: a call that computes it elsewhere copies none of it.  A model placed
before any graph (``fx_offload.place``) takes the chunks an instance of its class got from a
graph with the same options (Dynamo shares that graph among the instances), or else small
parameters (norms, biases) first, then the rest in declaration order; a copy of an offloaded
model offloaded again keeps the chunks it had.  The layout is arranged once per model,
before its host blocks are filled, and never changes.  Where the pass puts each chunk's wait
and start, and the order taken from the first graph: docs/design.md (The inserted op
pattern).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from .copy_rules import ALIGN

log = logging.getLogger("fx_offload")

# (model class name, placement options) -> the chunks a graph gave it: another instance placed
# before any graph of its own runs the graph Dynamo compiled for the first (Dynamo shares one
# among instances), so it is arranged alike
_FROM_GRAPHS: dict[tuple, dict] = {}
ALIGN_CPU = 64                    # bytes; a CPU run only needs each view's dtype aligned
SMALL = 1 / 64          # without a graph: parameters this fraction of the layer's largest go first


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One contiguous copy: bytes ``[start, end)`` of a layer's block and slot region."""

    index: int
    start: int
    end: int
    suffixes: tuple[str, ...]

    def overlaps(self, other: "Chunk") -> bool:
        return self.start < other.end and other.start < self.end


def arrange(choice, learned, graph=None, like=None) -> dict[int, list[Chunk]]:
    """The chunks of every offloaded layer of ``choice``, arranged once into
    ``learned.layout`` (:class:`~fx_offload.learned.Learned`): each layer's parameters in
    first-read order, from ``graph`` (``(gm, graph_inputs)``) when given, which is the order
    of its host block (:func:`in_layout_order`; ``choice.params`` stays as selection made
    it).  ``like`` (:func:`chunk_names` of another layout: a copy of an offloaded model
    offloaded again) gives the chunks outright, where it names the same parameters."""
    chunks = learned.layout
    if chunks:
        return chunks
    align = align_for(choice.device)
    key = (choice.model_name, choice.options.placement_key())
    if like is None and graph is None:
        like = _FROM_GRAPHS.get(key)
    if like is not None and _names_alike(like, choice.params):
        for layer, ps in choice.params.items():
            groups = [list(chunk) for chunk in like[layer]]
            chunks[layer] = _split(_in_order(ps, groups), groups, align, len(groups),
                                   exact=True)
        return chunks
    firsts = _first_reads(choice, graph) if graph is not None else {}
    found: dict[frozenset, list[list[str]]] = {}
    for layer, ps in choice.params.items():
        groups = _groups_from_graph(ps, firsts)
        if groups is not None:
            found.setdefault(frozenset(p.suffix for p in ps), groups)
    for layer, ps in choice.params.items():
        names = frozenset(p.suffix for p in ps)
        groups = found.get(names) or _groups_without_graph(ps)
        chunks[layer] = _split(_in_order(ps, groups), groups, align,
                               choice.options.copy_chunks,
                               alone=frozenset((*choice.experts.get(layer, ()),
                                                *choice.mlps.get(layer, ()))))
    if graph is not None:
        _FROM_GRAPHS[key] = chunk_names(chunks)
    log.debug("fx_offload: copy chunks per layer %s",
              {layer: len(c) for layer, c in chunks.items()})
    return chunks


def _names_alike(like, params) -> bool:
    return {layer: sorted(s for chunk in chunks for s in chunk)
            for layer, chunks in like.items()} == \
        {layer: sorted(p.suffix for p in ps) for layer, ps in params.items()}


def _in_order(ps, groups) -> list:
    """The parameters ``ps`` in the order ``groups`` name them."""
    by_suffix = {p.suffix: p for p in ps}
    return [by_suffix[s] for group in groups for s in group]


def in_layout_order(ps, chunks: list[Chunk]) -> list:
    """A layer's parameters ``ps`` in the order of its host block and slot region, which its
    ``chunks`` name (every one of them: a parameter left out would have no place in its
    block)."""
    ordered = _in_order(ps, [c.suffixes for c in chunks])
    if len(ordered) != len(ps):
        raise RuntimeError(f"fx_offload: the layout names {len(ordered)} of a layer's "
                           f"{len(ps)} offloaded parameters; this is a bug in fx_offload")
    return ordered


def _first_reads(choice, graph) -> dict[str, int]:
    """Parameter name -> position in the graph of its first reader."""
    gm, gi = graph
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    return {name: min(order[u] for u in node.users)
            for node, (name, _) in gi.params.items() if node.users}


def _groups_from_graph(ps, firsts) -> list[list[str]] | None:
    """The layer's parameters in first-read order, those read first by the same node in one
    group; None if the graph reads none of them."""
    read = sorted((firsts[p.name], i) for i, p in enumerate(ps) if p.name in firsts)
    if not read:
        return None
    groups: list[list[str]] = []
    last = None
    for position, i in read:
        if position != last:
            groups.append([])
            last = position
        groups[-1].append(ps[i].suffix)
    unread = [p.suffix for p in ps if p.name not in firsts]
    return groups + [[s] for s in unread]


def _groups_without_graph(ps) -> list[list[str]]:
    """Small parameters (norms, biases: read early or cheap to wait for) in one group first,
    then each other parameter in declaration order."""
    sizes = [p.nbytes for p in ps]
    largest = max(sizes, default=0)
    small = [p.suffix for p, n in zip(ps, sizes) if n < largest * SMALL]
    rest = [[p.suffix] for p, n in zip(ps, sizes) if n >= largest * SMALL]
    return ([small] if small else []) + rest


def _split(ps, groups: list[list[str]], align: int, max_chunks: int,
           exact: bool = False, alone: frozenset = frozenset()) -> list[Chunk]:
    """Consecutive groups joined into chunks of at least ``1/max_chunks`` of the layer; a
    last chunk smaller than half that joins the one before.  ``exact``: one chunk per
    group.  A group holding a parameter named in ``alone`` (an expert tensor, whose chunk
    may move only the experts a call picked) is a chunk of its own."""
    entries, total = layout_of(block_tensors(ps), align)
    part_offset = {key: off for key, off, *_ in entries}
    ends = [off for _, off, *_ in entries[1:]] + [total]
    part_span = {key: end - off for (key, off, *_), end in zip(entries, ends)}
    # a parameter's bytes: its parts (a tensor subclass's inner tensors), laid out together
    offset = {p.suffix: min(part_offset[k] for k in p.parts()) for p in ps}
    span = {p.suffix: sum(part_span[k] for k in p.parts()) for p in ps}
    target = total / max(max_chunks, 1)
    bounds: list[list[str]] = []
    size, isolated = 0, False
    for group in groups:
        apart = any(s in alone for s in group)
        if not bounds or size >= target or exact or apart or isolated:
            bounds.append([])
            size = 0
        bounds[-1] += group
        size += sum(span[s] for s in group)
        isolated = apart
    joinable = not any(s in alone for b in bounds[-2:] for s in b)
    if len(bounds) > 1 and size < target / 2 and not exact and joinable:
        tail = bounds.pop()
        bounds[-1] += tail
    chunks = []
    for i, suffixes in enumerate(bounds):
        start = offset[suffixes[0]]
        end = offset[bounds[i + 1][0]] if i + 1 < len(bounds) else total
        chunks.append(Chunk(i, start, end, tuple(suffixes)))
    return chunks


def chunk_names(layout: dict[int, list[Chunk]]) -> dict[int, tuple[tuple[str, ...], ...]]:
    """Layer -> its chunks' parameter names: what :func:`arrange` needs to arrange a copy
    of the model alike."""
    return {layer: tuple(c.suffixes for c in chunks) for layer, chunks in layout.items()}


def chunk_of_suffix(chunks: list[Chunk]) -> dict[str, int]:
    return {s: c.index for c in chunks for s in c.suffixes}


def describe(chunks: list[Chunk]) -> str:
    """``0: q k v | 1: gate | ...`` for ``explain``."""
    return " | ".join(f"{c.index}: {' '.join(c.suffixes)}" for c in chunks)


def align_for(device: torch.device) -> int:
    """The alignment of each tensor in a host block and its slot on ``device``."""
    return ALIGN if device.type == "cuda" else ALIGN_CPU


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def span(shape, stride) -> int:
    """Elements a tensor takes in a block: from its first to its last, past any gaps its
    strides leave (a parameter made as ``t[:, ::2]`` spans twice its elements), and never
    fewer than its element count (contiguous or transposed: exactly that)."""
    count = math.prod(shape)
    return count if count == 0 else max(count, 1 + sum((d - 1) * s
                                                       for d, s in zip(shape, stride)))


def layout_of(tensors: dict[str, torch.Tensor], align: int = ALIGN) -> tuple:
    """Byte layout of ``tensors`` packed one after the other (each at a multiple of
    ``align``): a tuple of ``(key, offset, shape, stride, dtype)`` plus the total size.
    Each tensor keeps its strides (so a graph compiled for the parameter fits its views)
    and takes the bytes they span."""
    entries, total = [], 0
    for key, t in tensors.items():
        entries.append((key, total, tuple(t.shape), tuple(t.stride()), t.dtype))
        total += _round_up(span(t.shape, t.stride()) * t.element_size(), align)
    return tuple(entries), total


def block_tensors(ps) -> dict[str, torch.Tensor]:
    """A layer's offloaded parameters (``OffloadedParam``, in host-block order) as the plain
    tensors its host block and slot region hold, keyed as each parameter's parts."""
    return {key: t for p in ps for key, t in p.parts().items()}
