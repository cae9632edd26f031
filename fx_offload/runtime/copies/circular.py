"""Where each call's circular prefetch starts when the schedule leaves it to the runtime
(``circular="either"``, the default outside CUDA graphs; see :mod:`fx_offload.schedule`).

The graphs then hold two starts of each slot's first layer for the next call: one after the
slot's last layer (the end) and one at the call's entry (the call hook, and the top of the
first graph), which copies only where the slot does not hold that layer already.  As each
call begins, :class:`CircularStart` decides whether the coming call's end start copies or
stays idle and leaves the copy to the next entry::

    call k    ... last(s) reads | end start: copy l_s  (or idle) | return
    caller    ............................................ (waits for the device, or not)
    call k+1  hook: landed?  -> choose for call k+1 | entry start: copy l_s unless held ...

An end copy found landed at ``LANDED_CALLS`` entries in a row means the caller waits for
the device (or idles long enough that either place hides the copy): the entry takes over,
and one call in ``RECHECK_EVERY`` tries the end again, in case the caller changed.

The entry is chosen only where something runs before the first offloaded layer (a
resident layer): its compute is what hides a copy begun at the entry.  Where the call's
first layer is offloaded, it waits for that copy at once, and a caller that waits for the
device pays the copy either way (in its wait, or at the next call's start); the end stays,
since it also hides the copy behind whatever the host does between calls (Hugging Face
``generate``'s token handling: the copy lands there, which alone would have looked like a
waiting caller).

Which place suits which caller, the tell, and why correctness never depends on the choice:
docs/design.md, "Slot rotation" (the bullet "chosen per call").
"""
from __future__ import annotations

import logging

log = logging.getLogger("fx_offload")

LANDED_CALLS = 2        # entries in a row that find the end's copy landed: move to the entry
RECHECK_EVERY = 16      # calls at the entry between two tries of the end


class CircularStart:
    """The per-call choice of one offloaded model; trivial unless ``circular`` is
    ``"either"``."""

    def __init__(self, circular: str, model_name: str = "model", entry_hides: bool = True):
        self.circular = circular
        # False where the call's first layer is offloaded: no compute before its wait
        self.entry_hides = entry_hides
        self.model_name = model_name
        self.at_end = circular != "entry"   # where the coming call's circular copy starts
        self._end_copy = None       # done event of the latest copy begun at a call's end
        self._landed = 0            # entries in a row that found it landed
        self._calls_at_entry = 0
        self.moves = 0              # times the choice changed (a report's figure)

    def copies_at_end(self, capturing: bool) -> bool:
        """Whether a start at a call's end copies (else the next call's entry does)."""
        if self.circular != "either":
            return True
        return self.at_end and not capturing

    def began_at_end(self, done_event) -> None:
        """A copy was begun at a call's end; ``done_event`` is recorded after it."""
        self._end_copy = done_event

    def call_begins(self) -> None:
        """A call begins (outside a capture): choose where its circular prefetch starts."""
        if self.circular != "either":
            return
        if not self.at_end:
            self._calls_at_entry += 1
            if self._calls_at_entry >= RECHECK_EVERY:
                self.at_end = True                      # try the end for one call
                self._landed = LANDED_CALLS - 1         # one landed copy sends it back
                self.moves += 1
            return
        event, self._end_copy = self._end_copy, None
        if event is None:           # nothing began at the end (a first call; the CPU)
            return
        if not event.query():
            self._landed = 0        # still copying: the caller let it run on
            return
        self._landed += 1
        if self._landed >= LANDED_CALLS and self.entry_hides:
            self.at_end, self._calls_at_entry = False, 0
            self.moves += 1
            log.debug("fx_offload: %s: the copies begun at the end of a call had landed "
                      "before the next call began (the caller waits for the device); the "
                      "circular prefetch starts at each call's entry now", self.model_name)

    @property
    def now(self) -> str:
        """Where the coming call's circular prefetch starts: ``"end"`` or ``"entry"``."""
        return "end" if self.at_end else "entry"

    def describe(self) -> str:
        """Where the circular prefetch starts, in words."""
        if self.circular == "either":
            return (f"chosen per call: at the end while the caller lets its copy run on, at "
                    f"the next call's entry where the caller waits for the device (now: the "
                    f"{self.now})")
        return ("after the slot's last layer" if self.circular == "end"
                else "when the next call begins")
