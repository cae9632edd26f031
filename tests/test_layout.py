"""The packed slot layout: parameters in first-read order, split into copy chunks that tile
each layer's block; a model placed before any graph gets small parameters first."""
import copy

import pytest
import torch

import fx_offload
from fx_offload import layout
from fx_offload.learned import Learned
from fx_offload.selection import choose
from fx_offload.options import parse_options
from fx_offload.tools import models


def _tiles(chunks, total):
    assert chunks[0].start == 0 and chunks[-1].end == total
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))


def test_chunks_follow_the_graph_and_tile_each_layer():
    model, inputs = models.build("decoder", num_layers=4)
    e = fx_offload.explain(model, *inputs, group_size=2)
    for layer in e.choice.layers:
        chunks = e.learned.layout[layer]
        names = [s for c in chunks for s in c.suffixes]
        # the norm before attention is read first, the down projection last
        assert names[0] == "input_layernorm.weight" and names[-1] == "mlp.down_proj.weight"
        _tiles(chunks, sum(c.end - c.start for c in chunks))
        assert 2 <= len(chunks) <= 8
    one = fx_offload.explain(model, *inputs, group_size=2, copy_chunks=1).learned.layout
    assert all(len(chunks) == 1 for chunks in one.values())


def test_without_a_graph_small_parameters_go_first():
    model, inputs = models.build("decoder", num_layers=4)
    choice = choose(model, parse_options({"group_size": 2, "copy_chunks": 4}))
    declared = {layer: [p.suffix for p in ps] for layer, ps in choice.params.items()}
    chunks = layout.arrange(choice, Learned())[1]
    first = chunks[0].suffixes
    assert first[:2] == ("input_layernorm.weight", "post_attention_layernorm.weight")
    assert len(chunks) <= 4
    # the host block's order is the chunks'; the frozen choice keeps selection's order
    assert [p.suffix for p in layout.in_layout_order(choice.params[1], chunks)] == \
        [s for c in chunks for s in c.suffixes]
    assert {layer: [p.suffix for p in ps] for layer, ps in choice.params.items()} == declared
    assert declared[1][1] == "self_attn.q_proj.weight"


def test_host_blocks_and_slots_are_laid_out_in_the_chunks_order():
    model, inputs = models.build("decoder", num_layers=4)
    fx_offload.place(model, "cpu", group_size=2, num_in_group=1, copy_chunks=4)
    state = fx_offload.registry.state_for_model(model)
    for layer, chunks in state.learned.layout.items():
        names = [s for c in chunks for s in c.suffixes]
        assert [p.suffix for p in state.buffers.params[layer]] == names
        views = state.buffers.views[layer]
        base = state.buffers.flat[state.schedule.slot_of[layer]].data_ptr()
        for c in chunks:        # each chunk's bytes of the slot hold its parameters
            for s in c.suffixes:
                assert c.start <= views[s].data_ptr() - base < c.end


def test_a_placed_model_computes_exactly_with_chunks_from_no_graph():
    torch.manual_seed(0)
    model, inputs = models.build("decoder", num_layers=4)
    reference = models.build("decoder", num_layers=4)[0]
    reference.load_state_dict(model.state_dict())
    fx_offload.place(model, "cpu", group_size=2, num_in_group=1, copy_chunks=4)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        want = torch.compile(reference, backend="aot_eager")(*inputs)
        for _ in range(2):
            assert torch.equal(compiled(*inputs), want)
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["sync_loads"] == 0 and state.stats["prefetches"] > 0


class _GappedLayer(torch.nn.Module):
    """A weight whose strides leave gaps (``t[:, ::2]``: stride (128, 2)), declared after the
    weight read last, beside a transposed one (strides without gaps)."""

    def __init__(self):
        super().__init__()
        self.w2 = torch.nn.Parameter(torch.randn(64, 64).t() * 0.1)
        self.w1 = torch.nn.Parameter((torch.randn(64, 128) * 0.1)[:, ::2])
        self.b = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        return x + torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(x, self.w1, self.b)), self.w2)


@pytest.mark.parametrize("how", ["compile", "place"])
def test_weights_whose_strides_leave_gaps_keep_their_values(how, tmp_path, monkeypatch):
    """A host block gives each tensor the bytes its strides span, not its element count: a
    gapped weight laid out by its element count reached into the next tensor's bytes (wrong
    outputs from the second call on; a checkpoint's fill out of bounds)."""
    monkeypatch.setenv("FX_OFFLOAD_CHECK_SLOTS", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_GappedLayer() for _ in range(6)])
    reference = copy.deepcopy(model)
    options = dict(inner_backend="aot_eager", group_size=2, num_in_group=1, copy_chunks=4)
    assert model[1].w1.stride() == (128, 2)
    if how == "place":
        safetensors = pytest.importorskip("safetensors.torch")
        path = tmp_path / "weights.safetensors"
        safetensors.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                              str(path))
        fx_offload.place(model, "cpu", checkpoint=str(path), **options)
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    x = torch.randn(4, 64)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), reference(x))
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    fx_offload.restore(model)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
