"""``python -m fx_offload moe``: Hugging Face ``generate`` on a Qwen3-MoE built from a config
with Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts of 768, top-8; random bf16 weights),
timed side by side in one process:

* resident, its ``forward`` compiled with Inductor (``dynamic=True``; static shapes and a
  static cache with ``--static-cache``);
* fx_offload through :func:`fx_offload.compile_forward`, every layer offloaded,
  ``experts="whole"`` (every expert crosses the link every call) and ``experts="routed"``
  (the default: only the experts the call's tokens picked);
* accelerate's ``cpu_offload`` on the same layers (eager), where accelerate is installed.

Each ``generate`` is greedy with a fixed number of new tokens, at each batch size asked for,
and is followed by a synchronize.  Prefill is the median time of
``generate(max_new_tokens=1)``; decode ms/token is the median time between two decode steps
of the timed ``generate(max_new_tokens=N)`` calls (a clock in ``generate``'s stopping
criteria, reached once a token; the first gap, which waits for the prompt, is left out:
``--new-tokens`` is at least 3).  The bound of a decode step is the bytes its last forward copied
(every offloaded byte but the expert tensors', plus the rows of the experts it picked,
counted on the device) over the pinned host-to-device bandwidth measured in
the same process.  Tokens are compared with the resident model's.  ``--profile`` also
traces one ``generate`` per fx_offload row and batch and prints how busy the link was over
its decode steps, the gather kernels counted with the copies.  ``--expert-cache`` adds
routed rows with a device cache of each layer's most-picked experts (option
``expert_cache``): ``cached`` is the GiB of picked experts a step found there (they did not
cross the link), ``x routed`` the step against the bound of every routed byte, those
included; ``x bound`` stays against the bytes that crossed.  ``x gather`` is the step
against the bound with the gathered expert rows at the rate the gather kernel reads host
memory, measured in the same process (the SMs drive those reads; on the H100s measured the
probe read 12-14% slower than the copy engine), the rest at the copy engine's.  ``--memory-budget`` adds routed
rows planned by ``memory_budget`` instead (where the budget holds the layers' attention,
routers and norms, the planner offloads their expert tensors alone).  Needs a GPU and
``transformers``.

``--host-compute`` runs the routed rows with each ``host_compute`` value asked for: the
experts computed on the host's cores read their weights in place (``host GiB``, from
``report``), and such a step's bound is the larger of its copies over the link and its host
reads over the host's read rate: the link's rate measured while the host reads, the host's
the fastest it was seen reading (:func:`.common.fastest_host_read`).  Before a row's timed
calls at each batch, ``"auto"`` is let finish timing its plans (its trial) at that batch's
prompt and decode sizes, so the rows time the plan it keeps.
"""
from __future__ import annotations

import argparse
import gc
import os

import torch

from .. import backend, compile_forward, registry, report
from ..reporting.report import jobs_line
from .bench import gather_bandwidth, h2d_bandwidth
from .common import (add_flags, add_generate_arguments, build_random, fastest_host_read,
                     plain_read_rate, unavailable, with_accelerate)
from .common import graphs_route as _graphs
from .generate_bench import measure
from ..host_compute.trial import ROUNDS, SETTLE

# generate calls (and the decode steps of the first) that let "auto" time each plan's blocks
# at a batch's sizes, with calls read late
_SETTLE_CALLS = SETTLE + ROUNDS * 3 * 2 + 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generate_arguments(parser, layers=8, new_tokens=17, fewest=3,
                           timed="decode is timed from the second to the last")
    add_flags(parser, [
        ("--batch", "1,8", "comma-separated batch sizes"),
        ("--prefetch-step", 1, "slots (prefetch_step); 1, the library's default, measures what "
         "a user who sets nothing gets"),
        ("--experts", "whole,routed", "comma-separated experts values of the fx_offload rows"),
        ("--expert-cache", "0", "comma-separated expert_cache sizes of the routed rows (bytes, "
         "or such as 1GiB; 0: none): a row each"),
        ("--memory-budget", "", "comma-separated memory_budget values (such as 3GiB): a routed "
         "row each, planned by the planner instead of every layer offloaded (where the budget "
         "holds the layers' other weights, it offloads their experts alone)"),
        ("--ahead", "", "comma-separated depths of the ring that fetches routed layers' other "
         "chunks ahead (FX_OFFLOAD_AHEAD; 0: off) for the routed rows, a row each; empty: the "
         "library's default alone"),
        ("--host-compute", "", "comma-separated host_compute values (never, auto, always) of "
         "the routed rows, a row each; empty: the library's default alone"),
        ("--static-cache", False, "compile with static shapes (dynamic=False) and generate with "
         "a static cache sized for the longest generate: two graphs a batch size (the prompt, "
         "the decode steps) instead of four, about six times less to compile (what a 48-layer "
         "row needs)"),
        ("--profile", False, "after each fx_offload row's timing, profile the decode steps of "
         "one generate and print how busy the link was (copies and the routed experts' gather) "
         "and its longest idle gaps")])


def run(args: argparse.Namespace) -> int:
    if unavailable("MoE", "transformers"):
        return 2
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_hidden_layers=args.layers,
                            vocab_size=151936, max_position_embeddings=8192,
                            torch_dtype=torch.bfloat16)
    bandwidth = h2d_bandwidth(torch.device("cuda"), 1 << 30)
    gathering = gather_bandwidth(torch.device("cuda"))
    batches = [int(b) for b in args.batch.split(",") if b]
    print(f"Qwen3-MoE, {args.layers} layers of Qwen3-30B-A3B shape (bf16, random weights, "
          f"128 experts, top-8), prompt {args.prompt} tokens, {args.new_tokens} new, batch "
          f"{batches}; {torch.cuda.get_device_name()}, torch {torch.__version__}; pinned H2D "
          f"{bandwidth / 1e9:.1f} GB/s, expert gather from host {gathering / 1e9:.1f} GB/s",
          flush=True)

    dynamic = not args.static_cache

    def build():
        model = build_random(Qwen3MoeForCausalLM, config)
        if args.static_cache:
            _static_cache(model, args.prompt + max(args.new_tokens, _SETTLE_CALLS))
        return model

    # a prompt to warm up on and one per timed generate: no row decodes a sequence it saw
    # (an expert cache would learn its experts exactly)
    prompts = {b: [torch.randint(0, config.vocab_size, (b, args.prompt), device="cuda",
                                 generator=torch.Generator("cuda").manual_seed(1000 * b + i))
                   for i in range(args.repeats + 1)] for b in batches}
    rows, tokens, moved = {}, {}, {}
    methods = [m for m in args.methods.split(",") if m]
    graphs = " + CUDA graphs" if args.cuda_graphs else ""
    if "resident" in methods:
        model = build()
        extra = _graphs(None) if args.cuda_graphs else {}
        if not args.cuda_graphs:
            model.forward = torch.compile(model.forward, dynamic=dynamic)
        for b in batches:
            rows[(f"resident (Inductor{graphs})", b)], tokens[("resident", b)] = \
                measure(model, prompts[b], args, extra=extra, steps=True)
        del model
        _free()
    depths = [d for d in args.ahead.split(",") if d] or [None]
    hosts = [h for h in args.host_compute.split(",") if h] or [None]
    rows_of = [(e, c, None, a, h) for e in args.experts.split(",") if e
               for c in (args.expert_cache.split(",") if e == "routed" else ["0"])
               for a in (depths if e == "routed" else [None])
               for h in (hosts if e == "routed" else [None])]
    rows_of += [("routed", "auto", b, None, h) for b in args.memory_budget.split(",") if b
                for h in hosts]
    default_depth = os.environ.get("FX_OFFLOAD_AHEAD")
    rates, host_read = _host_rates() if any(h != "never" for h in hosts) else (None, None)
    for experts, cache, budget, depth, host in rows_of if "fx_offload" in methods else []:
        torch._dynamo.reset()
        _set_env("FX_OFFLOAD_AHEAD", default_depth if depth is None else depth)
        model = build()
        options = dict(group_size=1, num_in_group=1, prefetch_step=args.prefetch_step) \
            if budget is None else dict(memory_budget=budget)
        options |= dict(experts=experts, expert_cache=cache if cache != "0" else None)
        if host is not None:
            options["host_compute"] = host
        extra = _graphs(backend(**options)) if args.cuda_graphs else {}
        if not args.cuda_graphs:
            compile_forward(model, dynamic=dynamic, **options)
        name = (f"fx_offload, {args.layers} layers, {args.prefetch_step} slots, "
                f"experts={experts!r}" + (f", cache {cache}" if cache != "0" else "")
                + (f", ahead {depth}" if depth is not None else "")
                if budget is None else f"fx_offload, memory_budget={budget}, experts={experts!r}"
                ) + (f", host_compute={host!r}" if host and experts == "routed" else "") + graphs
        for b in batches:
            if host != "never" and experts == "routed" and not args.cuda_graphs:
                _settle_trials(model, prompts[b][0])
            rows[(name, b)], tokens[(name, b)] = measure(model, prompts[b], args, extra=extra,
                                                         steps=True)
            print(f"  {name}, batch {b}: prefill {rows[(name, b)][0]:.1f} ms, decode "
                  f"{rows[(name, b)][1]:.2f} ms/token", flush=True)   # (a row takes minutes)
            moved[(name, b)] = _step_bytes(model)
            jobs = report(model).host_jobs_last_call
            if jobs is not None:    # (the report after the row holds the last batch's only)
                print(f"  batch {b}, the last step: {jobs_line(*jobs).strip()}",
                      flush=True)
            if args.profile:
                _profile(model, prompts[b][0], extra)
        print(report(model), flush=True)
        del model
        _free()
    _set_env("FX_OFFLOAD_AHEAD", default_depth)
    model = with_accelerate(build, lambda m: m.model.layers) \
        if "accelerate" in methods else None
    if model is not None:
        name = f"accelerate cpu_offload, {args.layers} layers (eager)"
        for b in batches:
            first_last = [prompts[b][0], prompts[b][-1]]    # the others' last tokens
            rows[(name, b)], tokens[(name, b)] = measure(model, first_last, args, 1,
                                                         steps=True)
        del model
    torch.cuda.empty_cache()
    _print_table(rows, tokens, moved, bandwidth, gathering, rates, host_read)
    return 0


def _settle_trials(model, prompt) -> None:
    """Let ``host_compute="auto"`` finish timing its plans at this batch's prompt and decode
    sizes before the timed calls (:mod:`fx_offload.host_compute.trial`): enough prompts and
    decode steps for each plan's warm-up and timed calls."""
    calls = _SETTLE_CALLS
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=calls, min_new_tokens=calls, do_sample=False)
        for _ in range(calls):
            model.generate(prompt, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()


def _static_cache(model, longest: int) -> None:
    """Every ``generate`` of ``model`` on a static cache of one length, ``longest`` tokens
    (the prompt and the most new tokens any call asks for), so its shapes never change: a
    call with fewer tokens reuses the compiled graphs.  Needs a transformers whose
    ``GenerationConfig`` has ``max_cache_len`` (5.17 and 5.23 have it); without it a call
    longer than those before it may compile again."""
    model.generation_config.cache_implementation = "static"
    model.generation_config.max_cache_len = longest


def _host_rates():
    """The host's rates as ``host_compute`` measured them (cached per machine), and the
    fastest rate the host was seen reading (a step's bound holds its host reads to it)."""
    from ..host_compute.rates import host_rates
    rates = host_rates(torch.device("cuda"))
    plain = plain_read_rate()
    print(f"host read rate {rates.read_rate / 1e9:.1f} GB/s alone, "
          f"{rates.read_beside_link / 1e9:.1f} while the link copies (at "
          f"{rates.link_beside_reads / 1e9:.1f} GB/s; {rates.link_rate / 1e9:.1f} alone), "
          f"a plain sum {plain / 1e9:.1f}; the bound takes the fastest, "
          f"{fastest_host_read(rates, plain) / 1e9:.1f}: "
          "host_compute's measurements", flush=True)
    return rates, fastest_host_read(rates, plain)


def _profile(model, prompt, extra, new_tokens: int = 6) -> None:
    """The link's busy time and idle gaps over the decode steps of one ``generate`` (from
    the second decode step on: the prefill and the first step excluded), the routed
    experts' gather kernels counted with the copies."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import StoppingCriteria, StoppingCriteriaList
    from .profiling import link_gaps

    class _Mark(StoppingCriteria):          # reached once a step, before its token is read
        def __call__(self, input_ids, scores, **kwargs):
            with record_function("fx_offload_step"):
                pass
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, stopping_criteria=StoppingCriteriaList([_Mark()]),
                       **(extra or {}))
        torch.cuda.synchronize()
    events = prof.events()
    marks = sorted(ev.time_range.start for ev in events if ev.name == "fx_offload_step")
    after = marks[1] if len(marks) > 1 else 0.0
    print(f"  batch {prompt.shape[0]}, {max(len(marks) - 2, 0)} decode steps profiled: "
          f"{link_gaps(events, after, kernels=('_gather_rows',))}", flush=True)


def _print_table(rows, tokens, moved, bandwidth, gathering, rates=None,
                 host_read=None) -> None:
    print(f"\n{'method':88s} {'batch':>5s} {'prefill ms':>10s} {'decode ms/tok':>13s} "
          f"{'GiB/step':>8s} {'host GiB':>8s} {'x bound':>8s} {'x gather':>8s} {'cached':>8s} "
          f"{'x routed':>8s} {'x whole':>8s} {'same tokens':>11s}")
    for (name, b), (prefill, decode) in rows.items():
        ref = tokens.get(("resident", b))
        same = "-" if ref is None or name.startswith("resident") else (
            "yes" if torch.equal(tokens[(name, b)], ref) else "NO")
        nbytes, cached, gathered, host = moved.get((name, b), (None, 0, 0, 0))
        # a step's bound: its copies over the link (at its rate beside the host's reads) and
        # its host reads over the fastest the host was seen reading, the larger of the two
        floor = max(nbytes / rates.link_beside_reads, host / host_read) \
            if nbytes and host and rates else nbytes / bandwidth if nbytes else None
        bound = decode / (floor * 1e3) if floor else float("nan")
        # the gathered rows at the gather kernel's rate, the rest at the copy engine's
        reach = decode / (((nbytes - gathered) / bandwidth + gathered / gathering) * 1e3) \
            if nbytes else float("nan")
        # against the bound of every routed byte, those the expert cache held included
        routed = decode / ((nbytes + cached) / bandwidth * 1e3) if nbytes else float("nan")
        whole = next((d for (n, bb), (_, d) in rows.items()
                      if bb == b and "experts='whole'" in n), None)
        to_whole = decode / whole if whole and nbytes else float("nan")
        gib = f"{nbytes / 2**30:8.3f}" if nbytes else f"{'-':>8s}"
        print(f"{name:88s} {b:5d} {prefill:10.1f} {decode:13.2f} {gib} {host / 2**30:8.3f} "
              f"{bound:8.3f} "
              f"{reach:8.3f} {cached / 2**30:8.3f} {routed:8.3f} {to_whole:8.3f} {same:>11s}")


def _step_bytes(model) -> tuple[int, int, int, int]:
    """Bytes the last decode step had to move: every offloaded byte but the expert tensors',
    plus the expert rows it gathered across the link (counted on the device, replays of a
    CUDA graph too) where experts are routed, else every expert's; the bytes of picked
    experts the expert cache held (they did not cross); of the first, the gathered
    rows; and the host memory its host-computed experts read in place.  This is what the step must move, whatever moved (``copied_bytes_last_call`` says
    what did)."""
    rep = report(model)
    state = registry.state_for_model(model)
    expert_bytes = sum(p.nbytes for layer, tensors in state.choice.experts.items()
                       for p in state.params[layer] if p.suffix in tensors)
    routed = any(v.startswith("routed") for v in rep.experts.values())
    gathered = int(state.routed.gathered) if routed else 0
    cached = int(state.routed.cached_bytes) if routed else 0
    others = sum(rep.layer_bytes.values()) - expert_bytes
    # host-computed experts gathered nothing: what they read is counted apart
    return others + (gathered if routed else expert_bytes), cached, gathered, \
        rep.host_read_bytes_last_call


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _free() -> None:
    """Give the device memory of the row just measured back before the next is built."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()

