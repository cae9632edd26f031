"""MoE layers stream only the experts their tokens are routed to (``experts="routed"``, the
default): Hugging Face MoE models built from small configs give the logits and tokens of the
model without offloading, a call of few tokens moves fewer bytes than the whole layer, and a
graph that reads every expert falls back to whole-layer copies."""
import copy
import math


import pytest
import torch

import fx_offload
from fx_offload import registry
from fx_offload.errors import OffloadError
from fx_offload.passes import plan as plan_module, routing
from fx_offload.runtime.experts import gather
from fx_offload.tools import models
from helpers import PLANNER_RATES, SMALL_HF as SMALL, experts_alone_budget, small_moe as build

transformers = pytest.importorskip("transformers", reason="install the test extra")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# a model on the second GPU while the current device is the first: kernels of ours launch on
# the current device unless told
SECOND_GPU = pytest.param("cuda:1", marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs")])


def _expert_bytes(model, layer):
    return sum(p.numel() * p.element_size()
               for p in model.model.layers[layer].mlp.experts.parameters())


def _run_calls(model, compiled, ref_fn, device, shapes):
    """Each call's logits equal the reference's; the bytes each call copied."""
    moved = []
    with torch.no_grad():
        for i, shape in enumerate(shapes):
            ids = torch.randint(0, 256, shape, device=device,
                                generator=torch.Generator(device).manual_seed(i))
            got = compiled(ids, use_cache=False).logits
            want = ref_fn(ids, use_cache=False).logits
            assert torch.equal(got, want), (shape, i)
            moved.append(fx_offload.report(model).copied_bytes_last_call)
    return moved


@pytest.mark.parametrize("device", DEVICES + [SECOND_GPU])
@pytest.mark.parametrize("name,impl", [("qwen3_moe", "grouped_mm"), ("qwen3_moe", "batched_mm"),
                                       ("mixtral", "grouped_mm"), ("qwen2_moe", "grouped_mm"),
                                       ("deepseek_v3", "batched_mm")])
def test_routed_experts_give_the_same_logits_and_move_fewer_bytes(name, impl, device):
    model = build(name, impl).eval().to(device)
    ref_fn = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    # a prefill-sized call, then decode-sized ones (two sequences of one token)
    moved = _run_calls(model, compiled, ref_fn, device, [(2, 12), (2, 1), (2, 1), (2, 1)])
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3]
    assert all(rep.experts[layer].startswith("routed") for layer in rep.layers), rep.experts
    layer_bytes = sum(rep.layer_bytes.values())
    experts = sum(_expert_bytes(model, layer) for layer in rep.layers)
    # two tokens pick at most 4 experts of each offloaded layer (of 8 or 16): the rest of
    # the layer moves whole (in this call, or at the end of the one before: the circular
    # prefetch's place)
    assert 0 < moved[2] < layer_bytes - experts / 2, (moved, layer_bytes, experts)
    gathered = registry.state_for_model(model).routed.gathered.item()
    per_expert = experts / 2 / model.model.layers[1].mlp.experts.num_experts
    # the last call: two tokens, top-2, two layers
    assert 0 < gathered <= 2 * 4 * per_expert, (gathered, per_expert)
    assert "experts" in str(rep)


@pytest.mark.parametrize("device", DEVICES)
def test_generate_gives_the_same_tokens_with_routed_experts(device):
    model = build("qwen3_moe").eval().to(device)
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager")
    reference.forward = torch.compile(reference.forward, backend="aot_eager")
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for call in range(2):       # twice: the second begins from what the first left
            ids = torch.randint(0, 256, (2, 7), device=device,
                                generator=torch.Generator(device).manual_seed(call))
            got = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            assert torch.equal(got, want), call
    state = registry.state_for_model(model)
    assert state.routed.share is not None and state.routed.share < 0.5   # decode was routed


def test_experts_whole_moves_every_expert_every_call():
    model = build("qwen3_moe").eval()
    ref_fn = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", "experts": "whole"})
    moved = _run_calls(model, compiled, ref_fn, "cpu", [(2, 12), (1, 1), (1, 1)])
    rep = fx_offload.report(model)
    assert rep.experts == {}
    assert moved[2] == sum(rep.layer_bytes.values())    # one slot: both layers, whole


def test_a_bad_experts_value_is_refused():
    model, (x,) = models.build("mlp")
    with pytest.raises(OffloadError, match="option 'experts' must be one of"):
        fx_offload.place(model, "cpu", experts="some")


def _builtin_calls(model, shape, calls=3, before=None):
    """Compile the built-in MoE ``model``; whether each of ``calls`` calls equalled the model
    without offloading (``before()`` runs first, after the compile is set up)."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    if before is not None:
        before()
    with torch.no_grad():
        return [torch.equal(compiled(x), reference(x))
                for x in (torch.randn(shape, generator=torch.Generator().manual_seed(seed))
                          for seed in range(calls))]


def test_a_graph_that_reads_every_expert_moves_them_whole():
    """The built-in MoE computes every expert (gates zero for the others): the experts' rows
    it reads but no router picked must be there, so they move whole, and report says why."""
    model, (x,) = models.build("moe", num_layers=4)
    for layer in model.layers:
        layer.mlp.experts.num_experts = layer.mlp.experts.w13_weight.shape[0]
    assert all(_builtin_calls(model, x.shape))
    rep = fx_offload.report(model)
    assert rep.experts[1].startswith("whole: ") and "reads rows of mlp.experts.w13_weight_scale other than its router's picks" in rep.experts[1]
    assert registry.state_for_model(model).routed.gathered.item() == 0


def test_routed_builtin_moe_matches_and_gathers():
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    assert all(_builtin_calls(model, x.shape))
    # one token, top-2: each offloaded layer gathered its two picked experts
    want = "routed (8 experts; 2 gathered in the last call)"
    assert fx_offload.report(model).experts == {1: want, 3: want}
    assert registry.state_for_model(model).routed.gathered.item() > 0


def test_a_missing_expert_copy_changes_the_output(monkeypatch):
    """The equality checks above can fail: with the gather dropped, the slot holds another
    layer's experts where the picked rows should be."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    drop = lambda: monkeypatch.setattr(gather, "gather_rows", lambda host, slot, mask, *cache: None)
    assert not all(_builtin_calls(model, x.shape, before=drop))


def _route_everything(layer, weights, names, members, choice, learned):
    """A planted planner bug: every chunk of expert tensors routed, whatever reads them."""
    ids, _ = routing._router_ids(members, 8)
    chunks = {c.index for c in learned.layout[layer]
              if all(s in choice.experts[layer] for s in c.suffixes)}
    return {c: ids for c in chunks}


def test_the_verifier_refuses_a_routed_wait_before_a_read_of_every_expert(monkeypatch):
    """A planted planner bug: every chunk of expert tensors routed, though the graph reads
    every expert (the built-in dense MoE).  The verifier names the read."""
    monkeypatch.setattr(plan_module, "route", _route_everything)
    model, (x,) = models.build("moe", num_layers=4)
    for layer in model.layers:
        layer.mlp.experts.num_experts = 8
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with pytest.raises(Exception, match="reads rows of .* other than its router's picks, "
                                        "but .*fills only the experts its router picked"), \
            torch.no_grad():
        compiled(x)


def test_weights_changed_between_calls_are_what_the_next_call_gathers():
    """load_state_dict on an offloaded MoE layer's experts (the truth on the host): the next
    decode-sized call reads the new rows; state_dict and restore see the true weights."""
    model = build("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    ref_fn = torch.compile(reference, backend="aot_eager")
    _run_calls(model, compiled, ref_fn, "cpu", [(1, 1), (1, 1)])
    new = {k: v + 0.01 for k, v in reference.model.layers[3].mlp.experts.state_dict().items()}
    reference.model.layers[3].mlp.experts.load_state_dict(new)
    model.model.layers[3].mlp.experts.load_state_dict(new)
    _run_calls(model, compiled, ref_fn, "cpu", [(1, 1), (2, 12), (1, 1)])
    got = model.model.layers[3].mlp.experts.state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)
    fx_offload.restore(model)
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("case", ["routed_then_whole", "sizes_sharing_a_slot"])
def test_an_update_reaches_every_chunk_a_slot_kept_from_earlier_calls(case):
    """A slot may hold chunks of its first layer copied at different times: a refill skips
    the chunks the slot holds.  After update_weights, each such chunk copied before the
    update is reloaded, not only the layer's newest copy checked: chunks of attention kept
    since a decode call (its experts gathered, not held) when the next call prefetches the
    experts whole; the tail of an MoE layer that the smaller dense layer sharing its slot
    never overwrites."""
    if case == "routed_then_whole":
        model, options, names = build("qwen3_moe").eval(), {}, "model.layers.1.self_attn."
    else:
        torch.manual_seed(0)
        config = transformers.Qwen2MoeConfig(
            **SMALL, experts_implementation="grouped_mm", moe_intermediate_size=32,
            num_experts=16, num_experts_per_tok=2, shared_expert_intermediate_size=64,
            mlp_only_layers=[3])
        model = transformers.Qwen2MoeForCausalLM(config).eval()
        options, names = {"experts": "whole", "circular_prefetch": "entry"}, "model.layers.1."
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "group_size": 2, "num_in_group": 1, **options})
    ref_fn = torch.compile(reference, backend="aot_eager")
    _run_calls(model, compiled, ref_fn, "cpu", [(1, 8), (1, 1)])
    assert fx_offload.report(model).num_slots == 1
    with torch.no_grad():
        new = {n: p * 2 for n, p in reference.named_parameters() if n.startswith(names)}
    fx_offload.update_weights(model, new)
    reference.load_state_dict(new, strict=False)
    _run_calls(model, compiled, ref_fn, "cpu", [(1, 8), (1, 8), (1, 1)])


def _calls_equal(compiled, ref_fn):
    """Decode-sized calls of new ids each, a prompt-sized one among them: yields (index,
    shape) of each once its logits are checked equal to the reference's."""
    for i, shape in enumerate([(1, 1)] * 5 + [(2, 12)] + [(1, 1)] * 4):
        ids = torch.randint(0, 256, shape, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(i))
        got = compiled(ids, use_cache=False).logits.clone()
        want = ref_fn(ids, use_cache=False).logits.clone()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        yield i, shape


@pytest.mark.cuda
def test_routed_experts_inside_cuda_graphs():
    """reduce-overhead: the decode graph is captured with the gather in it; each replay
    copies the experts its own ids pick (new ids every call), between prefill-sized calls."""
    # batched_mm: transformers' grouped_mm falls back to a loop that copies to the host (not
    # capturable) for float32 weights
    model = build("qwen3_moe", "batched_mm").eval().cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"mode": "reduce-overhead", "host_compute": "never"})
    ref_fn = torch.compile(reference, mode="reduce-overhead")
    state = None
    with torch.no_grad():
        for i, shape in _calls_equal(compiled, ref_fn):
            state = state or registry.state_for_model(model)
            if shape == (1, 1) and i > 2:
                assert state.routed.gathered.item() > 0, i     # this replay gathered
                # the call hook copied each entry refill's other chunks once (the routed
                # ones are the replay's to gather), not again after its look at the weights
                hooked = sum(c.end - c.start for _, refill in state.hook_copies.refills
                             for c in state.contents.chunks(refill)
                             if not state.routed.gathers(refill, c))
                assert 0 < state.buffers.copied <= hooked, (i, state.buffers.copied, hooked)
                # what crossed in the replayed call: every offloaded layer's other chunks
                # once (the hook's and the graph's own copies) and the rows it gathered
                others = sum(c.end - c.start for layer in state.layers
                             for c in state.contents.chunks(layer)
                             if not state.routed.gathers(layer, c))
                moved = fx_offload.report(model).copied_bytes_last_call
                assert moved == others + state.routed.gathered.item(), (i, moved, others)


@pytest.mark.cuda
@pytest.mark.parametrize("plan", ["host", "split"])
def test_routed_experts_recorded_as_host_jobs_inside_cuda_graphs(plan, monkeypatch):
    """reduce-overhead with host_compute="auto": the decode graph records each layer's
    experts as a host job (a host node of the graph), and every replay computes on the host
    the picks its own ids make.  "host": the rule's split is only a little faster than the
    host alone (not recorded), which beats streaming: the host computes every pick.
    "split": the split is clearly faster, in calls of two tokens (one-token calls never
    split): the device gathers and computes each token's first pick beside the job
    (recorded too), the host the second.  Logits as the model's (the
    host sums in fp32, in another order: 1e-4), the replays' host reads counted from their
    jobs' records, the gathered rows by the device's counters, and the report says where
    each layer ran."""
    from fx_offload.host_compute import split
    monkeypatch.setattr(split, "device_picks", lambda *args: 1)
    faster = 0.45 if plan == "host" else 0.3        # the split's seconds; the host's 0.5
    monkeypatch.setattr(split, "layer_seconds",
                        lambda m, tokens, k, *rest: {0: 0.5, k: 1.0}.get(m, faster))
    model = build("qwen3_moe", "batched_mm").eval().cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "mode": "reduce-overhead", "group_size": 1, "num_in_group": 1})
    ref_fn = torch.compile(reference, mode="reduce-overhead")
    tokens = 1 if plan == "host" else 2
    with torch.no_grad():
        for i in range(7):
            ids = torch.randint(0, 256, (tokens, 1), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(i))
            got = compiled(ids, use_cache=False).logits.clone()
            want = ref_fn(ids, use_cache=False).logits.clone()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            if i < 3:       # compiled, warmed up, recorded: from the fourth call, replays
                continue
            state = registry.state_for_model(model)
            rep = fx_offload.report(model)
            ran = "host (CUDA graph)" if plan == "host" else "split 1 (CUDA graph)"
            assert rep.ran_on == {layer: ran for layer in range(4)}, i
            # what the replays run: one recorded job a layer, at this size
            assert set(state.host_experts._jobs.fixed) == {
                (layer, tokens, 2) for layer in range(4)}
            one = _expert_bytes(model, 0) // 16     # an expert (the same in every layer)
            assert all(_expert_bytes(model, layer) == 16 * one for layer in range(4))
            read, gathered = rep.host_read_bytes_last_call, state.routed.gathered.item()
            if plan == "host":      # top-2 of 16, one token: two experts a layer
                assert (read, gathered) == (8 * one, 0), i
            else:   # each token's second pick on the host, its first on the device: the
                # distinct experts of each, one or two a layer
                assert read % one == 0 and 4 <= read // one <= 8, (i, read)
                assert gathered % one == 0 and 4 <= gathered // one <= 8, (i, gathered)
            if plan == "host":
                # what crossed: some of the layers' other chunks (the ring that fetches them
                # ahead keeps some across calls), never an expert chunk (whole, they are
                # more bytes than the other chunks of all four layers)
                others = sum(c.end - c.start for layer in state.layers
                             for c in state.contents.chunks(layer)
                             if not state.routed.gathers(layer, c))
                assert 0 < rep.copied_bytes_last_call <= others, (i, rep.copied_bytes_last_call)
            else:
                assert "split with the device" in str(rep) and "layer 3 1" in str(rep)
            # the replay's jobs timed from their records, launched by no Python
            count, nbytes, ran, span, queueing, ahead = rep.host_jobs_last_call
            assert (count, nbytes, queueing, ahead) == (4, read, None, None), i
            assert 0 < ran <= span and "a CUDA graph's replay launched them" in str(rep)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_other_chunks_fetched_ahead_give_the_same_outputs_and_bytes(mode, monkeypatch):
    """Every layer offloaded over one slot: the routed layers' other chunks run ahead
    through the ring (runtime.experts.ahead), and every call's logits equal the model's, while a
    call moves exactly the bytes it moves without the ring (each layer's other chunks once,
    plus the rows it gathered), in replayed CUDA graphs too, decode and prompt calls
    interleaved; and weights changed between calls reach the next call."""
    from fx_offload.runtime.experts import ahead as ahead_module
    model = build("qwen3_moe", "batched_mm").eval().cuda()
    reference = copy.deepcopy(model)
    options = {"group_size": 1, "num_in_group": 1, "mode": mode, "host_compute": "never"}
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    ref_fn = torch.compile(reference, mode=mode)
    hits = []
    real = ahead_module.AheadCopies.copy_into_slot

    def counted(self, *args):
        hit = real(self, *args)
        hits.append(hit)
        return hit
    monkeypatch.setattr(ahead_module.AheadCopies, "copy_into_slot", counted)
    with torch.no_grad():
        for i, shape in _calls_equal(compiled, ref_fn):
            state = registry.state_for_model(model)
            assert state.ahead is not None and state.ahead.depth == 2
            assert len(state.ahead.sequence) == 3      # layers 1..3's other chunks
            if shape == (1, 1) and i > 2:
                others = sum(c.end - c.start for layer in state.layers
                             for c in state.contents.chunks(layer)
                             if not state.routed.gathers(layer, c))
                moved = fx_offload.report(model).copied_bytes_last_call
                assert moved == others + state.routed.gathered.item(), (i, moved, others)
        # the first layers' other chunks were fetched as the last call ended: a weight
        # changed since reaches the next call, through the parameter or update_weights
        one = torch.ones(1, 1, dtype=torch.long, device="cuda")
        for change in ("copy_", "update_weights"):
            compiled(one, use_cache=False)      # its end fetches the first ones ahead
            new = torch.randn_like(reference.model.layers[1].self_attn.o_proj.weight)
            reference.model.layers[1].self_attn.o_proj.weight.copy_(new)
            if change == "copy_":
                model.model.layers[1].self_attn.o_proj.weight.copy_(new)
            else:
                fx_offload.update_weights(model, {"model.layers.1.self_attn.o_proj.weight": new})
            for _ in range(2):
                got = compiled(one, use_cache=False).logits.clone()
                want = ref_fn(one, use_cache=False).logits.clone()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # served from the ring: in every call outside replays, and in the capture
    assert sum(hits) >= len(state.ahead.sequence), hits
    rep = fx_offload.report(model)
    assert rep.ahead == (3, state.ahead.nbytes) and state.ahead.nbytes > 0     # depth + 1
    assert rep.buffer_bytes == sum(f.numel() for f in state.buffers.flat) + state.ahead.nbytes
    assert "and 3 that fetch routed layers' other weights ahead" in str(rep)


@pytest.mark.parametrize("value, depth", [("two", None), ("-1", None), ("0", 0), (" 3 ", 3)])
def test_a_bad_ahead_count_warns_and_keeps_the_default(value, depth, monkeypatch, caplog):
    """docs/errors.md row 74: FX_OFFLOAD_AHEAD takes a count (0: off); anything else gets a
    warning naming it, and the default depth."""
    import logging
    from fx_offload.runtime.experts import ahead
    monkeypatch.setenv("FX_OFFLOAD_AHEAD", value)
    with caplog.at_level(logging.WARNING, "fx_offload"):
        got = ahead.depth_wanted(47)
    assert got == (8 if depth is None else depth)
    assert ("FX_OFFLOAD_AHEAD=" in caplog.text) == (depth is None), caplog.text
    if depth is None:
        assert "the default, 8, used" in caplog.text


@pytest.mark.parametrize("layers, depth", [(3, 4), (7, 4), (23, 4), (31, 6), (47, 8), (93, 8)])
def test_the_ring_grows_with_the_routed_layers_it_fetches(layers, depth, monkeypatch):
    """Unset, the ring's depth is a fifth of the routed layers it fetches ahead, between
    four (measured best at 8 layers) and eight (at 48)."""
    from fx_offload.runtime.experts import ahead
    monkeypatch.delenv("FX_OFFLOAD_AHEAD", raising=False)
    assert ahead.depth_wanted(layers) == depth


def test_host_memory_the_device_cannot_read_moves_experts_whole(caplog):
    """Where page-locking failed (pageable host memory), a kernel cannot read expert rows
    from the host: routed chunks are prefetched whole, with one warning."""
    import logging
    import types
    from fx_offload.runtime.experts.routed import RoutedExperts
    choice = types.SimpleNamespace(experts={1: {"w": 8}}, device=torch.device("meta"),
                                   model_name="M")
    with caplog.at_level(logging.WARNING, "fx_offload"):
        routed = RoutedExperts(choice, {1: {1: "routed"}}, types.SimpleNamespace(pinned=False))
    assert "not page-locked" in caplog.text
    chunk = types.SimpleNamespace(index=1, suffixes=("w",))
    routed.share = 0.1
    assert not routed.routes(1, chunk) and not routed.skips(1, chunk, None)
    assert not routed.observe(1, chunk, torch.zeros(1, 2, dtype=torch.long))


def test_the_eager_experts_loop_offloads_with_a_warning_naming_the_implementations_that_compile(
        caplog):
    """transformers' 'eager' experts loop breaks the graph inside each MoE layer (its loop
    runs over the experts a batch hit), so Dynamo compiles each decoder layer on its own frame
    (wrapped by transformers for gradient checkpointing) and the final norm on its own: the
    model is still offloaded (its layers loaded synchronously, whole), outputs equal the
    model without offloading, and the warning names the implementations that compile."""
    import logging
    # (2 layers of 4 experts: the loop's graph breaks compile a frame per expert hit)
    model = build("qwen3_moe", "eager", num_hidden_layers=2, num_experts=4).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        for seq in (4, 7):     # (a decode step's one token: the generate below)
            x = torch.randint(0, 256, (2, seq))
            assert torch.equal(compiled(x, use_cache=False).logits,
                               reference(x, use_cache=False).logits)
    warned = " ".join(r.getMessage() for r in caplog.records)
    # once, though Dynamo traces a layer's frame again (a dynamic shape's restart)
    assert warned.count("compiled Qwen3MoeDecoderLayer.forward on its own") == 1
    assert "'eager' loop" in warned and "'grouped_mm'" in warned and "'batched_mm'" in warned
    rep = fx_offload.report(model)
    assert rep.model == "Qwen3MoeForCausalLM" and rep.layers
    # generate through compile_forward(dynamic=True): Dynamo traces a layer's frame again
    # (a restart for its dynamic scalars), and the warning still comes once
    caplog.clear()
    model = build("qwen3_moe", "eager", num_hidden_layers=2, num_experts=4).eval()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, dynamic=True, inner_backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        x = torch.randint(0, 256, (1, 5))
        assert torch.equal(model.generate(x, max_new_tokens=4, do_sample=False),
                           reference.generate(x, max_new_tokens=4, do_sample=False))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert warned.count("on its own") == 1


class _OldExpert(torch.nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, inner, bias=False)
        self.w2 = torch.nn.Linear(inner, hidden, bias=False)
        self.w3 = torch.nn.Linear(hidden, inner, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _OldSparseMoe(torch.nn.Module):
    """The per-expert ``ModuleList`` form of older MoE code (Mixtral's before the fused
    experts): a loop over the experts the batch hit, each called as a module."""

    def __init__(self, hidden=32, inner=64, num_experts=8, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(_OldExpert(hidden, inner) for _ in range(num_experts))

    def forward(self, x):
        b, t, h = x.shape
        x = x.view(-1, h)
        weights = torch.softmax(self.gate(x), dim=1, dtype=torch.float)
        weights, picked = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(picked, self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.view(b, t, h)


def test_an_older_moe_of_expert_modules_in_a_list_stays_right():
    """The per-expert ``ModuleList`` form breaks the graph in its loop: Dynamo compiles each
    layer and each expert's forward on its own frame.  The layers are offloaded and loaded
    whole, synchronously; outputs equal the model's, call after call, and the weights stay
    the user's."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.attn = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)
            self.moe = _OldSparseMoe()

        def forward(self, x):
            x = x + self.attn(self.norm(x))
            return x + self.moe(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.layers = torch.nn.ModuleList(Block() for _ in range(4))
            self.head = torch.nn.Linear(32, 64)

        def forward(self, ids):
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model().eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"group_size": 1, "num_in_group": 1,
                                      "inner_backend": "aot_eager"})
    with torch.no_grad():
        for seq in (3, 1, 5, 1):
            ids = torch.randint(0, 64, (2, seq))
            assert torch.equal(compiled(ids), reference(ids)), seq
    rep = fx_offload.report(model)
    assert rep.layers == [0, 1, 2, 3] and rep.copied_bytes_last_call > 0
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_gather_that_fails_part_way_leaves_the_next_calls_right(monkeypatch):
    """A fault in the middle of a routed copy (some rows written, then an error): the error
    reaches the caller, and later calls read no bytes the broken copy left behind."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    real = gather.gather_rows
    calls = {"n": 0}

    def flaky(host, slot, mask, *cache):
        calls["n"] += 1
        if calls["n"] == 3:
            slot.view(-1)[: slot.numel() // 2].fill_(float("nan"))     # half written
            raise RuntimeError("injected fault")
        real(host, slot, mask, *cache)
    monkeypatch.setattr(gather, "gather_rows", flaky)
    with torch.no_grad():
        outcomes = []
        for seed in range(6):
            x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
            try:
                outcomes.append(torch.equal(compiled(x), reference(x)))
            except Exception as err:
                assert "injected fault" in str(err)
                outcomes.append("fault")
    assert outcomes.count("fault") == 1 and all(o is True for o in outcomes if o != "fault"), \
        outcomes
    assert calls["n"] > 3


# an op of the user's that raises their own error at run time when told, from inside a
# compiled graph (an opaque custom op: Dynamo keeps it in the graph, with no graph break)
_REFUSE = {"now": False}


@torch.library.custom_op("fx_offload_tests::refuse_when_told", mutates_args=())
def _refuse_when_told(x: torch.Tensor) -> torch.Tensor:
    if _REFUSE["now"]:
        raise ValueError("the user's own error")
    return x.clone()


@_refuse_when_told.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("plan", ["whole layers", "experts alone", "expert cache"])
def test_a_users_exception_after_a_gather_surfaces_and_the_model_keeps_working(plan):
    """The user's own error raised inside the compiled graph, in an offloaded MoE layer
    after that layer's experts (and the layers' before) were gathered: the call raises that
    error, the weights are intact, and the next calls give the model's outputs, under each
    kind of plan (every layer whole, the planner's experts-only plan, an expert cache)."""
    model = build("qwen3_moe").eval()
    truth = {k: v.clone() for k, v in model.state_dict().items()}
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    experts = model.model.layers[2].mlp.experts

    def computes_then_may_refuse(*args, **kwargs):
        return torch.ops.fx_offload_tests.refuse_when_told(
            type(experts).forward(experts, *args, **kwargs))
    experts.forward = computes_then_may_refuse
    options = {"inner_backend": "aot_eager", "group_size": 1, "num_in_group": 1}
    if plan == "experts alone":
        options = {"inner_backend": "aot_eager", "expert_cache": 0, **PLANNER_RATES,
                   "memory_budget": experts_alone_budget(model)[0]}
    elif plan == "expert cache":
        options["expert_cache"] = 4 * 1024
    compiled = torch.compile(model, backend="prefetch_offload", options=options)

    def decode(i):
        ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(i))
        return compiled(ids, use_cache=False).logits, reference(ids, use_cache=False).logits

    with torch.no_grad():
        for i in range(3):
            assert torch.equal(*decode(i)), i
        state = registry.state_for_model(model)
        try:
            _REFUSE["now"] = True
            for i in range(3, 5):
                with pytest.raises(ValueError) as raised:
                    decode(i)
                assert str(raised.value) == "the user's own error"
                # it struck mid-call: layers 0-2 gathered their picks, layer 3 never ran
                picked = {layer: n for layer, (n, _) in state.routed.gathered_last_call().items()}
                assert all(picked[layer] > 0 for layer in (0, 1, 2)) and picked[3] == 0, picked
        finally:
            _REFUSE["now"] = False
        for i in range(5, 9):
            assert torch.equal(*decode(i)), i
    assert fx_offload.report(model).layers == [0, 1, 2, 3]
    if plan == "experts alone":
        assert {p.suffix for ps in state.params.values() for p in ps} == {
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    got = model.state_dict()
    assert got.keys() == truth.keys() and all(torch.equal(got[k], v) for k, v in truth.items())


def test_a_restored_routed_model_runs_its_compiled_graph():
    """After restore the graph's routed waits reach the restored stand-in, which has
    nothing to do: the compiled model computes with the restored weights."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    assert all(_builtin_calls(model, x.shape, calls=1))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    fx_offload.restore(model)
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))


def test_the_link_profile_counts_the_gather_kernels_as_busy():
    """``moe --profile``'s summary: a gather kernel reads host memory, so the link is busy
    while it runs, beside the copy stream's copies; compute kernels leave it idle."""
    import types
    from fx_offload.benchmarks.profiling import link_gaps
    cuda = types.SimpleNamespace(name="CUDA")

    def event(name, start, end):
        return types.SimpleNamespace(name=name, device_type=cuda,
                                     time_range=types.SimpleNamespace(start=start, end=end))
    events = [event("Memcpy HtoD (Pinned -> Device)", 0, 1000),
              event("_gather_rows", 500, 3000),            # overlaps the copy
              event("triton_poi_fused_mm", 3000, 3400),    # compute: the link idles
              event("_gather_rows", 3400, 6000),
              event("Memcpy HtoD (Pinned -> Device)", 9000, 10000)]
    got = link_gaps(events, kernels=("_gather_rows",))
    assert got.startswith("link busy 6.60 of 10.00 ms (66.0%) (copies 2.00 ms, _gather_rows "
                          "5.10 ms)"), got
    assert "longest idle gaps: 3.00 ms at 6.0, 0.40 ms at 3.0" in got, got
    # without naming the kernel, only the copies count
    assert link_gaps(events).startswith("link busy 2.00 of 10.00 ms"), link_gaps(events)


def test_the_moe_benchmark_puts_the_gathered_rows_at_the_gather_kernels_rate(capsys):
    """``moe``'s table: ``x bound`` holds every byte of a step to the copy engine's rate,
    ``x gather`` only the bytes the gathers did not move (the gathered rows at the gather
    kernel's own rate); a row that moved its experts whole gathered nothing, so the two
    agree; a row whose experts ran on the host is held to the larger of its copies over the
    link and its host reads over the fastest the host was seen reading.  Without a GPU the
    gather's rate is not measured."""
    from fx_offload.benchmarks import bench, moe_bench
    routed, whole = "fx_offload, experts='routed'", "fx_offload, experts='whole'"
    hosted = "fx_offload, experts='routed', host_compute='always'"
    rows = {(routed, 1): (100.0, 35.0), (whole, 1): (200.0, 140.0), (hosted, 1): (90.0, 30.0)}
    moved = {(routed, 1): (3 * 10**9, 0, 2 * 10**9, 0), (whole, 1): (7 * 10**9, 0, 0, 0),
             (hosted, 1): (10**9, 0, 0, 4 * 10**9)}
    tokens = {key: torch.zeros(1) for key in rows}
    from fx_offload.host_compute.rates import HostRates
    rates = HostRates(read_rate=90e9, flop_rate=1e12, latency=0.0, link_rate=55e9,
                      shared_read_rate=80e9, shared_link_rate=50e9)
    from fx_offload.benchmarks.common import fastest_host_read
    moe_bench._print_table(rows, tokens, moved, bandwidth=50e9, gathering=40e9, rates=rates,
                           host_read=fastest_host_read(rates, 100e9))   # a plain sum's 100
    lines = capsys.readouterr().out.splitlines()
    assert "host GiB x bound x gather" in " ".join(lines[1].split())
    # after the name: batch, prefill, decode, GiB/step, host GiB, x bound, x gather, cached,
    # x routed, x whole, same tokens
    got = {line[:88].strip(): line[88:].split() for line in lines[2:]}
    # 3 GB at 50 GB/s: 60 ms; 1 GB at 50 and 2 GB at 40: 20 + 50 ms
    assert float(got[routed][5]) == pytest.approx(35 / 60, abs=1e-3)
    assert float(got[routed][6]) == pytest.approx(35 / 70, abs=1e-3)
    assert float(got[routed][9]) == pytest.approx(35 / 140, abs=1e-3)
    assert got[whole][5] == got[whole][6] == "1.000"
    # 1 GB over the link (20 ms) and 4 GB read on the host at the fastest rate it was seen
    # reading, the plain sum's 100 GB/s (the probe's 90 alone, 80 beside the link): 40 ms
    assert float(got[hosted][5]) == pytest.approx(30 / 40, abs=1e-3)
    assert math.isnan(bench.gather_bandwidth(torch.device("cpu")))


def test_the_step_clock_leaves_out_the_gap_that_waits_for_the_prompt():
    """``generate``'s step clock ticks as each token's step is queued: the gap after the
    first tick waits for the prompt's forward, not for a decode step.  With 3 new tokens and
    that gap counted, half the gaps were not steps and the median came out at about half a
    step; left out, every gap is one."""
    from fx_offload.benchmarks.generate_bench import step_gaps
    # the prompt's forward nearly done when its tick comes: a short first gap, then 40 ms steps
    ticks = [1.000, 1.002, 1.042, 1.082]
    assert step_gaps(ticks) == pytest.approx([40.0, 40.0])
    assert step_gaps(ticks[:2]) == []           # two new tokens: no step to time
    # so the benchmarks that time decode by the clock alone refuse fewer than three
    import argparse
    from fx_offload.benchmarks import kv_bench, moe_bench
    for tool in (moe_bench, kv_bench):
        parser = argparse.ArgumentParser()
        tool.add_arguments(parser)
        assert parser.parse_args(["--new-tokens", "3"]).new_tokens == 3
        with pytest.raises(SystemExit):
            parser.parse_args(["--new-tokens", "2"])


def _reading_through(transform, **kw):
    """The built-in routed MoE (``kw`` for its builder), each layer reading its experts'
    rows by ``transform(ids)`` instead of the router's ids themselves."""
    model, (x,) = models.build("moe", **{"num_layers": 4, "routed": True, "seq": 1,
                                         "batch": 1, **kw})

    def forward(self, x, idx, weights):
        return models.RoutedExperts.forward(self, x, transform(self, idx), weights)
    for layer in model.layers:
        experts = layer.mlp.experts
        if isinstance(experts, models.RoutedExperts):
            experts.register_buffer("expert_map", torch.tensor([3, 7, 0, 5, 1, 6, 2, 4]))
            experts.forward = forward.__get__(experts)
    return model, x


def test_the_verifier_refuses_a_routed_wait_whose_ids_the_layer_writes(monkeypatch):
    """A planted planner bug routes a layer that reads its experts by a copy of the ids
    and then writes the ids: the gather would copy the rows the written ids name."""
    def transform(experts, idx):
        copy = idx.clone()
        idx.add_(1).remainder_(8)
        return copy
    monkeypatch.setattr(plan_module, "route", _route_everything)
    model, x = _reading_through(transform)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with pytest.raises(Exception, match="graph writes those ids in place"), torch.no_grad():
        compiled(x)


def _written_by(change, dtype=None):
    """A transform: a copy of the ids (as ``dtype``, read back as ids) after
    ``change(experts, copy, ids)`` wrote into it (or into a view of it)."""
    def transform(experts, idx):
        copy = idx.clone() if dtype is None else idx.to(dtype)
        change(experts, copy, idx)
        return copy.long()
    return transform


@pytest.mark.parametrize("transform,why", [
    (lambda experts, idx: experts.expert_map[idx], "getitem"),     # a logical -> physical map
    (lambda experts, idx: torch.where(idx > 5, 0, idx), "getitem"),     # dropped onto one
    (lambda experts, idx: (idx + 1) % 8, "getitem"),
    (lambda experts, idx: idx.reshape(-1).sort()[1].reshape(idx.shape), "getitem"),  # positions
    (lambda experts, idx: idx.clamp(0, 5), "getitem"),      # a clamp that changes picks
    (_written_by(lambda e, t, idx: t.__setitem__(t > 5, 0)), "getitem"),
    (_written_by(lambda e, t, idx: t.add_(1).remainder_(8)), "getitem"),
    (_written_by(lambda e, t, idx: t.reshape(-1).clamp_(max=5)), "getitem"),
], ids=["a table", "a drop", "arithmetic", "sort positions", "a narrowing clamp",
        "a drop in place", "arithmetic in place", "a narrowing clamp in place of a view"])
def test_rows_taken_by_other_values_than_the_picks_move_whole(transform, why):
    """Rows read by values computed from the router's ids but other than them (a remap, a
    drop, arithmetic, sort positions) are rows no gather fills: those chunks move whole,
    report says why, and every call equals the model without offloading."""
    model, x = _reading_through(transform)
    assert all(_builtin_calls(model, x.shape, calls=4))
    experts = fx_offload.report(model).experts
    assert set(experts) == {1, 3}, experts
    for text in experts.values():
        assert text.startswith("whole: ") and f"({why}) reads rows of mlp.experts.w13_weight" \
            in text and "other than its router's picks" in text, text


def test_ids_converted_to_a_dtype_that_cannot_hold_them_move_whole():
    """300 experts: ids as uint8 wrap above 255 onto experts nobody picked, so the layers
    move their experts whole; an int16 holds them all, so those stay routed."""
    def build(dtype):
        return _reading_through(lambda experts, idx: idx.to(dtype).long(), num_experts=300,
                                top_k=8, batch=4)
    model, x = build(torch.uint8)
    assert all(_builtin_calls(model, x.shape, calls=3))
    for text in fx_offload.report(model).experts.values():
        assert text.startswith("whole: ") and "other than its router's picks" in text, text
    model, x = build(torch.int16)
    assert all(_builtin_calls(model, x.shape, calls=3))
    assert all(t.startswith("routed") for t in fx_offload.report(model).experts.values())


@pytest.mark.parametrize("transform", [
    lambda experts, idx: idx.reshape(-1).sort()[0][idx.reshape(-1).argsort().argsort()]
    .reshape(idx.shape).long(),
    # transformers' batched_mm clamps expert-parallel sentinels: identity on a top-k over 8
    lambda experts, idx: idx.clamp(0, 7),
    _written_by(lambda e, t, idx: t.clamp_(max=7)),
], ids=["a reordering", "a clamp to the experts", "a clamp in place"])
def test_rows_taken_by_a_view_or_a_reordering_of_the_picks_stay_routed(transform):
    """A view, a sort's values, a selection of the ids, a clamp that keeps every expert's
    id hold only picked values: routed, and every call equals the model not offloaded."""
    model, x = _reading_through(transform)
    assert all(_builtin_calls(model, x.shape, calls=3))
    assert all(text.startswith("routed") for text in fx_offload.report(model).experts.values())


@torch.library.custom_op("fx_offload_tests::remap_into", mutates_args={"out"})
def _remap_into(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
    """A library kernel that writes ``table[ids]`` into its third argument."""
    out.copy_(table[ids])


@torch.library.custom_op("fx_offload_tests::take", mutates_args=())
def _library_take(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A library op named like torch's ``take`` that remaps the ids through a table."""
    return table[ids]


@_library_take.register_fake
def _(ids, table):
    return torch.empty_like(ids)


def test_ids_written_after_a_copy_was_taken_move_whole():
    """A copy of the ids holds the picks, but the wait gathers by the ids themselves,
    which the layer then changes: the experts move whole and report says why."""
    def transform(experts, idx):
        copy = idx.clone()
        idx.add_(1).remainder_(8)
        return copy
    model, x = _reading_through(transform)
    assert all(_builtin_calls(model, x.shape, calls=4))
    for text in fx_offload.report(model).experts.values():
        assert text.startswith("whole: the layer writes its router's ids"), text



@pytest.mark.parametrize("transform,kw", [
    (lambda e, idx: torch.max(idx, torch.full_like(idx, 7))[0][None], {}),   # elementwise
    (lambda e, idx: torch.zeros_like(idx).where(idx.to(torch.bool), idx),      # where method
     {"num_experts": 2, "top_k": 1}),
    (lambda e, idx: idx.to(torch.float8_e5m2).long(), {"num_experts": 10}),   # 9 -> 8
    (_written_by(lambda e, c, idx: torch._foreach_mul_([c], 0)), {}),
    (_written_by(lambda e, c, idx: c.__imul__(0)), {}),
    (_written_by(lambda e, c, idx: torch.ops.aten._index_put_impl_.default(
        c, [torch.tensor([0])], torch.tensor(0), False, False)), {}),
    (_written_by(lambda e, c, idx: torch.sort(torch.tensor([[5, 3]]), out=(
        torch.empty(1, 2, dtype=torch.long), c))), {}),
    (_written_by(lambda e, c, idx: torch.ops.aten.topk.values(
        torch.tensor([[5., 3.]]), 2, -1, True, True, values=torch.empty(1, 2), indices=c)), {}),
    (_written_by(lambda e, c, idx: torch.ops.fx_offload_tests.remap_into(idx, e.expert_map, c)),
     {}),
    (lambda e, idx: torch.ops.fx_offload_tests.take(idx, e.expert_map), {}),
    (_written_by(lambda e, f, idx: torch.nn.functional.hardtanh(f, 0., 1., inplace=True),
                 torch.float32), {}),
    (_written_by(lambda e, f, idx: torch.nn.functional.embedding(
        torch.tensor([0]), f.view(1, -1), max_norm=1.0), torch.float32), {}),
], ids=["elementwise max", "where method", "float8", "foreach in place", "dunder in place",
        "private aten in place", "out tuple", "aten values= indices=", "library op writes",
        "library op named take", "a function's inplace=True", "embedding's max_norm"])
def test_ids_changed_in_ways_the_rule_must_see_move_whole(transform, kw):
    """Each of these reads rows other than the picks (found by an adversarial run, each
    routed before and wrong from the second call): the experts move whole, every call
    equals the model not offloaded."""
    model, x = _reading_through(transform, **kw)
    if kw.get("num_experts", 8) != 8:
        for layer in model.layers:
            experts = layer.mlp.experts
            if isinstance(experts, models.RoutedExperts):
                experts.expert_map = torch.randperm(kw["num_experts"],
                                                    generator=torch.Generator().manual_seed(0))
    assert all(_builtin_calls(model, x.shape, calls=4))
    for text in fx_offload.report(model).experts.values():
        assert text.startswith("whole: ") and "other than its router's picks" in text, text


def _grouped_experts(offsets, extra=None):
    """An experts forward through grouped matmuls: ``offsets(counts)`` gives the group
    offsets from the per-expert counts of the picks; ``extra(w13, x, offs)``, if given, is
    one more grouped product whose sum is added."""
    def forward(self, x, idx, weights):
        tokens, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        sorted_ids, token = flat[order], order // k
        counts = torch.histc(sorted_ids.float(), bins=self.num_experts, min=0,
                             max=self.num_experts - 1)
        offs = offsets(counts)
        xs = torch.cat([x[token], x.new_zeros(64 - token.shape[0], x.shape[1])])
        h = torch._grouped_mm(xs, self.w13_weight.transpose(-2, -1), offs=offs)
        valid = (torch.arange(h.shape[0]) < offs[-1])[:, None]
        h = torch.where(valid, h, torch.zeros_like(h))[:token.shape[0]]
        h = h * self.w13_weight_scale[sorted_ids][..., 0]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up,
                              self.w2_weight.transpose(-2, -1), offs=offs.clone())
        y = y * self.w2_weight_scale[sorted_ids][..., 0] * weights.reshape(-1)[order][:, None]
        out = torch.zeros(tokens, x.shape[1], dtype=x.dtype).index_add_(0, token, y)
        if extra is not None:
            more = extra(self.w13_weight, xs[:, :self.num_experts].contiguous(), offs)
            out = out + torch.where(valid, more, torch.zeros_like(more)).sum() * 1e-2
        return out
    return forward


@torch.library.custom_op("fx_offload_tests::grouped_mm", mutates_args=())
def _library_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A library op named like torch's grouped matmul that reads every expert."""
    return x @ w.sum(0)


@_library_grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@pytest.mark.parametrize("offsets,extra,routed", [
    (lambda c: c.cumsum(0).to(torch.int32), None, True),
    (lambda c: c.cumsum(0).cumsum(0).to(torch.int32), None, False),
    # group g reads row g of every expert: [E, 2I, H] seen as [2I, E, H] (2I = E here)
    (lambda c: c.cumsum(0).to(torch.int32),
     lambda w, x, offs: torch._grouped_mm(x, w.transpose(0, 1), offs=offs), False),
    (lambda c: (c.add_(1), c.cumsum(0).to(torch.int32))[1], None, False),   # counts written
    # not one running sum: offsets that fall again, which _grouped_mm leaves undefined (its
    # rows uninitialized), so only the routing is compared, not the outputs
    (lambda c: c.view(8, 2).cumsum(0).view(-1).to(torch.int32), None, None),
    (lambda c: c.cumsum(0).to(torch.int32),
     lambda w, x, offs: torch.ops.fx_offload_tests.grouped_mm(x, w, offs), False),
], ids=["one running sum", "two running sums", "experts moved off the first dimension",
        "counts written in place", "a running sum of a reshaped count",
        "a library op named grouped_mm"])
def test_grouped_matmuls_route_only_groups_counted_from_the_picks(offsets, extra, routed):
    """A second running sum gives unpicked experts rows; a weight viewed with its experts
    off the first dimension is read across every expert: those move whole; the plain
    grouped form stays routed. Every call equals the model not offloaded."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1,
                               num_experts=16, inner=8)
    for layer in model.layers:
        if isinstance(layer.mlp.experts, models.RoutedExperts):
            layer.mlp.experts.forward = _grouped_experts(offsets, extra).__get__(
                layer.mlp.experts)
    model.to(torch.bfloat16)        # _grouped_mm takes bf16
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        for seed in range(6):
            x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
            got, want = compiled(x.bfloat16()), reference(x.bfloat16())
            assert routed is None or torch.equal(got, want), seed
    for text in fx_offload.report(model).experts.values():
        assert text.startswith("routed" if routed else "whole: "), text


def test_a_routed_moe_generates_on_one_static_cache_in_two_graphs():
    """``generate`` of a routed MoE compiled with static shapes, every call on a static cache
    of one length (the moe benchmark's ``--static-cache``, which a 48-layer row needs to
    compile in minutes): calls of different lengths reuse one graph for the prompt and one
    for the decode steps, and give the tokens of the model without offloading."""
    from fx_offload.benchmarks.moe_bench import _static_cache
    from torch._dynamo.utils import counters
    model = build("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    _static_cache(model, 6 + 9)
    _static_cache(reference, 6 + 9)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]        # (the process's count)
    fx_offload.compile_forward(model, dynamic=False, group_size=2, num_in_group=1,
                               experts="routed", inner_backend="aot_eager")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for new in (9, 1, 4):
            kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
            assert torch.equal(model.generate(ids, **kw), reference.generate(ids, **kw))
    assert counters["stats"]["unique_graphs"] - before == 2
    assert registry.state_for_model(model).stats["prefetches"] > 0


def test_a_copy_of_an_offloaded_routed_model_keeps_its_experts_routed():
    """``copy.deepcopy`` of an offloaded model, compiled in turn (a copy runs its own
    forward eagerly until then), offloads the copy again at its first call, running the
    graph Dynamo shares between them: the copy keeps what that graph's pass learned (its
    routed chunks), so its calls gather only the picked experts as the original's do,
    instead of moving them whole; outputs equal, weights its own."""
    model = build("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager", group_size=2, num_in_group=1)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids, use_cache=False).logits
        for _ in range(2):
            assert torch.equal(model(ids, use_cache=False).logits, want)
        routed_bytes = fx_offload.report(model).copied_bytes_last_call
        twin = copy.deepcopy(model)
        fx_offload.compile_forward(twin, inner_backend="aot_eager", group_size=2,
                                   num_in_group=1)
        for _ in range(2):
            assert torch.equal(twin(ids, use_cache=False).logits, want)
    original = fx_offload.registry.state_for_model(model)
    state = fx_offload.registry.state_for_model(twin)
    assert state is not original and state.learned.routing == original.learned.routing
    assert state.learned.routing and state.learned.routing is not original.learned.routing
    rep = fx_offload.report(twin)
    assert all(v.startswith("routed") for v in rep.experts.values()), rep.experts
    assert 0 < rep.copied_bytes_last_call == routed_bytes < sum(rep.layer_bytes.values())
    assert state.stats["prefetches"] > 0
