"""The command line's front door: help pages, errors for a misspelled flag, and what
``inspect`` prints by default."""
from fx_offload import explain
from fx_offload.tools import models


def test_explain_folds_layers_cut_alike_and_gives_sizes_in_binary_units():
    model, inputs = models.build("mlp", num_layers=8)
    e = explain(model, *inputs, group_size=2)
    plan = e.plan_text()
    assert "offloaded 65.50 KiB; 1 slot(s) of 16.38 KiB in all on <device>" in plan
    assert [line for line in plan.splitlines() if "chunks" in line] == [
        "layers 1, 3, 5, 7 chunks: 0: fc1.weight fc1.bias | 1: fc2.weight fc2.bias"]
    assert [row[3] for row in e.plan_rows()] == ["bytes"] + ["16.38 KiB"] * 4
    short, full = e.text(graphs=False), str(e)
    graph = e.graphs[0].text().splitlines()       # a line per node, ">>>" for ours
    inserted = sum(line.startswith(">>>") for line in graph)
    assert inserted == 4 * 2 * 2 + 2 and any(line.startswith(">>> wait_prefetch(layer 1 chunk 0)")
                                         for line in graph)
    assert short.endswith(f"graph 0: {len(graph)} nodes, {inserted} inserted op(s)\n"), short
    assert full.startswith(plan) and full.endswith("\n".join(graph) + "\n")
    assert ">>>" not in short
