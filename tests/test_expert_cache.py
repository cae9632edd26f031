"""The device cache of each routed MoE layer's most-picked experts (option ``expert_cache``):
a picked expert it holds does not cross the link, outputs stay those of the model without
offloading, and a change of the weights reaches the cached rows before the next call reads
them."""
import copy
import dataclasses
import logging

import pytest
import torch

import fx_offload
from fx_offload import registry
from fx_offload.errors import OffloadError
from fx_offload.runtime.experts import expert_cache
from fx_offload.tools import models
from helpers import small_moe

transformers = pytest.importorskip("transformers", reason="install the test extra")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
EXPERT = 3 * 32 * 64 * 4        # bytes of one expert of one layer (float32 gate, up, down)


def _build(device="cpu", impl="grouped_mm"):
    return small_moe("qwen3_moe", impl).eval().to(device)


def _calls(model, compiled, reference, device, count, first=0, between=None):
    """``count`` decode-sized calls, each equal to the reference's (``between(i)`` before
    call ``i``); the expert bytes that crossed the link in each."""
    crossed = []
    state = registry.state_for_model(model)
    with torch.no_grad():
        for i in range(first, first + count):
            if between is not None:
                between(i)
            ids = torch.randint(0, 256, (2, 1), device=device,
                                generator=torch.Generator(device).manual_seed(i))
            got = compiled(ids, use_cache=False).logits
            want = reference(ids, use_cache=False).logits
            assert torch.equal(got, want), i
            state = state or registry.state_for_model(model)
            crossed.append(int(state.routed.gathered))
    return crossed


def _offloaded(cache, device="cpu", impl="grouped_mm", **options):
    model = _build(device, impl)
    reference = torch.compile(copy.deepcopy(model), backend="aot_eager")
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "expert_cache": cache} | options)
    return model, compiled, reference


@pytest.mark.parametrize("device", DEVICES)
def test_experts_the_cache_holds_do_not_cross_the_link(device):
    """A cache of every expert: from its first refresh (the fifth call: the first, which
    compiles, begins before the cache exists) no expert row crosses the link, and report
    says where they came from."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT, device)
    crossed = _calls(model, compiled, reference, device, 8)
    assert all(c > 0 for c in crossed[:4]) and crossed[4:] == [0] * 4, crossed
    rep = fx_offload.report(model)
    assert rep.expert_cache[0] == 16 and rep.expert_cache[2] > 0, rep.expert_cache
    assert "from the expert cache" in rep.experts[1] and "room for the 16 most" in str(rep)
    assert rep.saved_bytes == rep.offloaded_bytes - rep.buffer_bytes - rep.expert_cache[1]
    # a CUDA graph's host jobs compute every pick: the cache line says why it found nothing
    assert "cached or not" not in str(rep)
    replayed = dataclasses.replace(rep, ran_on={1: "host (CUDA graph)"})
    assert "layers [1] ran as a CUDA graph's host jobs" in str(replayed)


def test_a_cache_of_some_experts_keeps_the_most_picked():
    """Four of sixteen per layer: at the first refresh those are the four picked most in
    the calls before (the first call, which compiles, begins before the cache exists)."""
    model, compiled, reference = _offloaded(2 * 4 * EXPERT)
    first = expert_cache.FIRST_REFRESHES[0]
    _calls(model, compiled, reference, "cpu", first)
    cache = registry.state_for_model(model).routed.cache
    assert cache.calls == first - 1 and not any(e >= 0 for h in cache.held.values() for e in h)
    picks = {layer: counts.tolist() for layer, counts in cache.counts.items()}
    _calls(model, compiled, reference, "cpu", 1, first=first)
    for layer, held in cache.held.items():
        n = picks[layer]
        kept = [e for e in held if e >= 0]
        assert len(kept) == 4, held
        assert min(n[e] for e in kept) >= max(n[e] for e in range(16) if e not in kept), \
            (held, n)


@pytest.mark.parametrize("change", ["load_state_dict", "update_weights", "data", "mul_"])
def test_weights_changed_after_the_cache_was_filled_reach_the_next_call(change):
    """Every way a user changes the experts' weights (in place, new storage, our
    update_weights) is what the next call computes with, the cached rows included."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)
    experts = model.model.layers[3].mlp.experts
    theirs = reference._orig_mod.model.layers[3].mlp.experts
    new = {k: v * 1.5 + 0.01 for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(new)
    with torch.no_grad():
        if change == "load_state_dict":
            experts.load_state_dict(new)
        elif change == "update_weights":
            fx_offload.update_weights(model, {f"model.layers.3.mlp.experts.{k}": v
                                              for k, v in new.items()})
        elif change == "data":
            for k, v in new.items():
                getattr(experts, k).data = v.clone()
        else:
            for k, v in new.items():
                getattr(experts, k).mul_(1.5).add_(0.01)
    # the cache still holds every expert: a row not copied again would differ
    assert _calls(model, compiled, reference, "cpu", 3, first=5) == [0, 0, 0]


def test_a_cached_row_not_copied_again_would_change_the_output(monkeypatch):
    """The test above can fail: with the copy after a change skipped, the next call
    computes with the old rows."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)
    monkeypatch.setattr(expert_cache.ExpertCache, "reload_changed", lambda *a: None)
    theirs = reference._orig_mod.model.layers[3].mlp.experts
    new = {k: v * 2 for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(new)
    model.model.layers[3].mlp.experts.load_state_dict(new)
    with pytest.raises(AssertionError):
        _calls(model, compiled, reference, "cpu", 1, first=5)


def test_the_cache_is_read_for_the_experts_it_holds(monkeypatch):
    """Rows the cache says it holds but that hold nothing change the output: the gather
    does read them."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    def publish_only(self, layer, rows, masters, version):
        for t in self.tensors[layer].values():
            t.zero_()
        for r, e in rows:
            self.held[layer][r] = e
        self._publish(layer, self.held[layer])      # where[] published, no row copied
    monkeypatch.setattr(expert_cache.ExpertCache, "_fill", publish_only)
    with pytest.raises(AssertionError):
        _calls(model, compiled, reference, "cpu", 6)


def test_restore_after_the_cache_gives_the_weights_back_and_frees_it():
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)
    cache = registry.state_for_model(model).routed.cache
    fx_offload.restore(model)
    assert cache.tensors == {}
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), n


def test_a_cache_smaller_than_one_expert_per_layer_warns(caplog):
    model, compiled, reference = _offloaded(EXPERT)
    with caplog.at_level(logging.WARNING, "fx_offload"):
        crossed = _calls(model, compiled, reference, "cpu", 5)
    assert "holds less than one expert of each routed MoE layer" in caplog.text
    assert all(crossed)
    assert fx_offload.report(model).expert_cache is None


@pytest.mark.parametrize("options,match", [
    ({"expert_cache": "1GiB", "experts": "whole"},
     "option 'expert_cache' .* applies with experts='routed' only"),
    ({"expert_cache": "lots"}, "option 'expert_cache' must be 'auto' .*, 0 .*, or a positive"),
    ({"expert_cache": -5}, "option 'expert_cache' must be 'auto'"),
    ({"expert_cache": True}, "option 'expert_cache' must be 'auto'"),
])
def test_bad_expert_cache_values_are_refused(options, match):
    model, (x,) = models.build("mlp")
    with pytest.raises(OffloadError, match=match):
        fx_offload.place(model, "cpu", **options)


def test_the_planner_sets_the_cache_aside_from_the_budget():
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    reference = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "memory_budget": total // 2 + 4096,
        "expert_cache": 4096})
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
    planner = fx_offload.report(model).planner
    assert planner.budget == total // 2 and "expert_cache's 4.00 KiB" in str(planner)


@pytest.mark.cuda
def test_cached_experts_inside_cuda_graphs():
    """reduce-overhead: the replays read the cache the refreshes fill between them, and
    after a change of the weights the cached rows are the new ones (streamed: under
    "auto" a host whose rates favour it would record the experts as host jobs)."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT, "cuda", "batched_mm",
                                            inner_backend="inductor", mode="reduce-overhead",
                                            host_compute="never")
    reference = torch.compile(copy.deepcopy(model), mode="reduce-overhead")
    state = None
    with torch.no_grad():
        for i in range(10):
            if i == 7:
                new = {k: v * 2 for k, v in
                       reference._orig_mod.model.layers[3].mlp.experts.state_dict().items()}
                reference._orig_mod.model.layers[3].mlp.experts.load_state_dict(new)
                model.model.layers[3].mlp.experts.load_state_dict(new)
            ids = torch.randint(0, 256, (1, 1), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(i))
            got = compiled(ids, use_cache=False).logits.clone()
            want = reference(ids, use_cache=False).logits.clone()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            state = state or registry.state_for_model(model)
            if i >= 4:
                assert int(state.routed.gathered) == 0 and int(state.routed.cached_bytes), i
            cache = state.routed.cache
            if i >= 3:      # a replay of the captured decode graph counts its picks too
                if cache.calls in expert_cache.FIRST_REFRESHES:     # halved as it began
                    before = before // 2
                added = cache._counts - before
                assert added.min() >= 0 and added.sum() > 0, (i, added)
            before = cache._counts.clone()


def test_by_default_the_cache_takes_what_memory_budget_leaves_and_nothing_without_one():
    """``expert_cache="auto"``: memory_budget is the device memory the user gives the
    weights, so what the chosen plan leaves of it keeps experts; without a budget nothing
    is taken (that memory may be the KV cache's)."""
    model, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    reference = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    compiled = torch.compile(model, backend="prefetch_offload", options={
        "inner_backend": "aot_eager", "memory_budget": total // 2})
    with torch.no_grad():
        for seed in range(6):
            x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(compiled(x), reference(x)), seed
    rep = fx_offload.report(model)
    left = rep.planner.budget - rep.planner.chosen.candidate.weights_bytes
    assert rep.expert_cache is not None and 0 < rep.expert_cache[1] <= left, (rep.expert_cache,
                                                                              left)
    assert rep.expert_cache[2] > 0          # and the last call found experts there
    model, compiled, reference = _offloaded("auto")
    _calls(model, compiled, reference, "cpu", 5)
    assert fx_offload.report(model).expert_cache is None


def test_a_cache_that_does_not_fit_on_the_device_says_what_to_lower(monkeypatch):
    """Out of device memory while the cache is made: a clear error, and the model as it
    was (its weights where they were, usable without offloading)."""
    def full(count, like, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(expert_cache, "_rows", full)
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    ids = torch.randint(0, 256, (2, 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="option 'expert_cache' .* does not fit on cpu beside "
                                        "the slots: CUDA out of memory.* Lower it"), \
            torch.no_grad():
        compiled(ids, use_cache=False)
    assert registry.state_for_model(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits,
                           reference(ids, use_cache=False).logits)
    # place() too: the cache is made before any host block, so no parameter moved
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(OffloadError, match="option 'expert_cache' .* does not fit"):
        fx_offload.place(model, "cpu", expert_cache=2 * 16 * EXPERT)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert registry.state_for_model(model) is None


@pytest.mark.parametrize("where", ["at the first refresh", "part-way through a newcomer"])
def test_a_refresh_that_fails_leaves_the_next_calls_right(monkeypatch, where):
    """An error while a refresh copies rows (a device fault, say): that call raises it, and
    every later call is right, however many rows were written and whether the experts it
    was bringing in are still wanted at the next refresh.  Four experts a layer; calls 5
    to 8 pick other experts than those before, so the refresh as call 9 begins brings in
    newcomers."""
    model, compiled, reference = _offloaded(2 * 4 * EXPERT)
    real, cache = expert_cache.ExpertCache._copy_expert, expert_cache.ExpertCache._cache
    failing = {"call": 5 if where == "at the first refresh" else 9}
    before = {}

    def remember(self, layer, wanted, masters, version):
        before[layer] = set(self.held[layer])       # to tell newcomers from kept experts
        return cache(self, layer, wanted, masters, version)

    def flaky(self, layer, row, expert, masters):
        if self.calls + 1 == failing["call"] and expert not in before[layer]:
            if where != "at the first refresh":     # one tensor of the row written, then
                suffix, t = next(iter(self.tensors[layer].items()))
                t[row].copy_(masters[suffix][expert])
            raise RuntimeError("injected fault")
        return real(self, layer, row, expert, masters)
    monkeypatch.setattr(expert_cache.ExpertCache, "_cache", remember)
    monkeypatch.setattr(expert_cache.ExpertCache, "_copy_expert", flaky)
    raised = []
    for i in range(20):
        prompt = 100 if 4 <= i < 8 else 0     # the same tokens, but for calls 4 to 7
        try:
            _calls(model, compiled, reference, "cpu", 1, first=prompt)
        except RuntimeError as error:
            assert "injected fault" in str(error)
            raised.append(i)
    assert raised == [failing["call"] - 1], raised


def test_a_write_no_version_counter_sees_reaches_the_cache_at_the_next_refresh():
    """``p.data.mul_(2)`` moves no counter the library can read: a slot is copied again
    each call anyway, the cache's rows at the next refresh (documented)."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)            # the first refresh: call 5
    experts = model.model.layers[3].mlp.experts
    theirs = reference._orig_mod.model.layers[3].mlp.experts
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.data.mul_(2)
            getattr(theirs, name).mul_(2)
    cache = registry.state_for_model(model).routed.cache
    stale = 0
    with torch.no_grad():
        while cache.calls + 1 < expert_cache.FIRST_REFRESHES[1]:    # until the next one
            ids = torch.randint(0, 256, (2, 1), generator=torch.Generator().manual_seed(0))
            stale += not torch.equal(compiled(ids, use_cache=False).logits,
                                     reference(ids, use_cache=False).logits)
    assert stale        # (documented: the rows held are the old ones until then)
    _calls(model, compiled, reference, "cpu", 4, first=8)


def test_layers_whose_experts_move_whole_keep_no_cache():
    """transformers' eager experts loop breaks the graph inside each layer: its experts
    move whole, no gather ever reads a cache, so the cache frees its rows (and report
    says nothing of a cache)."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT, impl="eager")
    cache = None
    with torch.no_grad():
        for i in range(6):
            ids = torch.randint(0, 256, (2, 1), generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(ids, use_cache=False).logits,
                               reference(ids, use_cache=False).logits), i
            cache = cache or registry.state_for_model(model).routed.cache
    assert cache.tensors == {} and cache.nbytes == 0
    rep = fx_offload.report(model)
    assert rep.expert_cache is None and rep.saved_bytes == rep.offloaded_bytes - rep.buffer_bytes


@pytest.mark.parametrize("zero", [0, 0.0, "0", "0B", "0 GiB"])
def test_a_cache_of_nothing_may_be_written_any_way_a_size_is(zero):
    assert fx_offload.backend(expert_cache=zero).options.expert_cache == 0


@pytest.mark.parametrize("step", ["unpublish", "publish"])
def test_a_fault_while_where_is_written_leaves_the_next_calls_right(monkeypatch, step):
    """The reload after a change of the weights fails where it takes the rows out of
    ``where`` (before any row is written) or where it names them again (after): that call
    raises, the next ones compute with the new weights, and what the cache says it holds
    is what it serves."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)
    cache = registry.state_for_model(model).routed.cache
    real, seen = expert_cache.ExpertCache._publish, {"n": 0}

    def flaky(self, layer, held):
        seen["n"] += 1
        if seen["n"] == (1 if step == "unpublish" else 2):
            raise RuntimeError("injected fault")
        return real(self, layer, held)
    theirs = reference._orig_mod.model.layers[3].mlp.experts
    new = {k: v * 2 for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(new)
    model.model.layers[3].mlp.experts.load_state_dict(new)
    monkeypatch.setattr(expert_cache.ExpertCache, "_publish", flaky)
    with pytest.raises(RuntimeError, match="injected fault"):
        _calls(model, compiled, reference, "cpu", 1, first=5)
    _calls(model, compiled, reference, "cpu", 2, first=6)   # before the next refresh
    where = cache.where[3].tolist()
    assert all(where[e] == r for r, e in enumerate(cache.held[3]) if e >= 0)
    assert sum(w >= 0 for w in where) == sum(e >= 0 for e in cache.held[3])


def test_restore_copies_no_cached_row(monkeypatch):
    """A change of the weights then restore: the cache is dropped, not filled first."""
    model, compiled, reference = _offloaded(2 * 16 * EXPERT)
    _calls(model, compiled, reference, "cpu", 5)
    with torch.no_grad():
        model.model.layers[3].mlp.experts.down_proj.mul_(2)
    copied = []
    monkeypatch.setattr(expert_cache.ExpertCache, "_copy_expert",
                        lambda self, *a: copied.append(a))
    fx_offload.restore(model)
    assert copied == []


def test_picks_computed_on_the_host_are_counted_once_an_expert_as_a_gather_counts_them():
    """The host's share of a split layer (host_compute): ``count_picks`` adds each expert
    its ids pick once, sentinels (the device's share) nowhere, so the next refresh weighs
    them; ``cache_rows`` is the layer's ``where`` once the cache holds rows of it."""
    model, compiled, reference = _offloaded(4 * 2 * EXPERT)
    _calls(model, compiled, reference, "cpu", 1)
    routed = registry.state_for_model(model).routed
    layer = sorted(routed.cache.counts)[0]
    counts = routed.cache.counts[layer]
    before = counts.clone()
    experts = counts.numel()
    ids = torch.tensor([[3, experts], [3, 5], [experts, 7]])     # E: the device's picks
    routed.count_picks(layer, ids)
    added = counts - before
    assert added[[3, 5, 7]].tolist() == [1, 1, 1] and int(added.sum()) == 3
    assert routed.cache_rows(layer) is routed.cache.where[layer]
    routed.cache._drop(layer)
    assert routed.cache_rows(layer) is None
