"""Under load: random configurations (hypothesis) and long runs with changing shapes."""
import copy
import gc

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fx_offload
from fx_offload.tools import models

PARAM_CHOICES = {
    "mlp": [["fc1"], ["fc2.weight"], ["fc1.bias", "fc2"]],
    "decoder": [["self_attn"], ["mlp.down_proj"], ["input_layernorm", "q_proj"]],
    "moe": [["experts"], ["w13_weight"], ["w2_weight_scale", "gate"]],
}


@st.composite
def configs(draw):
    name = draw(st.sampled_from(sorted(PARAM_CHOICES)))
    layers = draw(st.integers(2, 9))
    group = draw(st.integers(1, layers))
    num = draw(st.integers(1, group))
    offloaded = sum(1 for i in range(layers) if i % group >= group - num)
    step = draw(st.integers(1, max(1, offloaded)))
    params = draw(st.sampled_from([None] + PARAM_CHOICES[name]))
    inner = draw(st.sampled_from(["eager", "aot_eager"]))
    circular = draw(st.sampled_from(["end", "entry"]))
    chunks = draw(st.sampled_from([1, 2, 8]))
    return name, layers, dict(group_size=group, num_in_group=num, prefetch_step=step,
                              offload_params=params, inner_backend=inner,
                              circular_prefetch=circular, copy_chunks=chunks)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(configs())
def test_random_configurations_match_the_model(config):
    name, layers, options = config
    torch._dynamo.reset()
    model, inputs = models.build(name, num_layers=layers)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={k: v for k, v in options.items() if v is not None})
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs)), config
    rep = fx_offload.report(model)
    assert rep.layers and all(i % options["group_size"] >= options["group_size"] -
                              options["num_in_group"] for i in rep.layers)
    # every layer was copied in ahead of its reads, wherever the circular prefetch starts
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0, config


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_thousand_calls_with_changing_batch_sizes():
    model, (x,) = models.build("mlp", num_layers=8, hidden=64, inner=128)
    reference = copy.deepcopy(model)
    compiles = []
    import fx_offload.compiler as compiler
    real = compiler.compile_graph

    def counting(*args, **kwargs):
        compiles.append(1)
        return real(*args, **kwargs)

    compiler.compile_graph, saved = counting, compiler.compile_graph
    try:
        compiled = torch.compile(model, backend="prefetch_offload", dynamic=True,
                                 options={"inner_backend": "aot_eager", "prefetch_step": 2})
        with torch.no_grad():
            checked = 0
            for call in range(1000):
                batch = 1 + (call * 7) % 13
                x = torch.randn(batch, 64)
                out = compiled(x)
                if call % 50 == 0:
                    assert torch.equal(out, reference(x)), call
                    checked += 1
                if call == 100:
                    gc.collect()
                    rss_100 = _rss()
            gc.collect()
            rss_1000 = _rss()
    finally:
        compiler.compile_graph = saved
    # batch 1 is specialized by Dynamo, every other size shares one dynamic graph
    assert len(compiles) <= 2, len(compiles)
    assert rss_1000 - rss_100 < 16 * 2**20, (rss_100, rss_1000)
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["sync_loads"] == 0 and not state.contents.pending()
    assert checked == 20
