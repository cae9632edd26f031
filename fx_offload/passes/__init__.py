"""The pass, once per graph: plan where each op goes, insert the ops, verify slot safety.
:func:`run_prefetch_pass` is the one sequence; see README.md for the invariants."""
from .prefetch import run_prefetch_pass

__all__ = ["run_prefetch_pass"]
