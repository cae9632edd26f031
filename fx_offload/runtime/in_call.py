"""Weights written during a call of the model, from inside it (a forward hook that calls
``update_weights`` or ``load_state_dict``, a step of a loop that syncs weights between
layers).

During a call the offloaded parameters point at their slots, so such a write would land in
a slot, which the next copy into it overwrites: the weights would be dropped.  Instead the
parameters point at the truth (their host blocks) while the write runs, as between calls;
then the slots follow: what they hold of a layer written is loaded again (a layer read later
in this call computes with the new values, as in a plain model), compressed copies are
encoded again and cached experts copied again.  A mixin of :class:`~.ownership.Ownership`.
"""
from __future__ import annotations

import threading

import torch


class WritesInCall:
    """Writes of the true weights from inside this thread's call (a mixin)."""

    _writer = None      # the module whose load (or the update) began the write in progress

    def in_own_call(self) -> bool:
        """This thread's call holds the slots, the parameters pointing at them."""
        turns = self.turns
        return self.swapped_in and turns.holder == threading.get_ident() and \
            turns.kind == "call"

    @torch._dynamo.disable         # from a hook Dynamo traces: run as it is, not traced
    def begin_write(self, writer) -> None:
        """``writer`` is about to write the weights: inside this thread's call, point the
        parameters at the truth until :meth:`end_write` of the same ``writer``."""
        if self._writer is not None or not self.in_own_call():
            return                      # between calls, or inside another write
        self._writer = writer
        self._before = {layer: self._versions(layer) for layer in self.params}
        self._point_at(truth=True)

    @torch._dynamo.disable
    def end_write(self, writer) -> None:
        """The write ``writer`` began is done: the parameters point at the slots again, and
        what the slots hold of layers it changed is loaded anew."""
        if self._writer is not writer or writer is None:
            return
        self._writer = None
        self._point_at(truth=False)
        self._call_versions = {}        # the call's memo of the counters: they moved
        written = {layer for layer, seen in self._before.items()
                   if self._versions(layer) != seen}
        if not written:
            return
        written |= self.buffers.recompress_changed(self._versions, (), self.synchronize)
        self.routed.reload_changed(written, self._versions)
        self._reload_stale(written)

    def forget_write(self) -> None:
        """A call begins or ends: a write left unfinished (its load raised) is forgotten."""
        self._writer = None
