"""``python -m fx_offload host``: what the host's cores reach computing with weights in host
memory, against the link that would otherwise carry those weights to the GPU.

Rows: the host's read rate (a multithreaded fp32 sum over a tensor bigger than any cache);
the pinned host-to-device copy rate (CUDA only); both at once (the copy engine copying one
pinned buffer while the cores sum another, each one's rate while together); then each kernel
path of :mod:`fx_offload.host_compute.kernels` at decode shapes: Qwen3-30B-A3B's routed
experts and Llama-3-8B's dense MLP and attention projections, at 1 and 8 tokens; and decode
attention over a 64k-token KV cache in host memory (the host attention kernel of
``kv_cache="host"`` with ``host_compute``, and torch's ``sdpa``).

GB/s counts the weight bytes a call reads (for experts, the distinct experts picked times
``3 * H * I`` weights); ``x read`` divides it by the host's read rate.  The weights of every
kernel row span several layers, each at least four times the last-level cache, and each rep
takes the next layer (and random experts), so the rows measure memory, not cache.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from ..host_compute import kernels
from .common import at_least

GiB = 2 ** 30
EXPERTS = dict(H=2048, I=768, E=128, k=8)           # Qwen3-30B-A3B
DENSE = dict(H=4096, I=14336, kv=1024)             # Llama-3-8B
QUICK_EXPERTS = dict(H=256, I=128, E=16, k=4)
QUICK_DENSE = dict(H=256, I=512, kv=64)
# paths of the benchmark alone: oneDNN's matmul on weights packed ahead into its layout (a
# second copy of the weights, which the kernels cannot keep for host weights they are given)
BENCH_PATHS = ("onednn",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and buffers: a smoke run of seconds")
    parser.add_argument("--tokens", default="1,8", help="comma-separated token counts")
    parser.add_argument("--paths", default="auto",
                        help="comma-separated kernel paths to time, 'auto' (the one the "
                             "kernels pick per shape) or 'all'")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="weights' dtype")
    parser.add_argument("--reps", type=at_least(1, "timed calls per row"), default=20,
                        help="timed calls per row")
    parser.add_argument("--read-gib", type=float, default=None,
                        help="GiB summed by the read-rate row (default 4, 1/16 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's, the "
                             "physical cores)")
    parser.add_argument("--kt-kernel", action="store_true",
                        help="add kt-kernel's bf16 MoE rows (where the kt-kernel package "
                             "imports) on the same weights and routing")


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    span = 16 * 2 ** 20 if quick else max(GiB, 4 * _llc_bytes())
    reps = min(args.reps, 3) if quick else args.reps
    read_gib = args.read_gib or (0.0625 if quick else 4.0)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, {kernels.host_threads()} threads "
          f"({kernels.physical_cores()} physical cores), last-level cache "
          f"{_llc_bytes() / 2 ** 20:.0f} MiB, CUDA {torch.cuda.is_available()}, "
          f"weights {args.dtype}, each row's weights span >= {span / GiB:.2f} GiB")
    print("| what | shape | ms median | GB/s | x read |\n| --- | --- | ---: | ---: | ---: |")
    read = _read_rows(read_gib, quick, reps)
    for t in tokens:
        for path in _paths(args.paths, kernels.EXPERT_PATHS + BENCH_PATHS):
            name = path or f"auto={kernels.pick(t, dtype, experts=True)}"
            _guarded(f"experts {name}", read, _experts, t, path, dtype, span, quick, reps)
    for t in tokens:
        for path in _paths(args.paths, kernels.LINEAR_PATHS + BENCH_PATHS):
            name = path or f"auto={kernels.pick(t, dtype, experts=False)}"
            for what, measure in _dense(t, path, dtype, span, quick, reps):
                _guarded(f"{what} {name}", read, measure)
    for t in tokens:
        for what, measure in _attention(t, dtype, span, quick, reps):
            _guarded(what, read, measure)
    if args.kt_kernel:
        _kt_rows(tokens, span, quick, reps, read)
    return 0


def _attention(tokens: int, dtype, span: int, quick: bool, reps: int) -> list:
    """Decode attention over a KV cache in host memory, Llama-3-8B's heads (32 query heads
    over 8 KV heads of 128), 64k tokens (4k with --quick): the host attention kernel
    (:mod:`fx_offload.host_compute.attention`) and torch's ``sdpa``; GB/s of keys and values
    read.  Enough layers to span ``span``, one a call."""
    from ..host_compute import attention
    context = 4096 if quick else 65536
    per_layer = 2 * 8 * context * 128 * dtype.itemsize
    layers = [tuple(_filled((1, 8, context, 128), dtype) for _ in range(2))
              for _ in range(max(2, -(-span // per_layer)))]
    q = torch.randn(1, 32, tokens, 128)
    shape = f"{tokens} token(s), 8 KV heads x {context}, {len(layers)} layers"
    lib = attention.library()

    def kernel():
        def call(i):
            attention.attend(lib, q, *layers[i % len(layers)], context, None, None)
        return shape, _median_seconds(call, reps), per_layer

    def sdpa():
        qd = q.to(dtype)

        def call(i):
            k, v = layers[i % len(layers)]
            torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
        return shape, _median_seconds(call, reps), per_layer
    rows = [("attention torch sdpa", sdpa)]
    return ([("attention kernel", kernel)] if lib is not None else []) + rows


def _guarded(what: str, read: float, measure, *args) -> None:
    """A row of ``measure(*args)``, or a row saying why it failed (a path this CPU or torch
    build lacks, such as oneDNN's bf16 matmul without AVX-512 BF16)."""
    try:
        _row(what, *measure(*args), read)
    except Exception as err:        # noqa: BLE001  (one row fails, the table goes on)
        print(f"| {what} | failed: {type(err).__name__}: {str(err)[:160]} | - | - | - |",
              flush=True)


def _paths(chosen: str, known: tuple[str, ...]) -> list:
    if chosen == "auto":
        return [None]
    if chosen == "all":
        return list(known)
    return [p for p in chosen.split(",") if p in known]


def _row(what: str, shape: str, seconds: float, nbytes: float, read: float | None) -> None:
    rate = nbytes / seconds / 1e9
    ratio = f"{rate / read:.2f}" if read else "-"
    print(f"| {what} | {shape} | {seconds * 1e3:.3f} | {rate:.1f} | "
          f"{ratio} |", flush=True)


def _median_seconds(fn, reps: int, warmup: int = 2) -> float:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn(warmup + i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _llc_bytes() -> int:
    """The last-level cache of all sockets together (sysfs; 32 MiB where unreadable)."""
    seen, total = set(), 0
    base = "/sys/devices/system/cpu/cpu{}/cache/index3/"
    for cpu in range(torch.multiprocessing.cpu_count() if hasattr(torch, "multiprocessing")
                     else 1):
        try:
            with open(base.format(cpu) + "shared_cpu_list") as f:
                shared = f.read().strip()
            with open(base.format(cpu) + "size") as f:
                size = f.read().strip()
        except OSError:
            continue
        if shared not in seen:
            seen.add(shared)
            total += int(size.rstrip("K")) * 1024 if size.endswith("K") else int(size)
    return total or 32 * 2 ** 20


def _filled(shape, dtype, pin=False) -> torch.Tensor:
    # written, so every page is its own memory (an untouched page reads as the zero page)
    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
    return t.uniform_(-0.05, 0.05) if dtype.is_floating_point else t.fill_(1)


def _read_rows(gib: float, quick: bool, reps: int) -> float:
    n = int(gib * GiB) // 4
    a = _filled((n,), torch.float32, pin=torch.cuda.is_available())
    seconds = _median_seconds(lambda i: a.sum(), min(reps, 10))
    read = n * 4 / seconds / 1e9
    _row("host read (fp32 sum)", f"{gib:g} GiB", seconds, n * 4, read)
    if torch.cuda.is_available():
        _copy_rows(a, read, reps)
    return read


def _copy_rows(a: torch.Tensor, read: float, reps: int) -> None:
    """The pinned copy rate alone, then with the cores summing another buffer meanwhile."""
    gpu = torch.empty_like(a, device="cuda")
    stream = torch.cuda.Stream()

    def copy(i):
        with torch.cuda.stream(stream):
            gpu.copy_(a, non_blocking=True)
        stream.synchronize()
    seconds = _median_seconds(copy, min(reps, 10))
    _row("pinned H2D", f"{a.numel() * 4 / GiB:g} GiB", seconds, a.numel() * 4, read)
    other = _filled(a.shape, torch.float32)
    copies = 8
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start_ev.record(stream)
        for _ in range(copies):
            gpu.copy_(a, non_blocking=True)
        end_ev.record(stream)
    sums, begin = 0, time.perf_counter()
    while not end_ev.query():           # the cores sum while the copy engine copies
        other.sum()
        sums += 1
    cpu_seconds = time.perf_counter() - begin
    end_ev.synchronize()
    copy_seconds = start_ev.elapsed_time(end_ev) / 1e3
    _row("together: pinned H2D", f"{copies} x {a.numel() * 4 / GiB:g} GiB", copy_seconds / copies,
         a.numel() * 4, read)
    _row(f"together: host read ({sums} sums)", f"{a.numel() * 4 / GiB:g} GiB",
         cpu_seconds / max(sums, 1), a.numel() * 4 if sums else 0, read)


@functools.lru_cache(maxsize=None)
def _expert_layers(dtype, span: int, quick: bool):
    """(shape, layers, gate_up of each layer, down of each layer): every row of a run reads
    the same weights, spanning ``span`` bytes at least."""
    s = QUICK_EXPERTS if quick else EXPERTS
    layers = max(2, -(-span // (3 * s["E"] * s["H"] * s["I"] * dtype.itemsize)))
    gate_up = [_filled((s["E"], 2 * s["I"], s["H"]), dtype) for _ in range(layers)]
    down = [_filled((s["E"], s["H"], s["I"]), dtype) for _ in range(layers)]
    return s, layers, gate_up, down


def _routings(tokens: int, s: dict, dtype, count: int) -> tuple[list, float]:
    """``count`` calls' (x, ids, gates), each token's k experts distinct and random, and the
    median count of distinct experts a call picks."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(count):
        ids = torch.rand(tokens, s["E"], generator=gen).topk(s["k"], dim=1).indices
        gates = torch.rand(tokens, s["k"], generator=gen).softmax(-1)
        calls.append((torch.randn(tokens, s["H"], generator=gen).to(dtype), ids, gates))
    return calls, statistics.median(len(torch.unique(c[1])) for c in calls)


def _experts(tokens: int, path, dtype, span: int, quick: bool, reps: int):
    s, layers, gate_up, down = _expert_layers(dtype, span, quick)
    calls, picked = _routings(tokens, s, dtype, reps + 2)

    if path == "onednn":
        packed = _packed_experts(dtype, span, quick, tokens)

        def call(i):
            x, ids, gates = calls[i]
            pgu, pdn = packed[i % layers]
            kernels.per_expert(x, ids, gates, s["E"], "silu",
                               lambda e, v: _onednn(v.to(dtype), pgu[e]),
                               lambda e, v: _onednn(v.to(dtype), pdn[e]))
    else:
        def call(i):
            x, ids, gates = calls[i]
            kernels.routed_experts(x, ids, gates, gate_up[i % layers], down[i % layers],
                                   path=path)
    seconds = _median_seconds(call, reps)
    return _expert_shape(tokens, s, picked, layers), seconds, \
        picked * 3 * s["H"] * s["I"] * dtype.itemsize


def _pack(w: torch.Tensor, tokens: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, tokens)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()


@functools.lru_cache(maxsize=None)
def _packed_experts(dtype, span: int, quick: bool, tokens: int) -> list:
    s, layers, gate_up, down = _expert_layers(dtype, span, quick)
    return [([_pack(gu[e], tokens) for e in range(s["E"])],
             [_pack(dn[e], tokens) for e in range(s["E"])]) for gu, dn in zip(gate_up, down)]


def _expert_shape(tokens: int, s: dict, picked: float, layers: int) -> str:
    return (f"T={tokens} H={s['H']} I={s['I']} E={s['E']} k={s['k']} ({picked:g} experts, "
            f"{layers} layers)")


def _dense(tokens: int, path, dtype, span: int, quick: bool, reps: int) -> list:
    """(what, measure) of the MLP (gate, up, down) and the attention projections (q, k, v,
    o) of a layer: ``measure()`` gives the row."""
    s = QUICK_DENSE if quick else DENSE
    H, I, kv = s["H"], s["I"], s["kv"]
    x = {n: torch.randn(tokens, n).to(dtype) for n in (H, I)}

    def measure(shapes):
        layers, weights = _dense_layers(shapes, dtype, span)
        if path == "onednn":
            packed = [[(w.shape[1], _pack(w, tokens)) for w in ws] for ws in weights]

            def call(i):
                for n, p in packed[i % layers]:
                    _onednn(x[n], p)
        else:
            def call(i):
                for w in weights[i % layers]:
                    kernels.linear(x[w.shape[1]], w, path=path)
        seconds = _median_seconds(call, reps)
        shape = f"T={tokens} " + " ".join(f"{a}x{b}" for a, b in shapes) + f" ({layers} layers)"
        return shape, seconds, sum(a * b for a, b in shapes) * dtype.itemsize
    return [(f"dense {what}", functools.partial(measure, shapes)) for what, shapes in
            (("mlp", ((I, H), (I, H), (H, I))), ("qkvo", ((H, H), (kv, H), (kv, H), (H, H))))]


@functools.lru_cache(maxsize=None)
def _dense_layers(shapes: tuple, dtype, span: int) -> tuple[int, list]:
    layer_bytes = sum(a * b for a, b in shapes) * dtype.itemsize
    layers = max(2, -(-span // layer_bytes))
    return layers, [[_filled(sh, dtype) for sh in shapes] for _ in range(layers)]


def _kt_rows(tokens, span, quick, reps, read) -> None:
    """kt-kernel's bf16 MoE (AMX where present, else AVX2) on the same weights and routing,
    through its C++ interface with one thread pool of torch's size: its own copy of each
    layer's weights in its layout, so twice the memory."""
    try:
        import kt_kernel
        ext = kt_kernel.kt_kernel_ext
    except Exception as err:        # noqa: BLE001  (an optional row: any failure is printed)
        print(f"| kt-kernel | does not import here: {type(err).__name__}: {err} | - | - | - |")
        return
    try:
        s, layers, gate_up, down = _expert_layers(torch.bfloat16, span, quick)
        pool, moes = _kt_layers(ext, s, gate_up, down, max(tokens))
        for t in tokens:
            calls, picked = _routings(t, s, torch.bfloat16, reps + 2)
            out = torch.empty(t, s["H"], dtype=torch.bfloat16)
            size = torch.tensor([t], dtype=torch.int32)

            def call(i, calls=calls, out=out, size=size):
                x, ids, gates = calls[i]
                pool.submit(moes[i % layers].forward_task(size.data_ptr(), s["k"], ids.data_ptr(),
                                                         gates.data_ptr(), x.data_ptr(),
                                                         out.data_ptr(), False))
                pool.sync()
            seconds = _median_seconds(call, reps)
            _row(f"experts kt-kernel ({kt_kernel.__cpu_variant__})",
                 _expert_shape(t, s, picked, layers), seconds,
                 picked * 3 * s["H"] * s["I"] * 2, read)
    except Exception as err:        # noqa: BLE001
        print(f"| kt-kernel | failed: {type(err).__name__}: {err} | - | - | - |")


def _kt_layers(ext, s: dict, gate_up: list, down: list, max_tokens: int):
    """kt-kernel's thread pool and one bf16 MoE of it per layer, loaded from our tensors."""
    config = ext.WorkerPoolConfig()
    config.subpool_count = 1
    config.subpool_numa_map = [0]
    config.subpool_thread_count = [torch.get_num_threads()]
    pool = ext.CPUInfer(config)
    kind = getattr(ext.moe, "AMXBF16_MOE", None) or ext.moe.AVX2BF16_MOE
    E, H, I = s["E"], s["H"], s["I"]
    mask = torch.zeros(E, dtype=torch.bool)
    logical = torch.arange(E, dtype=torch.int64)
    moes = []
    for n, (gu, dn) in enumerate(zip(gate_up, down)):
        moe_config = ext.moe.MOEConfig(E, s["k"], H, I, mask.data_ptr())
        moe_config.layer_idx = n
        moe_config.pool = pool.backend_
        moe_config.max_len = max(max_tokens, 1)
        moe_config.gate_projs = [[gu.data_ptr() + e * 2 * I * H * 2 for e in range(E)]]
        moe_config.up_projs = [[gu.data_ptr() + (e * 2 + 1) * I * H * 2 for e in range(E)]]
        moe_config.down_projs = [[dn.data_ptr() + e * H * I * 2 for e in range(E)]]
        zeros = [[0] * E]
        moe_config.gate_scales, moe_config.up_scales, moe_config.down_scales = zeros, zeros, zeros
        moe = kind(moe_config)
        pool.submit(moe.load_weights_task(logical.data_ptr()))
        pool.sync()
        moes.append(moe)
    return pool, moes
