"""Under ``memory_budget``: which layers of a static cache live on the host (:func:`choose`,
giving a :class:`KVPlan`).

Where every movable layer on the host is not enough, weights are offloaded anyway, and all
of those layers go, except where the whole cache is a small share of the budget
(``SMALL_SHARE``): then only layers of at least ``WORTH_MOVING`` bytes go.  A host layer
costs a decode step about 0.15 ms besides its bytes' copy (its fill, write-back and ops),
which a small layer does not repay; a cache that is a large share of the budget goes
whatever its layers' size, since what it frees may decide whether the weights fit at all.
The weight planner plans for ``memory_budget`` less the cache's device bytes
(:func:`fx_offload.kv.reserved`).

The rule itself (the cache at full length, KV layers before weights, the fewest from the
end, the slots' bytes taken back, ``kv_cache="host"`` and ``"device"``, a cache met after
the weights were planned): docs/planner.md, "The KV cache's share", and
docs/huggingface.md, "The KV cache on the host", the bullet "Under ``memory_budget``".
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

from ..text import format_bytes

log = logging.getLogger("fx_offload")
_WARNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # runtime -> sizes
# a cache layer's bytes at full length below which, where the weights are offloaded anyway, it
# stays on the device: on the H100 the 64k-token KV row stood 0.58 ms a step over its bytes'
# bound with 4 host layers (0.15 ms a layer), which is 8 MB of the link at 55 GB/s
WORTH_MOVING = 8 << 20
SMALL_SHARE = 0.01      # of memory_budget: a cache this small cannot decide what fits


@dataclasses.dataclass(frozen=True)
class KVPlan:
    layers: tuple[int, ...]     # the host layers
    layer_bytes: dict           # every cache layer's keys and values at full length
    slots: int
    budget: int | None          # None: no memory_budget (kv_cache="host" alone)
    weights_bytes: int          # the device memory the weights take, or are taken to
    weights_planned: bool       # True: the weights' plan was made before the cache's

    @property
    def slot_bytes(self) -> int:
        if not self.layers:
            return 0
        return min(self.slots, len(self.layers)) * max(self.layer_bytes[i] for i in self.layers)

    @property
    def host_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.layers)

    @property
    def device_bytes(self) -> int:
        """The cache's device memory: the layers kept there and the slots."""
        return sum(self.layer_bytes.values()) - self.host_bytes + self.slot_bytes

    def describe(self) -> str:
        whole = sum(self.layer_bytes.values())
        where = ("every layer on the device" if not self.layers else
                 f"layer(s) {list(self.layers)} on the host ({format_bytes(self.host_bytes)})")
        weights = "planned first" if self.weights_planned else "resident"
        return (f"KV cache {format_bytes(whole)} at full length: {where}, "
                f"{format_bytes(self.device_bytes)} on the device with the slots, beside "
                f"{format_bytes(self.weights_bytes)} of weights ({weights}); memory_budget "
                f"{format_bytes(self.budget, as_option=True)}")


def choose(layer_bytes: dict[int, int], movable: list[int], slots: int, budget: int,
           weights: int, planned: bool) -> KVPlan:
    """The fewest host layers, from the end of ``movable``, that make the weights and the
    cache fit ``budget``; where none do, all of ``movable``, or those of at least
    ``WORTH_MOVING`` bytes where the cache is at most ``SMALL_SHARE`` of the budget (none
    where moving them frees nothing)."""
    def plan(layers):
        return KVPlan(tuple(sorted(layers)), dict(layer_bytes), slots, budget, weights,
                      planned)

    none = plan(())
    if weights + none.device_bytes <= budget:
        return none
    for n in range(1, len(movable) + 1):
        candidate = plan(movable[-n:])
        if weights + candidate.device_bytes <= budget:
            return candidate
    # weights are offloaded anyway: a small cache keeps the layers too small to repay a host
    # layer's cost per step
    small = sum(layer_bytes.values()) <= SMALL_SHARE * budget
    worth = plan([i for i in movable if layer_bytes[i] >= WORTH_MOVING or not small])
    return worth if worth.device_bytes < none.device_bytes else none


def warn_if_over(runtime, layer_bytes: dict[int, int]) -> None:
    """A cache after the first, bigger than the one the plan was made for (a longer
    ``max_cache_len``, a bigger batch): its layers go where the plan put the first's, which
    the compiled graphs are built for, so it may take more of the device than the budget
    gave; said once per size."""
    plan = runtime.plan
    if plan is None or plan.budget is None:
        return
    now = dataclasses.replace(plan, layer_bytes=dict(layer_bytes))
    key = tuple(sorted(layer_bytes.items()))
    if now.device_bytes <= plan.device_bytes or key in _WARNED.setdefault(runtime, set()):
        return
    _WARNED[runtime].add(key)
    log.warning(
        "fx_offload: %s: this KV cache takes %s on the device, more than the %s that "
        "memory_budget's plan gave the first one (made for that cache's size): the budget may "
        "be exceeded. Pass the longest max_cache_len first (a StaticCache given to the first "
        "call), or kv_cache='host' to keep every layer that can move on the host",
        runtime.model_name, format_bytes(now.device_bytes), format_bytes(plan.device_bytes))
