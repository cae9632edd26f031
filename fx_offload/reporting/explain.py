"""``fx_offload.explain``: what the pass would do to a model, without changing the model.

The model is traced by Dynamo with a recording backend that runs the pass on a copy of each
graph, verifies it, and lets the original graph run: weights are not moved, nothing is
registered, the model runs once on the example inputs (under ``no_grad``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from .. import layout, registry
from ..errors import OffloadError
from ..graph_inputs import read_graph_inputs
from ..learned import Learned
from ..options import parse_options
from ..passes.prefetch import run_prefetch_pass
from ..passes.rewrite import drop_waits_of
from ..passes.plan import GraphPlan
from ..selection import Choice, NothingOffloaded, choose
from ..ops import OpCall
from ..text import format_bytes, format_numbers, render_table
from .printing import format_graph, source_display_name


@dataclasses.dataclass
class GraphRecord:
    index: int
    before: fx.GraphModule                 # the graph Dynamo made (a copy)
    after: fx.GraphModule                  # the rewritten graph
    plan: GraphPlan | None                 # None: no offloaded layer in this graph
    weight_tags: dict[fx.Node, tuple[int, int, int]]  # node of ``after`` -> (layer, slot, chunk)
    aten: fx.GraphModule | None = None     # post-AOTAutograd forward graph, if asked for
    input_names: list[str] = dataclasses.field(default_factory=list)
    input_tags: list = dataclasses.field(default_factory=list)
    note: str = ""

    def text(self) -> str:
        return format_graph(self.after, self.weight_tags)

    def summary(self) -> str:
        """One line in place of the graph: its size and the ops the pass inserted."""
        nodes = list(self.after.graph.nodes)
        inserted = sum(1 for n in nodes if OpCall.of(n) is not None)
        note = f" ({self.note})" if self.note else ""
        return f"graph {self.index}{note}: {len(nodes)} nodes, {inserted} inserted op(s)"

    def aten_text(self) -> str | None:
        if self.aten is None:
            return None
        return format_graph(self.aten, input_names=self.input_names,
                            input_tags=self.input_tags)


@dataclasses.dataclass(repr=False)
class Explanation:
    model: str
    options: str
    choice: Choice | NothingOffloaded       # what would be offloaded, and how
    graphs: list[GraphRecord]
    learned: Learned = dataclasses.field(default_factory=Learned)    # what the pass found

    def plan_rows(self) -> list[tuple[str, ...]]:
        choice = self.choice
        where: dict[int, tuple[str, str]] = {}
        at_entry: dict[int, str] = {}           # leaving layer -> where its slot is refilled
        for record in self.graphs:
            if record.plan is not None and record.plan.entry is not None:
                for leaving, _ in record.plan.entry.starts:
                    at_entry[leaving] = f"next call, g{record.index}: at entry"
            for lp in record.plan.layers if record.plan else []:
                befores = ", ".join(w.first_use.name for w in lp.waits)
                afters = ", ".join(dict.fromkeys(
                    st.after.name if st.behind is None else
                    f"{st.after.name} (placed before {st.behind.first_use.name})"
                    for st in lp.starts))
                where[lp.layer] = (f"g{record.index}: " + (f"before {befores}" if befores
                                                            else "none (host_experts)"),
                                   f"after {afters}" if lp.starts else "-")
        rows = [("layer", "slot", "params", "bytes", "wait", "start", "prefetches")]
        sizes = choice.layer_bytes
        for layer in choice.layers:
            wait, start = where.get(layer, ("(not in these graphs)", "-"))
            if layer in at_entry:       # with the end start too where both are in the graphs
                start = at_entry[layer] if start == "-" else f"{start}, or {at_entry[layer]}"
            refill = choice.schedule.refill_of[layer]
            rows.append((str(layer), str(choice.schedule.slot_of[layer]),
                         str(len(choice.params[layer])), format_bytes(sizes[layer]), wait,
                         start,
                         "-" if refill is None else f"layer {refill}"))
        return rows

    def plan_text(self) -> str:
        choice = self.choice
        if isinstance(choice, NothingOffloaded):
            return (f"model: {self.model}; options: {self.options}\nnothing offloaded\n"
                    f"{choice.planner}\n")
        head = [f"model: {self.model}; layer stack {choice.stack.path or '<root>'!r} of "
                f"{len(choice.stack.modules)}; offloaded layers {choice.layers}",
                f"options: {self.options}",
                f"offloaded {format_bytes(choice.offloaded_bytes)}; "
                f"{choice.schedule.num_slots} slot(s) of {format_bytes(choice.slot_bytes)} in "
                "all on <device>"]
        # layers cut alike (the usual case) share one line
        alike: dict[str, list[int]] = {}
        for layer in choice.layers:
            alike.setdefault(f"chunks: {layout.describe(self.learned.layout[layer])}"
                             if layer in self.learned.layout else
                             ", ".join(p.suffix for p in choice.params[layer]), []).append(layer)
        params = [f"{'layers' if len(layers) > 1 else 'layer'} {format_numbers(layers)}"
                  f"{'' if what.startswith('chunks') else ':'} {what}"
                  for what, layers in alike.items()]
        planner = [] if choice.planner is None else ["", str(choice.planner)]
        hosting = [] if not self.learned.hosting else [
            "host_compute: " + "; ".join(
                f"layer {layer}: " + (why if why != "host" else "a host_mlp op (its MLP)"
                                      if layer in self.choice.mlps else "a host_experts op")
                for layer, why in sorted(self.learned.hosting.items()))]
        if hosting and choice.under_cuda_graphs:
            hosting.append("  under CUDA graphs: a host_experts op is recorded as a host job "
                           "(a host node) where the host alone, or a split with the device, "
                           "is predicted faster than streaming at the call's size, else its "
                           "experts stream in the graph; a host_mlp op streams "
                           "(report(model) says where each ran)")
        return "\n".join(head + [""] + render_table(self.plan_rows()) + [""] + params
                         + hosting + planner) + "\n"

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        # what a REPL shows for a bare explain(...): the plan and a line per graph, not the
        # fields' own reprs (every tensor's values, raw byte offsets: 200 lines at 4 layers)
        return self.text(graphs=False)

    def text(self, graphs: bool = True) -> str:
        """The plan, then each rewritten graph; ``graphs=False``: a line per graph instead."""
        parts = [self.plan_text()]
        if not graphs:
            return "\n".join(parts + [r.summary() for r in self.graphs]) + "\n"
        for record in self.graphs:
            note = f" ({record.note})" if record.note else ""
            parts.append(f"== graph {record.index}: rewritten{note} ==\n{record.text()}")
            aten = record.aten_text()
            if aten is not None:
                parts.append(f"== graph {record.index}: after AOTAutograd (ATen) ==\n{aten}")
        return "\n".join(parts)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _aten_graph(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    captured = []

    def record(fw_gm, _inputs):
        captured.append(fw_gm)
        return make_boxed_func(fw_gm.forward)

    aot_module_simplified(gm, example_inputs, fw_compiler=record)
    return captured[0]


def explain(model: nn.Module, *example_inputs, aten: bool = False, dynamic: bool | None = None,
            **options) -> Explanation:
    """Trace ``model`` on ``example_inputs`` and show the plan and the rewritten graphs the
    backend would produce with ``options``, without moving any weight."""
    model = registry.model_arg(model, "fx_offload.explain")     # (unwraps torch.compile's)
    opts = parse_options(options)
    existing = registry.state_for_model(model)
    if existing is not None and existing.choice.options.placement_key() == opts.placement_key():
        choice, handle = existing.choice, existing.handle
        # the model's chunks (arranged once); routing and hosting found here stay here
        learned = Learned(layout=dict(existing.learned.layout))
    else:
        learned = Learned()
        # the planner needs the first graph's costs: it chooses in the backend below
        choice = None if opts.planned else choose(model, opts, check_owners=existing is None)
        handle = registry.new_handle()      # names the ops; they never run here
    records: list[GraphRecord] = []

    def backend(gm, inputs):
        nonlocal choice
        after = _copy_graph_module(gm)
        if existing is not None and handle != existing.handle:
            # other options than the model's own: its layers' hooks traced waits of its
            # own offload into the graph, which the graph of a plain model has not
            drop_waits_of(after, existing.handle)
        gi = read_graph_inputs(after, inputs)
        index = len(records)
        names = [source_display_name(n) or n.name for n in gi.placeholders]
        if choice is None and gi.root is model and gi.params:
            choice = choose(model, opts, graph=(after, gi), check_owners=existing is None)
        if isinstance(choice, NothingOffloaded):
            records.append(GraphRecord(index, gm, after, None, {}, input_names=names,
                                       note="nothing offloaded"))
            return gm.forward
        if gi.root is not model or not gi.params:
            note = ("no model parameters" if not gi.params else
                    f"compiled from {type(gi.root).__name__}.forward on its own: no prefetch, "
                    "the layers' hooks load their weights")
            records.append(GraphRecord(index, gm, after, None, {}, note=note,
                                       input_names=names))
            return gm.forward
        plan = run_prefetch_pass(after, gi, choice, learned, handle,
                                 choice.options.host_compute_in(choice.device.type, opts.mode),
                                 choice.options.mlps_on_host_in(choice.device.type, opts.mode))
        tags = {w: (lp.layer, lp.slot, chunk) for lp in plan.layers
                for w, chunk in lp.weights.items()}
        record = GraphRecord(index, gm, after, plan, tags, input_names=names,
                             input_tags=[tags.get(n) for n in gi.placeholders])
        if aten:
            record.aten = _aten_graph(after, inputs)
        records.append(record)
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        compiled(*example_inputs)
    if choice is None:
        raise OffloadError(f"no graph of {type(model).__name__} read its parameters, so the "
                           "planner had nothing to weigh", where="fx_offload.explain")
    return Explanation(type(model).__name__, opts.describe(placement_only=True), choice, records,
                       learned)
