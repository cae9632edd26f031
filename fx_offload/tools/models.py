"""Built-in models: the demo's default decoder and the fixtures the tests and tools share.

Each builder returns ``(model, example_inputs)`` with deterministic random weights.

* ``mlp``: a stack of residual MLP blocks, the smallest model with repeated layers;
* ``decoder``: a Llama-like decoder (embedding, RMSNorm, rotary attention with grouped KV
  heads, gated MLP) whose layers take and return ``(hidden, residual)``;
* ``moe``: layers whose MLP holds stacked expert weights with ``*_scale`` parameters that are
  multiplied in before use, as dequantizing layers do; every expert is computed, weighted
  by gates that are zero for the experts not picked.  ``routed=True``: only the picked
  experts' rows are read (indexed by the router's top-k), as Hugging Face's MoE layers do.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, num_layers: int = 8, hidden: int = 32, inner: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(hidden, inner) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Returns ``(hidden, residual)``; the residual add is fused into the next norm."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, inner: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = GatedMLP(hidden, inner)

    def forward(self, hidden, residual, cos, sin):
        residual = hidden if residual is None else hidden + residual
        hidden = self.self_attn(self.input_layernorm(residual), cos, sin)
        residual = hidden + residual
        hidden = self.mlp(self.post_attention_layernorm(residual))
        return hidden, residual


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]


class TinyDecoder(nn.Module):
    def __init__(self, num_layers: int = 6, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 inner: int = 128, vocab: int = 256):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // heads)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, heads, kv_heads, inner) for _ in range(num_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden, residual = self.embed_tokens(input_ids), None
        cos, sin = (t.to(hidden.dtype) for t in self.rotary(positions))
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        return self.lm_head(self.norm(hidden + residual))


class Experts(nn.Module):
    """Stacked expert weights with per-row scales, multiplied in before use."""

    def __init__(self, num_experts: int, hidden: int, inner: int):
        super().__init__()
        self.w13_weight = nn.Parameter(
            torch.randn(num_experts, 2 * inner, hidden) / math.sqrt(hidden))
        self.w13_weight_scale = nn.Parameter(torch.rand(num_experts, 2 * inner, 1) + 0.5)
        self.w2_weight = nn.Parameter(torch.randn(num_experts, hidden, inner) / math.sqrt(inner))
        self.w2_weight_scale = nn.Parameter(torch.rand(num_experts, hidden, 1) + 0.5)

    def forward(self, x, gates):
        w13 = self.w13_weight * self.w13_weight_scale
        gate, up = torch.einsum("th,eih->tei", x, w13).chunk(2, dim=-1)
        w2 = self.w2_weight * self.w2_weight_scale
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)
        return (out * gates[..., None]).sum(dim=1)


class RoutedExperts(Experts):
    """The same weights, of which each token reads only its picked experts' rows."""

    def __init__(self, num_experts: int, hidden: int, inner: int):
        super().__init__(num_experts, hidden, inner)
        self.num_experts = num_experts

    def forward(self, x, idx, weights):
        w13 = self.w13_weight[idx] * self.w13_weight_scale[idx]         # [T, k, 2I, H]
        gate, up = torch.einsum("th,tkih->tki", x, w13).chunk(2, dim=-1)
        w2 = self.w2_weight[idx] * self.w2_weight_scale[idx]            # [T, k, H, I]
        out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2)
        return (out * weights[..., None]).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int,
                 routed: bool = False):
        super().__init__()
        self.top_k, self.routed = top_k, routed
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = (RoutedExperts if routed else Experts)(num_experts, hidden, inner)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        if self.routed:
            return self.experts(x, idx, top / top.sum(-1, keepdim=True)).reshape(shape)
        gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        return self.experts(x, gates).reshape(shape)


class MoELayer(nn.Module):
    """A MoE layer, or a dense one (``dense=True``, as the first layers of some MoE models):
    one layer type either way, so the stack is still a list of same-type modules."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int,
                 dense: bool = False, routed: bool = False):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.mlp = GatedMLP(hidden, inner) if dense else \
            MoE(hidden, inner, num_experts, top_k, routed)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MoEStack(nn.Module):
    def __init__(self, num_layers: int = 6, hidden: int = 32, inner: int = 32,
                 num_experts: int = 8, top_k: int = 2, dense_every: int = 0,
                 routed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(
            MoELayer(hidden, inner, num_experts, top_k,
                     dense=bool(dense_every) and i % dense_every == 0, routed=routed)
            for i in range(num_layers))
        self.norm = RMSNorm(hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class SplitMLPStack(MLPStack):
    """An MLP stack whose forward has a graph break after layer ``split``: Dynamo compiles
    two graphs of one model."""

    def __init__(self, num_layers: int = 6, split: int = 3, **kw):
        super().__init__(num_layers, **kw)
        self.split = split

    def forward(self, x):
        for layer in self.layers[:self.split]:
            x = layer(x)
        torch._dynamo.graph_break()
        for layer in self.layers[self.split:]:
            x = layer(x)
        return x


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial values everywhere (norm weights are ones at init), deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def build_mlp(num_layers: int = 8, batch: int = 4, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = _randomize(MLPStack(num_layers, **kw), seed)
    return model, (torch.randn(batch, model.layers[0].fc1.in_features),)


def build_decoder(num_layers: int = 6, batch: int = 2, seq: int = 16, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = _randomize(TinyDecoder(num_layers, **kw), seed)
    vocab = model.lm_head.out_features
    return model, (torch.randint(0, vocab, (batch, seq)),)


def build_moe(num_layers: int = 6, batch: int = 2, seq: int = 8, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = _randomize(MoEStack(num_layers, **kw), seed)
    return model, (torch.randn(batch, seq, model.norm.weight.shape[0]),)


def build_split_mlp(num_layers: int = 6, split: int = 3, batch: int = 4, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = _randomize(SplitMLPStack(num_layers, split, **kw), seed)
    return model, (torch.randn(batch, model.layers[0].fc1.in_features),)


# the layer count ``demo`` and ``inspect`` build a built-in model with: one model for both, and
# with the decoder's every second layer offloaded, four layers that prefetch_step=2 puts two
# to a slot (six left one alone in its slot, which saves nothing and is warned about)
TOOL_LAYERS = 8

BUILDERS: dict[str, Callable] = {"mlp": build_mlp, "decoder": build_decoder, "moe": build_moe,
                                 "split_mlp": build_split_mlp}


def build(name: str, **kwargs):
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; choose one of "
                         f"{sorted(BUILDERS)}") from None
    return builder(**kwargs)
