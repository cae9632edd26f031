"""Host kernels.

:func:`routed_experts` is the math of a routed mixture-of-experts layer whose expert
tensors are fused in the usual way (``gate_up`` ``[E, 2I, H]``: the gate's rows, then the
up projection's; ``down`` ``[E, H, I]``), computed on the host from the weights where they
lie.  This is the plain reference: each picked expert once, its tokens gathered, in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu}


def routed_experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                   ) -> torch.Tensor:
    """``sum_j gates[t, j] * down[e] @ (act(g) * u)``, ``g, u = split(gate_up[e] @ x[t])``,
    ``e = ids[t, j]``, for each token ``t``: ``(T, H)`` in fp32.  ``x`` ``(T, H)``, ``ids``
    and ``gates`` ``(T, k)``; an id outside ``[0, E)`` (an expert-parallel sentinel)
    contributes nothing.  All on the host."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; known: {sorted(ACTIVATIONS)}")
    fn = ACTIVATIONS[act]
    experts, inner = gate_up.shape[0], down.shape[-1]
    x32 = x.float()
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    flat = ids.reshape(x.shape[0], -1).long()
    weights = gates.reshape(flat.shape).float()
    for e in torch.unique(flat).tolist():
        if not 0 <= e < experts:
            continue
        tokens, slot = (flat == e).nonzero(as_tuple=True)
        h = x32[tokens] @ gate_up[e].float().t()
        h = fn(h[:, :inner]) * h[:, inner:]
        y = h @ down[e].float().t()
        out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out
