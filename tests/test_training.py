"""Training on a frozen offloaded base (fx_offload.training): the backward streams the frozen
weights into the slots again, in reverse; trainable parameters stay resident."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fx_offload
from fx_offload.tools import models

# layers 1, 3, 5, ... offloaded, one slot
OPTIONS = {"group_size": 2, "num_in_group": 1, "inner_backend": "aot_eager"}


def frozen_mlp(num_layers=6, trained_layer=None):
    """An MLP stack whose weights are frozen and biases trained (and every parameter of
    ``trained_layer``), in training mode; an input that requires grad."""
    model, (x,) = models.build("mlp", num_layers=num_layers)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    if trained_layer is not None:
        model.layers[trained_layer].requires_grad_(True)
    return model.train(), x.requires_grad_(True)


def trained(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def assert_grads(model, reference, exact=True):
    got, want = trained(model), trained(reference)
    assert got.keys() == want.keys()
    for name, p in got.items():
        if exact:
            assert torch.equal(p.grad, want[name].grad), name
        else:
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-6, rtol=1e-5)


def offloaded_names(model):
    return {n.split(".", 2)[-1] for ps in fx_offload.report(model).params.values() for n in ps}


def steps(compiled, reference_compiled, model, reference, x, n=3, exact=True):
    """``n`` AdamW steps of both; gradients and losses compared at each."""
    opts = [torch.optim.AdamW(trained(m).values(), lr=1e-2) for m in (model, reference)]
    for _ in range(n):
        losses = [f(x).square().mean() for f in (compiled, reference_compiled)]
        for loss in losses:
            loss.backward()
        if exact:
            assert torch.equal(*losses)
        assert_grads(model, reference, exact)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def lm_steps(compiled, reference_compiled, model, reference, batches):
    """An AdamW step of both language models on each of ``batches`` (token ids, their own
    labels); the trained parameters' gradients compared bitwise at each."""
    opts = [torch.optim.AdamW(trained(m).values(), lr=1e-2) for m in (model, reference)]
    for ids in batches:
        for f in (compiled, reference_compiled):
            f(input_ids=ids, labels=ids).loss.backward()
        assert_grads(model, reference)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_frozen_weights_offloaded_trained_ones_resident_bitwise_gradients(caplog):
    """Biases and a wholly trained layer stay resident (one INFO line names it); the
    gradients of the biases and of the input equal the model's without offloading, bitwise,
    over three AdamW steps."""
    caplog.set_level("INFO", logger="fx_offload")
    model, x = frozen_mlp(trained_layer=5)
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    xr = x.detach().clone().requires_grad_(True)
    loss, ref_loss = compiled(x).square().mean(), ref_compiled(xr).square().mean()
    loss.backward()
    ref_loss.backward()
    assert torch.equal(x.grad, xr.grad)
    assert_grads(model, reference)
    assert sorted(fx_offload.report(model).params) == [1, 3]      # layer 5: all trained
    assert any("1 layer(s) kept resident, every parameter of them requires grad" in r.message
               and "layers.5" in r.message for r in caplog.records), caplog.text
    assert offloaded_names(model) == {"fc1.weight", "fc2.weight"}
    model.zero_grad()
    reference.zero_grad()
    steps(compiled, ref_compiled, model, reference, x)
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), ref_compiled(x))


def test_the_backward_waits_are_what_make_the_gradients_right():
    """The backward reads the slots: with its waits and starts doing nothing, the slot holds
    another layer and the gradients are wrong."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    compiled(x).sum().backward()                # compiles both graphs
    model.zero_grad()
    state = fx_offload.registry.state_for_model(model)
    loss = compiled(x).sum()
    state.wait = state.start = lambda *args, **kwargs: None
    loss.backward()
    reference(x.detach()).sum().backward()
    assert any(not torch.equal(p.grad, trained(reference)[n].grad)
               for n, p in trained(model).items())


@pytest.mark.parametrize("options", [{"prefetch_step": 2, "circular_prefetch": "entry"},
                                     {"prefetch_step": 3, "copy_chunks": 2}])
def test_the_reversed_ring_prefetches_every_layer(options):
    """More slots, chunked copies, the circular prefetch at the entry: the gradients stay
    bitwise, and every layer the backward reads was prefetched (no synchronous load)."""
    model, x = frozen_mlp(num_layers=12)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options={**OPTIONS, **options})
    steps(compiled, torch.compile(reference, backend="aot_eager"), model, reference, x, n=2)
    state = fx_offload.registry.state_for_model(model)
    assert state.stats["sync_loads"] == 0 and state.stats["prefetches"] > 0


def test_a_training_step_copies_only_what_its_slot_does_not_hold():
    """One slot, layers 1, 3 and 5 offloaded: a step's forward copies 3 and 5 (the last
    backward left 1 in the slot) and its backward 3 and 1 (the forward left 5): four layers.
    The forward's circular prefetch, of layer 1 after layer 5 for the next call, would evict
    the layer the backward reads first, and make six.  (The CPU's calls begin it at their
    end, as a GPU's do where the caller lets the copies run on between steps.)"""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    steps(compiled, torch.compile(reference, backend="aot_eager"), model, reference, x, n=1)
    layer = fx_offload.report(model).offloaded_bytes // 3
    for _ in range(2):
        compiled(x).square().mean().backward()
        assert fx_offload.report(model).copied_bytes_last_call == 4 * layer
    model.zero_grad()
    # a forward with no backward after it: the next call's entry copies layer 1 back
    with torch.no_grad():
        compiled(x)
    steps(compiled, torch.compile(reference, backend="aot_eager"), model, reference, x, n=2)
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


def test_the_verifier_proves_the_backward_schedule(monkeypatch):
    """A backward whose waits are left out is refused by the verifier when it is compiled (at
    the first backward), before it runs; the weights are intact."""
    from fx_offload import training
    real = training._call
    monkeypatch.setattr(training, "_call", lambda graph, op, args: None if op is training.WAIT
                        else real(graph, op, args))
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with pytest.raises(Exception, match=r"reads \w+ of layer 5 chunk \d from slot 0, but no "
                                        "wait_prefetch for it precedes this read"):
        compiled(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_a_backward_whose_saved_weights_cannot_be_matched_is_refused(monkeypatch):
    """Where the backward graph's inputs cannot be told to be the forward's offloaded
    weights (another torch, other fake tensors), the compile is refused rather than the
    backward left without its waits."""
    from fx_offload import training
    real = training.BackwardOps.backward

    def unmatched(self, bw):
        self.storages, self.names = {}, {}
        return real(self, bw)
    monkeypatch.setattr(training.BackwardOps, "backward", unmatched)
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with pytest.raises(Exception, match=r"training: the forward saves \d+ offloaded weight"):
        compiled(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("pattern", ["recompiled_for_an_input_without_grad",
                                     "two_calls_then_one_backward",
                                     "two_calls_then_the_earlier_backward"])
def test_backwards_of_graphs_traced_inside_a_call_and_of_earlier_calls(pattern):
    """A graph compiled after the model was offloaded is traced inside a call, where the
    parameters sit in their slots: layers sharing a slot share storage and offsets there,
    so the backward must tell their saved weights apart by the forward's node names (by
    storage alone it took one layer's for another: gradients silently wrong).  Gradient
    accumulation over two calls before a backward, and the backward of the earlier call
    after a later forward, give the reference's gradients bitwise too."""
    model, x = frozen_mlp(num_layers=8)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    for f in (compiled, ref_compiled):
        if pattern == "recompiled_for_an_input_without_grad":
            f(x).sum().backward()               # the first compile, then a second graph
            f(x2).square().mean().backward()
        elif pattern == "two_calls_then_one_backward":
            (f(x).square().mean() + 2 * f(x2).square().mean()).backward()
        else:
            earlier, later = f(x2).sum(), f(x).square().sum()
            earlier.backward()
            later.backward()
    assert_grads(model, reference)
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


def test_inductor_inner_backend_trains_within_tolerance():
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": "inductor"})
    steps(compiled, torch.compile(reference), model, reference, x, n=2, exact=False)


def test_reduce_overhead_trains_bitwise_with_the_hooks_of_cuda_graphs():
    """mode="reduce-overhead" (Inductor inside) trains: the call hooks refill as under CUDA
    graphs (on the CPU no graph is captured, so this checks the copies' bookkeeping of that
    mode; the replays are the CUDA test's); gradients and losses equal the same model
    compiled with Inductor in that mode, bitwise, and every layer was prefetched."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": "inductor",
                                      "mode": "reduce-overhead"})
    steps(compiled, torch.compile(reference, mode="reduce-overhead"), model, reference, x)
    state = fx_offload.registry.state_for_model(model)
    assert state.hook_copies.under_cuda_graphs
    assert state.stats["sync_loads"] == 0


class Checkpointed(torch.nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.layers = stack.layers

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def test_activation_checkpointed_layers_train_bitwise_and_cross_once_in_backward():
    """Each layer checkpointed on its own: its region is waited for and refilled as a whole;
    in backward its recomputation and its gradients read the weights after one wait, so a
    step copies what it copies without checkpointing; gradients bitwise over two steps."""
    copied = {}
    for wrap in (Checkpointed, lambda stack: stack):
        stack, x = frozen_mlp()
        model = wrap(stack)
        reference = copy.deepcopy(model)
        compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
        steps(compiled, torch.compile(reference, backend="aot_eager"), model, reference, x, n=2)
        copied[wrap] = fx_offload.report(model).copied_bytes_last_call
    assert copied[Checkpointed] == copied[next(w for w in copied if w is not Checkpointed)] > 0


class CheckpointedPairs(torch.nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.layers = stack.layers

    def forward(self, x):
        for i in range(0, len(self.layers), 2):
            first, second = self.layers[i], self.layers[i + 1]
            x = checkpoint(lambda v: second(first(v)), x, use_reentrant=False)
        return x


def test_a_checkpointed_region_over_two_offloaded_layers_is_refused_and_loses_nothing():
    stack, x = frozen_mlp()
    model, reference = CheckpointedPairs(stack), copy.deepcopy(stack)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "group_size": 3, "num_in_group": 2})
    with pytest.raises(Exception, match=r"one activation-checkpointed region reads the "
                                        r"offloaded weights of layers \[4, 5\].*on its own"):
        compiled(x)
    assert fx_offload.registry.state_for_model(model) is None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_retained_graph_backward_twice_and_optimizer_over_frozen_weights():
    """A second backward through a retained graph streams the weights again (the gradients
    add up as without offloading); an optimizer handed the frozen offloaded weights as well
    leaves them as they are (they get no gradient)."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    for f in (compiled, ref_compiled):
        loss = f(x.detach()).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads(model, reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def test_backward_after_restore_reads_no_freed_slot_and_the_forward_again_trains():
    """A backward whose forward ran before ``restore``: refused where it would read a slot
    restore freed (a saved view of it); here the forward saved the parameters themselves,
    which hold their true weights again, so it computes the reference's gradients.  A
    forward after restore trains through the same callable, its ops doing nothing."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    compiled(x).sum().backward()
    ref_compiled(x).sum().backward()
    state = fx_offload.registry.state_for_model(model)
    handle, slot_view = state.handle, state.buffers.flat[0][:8]
    loss, ref_loss = compiled(x).sum(), ref_compiled(x).sum()
    fx_offload.restore(model)
    assert fx_offload.registry.reads_freed_slots(handle, [x, slot_view])
    assert not fx_offload.registry.reads_freed_slots(handle, list(model.parameters()))
    loss.backward()
    ref_loss.backward()
    assert_grads(model, reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    model.zero_grad()
    reference.zero_grad()
    steps(compiled, ref_compiled, model, reference, x, n=2)


def test_a_backward_that_reads_a_freed_slot_is_refused_and_loses_nothing(monkeypatch):
    """Where a saved tensor views a slot that restore freed, the backward is refused before
    it runs, and the weights stay the reference's."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    loss = compiled(x).sum()
    fx_offload.restore(model)
    monkeypatch.setattr(fx_offload.registry, "reads_freed_slots", lambda handle, args: True)
    with pytest.raises(fx_offload.OffloadError, match="backward after fx_offload.restore"):
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_backward_that_raises_midway_leaves_the_weights_and_the_next_step_right(
        monkeypatch, inner):
    """A refill that raises in the middle of the backward (after it began as a call of the
    model, before the graph's last op ends it): the error reaches the caller, the model's
    parameters hold their true weights at once (not their slots), and the next forward and
    backward give the reference's gradients with their refills prefetched."""
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": inner})
    compiled(x).sum().backward()
    model.zero_grad()
    state = fx_offload.registry.state_for_model(model)
    real, seen = state.start, []

    def failing(layer, refill, chunk=-1):
        seen.append((layer, refill, chunk))
        if state.copies.backward and len(seen) > 2:
            raise RuntimeError("injected refill failure")
        return real(layer, refill, chunk)
    loss = compiled(x).sum()
    monkeypatch.setattr(state, "start", failing)
    with pytest.raises(RuntimeError, match="injected refill failure"):
        loss.backward()
    monkeypatch.setattr(state, "start", real)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    model.zero_grad()
    loads = state.stats["sync_loads"]
    xr = x.detach().clone().requires_grad_(True)
    compiled(x).sum().backward()
    reference(xr).sum().backward()
    assert_grads(model, reference, exact=inner == "aot_eager")
    assert not state.copies.backward and state.stats["sync_loads"] == loads


def test_an_offloaded_weight_unfrozen_after_compile_is_refused_and_loses_nothing():
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    compiled(x).sum().backward()
    model.layers[1].fc1.weight.requires_grad_(True)
    with pytest.raises(Exception, match="trains only parameters that are not offloaded"):
        compiled(x)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    fx_offload.restore(model)           # then offloaded anew, that weight resident
    compiled(x.detach()).sum().backward()
    assert "fc1.weight" not in set(fx_offload.report(model).params[1])


def test_eager_inner_backend_refuses_training():
    model, x = frozen_mlp()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": "eager"})
    with pytest.raises(Exception, match="trains only with inner_backend 'aot_eager' or"):
        compiled(x)
    assert fx_offload.registry.state_for_model(model) is None


def lora_llama(num_layers=4):
    """A tiny Llama with LoRA adapters on q/k/v/o (the base frozen by PEFT), in training
    mode, its copy and input ids."""
    transformers = pytest.importorskip("transformers", reason="install the test extra")
    peft = pytest.importorskip("peft", reason="install the test extra")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False))      # B nonzero: every adapter gets a grad
    return model.train(), copy.deepcopy(model).train(), torch.randint(0, 64, (2, 8))


def test_lora_adapters_train_on_an_offloaded_llama(tmp_path, inner="aot_eager"):
    """Three AdamW steps, the third of a new sequence length: the adapters' gradients equal
    those of the model compiled with the inner compiler alone (bitwise with aot_eager; with
    inner="inductor", the same within 1e-6, bitwise as measured, but four minutes of
    compiling on two cores: the MLP test above covers Inductor), the frozen base is
    unchanged, then eval equals too, and save_pretrained saves the trained adapters."""
    model, reference, ids = lora_llama()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": inner})
    ref_compiled = torch.compile(reference, backend=inner)
    opts = [torch.optim.AdamW(trained(m).values(), lr=1e-2) for m in (model, reference)]
    # the third step's new length recompiles inside a call, the parameters in their slots
    # (its gradients were silently wrong when the backward matched saved weights by storage)
    longer = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    for step in range(3):
        batch = ids if step < 2 else longer
        losses = [f(input_ids=batch, labels=batch).loss for f in (compiled, ref_compiled)]
        for loss in losses:
            loss.backward()
        assert_grads(model, reference, exact=inner == "aot_eager")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    offloaded = offloaded_names(model)
    assert sorted(fx_offload.report(model).params) == [1, 3]
    assert offloaded and not any("lora" in n for n in offloaded)
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name
    model.eval()
    reference.eval()
    with torch.no_grad():
        got, want = compiled(input_ids=ids).logits, ref_compiled(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=0 if inner == "aot_eager" else 1e-6, rtol=0)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter_model.safetensors")
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(saved) == len(lora) > 0
    for key, value in saved.items():
        match = [p for n, p in lora.items() if n.replace(".default", "") == key]
        assert len(match) == 1 and torch.equal(match[0], value), key


def _backward_graphs(monkeypatch):
    """The backward graphs, as the backward's ops were placed in them."""
    from fx_offload import training
    graphs, real = [], training.BackwardOps.backward

    def keep(self, bw):
        real(self, bw)
        graphs.append(bw)
    monkeypatch.setattr(training.BackwardOps, "backward", keep)
    return graphs


def test_a_read_of_a_weight_alone_in_backward_waits_for_it_gemma(monkeypatch,
                                                                  inner="aot_eager"):
    """Gemma's norm computes ``x * (1 + weight)``, and the backward recomputes
    ``1 + weight`` from the weight alone: nothing of it can carry the wait's order, so the
    wait is tied to that weight itself (it was refused: "takes nothing the layer's backward
    wait can be tied to").  A LoRA trains as without offloading (layer 1 offloaded), over
    two steps, bitwise (with Inductor inside too, in a script: Gemma bitwise, Gemma2 within
    2e-6, as Inductor's fusions differ)."""
    transformers = pytest.importorskip("transformers", reason="install the test extra")
    peft = pytest.importorskip("peft", reason="install the test extra")
    from fx_offload.ops import WAIT
    graphs = _backward_graphs(monkeypatch)
    torch.manual_seed(0)
    config = transformers.GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = peft.get_peft_model(
        transformers.GemmaForCausalLM(config),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "inner_backend": inner})
    ref_compiled = torch.compile(reference, backend=inner)
    lm_steps(compiled, ref_compiled, model, reference,
             [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(n))
              for n in range(2)])
    found = 0
    for bw in (g.graph for g in graphs):
        nodes = list(bw.nodes)
        for read in (n for n in nodes if n.target is torch.ops.aten.add.Tensor and
                     n.args[1] == 1 and n.args[0].op == "placeholder"):
            tied = [w for w in nodes if w.target is WAIT and read.args[0] in w.args[0]]
            if tied:
                found += 1
                assert nodes.index(tied[0]) < nodes.index(read)
    assert found


def test_backward_refills_the_slot_chunk_by_chunk_as_its_bytes_come_free(monkeypatch):
    """A layer's backward reads its MLP's chunks before its attention's.  The next layer of
    the slot is begun chunk by chunk, each once the bytes it overwrites were last read (not
    after the leaving layer's whole backward, which leaves the link idle that long), and
    each chunk is waited for before its own first read; the gradients stay bitwise, with
    no synchronous load."""
    from fx_offload.ops import OpCall
    graphs = _backward_graphs(monkeypatch)
    model, reference, ids = lora_llama(num_layers=4)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    for f in (compiled, ref_compiled):
        f(input_ids=ids, labels=ids).loss.backward()
    assert_grads(model, reference)
    calls = [(i, c) for i, n in enumerate(graphs[0].graph.nodes)
             if (c := OpCall.of(n)) is not None and c.kind in ("wait", "start")]
    waits = [(i, c.chunk) for i, c in calls if c.kind == "wait" and c.layer == 3]
    starts = [(i, c.chunk) for i, c in calls
              if c.kind == "start" and (c.layer, c.refill) == (3, 1)]
    chunks = len(fx_offload.registry.state_for_model(model).learned.layout[3])
    assert chunks > 1
    assert sorted(c for _, c in waits) == list(range(chunks)), waits
    assert sorted(c for _, c in starts) == list(range(chunks)), starts
    # the first chunk freed is begun before layer 3's last chunk is even waited for
    assert min(i for i, _ in starts) < max(i for i, _ in waits)
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


@pytest.mark.cuda
def test_lora_adapters_train_on_the_gpu_bitwise_with_chunked_refills():
    """On the GPU the backward's refills run on the copy stream, chunk by chunk, beside the
    backward's kernels: three steps' adapter gradients equal the model's compiled with
    aot_eager alone, bitwise, and every layer was prefetched (no synchronous load)."""
    model, reference, ids = lora_llama(num_layers=6)
    model, reference, ids = model.cuda(), reference.cuda(), ids.cuda()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    lm_steps(compiled, ref_compiled, model, reference, [ids] * 3)
    assert fx_offload.registry.state_for_model(model).stats["sync_loads"] == 0


@pytest.mark.cuda
def test_lora_adapters_train_under_cuda_graphs_as_inductor_alone():
    """mode="reduce-overhead": the forward and the backward graphs are both captured (no
    CUDA graph skipped) and replayed, their copies inside; four steps over two sequence
    lengths give the adapter gradients of the same model compiled with Inductor's own CUDA
    graphs, within Inductor's spread (the offload ops change its fusions on this tiny model,
    and the last bits of a gradient with them), and the frozen weights come back
    unchanged."""
    from torch._dynamo.utils import counters
    model, reference, ids = lora_llama(num_layers=6)
    model, reference = model.cuda(), reference.cuda()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(OPTIONS, inner_backend="inductor",
                                          mode="reduce-overhead"))
    ref_compiled = torch.compile(reference, mode="reduce-overhead")
    batches = [torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n)).cuda()
               for n in (8, 8, 12, 8)]
    grads = {}
    # one model's steps after the other's: CUDA graph trees take a forward then its backward
    for name, m, f in (("reference", reference, ref_compiled), ("offloaded", model, compiled)):
        opt = torch.optim.AdamW(trained(m).values(), lr=1e-2)
        for i, x in enumerate(batches):
            f(input_ids=x, labels=x).loss.backward()
            grads[name, i] = {n: p.grad.clone() for n, p in trained(m).items()}
            opt.step()
            opt.zero_grad()
    for i in range(len(batches)):
        for n, g in grads["reference", i].items():
            torch.testing.assert_close(grads["offloaded", i][n], g, atol=1e-6, rtol=1e-4,
                                       msg=lambda m, i=i, n=n: f"step {i}, {n}: {m}")
    assert counters["inductor"]["cudagraph_skips"] == 0
    fx_offload.restore(model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_hugging_face_gradient_checkpointing_trains_the_adapters_bitwise():
    # graph breaks under torch.compile, as the docs say: transformers' hook that makes the
    # embeddings' output require grad (not needed with use_reentrant=False), and its warning
    # when use_cache is left on.  Two offloaded layers sharing the slot: a recomputed
    # norm's read of its weight takes only values computed after the layer's first read
    # (it was refused as a read the backward's wait could not be tied to)
    model, reference, ids = lora_llama(num_layers=4)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.disable_input_require_grads()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    for _ in range(2):
        losses = [f(input_ids=ids, labels=ids, use_cache=False).loss for f in (compiled, ref_compiled)]
        for loss in losses:
            loss.backward()
        assert torch.equal(*losses)
        assert_grads(model, reference)
        for m in (model, reference):
            m.zero_grad()
    assert fx_offload.report(model).layers == [1, 3]


def test_the_require_grad_hook_of_gradient_checkpointing_gets_advice_not_already_offloaded():
    """Left on, transformers' hook that makes the embeddings' output require grad breaks
    the graph; Dynamo then compiles the inner model's forward on its own, where no backward
    prefetch can be placed: the error says so and what to call, and nothing is lost."""
    model, reference, ids = lora_llama(num_layers=2)
    model.gradient_checkpointing_enable()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with pytest.raises(Exception, match=r"compiled LlamaModel.forward on its own .*"
                                        r"disable_input_require_grads"):
        compiled(input_ids=ids, labels=ids, use_cache=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    # the advice followed: it trains, its gradients the reference's
    for m in (model, reference):
        m.disable_input_require_grads()
    torch._dynamo.reset()
    ref_compiled = torch.compile(reference, backend="aot_eager")
    losses = [f(input_ids=ids, labels=ids, use_cache=False).loss
              for f in (compiled, ref_compiled)]
    for loss in losses:
        loss.backward()
    assert torch.equal(*losses)
    assert_grads(model, reference)
    assert fx_offload.report(model).layers == [1]


@pytest.mark.parametrize("where", ["unrolled", "inside"])
def test_graph_breaks_between_layers_train_and_inside_a_layer_are_refused(where):
    """A break between layers: each graph's backward streams its own layers (gradients
    bitwise). A break inside every layer: Dynamo compiles the layer's forward on its own,
    where no backward prefetch can be placed: refused, nothing lost."""
    from test_graph_breaks import Stack
    torch.manual_seed(0)
    model = Stack(where)
    model.requires_grad_(False)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    got, want = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    if where == "inside":
        with pytest.raises(Exception, match="trains only a model whose layers run in its own "
                                            "graph"):
            compiled(got)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), name
        return
    for _ in range(2):
        compiled(got).square().sum().backward()
        reference(want).square().sum().backward()
        assert torch.equal(got.grad, want.grad)
    assert sorted(fx_offload.report(model).params) == [1, 3, 5]


def test_hugging_face_trainer_trains_the_adapters_as_without_offloading(tmp_path):
    """transformers' Trainer (AdamW, a linear schedule, its own loop and data order) on a
    model whose forward compile_forward offloaded: after three steps the adapters equal
    those trained the same way without offloading (both compiled with aot_eager, so
    bitwise), the frozen base is unchanged, the Trainer's saved adapter loads back, and
    model.eval() then generate gives the same tokens."""
    transformers = pytest.importorskip("transformers", reason="install the test extra")
    model, reference, _ = lora_llama(num_layers=2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (6, 8), generator=gen)]
    fx_offload.compile_forward(model, **OPTIONS)
    reference.forward = torch.compile(reference.forward, backend="aot_eager")
    for m, out in ((model, tmp_path / "offloaded"), (reference, tmp_path / "reference")):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=3, per_device_train_batch_size=2,
            learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
            logging_strategy="no", seed=0, dataloader_num_workers=0)
        transformers.Trainer(model=m, args=args, train_dataset=data).train()
    lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    assert lora
    for (name, p), q in zip(lora, (p for n, p in reference.named_parameters() if "lora_" in n)):
        assert torch.equal(p, q), name
        assert not torch.equal(p, start[name]), name           # the steps trained it
    assert fx_offload.report(model).layers == [1]
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(lora)
    # then evaluation on the same model: greedy generate gives the reference's tokens
    ids = torch.randint(0, 64, (1, 6), generator=gen)
    tokens = []
    for m in (model, reference):
        m.eval()
        m.generation_config.eos_token_id = None
        with torch.no_grad():
            tokens.append(m.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    assert tokens[0].shape == (1, 11) and torch.equal(*tokens)


def _weights(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_memory_budget_sets_a_training_steps_bytes_aside_before_the_weights():
    """A budget that holds the weights whole holds no training step: its saved activations,
    the biases' gradients and AdamW state are set aside first (a bound read from the
    graph), so the planner offloads; the step trains as without offloading. The same model
    in eval mode fits whole."""
    from fx_offload.selection import training_memory
    from helpers import PLANNER_RATES
    model, x = frozen_mlp()
    reference = copy.deepcopy(model)
    options = {"memory_budget": _weights(model), "inner_backend": "aot_eager",
               **PLANNER_RATES}
    compiled = torch.compile(model, backend="prefetch_offload", options=options)
    ref_compiled = torch.compile(reference, backend="aot_eager")
    steps(compiled, ref_compiled, model, reference, x, n=2)
    planner = fx_offload.report(model).planner
    state = sum(p.numel() * (p.element_size() + 8) for p in trained(model).values())
    # the activations: at least each layer's output (batch x width, fp32), counted once
    assert planner.training > state + 6 * x.numel() * 4, (planner.training, state)
    assert planner.budget == _weights(model) - planner.training
    assert fx_offload.report(model).params, "nothing offloaded"
    assert "a training step's" in str(planner)
    assert training_memory.step_bytes(model.eval(), None) == 0

    plain, _ = frozen_mlp()
    compiled = torch.compile(plain.eval(), backend="prefetch_offload",
                             options={**options, "memory_budget": _weights(plain)})
    with torch.no_grad():
        compiled(x.detach())
    assert not fx_offload.report(plain).params


def test_a_budget_below_weights_and_the_training_step_says_what_to_shrink():
    from helpers import PLANNER_RATES
    model, x = frozen_mlp()
    layer = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"memory_budget": _weights(model) - 4 * layer,
                                      "inner_backend": "aot_eager", **PLANNER_RATES})
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(Exception, match="BudgetError.*a training step's .*activation "
                                        "checkpointing make it smaller"):
        compiled(x).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p, frozen[name]), name
