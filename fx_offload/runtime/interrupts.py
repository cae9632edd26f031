"""Ctrl-C in the middle of a call of an offloaded model.

torch runs a module's always-called forward hooks on ``Exception`` only, so a
``KeyboardInterrupt`` raised inside a call skips the hook that ends it: the parameters would
stay pointed at their slots (``load_state_dict`` would then write into a slot, ``deepcopy``
copy one) and the slots stay held (another thread's call would wait).  While calls of
offloaded models hold slots in the main thread, the process's one :data:`GUARD` stands in
front of the SIGINT handler that was there::

    SIGINT in a call's body          the handler that was there runs; if it raises (Python's
                                     default raises KeyboardInterrupt), every call of the
                                     main thread is ended first, innermost first
                                     (parameters on the truth, the slots free)
    SIGINT in a section held         waits for the section's end (the slots being taken or
    (GUARD.holding())                given back, parameters being pointed one way or the
                                     other), then as above

A handler that does not raise (one that only records the signal) leaves the calls running.
One guard for the process, so that nested calls of two offloaded models give the handler
back as they found it.  Only the main thread receives signals; a ``KeyboardInterrupt``
raised by code rather than by the signal leaves its hold behind (:mod:`.turns`).  The
user's side: docs/ownership.md, the paragraph "One thread at a time holds the slots", and
docs/usage.md, "Who owns the weights".
"""
from __future__ import annotations

# the C module under ``signal``: its wrappers convert every handler to and from an enum,
# 2.5 us a call against 0.02 us, and a call of the model arms and disarms once each
import _signal
import threading


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class InterruptGuard:
    """SIGINT while calls hold slots in the main thread (see the module's docstring)."""

    def __init__(self):
        self._previous = None           # the handler ours stands in front of, while armed
        self._calls: list = []          # how to end each call of the main thread, in order
        self._held = 0                  # depth of sections in which a signal waits
        self._pending = None            # (signum, frame) that arrived in such a section

    def arm(self, end_call) -> None:
        """A call of the main thread took the slots; ``end_call()`` ends it."""
        if not _main_thread():
            return
        if end_call in self._calls:     # a call left behind by a BaseException raised by
            self._calls.remove(end_call)    # code, ended since by another thread
        self._calls.append(end_call)
        if self._previous is None:
            current = _signal.getsignal(_signal.SIGINT)
            # not where SIGINT is ignored or left to its default (the process ends)
            if callable(current) and current != self._handle:
                self._previous = current
                _signal.signal(_signal.SIGINT, self._handle)

    def disarm(self, end_call) -> None:
        """That call gave the slots back; with the last one, the handler that was there is
        back."""
        if not _main_thread():
            return
        for i in range(len(self._calls) - 1, -1, -1):
            if self._calls[i] == end_call:
                del self._calls[i]
                break
        if not self._calls and self._previous is not None:
            previous, self._previous = self._previous, None
            if _signal.getsignal(_signal.SIGINT) == self._handle:
                _signal.signal(_signal.SIGINT, previous)

    def holding(self) -> "_Holding":
        """A section in which a signal waits for the section's end (main thread only)."""
        return _Holding(self)

    def _handle(self, signum, frame) -> None:
        if self._held:
            self._pending = (signum, frame)
            return
        self._deliver(self._previous or _signal.default_int_handler, signum, frame)

    def _deliver(self, handler, signum, frame) -> None:
        if not callable(handler):
            return
        try:
            handler(signum, frame)
        except BaseException:
            for end_call in reversed(list(self._calls)):
                end_call()
            raise


class _Holding:
    def __init__(self, guard: InterruptGuard):
        self.guard = guard
        self.main = _main_thread()

    def __enter__(self) -> None:
        if self.main:
            self.guard._held += 1

    def __exit__(self, *exc) -> None:
        guard = self.guard
        if not self.main:
            return
        guard._held -= 1
        if guard._held or guard._pending is None:
            return
        (signum, frame), guard._pending = guard._pending, None
        # disarmed in the section (the last call ended): the handler that is back takes it
        handler = guard._previous or _signal.getsignal(_signal.SIGINT)
        guard._deliver(handler, signum, frame)


GUARD = InterruptGuard()
