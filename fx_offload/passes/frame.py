"""What every graph pass of fx_offload does around its edits, in one place: the weight pass
(:func:`~fx_offload.passes.prefetch.run_prefetch_pass`) and the host KV cache's reroute
(:func:`fx_offload.kv.run_kv_pass`) both run inside :func:`pass_frame`::

    trace "<name>_before" -> the pass's edits -> trace "<name>_after" -> counters[<name>_us]

The traces are structured-trace artifacts (``TORCH_TRACE``), so tlparse shows each graph
before and after each pass; their text is built only when tracing is on.
"""
from __future__ import annotations

import contextlib
import time

from torch import fx
from torch._dynamo.utils import counters
from torch._logging import trace_structured


@contextlib.contextmanager
def pass_frame(name: str, gm: fx.GraphModule, spent_key: str):
    """Trace ``gm`` as ``name + "_before"``, run the body, trace it as ``name + "_after"``,
    and add the body's microseconds to ``counters["fx_offload"][spent_key]``.  A body that
    raises leaves no "after" trace and counts nothing."""
    trace_graph(f"{name}_before", gm)
    started = time.perf_counter()
    yield
    counters["fx_offload"][spent_key] += int((time.perf_counter() - started) * 1e6)
    trace_graph(f"{name}_after", gm)


def trace_graph(name: str, gm: fx.GraphModule) -> None:
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: gm.print_readable(print_output=False, include_stride=True,
                                             include_device=True),
    )
