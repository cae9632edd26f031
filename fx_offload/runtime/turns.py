"""Whose turn it is to hold one offloaded model's slots, and holds left behind.

One thread at a time holds them: a call, from its first hook to its last (the parameters
point at the slots in between), or a ``load_state_dict`` writing the parameters of one of
the model's modules (its pre-hook takes the turn, its post-hook gives it back, so the
values land in the host blocks, not in a slot another thread's call is using).
``update_weights`` and ``restore`` take the lock alone (:meth:`Turns.take_plain`).

A hold is given back by the code that took it, except where torch skips that code: the hooks
that end a call run on ``Exception`` only (Ctrl-C's signal is handled in
:mod:`.interrupts`; a ``KeyboardInterrupt`` or ``SystemExit`` raised by code is not), and a
load's post-hook does not run when the load raises.  Such a hold is ended
(:meth:`Turns.end_left`):

* by a thread that has waited :data:`STALL_S` for the turn and finds the holder's thread
  outside any module call (or outside ``load_state_dict``, for a load's hold), or gone;
* by the holder's own thread at its next touch (a call, a load, ``update_weights``).

Frames are told by their code objects (``Module._call_impl``, ``Module.load_state_dict``,
which Dynamo never compiles); no frame's locals are read.
"""
from __future__ import annotations

import logging
import sys
import threading

from torch import nn

log = logging.getLogger("fx_offload")
STALL_S = 1.0       # a wait for the turn this long looks at whether the holder is still at it
_CALL = nn.Module._call_impl.__code__
_LOAD = nn.Module.load_state_dict.__code__


def _running(thread: int, code) -> bool:
    """``thread`` has a frame of ``code`` on its stack."""
    frame = sys._getframe() if thread == threading.get_ident() else \
        sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class Turns:
    """The slots' lock of one model, who holds it and how (calls nest, loads nest)."""

    def __init__(self, model_name: str, end_call):
        self.model_name = model_name
        self._end_call = end_call       # points the parameters at the truth again
        self._lock = threading.Lock()
        self._mutex = threading.Lock()  # between a holder giving back and a waiter ending
        self.holder: int | None = None  # the thread in a call or a load
        self.depth = 0                  # nested enters of that thread's call
        self.loads = 0                  # nested load_state_dict holds of that thread

    def take(self) -> None:
        """Wait for the turn (ending a hold left behind) and hold it."""
        self.take_plain()
        self.holder = threading.get_ident()

    def take_plain(self) -> None:
        """Wait for the turn and hold the lock, with no holder named (``update_weights``,
        ``restore``: held for a statement, given back by ``release``)."""
        while not self._lock.acquire(timeout=STALL_S):
            holder = self.holder
            if holder is not None and not self.still_at_it(holder):
                self.end_left(holder)

    def release(self) -> None:
        self._lock.release()

    def give_back(self) -> bool:
        """The holder is done; False where another thread ended its hold already."""
        with self._mutex:
            if self.holder != threading.get_ident():
                return False
            self.holder, self.depth, self.loads = None, 0, 0
            self._lock.release()
            return True

    def still_at_it(self, holder: int) -> bool:
        """The holder's thread still runs what took the turn: a load_state_dict for a
        load's hold, any module call for a call's (which may be this model's)."""
        return _running(holder, _LOAD if self.loads else _CALL)

    def left_here(self) -> bool:
        """This thread holds the turn for a call, yet runs no module call: the call ended
        without the hooks that end one."""
        me = threading.get_ident()
        return self.holder == me and not self.loads and not _running(me, _CALL)

    def end_left(self, holder: int) -> None:
        """End a hold that ``holder``'s thread left behind."""
        with self._mutex:
            if self.holder != holder:
                return
            log.warning("fx_offload: %s: a %s left the slots held (a BaseException other "
                        "than Ctrl-C's, such as a KeyboardInterrupt raised by code, skips the "
                        "hooks that end it); ended now", self.model_name,
                        "load_state_dict" if self.loads else "call")
            self._end_call()
            self.holder, self.depth, self.loads = None, 0, 0
            self._lock.release()

    def begin_load(self) -> None:
        """A module of the model is about to load a state dict into its parameters: they
        must hold the truth, so another thread's call ends first and none begins until
        :meth:`end_load` (a call this thread left behind ends now)."""
        me = threading.get_ident()
        if self.holder == me and self.loads:
            self.loads += 1                 # a module inside the one loading
            return
        if self.left_here():
            self.end_left(me)
        if self.holder != me:               # (else a load inside this thread's own call)
            self.take()
            self.loads = 1

    def end_load(self) -> None:
        if self.holder == threading.get_ident() and self.loads:
            self.loads -= 1
            if not self.loads:
                self.give_back()
