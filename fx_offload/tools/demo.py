"""``python -m fx_offload demo``: the main job on a built-in model.

Builds a small Llama-like decoder, compiles it with the backend, checks several calls against
the same model without offloading, prints the offload report and the timings of both.
"""
from __future__ import annotations

import argparse
import copy
import logging
import time

import torch

from .. import report, restore
from ..benchmarks.common import at_least
from .models import TOOL_LAYERS, build


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="decoder", choices=["decoder", "mlp", "moe"],
                        help="the built-in model")
    parser.add_argument("--layers", type=at_least(2, "the built-in model's layer count (a "
                                                      "stack needs two)"),
                        default=TOOL_LAYERS, help="number of layers")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--group-size", type=int, default=2,
                        help="option group_size: layers taken per group")
    parser.add_argument("--num-in-group", type=int, default=1,
                        help="option num_in_group: the last this many of each group "
                             "are offloaded")
    parser.add_argument("--prefetch-step", type=int, default=1,
                        help="option prefetch_step: the slot buffers, and how many "
                             "offloaded layers ahead a copy starts")
    parser.add_argument("--inner-backend", default="inductor",
                        choices=["inductor", "aot_eager", "eager"],
                        help="option inner_backend: the compiler of the rewritten "
                             "graphs")
    parser.add_argument("--calls", type=at_least(1, "calls checked"), default=5,
                        help="calls checked against the model without offloading")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the compile summary")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, inputs = build(args.model, num_layers=args.layers)
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    reference = copy.deepcopy(model)
    options = {"group_size": args.group_size, "num_in_group": args.num_in_group,
               "prefetch_step": args.prefetch_step, "inner_backend": args.inner_backend}
    print(f"fx_offload demo: {args.model} with {args.layers} layers on {device}, "
          f"torch {torch.__version__}, options {options}")
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    worst = 0.0
    with torch.no_grad():
        start = time.perf_counter()
        expected = reference(*inputs)
        compiled(*inputs)                  # compiles, then offloads at the first call
        print(f"compiled in {time.perf_counter() - start:.1f} s")
        for call in range(args.calls):
            got = compiled(*inputs)
            worst = max(worst, (got - expected).abs().max().item())
        times = _median_times(compiled, reference, inputs, device)
    print(report(model))
    ok = worst <= 1e-4 * max(1.0, expected.abs().max().item())
    print(f"max |offloaded - reference| over {args.calls} calls: {worst:.3g} "
          f"({'OK' if ok else 'MISMATCH'})")
    print(f"median forward: offloaded {times[0] * 1e3:.2f} ms, reference (eager, resident) "
          f"{times[1] * 1e3:.2f} ms")
    restore(model)
    return 0 if ok else 1


def _median_times(compiled, reference, inputs, device, repeats: int = 10):
    def timed(fn):
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn(*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]
    return timed(compiled), timed(reference)
