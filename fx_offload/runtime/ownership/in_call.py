"""Weights written during a call of the model, from inside it (a forward hook that calls
``update_weights`` or ``load_state_dict``, a step of a loop that syncs weights between
layers).

During a call the offloaded parameters point at their slots, so such a write would land in
a slot, which the next copy into it overwrites: the weights would be dropped.  Instead the
parameters point at the truth (their host blocks) while the write runs, as between calls;
then the slots follow: what they hold of a layer written is loaded again (a layer read later
in this call computes with the new values, as in a plain model), compressed copies are
encoded again and cached experts copied again.  :class:`WritesInCall` is the state's
``writes``: it keeps which write is in progress and what the counters read before it;
:meth:`~.state.OffloadState.begin_write` and ``end_write`` point the parameters and reload.
"""
from __future__ import annotations


class WritesInCall:
    """The write in progress inside this thread's call, if any (``versions``: the state's
    :class:`~.versions.ParamVersions`)."""

    def __init__(self, versions):
        self.versions = versions
        self.writer = None      # the module whose load (or the update) began the write
        self._before: dict[int, tuple] = {}

    def begin(self, writer) -> bool:
        """``writer`` is about to write the weights: True (the caller points the parameters
        at the truth) unless another write is in progress."""
        if self.writer is not None:
            return False
        self.writer = writer
        self._before = {layer: self.versions.of(layer) for layer in self.versions.params}
        return True

    def end(self, writer) -> bool:
        """The write ``writer`` began is done: True (the caller points the parameters at
        the slots again, then asks :meth:`written`) unless it began none."""
        if self.writer is not writer or writer is None:
            return False
        self.writer = None
        return True

    def written(self) -> set[int]:
        """The layers the write that ended changed."""
        self.versions.memo = {}         # the call's memo of the counters: they moved
        return {layer for layer, seen in self._before.items()
                if self.versions.of(layer) != seen}

    def forget(self) -> None:
        """A call begins or ends: a write left unfinished (its load raised) is forgotten."""
        self.writer = None
