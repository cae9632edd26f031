"""Which offloaded layers hold a dense gated MLP that ``host_compute`` may run on the host.

Llama, Mistral, Qwen2/3 and most decoders since keep their MLP as three bias-free linears::

    mlp.down_proj(act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    gate_proj.weight (I, H), up_proj.weight (I, H), down_proj.weight (H, I)

which is one routed expert's computation with one expert and every token picking it, so the
host kernel of the routed experts runs it too.  A layer holding one such module, its three
weights offloaded as plain tensors (no quantized subclass, no shard), contiguous and of one
dtype of bf16, fp16 or fp32, is a candidate: its three weights get copy chunks of their own
(:func:`fx_offload.layout.arrange`), so a call computing the MLP on the host copies none of
them.  Whether the graph computes it as that module, with a SiLU between, is the pass's to
prove (:mod:`fx_offload.passes.host_regions`).  A layer with expert tensors is no
candidate: its experts are the host's work there (one plan a call).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import dtensor
from .params import OffloadedParam

NAMES = ("gate_proj", "up_proj", "down_proj")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def mlp_path(names: tuple[str, ...]) -> str:
    """The MLP module's path inside its layer (``mlp``), from its weights' suffixes."""
    return names[0].rpartition(".")[0].rpartition(".")[0]


def refused_mlps(params: dict[int, list[OffloadedParam]], experts: dict, found: dict,
                 stack) -> dict[int, str]:
    """Layer -> why its MLP-like module (one with ``gate_proj``, ``up_proj``, ``down_proj``
    or a fused ``gate_up_proj``) is no candidate, for the layers :func:`dense_mlps` left out:
    ``report`` and ``explain`` say it rather than nothing."""
    refused = {}
    for layer, ps in params.items():
        if layer in experts or layer in found:
            continue
        mine = {p.suffix for p in ps}
        for path, module in stack.modules[layer].named_modules():
            names = {n for n in (*NAMES, "gate_up_proj") if hasattr(module, n)}
            if not names & {"gate_up_proj", "gate_proj"}:
                continue
            own = {f"{path}.{n}.weight" if path else f"{n}.weight" for n in NAMES}
            if "gate_up_proj" in names:
                why = "streamed: its MLP's gate and up are one fused weight (gate_up_proj)"
            elif not own <= mine and not own & mine:
                why = ("resident: its MLP's weights are shared with another layer or kept on "
                       "the device")
            elif not own <= mine:
                why = ("streamed: not all three of its MLP's weights are this layer's own "
                       "offloaded ones (one is shared, or kept on the device)")
            elif any(getattr(getattr(module, n, None), "bias", None) is not None
                     for n in NAMES):
                why = "streamed: its MLP's linears have biases"
            else:
                why = ("streamed: its MLP's weights are not plain contiguous bf16, fp16 or "
                       "fp32 tensors shaped (I, H), (I, H), (H, I)")
            refused[layer] = why
            break
    return refused


def dense_mlps(params: dict[int, list[OffloadedParam]],
               experts: dict) -> dict[int, tuple[str, str, str]]:
    """Layer -> the suffixes of its one dense MLP's (gate, up, down) weights; layers with
    none (or more than one, or expert tensors) are left out."""
    found = {}
    for layer, ps in params.items():
        if layer in experts:
            continue
        by_suffix = {p.suffix: p for p in ps}
        prefixes = {p.suffix[:-len(f".{n}.weight")] for p in ps for n in NAMES
                    if p.suffix.endswith(f".{n}.weight")}
        triples = [t for t in (tuple(f"{prefix}.{n}.weight" for n in NAMES)
                               for prefix in sorted(prefixes))
                   if all(s in by_suffix for s in t) and
                   _plain(*(by_suffix[s] for s in t))]
        if len(triples) == 1:
            found[layer] = triples[0]
    return found


def _plain(gate: OffloadedParam, up: OffloadedParam, down: OffloadedParam) -> bool:
    """Three bias-free linears' weights shaped as a gated MLP's, plain and contiguous."""
    for p in (gate, up, down):
        t = p.owner._parameters.get(p.attr)
        if p.inner or dtensor.is_dtensor(t) or type(p.param) not in (torch.Tensor,
                                                                     nn.Parameter):
            return False
        if not isinstance(p.owner, nn.Linear) or p.owner.bias is not None or p.attr != "weight":
            return False
        if p.param.dim() != 2 or not p.param.is_contiguous() or p.param.dtype not in DTYPES:
            return False
    g, u, d = gate.param, up.param, down.param
    return g.shape == u.shape and tuple(d.shape) == (g.shape[1], g.shape[0]) and \
        g.dtype == u.dtype == d.dtype
