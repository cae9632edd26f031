"""``python -m fx_offload bench``: offloaded forward time against the same model resident,
the ideal bound, and what users pick today; see docs/benchmarks.md for the method.

Each method runs on its own copy of a decoder stack with Llama-3-8B layer shapes (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, bf16, random weights).  A forward is timed with CUDA
events over back-to-back calls (no synchronization between calls, so copies that run on into
the next call are counted where they are waited for), or with ``--sync-each-call`` by the
wall clock from one synchronize of every stream to the next (what a generate loop that reads
each step's token sees: every copy of the call, the circular prefetch included, is in it);
the table gives medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import statistics
import time

import torch

from .. import backend, report
from ..options import parse_size
from ..runtime.memory.slots import SlotBuffers
from ..schedule import Schedule
from ..selection.budget import CHUNKS_PREDICTED, simulate, weights_bytes
from .baselines import HookPrefetcher, accelerate_offload
from ..tools.models import TinyDecoder
from .profiling import copies_alone

log = logging.getLogger("fx_offload")

CONFIGS = {  # name: (group_size, num_in_group, prefetch_step)
    "g2n1s1": (2, 1, 1), "g2n1s2": (2, 1, 2), "g2n1s3": (2, 1, 3), "g4n1s1": (4, 1, 1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and few calls: a smoke run (CPU, CI)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers in the stack")
    parser.add_argument("--tokens", default="1,16,128,1024,4096,16384",
                        help="comma-separated token counts (batch 1)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"offload configs among {list(CONFIGS)}")
    parser.add_argument("--alternatives", default="hooks,accelerate,reduce-overhead",
                        help="comma-separated among hooks, accelerate, reduce-overhead")
    parser.add_argument("--budgets", default=None,
                        help="memory budgets for the planner (memory_budget): a config name "
                             "stands for the device memory that config's weights take, or "
                             "give sizes such as 3GiB; empty for none (default: those of "
                             "g2n1s1, g2n1s2, g4n1s1 that are run)")
    parser.add_argument("--inner-backend", default="inductor",
                        choices=("inductor", "aot_eager"),
                        help="what compiles the resident row and the offloaded graphs "
                             "(aot_eager: no kernels built, for a quick check that the bench "
                             "runs)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each row")
    parser.add_argument("--per-param-copies", action="store_true",
                        help="also run each config with one copy per parameter instead of "
                             "one packed copy per layer")
    parser.add_argument("--whole-layer-copies", action="store_true",
                        help="also run each config with copy_chunks=1: each layer copied "
                             "whole, after its last node, as a forward hook would")
    parser.add_argument("--circular-prefetch", default="auto",
                        help="comma-separated circular_prefetch values each config runs with "
                             "(auto, end, entry): where each slot's first layer is copied "
                             "back in for the next call; the first is the plain row")
    parser.add_argument("--circular-at-entry", action="store_true",
                        help="also run each config with circular_prefetch='entry' (the same "
                             "as adding entry to --circular-prefetch)")
    parser.add_argument("--sync-each-call", action="store_true",
                        help="time each call from a synchronize of every stream to the next")
    parser.add_argument("--hook-slots", default="1",
                        help="slot counts of the hook prefetcher alternative, e.g. 1,2")
    parser.add_argument("--out", default="bench_out", help="folder for results.md and plot")
    parser.add_argument("--pass-cost", action="store_true",
                        help="instead: time the pass alone at 8, 32 and 128 layers")


@dataclasses.dataclass
class Row:
    method: str
    tokens: int
    median_ms: float
    bound_ms: float | None = None
    sched_ms: float | None = None
    predicted_ms: float | None = None
    peak_gib: float | None = None


def _shapes(quick: bool, device: torch.device) -> dict:
    if quick or device.type == "cpu":
        return dict(hidden=64, heads=4, kv_heads=2, inner=128, vocab=256)
    return dict(hidden=4096, heads=32, kv_heads=8, inner=14336, vocab=1024)


def _build(layers: int, shapes: dict, device, dtype, seed: int = 0) -> TinyDecoder:
    with torch.device("meta"):
        model = TinyDecoder(layers, **shapes)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
                    .mul_(0.02).to(dtype))
        model.rotary.__init__(shapes["hidden"] // shapes["heads"])
        model.rotary.to(device)
    return model.eval()


def _time(fn, ids, repeats: int, device, sync_each_call: bool = False) -> float:
    with torch.no_grad():
        for _ in range(2):
            fn(ids)
        if device.type != "cuda" or sync_each_call:
            samples = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                fn(ids)
                _synchronize(device)
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        events[0].record()
        for i in range(repeats):
            fn(ids)
            events[i + 1].record()
        torch.cuda.synchronize(device)
        return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(repeats))


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)     # every stream of the device: copies included


def _rate(run, nbytes: int, device) -> float:
    """Bytes per second of ``run()`` moving ``nbytes`` on the current stream: the median of
    five runs after one more (CUDA events)."""
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:])


def h2d_bandwidth(device, nbytes: int = 1 << 28, rounds: int = 3) -> float:
    """Bytes per second of a pinned host-to-device copy, measured now: the best of
    ``rounds`` rounds, each the median of five copies from a buffer pinned for it.  One round
    alone read 32-46 GB/s in some processes on an H100 where the others read 55 GB/s, while
    the decode steps those processes timed were as fast as the others': a bound from such a
    reading is too long, and flatters every ratio to it."""
    if device.type != "cuda":
        return float("nan")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(rounds):
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        best = max(best, _rate(lambda: dev.copy_(host, non_blocking=True), nbytes, device))
        del host
    return best


def gather_bandwidth(device, rows: int = 64, row_bytes: int = 6 << 20, picked: int = 25,
                     rounds: int = 3) -> float:
    """Bytes per second that the routed-expert gather (:mod:`fx_offload.runtime.experts.gather`)
    reads from a host block page-locked as the offloaded weights are, ``picked`` of ``rows``
    rows of ``row_bytes`` (the default: Qwen3-30B-A3B's ``gate_up_proj`` rows), measured
    now: the best of ``rounds`` rounds, each the median of five gathers.  The SMs drive
    those reads (only the device knows which rows), and on the H100s measured they read host
    memory more slowly than the copy engine does (47-51 GB/s against 54-55,
    docs/notes/2026-11-27-moe-ring-ahead.md); NaN where the gather cannot run (no GPU, no
    Triton)."""
    from ..runtime.experts import gather
    from ..runtime.memory.host_memory import HostBlock
    if device.type != "cuda" or gather.triton is None:
        return float("nan")
    words = row_bytes // 4
    meta = torch.empty(rows, words, dtype=torch.int32, device="meta")
    block = HostBlock({"rows": meta}, fill=lambda views: views["rows"].fill_(1))
    host = block.views["rows"]
    slot = torch.empty(rows, words, dtype=torch.int32, device=device)
    mask = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    mask[torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:picked]] = 1
    best = max(_rate(lambda: gather.gather_rows(host, slot, mask), picked * row_bytes, device)
               for _ in range(rounds))
    del host, slot
    block.release()
    return best


def _peak(device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.pass_cost:
        return pass_cost(args)
    bench = Bench(args)
    bench.measure(bench.resident_name, bench.resident)
    bench.run_configs()
    bench.run_budgets()
    bench.run_alternatives()
    annotate(bench)
    write_results(bench)
    return 0


class Bench:
    """One benchmark run: the methods timed side by side and their rows."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = device = torch.device(
            args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cpu":
            print("note: on the CPU every 'copy' is a memcpy in the same memory and the "
                  "threads are shared: these timings check that the bench runs, they say "
                  "nothing about offloading speed (run it on a GPU)")
        tokens = [int(t) for t in args.tokens.split(",")]
        if args.quick:
            self.tokens, self.repeats = [t for t in tokens if t <= 128][:2] or [1, 16], 3
        else:
            self.tokens, self.repeats = tokens, args.repeats
        self.shapes = _shapes(args.quick, device)
        self.configs = [c for c in args.configs.split(",") if c]
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown config(s) {unknown}; choose among {list(CONFIGS)}")
        self.alternatives = [a for a in args.alternatives.split(",") if a]
        self.bandwidth = h2d_bandwidth(device)
        print(f"fx_offload bench: {args.layers} layers {self.shapes}, {self.dtype}, on {device} "
              f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
              f"torch {torch.__version__}; pinned H2D {self.bandwidth / 1e9:.1f} GB/s",
              flush=True)
        self.rows: list[Row] = []
        self.weights_on_device: dict[str, int] = {}   # config -> device bytes for weights
        self.moved: dict[str, int] = {}               # plan name -> bytes copied per call
        self.plans: dict[str, object] = {}            # plan name -> its report
        self.copies_alone: dict[str, float] = {}      # plan name -> ms of its copies alone
        self.planner_rep: dict[tuple[str, int], object] = {}
        self.chosen: dict[str, tuple] = {}
        self.cost_model = None

    def build(self):
        return _build(self.args.layers, self.shapes, self.device, self.dtype)

    def measure(self, method, make, only=None):
        device = self.device
        # every method compiles the same model class afresh: without a reset, Dynamo's
        # per-code cache would reach its recompile limit and run later methods eagerly
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        started = time.perf_counter()
        fn = make()
        if isinstance(fn, tuple):    # (callable, the token counts it is timed at)
            fn, only = fn
        timed = [t for t in self.tokens if only is None or t in only]
        for t in timed:
            ids = torch.randint(0, self.shapes["vocab"], (1, t), device=device)
            _reset_peak(device)
            ms = _time(fn, ids, self.repeats, device, self.args.sync_each_call)
            peak = _peak(device)
            self.rows.append(Row(method, t, ms,
                                 peak_gib=None if peak is None else peak - before / 2**30))
            print(f"  {method:<22} tokens {t:>6}: {ms:9.3f} ms", flush=True)
        print(f"  ({method}: {time.perf_counter() - started:.0f} s with compile)", flush=True)
        del fn
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return timed

    @property
    def resident_name(self) -> str:
        return f"resident ({self.args.inner_backend})"

    def resident(self):
        return torch.compile(self.build(), backend=self.args.inner_backend, dynamic=True)

    def run_configs(self) -> None:
        default_packed = SlotBuffers.packed
        args = self.args
        circular = [c for c in args.circular_prefetch.split(",") if c] or ["auto"]
        if args.circular_at_entry and "entry" not in circular:
            circular.append("entry")
        first = {} if circular[0] == "auto" else {"circular_prefetch": circular[0]}
        modes = [(default_packed, first, "")] + (
            [(False, first, "/per-param")] if args.per_param_copies else []) + (
            [(default_packed, {**first, "copy_chunks": 1}, "/whole-layer")]
            if args.whole_layer_copies else []) + [
            (default_packed, {"circular_prefetch": c}, f"/circular-{c}")
            for c in circular[1:]]
        for name in self.configs:
            group, num, step = CONFIGS[name]
            for packed, extra, suffix in modes:
                def offloaded(group=group, num=num, step=step, name=name + suffix,
                              packed=packed, extra=extra):
                    SlotBuffers.packed = packed
                    model = self.build()
                    total = weights_bytes(model, self.device)
                    options = dict(group_size=group, num_in_group=num, prefetch_step=step,
                                   inner_backend=args.inner_backend, **extra)
                    fn = torch.compile(model, backend="prefetch_offload", dynamic=True,
                                       options=options)
                    with torch.no_grad():
                        fn(torch.zeros(1, 1, dtype=torch.long, device=self.device))
                    SlotBuffers.packed = default_packed
                    rep = report(model)
                    self.moved[name] = moved_by(rep)
                    if self.device.type == "cuda":
                        self.copies_alone[name] = copies_alone(model)
                    self.plans[name] = rep
                    self.weights_on_device[name] = total - rep.offloaded_bytes + rep.buffer_bytes
                    return fn
                self.measure(f"offload {name}{suffix}", offloaded)

    def run_budgets(self) -> None:
        args = self.args
        specs = [b for b in args.budgets.split(",") if b] if args.budgets is not None else \
            [c for c in ("g2n1s1", "g2n1s2", "g4n1s1") if c in self.configs]
        for spec in specs:
            if spec in CONFIGS:
                if spec not in self.weights_on_device:
                    raise SystemExit(f"budget {spec!r} names a config that was not run; add "
                                     "it to --configs")
                budget = self.weights_on_device[spec]
            else:
                budget = parse_size("--budgets", spec)
            self._run_budget(spec, budget)

    def _run_budget(self, spec: str, budget: int) -> None:
        name = f"planner@{spec}"
        # The plan depends on the workload: each token count is timed with the plan chosen
        # for it alone (plan_tokens=[T]); token counts that get the same plan share a compile.
        todo = list(self.tokens)
        while todo:
            def planned(first=todo[0]):
                model = self.build()
                fn = torch.compile(model, backend="prefetch_offload", dynamic=True,
                                   options=dict(memory_budget=budget, plan_tokens=[first],
                                                inner_backend=self.args.inner_backend))
                with torch.no_grad():   # two tokens: a size-1 dimension would be traced static
                    fn(torch.zeros(1, 2, dtype=torch.long, device=self.device))
                rep = report(model)
                mine = rep.planner.chosen.candidate
                same = [t for t in todo if rep.planner.best_for([t]).candidate == mine]
                for t in same:
                    self.planner_rep[(name, t)] = rep
                self.chosen.setdefault(name, (spec, budget, {}))[2].update(
                    {t: rep for t in same})
                print(f"  planner, budget {spec} ({budget} bytes), tokens {same}: "
                      f"{mine.describe() if mine else 'nothing offloaded'}", flush=True)
                return fn, same
            done = self.measure(name, planned)
            todo = [t for t in todo if t not in done]
            self.cost_model = self.cost_model or \
                self.planner_rep[(name, done[0])].planner.cost_model

    def run_alternatives(self) -> None:
        alternatives, device = self.alternatives, self.device
        base_offloaded = [i for i in range(self.args.layers) if i % 2 >= 1]
        if "reduce-overhead" in alternatives and device.type == "cuda" and \
                "g2n1s1" in self.configs:
            def reduce_overhead():
                return torch.compile(self.build(),
                                     backend=backend(group_size=2, num_in_group=1),
                                     mode="reduce-overhead")
            self.measure("offload g2n1s1 +cudagraphs", reduce_overhead,
                         only={t for t in self.tokens if t <= 128})
        if "hooks" in alternatives and device.type == "cuda":
            for slots in [int(k) for k in self.args.hook_slots.split(",") if k]:
                def hooks(slots=slots):
                    model = self.build()
                    HookPrefetcher(model.layers, base_offloaded, device, slots=slots)
                    return model
                self.measure(f"hook prefetcher {slots} slot(s)", hooks)
        if "accelerate" in alternatives and device.type == "cuda":
            def accel():
                model = self.build()
                if not accelerate_offload(model.layers, base_offloaded, device):
                    raise RuntimeError("accelerate is not installed")
                return model
            try:
                self.measure("accelerate cpu_offload", accel)
            except RuntimeError as err:
                print(f"  accelerate skipped: {err}")

    @property
    def compute(self) -> dict[int, float]:
        return {r.tokens: r.median_ms for r in self.rows if r.method == self.resident_name}


def annotate(self: Bench) -> None:
    """Each offloaded row gets its bounds and the planner's prediction."""
    bandwidth, compute = self.bandwidth, self.compute
    for row in self.rows:
        cfg = row.method.split()[1] if row.method.startswith("offload ") else None
        rep = self.planner_rep.get((row.method, row.tokens)) or self.plans.get(cfg)
        if rep is None or not rep.layers:
            continue
        if self.cost_model is not None:
            row.predicted_ms = 1e3 * self.cost_model.predict(
                rep.layers, rep.num_slots, rep.layer_bytes, row.tokens)
        if row.tokens in compute:
            copy_ms = moved_by(rep) / bandwidth * 1e3 if bandwidth == bandwidth else 0.0
            row.bound_ms = max(compute[row.tokens], copy_ms)
            if bandwidth == bandwidth:
                row.sched_ms = schedule_bound(
                    self.args.layers, schedule_of(rep),
                    compute[row.tokens] / self.args.layers,
                    {layer: rep.layer_bytes[layer] / bandwidth * 1e3
                     for layer in rep.layers})
    # each distinct plan the planner chose gets its own line in the byte counts
    for (name, _), rep in self.planner_rep.items():
        if not rep.layers:
            continue
        key = f"{name} ({rep.planner.chosen.candidate.describe()})"
        self.plans.setdefault(key, rep)
        self.moved.setdefault(key, moved_by(rep))
    if self.cost_model is not None:
        for t in self.tokens:
            self.rows.append(Row("resident (predicted)", t,
                                 1e3 * self.cost_model.resident(t)))


def write_results(self: Bench) -> None:
    """The table (printed and written to results.md) and the plot."""
    compute = self.compute
    table = format_table(self.rows, compute, self.moved, self.bandwidth, self.plans,
                         self.copies_alone)
    table += planner_summary(self.rows, self.chosen, self.weights_on_device, self.configs,
                             self.plans)
    if self.cost_model is not None:
        table += (f"cost model: {self.cost_model.costs.describe()}; "
                  f"{self.cost_model.rates.describe()}\n")
    print(table)
    os.makedirs(self.args.out, exist_ok=True)
    results = os.path.join(self.args.out, "results.md")
    with open(results, "w") as f:
        f.write(table)
    print(f"table written to {results}")
    plot(self.rows, compute, os.path.join(self.args.out, "bench.png"))


def schedule_of(rep) -> Schedule:
    return Schedule(rep.layers, rep.num_slots, rep.circular)


def moved_by(rep) -> int:
    """Bytes a report's plan copies per forward."""
    return schedule_of(rep).moved_bytes(rep.layer_bytes)


def schedule_bound(num_layers: int, schedule: Schedule, layer_ms: float, copy_ms: dict,
                   calls: int = 4) -> float:
    """The fastest a forward can be under the slot constraints, from measured inputs: every
    layer computes for ``layer_ms`` (the resident model's time over the layers); see
    :func:`fx_offload.planner.simulate`."""
    return simulate(0.0, [layer_ms] * num_layers, 0.0, schedule, copy_ms, calls=calls,
                    chunks=CHUNKS_PREDICTED)


def planner_summary(rows, chosen, weights_on_device, configs, plans) -> str:
    """Per budget and token count: the plan the planner chose for that token count against
    every grid config that fits the same budget."""
    if not chosen:
        return ""
    ms = {(r.method, r.tokens): r.median_ms for r in rows}
    lines = ["", "planner (plan chosen per token count) against the grid configs that fit the "
             "same budget (median ms; ratio < 1: the planner's plan is faster):"]
    for name, (spec, budget, reps) in chosen.items():
        fits = [c for c in configs if weights_on_device.get(c, budget + 1) <= budget]
        lines.append(f"- budget {spec} = {budget / 2**30:.3f} GiB; grid configs that fit: "
                     f"{fits or 'none'}")
        for t, rep in sorted(reps.items()):
            plan = rep.planner.chosen.candidate
            same = [c for c in fits if plan and plans[c].layers == list(plan.layers)
                    and plans[c].num_slots == plan.num_slots]
            best = min(((ms[(f'offload {c}', t)], c) for c in fits
                        if (f'offload {c}', t) in ms), default=None)
            mine = ms[(name, t)]
            text = (f"  tokens {t}: {plan.describe() if plan else 'nothing offloaded'}"
                    f"{f' (the plan of {same[0]})' if same else ''}: {mine:.3f}")
            if best is not None:
                text += f"; best grid {best[1]} {best[0]:.3f}, ratio {mine / best[0]:.3f}"
            lines.append(text)
    errors = [r.median_ms / r.predicted_ms for r in rows if r.predicted_ms]
    resident = [(r.median_ms, ms.get(("resident (predicted)", r.tokens))) for r in rows
                if r.method.startswith("resident (") and r.method != "resident (predicted)"]
    errors_res = [m / p for m, p in resident if p]
    if errors:
        lines.append(f"measured / predicted, offloaded rows: {min(errors):.3f} .. "
                     f"{max(errors):.3f} over {len(errors)} rows; resident: "
                     f"{min(errors_res):.3f} .. {max(errors_res):.3f}")
    return "\n".join(lines) + "\n"


def format_table(rows, compute, moved, bandwidth, plans=None, alone=None) -> str:
    plans = plans or {}
    lines = ["| method | tokens | median ms | resident ms | bound ms | x bound | "
             "schedule bound ms | x schedule | predicted ms | x predicted | peak GPU GiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        bound = f"{r.bound_ms:.3f}" if r.bound_ms is not None else ""
        ratio = f"{r.median_ms / r.bound_ms:.3f}" if r.bound_ms else ""
        sched = f"{r.sched_ms:.3f}" if r.sched_ms is not None else ""
        sratio = f"{r.median_ms / r.sched_ms:.3f}" if r.sched_ms else ""
        peak = f"{r.peak_gib:.2f}" if r.peak_gib is not None else ""
        pred = f"{r.predicted_ms:.3f}" if r.predicted_ms else ""
        pratio = f"{r.median_ms / r.predicted_ms:.3f}" if r.predicted_ms else ""
        lines.append(f"| {r.method} | {r.tokens} | {r.median_ms:.3f} | "
                     f"{compute.get(r.tokens, float('nan')):.3f} | {bound} | {ratio} | "
                     f"{sched} | {sratio} | {pred} | {pratio} | {peak} |")
    lines.append("")
    lines.append("bytes copied per forward: " + ", ".join(
        f"{k} {v / 2**20:.0f} MiB" for k, v in moved.items()) +
        f"; pinned H2D bandwidth {bandwidth / 1e9:.1f} GB/s")
    lines.append("host memory (page-locked masters): " + ", ".join(
        f"{k} {p.offloaded_bytes / 2**20:.0f} MiB" for k, p in plans.items()))
    if alone:
        lines.append("copies alone, one call's bytes from the model's own host blocks in its "
                     "chunks, no compute: " + ", ".join(
                         f"{k} {ms:.2f} ms ({moved[k] / ms / 1e6:.1f} GB/s)"
                         for k, ms in alone.items()))
    return "\n".join(lines) + "\n"


def plot(rows, compute, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('(matplotlib not installed: no plot; pip install -e ".[bench]")')
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    methods = sorted({r.method for r in rows}, key=lambda m: [r.method for r in rows].index(m))
    for m in methods:
        pts = sorted((r.tokens, r.median_ms) for r in rows if r.method == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    bound = sorted({(r.tokens, r.bound_ms) for r in rows if r.method == "offload g2n1s1"
                    and r.bound_ms})
    if bound:
        ax.plot([b[0] for b in bound], [b[1] for b in bound], "k--", label="bound g2n1s1")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("median forward time (ms)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def pass_cost(args) -> int:
    """Time the pass alone (plan + rewrite + verify, as the pass records it in Dynamo's
    counters) against the whole first compile."""
    from torch._dynamo.utils import counters
    print("layers | pass ms | whole first compile ms (aot_eager) | pass share")
    for layers in (8, 32, 128):
        torch._dynamo.reset()
        counters["fx_offload"].clear()
        model = _build(layers, _shapes(True, torch.device("cpu")), "cpu", torch.float32)
        ids = torch.randint(0, 256, (1, 8))
        start = time.perf_counter()
        with torch.no_grad():
            torch.compile(model, backend="prefetch_offload",
                          options={"inner_backend": "aot_eager"})(ids)
        total = time.perf_counter() - start
        spent = counters["fx_offload"]["pass_us"] / 1e6
        print(f"{layers:6d} | {spent * 1e3:7.1f} | {total * 1e3:10.1f} | "
              f"{spent / total:.1%}", flush=True)
    return 0
