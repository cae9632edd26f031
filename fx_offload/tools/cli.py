"""Command line: ``python -m fx_offload
demo|inspect|bench|bigger|flux|generate|moe|trace|codec|hostmem|ratio|kv``."""
from __future__ import annotations

import argparse
import sys

import torch

from ..errors import OffloadError
from . import (bench, bigger, codec_bench, demo, flux_bench, generate_bench, hostmem_bench,
               inspect_cli, kv_bench, moe_bench, ratio_bench, trace_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fx_offload",
                                     description="fx_offload: compile-time weight prefetch")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser(
        "demo", help="compile a built-in small decoder with offloading, check it and report"))
    inspect_cli.add_arguments(sub.add_parser(
        "inspect", help="print the offload plan and the rewritten graphs of a model"))
    bench.add_arguments(sub.add_parser(
        "bench", help="time offloaded forwards against the resident model, the bound and "
                      "the alternatives (a GPU; --device cpu --quick as a smoke run)"))
    bigger.add_arguments(sub.add_parser(
        "bigger", help="a model with more weights than the GPU holds: placed from the host, "
                       "compiled, run and checked (--shape tiny --device cpu as a smoke run)"))
    flux_bench.add_arguments(sub.add_parser(
        "flux", help="a Flux transformer (real dims) per denoising step: resident, fx_offload "
                     "and diffusers' group offloading side by side (a GPU, diffusers)"))
    generate_bench.add_arguments(sub.add_parser(
        "generate", help="Hugging Face generate on a Llama of 8B layer shapes: prefill and "
                         "decode ms/token resident, with fx_offload and with accelerate "
                         "(a GPU)"))
    moe_bench.add_arguments(sub.add_parser(
        "moe", help="Hugging Face generate on a Qwen3-MoE of 30B-A3B layer shapes: every "
                    "expert or only the routed ones crossing the link, resident and accelerate "
                    "(a GPU)"))
    trace_bench.add_arguments(sub.add_parser(
        "trace", help="a profiler trace of synchronized offloaded calls, whole-layer against "
                      "chunked copies: stream busy times and a figure (a GPU)"))
    codec_bench.add_arguments(sub.add_parser(
        "codec", help="the lossless codec (compress='lossless') on one layer of 8B shape: "
                      "ratio, GPU decode GB/s against DFloat11's, a layer's copy (a GPU)"))
    hostmem_bench.add_arguments(sub.add_parser(
        "hostmem", help="host memory of an offloaded model with compress='lossless', its "
                        "uncompressed weights in memory or in files, against compress='none'"))
    ratio_bench.add_arguments(sub.add_parser(
        "ratio", help="compress='lossless' on trained weights: a small decoder trained on the "
                      "CPU, the codecs' ratios before and after training"))
    kv_bench.add_arguments(sub.add_parser(
        "kv", help="generate at a long context with the KV cache on the host, against the "
                   "cache on the device and transformers' offloaded static cache (a GPU)"))
    args = parser.parse_args(argv)
    commands = {"trace": trace_bench.run, "bigger": bigger.run, "bench": bench.run, "demo": demo.run,
                "inspect": inspect_cli.run, "flux": flux_bench.run,
                "generate": generate_bench.run, "moe": moe_bench.run, "codec": codec_bench.run, "kv": kv_bench.run,
                "hostmem": hostmem_bench.run, "ratio": ratio_bench.run}
    try:
        _check_device(args)
        return commands[args.command](args)
    except Exception as err:
        # a bad option or an unsupported model: one line that says what to change, like
        # argparse's own errors (Dynamo wraps what the backend raised while compiling)
        inner = getattr(err, "inner_exception", None) or err
        if not isinstance(inner, (OffloadError, UsageError)):
            raise
        print(f"error: {inner}", file=sys.stderr)
        return 2


class UsageError(Exception):
    """A command-line choice this machine cannot honour."""


def _check_device(args: argparse.Namespace) -> None:
    device = getattr(args, "device", None)
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}, but torch {torch.__version__} sees no CUDA "
                         "device; use --device cpu, or run on a machine with a GPU")

