"""Weights swapped for a while (``torch.func.functional_call``, an EMA evaluation, a
parametrization) and weights written from inside a call (a forward hook): outputs during
and after, ``state_dict`` after and ``restore`` after are those of the model without
offloading, and the true weights are never lost.

Each case runs on two kinds of host copies: the parameters' own storage (a CPU model's
masters) and a host block (``compress="lossless"`` makes one on the CPU too, as on a GPU)."""
import copy

import pytest
import torch
from torch.func import functional_call

import fx_offload
from fx_offload import registry
from fx_offload.tools import models

OPTIONS = {"group_size": 2, "num_in_group": 1, "prefetch_step": 1, "inner_backend": "aot_eager"}
KINDS = {"own storage": {}, "host block": {"compress": "lossless"}}


def build(kind, seed=0):
    model, (x,) = models.build("mlp", num_layers=4, seed=seed)
    if kind == "host block":    # what compress="lossless" compresses: a block on the CPU
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    return model, x


def offloaded(kind, hook=None):
    """(model, its compiled callable, the model without offloading, other weights, x)."""
    model, x = build(kind)
    reference, other = copy.deepcopy(model), build(kind, seed=3)[0]
    if hook is not None:        # before the first compile: Dynamo does not see later hooks
        for m in (model, reference):
            m.layers[2].register_forward_hook(hook(m))
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, **KINDS[kind]})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
    return model, compiled, reference, other, x


def assert_is(model, compiled, reference, x):
    """``model`` computes, holds and restores ``reference``'s weights."""
    want = reference.state_dict()
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
        assert torch.equal(model(x), reference(x))
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    fx_offload.restore(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call,through", [("torch.func", "compiled"), ("stateless", "model"),
                                          ("state dict", "compiled")])
def test_functional_call_leaves_the_true_weights(kind, call, through):
    model, compiled, reference, other, x = offloaded(kind)
    before = copy.deepcopy(other)
    swapped = dict(other.named_parameters()) if call != "state dict" else other.state_dict()
    run = functional_call if call != "stateless" else torch.nn.utils.stateless.functional_call
    with torch.no_grad():
        for _ in range(2):
            got = run(compiled if through == "compiled" else model, swapped, (x,))
            assert torch.equal(got, other(x))
        assert torch.equal(other(x), before(x))     # the other weights stay as they were
    assert_is(model, compiled, reference, x)
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before.parameters()))


def test_functional_call_of_some_weights_of_a_layer():
    model, compiled, reference, other, x = offloaded("host block")
    swapped = {"layers.3.fc1.weight": other.layers[3].fc1.weight}
    with torch.no_grad():
        assert torch.equal(functional_call(compiled, swapped, (x,)),
                           functional_call(reference, swapped, (x,)))
    assert_is(model, compiled, reference, x)


def test_new_weights_go_into_the_host_block_unless_a_kept_tensor_views_it():
    """``load_state_dict(assign=True)`` lets the old parameter objects go: their host block
    takes the new values in place (host memory holds the weights once), but for a layer
    whose ``state_dict()`` value is kept, which keeps its values, as on a plain model."""
    model, compiled, reference, other, x = offloaded("host block")
    buffers = registry.state_for_model(model).buffers
    blocks = {layer: buffers.block_of(layer).data_ptr() for layer in (1, 3)}
    kept = model.state_dict()["layers.3.fc1.weight"]
    was = kept.clone()
    model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    reference.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(compiled(x), other(x))
    assert torch.equal(kept, was)
    assert buffers.block_of(1).data_ptr() == blocks[1]
    assert buffers.block_of(3).data_ptr() != blocks[3]
    assert_is(model, compiled, reference, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", [".data", "new parameters"])
def test_an_ema_evaluation_gives_the_training_weights_back(kind, how):
    """Keep the weights, set the EMA's, evaluate, put the kept ones back."""
    model, compiled, reference, other, x = offloaded(kind)
    ema = {n: p.detach().clone() for n, p in other.named_parameters()}
    owners = {n: model.get_submodule(n.rpartition(".")[0]) for n in ema}
    if how == ".data":
        backup = {n: p.data for n, p in model.named_parameters()}
        kept = {n: b.clone() for n, b in backup.items()}
        for n, p in model.named_parameters():
            p.data = ema[n].clone()
    else:
        backup = dict(model.named_parameters())
        for n, owner in owners.items():
            setattr(owner, n.rpartition(".")[2], torch.nn.Parameter(ema[n].clone()))
    with torch.no_grad():
        assert torch.equal(compiled(x), other(x))
        assert torch.equal(model(x), other(x))
    assert all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())
    for n, b in backup.items():
        if how == ".data":
            model.get_parameter(n).data = b
        else:
            setattr(owners[n], n.rpartition(".")[2], b)
    if how == ".data":      # what the user kept was never written
        assert all(torch.equal(backup[n], kept[n]) for n in kept)
    assert_is(model, compiled, reference, x)


def test_a_parametrization_of_an_offloaded_weight_computes_and_goes():
    parametrize = torch.nn.utils.parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return w * 2

    model, compiled, reference, other, x = offloaded("own storage")
    for m in (model, reference):
        parametrize.register_parametrization(m.layers[1].fc1, "weight", Doubled())
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
        assert torch.equal(model(x), reference(x))
    for m in (model, reference):
        parametrize.remove_parametrizations(m.layers[1].fc1, "weight",
                                            leave_parametrized=False)
    assert_is(model, compiled, reference, x)


def test_vmap_over_stacked_weights_is_refused_and_loses_nothing():
    model, compiled, reference, other, x = offloaded("own storage")
    params, buffers = torch.func.stack_module_state([model, other])

    def one(p, b, x):
        return functional_call(model, (p, b), (x,))

    with torch.no_grad(), pytest.raises(fx_offload.OffloadError, match="torch.func transform"):
        torch.func.vmap(one, in_dims=(0, 0, None))(params, buffers, x)
    assert_is(model, compiled, reference, x)


NEW_LAYERS = ("layers.1.", "layers.3.")     # one run before the hook, one after


@pytest.mark.parametrize("how,through,kind", [
    ("update_weights", "compiled", "own storage"), ("load_state_dict", "compiled", "host block"),
    ("update_weights", "model", "host block"), ("load_state_dict", "model", "own storage")])
def test_weights_written_from_a_forward_hook_land(how, through, kind):
    """A hook on layer 2 writes layers 1 and 3: this call computes layer 3 with the new
    weights (as a plain model does), the next ones both."""
    armed, new = [], {}

    def hook(m):
        @torch.compiler.disable     # one graph break, rather than Dynamo tracing a load
        def write(module, args, output):
            if not armed:
                return
            if how == "update_weights" and m is model:
                fx_offload.update_weights(m, new)
            else:
                m.load_state_dict(new, strict=False)
        return write

    model, compiled, reference, other, x = offloaded(kind, hook)
    new.update({k: v for k, v in other.state_dict().items() if k.startswith(NEW_LAYERS)})
    with torch.no_grad():
        armed.append(True)
        got = (compiled if through == "compiled" else model)(x)
        assert torch.equal(got, reference(x))
        armed.clear()
    assert_is(model, compiled, reference, x)


@pytest.mark.parametrize("options", [
    pytest.param({"host_compute": "never", "experts": "routed"}, id="routed"),
    pytest.param({"host_compute": "never", "experts": "whole"}, id="whole"),
    pytest.param({"host_compute": "always"}, id="host"),
])
def test_functional_call_of_one_layers_experts_as_plain_tensors(options):
    """``functional_call`` with a state dict's (plain) tensors for one offloaded layer's
    experts, the model's other weights kept: the call computes with them.  (A graph read
    them as inputs of no layer, without waits, where the call pointed them at a slot that
    the next layer's refill overwrote; or the host computed the kept weights.)"""
    from helpers import small_moe
    model, other = small_moe("qwen3_moe").eval(), small_moe("qwen3_moe").eval()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **options})
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    swapped = {name: value for name, value in other.state_dict().items()
               if name.startswith("model.layers.1.mlp.experts.")}
    with torch.no_grad():
        compiled(ids)
        got = functional_call(compiled, swapped, (ids,)).logits
        want = functional_call(reference, swapped, (ids,)).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
