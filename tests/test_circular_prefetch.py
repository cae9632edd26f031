"""Where the circular prefetch (each slot's first layer, copied back in for the next call)
starts: after the slot's last layer, or at the next call's entry (``circular_prefetch``)."""
import copy

import pytest
import torch
from torch import nn

import fx_offload
from fx_offload import ops, registry
from fx_offload.options import parse_options
from fx_offload.runtime.memory.contents import Pending
from fx_offload.selection.budget import simulate
from fx_offload.schedule import Schedule
from fx_offload.tools import models
from helpers import fresh_inputs


def test_auto_chooses_per_call_outside_cuda_graphs_and_the_entry_under_them():
    assert parse_options({}).circular_start == "either"
    assert parse_options({}, mode="reduce-overhead").circular_start == "entry"
    assert parse_options({"circular_prefetch": "entry"}).circular_start == "entry"
    assert parse_options({"circular_prefetch": "end"}, mode="reduce-overhead").circular_start \
        == "end"
    assert "circular_prefetch='entry'" in parse_options({"circular_prefetch": "entry"}).describe()


@pytest.mark.parametrize("circular", ["end", "entry", "auto"])
def test_calls_end_with_the_slots_the_schedule_says_and_outputs_equal(circular):
    model, inputs = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(group_size=2, prefetch_step=2, inner_backend="aot_eager",
                                          circular_prefetch=circular))
    with torch.no_grad():
        for call in range(4):
            x = fresh_inputs("mlp", inputs, call)
            assert torch.equal(compiled(*x), reference(*x)), call
            state = registry.state_for_model(model)
            held = [sorted({layer for layer, _ in slot}) for slot in state.contents.held]
            # slots 0 and 1 hold layers 1, 5 and 3; at the end of a call, the first layers
            # (copied back at the end) or the last ones (to be replaced at the entry); chosen
            # per call (auto), the end's copies run in line on the CPU: it stays at the end
            assert held == ([[5], [3]] if circular == "entry" else [[1], [3]]), (call, held)
    assert state.stats["sync_loads"] == 0          # every layer was prefetched in time
    # per call, layers 5 and 1 come into slot 0 (layer 3 is alone in slot 1); the first
    # call's entry found layer 1 there already
    assert state.stats["prefetches"] == (7 if circular == "entry" else 8)


class FromAnInt(nn.Module):
    """A forward with no tensor input: nothing to tie the entry refills to but the first
    offloaded layer's own values."""

    def __init__(self):
        super().__init__()
        self.inner = models.MLPStack(num_layers=4)

    def forward(self, n: int):
        return self.inner(torch.full((2, 32), float(n)).sin())


def test_a_graph_without_tensor_inputs_starts_the_entry_refills_before_the_first_wait():
    model = FromAnInt()
    reference = copy.deepcopy(model)
    e = fx_offload.explain(model, 3, group_size=2, circular_prefetch="entry")
    (record,) = e.graphs
    nodes = list(record.after.graph.nodes)
    calls = [ops.OpCall.of(n) for n in nodes]
    kinds = [(c.kind, c.layer, c.refill) for c in calls if c is not None]
    # layer 3 leaves slot 0, layer 1 comes in, just before layer 1's first wait
    assert kinds[:2] == [("start", 3, 1), ("wait", 1, None)]
    first = next(i for i, c in enumerate(calls) if c is not None)
    assert any(n.op == "call_function" and calls[i] is None for i, n in enumerate(nodes[:first]))
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(group_size=2, inner_backend="aot_eager",
                                          circular_prefetch="entry"))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(3), reference(3))


def test_simulation_follows_where_the_circular_prefetch_starts():
    """Back to back (what the planner predicts), a copy at the end overlaps the next call's
    first layers as one at the entry does, and also the end of its own call."""
    end, entry = Schedule([1, 3], 1), Schedule([1, 3], 1, "entry")
    copy_s = {1: 3.0, 3: 3.0}
    # whole layers, one slot: the same either way (layer 1's copy hides under layer 0)
    assert simulate(0, [1.0] * 4, 0, end, copy_s) == simulate(0, [1.0] * 4, 0, entry, copy_s) \
        == pytest.approx(8.0)
    # in two chunks: at the end the copy stream never idles (6 units, the copies); at the
    # entry it idles while layer 3 computes its second half after the last copy
    assert simulate(0, [1.0] * 4, 0, end, copy_s, chunks=2) == pytest.approx(6.0)
    assert simulate(0, [1.0] * 4, 0, entry, copy_s, chunks=2) == pytest.approx(6.5)
    # every layer offloaded, two slots: at the end each copy is a call ahead; at the entry
    # the first one has nothing to hide under
    four = dict.fromkeys(range(4), 3.0)
    assert simulate(0, [3.0] * 4, 0, Schedule(range(4), 2), four) == pytest.approx(12.0)
    assert simulate(0, [3.0] * 4, 0, Schedule(range(4), 2, "entry"), four) == \
        pytest.approx(15.0)


def test_the_call_hook_begins_the_entry_refills_before_the_graph_runs():
    """At the entry, outside CUDA graphs, the model's call hook begins each slot's refill
    (ahead of Dynamo's guards); the graph's own start then finds it begun and copies nothing,
    so each refill is copied once per call."""
    assert parse_options({"circular_prefetch": "entry"}).hook_starts_entry
    # under CUDA graphs too: a capture waits for the hook's copies through external events
    assert parse_options({}, mode="reduce-overhead").hook_starts_entry
    assert not parse_options({"circular_prefetch": "end"}).hook_starts_entry
    model, inputs = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(group_size=2, prefetch_step=2, inner_backend="aot_eager",
                                          circular_prefetch="entry"))
    seen = []

    def after_ours(module, args):       # a pre-hook registered after ours runs after it
        state = registry.state_for_model(module)
        seen.append((sorted({layer for layer, _ in state.contents.held[0]}),
                     state.stats["prefetches"]))
    with torch.no_grad():
        compiled(*fresh_inputs("mlp", inputs, 0))      # compiles; places the hooks
        model.register_forward_pre_hook(after_ours)
        for call in range(1, 4):
            x = fresh_inputs("mlp", inputs, call)
            assert torch.equal(compiled(*x), reference(*x)), call
    state = registry.state_for_model(model)
    # slot 0 cycles 1 -> 5 -> 1: when the user's hook runs, layer 1 is already copied in
    # (over layer 5): the first call copied layer 5, each later one copies 1 in its hook,
    # then 5; the graph's entry start copies nothing more
    assert [held for held, _ in seen] == [[1]] * 3
    assert [n for _, n in seen] == [2, 4, 6]
    assert state.stats == {"prefetches": 7, "sync_loads": 0}


def test_inside_a_capture_the_call_hook_leaves_the_entry_refills_to_the_graph(monkeypatch):
    from fx_offload.runtime.copies import hook_copies
    model, inputs = models.build("mlp", num_layers=6)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(group_size=2, inner_backend="aot_eager",
                                          circular_prefetch="entry"))
    with torch.no_grad():
        compiled(*inputs)
        state = registry.state_for_model(model)
        before = state.stats["prefetches"]
        held, key = state.contents.slot(1), (1, 0)
        # an earlier call's hook copy (that call raised before its wait): not this capture's
        held[key] = Pending(None, in_capture=False, by_hook=True)
        monkeypatch.setattr(hook_copies, "capturing", lambda: True)
        state.begin_entry_refills()
        assert state.stats["prefetches"] == before          # nothing begun from the hook
        assert key not in held                              # the graph's start copies it
        # a copy recorded in a capture that raised never ran: forgotten, copied afresh
        held[key] = Pending(None, in_capture=True)
        monkeypatch.setattr(hook_copies, "capturing", lambda: False)
        state.begin_entry_refills()
        assert state.stats["prefetches"] == before + 1      # layer 1 over layer 5, slot 0
        assert held[key] is None


def test_a_placed_model_compiled_for_cuda_graphs_later_is_switched_before_its_calls():
    """Placed with the default options, then compiled with reduce-overhead: from that
    compile on the model's calls may be replays, so the call hook copies every call and an
    eager call ends joined (runtime.copies.hook_copies)."""
    model, (x,) = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    fx_offload.place(model, "cpu", prefetch_step=2)
    state = registry.state_for_model(model)
    assert not state.hook_copies.under_cuda_graphs
    compiled = torch.compile(model, backend=fx_offload.backend(), mode="reduce-overhead")
    with torch.no_grad():       # Inductor (no CUDA graphs on the CPU): its own rounding
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    assert state.hook_copies.under_cuda_graphs and state.choice.hook_starts_entry


class Landed:
    """A stand-in for the done event of a copy begun at a call's end."""

    def __init__(self, landed: bool):
        self.landed = landed

    def query(self) -> bool:
        return self.landed


def test_per_call_choice_follows_what_the_caller_does_between_calls():
    from fx_offload.runtime.copies.circular import LANDED_CALLS, RECHECK_EVERY, CircularStart
    choice = CircularStart("either")
    assert choice.at_end and choice.copies_at_end(capturing=False)
    assert not choice.copies_at_end(capturing=True)      # a capture behaves as at the entry
    # calls back to back, or a loop that waits for its outputs alone: the end's copy is
    # still running when the next call begins: the end stays
    for _ in range(5):
        choice.began_at_end(Landed(False))
        choice.call_begins()
        assert choice.at_end
    choice.call_begins()            # nothing began at the end (a graph break, the CPU)
    assert choice.at_end
    # a loop that synchronizes the device after each call: landed every time
    for _ in range(LANDED_CALLS - 1):
        choice.began_at_end(Landed(True))
        choice.call_begins()
        assert choice.at_end         # once is not enough
    choice.began_at_end(Landed(True))
    choice.call_begins()
    assert not choice.at_end and not choice.copies_at_end(capturing=False)
    assert "now: the entry" in choice.describe()
    # the end is tried again once in RECHECK_EVERY calls; still synchronizing: back at once
    for _ in range(RECHECK_EVERY - 1):
        choice.call_begins()
        assert not choice.at_end
    choice.call_begins()
    assert choice.at_end
    choice.began_at_end(Landed(True))
    choice.call_begins()
    assert not choice.at_end
    # the caller changed (now back to back): the next try finds the copy running, and stays
    for _ in range(RECHECK_EVERY):
        choice.call_begins()
    assert choice.at_end
    choice.began_at_end(Landed(False))
    choice.call_begins()
    assert choice.at_end
    # the other places are fixed
    assert CircularStart("end").copies_at_end(capturing=True)
    fixed = CircularStart("entry")
    fixed.began_at_end(Landed(True))
    fixed.call_begins()
    assert not fixed.at_end and fixed.describe() == "when the next call begins"


def test_the_entry_is_not_chosen_where_nothing_runs_before_the_first_offloaded_layer():
    """A call whose first layer is offloaded waits for its copy at once: a copy begun at the
    entry is hidden by nothing, so copies that land between calls (a caller that
    synchronizes, or Hugging Face generate's token handling) keep the end."""
    from fx_offload.runtime.copies.circular import LANDED_CALLS, RECHECK_EVERY, CircularStart
    choice = CircularStart("either", entry_hides=False)
    for _ in range(LANDED_CALLS + RECHECK_EVERY):
        choice.began_at_end(Landed(True))
        choice.call_begins()
        assert choice.at_end and choice.copies_at_end(capturing=False)
    assert choice.moves == 0


def test_the_state_lets_the_entry_hide_a_copy_only_behind_a_resident_layer():
    for group_size, num_in_group, hides in ((2, 1, True), (1, 1, False)):
        model, (x,) = models.build("decoder", num_layers=4, batch=1, seq=4)
        compiled = torch.compile(model, backend="prefetch_offload",
                                 options=dict(group_size=group_size, num_in_group=num_in_group,
                                              inner_backend="eager"))
        with torch.no_grad():
            compiled(x)
        state = fx_offload.registry.state_for_model(model)
        assert (state.layers[0] > 0) == hides and state.circular.entry_hides == hides
        fx_offload.restore(model)


def test_a_call_whose_end_start_stays_idle_leaves_the_refill_to_the_entry():
    """Chosen per call, once the entry is chosen the end's start copies nothing: the call
    ends with the slot's last layer, and the next call's entry copies its first; outputs are
    those of the model, each refill copied once per call, none loaded synchronously."""
    model, inputs = models.build("mlp", num_layers=6)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options=dict(group_size=2, prefetch_step=2, inner_backend="aot_eager"))
    with torch.no_grad():
        compiled(*fresh_inputs("mlp", inputs, 0))
        state = registry.state_for_model(model)
        assert state.schedule.circular == "either"
        state.circular.at_end = False           # as chosen for a loop that synchronizes
        state.circular._calls_at_entry = -100   # no try of the end in this test
        before = state.stats["prefetches"]
        for call in range(1, 4):
            x = fresh_inputs("mlp", inputs, call)
            assert torch.equal(compiled(*x), reference(*x)), call
            held = [sorted({layer for layer, _ in slot}) for slot in state.contents.held]
            assert held == [[5], [3]], (call, held)
    # per call: layer 1 at the entry (over 5), then 5 (over 1); the first of these calls
    # found layer 1 copied by the end of the compiling call
    assert state.stats["prefetches"] - before == 5
    assert state.stats["sync_loads"] == 0
    assert "chosen per call" in str(fx_offload.report(model))
