"""The prefetch pass as one sequence, the only one: the backend, ``fx_offload.explain`` and
the benchmark's pass-cost timing all call :func:`run_prefetch_pass`.

    trace before -> layout (arranged at the model's first graph) -> plan (plan.py)
                 [-> routed experts into host_experts ops (host_regions.py) -> plan again]
                 -> rewrite (rewrite.py) -> verify (verify.py)
                 -> trace after -> counters

inside the frame every pass shares (frame.py; the host KV cache's reroute runs in it too).

The graph is edited in place; a plan the verifier refuses raises
:class:`~fx_offload.errors.ScheduleError` before anything is compiled or moved.
"""
from __future__ import annotations

import logging

from torch import fx
from torch._dynamo.utils import counters

from ..graph_inputs import GraphInputs
from ..layout import arrange
from ..selection.choice import Choice
from .frame import pass_frame
from .host_regions import host_regions
from .plan import GraphPlan, plan_graph
from .rewrite import apply_plan
from .verify import slot_model_for, verify_graph

log = logging.getLogger("fx_offload")


def run_prefetch_pass(gm: fx.GraphModule, gi: GraphInputs, choice: Choice, learned,
                      handle: int, host_compute: str = "never",
                      host_mlps: bool = True) -> GraphPlan:
    """Insert the ops for ``choice``'s offloaded layers into ``gm`` (named by the offload
    state's ``handle``) and verify the result; returns the plan that was applied.  What it
    learns from the graph goes into ``learned`` (:class:`~fx_offload.learned.Learned`, the
    model's: its layout arranged from the model's first graph, the routing and hosting of
    each graph).  ``host_compute`` other than "never": routed experts become
    ``host_experts`` ops, and dense MLPs ``host_mlp`` ops where ``host_mlps``."""
    with pass_frame("fx_offload", gm, "pass_us"):
        chunks = arrange(choice, learned, (gm, gi))     # the model's first graph fixes it
        plan = plan_graph(gm, gi, choice, learned, handle)
        if host_compute != "never" and host_regions(gm, gi, plan, choice, learned,
                                                    host_mlps):
            plan = plan_graph(gm, gi, choice, learned, handle)
            plan.hosts = True
        apply_plan(gm, plan)
        verify_graph(gm, plan.weight_chunks(),
                     slot_model_for(choice.schedule, chunks, [lp.layer for lp in plan.layers]))
    counters["fx_offload"]["graphs"] += 1
    counters["fx_offload"]["waits"] += sum(len(w.chunks) for lp in plan.layers for w in lp.waits)
    counters["fx_offload"]["starts"] += sum(len(lp.starts) for lp in plan.layers) + (
        len(plan.entry.starts) if plan.entry is not None else 0)
    log.debug("fx_offload: pass placed ops for layers %s", [lp.layer for lp in plan.layers])
    return plan

