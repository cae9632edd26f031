"""One routed MoE layer's picks split between the device and the host, so that the link and
the host's cores work on the same layer at once (``host_compute="auto"``); and which dense
MLPs stream, whole layers at a time (:func:`mlps_streamed`, :func:`streamed_mlps`).

Each token's first ``m`` picks (the router's strongest) and every pick the device's expert
cache holds run on the device, the rest on the host::

    keep     = (position < m) | cached[ids]            on the device, no host wait
    ids_dev  = where(keep, ids, E)                     E: the sentinel nobody reads
    ids_host = where(keep, E, ids)
    wait_routed(ids_dev)   -> the device's picks cross the link (or come from the cache)
    y = device_experts(x, ids_dev, gates, keep) + host kernel(x, ids_host, gates)

``m`` is chosen per layer and call shape from the measured rates so that both finish
together (:func:`device_picks`): ``m = k`` streams the layer, ``m = 0`` computes it wholly
on the host; the expert cache's hits are free extras on the device.  Where both work, each
runs at its rate measured beside the other (:mod:`.rates`' shared rates); a streamed layer
has the link to itself.  The streams the two parts run on, the rule's terms and the trial
that checks it: docs/host_compute.md (Split between the device and the host; The rule
checked against the clock; Dense MLPs on the host).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..copy_rules import WHOLE_ABOVE, expected_share


def device_picks(tokens: int, k: int, experts: int, expert_bytes: int, element_size: int,
                 other_bytes: int, link_rate: float, host) -> int:
    """``m``, how many of each token's ``k`` picks the device computes: the ``m`` minimizing
    :func:`layer_seconds`.  0 keeps every pick on the host; ``k`` streams the layer; a tie
    goes to the device (the host's part would add a round trip for nothing)."""
    shape = (tokens, k, experts, expert_bytes, element_size, other_bytes, link_rate, host)
    best, best_time = k, layer_seconds(k, *shape)
    for m in range(k - 1, -1, -1):
        time = layer_seconds(m, *shape)
        if time < best_time * (1 - 1e-9):
            best, best_time = m, time
    return best


def layer_seconds(m: int, tokens: int, k: int, experts: int, expert_bytes: int,
                  element_size: int, other_bytes: int, link_rate: float, host) -> float:
    """A layer's predicted time with each token's first ``m`` picks on the device: the
    larger of the link's time and the host's.  The link carries the layer's ``other_bytes``
    (its streamed non-expert chunks) and the distinct experts the first ``m`` positions
    pick (all ``k``: the layer streams, its chunk whole where most experts are picked);
    the host reads the experts the other positions pick and computes on them.  ``host``:
    :class:`~fx_offload.host_compute.rates.HostRates` (its shared rates where both work;
    ``link_rate`` is the link's alone)."""
    host_seconds = 0.0
    if m < k:
        share = expected_share(experts, k - m, tokens)
        host_seconds = experts * share * expert_bytes / host.read_beside_link + \
            2 * tokens * (k - m) * (expert_bytes / element_size) / host.flop_rate + \
            host.latency
    # where the call's tokens pick most experts, the device's routed wait loads the chunk
    # whole, whatever its share of the picks (it sees every token's ids)
    whole = expected_share(experts, k, tokens) > WHOLE_ABOVE
    share = 0.0 if not m else 1.0 if whole else expected_share(experts, m, tokens)
    rate = link_rate if m == k else (host.shared_link_rate or link_rate)
    return max((other_bytes + experts * share * expert_bytes) / rate, host_seconds)


def keep_on_device(ids: torch.Tensor, m: int, where: torch.Tensor | None) -> torch.Tensor:
    """Which picks of ``ids`` (T, k) the device computes: the first ``m`` of each token, and
    every pick that ``where`` (expert -> its row in the device's cache, -1 for none; one
    entry more than experts) says is cached."""
    keep = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    keep[:, :m] = True
    if where is not None:
        keep |= where[ids.clamp(0, where.numel() - 1)] >= 0
    return keep


def device_experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, keep: torch.Tensor,
                   first: int | None = None) -> torch.Tensor:
    """``sum_j keep[t, j] * gates[t, j] * down[e] @ (silu(gate) * up)`` in fp32, (T, H), for
    transformers' fused layout (``gate_up [E, 2I, H]``, gate rows first, ``down [E, H, I]``).
    Rows of experts no kept pick names may hold anything (a slot's stale bytes): their
    products are dropped with ``where``, never multiplied by zero (0 * NaN is NaN).
    ``first``: keep holds each token's first ``first`` picks and no other, so only those
    are computed (the gathered weights, a temporary of a whole expert per pick, are
    ``first / k`` of them: 226 MB instead of 604 at Qwen3-30B-A3B's shapes, 8 tokens, 3
    of 8 picks)."""
    if first is not None:
        ids, gates, keep = ids[:, :first], gates[:, :first], keep[:, :first]
    T, k = ids.shape
    safe = torch.where(keep, ids, 0).reshape(-1)
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)                 # (T*k, H, 1)
    h = torch.bmm(gate_up[safe], rows.to(gate_up.dtype)).squeeze(-1)   # (T*k, 2I)
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    out = torch.bmm(down[safe], act.unsqueeze(-1)).squeeze(-1).float()  # (T*k, H)
    out = out * gates.reshape(-1, 1).float()
    out = torch.where(keep.reshape(-1, 1), out, 0.0)
    return out.view(T, k, -1).sum(dim=1)


def mlps_streamed(tokens: int, count: int, mlp_bytes: float, element_size: int,
                  other_bytes: int, host) -> int:
    """How many of a call's ``count`` host-computable dense MLPs stream (the rest compute
    on the host): the number minimizing :func:`mlps_seconds`, a tie going to the device.
    Whole MLPs, not a share of each: a streamed MLP's chunks copy as any other, and the
    host's MLPs let the link fetch the next layers meanwhile."""
    shape = (tokens, count, mlp_bytes, element_size, other_bytes, host)
    return min(range(count + 1), key=lambda m: (mlps_seconds(m, *shape), -m))


def mlps_seconds(m: int, tokens: int, count: int, mlp_bytes: float, element_size: int,
                 other_bytes: int, host) -> float:
    """A call's predicted time with ``m`` of its ``count`` MLPs (``mlp_bytes`` each)
    streamed: the larger of the link's time (``other_bytes``, the call's other offloaded
    chunks, and the streamed MLPs) and the host's (reading the others, their arithmetic,
    a round trip each).  ``host``: :class:`~fx_offload.host_compute.rates.HostRates`."""
    host_seconds = (count - m) * (mlp_bytes / host.read_beside_link + host.latency +
                                  2 * tokens * (mlp_bytes / element_size) / host.flop_rate)
    rate = host.link_rate if m == count else host.link_beside_reads
    return max((other_bytes + m * mlp_bytes) / max(rate, 1.0), host_seconds)


def streamed_mlps(m: int, hosted: list[int], layers: tuple[int, ...], slots: int) -> frozenset:
    """Which ``m`` of the ``hosted`` layers' MLPs stream.  A streamed MLP's copy may begin
    only once its slot's previous occupant is done with those bytes, at once if that one
    computed its MLP on the host (its op begins the refill), else after its MLP ran.  So
    whole rounds of ``slots`` consecutive offloaded layers (``layers``, the schedule's order;
    one a slot) stream, spread evenly among the rounds that compute on the host: every
    streamed layer then follows a hosted one in its slot.  One slot: every ``k``-th layer;
    two slots, half streamed: ``H H S S H H S S``."""
    rounds: dict[int, list[int]] = {}
    wanted = set(hosted)
    for position, layer in enumerate(layers):
        if layer in wanted:
            rounds.setdefault(position // max(slots, 1), []).append(layer)
    order = sorted(rounds)
    if m <= 0 or not order:
        return frozenset()
    count = len(order)
    for taken in range(1, count + 1):
        chosen = [order[i] for i in range(count) if (i + 1) * taken // count > i * taken // count]
        if sum(len(rounds[r]) for r in chosen) >= m:
            break
    return frozenset([layer for r in chosen for layer in rounds[r]][:m])
