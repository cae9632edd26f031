"""Measure the weight copies: how much of their time a profiler trace shows hidden behind
compute, and how long they take alone, from the model's own host blocks."""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .. import registry


@dataclasses.dataclass
class Overlap:
    copy_ms: float            # host-to-device copy time on the copy stream
    overlapped_ms: float      # part of it during which a compute kernel ran
    copies: int
    kernels: int

    @property
    def fraction(self) -> float:
        return self.overlapped_ms / self.copy_ms if self.copy_ms else 0.0

    def __str__(self) -> str:
        return (f"{self.copies} H2D copies, {self.copy_ms:.3f} ms; {self.overlapped_ms:.3f} ms "
                f"of it overlapped compute kernels ({self.fraction:.1%}), {self.kernels} kernels")


def _merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap_from_events(events, copy_stream_id: int | None = None) -> Overlap:
    """``events``: ``torch.profiler`` kernel/memcpy events (``prof.events()``).  Copies are
    the HtoD memcpys (on ``copy_stream_id`` if given); compute is every other GPU kernel."""
    copies, kernels = [], []
    for ev in events:
        name = ev.name
        kind = getattr(getattr(ev, "device_type", None), "name", "")
        if kind != "CUDA":
            continue
        start = ev.time_range.start
        end = ev.time_range.end
        if "Memcpy HtoD" in name:
            if copy_stream_id is None or getattr(ev, "device_resource_id", None) == copy_stream_id:
                copies.append((start, end))
        elif "Memcpy" not in name and "Memset" not in name:
            kernels.append((start, end))
    busy = _merge(kernels)
    total = sum(e - s for s, e in copies)
    hidden = 0.0
    for s, e in copies:
        for ks, ke in busy:
            if ke <= s:
                continue
            if ks >= e:
                break
            hidden += min(e, ke) - max(s, ks)
    return Overlap(total / 1e3, hidden / 1e3, len(copies), len(kernels))


def copies_alone(model, chunked: bool = True, repeats: int = 3) -> float:
    """Median ms to copy one call's bytes (each refilled layer once) from ``model``'s own host
    blocks into device memory, back to back on a side stream with nothing else running: in
    the call's chunks, or each layer whole.  What the link gives from where the weights
    live, to set beside a fresh pinned buffer's rate and beside the call itself."""
    state = registry.state_for_model(model)
    layers = state.schedule.refilled_layers()
    blocks = {layer: state.buffers.block_of(layer) for layer in layers}
    pieces = [(blocks[layer], c.start, c.end) if chunked else (blocks[layer], 0,
                                                                blocks[layer].numel())
              for layer in layers for c in (state.learned.layout[layer] if chunked else [None])]
    scratch = torch.empty(max(b.numel() for b in blocks.values()), dtype=torch.uint8,
                          device=state.device)
    stream = torch.cuda.Stream(state.device)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(state.device)
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            for block, a, b in pieces:
                scratch[a:b].copy_(block[a:b], non_blocking=True)
        torch.cuda.synchronize(state.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def link_gaps(events, after_us: float = 0.0, top: int = 4, kernels: tuple = ()) -> str:
    """How busy the link was from the first host-to-device copy that starts ``after_us``
    (profiler time) to the last one: busy and idle ms, and the longest idle gaps, each
    with where it began (ms after the first copy).  ``kernels``: names of kernels that
    move bytes across the link too (the routed experts' gather reads host memory): they
    count as busy, and their total time is given."""
    copies, moving = [], []
    for ev in events:
        if getattr(getattr(ev, "device_type", None), "name", "") != "CUDA" or \
                ev.time_range.start < after_us:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        if "Memcpy HtoD" in ev.name:
            copies.append(span)
        elif any(k in ev.name for k in kernels):
            moving.append(span)
    busy = _merge(copies + moving)
    if not busy:
        return "no host-to-device copy in the trace"
    first, last = busy[0][0], busy[-1][1]
    gaps = sorted(((b[0] - a[1], a[1] - first) for a, b in zip(busy, busy[1:])), reverse=True)
    busy_us = sum(e - s for s, e in busy)
    longest = ", ".join(f"{g / 1e3:.2f} ms at {at / 1e3:.1f}" for g, at in gaps[:top])
    split = (f" (copies {sum(e - s for s, e in copies) / 1e3:.2f} ms, {'/'.join(kernels)} "
             f"{sum(e - s for s, e in moving) / 1e3:.2f} ms)") if kernels else ""
    return (f"link busy {busy_us / 1e3:.2f} of {(last - first) / 1e3:.2f} ms "
            f"({busy_us / (last - first):.1%}){split}; longest idle gaps: {longest or '-'}")
