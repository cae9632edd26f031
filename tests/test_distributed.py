"""Tensor parallelism on torch.distributed: each rank offloads its own shards.  Two gloo
processes on the CPU, a hard timeout (a hung rank is killed, never the suite), for both
styles: DTensor parameters from ``parallelize_module`` and hand-sharded layers with
functional collectives, and for a Hugging Face Llama sharded by torch's TP plan with sequence
parallelism and by Hugging Face's own ``tp_plan="auto"``.  Each rank compares with the same
TP model, not offloaded, under the same inner compiler."""
from __future__ import annotations

import copy
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD = 2
TIMEOUT_S = 240
OPTIONS = {"inner_backend": "aot_eager", "group_size": 2, "num_in_group": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, port, check, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        check(rank)
        results.put("ok")
    except BaseException:
        results.put(f"rank {rank}:\n{traceback.format_exc()}")
    try:
        dist.destroy_process_group()
    finally:
        # the interpreter's own teardown with gloo's threads alive can abort the process
        # ("terminate called without an active exception") after a passing check
        os._exit(0)


def run_on_ranks(check):
    """Run ``check(rank)`` on two gloo ranks; fail with the first rank's traceback, or after
    TIMEOUT_S with every process killed."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, port, check, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    reported = []
    while not results.empty():
        reported.append(results.get())
    for report in reported:
        if report != "ok":
            pytest.fail(report)
    assert not hung, f"{len(hung)} rank(s) hung for {TIMEOUT_S} s and were killed"
    assert reported == ["ok"] * WORLD, f"ranks reported {reported}, exit codes " \
        f"{[p.exitcode for p in procs]}"


def _tp_mlp_stack(seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from fx_offload.tools.models import build
    model, (x,) = build("mlp", num_layers=4, hidden=32, inner=64, seed=seed)
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {}
    for i in range(4):
        plan[f"layers.{i}.fc1"] = ColwiseParallel()
        plan[f"layers.{i}.fc2"] = RowwiseParallel()
    parallelize_module(model.eval(), mesh, plan)
    return model, x


def _check_dtensor_parameters(rank):
    import torch.distributed.checkpoint as dcp
    import fx_offload
    from torch.distributed.tensor import DTensor

    model, x = _tp_mlp_stack()
    reference = copy.deepcopy(model)
    expected = torch.compile(reference, backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        for inp in (x, x, torch.cat([x, x])):          # the last one recompiles
            assert torch.equal(compiled(inp), expected(inp))
    rep = fx_offload.report(model)
    weight = model.layers[1].fc1.weight
    assert rep.layers == [1, 3] and isinstance(weight, DTensor)
    local_bytes = sum(p.to_local().numel() * 4 for p in model.layers[1].parameters())
    assert rep.layer_bytes[1] == local_bytes       # this rank's shards, not the whole layer
    assert weight.to_local().device.type == "cpu"
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["sync_loads"] == 0 and state.stats["prefetches"] > 0

    with torch.no_grad():                          # a write through the DTensor is seen
        weight.mul_(0.5)
        reference.layers[1].fc1.weight.mul_(0.5)
        assert torch.equal(compiled(x), expected(x))
    saved = model.state_dict()["layers.1.fc1.weight"]
    assert isinstance(saved, DTensor) and torch.equal(
        saved.to_local(), reference.layers[1].fc1.weight.to_local())

    # torch.distributed.checkpoint: save the offloaded model, load into a plain TP model
    folder = os.environ["FX_OFFLOAD_TEST_DCP"]
    dcp.save(model.state_dict(), checkpoint_id=folder)
    fresh, _ = _tp_mlp_stack(seed=1)
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=folder)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        assert torch.equal(fresh(x), reference(x))
    # and load into the offloaded model, in place: the next call reads the loaded values
    other, _ = _tp_mlp_stack(seed=2)
    dcp.save(other.state_dict(), checkpoint_id=folder + "_other")
    target = model.state_dict()
    dcp.load(target, checkpoint_id=folder + "_other")
    with torch.no_grad():
        assert torch.equal(compiled(x), torch.compile(other, backend="aot_eager")(x))

    fx_offload.restore(model)
    assert isinstance(model.layers[1].fc1.weight, DTensor)
    with torch.no_grad():
        assert torch.equal(model(x), other(x))


def _check_what_users_do_to_a_tp_model(rank):
    """A submodule's state_dict, deepcopy, an exception inside the compiled call, .half():
    the shards stay true and later calls stay equal to the TP model not offloaded."""
    import fx_offload
    model, x = _tp_mlp_stack()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        compiled(x)
        for key, value in model.layers[1].state_dict().items():
            assert torch.equal(value.to_local(), reference.layers[1].state_dict()[key].to_local())
        assert torch.equal(copy.deepcopy(model)(x), reference(x))
        state = fx_offload.registry.state_for_model(model)
        wait = type(state).wait

        def fail_at_layer_3(self, layer, chunk=-1):
            if layer == 3:
                raise KeyboardInterrupt
            return wait(self, layer, chunk)
        type(state).wait = fail_at_layer_3
        try:
            with pytest.raises(KeyboardInterrupt):
                compiled(x)
        finally:
            type(state).wait = wait
        for key, value in model.state_dict().items():
            assert torch.equal(value.to_local(), reference.state_dict()[key].to_local()), key
        assert torch.equal(compiled(x), reference(x))
        model.half()
        reference.half()
        assert torch.equal(compiled(x.half()),
                           torch.compile(reference, backend="aot_eager")(x.half()))


def _check_new_weights_for_a_tp_model(rank):
    """update_weights with a DTensor or a whole tensor, a write through a DTensor state_dict
    gave, and a memory_budget plan: each next call equals the TP model not offloaded given
    the same change; a bad entry among good ones writes nothing and names the weight."""
    import fx_offload
    from torch.distributed.tensor import Replicate, distribute_tensor
    model, x = _tp_mlp_stack()
    reference = copy.deepcopy(model)
    expected = torch.compile(reference, backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        compiled(x)
        # the DTensor state_dict gives is written through: the next call reads it
        model.state_dict()["layers.1.fc1.weight"].mul_(2)
        ref["layers.1.fc1.weight"].mul_(2)
        assert torch.equal(compiled(x), expected(x))
        def whole_for(name, seed):
            return torch.randn(ref[name].shape, generator=torch.Generator().manual_seed(seed))

        def placed_as(name, value):
            p = ref[name]
            return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
        whole = whole_for("layers.1.fc2.weight", 5)         # every rank gives the same
        placed = placed_as("layers.3.fc1.weight", whole_for("layers.3.fc1.weight", 6))
        fx_offload.update_weights(model, {"layers.1.fc2.weight": whole,
                                          "layers.3.fc1.weight": placed})
        ref["layers.1.fc2.weight"].copy_(placed_as("layers.1.fc2.weight", whole))
        ref["layers.3.fc1.weight"].copy_(placed)
        assert torch.equal(compiled(x), expected(x))
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        other = ref["layers.3.fc2.weight"].redistribute(placements=[Replicate()])
        with pytest.raises(fx_offload.OffloadError, match=r"layers.3.fc2.weight is a DTensor "
                                                          r"placed .* got one placed"):
            fx_offload.update_weights(model, {"layers.1.fc1.weight": placed_as(
                "layers.1.fc1.weight", whole_for("layers.1.fc1.weight", 7)),
                "layers.3.fc2.weight": other})
        assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
        assert torch.equal(compiled(x), expected(x))
    # memory_budget counts each rank's shards
    budgeted, _ = _tp_mlp_stack()
    plain = copy.deepcopy(budgeted)
    run = torch.compile(budgeted, backend="prefetch_offload",
                        options={"inner_backend": "aot_eager", "memory_budget": "20KiB"})
    with torch.no_grad():
        assert torch.equal(run(x), torch.compile(plain, backend="aot_eager")(x))
    assert fx_offload.report(budgeted).layers


class _HandSharded(nn.Module):
    """A column-split up projection, a row-split down projection and a functional
    all_reduce: tensor parallelism written by hand, plain tensors."""

    def __init__(self, hidden, inner, rank):
        super().__init__()
        torch.manual_seed(0)
        full_up, full_down = nn.Linear(hidden, inner), nn.Linear(inner, hidden, bias=False)
        part = inner // WORLD
        self.up = nn.Linear(hidden, part)
        self.down = nn.Linear(part, hidden, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full_up.weight[rank * part:(rank + 1) * part])
            self.up.bias.copy_(full_up.bias[rank * part:(rank + 1) * part])
            self.down.weight.copy_(full_down.weight[:, rank * part:(rank + 1) * part])

    def forward(self, x):
        from torch.distributed import _functional_collectives as fc
        return x + fc.all_reduce(self.down(torch.relu(self.up(x))), "sum", dist.group.WORLD)


class _HandShardedStack(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.layers = nn.ModuleList(_HandSharded(32, 64, rank) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _check_hand_sharded(rank):
    import fx_offload
    model = _HandShardedStack(rank).eval()
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    torch.manual_seed(1)
    x = torch.randn(4, 32)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
    assert fx_offload.report(model).layers == [1, 3]
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


def _small_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=4, vocab_size=128,
                         max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _llama_sequence_parallel(model):
    """torch's TP plan for a Llama decoder with sequence parallelism: attention and MLP
    projections split by column then row, the norms and the residual stream split along the
    sequence (``SequenceParallel``), gathered before each projection."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (WORLD,))
    to_sequence = dict(output_layouts=Shard(1), use_local_output=False)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
            "self_attn.o_proj": RowwiseParallel(**to_sequence),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(**to_sequence)})
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **to_sequence),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model


def _check_offloaded_llama(model, reference):
    import fx_offload
    from fx_offload.dtensor import local
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        want = torch.compile(reference, backend="aot_eager")(ids, use_cache=False).logits
        for _ in range(2):
            assert torch.equal(compiled(ids, use_cache=False).logits, want)
    rep = fx_offload.report(model)
    shards = sum(local(p).numel() * 4 for p in model.model.layers[1].parameters())
    assert rep.layers == [1, 3] and rep.layer_bytes[1] == shards     # this rank's shards
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


def _check_llama_tp_plans(rank):
    """A Hugging Face Llama sharded by torch's TP plan with sequence parallelism, then by
    Hugging Face's own plan (one pair of processes for both: each costs a transformers import)."""
    _check_offloaded_llama(_llama_sequence_parallel(_small_llama()),
                           _llama_sequence_parallel(_small_llama()))
    _check_hugging_face_tp_plan(rank)


def _check_hugging_face_tp_plan(rank):
    """``from_pretrained`` with ``tp_plan="auto"``: Hugging Face's own TP plan (DTensor
    parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM
    folder = os.environ["FX_OFFLOAD_TEST_DCP"] + "_hf"
    if rank == 0:
        _small_llama().save_pretrained(folder)
    dist.barrier()
    # as torchrun sets them: without them Hugging Face loads the model unsharded
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    mesh = init_device_mesh("cpu", (WORLD,))
    try:
        from transformers import DistributedConfig
        plan = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:                         # transformers before DistributedConfig
        plan = {"tp_plan": "auto"}
    load = lambda: LlamaForCausalLM.from_pretrained(folder, device_mesh=mesh,    # noqa: E731
                                                    **plan).eval()
    model = load()
    from fx_offload.dtensor import local
    up = model.model.layers[1].mlp.up_proj.weight
    assert local(up).shape == (128 // WORLD, 64), (type(up), up.shape)
    _check_offloaded_llama(model, load())


@pytest.mark.parametrize("check", [_check_dtensor_parameters, _check_what_users_do_to_a_tp_model,
                                   _check_new_weights_for_a_tp_model, _check_hand_sharded,
                                   _check_llama_tp_plans],
                         ids=["dtensor_parameters", "user_calls", "new_weights", "hand_sharded",
                              "llama_sequence_parallel_and_hugging_face_tp_plan"])
def test_tensor_parallel_ranks_offload_their_shards(check, tmp_path, monkeypatch):
    monkeypatch.setenv("FX_OFFLOAD_TEST_DCP", str(tmp_path / "dcp"))
    run_on_ranks(check)


def test_tp_run_job_checks_a_sharded_llama_and_exits(tmp_path):
    """The job users launch, ``torchrun ... -m fx_offload.tools.tp_run``, on two gloo ranks: a
    Hugging Face Llama sharded by torch's TP plan; each rank's logits equal the same TP model
    not offloaded, no layer is loaded synchronously, and the job exits on its own (it releases
    its compiled models before the process group)."""
    import subprocess
    import sys
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(WORLD), "-m", "fx_offload.tools.tp_run", "--device", "cpu",
               "--model", "llama", "--layers", "4", "--hidden", "64", "--inner", "128",
               "--tokens", "8", "--inner-backend", "aot_eager", "--reps", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == WORLD, done.stdout
    for line in lines:
        assert "outputs match (largest difference 0, bitwise, later calls the same)" in line
        assert line.endswith("sync loads 0"), line
