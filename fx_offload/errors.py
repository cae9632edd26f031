"""The errors fx_offload raises on purpose, under one base class.

Every message starts with where it comes from (``prefetch_offload:`` for the backend,
``fx_offload.restore:`` for an API function), added here rather than typed into each message,
so a caller catches :class:`OffloadError` (a ``ValueError``) and reads one consistent form.
"""
from __future__ import annotations

BACKEND = "prefetch_offload"
META_REFUSED = ("cannot offload weights on the meta device: load real weights into the model "
                "before compiling it, or place it from its checkpoint with "
                "fx_offload.place(model, device, checkpoint=...)")


class OffloadError(ValueError):
    """A bad input or an unsupported model, with a message that says what to change."""

    def __init__(self, message: str, where: str = BACKEND):
        super().__init__(message)
        self.message, self.where = message, where

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def __reduce__(self):
        return type(self), (self.message, self.where)


class PlanError(OffloadError):
    """The pass cannot place its ops in this graph (a weight read outside its layer, ...)."""


class ScheduleError(OffloadError):
    """The slot-safety verifier found a rewritten graph that reads a slot it does not own."""


class BudgetError(OffloadError):
    """No plan fits the ``memory_budget``."""


class GradModeError(OffloadError, RuntimeError):
    """Compiled with grad enabled where autograd would save slot contents for backward."""


class StateGoneError(OffloadError, RuntimeError):
    """A compiled graph runs after its model's offload state was garbage collected."""
