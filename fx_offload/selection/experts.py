"""Which offloaded parameters are expert tensors: ``[E, ...]`` stacks of one tensor per expert
of a mixture-of-experts layer, of which a call reads only the rows its router picked.

Hugging Face's MoE layers keep their experts fused in one module (``Qwen3MoeExperts``,
``MixtralExperts``, ``DeepseekV3NaiveMoe``: ``gate_up_proj [E, 2I, H]``, ``down_proj
[E, H, I]``, biases ``[E, ...]``) that says how many experts it holds (``num_experts``).  A
parameter of such a module (its class or attribute named for experts: the router's weight
is ``[E, H]`` too) whose first dimension is that count is an expert tensor.  Whether
a graph reads only the picked rows of it is the pass's to prove
(:mod:`fx_offload.passes.routing`); this only names the candidates.
"""
from __future__ import annotations

import torch

from .. import dtensor
from .params import OffloadedParam


def expert_tensors(params: dict[int, list[OffloadedParam]]) -> dict[int, dict[str, int]]:
    """Layer -> {suffix of each of its expert tensors: number of experts}; layers with none
    are left out."""
    found: dict[int, dict[str, int]] = {}
    for layer, ps in params.items():
        for p in ps:
            count = _experts_in(p)
            if count:
                found.setdefault(layer, {})[p.suffix] = count
    return found


def _experts_in(p: OffloadedParam) -> int:
    where = p.suffix.rpartition(".")[0].rpartition(".")[2]
    if "expert" not in type(p.owner).__name__.lower() and "expert" not in where.lower():
        return 0                # a router's weight is [E, H] too
    count = getattr(p.owner, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return 0
    t = p.param
    if p.inner or dtensor.is_dtensor(p.owner._parameters.get(p.attr)) \
            or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return 0                # a quantized or sharded tensor: moved whole
    if t.dim() < 2 or t.shape[0] != count or not t.is_contiguous():
        return 0
    return count


def top_k_per_layer(membership: dict) -> dict[int, int]:
    """Layer -> ``k`` of its one top-k (a router picking ``k`` experts per token), from a
    Dynamo graph's layer ``membership`` (``graph_inputs.layers_of_nodes``) where ``k`` is a
    constant; layers with none, or several, are left out.  For the planner's copy times
    (:mod:`.budget`): the pass decides what is routed."""
    found: dict[int, list[int]] = {}
    for node, layers in membership.items():
        if node.target is torch.topk or (node.op == "call_method" and node.target == "topk"):
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            found.setdefault(layers[0], []).append(k)
    return {layer: ks[0] for layer, ks in found.items()
            if len(ks) == 1 and isinstance(ks[0], int) and not isinstance(ks[0], bool)}
