"""fx_offload: stream offloaded layers' weights into static GPU slots, as a compiler pass.

    compiled = torch.compile(model, backend="prefetch_offload", options={...})
    fx_offload.report(model)     # what was offloaded
    fx_offload.restore(model)    # weights back where they were
"""
from __future__ import annotations

from torch import nn

from . import ops as _ops  # noqa: F401  (registers the fx_offload:: custom ops)
from . import runtime as _runtime
from .compiler import PrefetchOffloadBackend, backend, prefetch_offload
from .explain import Explanation, explain
from .options import OffloadOptions, parse_options
from .report import Report, report
from .weights import named_weights, update_weights

__all__ = ["backend", "prefetch_offload", "report", "restore", "explain", "Explanation",
           "named_weights", "update_weights",
           "Report", "OffloadOptions", "PrefetchOffloadBackend", "parse_options"]


def restore(model: nn.Module) -> None:
    """Return every offloaded weight of ``model`` to its device, bitwise as it was; the model
    then runs eagerly as before.  A compiled callable of it stays correct (its ops do nothing)."""
    state = _runtime.state_for_model(model)
    if state is None:
        raise ValueError(f"fx_offload.restore: {type(model).__name__} has no offloaded weights")
    state.restore()


def _register_backend_name() -> None:
    """Make ``backend="prefetch_offload"`` work when the package is used without being
    installed; installed, torch finds it lazily through the entry point (registering it here
    too would make that lookup fail as a duplicate)."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry
    if entry_points(group="torch_dynamo_backends", name="prefetch_offload"):
        return
    if "prefetch_offload" not in registry._COMPILER_FNS:
        registry.register_backend(name="prefetch_offload")(prefetch_offload)


def _register_log_name() -> None:
    """``TORCH_LOGS=fx_offload`` turns on the summary lines, like torch's own loggers."""
    try:
        from torch._logging._internal import register_log
        register_log("fx_offload", "fx_offload")
    except Exception:  # pragma: no cover - torch's logging registry is internal
        pass


_register_backend_name()
_register_log_name()
