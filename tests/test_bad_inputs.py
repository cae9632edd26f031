"""Every row of docs/errors.md: a bad input and the clear error it gets.  Nothing is offloaded
when an error is raised."""
import re

import pytest
import torch
from torch import nn

import fx_offload
from fx_offload.tools import models
from fx_offload.tools.models import MLPBlock
from helpers import PLANNER_RATES as RATES


class TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList(MLPBlock(8, 8) for _ in range(3))
        self.decoder = nn.ModuleList(MLPBlock(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in [*self.encoder, *self.decoder]:
            x = layer(x)
        return x


class OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock(8, 8)])

    def forward(self, x):
        return self.layers[0](x)


class NoStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


def mlp():
    return models.build("mlp", num_layers=4)


def small(cls):
    return lambda: (cls().eval(), (torch.randn(2, 8),))


class Partial(nn.Module):
    """Runs only the layers in ``run``: the others may sit on another device (here "meta",
    standing in for a GPU on a CPU-only machine) without the forward touching them."""

    def __init__(self, run):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(8, 8) for _ in range(4))
        self.run = run

    def forward(self, x):
        for i in self.run:
            x = self.layers[i](x)
        return x


def meta_mlp():
    model, _ = mlp()
    return model.to("meta"), (torch.randn(4, 32, device="meta"),)


def mixed_devices():
    model = Partial([0, 1, 2]).eval()
    model.layers[3].to("meta")       # offloaded layers 1 (cpu) and 3 (elsewhere)
    return model, (torch.randn(2, 8),)


# (id, factory, options, extra compile kwargs, pattern of the error)
ROWS = [
    ("unknown_key", mlp, {"prefetch_stpe": 2}, {},
     r"prefetch_offload: unknown option\(s\) \['prefetch_stpe'\] \('prefetch_stpe': did you "
     r"mean 'prefetch_step'\?\); valid options are"),
    ("bad_type", mlp, {"group_size": "4"}, {}, r"'group_size' must be an int >= 1"),
    ("bad_value", mlp, {"prefetch_step": 0}, {}, r"'prefetch_step' must be >= 1"),
    ("bad_chunks", mlp, {"copy_chunks": 0}, {}, r"'copy_chunks' must be >= 1"),
    ("bad_circular", mlp, {"circular_prefetch": "start"}, {},
     r"'circular_prefetch' must be one of \['auto', 'end', 'entry'\], got 'start'"),
    ("num_over_group", mlp, {"group_size": 2, "num_in_group": 3}, {},
     r"'num_in_group' \(3\) must not exceed 'group_size' \(2\)"),
    ("offload_params_str", mlp, {"offload_params": "fc1"}, {}, r"write \['fc1'\]"),
    ("inner_backend", mlp, {"inner_backend": "tvm"}, {}, r"'inner_backend' must be one of"),
    ("mode_with_eager", mlp, {"inner_backend": "eager", "mode": "max-autotune"}, {},
     r"is an Inductor mode"),
    ("no_stack", small(NoStack), {}, {}, r"found no stack of repeated layers .* pass the "
                                         r"option 'layers'"),
    ("layers_twice", mlp, {"layers": ["layers", "layers"]}, {},
     r"option 'layers' names a list twice: \['layers', 'layers'\]"),
    ("layers_inside_another", small(TwoStacks), {"layers": ["", "encoder"]}, {},
     r"option 'layers': 'encoder' is inside '<root>'; give layer lists that do not contain"),
    ("layers_not_paths", mlp, {"layers": ["layers", 3]}, {},
     r"option 'layers' must be the dotted path of the layer list, such as 'model.layers', or "
     r"a list of paths"),
    ("layers_missing", mlp, {"layers": "model.layers"}, {},
     r"'layers'='model.layers': the model has no submodule at that path; candidates are "
     r"\['layers'\]"),
    ("layers_not_list", mlp, {"layers": "layers.0"}, {},
     r"'layers'='layers.0' names a MLPBlock, not an nn.ModuleList"),
    ("layer_list_of_one", small(OneLayer), {"layers": "layers"}, {},
     r"'layers'='layers' has 1 layer\(s\); offloading needs a stack of at least 2"),
    ("offload_params_nothing", mlp, {"offload_params": ["q_proj"]}, {},
     r"'offload_params'=\['q_proj'\] matches no parameter .* look like \['fc1.weight'"),
    ("step_over_count", mlp, {"prefetch_step": 3}, {},
     r"'prefetch_step' \(3\) is larger than the number of offloaded layers \(2: layers "
     r"\[1, 3\]\); use prefetch_step <= 2"),
    ("meta_weights", meta_mlp, {"inner_backend": "eager"}, {},
     r"cannot offload weights on the meta device"),
    ("mixed_devices", mixed_devices, {"inner_backend": "eager"}, {},
     r"needs the offloaded layers' weights on one device, found \['cpu', 'meta'\]"),
    ("budget_malformed", mlp, {"memory_budget": "40 gigs"}, {},
     r"'memory_budget' must be a positive number of bytes \(an int\) or a string such as "
     r"'40GiB'"),
    ("budget_bool", mlp, {"memory_budget": True}, {},
     r"'memory_budget' must be a positive number of bytes .*, got True"),
    ("options_not_a_mapping", mlp, "group_size=2", {},
     r"options must be a dict of option names to values, such as \{'group_size': 4\}, got "
     r"str 'group_size=2'"),
    ("budget_and_hand_picked", mlp, {"memory_budget": "1GiB", "prefetch_step": 2}, {},
     r"options \['prefetch_step'\] and 'memory_budget' both decide what is offloaded"),
    ("planner_option_alone", mlp, {"h2d_bandwidth": 5e10}, {},
     r"option\(s\) \['h2d_bandwidth'\] only apply to the planner: give 'memory_budget'"),
    ("group_larger_than_the_stack", mlp, {"group_size": 9, "num_in_group": 1}, {},
     r"selected no layer to offload with group_size=9, num_in_group=1 on a stack of 4 layers "
     r".*no group is complete: use group_size <= 4"),
    ("budget_below_minimum", mlp, {"memory_budget": 1000, **RATES}, {},
     r"'memory_budget' \(1000B, 1000 bytes\) is below the least this model can run in: "
     r".* \(\d+ bytes\) = the weights that stay on the device plus one slot buffer"),
]


def compile_and_call(factory, options, **kwargs):
    model, inputs = factory()
    with torch.no_grad():
        torch.compile(model, backend="prefetch_offload", options=options, **kwargs)(*inputs)
    return model


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_row(row):
    _, factory, options, kwargs, pattern = row
    model, inputs = factory()
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(model, backend="prefetch_offload", options=options, **kwargs)(*inputs)
    assert re.search(pattern, str(err.value), re.S), str(err.value)[:2000]
    # Dynamo wraps what the backend raised; underneath is our one error class, prefixed
    inner = getattr(err.value, "inner_exception", err.value)
    assert isinstance(inner, fx_offload.OffloadError), repr(inner)
    assert str(inner).startswith("prefetch_offload: "), str(inner)
    assert fx_offload.registry.state_for_model(model) is None


def test_an_option_given_as_none_takes_its_default_and_sizes_take_their_spellings():
    """None leaves any option at its default (as compress=None always did), and is not
    counted as given; a whole float and an exponent with its sign are sizes too."""
    assert fx_offload.backend(group_size=None, compress=None, kv_layers=None,
                              memory_budget=None).options == fx_offload.OffloadOptions()
    from fx_offload.options import parse_size
    assert parse_size("memory_budget", 40e9) == parse_size("memory_budget", "1e+9") * 40
    with pytest.raises(fx_offload.OffloadError, match="got 2.5"):
        parse_size("memory_budget", 2.5)


def test_whole_numbers_of_any_type_are_ints_and_bools_and_fractions_are_not():
    """numpy's integers (and anything whole through ``__index__``) are taken wherever an int
    is, as the same Python int; a bool, a fraction and numpy's bool are refused as before."""
    np = pytest.importorskip("numpy")
    opts = fx_offload.parse_options({"memory_budget": np.int64(40_000_000),
                                     "plan_tokens": [np.int32(1), 16]})
    assert opts.memory_budget == 40_000_000 and type(opts.memory_budget) is int
    assert opts.plan_tokens == (1, 16)
    assert fx_offload.parse_options({"memory_budget": "40GiB"}).memory_budget == 40 * 2**30
    assert fx_offload.parse_options({"memory_budget": np.float32(4096)}).memory_budget == 4096
    assert fx_offload.parse_options({"memory_budget": torch.tensor(4096)}).memory_budget == 4096
    hand = fx_offload.parse_options({"group_size": np.int64(4), "num_in_group": np.uint8(2),
                                     "kv_cache": "host", "kv_layers": [np.int16(0), 1]})
    assert (hand.group_size, hand.num_in_group, hand.kv_layers) == (4, 2, (0, 1))
    assert type(hand.group_size) is int
    assert fx_offload.parse_options({"expert_cache": np.int64(0)}).expert_cache == 0
    for bad in (np.bool_(True), True, np.float64(2.5), 2.5):
        with pytest.raises(fx_offload.OffloadError, match="'memory_budget' must be a positive"):
            fx_offload.parse_options({"memory_budget": bad})
    for bad in (np.bool_(True), np.float64(4.0)):
        with pytest.raises(fx_offload.OffloadError, match="'group_size' must be an int"):
            fx_offload.parse_options({"group_size": bad})


def test_grad_mode_row():
    model, inputs = mlp()
    with pytest.raises(Exception, match="trains only parameters that are not offloaded"):
        torch.compile(model, backend="prefetch_offload")(*inputs)


def test_inductor_freezing_row():
    import torch._inductor.config as config
    model, inputs = mlp()
    with config.patch(freezing=True), torch.no_grad(), pytest.raises(
            Exception, match=r"cannot be used with Inductor freezing"):
        torch.compile(model, backend="prefetch_offload")(*inputs)
    assert all(not m._forward_pre_hooks for m in model.layers)


def test_same_model_other_options_row():
    model = compile_and_call(mlp, {"inner_backend": "eager"})
    model_inputs = (torch.randn(4, 32),)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=r"already offloaded with "
                                                         r"group_size=2.*Call "
                                                         r"fx_offload.restore\(model\) first"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager", "group_size": 4})(*model_inputs)


def test_offloaded_model_offloaded_again_row():
    """A part of an offloaded model, compiled on its own with its own layer stack."""
    outer = nn.Module()
    outer.model, inputs = models.build("mlp", num_layers=4)
    outer.forward = lambda x: outer.model(x)
    compile_and_call(lambda: (outer.model, inputs), {"inner_backend": "eager"})
    wrapper = nn.Sequential(outer.model)           # a new root holding the offloaded model
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=r"already offloaded"):
        torch.compile(wrapper, backend="prefetch_offload",
                      options={"inner_backend": "eager", "layers": "0.layers"})(*inputs)


def test_weights_on_host_with_model_on_gpu_row():
    """Offloaded layers already on the host while the rest is on an accelerator."""
    model = Partial([1, 3]).eval()
    model.layers[0].to("meta")          # stands for "the rest is on the GPU"
    model.layers[2].to("meta")
    with torch.no_grad(), pytest.raises(Exception, match=r"already on the host \(cpu\) while "
                                                         r"the rest of the model is on "
                                                         r"\['meta'\]"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager"})(torch.randn(2, 8))


def test_layer_output_viewing_an_offloaded_weight_row():
    class Leaky(MLPBlock):
        def forward(self, x):
            return x + self.fc2(self.fc1(x)), self.fc1.weight.t()

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Leaky(8, 8) for _ in range(4))

        def forward(self, x):
            total = 0
            for layer in self.layers:
                x, w = layer(x)
                total = total + w.sum()
            return x + total

    model = Stack().eval()
    with torch.no_grad(), pytest.raises(Exception, match=r"returns a view of the offloaded "
                                                         r"weight layers\.1\.fc1\.weight, .*"
                                                         r"exclude that parameter"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager"})(torch.randn(2, 8))
    assert fx_offload.registry.state_for_model(model) is None


def test_layer_weight_read_outside_the_layer_row():
    class Peeking(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(MLPBlock(8, 8) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x + self.layers[1].fc1.bias     # reads an offloaded weight outside it

    model = Peeking().eval()
    # the node named as the user can find it: its op and the line of code that made it
    with torch.no_grad(), pytest.raises(Exception, match=r"node add_4 \(add, at test_bad_inputs"
                                                         r"\.py:\d+: `return x \+ self\.layers"
                                                         r"\[1\]\.fc1\.bias.*`\) reads "
                                                         r"layers\.1\.fc1\.bias of offloaded "
                                                         r"layer layers\.1 outside"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager"})(torch.randn(2, 8))
    assert fx_offload.registry.state_for_model(model) is None


def test_cpu_model_while_cuda_is_available_row(monkeypatch, caplog):
    """Offloading weights that already live in host memory saves nothing: said, not refused
    (it is how the CPU simulation runs)."""
    import logging
    monkeypatch.setattr(fx_offload.selection.decide, "_cuda_available", lambda: True)
    model, inputs = mlp()
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager"})(*inputs)
    assert any("is on the CPU although CUDA is available" in r.getMessage()
               for r in caplog.records)


class RunsLayerTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(8, 8) for _ in range(4))

    def forward(self, x):
        for i in (0, 1, 2, 3, 1):
            x = self.layers[i](x)
        return x


def test_layer_run_twice_in_one_forward_row():
    model, inputs = small(RunsLayerTwice)()
    with torch.no_grad(), pytest.raises(Exception, match=r"offloaded layer layers.1 runs again "
                                        r".* Keep it resident"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager"})(*inputs)
    assert fx_offload.registry.state_for_model(model) is None


def test_layer_reading_weights_before_any_activation_row():
    """A layer whose first copy chunk is read before the graph has computed anything: no op
    can be ordered ahead of those reads to wait for the chunk (an ordering no compiler may
    move needs an activation to hang on)."""
    class ScaledFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(8, 8))
            self.proj = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            scale = self.scale.square().mean()      # weights alone, before any activation
            if x is None:
                x = torch.ones(2, 8)
            return (x @ self.proj) * scale

    class FromNothing(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(ScaledFirst() for _ in range(4))

        def forward(self):
            x = None
            for layer in self.layers:
                x = layer(x)
            return x

    model = FromNothing().eval()
    with torch.no_grad(), pytest.raises(Exception, match=r"offloaded layer layers\.0 reads the "
                                                         r"weights of its copy chunk\(s\) \[0\] "
                                                         r"before any activation feeds them"):
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "eager", "group_size": 1, "prefetch_step": 2,
                               "copy_chunks": 2})()
    assert fx_offload.registry.state_for_model(model) is None
    # offloading the layers after it is fine: their reads follow layer 0's output
    with torch.no_grad():
        want = model()
        got = torch.compile(model, backend="prefetch_offload",
                            options={"inner_backend": "eager", "group_size": 2,
                                     "copy_chunks": 2})()
    assert torch.equal(got, want)


def test_layers_that_train_every_parameter_are_said_to_be_why_nothing_is_offloaded():
    """Training with the chosen layers' weights unfrozen (the others frozen): nothing to
    offload, and the error says why and what to change, instead of naming options that are
    fine."""
    model, inputs = mlp()
    for i, layer in enumerate(model.layers):
        layer.requires_grad_(i % 2 == 1)        # layers 1 and 3 (the chosen ones) train
    model.train()
    with pytest.raises(Exception) as err:
        torch.compile(model, backend="prefetch_offload",
                      options={"inner_backend": "aot_eager"})(*inputs)
    assert "every parameter of layers [1, 3] requires grad (trained), so they stay on the " \
        "device: freeze the weights to offload (requires_grad_(False))" in str(err.value)
    assert fx_offload.registry.state_for_model(model) is None
