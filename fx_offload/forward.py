"""Compile a model's ``forward`` in place, for models whose own methods call it.

``torch.compile(model)`` returns a wrapper whose ``__call__`` alone is compiled: the model's
other methods (a Hugging Face ``generate``, a diffusers pipeline calling its transformer)
reach the uncompiled ``model.forward``, so nothing is offloaded.  Setting the compiled
``forward`` on the model itself is the route every such caller takes.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from . import kv, registry
from .compiler import backend
from .options import parse_options
from .errors import OffloadError

log = logging.getLogger("fx_offload")


def compile_forward(model: nn.Module, *, dynamic: bool | None = None, mode: str | None = None,
                    fullgraph: bool = False, **options: Any) -> nn.Module:
    """Set ``model.forward`` to its compiled form with the backend and ``options`` (those of
    ``torch.compile(..., options=...)``, given as keywords), and return ``model``.

    ``model.generate(...)``, ``pipeline(...)`` and plain ``model(...)`` then run offloaded.
    ``dynamic``, ``mode`` and ``fullgraph`` go to ``torch.compile``; ``dynamic=True`` keeps
    one graph for a prompt and its one-token decode steps.  A ``torch.compile`` wrapper is
    accepted (its module's forward is compiled)."""
    module = registry.model_arg(model, "fx_offload.compile_forward")
    current = module.__dict__.get("forward")
    if current is not None and hasattr(current, "_torchdynamo_orig_callable"):
        offloaded = registry.state_for_model(module) is not None or \
            registry.nothing_offloaded(module) is not None
        raise OffloadError(
            f"{type(module).__name__}.forward is compiled already; "
            + ("call fx_offload.restore(model) and `del model.forward`" if offloaded
               else "`del model.forward` (it is not offloaded yet)")
            + " before compiling it again with other options",
            where="fx_offload.compile_forward")
    configured = backend(**options)      # options checked here, before anything changes
    parsed = parse_options(options, mode=mode)     # (the KV runtime's fills follow the mode)
    if parsed.kv_cache == "host" or parsed.memory_budget is not None:
        kv.install(module, parsed)      # its hook prepares (or counts) each static cache
    else:
        kv.uninstall(module)
    module.forward = torch.compile(module.forward, backend=configured, dynamic=dynamic,
                                   mode=mode, fullgraph=fullgraph)
    log.debug("fx_offload: %s.forward compiled with %r", type(module).__name__, configured)
    return module
