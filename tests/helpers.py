"""Shared test helpers: compile a built-in model with the backend and compare with the model
without offloading."""
from __future__ import annotations

import copy

import pytest
import torch

from fx_offload.tools import models

# device rates the planner would otherwise measure (or read from its cache): every test
# plans with the same ones, whatever machine runs it
PLANNER_RATES = dict(flop_rate=1e12, memory_bandwidth=1e11, h2d_bandwidth=1e10,
                     launch_overhead=5e-6)


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


# a Hugging Face MoE decoder from a small config (transformers' test extra)
SMALL_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def small_moe(name: str, impl: str = "grouped_mm", **smaller):
    """``name`` (qwen3_moe, mixtral, qwen2_moe, deepseek_v3) of 4 small layers, its experts
    computed by transformers' ``impl``, seeded; ``smaller``: qwen3_moe's config entries
    set otherwise (fewer layers or experts, where a test compiles many frames)."""
    transformers = pytest.importorskip("transformers", reason="install the test extra")
    torch.manual_seed(0)
    kw = dict(SMALL_HF, experts_implementation=impl)
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**(kw | dict(moe_intermediate_size=32,
                                                          num_experts=16,
                                                          num_experts_per_tok=2) | smaller))
        return transformers.Qwen3MoeForCausalLM(config)
    if name == "mixtral":
        config = transformers.MixtralConfig(**kw, num_local_experts=8, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**kw, moe_intermediate_size=32, num_experts=16,
                                             num_experts_per_tok=2,
                                             shared_expert_intermediate_size=64)
        return transformers.Qwen2MoeForCausalLM(config)
    if name == "deepseek_v3":
        kw["num_key_value_heads"] = kw["num_attention_heads"]     # multi-head latent attention
        config = transformers.DeepseekV3Config(
            **kw, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
        return transformers.DeepseekV3ForCausalLM(config)
    raise AssertionError(name)


def experts_alone_budget(model) -> tuple[int, int]:
    """(a ``memory_budget`` that holds every weight of ``model``, a small Hugging Face MoE,
    but its expert tensors, plus one slot of one layer's experts: the planner then offloads
    the expert tensors alone; the experts' bytes in one layer)."""
    stack = model.model.layers
    experts = sum(p.numel() * p.element_size() for layer in stack
                  for n, p in layer.named_parameters() if ".experts." in n)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    per_layer = experts // len(stack)
    return total - experts + per_layer + 1024, per_layer


def saved_and_loaded(model, how: str):
    """``model`` through ``pickle`` or ``torch.save``/``torch.load`` (``how``), as a user
    keeps one."""
    import io
    import pickle
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
