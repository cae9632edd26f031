"""Tensor parallelism with offloading, one process per GPU: ``torchrun --nproc-per-node 2
-m fx_offload.benchmarks.tp_bench``.

Builds a model sharded with torch's TP API, offloads every second layer's local shards on
each rank, checks the outputs against the same TP model not offloaded (same inner compiler)
and prints per rank: memory saved against offloaded - slots, the host-to-device rate of each
rank alone and of all ranks at once, the time of a call against the per-rank copy bound, and
the host's time to issue a call (offloaded and resident).

* ``--model mlp`` (default): a stack of MLP layers (``ColwiseParallel`` up,
  ``RowwiseParallel`` down);
* ``--model llama``: a Hugging Face ``LlamaForCausalLM`` built from a config (Llama-3-8B layer
  shapes by default), its attention and MLP projections split by column then row (q, k, v,
  gate, up by column; o, down by row), the plan torch's TP tutorial gives for Llama.

``--mode reduce-overhead`` runs the offloaded model under CUDA graphs; ``--circular-prefetch``
sets where each slot's first layer is copied back in (default: chosen per call, see
docs/notes/2026-11-23-chunked-copies-and-circular-prefetch.md); ``--trace DIR`` profiles three
synchronized calls on each rank and prints where the last one's time went, on the GPU
(``trace_bench.summarize``) and on the host (``trace_bench.host_view``).  ``--device cpu``
runs on gloo (a smoke run: outputs and a clean exit, no timing bound).  Before the process
group is destroyed the compiled models and their CUDA graphs are released: NCCL's communicator
destruction waits for graphs that captured its collectives, so a job that skipped this would
not exit.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, layers, hidden, inner):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, inner) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _mlp(args, mesh, device, dtype):
    """(sharded model, its input, how to call it)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = Stack(args.layers, args.hidden, args.inner).to(dtype).to(device).eval()
    if not args.no_tp:
        parallelize_module(model, mesh, {
            f"layers.{i}.{n}": ColwiseParallel() if n == "up" else RowwiseParallel()
            for i in range(args.layers) for n in ("up", "down")})
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype,
                    generator=torch.Generator(device).manual_seed(1))
    return model, (x,), lambda fn, x: fn(x)


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000)


def _llama(args, mesh, device, dtype):
    """A Hugging Face Llama (Llama-3-8B layer shapes; ``--hidden``/``--inner`` when given)
    with torch's TP plan for its projections; called on ``--tokens`` ids, no KV cache."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(LLAMA_8B)
    if args.hidden is not None:       # heads of 128 (16 in small models), KV heads a quarter
        heads = args.hidden // (128 if args.hidden >= 1024 else 16)
        shape.update(hidden_size=args.hidden, num_attention_heads=heads,
                     num_key_value_heads=max(2, heads // 4))
    if args.inner is not None:
        shape["intermediate_size"] = args.inner
    if device.type == "cpu":
        shape["vocab_size"] = 256
    config = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=4096,
                         attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    if not args.no_tp:
        for layer in model.model.layers:
            parallelize_module(layer, mesh, {
                **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    ids = torch.randint(0, shape["vocab_size"], (1, args.tokens), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    return model, (ids,), lambda fn, ids: fn(ids, use_cache=False).logits


MODELS = {"mlp": _mlp, "llama": _llama}
DEFAULT_SHAPE = {"mlp": (4096, 28672), "cpu": (64, 256)}      # (hidden, inner)


DESCRIPTION = ("Tensor parallelism with offloading, one process per GPU: each rank offloads "
               "every second layer's local shards, checks its outputs against the TP model "
               "not offloaded and prints its call's time against its copy bound. "
               "example: torchrun --standalone --nproc-per-node 2 -m fx_offload.tools.tp_run "
               "--model llama")


def _norm(a, b) -> float:
    return torch.linalg.vector_norm(a.float() - (b.float() if torch.is_tensor(b) else b)).item()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, reps, device, issued=None):
    """Median ms of ``fn`` followed by a synchronize of every stream (a generate loop's
    step): an event pair on the compute stream would miss the copy stream's tail.
    ``issued``: a list that gets the median ms until ``fn`` returned, before the synchronize
    (the host's time to issue the call: where it nears the call's, the host is the bound)."""
    times, returned = [], []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        returned.append((time.perf_counter() - start) * 1e3)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    if issued is not None:
        issued.append(statistics.median(returned))
    return statistics.median(times)


def _h2d_rates(nbytes, reps, rank, world, device) -> tuple[float, float]:
    """Host-to-device GB/s of this rank alone (the others wait), then of all ranks at once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    copy = lambda: dev.copy_(host, non_blocking=True)      # noqa: E731
    alone = None
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = _time(copy, reps, device)
        dist.barrier()
    dist.barrier()
    together = _time(copy, reps, device)
    return nbytes / alone / 1e6, nbytes / together / 1e6


def _trace(call, folder, rank, device) -> str:
    """Where a synchronized call's GPU time went on this rank (the last of three profiled)."""
    from .trace_bench import host_line, host_view, last_call, summarize
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"tp_trace_rank{rank}.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("fx_offload_call"):
                call()
                _sync(device)
    prof.export_chrome_trace(path)
    s = summarize(last_call(path))
    return (f"GPU time {s['span']:.2f} ms = copy stream idle before its first copy "
            f"{s['copy_idle_at_start']:.2f} + copying {s['copy']:.2f} + idle between copies "
            f"{s['copy_gaps']:.2f} + after its last {s['copy_tail']:.2f}; compute busy "
            f"{s['compute']:.2f} ({path})\n  rank {rank} {host_line(host_view(path))}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS),
                    help="mlp: a stack of MLP layers; llama: a Hugging Face Llama from a "
                         "config (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers; every second one is offloaded (default: %(default)s)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden size (default: mlp 4096, llama Llama-3-8B's; 64 on cpu)")
    ap.add_argument("--inner", type=int, default=None,
                    help="MLP inner size (default: mlp 28672, llama Llama-3-8B's; 256 on "
                         "cpu)")
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens of a call, batch 1 (default: %(default)s)")
    ap.add_argument("--device", default=None, help="cuda (NCCL; default with a GPU) or cpu "
                                                   "(gloo: a smoke run)")
    ap.add_argument("--inner-backend", default="inductor",
                    help="the compiler inside the offload backend and of the reference "
                         "(aot_eager: outputs bitwise) (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=15,
                    help="timed calls of each model; medians (default: %(default)s)")
    ap.add_argument("--prefetch-step", type=int, default=1,
                    help="option prefetch_step: slots (default: %(default)s)")
    ap.add_argument("--mode", default="default",
                    help="Inductor mode of the offloaded model (reduce-overhead: CUDA graphs) "
                         "(default: %(default)s)")
    ap.add_argument("--circular-prefetch", default="auto", choices=["auto", "end", "entry"],
                    help="option circular_prefetch: where each slot's first layer is copied "
                         "back in (default: %(default)s, chosen per call)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile three synchronized calls per rank and print where the "
                         "last one's time went, on the GPU and on the host; traces go to DIR")
    ap.add_argument("--no-tp", action="store_true",
                    help="the same model unsharded, plain parameters (one rank): a baseline")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="torchrun ... -m fx_offload.benchmarks.tp_bench",
                                 description=DESCRIPTION)
    add_arguments(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":    # a smoke run: the GPU shapes would take 30 GB of host memory
        hidden, inner = DEFAULT_SHAPE["cpu"]
        args.hidden, args.inner = args.hidden or hidden, args.inner or inner
    elif args.model == "mlp":
        hidden, inner = DEFAULT_SHAPE["mlp"]
        args.hidden, args.inner = args.hidden or hidden, args.inner or inner
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        ok = _run(args, rank, world, device)
    finally:
        # Release the compiled models and their CUDA graphs before the communicator: NCCL
        # waits for graphs that captured its collectives, and the job would not exit.
        gc.collect()
        torch.compiler.reset()
        _sync(device)
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def _run(args, rank, world, device) -> bool:
    import fx_offload
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build = MODELS[args.model]
    model, inputs, call = build(args, mesh, device, dtype)
    # the reference is built again (a deepcopy of a Hugging Face TP model fails in torch)
    reference, _, _ = build(args, mesh, device, dtype)
    expected = torch.compile(reference, backend=args.inner_backend)
    _sync(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": args.inner_backend, "group_size": 2, "num_in_group": 1,
        "prefetch_step": args.prefetch_step, "mode": args.mode,
        "circular_prefetch": args.circular_prefetch})
    with torch.no_grad():
        got = call(compiled, *inputs).clone()       # a CUDA graph's output is reused
        want = call(expected, *inputs)
    _sync(device)
    rep = fx_offload.report(model)
    saved = before - torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with torch.no_grad():
        # past CUDA-graph warm-up and capture (reduce-overhead), replays still agree
        replays_same = all(torch.equal(call(compiled, *inputs), got) for _ in range(3))
    max_diff = (got.float() - want.float()).abs().max().item()
    if args.inner_backend == "inductor":
        # Inductor fuses around our ops differently (they are fusion boundaries), so bf16
        # rounding differs, with or without TP: the offloaded output may differ from the
        # reference's by 1% of its norm, or by twice what the reference's own eager run
        # differs from it (the rounding spread of another choice of kernels).  Other inner
        # compilers run the same kernels: bitwise
        with torch.no_grad():
            spread = _norm(call(reference, *inputs), want)
        equal = bool(_norm(got, want) <= max(1e-2 * _norm(want, 0), 2 * spread))
    else:
        equal = torch.equal(got, want)
    equal = equal and replays_same
    state = fx_offload.registry.state_for_model(model)

    with torch.no_grad():
        run = lambda: call(compiled, *inputs)                # noqa: E731
        for _ in range(3):
            run()
        dist.barrier()
        issued = []
        offloaded_ms = _time(run, args.reps, device, issued)
        resident_ms = _time(lambda: call(expected, *inputs), args.reps, device, issued)
        traced = _trace(run, args.trace, rank, device) if args.trace else None
    compared = (f"{str(dtype).removeprefix('torch.')} rounding: within 1% of the norm, or "
                "twice the reference's eager-to-Inductor spread"
                if args.inner_backend == "inductor" else "bitwise")
    line = (f"rank {rank}: outputs {'match' if equal else 'DIFFER'} (largest difference "
            f"{max_diff:.3g}, {compared}, later calls "
            f"{'the same' if replays_same else 'DIFFER'}); "
            f"offloaded {rep.offloaded_bytes / 2**20:.1f} MiB, "
            f"slots {rep.buffer_bytes / 2**20:.1f} MiB")
    if device.type == "cuda":
        alone, together = _h2d_rates(rep.layer_bytes[rep.layers[0]], args.reps, rank, world,
                                     device)
        bound_ms = rep.offloaded_bytes / (together * 1e6)
        line += (f", saved {saved / 2**20:.1f} MiB (expected "
                 f"{(rep.offloaded_bytes - rep.buffer_bytes) / 2**20:.1f}); H2D {alone:.1f} "
                 f"GB/s alone, {together:.1f} GB/s with all ranks copying; call "
                 f"{offloaded_ms:.2f} ms vs copy bound {bound_ms:.2f} ms "
                 f"({offloaded_ms / bound_ms:.3f}x), resident {resident_ms:.2f} ms; the "
                 f"host issues a call in {issued[0]:.2f} ms ({issued[1]:.2f} resident)")
    else:
        line += f"; call {offloaded_ms:.2f} ms, resident {resident_ms:.2f} ms"
    line += (f"; circular prefetch now at the {state.circular.now}; sync loads "
             f"{state.stats['sync_loads']}")
    if traced:
        line += f"\n  rank {rank} trace: {traced}"
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        name = (f"{args.layers} MLP layers {args.hidden}x{args.inner}" if args.model == "mlp"
                else f"Llama, {args.layers} layers")
        print(f"torch {torch.__version__}, "
              f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {world} "
              f"ranks, {name}, {str(dtype).removeprefix('torch.')}, {args.tokens} token(s), "
              f"prefetch_step {args.prefetch_step}, inner {args.inner_backend}, mode "
              f"{args.mode}, circular_prefetch {args.circular_prefetch} ({rep.circular})",
              flush=True)
        print("\n".join(lines), flush=True)
    return equal and state.stats["sync_loads"] == 0


if __name__ == "__main__":
    main()
