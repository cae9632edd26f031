"""What the pass learns from a model's graphs, kept with the model rather than in its
:class:`~fx_offload.selection.Choice` (which selection made and nobody changes after):

* ``layout``: layer -> its copy chunks (:func:`fx_offload.layout.arrange`), arranged once:
  from the model's first graph, or at placement where no graph came first;
* ``routing``: layer -> {chunk index: ``"routed"`` or why it moves whole}
  (:func:`fx_offload.passes.routing.route`), added to by every graph;
* ``hosting``: layer -> ``"host"`` or why its routed experts stream
  (:func:`fx_offload.passes.host_regions.host_regions`), added to by every graph.

The compiler makes one at a model's first compile, hands it to the pass, then to the
run-time state (``OffloadState.learned``), and hands the state's to the pass of every later
graph.  The model's call hook holds it too, so a copy of the model (``deepcopy``, pickling),
offloaded again at its first call, starts from a copy of it: the graphs Dynamo shares with
the original fit it.  The runtime and the reports read it; only the pass and
:mod:`fx_offload.layout` write it.  The dicts are filled in place: the parts of the state
built before a layout is arranged (``place`` arranges at materialization) hold the same
dicts.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(eq=False)
class Learned:
    layout: dict = dataclasses.field(default_factory=dict)
    routing: dict = dataclasses.field(default_factory=dict)
    hosting: dict = dataclasses.field(default_factory=dict)
