"""Inductor keeps the schedule: read its generated code and check, for every copy chunk of
every offloaded layer, that its wait precedes its first weight read, that the start that
overwrites it follows its last (or, for the circular prefetch at the entry, sits above every
layer's compute), that no wait sits above the previous layer's compute, and that no slot
buffer is copied."""
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
    layout = fx_offload.registry.state_for_model(model).learned.layout
    layer_of_input = {}         # input index -> (layer, chunk); chunk None: not offloaded
    for i, value in enumerate(example_inputs):
        match = re.match(r"layers\.(\d+)\.(.*)", names.get(id(value), ""))
        if match:
            layer, suffix = int(match.group(1)), match.group(2)
            chunk = next((c.index for c in layout.get(layer, ()) if suffix in c.suffixes), None)
            layer_of_input[i] = (layer, chunk)
    return model, reference, inputs, out, code, (layer_of_input, layout)


def schedule_violations(code, inputs, rep) -> list[str]:
    layer_of_input, layout = inputs
    offloaded_inputs = {i for i, (l, c) in layer_of_input.items() if c is not None}
    waits, starts, reads, layer_reads, problems = {}, {}, {}, {}, []
    for pos, line in enumerate(schedule_lines(code)):
        op = CALL.search(line)
        if op:
            kind, args = op.groups()
            if kind != "join":
                ints = [int(a.split("=")[-1])      # chunk=-1 may come as a keyword
                        for a in args.rsplit("]", 1)[1].strip(" ,)").split(",")]
                if kind == "wait":                       # handle, layer, chunk
                    waits.setdefault((ints[1], ints[2]), pos)
                else:                                    # handle, layer, target, chunk
                    starts[(ints[1], ints[3])] = pos
            continue
        used = [int(i) for i in ARG.findall(line)]
        for i in used:
            if i in layer_of_input:
                layer, chunk = layer_of_input[i]
                layer_reads.setdefault(layer, []).append(pos)
                if chunk is not None:
                    reads.setdefault((layer, chunk), []).append(pos)
        if any(i in offloaded_inputs for i in used) and re.search(r"\.clone\(|copy_\(", line):
            problems.append(f"slot buffer copied: {line}")
    expected = {(l, c.index) for l in rep.layers for c in layout[l]}
    if set(waits) != expected:
        problems.append(f"waits for {sorted(waits)}, expected {sorted(expected)}")
    for (layer, chunk), positions in sorted(reads.items()):
        if (layer, chunk) not in waits:
            problems.append(f"layer {layer} chunk {chunk}: no wait")
            continue
        if waits[(layer, chunk)] > min(positions):
            problems.append(f"layer {layer} chunk {chunk} read before its wait")
        refill = rep.refill_of[layer]
        if refill is None:
            continue
        if rep.circular != "end" and refill < layer:
            # the next call's: one start of every chunk, above every layer's compute
            entry = starts.get((layer, -1))
            first_compute = min(p for ps in layer_reads.values() for p in ps)
            if entry is None:
                problems.append(f"no start of layer {refill} at the entry")
            elif entry > first_compute:
                problems.append(f"entry start of layer {refill} below the first layer's compute")
            if rep.circular == "entry":
                continue        # chosen per call ("either"), the end's starts follow too
        mine = layout[layer][chunk]
        for target in layout[refill]:
            start = starts.get((layer, target.index))
            if start is None:
                problems.append(f"no start of layer {refill} chunk {target.index}")
            elif target.overlaps(mine) and start < max(positions):
                problems.append(f"layer {layer} chunk {chunk} read after the start that "
                                f"overwrites it")
    for layer in rep.layers:
        first_wait = min((p for (l, _), p in waits.items() if l == layer), default=None)
        if layer - 1 in layer_reads and first_wait is not None and \
                first_wait < max(layer_reads[layer - 1]):
            problems.append(f"wait of layer {layer} hoisted above layer {layer - 1}'s compute")
    return problems


@pytest.mark.parametrize("name,options,layers", [
    ("decoder", dict(group_size=2, num_in_group=1, prefetch_step=1), 6),
    ("decoder", dict(group_size=1, num_in_group=1, prefetch_step=2), 5),
    ("moe", dict(group_size=2, num_in_group=1, prefetch_step=2), 6),
    ("mlp", dict(group_size=3, num_in_group=2, prefetch_step=3), 9),
    ("decoder", dict(group_size=2, num_in_group=1, prefetch_step=2, circular_prefetch="entry"),
     6),
])
def test_generated_code_keeps_the_schedule(name, options, layers):
    model, reference, inputs, out, code, layer_of_input = compile_and_read_code(
        name, options, layers)
    assert schedule_violations(code, layer_of_input, fx_offload.report(model)) == []
    with torch.no_grad():
        torch.testing.assert_close(out, torch.compile(reference, backend="inductor")(*inputs),
                                   rtol=0, atol=0)


def test_planted_early_start_is_caught_and_gives_wrong_numbers(monkeypatch):
    """The checks can fail, and slots are really shared: a chunk's start placed before the
    last read of what it overwrites is refused by the pass's verifier; let through, the
    generated-code check flags it, and its refill corrupts that layer's output."""
    real_plan = prefetch.plan_graph

    def early_start(*args):
        plan = real_plan(*args)
        for lp in plan.layers:
            start = lp.starts[0]     # chunk 0 (norm, q, k) right after its first read
            start.after, start.acts, start.reads = lp.first_use, [lp.first_use], []
        return plan

    monkeypatch.setattr(prefetch, "plan_graph", early_start)
    with pytest.raises(Exception, match=r"reads .* of layer 1 chunk 0 from slot 0, but its "
                                        r"bytes are being refilled with layer 3 chunk 0"):
        compile_and_read_code("decoder", dict(group_size=2, num_in_group=1, prefetch_step=1), 6)
    torch._dynamo.reset()
    monkeypatch.setattr(prefetch, "verify_graph", lambda *a: None)   # let it through
    model, reference, inputs, out, code, layer_of_input = compile_and_read_code(
        "decoder", dict(group_size=2, num_in_group=1, prefetch_step=1), 6)
    problems = schedule_violations(code, layer_of_input, fx_offload.report(model))
    assert any("read after the start that overwrites it" in p for p in problems), problems
    with torch.no_grad():
        assert not torch.allclose(out, reference(*inputs), atol=1e-3)
