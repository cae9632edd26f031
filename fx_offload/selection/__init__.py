"""Selection, once per model: the layer stack, the offloaded layers and parameters, the slot
count (by hand or by the ``memory_budget`` planner), decided by :func:`choose`."""
from .choice import Choice, NothingOffloaded
from .decide import choose

__all__ = ["Choice", "NothingOffloaded", "choose"]
