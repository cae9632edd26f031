"""The slot-safety verifier catches planted broken schedules; inspect/explain work."""
import os
import subprocess
import sys

import pytest
import torch

from fx_offload import ops
from fx_offload.tools import models
from fx_offload import explain
from fx_offload.errors import ScheduleError
from fx_offload.passes.verify import slot_model_for, verify_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_MLP = ("import torch, fx_offload\n"
               "from fx_offload.tools import models\n"
               "m, inp = models.build('mlp', num_layers=4)\n"
               "with torch.no_grad():\n"
               "    torch.compile(m, backend='prefetch_offload',"
               " options={'inner_backend': 'eager'})(*inp)\n")


AT_ENTRY = dict(group_size=2, circular_prefetch="entry")


def explained(name="mlp", num_layers=6, **options):
    model, inputs = models.build(name, num_layers=num_layers)
    e = explain(model, *inputs, **options)
    (record,) = e.graphs
    return e, record


def verify(e, record):
    verify_graph(record.after, {w: (t[0], t[2]) for w, t in record.weight_tags.items()},
                 slot_model_for(e.choice.schedule, e.learned.layout,
                                [lp.layer for lp in record.plan.layers]))


def op_nodes(gm, target, layer, chunk=None):
    return [n for n in gm.graph.nodes
            if (call := ops.OpCall.of(n)) is not None and call.op is target and call.layer == layer
            and (chunk is None or call.chunk == chunk)]


def test_verifier_passes_the_real_schedules():
    for options in (dict(group_size=2), dict(group_size=1, num_in_group=1, prefetch_step=4),
                    dict(group_size=3, num_in_group=2, prefetch_step=3),
                    dict(group_size=2, copy_chunks=1), AT_ENTRY,
                    dict(AT_ENTRY, prefetch_step=2, copy_chunks=1)):
        e, record = explained(**options)
        verify(e, record)


def test_each_layer_moves_in_chunks_waited_and_started_at_their_reads():
    e, record = explained(group_size=2)
    assert [[c.suffixes for c in e.learned.layout[layer]] for layer in (1, 3)] == [
        [("fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias")]] * 2
    order = {n: i for i, n in enumerate(record.after.graph.nodes)}
    for layer in (1, 3, 5):
        assert len(op_nodes(record.after, ops.WAIT, layer)) == 2
        # a chunk's start after its reads (the entry start of the default, chosen per call,
        # copies every chunk at once: chunk -1)
        starts = [n for n in op_nodes(record.after, ops.START, layer)
                  if ops.OpCall.of(n).chunk >= 0]
        assert [ops.OpCall.of(n).chunk for n in starts] == [0, 1]
        # chunk 0's copy starts before the layer reads chunk 1: while fc2 still computes
        (wait1,) = op_nodes(record.after, ops.WAIT, layer, chunk=1)
        assert order[starts[0]] < order[wait1] < order[starts[1]]
    e1, record1 = explained(group_size=2, copy_chunks=1)
    assert [len(e1.learned.layout[layer]) for layer in (1, 3, 5)] == [1, 1, 1]
    assert len(op_nodes(record1.after, ops.START, 1)) == 1


def test_start_moved_early_is_caught():
    e, record = explained(group_size=2)
    (start,) = op_nodes(record.after, ops.START, 1, chunk=0)
    (wait,) = op_nodes(record.after, ops.WAIT, 1, chunk=0)
    wait.append(start)                       # start right after the wait: before the reads
    with pytest.raises(ScheduleError, match=r"reads .* of layer 1 chunk 0 from slot 0, but its "
                                            r"bytes are being refilled with layer 3 chunk 0"):
        verify(e, record)


def test_chunk_start_before_its_chunks_last_read_is_caught():
    e, record = explained(group_size=2)
    (start,) = op_nodes(record.after, ops.START, 1, chunk=1)
    (wait,) = op_nodes(record.after, ops.WAIT, 1, chunk=1)
    wait.append(start)       # chunk 0's reads are done, chunk 1's are not
    with pytest.raises(ScheduleError, match=r"reads .*fc2.* of layer 1 chunk 1 from slot 0, "
                                            r"but its bytes are being refilled with layer 3 "
                                            r"chunk 1"):
        verify(e, record)


def test_missing_wait_is_caught():
    e, record = explained(group_size=2)
    (wait,) = op_nodes(record.after, ops.WAIT, 3, chunk=1)
    record.after.graph.erase_node(wait)
    with pytest.raises(ScheduleError, match=r"layer 3 chunk 1 from slot 0, but no wait_prefetch "
                                            r"for it precedes this read"):
        verify(e, record)


def test_two_layers_in_one_slot_at_once_is_caught():
    e, record = explained(group_size=2)
    (start,) = op_nodes(record.after, ops.START, 1, chunk=0)
    record.after.graph.erase_node(start)     # layer 3 waited for while slot 0 holds layer 1
    with pytest.raises(ScheduleError, match=r"wait for layer 3 chunk 0, but slot 0's bytes "
                                            r"for it were last filled with layer 1 chunk 0"):
        verify(e, record)


def test_the_call_begins_by_refilling_each_slot_before_any_compute():
    """The slot's last layer (5) leaves and its first (1) comes in at the top of the graph:
    the copy runs under layer 0, and nothing is copied past the call's end."""
    e, record = explained(**AT_ENTRY)
    nodes = list(record.after.graph.nodes)
    entry = op_nodes(record.after, ops.START, 5)
    assert [(ops.OpCall.of(n).refill, ops.OpCall.of(n).chunk) for n in entry] == [(1, -1)]
    computed = [n for n in nodes if n.op == "call_function" and ops.OpCall.of(n) is None]
    anchor = computed[0]      # no data, no kernel: nothing a compiler could fuse it with
    assert anchor.target is torch.empty_like and anchor.args[0].op == "placeholder"
    assert nodes.index(entry[-1]) < nodes.index(computed[1])
    (first_wait,) = op_nodes(record.after, ops.WAIT, 1, chunk=0)
    assert anchor in ops.OpCall.of(first_wait).acts    # ordered after the starts
    assert ops.OpCall.of(entry[0]).acts == [anchor]
    rows = {row[0]: row for row in e.plan_rows()}
    assert rows["5"][5] == "next call, g0: at entry" and rows["5"][6] == "layer 1"
    e1, record1 = explained(**AT_ENTRY, prefetch_step=2)      # slots 0, 1: 1, 5 and 3
    assert [(ops.OpCall.of(n).layer, ops.OpCall.of(n).refill) for n in
            op_nodes(record1.after, ops.START, 5)] == [(5, 1)]
    assert not op_nodes(record1.after, ops.START, 3)          # alone in its slot
    e2, record2 = explained(**AT_ENTRY, num_layers=8, prefetch_step=2)  # 1, 5 | 3, 7
    (anchor,) = [n for n in record2.after.graph.nodes if n.target is torch.empty_like]
    for layer in (1, 3):            # each layer refilled at the entry waits after the starts
        first_wait = op_nodes(record2.after, ops.WAIT, layer, chunk=0)[0]
        assert anchor in ops.OpCall.of(first_wait).acts, layer


def test_missing_entry_refill_is_caught():
    e, record = explained(**AT_ENTRY)
    (start,) = op_nodes(record.after, ops.START, 5)
    record.after.graph.erase_node(start)
    with pytest.raises(ScheduleError, match=r"wait for layer 1 chunk 0, but slot 0's bytes for "
                                            r"it were last filled with layer 5 chunk 0"):
        verify(e, record)


def test_missing_circular_prefetch_is_caught():
    e, record = explained(group_size=2)
    (start,) = op_nodes(record.after, ops.START, 5, chunk=1)
    record.after.graph.erase_node(start)
    with pytest.raises(ScheduleError, match=r"graph ends with slot\(s\) \[0\] not holding all "
                                            r"of layer\(s\) \[1\].*a circular prefetch is "
                                            r"missing"):
        verify(e, record)


def test_circular_prefetch_at_the_end_where_the_entry_was_asked_for_is_caught():
    """A refill after the call's last layer, where the schedule puts it at the next call's
    entry, leaves the slot not holding what that entry overwrites."""
    e, record = explained(**AT_ENTRY)
    graph = record.after.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        graph.call_function(ops.START, ([], [], record.plan.handle, 5, 1, 0))
    with pytest.raises(ScheduleError, match=r"graph ends with slot\(s\) \[0\] not holding all "
                                            r"of layer\(s\) \[5\]"):
        verify(e, record)


def test_prefetch_into_the_wrong_slot_is_caught():
    e, record = explained(group_size=2, prefetch_step=3)   # layers 1, 3, 5 in slots 0, 1, 2
    wrong = record.after.graph.call_function(ops.START, ([], [], record.plan.handle, 1, 3))
    (wait,) = op_nodes(record.after, ops.WAIT, 1, chunk=0)
    wait.append(wrong)
    with pytest.raises(ScheduleError, match=r"prefetches layer 3, which lives in slot 1"):
        verify(e, record)


def test_inspect_cli_builtin_and_file_targets(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "fx_offload", "inspect", "moe",
                          "--offload-params", "w13_weight,w2_weight", "--prefetch-step", "2",
                          "--aten"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "layer  slot  params  bytes " in out.stdout and "inserted op(s)" not in out.stdout
    assert ">>> wait_prefetch(layer 1 chunk 0)" in out.stdout and "(ATen)" in out.stdout
    factory = tmp_path / "my_model.py"
    factory.write_text("from fx_offload.tools.models import build_decoder\n"
                       "def make():\n    return build_decoder(num_layers=4)\n"
                       "def keywords():\n    model, (x,) = build_decoder(num_layers=4)\n"
                       "    return model, {'x': x}\n")
    out = subprocess.run([sys.executable, "-m", "fx_offload", "inspect", f"{factory}:make",
                          "--group-size", "4", "--num-in-group", "2"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "offloaded layers [2, 3]" in out.stdout
    # bad targets, in this process (the subprocess runs above cover the entry point)
    from fx_offload.tools.cli import main
    for bad, message in (["nope"], "unknown target 'nope'"), (
            [f"{factory}:missing"], "has no callable 'missing'"), (
            ["mlp", "--group-size", "0"], "'group_size' must be >= 1"), (
            [f"{factory}:keywords"], "returned keyword inputs (a dict); inspect calls the model "
                                     "with positional inputs"), (
            ["mlp", "--plan-tokens", "5"], "--plan-tokens applies with --memory-budget only"), (
            ["mlp", "--memory-budget", "1MiB", "--plan-tokens", "1,x"],
            "--plan-tokens must be comma-separated token counts"), (
            ["mlp", "--memory-budget", "1MiB", "--group-size", "3"],
            "--group-size and --memory-budget both decide what is offloaded"):
        assert main(["inspect", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err[-2000:]


def test_torch_trace_artifacts_before_and_after(tmp_path):
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", COMPILE_MLP], capture_output=True, text=True,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert '"name": "fx_offload_before"' in text and '"name": "fx_offload_after"' in text
    assert "fx_offload.wait_prefetch" in text


def test_torch_logs_turns_on_the_summary_line():
    env = dict(os.environ, TORCH_LOGS="fx_offload")
    out = subprocess.run([sys.executable, "-c", COMPILE_MLP], capture_output=True, text=True,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [l for l in out.stderr.splitlines() if "offloaded layer(s) [1, 3]" in l]
    assert len(lines) == 1, out.stderr[-2000:]


def test_bench_smoke_run_on_cpu(tmp_path):
    """The bench's rows, table and planner summary, compiled by aot_eager: Inductor's CPU
    kernels would take most of two minutes to build on a fresh machine, and the other
    tests compile with Inductor already."""
    out = subprocess.run([sys.executable, "-m", "fx_offload", "bench", "--device", "cpu",
                          "--quick", "--layers", "4", "--configs", "g2n1s1", "--tokens", "1,16",
                          "--budgets", "g2n1s1", "--inner-backend", "aot_eager",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    table = (tmp_path / "results.md").read_text()
    for needle in ("| resident (aot_eager) | 1 |", "| offload g2n1s1 | 16 |",
                   "| planner@g2n1s1 | 16 |",
                   "bytes copied per forward"):
        assert needle in table, table


def test_bigger_smoke_run_on_cpu():
    """The bigger-than-the-GPU journey on small shapes: built on meta, materialized on the
    host, placed, compiled, prefill and greedy decode equal to the eager run."""
    out = subprocess.run([sys.executable, "-m", "fx_offload", "bigger", "--shape", "tiny",
                          "--layers", "6", "--device", "cpu", "--prompt", "8", "--decode", "2"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "logits equal to the eager run: True" in out.stdout, out.stdout
    assert "same tokens as eager: True" in out.stdout, out.stdout
    assert "3 layers" in out.stdout and "in host blocks" in out.stdout, out.stdout
