"""``memory_budget`` counts a static KV cache (fx_offload.kv.host_layers): under the default
``kv_cache="auto"`` the fewest cache layers that make the weights and the cache fit go to the
host, before any weight is offloaded; the weight planner gets what the cache leaves."""
import copy

import pytest
import torch

import fx_offload
from fx_offload.errors import BudgetError, OffloadError
from fx_offload.kv import host_layers, runtime_of
from fx_offload.selection.budget import weights_bytes
from helpers import PLANNER_RATES as RATES

transformers = pytest.importorskip("transformers", reason="install the test extra")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
LENGTH = 2048       # the cache's tokens: its keys and values, 512 KiB a layer, outweigh
PER_LAYER = 1 * 2 * LENGTH * (16 + 16) * 4      # the weights (about 0.65 MiB)


def test_choose_takes_the_fewest_layers_from_the_end(monkeypatch):
    monkeypatch.setattr(host_layers, "WORTH_MOVING", 0)     # every layer repays its move
    sizes = {i: 100 for i in range(4)}
    fits = host_layers.choose(sizes, [0, 1, 2, 3], 2, budget=1400, weights=1000, planned=False)
    assert fits.layers == () and fits.device_bytes == 400
    # 100 too many: one or two host layers free nothing (their slots take it back)
    some = host_layers.choose(sizes, [0, 1, 2, 3], 2, budget=1300, weights=1000, planned=False)
    assert some.layers == (1, 2, 3) and some.device_bytes == 300
    short = host_layers.choose(sizes, [0, 1, 2, 3], 2, budget=1000, weights=1000, planned=False)
    assert short.layers == (0, 1, 2, 3) and short.device_bytes == 200     # the most it frees
    one_slot = host_layers.choose(sizes, [0, 2], 1, budget=1350, weights=1000, planned=False)
    assert one_slot.layers == (0, 2) and one_slot.device_bytes == 300
    assert "memory_budget" in some.describe()


def test_small_cache_layers_stay_on_the_device_where_weights_move_anyway():
    """Where no set of host layers makes the weights and the cache fit, the weights are
    offloaded anyway: a layer smaller than WORTH_MOVING of a cache that is a small share of
    the budget (a 7.5 MiB cache over 48 layers beside 57 GiB of weights, a 32 GiB budget)
    stays on the device; big layers still go, and small ones of a cache that is a large
    share of the budget (what they free may decide whether the weights fit); where a few
    small layers do make everything fit, they go (that spares a weight layer's copies)."""
    small = {i: 160 << 10 for i in range(48)}
    kept = host_layers.choose(small, list(range(48)), 2, budget=32 << 30, weights=57 << 30,
                              planned=False)
    assert kept.layers == () and kept.device_bytes == 48 * (160 << 10)
    big = {i: 64 << 20 for i in range(8)}
    moved = host_layers.choose(big, list(range(8)), 2, budget=20 << 30, weights=30 << 30,
                               planned=False)
    assert moved.layers == tuple(range(8)) and moved.device_bytes == 2 * (64 << 20)
    share = host_layers.choose(small, list(range(48)), 2, budget=200 << 20,
                               weights=57 << 30, planned=False)
    assert share.layers == tuple(range(48))
    fits = host_layers.choose(small, list(range(48)), 2, budget=(57 << 30) + 40 * (160 << 10),
                              weights=57 << 30, planned=False)
    assert fits.layers == tuple(range(38, 48))      # 10 host layers free 8, as needed


def _models(**options):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    reference.generation_config.eos_token_id = None
    model = copy.deepcopy(reference)
    fx_offload.compile_forward(reference, inner_backend="aot_eager", dynamic=False,
                               group_size=4, num_in_group=1)
    fx_offload.compile_forward(model, inner_backend="aot_eager", dynamic=False,
                               **(RATES if "memory_budget" in options else {}), **options)
    return reference, model


def _resident() -> int:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return weights_bytes(model, torch.device("cpu"))


def _generate(model, ids):
    cache = transformers.StaticCache(config=model.config, max_cache_len=LENGTH)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
    return out, cache


@pytest.mark.parametrize("spare, host, weights_offloaded, worth", [  # (both fit: next test)
    (7 * PER_LAYER // 2, [1, 2, 3], False, None),   # three layers make room (two hold nothing)
    (3 * PER_LAYER // 2, [0, 1, 2, 3], True, None)])    # all four do not: weights go too
def test_the_budget_counts_the_cache_and_moves_it_first(spare, host, weights_offloaded, worth,
                                                         monkeypatch):
    """A budget of the weights plus ``spare``: the host layers are the planner's, tokens
    equal the unbudgeted model's, the weight planner plans for what the cache left, and
    report says so.  ``worth``: host_layers.WORTH_MOVING where not the default."""
    if worth is not None:
        monkeypatch.setattr(host_layers, "WORTH_MOVING", worth)
    reference, model = _models(memory_budget=_resident() + spare)
    ids = torch.randint(0, 128, (1, 21))
    expected, _ = _generate(reference, ids)
    got, cache = _generate(model, ids)
    assert torch.equal(got, expected)
    runtime = runtime_of(model)
    assert runtime.layers == host
    kv_device = 4 * PER_LAYER - len(host) * PER_LAYER + min(2, len(host)) * PER_LAYER
    assert runtime.plan.device_bytes == kv_device
    rep = fx_offload.report(model)
    assert rep.planner.reserved == kv_device
    assert rep.planner.offloads == weights_offloaded
    assert ("KV cache on the host" in str(rep)) == bool(host)
    assert "KV cache 2.00 MiB at full length" in str(rep)
    for i, layer in enumerate(cache.layers):
        assert (runtime.owner_of(layer.keys) is not None) == (i in host)


def test_device_cache_counted_and_too_small_a_budget_says_so():
    """kv_cache='device' keeps the cache there, and the budget still counts it; a budget
    the cache leaves no room in is refused with the cache's share named."""
    _, model = _models(memory_budget=_resident() + 5 * PER_LAYER, kv_cache="device")
    ids = torch.randint(0, 128, (1, 9))
    _generate(model, ids)
    assert runtime_of(model).layers == []
    assert fx_offload.report(model).planner.reserved == 4 * PER_LAYER
    _, model = _models(memory_budget=PER_LAYER)
    with pytest.raises(Exception, match="KV cache's 1.00 MiB on the device") as caught:
        _generate(model, ids)
    assert isinstance(getattr(caught.value, "inner_exception", caught.value), BudgetError)


def test_a_bigger_cache_after_the_plan_is_warned_about(caplog):
    """The plan is made for the first cache; a later, longer one keeps its placement (the
    compiled graphs are built for it) and gets a warning that the budget may be exceeded,
    once."""
    reference, model = _models(memory_budget=_resident() + 5 * PER_LAYER)
    ids = torch.randint(0, 128, (1, 9))
    _generate(model, ids)
    assert runtime_of(model).layers == []       # weights and cache fit: nothing moves
    assert "every layer on the device" in str(fx_offload.report(model))
    for _ in range(2):
        cache = transformers.StaticCache(config=model.config, max_cache_len=3 * LENGTH)
        with torch.no_grad(), caplog.at_level("WARNING", logger="fx_offload"):
            model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache)
    warned = [r for r in caplog.records if "more than the" in r.getMessage()]
    assert len(warned) == 1 and "6.00 MiB" in warned[0].getMessage()


def test_kv_options_that_do_not_apply_are_refused():
    with pytest.raises(OffloadError, match="kv_layers' only applies with kv_cache='host'"):
        fx_offload.parse_options({"kv_layers": [0], "memory_budget": "1GiB"})
    with pytest.raises(OffloadError, match="only apply where the KV cache may go to the host"):
        fx_offload.parse_options({"kv_slots": 3})
    assert fx_offload.parse_options({"kv_slots": 3, "memory_budget": "1GiB"}).kv_slots == 3

