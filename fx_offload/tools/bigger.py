"""``python -m fx_offload bigger``: a model with more weights than the GPU holds, end to end.

The decoder is built on the meta device and materialized on the host only (never on the
GPU), filled with deterministic values, placed with :func:`fx_offload.place` (offloaded
layers into page-locked host blocks, the rest to the GPU), compiled, then run: a prefill and
a greedy decode (no KV cache: each step runs the whole sequence).  The compiled model (inner
``aot_eager``) is checked against the same placed model run eagerly, where each offloaded
layer is loaded synchronously by its hook: the same kernels, so the logits must be equal.
Reports decode ms/token against the copy bound (bytes copied per call over the measured
host-to-device bandwidth), peak GPU memory and host RSS against what the plan predicts.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from .. import place, report
from ..schedule import Schedule
from .bench import h2d_bandwidth
from .models import TinyDecoder

SHAPES = {   # hidden, heads, kv_heads, inner, vocab
    "llama70b": dict(hidden=8192, heads=64, kv_heads=8, inner=28672, vocab=1024),
    "llama8b": dict(hidden=4096, heads=32, kv_heads=8, inner=14336, vocab=1024),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, inner=128, vocab=256),
}
FILL_BLOCK = 1 << 24        # elements of the random block every weight is tiled from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama70b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--num-in-group", type=int, default=1)
    parser.add_argument("--prefetch-step", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=6, help="greedy decode steps")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def build_on_host(shape: dict, layers: int, dtype: torch.dtype) -> TinyDecoder:
    """The decoder built on meta, then given host memory once, filled from one seeded
    random block (fast for 100 GiB; every weight nonzero and small)."""
    with torch.device("meta"):
        model = TinyDecoder(layers, **shape).to(dtype)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    block = (torch.rand(FILL_BLOCK, generator=gen) - 0.5).mul_(0.04).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            for start in range(0, flat.numel(), FILL_BLOCK):
                n = min(FILL_BLOCK, flat.numel() - start)
                flat[start:start + n].copy_(block[:n])
        for name, m in model.named_modules():
            if hasattr(m, "weight") and m.weight is not None and "norm" in name:
                m.weight.fill_(1.0)
        model.rotary.__init__(shape["hidden"] // shape["heads"])
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _greedy(fn, ids, steps, device) -> tuple[torch.Tensor, list[float]]:
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        logits = fn(ids)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        ids = torch.cat([ids, nxt], dim=1)
    return ids, times


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    gpu_total = torch.cuda.get_device_properties(device).total_memory \
        if device.type == "cuda" else None
    started = time.perf_counter()
    model = build_on_host(shape, args.layers, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {args.layers} x {args.shape} on the host in {time.perf_counter() - started:.0f}"
          f" s: {weights / 2**30:.1f} GiB of weights"
          + (f" (the GPU holds {gpu_total / 2**30:.1f} GiB)" if gpu_total else "")
          + f"; host RSS {_rss() / 2**30:.1f} GiB", flush=True)
    started = time.perf_counter()
    place(model, device, group_size=args.group_size, num_in_group=args.num_in_group,
          prefetch_step=args.prefetch_step)
    gc.collect()
    rep = report(model)
    resident = weights - rep.offloaded_bytes
    print(f"placed in {time.perf_counter() - started:.0f} s: {len(rep.layers)} layers "
          f"({rep.offloaded_bytes / 2**30:.1f} GiB) in host blocks, {resident / 2**30:.1f} GiB "
          f"on {device}, {rep.num_slots} slots ({rep.buffer_bytes / 2**30:.2f} GiB); host RSS "
          f"{_rss() / 2**30:.1f} GiB", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compiled = torch.compile(model, backend="prefetch_offload", dynamic=True,
                             options={"inner_backend": "aot_eager"})
    ids = torch.randint(0, shape["vocab"], (1, args.prompt),
                        generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        started = time.perf_counter()
        logits = compiled(ids)
        _sync(device)
        print(f"first call (compile + prefill of {args.prompt} tokens): "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        _sync(device)
        started = time.perf_counter()
        logits = compiled(ids)
        _sync(device)
        prefill_ms = (time.perf_counter() - started) * 1e3
        eager = model(ids)
        same = torch.equal(logits, eager)
        print(f"prefill {prefill_ms:.0f} ms; logits equal to the eager run: {same} (max abs "
              f"diff {(logits.float() - eager.float()).abs().max().item():.3g})", flush=True)
        tokens, times = _greedy(compiled, ids, args.decode, device)
        ref_tokens, _ = _greedy(model, ids, args.decode, device)
    moved = Schedule(rep.layers, rep.num_slots).moved_bytes(rep.layer_bytes)
    bandwidth = h2d_bandwidth(device, 1 << 30)
    bound = moved / bandwidth * 1e3
    decode_ms = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(f"greedy decode of {args.decode} tokens: same tokens as eager: "
          f"{torch.equal(tokens, ref_tokens)}; {decode_ms:.0f} ms/token (median), copy bound "
          f"{bound:.0f} ms ({moved / 2**30:.1f} GiB per call at {bandwidth / 1e9:.1f} GB/s): "
          f"{decode_ms / bound:.3f}x", flush=True)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        print(f"peak GPU memory {peak / 2**30:.2f} GiB; predicted weights on the GPU "
              f"{(resident + rep.buffer_bytes) / 2**30:.2f} GiB (resident {resident / 2**30:.2f}"
              f" + slots {rep.buffer_bytes / 2**30:.2f}), the rest activations", flush=True)
    print(f"host RSS {_rss() / 2**30:.1f} GiB; predicted: offloaded weights "
          f"{rep.offloaded_bytes / 2**30:.1f} GiB plus the runtime", flush=True)
    return 0 if same and torch.equal(tokens, ref_tokens) else 1
