"""Ctrl-C in the middle of a call of an offloaded model.

torch runs a module's always-called forward hooks on ``Exception`` only, so a
``KeyboardInterrupt`` raised inside a call skips the hook that ends it: the parameters would
stay pointed at their slots (``load_state_dict`` would then write into a slot, ``deepcopy``
copy one) and the call's lock stay taken (another thread's call would wait for ever).  While
a call holds the slots in the main thread, :class:`InterruptGuard` stands in front of the
SIGINT handler that was there::

    SIGINT in the call's body          the handler that was there runs; if it raises (Python's
                                       default raises KeyboardInterrupt), the call is ended
                                       first (parameters on the truth, the lock free)
    SIGINT while the call begins or    held until the parameters are all pointed one way,
    ends (parameters half pointed)     then handled as above

A handler that does not raise (one that only records the signal) leaves the call running.
Only the main thread receives signals; a ``KeyboardInterrupt`` raised by code rather than by
the signal is caught up with at that thread's next call (:meth:`.Ownership.enter`).
"""
from __future__ import annotations

# the C module under ``signal``: its wrappers convert every handler to and from an enum,
# 2.5 us a call against 0.02 us, and a call of the model arms and disarms once each
import _signal
import threading


class InterruptGuard:
    """SIGINT while one model's call holds the slots (see the module's docstring)."""

    def __init__(self, end_call):
        self._end_call = end_call       # ends the call that holds the slots, if any
        self._previous = None           # the handler ours stands in front of, while armed
        self._held = 0                  # depth of sections in which a signal waits
        self._pending = None            # (signum, frame) that arrived in such a section

    def arm(self) -> None:
        """A call took the slots: stand in front of the SIGINT handler (main thread only;
        not where SIGINT is ignored or left to its default action, which ends the
        process)."""
        if self._previous is not None or \
                threading.current_thread() is not threading.main_thread():
            return
        current = _signal.getsignal(_signal.SIGINT)
        if callable(current) and current != self._handle:
            self._previous = current
            _signal.signal(_signal.SIGINT, self._handle)

    def disarm(self) -> None:
        """The call gave the slots back: the handler that was there is back (by the main
        thread; a guard left armed forwards every signal, and the next call there disarms
        it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, None
        if previous is not None and _signal.getsignal(_signal.SIGINT) == self._handle:
            _signal.signal(_signal.SIGINT, previous)

    def holding(self) -> "_Holding":
        """A section in which a signal waits for the section's end (the parameters are being
        pointed at their slots or back)."""
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
            self._end_call()
            raise


class _Holding:
    def __init__(self, guard: InterruptGuard):
        self.guard = guard

    def __enter__(self) -> None:
        self.guard._held += 1

    def __exit__(self, *exc) -> None:
        guard = self.guard
        guard._held -= 1
        if guard._held or guard._pending is None:
            return
        (signum, frame), guard._pending = guard._pending, None
        # disarmed in the section (the call ended): the handler that is back takes it
        handler = guard._previous or _signal.getsignal(_signal.SIGINT)
        guard._deliver(handler, signum, frame)
