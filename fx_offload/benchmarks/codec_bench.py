"""``python -m fx_offload codec``: the lossless codec of ``compress="lossless"`` on one layer of
Llama-3-8B shape (bf16 weights drawn normal(0, 0.02), the chunks the default layout makes),
timed on the GPU:

* the ratio (record bytes / raw bytes) and the encode time;
* decode throughput (GB/s of bf16 written), our Triton kernel and the torch-ops fallback,
  and, where the ``dfloat11`` package is importable, DFloat11's Huffman decoder on the same
  weights (``--dfloat11-words`` of them: its encoder is pure Python); where nvCOMP's Python
  package (``nvidia-nvcomp-cu13``) is importable, its ANS, GDeflate and Bitcomp codecs on the
  whole layer: ratio, decode throughput, and whether its decode can be captured in a CUDA
  graph and replayed right;
* a layer's copy: raw, record and decode on one stream (a synchronous load), record on the
  copy stream and decode on the decode stream (a prefetch), the same without the device
  check of each record's checksum (what that check costs), and the prefetch captured in a
  CUDA graph and replayed; each checked bitwise; for our records and, where nvCOMP is
  installed, for the nvCOMP ANS records ``compress="lossless"`` makes by default there.

Times are medians of CUDA-event timings.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from ..layout import Chunk
from ..codecs import ans, lossless
from ..runtime.memory.compressed import CompressedBlock, StagedCopies
from .bench import h2d_bandwidth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=4096, help="the layer's hidden size")
    parser.add_argument("--intermediate", type=int, default=14336,
                        help="the layer's MLP intermediate size")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per layer")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each row")
    parser.add_argument("--dfloat11-words", type=int, default=1 << 22,
                        help="bf16 words DFloat11 encodes for its row (0: skip it)")
    parser.add_argument("--nvcomp", default="ANS,ANS:<f2,GDeflate:0,Bitcomp:<u2",
                        help="comma-separated nvCOMP codecs (algorithm[:data type or GDeflate "
                             "level]) for their rows; empty: skip them")


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

    chunks = [Chunk(k, a, b, ()) for k, (a, b) in enumerate(spans)]
    blocks = {name: _block(raw, chunks, name) for name in ("fx_offload", "nvcomp")
              if name == "fx_offload" or ans.available(torch.device("cuda"))}
    block = blocks["fx_offload"]
    metas = [block.meta[c.index] for c in chunks]
    dev_records = [block.record_of(c).cuda() for c in chunks]
    out = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
    want = weights.view(torch.uint8)
    rows = []

    def decode_all(fn, records, metas):
        def go():
            for (a, b), rec, meta in zip(spans, records, metas):
                fn(rec, meta, out[a:b])
        return go
    for name, fn in (("Triton kernel (ours)", lossless.decode),
                     ("torch ops (fallback)", lossless._decode_torch)):
        out.fill_(0xAB)
        ms = _time(decode_all(fn, dev_records, metas), args.repeats)
        rows.append((name, raw.numel() / ms / 1e6, torch.equal(out, want)))
    if "nvcomp" in blocks:      # nvCOMP's records as fx_offload makes them, chunk by chunk
        nv = blocks["nvcomp"]
        out.fill_(0xAB)
        ms = _time(decode_all(ans.decode, [nv.record_of(c).cuda() for c in chunks],
                              [nv.meta[c.index] for c in chunks]), args.repeats)
        rows.append(("nvCOMP ANS (the records fx_offload makes)", raw.numel() / ms / 1e6,
                     torch.equal(out, want)))
    if args.dfloat11_words:
        few = weights[:args.dfloat11_words]
        rec, meta = lossless.encode(few.view(torch.uint8), torch.device("cuda"))
        rec, small = rec.cuda(), torch.empty_like(few)
        ms = _time(lambda: lossless.decode(rec, meta, small.view(torch.uint8)), args.repeats)
        rows.append((f"Triton kernel (ours), its {few.numel()} words, ratio "
                     f"{meta.nbytes / meta.raw_nbytes:.3f}", 2 * few.numel() / ms / 1e6,
                     torch.equal(small, few)))
        rows.append(_dfloat11(few, args.repeats))
    library = [_nvcomp(want, spec, args.repeats) for spec in args.nvcomp.split(",") if spec]

    timed = [("raw bytes, copy stream", _time(_raw_copy(raw, spans, out), args.repeats), None)]
    for name, packed in blocks.items():
        timed += _layer_copies(packed, chunks, out, want, args.repeats, name)
    timed[0] = timed[0][:2] + (_checked(_raw_copy(raw, spans, out), out, want, []),)
    _print_tables(rows, timed, library, bandwidth, raw.numel())
    return 0


def _block(raw: torch.Tensor, chunks, codec: str) -> CompressedBlock:
    """The layer's records made by ``codec`` (``"fx_offload"`` or ``"nvcomp"``), with its
    ratio and encode time printed."""
    before = os.environ.get(ans.ENV)
    os.environ[ans.ENV] = codec
    try:
        start = time.perf_counter()
        block = CompressedBlock("the layer", raw, chunks, lambda c: True,
                                torch.device("cuda"), pin=True, align=512)
        torch.cuda.synchronize()
        encode_s = time.perf_counter() - start
    finally:
        os.environ.pop(ans.ENV)
        if before is not None:
            os.environ[ans.ENV] = before
    if block.sums is not None:          # the device check of each copy, as a model has it
        block.flags = torch.zeros(block.sums.numel(), dtype=torch.int32, pin_memory=True)
    packed = sum(block.chunk_nbytes(c) for c in chunks)
    print(f"{block.codec.NAME}: ratio {packed / raw.numel():.4f} ({packed / 2**20:.1f} MiB of "
          f"{raw.numel() / 2**20:.1f}, {len(block.meta)} of {len(chunks)} chunks encoded); "
          f"encode {encode_s:.2f} s on the GPU", flush=True)
    return block


def _raw_copy(raw: torch.Tensor, spans, out: torch.Tensor):
    copy_stream, fork, done = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()

    def go():
        fork.record()
        copy_stream.wait_event(fork)
        with torch.cuda.stream(copy_stream):
            for a, b in spans:
                out[a:b].copy_(raw[a:b], non_blocking=True)
            done.record(copy_stream)
        torch.cuda.current_stream().wait_event(done)
    return go


def _checked(fn, out: torch.Tensor, want: torch.Tensor, buffers) -> bool:
    """One run from poisoned slot and staging buffers: every byte written, and no decode read
    a staging buffer before its record landed (repeated runs copy the same records, so a
    timed run's result would not show that)."""
    torch.cuda.synchronize()
    for buffer in [out, *buffers]:
        buffer.fill_(0xAB)
    torch.cuda.synchronize()        # the copy stream does not wait for the compute stream
    fn()
    torch.cuda.synchronize()
    return torch.equal(out, want)


def _layer_copies(block: CompressedBlock, chunks, out, want, repeats: int, codec: str):
    """(name, ms, bitwise) of a layer's copy from ``block``'s records: a synchronous load, a
    prefetch on the copy and decode streams, and that captured in a CUDA graph."""
    staging = torch.empty(block.staging_nbytes, dtype=torch.uint8, device="cuda")
    copy_stream = torch.cuda.Stream()
    staged = StagedCopies(torch.device("cuda"), block.staging_nbytes)
    fork, done = torch.cuda.Event(), [torch.cuda.Event() for _ in chunks]
    capturing = [False]
    buffers = [staging, *staged.buffers]

    def copy_one_stream():
        for c in chunks:
            block.copy_in(c, out[c.start:c.end], staging, non_blocking=True)

    def copy_staged():
        fork.record()
        for c in chunks:
            staged.copy(block, c, out[c.start:c.end], copy_stream, fork, done[c.index],
                        capturing[0])
        for event in done:
            torch.cuda.current_stream().wait_event(event)
    def unchecked():                    # without the device check of each record
        flags, block.flags = block.flags, None
        try:
            copy_staged()
        finally:
            block.flags = flags
    timed = []
    for name, fn in ((f"{codec}: records + decode, one stream", copy_one_stream),
                     (f"{codec}: records + decode, copy and decode streams", copy_staged),
                     (f"{codec}: the same without the device check", unchecked)):
        print(f"  timing {name}", flush=True)
        timed.append((name, _time(fn, repeats), _checked(fn, out, want, buffers)))
    if block.flags is not None and block.flags.any():
        raise AssertionError("the device check found an intact record corrupt")
    print(f"  timing {codec}: a CUDA graph", flush=True)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    capturing[0] = True
    with torch.cuda.graph(graph):
        copy_staged()
    capturing[0] = False
    timed.append((f"{codec}: the same, a CUDA graph replayed", _time(graph.replay, repeats),
                  _checked(graph.replay, out, want, buffers)))
    record = sum(block.chunk_nbytes(c) for c in chunks)
    timed.append((f"{codec}: (its record bytes alone at the measured H2D)", None, record))
    return timed


def _print_tables(rows, timed, library, bandwidth: float, raw_nbytes: int) -> None:
    """The decoders' throughput, a layer's copy each way, and nvCOMP's codecs."""
    print(f"\n{'decoder':56s} {'GB/s of bf16 out':>17s} {'bitwise':>8s}")
    for name, rate, ok in rows:
        print(f"{name:56s} {rate:17.0f} {'yes' if ok else 'NO':>8s}")
    print(f"\n{'a layer copied':58s} {'ms':>7s} {'x raw':>6s} {'bitwise':>8s}")
    raw_ms = timed[0][1]
    for name, ms, ok in timed:
        if ms is None:              # a bound: ``ok`` holds the record bytes
            ms, ok = ok / bandwidth * 1e3, "-"
        else:
            ok = "yes" if ok else "NO"
        print(f"{name:58s} {ms:7.2f} {ms / raw_ms:6.3f} {ok:>8s}")
    if library:
        print(f"\n{'nvCOMP, the whole layer as one buffer':44s} {'ratio':>6s} "
              f"{'GB/s out':>9s} {'bitwise':>8s}  captured in a CUDA graph")
        for name, ratio, rate, ok, captured in library:
            print(f"{name:44s} {ratio:6.3f} {rate:9.0f} {'yes' if ok else 'NO':>8s}  {captured}")
    print(f"(the raw bytes alone at {bandwidth / 1e9:.1f} GB/s: "
          f"{raw_nbytes / bandwidth * 1e3:.2f} ms)")


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


def _nvcomp(raw: torch.Tensor, spec: str, repeats: int):
    """(name, ratio, GB/s of output, bitwise, captured) of nvCOMP's codec ``spec`` on the bytes
    ``raw`` (on the GPU): encoded by nvCOMP on the GPU, decoded into a buffer of ours with a
    decompression config made once (the sync-free decode), and that decode captured in a
    CUDA graph on a stream of its own and replayed from a poisoned buffer."""
    algorithm, _, extra = spec.partition(":")
    options = {"algorithm": algorithm}
    if extra:
        options["algorithm_type" if extra.isdigit() else "data_type"] = \
            int(extra) if extra.isdigit() else extra
    name = f"{algorithm}" + (f" ({extra})" if extra else "")
    try:
        from nvidia import nvcomp
    except Exception as err:                # not installed: a row saying so
        return (f"{name}: nvCOMP not importable ({type(err).__name__})", float("nan"),
                float("nan"), False, "-")
    out = torch.empty_like(raw)
    try:
        stream = torch.cuda.current_stream()
        codec = nvcomp.Codec(device_id=raw.device.index or 0, cuda_stream=stream.cuda_stream,
                             **options)
        packed = codec.encode(nvcomp.as_array(raw))
        config = codec.decompression_config(packed)     # reads the header: one sync, here
        ms = _time(lambda: codec.decode(packed, out=out, decompression_config=config), repeats)
        out.fill_(0xAB)
        codec.decode(packed, out=out, decompression_config=config)
        torch.cuda.synchronize()
        ok = torch.equal(out, raw)
        ratio = packed.buffer_size / raw.numel()
    except Exception as err:
        return (f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:60]}", float("nan"),
                float("nan"), False, "-")
    return (name, ratio, raw.numel() / ms / 1e6, ok,
            _captured(lambda s: nvcomp.Codec(device_id=raw.device.index or 0,
                                             cuda_stream=s.cuda_stream, **options),
                      packed, out, raw))


def _captured(make_codec, packed, out: torch.Tensor, want: torch.Tensor) -> str:
    """Whether a decode by a codec on a capture stream is captured and its replay is right."""
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            codec = make_codec(side)
            config = codec.decompression_config(packed)
            codec.decode(packed, out=out, decompression_config=config)     # warm up
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            codec.decode(packed, out=out, decompression_config=config)
        out.fill_(0xAB)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as err:
        torch.cuda.synchronize()
        return f"no: {type(err).__name__}: {str(err).splitlines()[0][:70]}"
    return "yes, replayed bitwise" if torch.equal(out, want) else "captured, replay WRONG"
