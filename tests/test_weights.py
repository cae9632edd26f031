"""The user's weights are never lost: state_dict, load_state_dict, update_weights, restore,
failed compiles."""
import copy
import io

import pytest
import torch

import fx_offload
import fx_offload.compiler as compiler
from fx_offload.tools import models
from fx_offload import named_weights, update_weights


def offloaded(name="mlp", **options):
    model, inputs = models.build(name, num_layers=6)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **options})
    with torch.no_grad():
        for _ in range(2):
            compiled(*inputs)
    return model, compiled, reference, inputs


def test_state_dict_and_checkpoint_give_the_true_weights():
    model, compiled, reference, inputs = offloaded(prefetch_step=2)
    sd = model.state_dict()
    want = reference.state_dict()
    assert sd.keys() == want.keys()
    for key in want:
        assert torch.equal(sd[key], want[key]), key
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    fresh = copy.deepcopy(reference)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        assert torch.equal(fresh(*inputs), reference(*inputs))
    # between calls the parameter objects themselves hold the true values (layers 1 and 5
    # share slot 0, which the parameters no longer show), as do the submodules' state_dicts
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name
    for key, value in model.layers[5].state_dict().items():
        assert torch.equal(value, want[f"layers.5.{key}"]), key
    for name, value in named_weights(model):
        assert torch.equal(value, want[name]), name


def test_load_state_dict_updates_take_effect_in_the_next_call():
    model, compiled, reference, inputs = offloaded()
    other, _ = models.build("mlp", num_layers=6, seed=7)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), other(*inputs))
        assert torch.equal(model(*inputs), other(*inputs))       # uncompiled too
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_update_weights_path_for_weight_sync():
    model, compiled, reference, inputs = offloaded(prefetch_step=3)
    other, _ = models.build("mlp", num_layers=6, seed=11)
    new = {n: p.detach() for n, p in other.named_parameters() if n.startswith("layers.3.") or
           n.startswith("layers.0.")}
    update_weights(model, new)
    for n, p in reference.named_parameters():
        if n in new:
            with torch.no_grad():
                p.copy_(new[n])
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    with pytest.raises(ValueError, match="has no parameter or buffer 'layers.9.fc1.weight'"):
        update_weights(model, {"layers.9.fc1.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"has shape \(64, 32\), got \(2,\)"):
        update_weights(model, {"layers.1.fc1.weight": torch.zeros(2)})


def test_failed_compile_leaves_the_weights_untouched(monkeypatch):
    model, inputs = models.build("decoder", num_layers=4)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}

    def broken(*args, **kwargs):
        raise RuntimeError("inner compiler exploded")

    monkeypatch.setattr(compiler, "compile_inner", broken)
    with torch.no_grad(), pytest.raises(Exception, match="inner compiler exploded"):
        torch.compile(model, backend="prefetch_offload")(*inputs)
    assert fx_offload.registry.state_for_model(model) is None
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    assert not model.layers[1]._forward_pre_hooks


def test_shared_parameters_stay_resident(caplog):
    import logging
    model, inputs = models.build("mlp", num_layers=6)
    model.layers[3].fc2 = model.layers[0].fc2          # one module reused in two layers
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="fx_offload"), torch.no_grad():
        compiled = torch.compile(model, backend="prefetch_offload",
                                 options={"inner_backend": "eager"})
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    assert "layers.3.fc2.weight" not in fx_offload.report(model).params[3]
    assert any("not offloading layers.3.fc2.weight: the parameter is shared" in r.getMessage()
               for r in caplog.records)
