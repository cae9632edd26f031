"""Dense gated MLPs computed on the host (``host_compute``, the ``host_mlp`` op): Hugging Face
decoders built from small configs give the logits and tokens of the model without
offloading; the MLP's three weights are chunks of their own that a call on the host does not
copy; report and explain say where each MLP ran; an MLP the op cannot compute streams with
its reason; ``"auto"``'s rule streams a prompt and shares a decode step between the link and
the host.  CPU here: the "device" is the CPU (``"auto"`` means ``"never"`` on it, so these
use ``"always"``)."""
import copy
import dataclasses

import pytest
import torch

import fx_offload
from fx_offload import explain, registry
from fx_offload.host_compute import split
from fx_offload.host_compute.rates import HostRates
from helpers import assert_same_greedy_tokens

transformers = pytest.importorskip("transformers", reason="install the test extra")

ALWAYS = {"host_compute": "always"}
FP32 = dict(atol=2e-5, rtol=2e-5)       # the host kernel sums in another order
CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=4, vocab_size=256)


def _model(family: str = "llama", **extra):
    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    return model_class(config_class(**CONFIG, **extra)).eval()


def _mlp_bytes(model, layer: int) -> int:
    return sum(p.numel() * p.element_size()
               for p in model.model.layers[layer].mlp.parameters())


def _logits(compiled, reference, shapes):
    with torch.no_grad():
        for i, shape in enumerate(shapes):
            ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(ids, use_cache=False).logits,
                                       reference(ids, use_cache=False).logits, **FP32)


@pytest.mark.parametrize("family,inner", [("llama", "aot_eager"), ("qwen3", "aot_eager"),
                                          ("mistral", "aot_eager"), ("llama", "inductor")])
def test_always_gives_the_models_logits_and_copies_no_mlp_weight(family, inner):
    model = _model(family)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": inner, **ALWAYS})
    _logits(compiled, reference, [(2, 1)] * 2 if inner == "inductor" else [(2, 12), (2, 1)])
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3]
    assert rep.ran_on == {1: "host", 3: "host"}, rep.ran_on
    # each MLP read once in place, whatever the tokens
    assert rep.host_read_bytes_last_call == _mlp_bytes(model, 1) + _mlp_bytes(model, 3)
    # one slot: the call copied the layers' attention and norms, none of their MLPs
    others = sum(rep.layer_bytes.values()) - _mlp_bytes(model, 1) - _mlp_bytes(model, 3)
    assert 0 < rep.copied_bytes_last_call <= others, (rep.copied_bytes_last_call, others)
    assert "computed the experts or MLPs of layers [1, 3] on the host" in str(rep)
    # on a CPU no job is queued on a stream; where they are (CUDA), the report times them
    assert rep.host_jobs_last_call is None and "host job(s)" not in str(rep)
    timed = dataclasses.replace(rep, host_jobs_last_call=(8, 2_800_000_000, 0.022, 0.036,
                                                          0.0006, 0.0021))
    assert ("its 8 host job(s) on the stream ran 22.00 ms, reading 127.3 GB/s; 14.00 ms "
            "passed between them") in str(timed)
    assert ("the Python thread took 0.60 ms to queue one and launched it 2.10 ms before it "
            "began (medians") in str(timed)
    replayed = dataclasses.replace(rep, host_jobs_last_call=(8, 2_800_000_000, 0.022, 0.036,
                                                             None, None))
    assert str(replayed).count("a CUDA graph's replay launched them (no Python between") == 1
    assert "Python thread took" not in str(replayed)
    # each of the three weights is a chunk of its own (none shares a copy with a norm)
    chunks = registry.state_for_model(model).learned.layout[1]
    assert [c.suffixes for c in chunks[-3:]] == [
        ("mlp.gate_proj.weight",), ("mlp.up_proj.weight",), ("mlp.down_proj.weight",)]


def test_generate_gives_the_same_tokens():
    model = _model()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager", **ALWAYS)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    assert_same_greedy_tokens(model, reference, ids)
    assert set(fx_offload.report(model).ran_on.values()) == {"host"}


def test_bf16_logits_within_bf16_rounding():
    """bf16 weights: the host sums in fp32 and rounds once, the reference rounds after each
    matmul; the two agree to bf16's rounding."""
    model = _model().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits.float()
        want = reference(ids, use_cache=False).logits.float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def _gate_read_twice(model):
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))
                       + m.gate_proj(x)[..., :1] * 0)(mlp)
    return model


@pytest.mark.parametrize("make,why", [
    (lambda: _model(hidden_act="gelu"), "does not compute down(silu(gate(x)) * up(x))"),
    (lambda: _gate_read_twice(_model()), "reads one of its weights more than once")])
def test_an_mlp_the_host_kernel_does_not_compute_streams_and_says_why(make, why):
    """GELU between the linears, or a forward that reads its gate twice, is not what the
    host kernel computes: the layer streams as before, its outputs unchanged, and report
    and explain say why."""
    model = make()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           reference(ids, use_cache=False).logits)
    rep = fx_offload.report(model)
    assert set(rep.ran_on) == {1, 3}
    assert all(w.startswith("streamed: ") and why in w for w in rep.ran_on.values()), \
        rep.ran_on
    assert "streamed: " in explain(reference, ids, **ALWAYS).plan_text()


def test_never_leaves_the_mlp_weights_in_the_usual_chunks():
    model = _model()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", "host_compute": "never"})
    with torch.no_grad():
        compiled(torch.zeros(1, 3, dtype=torch.long), use_cache=False)
    state = registry.state_for_model(model)
    assert state.choice.mlps == {} and state.learned.hosting == {}


def test_the_rule_streams_a_prompt_and_shares_decode_between_link_and_host():
    """Llama-3-8B's shapes, 8 MLPs of 352 MB beside 84 MB of attention each: a 55 GB/s link
    (45 beside the host's reads), a host reading 60 GB/s beside the link, 1 TFLOP/s, 100 us
    a round trip.  A decode step computes most MLPs on the host; a prompt streams them all;
    a host slower than anything streams them all."""
    host = HostRates(read_rate=70e9, flop_rate=1e12, latency=100e-6, link_rate=55e9,
                     shared_read_rate=60e9, shared_link_rate=45e9)
    shape = dict(count=8, mlp_bytes=352e6, element_size=2, other_bytes=8 * 84_000_000)
    m = split.mlps_streamed(1, host=host, **shape)
    assert 1 <= m <= 3, m
    best = split.mlps_seconds(m, 1, host=host, **shape)
    streamed = split.mlps_seconds(8, 1, host=host, **shape)
    assert streamed / best > 1.6
    # the host's share and the link's finish close together
    link = (shape["other_bytes"] + m * shape["mlp_bytes"]) / 45e9
    assert abs(link - (8 - m) * (352e6 / 60e9 + 100e-6 + 2 * 176e6 / 1e12)) < 352e6 / 45e9
    assert split.mlps_streamed(512, host=host, **shape) == 8
    slow = HostRates(read_rate=5e9, flop_rate=1e11, latency=1e-3, link_rate=55e9)
    assert split.mlps_streamed(1, host=slow, **shape) == 8


def test_a_host_computed_mlp_lets_the_refill_over_its_chunks_begin_at_once(monkeypatch):
    """The MLP's slot bytes are free once the op computes it on the host: the refills over
    them begin in the op, before its host job, not after its result (where the graph's
    starts are); the graph's own starts then find them begun."""
    model = _model()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        compiled(ids, use_cache=False)
    state = registry.state_for_model(model)
    host = state.host_experts
    events = []
    run, start = host.on_host, state.start
    monkeypatch.setattr(host, "on_host", lambda *a: (events.append("host job"), run(*a))[1])
    monkeypatch.setattr(state, "start", lambda layer, refill, chunk=-1: (
        events.append((layer, refill, chunk)), start(layer, refill, chunk))[1])
    with torch.no_grad():
        compiled(ids, use_cache=False)
    first_job = events.index("host job")
    assert events[first_job - 3:first_job] == [(1, 3, 3), (1, 3, 4), (1, 3, 5)], events


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["always", "auto"])
def test_on_a_gpu_the_stream_runs_the_mlp_and_the_logits_agree(mode):
    """On CUDA a hosted MLP is a job queued on the stream (the caller never waits for it);
    bf16 logits agree with the model on the device to bf16 rounding, call after call while
    "auto" tries its plans; its report names a plan per call size."""
    model = _model().to(torch.bfloat16).cuda()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={"host_compute": mode})
    with torch.no_grad():
        for i in range(24):
            ids = torch.randint(0, 256, (2, 12 if i == 0 else 1), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(i))
            got = compiled(ids, use_cache=False).logits.float()
            want = reference(ids, use_cache=False).logits.float()
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    rep = fx_offload.report(model)
    assert set(rep.ran_on) == {1, 3}
    if mode == "always":
        assert set(rep.ran_on.values()) == {"host"}
        assert registry.state_for_model(model).host_experts._jobs is not None
        assert rep.host_read_bytes_last_call == _mlp_bytes(model, 1) + _mlp_bytes(model, 3)
        count, nbytes, ran, span, queueing, ahead = rep.host_jobs_last_call
        assert count == 2 and nbytes == rep.host_read_bytes_last_call and 0 < ran <= span
        # the Python thread's clock and the jobs' are one: a job begins after its launch
        # (or as the launch returns), within the call
        assert 0 < queueing < 1 and -1e-4 < ahead < 1
    else:
        assert 2 in rep.host_timing, rep.host_timing


def test_a_moe_model_with_dense_layers_hosts_both_kinds():
    """Qwen3-MoE with a dense layer among its MoE ones (``mlp_only_layers``): the dense
    layer's MLP is a host_mlp op, the MoE layer's experts a host_experts op; the logits are
    the model's."""
    from helpers import SMALL_HF
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SMALL_HF, moe_intermediate_size=32, num_experts=16,
                                         num_experts_per_tok=2, mlp_only_layers=[1])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    _logits(compiled, reference, [(2, 6), (2, 1)])
    state = registry.state_for_model(model)
    assert list(state.choice.mlps) == [1] and 3 in state.choice.experts
    assert fx_offload.report(model).ran_on == {1: "host", 3: "host"}
    shown = explain(reference, torch.zeros(1, 2, dtype=torch.long), **ALWAYS)
    assert "layer 1: a host_mlp op (its MLP); layer 3: a host_experts op" in shown.plan_text()
    assert "under CUDA graphs" not in shown.plan_text()
    # a CUDA model compiled with reduce-overhead (no CUDA here): what a graph records
    object.__setattr__(shown.choice, "under_cuda_graphs", True)
    assert "under CUDA graphs: a host_experts op is recorded as a host job" in \
        shown.plan_text()


def test_the_host_runtime_goes_with_the_model_without_a_garbage_collection():
    """The host runtime's parts hold no cycle: its page-locked staging is freed when the
    model and its compiled callable go, not at some later collection."""
    import gc
    import weakref
    model = _model()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    with torch.no_grad():
        compiled(torch.zeros(1, 3, dtype=torch.long), use_cache=False)
    host = weakref.ref(registry.state_for_model(model).host_experts)
    fx_offload.restore(model)
    gc.disable()
    try:
        del model, compiled
        torch._dynamo.reset()
        assert host() is None
    finally:
        gc.enable()


def test_a_moe_models_dense_mlps_follow_a_plan_made_at_the_calls_entry(monkeypatch):
    """With experts on the host the experts' plan is the one timed, and the dense MLPs take
    the rule's plan at the call's entry: their op then does not take the call for one of
    another size (which would drop the experts' timed call)."""
    from helpers import SMALL_HF
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SMALL_HF, moe_intermediate_size=32, num_experts=16,
                                         num_experts_per_tok=2, mlp_only_layers=[1])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    with torch.no_grad():
        compiled(torch.zeros(1, 2, dtype=torch.long), use_cache=False)
    host = registry.state_for_model(model).host_experts
    host.mode = "auto"      # ("auto" means "never" on a CPU: its runtime, as on a GPU)
    rates = HostRates(read_rate=50e9, flop_rate=1e12, latency=1e-4, link_rate=25e9)
    monkeypatch.setattr(host, "rates", lambda: rates)
    dropped = []
    monkeypatch.setattr(host, "discard_timing", lambda: dropped.append(True))
    host.begin_call(2)
    assert host.mlps.hosted == [1]
    assert isinstance(host.mlps._on_host(1, 2), bool) and not dropped
    host.begin_call(2)
    host.mlps._on_host(1, 3)        # another size than the entry's: not timed
    assert dropped == [True]


def test_an_mlp_plan_is_named_by_the_mlps_it_streams():
    from fx_offload.host_compute import trial
    assert trial.describe(4, 8, "MLPs") == "4 of 8 MLPs streamed"
    assert trial.describe(0, 8, "MLPs") == "on the host"
    assert trial.describe(8, 8, "MLPs") == "streamed"
    assert trial.describe(3, 8) == "split 3"        # experts: each token's first 3 picks
    timer = trial.CallTimer()
    timer.trials[(1, 8)] = trial.Trial([4], "MLPs")
    assert timer.summary()[1].startswith("4 of 8 MLPs streamed, the rule's plan")
    # the generate benchmark's --host-plans: one plan forced at one token a call
    fixed = trial.FixedPlan(2)
    assert fixed.summary() == {}
    assert fixed.begin(7, 8, 4, (), None) == 4 and fixed.summary() == {}
    assert fixed.begin(1, 8, 4, (), None, unit="MLPs") == 2
    assert fixed.summary() == {1: "2 of 8 MLPs streamed, forced"}
    assert trial.FixedPlan(9).begin(1, 8, 4, (), None) == 8


@pytest.mark.parametrize("flags, says", [
    (["--host-plans", "0,x"], "takes counts of streamed MLPs"),
    (["--host-compute", "never", "--host-plans", "0,2"], "add auto to --host-compute")])
def test_host_plans_flag_refuses_what_it_cannot_force(flags, says, capsys):
    import argparse
    from fx_offload.benchmarks import generate_bench
    parser = argparse.ArgumentParser()
    generate_bench.add_arguments(parser)
    assert generate_bench.run(parser.parse_args(flags)) == 2
    assert says in capsys.readouterr().err


def test_with_the_kv_cache_on_the_host_generate_gives_the_same_tokens():
    """kv_cache="host" and MLPs on the host together: greedy tokens of a static-cache
    generate equal the model's own."""
    model = _model()
    model.generation_config.eos_token_id = None
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager", kv_cache="host",
                               kv_block_size=16, **ALWAYS)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want)
    rep = fx_offload.report(model)
    assert set(rep.ran_on.values()) == {"host"} and rep.kv.get("layers")


def test_whole_rounds_of_slots_stream_so_each_follows_a_hosted_layer_in_its_slot():
    """A streamed MLP's copy begins early only where its slot's previous occupant was
    hosted: with one slot every other layer streams, with two ``H H S S``."""
    layers = tuple(range(1, 16, 2))
    assert sorted(split.streamed_mlps(4, list(layers), layers, 1)) == [3, 7, 11, 15]
    two = split.streamed_mlps(4, list(layers), layers, 2)
    assert sorted(two) == [5, 7, 13, 15]
    for m in range(9):
        for slots in (1, 2, 3):
            streamed = split.streamed_mlps(m, list(layers), layers, slots)
            assert len(streamed) == m
            # whole rounds, at most half of them: each streamed one follows a hosted one
            if 2 * m <= len(layers) and m % slots == 0 and len(layers) % (2 * slots) == 0:
                before = {layers[i]: layers[i - slots] for i in range(len(layers))}
                assert all(before[layer] not in streamed for layer in streamed), (m, slots)
    # layers whose MLP cannot be hosted keep their places in the rounds
    assert split.streamed_mlps(1, [1, 5], layers, 2) == {5}
