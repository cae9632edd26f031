"""fx_offload: stream offloaded layers' weights into static GPU slots, as a compiler pass.

    compiled = torch.compile(model, backend="prefetch_offload", options={...})
    fx_offload.report(model)     # what was offloaded
    fx_offload.restore(model)    # weights back where they were
    fx_offload.compile_forward(model, group_size=2)   # for model.generate / pipelines

    with fx_offload.empty_weights():             # a model bigger than the GPU
        model = build_model()
    fx_offload.place(model, "cuda", checkpoint=folder, group_size=2, num_in_group=1)

The package in three phases: ``selection`` (once per model: what is offloaded), ``passes``
(once per graph: where the ops go), ``runtime`` (once per call: what the ops do); the shared
leaves (``options``, ``schedule``, ``ops``, ``graph_inputs``, ``registry``, ``errors``,
``text``); ``reporting`` for people; ``tools`` (demo, bench, inspect) apart.
"""
from __future__ import annotations

from . import ops as _ops  # noqa: F401  (registers the fx_offload:: custom ops)
from .checkpoint import empty_weights
from .compiler import PrefetchOffloadBackend, backend, prefetch_offload, register_names
from .errors import OffloadError
from .forward import compile_forward
from .options import OffloadOptions, parse_options
from .placement import place
from .reporting.explain import Explanation, explain
from .reporting.report import Report, report
from .runtime.ownership.weights import named_weights, restore, update_weights

__all__ = ["backend", "prefetch_offload", "compile_forward", "place", "empty_weights", "report",
           "restore", "explain", "Explanation",
           "named_weights", "update_weights", "OffloadError",
           "Report", "OffloadOptions", "PrefetchOffloadBackend", "parse_options"]

register_names()
