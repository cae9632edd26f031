"""The planner (``memory_budget``): cost model, schedule simulation, choice, budget accounting,
outputs, report/inspect, device-rate cache."""
import copy
import dataclasses
import itertools
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fx_offload
from fx_offload.selection import budget as planner
from fx_offload.selection import device_rates
from fx_offload.tools import models
from fx_offload.benchmarks.bench import schedule_bound
from fx_offload.schedule import Schedule
from fx_offload.selection.budget import simulate, weights_bytes
from fx_offload.selection.stack import find_layer_stack
from helpers import PLANNER_RATES as RATES, experts_alone_budget, small_moe


def compile_planned(name, budget, build_kwargs=None, inner_backend="eager", dynamic=False,
                    **options):
    model, inputs = models.build(name, **(build_kwargs or {}))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", dynamic=dynamic,
                             options=dict(memory_budget=budget, inner_backend=inner_backend,
                                          **RATES, **options))
    with torch.no_grad():
        out = compiled(*inputs)
        expected = reference(*inputs)
    return model, compiled, reference, inputs, out, expected


def layer_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


def device_weights_now(model):
    """Bytes the model's weights take where its non-offloaded weights live: resident
    parameters plus the slot buffers (offloaded parameters point into the slots)."""
    state = fx_offload.registry.state_for_model(model)
    offloaded = {id(p.param) for ps in state.params.values() for p in ps}
    resident = sum(t.numel() * t.element_size()
                   for t in itertools.chain(model.parameters(), model.buffers())
                   if id(t) not in offloaded)
    return resident + state.buffer_bytes


# ---- the schedule simulation ------------------------------------------------------------

def test_simulate_copy_bound_and_compute_bound():
    layers, slots = [1, 3, 5, 7], 2
    schedule = Schedule(layers, slots)
    copy = {layer: 10.0 for layer in layers}
    # copies dominate: every call moves 4 layers one after another on one copy stream
    assert simulate(0, [0.1] * 8, 0, schedule, copy) == pytest.approx(40.0)
    # compute dominates: the copies hide
    assert simulate(0, [30.0] * 8, 0, schedule, copy) == pytest.approx(240.0)
    # without overlap (the CPU) they add
    assert simulate(0, [1.0] * 8, 0, schedule, copy, overlapped=False) == \
        pytest.approx(48.0)
    # the bench's bound is the same simulation
    assert schedule_bound(8, schedule, 30.0, copy) == pytest.approx(240.0)
    assert schedule_bound(8, schedule, 0.1, copy) == pytest.approx(40.0)


def test_one_slot_schedule_waits_for_the_previous_layer():
    # one slot: layer 3's copy starts only after layer 1 ran, and only layer 2 (1 unit) hides
    # its 3 units; likewise layer 1's copy for the next call behind layer 0: 2 + 2 waited
    t = simulate(0, [1.0] * 4, 0, Schedule([1, 3], 1), {1: 3.0, 3: 3.0})
    assert t == pytest.approx(4.0 + 2.0 + 2.0)
    # in two chunks, layer 3's first half copies while layer 1 computes its second half,
    # and layer 3 computes its first half while its second half copies: the copy stream
    # never idles, and the call takes what the copies take (6 units)
    assert simulate(0, [1.0] * 4, 0, Schedule([1, 3], 1), {1: 3.0, 3: 3.0}, chunks=2) == \
        pytest.approx(6.0)
    # compute-bound, the chunks change nothing
    assert simulate(0, [2.0] * 4, 0, Schedule([1, 3], 1), {1: 2.0, 3: 2.0}, chunks=4) == \
        pytest.approx(8.0)
    # two slots would start each copy a call ahead: fully hidden with 4 units per call
    t = simulate(0, [3.0] * 4, 0, Schedule([0, 1, 2, 3], 2), dict.fromkeys(range(4), 3.0))
    assert t == pytest.approx(12.0)


# ---- the cost model ---------------------------------------------------------------------

def _costs_of(name, tokens, **build):
    model, inputs = models.build(name, **build)
    seen = {}

    def backend(gm, example_inputs):
        from fx_offload.selection.costs import graph_costs
        from fx_offload.graph_inputs import read_graph_inputs
        gi = read_graph_inputs(gm, example_inputs)
        stack = find_layer_stack(model, None)
        seen["costs"] = graph_costs(gm, gi, {stack.layer_path(i): i
                                             for i in range(len(stack.modules))})
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(*inputs)
    return model, inputs, seen["costs"]


def test_symbolic_flops_match_the_flop_counter_at_other_sizes():
    model, inputs, costs = _costs_of("mlp", None, batch=5)
    assert costs.symbolic and costs.traced_tokens == 5
    for batch in (3, 17, 64):
        x = torch.randn(batch, inputs[0].shape[1])
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.layers[2](x)
        assert costs.layers[2].flops(batch) == counter.get_total_flops()


def test_attention_flops_are_quadratic_and_causal_is_half():
    _, _, costs = _costs_of("decoder", None, batch=1, seq=6, hidden=32, heads=4, kv_heads=2,
                            inner=64)
    f = costs.layers[0].flops
    linear = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64)     # q, o; k, v; gate, up, down
    causal_attention = 2 * 4 * (8 + 8) // 2   # 2 * heads * (head_dim q.k + v), halved
    for t in (6, 50):
        assert f(t) == pytest.approx(linear * t + causal_attention * t * t)


def test_static_graph_costs_scale_linearly_from_the_traced_shape():
    model, inputs = models.build("mlp", batch=4)
    seen = {}

    def backend(gm, example_inputs):
        from fx_offload.selection.costs import graph_costs
        from fx_offload.graph_inputs import read_graph_inputs
        seen["c"] = graph_costs(gm, read_graph_inputs(gm, example_inputs),
                                {f"layers.{i}": i for i in range(8)})
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(*inputs)
    c = seen["c"]
    assert not c.symbolic and c.traced_tokens == 4
    assert c.layers[0].flops(8) == 2 * c.layers[0].flops(4) > 0


# ---- choosing under a budget ------------------------------------------------------------

@pytest.mark.parametrize("layers_resident", [3.2, 5.0, 6.5])
def test_chosen_plan_fits_the_budget_and_outputs_are_exact(layers_resident):
    probe, _ = models.build("mlp")
    total = weights_bytes(probe, torch.device("cpu"))
    budget = int(total - (8 - layers_resident) * layer_bytes(probe))
    model, compiled, reference, inputs, out, expected = compile_planned("mlp", budget)
    assert torch.equal(out, expected)
    rep = fx_offload.report(model)
    chosen = rep.planner.chosen.candidate
    assert rep.layers == list(chosen.layers) and rep.num_slots == chosen.num_slots
    assert chosen.weights_bytes <= budget
    assert device_weights_now(model) == chosen.weights_bytes
    # the choice is the best prediction among every plan that fits (ties within NEAR)
    result = rep.planner
    best = min(planner.rank(result.fitting, False, result.cost_model,
                            result.plan_tokens), key=lambda s: s.slowdown)
    assert rep.planner.chosen.slowdown <= best.slowdown * planner.NEAR
    assert all(c.weights_bytes <= budget for c in result.fitting)
    for call in range(3):
        x = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(call))
        with torch.no_grad():
            assert torch.equal(compiled(x), reference(x))


def test_decode_moves_fewest_bytes_and_prefill_hides_the_copies():
    probe, _ = models.build("mlp")
    total = weights_bytes(probe, torch.device("cpu"))
    model, *_ = compile_planned("mlp", total - 4 * layer_bytes(probe))
    result = fx_offload.report(model).planner
    # weigh the same plans as on a GPU, where copies overlap compute, with a slow link
    slow = dataclasses.replace(result.cost_model.rates, h2d_bandwidth=1e7)
    cm = planner.CostModel(result.cost_model.costs, slow, 8, overlapped=True)
    decode = planner.rank(result.fitting, False, cm, (1,))[0]
    prefill = planner.rank(result.fitting, False, cm, (1 << 20,))[0]
    # one token: nothing hides a copy, so the plan that copies least wins
    assert decode.candidate.moved_bytes == min(c.moved_bytes for c in result.fitting)
    assert decode.slowdown > 1.5
    # many tokens: enough compute per layer to hide every copy
    assert prefill.slowdown <= planner.HIDDEN_WITHIN
    assert prefill.break_even is not None and prefill.break_even <= 1 << 20


def test_break_even_is_where_the_copies_hide():
    model, *_ = compile_planned("mlp", "60KiB")
    result = fx_offload.report(model).planner
    c, cm = result.chosen.candidate, result.cost_model
    sizes = dict(zip(c.layers, c.layer_bytes))
    be = result.chosen.break_even
    assert be is not None and be > 1
    assert cm.predict(list(c.layers), c.num_slots, sizes, be) <= 1.01 * cm.resident(be)
    assert cm.predict(list(c.layers), c.num_slots, sizes, be - 1) > 1.01 * cm.resident(be - 1)


def test_minimum_budget_is_exact():
    probe, _ = models.build("mlp", num_layers=4)
    with pytest.raises(Exception, match=r"below the least this model can run in") as err:
        compile_planned("mlp", 1000, build_kwargs={"num_layers": 4})
    minimum = int(str(err.value).split("(")[2].split(" bytes")[0].split()[-1])
    expected = weights_bytes(probe, torch.device("cpu")) - 3 * layer_bytes(probe)
    assert minimum == expected
    model, *_, out, ref = compile_planned("mlp", minimum, build_kwargs={"num_layers": 4})
    assert torch.equal(out, ref)
    assert fx_offload.report(model).layers == [0, 1, 2, 3]
    assert device_weights_now(model) == minimum


def test_budget_holding_everything_offloads_nothing(caplog):
    model, compiled, reference, inputs, out, expected = compile_planned("mlp", "1GiB")
    assert torch.equal(out, expected)
    assert fx_offload.registry.state_for_model(model) is None
    rep = fx_offload.report(model)
    assert rep.layers == [] and rep.planner.chosen.candidate is None
    assert "nothing offloaded" in str(rep)
    assert all(p.device.type == "cpu" for p in model.parameters())
    # restore forgets that plan, so another budget can be tried in the same process
    fx_offload.restore(model)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="prefetch_offload",
                            options=dict(memory_budget="60KiB", inner_backend="aot_eager",
                                         **RATES))(*inputs)
    assert torch.equal(out, reference(*inputs))
    assert fx_offload.report(model).layers


def test_offload_params_subsets_are_weighed():
    model, inputs = models.build("moe")
    total = weights_bytes(model, torch.device("cpu"))
    w13 = sum(p.numel() * p.element_size() for n, p in model.layers[0].named_parameters()
              if n.endswith("w13_weight"))
    del model
    budget = total - 2 * w13
    model, compiled, reference, inputs, out, expected = compile_planned(
        "moe", budget, offload_params=["w13_weight", "w2_weight"])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    rep = fx_offload.report(model)
    chosen = rep.planner.chosen.candidate
    assert chosen.params is not None and set(chosen.params) <= {"w13_weight", "w2_weight"}
    for names in rep.params.values():
        assert all(n.split(".")[-1] in chosen.params for n in names)
    assert device_weights_now(model) <= budget


def test_report_and_inspect_show_plan_prediction_and_runner_ups():
    model, *_ = compile_planned("decoder", "600KiB", plan_tokens=[1, 512])
    text = str(fx_offload.report(model))
    for needle in ("planner: memory_budget 600KiB", "device rates: 1 TFLOP/s", "cost model:",
                   "ms at 1", "ms at 512", "hidden from", "*  layers"):
        assert needle in text, text
    assert len(fx_offload.report(model).planner.runner_ups) >= 1
    out = subprocess.run([sys.executable, "-m", "fx_offload", "inspect", "decoder",
                          "--memory-budget", "600KiB", "--plan-tokens", "1,512", "--dynamic"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "planner: memory_budget 600KiB" in out.stdout and "wait" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fx_offload", "inspect", "decoder",
                          "--memory-budget", "1KiB"], capture_output=True, text=True)
    assert bad.returncode == 2 and "raise memory_budget to at least" in bad.stderr


def test_same_model_other_budget_is_refused():
    model, compiled, *_ = compile_planned("mlp", "60KiB")
    _, inputs = models.build("mlp")
    with pytest.raises(Exception, match="already offloaded with memory_budget=60KiB"):
        with torch.no_grad():
            torch.compile(model, backend="prefetch_offload",
                          options=dict(memory_budget="50KiB", inner_backend="eager",
                                       **RATES))(*inputs)


# ---- device rates -----------------------------------------------------------------------

def test_rates_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FX_OFFLOAD_CACHE_DIR", str(tmp_path))
    calls = []
    real = device_rates.measure

    def counting(device, dtype):
        calls.append(device)
        return real(device, dtype)
    monkeypatch.setattr(device_rates, "measure", counting)
    cpu = torch.device("cpu")
    first = device_rates.rates_for(cpu, torch.float32, {})
    second = device_rates.rates_for(cpu, torch.float32, {})
    assert len(calls) == 1 and (tmp_path / "device_rates.json").exists()
    assert first.flop_rate == second.flop_rate > 0 and second.source.startswith("cached")
    assert second.matmul_curve and second.attention_curve
    given = device_rates.rates_for(cpu, torch.float32, dict(RATES))
    assert len(calls) == 1 and given.flop_rate == 1e12 and given.source == "given"
    # a given FLOP rate holds for every kernel size
    assert given.rate(10.0) == given.rate(1e15) == 1e12
    half = device_rates.rates_for(cpu, torch.float32, {"h2d_bandwidth": 123.0})
    assert half.h2d_bandwidth == 123.0 and half.memory_bandwidth == first.memory_bandwidth


def test_lossless_compression_shortens_the_predicted_copies():
    """compress="lossless": the planner samples the model's bf16 weights for the bytes a copy
    moves (about 0.75) and predicts the copy-bound plans faster; the outputs stay exact."""
    build = {"num_layers": 8}
    probe, _ = models.build("mlp", **build)
    probe = probe.to(torch.bfloat16)
    total = weights_bytes(probe, torch.device("cpu"))
    budget = total - 4 * layer_bytes(probe)
    results = {}
    for compress in ("none", "lossless"):
        model, inputs = models.build("mlp", **build)
        model = model.to(torch.bfloat16)
        reference = copy.deepcopy(model)
        compiled = torch.compile(model, backend="prefetch_offload", dynamic=True,
                                 options=dict(memory_budget=budget, inner_backend="eager",
                                              compress=compress, **RATES))
        with torch.no_grad():
            assert torch.equal(compiled(inputs[0].bfloat16()), reference(inputs[0].bfloat16()))
        results[compress] = fx_offload.report(model).planner
    plain, packed = results["none"].cost_model, results["lossless"].cost_model
    assert plain.copy_fraction == 1.0 and 0.72 < packed.copy_fraction < 0.8
    assert packed.copy_seconds(1 << 20) < plain.copy_seconds(1 << 20)
    c = results["none"].chosen.candidate
    sizes = dict(zip(c.layers, c.layer_bytes))
    assert packed.predict(list(c.layers), c.num_slots, sizes, 1) < \
        plain.predict(list(c.layers), c.num_slots, sizes, 1)
    assert "compress='lossless': a copy moves" in str(results["lossless"])


def test_the_planner_counts_only_the_routed_experts_a_call_moves():
    """With ``experts="routed"`` a one-token call moves the picked experts of a layer, not all
    of them: the planner's copy times say so (the router's top-k is read from the graph),
    and a call of many tokens, which prefetches the experts whole, is predicted whole."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    reference = copy.deepcopy(model)
    total = weights_bytes(model, torch.device("cpu"))
    compiled = torch.compile(model, backend="prefetch_offload", dynamic=True,
                             options=dict(memory_budget=int(total * 0.8),
                                          inner_backend="aot_eager", **RATES))
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    cm = fx_offload.report(model).planner.cost_model
    assert cm.routed, "no routed layer known to the planner"
    layer, (expert_bytes, count, k) = next(iter(cm.routed.items()))
    moe = model.layers[layer].mlp
    assert k == moe.top_k and count == moe.experts.num_experts
    nbytes = sum(p.numel() * p.element_size() for p in model.layers[layer].parameters())
    one = cm.moved_bytes(layer, nbytes, 1)
    assert one == pytest.approx(nbytes - expert_bytes * (1 - k / count))
    assert cm.moved_bytes(layer, nbytes, 4096) == nbytes
    whole = copy.copy(cm)           # the same model, every expert predicted to move
    whole.routed = {}
    c = fx_offload.report(model).planner.chosen.candidate
    sizes = dict(zip(c.layers, c.layer_bytes))
    assert cm.predict(list(c.layers), c.num_slots, sizes, 1) < \
        whole.predict(list(c.layers), c.num_slots, sizes, 1)
    # ties between plans go to the fewest bytes a call is predicted to copy: the picks
    assert cm.call_bytes(c, (1,)) < c.moved_bytes == whole.call_bytes(c, (1,))
    # a plan offloading some expert tensors alone (a subset of the user's patterns) copies
    # the picked share of them, never a negative count
    assert cm.moved_bytes(layer, expert_bytes // 2, 1) == \
        pytest.approx(expert_bytes // 2 * k / count)


@pytest.mark.parametrize("change", ["half", "deepcopy"])
def test_a_budgeted_model_offloaded_anew_is_planned_without_a_graph(change):
    """A model offloaded under memory_budget and then offloaded anew outside any compile
    (``.half()``: its slots no longer fit; a deepcopy's first call) has no graph to plan
    from, and does not fail inside the planner: a copy keeps the plan it had; the model in
    half precision, whose layers now take half the bytes, is planned again from the first
    graph's costs (here the budget then holds it whole: nothing is offloaded)."""
    import copy
    model, (x,) = models.build("mlp")
    reference = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "memory_budget": total // 2})
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
        layers = fx_offload.report(model).layers
        if change == "half":
            model.half(), reference.half()
            assert torch.equal(compiled(x.half()), reference(x.half()))
            again = model
        else:
            again = copy.deepcopy(model)
            assert torch.equal(again(x), reference(x))
    rep = fx_offload.report(again)
    if change == "half":
        assert rep.layers == [] and not rep.planner.offloads
        assert rep.planner.layer_sizes == planner.sizes_of(find_layer_stack(again, None))
    else:
        assert rep.layers == layers


def test_a_model_kept_whole_in_half_precision_is_planned_again_in_full(caplog):
    """memory_budget, then .half() (the plan is made again and the budget holds the model
    whole: nothing offloaded), then .float(): Dynamo runs the graph it compiled for the
    first offload again, and the model is planned again at that call, not left plain over
    the budget; the same both ways, twice.  A model restored while kept whole is plain."""
    import logging
    from fx_offload.runtime import hooks
    model, (x,) = models.build("mlp")
    budget = int(weights_bytes(model, torch.device("cpu")) * 0.6)
    model, compiled, reference, inputs, out, expected = compile_planned("mlp", budget)
    first = fx_offload.report(model).layers
    assert first and torch.equal(out, expected)
    for round_trip in range(2):
        for dtype in (torch.float16, torch.float32):
            model.to(dtype), reference.to(dtype)
            with torch.no_grad(), caplog.at_level(logging.WARNING, "fx_offload"):
                for call in range(2):
                    y = torch.randn(x.shape, generator=torch.Generator().manual_seed(call))
                    assert torch.equal(compiled(y.to(dtype)), reference(y.to(dtype)))
            rep = fx_offload.report(model)
            if dtype == torch.float16:
                assert rep.layers == [] and not rep.planner.offloads
            else:
                assert rep.layers == first, round_trip
                assert device_weights_now(model) <= budget
                assert "changed size since memory_budget held them whole" in caplog.text
    model.half()
    with torch.no_grad():
        compiled(x.half())
    fx_offload.restore(model)
    assert not hooks.carries_hooks(model)
    with pytest.raises(fx_offload.OffloadError, match="has no offloaded weights"):
        fx_offload.report(model)


def _decode_calls(model, budget, count=4, **options):
    """A budgeted Qwen3-MoE's decode-sized calls, each equal to the model's without
    offloading; returns (the chosen plan, the offloaded suffixes per layer, the bytes the
    last call copied)."""
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=dict(
        memory_budget=budget, inner_backend="aot_eager", expert_cache=0, **RATES, **options))
    with torch.no_grad():
        for i in range(count):
            ids = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(ids, use_cache=False).logits,
                               reference(ids, use_cache=False).logits), i
    rep = fx_offload.report(model)
    state = fx_offload.registry.state_for_model(model)
    return (rep.planner.chosen.candidate,
            {layer: {p.suffix for p in ps} for layer, ps in state.params.items()},
            rep.copied_bytes_last_call)


def test_a_budget_that_keeps_the_moe_layers_other_weights_offloads_only_their_experts():
    """A MoE layer's attention, router and norms cross the link at every call when its whole
    layer is offloaded; with its experts alone offloaded a decode step moves only the picked
    experts.  Where the budget holds the rest of the layers, the planner offloads the
    experts alone (outputs unchanged), and a decode call copies less than any whole-layer
    plan of that budget would."""
    model = small_moe("qwen3_moe").eval()
    experts = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    stack = model.model.layers
    budget, per_layer = experts_alone_budget(model)     # the rest, and one slot
    chosen, offloaded, copied = _decode_calls(model, budget)
    assert chosen.experts_only and "expert tensors only" in chosen.describe()
    assert len(offloaded) == len(stack) and all(s == experts for s in offloaded.values())
    assert 0 < copied < per_layer * len(stack) / 2      # a token's picks, nothing else
    # every whole-layer plan this budget fits copies the layers' other weights too
    whole = [c for c in planner.candidates(model, find_layer_stack(model, None),
                                           fx_offload.options.OffloadOptions(), "cpu")[0]
             if not c.experts_only and c.weights_bytes <= budget]
    assert whole and all(c.moved_bytes > chosen.moved_bytes for c in whole)


def test_plans_of_routed_layers_count_the_ring_that_fetches_their_other_weights_ahead():
    """On a GPU a routed MoE layer's other weights run ahead through a ring of device
    buffers (runtime.experts.ahead): every plan's device memory counts it, one buffer per layer
    ahead (at most the ring's depth) and one more, none for plans of the expert tensors alone, none
    where the experts move whole, and none on the CPU."""
    from fx_offload.runtime.experts import ahead
    from fx_offload.runtime.memory.host_memory import ALIGN
    model = small_moe("qwen3_moe").eval()
    stack = find_layer_stack(model, None)

    def plans(device, **options):
        found = planner.candidates(model, stack, fx_offload.options.OffloadOptions(**options),
                                   torch.device(device))[0]
        return {(c.layers, c.num_slots, c.params): c for c in found}
    gpu, cpu, whole = plans("cuda:0"), plans("cpu"), plans("cuda:0", experts="whole")
    others = sum(p.numel() * p.element_size() for n, p in model.model.layers[0].named_parameters()
                 if ".experts." not in n)
    assert gpu.keys() == cpu.keys() == whole.keys()
    for key, plan in gpu.items():
        layers, slots, _ = key
        ring = 0 if plan.experts_only or len(layers) - slots < 2 else \
            (min(ahead.depth_wanted(len(layers) - slots), len(layers) - slots - 1) + 1) * \
            (others + ALIGN)
        assert plan.slot_bytes == cpu[key].slot_bytes + ring, key
        assert plan.weights_bytes == whole[key].weights_bytes + ring, key
        assert whole[key].slot_bytes == cpu[key].slot_bytes, key
    assert any(gpu[key].slot_bytes > cpu[key].slot_bytes for key in gpu)


def test_a_budget_too_small_for_the_other_weights_offloads_whole_layers():
    model = small_moe("qwen3_moe").eval()
    one_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = weights_bytes(model, torch.device("cpu"))
    chosen, offloaded, _ = _decode_calls(model, total - 3 * one_layer)
    assert not chosen.experts_only and chosen.params is None
    assert any(len(s) > 2 for s in offloaded.values())


def test_the_users_offload_params_are_the_only_parameter_sets_tried():
    model = small_moe("qwen3_moe").eval()
    total = weights_bytes(model, torch.device("cpu"))
    chosen, offloaded, _ = _decode_calls(model, total // 2, offload_params=["mlp"])
    assert not chosen.experts_only and chosen.params == ("mlp",)
    assert all("mlp.gate.weight" in s for s in offloaded.values())


def test_a_layer_deleted_after_planning_is_planned_again_as_a_fresh_model_would_be(caplog):
    """Under memory_budget, deleting a layer from the stack offloads the model again as
    its next call begins; there is no graph then, so the plan is made again from the first
    graph's costs carried to the layers' new places: the report shows that plan (not the
    old one over shifted indices), it is the plan a fresh compile of the smaller model
    gets, and the outputs stay those of the model without offloading; the layer taken
    out keeps none of fx_offload's hooks."""
    import logging
    from fx_offload.runtime import hooks
    model, inputs = models.build("decoder", num_layers=6, seed=0)
    total = weights_bytes(model, torch.device("cpu"))
    budget = int(total * 0.6)
    model, compiled, reference, inputs, out, expected = compile_planned(
        "decoder", budget, build_kwargs={"num_layers": 6}, inner_backend="aot_eager")
    assert torch.equal(out, expected)
    assert fx_offload.report(model).planner.cost_model.num_layers == 6
    gone = model.layers[2]
    assert any(isinstance(h, hooks.OurHook) for h in gone._forward_pre_hooks.values())
    del model.layers[2], reference.layers[2]
    with torch.no_grad(), caplog.at_level(logging.INFO, "fx_offload"):
        out = compiled(*inputs)
    assert torch.equal(out, reference(*inputs))
    assert "memory_budget planned again" in caplog.text
    # the layer taken out keeps none of our hooks: it runs, and compiles into another
    # model, as a plain layer
    for hook_dict in (gone._forward_pre_hooks, gone._forward_hooks, gone._state_dict_hooks):
        assert not any(isinstance(getattr(h, "hook", h), hooks.OurHook)
                       for h in hook_dict.values())
    assert not gone._forward_hooks_always_called
    rep = fx_offload.report(model)
    assert rep.planner.cost_model.num_layers == 5
    assert list(rep.planner.chosen.candidate.layers) == rep.layers
    fresh = copy.deepcopy(reference)
    compiled_fresh = torch.compile(fresh, backend="prefetch_offload", options=dict(
        memory_budget=budget, inner_backend="aot_eager", **RATES))
    with torch.no_grad():
        assert torch.equal(compiled_fresh(*inputs), out)
    assert fx_offload.report(fresh).layers == rep.layers


def test_layers_deleted_until_the_budget_holds_the_rest_leave_a_plain_model(caplog):
    """When the layers left fit memory_budget whole, the model offloaded again is a plain
    model, as a first compile of it would leave it: a warning says so, nothing is
    offloaded (report), its layers' hooks are gone (the model's call hooks stay, to plan
    again if its weights grow), and its calls give the reference outputs."""
    import logging
    from fx_offload.runtime import hooks
    model, inputs = models.build("decoder", num_layers=6, seed=0)
    budget = int(weights_bytes(model, torch.device("cpu")) * 0.6)
    model, compiled, reference, inputs, out, expected = compile_planned(
        "decoder", budget, build_kwargs={"num_layers": 6}, inner_backend="aot_eager")
    assert fx_offload.report(model).layers
    del model.layers[2:], reference.layers[2:]
    with torch.no_grad(), caplog.at_level(logging.WARNING, "fx_offload"):
        outs = [compiled(*inputs) for _ in range(2)]
    assert "now holds all" in caplog.text and "nothing is offloaded" in caplog.text
    assert all(torch.equal(o, reference(*inputs)) for o in outs)
    rep = fx_offload.report(model)
    assert rep.layers == [] and rep.planner is not None and not rep.planner.offloads
    assert hooks.carries_hooks(model)
    assert not any(isinstance(getattr(h, "hook", h), hooks.OurHook) for m in model.layers
                   for hook_dict in (m._forward_pre_hooks, m._forward_hooks,
                                     m._state_dict_hooks) for h in hook_dict.values())
    # grown past the budget again: planned anew from the graph Dynamo compiles for it
    for _ in range(4):
        layer = copy.deepcopy(reference.layers[0])
        model.layers.append(copy.deepcopy(layer))
        reference.layers.append(layer)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
    assert fx_offload.report(model).layers
    assert _device_bytes(model) <= budget


def _device_bytes(model):
    """Device bytes the offloaded model keeps: what is not offloaded, and its slots."""
    state = fx_offload.registry.state_for_model(model)
    offloaded = {id(p.param) for ps in state.params.values() for p in ps}
    kept = [t for t in itertools.chain(model.parameters(), model.buffers())
            if id(t) not in offloaded]
    return sum(t.numel() * t.element_size() for t in kept) + state.buffer_bytes


def test_a_copy_of_a_model_whose_layer_grew_is_planned_for_its_own_layers():
    """A layer replaced by a wider one, then the model copied before the copy's first call:
    the copy's layers are not the ones planned (their sizes differ), so the copy is planned
    again and stays within memory_budget, as a fresh compile of it would; a pickled copy
    too (the plan in the hooks pickles)."""
    import io
    model, inputs = models.build("decoder", num_layers=6, seed=0)
    budget = int(weights_bytes(model, torch.device("cpu")) * 0.6)
    model, compiled, reference, inputs, out, expected = compile_planned(
        "decoder", budget, build_kwargs={"num_layers": 6}, inner_backend="aot_eager")
    torch.manual_seed(5)
    wider = models.DecoderLayer(64, 4, 2, 320)
    copied, ref_copy = copy.deepcopy(model), copy.deepcopy(reference)
    copied.layers[1], ref_copy.layers[1] = copy.deepcopy(wider), wider
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for model_copy in (copied, loaded):
        with torch.no_grad():
            assert torch.equal(model_copy(*inputs), ref_copy(*inputs))
        assert _device_bytes(model_copy) <= budget
        assert fx_offload.report(model_copy).planner.layer_sizes == \
            planner.sizes_of(find_layer_stack(model_copy, None))



def test_with_host_compute_only_plans_of_expert_tensors_alone_are_chosen(monkeypatch):
    """Where the host computes routed experts (host_compute "auto" or "always" on a GPU), a
    whole offloaded layer's attention would cross the link every call while its experts do
    not: the planner keeps to plans of expert tensors alone (the budget that otherwise gets
    whole layers, above), outputs unchanged, and its report says why.  The rule's condition
    is checked as the GPU would see it; the run is the CPU's with the rule forced on."""
    cuda = torch.device("cuda", 0)
    assert planner._hosts_experts(fx_offload.options.OffloadOptions(), cuda)
    assert planner._hosts_experts(fx_offload.options.OffloadOptions(host_compute="always"), cuda)
    # under CUDA graphs too: a capture records the experts as host jobs
    assert planner._hosts_experts(fx_offload.options.OffloadOptions(mode="reduce-overhead"),
                                  cuda)
    for off in (dict(host_compute="never"), dict(experts="whole")):
        assert not planner._hosts_experts(fx_offload.options.OffloadOptions(**off), cuda), off
    assert not planner._hosts_experts(fx_offload.options.OffloadOptions(), torch.device("cpu"))
    model = small_moe("qwen3_moe").eval()
    plans = planner.candidates(model, find_layer_stack(model, None),
                               fx_offload.options.OffloadOptions(), torch.device("cpu"))[0]
    # below the second-smallest plan of expert tensors alone: only "every layer's experts"
    # fits of those, and planned for a 64-token prompt (as the 48-layer benchmark's first
    # graph) the streaming model prefers whole layers
    budget = sorted(c.weights_bytes for c in plans if c.experts_only)[1] - 1
    streamed, _, _ = _decode_calls(small_moe("qwen3_moe").eval(), budget, plan_tokens=[64])
    assert not streamed.experts_only
    torch._dynamo.reset()       # the next model compiles its own graph
    monkeypatch.setattr(planner, "_hosts_experts", lambda options, device: True)
    chosen, offloaded, _ = _decode_calls(model, budget, plan_tokens=[64])
    assert chosen.experts_only
    assert all(s == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
               for s in offloaded.values())
    rep = fx_offload.report(model)
    assert rep.planner.hosted and all(c.experts_only for c in rep.planner.fitting)
    assert "host_compute: only plans offloading expert tensors alone" in str(rep.planner)
