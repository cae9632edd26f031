"""Shared test helpers: compile a built-in model with the backend and compare with the model
without offloading."""
from __future__ import annotations

import copy

import torch

from fx_offload.tools import models


def compile_pair(name: str, options: dict, build_kwargs: dict | None = None, **compile_kwargs):
    """(offloaded model, its compiled callable, untouched reference model, inputs)."""
    model, inputs = models.build(name, **(build_kwargs or {}))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=options,
                             **compile_kwargs)
    return model, compiled, reference, inputs


def reference_output(reference, inputs, inner_backend: str):
    """The model without offloading, run by the same inner compiler where that is
    deterministic (eager and aot_eager equal eager)."""
    with torch.no_grad():
        if inner_backend == "inductor":
            return torch.compile(reference, backend="inductor")(*inputs)
        return reference(*inputs)


def fresh_inputs(name: str, inputs, call: int):
    """New input values for call ``call`` (same shapes), so each call's result is checked."""
    gen = torch.Generator().manual_seed(1000 + call)
    (x,) = inputs
    if x.dtype == torch.long:
        return (torch.randint(0, int(x.max()) + 1, x.shape, generator=gen),)
    return (torch.randn(x.shape, generator=gen),)


def assert_same_greedy_tokens(model, reference, ids, new_tokens: int = 8):
    """Greedy ``generate`` of a Hugging Face model gives the reference's tokens."""
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want), (got, want)


def bf16_decoder(num_layers: int = 6, seed: int = 0, **kwargs):
    """The built-in decoder in bf16 (what compress="lossless" compresses) and its inputs."""
    model, inputs = models.build("decoder", num_layers=num_layers, seed=seed, **kwargs)
    return model.to(torch.bfloat16), inputs
