"""Whose turn it is to hold one offloaded model's slots, and holds left behind.

One thread at a time holds them (:class:`Turns`): as a ``"call"``, from its first hook to
its last (calls of layers inside it nest); as a ``"load"``, a ``load_state_dict`` into a
module owning offloaded parameters, from its pre-hook to that module's post-hook, after its
children's loads; or as a plain hold (``update_weights``, ``restore``).  Taking the turn
and naming its holder, and giving it back, are one step for Ctrl-C (a section of
:data:`.interrupts.GUARD`).

A hold is given back by the code that took it, except where torch skips that code: the
hooks that end a call run on ``Exception`` only, and a load's post-hook does not run when
the load raises.  Such a hold is ended (:meth:`Turns.end_left`) by a thread that has waited
:data:`STALL_S` for the turn and finds the holder's thread gone or no longer running what
took it, or by the holder's own thread at its next touch (a call, a load,
``update_weights``).  A call that Ctrl-C ended and that runs on, because something
swallowed the ``KeyboardInterrupt`` (Dynamo's guard evaluation does), stops at its next op
or compile (:meth:`Turns.stop_if_interrupted`).

Frames are told by their code objects (``Module._call_impl``, the ``load`` inside
``Module.load_state_dict``, which Dynamo never compiles) and the module they run, read from
those frames only: no frame of the user's code is looked into.

Why each kind of hold, and how Ctrl-C's hold ends: docs/ownership.md, the paragraph "One
thread at a time holds the slots".
"""
from __future__ import annotations

import logging
import sys
import threading

from torch import nn

from .interrupts import GUARD

log = logging.getLogger("fx_offload")
STALL_S = 0.2       # a wait for the turn this long looks at whether the holder is still at it
_CALL = nn.Module._call_impl.__code__
_LOAD = next(c for c in nn.Module.load_state_dict.__code__.co_consts
             if getattr(c, "co_name", None) == "load")     # load(module, state_dict, prefix)


def _frames(thread: int):
    frame = sys._getframe() if thread == threading.get_ident() else \
        sys._current_frames().get(thread)
    while frame is not None:
        yield frame
        frame = frame.f_back


class Turns:
    """The slots' lock of one model, who holds it and how."""

    def __init__(self, model_name: str, end_call, runs_model):
        self.model_name = model_name
        self._end_call = end_call       # points the parameters at the truth again
        self._runs_model = runs_model   # module -> it is the model, wraps it, or a layer
        self._lock = threading.Lock()
        self._mutex = threading.Lock()  # between a holder giving back and a waiter ending
        self.holder: int | None = None  # the thread holding the turn
        self.kind = None                # "call", "load", or the code of a plain hold
        self.module = None              # the module whose load took the turn
        self.depth = 0                  # nested enters of the holder's call
        self.interrupted: tuple | None = None   # (thread, id of its frame calling the
        #   model) of a call Ctrl-C ended, until the model's next call

    def take(self, kind, module=None) -> None:
        """Wait for the turn (ending a hold left behind), then hold it as ``kind``."""
        me = threading.get_ident()
        while True:
            with GUARD.holding():           # Ctrl-C waits until the turn is named
                if self._lock.acquire(timeout=STALL_S):
                    self.holder, self.kind, self.module = me, kind, module
                    return
            holder = self.holder
            if holder is not None and not self.still_at_it(holder):
                self.end_left(holder)

    def give_back(self) -> bool:
        """The holder is done; False where another thread ended its hold already."""
        with self._mutex, GUARD.holding():
            if self.holder != threading.get_ident():
                return False
            self.holder, self.kind, self.module, self.depth = None, None, None, 0
            self._lock.release()
            return True

    def still_at_it(self, holder: int) -> bool:
        """The holder's thread still runs what took the turn."""
        for frame in _frames(holder):
            code = frame.f_code
            if code is _CALL and self.kind == "call":
                if self._runs_model(frame.f_locals.get("self")):
                    return True
            elif code is _LOAD and self.kind == "load":
                if frame.f_locals.get("module") is self.module:
                    return True
            elif code is self.kind:
                return True
        return False

    def runs_a_call_here(self) -> bool:
        """This thread runs a call of the model, through its hooks or not (one begun before
        another thread's first call put them on)."""
        return any(frame.f_code is _CALL and self._runs_model(frame.f_locals.get("self"))
                   for frame in _frames(threading.get_ident()))

    def part_called_here(self, layers) -> nn.Module | None:
        """The module of the outermost call on this thread that holds one of ``layers`` (a
        part of the model called on its own), or None."""
        ids, found = {id(layer) for layer in layers}, None
        for frame in _frames(threading.get_ident()):
            module = frame.f_locals.get("self") if frame.f_code is _CALL else None
            if isinstance(module, nn.Module) and any(id(m) in ids for m in module.modules()):
                found = getattr(module, "_orig_mod", module)
        return found

    # ---- a call Ctrl-C ended that runs on ----------------------------------------------
    def note_interrupted(self) -> None:
        """Ctrl-C ends this thread's call (:mod:`.interrupts`): remember the outermost frame
        calling the model, to know whether that call runs on."""
        found = None
        for frame in _frames(threading.get_ident()):
            if frame.f_code is _CALL and self._runs_model(frame.f_locals.get("self")):
                found = id(frame)
        self.interrupted = None if found is None else (threading.get_ident(), found)

    def stop_if_interrupted(self) -> None:
        """Ctrl-C ended this thread's call of the model, yet that call runs on: something
        between the signal handler and the caller swallowed the ``KeyboardInterrupt``
        (Dynamo's guard evaluation takes any exception for a failed guard, then runs another
        graph or compiles one).  The parameters hold the truth and the slots are free, so
        the call cannot go on with them: it stops here, as the user asked."""
        noted = self.interrupted
        if noted is None or noted[0] != threading.get_ident():
            return
        if not any(id(frame) == noted[1] and frame.f_code is _CALL and
                   self._runs_model(frame.f_locals.get("self")) for frame in _frames(noted[0])):
            self.interrupted = None     # that call is over: the interrupt reached its caller
            return
        raise KeyboardInterrupt(
            f"fx_offload: Ctrl-C interrupted a call of {self.model_name} at a point that "
            "swallowed the KeyboardInterrupt (Dynamo's guard evaluation takes it for a "
            "failed guard), and the call went on. The call had been ended as the interrupt "
            "came: the weights are safe (the parameters hold them), so the call stops here. "
            "Call the model again to go on; nothing needs restoring")

    def left_here(self) -> bool:
        """This thread holds the turn, yet no longer runs what took it."""
        me = threading.get_ident()
        return self.holder == me and not self.still_at_it(me)

    def end_left(self, holder: int) -> None:
        """End a hold that ``holder``'s thread left behind."""
        with self._mutex:
            if self.holder != holder:
                return
            what = {"call": "a call ended by a BaseException raised by code (torch skips "
                            "the hooks that end a call for a KeyboardInterrupt or SystemExit "
                            "that is not Ctrl-C's)",
                    "load": "a load_state_dict that raised before its post-hook"}.get(
                self.kind, "a statement that holds the slots")
            log.warning("fx_offload: %s: %s left the slots held; its hold ended now",
                        self.model_name, what)
            self._end_call()
            self.holder, self.kind, self.module, self.depth = None, None, None, 0
            self._lock.release()

    # ---- load_state_dict ----------------------------------------------------------------
    def begin_load(self, module) -> None:
        """``module`` is about to load a state dict into its parameters: they must hold the
        truth, so another thread's call ends first and none begins until :meth:`end_load`
        of the module that took the turn (a hold this thread left behind ends now)."""
        me = threading.get_ident()
        if self.holder == me and self.kind == "load" and self.still_at_it(me):
            return                          # a module inside the one loading
        if self.left_here():
            self.end_left(me)
        if self.holder != me:               # (else inside this thread's own call)
            self.take("load", module)

    def end_load(self, module) -> None:
        if self.holder == threading.get_ident() and self.kind == "load" and \
                self.module is module:
            self.give_back()
