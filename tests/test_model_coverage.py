"""Models beyond decoder-only LLMs: classes that define ``__getattr__`` (diffusers'
ModelMixin, PEFT's wrappers), a diffusers Flux transformer, a PEFT LoRA adapter on an offloaded
base; and the ``torch.compile`` wrappers accepted where a model is expected.  Each compiled
with the backend and compared with the model run by the same inner compiler."""
import copy
import logging

import pytest
import torch
from torch import nn

import fx_offload
from fx_offload.tools.models import MLPBlock

OPTIONS = {"inner_backend": "aot_eager", "group_size": 2, "num_in_group": 1}
RATES = dict(flop_rate=1e12, memory_bandwidth=1e11, h2d_bandwidth=1e10, launch_overhead=5e-6)


class WithGetattr(nn.Module):
    """Dynamo names this class's submodules ``L['self'].__dict__['_modules']['blocks']``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(16, 32) for _ in range(4))

    def __getattr__(self, name):
        return super().__getattr__(name)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Plain(WithGetattr):
    __getattr__ = nn.Module.__getattr__


@pytest.mark.parametrize("cls", [Plain, WithGetattr])
@pytest.mark.parametrize("planned", [False, True], ids=["hand_picked", "memory_budget"])
def test_a_model_class_with_getattr(cls, planned, caplog):
    torch.manual_seed(0)
    model = cls().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16)
    weights = sum(p.numel() * 4 for p in model.parameters())
    options = ({"inner_backend": "aot_eager", "memory_budget": weights // 2, **RATES}
               if planned else OPTIONS)
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    with caplog.at_level("INFO", logger="fx_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
    assert fx_offload.report(model).layers
    if planned:    # the planner saw every layer's cost (its INFO lines name them)
        assert "layer 0:" in caplog.text


class EncoderDecoder(nn.Module):
    """Two layer lists of one length; ``reverse`` runs the second first."""

    def __init__(self, reverse: bool = False):
        super().__init__()
        self.reverse = reverse
        self.encoder = nn.ModuleList(MLPBlock(16, 32) for _ in range(3))
        self.decoder = nn.ModuleList(MLPBlock(16, 64) for _ in range(3))   # another shape

    def forward(self, x):
        first, second = (self.decoder, self.encoder) if self.reverse else (self.encoder,
                                                                             self.decoder)
        for layer in [*first, *second]:
            x = layer(x)
        return x


@pytest.mark.parametrize("reverse", [False, True])
def test_two_stacks_share_one_schedule_in_run_order(reverse):
    """Both lists are found and offloaded in one circular schedule, their layers (of other
    shapes) sharing the slots, in the order they run: no layer is loaded synchronously."""
    torch.manual_seed(0)
    model = EncoderDecoder(reverse).eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", "group_size": 1,
                                      "num_in_group": 1, "prefetch_step": 2})
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), reference(x))
    state = fx_offload.registry.state_for_model(model)
    assert state.stack.paths == (("decoder", "encoder") if reverse else ("encoder", "decoder"))
    assert state.layers == list(range(6))
    assert state.stats["sync_loads"] == 0 and state.stats["prefetches"] > 0
    assert state.stack.layer_path(3) == ("encoder.0" if reverse else "decoder.0")


diffusers = pytest.importorskip("diffusers", reason="install the test extra")


def tiny_flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8)).eval()
    seq, text = 16, 8
    inputs = dict(hidden_states=torch.randn(1, seq, 4),
                  encoder_hidden_states=torch.randn(1, text, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([1.0]),
                  img_ids=torch.zeros(seq, 3), txt_ids=torch.zeros(text, 3), return_dict=False)
    return model, inputs


@pytest.mark.parametrize("stack", ["single_transformer_blocks", "transformer_blocks"])
def test_flux_transformer_bitwise(stack):
    model, inputs = tiny_flux()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "layers": stack, "group_size": 2})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(**inputs)[0], reference(**inputs)[0])
    assert fx_offload.report(model).layers == ([1, 3] if stack.startswith("single") else [1])


def test_flux_both_block_lists_in_one_schedule():
    """Flux's double- and single-stream blocks (other parameters) share the slots."""
    model, inputs = tiny_flux()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "group_size": 1, "prefetch_step": 2,
                                      "layers": ["transformer_blocks",
                                                 "single_transformer_blocks"]})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(**inputs)[0], reference(**inputs)[0])
    state = fx_offload.registry.state_for_model(model)
    assert state.layers == list(range(6)) and state.stats["sync_loads"] == 0
    assert fx_offload.report(model).num_slots == 2


def tiny_sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=16, out_channels=4)
    return model, dict(hidden_states=torch.randn(1, 4, 8, 8),
                       encoder_hidden_states=torch.randn(1, 6, 16),
                       pooled_projections=torch.randn(1, 16), timestep=torch.tensor([1.0]),
                       return_dict=False)


def tiny_wan():
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=4,
        rope_max_seq_len=32)
    return model, dict(hidden_states=torch.randn(1, 4, 2, 8, 8), timestep=torch.tensor([1]),
                       encoder_hidden_states=torch.randn(1, 6, 16), return_dict=False)


def tiny_ltx():
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=4, caption_channels=16)
    return model, dict(hidden_states=torch.randn(1, 2 * 4 * 4, 8),
                       encoder_hidden_states=torch.randn(1, 6, 16), timestep=torch.tensor([1]),
                       encoder_attention_mask=torch.ones(1, 6), num_frames=2, height=4, width=4,
                       return_dict=False)


@pytest.mark.parametrize("build", [tiny_sd3, tiny_wan, tiny_ltx], ids=["sd3", "wan", "ltx"])
def test_diffusion_transformers_with_every_block_offloaded(build):
    """SD3's last block has other parameters than the rest (it shares their slots now);
    Wan and LTX are video transformers. Every block offloaded, two slots, bitwise with aot_eager."""
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options={
        **OPTIONS, "group_size": 1, "prefetch_step": 2})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(**inputs)[0], reference(**inputs)[0])
    state = fx_offload.registry.state_for_model(model)
    assert state.layers == [0, 1, 2, 3] and state.stats["sync_loads"] == 0


peft = pytest.importorskip("peft", reason="install the test extra")
transformers = pytest.importorskip("transformers", reason="install the test extra")


def test_peft_lora_on_an_offloaded_base():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    base = transformers.LlamaForCausalLM(config).eval()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora).eval()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        for _ in range(2):
            got = compiled(input_ids=ids, use_cache=False).logits
            assert torch.equal(got, reference(input_ids=ids, use_cache=False).logits)
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3]
    names = [n for ns in rep.params.values() for n in ns]
    assert any("lora_A" in n for n in names)     # the adapter's weights move with the layer


def test_a_merged_peft_model_compiled_apart_is_not_called_another_model(caplog):
    """``merge_and_unload()`` of an offloaded PEFT model returns its inner model, whose layers
    are the offloaded ones; compiled with another backend, its graph traces the layers' waits
    and ran them outside the PeftModel's call, which was warned about as "another PeftModel
    that is not offloaded".  The warning now names the part and what to do; outputs are
    right, and after restoring the PeftModel the merged model runs plain, unwarned."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "group_size": 2, "num_in_group": 1, "prefetch_step": 1, "inner_backend": "aot_eager"})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fx_offload"):
        for _ in range(2):      # (the second through its hooks)
            compiled(input_ids=ids, use_cache=False)
        merged = torch.compile(model.merge_and_unload(), backend="aot_eager")
        want = reference.merge_and_unload()(input_ids=ids, use_cache=False).logits
        assert torch.equal(merged(input_ids=ids, use_cache=False).logits, want)
        assert "not offloaded" not in caplog.text
        assert "LlamaForCausalLM, which holds the offloaded layers of PeftModel" in caplog.text
        caplog.clear()
        fx_offload.restore(model)
        assert torch.equal(merged(input_ids=ids, use_cache=False).logits, want)
    assert caplog.text == ""


def test_compiled_wrappers_are_accepted_where_a_model_is():
    """report/restore/explain/named_weights/update_weights take what torch.compile
    returned."""
    torch.manual_seed(0)
    model = Plain().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    assert fx_offload.explain(compiled, x, **OPTIONS).choice.layers == [1, 3]
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(x)
    assert fx_offload.report(compiled).layers == fx_offload.report(model).layers == [1, 3]
    names = dict(fx_offload.named_weights(compiled))
    assert set(names) == {n for n, _ in reference.named_parameters()}
    new = torch.full_like(reference.blocks[1].fc1.weight, 0.01)
    fx_offload.update_weights(compiled, {"blocks.1.fc1.weight": new})
    reference.blocks[1].fc1.weight.data.copy_(new)
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    fx_offload.restore(compiled)
    with pytest.raises(fx_offload.OffloadError, match="or it was restored"):
        fx_offload.report(model)
    other = WithGetattr().eval()      # another class: see the second-instance test
    other.forward = torch.compile(other.forward, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        other(x)
    assert fx_offload.report(other.forward).layers == [1, 3]


def test_a_second_instance_of_a_class_is_not_offloaded_silently(caplog):
    """Dynamo runs the graph it compiled for the first instance with the second's
    parameters, and the backend never sees the second: a warning says so and what to do;
    placed with the same options, the second is offloaded through the same graph."""
    torch.manual_seed(0)
    first, second = WithGetattr().eval(), WithGetattr().eval()
    reference = copy.deepcopy(second)
    x = torch.randn(2, 16)
    with torch.no_grad():
        compiled_first = torch.compile(first, backend="prefetch_offload", options=OPTIONS)
        compiled_first(x)
        compiled_first(x)
        compiled = torch.compile(second, backend="prefetch_offload", options=OPTIONS)
        with caplog.at_level("WARNING", logger="fx_offload"):
            assert torch.equal(compiled(x), reference(x))
        assert "ran for another WithGetattr that is not offloaded" in caplog.text
        assert fx_offload.registry.state_for_model(second) is None
        fx_offload.place(second, "cpu", group_size=2, num_in_group=1)
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
    state = fx_offload.registry.state_for_model(second)
    assert state.stats["prefetches"] > 0 and fx_offload.report(second).layers == [1, 3]


def _t5():
    config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), {
        "input_ids": torch.randint(1, 256, (1, 10))}


def _whisper():
    config = transformers.WhisperConfig(
        vocab_size=256, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=32, max_target_positions=64,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return transformers.WhisperForConditionalGeneration(config), {
        "input_features": torch.randn(1, 16, 64)}


@pytest.mark.parametrize("build, stacks", [
    (_t5, ("encoder.block", "decoder.block")),
    (_whisper, ("model.encoder.layers", "model.decoder.layers"))], ids=["t5", "whisper"])
def test_encoder_decoder_models_offload_both_stacks(build, stacks):
    """The encoder's and the decoder's layers are found together and offloaded in one
    schedule; logits equal the model run by the same inner compiler; greedy generate (the
    encoder runs once, outside the compiled forward) gives the same tokens.  Two layers a
    stack: layers 1 and 3, one of each stack, share the slot."""
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    reference = copy.deepcopy(model)
    decoder_ids = torch.ones(1, 3, dtype=torch.long)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager"})
    expected = torch.compile(copy.deepcopy(model), backend="aot_eager")
    with torch.no_grad():
        got = compiled(**inputs, decoder_input_ids=decoder_ids, use_cache=False).logits
        want = expected(**inputs, decoder_input_ids=decoder_ids, use_cache=False).logits
    assert torch.equal(got, want)
    assert fx_offload.registry.state_for_model(model).stack.paths == stacks
    assert fx_offload.report(model).layers == [1, 3]
    fx_offload.restore(model)
    model.forward = torch.compile(model.forward, backend="prefetch_offload",
                                  options={"inner_backend": "aot_eager"})
    (source,) = inputs.values()
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(source, **kwargs), reference.generate(source, **kwargs))
    assert fx_offload.registry.state_for_model(model).stats["prefetches"] > 0


def _word_tokenizer(folder, **special):
    """A tokenizer of a few words, written to ``folder`` (no hub): enough for a pipeline's
    text encoders to run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<pad>", "</s>", "<unk>", "<|startoftext|>", "<|endoftext|>", "a", "cat", "on",
             "the", "moon"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(folder / "tokenizer.json")
    tokenizer.save(path)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=path, pad_token="<pad>",
                                                model_max_length=8, **special)


def tiny_flux_pipeline(tmp_path, transformer):
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=8, projection_dim=16, eos_token_id=4,
        bos_token_id=3, pad_token_id=0)).eval()
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=10, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], latent_channels=4,
        norm_num_groups=4, sample_size=16, shift_factor=0.1, scaling_factor=1.5).eval()
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
        tokenizer=_word_tokenizer(tmp_path, eos_token="<|endoftext|>",
                                  bos_token="<|startoftext|>"),
        text_encoder_2=t5, tokenizer_2=_word_tokenizer(tmp_path, eos_token="</s>"),
        transformer=transformer)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_flux_pipeline_end_to_end(tmp_path, device):
    """A diffusers pipeline (its own tokenizers, CLIP and T5 text encoders, VAE, scheduler)
    with its transformer's forward compiled by ``compile_forward``: both block lists
    offloaded, every denoising step through the offloaded graph, the image equal to the
    pipeline whose transformer runs under the same inner compiler."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=[2, 2, 4]).eval()
    reference = copy.deepcopy(transformer)
    reference.forward = torch.compile(reference.forward, backend="aot_eager")
    kwargs = dict(prompt="a cat on the moon", height=16, width=16, num_inference_steps=3,
                  max_sequence_length=8, output_type="pt")
    pipe = tiny_flux_pipeline(tmp_path, transformer).to(device)
    fx_offload.compile_forward(pipe.transformer, inner_backend="aot_eager", group_size=1,
                               prefetch_step=2,
                               layers=["transformer_blocks", "single_transformer_blocks"])
    got = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    want = tiny_flux_pipeline(tmp_path, reference).to(device)
    want.text_encoder, want.text_encoder_2, want.vae = pipe.text_encoder, pipe.text_encoder_2, \
        pipe.vae
    want = want(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert got.shape == (1, 3, 16, 16) and torch.equal(got, want)
    state = fx_offload.registry.state_for_model(transformer)
    assert state.layers == list(range(6)) and state.stats["sync_loads"] == 0
    assert state.stats["prefetches"] >= 3 * 6       # three steps, every layer each step


def _llama(layers: int = 4):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


def test_compile_forward_makes_generate_run_offloaded():
    """``compiled.generate`` runs the uncompiled forward (torch.compile compiles __call__
    only): report says so and names the helper; ``compile_forward`` compiles the forward
    that generate calls, once (a second call is refused, not stacked)."""
    from helpers import assert_same_greedy_tokens
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 6))
    wrapper = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    assert_same_greedy_tokens(wrapper, reference, ids)
    with pytest.raises(fx_offload.OffloadError, match="compile_forward"):
        fx_offload.report(wrapper)      # nothing ran through the backend
    assert fx_offload.compile_forward(wrapper, dynamic=True, **OPTIONS) is model
    assert_same_greedy_tokens(model, reference, ids)
    state = fx_offload.registry.state_for_model(model)
    assert state.layers == [1, 3] and state.stats["prefetches"] > 0
    with pytest.raises(fx_offload.OffloadError, match="compiled already; call "
                                                      "fx_offload.restore"):
        fx_offload.compile_forward(model, **OPTIONS)
    fresh = _llama()        # compiled, never called: following the advice works
    fx_offload.compile_forward(fresh, **OPTIONS)
    with pytest.raises(fx_offload.OffloadError, match=r"compiled already; `del model.forward` "
                                                      r"\(it is not offloaded yet\)"):
        fx_offload.compile_forward(fresh, **OPTIONS)
    del fresh.forward
    fx_offload.compile_forward(fresh, **OPTIONS)
    with pytest.raises(fx_offload.OffloadError, match="group_size"):
        fx_offload.compile_forward(_llama(), group_size=0)       # checked before compiling


def test_generation_config_compile_config_names_the_backend():
    """Hugging Face's own compile route: ``generate(..., compile_config=CompileConfig(
    backend="prefetch_offload", mode=None, options=...))`` with a static cache compiles the
    decode steps with the backend (``mode=None``: torch.compile takes a mode or options, not
    both; ``backend=fx_offload.backend(...)`` keeps a mode). The prefill runs uncompiled,
    loading offloaded layers synchronously once the model is offloaded."""
    model = _llama()
    reference = copy.deepcopy(model)
    config = transformers.CompileConfig(backend="prefetch_offload", mode=None, options=OPTIONS)
    config._compile_all_devices = True        # generate compiles on the GPU only otherwise
    ids = torch.randint(0, 256, (1, 6))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                  pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        want = reference.generate(ids, **kwargs)
        for _ in range(2):
            assert torch.equal(model.generate(ids, **kwargs, compile_config=config), want)
    state = fx_offload.registry.state_for_model(model)
    assert state.layers == [1, 3] and state.stats["prefetches"] >= 2 * 7


def test_convnext_stack_is_the_blocks_inside_a_stage(caplog):
    """ConvNeXt's stages each have their own width: detection looks inside them and takes
    the longest list of alike blocks (stage 2), not the four unlike stages."""
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 6, 2],
                                         image_size=32)
    model = transformers.ConvNextModel(config).eval()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    x = torch.randn(2, 3, 32, 32)
    with caplog.at_level("WARNING", logger="fx_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x).last_hidden_state, reference(x).last_hidden_state)
    rep = fx_offload.report(model)
    assert rep.stack == "encoder.stages.2.layers" and rep.layers == [1, 3, 5]
    assert "slots hold nearly all" not in caplog.text


def test_detection_looks_inside_unlike_layers_only_when_each_holds_a_list():
    """Hybrid layers (attention or a mixer, dense or experts) are unlike too, but not each
    holds a layer list: they stay the stack, and the experts are never taken for it."""
    from fx_offload.selection.stack import find_layer_stack

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))

    class Hybrid(nn.Module):
        def __init__(self, mixer, ffn):
            super().__init__()
            self.mixer, self.ffn = mixer, ffn

    class Stage(nn.Module):
        def __init__(self, width, depth):
            super().__init__()
            self.down = nn.Linear(width, width)
            self.blocks = nn.ModuleList(MLPBlock(width, 2 * width) for _ in range(depth))

    root = nn.Module()
    root.layers = nn.ModuleList([Hybrid(nn.Conv1d(4, 4, 3), nn.Linear(4, 4)),
                                 Hybrid(nn.Conv1d(4, 4, 3), Experts()),
                                 Hybrid(nn.Linear(4, 4), nn.Linear(4, 4)),
                                 Hybrid(nn.Linear(4, 4), Experts())])
    assert find_layer_stack(root, None).paths == ("layers",)
    root.layers = nn.ModuleList([Stage(8, 2), Stage(16, 3), Stage(32, 3), Stage(64, 2)])
    assert find_layer_stack(root, None).paths == ("layers.1.blocks", "layers.2.blocks")
