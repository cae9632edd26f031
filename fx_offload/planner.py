"""The planner behind ``memory_budget``: which layers (and parameters) to offload, how many
slots, predicted from the graph's costs.

At a model's first compile, with the graph's per-layer costs (:mod:`fx_offload.costs`) and the
device's rates (:mod:`fx_offload.device_rates`):

1. list candidate plans: a set of offloaded layers (spread evenly over the stack, or every
   ``group_size``/``num_in_group`` pattern), a slot count (the prefetch depth, 1..8), and, with
   ``offload_params``, a subset of its patterns;
2. keep those whose device memory for weights fits the budget:
   ``resident weights - offloaded bytes + slot buffers`` (a slot is as large as the largest
   layer it holds);
3. predict each one's forward time at the plan's token counts by simulating the schedule the
   pass builds (:func:`simulate`: compute in order, one copy stream, a copy into a slot starts
   when the layer leaving the slot is done, a layer waits for its copy);
4. choose the lowest mean predicted slowdown against the resident model; plans predicted
   within 0.5% of it count as equal, and of those the one that copies, then pins, the fewest
   bytes with the fewest slots wins; the runner-ups are kept for ``report``/``inspect``.

The break-even token count of a plan is the smallest ``T`` at which its predicted time is
within 1% of the resident model's: from there on the copies are hidden.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import time

import torch
from torch import nn

from .costs import GraphCosts
from .device_rates import DeviceRates
from .options import OffloadOptions, format_budget
from .report import format_bytes
from .selection import LayerStack, rotation, select_params

log = logging.getLogger("fx_offload")

MAX_SLOTS = 8              # deeper prefetch than this has not paid for its memory
MAX_GROUP = 16             # group patterns tried up to this group size
MAX_PATTERN_SUBSETS = 6    # with more offload_params patterns, only all of them together
NEAR = 1.005               # predicted slowdowns this close count as equal
HIDDEN_WITHIN = 1.01       # "copies hidden": predicted time within 1% of resident
BREAK_EVEN_LIMIT = 1 << 24


class BudgetError(ValueError):
    pass


def simulate(pre: float, layer_s: list[float], post: float, offloaded: list[int],
             slot_of: dict[int, int], target_of: dict[int, int | None],
             copy_s: dict[int, float], overlapped: bool = True, calls: int = 3) -> float:
    """Duration of one forward in steady state (the last of ``calls`` back-to-back calls).

    Compute runs the segments in order; where a layer's prefetch target is set, the copy of
    the target starts after the layer (and after the previous copy, one copy stream) and the
    target's compute waits for it.  Not ``overlapped`` (the CPU): copies run in line."""
    compute_free = copy_free = 0.0
    ready = {layer: 0.0 for layer in offloaded}
    start = 0.0
    for _ in range(calls):
        start = compute_free
        compute_free += pre
        for layer, seconds in enumerate(layer_s):
            compute_free = max(compute_free, ready.get(layer, 0.0)) + seconds
            target = target_of.get(layer)
            if target is None:
                continue
            if overlapped:
                copy_free = ready[target] = max(compute_free, copy_free) + copy_s[target]
            else:
                compute_free += copy_s[target]
                ready[target] = compute_free
        compute_free += post
    return compute_free - start


@dataclasses.dataclass(frozen=True)
class Candidate:
    layers: tuple[int, ...]
    slots: int
    params: tuple[str, ...] | None       # the offload_params patterns used; None: all
    layer_bytes: tuple[int, ...]         # offloaded bytes of each of ``layers``
    weights_bytes: int                   # device memory for weights under this plan
    slot_bytes: int

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def moved_bytes(self) -> int:
        """Bytes copied per forward (layers alone in their slot are never refilled)."""
        _, target_of = rotation(list(self.layers), self.slots)
        sizes = dict(zip(self.layers, self.layer_bytes))
        return sum(sizes[t] for t in target_of.values() if t is not None)

    def describe(self) -> str:
        params = "" if self.params is None else f", params {list(self.params)}"
        return (f"layers {list(self.layers)}, {self.slots} slot{'s' * (self.slots > 1)}"
                f"{params}")


class CostModel:
    """Predicted times of the model and of any plan, from graph costs and device rates."""

    def __init__(self, costs: GraphCosts, rates: DeviceRates, num_layers: int,
                 overlapped: bool):
        self.costs, self.rates = costs, rates
        self.num_layers, self.overlapped = num_layers, overlapped
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

    def predict(self, layers: list[int], slots: int, layer_bytes: dict[int, int],
                tokens: float) -> float:
        pre, layer_s, post = self.segments(tokens)
        slot_of, target_of = rotation(sorted(layers), slots)
        copy_s = {layer: b / self.rates.h2d_bandwidth for layer, b in layer_bytes.items()}
        return simulate(pre, layer_s, post, sorted(layers), slot_of, target_of, copy_s,
                        self.overlapped)

    def break_even(self, layers: list[int], slots: int, layer_bytes: dict[int, int],
                   ) -> int | None:
        """Smallest token count from which the plan is within 1% of resident (copies
        hidden); None if not below 2**24 tokens."""
        def hidden(t):
            return self.predict(layers, slots, layer_bytes, t) <= \
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
        head = [f"planner: memory_budget {format_budget(self.budget)} for "
                f"{format_bytes(self.weights_bytes)} of weights (minimum "
                f"{format_bytes(self.minimum_bytes)}); {self.considered} plans fit, chosen for "
                f"{toks} token(s) in {self.seconds * 1e3:.0f} ms",
                f"  device rates: {cm.rates.describe()}",
                f"  cost model: {cm.costs.describe()}"]
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
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
                 for r in rows]
        return "\n".join(head + table)


def weights_bytes(model: nn.Module, device: torch.device) -> int:
    """Device memory of the model's parameters and buffers (shared storage counted once)."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device != device:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _pattern_subsets(patterns: tuple[str, ...] | None):
    if patterns is None:
        return [None]
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
    total = weights_bytes(model, device)
    everything = range(len(stack.layers))
    found: list[Candidate] = []
    minimum = total
    any_match = False
    for patterns in _pattern_subsets(options.offload_params):
        try:
            params = select_params(model, stack, options, layers=everything, patterns=patterns)
        except ValueError:
            continue        # this subset of the patterns matches nothing
        any_match = True
        sizes = {layer: sum(p.param.numel() * p.param.element_size() for p in ps)
                 for layer, ps in params.items()}
        if len(sizes) >= 2:
            minimum = min(minimum, total - sum(sizes.values()) + max(sizes.values()))
        seen = set()
        for layers in layer_sets(len(stack.layers)):
            layers = tuple(i for i in layers if i in sizes)
            if len(layers) < 2 or layers in seen:
                continue
            seen.add(layers)
            lb = tuple(sizes[i] for i in layers)
            for slots in range(1, min(len(layers) - 1, MAX_SLOTS) + 1):
                slot_of, _ = rotation(list(layers), slots)
                slot_bytes = sum(max(b for i, b in zip(layers, lb) if slot_of[i] == s)
                                 for s in range(slots))
                found.append(Candidate(layers, slots, patterns, lb,
                                       total - sum(lb) + slot_bytes, slot_bytes))
    if not any_match:   # the user's patterns match nothing: the usual error
        select_params(model, stack, options, layers=everything)
    return found, total, minimum


def plan(model: nn.Module, stack: LayerStack, options: OffloadOptions, costs: GraphCosts,
         rates: DeviceRates, device: torch.device, runner_ups: int = 4) -> PlannerResult:
    started = time.perf_counter()
    budget = options.memory_budget
    all_plans, total, minimum = candidates(model, stack, options, device)
    if budget < minimum:
        raise BudgetError(
            f"prefetch_offload option 'memory_budget' ({format_budget(budget)}, {budget} bytes) "
            f"is below the least this model can run in: {format_budget(minimum)} ({minimum} "
            f"bytes) = the weights that stay on the device plus one slot buffer, with every "
            f"layer of {stack.path or '<root>'!r} offloaded"
            + ("" if options.offload_params is None else
               f" (parameters matching {list(options.offload_params)})")
            + f"; raise memory_budget to at least {format_budget(minimum)}")
    fitting = [c for c in all_plans if c.weights_bytes <= budget]
    cost_model = CostModel(costs, rates, len(stack.layers), overlapped=device.type == "cuda")
    tokens = options.plan_tokens or (costs.traced_tokens,)
    best = rank(fitting, total <= budget, cost_model, tokens)[:runner_ups + 1]
    result = PlannerResult(budget, total, minimum, tuple(tokens), best[0], best[1:],
                           len(fitting) + (total <= budget), cost_model,
                           time.perf_counter() - started, fitting)
    log.info("fx_offload: %s", result)
    return result


def rank(fitting: list[Candidate], resident_fits: bool, cost_model: CostModel,
         tokens) -> list[Scored]:
    """Plans best first for a workload of ``tokens``: by mean predicted slowdown against the
    resident model, then fewer bytes copied, fewer slots; the first few get break-evens."""
    def score(c: Candidate | None) -> Scored:
        if c is None:
            predicted = {t: cost_model.resident(t) for t in tokens}
        else:
            sizes = dict(zip(c.layers, c.layer_bytes))
            predicted = {t: cost_model.predict(list(c.layers), c.slots, sizes, t)
                         for t in tokens}
        slowdown = statistics.fmean(predicted[t] / cost_model.resident(t) for t in tokens)
        return Scored(c, predicted, slowdown)

    scored = [score(c) for c in fitting] + ([score(None)] if resident_fits else [])

    def key(s: Scored):
        c = s.candidate
        return (round(s.slowdown, 9), 0 if c is None else c.moved_bytes,
                0 if c is None else c.slots, () if c is None else c.layers)
    scored.sort(key=key)
    # Predictions within NEAR of the best are a tie: take the one that moves and pins the
    # fewest bytes (host memory and PCIe traffic are not free either).
    near = [s for s in scored if s.slowdown <= scored[0].slowdown * NEAR]

    def thrift(s: Scored):
        c = s.candidate
        return (0, 0, 0, ()) if c is None else (c.moved_bytes, c.offloaded_bytes, c.slots,
                                                c.layers)
    best = min(near, key=thrift)
    scored.remove(best)
    scored.insert(0, best)
    for s in scored[:8]:
        c = s.candidate
        if c is not None:
            s.break_even = cost_model.break_even(list(c.layers), c.slots,
                                                 dict(zip(c.layers, c.layer_bytes)))
    return scored
