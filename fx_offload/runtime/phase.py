"""Where one offload state is in its life, as one value (:class:`Phase`), and the moves it may
make::

    PLANNED -materialize-> MATERIALIZED -enter-> ON_SLOTS -leave, a write begins-> ON_TRUTH
       |                        |                |    ^                             |
       |                        |                |    +----enter, the write ends----+
       |                        |                |                                  |
       +--------detach----------+-----detach-----+---> RESTORED <-------detach------+

``PLANNED``: built from a choice; no host blocks or slots yet (the first compile's pass runs
here).  ``MATERIALIZED``: the host blocks hold the truth and the slots are filled, but no call
has begun through the hooks (the first call, compiled inside, runs its graph before any
hook: the ops then act on this state whoever holds the turn).  ``ON_SLOTS``: a call points
the parameters at their slots.  ``ON_TRUTH``: they point at their host blocks again, between
calls or while a write from inside a call runs (:mod:`.in_call`).  ``RESTORED``: detached,
the slots freed; every op does nothing.  Every self-move but ``PLANNED`` and
``MATERIALIZED``'s is allowed (a call begun again after one a ``BaseException`` left behind;
the parameters pointed at the truth twice).  Any other move is a bug in fx_offload and
raises :class:`PhaseError`.
"""
from __future__ import annotations

import enum


class PhaseError(RuntimeError):
    """An impossible move between phases: a bug in fx_offload, not a bad input."""


class Phase(enum.Enum):
    PLANNED = "planned"
    MATERIALIZED = "materialized"
    ON_SLOTS = "on slots"
    ON_TRUTH = "on truth"
    RESTORED = "restored"

    @property
    def called(self) -> bool:
        """A call has begun through the hooks (the parameters were pointed at the slots)."""
        return self in (Phase.ON_SLOTS, Phase.ON_TRUTH)

    def to(self, after: "Phase", model_name: str = "") -> "Phase":
        """``after``, where the move from this phase to it is allowed; else PhaseError."""
        if after not in _MOVES[self]:
            raise PhaseError(f"fx_offload: the offload state of {model_name} cannot move from "
                             f"{self.value} to {after.value}. This is a bug in fx_offload: "
                             "please report it with the traceback")
        return after


_MOVES = {
    Phase.PLANNED: {Phase.MATERIALIZED, Phase.RESTORED},
    Phase.MATERIALIZED: {Phase.ON_SLOTS, Phase.RESTORED},
    Phase.ON_SLOTS: {Phase.ON_SLOTS, Phase.ON_TRUTH, Phase.RESTORED},
    Phase.ON_TRUTH: {Phase.ON_TRUTH, Phase.ON_SLOTS, Phase.RESTORED},
    Phase.RESTORED: {Phase.RESTORED},
}
