"""Graph breaks between and inside layers: correct outputs, never silently wrong."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fx_offload
from fx_offload.tools.models import MLPBlock, MLPStack


class BreakingBlock(MLPBlock):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return x + self.fc2(h)


class Stack(nn.Module):
    """``where``: 'loop' (break between layers in the for loop), 'unrolled' (break between
    layers 2 and 3 of an unrolled forward), 'inside' (break inside every layer)."""

    def __init__(self, where: str, num_layers: int = 6):
        super().__init__()
        block = BreakingBlock if where == "inside" else MLPBlock
        self.layers = nn.ModuleList(block(16, 32) for _ in range(num_layers))
        self.where = where

    def forward(self, x):
        x = x * 2
        if self.where == "unrolled":
            for layer in self.layers[:3]:
                x = layer(x)
            torch._dynamo.graph_break()
            for layer in self.layers[3:]:
                x = layer(x)
            return x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.where == "loop" and i == 2:
                torch._dynamo.graph_break()
        return x


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("where", ["loop", "unrolled", "inside"])
def test_graph_breaks_give_correct_outputs(where, inner, caplog):
    torch.manual_seed(0)
    model = Stack(where).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": inner, "prefetch_step": 2})
    with caplog.at_level(logging.INFO, logger="fx_offload"), torch.no_grad():
        for call in range(3):
            x = torch.randn(4, 16)
            got, want = compiled(x), reference(x)
            if inner == "inductor":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, want), f"call {call}"
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3, 5]
    messages = " ".join(r.getMessage() for r in caplog.records)
    if where == "unrolled":
        # two graphs, each with prefetch ops; the last layer refills the first for next call
        assert "graph with 1 offloaded layer(s) [1]" in messages
        assert "graph with 2 offloaded layer(s) [3, 5]" in messages
        assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0
    else:
        # Dynamo compiled Block.forward alone and reuses it for every layer: no prefetch in
        # it, the layers' pre-forward hooks load synchronously, and the user is told why
        assert "compiled" in messages and "on its own" in messages
        assert fx_offload.registry.state_for_model(model).stats["sync_loads"] > 0


class Pipeline(nn.Module):
    """A user's module that calls a model it holds (and whose stack it holds too)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) * 2


def test_a_module_calling_the_compiled_model_is_not_taken_for_it():
    """Only the inner model is compiled; the graph break inside its layers makes Dynamo
    compile a layer on its own, whose model is looked for among the callers: the compiled one,
    not the pipeline around it."""
    torch.manual_seed(0)
    model = Stack("inside").eval()
    reference = copy.deepcopy(model)
    pipe = Pipeline(model)
    pipe.model = torch.compile(model, backend="prefetch_offload",
                               options={"inner_backend": "aot_eager", "prefetch_step": 2})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16)
            assert torch.equal(pipe(x), reference(x) * 2)
    assert fx_offload.report(model).layers == [1, 3, 5]
    assert fx_offload.registry.state_for_model(pipe) is None


def test_two_models_stay_independent():
    from fx_offload.tools import models
    a, (xa,) = models.build("mlp", num_layers=4, seed=1)
    b, (xb,) = models.build("decoder", num_layers=4, seed=2)
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    ca = torch.compile(a, backend="prefetch_offload", options={"inner_backend": "eager"})
    cb = torch.compile(b, backend="prefetch_offload",
                       options={"inner_backend": "eager", "prefetch_step": 2})
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(ca(xa), ra(xa))
            assert torch.equal(cb(xb), rb(xb))
    assert fx_offload.report(a).num_slots == 1 and fx_offload.report(b).num_slots == 2


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=256)).eval()


@pytest.mark.parametrize("first", ["plain", "hidden_states"])
def test_hidden_states_asked_in_any_call_are_right_with_a_warning(caplog, first):
    """transformers' ``output_hidden_states=True`` breaks the graph inside the model, so
    Dynamo compiles the inner ``LlamaModel.forward`` on its own during the offloaded
    model's call: a graph of a part of that model, run as a layer's frame is (its offloaded
    layers loaded synchronously, a warning naming the break), not refused as a part
    compiled on its own.  Asked in the very first call, the causal LM still owns the
    layers (not the decoder compiled first), so later plain calls prefetch as usual."""
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))

    def plain():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           reference(ids, use_cache=False).logits)

    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fx_offload"):
        if first == "plain":
            plain()
        for _ in range(2):
            got = compiled(ids, use_cache=False, output_hidden_states=True)
            want = reference(ids, use_cache=False, output_hidden_states=True)
            assert torch.equal(got.logits, want.logits)
            assert all(torch.equal(g, w) for g, w in zip(got.hidden_states, want.hidden_states))
        plain()
        state = fx_offload.registry.state_for_model(model)
        loads = state.stats["sync_loads"]
        plain()                 # the whole model's graph: prefetched, nothing loaded whole
        assert state.stats["sync_loads"] == loads
    assert "LlamaModel.forward on its own" in caplog.text
    rep = fx_offload.report(model)
    assert rep.model == "LlamaForCausalLM" and rep.layers == [1, 3]
    assert fx_offload.registry.state_for_model(model.model) is None
    fx_offload.restore(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 reference.state_dict().values()))


def test_hidden_states_in_an_encoder_decoders_first_call_are_right():
    """T5 asked for hidden states in its very first call: each of its two stacks compiles
    on its own inside the model's call, the first before the model was offloaded, the
    second after; both are the model's, and later plain calls prefetch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0)).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    g = torch.Generator().manual_seed(1)
    ids, decoder_ids = torch.randint(0, 128, (1, 7), generator=g), \
        torch.randint(0, 128, (1, 5), generator=g)
    with torch.no_grad():
        for hidden in (True, False, True, False):
            got = compiled(input_ids=ids, decoder_input_ids=decoder_ids,
                           output_hidden_states=hidden)
            want = reference(input_ids=ids, decoder_input_ids=decoder_ids,
                             output_hidden_states=hidden)
            assert torch.equal(got.logits, want.logits)
            if hidden:
                for mine, theirs in ((got.encoder_hidden_states, want.encoder_hidden_states),
                                     (got.decoder_hidden_states, want.decoder_hidden_states)):
                    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        state = fx_offload.registry.state_for_model(model)
        loads = state.stats["sync_loads"]
        compiled(input_ids=ids, decoder_input_ids=decoder_ids)
        assert state.stats["sync_loads"] == loads
    assert fx_offload.report(model).model == "T5ForConditionalGeneration"


def test_a_decoder_offloaded_on_its_own_then_its_causal_lm_compiled_is_refused_then_works():
    """The decoder inside a causal LM compiled and offloaded on its own, then the LM
    compiled too: both hold the layers, a model is offloaded once; the error says so and
    what to do, nothing is lost, and after restoring the decoder the LM offloads."""
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    options = {"inner_backend": "aot_eager"}
    with torch.no_grad():
        torch.compile(model.model, backend="prefetch_offload", options=options)(ids)
        compiled = torch.compile(model, backend="prefetch_offload", options=options)
        with pytest.raises(Exception, match=r"LlamaModel and this LlamaForCausalLM, one module "
                                            r"inside the other, both hold these layers.*"
                                            r"call fx_offload.restore on it first"):
            compiled(ids)
        fx_offload.restore(model.model)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     reference.state_dict().values()))
        assert torch.equal(compiled(ids).logits, reference(ids).logits)
    assert fx_offload.report(model).model == "LlamaForCausalLM"


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_peft_dora_breaks_inside_each_layer_and_is_one_model(caplog, mode):
    """PEFT's DoRA breaks the graph inside each adapted projection (``dequantize_module_
    weight``), and Dynamo compiles DoRA's forward on its own: a frame whose parameters are
    held by ``lora_A``, ``lora_B`` and ``base_layer``, arguments of one layer's call, not
    the "2 models" it was refused as.  Inference: right outputs, the layer-frame warning;
    training: the error for layers compiled apart (errors.md row 90), nothing lost."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True,
                        init_lora_weights=False))
    model.train(mode == "training")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "group_size": 2, "num_in_group": 1, "prefetch_step": 1, "inner_backend": "aot_eager"})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    if mode == "training":
        with pytest.raises(Exception, match=r"trains only a model whose layers run in its "
                                            r"own graph: Dynamo compiled DoraLinearLayer"
                                            r"\.forward \(inside Linear\.forward\) on its own"):
            compiled(input_ids=ids, labels=ids)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), name
        return
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fx_offload"):
        want = reference(input_ids=ids, use_cache=False).logits
        for _ in range(2):
            assert torch.equal(compiled(input_ids=ids, use_cache=False).logits, want)
    assert "on its own (a graph break in or between the layers of PeftModel" in caplog.text
    names = fx_offload.report(model).params[1]
    assert any("lora_magnitude_vector" in n for n in names)


def _two_layers(a, b, x):
    torch._dynamo.graph_break()
    return b(a(x))


class HelperStack(nn.Module):
    """Its first two layers run in a function given both (a break in it)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.layers = nn.ModuleList(MLPBlock(16, 32) for _ in range(4))

    def forward(self, x):
        x = _two_layers(self.layers[0], self.layers[1], x * self.scale)
        for layer in self.layers[2:]:
            x = layer(x)
        return x


def test_a_function_given_two_layers_is_a_part_of_the_model(caplog):
    """The rest of ``_two_layers`` after its break is compiled on its own, holding two
    layers of the model: a part of the model, whose call runs around it (it was refused as
    "2 models"), run as a layer's frame is: right outputs and the warning naming it."""
    torch.manual_seed(0)
    model = HelperStack().eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "group_size": 2, "num_in_group": 1, "inner_backend": "aot_eager"})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fx_offload"):
        for _ in range(3):
            x = torch.randn(4, 16)
            assert torch.equal(compiled(x), reference(x))
    assert "compiled _two_layers (inside HelperStack.forward) on its own" in caplog.text
    assert fx_offload.report(model).layers == [1, 3]


def test_two_models_read_in_one_graph_are_still_refused():
    """Two models called from one compiled function: no module's call runs around the
    frame and holds both, so they are two models (DoRA's frame above is one)."""
    a, b = MLPStack().eval(), MLPStack().eval()
    both = torch.compile(lambda x: a(x) + b(x), backend="prefetch_offload")
    with torch.no_grad(), pytest.raises(Exception, match=r"reads parameters of 2 models "
                                                         r"\(\['MLPStack', 'MLPStack'\]\)"):
        both(torch.randn(2, a.layers[0].fc1.in_features))
