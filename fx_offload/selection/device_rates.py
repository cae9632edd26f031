"""The device's speeds the planner's cost model runs against, measured once and cached.

Four numbers, each measured with a short micro-benchmark on first use for a (device, dtype,
torch version) and cached in a JSON file (``$FX_OFFLOAD_CACHE_DIR`` or
``~/.cache/fx_offload/device_rates.json``), so later compiles do not measure again:

* ``flop_rate``: FLOP/s of a large matrix multiply in the weights' dtype, and with it the
  rates of smaller multiplies and of causal attention (``scaled_dot_product_attention``) at a
  few sizes, since a kernel's rate grows with its size and attention runs slower than a
  matrix multiply; a node's rate is interpolated from these by its FLOPs;
* ``memory_bandwidth``: device memory bytes/s (read plus write of a large copy);
* ``h2d_bandwidth``: bytes/s of a copy from page-locked host memory to the device (on the CPU,
  where offloading is a simulation, a host-to-host copy);
* ``launch_overhead``: host seconds per kernel launch.

Any of them given as a backend option is used as given and not measured.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time

import torch

log = logging.getLogger("fx_offload")

RATE_NAMES = ("flop_rate", "memory_bandwidth", "h2d_bandwidth", "launch_overhead")
CURVE_NAMES = ("matmul_curve", "attention_curve")


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    flop_rate: float            # FLOP/s
    memory_bandwidth: float     # bytes/s
    h2d_bandwidth: float        # bytes/s
    launch_overhead: float      # seconds per kernel
    source: str = "measured"
    matmul_curve: tuple = ()    # ((flops, FLOP/s), ...) by size; empty: flop_rate throughout
    attention_curve: tuple = ()

    def rate(self, flops: float, attention: bool = False) -> float:
        """FLOP/s of a kernel doing ``flops``: interpolated (log-log) from the measured
        curve, clamped at its ends; ``flop_rate`` where no curve was measured."""
        curve = (self.attention_curve if attention else ()) or self.matmul_curve
        if not curve or flops <= 0:
            return self.flop_rate
        if flops <= curve[0][0]:
            return curve[0][1]
        for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
            if flops <= f1:
                w = math.log(flops / f0) / math.log(f1 / f0)
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        return curve[-1][1]

    def describe(self) -> str:
        curve = ""
        if self.attention_curve:
            curve = (f" (matmul {self.matmul_curve[0][1] / 1e12:.3g}..."
                     f"{self.matmul_curve[-1][1] / 1e12:.3g}, attention "
                     f"{self.attention_curve[0][1] / 1e12:.3g}..."
                     f"{self.attention_curve[-1][1] / 1e12:.3g} by size)")
        return (f"{self.flop_rate / 1e12:.3g} TFLOP/s{curve}, memory {self.memory_bandwidth / 1e9:.4g} "
                f"GB/s, host-to-device {self.h2d_bandwidth / 1e9:.4g} GB/s, launch "
                f"{self.launch_overhead * 1e6:.3g} us ({self.source})")


def cache_path() -> str:
    folder = os.environ.get("FX_OFFLOAD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fx_offload")
    return os.path.join(folder, "device_rates.json")


def _device_key(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type} x{torch.get_num_threads()} threads"
    return f"{name} | {dtype} | torch {torch.__version__}"


def _read_cache() -> dict:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, values: dict) -> None:
    path = cache_path()
    data = _read_cache()
    data[key] = values
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:   # a read-only home: measure again next time, say so once
        log.warning("fx_offload: could not cache device rates in %s (%s)", path, err)


def rates_for(device: torch.device, dtype: torch.dtype, given: dict[str, float | None],
              ) -> DeviceRates:
    """Rates for ``device``/``dtype``: the ``given`` ones as they are, the others from the
    cache or, the first time, measured now."""
    missing = [name for name in RATE_NAMES if given.get(name) is None]
    measured: dict[str, float] = {}
    source = "given"
    if missing:
        key = _device_key(device, dtype)
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and all(isinstance(cached.get(n), (int, float))
                                            for n in RATE_NAMES) and \
                all(isinstance(cached.get(n), list) for n in CURVE_NAMES):
            measured, source = cached, f"cached in {cache_path()}"
        else:
            log.warning("fx_offload: measuring %s once for the planner (a few seconds; cached "
                        "in %s)", key, cache_path())
            started = time.perf_counter()
            measured = measure(device, dtype)
            log.warning("fx_offload: measured in %.1f s: %s", time.perf_counter() - started,
                        _rates(measured, {}, "measured").describe())
            _write_cache(key, measured)
            source = "measured"
        if len(missing) < len(RATE_NAMES):
            source += f"; given: {[n for n in RATE_NAMES if n not in missing]}"
    return _rates(measured, given, source)


def _rates(measured: dict, given: dict, source: str) -> DeviceRates:
    values = {n: given[n] if given.get(n) is not None else float(measured[n])
              for n in RATE_NAMES}
    curves = {}
    if given.get("flop_rate") is None:   # a given FLOP rate holds for every kernel
        curves = {n: tuple((float(f), float(r)) for f, r in measured[n]) for n in CURVE_NAMES}
    return DeviceRates(**values, source=source, **curves)


def measure(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    matmul = _matmul_curve(device, dtype)
    rates = {"flop_rate": matmul[-1][1],
             "matmul_curve": matmul,
             "attention_curve": _attention_curve(device, dtype),
             "memory_bandwidth": _memory_bandwidth(device),
             "h2d_bandwidth": _h2d_bandwidth(device),
             "launch_overhead": _launch_overhead(device)}
    if device.type == "cuda":
        # the probes' buffers (a few GiB) go back to the device: place() measures before
        # any weight is there, and a model that fills the GPU needs that memory
        torch.cuda.empty_cache()
    return rates


@dataclasses.dataclass(frozen=True)
class _Probe:
    """The sizes each rate is measured at: a GPU's, and the CPU's (smaller, as the CPU only
    simulates offloading)."""
    matmul_sizes: tuple[int, ...]
    attention_heads: int
    attention_dim: int
    attention_lengths: tuple[int, ...]
    copy_bytes: int
    h2d_bytes: int


_PROBES = {
    "cuda": _Probe((512, 1024, 2048, 4096, 8192), 32, 128, (512, 2048, 8192), 1 << 30, 256 << 20),
    "cpu": _Probe((128, 256, 512), 4, 32, (64, 256), 64 << 20, 64 << 20),
}
LAUNCH_PROBE_CALLS = 2000       # tiny kernels issued back to back to time one launch
LAUNCH_PROBE_ELEMENTS = 16


def _probe(device) -> _Probe:
    return _PROBES["cuda" if device.type == "cuda" else "cpu"]


def _median_seconds(fn, device, repeats: int = 7, inner: int = 10) -> float:
    """Median time of ``fn()`` after one warm-up call: on the GPU CUDA events around
    ``inner`` back-to-back calls (so a small kernel is not timed by its launch), on the CPU a
    wall clock."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _float(dtype):
    return dtype if dtype.is_floating_point else torch.float32


def _matmul_curve(device, dtype) -> list[list[float]]:
    """[flops, FLOP/s] of square matrix multiplies from small to large."""
    curve = []
    for n in _probe(device).matmul_sizes:
        a = torch.randn(n, n, device=device).to(_float(dtype))
        b = torch.randn(n, n, device=device).to(_float(dtype))
        out = torch.empty(n, n, device=device, dtype=_float(dtype))
        flops = 2 * n**3
        curve.append([flops, flops / _median_seconds(lambda: torch.mm(a, b, out=out), device)])
    return curve


def _attention_curve(device, dtype) -> list[list[float]]:
    """[flops, FLOP/s] of causal attention at growing sequence lengths, counted as the cost
    model counts it: half of the full ``4 * s * s * d`` per head."""
    probe = _probe(device)
    heads, dim = probe.attention_heads, probe.attention_dim
    curve = []
    for s in probe.attention_lengths:
        q, k, v = (torch.randn(1, heads, s, dim, device=device).to(_float(dtype))
                   for _ in range(3))
        flops = 2 * heads * s * s * dim
        seconds = _median_seconds(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            device)
        curve.append([flops, flops / seconds])
    return curve


def _memory_bandwidth(device) -> float:
    nbytes = _probe(device).copy_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device)


def _h2d_bandwidth(device) -> float:
    nbytes = _probe(device).h2d_bytes
    host = torch.empty(nbytes, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_seconds(lambda: dst.copy_(host, non_blocking=True), device)


def _launch_overhead(device) -> float:
    """Host time per launch of a tiny kernel, issued back to back (the device keeps up)."""
    x = torch.zeros(LAUNCH_PROBE_ELEMENTS, device=device)
    calls = LAUNCH_PROBE_CALLS

    def burst():
        for _ in range(calls):
            x.add_(1)
    burst()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        burst()
        samples.append((time.perf_counter() - start) / calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)
