"""FX_OFFLOAD_CHECK_SLOTS=1: every wait compares the slot with the host copy of its weights
(fx_offload.runtime.memory.slot_check); a planted wrong copy is caught and named, and the model
keeps working once it is gone."""
import copy

import pytest
import torch

import fx_offload
from fx_offload import registry
from fx_offload.runtime.experts import gather
from fx_offload.runtime.memory import slot_check
from fx_offload.runtime.memory.slot_check import SlotCheckError
from fx_offload.runtime.memory.slots import SlotBuffers
from fx_offload.tools import models


@pytest.fixture
def compared(monkeypatch):
    """Turn the check on; count the tensors it compares."""
    monkeypatch.setenv(slot_check.ENV, "1")
    seen = []
    real = slot_check._differs

    def counted(slot, host, rows):
        seen.append(rows)
        return real(slot, host, rows)
    monkeypatch.setattr(slot_check, "_differs", counted)
    return seen


def _compiled(model, **options):
    return torch.compile(model, backend="prefetch_offload",
                         options={"inner_backend": "aot_eager", "prefetch_step": 2, **options})


def _calls(compiled, reference, shape, calls=3, dtype=torch.float32):
    with torch.no_grad():
        for seed in range(calls):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
            assert torch.equal(compiled(x), reference(x))


@pytest.mark.parametrize("options", [{}, {"compress": "lossless"}])
def test_every_wait_is_checked_and_a_right_model_passes(compared, options):
    model, (x,) = models.build("mlp", num_layers=6)
    dtype = torch.bfloat16 if options else torch.float32
    model = model.to(dtype)
    reference = copy.deepcopy(model)
    _calls(_compiled(model, **options), reference, x.shape, dtype=dtype)
    state = registry.state_for_model(model)
    per_call = sum(len(ps) for ps in state.params.values())
    assert len(compared) >= 3 * per_call            # each offloaded tensor, each call


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(slot_check.ENV, raising=False)
    called = []
    monkeypatch.setattr(slot_check, "after_wait", lambda *a, **k: called.append(a))
    model, (x,) = models.build("mlp", num_layers=4)
    _calls(_compiled(model), copy.deepcopy(model), x.shape, calls=1)
    assert not called


def test_a_wrong_copy_is_named_and_the_model_recovers(compared, monkeypatch):
    """A planted bug: every copy of layer 5 writes one byte wrong.  The check names the
    layer and its tensor; with the bug gone the next call is right (the chunk reloaded)."""
    model, (x,) = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    compiled = _compiled(model, group_size=2)
    _calls(compiled, reference, x.shape, calls=1)
    real = SlotBuffers.copy_in

    def corrupting(self, layer, chunk=None, non_blocking=False):
        real(self, layer, chunk, non_blocking)
        if layer == 5:
            first = next(iter(self.views[layer].values()))
            first.view(-1)[0] += 1
    monkeypatch.setattr(SlotBuffers, "copy_in", corrupting)
    with pytest.raises(SlotCheckError, match=r"the slot of layer 5 of .* held other bytes than "
                                             r"the host copy of layers\.5\.fc1\.weight"):
        with torch.no_grad():
            compiled(x)
    monkeypatch.setattr(SlotBuffers, "copy_in", real)
    _calls(compiled, reference, x.shape, calls=2)


def test_routed_experts_are_checked_on_the_rows_they_picked(compared):
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    _calls(_compiled(model, prefetch_step=1), copy.deepcopy(model), x.shape)
    assert registry.state_for_model(model).routed.gathered.item() > 0
    assert any(rows is not None and 0 < rows.numel() < 8 for rows in compared)


def test_a_wrong_expert_row_is_caught(compared, monkeypatch):
    """The gather dropped (the slot keeps another layer's experts where the picked rows
    should be): the check names the expert tensor."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    compiled = _compiled(model, prefetch_step=1)
    monkeypatch.setattr(gather, "gather_rows", lambda host, slot, mask, *cache: None)
    with pytest.raises(SlotCheckError, match="experts"):
        with torch.no_grad():
            compiled(x)


def test_ids_outside_the_experts_pick_no_row(compared):
    """Ids below 0 (an expert-parallel sentinel) or past the experts pick nothing: the
    check compares only the rows the gather copied, and raises nothing."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    compiled = _compiled(model, prefetch_step=1)
    with torch.no_grad():
        compiled(x)
    state = registry.state_for_model(model)
    layer = next(layer for layer, chunks in state.learned.routing.items() if chunks)
    chunk = next(i for i, how in state.learned.routing[layer].items() if how == "routed")
    other = next(o for o in state.layers
                 if o != layer and state.schedule.slot_of[o] == state.schedule.slot_of[layer])
    state.enter(root=False)
    try:
        state.wait(other)       # the slot holds another layer's experts
        ids = torch.tensor([[0, -1, 99]])
        state.wait_routed(layer, chunk, ids)
        slot_check.after_wait(state, layer, chunk, ids)     # raises nothing
        assert compared[-1].tolist() == [-1, 0, 99]         # compared by rows: row 0 alone
    finally:
        state.leave()


def test_a_restored_model_is_not_checked_and_still_runs(monkeypatch):
    """After restore the graph's ops reach a stand-in state: nothing to check."""
    model, (x,) = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    _calls(compiled, reference, x.shape, calls=2)
    fx_offload.restore(model)
    monkeypatch.setenv(slot_check.ENV, "1")
    _calls(compiled, reference, x.shape, calls=2)
