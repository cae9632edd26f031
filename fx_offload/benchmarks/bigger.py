"""``python -m fx_offload bigger``: a model with more weights than the GPU holds, end to end.

The decoder is built on the meta device and materialized on the host only (never on the
GPU), filled with deterministic values, placed with :func:`fx_offload.place` (offloaded
layers into page-locked host blocks, the rest to the GPU), compiled, then run: a prefill and
a greedy decode (no KV cache: each step runs the whole sequence).  The compiled model (inner
``aot_eager``) is checked against the same placed model run eagerly, where each offloaded
layer is loaded synchronously by its hook: the same kernels, so the logits must be equal.
Reports decode ms/token against the copy bound (one call's bytes copied alone from the
model's own host blocks), where a decode step's time goes (a profiler trace), peak GPU
memory and host RSS against what the plan predicts.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from .. import place, registry, report
from ..schedule import Schedule
from .bench import h2d_bandwidth
from ..tools.models import TinyDecoder

SHAPES = {   # hidden, heads, kv_heads, inner, vocab
    "llama70b": dict(hidden=8192, heads=64, kv_heads=8, inner=28672, vocab=1024),
    "llama8b": dict(hidden=4096, heads=32, kv_heads=8, inner=14336, vocab=1024),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, inner=128, vocab=256),
}
FILL_BLOCK = 1 << 24        # elements of the random block every weight is tiled from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama70b", choices=sorted(SHAPES),
                        help="layer shapes (tiny: a smoke run)")
    parser.add_argument("--layers", type=int, default=60, help="decoder layers")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--group-size", type=int, default=2, help="option group_size")
    parser.add_argument("--num-in-group", type=int, default=1, help="option num_in_group")
    parser.add_argument("--prefetch-step", type=int, default=2, help="option prefetch_step")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=6, help="greedy decode steps")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="also write the profiler trace of one decode step to DIR")


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
    decode_ms = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(f"greedy decode of {args.decode} tokens: same tokens as eager: "
          f"{torch.equal(tokens, ref_tokens)}; {decode_ms:.0f} ms/token (median), "
          f"{moved / 2**30:.1f} GiB copied per call", flush=True)
    if device.type == "cuda":
        with torch.no_grad():
            where_time_goes(model, compiled, tokens[:, :-1], moved, decode_ms, args.trace)
        peak = torch.cuda.max_memory_allocated(device)
        print(f"peak GPU memory {peak / 2**30:.2f} GiB; predicted weights on the GPU "
              f"{(resident + rep.buffer_bytes) / 2**30:.2f} GiB (resident {resident / 2**30:.2f}"
              f" + slots {rep.buffer_bytes / 2**30:.2f}), the rest activations", flush=True)
    print(f"host RSS {_rss() / 2**30:.1f} GiB; predicted: offloaded weights "
          f"{rep.offloaded_bytes / 2**30:.1f} GiB plus the runtime", flush=True)
    return 0 if same and torch.equal(tokens, ref_tokens) else 1


def where_time_goes(model, compiled, ids, moved: int, decode_ms: float,
                    folder: str | None) -> None:
    """The copy bound and where a decode step's time goes.  The bound is the copy of one
    call's bytes from the model's own host blocks alone, back to back in the call's chunks:
    what the link gives from where the weights live (a fresh pinned buffer, measured beside
    it, reads faster, and on a host holding tens of GiB page-locked its rate varies from run
    to run).  Then a profiler trace of one synchronized step: the copy stream busy, idle
    before its first copy, between copies, after its last."""
    import os
    import tempfile

    from .profiling import copies_alone
    from .trace_bench import last_call, summarize
    device = registry.state_for_model(model).device
    chunked, whole = copies_alone(model, repeats=2), copies_alone(model, False, repeats=2)
    fresh = h2d_bandwidth(device, 1 << 30)
    print(f"copy bound: {moved / 2**30:.1f} GiB from the model's host blocks, copied alone in "
          f"the call's chunks {chunked:.0f} ms ({moved / chunked / 1e6:.1f} GB/s; whole layers "
          f"{whole:.0f} ms; a fresh pinned 1 GiB buffer reads {fresh / 1e9:.1f} GB/s here); "
          f"decode step {decode_ms:.0f} ms = {decode_ms / chunked:.3f}x the bound", flush=True)
    folder = folder or tempfile.mkdtemp(prefix="fx_offload_bigger_")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "bigger_decode_step.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("fx_offload_call"):
                compiled(ids)
                _sync(device)
    prof.export_chrome_trace(path)
    t = summarize(last_call(path))
    print(f"a traced decode step: GPU time {t['span']:.0f} ms = copy stream idle before its "
          f"first copy {t['copy_idle_at_start']:.1f} + copying {t['copy']:.0f} + idle between "
          f"copies {t['copy_gaps']:.1f} + after its last {t['copy_tail']:.1f}; compute busy "
          f"{t['compute']:.0f} ms ({path})", flush=True)
