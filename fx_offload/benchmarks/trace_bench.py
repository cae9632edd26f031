"""``python -m fx_offload trace``: where the time of a synchronized offloaded call goes, from a
profiler trace of the benchmark's decoder (Llama-3-8B layer shapes, bf16).

For each copy setting (whole-layer copies, ``copy_chunks=1``, and the default chunked copies)
the model is compiled, warmed up, and a few calls, each followed by a synchronize, are
profiled.  From the trace's GPU events of the last call it prints the call's GPU time, how
long the compute stream and the copy stream were busy, how long the copy stream idled at the
start of the call before its first copy, and how long compute waited on copies (the call's
GPU time minus the compute stream's busy time).  It writes the Chrome traces (open them in
Perfetto) and a figure of the two streams of that call, one row per setting.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from .. import restore
from .bench import _build, _shapes
from .profiling import copies_alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of a call (batch 1)")
    parser.add_argument("--prefetch-step", type=int, default=1, help="option prefetch_step")
    parser.add_argument("--calls", type=int, default=3, help="profiled calls")
    parser.add_argument("--out", default="trace_out", help="folder for the traces and figure")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("error: the trace needs a GPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    shapes = _shapes(False, device)
    ids = torch.randint(0, shapes["vocab"], (1, args.tokens), device=device)
    print(f"trace: {args.layers} layers {shapes}, every second offloaded, prefetch_step "
          f"{args.prefetch_step}, {args.tokens} tokens; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}", flush=True)
    calls = {}
    for label, chunks in (("whole-layer copies", 1), ("chunked copies (default)", None)):
        torch._dynamo.reset()
        model = _build(args.layers, shapes, device, torch.bfloat16)
        options = dict(group_size=2, num_in_group=1, prefetch_step=args.prefetch_step)
        if chunks is not None:
            options["copy_chunks"] = chunks
        fn = torch.compile(model, backend="prefetch_offload", options=options)
        path = os.path.join(args.out, f"trace_{'whole' if chunks else 'chunked'}.json")
        with torch.no_grad():
            for _ in range(3):
                fn(ids)
            torch.cuda.synchronize()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU,
                                torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    with torch.profiler.record_function("fx_offload_call"):
                        fn(ids)
                        torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        calls[label] = last_call(path)
        summary = summarize(calls[label])
        print(f"{label:26s} GPU time {summary['span']:7.2f} ms | compute busy "
              f"{summary['compute']:7.2f} | copies busy {summary['copy']:7.2f} | copy stream "
              f"idle before its first copy {summary['copy_idle_at_start']:6.2f} | compute "
              f"waiting {summary['span'] - summary['compute']:6.2f}   ({path})", flush=True)
        if chunks is None:
            print(f"{'':26s} copies alone from the model's host blocks, no compute: "
                  f"{copies_alone(model):.2f} ms in the call's chunks, "
                  f"{copies_alone(model, chunked=False):.2f} ms whole", flush=True)
        restore(model)
        del fn, model
        torch.cuda.empty_cache()
    figure(calls, os.path.join(args.out, "trace.png"))
    return 0


def last_call(path: str) -> list[tuple[str, float, float]]:
    """(``"copy"`` or ``"compute"``, start ms, end ms) of the GPU events of the last profiled
    call, from its start."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    marks = sorted(e["ts"] for e in events
                   if e.get("name") == "fx_offload_call" and e.get("cat") == "user_annotation")
    begin = marks[-1]
    gpu = []
    for e in events:
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or e["ts"] < begin:
            continue
        kind = "copy" if cat == "gpu_memcpy" and "HtoD" in e.get("name", "") else "compute"
        gpu.append((kind, e["ts"], e["ts"] + e.get("dur", 0)))
    start = min(t0 for _, t0, _ in gpu)
    return sorted((k, (t0 - start) / 1e3, (t1 - start) / 1e3) for k, t0, t1 in gpu)


def _busy(spans) -> float:
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(spans):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def summarize(events) -> dict[str, float]:
    """A call's GPU time (``span``), ms: the compute and copy streams' busy time, and the
    copy stream's idle time before its first copy, between copies (``copy_gaps``) and after
    its last (``copy_tail``); span = copy_idle_at_start + copy + copy_gaps + copy_tail."""
    copies = [(t0, t1) for k, t0, t1 in events if k == "copy"]
    compute = [(t0, t1) for k, t0, t1 in events if k == "compute"]
    span = max(t1 for _, _, t1 in events)
    busy = _busy(copies)
    first = min((t0 for t0, _ in copies), default=0.0)
    last = max((t1 for _, t1 in copies), default=0.0)
    return dict(span=span, compute=_busy(compute), copy=busy, copy_idle_at_start=first,
                copy_gaps=max(0.0, last - first - busy) if copies else 0.0,
                copy_tail=span - last if copies else span)


def host_view(path: str) -> dict[str, float]:
    """The host's side of the last profiled call, ms from the call's start (its
    ``fx_offload_call`` mark): Dynamo's guard checks (``lookup``, summed), the start of the
    first compiled graph (``graph``), the launch of the first host-to-device copy
    (``first_copy_issued``) and of the last operation (``issued_all``), the link's idle time
    between copies spent waiting for the host to issue the next one (``idle_for_host``: the
    next copy was launched after the last one ended) and the time from the GPU's last event to
    the call's end (``after_gpu``: the synchronize's return)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    mark = max((e for e in events if e.get("name") == "fx_offload_call"
                and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    begin, end = mark["ts"], mark["ts"] + mark["dur"]
    inside = [e for e in events if begin <= e["ts"] <= end]
    launches = {e["args"]["correlation"]: e["ts"] for e in inside
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("args", {}).get("correlation") in launches]
    copies = sorted((e["ts"], e["ts"] + e.get("dur", 0), launches[e["args"]["correlation"]])
                    for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"])
    idle_for_host, last_end = 0.0, None
    for t0, t1, issued in copies:
        if last_end is not None and t0 > last_end:
            idle_for_host += max(0.0, min(t0, issued) - last_end)
        last_end = t1 if last_end is None else max(last_end, t1)
    graphs = [e["ts"] for e in inside if e["name"].startswith("## Call CompiledFxGraph")]
    ms = lambda t: (t - begin) / 1e3                                    # noqa: E731
    return dict(
        lookup=sum(e["dur"] for e in inside if e["name"] == "TorchDynamo Cache Lookup") / 1e3,
        graph=ms(min(graphs)) if graphs else float("nan"),
        first_copy_issued=ms(copies[0][2]) if copies else float("nan"),
        first_copy=ms(copies[0][0]) if copies else float("nan"),
        issued_all=ms(max(launches.values())) if launches else float("nan"),
        idle_for_host=idle_for_host / 1e3,
        after_gpu=(end - max(e["ts"] + e.get("dur", 0) for e in gpu)) / 1e3 if gpu
        else float("nan"),
        call=mark["dur"] / 1e3)


def host_line(view: dict[str, float]) -> str:
    return (f"host: call {view['call']:.2f} ms; guards {view['lookup']:.2f} ms; first graph "
            f"at {view['graph']:.2f}; first copy issued at {view['first_copy_issued']:.2f}, "
            f"begins at {view['first_copy']:.2f}; last operation issued at "
            f"{view['issued_all']:.2f}; link idle waiting for the host to issue a copy "
            f"{view['idle_for_host']:.2f} ms; synchronize returns {view['after_gpu']:.2f} ms "
            "after the GPU's last event")


def figure(calls: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('(matplotlib not installed: no figure; pip install -e ".[bench]")')
        return
    fig, axes = plt.subplots(len(calls), 1, figsize=(11, 1.6 * len(calls) + 0.6),
                             sharex=True, squeeze=False)
    for ax, (label, events) in zip(axes[:, 0], calls.items()):
        for row, (kind, color) in enumerate((("compute", "tab:blue"), ("copy", "tab:orange"))):
            spans = [(t0, t1 - t0) for k, t0, t1 in events if k == kind]
            ax.broken_barh(spans, (row * 10, 8), facecolors=color)
        ax.set_yticks([4, 14], ["compute", "H2D copies"])
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the start of a synchronized call")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure written to {path}")
