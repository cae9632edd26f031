"""The command line's front door: help pages, errors for a misspelled flag, and what
``inspect`` prints by default."""
import argparse
import os
import subprocess
import sys

import pytest

from fx_offload import explain
from fx_offload.tools import cli, demo, models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_help(name, parser) -> list[str]:
    """What of ``parser``'s page a user would miss: a description with an example, a help
    for each flag, the default in each help where there is one."""
    missing = []
    if "example: " not in (parser.description or ""):
        missing.append(f"{name}: description with an example")
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
        if not (action.help or "").strip():
            missing.append(f"{flag}: help")
        elif (action.option_strings and action.help != argparse.SUPPRESS
              and action.default not in (None, False)
              and "default" not in formatter._get_help_string(action)):
            missing.append(f"{flag}: its default ({action.default!r}) in its help")
    return missing


def test_every_subcommand_has_a_description_and_every_flag_a_help_with_its_default():
    _, parsers = cli.build_parser()
    assert sorted(parsers) == sorted(name for name, *_ in cli.TOOLS) and len(parsers) >= 12
    missing = []
    for name, parser in parsers.items():
        if "example: python -m fx_offload " + name not in (parser.description or ""):
            missing.append(f"{name}: description with its own example")
        missing += _without_help(name, parser)
    assert missing == []


def test_the_tensor_parallel_job_has_a_description_and_every_flag_a_help_with_its_default():
    """``torchrun ... -m fx_offload.tools.tp_run`` is no subcommand, but a user reads its
    ``--help`` the same way."""
    from fx_offload.benchmarks import tp_bench
    parser = argparse.ArgumentParser(description=tp_bench.DESCRIPTION)
    tp_bench.add_arguments(parser)
    assert "example: torchrun" in parser.description
    assert _without_help("tp_run", parser) == []


def test_every_subcommand_help_page_prints(capsys):
    for name, *_ in cli.TOOLS:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0, name
        page = capsys.readouterr().out
        assert page.startswith(f"usage: python -m fx_offload {name} ") and "example:" in page


def test_a_misspelled_flag_prints_the_subcommand_usage_and_names_the_flag(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--devcie", "cpu"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fx_offload demo ") and "--calls" in err, err
    assert ("python -m fx_offload demo: error: unrecognized arguments: --devcie cpu "
            "(did you mean --device?)") in err, err
    # the entry point too, and an unknown flag with nothing close to it
    out = subprocess.run([sys.executable, "-m", "fx_offload", "inspect", "mlp", "--zzz"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("usage: python -m fx_offload inspect")
    assert out.stderr.rstrip().endswith("error: unrecognized arguments: --zzz"), out.stderr


def test_demo_and_inspect_build_the_same_model_and_the_readme_example_warns_nothing(
        capsys, caplog):
    demo_parser = argparse.ArgumentParser()
    demo.add_arguments(demo_parser)
    layers = demo_parser.parse_args([]).layers
    with caplog.at_level("WARNING", logger="fx_offload"):
        assert cli.main(["inspect", "decoder", "--prefetch-step", "2"]) == 0
    assert caplog.records == [], caplog.text
    out = capsys.readouterr().out
    assert f"layer stack 'layers' of {layers}; offloaded layers [1, 3, 5, 7]" in out
    # the plan and a line per graph: no graph text without --graphs, sizes as report gives them
    assert "layers 1, 3, 5, 7 chunks: 0: input_layernorm.weight" in out
    assert "offloaded 578.00 KiB; 2 slot(s) of 289.00 KiB in all" in out
    assert "graph 0: " in out and "input " not in out and ">>>" not in out
    assert len(out.splitlines()) < 20, out


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
    # what a REPL shows for a bare explain(...): the short text, not the fields' reprs
    assert repr(e) == short and "Chunk(" not in repr(e)


def test_train_smoke_run_trains_the_adapters_offloaded_as_resident(capsys):
    """``python -m fx_offload train --device cpu --quick``: the LoRA step runs offloaded
    (aot_eager inside) and its adapters' gradients equal the resident row's."""
    pytest.importorskip("peft", reason="install the test extra")
    assert cli.main(["train", "--device", "cpu", "--quick", "--layers", "2", "--seq", "16",
                     "--steps", "1", "--methods", "resident,fx_offload"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| fx_offload")]
    assert len(rows) == 1 and rows[0].rstrip(" |").endswith("0.00e+00"), rows


def test_a_host_compute_rows_bound_takes_the_fastest_read_the_host_was_seen_making():
    # a probe that read slower than the plain sum would make the bound no floor (x bound < 1)
    from fx_offload.benchmarks.common import fastest_host_read, plain_read_rate
    from fx_offload.host_compute.rates import HostRates
    plain = plain_read_rate(gib=1 / 64, reps=3)
    assert 1e8 < plain < 1e13       # a real rate in bytes/s, not seconds or GB/s
    slow = HostRates(read_rate=plain / 4, flop_rate=1e9, latency=1e-4,
                     shared_read_rate=plain / 3)
    assert fastest_host_read(slow, plain) == plain
    fast = HostRates(read_rate=plain * 2, flop_rate=1e9, latency=1e-4,
                     shared_read_rate=plain * 3)
    assert fastest_host_read(fast, plain) == plain * 3


def test_a_benchmark_generates_until_autos_trial_has_kept_a_plan(monkeypatch):
    # the timed calls must measure the plan kept, not the trial's turns; a model with no
    # trial (not "auto", or no size timed) is not generated on needlessly
    from types import SimpleNamespace
    from fx_offload import registry
    from fx_offload.benchmarks.common import settle_trials
    trial = SimpleNamespace(best=None)
    timer = SimpleNamespace(trials={})
    state = SimpleNamespace(host_experts=SimpleNamespace(timer=timer))
    built = []

    class Model:
        calls = 0

        def generate(self, prompt, **kwargs):
            self.calls += 1
            built.append(True)
            timer.trials[(1, 8)] = trial
            if self.calls == 3:
                trial.best = 0

    monkeypatch.setattr(registry, "state_for_model", lambda m: state if built else None)
    model = Model()
    assert settle_trials(model, None) == 3 and model.calls == 3
    assert settle_trials(model, None) == 0 and model.calls == 3     # settled: none more
    trial.best, model.calls = None, -100
    assert settle_trials(model, None, most=4) == 4                   # bounded
    timer.trials.clear()
    quiet = SimpleNamespace(generate=lambda prompt, **kw: built.append(True))
    assert settle_trials(quiet, None) == 1      # one generate, and no size was on trial
    state.host_experts = None                   # host_compute="never": no trial at all
    assert settle_trials(model, None) == 0
