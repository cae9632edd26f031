"""Hugging Face transformers models built from small configs (no downloads): compiled with the
backend, logits equal the model without offloading; greedy generate() gives the same tokens.
Run on CPU in CI and on the GPU (``-m cuda``)."""
import copy
import gc

import pytest
import torch

import fx_offload
from helpers import assert_same_greedy_tokens

transformers = pytest.importorskip("transformers", reason="install the test extra")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def build(name, **smaller):
    """``name`` from SMALL; ``smaller``: a Llama's config entries set otherwise."""
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(SMALL | smaller))), {}
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)), {}
    if name == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL)), {}
    if name == "mixtral":
        config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config), {"offload_params": ["experts"]}
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256,
                                         n_positions=128)
        return transformers.GPT2LMHeadModel(config), {}
    raise AssertionError(name)


STACKS = {"llama": "model.layers", "qwen2": "model.layers", "mistral": "model.layers",
          "mixtral": "model.layers", "gpt2": "transformer.h"}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", sorted(STACKS))
def test_logits_equal(name, inner, device):
    model, extra = build(name)
    model = model.eval().to(device)
    reference = copy.deepcopy(model)
    # the same inner compiler on the model without offloading: transformers takes other code
    # paths (attention masks) under torch.compile than eagerly
    ref_fn = torch.compile(reference, backend=inner)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": inner, "group_size": 2,
                                      "num_in_group": 1, **extra})
    with torch.no_grad():
        for call in range(3):
            ids = torch.randint(0, 256, (2, 12), device=device)
            got = compiled(ids, use_cache=False).logits
            want = ref_fn(ids, use_cache=False).logits
            if inner == "inductor" and device == "cuda":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, want), (name, inner, call)
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3]
    assert all(n.startswith(f"{STACKS[name]}.") for ns in rep.params.values() for n in ns)
    if name == "mixtral":
        assert all(".experts." in n for ns in rep.params.values() for n in ns)
    if name == "gpt2":     # Conv1D weights offloaded; the tied embedding/lm_head stays
        assert "transformer.h.1.attn.c_attn.weight" in rep.params[1]
        assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_generate_gives_the_same_tokens(name, device):
    model, extra = build(name)
    model = model.eval().to(device)
    reference = copy.deepcopy(model)
    model.forward = torch.compile(model.forward, backend="prefetch_offload",
                                  options={"inner_backend": "aot_eager", **extra})
    ids = torch.randint(0, 256, (1, 6), device=device)
    assert_same_greedy_tokens(model, reference, ids)
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["prefetches"] > 0


def test_llama_submodule_state_dict_deepcopy_and_half_hold_the_truth():
    """What users do to a Hugging Face model once it is offloaded: the inner model's
    state_dict, a deepcopy, a dtype conversion."""
    model, _ = build("llama")
    model.eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", "group_size": 2,
                                      "num_in_group": 1})
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        for _ in range(2):
            compiled(ids, use_cache=False)
    want = reference.model.state_dict()
    got = model.model.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    clone = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(clone(ids, use_cache=False).logits,
                           reference(ids, use_cache=False).logits)
    model.half()
    reference.half()
    ref_fn = torch.compile(reference, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           ref_fn(ids, use_cache=False).logits)


@pytest.mark.parametrize("kv", [{}, dict(kv_cache="host", kv_block_size=16)])
def test_a_deepcopy_after_compile_forward_computes_with_its_own_weights(kv, caplog):
    """compile_forward sets a compiled function as model.forward, which a deepcopy of the
    model shares: the copy called the original's forward and computed with the original's
    weights (silently, once its own were changed).  The copy now runs its own forward, eager
    with a warning that says how to compile it; compiled, it is offloaded on its own (with
    its own host KV cache); the original is unchanged, and the copy outlives it.  Two layers
    (layer 1 offloaded): what is checked is whose forward and weights a copy computes with."""
    torch.manual_seed(0)
    model, _ = build("llama", num_hidden_layers=2)
    model = model.eval()
    model.generation_config.eos_token_id = None
    reference = copy.deepcopy(model)
    options = dict(group_size=2, num_in_group=1, inner_backend="aot_eager", **kv)
    fx_offload.compile_forward(model, **options)
    ids = torch.randint(0, 256, (1, 6))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        expected = reference.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs), expected)
        with caplog.at_level("WARNING", logger="fx_offload"):
            twin = copy.deepcopy(model)
        assert "runs its own forward eagerly" in caplog.text
        twin_reference = copy.deepcopy(reference)
        for m in (twin, twin_reference):
            m.lm_head.weight.data.mul_(-1.0)
        twin_expected = twin_reference.generate(ids, **kwargs)
        assert not torch.equal(twin_expected, expected)
        assert torch.equal(twin.generate(ids, **kwargs), twin_expected)
        fx_offload.compile_forward(twin, **options)
        assert torch.equal(twin.generate(ids, **kwargs), twin_expected)
        assert fx_offload.registry.state_for_model(twin) is not None
        if kv:
            assert fx_offload.report(twin).kv["layers"] == [0, 1]   # every layer
        assert torch.equal(model.generate(ids, **kwargs), expected)
        del model
        gc.collect()
        assert torch.equal(twin.generate(ids, **kwargs), twin_expected)


def test_greedy_generate_with_a_static_cache():
    """generate(cache_implementation="static"): fixed-shape caches, one graph for prefill and
    one for the decode steps; same tokens as the model without offloading."""
    model, _ = build("llama")
    model = model.eval()
    reference = copy.deepcopy(model)
    model.forward = torch.compile(model.forward, backend="prefetch_offload",
                                  options={"inner_backend": "aot_eager"})
    ids = torch.randint(0, 256, (1, 6))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                  pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["prefetches"] > 0 and state.stats["sync_loads"] == 0


@pytest.mark.parametrize("fullgraph", [False, True])
def test_generates_own_compile_of_the_decode_steps_keeps_compile_forwards_graphs(fullgraph):
    """With a static cache on CUDA, ``generate`` compiles ``model.__call__`` itself (forced
    here on the CPU).  That compile traced through the callable that compile_forward sets as
    the forward (for deepcopy) into the compiled forward, whose backend it then dropped:
    every decode step loaded each offloaded layer whole through the eager hooks (9 times
    slower on an H200, with the right tokens) and host compute never ran.  It now runs that
    callable as it is (``fullgraph=True`` too), and with it the forward's own graphs."""
    transformers = pytest.importorskip("transformers")
    from helpers import small_moe
    model, reference = small_moe("qwen3_moe").eval(), small_moe("qwen3_moe").eval()
    for m in (model, reference):
        m.generation_config.pad_token_id = 0
    fx_offload.compile_forward(model, dynamic=False, group_size=1, num_in_group=1,
                               experts="routed", host_compute="always",
                               inner_backend="aot_eager")
    config = transformers.CompileConfig(backend="aot_eager", mode=None, fullgraph=fullgraph)
    config._compile_all_devices = True      # (generate compiles on CUDA alone otherwise)
    ids = torch.randint(0, 256, (1, 8))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False,
                  cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs, compile_config=config),
                           reference.generate(ids, **kwargs))
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["sync_loads"] == 0
    rep = fx_offload.report(model)      # the last decode step: experts on the host
    assert rep.ran_on == {layer: "host" for layer in range(4)}, rep.ran_on
    assert rep.copied_bytes_last_call < sum(rep.layer_bytes.values()) / 2


def _bf16_llama_offloaded(compress: str):
    """(a bf16 Llama compiled through compile_forward with every second layer offloaded and
    ``compress``, an untouched copy of it, token ids)."""
    model, _ = build("llama")
    model = model.to(torch.bfloat16).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    fx_offload.compile_forward(model, group_size=2, num_in_group=1, compress=compress,
                               inner_backend="aot_eager")
    return model, reference, ids


@pytest.mark.parametrize("compress", ["none", "lossless"])
def test_a_users_exception_inside_a_layers_submodule_surfaces_as_itself(compress):
    """A Hugging Face Llama compiled through compile_forward whose offloaded layer's MLP
    raises the user's own error: Dynamo breaks the graph there and compiles the layer's norm
    on its own; that graph belongs to the model (a module inside one of its layers), the call
    raises the user's error, and once the MLP is put back the model computes as before."""
    model, reference, ids = _bf16_llama_offloaded(compress)
    mlp = model.model.layers[3].mlp

    def refuse(*args, **kwargs):
        raise ValueError("the user's own error")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        mlp.forward = refuse
        with pytest.raises(ValueError) as raised:
            model(ids)
        assert type(raised.value) is ValueError and str(raised.value) == "the user's own error"
        del mlp.forward
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert fx_offload.report(model).layers == [1, 3]


@pytest.mark.parametrize("compress", ["none", "lossless"])
def test_save_pretrained_of_an_offloaded_model_saves_the_true_weights(compress, tmp_path):
    """save_pretrained of a Hugging Face model compiled with offloading (its records compressed,
    its uncompressed weights in files by default) writes the true weights: from_pretrained
    loads them back equal, and the offloaded model computes as before afterwards."""
    model, reference, ids = _bf16_llama_offloaded(compress)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        if compress == "lossless":
            assert fx_offload.report(model).call_bytes
        model.save_pretrained(tmp_path)
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        want = reference.state_dict()
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(v, want[k]) for k, v in got.items())
        assert torch.equal(model(ids).logits, reference(ids).logits)
