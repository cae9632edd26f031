"""Command line: ``python -m fx_offload demo|inspect|bench|bigger``."""
from __future__ import annotations

import argparse

from . import bench, bigger, demo, inspect_cli


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
    args = parser.parse_args(argv)
    if args.command == "bigger":
        return bigger.run(args)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "inspect":
        return inspect_cli.run(args)
    return 2  # pragma: no cover

