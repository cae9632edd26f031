"""The KV cache on the host (``kv_cache="host"``): a Hugging Face Llama built from a small
config, ``generate`` with a static cache through ``compile_forward``; tokens and the cache's
contents equal the same model with its cache on the device; bad options and caches get
clear errors; a copy that fails leaves the cache usable.  CPU here; the GPU cases carry the
``cuda`` marker."""
import copy
import gc
import weakref

import pytest
import torch

import fx_offload
from fx_offload.errors import OffloadError
from fx_offload.kv import reroute, runtime_of, verify_reroute

transformers = pytest.importorskip("transformers", reason="install the test extra")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
WEIGHTS = dict(group_size=4, num_in_group=1)      # one layer's weights offloaded too
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pair(device="cpu", inner="aot_eager", dynamic=False, **kv):
    """(reference with its cache on the device, the same model with kv_cache='host'),
    both compiled by ``compile_forward`` with the same inner backend."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    reference = reference.to(device)
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    fx_offload.compile_forward(reference, inner_backend=inner, dynamic=dynamic, **WEIGHTS)
    fx_offload.compile_forward(model, inner_backend=inner, dynamic=dynamic, kv_cache="host",
                               **{"kv_block_size": 16, **kv}, **WEIGHTS)
    return reference, model


def generate(model, ids, new=10, **kw):
    """Greedy; generate's own static cache unless the call passes one."""
    if "past_key_values" not in kw:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, **kw)


def static_cache(model, batch, length):
    """A static cache initialized before the first call, as kv_cache='host' initializes
    each cache it is given (transformers' masks differ, by rounding, between a cache
    initialized in the first call and one initialized before it)."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    weight = next(model.parameters())
    cache.early_initialization(batch, CONFIG["num_key_value_heads"], 16, weight.dtype,
                               weight.device)
    return cache


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_and_cache_equal_the_device_cache(device):
    """Batch 2, a prompt of 37 tokens (two full blocks of 16 and one ending mid-block), ten
    new tokens, two generates in a row: the tokens and every valid position of every
    layer's keys and values equal the device cache's, bitwise (aot_eager both); report gives
    the host bytes and what a step copies in and writes back."""
    reference, model = pair(device, dynamic=True)      # (the other tests: static shapes)
    ids = torch.randint(0, 128, (2, 37), device=device)
    for _ in range(2):
        cache_ref, cache = static_cache(reference, 2, 64), static_cache(model, 2, 64)
        expected = generate(reference, ids, past_key_values=cache_ref)
        got = generate(model, ids, past_key_values=cache)
        assert torch.equal(got, expected)
        valid = int(cache.layers[0].cumulative_length)
        assert valid == 37 + 10 - 1
        for mine, theirs in zip(cache.layers, cache_ref.layers):
            assert torch.equal(mine.keys[:, :, :valid].cpu(), theirs.keys[:, :, :valid].cpu())
            assert torch.equal(mine.values[:, :, :valid].cpu(),
                               theirs.values[:, :, :valid].cpu())
    runtime = runtime_of(model)
    assert runtime.layers == [0, 1, 2, 3]
    rep = fx_offload.report(model)
    per_token = 2 * 2 * 16 * next(model.parameters()).element_size()    # batch 2, 2 heads,
    assert rep.kv["host_bytes"] == 4 * 64 * per_token * 2      # 16 dims; keys and values
    assert rep.kv["valid_tokens"] == 46
    assert rep.kv["copied_per_step"] == 4 * 48 * per_token * 2     # 3 blocks of 16
    assert rep.kv["written_per_step"] == 4 * 1 * per_token * 2
    assert "KV cache" in str(rep)
    if device == "cuda":        # the truth is host memory, seen through its mapped address
        host = cache.layers[0].keys
        assert host.device.type == "cuda"
        assert torch.cuda.memory_allocated() < 4 * host.numel() * host.element_size() * 2 \
            + 64 * 2**20


def test_generate_own_cache_several_calls_and_a_longer_prompt():
    """generate() making its own static cache, called again with other prompt lengths (the
    cache reset between calls, a prompt filling several blocks): the reference's tokens,
    and the slots of the caches that are gone freed.  report keeps the last generate's
    figures after its cache is gone."""
    reference, model = pair()
    for length in (5, 40, 16, 3):
        ids = torch.randint(0, 128, (1, length))
        assert torch.equal(generate(model, ids, new=8), generate(reference, ids, new=8))
        # each generate made a cache of another length; the last one's slots alone remain
        assert len(runtime_of(model).slots._flats) == 1
    gc.collect()                # the last generate's cache is gone
    kv = fx_offload.report(model).kv
    per_token = 4 * 2 * 16 * 4 * 2      # 4 layers, batch 1, 2 heads, 16 dims, f32, K and V
    capacity = kv["host_bytes"] // per_token
    assert capacity >= 3 + 8 - 1
    assert kv["valid_tokens"] == 3 + 8 - 1
    assert kv["copied_per_step"] == min(16, capacity) * per_token     # one block of 16
    assert kv["written_per_step"] == per_token


@pytest.mark.parametrize("kv", [dict(kv_layers=[1, 3], kv_slots=1),
                                dict(kv_block_size=32, kv_slots=3)])    # slots of 2, 1, 1
def test_layer_subsets_and_slot_counts(kv):
    reference, model = pair(**kv)
    ids = torch.randint(0, 128, (2, 21))
    assert torch.equal(generate(model, ids), generate(reference, ids))
    runtime = runtime_of(model)
    assert runtime.layers == list(kv.get("kv_layers", range(4)))
    cache = static_cache(model, 2, 48)
    generate(model, ids, past_key_values=cache)
    for i, layer in enumerate(cache.layers):    # the host layers' tensors are the runtime's
        assert (runtime.owner_of(layer.keys) is not None) == (i in runtime.layers)


def test_graph_holds_one_update_per_layer_and_verifies():
    """The rewritten graph: one kv_begin (each slot's first layer), one kv_update per host
    layer, one kv_join; no index_copy_ into a host cache is left; the verifier refuses a
    refill planted into the wrong slot and a missing join."""
    reference, model = pair()
    graphs = []
    original = fx_offload.kv.reroute.apply

    def keep(gm, runtime, layers, attended=None):
        original(gm, runtime, layers, attended)
        graphs.append((gm, runtime))
    fx_offload.kv.reroute.apply = keep
    try:
        generate(model, torch.randint(0, 128, (1, 9)), new=3)
    finally:
        fx_offload.kv.reroute.apply = original
    gm, runtime = graphs[-1]
    targets = [n.target for n in gm.graph.nodes]
    ops = fx_offload.kv.kv_ops
    assert targets.count(ops.BEGIN) == 1 and targets.count(ops.JOIN) == 1
    assert targets.count(ops.UPDATE) == 4
    assert not [n for n in gm.graph.nodes if reroute._is_index_copy(n)]
    begin = next(n for n in gm.graph.nodes if n.target is ops.BEGIN)
    assert list(begin.args[5]) == [0, 1]
    updates = [n for n in gm.graph.nodes if n.target is ops.UPDATE]
    assert [(u.args[8], u.args[9]) for u in updates] == [(0, 2), (1, 3), (2, -1), (3, -1)]
    verify_reroute.verify(gm.graph, runtime)
    bad = copy.deepcopy(gm)
    first = next(n for n in bad.graph.nodes if n.target is ops.UPDATE)
    first.args = first.args[:9] + (3,)          # slot 0 refilled with layer 3 (slot 1)
    with pytest.raises(reroute.KVPassError, match="whose slot is 1"):
        verify_reroute.verify(bad.graph, runtime)
    bad = copy.deepcopy(gm)
    bad.graph.erase_node(next(n for n in bad.graph.nodes if n.target is ops.JOIN))
    with pytest.raises(reroute.KVPassError, match="before kv_join"):
        verify_reroute.verify(bad.graph, runtime)


def _step(model, cache, ids, start):
    """One forward of ``ids`` at ``start`` on ``cache``: the logits."""
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True,
                     cache_position=torch.arange(start, start + ids.shape[1])).logits


class _Taken:
    """The count of fills found done ahead, by either mechanism."""

    def __init__(self, runtime, by):
        self.runtime, self.by = runtime, by

    @property
    def skipped(self):
        if self.by == "join":
            return self.runtime.next_call.skipped
        return self.runtime.before_replay.taken


@pytest.mark.parametrize("by", ["join", "hooks"])
def test_fills_begun_ahead_are_taken_only_while_they_hold(by):
    """Each call's join (``by="join"``), or under ``mode="reduce-overhead"`` the hook after
    each call (``"hooks"``: a replay runs none of the runtime's Python; set here directly,
    the CPU having no CUDA graphs), fills the slots with the next call's first layers; the
    next call takes them (no fill of its own) only while they still hold.  A user's in-place
    write into a host layer between calls, cache.reset() and a new prefill, and two caches
    used in turn each make the begin fill again: the logits stay the reference's, bitwise."""
    reference, model = pair()
    if by == "hooks":
        runtime_of(model).next_call.enabled = False
        runtime_of(model).before_replay.enabled = True
    ids = torch.randint(0, 128, (1, 40))
    assert torch.equal(generate(model, ids), generate(reference, ids))
    ahead = _Taken(runtime_of(model), by)
    assert ahead.skipped == 2 * 9       # each decode step found slots 0 and 1 filled

    caches = [(static_cache(reference, 1, 64), static_cache(model, 1, 64)) for _ in range(2)]
    lengths = [0, 0]

    def step(which, ids):
        ref_cache, cache = caches[which]
        expected = _step(reference, ref_cache, ids, lengths[which])
        got = _step(model, cache, ids, lengths[which])
        lengths[which] += ids.shape[1]
        assert torch.equal(got, expected)

    step(0, ids[:, :20])
    for token in range(3):
        step(0, ids[:, 20 + token:21 + token])
    assert ahead.skipped == 2 * 9 + 2 * 3
    for ref_cache, cache in caches[:1]:     # the user writes a valid position in place
        for c in (ref_cache, cache):
            c.layers[0].keys[:, :, 5] = 0.5
            c.layers[1].values[:, 1, 7] = -0.5
    step(0, ids[:, 30:31])
    assert ahead.skipped == 2 * 9 + 2 * 3           # both slots filled again
    step(0, ids[:, 31:32])
    assert ahead.skipped == 2 * 9 + 2 * 4
    for c in caches[0]:
        c.reset()
    lengths[0] = 0
    step(0, ids[:, 3:12])       # reset wrote the blocks the slots were filled with
    assert ahead.skipped == 2 * 9 + 2 * 4
    step(1, ids[:, 0:5])        # two caches in turn: each finds the other's layers
    step(0, ids[:, 12:13])
    step(1, ids[:, 5:6])
    assert ahead.skipped == 2 * 9 + 2 * 4
    step(1, ids[:, 6:7])
    assert ahead.skipped == 2 * 9 + 2 * 5
    # a layer put back on the host at the address its freed memory had (beam search's
    # reorder_cache, then the allocator handing the same block on): the address and the
    # version counters match, the runtime's record of the tensor does not
    runtime = runtime_of(model)
    keys = caches[1][1].layers[0].keys
    held = dict(runtime.owners)
    alias = keys.view_as(keys)          # another tensor object at the same address
    runtime.owners[keys.data_ptr()] = (0, "keys", weakref.ref(alias))
    step(1, ids[:, 7:8])
    assert ahead.skipped == 2 * 9 + 2 * 5 + 1          # layer 1's fill alone was taken
    runtime.owners.update(held)


@pytest.mark.parametrize("which", ["fill", "write_back"])
def test_a_failing_copy_leaves_the_cache_usable(which):
    """A copy that raises in the middle of a decode step: the generate raises; the valid
    part of the cache is what the reference holds at that length; the next generate gives
    the reference's tokens."""
    reference, model = pair()
    ids = torch.randint(0, 128, (1, 20))
    expected = generate(reference, ids)
    generate(model, ids)                        # compiled
    runtime = runtime_of(model)
    real, calls = getattr(runtime, which), []

    def failing(*args):
        calls.append(1)
        if len(calls) == 13:                    # a decode step, part-way through its layers
            raise RuntimeError("copy failed")
        return real(*args)
    setattr(runtime, which, failing)
    cache = static_cache(model, 1, 40)
    try:
        with pytest.raises(RuntimeError, match="copy failed"):
            generate(model, ids, past_key_values=cache)
    finally:
        setattr(runtime, which, real)
    cache_ref = static_cache(reference, 1, 40)
    generate(reference, ids, new=1, past_key_values=cache_ref)
    for mine, theirs in zip(cache.layers, cache_ref.layers):
        valid = int(mine.cumulative_length)
        assert valid >= 20
        assert torch.equal(mine.keys[:, :, :20], theirs.keys[:, :, :20])
    assert torch.equal(generate(model, ids), expected)


def test_bad_options_and_caches_get_clear_errors():
    with pytest.raises(OffloadError, match="multiple of 16"):
        fx_offload.parse_options({"kv_cache": "host", "kv_block_size": 40})
    with pytest.raises(OffloadError, match="only applies with kv_cache='host'"):
        fx_offload.parse_options({"kv_layers": [0]})
    with pytest.raises(OffloadError, match="distinct layer indices"):
        fx_offload.parse_options({"kv_cache": "host", "kv_layers": [1, 1]})
    with pytest.raises(OffloadError, match="must be one of"):
        fx_offload.parse_options({"kv_cache": "cpu"})
    _, model = pair()
    ids = torch.randint(0, 128, (1, 6))
    with pytest.raises(OffloadError, match="cache_implementation='static'"):
        with torch.no_grad():           # generate's default: a dynamic cache
            model.generate(ids, max_new_tokens=2, do_sample=False)
    _, model = pair(kv_layers=[7])
    with pytest.raises(OffloadError, match=r"kv_layers \[7\] name no layer"):
        generate(model, ids)


def test_compiling_without_compile_forward_is_refused():
    """torch.compile with kv_cache='host' but without compile_forward's call hook: the
    cache would stay on the device; refused with what to do instead."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.generation_config.eos_token_id = None
    model.forward = torch.compile(model.forward, backend=fx_offload.backend(
        kv_cache="host", inner_backend="aot_eager", **WEIGHTS), dynamic=False)
    ids = torch.randint(0, 128, (1, 6))
    cache = static_cache(model, 1, 16)
    for layer in cache.layers:          # a cache initialized on the device beforehand
        layer.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    with pytest.raises(Exception, match="compile_forward"):
        generate(model, ids, new=2, past_key_values=cache)


@pytest.mark.cuda
def test_inductor_on_gpu_tokens_equal_and_cache_is_host_memory():
    """Inductor inside, on the GPU, bf16: greedy tokens equal the device cache's (both
    Inductor); the host layers' cache tensors are page-locked host memory, which the
    device's allocator does not hold."""
    reference, model = pair("cuda", inner="inductor")
    reference.to(torch.bfloat16)
    model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 50), device="cuda")
    for _ in range(2):
        assert torch.equal(generate(model, ids, new=12), generate(reference, ids, new=12))
    cache = static_cache(model, 2, 4096)
    before = torch.cuda.memory_allocated()
    generate(model, ids, new=4, past_key_values=cache)
    keys = cache.layers[0].keys
    assert keys.device.type == "cuda" and keys.dtype == torch.bfloat16
    host = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))
    # the device cache early_initialization made is freed (all of it: -host) and two slots
    # of one layer each are allocated at this shape (+host / 2)
    assert torch.cuda.memory_allocated() - before <= -host / 4


@pytest.mark.cuda
def test_under_cuda_graphs_the_hooks_fill_the_next_calls_first_slots():
    """``mode="reduce-overhead"``: the hook after each call fills the first slots for the
    next on the copy engine, the replay's fill kernels of those layers copy nothing, and
    the greedy tokens equal the device cache's (both Inductor, bf16)."""
    reference, model = pair("cuda", inner="inductor", mode="reduce-overhead")
    reference.to(torch.bfloat16)
    model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 50), device="cuda")
    for _ in range(3):
        assert torch.equal(generate(model, ids, new=12), generate(reference, ids, new=12))
    runtime = runtime_of(model)
    assert not runtime.next_call.enabled
    # every decode step of the last two generates found both first slots filled
    assert runtime.before_replay.taken >= 2 * 2 * 11
    # and each of those fills began once its slot's last layer was done with the slot, not
    # after the whole replay: every capture recorded both slots' events
    assert runtime.before_replay.every_capture_records
    assert runtime.before_replay.early >= 2 * 2 * 11


def test_a_capture_that_records_not_every_slot_leaves_the_hook_waiting_for_whole_replays(
        monkeypatch):
    """Under CUDA graphs the hook's fill of a slot waits for the event the slot's last layer
    records in the call.  A captured call that recorded not every slot's (a graph without
    one of those layers) would leave its replays an older record to wait for, so a fill
    could overwrite a slot the replay still reads: from then on the hook waits for whole
    replays."""
    from fx_offload.kv import next_call
    hooks = next_call.BeforeReplay(enabled=True)
    hooks.free = {0: object(), 1: object()}
    monkeypatch.setattr(next_call, "capturing", lambda: True)
    hooks.begin_call()
    hooks.recorded.update({0, 1})
    hooks.joined()
    assert hooks.every_capture_records
    hooks.begin_call()
    hooks.recorded.add(1)
    hooks.joined()
    assert not hooks.every_capture_records


def test_compiled_again_with_other_kv_options_or_without():
    """restore, then compile again: with other KV options a new runtime takes the cache
    over; without kv_cache the call hook is gone.  Tokens stay the reference's."""
    reference, model = pair()
    ids = torch.randint(0, 128, (1, 19))
    expected = generate(reference, ids)
    assert torch.equal(generate(model, ids), expected)
    first = runtime_of(model)
    for kv in (dict(kv_cache="host", kv_slots=1, kv_block_size=32), {}):
        fx_offload.restore(model)
        del model.forward
        torch._dynamo.reset()
        fx_offload.compile_forward(model, inner_backend="aot_eager", dynamic=False, **kv,
                                   **WEIGHTS)
        assert torch.equal(generate(model, ids), expected)
        runtime = runtime_of(model)
        hooks = [h for h in model._forward_pre_hooks.values()
                 if getattr(h, "__name__", "") == "prepare_cache"]
        if kv:
            assert runtime is not first and runtime.num_slots == 1 and runtime.block == 32
            assert len(hooks) == 1
        else:
            assert runtime is None and not hooks


def test_beam_search_use_cache_false_and_sliding_layers():
    """Beam search (its reorder_cache replaces the cache's tensors: they go back to the
    host), a model whose config says use_cache=False (no cache, nothing refused), and a
    Mistral whose every layer slides (refused with why) or a Qwen2 with some sliding layers
    (those stay on the device, the rest move)."""
    reference, model = pair()
    ids = torch.randint(0, 128, (1, 11))
    assert torch.equal(generate(model, ids, new=6, num_beams=2),
                       generate(reference, ids, new=6, num_beams=2))
    model.config.use_cache = False
    with torch.no_grad():
        model(ids)
    model.config.use_cache = True
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**CONFIG, use_sliding_window=True, sliding_window=8,
                                      max_window_layers=2)
    reference = transformers.Qwen2ForCausalLM(config).eval()
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    fx_offload.compile_forward(reference, inner_backend="aot_eager", dynamic=False, **WEIGHTS)
    fx_offload.compile_forward(model, inner_backend="aot_eager", dynamic=False,
                               kv_cache="host", kv_block_size=16, **WEIGHTS)
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    assert torch.equal(generate(model, ids), generate(reference, ids))
    assert runtime_of(model).layers == [i for i in range(4) if i not in sliding]
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        **CONFIG, sliding_window=8)).eval()
    fx_offload.compile_forward(mistral, inner_backend="aot_eager", dynamic=False,
                               kv_cache="host", **WEIGHTS)
    with pytest.raises(OffloadError, match="every layer of this cache is a sliding-window"):
        generate(mistral, ids, new=2)


def test_a_direct_forward_call_with_a_fresh_cache_is_refused():
    """model.forward(...) skips the call hook: a cache transformers would initialize
    inside the graph, on the device, is refused rather than silently kept there."""
    _, model = pair()
    ids = torch.randint(0, 128, (1, 6))
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(Exception, match="not model.forward directly"):
        with torch.no_grad():
            model.forward(ids, past_key_values=cache, use_cache=True)


def host_model(**kv):
    """The model of ``pair()`` (the same weights) with kv_cache='host', and no reference."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.generation_config.eos_token_id = None
    return fx_offload.compile_forward(model, inner_backend="aot_eager", dynamic=False,
                                      kv_cache="host", kv_block_size=16, **kv, **WEIGHTS)


def test_a_cache_handed_to_another_model_is_taken_over():
    """A StaticCache used by one kv_cache='host' model, reset, and handed to another (which
    keeps other layers on the host), then back: each model takes it over from the other
    (the one that let it go no longer holds its tensors) and gives the tokens the first
    model gave with the cache new; report keeps each model's own last figures."""
    first, second = host_model(), host_model(kv_layers=[1, 3])
    ids = torch.randint(0, 128, (1, 9))
    cache = static_cache(first, 1, 32)
    expected = generate(first, ids, new=3, past_key_values=cache)
    figures = fx_offload.report(first).kv
    assert figures["valid_tokens"] == 9 + 3 - 1
    cache.reset()                       # (the prompt alone: one graph compiled, not two)
    assert torch.equal(generate(second, ids, new=1, past_key_values=cache), expected[:, :10])
    assert all(runtime_of(first).owner_of(layer.keys) is None for layer in cache.layers)
    hosts = [runtime_of(second).owner_of(layer.keys) for layer in cache.layers]
    assert hosts == [None, (1, "keys"), None, (3, "keys")]
    assert fx_offload.report(first).kv == figures
    assert fx_offload.report(second).kv["host_bytes"] == figures["host_bytes"] // 2
    cache.reset()
    assert torch.equal(generate(first, ids, new=3, past_key_values=cache), expected)
    assert [runtime_of(first).owner_of(layer.keys) for layer in cache.layers] == \
        [(i, "keys") for i in range(4)]
    assert all(runtime_of(second).owner_of(layer.keys) is None for layer in cache.layers)


def test_the_kv_reroute_runs_in_the_frame_every_pass_shares(monkeypatch):
    """The KV pass traces its graph before and after and counts its time through
    ``passes.frame``, as the weight pass does (one frame for both)."""
    from torch._dynamo.utils import counters
    from fx_offload.passes import frame
    names = []
    monkeypatch.setattr(frame, "trace_structured",
                        lambda kind, metadata_fn, payload_fn: names.append(metadata_fn()["name"]))
    counters["fx_offload"].clear()
    _, model = pair()
    generate(model, torch.tensor([[1, 2, 3, 4]]), new=2)
    kv = [n for n in names if n.startswith("fx_offload_kv")]
    assert kv and kv[0] == "fx_offload_kv_before" and kv.count("fx_offload_kv_after") == \
        kv.count("fx_offload_kv_before") == counters["fx_offload"]["kv_layers"] // 4
    assert "fx_offload_before" in names and "fx_offload_after" in names
    assert counters["fx_offload"]["kv_pass_us"] > 0 and counters["fx_offload"]["pass_us"] > 0
