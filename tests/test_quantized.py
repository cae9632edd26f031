"""Quantized models offloaded as they are: a torchao weight (a tensor subclass) moves its packed
inner tensors (int8 or float8 data, scales) between its host block and its slot, computes with
torchao's own code, and gives the outputs of the same quantized model not offloaded; what users
do to such a model keeps its weights."""
import copy
import io
import warnings

import pytest
import torch
from torch import nn

import fx_offload
from fx_offload import registry
from fx_offload.tools import models


def _torchao():
    return pytest.importorskip("torchao.quantization")   # installed by the test extra


OPTIONS = {"inner_backend": "aot_eager", "prefetch_step": 2}     # layers 1, 5 | 3
CONFIGS = {"int8": "Int8WeightOnlyConfig", "float8": "Float8WeightOnlyConfig"}


def quantized(kind: str, seed: int = 0, num_layers: int = 6):
    model, (x,) = models.build("mlp", num_layers=num_layers, hidden=64, inner=128, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao = _torchao()
        torchao.quantize_(model.eval(), getattr(torchao, CONFIGS[kind])())
    return model, x


def inner(t):
    """A weight's bytes: its inner tensors (a quantized weight), or itself."""
    if not fx_offload.subclass.is_subclass(t):
        return {"": t}
    return {n: getattr(t, n) for n in t.__tensor_flatten__()[0]}


def same_weights(got, want) -> bool:
    a, b = inner(got), inner(want)
    return type(got.data) is type(want.data) and a.keys() == b.keys() and \
        all(x.dtype == b[k].dtype and torch.equal(x, b[k]) for k, x in a.items())


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_a_quantized_model_offloads_its_packed_bytes(kind):
    model, x = quantized(kind)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(x.shape, generator=gen)
            assert torch.equal(compiled(x), reference(x))
    rep = fx_offload.report(model)
    state = registry.state_for_model(model)
    assert rep.layers == [1, 3, 5] and state.stats["sync_loads"] == 0
    # what moves is the packed data and the scales, not the weights' logical float size
    packed = sum(t.numel() * t.element_size() for p in model.layers[1].parameters()
                 for t in inner(p).values())
    logical = sum(p.numel() * p.element_size() for p in model.layers[1].parameters())
    assert rep.layer_bytes[1] == packed < logical / 3
    quantized_dtype = next(iter(inner(model.layers[1].fc1.weight).values())).dtype
    assert quantized_dtype in (torch.int8, torch.float8_e4m3fn)
    assert state.masters[1]["fc1.weight:qdata"].dtype == quantized_dtype
    # the weight object stays torchao's; its inner tensors are the host block's (between calls)
    w = model.layers[1].fc1.weight
    assert type(w.data) is type(reference.layers[1].fc1.weight.data)
    assert w.qdata.data_ptr() == state.masters[1]["fc1.weight:qdata"].data_ptr()


def test_a_quantized_hugging_face_llama_with_inductor():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=4, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    torchao = _torchao()
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    reference = torch.compile(copy.deepcopy(model), backend="inductor")
    compiled = torch.compile(model, backend="prefetch_offload")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for _ in range(2):
            # our ops are fusion boundaries: Inductor may round differently (fp32, 1e-5)
            torch.testing.assert_close(compiled(ids, use_cache=False).logits,
                                       reference(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
    assert fx_offload.report(model).layers == [1, 3]
    assert registry.state_for_model(model).stats["sync_loads"] == 0


def test_what_users_do_to_a_quantized_offloaded_model():
    model, x = quantized("int8")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        compiled(x)
    state_dict = model.state_dict()
    for key, value in reference.state_dict().items():
        assert same_weights(state_dict[key], value), key
    weights = dict(fx_offload.named_weights(model))
    assert same_weights(weights["layers.3.fc2.weight"], reference.layers[3].fc2.weight)

    other, _ = quantized("int8", seed=3)
    # written through torchao's own copy_ (it writes the inner tensors below autograd: the
    # weight's own version counter is what moves): the next call uses it
    with torch.no_grad():
        model.layers[3].fc2.weight.copy_(other.layers[3].fc2.weight)
        reference.layers[3].fc2.weight.copy_(other.layers[3].fc2.weight)
        assert torch.equal(compiled(x), reference(x))
    # update_weights: the same kind of tensor is copied as it is; any other refused, nothing
    # written
    fx_offload.update_weights(model, {"layers.1.fc1.weight": other.layers[1].fc1.weight})
    with torch.no_grad():
        reference.layers[1].fc1.weight.copy_(other.layers[1].fc1.weight)
        assert torch.equal(compiled(x), reference(x))
    with pytest.raises(fx_offload.OffloadError,
                       match=r"layers.5.fc1.weight is of kind Int8Tensor, got Tensor.*nothing"):
        fx_offload.update_weights(model, {"layers.1.fc2.weight": other.layers[1].fc2.weight,
                                          "layers.5.fc1.weight": torch.randn(128, 64)})
    assert same_weights(dict(fx_offload.named_weights(model))["layers.1.fc2.weight"],
                        reference.layers[1].fc2.weight)
    # load_state_dict of another quantized model, a deepcopy, torch.save of the state dict
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(compiled(x), other(x))
        assert torch.equal(copy.deepcopy(model)(x), other(x))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert all(same_weights(saved[k], v) for k, v in other.state_dict().items())
    # restore: the weights back as they were, still torchao's
    fx_offload.restore(model)
    for name, p in model.named_parameters():
        assert same_weights(p, dict(other.named_parameters())[name]), name
    with torch.no_grad():
        assert torch.equal(model(x), other(x))


@pytest.mark.parametrize("change", ["copy_", "load_state_dict", "assign", "inner tensor",
                                    "inner attribute"])
def test_unchanged_quantized_weights_skip_the_look_and_a_change_is_taken_up(change,
                                                                             monkeypatch):
    """The call hook's fingerprint covers quantized weights too (their inner tensors and
    their own version counter): a call after no change looks at no parameter; each way of
    writing one is still seen by the next call."""
    from fx_offload.selection.params import OffloadedParam
    model, x = quantized("int8")
    reference = copy.deepcopy(model)
    other, _ = quantized("int8", seed=3)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    looks = []
    real = OffloadedParam.current
    monkeypatch.setattr(OffloadedParam, "current", lambda p: looks.append(p) or real(p))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
        looks.clear()
        assert torch.equal(compiled(x), reference(x))
        assert looks == []
        for target in (model, reference):
            w, new = target.layers[3].fc2.weight, other.layers[3].fc2.weight
            if change == "copy_":
                w.copy_(new)
            elif change == "load_state_dict":
                target.layers[3].load_state_dict(other.layers[3].state_dict())
            elif change == "assign":
                target.layers[3].load_state_dict(copy.deepcopy(other.layers[3]).state_dict(),
                                                 assign=True)
            elif change == "inner tensor":
                w.qdata.copy_(new.qdata)
            else:                       # a new tensor object set as its data
                w.qdata = new.qdata.clone()
        assert torch.equal(compiled(x), reference(x))
        assert looks
        looks.clear()
        assert torch.equal(compiled(x), reference(x))
        assert looks == []
    for key, value in reference.state_dict().items():
        assert same_weights(model.state_dict()[key], value), key


def test_the_host_twin_path_run_on_the_cpu(monkeypatch):
    """What a GPU does with quantized weights (the module holds a host twin between calls),
    run on the CPU by taking the weights' device to be another than their host blocks':
    outputs, what users do between calls (torchao's copy_, assign=True, an inner tensor set
    anew on the twin, update_weights), skipped looks while nothing changed, and restore."""
    from fx_offload.selection.params import OffloadedParam
    monkeypatch.setattr(OffloadedParam, "_device", property(lambda p: torch.device("meta")))
    model, x = quantized("int8")
    reference = copy.deepcopy(model)
    other, _ = quantized("int8", seed=3)
    original = model.layers[3].fc2.weight
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    looks = []
    real = OffloadedParam.current
    monkeypatch.setattr(OffloadedParam, "current", lambda p: looks.append(p) or real(p))

    def changed_then_skipped():
        assert torch.equal(compiled(x), reference(x)) and looks
        looks.clear()
        assert torch.equal(compiled(x), reference(x)) and not looks

    with torch.no_grad():
        for _ in range(3):      # the first call's weights are taken up by the second's look
            assert torch.equal(compiled(x), reference(x))
        held = model.layers[3].fc2.weight
        assert held is not original and type(held) is type(original)
        assert registry.owner_of_param(held)[1] == 3
        looks.clear()
        assert torch.equal(compiled(x), reference(x)) and not looks
        for target in (model, reference):
            target.layers[3].fc2.weight.copy_(other.layers[3].fc2.weight)
        changed_then_skipped()
        for target in (model, reference):
            target.layers[1].load_state_dict(copy.deepcopy(other.layers[1]).state_dict(),
                                             assign=True)
        changed_then_skipped()
        assert model.layers[1].fc1.weight is registry.state_for_model(model).params[1][0].host
        for target in (model, reference):
            target.layers[5].fc1.weight.qdata = other.layers[5].fc1.weight.qdata.clone()
        changed_then_skipped()
    fx_offload.update_weights(model, {"layers.5.fc2.weight": other.layers[5].fc2.weight})
    with torch.no_grad():
        reference.layers[5].fc2.weight.copy_(other.layers[5].fc2.weight)
        changed_then_skipped()
        # nn.Module._apply swaps a tensor subclass's contents, which torch refuses for one
        # with a weakref: the registry keeps none (a quantized model's usual conversion)
        model.to(torch.float32)
        reference.to(torch.float32)
        changed_then_skipped()
        model.half()            # the biases change dtype: the model is offloaded anew
        reference.half()
        for _ in range(3):
            assert torch.equal(compiled(x.half()), reference(x.half()))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    for key, value in reference.state_dict().items():
        assert same_weights(saved[key], value), key
    fx_offload.restore(model)
    assert model.layers[3].fc2.weight is original
    with torch.no_grad():
        assert torch.equal(model(x.half()), reference(x.half()))


@pytest.mark.parametrize("then", ["compiled", "eager", "restore"])
def test_quantizing_an_offloaded_model_offloads_its_layers_anew(then):
    """torchao's quantize_ applied to a model after it was offloaded (each weight replaced
    by a new Parameter around a quantized tensor of the same shape and dtype): the next
    call offloads the layers anew as packed bytes and computes as the same quantized model
    not offloaded, and restore gives the quantized weights back.  Before, the quantized
    weight passed for a plain one of the same shape and dtype, and the call, an eager call
    and restore all failed reading its data pointer."""
    model, (x,) = models.build("mlp", num_layers=6, hidden=64, inner=128)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    torchao = _torchao()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for target in (model, reference):
            torchao.quantize_(target.eval(), torchao.Int8WeightOnlyConfig())
    with torch.no_grad():
        want = reference(x)
        if then != "restore":
            for _ in range(3):
                assert torch.equal((compiled if then == "compiled" else model)(x), want)
            state = registry.state_for_model(model)
            assert state.layers == [1, 3, 5]
            assert state.masters[1]["fc1.weight:qdata"].dtype == torch.int8
            if then == "compiled":
                assert state.stats["prefetches"] > 0 and state.stats["sync_loads"] == 0
        fx_offload.restore(model)
        assert registry.state_for_model(model) is None
        for name, p in model.named_parameters():
            assert same_weights(p, dict(reference.named_parameters())[name]), name
        assert torch.equal(model(x), want)


def test_a_tensor_subclass_with_inner_tensors_of_its_own_kind_is_refused():
    """A weight whose bytes are not plain inner tensors (a subclass nested in a subclass)
    cannot be laid out in a host block: refused by name, nothing offloaded."""
    from torch.testing._internal.two_tensor import TwoTensor
    model, (x,) = models.build("mlp", num_layers=4)
    w = model.layers[1].fc1.weight.detach()
    model.layers[1].fc1.weight = nn.Parameter(
        TwoTensor(TwoTensor(w, w.clone()), TwoTensor(w.clone(), w.clone())), requires_grad=False)
    with pytest.raises(fx_offload.OffloadError,
                       match=r"parameter layers.1.fc1.weight is a torch.testing._internal."
                             r"two_tensor.TwoTensor, a tensor subclass whose bytes are not "
                             r"plain inner tensors.*offload_params"):
        fx_offload.place(model, "cpu", group_size=2, num_in_group=1)
    assert registry.state_for_model(model) is None


def test_any_tensor_subclass_of_plain_inner_tensors_offloads_them():
    """The mechanism is torch's subclass protocol, not torchao's: torch's own ``TwoTensor``
    (two inner tensors) moves both, and computes as it does resident."""
    from torch.testing._internal.two_tensor import TwoTensor
    model, (x,) = models.build("mlp", num_layers=4)
    for layer in model.layers:
        w = layer.fc1.weight.detach()
        layer.fc1.weight = nn.Parameter(TwoTensor(w, 2 * w), requires_grad=False)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        for _ in range(3):
            got, want = compiled(x), reference(x)
            assert torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
    state = registry.state_for_model(model)
    assert set(state.masters[1]) == {"fc1.weight:a", "fc1.weight:b", "fc1.bias", "fc2.weight",
                                     "fc2.bias"}
    assert fx_offload.report(model).layer_bytes[1] == 4 * (2 * 64 * 32 + 64 + 32 * 64 + 32)
    assert state.stats["sync_loads"] == 0


def quantized_gpu(kind: str, seed: int = 0):
    """The MLP stack in bf16 on the GPU, quantized with torchao (int4: the tile-packed layout
    of torch's own int4 matmul)."""
    model, (x,) = models.build("mlp", num_layers=6, hidden=256, inner=512, seed=seed)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    torchao = _torchao()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "int4":
            from torchao.quantization.quantize_.workflows import Int4PackingFormat
            config = torchao.Int4WeightOnlyConfig(
                group_size=64, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
        else:
            config = getattr(torchao, CONFIGS[kind])()
        torchao.quantize_(model.eval(), config)
    return model, x.to(device="cuda", dtype=torch.bfloat16)


def on_host(t) -> bool:
    return t.device.type == "cpu" and all(x.device.type == "cpu" for x in inner(t).values())


def same_on_cpu(got, want) -> bool:
    return same_weights(got, want) if got.device == want.device else \
        all(torch.equal(x.cpu(), inner(want)[k].cpu()) for k, x in inner(got).items())


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["int8", "float8", "int4"])
def test_a_quantized_model_offloaded_on_the_gpu(kind):
    """On a GPU the packed bytes live in pinned host memory between calls: the model holds a
    host-side twin of each quantized weight there (its device fixed at ``cpu``, so ``detach``,
    ``state_dict`` and ``torch.save`` work), the weight the graph was compiled with during a
    call; what users do between calls reaches the next call."""
    model, x = quantized_gpu(kind)
    reference = copy.deepcopy(model)
    original = model.layers[1].fc1.weight
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(3):
            xi = torch.randn(x.shape, generator=gen).to(x)
            assert torch.equal(compiled(xi), reference(xi))
            if i == 0:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    state = registry.state_for_model(model)
    assert fx_offload.report(model).layers == [1, 3, 5] and state.stats["sync_loads"] == 0
    assert state.masters[1]["fc1.weight:qdata"].is_pinned()
    held = model.layers[1].fc1.weight
    assert held is not original and type(held) is type(original) and on_host(held)
    # a reference kept from before (its device stays cuda) reads the host block's bytes too
    assert all(t.device.type == "cpu" for t in inner(original).values())
    state_dict = model.state_dict()
    for key, value in reference.state_dict().items():
        assert same_on_cpu(state_dict[key], value), key
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert same_on_cpu(saved["layers.3.fc2.weight"], reference.layers[3].fc2.weight)
    assert same_on_cpu(copy.deepcopy(model.layers[3]).fc2.weight, reference.layers[3].fc2.weight)

    other, _ = quantized_gpu(kind, seed=3)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())                   # copy_ into the twins
        assert torch.equal(compiled(x), other(x))
        third, _ = quantized_gpu(kind, seed=4)
        model.load_state_dict(third.state_dict(), assign=True)      # new objects: copied in
        assert torch.equal(compiled(x), third(x))
        assert on_host(model.layers[5].fc1.weight)
    fx_offload.update_weights(model, {"layers.3.fc2.weight": other.layers[3].fc2.weight})
    assert same_on_cpu(dict(fx_offload.named_weights(model))["layers.3.fc2.weight"],
                       other.layers[3].fc2.weight)
    with torch.no_grad():
        third.layers[3].fc2.weight.copy_(other.layers[3].fc2.weight)
        assert torch.equal(compiled(x), third(x))
    # the weight the graph saw is back for each call: its guards held, nothing recompiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    fx_offload.restore(model)
    w = model.layers[1].fc1.weight
    assert w is original and w.device.type == "cuda" and \
        all(t.device.type == "cuda" for t in inner(w).values())
    assert registry.owner_of_param(w) is None
    with torch.no_grad():
        assert torch.equal(model(x), third(x))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float8", "int4"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_quantized_model_on_the_gpu_with_inductor(kind, mode):
    """With Inductor (and under CUDA graphs) the offloaded quantized model gives the outputs of
    the same model resident, compiled the same way, to bf16 rounding: the prefetch ops are
    fusion boundaries, so Inductor's kernels may differ (with aot_eager they are bitwise,
    above)."""
    model, x = quantized_gpu(kind)
    reference = torch.compile(copy.deepcopy(model), mode=mode)
    options = {"prefetch_step": 2} if mode is None else {"prefetch_step": 2, "mode": mode}
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for _ in range(4):
            xi = torch.randn(x.shape, generator=gen).to(x)
            got, want = compiled(xi).clone().float(), reference(xi).clone().float()
            # bf16 through six layers, each a few roundings apart (measured: 0.6% on average,
            # 2% at most); another layer's weights would be 100% off
            assert (got - want).abs().max() <= 0.05 * want.abs().max()
            assert (got - want).abs().mean() <= 0.02 * want.abs().mean()
    assert registry.state_for_model(model).stats["sync_loads"] == 0
    skipped = {k: v for k, v in torch._dynamo.utils.counters["inductor"].items()
               if "cudagraph_skips" in k}
    assert not skipped, skipped


def test_a_call_reads_each_layers_versions_once_however_many_chunks(monkeypatch):
    """Each start and load of a chunk records its layer's version counters; for a quantized
    layer reading them walks every inner tensor.  Inside a call they are read once per layer
    (nothing writes the weights while the graph runs), and a write between calls is still
    taken up: the memo begins afresh with each call."""
    from fx_offload.runtime.ownership.versions import ParamVersions
    model, x = quantized("int8")
    reference = copy.deepcopy(model)
    other, _ = quantized("int8", seed=3)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "copy_chunks": 3})
    reads = []
    real = ParamVersions.read
    monkeypatch.setattr(ParamVersions, "read",
                        lambda self, layer: reads.append(layer) or real(self, layer))
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
        for _ in range(3):
            reads.clear()
            assert torch.equal(compiled(x), reference(x))
            assert reads and len(reads) == len(set(reads)), reads
        for target in (model, reference):
            target.layers[3].fc2.weight.copy_(other.layers[3].fc2.weight)
        assert torch.equal(compiled(x), reference(x))
        assert torch.equal(compiled(x), reference(x))
