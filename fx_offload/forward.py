"""Compile a model's ``forward`` in place, for models whose own methods call it.

``torch.compile(model)`` returns a wrapper whose ``__call__`` alone is compiled: the model's
other methods (a Hugging Face ``generate``, a diffusers pipeline calling its transformer)
reach the uncompiled ``model.forward``, so nothing is offloaded.  Setting the compiled
``forward`` on the model itself is the route every such caller takes.
"""
from __future__ import annotations

import logging
import types
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
    module.forward = CompiledForward(torch.compile(module.forward, backend=configured,
                                                   dynamic=dynamic, mode=mode,
                                                   fullgraph=fullgraph))
    log.debug("fx_offload: %s.forward compiled with %r", type(module).__name__, configured)
    return module


class CompiledForward:
    """``model.forward`` after :func:`compile_forward`: the compiled method, called as it is,
    its attributes read through (``_torchdynamo_orig_callable`` among them).  A plain
    compiled function would be copied as itself by ``copy.deepcopy(model)``, so the copy
    would call the original's forward and compute with the original's weights, whatever
    was done to its own.  The copy gets its class's forward instead, eager, with a warning
    that says how to compile it."""

    def __init__(self, compiled):
        self.compiled = compiled

    # A compile around the model (transformers' ``generate`` compiles ``model.__call__`` for
    # a static cache on CUDA) would trace through this call and drop our backend: its graph
    # then reads each offloaded layer through the eager hooks, whole.  It runs this call as
    # it is instead (with fullgraph=True too), and our compiled forward with it.
    @torch._dynamo.disable(reason="fx_offload: model.forward is compiled by compile_forward "
                           "with its own backend; a compile around the model runs it as it is")
    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name):
        if name == "compiled":      # (a copy whose state is not set yet)
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def __deepcopy__(self, memo):
        owner = registry.model_of(self.compiled)
        twin = memo.get(id(owner))
        if twin is None:        # the forward copied on its own: it stays the original's
            return self
        log.warning("fx_offload: a copy of %s made after compile_forward runs its own "
                    "forward eagerly (not offloaded by a compiled graph); call "
                    "fx_offload.compile_forward(copy, ...) to compile it",
                    type(owner).__name__)
        method = getattr(self.compiled, "_torchdynamo_orig_callable", None)
        return types.MethodType(getattr(method, "__func__", None) or type(owner).forward,
                                twin)
