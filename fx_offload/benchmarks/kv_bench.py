"""``python -m fx_offload kv``: greedy ``generate`` at a long context, the KV cache on the
host (``kv_cache="host"``) against the cache on the device and transformers' own offloaded
static cache, side by side in one process.

A Llama of Llama-3-8B layer shapes (random bf16 weights, ``--layers`` decoder layers), one
prompt of ``--context`` tokens, ``--new-tokens`` tokens; each row generates once to compile
and warm up, then once timed.  Prefill is the time of a ``generate`` of one token, to its end on
the device; decode is the median time between two decode steps (a step clock in ``generate``'s
stopping criteria).  Rows:

* ``device``: the cache on the device, ``forward`` compiled with Inductor (``dynamic=True``);
* the ``host`` rows: :func:`fx_offload.compile_forward` with ``kv_cache="host"``, the
  weights on the device (as in the transformers row), Inductor inside:
* ``host``: :func:`fx_offload.compile_forward` with ``kv_cache="host"`` and
  ``host_compute="never"``: each decode step streams the valid blocks into slots;
* ``host-attend``: the same with the default ``host_compute="auto"``: a decode step's
  attention runs on the host's cores over the cache in place (only the query, the step's
  tokens and the output cross the link) where the host's kernel reads fast enough;
* ``host-always``: ``host_compute="always"``: every decode step's attention on the host;
* ``host-offload``: ``host`` with the default weight offloading (every second layer's
  weights cross the link too);
* ``budget``: :func:`fx_offload.compile_forward` with default options and a
  ``memory_budget`` (``--budget``; by default the weights plus half the cache, so the cache
  does not fit beside them): the planner chooses what goes to the host;
* ``host-graphs``, ``host-attend-graphs``, ``host-always-graphs``: ``host``,
  ``host-attend`` and ``host-always`` with ``mode="reduce-overhead"`` (CUDA graphs: a decode
  step's attention jobs on the host recorded as host nodes);
* ``transformers``: ``cache_implementation="offloaded_static"`` (eager: the whole cache
  of the next layer is prefetched, in Python).

The bound of a host decode step is ``max(compute, bytes / H2D, read / host)``: compute is
the device row's decode step, bytes are the valid KV blocks copied in plus the offloaded
weights (``fx_offload.report``), H2D is the pinned copy bandwidth measured in the same
process, read the cache the host's cores read in place and host their measured rate.
Tokens are compared with the device row's.  Needs a GPU and ``transformers``.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from .. import compile_forward, report
from ..text import format_bytes
from ..selection.budget import weights_bytes
from .bench import h2d_bandwidth
from .common import at_least, build_random
from .generate_bench import step_gaps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--context", type=int, default=65536, help="prompt tokens")
    parser.add_argument("--new-tokens", type=at_least(3, "tokens generated (decode is timed "
                                                  "from the second to the last)"), default=9,
                        help="tokens generated")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together")
    parser.add_argument("--block", type=int, default=256, help="kv_block_size")
    parser.add_argument("--slots", type=int, default=2, help="kv_slots")
    parser.add_argument("--profile", action="store_true",
                        help="profile the decode steps of the rows with the cache on the host: "
                             "how busy the link is")
    parser.add_argument("--budget", default=None,
                        help="memory_budget of the budget row (default: the weights plus half "
                             "the cache)")
    parser.add_argument("--methods",
                        default="device,host,host-attend,host-offload,budget,host-graphs,"
                                "transformers",
                        help="comma-separated among device, host, host-attend, host-always, "
                             "host-offload, budget, host-graphs, host-attend-graphs, "
                             "host-always-graphs, transformers")


def _generate(model, prompt, new: int, mark: bool = False, **kwargs):
    """(prefill ms, median decode ms, tokens) of one greedy generate; ``mark``: each step
    leaves an ``fx_offload_step`` range in a profiler's trace (also under CUDA graphs, whose
    replays run none of the graph's ops on the host)."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    ticks: list[float] = []

    class _Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            ticks.append(time.perf_counter())
            if mark:
                with torch.profiler.record_function("fx_offload_step"):
                    pass
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             disable_compile=True, stopping_criteria=StoppingCriteriaList([_Clock()]), **kwargs)
    torch.cuda.synchronize()
    steps = step_gaps(ticks) or [float("nan")]
    return (ticks[0] - start) * 1e3, statistics.median(steps), out


def _cache(model, args):
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=args.context + args.new_tokens)
    return cache


# every weight stays on the device, as in the transformers row (a budget that holds them all,
# with device rates given so that the planner measures nothing)
RESIDENT = dict(memory_budget="1TiB", flop_rate=5e14, memory_bandwidth=3e12,
                h2d_bandwidth=5e10, launch_overhead=5e-6)


def _fresh(kept, model, args):
    """A new cache for each generate (one passed in is not reset), the latest kept."""
    kept["cache"] = _cache(model, args)
    return kept["cache"]


def _row(method, model, prompt, args, kept):
    """``kept``: the last cache, alive for the report, and the report of the timed decode."""
    if method == "device":
        model.forward = torch.compile(model.forward, dynamic=True)
        extra = lambda: dict(past_key_values=_fresh(kept, model, args))  # noqa: E731
    elif method == "budget":
        compile_forward(model, dynamic=True, memory_budget=args.budget)
        extra = lambda: dict(past_key_values=_fresh(kept, model, args))  # noqa: E731
    elif method.startswith("host"):
        graphs = method.endswith("-graphs")     # one graph per shape there: a prefill's and
        base = method[:-len("-graphs")] if graphs else method       # a decode step's
        weights = {} if method == "host-offload" else RESIDENT
        if base != "host-attend":
            weights = dict(weights, host_compute="always" if base == "host-always"
                           else "never")
        compile_forward(model, dynamic=not graphs, kv_cache="host",
                        kv_block_size=args.block, kv_slots=args.slots,
                        mode="reduce-overhead" if graphs else None, **weights)
        extra = lambda: dict(past_key_values=_fresh(kept, model, args))  # noqa: E731
    else:   # eager, as transformers runs it unless told to compile
        extra = lambda: dict(cache_implementation="offloaded_static")  # noqa: E731
    _generate(model, prompt, 3, **extra())                  # compile, warm up
    torch.cuda.reset_peak_memory_stats()
    _, decode, out = _generate(model, prompt, args.new_tokens, **extra())
    # what a decode step moved and read (the next generate's last call is a prefill)
    kept["report"] = report(model) if method.startswith("host") or method == "budget" \
        else None
    # the prefill alone, to its end on the device (the step clock's first tick is taken
    # before the device has finished it)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _generate(model, prompt, 1, **extra())
    prefill = (time.perf_counter() - start) * 1e3
    if args.profile and method != "device" and method != "transformers":
        _profile(method, model, prompt, extra, args.new_tokens)
    return prefill, decode, out, torch.cuda.max_memory_allocated()


def _profile(method, model, prompt, extra, new: int) -> None:
    """The link's busy time and idle gaps over the decode steps of one generate of up to 6
    tokens (``new``: no more than the cache holds; from the second step: the prefill and
    the first decode step excluded)."""
    from torch.profiler import ProfilerActivity, profile
    from .profiling import link_gaps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _generate(model, prompt, min(new, 6), mark=True, **extra())
    events = prof.events()
    # a mark is taken as a step's token is queued: from the second, the decode steps
    starts = sorted(ev.time_range.start for ev in events if ev.name == "fx_offload_step")
    after = starts[1] if len(starts) > 1 else 0.0
    # under CUDA graphs the fills are the kernel that reads the host through SMs
    print(f"  {method}, {max(len(starts) - 2, 0)} decode steps profiled: "
          f"{link_gaps(events, after, kernels=('_fill_prefix',))}", flush=True)


def run(args: argparse.Namespace) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=args.layers,
                         vocab_size=32000,
                         max_position_embeddings=args.context + args.new_tokens + 16)
    torch.manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.context), device="cuda")
    h2d = h2d_bandwidth(torch.device("cuda"))
    whole_cache = args.layers * 2 * args.batch * 8 * 128 * 2 * (args.context + args.new_tokens)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers "
          f"of Llama-3-8B shapes, batch {args.batch}, context {args.context}, "
          f"{args.new_tokens} new tokens; the whole cache: {format_bytes(whole_cache)}; "
          f"pinned H2D {h2d / 1e9:.1f} GB/s", flush=True)
    rows, results, kept, read = {}, {}, {}, {}
    for method in args.methods.split(","):
        torch._dynamo.reset()       # each row compiles anew (and stays under Dynamo's limit)
        model = build_random(LlamaForCausalLM, config)
        if method == "budget" and args.budget is None:
            args.budget = weights_bytes(model, torch.device("cuda")) + whole_cache // 2
            print(f"  budget: memory_budget {format_bytes(args.budget, as_option=True)} = the "
                  "weights and half the cache", flush=True)
        rows[method] = _row(method, model, prompt, args, kept)
        rep = kept.get("report")
        if rep is not None:
            results[method] = rep.kv["copied_per_step"] + rep.offloaded_bytes
            read[method] = rep.kv["attended_read"]
            results["kv"] = rep.kv
            print(str(rep), flush=True)
        del model
        kept.clear()
        gc.collect()
        torch.cuda.empty_cache()
        prefill, decode, _, peak = rows[method]
        print(f"  {method}: prefill {prefill:.1f} ms, decode {decode:.2f} ms/token, peak GPU "
              f"{format_bytes(peak)}", flush=True)
    reference = rows.get("device")
    host_read = 0.0
    if any(read.values()):
        from ..host_compute.rates import host_rates
        host_read = host_rates(torch.device("cuda")).read_rate
        print(f"\nthe host read its memory at {host_read / 1e9:.1f} GB/s (host_compute's probe):"
              " a host-attend row's bound also counts the cache it read at that rate")
    print("\n| method | prefill ms | decode ms/token | bound ms | x bound | peak GPU | "
          "tokens = device |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, (prefill, decode, out, peak) in rows.items():
        bound = "-"
        ratio = "-"
        if method in results:
            link = results[method] / h2d * 1e3
            compute = reference[1] if reference is not None else 0.0
            host = read.get(method, 0) / host_read * 1e3 if read.get(method) else 0.0
            bound = f"{max(compute, link, host):.2f}"
            ratio = f"{decode / max(compute, link, host):.3f}"
        same = "-" if reference is None or method == "device" else \
            str(bool(torch.equal(out, reference[2])))
        print(f"| {method} | {prefill:.1f} | {decode:.2f} | {bound} | {ratio} | "
              f"{format_bytes(peak)} | {same} |")
    if "kv" in results:
        kv = results["kv"]
        print(f"\na host decode step moves {format_bytes(kv['copied_per_step'])} of KV (valid "
              f"blocks at {kv['valid_tokens']} tokens); host-offload also every second "
              "layer's weights")
    return 0
