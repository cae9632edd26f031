"""The planner behind ``memory_budget``: which layers (and parameters) to offload and how
many slots, chosen at a model's first compile from the graph's per-layer costs
(:mod:`.costs`) and the device's rates (:mod:`.device_rates`).

It lists candidate plans; keeps those whose device memory for weights,
``resident weights - offloaded bytes + slot buffers`` (a slot is as large as the largest
layer it holds), fits what the budget leaves once the KV cache's, the expert cache's and a
training step's (:mod:`.training_memory`) shares are set aside; predicts each one's forward
time at the plan's token counts (:func:`simulate`: compute in order, one copy stream, each
layer moved in chunks, a chunk's copy starting when the layer leaving the slot has read
what it overwrites); and chooses the lowest mean predicted slowdown against the resident
model.  Plans predicted within 0.5% of it (``NEAR``) count as equal, and of those the one
that copies, then pins, the fewest bytes with the fewest slots wins; the runner-ups are
kept for ``report``/``inspect``.

The steps, the break-even token count and the rules for MoE layers: docs/planner.md (The
planner: ``memory_budget``; The KV cache's share; A training step's share; The expert
cache's share; A MoE layer's experts alone).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import time

import torch
from torch import nn

from .. import dtensor, registry, subclass
from ..errors import META_REFUSED, BudgetError, OffloadError
from ..options import OffloadOptions
from ..copy_rules import ALIGN, WHOLE_ABOVE, depth_wanted, expected_share
from ..schedule import Schedule
from ..text import format_bytes, render_table
from . import compression, training_memory
from .costs import GraphCosts, graph_costs
from .device_rates import RATE_NAMES, DeviceRates, rates_for
from .experts import expert_tensors
from .params import layer_bytes, select_params
from .stack import LayerStack

log = logging.getLogger("fx_offload")

CHUNKS_PREDICTED = 4        # a decoder layer's usual chunk count (attention, gate, up, down)
MAX_SLOTS = 8              # deeper prefetch than this has not paid for its memory
MAX_GROUP = 16             # group patterns tried up to this group size
MAX_PATTERN_SUBSETS = 6    # with more offload_params patterns, only all of them together
NEAR = 1.005               # predicted slowdowns this close count as equal
HIDDEN_WITHIN = 1.01       # "copies hidden": predicted time within 1% of resident
BREAK_EVEN_LIMIT = 1 << 24
BREAK_EVENS = 8             # the best plans whose break-even token count is searched


def simulate(pre: float, layer_s: list[float], post: float, schedule: Schedule,
             copy_s: dict[int, float], overlapped: bool = True, calls: int = 3,
             chunks: int = 1) -> float:
    """Duration of one forward in steady state (the last of ``calls`` back-to-back calls).

    Compute runs the segments in order.  An offloaded layer moves in ``chunks`` equal parts
    (:mod:`fx_offload.layout`) and computes in as many equal parts, part ``i`` reading chunk
    ``i``: it waits for each chunk before computing its part, and once it has computed part
    ``i``, the copy of its refill's chunk ``i`` starts (after the previous copy: one copy
    stream); the refills a call begins with (:mod:`fx_offload.schedule`) start at its entry,
    from the second call on (the first finds its slots filled).  Not ``overlapped`` (the
    CPU): copies run in line."""
    compute_free = copy_free = 0.0
    ready = {layer: [0.0] * chunks for layer in schedule.layers}

    def copy(refill: int, i: int) -> None:
        nonlocal compute_free, copy_free
        if overlapped:
            copy_free = ready[refill][i] = max(compute_free, copy_free) + copy_s[refill] / chunks
        else:
            compute_free += copy_s[refill] / chunks
            ready[refill][i] = compute_free

    start = 0.0
    for call in range(calls):
        start = compute_free
        for _, refill in schedule.entry_refills() if call else ():
            for i in range(chunks):
                copy(refill, i)
        compute_free += pre
        for layer, seconds in enumerate(layer_s):
            arrived = ready.get(layer)
            if arrived is None:                 # resident
                compute_free += seconds
                continue
            refill = schedule.refill_in_call(layer)
            for i in range(chunks):
                compute_free = max(compute_free, arrived[i]) + seconds / chunks
                if refill is not None:
                    copy(refill, i)
        compute_free += post
    return compute_free - start


@dataclasses.dataclass(frozen=True)
class Candidate:
    layers: tuple[int, ...]
    num_slots: int
    params: tuple[str, ...] | None       # the offload_params patterns used; None: all
    layer_bytes: tuple[int, ...]         # offloaded bytes of each of ``layers``
    weights_bytes: int                   # device memory for weights under this plan
    slot_bytes: int
    experts_only: bool = False           # ``params`` names the expert tensors (the planner's
    #                                      own patterns, not the user's: _experts_only)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def moved_bytes(self) -> int:
        """Bytes copied per forward (layers alone in their slot are never refilled)."""
        return Schedule(self.layers, self.num_slots).moved_bytes(dict(zip(self.layers,
                                                                      self.layer_bytes)))

    def describe(self) -> str:
        params = "" if self.params is None else (
            ", expert tensors only" if self.experts_only
            else f", params {list(self.params)}")
        return (f"layers {list(self.layers)}, {self.num_slots} slot{'s' * (self.num_slots > 1)}"
                f"{params}")


class CostModel:
    """Predicted times of the model and of any plan, from graph costs and device rates."""

    def __init__(self, costs: GraphCosts, rates: DeviceRates, num_layers: int,
                 overlapped: bool, chunks: int = 1, circular: str = "end",
                 copy_fraction: float = 1.0, decode_rate: float | None = None,
                 routed: dict[int, tuple[int, int, int]] | None = None):
        """``copy_fraction``, ``decode_rate``: under ``compress="lossless"``, the bytes a copy
        moves per offloaded byte, and the decode's bytes per second (selection.compression).
        ``routed``: layer -> (bytes of its expert tensors, experts, top-k) where a call may
        move only the experts its tokens pick (``experts="routed"``)."""
        self.routed = routed or {}
        self.costs, self.rates = costs, rates
        self.copy_fraction, self.decode_rate = copy_fraction, decode_rate
        self.num_layers, self.overlapped, self.chunks = num_layers, overlapped, chunks
        # where the circular prefetch starts (fx_offload.schedule); chosen per call, it is at
        # the end for the calls the simulation models (back to back,
        # fx_offload.runtime.copies.circular)
        self.circular = "end" if circular == "either" else circular
        self._cache: dict[float, tuple[float, list[float], float]] = {}

    def segments(self, tokens: float) -> tuple[float, list[float], float]:
        """(before the layers, each layer, after the layers) in seconds at ``tokens``; a
        layer absent from the traced graph costs the mean of the present ones."""
        hit = self._cache.get(tokens)
        if hit is not None:
            return hit
        r, c, ov = self.rates, self.costs, self.overlapped
        present = {i: seg.seconds(tokens, r, ov) for i, seg in c.layers.items()}
        mean = statistics.fmean(present.values()) if present else 0.0
        result = (c.pre.seconds(tokens, r, ov),
                  [present.get(i, mean) for i in range(self.num_layers)],
                  c.post.seconds(tokens, r, ov))
        self._cache[tokens] = result
        return result

    def resident(self, tokens: float) -> float:
        pre, layers, post = self.segments(tokens)
        return pre + sum(layers) + post

    def predict(self, layers: list[int], num_slots: int, layer_bytes: dict[int, int],
                tokens: float) -> float:
        pre, layer_s, post = self.segments(tokens)
        copy_s = {layer: self.copy_seconds(self.moved_bytes(layer, b, tokens))
                  for layer, b in layer_bytes.items()}
        return simulate(pre, layer_s, post, Schedule(layers, num_slots, self.circular), copy_s,
                        self.overlapped, chunks=self.chunks)

    def moved_bytes(self, layer: int, nbytes: int, tokens: float) -> float:
        """Bytes a call of ``tokens`` tokens moves of ``layer``'s ``nbytes`` offloaded ones:
        all of them, or, for routed experts, the expected share its tokens pick (whole above
        the share at which the runtime prefetches them whole: runtime.experts.routed)."""
        found = self.routed.get(layer)
        if found is None:
            return nbytes
        expert_bytes, count, k = found
        share = expected_share(count, k, max(int(tokens), 1))
        if share > WHOLE_ABOVE:
            return nbytes
        # a plan of some of the user's patterns may offload some expert tensors only: never
        # less than the picked share of what it offloads
        return max(nbytes - expert_bytes * (1.0 - share), nbytes * share)

    def call_bytes(self, c: Candidate, tokens) -> float:
        """Bytes a call of plan ``c`` is predicted to copy, the mean over ``tokens``: the
        routed layers' picked experts, not all of them (``Candidate.moved_bytes``)."""
        sizes = dict(zip(c.layers, c.layer_bytes))
        refilled = Schedule(c.layers, c.num_slots).refilled_layers()
        return statistics.fmean(sum(self.moved_bytes(layer, sizes[layer], t) for layer in refilled)
                                for t in tokens)

    def copy_seconds(self, nbytes: float) -> float:
        """A layer of ``nbytes`` offloaded bytes: the link's time for what it moves, or the
        decode's, whichever is longer (they overlap, one chunk apart)."""
        link = nbytes * self.copy_fraction / self.rates.h2d_bandwidth
        return link if self.decode_rate is None else max(link, nbytes / self.decode_rate)

    def break_even(self, layers: list[int], num_slots: int, layer_bytes: dict[int, int],
                   ) -> int | None:
        """Smallest token count from which the plan is within 1% of resident (copies
        hidden); None if not below 2**24 tokens."""
        def hidden(t):
            return self.predict(layers, num_slots, layer_bytes, t) <= \
                HIDDEN_WITHIN * self.resident(t)
        if hidden(1):
            return 1
        low, high = 1, 2
        while not hidden(high):
            if high >= BREAK_EVEN_LIMIT:
                return None
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if hidden(mid) else (mid, high)
        return high


@dataclasses.dataclass
class Scored:
    candidate: Candidate | None          # None: nothing offloaded
    predicted: dict[int, float]          # token count -> seconds
    slowdown: float                      # mean predicted / resident over the plan tokens
    break_even: int | None = None
    copied: float = 0.0                  # bytes a call copies, predicted (CostModel.call_bytes)


@dataclasses.dataclass
class PlannerResult:
    budget: int
    weights_bytes: int                   # the whole model resident
    minimum_bytes: int
    plan_tokens: tuple[int, ...]
    chosen: Scored
    runner_ups: list[Scored]
    considered: int
    cost_model: CostModel
    seconds: float                       # time the planner took
    fitting: list[Candidate] = dataclasses.field(default_factory=list, repr=False)
    reserved: int = 0                    # of memory_budget, the KV cache's device bytes
    expert_cache: int = 0                # of memory_budget, the expert cache's (its option)
    # each layer's parameter bytes when planned: a plan is kept only for layers alike
    layer_sizes: tuple[int, ...] = ()
    training: int = 0                    # of memory_budget, a training step's (its graph's)
    hosted: bool = False                 # only plans of expert tensors alone (_hosts_experts)

    @property
    def reserved_words(self) -> str:
        """What of the budget is set aside before the weights, in words."""
        return reserved_words(self.reserved, self.expert_cache, self.training)

    def best_for(self, tokens) -> Scored:
        """The plan this budget would get for another workload (``plan_tokens``)."""
        return rank(self.fitting, self.weights_bytes <= self.budget, self.cost_model,
                    tuple(tokens))[0]

    @property
    def offloads(self) -> bool:
        return self.chosen.candidate is not None

    def __str__(self) -> str:
        cm = self.cost_model
        toks = list(self.plan_tokens)
        kv = "" if not (self.reserved or self.expert_cache or self.training) else \
            f" (after {self.reserved_words})"
        head = [f"planner: memory_budget {format_bytes(self.budget, as_option=True)}{kv} for "
                f"{format_bytes(self.weights_bytes)} of weights (minimum "
                f"{format_bytes(self.minimum_bytes)}); {self.considered} plans fit, chosen for "
                f"{toks} token(s) in {self.seconds * 1e3:.0f} ms",
                f"  device rates: {cm.rates.describe()}",
                f"  cost model: {cm.costs.describe()}"]
        if cm.decode_rate is not None:
            head.append(f"  compress='lossless': a copy moves {cm.copy_fraction:.3f} of its "
                        f"bytes (\"copied per call\" below is before compression), decoded at "
                        f"{cm.decode_rate / 1e9:.0f} GB/s")
        if cm.routed:
            e, k = next(iter(cm.routed.values()))[1:]
            head.append(f"  experts='routed': in {len(cm.routed)} layer(s) a call copies the "
                        f"experts its tokens pick ({k} of {e} per token; whole when they "
                        "pick most), which the times below count; \"copied per call\" counts "
                        "every expert")
        if self.hosted:
            head.append("  host_compute: only plans offloading expert tensors alone (the host "
                        "computes those in place; other offloaded weights would cross the "
                        "link every call)")
        rows = [("", "plan", "weights on device", "copied per call",
                 *[f"ms at {t}" for t in toks], "resident ms" if len(toks) == 1 else
                 "x resident", "hidden from")]
        for mark, s in [("*", self.chosen)] + [(" ", r) for r in self.runner_ups]:
            c = s.candidate
            rows.append((
                mark,
                "nothing offloaded" if c is None else c.describe(),
                format_bytes(self.weights_bytes if c is None else c.weights_bytes),
                format_bytes(0 if c is None else c.moved_bytes),
                *[f"{s.predicted[t] * 1e3:.3f}" for t in toks],
                f"{cm.resident(toks[0]) * 1e3:.3f}" if len(toks) == 1 else f"{s.slowdown:.3f}",
                "-" if c is None else ("never" if s.break_even is None
                                       else f"{s.break_even} tokens")))
        table = render_table(rows, indent="  ")
        return "\n".join(head + table)


def weights_bytes(model: nn.Module, device: torch.device, as_plain: bool = False) -> int:
    """Device memory of the model's parameters and buffers (shared storage counted once).
    A tensor on the meta device counts as on ``device``: it is a model about to be placed
    there (``place`` plans on a meta copy).  ``as_plain``: an offloaded model's, were it
    not offloaded (``explain`` with other options): each offloaded parameter counts whole,
    not its share of a slot that several layers' parameters point at."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        t = dtensor.local(t)            # this rank's shard of a DTensor
        if t.device.type == "meta":
            key = ("meta", id(t))
        elif t.device != device:
            continue
        elif subclass.is_subclass(t):   # a quantized weight: the bytes of its inner tensors
            key = ("subclass", id(t))
        elif as_plain and registry.owner_of_param(t) is not None:
            key = ("offloaded", id(t))
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += subclass.nbytes(t)
    return total


def _pattern_subsets(patterns: tuple[str, ...] | None, experts_only=None):
    """The parameter sets a plan may offload, as ``offload_params`` patterns (None: every
    parameter of a layer).  Without the user's patterns, a model with expert tensors may also
    offload those alone (``experts_only``)."""
    if patterns is None:
        return [None] if not experts_only else [None, experts_only]
    if len(patterns) > MAX_PATTERN_SUBSETS:
        return [patterns]
    return [tuple(c) for r in range(len(patterns), 0, -1)
            for c in itertools.combinations(patterns, r)]


def layer_sets(num_layers: int) -> list[tuple[int, ...]]:
    """Evenly spread sets of every size, and every group pattern up to MAX_GROUP."""
    sets = {tuple(sorted({(j + 1) * num_layers // n - 1 for j in range(n)}))
            for n in range(1, num_layers + 1)}
    for g in range(1, min(num_layers, MAX_GROUP) + 1):
        for m in range(1, g + 1):
            sets.add(tuple(i for i in range(num_layers) if i % g >= g - m))
    return sorted(s for s in sets if s)


def candidates(model: nn.Module, stack: LayerStack, options: OffloadOptions,
               device: torch.device) -> tuple[list[Candidate], int, int]:
    """(every plan, whole-model weights bytes, the least device memory any plan needs)."""
    total = weights_bytes(model, device, as_plain=True)
    everything = range(len(stack.modules))
    found: list[Candidate] = []
    minimum = total
    any_match = False
    experts_only = _experts_only(model, stack, options)
    for patterns in _pattern_subsets(options.offload_params, experts_only):
        try:
            params = select_params(model, stack, everything, patterns)
        except OffloadError:
            continue        # this subset of the patterns matches nothing
        any_match = True
        sizes = layer_bytes(params)
        others = _routed_others(params, options, device)
        if len(sizes) >= 2:
            minimum = min(minimum, total - sum(sizes.values()) + max(sizes.values()))
        seen = set()
        for layers in layer_sets(len(stack.modules)):
            layers = tuple(i for i in layers if i in sizes)
            if len(layers) < 2 or layers in seen:
                continue
            seen.add(layers)
            lb = tuple(sizes[i] for i in layers)
            for num_slots in range(1, min(len(layers) - 1, MAX_SLOTS) + 1):
                slot_bytes = Schedule(layers, num_slots).slot_bytes(sizes) + \
                    _ahead_bytes(others, layers, num_slots)
                found.append(Candidate(layers, num_slots, patterns, lb,
                                       total - sum(lb) + slot_bytes, slot_bytes,
                                       experts_only=patterns is experts_only is not None))
    if not any_match:   # the user's patterns match nothing: the usual error
        select_params(model, stack, everything, options.offload_params)
    return found, total, minimum


def _routed_others(params, options: OffloadOptions, device: torch.device) -> dict[int, int]:
    """Layer -> offloaded bytes of its weights other than its expert tensors, for layers
    whose experts may be routed (what :mod:`fx_offload.runtime.experts.ahead` fetches ahead)."""
    if options.experts != "routed" or torch.device(device).type != "cuda" \
            or options.compress == "lossless":      # compressed layers take no ring
        return {}
    experts = expert_tensors(params)
    return {layer: sum(p.nbytes for p in params[layer] if p.suffix not in tensors)
            for layer, tensors in experts.items()}


def _ahead_bytes(others: dict[int, int], layers: tuple[int, ...], num_slots: int) -> int:
    """Device memory of the ring that fetches routed layers' other weights ahead, for a
    plan of ``layers`` over ``num_slots`` slots: a buffer per layer ahead and one more,
    each as large as the largest such layer's (an upper bound: the ring's buffers hold one
    chunk each)."""
    ahead = [others[layer] for layer in layers[num_slots:] if others.get(layer)]
    depth = min(depth_wanted(len(ahead)), len(ahead) - 1)
    if depth <= 0:
        return 0
    return (depth + 1) * (max(ahead) + ALIGN)


def _experts_only(model: nn.Module, stack: LayerStack, options: OffloadOptions,
                  ) -> tuple[str, ...] | None:
    """Patterns naming every expert tensor of the stack (``mlp.experts.gate_up_proj``...), where
    the user gave no ``offload_params`` and a layer holds expert tensors; else None.

    Offloading only a MoE layer's experts keeps its attention, router and norms resident: a
    decode step then moves only the experts its tokens pick, where whole layers also move
    those other bytes at every call (for Qwen3-30B-A3B's layers, 38 MB against a token's
    75 MB of experts).  Per byte of device memory that is worth more than any other use, so
    the planner weighs such plans beside whole-layer ones and the budget decides."""
    if options.offload_params is not None:
        return None
    try:
        params = select_params(model, stack, range(len(stack.modules)), None)
    except OffloadError:
        return None
    found = expert_tensors(params)
    suffixes = sorted({s for tensors in found.values() for s in tensors})
    if not suffixes or all(set(tensors) == {p.suffix for p in params[layer]}
                           for layer, tensors in found.items()):
        return None             # no expert tensors, or nothing else in their layers
    return tuple(suffixes)


def plan(model: nn.Module, stack: LayerStack, options: OffloadOptions, costs: GraphCosts,
         rates: DeviceRates, device: torch.device, runner_ups: int = 4,
         reserved: int = 0, training: int = 0) -> PlannerResult:
    """``reserved``: device bytes of the budget the KV cache takes (fx_offload.kv.host_layers);
    ``training``: a training step's (:mod:`.training_memory`); the bytes the option
    ``expert_cache`` asks for are set aside too."""
    started = time.perf_counter()
    budget = options.memory_budget - reserved - options.expert_cache_asked - training
    all_plans, total, minimum = candidates(model, stack, options, device)
    if budget < minimum:
        least = minimum + reserved + options.expert_cache_asked + training
        kv = "" if not (reserved or options.expert_cache_asked or training) else (
            f" and {reserved_words(reserved, options.expert_cache_asked, training, True)}")
        raise BudgetError(
            f"option 'memory_budget' ({format_bytes(options.memory_budget, as_option=True)}, "
            f"{options.memory_budget} bytes) "
            f"is below the least this model can run in: {format_bytes(least, as_option=True)} "
            f"({least} "
            f"bytes) = the weights that stay on the device plus one slot buffer, with every "
            f"layer of {stack.path or '<root>'!r} offloaded"
            + ("" if options.offload_params is None else
               f" (parameters matching {list(options.offload_params)})")
            + kv + f"; raise memory_budget to at least {format_bytes(least, as_option=True)}")
    fitting = [c for c in all_plans if c.weights_bytes <= budget]
    hosted = _hosts_experts(options, device) and any(c.experts_only for c in fitting)
    if hosted:
        fitting = [c for c in fitting if c.experts_only]
    fraction = compression.copy_fraction(stack, options.compress, device)
    cost_model = CostModel(costs, rates, len(stack.modules), overlapped=device.type == "cuda",
                           chunks=min(options.copy_chunks, CHUNKS_PREDICTED),
                           circular=options.circular_start, copy_fraction=fraction,
                           decode_rate=compression.decode_rate(device)
                           if options.compress == "lossless" else None,
                           routed=_routed_layers(model, stack, options, costs))
    tokens = options.plan_tokens or (costs.traced_tokens,)
    best = rank(fitting, total <= budget, cost_model, tokens)[:runner_ups + 1]
    result = PlannerResult(budget, total, minimum, tuple(tokens), best[0], best[1:],
                           len(fitting) + (total <= budget), cost_model,
                           time.perf_counter() - started, fitting, reserved,
                           options.expert_cache_asked, sizes_of(stack), training, hosted)
    log.info("fx_offload: %s", result)
    return result


def _hosts_experts(options: OffloadOptions, device: torch.device) -> bool:
    """Where the host computes routed experts (``host_compute`` "auto" or "always" on a
    GPU), a plan offloads expert tensors alone: the host reads them in place and only
    activations cross the link, while any other offloaded weight (attention, norms, the
    router) would cross it every call; the streaming cost model below cannot see that (the
    measured case: docs/planner.md, a MoE layer's experts alone)."""
    return options.experts == "routed" and \
        options.host_compute_in(device.type, options.mode) != "never"


def reserved_words(kv_bytes: int, cache_bytes: int, training_bytes: int = 0,
                   advice: bool = False) -> str:
    """The device bytes of a budget set aside before the weights, in words (``advice``:
    with how to make them smaller)."""
    parts = []
    if kv_bytes:
        parts.append(f"the KV cache's {format_bytes(kv_bytes)} on the device" + (
            " (the layers it keeps there and its slots: a shorter max_cache_len, a smaller "
            "batch or fewer kv_slots make it smaller)" if advice else ""))
    if cache_bytes:
        parts.append(f"expert_cache's {format_bytes(cache_bytes)}")
    if training_bytes:
        parts.append(f"a training step's {format_bytes(training_bytes)} (the activations "
                     "saved for backward, the trainable parameters' gradients and AdamW "
                     "state" + ("; a shorter sequence, a smaller batch or activation "
                                "checkpointing make it smaller" if advice else "") + ")")
    return " and ".join(parts)


def rank(fitting: list[Candidate], resident_fits: bool, cost_model: CostModel,
         tokens) -> list[Scored]:
    """Plans best first for a workload of ``tokens``: by mean predicted slowdown against the
    resident model, then fewer bytes copied, fewer slots; the first few get break-evens."""
    def score(c: Candidate | None) -> Scored:
        if c is None:
            predicted = {t: cost_model.resident(t) for t in tokens}
        else:
            sizes = dict(zip(c.layers, c.layer_bytes))
            predicted = {t: cost_model.predict(list(c.layers), c.num_slots, sizes, t)
                         for t in tokens}
        slowdown = statistics.fmean(predicted[t] / cost_model.resident(t) for t in tokens)
        return Scored(c, predicted, slowdown,
                      copied=0.0 if c is None else cost_model.call_bytes(c, tokens))

    scored = [score(c) for c in fitting] + ([score(None)] if resident_fits else [])

    def key(s: Scored):
        c = s.candidate
        return (round(s.slowdown, 9), s.copied,
                0 if c is None else c.num_slots, () if c is None else c.layers)
    scored.sort(key=key)
    # Predictions within NEAR of the best are a tie: take the one that moves and pins the
    # fewest bytes (host memory and PCIe traffic are not free either); moves as predicted:
    # a routed layer's picked experts, not all of them.
    near = [s for s in scored if s.slowdown <= scored[0].slowdown * NEAR]

    def thrift(s: Scored):
        c = s.candidate
        return (0, 0, 0, ()) if c is None else (s.copied, c.offloaded_bytes, c.num_slots,
                                                c.layers)
    best = min(near, key=thrift)
    scored.remove(best)
    scored.insert(0, best)
    for s in scored[:BREAK_EVENS]:
        c = s.candidate
        if c is not None:
            s.break_even = cost_model.break_even(list(c.layers), c.num_slots,
                                                 dict(zip(c.layers, c.layer_bytes)))
    return scored


def _routed_layers(model, stack, options, costs) -> dict[int, tuple[int, int, int]]:
    """Layer -> (expert bytes, experts, top-k) for the copy times of routed expert tensors:
    where ``experts="routed"``, the layer holds expert tensors, and its graph's top-k is
    known; the rest are predicted whole."""
    if options.experts != "routed" or not costs.top_k:
        return {}
    try:
        params = select_params(model, stack, range(len(stack.modules)), options.offload_params)
    except OffloadError:
        return {}
    found = {}
    for layer, tensors in expert_tensors(params).items():
        k = costs.top_k.get(layer)
        if k is not None:
            nbytes = sum(p.nbytes for p in params[layer] if p.suffix in tensors)
            found[layer] = (nbytes, max(tensors.values()), k)
    return found


def plan_for(model: nn.Module, stack: LayerStack, options: OffloadOptions, graph,
             layer_frame: bool, device: torch.device | None = None,
             reserved: int = 0) -> PlannerResult:
    """The planner's result for ``model`` from its first graph ``(gm, graph_inputs)``:
    that graph's costs, the device's rates (measured once, or given as options).
    ``device``: where the model will run (``place``); by default, where its weights are."""
    here, dtype = _weights_device_and_dtype(stack, allow_meta=device is not None)
    device = here if device is None else device
    gm, gi = graph
    whole = next((i for i, m in enumerate(stack.modules) if m is gi.root), None) \
        if layer_frame else None
    costs = graph_costs(gm, gi, {stack.layer_path(i): i for i in range(len(stack.modules))},
                        whole_graph_layer=whole)
    rates = rates_for(device, dtype, {n: getattr(options, n) for n in RATE_NAMES})
    return plan(model, stack, options, costs, rates, device, reserved=reserved,
                training=training_memory.step_bytes(model, gm))


def carried_over(model: nn.Module, stack: LayerStack, options: OffloadOptions,
                 planner: PlannerResult, before: list[nn.Module] | None,
                 device: torch.device, reserved: int = 0) -> PlannerResult:
    """The planner's result for ``stack`` where ``planner`` was reached for the layers
    ``before`` (None: a copy's, or the model's after a plan that failed, position by
    position): itself where they are the same layers of the same sizes (a copy), else the
    plan made again from its graph's costs, each carried to where its layer is now (a
    layer deleted, inserted, moved or resized, a dtype changed; a layer new to the stack
    costs the mean), its rates and the same budget.  There is no
    graph to plan from here: the model is offloaded again as a call begins."""
    modules, count = list(stack.modules), planner.cost_model.num_layers
    alike = sizes_of(stack) == planner.layer_sizes
    if before is None:          # a copy's layers, or the model's after a failed plan
        if alike:
            return planner
        new_index = {i: i for i in range(min(count, len(modules)))}
    elif alike and all(a is b for a, b in zip(before, modules)):
        return planner
    else:
        where = {id(m): i for i, m in enumerate(before)}
        new_index = {where[id(m)]: j for j, m in enumerate(modules) if id(m) in where}
    costs = planner.cost_model.costs

    def moved(per_layer: dict) -> dict:
        return {new_index[i]: v for i, v in per_layer.items() if i in new_index}
    if any(i in new_index for i in costs.layers):   # else kept as they are, by position
        costs = dataclasses.replace(costs, layers=moved(costs.layers),
                                    flop_expr=moved(costs.flop_expr), top_k=moved(costs.top_k))
    log.info("fx_offload: the layers of %r changed (now %d, planned for %d): memory_budget "
             "planned again from the first graph's costs", stack.path or "<root>",
             len(modules), count)
    return plan(model, stack, options, costs, planner.cost_model.rates, device,
                reserved=reserved, training=planner.training)


def sizes_of(stack: LayerStack) -> tuple[int, ...]:
    """Each layer's parameter bytes (as their shapes and dtypes say, wherever they are)."""
    return tuple(sum(p.numel() * p.element_size() for p in m.parameters())
                 for m in stack.modules)


def _weights_device_and_dtype(stack: LayerStack, allow_meta: bool = False,
                              ) -> tuple[torch.device, torch.dtype]:
    """The device of the stack's weights and their most common dtype (by elements)."""
    params = [p for layer in stack.modules for p in layer.parameters()]
    if not params:
        raise OffloadError("the layers of the stack have no parameters")
    device = params[0].device
    if device.type == "meta" and not allow_meta:
        raise OffloadError(META_REFUSED)
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return device, max(sizes, key=sizes.get)
