"""The host's speeds that ``host_compute="auto"`` weighs against the link's, measured once per
machine and cached beside the device's (:mod:`fx_offload.selection.device_rates`: the same
JSON file, a key of its own):

* ``read_rate``: bytes/s of expert weights :func:`.kernels.routed_experts` reads, one token
  on each of a few experts (decode: reading the weights is the cost);
* ``flop_rate``: FLOP/s of a host matrix multiply (a prompt: the arithmetic is the cost);
* ``latency``: seconds one layer's host computation costs whatever its size: a round trip of
  tiny tensors between the device and the host with the wait between, and a kernel call on
  tiny weights;
* ``link_rate``: bytes/s from page-locked host memory to the device (the device rates'
  ``h2d_bandwidth`` where they are cached, else measured alone: the whole set's probes take
  gigabytes of device memory, which a call of a model that fills the device does not have).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..selection import device_rates
from . import kernels

log = logging.getLogger("fx_offload")

NAMES = ("read_rate", "flop_rate", "latency", "link_rate")
# the probe: experts as large as a mid-sized MoE's (fp32 here: 12 MiB each), 4 of them
PROBE_EXPERTS, PROBE_INNER, PROBE_HIDDEN = 4, 768, 1024


@dataclasses.dataclass(frozen=True)
class HostRates:
    read_rate: float        # bytes/s
    flop_rate: float        # FLOP/s
    latency: float          # seconds per layer and call
    link_rate: float = 0.0  # bytes/s, host to device


def host_rates(device: torch.device) -> HostRates:
    """The host's rates next to ``device``: cached, or measured now (a second or two)."""
    key = f"host experts | {device_rates._device_key(torch.device('cpu'), torch.float32)}" \
        f" | beside {device_rates._device_key(device, torch.float32)}"
    cached = device_rates._read_cache().get(key)
    if isinstance(cached, dict) and all(isinstance(cached.get(n), (int, float)) for n in NAMES):
        return HostRates(*(float(cached[n]) for n in NAMES))
    started = time.perf_counter()
    values = measure(device)
    log.warning("fx_offload: measured the host's rates for host_compute='auto' in %.1f s: %s "
                "(cached in %s)", time.perf_counter() - started, values,
                device_rates.cache_path())
    device_rates._write_cache(key, values)
    return HostRates(*(values[n] for n in NAMES))


def measure(device: torch.device) -> dict[str, float]:
    cpu = torch.device("cpu")
    gate_up = torch.randn(PROBE_EXPERTS, 2 * PROBE_INNER, PROBE_HIDDEN)
    down = torch.randn(PROBE_EXPERTS, PROBE_HIDDEN, PROBE_INNER)
    x = torch.randn(PROBE_EXPERTS, PROBE_HIDDEN)
    ids = torch.arange(PROBE_EXPERTS).reshape(-1, 1)       # one token on each expert
    gates = torch.ones(PROBE_EXPERTS, 1)
    read = (gate_up.numel() + down.numel()) * 4 / device_rates._median_seconds(
        lambda: kernels.routed_experts(x, ids, gates, gate_up, down), cpu)
    a, b = torch.randn(512, PROBE_HIDDEN), torch.randn(PROBE_HIDDEN, PROBE_HIDDEN)
    flops = 2 * 512 * PROBE_HIDDEN * PROBE_HIDDEN / device_rates._median_seconds(
        lambda: a @ b, cpu)
    tiny = (torch.randn(1, 8), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
            torch.randn(1, 8, 8), torch.randn(1, 8, 4))

    def round_trip():
        there = tiny[0].to(device)
        back = there.to("cpu", non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        out = kernels.routed_experts(back, *tiny[1:])
        return out.to(device, non_blocking=True)
    latency = device_rates._median_seconds(round_trip, cpu)
    cached = device_rates._read_cache().get(device_rates._device_key(device, torch.float32))
    link = cached.get("h2d_bandwidth") if isinstance(cached, dict) else None
    if not isinstance(link, (int, float)):
        link = device_rates._h2d_bandwidth(device)
    return {"read_rate": read, "flop_rate": flops, "latency": latency, "link_rate": link}
