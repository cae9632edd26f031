"""``FX_OFFLOAD_CHECK_SLOTS=1``: after each wait, compare what the slot holds with the host
block it was copied from, and fail the call, naming the layer and its tensors, where they
differ.

A debugging aid for outputs that look wrong: a copy that had not landed when the layer read
it, a decode that wrote other bytes, a slot overwritten too early.  Each op's wait is
followed by a comparison, made in stream order right after it, so it sees what the layer's
first read sees::

    wait_prefetch([x], h, L, c)          state.wait(L, c);  slot bytes of chunk c == host bytes
    wait_routed([x], ids, h, L, c)       ... ;  the rows ``ids`` picked (or the whole chunk)

Slow by design: every comparison waits for the device (and copies the slot's bytes to the
host).  Not inside a CUDA-graph capture: a replay runs no Python, so replays are not
checked; run the model without ``mode="reduce-overhead"`` to check it.  Compared as bytes,
so a NaN weight compares equal to itself.  A chunk found wrong is forgotten first, so its
next wait reloads it and the model keeps working once the cause is gone.
"""
from __future__ import annotations

import logging
import os

import torch

from ...errors import OffloadError
from .streams import capturing
from ..phase import Phase

log = logging.getLogger("fx_offload")

ENV = "FX_OFFLOAD_CHECK_SLOTS"


class SlotCheckError(OffloadError):
    """A slot held other bytes than its host block when its layer was about to read them."""


def enabled() -> bool:
    """Read when the state is made and at each call's hook (on and off between calls)."""
    return os.environ.get(ENV, "") not in ("", "0")


def after_wait(state, layer: int, chunk: int, ids: torch.Tensor | None = None) -> None:
    """``layer``'s ``chunk`` (-1: all of them) was just waited for: compare each of its
    tensors in the slot with its host copy (for a routed chunk not held whole, the rows
    ``ids`` picked).  Raises :class:`SlotCheckError` naming what differs."""
    if getattr(state, "phase", Phase.RESTORED) is Phase.RESTORED or state.buffers is None \
            or capturing():
        return                          # restored, or a stand-in (fx_offload.registry)
    buffers, held = state.buffers, state.contents.slot(layer)
    for c in state.contents.chunks(layer, chunk):
        rows = None
        if ids is not None and (layer, c.index) not in held:    # gathered: picked rows only
            rows = torch.unique(ids.detach().reshape(-1)).cpu()
        wrong = [p.name for p in buffers.params[layer] if p.suffix in c.suffixes
                 and any(_differs(buffers.views[layer][key], buffers.masters[layer][key], rows)
                         for key in p.parts())]
        if wrong:
            state.contents.forget(layer, c)     # reloaded at its next wait
            # not a bug: its record was found corrupt
            state.buffers.compression.raise_if_corrupt()
            raise SlotCheckError(
                f"{ENV}: the slot of layer {layer} of {state.model_name} held other bytes than "
                f"the host copy of {', '.join(wrong)} (chunk {c.index}) when the layer was "
                "about to read them. This is a bug in fx_offload: please report it with the "
                "model, the options and the torch version. The chunk is reloaded at its next "
                "wait", where="fx_offload")
        log.debug("fx_offload: %s: layer %d chunk %d: the slot holds its host bytes",
                  state.model_name, layer, c.index)


def _differs(slot: torch.Tensor, host: torch.Tensor, rows: torch.Tensor | None) -> bool:
    if rows is not None:
        if not slot.dim():
            return False
        rows = rows[(rows >= 0) & (rows < slot.shape[0])]   # others pick nothing
        slot, host = slot[rows.to(slot.device)], host[rows]
    return not torch.equal(_bytes(slot.cpu()), _bytes(host.cpu()))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
