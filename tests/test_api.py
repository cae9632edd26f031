"""The three routes into the backend, options validation, report, restore, logging."""
import copy
import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest
import torch

import fx_offload
from fx_offload.tools import models
from helpers import compile_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled(model, inputs, calls=2, **compile_kwargs):
    compiled = torch.compile(model, **compile_kwargs)
    with torch.no_grad():
        return [compiled(*inputs) for _ in range(calls)]


def test_plain_backend_name_uses_defaults_and_says_so(caplog):
    model, inputs = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="fx_offload"):
        outs = run_compiled(model, inputs, backend="prefetch_offload")
    with torch.no_grad():
        want = torch.compile(reference, backend="inductor")(*inputs)
    assert all(torch.equal(o, want) for o in outs)
    rep = fx_offload.report(model)
    assert rep.layers == [1, 3, 5] and rep.num_slots == 1
    summary = [r.getMessage() for r in caplog.records if "offloaded layer" in r.getMessage()]
    assert len(summary) == 1, summary
    assert "group_size=2, num_in_group=1, prefetch_step=1" in summary[0]
    assert "(defaults)" in summary[0]


def test_configured_backend_object_takes_torch_compile_mode(monkeypatch):
    seen = {}
    import fx_offload.compiler as compiler
    real = compiler.compile_inner

    def spy(gm, example_inputs, options, *rest):
        seen["mode"] = options.mode
        return real(gm, example_inputs, options, *rest)

    monkeypatch.setattr(compiler, "compile_inner", spy)
    model, inputs = models.build("mlp", num_layers=4)
    reference = copy.deepcopy(model)
    be = fx_offload.backend(group_size=2, num_in_group=1, inner_backend="inductor")
    outs = run_compiled(model, inputs, backend=be, mode="max-autotune-no-cudagraphs")
    assert seen["mode"] == "max-autotune-no-cudagraphs"
    with torch.no_grad():
        torch.testing.assert_close(outs[-1], reference(*inputs))


def test_mode_inside_options():
    model, inputs = models.build("mlp", num_layers=4)
    reference = copy.deepcopy(model)
    outs = run_compiled(model, inputs, backend="prefetch_offload",
                        options={"mode": "reduce-overhead"})   # cudagraphs skip on CPU
    with torch.no_grad():
        torch.testing.assert_close(outs[-1], reference(*inputs))


@pytest.mark.parametrize("options,needle", [
    ({"group_sise": 2}, "prefetch_offload: unknown option(s) ['group_sise'] ('group_sise': did "
     "you mean 'group_size'?); valid options are"),
    ({"options": {}}, "('options': give the options themselves as keywords, backend(**options))"),
    ({"group_size": 0}, "'group_size' must be >= 1"),
    ({"group_size": 2.0}, "'group_size' must be an int"),
    ({"group_size": True}, "'group_size' must be an int"),
    ({"num_in_group": 3, "group_size": 2}, "'num_in_group' (3) must not exceed 'group_size'"),
    ({"prefetch_step": 0}, "'prefetch_step' must be >= 1"),
    ({"offload_params": "w13_weight"}, "write ['w13_weight']"),
    ({"offload_params": []}, "'offload_params' is empty"),
    ({"offload_params": ["a..b", ""]}, "entries must be non-empty dotted names"),
    ({"inner_backend": "cudagraphs"}, "'inner_backend' must be one of"),
    ({"mode": "fast"}, "'mode' must be one of"),
    ({"mode": "reduce-overhead", "inner_backend": "eager"}, "is an Inductor mode"),
    ({"layers": 3}, "'layers' must be the dotted path"),
])
def test_bad_options_are_clear_errors_on_every_route(options, needle):
    """Each bad option is refused with what to change, through the backend object and
    through torch.compile's options (before anything moves)."""
    with pytest.raises(fx_offload.OffloadError) as err:     # a ValueError
        fx_offload.backend(**options)
    assert needle in str(err.value) and str(err.value).startswith("prefetch_offload: ")
    model, inputs = models.build("mlp", num_layers=4)
    with pytest.raises(Exception) as err:
        run_compiled(model, inputs, backend="prefetch_offload", options=options)
    assert needle in str(err.value)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert fx_offload.registry.state_for_model(model) is None   # nothing was offloaded


def test_compile_time_errors_name_the_fix():
    model, inputs = models.build("mlp", num_layers=4)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(Exception, match=r"'prefetch_step' \(3\) is larger than the number "
                                        r"of offloaded layers \(2"):
        run_compiled(model, inputs, backend="prefetch_offload", options={"prefetch_step": 3})
    with pytest.raises(Exception, match="option 'layers'='blocks': the model has no submodule"):
        run_compiled(model, inputs, backend="prefetch_offload", options={"layers": "blocks"})
    with pytest.raises(Exception, match="matches no parameter of the selected layers"):
        run_compiled(model, inputs, backend="prefetch_offload",
                     options={"offload_params": ["w13_weight"]})
    for n, p in model.named_parameters():     # weights untouched by the refused compiles
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n
    assert fx_offload.registry.state_for_model(model) is None


def test_grad_enabled_compile_is_refused():
    model, inputs = models.build("mlp", num_layers=4)
    compiled = torch.compile(model, backend="prefetch_offload")
    with pytest.raises(Exception, match="trains only parameters that are not offloaded"):
        compiled(*inputs)
    assert fx_offload.registry.state_for_model(model) is None
    with torch.no_grad():
        compiled(*inputs)                      # fine without grad
    with pytest.raises(Exception, match="trains only parameters that are not offloaded"):
        compiled(*inputs)                      # grad mode is guarded: recompiles, refused


def test_report_fields_and_table(caplog):
    model, compiled, reference, inputs = compile_pair(
        "moe", {"group_size": 3, "num_in_group": 2, "prefetch_step": 3,
                "inner_backend": "eager"}, {"num_layers": 7})
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        compiled(*inputs)
        compiled(*inputs)
    # layers alone in their slot are named once, with what that costs and what to change
    alone = [r.getMessage() for r in caplog.records if "alone in their slot" in r.getMessage()]
    assert len(alone) == 1 and "[2, 4]" in alone[0] and "prefetch_step=2 or less" in alone[0]
    assert ".data never reaches it" in alone[0]
    rep = fx_offload.report(model)
    assert rep.layers == [1, 2, 4, 5]
    assert rep.num_slots == 3 and rep.device == "cpu"
    per_layer = sum(p.numel() * p.element_size() for p in reference.layers[1].parameters())
    assert rep.offloaded_bytes == 4 * per_layer
    assert rep.buffer_bytes == 3 * per_layer
    assert rep.params[2][0].startswith("layers.2.")
    # 4 layers over 3 slots: slot 0 serves layers 1 and 5; slots 1 and 2 one layer each,
    # which stay resident and are never refilled
    assert rep.slot_of == {1: 0, 2: 1, 4: 2, 5: 0}
    assert rep.refill_of == {1: 5, 2: None, 4: None, 5: 1}
    # the first releases' names read the same values
    assert rep.target_of == rep.refill_of and rep.slots == rep.num_slots
    text = str(rep)
    for needle in ("layer  slot  prefetches next", "4 of 7 layers of 'layers' offloaded",
                   "layer 5", "3 slot buffer(s)"):
        assert needle in text, text


def test_slot_rotation_with_counts_not_divisible_by_step(caplog):
    model, compiled, reference, inputs = compile_pair(
        "mlp", {"group_size": 1, "num_in_group": 1, "prefetch_step": 2,
                "inner_backend": "eager"}, {"num_layers": 5})
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        compiled(*inputs)
    assert "alone in their slot" not in caplog.text      # every slot serves two or more
    rep = fx_offload.report(model)
    # 5 layers over 2 slots: slot 0 serves 0, 2, 4; slot 1 serves 1, 3
    assert rep.slot_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert rep.refill_of == {0: 2, 1: 3, 2: 4, 3: 1, 4: 0}
    slots = fx_offload.registry.state_for_model(model).buffers
    ptr = {i: slots.views[i]["fc1.weight"].data_ptr() for i in range(5)}
    assert ptr[0] == ptr[2] == ptr[4] != ptr[1] == ptr[3]


def test_restore_returns_weights_bitwise_and_model_runs_eagerly():
    model, compiled, reference, inputs = compile_pair("decoder", {"prefetch_step": 2,
                                                                  "inner_backend": "aot_eager"})
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for _ in range(3):
            compiled(*inputs)
        fx_offload.restore(model)
        assert fx_offload.registry.state_for_model(model) is None
        for name, p in model.named_parameters():
            assert torch.equal(p, originals[name]), name
        assert len({p.data_ptr() for p in model.parameters()}) == len(originals)
        assert torch.equal(model(*inputs), reference(*inputs))
        assert torch.equal(compiled(*inputs), reference(*inputs))  # ops now do nothing
    with pytest.raises(ValueError, match="has no offloaded weights"):
        fx_offload.restore(model)


def test_uncompiled_model_after_offload_loads_weights_itself():
    model, compiled, reference, inputs = compile_pair("mlp", {"inner_backend": "eager"})
    with torch.no_grad():
        compiled(*inputs)
        assert torch.equal(model(*inputs), reference(*inputs))
        assert torch.equal(compiled(*inputs), reference(*inputs))


def test_recompile_reuses_state_and_buffers():
    model, compiled, reference, inputs = compile_pair("mlp", {"prefetch_step": 2,
                                                              "inner_backend": "aot_eager"})
    with torch.no_grad():
        compiled(*inputs)
        state = fx_offload.registry.state_for_model(model)
        ptrs = [p.data_ptr() for p in model.parameters()]
        for batch in (7, 1, 13):          # new shapes: Dynamo recompiles
            x = torch.randn(batch, inputs[0].shape[1])
            assert torch.equal(compiled(x), reference(x))
    assert fx_offload.registry.state_for_model(model) is state
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_same_model_other_options_is_refused():
    model, inputs = models.build("mlp", num_layers=4)
    run_compiled(model, inputs, backend="prefetch_offload", options={"inner_backend": "eager"})
    with pytest.raises(Exception, match="already offloaded with"):
        run_compiled(model, inputs, backend="prefetch_offload",
                     options={"inner_backend": "eager", "prefetch_step": 2})


def test_entry_point_and_cli_demo():
    """The installed entry point resolves the name without importing fx_offload first, and
    the README's main job runs."""
    code = ("import torch, torch.nn as nn\n"
            "from importlib.metadata import entry_points\n"
            "names = [e.name for e in entry_points(group='torch_dynamo_backends')]\n"
            "assert 'prefetch_offload' in names, names\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "fn = lookup_backend('prefetch_offload')\n"
            "print(fn.__module__)\n")
    try:
        importlib.metadata.version("fx_offload")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("fx_offload is not installed: run `pip install -e .[test]` first")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fx_offload" in out.stdout
    demo = subprocess.run([sys.executable, "-m", "fx_offload", "demo", "--layers", "4",
                           "--inner-backend", "aot_eager", "--calls", "2"],
                          capture_output=True, text=True, cwd=ROOT)
    assert demo.returncode == 0, demo.stdout + demo.stderr[-2000:]
    assert "(OK)" in demo.stdout and "fx_offload report for TinyDecoder" in demo.stdout


@pytest.mark.parametrize("argv, message", [
    (["demo", "--layers", "4", "--group-size", "2", "--num-in-group", "3"],
     "error: prefetch_offload: option 'num_in_group' (3) must not exceed 'group_size' (2)"),
    (["demo", "--device", "cuda:0"] if not torch.cuda.is_available() else
     ["demo", "--layers", "1"], "error: "),
    (["demo", "--calls", "0"], "error: argument --calls: calls checked: an int >= 1, got '0'"),
    (["demo", "--device", "gpu"], "error: --device 'gpu' names no device torch knows; give "
     "cuda, cuda:1 or cpu"),
    pytest.param(["flux"], "error: the flux benchmark needs a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_cli_errors_are_one_line_not_a_traceback(argv, message):
    out = subprocess.run([sys.executable, "-m", "fx_offload", *argv], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("options, warning", [
    ({"group_size": 4, "num_in_group": 1, "prefetch_step": 2},          # a slot each
     "the slots hold nearly all of it): lower prefetch_step (2 now) or offload more"),
    ({"group_size": 8, "num_in_group": 1, "prefetch_step": 1},          # one layer, one slot
     "the slots hold nearly all of it): offload more layers"),
    ({"group_size": 2, "num_in_group": 1, "prefetch_step": 2}, None),
])
def test_options_that_save_nothing_warn(options, warning, caplog):
    model, inputs = models.build("mlp", num_layers=8)
    with caplog.at_level("WARNING", logger="fx_offload"):
        run_compiled(model, inputs, backend="prefetch_offload",
                     options={"inner_backend": "eager", **options})
    if warning is None:
        assert "the slots hold nearly all of it" not in caplog.text
    else:
        assert warning in caplog.text
        # every layer alone in its slot: this one warning, not a second about the same slots
        assert "alone in their slot" not in caplog.text


def test_report_names_dynamos_recompile_limit_when_a_compiled_forward_ran_uncompiled():
    """Models of one class compiled one after another add entries to one code object; past
    Dynamo's recompile limit it runs the next one uncompiled (nothing offloaded).  report
    says so instead of only "compile it"."""
    torch._dynamo.reset()
    compiled = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed in range(2):
            model, inputs = models.build_decoder(num_layers=4, seed=seed)
            fx_offload.compile_forward(model, inner_backend="aot_eager", group_size=2,
                                       num_in_group=1)
            with torch.no_grad():
                model(*inputs)
            compiled.append(model)
    fx_offload.report(compiled[0])          # the first was compiled and offloaded
    with pytest.raises(fx_offload.errors.OffloadError, match="recompile_limit"):
        fx_offload.report(compiled[1])


def test_every_public_function_taking_a_model_refuses_what_is_not_one():
    """None, a tensor or a state dict given where a model goes: every public function whose
    first argument is the model says what it expected (before anything else is checked),
    as report always did; none fails inside with a TypeError."""
    import inspect
    takers = [name for name in fx_offload.__all__
              for f in [getattr(fx_offload, name)]
              if inspect.isfunction(f)
              and next(iter(inspect.signature(f).parameters), None) == "model"]
    assert {"place", "report", "restore", "explain", "named_weights", "update_weights",
            "compile_forward"} <= set(takers)
    args = {"update_weights": ({},), "explain": (torch.zeros(2),)}
    for bad in (None, torch.zeros(2), {"w": torch.zeros(2)}):
        for name in takers:
            with pytest.raises(fx_offload.OffloadError, match=(
                    rf"^fx_offload.{name}: expected a model \(an nn.Module, or what "
                    rf"torch.compile returned for one\), got {type(bad).__name__}$")):
                getattr(fx_offload, name)(bad, *args.get(name, ()))


def test_the_pass_runs_from_the_choice_and_a_handle_before_any_state_exists(monkeypatch):
    """The phases run one way (selection -> pass -> runtime): at a model's first compile the
    pass gets the choice and a new handle, and the run-time state is built only after it, so
    a pass that fails leaves no state and the model as it was.  What the pass learns from
    the graph goes to the state, never into the choice."""
    from fx_offload import compiler, registry
    from fx_offload.runtime.state import OffloadState
    built, seen = [], []
    real_init, real_pass = OffloadState.__init__, compiler.run_prefetch_pass

    def init(self, model, choice, handle=None, learned=None):
        built.append(handle)
        real_init(self, model, choice, handle, learned)

    def failing_pass(gm, gi, choice, learned, handle, host_compute, host_mlps):
        seen.append((choice, handle, list(built)))
        raise RuntimeError("injected in the pass")

    monkeypatch.setattr(OffloadState, "__init__", init)
    monkeypatch.setattr(compiler, "run_prefetch_pass", failing_pass)
    model, (x,) = models.build("decoder", num_layers=4, batch=1, seq=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    with pytest.raises(Exception, match="injected in the pass"), torch.no_grad():
        torch.compile(model, backend="prefetch_offload",
                      options=dict(inner_backend="eager"))(x)
    (choice, handle, built_then), = seen
    assert choice.layers and isinstance(handle, int) and built_then == []
    assert built == [] and registry.state_for_model(model) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # with the pass as it is: one state, named by the handle the pass gave its ops
    monkeypatch.setattr(compiler, "run_prefetch_pass",
                        lambda *a: seen.append(a[3:5]) or real_pass(*a))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="prefetch_offload", options=dict(inner_backend="eager"))(x)
    state = registry.state_for_model(model)
    learned, handle = seen[-1]
    assert built == [handle] == [state.handle]
    # what the pass learned (the chunks) is the state's, and the choice holds none of it
    assert state.learned is learned and set(learned.layout) == set(state.layers)
    assert not hasattr(state.choice, "layout") and not hasattr(state.choice, "routing")
    fx_offload.restore(model)


def test_an_nn_sequential_offloads_through_its_compiled_forward(caplog, monkeypatch):
    """Dynamo does not trace from nn.Sequential's own forward: ``torch.compile(m.forward)``
    (and ``compile_forward``) trace a wrapper that holds the bound method.  The model behind
    it is still found: offloaded, the same outputs, reported through the compiled forward,
    restored bitwise; a graph whose model cannot be found says so instead of nothing."""
    from fx_offload import registry
    torch.manual_seed(0)
    for route in ("compile_forward", "torch.compile(m.forward)"):
        torch._dynamo.reset()
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32),
                                                          torch.nn.ReLU())
                                      for _ in range(8))).eval()
        before = copy.deepcopy(model.state_dict())
        x = torch.randn(3, 32)
        with torch.no_grad():
            expected = model(x)
            if route == "compile_forward":
                fx_offload.compile_forward(model, inner_backend="aot_eager")
                call = model.forward
                got = model(x)
            else:
                call = torch.compile(model.forward, backend="prefetch_offload",
                                     options={"inner_backend": "aot_eager"})
                got = call(x)
        assert registry.state_for_model(model) is not None, route
        assert torch.equal(got, expected), route
        assert fx_offload.report(call).layers == [1, 3, 5, 7], route
        fx_offload.restore(model)
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), route
    # parameters of a model the compiled frame does not name: a warning, not silence
    from fx_offload import compiler
    monkey = compiler.read_graph_inputs

    def unnamed(gm, example_inputs):
        gi = monkey(gm, example_inputs)
        return gi.__class__(None, False, None, {}, gi.placeholders)
    torch._dynamo.reset()
    monkeypatch.setattr(compiler, "read_graph_inputs", unnamed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).eval()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fx_offload"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "aot_eager"})(torch.randn(2, 4))
    assert "reads 4 parameter(s) of a model that the compiled frame does not name" in \
        caplog.text


def test_option_names_of_mixed_types_are_refused_clearly():
    # names of several types cannot be sorted together: still the project's error
    model, inputs = models.build("mlp", num_layers=4)
    with pytest.raises(Exception) as err:
        run_compiled(model, inputs, backend="prefetch_offload", options={1: 2, "x": 3})
    assert "prefetch_offload: unknown option(s) ['x', 1]; valid options are" in str(err.value)


def test_a_layer_of_an_offloaded_model_is_named_as_such_and_a_plain_model_takes_weights():
    """``restore``, ``report`` and ``update_weights`` given one layer of an offloaded model
    say so and to pass the model (they named it a copy, or said to compile it); nothing
    changes.  ``update_weights`` on a model that is not offloaded writes, as documented."""
    model, inputs = models.build("mlp", num_layers=4)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        compiled(*inputs)
    before = {k: v.clone() for k, v in fx_offload.named_weights(model)}
    layer = model.layers[1]
    for call in (fx_offload.restore, fx_offload.report,
                 lambda m: fx_offload.update_weights(m, {})):
        with pytest.raises(fx_offload.OffloadError, match=r"is a part of the offloaded "
                           r"\w+ \(it holds offloaded weights of layer 1\); pass the model"):
            call(layer)
    assert all(torch.equal(v, before[k]) for k, v in fx_offload.named_weights(model))
    assert fx_offload.report(model).layers == [1, 3]
    plain, _ = models.build("mlp", num_layers=4)
    name, param = next(iter(plain.named_parameters()))
    fx_offload.update_weights(plain, {name: torch.full_like(param, 0.5)})
    assert torch.equal(param, torch.full_like(param, 0.5))
    with pytest.raises(fx_offload.OffloadError, match="nothing was written"):
        fx_offload.update_weights(plain, {name: torch.zeros(1)})
    assert torch.equal(param, torch.full_like(param, 0.5))


def test_update_weights_takes_the_compiled_wrappers_own_state_dict():
    # torch.compile's wrapper names the weights "_orig_mod.<name>", as load_state_dict on it
    # accepts them
    model, inputs = models.build("mlp", num_layers=4)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        compiled(*inputs)
    new = {k: torch.full_like(v, 0.25) for k, v in compiled.state_dict().items()}
    assert all(k.startswith("_orig_mod.") for k in new)
    fx_offload.update_weights(compiled, new)
    assert all(torch.equal(v, torch.full_like(v, 0.25))
               for _, v in fx_offload.named_weights(model))
