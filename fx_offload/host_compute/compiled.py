"""The ``inductor`` path: the routed experts written as gathers and reductions that Inductor's
C++ backend fuses into loops of its own (the gather of each pair's expert becomes an indirect
load, the conversion to fp32 happens in registers, the reduction over the hidden size is
vectorized and the outer loops run in an OpenMP region: its output code has one
``#pragma omp parallel`` holding every loop, bf16 loaded as ``at::vec::Vectorized`` and
widened to float).

Each (token, slot) pair reads its expert, so at several tokens an expert picked twice is read
twice; an id outside ``[0, E)`` reads expert 0 with a zero weight.  Dynamo's own cache keeps
the compiled graphs: the first call's shapes static, a second token count makes them dynamic
(one graph for every count after it), and each activation and dtype adds one.  The graphs
share one function, so its recompile limit is raised while it runs (at Dynamo's default of
8, the ninth variant would be an error)."""
from __future__ import annotations

import torch
import torch._dynamo
import torch.nn.functional as F

_compiled: dict = {}
VARIANTS = 64       # graphs of _pairs Dynamo may keep: activations x dtypes x shapes


def _pairs(x, ids, gates, gate_up, down, act: str):
    w1 = gate_up[ids]                                   # (T, k, 2I, H): an indirect load
    gu = (w1.float() * x[:, None, None, :]).sum(-1)     # (T, k, 2I)
    g, u = gu.chunk(2, -1)
    if act == "silu":
        g = F.silu(g)
    elif act == "relu":
        g = F.relu(g)
    else:
        g = F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")
    a = g * u * gates[..., None]                         # (T, k, I)
    return (down[ids].float() * a[:, :, None, :]).sum(-1).sum(1)    # (T, H)


def experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, act: str) -> torch.Tensor:
    """The routed experts by Inductor's code; ``x`` fp32 (T, H), ``ids`` int64 (T, k)."""
    E = gate_up.shape[0]
    valid = (ids >= 0) & (ids < E)
    ids = torch.where(valid, ids, 0)
    gates = torch.where(valid, gates.float(), 0.0)
    if act not in _compiled:
        _compiled[act] = torch.compile(_pairs, dynamic=None, fullgraph=True)
    limit = max(torch._dynamo.config.recompile_limit, VARIANTS)
    with torch._dynamo.config.patch(recompile_limit=limit):
        return _compiled[act](x.contiguous(), ids.contiguous(), gates.contiguous(), gate_up,
                              down, act)
