"""Golden graphs: the plan and the rewritten graph of each scenario, normalized, in
``golden_graphs/<scenario>.expect``.  ``EXPECTTEST_ACCEPT=1 python -m pytest
tests/test_golden.py`` rewrites them; otherwise a change fails with a unified diff naming the
file.  Each golden is paired with an output check of the same scenario, and the slot-safety
verifier runs on every rewritten graph (``explain`` runs it)."""
import copy
import difflib
import os
import re
from pathlib import Path

import pytest
import torch

import fx_offload
from fx_offload.tools import models
from fx_offload import explain

GOLDEN = Path(__file__).resolve().parent.parent / "golden_graphs"
ACCEPT = os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0")

# name: (model, build kwargs, options, dynamic, aten)
SCENARIOS = {
    "mlp_g2_n1_s1": ("mlp", {"num_layers": 6}, dict(group_size=2, num_in_group=1), False, True),
    "mlp_g4_n2_s2": ("mlp", {"num_layers": 8}, dict(group_size=4, num_in_group=2,
                                                    prefetch_step=2), False, False),
    "mlp_g8_n2_s1_16layers": ("mlp", {"num_layers": 16}, dict(group_size=8, num_in_group=2),
                              False, False),
    "mlp_all_s3_wraparound": ("mlp", {"num_layers": 7}, dict(group_size=1, num_in_group=1,
                                                             prefetch_step=3), False, False),
    "mlp_g3_n1_s2_odd": ("mlp", {"num_layers": 9}, dict(group_size=3, num_in_group=1,
                                                        prefetch_step=2), False, False),
    # the circular prefetch at the next call's entry: the refills at the top of the graph
    "mlp_g2_n1_s2_circular_at_entry": ("mlp", {"num_layers": 8},
                                       dict(group_size=2, num_in_group=1, prefetch_step=2,
                                            circular_prefetch="entry"), False, True),
    "split_mlp_graph_break_circular_at_entry": ("split_mlp", {"num_layers": 6, "split": 3},
                                                dict(group_size=2, num_in_group=1,
                                                     circular_prefetch="entry"), False, False),
    "mlp_dynamic": ("mlp", {"num_layers": 6}, dict(group_size=2, num_in_group=1), True, False),
    "split_mlp_graph_break": ("split_mlp", {"num_layers": 6, "split": 3},
                              dict(group_size=2, num_in_group=1, prefetch_step=2), False, False),
    "decoder_tuple_g2_n1_s2": ("decoder", {"num_layers": 6}, dict(group_size=2, num_in_group=1,
                                                                  prefetch_step=2), False, False),
    "decoder_q_proj_only": ("decoder", {"num_layers": 4},
                            dict(group_size=1, num_in_group=1, prefetch_step=2,
                                 offload_params=["self_attn.q_proj"]), False, False),
    "moe_g2_n1_s1": ("moe", {"num_layers": 4}, dict(group_size=2, num_in_group=1), False, True),
    "moe_experts_only": ("moe", {"num_layers": 6}, dict(group_size=2, num_in_group=1,
                                                        prefetch_step=2,
                                                        offload_params=["w13_weight",
                                                                        "w2_weight"]),
                         False, False),
    "moe_dense_layers_skipped": ("moe", {"num_layers": 6, "dense_every": 3},
                                 dict(group_size=1, num_in_group=1, prefetch_step=2,
                                      offload_params=["experts"]), False, False),
    # experts read only by the router's picks: their chunks get wait_routed (experts="routed")
    "moe_routed_experts": ("moe", {"num_layers": 4, "routed": True, "batch": 1, "seq": 1},
                           dict(group_size=2, num_in_group=1), False, False),
    # every layer offloaded in two slots: the refill's other chunks start behind the routed
    # waits (the link idles there while the gathered experts are computed on)
    "moe_routed_refills_behind_gathers": ("moe", {"num_layers": 4, "routed": True, "batch": 1,
                                                  "seq": 1},
                                          dict(group_size=1, num_in_group=1,
                                               prefetch_step=2), False, False),
    # host_compute="always": each routed layer's experts module is one host_experts op, with
    # no wait for its expert tensors; the other chunks wait and refill as before
    "moe_host_experts": ("moe", {"num_layers": 4, "routed": True, "batch": 1, "seq": 1},
                         dict(group_size=2, num_in_group=1, host_compute="always"), False,
                         True),
    # only the experts offloaded: a layer left with no wait at all, its refill after the op
    "moe_host_experts_only": ("moe", {"num_layers": 4, "routed": True, "batch": 1, "seq": 1},
                              dict(group_size=2, num_in_group=1, host_compute="always",
                                   offload_params=["experts"]), False, False),
    # host_compute="always": each offloaded layer's gated MLP is one host_mlp op, its three
    # weights chunks of their own that no wait names; attention waits and refills as before
    "decoder_host_mlp": ("decoder", {"num_layers": 4}, dict(group_size=2, num_in_group=1,
                                                            host_compute="always"), False, False),
    # dense and MoE layers (different parameters) offloaded into one slot, sized to the MoE
    "moe_dense_and_moe_layers_share_a_slot": ("moe", {"num_layers": 6, "dense_every": 3},
                                              dict(group_size=1, num_in_group=1,
                                                   prefetch_step=1), False, False),
}

# scenarios whose host kernel sums in fp32 in another order than the reference's matmuls
HOST_SUMS = {"decoder_host_mlp"}


def render(name) -> tuple[str, object]:
    model_name, kwargs, options, dynamic, aten = SCENARIOS[name]
    model, inputs = models.build(model_name, **kwargs)
    explanation = explain(model, *inputs, aten=aten, dynamic=dynamic or None, **options)
    text = f"# scenario {name}: {model_name} {kwargs}, dynamic={dynamic}\n{explanation}"
    return text, explanation


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.expect"
    if ACCEPT:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"{path.relative_to(GOLDEN.parent)} is missing; create it with "
                    "EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py")
    want = path.read_text()
    if want != text:
        diff = "".join(difflib.unified_diff(
            want.splitlines(True), text.splitlines(True),
            fromfile=f"golden_graphs/{name}.expect", tofile=f"{name} (this run)"))
        pytest.fail(f"golden graph golden_graphs/{name}.expect changed (rerun with "
                    f"EXPECTTEST_ACCEPT=1 to accept, then review the diff):\n{diff}")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_graph(name):
    text, explanation = render(name)
    assert "/" not in text.replace(" / ", ""), "a path leaked into the golden"
    check_golden(name, text)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_scenario_outputs(name):
    """The scenario's compiled + offloaded outputs equal the model without offloading."""
    model_name, kwargs, options, dynamic, aten = SCENARIOS[name]
    model, inputs = models.build(model_name, **kwargs)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**options, "inner_backend": "aot_eager"},
                             dynamic=dynamic or None)
    with torch.no_grad():
        for call in range(3):
            x = inputs if call == 0 else tuple(
                torch.randint_like(t, 0, 256) if t.dtype == torch.long else torch.randn_like(t)
                for t in inputs)
            got, want = compiled(*x), reference(*x)
            if name in HOST_SUMS:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, want), f"call {call}"
    rep = fx_offload.report(model)
    _, explanation = render(name)
    assert rep.layers == explanation.choice.layers


def test_regenerating_twice_gives_identical_text():
    first, _ = render("decoder_tuple_g2_n1_s2")
    torch._dynamo.reset()
    second, _ = render("decoder_tuple_g2_n1_s2")
    assert first == second


def test_explain_leaves_the_model_untouched():
    model, inputs = models.build("mlp", num_layers=4)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    explanation = explain(model, *inputs, group_size=2)
    assert fx_offload.registry.state_for_model(model) is None
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1])
    assert [r.plan is not None for r in explanation.graphs] == [True]
    assert ">>> wait_prefetch(layer 1 chunk 0)" in str(explanation)


@pytest.mark.parametrize("options", [dict(group_size=4, num_in_group=2),
                                     dict(memory_budget="40KiB", flop_rate=1e12,
                                          memory_bandwidth=1e11, h2d_bandwidth=1e10,
                                          launch_overhead=5e-6)])
def test_explain_of_an_offloaded_model_with_other_options_explains_those(options):
    """What other options would do to a model already offloaded: the plan and graphs they
    give the same model not offloaded, and the offloaded model keeps its own offload, its
    weights and its outputs."""
    model, (x,) = models.build("mlp", num_layers=8)
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "eager"})
    with torch.no_grad():
        expected = compiled(x)
    state = fx_offload.registry.state_for_model(model)
    truth = {n: t.clone() for n, t in fx_offload.named_weights(model)}
    other = explain(model, x, **options)
    torch._dynamo.reset()
    want = explain(plain, x, **options)
    assert other.choice.layers == want.choice.layers != state.choice.layers
    timeless = lambda e: re.sub(r"in \d+ ms", "", str(e))     # the planner's own time
    assert timeless(other) == timeless(want)
    assert fx_offload.registry.state_for_model(model) is state
    assert fx_offload.report(model).layers == [1, 3, 5, 7]
    for n, t in fx_offload.named_weights(model):
        assert torch.equal(t, truth[n]), n
    with torch.no_grad():
        assert torch.equal(compiled(x), expected)
