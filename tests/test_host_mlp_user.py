"""Dense gated MLPs computed on the host (``host_compute="always"``, the ``host_mlp`` op)
used as users use models, CPU: what they do to a model after its first compiled call
(copies, new storage, dtypes, restore, a second instance), models whose MLP must stream or
stay (exact outputs, a 'streamed: <why>' or 'resident: <why>' reason), hooks, threads,
generate, dynamic shapes, faults inside the host path and Ctrl-C from a hook.  Written to
break the feature: each failure it found is fixed (a stale host view after new storage, the
compiled callable after ``restore``, a copy made after one call running the original's
state, silent non-candidates).

Tiny Hugging Face configs built locally (no network): hidden 64, 4 layers, vocab 256;
layers 1 and 3 offloaded (the default group_size=2, num_in_group=1)."""
import copy
import threading

import pytest
import torch

import fx_offload
from fx_offload.host_compute import kernels
from helpers import saved_and_loaded

transformers = pytest.importorskip("transformers", reason="install the test extra")

ALWAYS = {"host_compute": "always"}
FP32 = dict(atol=2e-5, rtol=2e-5)
CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=4, vocab_size=256)
HOSTED = {1: "host", 3: "host"}


def _model(family: str = "llama", seed: int = 0, **extra):
    torch.manual_seed(seed)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[family]
    kw = dict(CONFIG, **extra)
    if family == "gemma":
        kw.setdefault("head_dim", 16)
    if family == "phi3":
        kw.setdefault("pad_token_id", 0)
    return model_class(config_class(**kw)).eval()


def _compile(model, **options):
    return torch.compile(model, backend="prefetch_offload",
                         options={"inner_backend": "aot_eager", **ALWAYS, **options})


def _ids(shape=(2, 7), seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def _same(got_model, want_model, ids, exact=False, **kw):
    with torch.no_grad():
        got = got_model(ids, use_cache=False, **kw).logits
        want = want_model(ids, use_cache=False, **kw).logits
    if exact:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, **FP32)


def _state_dict_equal(model, reference):
    want = reference.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


def _offloaded(family="llama", calls=1, **extra):
    """A model, its compiled callable (``calls`` calls made, both MLPs hosted) and a
    reference."""
    model = _model(family, **extra)
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    for i in range(calls):
        _same(compiled, reference, _ids(seed=100 + i))
    assert fx_offload.report(model).ran_on == HOSTED
    return model, compiled, reference


def _mlp(model, layer=1):
    return model.model.layers[layer].mlp


# ---------------------------------------------------------------- module operations after a call

def test_a_copy_made_after_one_call_runs_its_own_state_when_streaming_too():
    """Without host compute: the copy of a model called once runs the graph Dynamo shares
    with the original, whose state has had no call through its hooks; the copy's ops act on
    the copy's own state, not the original's slots."""
    model = _model()
    reference = copy.deepcopy(model)
    compiled = _compile(model, host_compute="never")
    _same(compiled, reference, _ids(seed=1))
    twin, twin_reference = copy.deepcopy(model), copy.deepcopy(reference)
    with torch.no_grad():
        for m in (twin, twin_reference):
            m.model.layers[1].mlp.down_proj.weight.mul_(3)
    _same(torch.compile(twin, backend="prefetch_offload",
                        options={"inner_backend": "aot_eager", "host_compute": "never"}),
          twin_reference, _ids(seed=2))
    _same(compiled, reference, _ids(seed=3))


@pytest.mark.parametrize("calls", [1, 2])
def test_deepcopy_after_a_call_is_a_correct_model_of_its_own(calls):
    """calls=1: the copy is made while the original's state has had no call through its
    hooks yet (its first call ran before them)."""
    model, compiled, reference = _offloaded(calls=calls)
    clone = copy.deepcopy(model)
    _state_dict_equal(clone, reference)
    _same(_compile(clone), reference, _ids(seed=1))
    assert fx_offload.report(clone).ran_on == HOSTED
    # the copy's weights changed: the original's outputs are not
    with torch.no_grad():
        _mlp(clone).down_proj.weight.mul_(3)
        _mlp(reference).down_proj.weight.mul_(3)
    _same(clone, reference, _ids(seed=2))
    with torch.no_grad():
        _mlp(reference).down_proj.weight.div_(3)
    _same(compiled, reference, _ids(seed=3))


@pytest.mark.parametrize("how,calls", [("pickle", 1), ("torch.save", 2)])
def test_a_pickled_model_loads_as_a_correct_hosted_model(how, calls):
    model, compiled, reference = _offloaded(calls=calls)
    loaded = saved_and_loaded(model, how)
    _state_dict_equal(loaded, reference)
    _same(_compile(loaded), reference, _ids(seed=1))
    assert fx_offload.report(loaded).ran_on == HOSTED
    _same(compiled, reference, _ids(seed=2))


def test_state_dict_of_the_model_and_of_a_hosted_mlp_is_the_truth():
    model, compiled, reference = _offloaded(calls=2)
    _state_dict_equal(model, reference)
    for layer in range(4):
        got, want = _mlp(model, layer).state_dict(), _mlp(reference, layer).state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), layer
    # named_weights too
    want = dict(reference.named_parameters())
    for name, value in fx_offload.named_weights(model):
        assert torch.equal(value, want[name]), name


def test_load_state_dict_with_new_values_then_call():
    model, compiled, reference = _offloaded()
    other = _model(seed=7)
    model.load_state_dict(other.state_dict())
    _same(compiled, other, _ids(seed=1))
    _state_dict_equal(model, other)
    # a submodule's load: one hosted MLP only
    third = _model(seed=9)
    _mlp(model, 3).load_state_dict(_mlp(third, 3).state_dict())
    _mlp(other, 3).load_state_dict(_mlp(third, 3).state_dict())
    _same(compiled, other, _ids(seed=2))
    assert fx_offload.report(model).ran_on == HOSTED


def test_load_state_dict_assign_then_call():
    """``assign=True`` gives the parameters new storage (on the CPU the new storage becomes
    the master)."""
    model, compiled, reference = _offloaded()
    other = _model(seed=7)
    model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    _same(compiled, other, _ids(seed=1))
    _state_dict_equal(model, other)


def test_in_place_edit_of_a_hosted_mlp_weight_is_taken_up():
    model, compiled, reference = _offloaded()
    for i, which in enumerate(["gate_proj", "up_proj", "down_proj"]):
        for m in (model, reference):
            with torch.no_grad():
                getattr(_mlp(m, 1 + 2 * (i % 2)), which).weight.mul_(2)
        _same(compiled, reference, _ids(seed=1 + i))


@pytest.mark.parametrize("how", ["data", "parameter", "non-contiguous data"])
def test_a_hosted_mlp_weight_given_new_storage_is_taken_up(how):
    """``w.data = new`` (an EMA swap), a new ``nn.Parameter``, or new storage laid out
    transposed: the next call uses the new values (or says clearly why it cannot)."""
    model, compiled, reference = _offloaded()
    for m in (model, reference):
        lin = _mlp(m).up_proj
        new = lin.weight.detach().clone() * 2
        if how == "data":
            lin.weight.data = new
        elif how == "parameter":
            lin.weight = torch.nn.Parameter(new, requires_grad=False)
        else:
            lin.weight.data = new.t().contiguous().t()
            assert not lin.weight.is_contiguous()
    _same(compiled, reference, _ids(seed=1))
    _state_dict_equal(model, reference)
    # and back (an EMA evaluation undone)
    for m in (model, reference):
        lin = _mlp(m).up_proj
        lin.weight.data = (lin.weight.detach() / 2).contiguous()
    _same(compiled, reference, _ids(seed=2))


def test_mlp_weights_swapped_between_hosted_layers_are_taken_up():
    model, compiled, reference = _offloaded()
    for m in (model, reference):
        a, b = _mlp(m, 1), _mlp(m, 3)
        a.gate_proj.weight, b.gate_proj.weight = b.gate_proj.weight, a.gate_proj.weight
    _same(compiled, reference, _ids(seed=1))
    _state_dict_equal(model, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_dtype_change_after_a_call_is_taken_up(dtype):
    """bf16/fp16: still hosted; float64 (no host dtype): the MLPs stream, exactly."""
    model, compiled, reference = _offloaded()
    model.to(dtype)
    reference.to(dtype)
    ids = _ids(seed=1)
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        want = reference(ids, use_cache=False).logits
    if dtype == torch.float64:
        assert torch.equal(got, want), (got - want).abs().max()
        assert "host" not in fx_offload.report(model).ran_on.values()
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
        assert fx_offload.report(model).ran_on == HOSTED
    _state_dict_equal(model, reference)


def test_restore_gives_the_plain_model_back():
    model, compiled, reference = _offloaded()
    fx_offload.restore(model)
    _same(model, reference, _ids(seed=1), exact=True)
    _state_dict_equal(model, reference)
    # "A compiled callable of it stays correct (its ops do nothing)" (restore's docstring)
    _same(compiled, reference, _ids(seed=2))
    # offloaded anew as the docs say (placed: compiling again reuses Dynamo's graph)
    fx_offload.place(model, "cpu", **ALWAYS)
    _same(compiled, reference, _ids(seed=3))
    assert fx_offload.report(model).layers == [1, 3]
    _state_dict_equal(model, reference)


@pytest.mark.parametrize("calls", [1, 2])
def test_a_second_instance_sharing_the_graph_is_refused_until_offloaded_too(calls):
    """Dynamo shares one graph among instances of a class, so the backend never sees the
    second one; the graph's host ops compute from the first instance's host blocks. Called
    once (its hooks never ran: the case that computed silently with the first instance's
    MLPs) or twice, the first instance's graph refuses the second one with an error saying
    what to do; done, both are right."""
    model, compiled, reference = _offloaded(calls=calls)
    other = _model(seed=5)
    other_reference = copy.deepcopy(other)
    other_compiled = _compile(other)
    with pytest.raises(fx_offload.OffloadError, match="Offload this instance too"):
        _same(other_compiled, other_reference, _ids(seed=1))
    _same(compiled, reference, _ids(seed=2))
    fx_offload.place(other, "cpu", **ALWAYS)
    _same(other_compiled, other_reference, _ids(seed=1))
    assert fx_offload.report(other).layers == [1, 3]
    _same(compiled, reference, _ids(seed=3))
    _state_dict_equal(model, reference)


def test_update_weights_on_hosted_mlp_weights():
    model, compiled, reference = _offloaded()
    new = {f"model.layers.{i}.mlp.{n}.weight":
           torch.randn_like(getattr(_mlp(reference, i), n).weight) for i in (1, 3)
           for n in ("gate_proj", "down_proj")}
    fx_offload.update_weights(model, new)
    reference.load_state_dict(new, strict=False)
    _same(compiled, reference, _ids(seed=1))
    _state_dict_equal(model, reference)


def test_update_weights_from_a_forward_hook_inside_a_call(monkeypatch):
    """A write from inside a call (a hook on layer 0, before the hosted layers run) is used
    by that call's later layers.  (Dynamo ignores hooks added after compiling unless told to
    guard on them; the hook runs eagerly, a graph break.)"""
    monkeypatch.setattr(torch._dynamo.config, "skip_nnmodule_hook_guards", False)
    model, compiled, reference = _offloaded()
    new = torch.randn_like(_mlp(reference, 3).up_proj.weight)
    fired = []

    @torch._dynamo.disable
    def hook(module, args, output):
        if not fired:
            fired.append(True)
            fx_offload.update_weights(model, {"model.layers.3.mlp.up_proj.weight": new})
    handle = model.model.layers[0].register_forward_hook(hook)
    with torch.no_grad():
        _mlp(reference, 3).up_proj.weight.copy_(new)
    try:
        _same(compiled, reference, _ids(seed=1))
    finally:
        handle.remove()
    assert fired
    _same(compiled, reference, _ids(seed=2))


# ----------------------------------------------------- MLPs that must stream, exact and explained

def _streams(model, why=None):
    """Exact outputs (checked first), then a 'streamed: <why>' for layers 1 and 3."""
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    _same(compiled, reference, _ids((2, 6), 0), exact=True)
    ran = fx_offload.report(model).ran_on
    for layer in (1, 3):
        assert ran.get(layer, "").startswith("streamed: "), \
            f"outputs exact, but no reason given: ran_on={ran}"
        if why:
            assert why in ran[layer], ran
    return ran


def test_mlp_bias_streams():
    _streams(_model(mlp_bias=True))


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu"])
def test_another_activation_streams(act):
    _streams(_model(hidden_act=act), "does not compute down(silu(gate(x)) * up(x))")


def test_gemma_gelu_tanh_streams():
    _streams(_model("gemma"), "does not compute")


def test_phi3_fused_gate_up_streams_and_says_so():
    _streams(_model("phi3"))


@pytest.mark.parametrize("tie", ["linear 3=1", "mlp 3=1", "linear 1=0 (resident)"])
def test_tied_mlp_weights_give_exact_outputs(tie):
    model = _model()
    layers = model.model.layers
    if tie == "linear 3=1":
        layers[3].mlp.gate_proj = layers[1].mlp.gate_proj
    elif tie == "mlp 3=1":
        layers[3].mlp = layers[1].mlp
    else:
        layers[1].mlp.gate_proj = layers[0].mlp.gate_proj
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    for seed in range(2):
        _same(compiled, reference, _ids(seed=seed))
    _state_dict_equal(model, reference)
    # a write through the tie reaches both users
    for m in (model, reference):
        with torch.no_grad():
            m.model.layers[1].mlp.gate_proj.weight.mul_(-1)
    _same(compiled, reference, _ids(seed=3))
    ran = fx_offload.report(model).ran_on
    # each offloaded layer's MLP either ran on the host or says why it streamed
    assert all(ran.get(layer, "") == "host" or ran.get(layer, "").startswith(
        ("streamed: ", "resident: ")) for layer in (1, 3)), \
        f"outputs exact, but no reason given: ran_on={ran}"


VARIANTS = {
    "up read twice": lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x) * 0.5
                                              + m.up_proj(x) * 0.5 * m.act_fn(m.gate_proj(x))),
    "silu on up": lambda m, x: m.down_proj(m.gate_proj(x) * m.act_fn(m.up_proj(x))),
    "scaled output": lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x)) * 0.5,
    "residual inside": lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x)) + x,
    "up of another input": lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) *
                                                    m.up_proj(x * 2)),
    "sigmoid gate": lambda m, x: m.down_proj(torch.sigmoid(m.gate_proj(x)) * m.up_proj(x)),
    "sum not product": lambda m, x: m.down_proj(m.act_fn(m.gate_proj(x)) + m.up_proj(x)),
    "gate weight read directly": lambda m, x: m.down_proj(
        m.act_fn(x @ m.gate_proj.weight.t()) * m.up_proj(x)),
}


@pytest.mark.parametrize("first,second", [("up read twice", "silu on up"),
                                          ("scaled output", "residual inside"),
                                          ("up of another input", "sigmoid gate"),
                                          ("sum not product", "gate weight read directly")])
def test_an_mlp_forward_the_kernel_does_not_compute_streams(first, second):
    """Layer 1's MLP runs one forward, layer 3's another; neither is down(silu(gate(x)) *
    up(x)) alone."""
    model = _model()
    for layer, name in ((1, first), (3, second)):
        mlp = model.model.layers[layer].mlp
        mlp.forward = (lambda m, f: lambda x: f(m, x))(mlp, VARIANTS[name])
    _streams(model)


def test_hooks_changing_an_mlps_input_and_output_are_kept():
    """A pre-hook scaling layer 1's MLP input, a forward hook scaling layer 3's MLP
    output: their graphs' MLP regions hold more than the five nodes."""
    model = _model()
    model.model.layers[1].mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    model.model.layers[3].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    _same(compiled, reference, _ids(seed=1))
    _same(compiled, reference, _ids((2, 1), seed=2))


def test_a_forward_hook_capturing_gate_activations_sees_them():
    """Interpretability: a hook stores gate_proj's output; the stored values are the
    reference's, whether the MLP is then hosted or streamed."""
    model = _model()
    reference = copy.deepcopy(model)
    seen = {id(model): [], id(reference): []}
    for m in (model, reference):
        store = seen[id(m)]
        for layer in m.model.layers:
            layer.mlp.gate_proj.register_forward_hook(
                lambda mod, args, out, store=store: store.append(out.detach().clone()))
    compiled = _compile(model)
    _same(compiled, reference, _ids(seed=1))
    got, want = seen[id(model)], seen[id(reference)]
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


# --------------------------------------------------------------------------- modes of calling

def test_inference_mode_first_then_no_grad():
    """The first hosted call under torch.inference_mode() (its staging buffers made there),
    later calls under no_grad (generate's) still work."""
    model = _model()
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    ids = _ids(seed=1)
    with torch.inference_mode():
        got = compiled(ids, use_cache=False).logits
        want = reference(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **FP32)
    _same(compiled, reference, _ids(seed=2))


def test_grad_enabled_call_is_a_clear_error_or_right():
    """A frozen model called with grad enabled (prompt tuning: inputs_embeds require grad):
    either a clear OffloadError that says no_grad, or the right output and input gradient."""
    model = _model().requires_grad_(False)
    reference = copy.deepcopy(model)
    compiled = _compile(model)
    ids = _ids(seed=1)
    emb = reference.model.embed_tokens(ids).detach()
    a, b = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    try:
        got = compiled(inputs_embeds=a, use_cache=False).logits
    except Exception as error:      # noqa: BLE001  (Dynamo wraps the backend's error)
        assert "no_grad" in str(error), error
        return
    want = reference(inputs_embeds=b, use_cache=False).logits
    torch.testing.assert_close(got, want, **FP32)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_threads_calling_at_once_get_their_own_right_outputs():
    model, compiled, reference = _offloaded()
    inputs = [_ids(seed=10 + i) for i in range(4)]
    with torch.no_grad():
        wants = [reference(x, use_cache=False).logits for x in inputs]
    results, errors = {}, []
    barrier = threading.Barrier(4)

    def worker(i):
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(3):
                    results.setdefault(i, []).append(compiled(inputs[i], use_cache=False).logits)
        except BaseException as error:      # noqa: BLE001
            errors.append((i, error))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:      # refused: it must say so clearly
        assert all(isinstance(e, fx_offload.OffloadError) and "thread" in str(e)
                   for _, e in errors), errors
    for i, outs in results.items():
        for out in outs:
            torch.testing.assert_close(out, wants[i], **FP32)
    _same(compiled, reference, _ids(seed=5))


def test_generate_batch_two_with_left_padding():
    model = _model()
    model.generation_config.eos_token_id = None
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager", **ALWAYS)
    ids = _ids((2, 8), seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want), (got, want)
    assert fx_offload.report(model).ran_on == HOSTED


def test_prompt_then_decode_with_the_dynamic_cache():
    model, compiled, reference = _offloaded()
    ids = _ids((2, 6), seed=4)
    with torch.no_grad():
        a = compiled(ids, use_cache=True)
        b = reference(ids, use_cache=True)
        torch.testing.assert_close(a.logits, b.logits, **FP32)
        pa, pb = a.past_key_values, b.past_key_values
        for step in range(4):
            nxt = b.logits[:, -1:].argmax(-1)
            a = compiled(nxt, past_key_values=pa, use_cache=True)
            b = reference(nxt, past_key_values=pb, use_cache=True)
            torch.testing.assert_close(a.logits, b.logits, **FP32)
            pa, pb = a.past_key_values, b.past_key_values
    assert fx_offload.report(model).ran_on == HOSTED


def test_dynamic_true_compile_over_many_lengths():
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", dynamic=True,
                             options={"inner_backend": "aot_eager", **ALWAYS})
    for i, shape in enumerate([(2, 5), (3, 11)]):
        _same(compiled, reference, _ids(shape, seed=i))
        assert fx_offload.report(model).ran_on == HOSTED, shape


# ------------------------------------------------------------------- faults inside the host path

@pytest.mark.parametrize("when", [1, 3])
def test_an_exception_in_the_host_kernel_leaves_the_next_calls_right(monkeypatch, when):
    """``kernels.linear`` raises once: at layer 1's gate (1) or its down (3) -- after the
    refills over its chunks began.  The call raises that error; the next calls are right,
    the MLPs still hosted; state_dict and a restore give the reference's weights."""
    model, compiled, reference = _offloaded()
    real = kernels.linear
    count = []

    def nth(*args, **kwargs):
        count.append(1)
        if len(count) == when:
            raise RuntimeError("injected")
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, "linear", nth)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        compiled(_ids(seed=1), use_cache=False)
    monkeypatch.setattr(kernels, "linear", real)
    _state_dict_equal(model, reference)
    _same(compiled, reference, _ids(seed=2))
    _same(compiled, reference, _ids((2, 1), seed=3))
    assert fx_offload.report(model).ran_on == HOSTED
    _state_dict_equal(model, reference)
    # restore after the fault: the plain model is the reference's
    fx_offload.restore(model)
    _same(model, reference, _ids(seed=4), exact=True)


def test_keyboard_interrupt_from_a_forward_hook_then_a_normal_call(monkeypatch):
    """Ctrl-C's KeyboardInterrupt raised by a hook on layer 2 (after layer 1's MLP ran on
    the host, before layer 3's) of the compiled model; then normal calls."""
    monkeypatch.setattr(torch._dynamo.config, "skip_nnmodule_hook_guards", False)
    model, compiled, reference = _offloaded()
    raising = []

    @torch._dynamo.disable
    def interrupt(module, args, output):
        if raising:
            raise KeyboardInterrupt
    handle = model.model.layers[2].register_forward_hook(interrupt)
    raising.append(True)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        compiled(_ids(seed=1), use_cache=False)
    raising.clear()
    _same(compiled, reference, _ids(seed=2))
    _same(compiled, reference, _ids((2, 1), seed=3))
    _state_dict_equal(model, reference)
    handle.remove()
    _same(compiled, reference, _ids(seed=4))


def test_keyboard_interrupt_from_a_hook_in_an_eager_call_then_a_normal_call():
    """The same through the model itself (eager, its hooks fire): a pre-hook on the hosted
    MLP of layer 3."""
    model, compiled, reference = _offloaded(calls=2)
    raising = []

    def interrupt(module, args):
        if raising:
            raise KeyboardInterrupt
    handle = _mlp(model, 3).register_forward_pre_hook(interrupt)
    raising.append(True)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(_ids(seed=1), use_cache=False)
    raising.clear()
    handle.remove()
    _same(compiled, reference, _ids(seed=2))
    _same(model, reference, _ids(seed=3))
    _state_dict_equal(model, reference)


def test_keyboard_interrupt_inside_the_host_op_then_a_normal_call(monkeypatch):
    """KeyboardInterrupt raised inside the host_mlp op itself (its kernel), after the
    refills over its chunks began."""
    model, compiled, reference = _offloaded(calls=2)
    real = kernels.linear
    raised = []

    def once(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(kernels, "linear", once)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        compiled(_ids(seed=1), use_cache=False)
    _same(compiled, reference, _ids(seed=2))
    _same(compiled, reference, _ids((2, 1), seed=3))
    _state_dict_equal(model, reference)
