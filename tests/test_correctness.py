"""Compiled + offloaded outputs equal the model without offloading, call after call."""
import pytest
import torch

import fx_offload
from helpers import compile_pair, fresh_inputs

FAST = ["eager", "aot_eager"]


def check_calls(name, options, calls=3, build_kwargs=None):
    model, compiled, reference, inputs = compile_pair(name, options, build_kwargs)
    inner = options.get("inner_backend", "inductor")
    ref_fn = (torch.compile(reference, backend="inductor") if inner == "inductor"
              else reference)
    with torch.no_grad():
        for call in range(calls):
            args = inputs if call == 0 else fresh_inputs(name, inputs, call)
            got, want = compiled(*args), ref_fn(*args)
            assert torch.equal(got, want), (
                f"call {call}: max diff {(got - want).abs().max().item()}")
    return model


CONFIGS = [  # (group_size, num_in_group, prefetch_step, layers)
    (2, 1, 1, 8),      # every second layer, one slot
    (4, 2, 2, 8),      # layers 2,3,6,7 in two slots
    (3, 1, 2, 9),      # 3 offloaded, step 2: count not divisible by the step
    (1, 1, 3, 7),      # every layer, 7 offloaded over 3 slots; layer 0 reads a graph input
    (4, 3, 4, 8),      # 6 offloaded, 4 slots
]
CASES = [(name, *cfg) for name in ("mlp", "decoder", "moe") for cfg in CONFIGS]
CASES += [("mlp", 8, 2, 1, 16), ("moe", 8, 2, 2, 16)]   # the brief's 8/2: layers 6, 7, 14, 15


@pytest.mark.parametrize("inner", FAST)
@pytest.mark.parametrize("name,group,num,step,layers", CASES)
def test_outputs_equal_fast_backends(name, inner, group, num, step, layers):
    options = dict(group_size=group, num_in_group=num, prefetch_step=step, inner_backend=inner)
    model = check_calls(name, options, build_kwargs={"num_layers": layers})
    rep = fx_offload.report(model)
    assert rep.layers == [i for i in range(layers) if i % group >= group - num]


@pytest.mark.parametrize("name,group,num,step,layers", [
    ("mlp", 2, 1, 1, 6),
    ("decoder", 3, 2, 3, 6),     # 4 offloaded, 3 slots
    ("moe", 2, 1, 2, 6),         # 3 offloaded, 2 slots, weight-only dequant compute
    ("decoder", 1, 1, 2, 5),     # all layers, odd count
])
def test_outputs_equal_inductor_bitwise(name, group, num, step, layers):
    check_calls(name, dict(group_size=group, num_in_group=num, prefetch_step=step),
                build_kwargs={"num_layers": layers})


@pytest.mark.parametrize("inner", FAST + ["inductor"])
def test_offload_params_subset(inner):
    options = dict(group_size=2, num_in_group=1, prefetch_step=2, inner_backend=inner,
                   offload_params=["w13_weight", "w2_weight"])
    model = check_calls("moe", options, build_kwargs={"num_layers": 6})
    rep = fx_offload.report(model)
    assert rep.params == {i: [f"layers.{i}.mlp.experts.w13_weight",
                              f"layers.{i}.mlp.experts.w2_weight"] for i in (1, 3, 5)}


def test_offload_params_multi_segment_and_skipped_layers():
    # 'self_attn.q_proj' matches two segments; only decoder layers have it
    options = dict(group_size=2, num_in_group=1, inner_backend="eager",
                   offload_params=["self_attn.q_proj"])
    model = check_calls("decoder", options, build_kwargs={"num_layers": 4})
    assert fx_offload.report(model).params == {
        1: ["layers.1.self_attn.q_proj.weight"], 3: ["layers.3.self_attn.q_proj.weight"]}


def test_inference_mode_works():
    model, compiled, reference, inputs = compile_pair("mlp", {"inner_backend": "aot_eager"})
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_dynamic_shapes(inner):
    model, compiled, reference, inputs = compile_pair(
        "decoder", {"inner_backend": inner, "prefetch_step": 2}, {"num_layers": 4},
        dynamic=True)
    ref_fn = torch.compile(reference, backend="inductor", dynamic=True) if inner == "inductor" \
        else reference
    with torch.no_grad():
        for seq in (5, 9, 16, 7):
            ids = torch.randint(0, 256, (2, seq))
            torch.testing.assert_close(compiled(ids), ref_fn(ids), rtol=0, atol=0)


@pytest.mark.parametrize("model_name", ["decoder", "mlp"])
def test_aot_eager_calls_our_ops_in_place(model_name, monkeypatch):
    """inner_backend="aot_eager" runs AOTAutograd's ATen graph as it is: our ops are called
    there directly, not through auto_functionalized_v2 (which clones the activations they
    are tied to and runs its Python at every call), and the outputs stay bitwise."""
    from fx_offload import inner
    made = []
    real = inner.call_in_place

    def spy(gm):
        made.append((real(gm), gm.code))
        return made[-1][0]
    monkeypatch.setattr(inner, "call_in_place", spy)
    model, compiled, reference, inputs = compile_pair(model_name, {"inner_backend": "aot_eager"})
    with torch.no_grad():
        for x in [inputs, fresh_inputs(model_name, inputs, 1), fresh_inputs(model_name, inputs, 2)]:
            assert torch.equal(compiled(*x), reference(*x))
    assert made and all(n > 0 for n, _ in made), made
    code = "\n".join(text for _, text in made)
    assert "auto_functionalized" not in code, code
    assert "fx_offload.wait_prefetch" in code and "fx_offload.start_prefetch" in code, code
