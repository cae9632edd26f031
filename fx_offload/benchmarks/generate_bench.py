"""``python -m fx_offload generate``: Hugging Face ``generate`` on a Llama built from a config
with Llama-3-8B layer shapes (random weights, bf16), timed side by side in one process:

* resident, its ``forward`` compiled with Inductor (``dynamic=True``), with ``--quantize``
  also each quantized form of it resident;
* fx_offload through :func:`fx_offload.compile_forward` (every second layer offloaded,
  ``prefetch_step`` slots), Inductor inside (``--inner-backend`` names another); with
  ``--quantize int8,float8,...`` also the same model with its layers' weights quantized by
  torchao first (their packed bytes move; "x bf16" compares decode with the bf16 row); with
  ``--host-compute never,auto`` a row for each (``auto``, the default, computes some
  offloaded layers' MLPs on the host: its bound is the larger of its copies' time and its
  host reads' time at the fastest rate the host was seen reading, see
  :func:`.common.fastest_host_read`);
* accelerate's ``cpu_offload`` on the same layers (eager), where accelerate is installed.

With ``--cuda-graphs`` every row decodes through transformers' own compile route instead: a
static cache and ``CompileConfig`` (``reduce-overhead``: CUDA graphs), naming
``fx_offload.backend(...)`` with the same options for the fx_offload rows; prefill then runs
eagerly.

Each ``generate`` is greedy with a fixed number of new tokens and is followed by a
synchronize.  Prefill is the median time of ``generate(max_new_tokens=1)``; decode ms/token is
``(median time of generate(max_new_tokens=N) - prefill) / (N - 1)``, or with ``--step-clock``
the median time between two decode steps (free of the prefill's noise).  The copy bound of a
decode step is the bytes copied per forward over the pinned host-to-device bandwidth measured
in the same process.  The tokens of each method are compared with the resident model's.
Needs a GPU and ``transformers``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from .. import backend, compile_forward, registry, report
from ..codecs import ans
from ..host_compute.rates import host_rates
from ..host_compute.trial import FixedPlan
from ..schedule import Schedule
from .bench import h2d_bandwidth
from .common import (SETTLE_TOKENS, add_flags, add_generate_arguments, build_random,
                     fastest_host_read, graphs_route, plain_read_rate, settle_trials,
                     unavailable, with_accelerate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generate_arguments(parser, layers=16, new_tokens=33, fewest=2,
                           timed="decode is timed between them")
    add_flags(parser, [
        ("--prefetch-step", 2, "option prefetch_step of the fx_offload rows"),
        ("--circular-prefetch", "auto", "comma-separated circular_prefetch values (auto, end, "
         "entry): one fx_offload row each"),
        ("--quantize", "none", "comma-separated weight formats of the fx_offload rows: none "
         "(bf16) or torchao's int8, float8, int4 weight-only (quantize_ before offloading: the "
         "packed bytes are what moves)"),
        ("--compress", "none", "comma-separated compress values of the fx_offload rows: none, "
         "lossless (bf16 weights cross the link compressed, by nvCOMP's ANS where it is "
         "installed), lossless:fx_offload or lossless:nvcomp (that codec: "
         "FX_OFFLOAD_LOSSLESS_CODEC)"),
        ("--inner-backend", "inductor", "the fx_offload rows' inner compiler (aot_eager: each op "
         "as eager runs it, so rows that move the same weights otherwise must give the same "
         "tokens bitwise)"),
        ("--host-compute", "auto", "comma-separated host_compute values of the fx_offload rows "
         "(auto, never, always): one row each"),
        ("--step-clock", False, "decode: the median time between two decode steps"),
        ("--host-plans", "", "comma-separated counts of hosted dense MLPs to stream, each forced "
         "in turn on the host_compute=auto row's model after it ran (decode by the step "
         "clock, one line each): the trial's choice beside every plan, in one process")])


def run(args: argparse.Namespace) -> int:
    plans = [p.strip() for p in args.host_plans.split(",") if p.strip()]
    if plans and not all(p.isdigit() for p in plans):
        print(f"--host-plans takes counts of streamed MLPs, such as 0,2,4 (got "
              f"{args.host_plans!r})", file=sys.stderr)
        return 2
    if plans and "auto" not in args.host_compute.split(","):
        print("--host-plans forces plans on the host_compute=auto row: add auto to "
              "--host-compute", file=sys.stderr)
        return 2
    if unavailable("generate", "transformers"):
        return 2
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=args.layers,
                         vocab_size=32000, max_position_embeddings=8192,
                         torch_dtype=torch.bfloat16)
    offloaded = [i for i in range(args.layers) if i % 2 == 1]
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    bandwidth = h2d_bandwidth(torch.device("cuda"), 1 << 30)
    print(f"Llama, {args.layers} layers of Llama-3-8B shape (bf16, random weights), prompt "
          f"{args.prompt} tokens, {args.new_tokens} new; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; pinned H2D {bandwidth / 1e9:.1f} GB/s", flush=True)

    def build():
        return build_random(LlamaForCausalLM, config)

    rows, tokens, moved = {}, {}, {}
    resident_row: dict[str, str] = {}   # a weight format -> its resident row
    resident_of: dict[str, str] = {}    # an fx_offload row -> the resident row of its weights
    methods = [m for m in args.methods.split(",") if m]
    formats = [q for q in args.quantize.split(",") if q]
    graphs = " + CUDA graphs" if args.cuda_graphs else ""
    for quantize in formats if "resident" in methods else ():
        torch._dynamo.reset()
        model = build()
        name = f"resident (Inductor{graphs})"
        if quantize != "none":
            _quantize(model, quantize)
            name += f", {quantize}"
        if not args.cuda_graphs:
            model.forward = torch.compile(model.forward, dynamic=True)
        rows[name], tok = measure(model, prompt, args, steps=args.step_clock,
                                  extra=graphs_route(None) if args.cuda_graphs else None)
        resident_row[quantize] = name
        if quantize == "none":
            tokens["resident"] = tok
        del model
    circulars = [c for c in args.circular_prefetch.split(",") if c]
    compressions = [c for c in args.compress.split(",") if c]
    hostings = [h for h in args.host_compute.split(",") if h]
    variants = [(c, q, z, h) for c in circulars for q in formats for z in compressions
                for h in hostings] if "fx_offload" in methods else []
    host_read: dict[str, int] = {}
    for circular, quantize, compress, hosting in variants:
        torch._dynamo.reset()       # each model compiles afresh (one class: shared caches)
        compress, codec = _codec_of_row(compress)
        model = build()
        if quantize != "none":
            _quantize(model, quantize)
        options = dict(group_size=2, num_in_group=1, prefetch_step=args.prefetch_step,
                       circular_prefetch=circular, compress=compress,
                       inner_backend=args.inner_backend, host_compute=hosting)
        extra = graphs_route(backend(**options)) if args.cuda_graphs else None
        if not args.cuda_graphs:
            compile_forward(model, dynamic=True, **options)
        if hosting == "auto" and not args.cuda_graphs:
            runs = settle_trials(model, prompt)
            print(f"  host_compute='auto' settled its trial in {runs} generate(s) of "
                  f"{SETTLE_TOKENS} tokens before the timed ones", flush=True)
        name = _row_name(args, len(offloaded), graphs, (circulars, circular),
                         (formats, quantize), (compressions, compress, codec),
                         (hostings, hosting))
        rows[name], tokens[name] = measure(model, prompt, args, steps=args.step_clock,
                                           extra=extra)
        if quantize in resident_row:
            resident_of[name] = resident_row[quantize]
        if quantize != "none":
            tokens.pop(name)            # other weights: other tokens than the bf16 resident's
        rep = report(model)
        moved[name] = Schedule(rep.layers, rep.num_slots).moved_bytes(
            rep.call_bytes or rep.layer_bytes)
        if quantize == "none":
            moved.setdefault("bf16", Schedule(rep.layers, rep.num_slots).moved_bytes(
                rep.layer_bytes))
        if rep.host_read_bytes_last_call:       # the last decode step's: copied, read
            moved[name] = rep.copied_bytes_last_call
            host_read[name] = rep.host_read_bytes_last_call
        if hosting == "auto" and args.host_plans:
            _forced_plans(model, prompt, args)
        choice = registry.state_for_model(model).circular
        print(f"{rep}\n  circular prefetch at the {choice.now} after the run ({choice.moves} "
              "changes of place)", flush=True)
        del model, rep
    model = with_accelerate(build, lambda m: [m.model.layers[i] for i in offloaded]) \
        if "accelerate" in methods else None
    if model is not None:
        name = f"accelerate cpu_offload, {len(offloaded)} layers (eager)"
        rows[name], tokens[name] = measure(model, prompt, args, repeats=1)
        del model
    torch.cuda.empty_cache()

    _table(rows, tokens, moved, host_read, resident_of, bandwidth)
    return 0


def _forced_plans(model, prompt, args) -> None:
    """Each plan of ``--host-plans`` forced on ``model``'s decode steps (one token a call),
    its decode ms/token by the step clock and the bytes its last step moved; then the
    model's own timer again."""
    host = registry.state_for_model(model).host_experts
    kept = host.timer
    try:
        for plan in [int(p) for p in args.host_plans.split(",") if p.strip()]:
            host.timer = FixedPlan(plan)
            (_, decode), _ = measure(model, prompt, args, steps=True)
            rep = report(model)
            where = "".join("H" if r == "host" else "S" if r == "device" else "?"
                            for _, r in sorted(rep.ran_on.items()))
            print(f"  forced: {plan} streamed ({where}): {decode:.2f} ms/token, "
                  f"{rep.copied_bytes_last_call / 2**30:.2f} GiB copied, "
                  f"{rep.host_read_bytes_last_call / 2**30:.2f} GiB read on the host",
                  flush=True)
    finally:
        host.timer = kept


def _table(rows, tokens, moved, host_read, resident_of, bandwidth) -> None:
    """The rows beside their bounds, their ratios and whether their tokens match."""
    print(f"\ncopy bound of a decode step: bytes copied per forward at {bandwidth / 1e9:.1f} "
          "GB/s; " + ", ".join(f"{k}: {m / 2**30:.2f} GiB = {m / bandwidth * 1e3:.1f} ms"
                              for k, m in moved.items() if k == "bf16" or k not in rows))
    host_rate = fastest_host_read(host_rates(torch.device("cuda")), plain_read_rate()) \
        if host_read else 0.0
    if host_read:
        print(f"host compute rows: bound = max(bytes copied / {bandwidth / 1e9:.1f} GB/s, "
              f"bytes the host read / {host_rate / 1e9:.1f} GB/s, the fastest it was seen "
              "reading: host_compute's probe alone or beside the link, or a sum of 1 GiB); "
              + ", ".join(
                  f"{name}: {moved[name] / 2**30:.2f} GiB copied, {read / 2**30:.2f} GiB read"
                  for name, read in host_read.items()))
    bf16 = next((decode for name, (_, decode) in rows.items()
                 if name in moved and moved[name] == moved.get("bf16")
                 and name not in host_read), None)
    print(f"{'method':66s} {'prefill ms':>10s} {'decode ms/token':>16s} {'x bound':>8s} "
          f"{'x bf16':>7s} {'x resident':>10s} {'same tokens':>12s}")
    # tokens compared with the resident model's, or else with the first bf16 row's
    first = "resident" if "resident" in tokens else next(iter(tokens), None)
    for name, (prefill, decode) in rows.items():
        same = "-" if first is None or name not in tokens or name == first or \
            name.startswith("resident") else (
                "yes" if torch.equal(tokens[name], tokens[first]) else
                "NO*" if name in host_read else "NO")
        nbytes = moved.get(name, None if name.startswith("resident") else moved.get("bf16"))
        bound = max(nbytes / bandwidth, host_read.get(name, 0) / host_rate
                    if name in host_read else 0.0) if nbytes else 0.0
        ratio = decode / (bound * 1e3) if bound else float("nan")
        to_bf16 = decode / bf16 if bf16 and name in moved else float("nan")
        # to the same weights resident: what offloading them costs on top of their compute
        to_resident = decode / rows[resident_of[name]][1] if name in resident_of \
            else float("nan")
        print(f"{name:66s} {prefill:10.1f} {decode:16.2f} {ratio:8.3f} {to_bf16:7.3f} "
              f"{to_resident:10.3f} {same:>12s}")
    if host_read:
        print("* the host sums an MLP in fp32 and rounds once, the device after each matmul: "
              "logits agree to bf16 rounding, and greedy tokens of random weights part at a "
              "near-tie")


def _row_name(args, offloaded: int, graphs: str, circular, quantize, compress,
              hosting) -> str:
    """An fx_offload row's name: its inner compiler, and each of its options that varies
    (each given with the run's values of it)."""
    inner = "Inductor" if args.inner_backend == "inductor" else args.inner_backend
    name = f"fx_offload, {offloaded} layers, {args.prefetch_step} slots ({inner}{graphs})"
    if circular[0] != ["auto"]:
        name += f", circular at {circular[1]}"
    if quantize[0] != ["none"]:
        name += f", {quantize[1] if quantize[1] != 'none' else 'bf16'}"
    if compress[0] != ["none"]:
        name += f", compress={compress[1]}" + (f" ({compress[2]})" if compress[2] else "")
    if hosting[0] != ["auto"]:
        name += f", host_compute={hosting[1]}"
    return name


def _codec_of_row(compress: str) -> tuple[str, str]:
    """``"lossless:fx_offload"`` -> ``("lossless", "fx_offload")``, that codec chosen through
    FX_OFFLOAD_LOSSLESS_CODEC (read where the records are made: the row's first call)."""
    compress, _, codec = compress.partition(":")
    os.environ.pop(ans.ENV, None)
    if codec:
        os.environ[ans.ENV] = codec
    return compress, codec


TORCHAO_CONFIGS = {"int8": "Int8WeightOnlyConfig", "float8": "Float8WeightOnlyConfig",
                   "int4": "Int4WeightOnlyConfig"}


def _quantize(model, fmt: str) -> None:
    """torchao's weight-only quantization of the decoder layers' linear weights."""
    import torchao.quantization as quantization
    if fmt not in TORCHAO_CONFIGS:
        raise SystemExit(f"--quantize {fmt}: choose among none, {', '.join(TORCHAO_CONFIGS)}")
    if fmt == "int4":   # the tile-packed layout: torch's own int4 matmul, no extra kernels
        from torchao.quantization.quantize_.workflows import Int4PackingFormat
        config = quantization.Int4WeightOnlyConfig(
            group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
    else:
        config = getattr(quantization, TORCHAO_CONFIGS[fmt])()
    quantization.quantize_(model.model.layers, config)


def step_gaps(ticks: list[float]) -> list[float]:
    """The decode steps' times (ms) from one ``generate``'s step clock (``perf_counter`` at
    each call of its stopping criteria).  ``generate`` reaches the clock once a token, as the
    token's step is queued and before it waits for the token, so each gap is the wait for one
    step and the queueing of the next: one decode step; but the first gap waits for the
    prompt's forward instead (what of it the device had not finished), so it is left out."""
    return [(b - a) * 1e3 for a, b in zip(ticks[1:], ticks[2:])]


def measure(model, prompt, args, repeats: int | None = None, extra=None, steps=False):
    """((prefill ms, decode ms per token), the generated tokens); ``extra``: more keywords
    for ``generate``.  ``steps``: decode is the median time of the timed generates' decode
    steps (:func:`step_gaps`; from 3 new tokens), rather than the difference of two medians
    (whose noise, a prefill's over ``N - 1``, grows with the prefill).
    ``prompt`` may be a list: the warm-up and the prefill take the first, each timed
    generate the next one (what a cache that learns from the calls before sees anew)."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    prompts = list(prompt) if isinstance(prompt, (list, tuple)) else [prompt]
    prompt = prompts[0]
    repeats = repeats or args.repeats
    ticks: list[list[float]] = []

    class _Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            ticks[-1].append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(n, prompt=prompt):
        ticks.append([])
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([_Clock()]),
                                 **(extra or {}))
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, out

    generate(args.new_tokens)                    # compile, first fill, warm-up
    generate(1)
    prefill = statistics.median(generate(1)[0] for _ in range(repeats))
    del ticks[:]
    timed = [generate(args.new_tokens, prompts[1 + i % (len(prompts) - 1)]
                      if len(prompts) > 1 else prompt) for i in range(repeats)]
    full = statistics.median(ms for ms, _ in timed)
    decode = (full - prefill) / (args.new_tokens - 1)
    gaps = [gap for t in ticks for gap in step_gaps(t)]
    if steps and gaps:      # (none with fewer than 3 new tokens: the difference above)
        decode = statistics.median(gaps)
    from torch._dynamo.utils import counters
    skips = sum(v for k, v in counters["inductor"].items() if "cudagraph_skips" in k)
    print(f"  batch {prompt.shape[0]}: prefill {prefill:.1f} ms, decode {decode:.2f} ms/token"
          + (f" (CUDA graphs skipped {skips} times in this process)" if skips else ""),
          flush=True)
    return (prefill, decode), timed[-1][1]
