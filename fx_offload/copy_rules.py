"""The rules by which the runtime sizes and chooses its copies, written once here for the
runtime that follows them and the planner that predicts them (``memory_budget``,
:mod:`fx_offload.selection.budget`): a leaf both import, so that the planner never imports
the runtime.

* :data:`ALIGN`: every view of a host block and of a slot starts at a multiple of it
  (:mod:`fx_offload.runtime.memory.host_memory`), so a layer's bytes are its tensors' bytes rounded
  up to it.
* :func:`expected_share` and :data:`WHOLE_ABOVE`: a routed MoE layer's experts move whole
  for a call whose tokens are expected to pick more than that share of them, else only the
  picked rows move (:mod:`fx_offload.runtime.experts.routed`).
* :func:`depth_wanted`: how many buffers the ring that fetches routed layers' other weights
  ahead holds (:mod:`fx_offload.runtime.experts.ahead`).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("fx_offload")

ALIGN = 512             # bytes; keeps every view aligned for the copy engine
WHOLE_ABOVE = 0.5       # expected share of a layer's experts a call picks: above it, whole

DEPTH = 4           # the fewest buffers in the ring (fewer only where fewer chunks follow)
MOST = 8            # the most the library picks by itself
PER_BUFFER = 5      # routed layers fetched ahead per buffer, between the two


def expected_share(num_experts: int, k: int, tokens: int) -> float:
    """Expected share of ``num_experts`` experts that ``tokens`` tokens pick, ``k`` each, if
    each picked at random."""
    return 1.0 - (1.0 - min(k / num_experts, 1.0)) ** tokens


def depth_wanted(layers: int) -> int:
    """How many buffers for a ring that fetches ``layers`` routed layers' other chunks:
    ``FX_OFFLOAD_AHEAD`` (a count; 0 turns the ring off), else one per :data:`PER_BUFFER`
    layers, at least :data:`DEPTH` and at most :data:`MOST`.

    The count follows the measurements, not a model of them (why eight pay at 48 layers
    and not at 8 was not traced; the fills begun as a call ends, which can use only the
    host's time between calls, are one candidate): at 8 layers four buffers were faster
    than eight, at 48 layers eight faster than four and sixteen no faster than eight
    (docs/notes/2026-11-27-moe-ring-ahead.md)."""
    value = os.environ.get("FX_OFFLOAD_AHEAD", "").strip()
    default = min(MOST, max(DEPTH, layers // PER_BUFFER))
    if not value:
        return default
    if value.isdigit():
        return int(value)
    log.warning("fx_offload: the environment variable FX_OFFLOAD_AHEAD=%r sets how many "
                "routed MoE layers' other weights are fetched ahead, a count (0 turns it "
                "off): the default, %d, used", value, default)
    return default
