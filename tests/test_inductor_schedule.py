"""Inductor keeps the schedule: read its generated code and check, for every offloaded layer,
that its wait precedes its first weight read, its start follows its last, no wait sits above
the previous layer's compute, and no slot buffer is copied."""
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fx_offload
import fx_offload.compiler as compiler
from fx_offload.passes import prefetch
from helpers import compile_pair

CALL = re.compile(r"torch\.ops\.fx_offload\.(wait|start|join)_prefetch\.default\((.*)\)")
ARG = re.compile(r"\barg(\d+)_1\b")


def schedule_lines(code: str) -> list[str]:
    """The statements of the generated ``call`` function, in order."""
    body = code[code.index("def call("):]
    lines = []
    for line in body.splitlines()[1:]:
        if line and not line.startswith(" "):
            break
        line = line.strip()
        if not line or line.startswith(("#", "del ", "assert_size_stride", "args.clear")) \
                or line.endswith("= args"):
            continue   # bookkeeping, not reads of the inputs' data
        lines.append(line)
    return lines


def compile_and_read_code(name, options, layers):
    """Run the compiled model once; return what the schedule check needs."""
    model, compiled, reference, inputs = compile_pair(name, options, {"num_layers": layers})
    seen_inputs = []
    real = compiler.read_graph_inputs

    def spy(gm, example_inputs):
        seen_inputs.append(list(example_inputs))
        return real(gm, example_inputs)

    compiler.read_graph_inputs = spy
    try:
        with torch.no_grad():
            out, codes = run_and_get_code(compiled, *inputs)
            # the first call's graph reads the weights the parameters held when it was
            # compiled; from the second call on it reads the slots
            out = compiled(*inputs)
    finally:
        compiler.read_graph_inputs = real
    (example_inputs,) = seen_inputs
    (code,) = codes
    names = {id(p): n for n, p in model.named_parameters()}
    layer_of_input = {}
    for i, value in enumerate(example_inputs):
        match = re.match(r"layers\.(\d+)\.", names.get(id(value), ""))
        if match:
            layer_of_input[i] = int(match.group(1))
    return model, reference, inputs, out, code, layer_of_input


def schedule_violations(code, layer_of_input, rep) -> list[str]:
    offloaded_inputs = {i for i, l in layer_of_input.items() if l in rep.layers}
    waits, starts, reads, problems = {}, {}, {}, []
    for pos, line in enumerate(schedule_lines(code)):
        op = CALL.search(line)
        if op:
            kind, args = op.groups()
            if kind != "join":
                layer = int(args.rsplit("]", 1)[1].split(",")[2])
                (waits if kind == "wait" else starts)[layer] = pos
            continue
        used = [int(i) for i in ARG.findall(line)]
        for i in used:
            if i in layer_of_input:
                reads.setdefault(layer_of_input[i], []).append(pos)
        if any(i in offloaded_inputs for i in used) and re.search(r"\.clone\(|copy_\(", line):
            problems.append(f"slot buffer copied: {line}")
    if set(waits) != set(rep.layers):
        problems.append(f"waits for layers {sorted(waits)}, expected {rep.layers}")
    expected_starts = {l for l in rep.layers if rep.refill_of[l] is not None}
    if set(starts) != expected_starts:
        problems.append(f"starts for layers {sorted(starts)}, expected {sorted(expected_starts)}")
    for layer in rep.layers:
        if not reads.get(layer) or layer not in waits:
            problems.append(f"layer {layer}: no reads or no wait")
            continue
        if waits[layer] > min(reads[layer]):
            problems.append(f"layer {layer} read before its wait")
        if layer in starts and starts[layer] < max(reads[layer]):
            problems.append(f"layer {layer} read after its start")
        if layer - 1 in reads and waits[layer] < max(reads[layer - 1]):
            problems.append(f"wait of layer {layer} hoisted above layer {layer - 1}'s compute")
    return problems


@pytest.mark.parametrize("name,options,layers", [
    ("decoder", dict(group_size=2, num_in_group=1, prefetch_step=1), 6),
    ("decoder", dict(group_size=1, num_in_group=1, prefetch_step=2), 5),
    ("moe", dict(group_size=2, num_in_group=1, prefetch_step=2), 6),
    ("mlp", dict(group_size=3, num_in_group=2, prefetch_step=3), 9),
])
def test_generated_code_keeps_the_schedule(name, options, layers):
    model, reference, inputs, out, code, layer_of_input = compile_and_read_code(
        name, options, layers)
    assert schedule_violations(code, layer_of_input, fx_offload.report(model)) == []
    with torch.no_grad():
        torch.testing.assert_close(out, torch.compile(reference, backend="inductor")(*inputs),
                                   rtol=0, atol=0)


def test_planted_early_start_is_caught_and_gives_wrong_numbers(monkeypatch):
    """The checks can fail, and slots are really shared: a start placed before its layer's
    last weight read is refused by the pass's verifier; let through, the generated-code
    check flags it, and its refill corrupts that layer's output."""
    real_plan = prefetch.plan_graph

    def early_start(*args):
        plan = real_plan(*args)
        for lp in plan.layers:
            lp.last_node = lp.first_use      # start right after the first weight read
            lp.start_acts, lp.start_reads = [lp.first_use], []
        return plan

    monkeypatch.setattr(prefetch, "plan_graph", early_start)
    with pytest.raises(Exception, match=r"reads .* of layer 1 from slot 0, but it is being "
                                        r"refilled with layer 3"):
        compile_and_read_code("mlp", dict(group_size=2, num_in_group=1, prefetch_step=1), 6)
    torch._dynamo.reset()
    monkeypatch.setattr(prefetch, "verify_graph", lambda *a: None)   # let it through
    model, reference, inputs, out, code, layer_of_input = compile_and_read_code(
        "mlp", dict(group_size=2, num_in_group=1, prefetch_step=1), 6)
    problems = schedule_violations(code, layer_of_input, fx_offload.report(model))
    assert any("read after its start" in p for p in problems), problems
    with torch.no_grad():
        assert not torch.allclose(out, reference(*inputs), atol=1e-3)
