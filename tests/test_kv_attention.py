"""Attention over the host KV cache computed on the host (``kv_cache="host"`` with
``host_compute``): the kernel against torch's attention in fp64; the graph (one
``kv_attend`` per host layer in a decode graph, a golden of one); greedy tokens and the
cache's contents against the same model with its cache on the device; a prefill of dynamic
shapes on the device; what ``report`` says; the choice's reasons; attentions the pass must
not rewrite.  CPU here; the GPU case carries the ``cuda`` marker."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

import fx_offload
from fx_offload.host_compute import attention as kernel
from fx_offload.kv import host_attention, kv_ops, runtime_of

transformers = pytest.importorskip("transformers", reason="install the test extra")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
needs_cc = pytest.mark.skipif(kernel.library() is None, reason="no C compiler")


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1, 700, 64, 533, "bool"),
                                   (2, 4, 4, 3, 300, 16, 300, "float"),
                                   (1, 32, 8, 1, 2048, 128, 2000, "heads"),
                                   (2, 6, 3, 2, 100, 40, 77, None)])
def test_kernel_equals_torch_attention_in_fp64(dtype, shape):
    """Grouped-query heads, several query tokens, head sizes that are no multiple of a
    register, bool / float / per-head masks or none, a valid length under the cache's:
    within 2e-5 of torch's attention in fp64 on the same (rounded) inputs."""
    b, h, kvh, nq, t, d, valid, kind = shape
    torch.manual_seed(0)
    q = torch.randn(b, h, nq, d)
    k, v = (torch.randn(b, kvh, t, d).to(dtype) for _ in range(2))
    keep = torch.zeros(b, h if kind == "heads" else 1, nq, t, dtype=torch.bool)
    keep[..., :valid] = True
    keep[..., 3] = False
    bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    if kind == "float":
        bias[..., :valid] += torch.randn(b, 1, nq, valid)
    expected = F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(h // kvh, 1),
        v.double().repeat_interleave(h // kvh, 1), scale=0.3,
        attn_mask=None if kind is None else bias.double())
    got = kernel.attend(kernel.library(), q, k, v, valid if kind else t,
                        None if kind is None else bias, 0.3)
    assert (got.double() - expected).abs().max() < 2e-5


@needs_cc
def test_kernel_a_row_masked_out_entirely_gives_zeros():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 64, 16)
    bias = torch.zeros(1, 2, 1, 64)
    bias[0, 1] = float("-inf")
    out = kernel.attend(kernel.library(), q, k, k.clone(), 64, bias, None)
    assert torch.equal(out[0, 1], torch.zeros(1, 16)) and out[0, 0].abs().sum() > 0


@needs_cc
@pytest.mark.parametrize("case", ["valid", "reads further", "no bias", "nothing written"])
def test_a_queued_job_finds_its_valid_tokens_as_the_op_did(case):
    """The job a CUDA stream runs reads its valid tokens when it runs: one past the largest
    position written, or the whole cache where there is no bias or the bias lets a row read
    further.  Run here directly: the same output as :func:`attend` given those tokens, and
    the tokens in its record."""
    import ctypes
    from fx_offload.host_compute import native
    torch.manual_seed(0)
    b, h, kvh, t, d = 2, 8, 2, 600, 64
    q = torch.randn(b, h, 1, d)
    k, v = (torch.randn(b, kvh, t, d).to(torch.bfloat16) for _ in range(2))
    index = torch.tensor([] if case == "nothing written" else [299], dtype=torch.int64)
    bias = torch.full((b, 1, 1, t), float("-inf"))
    bias[..., :0 if case == "nothing written" else 300] = 0.0
    if case == "reads further":
        bias[1, 0, 0, 450] = 0.5
    tokens = {"valid": 300, "reads further": t, "no bias": t, "nothing written": 0}[case]
    bias = None if case == "no bias" else bias
    expected = kernel.attend(kernel.library(), q, k, v, tokens, bias, 0.2, threads=3)
    floats, chunks = kernel.scratch_floats(q.shape, kvh, t, d, 3)
    out, scratch = torch.full_like(expected, float("nan")), torch.empty(floats)
    job, record = kernel.AttendJob(), native.JobRecord()
    kernel.fill_job(job, q, k, v, index, bias, 0.2, out, scratch, chunks, record, 3)
    kernel.library().fx_attend_run(ctypes.addressof(job))
    assert torch.equal(out, expected) and record[0] == tokens and job.done == 1
    assert record[2] >= record[1] > 0


def test_a_capture_with_no_call_of_its_shapes_before_is_refused(monkeypatch):
    """Under CUDA graphs a job takes buffers made at an earlier call of its shapes (the
    warm-up); a capture that finds none is refused with what to do, before anything is
    queued."""
    monkeypatch.setattr(host_attention, "capturing", lambda: True)
    jobs = object.__new__(host_attention._Jobs)     # (no stream: nothing is queued)
    jobs.fixed, jobs.threads = {}, 2
    keys = torch.zeros(1, 2, 64, 16)
    with pytest.raises(fx_offload.OffloadError, match="no call of its shapes before"):
        jobs.run(3, torch.zeros(1, 4, 1, 16), None, torch.zeros(1, dtype=torch.int64), keys,
                 keys.clone(), None, fixed=True)
    assert jobs.fixed == {}


def _pair(host_compute="always", **kv):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    weights = dict(group_size=4, num_in_group=1, inner_backend="aot_eager")
    fx_offload.compile_forward(reference, **weights)
    fx_offload.compile_forward(model, kv_cache="host", kv_block_size=16,
                               host_compute=host_compute, **kv, **weights)
    return reference, model


def _generate(model, ids, cache, new=10):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False,
                              past_key_values=cache, output_logits=True,
                              return_dict_in_generate=True)


def _cache(model, batch, length):
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    cache.early_initialization(batch, CONFIG["num_key_value_heads"], 16, torch.float32,
                               torch.device("cpu"))
    return cache


def _render(graph) -> str:
    """The graph's host KV ops, attentions and cache writes, one a line, in graph order; the
    runtime's handle (a count of the process's models) as ``h``."""
    handles = {kv_ops.BEGIN: 4, kv_ops.UPDATE: 7, kv_ops.ATTEND: 8, kv_ops.JOIN: 1}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return repr(a)
    lines = []
    for node in graph.nodes:
        name = str(node.target) if node.target in handles else \
            getattr(node.target, "__name__", str(node.target))
        if node.target in handles or name in ("scaled_dot_product_attention", "index_copy_"):
            args = [arg(a) for a in node.args]
            if node.target in handles:
                args[handles[node.target]] = "h"
            args += [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name} = {name}({', '.join(args)})")
    return "\n".join(lines) + "\n"


@needs_cc
@pytest.mark.parametrize("kv", [{}, dict(kv_layers=[1, 3], kv_slots=1)])
def test_decode_attends_on_the_host_tokens_and_cache_equal(kv, monkeypatch):
    """host_compute='always': each decode step's graph attends on the host for every host
    layer (its graph holds one kv_attend per host layer and no kv_update; with two host
    layers of four, a golden in golden_graphs/kv_host_attention_decode.expect); the greedy
    tokens of three generates in a row, every valid position of the cache and the logits
    (within fp32 rounding: the offloaded layer's MLP runs on the host too) equal the model
    with its cache on the device; report says where the attention ran and what it read."""
    from fx_offload.kv import reroute
    reference, model = _pair(**kv)
    ids = torch.randint(0, 128, (2, 37))
    graphs = []
    original = reroute.apply

    def keep(gm, runtime, layers, attended=None):
        original(gm, runtime, layers, attended)
        graphs.append(gm.graph)
    monkeypatch.setattr(reroute, "apply", keep)
    for _ in range(3):
        cache_ref, cache = _cache(reference, 2, 64), _cache(model, 2, 64)
        expected = _generate(reference, ids, cache_ref)
        got = _generate(model, ids, cache)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # (close, not equal: the offloaded layer's MLP runs on the host too)
        for mine, theirs in zip(cache.layers, cache_ref.layers):
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                torch.testing.assert_close(a[:, :, :46], b[:, :, :46], rtol=1e-5, atol=1e-5)
    runtime = runtime_of(model)
    hosted = kv.get("kv_layers", [0, 1, 2, 3])
    assert runtime.hosting[1] == {layer: "host" for layer in hosted}
    assert len(set(graphs)) == 2    # the prefill's graph and the decode step's, once each
    for graph in set(graphs):
        targets = [n.target for n in graph.nodes]
        assert targets.count(kv_ops.ATTEND) == len(hosted)
        assert kv_ops.UPDATE not in targets and targets.count(kv_ops.JOIN) == 1
        # the device layers' writes alone are left
        assert sum(n.target == "index_copy_" for n in graph.nodes) == 2 * (4 - len(hosted))
    if kv:      # the decode step's graph: its query is one token, of a static size
        from test_golden import check_golden
        (decode,) = [g for g in set(graphs) if any(
            n.target is kv_ops.ATTEND and n.args[1].meta["example_value"].shape[2] == 1
            for n in g.nodes)]
        check_golden("kv_host_attention_decode", _render(decode))
    rep = fx_offload.report(model)
    assert rep.kv["attended"] == hosted
    per_token = 2 * 2 * 16 * 4 * 2          # batch 2, 2 heads, 16 dims, fp32, K and V
    assert rep.kv["attended_read"] == len(hosted) * 46 * per_token
    assert rep.kv["copied_per_step"] == 0
    assert f"computed layers {hosted} on the host" in str(rep)
    # the prefill's graph has dynamic shapes: its op chose the device for 2 x 37 tokens
    assert runtime.hosting["dynamic"] == {layer: "host" for layer in hosted}
    cache_ref, cache = _cache(reference, 2, 64), _cache(model, 2, 64)
    assert torch.equal(_generate(model, ids, cache, new=1).sequences,
                       _generate(reference, ids, cache_ref, new=1).sequences)
    rep = fx_offload.report(model)
    assert rep.kv["attended"] == [] and rep.kv["attended_on_device"] == hosted
    assert "on the device (more query rows than the host takes" in str(rep)


@needs_cc
def test_dynamic_shapes_attend_on_the_host_call_by_call():
    """compile_forward(dynamic=True): graphs of symbolic sizes (the cache's length, the
    prompt's) are rewritten too, and each call chooses by its own shapes: two generates with
    caches of two lengths give the reference's tokens, their decode steps on the host (two
    layers: what is checked is per layer)."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**CONFIG, "num_hidden_layers": 2})).eval()
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    fx_offload.compile_forward(reference, inner_backend="aot_eager", dynamic=True)
    fx_offload.compile_forward(model, inner_backend="aot_eager", dynamic=True,
                               kv_cache="host", kv_block_size=16, host_compute="always")
    ids = torch.randint(0, 128, (1, 7))
    for length in (40, 56):
        expected = _generate(reference, ids, _cache(reference, 1, length), new=4)
        got = _generate(model, ids, _cache(model, 1, length), new=4)
        assert torch.equal(got.sequences, expected.sequences)
        assert fx_offload.report(model).kv["attended"] == [0, 1]
    assert set(runtime_of(model).hosting["dynamic"].values()) == {"host"}


def _repeat_kv(x, n):
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)


def _small(attention_impl=None):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 2})
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    if attention_impl is not None:
        model.config._attn_implementation = attention_impl
    copied = copy.deepcopy(model)
    fx_offload.compile_forward(copied, kv_cache="host", host_compute="always",
                               inner_backend="aot_eager", group_size=2, num_in_group=1)
    return model, copied


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=5, do_sample=False,
                              cache_implementation="static", output_logits=True,
                              return_dict_in_generate=True)


@needs_cc
def test_an_attention_without_a_mask_reads_the_whole_cache():
    """An attention of the user's (registered with transformers) that takes no mask reads
    every position of the static cache, the unwritten ones too: so does the host's, exactly
    (it read only the written tokens once: other logits, silently)."""
    def no_mask(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
        n = module.num_key_value_groups
        out = F.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n),
                                             scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register("fx_offload_test_no_mask", no_mask)
    eager, model = _small("fx_offload_test_no_mask")
    ids = torch.randint(0, 128, (2, 9))
    expected, got = _greedy(eager, ids), _greedy(model, ids)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fx_offload.report(model).kv["attended"] == [0, 1]


@needs_cc
def test_an_attention_scale_given_per_call_is_right_at_each_value():
    """The attention's scale as the caller gives it, changed between sequences: each value
    gives the eager model's logits on the host.  (Dynamo may also take such a float as an
    input of the graph, a node that reads it: with ``dynamic=True`` it did for transformers'
    ``scaling`` in a 32-layer Llama, where the pass had refused it as "not a constant" and
    every layer streamed.  The op now takes that node and reads the value at each call;
    here Dynamo compiles one graph per value instead, which this checks end to end.)"""
    def given_scale(module, q, k, v, mask, dropout=0.0, scaling=None, fx_scale=None, **kw):
        n = module.num_key_value_groups
        out = F.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n),
                                             attn_mask=mask, scale=fx_scale)
        return out.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register("fx_offload_test_given_scale", given_scale)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 2})
    eager = transformers.LlamaForCausalLM(config).eval()
    eager.generation_config.eos_token_id = None
    eager.config._attn_implementation = "fx_offload_test_given_scale"
    model = copy.deepcopy(eager)
    fx_offload.compile_forward(model, kv_cache="host", host_compute="always", dynamic=True,
                               inner_backend="aot_eager", group_size=2, num_in_group=1)
    ids = torch.randint(0, 128, (1, 9))
    results = []
    # a prefill and three decode steps, called as generate does; a change of the scale
    # compiles anew with the scale as an input (Dynamo's automatic dynamic): the last two
    for scale in (0.25, 4.0, 1.0):
        caches = {m: _cache(m, 1, 16) for m in (eager, model)}
        step = {m: ids for m in caches}
        for position in range(4):
            start = 0 if position == 0 else 8 + position
            logits = {}
            for m, cache in caches.items():
                with torch.no_grad():
                    n = step[m].shape[1]
                    logits[m] = m(step[m], past_key_values=cache, fx_scale=scale,
                                  cache_position=torch.arange(start, start + n)).logits[:, -1]
                step[m] = logits[m].argmax(-1, keepdim=True)
            torch.testing.assert_close(logits[model], logits[eager], rtol=1e-5, atol=1e-5)
            assert fx_offload.report(model).kv["attended"] == [0, 1], (scale, position)
        results.append(logits[eager])
    assert not torch.allclose(results[0], results[1])


@needs_cc
def test_an_attention_before_the_steps_write_is_refused_not_rewritten(monkeypatch):
    """An attention that reads the cache before the step writes it (a patched forward):
    the op, which writes then attends, would see the step's own token; the layer is left to
    the reroute, which refuses it as it does under host_compute='never'."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        shape = hidden_states.shape[:-1]
        heads = (*shape, -1, self.head_dim)
        q, k, v = (p(hidden_states).view(heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        layer = past_key_values.layers[self.layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(k, v)
        idx = torch.arange(k.shape[-2]) + layer.cumulative_length
        layer.cumulative_length.add_(k.shape[-2])
        n = self.num_key_value_groups
        o = F.scaled_dot_product_attention(q, _repeat_kv(layer.keys, n),
                                           _repeat_kv(layer.values, n),
                                           attn_mask=attention_mask, scale=self.scaling)
        layer.keys.index_copy_(2, idx, k)
        layer.values.index_copy_(2, idx, v)
        return self.o_proj(o.transpose(1, 2).reshape(*shape, -1).contiguous()), None
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    _, model = _small()
    with pytest.raises(Exception, match="reads cache layer 0 before the step writes it"):
        _greedy(model, torch.randint(0, 128, (2, 9)))


def test_auto_on_a_cpu_device_keeps_the_attention_on_the_device():
    """'auto' on a CPU device: no kv_attend, tokens as before, report silent about it
    beyond the reason recorded per graph."""
    reference, model = _pair("auto")
    ids = torch.randint(0, 128, (1, 9))
    assert torch.equal(_generate(model, ids, _cache(model, 1, 32)).sequences,
                       _generate(reference, ids, _cache(reference, 1, 32)).sequences)
    runtime = runtime_of(model)
    assert set(runtime.hosting[1].values()) == {
        "streamed: host_compute='auto' on a CPU device (there is no link to spare)"}
    assert fx_offload.report(model).kv["attended"] == []


def _found(rows, dynamic=False):
    return host_attention.Found(None, [], None, None, None, rows, dynamic)


@pytest.mark.parametrize("mode, torch_mode, rows, device, why", [
    ("never", "default", 4, "cuda", "host_compute='never'"),
    ("always", "reduce-overhead", 4, "cuda", None),
    ("always", "reduce-overhead", "dynamic", "cuda", "a graph of dynamic shapes under CUDA"),
    ("auto", "default", 4, "cpu", "on a CPU device"),
    ("auto", "default", 9, "cuda", "more than 8 query rows per KV head"),
    ("always", "default", 64, "cpu", None),
])
def test_the_choice_and_its_reasons(monkeypatch, mode, torch_mode, rows, device, why):
    """The rule, layer by layer: a layer the pass cannot rewrite streams with its own reason;
    the others are on the host, or all stream with one reason.  Under CUDA graphs a graph of
    static shapes records its jobs as host nodes; one of dynamic shapes streams (a prefill
    call would copy the cache in from inside the capture)."""
    monkeypatch.setattr(kernel, "library", lambda: object())
    options = types.SimpleNamespace(host_compute=mode, mode=torch_mode)
    runtime = types.SimpleNamespace(device=torch.device(device))
    found = _found(4, dynamic=True) if rows == "dynamic" else _found(rows)
    got = host_attention.choose(options, runtime, {0: found, 1: "its heads are wider"})
    assert got[1] == "streamed: its heads are wider"
    assert got[0] == "host" if why is None else (got[0].startswith("streamed: ") and
                                                 why in got[0])


@pytest.mark.parametrize("host_rate, hosted", [(50e9, False), (68.7e9, False),
                                                (90e9, True)])
def test_auto_weighs_the_kernels_measured_rate_against_the_link(monkeypatch, host_rate,
                                                                  hosted):
    """On a GPU, 'auto' takes the host where its kernel reads the cache 1.5x as fast as the
    link copies it (a 16-core H200 host's kernel, 68.7 GB/s against 55, streamed faster:
    the device)."""
    from fx_offload.host_compute import rates
    monkeypatch.setattr(kernel, "library", lambda: object())
    monkeypatch.setattr(kernel, "rate", lambda: host_rate)
    monkeypatch.setattr(rates, "host_rates", lambda device: rates.HostRates(
        read_rate=90e9, flop_rate=1e12, latency=1e-4, link_rate=55e9))
    options = types.SimpleNamespace(host_compute="auto", mode="default")
    runtime = types.SimpleNamespace(device=torch.device("cuda"))
    got = host_attention.choose(options, runtime, {0: _found(4)})
    assert (got[0] == "host") == hosted
    if not hosted:
        assert f"reads the cache at {host_rate / 1e9:.0f} GB/s, not 1.5x the link's 55 GB/s" \
            in got[0]


@needs_cc
def test_the_kernels_rate_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("FX_OFFLOAD_CACHE_DIR", str(tmp_path))
    first = kernel.rate()
    assert first > 1e8
    monkeypatch.setattr(kernel, "attend", lambda *a, **k: pytest.fail("measured again"))
    assert kernel.rate() == first


def test_always_without_a_c_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(kernel, "library", lambda: None)
    options = types.SimpleNamespace(host_compute="always", mode="default")
    runtime = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(fx_offload.OffloadError, match="needs a C compiler"):
        host_attention.choose(options, runtime, {0: _found(1)})


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_on_gpu_decode_attends_on_the_host_within_bf16_rounding(graphs):
    """Inductor inside, bf16, a GPU: the decode graph attends on the host, each layer a job
    queued on a stream (under CUDA graphs, a host node the replays run); logits of each
    step within bf16 rounding of the device cache's (the host sums in fp32 and rounds
    once); report reads what the last call's jobs did, a replay's too."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    reference = reference.to("cuda", torch.bfloat16)
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    fx_offload.compile_forward(reference, group_size=4, num_in_group=1)
    fx_offload.compile_forward(model, kv_cache="host", kv_block_size=16,
                               host_compute="always", group_size=4, num_in_group=1,
                               **(dict(mode="reduce-overhead", dynamic=False) if graphs
                                  else {}))
    ids = torch.randint(0, 128, (2, 50), device="cuda")
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static",
                  output_logits=True, return_dict_in_generate=True)
        expected, got = reference.generate(ids, **kw), model.generate(ids, **kw)
    compared = 0
    for i, (a, b) in enumerate(zip(got.logits, expected.logits)):
        # greedy tokens of random weights may part at a near-tie; compared while the same
        if not torch.equal(got.sequences[:, :50 + i], expected.sequences[:, :50 + i]):
            break
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
        compared += 1
    assert compared >= 2        # the prefill and at least the first decode step
    rep = fx_offload.report(model)
    assert rep.kv["attended"] == [0, 1, 2, 3]
    # the last decode step's four jobs, queued on a stream, read the 57 valid tokens
    per_token = 2 * 2 * 16 * 2 * 2          # batch 2, 2 heads, 16 dims, bf16, K and V
    assert rep.kv["attended_read"] == 4 * 57 * per_token
    assert rep.kv["attended_jobs"][0] == 4 and "its 4 jobs on the host ran" in str(rep)
    runtime = runtime_of(model)
    if graphs:      # the decode steps' jobs were recorded, and no slot is filled for them
        assert runtime.hosting[1] == {layer: "host" for layer in range(4)}
        assert len(runtime.attention.recorded) == 4 and not runtime.before_replay.begun
        for _ in range(2):      # new caches: graphs recorded again, each job its own cache
            cache = transformers.StaticCache(config=model.config, max_cache_len=58)
            with torch.no_grad():
                again = model.generate(ids, max_new_tokens=8, do_sample=False,
                                       past_key_values=cache)
            assert torch.equal(again, got.sequences)
            assert fx_offload.report(model).kv["attended"] == [0, 1, 2, 3]
