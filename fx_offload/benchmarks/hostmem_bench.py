"""``python -m fx_offload hostmem``: the host memory an offloaded model takes with
``compress="lossless"``, its uncompressed weights in host memory or in files (option
``uncompressed_weights``), against ``compress="none"``.

Each row runs in a process of its own (a fresh heap): a decoder of bf16 weights drawn
normal(0, 0.02) is built, placed with :func:`fx_offload.place`, and called twice.  The
process's resident memory (``VmRSS``, after a collection and ``malloc_trim``, so freed heap
memory is not counted) is read before ``place`` and after the calls; the change is what the
offloading cost the host: its host blocks and records, less the original weights it let go.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

ROWS = (("none", "memory"), ("lossless", "memory"), ("lossless", "auto"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (half offloaded)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size")
    parser.add_argument("--inner", type=int, default=4096, help="MLP intermediate size")
    parser.add_argument("--folder", default="auto",
                        help="uncompressed_weights of the files row: 'auto' or a folder")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)   # one row, inside


def run(args: argparse.Namespace) -> int:
    if args.row is not None:
        print(json.dumps(_measure(args)))
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"a decoder of {args.layers} layers (hidden {args.hidden}, inner {args.inner}), "
          f"bf16, every second layer offloaded, on {device}, torch {torch.__version__}")
    rows = []
    for compress, where in ROWS:
        where = args.folder if where == "auto" else where
        argv = [sys.executable, "-m", "fx_offload", "hostmem", "--device", device,
                "--layers", str(args.layers), "--hidden", str(args.hidden), "--inner",
                str(args.inner), "--folder", where, "--row", compress]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("\n| compress | uncompressed weights | offloaded MiB | records MiB | in files MiB "
          "| host memory change MiB | outputs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['compress']} | {r['where']} | {r['offloaded']:.1f} | {r['records']:.1f} | "
              f"{r['in_files']:.1f} | {r['change']:+.1f} | "
              f"{'equal' if r['equal'] else 'DIFFER'} |")
    return 0


def _resident_mib() -> float:
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:             # not glibc: freed heap memory may still be counted
        pass
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(args: argparse.Namespace) -> dict:
    import copy

    import torch

    import fx_offload
    from ..tools import models
    torch.manual_seed(0)
    model, (x,) = models.build("decoder", num_layers=args.layers, hidden=args.hidden,
                               inner=args.inner)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    reference = copy.deepcopy(model).to(args.device)
    x = x.to(args.device)
    with torch.no_grad():
        want = reference(x)
    before = _resident_mib()
    compress = args.row
    options = {"inner_backend": "aot_eager", "compress": compress}
    if compress == "lossless":
        options["uncompressed_weights"] = args.folder
    fx_offload.place(model, args.device, **options)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        equal = all(torch.equal(compiled(x), want) for _ in range(2))
    after = _resident_mib()
    rep = fx_offload.report(model)
    mib = 2 ** 20
    return {"compress": compress, "where": args.folder if compress == "lossless" else "-",
            "offloaded": rep.offloaded_bytes / mib, "records": rep.compressed_host_bytes / mib,
            "in_files": rep.uncompressed_in_file_bytes / mib, "change": after - before,
            "equal": equal}
