"""A model bigger than the GPU, from its checkpoint: built on the meta device, placed with
``fx_offload.place(model, device, checkpoint=...)`` (each tensor read straight into the memory
that keeps it), compiled, and equal to the model it was saved from; the planner choosing
from a trace on the meta device; faults at every tensor read; peak host memory."""
import copy
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import fx_offload
from helpers import PLANNER_RATES as RATES, assert_same_greedy_tokens
from fx_offload.checkpoint import Checkpoint, empty_weights
from fx_offload.errors import OffloadError
from fx_offload.tools import models

safetensors_torch = pytest.importorskip("safetensors.torch", reason="install the test extra")
OPTIONS = {"inner_backend": "aot_eager"}


def save(model, folder, kind):
    """Write ``model``'s state dict as one file, as a sharded folder with an index, or keep
    it as a mapping; returns what ``place`` is given."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if kind == "mapping":
        return sd
    if kind == "file":
        path = os.path.join(folder, "weights.safetensors")
        safetensors_torch.save_file(sd, path)
        return path
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        safetensors_torch.save_file({k: sd[k] for k in keys}, os.path.join(folder, shard))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    return folder


def assert_same_weights(model, reference):
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].device.type != "meta", name
        assert torch.equal(got[name], want[name]), name


def assert_placed_nothing(model, before, params, values=True):
    """A place() that raised left ``model`` as it was: no state, no hooks, its own parameter
    objects on their devices (holding ``before``'s values where ``values``)."""
    assert fx_offload.registry.state_for_model(model) is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    for name, t in model.state_dict().items():
        assert t.device == before[name].device, name
        assert not values or torch.equal(t, before[name]), name


@pytest.mark.parametrize("kind", ["file", "sharded_folder", "mapping"])
@pytest.mark.parametrize("name", ["mlp", "decoder"])
def test_a_model_built_without_weights_placed_from_its_checkpoint(name, kind, tmp_path):
    reference, inputs = models.build(name, num_layers=6)
    source = save(reference, tmp_path, kind)
    with empty_weights():
        model, _ = models.build(name, num_layers=6)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())      # computed, not saved
    fx_offload.place(model, "cpu", checkpoint=source, group_size=2, num_in_group=1)
    assert fx_offload.report(model).layers == [1, 3, 5]
    assert_same_weights(model, reference)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    assert_same_weights(model, reference)
    fx_offload.restore(model)
    assert_same_weights(model, reference)


def test_checkpoint_values_take_the_models_dtype(tmp_path):
    reference, (x,) = models.build("mlp", num_layers=4)
    path = save(reference, tmp_path, "file")                    # float32 on disk
    with empty_weights():
        model, _ = models.build("mlp", num_layers=4)
    model.to(torch.bfloat16)
    fx_offload.place(model, "cpu", checkpoint=path, group_size=2, num_in_group=1)
    assert_same_weights(model, copy.deepcopy(reference).to(torch.bfloat16))


def test_a_checkpoint_overrides_real_weights_and_leaves_the_rest(tmp_path):
    """A model with real (stale) weights and a checkpoint holding some of them: the
    checkpoint's values are taken where it has them, the model's own elsewhere."""
    reference, (x,) = models.build("mlp", num_layers=4)
    stale, _ = models.build("mlp", num_layers=4, seed=1)
    partial = {k: v for k, v in reference.state_dict().items() if "fc1" in k}
    fx_offload.place(stale, "cpu", checkpoint=partial, group_size=2, num_in_group=1)
    want = {k: (reference if "fc1" in k else models.build("mlp", num_layers=4, seed=1)[0])
            .state_dict()[k] for k in reference.state_dict()}
    got = stale.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


transformers = pytest.importorskip("transformers", reason="install the test extra")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def hf_pair(tmp_path, tie: bool):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SMALL, tie_word_embeddings=tie)).eval()
    reference.save_pretrained(tmp_path, max_shard_size="100KB")    # sharded safetensors
    with empty_weights():
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model, reference


# each dimension both ways, in two runs rather than four (each is a whole HF journey)
@pytest.mark.parametrize("tie, planned", [(False, False), (True, True)],
                         ids=["untied-hand_picked", "tied-memory_budget"])
def test_hugging_face_from_save_pretrained_generates(tmp_path, tie, planned):
    model, reference = hf_pair(tmp_path, tie)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    ids = torch.randint(0, 256, (1, 6))
    if planned:
        weights = sum(p.numel() * p.element_size() for p in reference.parameters())
        # ids alone, as the model is called: the trace leaves the KV cache out by itself
        options = dict(memory_budget=weights // 2, example_inputs=(ids,), **RATES)
    else:
        options = dict(group_size=2, num_in_group=1, prefetch_step=1)
    fx_offload.place(model, "cpu", checkpoint=tmp_path, **options)
    assert fx_offload.report(model).layers
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert_same_weights(model, reference)
    model.forward = torch.compile(model.forward, backend="prefetch_offload", options=OPTIONS)
    assert_same_greedy_tokens(model, reference, ids)
    assert fx_offload.registry.state_for_model(model).stats["prefetches"] > 0
    assert_same_weights(model, reference)


def test_place_plans_as_the_compile_route_does(tmp_path):
    """memory_budget at place() (a trace of a meta copy on example inputs) chooses what the
    same budget chooses at compile time on the model itself."""
    reference, (x,) = models.build("mlp", num_layers=8)
    budget = 0.6 * sum(p.numel() * 4 for p in reference.parameters())
    options = dict(memory_budget=int(budget), plan_tokens=[4], **RATES)
    resident = copy.deepcopy(reference)
    compiled = torch.compile(resident, backend="prefetch_offload",
                             options={**options, **OPTIONS})
    with torch.no_grad():
        compiled(x)
    with empty_weights():
        model, _ = models.build("mlp", num_layers=8)
    before = copy.deepcopy(model)
    fx_offload.place(model, "cpu", checkpoint=save(reference, tmp_path, "file"),
                     example_inputs=(x,), **options)
    at_compile, at_place = fx_offload.report(resident), fx_offload.report(model)
    assert at_place.layers == at_compile.layers and at_place.layers
    assert at_place.num_slots == at_compile.num_slots
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    # the trace ran on a meta copy: the model was not touched before placing
    assert all(p.device.type == "meta" for p in before.parameters())


def test_a_budget_that_holds_everything_moves_the_model(tmp_path):
    reference, (x,) = models.build("mlp", num_layers=4)
    with empty_weights():
        model, _ = models.build("mlp", num_layers=4)
    fx_offload.place(model, "cpu", checkpoint=save(reference, tmp_path, "file"),
                     example_inputs=(x,), memory_budget="1GiB", **RATES)
    assert fx_offload.report(model).layers == []
    assert_same_weights(model, reference)
    with torch.no_grad():
        out = torch.compile(model, backend="prefetch_offload", options=OPTIONS)(x)
    assert torch.equal(out, reference(x))


@pytest.mark.parametrize("fail_at", [0, 3, 9, 17])
def test_a_failed_read_loses_nothing_and_place_can_be_retried(tmp_path, fail_at, monkeypatch):
    """A read that fails (a truncated file, a full disk, Ctrl-C) at any tensor: the error
    reaches the caller, no offload state or hook is left, every tensor holds the checkpoint's
    value or is still on the meta device; placing again finishes the job."""
    reference, (x,) = models.build("mlp", num_layers=8)
    path = save(reference, tmp_path, "file")
    with empty_weights():
        model, _ = models.build("mlp", num_layers=8)
    calls = {"n": 0}
    real = Checkpoint.read_into

    def flaky(self, name, dest):
        calls["n"] += 1
        if calls["n"] == fail_at + 1:
            raise KeyboardInterrupt
        return real(self, name, dest)

    monkeypatch.setattr(Checkpoint, "read_into", flaky)
    with pytest.raises(KeyboardInterrupt):
        fx_offload.place(model, "cpu", checkpoint=path, group_size=2, num_in_group=1)
    monkeypatch.setattr(Checkpoint, "read_into", real)
    assert fx_offload.registry.state_for_model(model) is None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    want = reference.state_dict()
    for name, t in model.state_dict().items():
        assert t.device.type == "meta" or torch.equal(t, want[name]), name
    fx_offload.place(model, "cpu", checkpoint=path, group_size=2, num_in_group=1)
    assert_same_weights(model, reference)
    with torch.no_grad():
        out = torch.compile(model, backend="prefetch_offload", options=OPTIONS)(x)
    assert torch.equal(out, reference(x))


def test_peak_host_memory_holds_each_weight_once(tmp_path):
    """In a fresh process: placing a 192 MiB model from its checkpoint onto the CPU raises
    peak resident memory by the model's size plus its slot (each weight read once, into the
    memory that keeps it), where the usual route (build the model, load the state dict into it)
    takes twice that."""
    reference, _ = models.build("mlp", num_layers=6, hidden=1024, inner=4096)
    path = save(reference, tmp_path, "file")
    script = textwrap.dedent(f"""
        import gc, torch, fx_offload, safetensors.torch
        from fx_offload.checkpoint import empty_weights
        from fx_offload.tools import models

        def peak_mib():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024

        def reset_peak():
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

        def measured(load):
            reset_peak()
            base = peak_mib()
            model = load()
            return peak_mib() - base, model

        def place():
            with empty_weights():
                model = models.MLPStack(6, hidden=1024, inner=4096)
            fx_offload.place(model, "cpu", checkpoint={path!r}, group_size=2, num_in_group=1)
            return model

        def usual():
            model = models.MLPStack(6, hidden=1024, inner=4096)
            model.load_state_dict(safetensors.torch.load_file({path!r}))
            return model

        placed, model = measured(place)
        del model
        gc.collect()    # any garbage left is collected here, not inside the next
        #                 measurement
        loaded, model = measured(usual)
        print(placed, loaded)
    """)
    # glibc keeps freed heap memory for reuse; allocate large blocks with mmap so that
    # what is freed leaves the process and the peak is what was held at once
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    placed, loaded = (float(v) for v in out.stdout.split()[-2:])
    size = sum(p.numel() * 4 for p in reference.parameters()) / 2**20
    slot = sum(p.numel() * 4 for p in reference.layers[1].parameters()) / 2**20
    # on the CPU the "device" is host memory too: the model once plus its one slot
    assert placed < size + slot + 0.05 * size, (placed, size, slot)
    # the check can fail: the usual route holds every weight twice at its peak
    assert loaded > 1.6 * size, (loaded, size)


def _decoder_on_meta():
    with torch.device("meta"):
        return models.TinyDecoder(4)


@pytest.mark.parametrize("case, pattern", [
    ("no_checkpoint", r"tensors are on the meta device \(\['layers.0.fc1.weight'.*and no "
                      r"checkpoint was given; pass checkpoint=<save_pretrained folder"),
    ("missing", r"2 tensors on the meta device are not in the mapping given \(e.g. "
                r"\['layers.3.fc2.weight', 'layers.3.fc2.bias'\].*give the checkpoint of this"),
    ("shape", r"shapes differ: \['layers.0.fc1.weight: \(8, 32\) in the checkpoint, \(64, 32\) "
              r"in the model'\]"),
    ("meta_buffers", r"buffers \['rotary.inv_freq'.*are on the meta device and no checkpoint "
                     r"saves them .*build the model under fx_offload.empty_weights\(\)"),
    ("not_safetensors", r"not a safetensors file \(no valid header\)"),
    ("empty_folder", r"holds no model.safetensors or model.safetensors.index.json \(found "
                     r"\['notes.txt'\]\); save the model with save_pretrained"),
    ("no_such_path", r"checkpoint '.*nowhere' does not exist"),
    ("not_tensors", r"checkpoint mapping values must be tensors; \['layers.0.fc1.weight'\]"),
    ("budget_trace_fails", r"memory_budget plans from a trace of MLPStack on the meta device, "
                           r"and that trace failed \(.*\). Give example_inputs the model runs "
                           r"with on the meta device, or give group_size"),
    ("budget_too_small", r"option 'memory_budget' \(1000B, 1000 bytes\) is below the least "
                         r"this model can run in: .*raise memory_budget to at least"),
])
def test_place_errors_say_what_to_change(case, pattern, tmp_path):
    """docs/errors.md rows 28, 35-39: each bad input to place() names the fix, and the model is
    left as it was (nothing placed, nothing registered)."""
    reference, (x,) = models.build("mlp", num_layers=4)
    with empty_weights():
        model, _ = models.build("mlp", num_layers=4)
    sd = reference.state_dict()
    options = dict(group_size=2, num_in_group=1)
    checkpoint = {
        "no_checkpoint": None,
        "missing": {k: v for k, v in sd.items() if not k.startswith("layers.3.fc2")},
        "shape": {**sd, "layers.0.fc1.weight": torch.zeros(8, 32)},
        "meta_buffers": None,
        "not_safetensors": str(tmp_path / "w.bin"),
        "empty_folder": str(tmp_path),
        "no_such_path": str(tmp_path / "nowhere"),
        "not_tensors": {**sd, "layers.0.fc1.weight": "w"},
        "budget_trace_fails": sd,
        "budget_too_small": sd,
    }[case]
    if case == "not_safetensors":
        torch.save(sd, checkpoint)
    if case == "empty_folder":
        (tmp_path / "notes.txt").write_text("no weights here")
    if case == "meta_buffers":
        model = _decoder_on_meta()
        checkpoint = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    if case == "budget_too_small":      # the planner's own error, not a failed trace
        options = dict(memory_budget=1000, example_inputs=(x,), **RATES)
    if case == "budget_trace_fails":
        options = dict(memory_budget="1MiB", example_inputs=(x, x), **RATES)  # one too many
    before = {k: v.device for k, v in model.state_dict().items()}
    with pytest.raises(fx_offload.OffloadError, match=pattern):
        fx_offload.place(model, "cpu", checkpoint=checkpoint, **options)
    assert fx_offload.registry.state_for_model(model) is None
    assert {k: v.device for k, v in model.state_dict().items()} == before


@pytest.mark.parametrize("built", ["meta", "real"])
def test_an_index_naming_a_missing_shard_says_which_and_places_nothing(built, tmp_path):
    """A save_pretrained folder whose index names a shard that is not there (a download cut
    short): the error names the index, the shard and the tensors it should hold, and the
    model is left as it was: on the meta device, or holding its own values."""
    reference, _ = models.build("mlp", num_layers=4)
    folder = save(reference, tmp_path, "sharded_folder")
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    if built == "meta":
        with empty_weights():
            model, _ = models.build("mlp", num_layers=4)
    else:
        model, _ = models.build("mlp", num_layers=4, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    with pytest.raises(fx_offload.OffloadError, match=(
            r"^fx_offload.place: .*model.safetensors.index.json names the shard "
            r"'model-00002-of-00002.safetensors', which is not in .*; it should hold 8 "
            r"tensor\(s\) \(\['layers.0.fc1.weight', 'layers.0.fc2.weight', .*\] and 3 more\)")):
        fx_offload.place(model, "cpu", checkpoint=folder, group_size=2, num_in_group=1)
    assert_placed_nothing(model, before, params, values=built != "meta")


def test_a_shard_gone_after_the_checkpoint_was_opened_names_the_tensor_and_places_nothing(
        tmp_path):
    """A shard removed between opening the checkpoint and reading it (a download still
    running, a disk unmounted): the project's error names the tensor, the file and what to
    do, the model keeps its own values, and placing it again from a whole checkpoint works."""
    reference, inputs = models.build("mlp", num_layers=4)
    folder = save(reference, tmp_path, "sharded_folder")
    model, _ = models.build("mlp", num_layers=4, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    opened = Checkpoint.open(folder)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(fx_offload.OffloadError, match=(
            r"^fx_offload.place: reading layers\.\d\.\w+\.\w+ from .*model-00002-of-00002"
            r"\.safetensors failed \(.*No such file.*\); it was readable when .* was opened\. "
            r"Check that every file")):
        fx_offload.place(model, "cpu", checkpoint=opened, group_size=2, num_in_group=1)
    assert_placed_nothing(model, before, params)
    save(reference, tmp_path, "sharded_folder")
    fx_offload.place(model, "cpu", checkpoint=folder, group_size=2, num_in_group=1)
    assert_same_weights(model, reference)
    with torch.no_grad():
        assert torch.equal(model(*inputs), reference(*inputs))


def test_experts_saved_one_tensor_per_expert_get_a_clear_error(tmp_path):
    """transformers saves a fused MoE expert tensor ([E, ...]) as one tensor per expert and
    fuses them again as it loads; place() reads by name: it says so and what to do instead
    of "not in the checkpoint" (and a folder as transformers saved it gets the same
    message or is placed right, whichever way this transformers saves)."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)
    torch.manual_seed(0)
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    apart = {}
    for name, t in reference.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix, what = name.rsplit(".", 1)
            for i in range(t.shape[0]):
                apart[f"{prefix}.{i}.{what}.weight"] = t[i].clone()
        else:
            apart[name] = t
    want = r"keeps the experts of an MoE layer one tensor per expert .*from_pretrained"
    with empty_weights():
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    with pytest.raises(OffloadError, match=want):
        fx_offload.place(model, "cpu", checkpoint=apart, group_size=1)
    reference.save_pretrained(tmp_path)
    x = torch.randint(0, 256, (1, 5))
    try:
        fx_offload.place(model, "cpu", checkpoint=str(tmp_path), group_size=1)
    except OffloadError as err:
        assert re.search(want, str(err)), err
    else:
        compiled = torch.compile(model, backend="prefetch_offload",
                                 options={"inner_backend": "aot_eager"})
        with torch.no_grad():
            assert torch.equal(compiled(x).logits, reference(x).logits)
