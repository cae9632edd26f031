"""The host's speeds that ``host_compute="auto"`` weighs against the link's, measured once per
machine and cached beside the device's (:mod:`fx_offload.selection.device_rates`: the same
JSON file, a key of its own):

* ``read_rate``: bytes/s of expert weights the host job reads at one token (decode: reading
  the weights is the cost), taken as the runtime runs it: bf16 experts of a mid-sized MoE's
  size, eight picked at random from far more than a last-level cache holds, the kernel run
  from a thread of its own with the job's team (:func:`.kernels.job_threads`).  (A probe on
  a few small experts read them from the cache: 150-280 GB/s on a host whose memory reads
  86.)
* ``flop_rate``: FLOP/s of a host matrix multiply (a prompt: the arithmetic is the cost);
* ``latency``: seconds one layer's host computation costs whatever its size: a round trip of
  tiny tensors between the device and the host with the wait between, and a kernel call on
  tiny weights;
* ``link_rate``: bytes/s from page-locked host memory to the device (the device rates'
  ``h2d_bandwidth`` where they are cached, else measured alone: the whole set's probes take
  gigabytes of device memory, which a call of a model that fills the device does not have).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import statistics
import threading
import time

import torch

from ..selection import device_rates
from . import kernels, native

log = logging.getLogger("fx_offload")

NAMES = ("read_rate", "flop_rate", "latency", "link_rate")
KEY = "host experts v2"     # (v1 read its probe's weights from the cache: measured again)
# the read probe: bf16 experts of Qwen3-30B-A3B's size (9 MiB each), 8 picked a call of 64
# (576 MiB: more than any last-level cache); the flop probe's matmul
PROBE_EXPERTS, PROBE_INNER, PROBE_HIDDEN, PROBE_PICKS = 64, 768, 2048, 8
FLOP_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class HostRates:
    read_rate: float        # bytes/s
    flop_rate: float        # FLOP/s
    latency: float          # seconds per layer and call
    link_rate: float = 0.0  # bytes/s, host to device


def host_rates(device: torch.device) -> HostRates:
    """The host's rates next to ``device``: cached, or measured now (a second or two)."""
    key = f"{KEY} | {device_rates._device_key(torch.device('cpu'), torch.float32)}" \
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
    read = read_rate()
    a, b = torch.randn(512, FLOP_SIZE), torch.randn(FLOP_SIZE, FLOP_SIZE)
    flops = 2 * 512 * FLOP_SIZE * FLOP_SIZE / device_rates._median_seconds(lambda: a @ b, cpu)
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


def read_rate(repeats: int = 9) -> float:
    """Bytes/s the host job reads expert weights at one token (the module's docstring)."""
    E, I, H, k = PROBE_EXPERTS, PROBE_INNER, PROBE_HIDDEN, PROBE_PICKS
    # the values do not change the kernel's speed: a fill is quicker than random numbers
    gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16).fill_(0.01)
    down = torch.empty(E, H, I, dtype=torch.bfloat16).fill_(0.01)
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(E, generator=gen)[:k].reshape(1, k) for _ in range(repeats + 1)]
    x, gates = torch.randn(1, H), torch.full((1, k), 1.0 / k)
    lib = native.library()
    seconds: list[float] = []
    if lib is None:             # torch's path, on this thread
        for ids in picks:
            start = time.perf_counter()
            kernels.routed_experts(x, ids, gates, gate_up, down)
            seconds.append(time.perf_counter() - start)
    else:                       # as a queued job runs: its own thread and team
        floats, ints = native.scratch_sizes(k, H, I, E)
        scratch = (torch.empty(floats), torch.empty(ints, dtype=torch.int64))
        y, picked, job = torch.empty(1, H), ctypes.c_int64(0), native.ExpertsJob()

        def run() -> None:
            for ids in picks:
                native.fill_job(job, gate_up, down, "silu", x, ids, gates, *scratch, y,
                                picked, kernels.job_threads())
                start = time.perf_counter()
                lib.fx_experts_run(ctypes.byref(job))
                seconds.append(time.perf_counter() - start)
        worker = threading.Thread(target=run, name="fx_offload-read-probe")
        worker.start()
        worker.join()
    return k * per_expert / statistics.median(seconds[1:])      # the first: warm-up
