"""Command line: ``python -m fx_offload
demo|inspect|bench|bigger|flux|generate|moe|trace|codec|hostmem|ratio|kv|train|host``."""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import textwrap

import torch

from ..benchmarks import (bench, bigger, codec_bench, flux_bench, generate_bench, host_bench,
                          hostmem_bench, kv_bench, moe_bench, ratio_bench, trace_bench,
                          train_bench)
from ..errors import OffloadError
from . import demo, inspect_cli

# name, module (its add_arguments and run), the line in the list of commands, and the
# description its --help opens with: what it does, what it needs, an example
TOOLS = (
    ("demo", demo, "compile a built-in small decoder with offloading, check it and report",
     "Compile a built-in model with the prefetch_offload backend, check several calls "
     "against the same model without offloading, and print the offload report and the "
     "timings of both. Runs on the CPU or a GPU.",
     "python -m fx_offload demo --device cpu"),
    ("inspect", inspect_cli, "print the offload plan (and the rewritten graphs) of a model",
     "Print what the backend would offload in a model and where the prefetches go, without "
     "moving a weight; --graphs adds the rewritten graphs. Needs no GPU.",
     "python -m fx_offload inspect decoder --prefetch-step 2"),
    ("bench", bench, "time offloaded forwards against the resident model, the bound and the "
                     "alternatives (a GPU; --device cpu --quick as a smoke run)",
     "Time offloaded forwards of a decoder of Llama-3-8B layer shapes against the same model "
     "resident, the copy bound, a hook prefetcher and accelerate, and write a table and a "
     "plot. Needs a GPU; --device cpu --quick is a smoke run.",
     "python -m fx_offload bench --tokens 1,128"),
    ("bigger", bigger, "a model with more weights than the GPU holds: placed from the host, "
                       "compiled, run and checked (--shape tiny --device cpu as a smoke run)",
     "Build a decoder with more weights than the GPU holds on the host, place, compile and "
     "run it, check it against the eager run and compare a decode step with the copy bound. "
     "Needs a GPU; --shape tiny --device cpu is a smoke run.",
     "python -m fx_offload bigger --shape tiny --device cpu"),
    ("flux", flux_bench, "a Flux transformer (real dims) per denoising step: resident, "
                         "fx_offload and diffusers' group offloading side by side (a GPU, "
                         "diffusers)",
     "Time a Flux transformer of the real model's dimensions per denoising step: resident, "
     "offloaded with fx_offload, and with diffusers' group offloading. Needs a GPU and "
     "diffusers.",
     "python -m fx_offload flux --double 2 --single 4"),
    ("generate", generate_bench, "Hugging Face generate on a Llama of 8B layer shapes: prefill "
                                 "and decode ms/token resident, with fx_offload and with "
                                 "accelerate (a GPU)",
     "Time Hugging Face generate (prefill, decode ms/token) on a Llama of Llama-3-8B layer "
     "shapes: resident, offloaded with fx_offload and with accelerate. Needs a GPU and "
     "transformers.",
     "python -m fx_offload generate --compress none,lossless"),
    ("moe", moe_bench, "Hugging Face generate on a Qwen3-MoE of 30B-A3B layer shapes: every "
                       "expert or only the routed ones crossing the link, resident and "
                       "accelerate (a GPU)",
     "Time Hugging Face generate on a Qwen3-MoE of Qwen3-30B-A3B layer shapes, every expert "
     "or only the routed ones crossing the link, against resident and accelerate. Needs a "
     "GPU and transformers.",
     "python -m fx_offload moe --cuda-graphs --ahead 0,4"),
    ("trace", trace_bench, "a profiler trace of synchronized offloaded calls, whole-layer "
                           "against chunked copies: stream busy times and a figure (a GPU)",
     "Profile synchronized offloaded calls with whole-layer and with chunked copies, and "
     "print how long each stream was busy and idle, with a figure. Needs a GPU.",
     "python -m fx_offload trace --layers 8"),
    ("codec", codec_bench, "the lossless codec (compress='lossless') on one layer of 8B shape: "
                           "ratio, GPU decode GB/s against DFloat11's, a layer's copy (a GPU)",
     "Measure the lossless codec of compress='lossless' on one layer of Llama-3-8B shape: "
     "its ratio, its GPU decode rate against DFloat11's and nvCOMP's, and a layer's copy. "
     "Needs a GPU.",
     "python -m fx_offload codec --dfloat11-words 0"),
    ("hostmem", hostmem_bench, "host memory of an offloaded model with compress='lossless', "
                               "its uncompressed weights in memory or in files, against "
                               "compress='none'",
     "Measure the host memory an offloaded model takes with compress='lossless', its "
     "uncompressed weights in memory or in files, against compress='none'. Runs on the CPU "
     "or a GPU.",
     "python -m fx_offload hostmem --device cpu --hidden 256 --inner 512"),
    ("ratio", ratio_bench, "compress='lossless' on trained weights: a small decoder trained on "
                           "the CPU, the codecs' ratios before and after training",
     "Train a small decoder on the CPU and print the lossless codecs' ratios on its weights "
     "before and after training. Needs no GPU (nvCOMP's rows need one).",
     "python -m fx_offload ratio --steps 100"),
    ("kv", kv_bench, "generate at a long context with the KV cache on the host, against the "
                     "cache on the device and transformers' offloaded static cache (a GPU)",
     "Time generate at a long context with the KV cache on the host, against the cache on "
     "the device and transformers' offloaded static cache. Needs a GPU and transformers.",
     "python -m fx_offload kv --context 16384"),
    ("train", train_bench, "a LoRA training step on a frozen offloaded base against resident, "
                           "FSDP2's CPU offload and accelerate (a GPU; --device cpu --quick "
                           "as a smoke run)",
     "Time a LoRA fine-tuning step (forward, backward, AdamW) on a Llama of Llama-3-8B layer "
     "shapes whose frozen base is offloaded, against the same step resident, FSDP2 with "
     "CPUOffloadPolicy and accelerate's cpu_offload, with peak memory and the copy bound. "
     "Needs a GPU, transformers and peft; --device cpu --quick is a smoke run.",
     "python -m fx_offload train --layers 16 --seq 2048"),
    ("host", host_bench, "computing on the host's cores with weights in host memory: the "
                         "read rate, the link, and the host kernels at decode shapes "
                         "(--quick as a smoke run)",
     "Time the host's read rate, the pinned copy rate (a GPU) and both at once, and the host "
     "kernels (routed experts of Qwen3-30B-A3B shapes, the dense layers of Llama-3-8B) at "
     "decode shapes, each against the read rate. Runs on the CPU; --quick is a smoke run.",
     "python -m fx_offload host --paths all"),
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (the example on a line of its own) and ends each
    flag's help with its default, unless the flag is a switch (off by default) or its help
    already says what the default is; a flag taking a value that is unset by default says
    ``(default: none)``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or "default" in text or \
                action.default is argparse.SUPPRESS:
            return text
        if action.default in (None, ""):
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's own parser, by name."""
    # the installed command is named as it was called; python -m, as it is typed
    prog = "fx-offload" if os.path.basename(sys.argv[0]) == "fx-offload" else \
        "python -m fx_offload"
    parser = argparse.ArgumentParser(prog=prog,
                                     description="fx_offload: compile-time weight prefetch")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, module, line, description, example in TOOLS:
        parsers[name] = sub.add_parser(name, help=line, formatter_class=HelpFormatter,
                                       description=f"{textwrap.fill(description, 79)}\n\n"
                                                   f"example: {example}")
        module.add_arguments(parsers[name])
    return parser, parsers


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; an unknown flag after a subcommand is refused by that
    subcommand's parser, so the usage printed is the subcommand's and the flag is named."""
    parser, parsers = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        own = parsers[args.command]
        flags = [s for action in own._actions for s in action.option_strings]
        message = f"unrecognized arguments: {' '.join(unknown)}"
        first = next((u.split("=")[0] for u in unknown if u.startswith("-")), None)
        close = difflib.get_close_matches(first, flags, n=1) if first else []
        own.error(message + (f" (did you mean {close[0]}?)" if close else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    commands = {name: module.run for name, module, *_ in TOOLS}
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
    if device:
        try:
            torch.device(device)
        except (RuntimeError, ValueError):
            raise UsageError(f"--device {device!r} names no device torch knows; give cuda, "
                             "cuda:1 or cpu") from None
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}, but torch {torch.__version__} sees no CUDA "
                         "device; use --device cpu, or run on a machine with a GPU")
