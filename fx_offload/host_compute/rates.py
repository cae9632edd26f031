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
  gigabytes of device memory, which a call of a model that fills the device does not have);
* ``shared_read_rate`` and ``shared_link_rate``: the same two measured at once, the read
  probe's jobs run back to back while the copy engine copies from page-locked memory.  Both
  read the host's memory, and a split layer runs both: :mod:`.split` weighs a split with
  these (0 where there is no link: the rates alone stand in).
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

NAMES = ("read_rate", "flop_rate", "latency", "link_rate", "shared_read_rate",
         "shared_link_rate")
# a new version whenever the probe or the kernel changes, so that each machine measures again
KEY = "host experts v5"
# the read probe: bf16 experts of Qwen3-30B-A3B's size (9 MiB each), 8 picked a call of 64
# (576 MiB: more than any last-level cache); the flop probe's matmul
PROBE_EXPERTS, PROBE_INNER, PROBE_HIDDEN, PROBE_PICKS = 64, 768, 2048, 8
FLOP_SIZE = 1024
SHARED_COPY, SHARED_COPIES = 256 << 20, 8     # the copies the shared probe runs: 2 GiB


@dataclasses.dataclass(frozen=True)
class HostRates:
    read_rate: float        # bytes/s
    flop_rate: float        # FLOP/s
    latency: float          # seconds per layer and call
    link_rate: float = 0.0  # bytes/s, host to device
    shared_read_rate: float = 0.0   # bytes/s read while the link copies (0: not measured)
    shared_link_rate: float = 0.0   # bytes/s copied while the host reads (0: not measured)

    @property
    def read_beside_link(self) -> float:
        """The host's read rate while the link copies too."""
        return self.shared_read_rate or self.read_rate

    @property
    def link_beside_reads(self) -> float:
        """The link's rate while the host's cores read too."""
        return self.shared_link_rate or self.link_rate


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
    shared_read, shared_link = shared_rates(device) if device.type == "cuda" else (0.0, 0.0)
    return {"read_rate": read, "flop_rate": flops, "latency": latency, "link_rate": link,
            "shared_read_rate": shared_read, "shared_link_rate": shared_link}


def read_rate(repeats: int = 9) -> float:
    """Bytes/s the host job reads expert weights at one token (the module's docstring)."""
    probe = _ReadProbe(repeats)
    return probe.rate(probe.run())


def shared_rates(device: torch.device, repeats: int = 9) -> tuple[float, float]:
    """(read rate, link rate) in bytes/s while both run: the read probe's jobs back to back
    while ``SHARED_COPIES`` copies of ``SHARED_COPY`` bytes cross from page-locked memory on
    a stream of their own; the jobs that ran while the copies did are counted."""
    probe = _ReadProbe(repeats)
    source = torch.empty(SHARED_COPY, dtype=torch.uint8).pin_memory()
    target = torch.empty(SHARED_COPY, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source)            # warm-up: the first copy sets the path up
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        begin.record()
        for _ in range(SHARED_COPIES):
            target.copy_(source, non_blocking=True)
        end.record()
    seconds = probe.run(until=end.query)
    end.synchronize()
    link = SHARED_COPIES * SHARED_COPY / (begin.elapsed_time(end) / 1e3)
    return probe.rate(seconds), link


class _ReadProbe:
    """The read probe's weights and picks, run as the runtime's queued job runs."""

    def __init__(self, repeats: int):
        E, I, H, k = PROBE_EXPERTS, PROBE_INNER, PROBE_HIDDEN, PROBE_PICKS
        # the values do not change the kernel's speed: a fill is quicker than random numbers
        self.gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16).fill_(0.01)
        self.down = torch.empty(E, H, I, dtype=torch.bfloat16).fill_(0.01)
        self.per_expert = (self.gate_up[0].numel() + self.down[0].numel()) * 2
        gen = torch.Generator().manual_seed(0)
        self.picks = [torch.randperm(E, generator=gen)[:k].reshape(1, k)
                      for _ in range(repeats + 1)]
        self.x, self.gates = torch.randn(1, H), torch.full((1, k), 1.0 / k)

    def rate(self, seconds: list[float]) -> float:
        return PROBE_PICKS * self.per_expert / statistics.median(seconds[1:])  # [0]: warm-up

    def run(self, until=None) -> list[float]:
        """Seconds of each job: one per pick set, or (``until`` given) the pick sets over
        and over until ``until()`` is true (at least two)."""
        lib = native.library()
        seconds: list[float] = []

        def sets():
            i = 0
            while True:
                yield self.picks[i % len(self.picks)]
                i += 1
                if (until is None and i == len(self.picks)) or \
                        (until is not None and i >= 2 and until()):
                    return
        if lib is None:             # torch's path, on this thread
            for ids in sets():
                start = time.perf_counter()
                kernels.routed_experts(self.x, ids, self.gates, self.gate_up, self.down)
                seconds.append(time.perf_counter() - start)
            return seconds
        floats, ints = native.scratch_sizes(PROBE_PICKS, PROBE_HIDDEN, PROBE_INNER,
                                            PROBE_EXPERTS)
        scratch = (torch.empty(floats), torch.empty(ints, dtype=torch.int64))
        y, record, job = torch.empty(1, PROBE_HIDDEN), native.JobRecord(), native.ExpertsJob()

        def run() -> None:          # as a queued job runs: its own thread and team
            for ids in sets():
                native.fill_job(job, self.gate_up, self.down, "silu", self.x, ids,
                                self.gates, *scratch, y, record, kernels.job_threads())
                start = time.perf_counter()
                lib.fx_experts_run(ctypes.byref(job))
                seconds.append(time.perf_counter() - start)
        worker = threading.Thread(target=run, name="fx_offload-read-probe")
        worker.start()
        worker.join()
        return seconds
