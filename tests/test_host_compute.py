"""Routed MoE experts computed on the host (``host_compute``): Hugging Face MoE models built
from small configs give the logits and tokens of the model without offloading, the experts'
chunk is not copied, report says where the experts ran and what the host read; "never"
(and "auto" on a CPU) leaves the graphs as they were; a region that is not clean streams
with its reason; bad combinations are refused.  CPU here: the "device" is the CPU, and the
op takes the same path (its staging copies are copies within host memory)."""
import copy
import types

import pytest
import torch

import fx_offload
from fx_offload import explain, ops, registry
from fx_offload.errors import OffloadError, ScheduleError
from fx_offload.host_compute import kernels
from fx_offload.host_compute.rates import HostRates
from fx_offload.tools import models
from helpers import PLANNER_RATES, assert_same_greedy_tokens, small_moe

transformers = pytest.importorskip("transformers", reason="install the test extra")

ALWAYS = {"host_compute": "always"}
FP32 = dict(atol=1e-5, rtol=1e-5)       # the host kernel sums in another order


def _experts_bytes(model, layer):
    return sum(p.numel() * p.element_size()
               for p in model.model.layers[layer].mlp.experts.parameters())


def _calls(compiled, reference, shapes, seed=0, **tolerance):
    with torch.no_grad():
        for i, shape in enumerate(shapes):
            ids = torch.randint(0, 256, shape,
                                generator=torch.Generator().manual_seed(seed + i))
            got = compiled(ids, use_cache=False).logits
            want = reference(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("name,inner", [("qwen3_moe", "aot_eager"), ("mixtral", "aot_eager"),
                                        ("qwen3_moe", "inductor")])
def test_always_gives_the_models_logits_and_copies_no_expert(name, inner):
    model = small_moe(name).eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": inner, **ALWAYS})
    # a prompt, then a decode step (Inductor: two steps, one compile; the first call fills
    # the slot whole as it offloads)
    _calls(compiled, reference, [(2, 1)] * 2 if inner == "inductor" else [(2, 12), (2, 1)],
           **FP32)
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3]
    assert rep.ran_on == {1: "host", 3: "host"}, rep.ran_on
    # transformers' fused layout runs the host kernel, not the module's own forward
    assert registry.state_for_model(model).host_experts._layers[1].fused
    # the last call: 2 tokens, top-2, so at most 4 distinct experts read per layer
    per_expert = _experts_bytes(model, 1) // model.model.layers[1].mlp.experts.num_experts
    assert 2 * per_expert <= rep.host_read_bytes_last_call <= 2 * 4 * per_expert
    # one slot: what the call copied is the layers' other weights, none of their experts
    others = sum(rep.layer_bytes.values()) - sum(_experts_bytes(model, i) for i in (1, 3))
    assert 0 < rep.copied_bytes_last_call <= others, (rep.copied_bytes_last_call, others)
    assert "computed the experts or MLPs of layers [1, 3] on the host" in str(rep)


def test_experts_given_new_storage_with_other_strides_still_compute_on_the_host():
    """`p.data = t` of the same shape and dtype is taken up as the true weights; the C
    kernel reads rows in place, so a transposed copy is computed by the module's own code
    (on the host still), not refused with an error naming a kernel the user never called."""
    model = small_moe("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    _calls(compiled, reference, [(2, 3)], **FP32)
    for m in (model, reference):
        p = m.model.layers[1].mlp.experts.gate_up_proj
        p.data = (p.data * 1.5).transpose(-1, -2).contiguous().transpose(-1, -2)
    _calls(compiled, reference, [(2, 3), (2, 3)], seed=1, **FP32)
    assert fx_offload.report(model).ran_on == {1: "host", 3: "host"}
    torch.testing.assert_close(model.model.layers[1].mlp.experts.gate_up_proj,
                               reference.model.layers[1].mlp.experts.gate_up_proj,
                               rtol=0, atol=0)


def test_generate_gives_the_same_tokens():
    model = small_moe("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, inner_backend="aot_eager", **ALWAYS)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    assert_same_greedy_tokens(model, reference, ids, new_tokens=4)
    assert fx_offload.report(model).ran_on == {1: "host", 3: "host"}


def test_a_size_shared_out_of_the_experts_keeps_them_on_the_host():
    # dynamic shapes, batch 1, a cache: the tracer shares the size T * k computed inside
    # layer 0's experts with a later node; the size stays in the graph, the experts go
    model = small_moe("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, dynamic=True, group_size=1, num_in_group=1,
                               inner_backend="aot_eager", **ALWAYS)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **FP32)
    assert fx_offload.report(model).ran_on == {i: "host" for i in range(4)}


def test_bf16_logits_within_bf16_rounding():
    """The host sums in fp32 and rounds once; the model rounds each step in bf16."""
    model = small_moe("qwen3_moe").eval().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    with torch.no_grad():
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
        got = compiled(ids, use_cache=False).logits.float()
        want = reference(ids, use_cache=False).logits.float()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert fx_offload.report(model).ran_on == {1: "host", 3: "host"}


def test_a_streamed_call_runs_the_same_op_on_the_slot(monkeypatch):
    """Under "auto" the op streams where host computation is not predicted faster: the
    routed wait gathers the picked experts and the module runs on the slot."""
    model = small_moe("qwen3_moe").eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    _calls(compiled, reference, [(2, 1)], **FP32)
    host = registry.state_for_model(model).host_experts
    monkeypatch.setattr(host, "mode", "auto")
    monkeypatch.setattr(host, "_plan", lambda entry, layer, tokens, k: k)
    monkeypatch.setattr(host, "on_host_now", False)
    _calls(compiled, reference, [(2, 1)], seed=1, **FP32)
    rep = fx_offload.report(model)
    assert rep.ran_on == {1: "device", 3: "device"}
    assert rep.host_read_bytes_last_call == 0
    assert registry.state_for_model(model).routed.gathered.item() > 0


@pytest.mark.parametrize("value", ["never", "auto"])
def test_never_and_auto_on_a_cpu_leave_the_graphs_unchanged(value):
    model, inputs = models.build("moe", num_layers=4, routed=True, batch=1, seq=1)
    plain = explain(model, *inputs, group_size=2, num_in_group=1)
    torch._dynamo.reset()
    other = explain(model, *inputs, group_size=2, num_in_group=1, host_compute=value)
    assert [r.text() for r in other.graphs] == [r.text() for r in plain.graphs]
    assert other.learned.hosting == {}


def test_a_region_that_is_not_clean_streams_and_says_why():
    """An experts module that takes a fourth activation (the router's scores) is not the
    op's (x, ids, gates): it streams, and report and explain say why."""
    class Wider(models.RoutedExperts):
        def forward(self, x, idx, weights, probs):
            return super().forward(x, idx, weights) + probs.sum() * 0

    class MoE(models.MoE):
        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            probs = torch.softmax(self.gate(x), dim=-1)
            top, idx = probs.topk(self.top_k, dim=-1)
            return self.experts(x, idx, top / top.sum(-1, keepdim=True), probs).reshape(shape)

    model, (x,) = models.build("moe", num_layers=4, routed=True, batch=1, seq=1)
    for layer in model.layers:
        old = layer.mlp
        layer.mlp = MoE.__new__(MoE)
        layer.mlp.__dict__.update(old.__dict__)
        layer.mlp.experts.__class__ = Wider
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    rep = fx_offload.report(model)
    assert set(rep.ran_on) == {1, 3}
    assert all(why.startswith("streamed: ") and "are not one activation" in why
               for why in rep.ran_on.values()), rep.ran_on
    assert "layer 1 streamed: " in str(rep)
    assert "streamed: " in explain(reference, x, **ALWAYS).plan_text()


def test_the_verifier_refuses_a_refill_over_the_experts_before_their_op():
    model, inputs = models.build("moe", num_layers=4, routed=True, batch=1, seq=1)
    e = explain(model, *inputs, group_size=2, num_in_group=1, offload_params=["experts"],
                **ALWAYS)
    (record,) = e.graphs
    gm = record.after
    (op,) = [n for n in gm.graph.nodes if (c := ops.OpCall.of(n)) and c.kind == "host"
             and c.layer == 1]
    start = next(n for n in gm.graph.nodes if (c := ops.OpCall.of(n)) and c.kind == "start"
                 and c.layer == 1 and c.chunk == 0)
    start.args = ([op.args[0]],) + start.args[1:]     # tied to the op's input instead
    op.prepend(start)
    from fx_offload.passes.verify import slot_model_for, verify_graph
    with pytest.raises(ScheduleError, match="computes layer 1's experts .* refill of another"):
        verify_graph(gm, {w: (t[0], t[2]) for w, t in record.weight_tags.items()},
                     slot_model_for(e.choice.schedule, e.learned.layout, [1, 3]))


def test_auto_prefers_the_host_for_decode_and_the_link_for_a_prompt():
    """Qwen3-30B-A3B's shapes (128 experts, top 8, 9.4 MB each in bf16), a 50 GB/s link,
    a host reading 100 GB/s and computing 1 TFLOP/s, 50 us a layer: decode splits with
    most picks on the host, a prompt streams (m = k)."""
    from fx_offload.host_compute import split
    host = HostRates(read_rate=100e9, flop_rate=1e12, latency=50e-6)
    shape = dict(k=8, experts=128, expert_bytes=9_437_184, element_size=2, link_rate=50e9,
                 host=host)
    assert split.device_picks(1, other_bytes=0, **shape) in (2, 3)
    assert split.device_picks(4, other_bytes=0, **shape) < 8
    assert split.device_picks(512, other_bytes=0, **shape) == 8
    # every layer offloaded: its 36 MiB of attention leave the link less time
    assert split.device_picks(1, other_bytes=36 << 20, **shape) == 0
    # a host far slower than the link still takes one pick where the link is free ...
    slow = dict(shape, host=HostRates(read_rate=10e9, flop_rate=1e12, latency=50e-6))
    assert split.device_picks(1, other_bytes=0, **slow) == 7
    # ... but not where its round trip costs more than the pick
    slower = dict(shape, host=HostRates(read_rate=10e9, flop_rate=1e12, latency=2e-3))
    assert split.device_picks(1, other_bytes=0, **slower) == 8


def test_the_reference_kernel_skips_sentinels_and_sums_in_fp32():
    torch.manual_seed(0)
    gate_up, down = torch.randn(4, 6, 5), torch.randn(4, 5, 3)
    x, gates = torch.randn(3, 5), torch.rand(3, 2)
    ids = torch.tensor([[0, 3], [2, 4], [-1, 1]])       # 4 and -1: no expert of these
    out = kernels.routed_experts(x, ids, gates, gate_up, down)
    want = torch.zeros(3, 5)
    for t in range(3):
        for j in range(2):
            e = int(ids[t, j])
            if 0 <= e < 4:
                g, u = (gate_up[e] @ x[t]).chunk(2)
                want[t] += gates[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("options,match", [
    (dict(host_compute="sometimes"), "option 'host_compute' must be one of"),
    (dict(host_compute=True), "option 'host_compute' must be one of"),
    (dict(host_compute="always", mode="reduce-overhead"), "CUDA graph"),
    (dict(host_compute="always", expert_cache="1MiB"), "drop expert_cache"),
    (dict(host_compute="always", compress="lossless"), "compress='lossless'"),
    (dict(host_compute="always", experts="whole"), "experts='routed' only"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(OffloadError, match=match):
        fx_offload.parse_options(options)


def test_a_model_placed_with_always_is_refused_under_cuda_graphs():
    model, (x,) = models.build("moe", num_layers=4, routed=True, batch=1, seq=1)
    fx_offload.place(model, "cpu", group_size=2, num_in_group=1, **ALWAYS)
    compiled = torch.compile(model, backend="prefetch_offload", mode="reduce-overhead")
    with pytest.raises(Exception, match="host_compute='always' runs the experts on the host"):
        with torch.no_grad():
            compiled(x)


@pytest.mark.cuda
def test_on_a_gpu_the_stream_runs_the_host_kernel_and_the_caller_never_waits(monkeypatch):
    """On CUDA the op enqueues the host kernel on the stream (a host function) instead of
    waiting for it: greedy tokens as the model's, the experts' bytes counted, no
    synchronize of the stream from the op."""
    model = small_moe("qwen3_moe").eval().cuda()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, dynamic=True, inner_backend="aot_eager", **ALWAYS)
    ids = torch.randint(0, 256, (2, 7), device="cuda")
    waits = []
    real = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: waits.append(self) or real(self))
    with torch.no_grad():
        model(ids)                              # the first call grows the staging once
        waits.clear()
        got = model(ids, use_cache=False).logits
        want = reference(ids, use_cache=False).logits
    assert waits == []
    torch.testing.assert_close(got, want, **FP32)
    rep = fx_offload.report(model)
    assert rep.ran_on == {1: "host", 3: "host"} and rep.host_read_bytes_last_call > 0
    jobs = registry.state_for_model(model).host_experts._jobs
    assert jobs is not None and jobs.fixed == {}    # no CUDA graphs: nothing kept for one


def test_a_job_still_queued_is_waited_for_before_the_host_blocks_change(monkeypatch):
    """The state's synchronize (before update_weights, restore, freeing) waits for host
    jobs a stream still holds: they read the host blocks."""
    from fx_offload.runtime.experts import host_experts
    model, (x,) = models.build("moe", num_layers=4, routed=True, batch=1, seq=1)
    fx_offload.place(model, "cpu", group_size=2, num_in_group=1, **ALWAYS)
    state = registry.state_for_model(model)
    jobs = state.host_experts._jobs = host_experts._StreamJobs(None, 1)
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    state.synchronize()
    assert waited == []                         # nothing queued
    jobs.ring.queued[0], jobs.ring.jobs[0].done = True, 0
    state.synchronize()
    assert len(waited) == 1
    jobs.ring.jobs[0].done = 1                  # the job marked itself done
    state.synchronize()
    assert len(waited) == 1


def test_the_host_jobs_threads_leave_an_eighth_of_the_pool_or_follow_the_variable(
        monkeypatch, caplog):
    from fx_offload.runtime.experts.host_experts import job_threads
    pool = torch.get_num_threads()
    monkeypatch.delenv("FX_OFFLOAD_HOST_THREADS", raising=False)
    assert job_threads() == max(1, pool - max(1, pool // 8))
    assert job_threads(spare=False) == pool        # an attention job's: every core
    monkeypatch.setenv("FX_OFFLOAD_HOST_THREADS", "3")
    assert job_threads() == 3
    assert job_threads(spare=False) == 3
    monkeypatch.setenv("FX_OFFLOAD_HOST_THREADS", "0")
    with caplog.at_level("WARNING", logger="fx_offload"):
        assert job_threads() == max(1, pool - max(1, pool // 8))
    assert "FX_OFFLOAD_HOST_THREADS='0' is no count of threads" in caplog.text


@pytest.mark.cuda
def test_always_inside_a_capture_is_refused():
    model = small_moe("qwen3_moe").eval().cuda()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    ids = torch.randint(0, 256, (1, 1), device="cuda")
    with torch.no_grad():
        compiled(ids, use_cache=False)
        with pytest.raises(Exception, match="a CUDA graph capture cannot record"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                compiled(ids, use_cache=False)


def test_always_takes_no_expert_cache_from_the_budget():
    """``expert_cache="auto"`` takes what memory_budget's plan leaves, for the calls that
    stream experts; under "always" none does, so it takes nothing."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    reference = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "memory_budget": total // 2, **PLANNER_RATES, **ALWAYS})
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    rep = fx_offload.report(model)
    assert rep.expert_cache is None
    assert rep.layers and set(rep.ran_on.values()) == {"host"}, rep.ran_on


def test_experts_that_are_not_routed_stream_and_say_why():
    """The built-in MoE computing every expert (gates zero for the others) is not routed:
    under "always" its experts stream whole, and report says so rather than nothing."""
    model, (x,) = models.build("moe", num_layers=4)
    for layer in model.layers:
        layer.mlp.experts.num_experts = layer.mlp.experts.w13_weight.shape[0]
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    ran = fx_offload.report(model).ran_on
    assert set(ran) == {1, 3} and all(
        why.startswith("streamed: its experts are not routed (") for why in ran.values()), ran


def test_always_is_refused_for_a_training_graph():
    """The host_experts op has no backward: a model placed with "always" compiled for
    training is refused (errors row 92), its weights untouched."""
    model = small_moe("qwen3_moe").train()
    for name, p in model.named_parameters():
        p.requires_grad_("lm_head" in name)        # a trainable head on a frozen base
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager", **ALWAYS})
    ids = torch.randint(0, 256, (1, 4))
    with pytest.raises(Exception, match="inference only; this graph trains"):
        compiled(ids, use_cache=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _fused_experts(experts=6, hidden=16, inner=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen).to(dtype)
    down = torch.randn(experts, hidden, inner, generator=gen).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("m,cached", [(0, ()), (1, ()), (2, (4,)), (0, (0, 3, 5)), (3, ())])
def test_a_split_layers_two_parts_sum_to_the_whole(m, cached):
    """The device's part (each token's first ``m`` picks and the cached experts) and the
    host kernel's part (the rest, the device's ids set to the sentinel) add up to the
    layer's experts; rows the device's part does not keep may hold NaN (a slot's stale
    bytes) and change nothing."""
    from fx_offload.host_compute import split
    E, T, k = 6, 5, 3
    gate_up, down = _fused_experts(E)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, 16, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    gates = torch.rand(T, k, generator=gen)
    where = torch.full((E + 1,), -1, dtype=torch.int32)
    for row, e in enumerate(cached):
        where[e] = row
    keep = split.keep_on_device(ids, m, where if cached else None)
    assert keep[:, :m].all()
    for t in range(T):
        for j in range(m, k):
            assert keep[t, j] == (int(ids[t, j]) in cached)
    sentinel = torch.full_like(ids, E)
    on_device, on_host = torch.where(keep, ids, sentinel), torch.where(keep, sentinel, ids)
    stale_up, stale_down = gate_up.clone(), down.clone()
    unkept = [e for e in range(E) if not (on_device == e).any()]
    stale_up[unkept], stale_down[unkept] = float("nan"), float("nan")
    mine = split.device_experts(x, on_device, gates, stale_up, stale_down, keep)
    theirs = kernels.routed_experts(x, on_host, gates, gate_up, down)
    whole = kernels.routed_experts(x, ids, gates, gate_up, down)
    assert mine.dtype == torch.float32 and mine.isfinite().all()
    torch.testing.assert_close(mine + theirs, whole, **FP32)


def test_the_split_takes_the_share_that_lets_link_and_host_finish_together():
    """``device_picks``: with the link free and as fast as the host, about half of the
    picks; with the link busy with the layer's other chunks, fewer or none."""
    from fx_offload.host_compute import split
    E, k, b = 128, 8, 9 << 20

    def picks(rate, link, others=0):
        host = HostRates(read_rate=rate, flop_rate=1e15, latency=0.0)
        return split.device_picks(1, k, E, b, 2, others, link, host)

    assert picks(50e9, 50e9) == 4
    assert picks(100e9, 50e9) in (2, 3)
    # the layer's attention (36 MiB) crosses too: one pick is left for the link
    assert picks(80e9, 55e9, 36 << 20) == 1
    assert picks(80e9, 55e9, 1 << 30) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("cached", [0, 4])
def test_on_a_gpu_auto_splits_a_layers_picks_between_device_and_host(monkeypatch, cached):
    """Under "auto", each token's first pick (and the cached experts: 4 of 16 a layer) run
    on the device while the host computes the others, on a stream of its own: the model's
    logits, the split reported, the host's share read."""
    from fx_offload.host_compute import split, trial
    monkeypatch.setattr(split, "device_picks", lambda *a, **kw: 1)
    monkeypatch.setattr(trial, "TRY_WITHIN", 0.0)    # the rule's plan alone
    model = small_moe("qwen3_moe").eval().cuda()
    reference = copy.deepcopy(model)
    # the cache holds as many experts of each routed layer (layers 1 and 3)
    per_expert = _experts_bytes(model, 1) // model.model.layers[1].mlp.experts.num_experts
    fx_offload.compile_forward(model, dynamic=True, inner_backend="aot_eager",
                               host_compute="auto",
                               expert_cache=cached * 2 * per_expert or None)
    with torch.no_grad():
        for seed in range(6):       # the cache is filled after 4 calls
            ids = torch.randint(0, 256, (2, 1), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(seed))
            got = model(ids, use_cache=False).logits
            want = reference(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, **FP32)
    rep = fx_offload.report(model)
    assert rep.ran_on == {1: "split 1", 3: "split 1"}, rep.ran_on
    assert rep.host_read_bytes_last_call > 0
    assert "split with the device" in str(rep)
    if cached:
        assert rep.expert_cache[0] == cached and rep.expert_cache[3] == 2 * cached


@pytest.mark.parametrize("split_seconds, host_faster, want", [
    (0.5, True, 1), (0.5, False, 1),            # the split clearly faster: recorded
    (0.9, True, 0), (0.9, False, 8),            # only a little: the better of the other two
])
def test_under_cuda_graphs_auto_records_a_split_only_where_the_rule_finds_it_clearly_faster(
        split_seconds, host_faster, want, monkeypatch):
    """No trial times a CUDA graph's replays, so under mode="reduce-overhead" "auto" records
    the rule's split only for calls of several tokens and where it predicts it at most
    GRAPH_SPLIT_SHARE (0.85) of the better of the host alone and streaming (the rule has
    predicted one-token splits much faster than they ran); else the faster of those two, by the rule's own times (once a 1.75x
    slower decode: the capture streamed every layer the rule would split).  The GPU test of
    the capture: test_moe's ..._recorded_as_host_jobs_inside_cuda_graphs."""
    from fx_offload.host_compute import native
    from fx_offload.runtime.experts.host_experts import HostExperts
    monkeypatch.setattr(native, "library", lambda: object())    # (a C compiler)
    alone, streamed = (1.0, 2.0) if host_faster else (2.0, 1.0)
    # the rule's (m, seconds with m, with 0, with k): it would split, 1 pick on the device
    runtime = types.SimpleNamespace(
        mode="auto", GRAPH_SPLIT_SHARE=HostExperts.GRAPH_SPLIT_SHARE,
        _predicted=lambda entry, layer, tokens, k: (1, split_seconds, alone, streamed),
        _state=types.SimpleNamespace(hook_copies=types.SimpleNamespace(
            under_cuda_graphs=True)))
    runtime._graphed = types.MethodType(HostExperts._graphed, runtime)
    entry = types.SimpleNamespace(queueable=True)
    assert runtime._graphed(entry, 3, 2, 8) == want
    # a call under CUDA graphs outside a capture (the warm-up that makes a recorded job's
    # buffers) plans the same
    assert HostExperts._plan(runtime, entry, 3, 2, 8) == want
    # one token: never a split
    assert runtime._graphed(entry, 3, 1, 8) == (0 if host_faster else 8)
    # a size no capture records as a host job (more than 64 token picks), or a layout the
    # queued kernel does not take, streams as its capture does
    assert runtime._graphed(entry, 3, 9, 8) == 8
    assert runtime._graphed(types.SimpleNamespace(queueable=False), 3, 1, 8) == 8
    # without CUDA graphs the rule's split stands (the trial times it)
    runtime._state.hook_copies.under_cuda_graphs = False
    assert HostExperts._plan(types.SimpleNamespace(**vars(runtime), _call=None),
                             entry, 3, 1, 8) == 1


def test_the_device_share_computes_only_the_first_picks_where_nothing_else_is_kept():
    """A split with no expert cache keeps each token's first m picks: device_experts given
    ``first=m`` computes those alone (a temporary of m instead of k experts a token) and
    gives what it gives computing all k with the rest dropped, stale slot rows (NaN)
    included."""
    from fx_offload.host_compute import split
    torch.manual_seed(0)
    E, H, I, T, k, m = 6, 16, 8, 3, 4, 2
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    x, gates = torch.randn(T, H), torch.rand(T, k)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    keep = split.keep_on_device(ids, m, None)
    sentinel = torch.full_like(ids, E)
    ids_device = torch.where(keep, ids, sentinel)
    # rows no kept pick names may hold any bytes
    stale = [e for e in range(E) if e not in ids[:, :m].flatten().tolist()]
    assert stale
    gate_up[stale], down[stale] = float("nan"), float("nan")
    every = split.device_experts(x, ids_device, gates, gate_up, down, keep)
    first = split.device_experts(x, ids_device, gates, gate_up, down, keep, m)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, every, rtol=1e-6, atol=1e-6)
    want = sum(gates[:, j, None] * torch.einsum(
        "thi,ti->th", down[ids[:, j]],
        torch.nn.functional.silu(torch.einsum("tih,th->ti", gate_up[ids[:, j], :I], x)) *
        torch.einsum("tih,th->ti", gate_up[ids[:, j], I:], x)) for j in range(m))
    torch.testing.assert_close(first, want, rtol=1e-4, atol=1e-4)


def test_the_read_probe_reads_more_than_a_cache_holds_through_a_job_thread(monkeypatch):
    """``"auto"``'s read rate is taken on experts far larger than a last-level cache (a
    probe held in the cache read 150-280 GB/s on a host whose memory reads 86), on a
    thread of its own as a queued job runs."""
    import threading
    from fx_offload.host_compute import rates
    per_expert = 3 * rates.PROBE_INNER * rates.PROBE_HIDDEN * 2
    assert rates.PROBE_EXPERTS * per_expert >= 512 << 20
    threads = []
    real = kernels.job_threads
    monkeypatch.setattr(kernels, "job_threads",
                        lambda: threads.append(threading.current_thread()) or real())
    rate = rates.read_rate(repeats=2)
    assert 1e8 < rate < 1e13
    if fx_offload.host_compute.native.library() is not None:
        assert threads and all(t is not threading.main_thread() for t in threads)


def test_a_split_is_weighed_at_the_rates_measured_side_by_side():
    """Where the host and the link both work, each is counted at its rate measured beside
    the other (they share the host's memory); a streamed layer has the link alone.  Rates
    that fall when both run move picks back to the link, and unmeasured shared rates fall
    back to the rates alone."""
    from fx_offload.host_compute import split
    alone = HostRates(read_rate=100e9, flop_rate=1e12, latency=50e-6, link_rate=50e9)
    assert alone.read_beside_link == 100e9 and alone.link_beside_reads == 50e9
    shape = dict(tokens=1, k=8, experts=128, expert_bytes=9_437_184, element_size=2,
                 other_bytes=0, link_rate=50e9)
    m_alone = split.device_picks(host=alone, **shape)
    crowded = HostRates(read_rate=100e9, flop_rate=1e12, latency=50e-6, link_rate=50e9,
                        shared_read_rate=40e9, shared_link_rate=45e9)
    m_crowded = split.device_picks(host=crowded, **shape)
    assert m_crowded > m_alone
    # the rule's choice is the m minimizing the larger time at the shared rates
    def step(m):
        link = 0.0 if not m else 128 * split.expected_share(128, m, 1) * 9_437_184 / \
            (50e9 if m == 8 else 45e9)
        host = 0.0 if m == 8 else 128 * split.expected_share(128, 8 - m, 1) * 9_437_184 / \
            40e9 + 2 * (8 - m) * 9_437_184 / 2 / 1e12 + 50e-6
        return max(link, host)
    assert step(m_crowded) == pytest.approx(min(step(m) for m in range(9)))


@pytest.mark.cuda
def test_the_shared_probe_reads_while_the_link_copies():
    from fx_offload.host_compute import rates
    read, link = rates.shared_rates(torch.device("cuda"), repeats=2)
    assert 1e8 < read < 1e13 and 1e8 < link < 1e12
    measured = rates.measure(torch.device("cuda"))
    assert set(measured) == set(rates.NAMES) and measured["shared_link_rate"] > 0


def test_auto_keeps_the_plan_its_timed_calls_found_fastest():
    """``"auto"``'s trial: each plan runs in blocks of calls (a call after a change of plan
    pays for the change: each block's first call is a warm-up), plan after plan for ROUNDS
    rounds; the plan with the fastest timed call stays for good.  A plan slow only in its
    first block (the first plan tried paying the first calls' costs) still wins."""
    from fx_offload.host_compute.trial import ROUNDS, SETTLE, Trial
    trial = Trial([3, 0, 8, 0])
    assert trial.plans == [3, 0, 8]
    took = {3: 0.016, 0: 0.019, 8: 0.018}
    order, blocks = [], []
    while trial.best is None:
        plan, block = trial.next_plan()
        order.append(plan)
        blocks.append(block)
        seconds = took[plan] + (1.0 if len(blocks) == 1 or blocks[-2] != block else 0.0)
        seconds += 5.0 if block == 0 else 0.0       # settling calls: never counted
        if plan == 3 and block == 1:
            seconds += 0.3      # the first block of the first plan: slow for its own reasons
        trial.timed(plan, block, seconds)
    # the first calls settle on the rule's plan, untimed (block 0), then the blocks
    assert order == [3] * SETTLE + [3, 3, 0, 0, 8, 8] * ROUNDS
    assert blocks[:SETTLE] == [0] * SETTLE and blocks[SETTLE] == 1
    assert trial.best == 3 and trial.next_plan() == (3, -1)
    assert trial.fastest() == pytest.approx(took)      # the warm-ups' second left out
    assert not trial.timed(3, trial.block, 0.001) and trial.best == 3
    assert Trial([4]).best == 4                          # nothing to choose from
    # a call of a block already done is not counted in the next block
    late = Trial([2, 8])
    for _ in range(SETTLE):
        late.next_plan()
    plan, block = late.next_plan()
    late.timed(plan, block, 1.0)                         # warm-up
    late.timed(plan, block, 0.5)                         # timed: the block is done
    assert late.next_plan() == (8, block + 1)
    late.timed(2, block, 0.1)                            # read late: ignored
    assert late.times == {2: [0.5], 8: []}
    late.timed(8, block + 1, 9.0)                        # the new block's warm-up
    assert late.times == {2: [0.5], 8: []}
    # the last plan of a round: a call past its timed one, read in the same pass (the round
    # has just moved on), is not its next round's time; that comes from a block of its own
    late.timed(8, block + 1, 0.7)
    late.timed(8, block + 1, 0.6)
    assert late.times == {2: [0.5], 8: [0.7]} and late.round == 2
    assert late.next_plan() == (2, block + 2)


def test_the_call_timer_reads_only_events_that_are_done(monkeypatch):
    """Each call is timed from an event at its entry to one at its end, read once done and
    never waited for; a call that did not run its plan, or during which a graph was
    compiled, is left out; the report's words."""
    from fx_offload.host_compute import trial as trial_mod

    class Event:
        now = 0.0

        def __init__(self, enable_timing=False):
            self.at, self.done = None, False

        def record(self, stream=None):
            self.at = Event.now

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    from torch._dynamo.utils import counters
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = trial_mod.CallTimer("m")
    took = {2: 0.010, 0: 0.020, 8: 0.030}
    events = []
    for call in range(24):
        plan = timer.begin(1, 8, 2, [1.0, 1.5, 1.9], stream=object())
        Event.now += took[plan]
        if call == 4:
            timer.discard()     # its tokens were miscounted: not timed
        if call in (1, 7):      # Dynamo compiles during the call: the device waited for it
            Event.now += 10.0
            counters["stats"]["unique_graphs"] += 1
        timer.end(stream=object())
        events.extend(e for p in timer._pending for e in p[3::3])
        if call % 2:            # the device catches up every other call
            for e in events:
                e.done = True
    assert timer.begin(1, 8, 2, [1.0, 1.5, 1.9], stream=object()) == 2
    trial = timer.trials[(1, 8)]
    assert trial.best == 2 and trial.fastest() == pytest.approx(took)
    assert timer.summary() == {1: "split 2 10.00 ms, on the host 20.00 ms, streamed "
                                  "30.00 ms: keeps split 2"}
    # a plan the rule predicts more than TRY_WITHIN times slower is not tried (a prompt on
    # the host alone)
    assert timer.begin(64, 8, 8, [1.0, 5.0, 1.0], stream=object()) == 8
    assert timer.trials[(64, 8)].plans == [8]
    assert timer.summary()[64] == ("streamed, the rule's plan (the others predicted over "
                                   "2x as slow: not tried)")
    # sizes beyond MAX_SIZES run the rule's plan, untimed and unkept
    monkeypatch.setattr(trial_mod, "MAX_SIZES", 2)
    assert timer.begin(5, 8, 3, [1.0, 1.0, 1.0], stream=object()) == 3
    assert (5, 8) not in timer.trials and timer._start is None


@pytest.mark.cuda
def test_on_a_gpu_auto_times_its_plans_and_keeps_one(monkeypatch):
    """Decode calls of one size take turns with the rule's split, the host alone and
    streaming (the rule made to call all three close), timed on the device; one stays, the
    report says which and the medians; logits equal the model's in every call."""
    from fx_offload.host_compute import split, trial
    monkeypatch.setattr(split, "device_picks", lambda *a, **kw: 1)
    monkeypatch.setattr(split, "layer_seconds", lambda m, *a: 1.0)
    model = small_moe("qwen3_moe").eval().cuda()
    reference = copy.deepcopy(model)
    fx_offload.compile_forward(model, dynamic=True, inner_backend="aot_eager",
                               host_compute="auto")
    seen = set()
    with torch.no_grad():
        for seed in range(2 + trial.SETTLE + trial.ROUNDS * 3 * 2 + 4):
            ids = torch.randint(0, 256, (2, 1), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(seed))
            got = model(ids, use_cache=False).logits
            torch.testing.assert_close(got, reference(ids, use_cache=False).logits, **FP32)
            torch.cuda.synchronize()        # the events are read at the next call
            seen.add(tuple(sorted(set(fx_offload.report(model).ran_on.values()))))
    assert {("split 1",), ("host",), ("device",)} <= seen
    timer = registry.state_for_model(model).host_experts.timer
    assert timer.trials[(2, 2)].best in (1, 0, 2)
    assert "'auto' at 2 token(s) a call: split 1 " in str(fx_offload.report(model))
    assert ": keeps " in str(fx_offload.report(model))


def test_a_call_that_raised_is_not_timed(monkeypatch):
    """The leave hook runs for a call that raised too (torch gives it no output): that call's
    time is no plan's, so its start is dropped instead of ended."""
    from fx_offload.placement import LeaveCall
    from fx_offload.runtime.experts.host_experts import HostExperts
    ended = []

    class Timer:
        def end(self, stream):
            ended.append("end")

        def discard(self):
            ended.append("discard")

    host = HostExperts.__new__(HostExperts)
    host.timer, host._state = Timer(), types.SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for completed in (False, True):
        host._call = (1, 0)
        host.end_call(completed)
        assert host._call is None
    assert ended == ["discard", "end"]
    # the hook tells the two apart by the output torch hands it
    left = []
    state = types.SimpleNamespace(leave=lambda completed: left.append(completed))
    monkeypatch.setattr(registry, "state_for_model", lambda module: state)
    LeaveCall.__call__(object.__new__(LeaveCall), None, (), None)
    LeaveCall.__call__(object.__new__(LeaveCall), None, (), torch.zeros(1))
    assert left == [False, True]
