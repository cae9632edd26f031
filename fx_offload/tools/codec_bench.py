"""``python -m fx_offload codec``: the lossless codec of ``compress="lossless"`` on one layer of
Llama-3-8B shape (bf16 weights drawn normal(0, 0.02), the chunks the default layout makes),
timed on the GPU:

* the ratio (record bytes / raw bytes) and the encode time;
* decode throughput (GB/s of bf16 written), our Triton kernel and the torch-ops fallback,
  and, where the ``dfloat11`` package is importable, DFloat11's Huffman decoder on the same
  weights (``--dfloat11-words`` of them: its encoder is pure Python);
* a layer's copy, raw against record + decode on one stream, as a prefetch does it; and the
  same captured in a CUDA graph and replayed (bitwise checked).

Times are medians of CUDA-event timings.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ..runtime import lossless
from .bench import h2d_bandwidth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per layer")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dfloat11-words", type=int, default=1 << 22,
                        help="bf16 words DFloat11 encodes for its row (0: skip it)")


def _time(fn, repeats: int) -> float:
    """Median ms of ``fn`` on the current stream."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("error: the codec benchmark needs a GPU", file=sys.stderr)
        return 2
    h, i = args.hidden, args.intermediate
    kv = h // 4
    numel = h * h * 2 + h * kv * 2 + 3 * h * i         # q, o, k, v, gate, up, down
    gen = torch.Generator("cuda").manual_seed(0)
    weights = torch.randn(numel, generator=gen, device="cuda").mul_(0.02).bfloat16()
    raw = weights.view(torch.uint8).cpu().pin_memory()
    step = -(-raw.numel() // args.chunks) // 512 * 512
    spans = [(a, min(a + step, raw.numel())) for a in range(0, raw.numel(), step)]
    bandwidth = h2d_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"one layer of {numel * 2 / 2**20:.0f} MiB (hidden {h}, intermediate {i}, bf16 "
          f"normal(0, 0.02)), {len(spans)} chunks; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; pinned H2D {bandwidth / 1e9:.1f} GB/s", flush=True)

    start = time.perf_counter()
    made = [lossless.encode(raw[a:b], torch.device("cuda")) for a, b in spans]
    encode_s = time.perf_counter() - start
    records = [r.pin_memory() for r, _ in made]
    metas = [m for _, m in made]
    packed = sum(m.nbytes for m in metas)
    print(f"ratio {packed / raw.numel():.4f} ({packed / 2**20:.1f} MiB of "
          f"{raw.numel() / 2**20:.1f}); escapes {sum(m.escapes for m in metas)} entries; "
          f"encode {encode_s:.2f} s on the GPU", flush=True)

    dev_records = [r.cuda() for r in records]
    out = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
    rows = []

    def decode_all(fn):
        def go():
            for (a, b), rec, meta in zip(spans, dev_records, metas):
                fn(rec, meta, out[a:b])
        return go
    for name, fn in (("Triton kernel (ours)", lossless.decode),
                     ("torch ops (fallback)", lossless._decode_torch)):
        out.fill_(0xAB)
        ms = _time(decode_all(fn), args.repeats)
        ok = torch.equal(out, weights.view(torch.uint8))
        rows.append((name, raw.numel() / ms / 1e6, ok))
    if args.dfloat11_words:
        few = weights[:args.dfloat11_words]
        rec, meta = lossless.encode(few.view(torch.uint8), torch.device("cuda"))
        rec, small = rec.cuda(), torch.empty_like(few)
        ms = _time(lambda: lossless.decode(rec, meta, small.view(torch.uint8)), args.repeats)
        rows.append((f"Triton kernel (ours), its {few.numel()} words, ratio "
                     f"{meta.nbytes / meta.raw_nbytes:.3f}", 2 * few.numel() / ms / 1e6,
                     torch.equal(small, few)))
        rows.append(_dfloat11(few, args.repeats))

    staging = torch.empty(max(m.nbytes for m in metas), dtype=torch.uint8, device="cuda")

    def copy_raw():
        for a, b in spans:
            out[a:b].copy_(raw[a:b], non_blocking=True)

    def copy_records():
        for (a, b), rec, meta in zip(spans, records, metas):
            staging[:meta.nbytes].copy_(rec, non_blocking=True)
            lossless.decode(staging[:meta.nbytes], meta, out[a:b])
    raw_ms = _time(copy_raw, args.repeats)
    out.fill_(0xAB)
    rec_ms = _time(copy_records, args.repeats)
    copied_ok = torch.equal(out, weights.view(torch.uint8))

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        copy_records()                       # warm on the capture stream
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        copy_records()
    out.fill_(0xAB)
    graph.replay()
    torch.cuda.synchronize()
    graph_ok = torch.equal(out, weights.view(torch.uint8))
    graph_ms = _time(graph.replay, args.repeats)

    print(f"\n{'decoder':34s} {'GB/s of bf16 out':>17s} {'bitwise':>8s}")
    for name, rate, ok in rows:
        print(f"{name:34s} {rate:17.0f} {'yes' if ok else 'NO':>8s}")
    print(f"\n{'a layer copied':42s} {'ms':>7s} {'x raw':>6s} {'bitwise':>8s}")
    bound = packed / bandwidth * 1e3
    for name, ms, ok in (("raw bytes", raw_ms, True),
                         ("records + decode, one stream", rec_ms, copied_ok),
                         ("records + decode, CUDA graph replay", graph_ms, graph_ok)):
        print(f"{name:42s} {ms:7.2f} {ms / raw_ms:6.3f} {'yes' if ok else 'NO':>8s}")
    print(f"(the record bytes alone at {bandwidth / 1e9:.1f} GB/s: {bound:.2f} ms)")
    return 0


def _dfloat11(words: torch.Tensor, repeats: int):
    """DFloat11's decoder on ``words`` (its own encoder, a Huffman code of the exponents)."""
    try:
        import cupy
        import dfloat11.dfloat11 as df
        from dfloat11.dfloat11_utils import encode_weights, get_32bit_codec, get_codec, get_luts
    except Exception as err:                # not installed: a row saying so
        return (f"DFloat11 (not importable: {type(err).__name__})", float("nan"), False)
    import contextlib
    import io
    cpu = words.cpu()
    with contextlib.redirect_stdout(io.StringIO()):     # it prints its code tables
        _, counter = get_codec(cpu)
        codec, _, table = get_32bit_codec(counter)
        luts = get_luts(table)
        encoded, sm, positions, gaps, _ = encode_weights(
            [cpu], codec, df.bytes_per_thread, df.threads_per_block[0])
    dev = [t.cuda() for t in (luts, encoded, sm, positions, gaps)]
    out = torch.empty(cpu.numel(), dtype=torch.bfloat16, device="cuda")
    pos = positions.numpy()
    shared = df.threads_per_block[0] * 4 + 4 + int((pos[1:] - pos[:-1]).max()) * 2
    blocks = -(-encoded.numel() // (df.threads_per_block[0] * df.bytes_per_thread))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def go():
        with stream:
            df._decode(grid=(blocks,), block=df.threads_per_block, shared_mem=shared,
                       args=[dev[0].data_ptr(), dev[1].data_ptr(), dev[2].data_ptr(),
                             dev[3].data_ptr(), dev[4].data_ptr(), out.data_ptr(),
                             luts.shape[0], encoded.numel(), cpu.numel()])
    ms = _time(go, repeats)
    ratio = (encoded.numel() + sm.numel() + positions.numel() * 4 + gaps.numel()) / \
        (2 * cpu.numel())
    ok = torch.equal(out, words)
    return (f"DFloat11 (ratio {ratio:.3f})", 2 * cpu.numel() / ms / 1e6, ok)
