"""One layer's weights as a host job reads them (:class:`HostWeights`): the routed experts
of :mod:`.host_experts` or a dense MLP of :mod:`.host_mlps`, as views of the layer's host
block, checked against the layout the C kernel computes."""
from __future__ import annotations

import torch
from torch import nn

from ...host_compute import native


class HostWeights:
    """One layer's experts, or its dense MLP, as the host job reads them: the module, the
    weights' host views, and whether the C kernel can be queued on the stream for them."""

    def __init__(self, module: nn.Module, params, masters, experts: int, mlp=None):
        self.module = module
        self.suffixes = mlp or tuple(p.suffix for p in params)
        self.views = tuple(masters[s] for s in self.suffixes)
        self.host = {p.attr: masters[p.suffix] for p in params}     # attribute -> host view
        self.experts = experts
        if mlp is not None:     # a dense MLP (selection.mlps): one expert, the pass proved it
            gate, up, down = (masters[s] for s in mlp)
            self.host = {"gate": gate, "up": up, "down": down}
            self.gate_up, self.down = (gate, up), down
            self.expert_bytes = sum(t.numel() * t.element_size() for t in self.host.values())
        else:
            self.gate_up, self.down = self.host.get("gate_up_proj"), self.host.get("down_proj")
            self.expert_bytes = sum(t[0].numel() * t.element_size()
                                    for t in self.host.values())
        self.dtype = next(iter(self.host.values())).dtype
        self.element_size = next(iter(self.host.values())).element_size()
        self.fused = mlp is not None or _fused_silu(module, self.host, experts)
        # the kernels read rows in place: a weight given new storage with other strides
        # (the user's `.data = t`) is computed by its module's own code instead
        self.contiguous = all(t.is_contiguous() for t in self.host.values())
        # the C kernel can be queued on the stream for it (weights it reads as they are)
        self.queueable = self.fused and self.dtype in native.WEIGHT_CODES and self.contiguous

    def reads(self, masters) -> bool:
        """Its host views are still the layer's (a weight given new storage, a new dtype,
        a host block made again: made anew, never read stale)."""
        return all(masters.get(s) is v for s, v in zip(self.suffixes, self.views))


def _fused_silu(module: nn.Module, host: dict, experts: int) -> bool:
    """The layout :func:`kernels.routed_experts` computes: ``gate_up_proj [E, 2I, H]`` (the
    gate's rows first), ``down_proj [E, H, I]``, no bias, a SiLU between."""
    gate_up, down = host.get("gate_up_proj"), host.get("down_proj")
    if set(host) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3:
        return False
    flags = (getattr(module, "has_gate", True), not getattr(module, "has_bias", False),
             not getattr(module, "is_transposed", False),
             getattr(module, "is_concatenated", True),
             not getattr(module, "has_post_expert_norm", False))
    gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    shapes = gate_up.shape[0] == down.shape[0] == experts and \
        gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
    return all(flags) and silu and shapes and \
        (gate is None or gate.__name__ == "_default_apply_gate")


def laid_out_as(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` with ``torch.empty_like(x)``'s dtype and strides, what the op's fake kernel
    promised the compiler."""
    if out.dtype == x.dtype and (out.stride() == x.stride() or
                                 (out.is_contiguous() and x.is_contiguous())):
        return out
    return torch.empty_like(x).copy_(out)
