"""The prefetch pass as one sequence, the only one: the backend, ``fx_offload.explain`` and
the benchmark's pass-cost timing all call :func:`run_prefetch_pass`.

    trace before -> layout (arranged at the model's first graph) -> plan (plan.py)
                 [-> routed experts into host_experts ops (host_regions.py) -> plan again]
                 -> rewrite (rewrite.py) -> verify (verify.py)
                 -> trace after -> counters

The graph is edited in place; a plan the verifier refuses raises
:class:`~fx_offload.errors.ScheduleError` before anything is compiled or moved.
"""
from __future__ import annotations

import logging
import time

from torch import fx
from torch._dynamo.utils import counters
from torch._logging import trace_structured

from ..graph_inputs import GraphInputs
from ..layout import arrange
from ..selection.choice import Choice
from .host_regions import host_regions
from .plan import GraphPlan, plan_graph
from .rewrite import apply_plan
from .verify import slot_model_for, verify_graph

log = logging.getLogger("fx_offload")


def run_prefetch_pass(gm: fx.GraphModule, gi: GraphInputs, choice: Choice, learned,
                      handle: int, host_compute: str = "never") -> GraphPlan:
    """Insert the ops for ``choice``'s offloaded layers into ``gm`` (named by the offload
    state's ``handle``) and verify the result; returns the plan that was applied.  What it
    learns from the graph goes into ``learned`` (:class:`~fx_offload.learned.Learned`, the
    model's: its layout arranged from the model's first graph, the routing and hosting of
    each graph).  ``host_compute`` other than "never": routed experts become
    ``host_experts`` ops."""
    _trace_graph("fx_offload_before", gm)
    started = time.perf_counter()
    chunks = arrange(choice, learned, (gm, gi))     # the model's first graph fixes it
    plan = plan_graph(gm, gi, choice, learned, handle)
    if host_compute != "never" and host_regions(gm, gi, plan, choice, learned):
        plan = plan_graph(gm, gi, choice, learned, handle)
    apply_plan(gm, plan)
    verify_graph(gm, plan.weight_chunks(),
                 slot_model_for(choice.schedule, chunks, [lp.layer for lp in plan.layers]))
    spent_us = int((time.perf_counter() - started) * 1e6)
    _trace_graph("fx_offload_after", gm)
    counters["fx_offload"]["graphs"] += 1
    counters["fx_offload"]["waits"] += sum(len(w.chunks) for lp in plan.layers for w in lp.waits)
    counters["fx_offload"]["starts"] += sum(len(lp.starts) for lp in plan.layers) + (
        len(plan.entry.starts) if plan.entry is not None else 0)
    counters["fx_offload"]["pass_us"] += spent_us
    log.debug("fx_offload: pass placed ops for layers %s in %d us",
              [lp.layer for lp in plan.layers], spent_us)
    return plan


def _trace_graph(name: str, gm: fx.GraphModule) -> None:
    """A structured-trace artifact (``TORCH_TRACE``), so tlparse shows the graph before and
    after the pass; the text is only built when tracing is on."""
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False, include_stride=True,
                                             include_device=True),
    )
