"""``python -m fx_offload generate``: Hugging Face ``generate`` on a Llama built from a config
with Llama-3-8B layer shapes (random weights, bf16), timed side by side in one process:

* resident, its ``forward`` compiled with Inductor (``dynamic=True``);
* fx_offload through :func:`fx_offload.compile_forward` (every second layer offloaded,
  ``prefetch_step`` slots), Inductor inside;
* accelerate's ``cpu_offload`` on the same layers (eager), where accelerate is installed.

Each ``generate`` is greedy with a fixed number of new tokens and is followed by a
synchronize.  Prefill is the median time of ``generate(max_new_tokens=1)``; decode ms/token is
``(median time of generate(max_new_tokens=N) - prefill) / (N - 1)``.  The copy bound of a
decode step is the bytes copied per forward over the pinned host-to-device bandwidth measured
in the same process.  The tokens of each method are compared with the resident model's.
Needs a GPU and ``transformers``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .. import compile_forward, registry, report
from ..schedule import Schedule
from .bench import h2d_bandwidth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=16, help="decoder layers")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=33,
                        help="tokens generated per timed generate")
    parser.add_argument("--prefetch-step", type=int, default=2)
    parser.add_argument("--circular-prefetch", default="auto",
                        help="comma-separated circular_prefetch values (auto, end, entry): one "
                             "fx_offload row each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="resident,fx_offload,accelerate",
                        help="comma-separated among resident, fx_offload, accelerate")


def run(args: argparse.Namespace) -> int:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("error: the generate benchmark needs transformers", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the generate benchmark needs a GPU", file=sys.stderr)
        return 2
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
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model = model.to_empty(device="cuda").to(torch.bfloat16).eval()
        gen = torch.Generator("cuda").manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda").mul_(0.02))
            model.model.rotary_emb.__init__(config, device="cuda")
        model.generation_config.eos_token_id = None     # always the full length
        model.generation_config.pad_token_id = 0
        return model

    rows, tokens, moved = {}, {}, 0
    methods = [m for m in args.methods.split(",") if m]
    if "resident" in methods:
        model = build()
        model.forward = torch.compile(model.forward, dynamic=True)
        rows["resident (Inductor)"], tokens["resident"] = _measure(model, prompt, args)
        del model
    circulars = [c for c in args.circular_prefetch.split(",") if c]
    for circular in circulars if "fx_offload" in methods else []:
        torch._dynamo.reset()       # each model compiles afresh (one class: shared caches)
        model = build()
        compile_forward(model, dynamic=True, group_size=2, num_in_group=1,
                        prefetch_step=args.prefetch_step, circular_prefetch=circular)
        name = f"fx_offload, {len(offloaded)} layers, {args.prefetch_step} slots (Inductor)"
        if circulars != ["auto"]:
            name += f", circular at {circular}"
        rows[name], tokens[name] = _measure(model, prompt, args)
        rep = report(model)
        moved = Schedule(rep.layers, rep.num_slots).moved_bytes(rep.layer_bytes)
        choice = registry.state_for_model(model).circular
        print(f"{rep}\n  circular prefetch at the {choice.now} after the run ({choice.moves} "
              "changes of place)", flush=True)
        del model, rep
    if "accelerate" in methods:
        try:
            from accelerate import cpu_offload
        except ImportError:
            print("  accelerate not installed: skipped")
        else:
            model = build()
            for i in offloaded:
                cpu_offload(model.model.layers[i], execution_device=torch.device("cuda"))
            name = f"accelerate cpu_offload, {len(offloaded)} layers (eager)"
            rows[name], tokens[name] = _measure(model, prompt, args, repeats=1)
            del model
    torch.cuda.empty_cache()

    bound = moved / bandwidth * 1e3 if moved else float("nan")
    print(f"\ncopy bound of a decode step: {moved / 2**30:.2f} GiB copied per forward = "
          f"{bound:.1f} ms")
    print(f"{'method':62s} {'prefill ms':>10s} {'decode ms/token':>16s} {'x bound':>8s} "
          f"{'tokens as resident':>19s}")
    for name, (prefill, decode) in rows.items():
        same = "-" if "resident" not in tokens or name.startswith("resident") else (
            "yes" if torch.equal(tokens[name], tokens["resident"]) else "NO")
        print(f"{name:62s} {prefill:10.1f} {decode:16.2f} {decode / bound:8.3f} {same:>19s}")
    return 0


def _measure(model, prompt, args, repeats: int | None = None):
    """((prefill ms, decode ms per token), the generated tokens)."""
    repeats = repeats or args.repeats

    def generate(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, out

    generate(args.new_tokens)                    # compile, first fill, warm-up
    generate(1)
    prefill = statistics.median(generate(1)[0] for _ in range(repeats))
    timed = [generate(args.new_tokens) for _ in range(repeats)]
    full = statistics.median(ms for ms, _ in timed)
    decode = (full - prefill) / (args.new_tokens - 1)
    print(f"  prefill {prefill:.1f} ms, decode {decode:.2f} ms/token", flush=True)
    return (prefill, decode), timed[-1][1]
