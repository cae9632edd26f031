"""The slot rule, written once in fx_offload.schedule, on the cases docs/design.md describes."""
import pytest

from fx_offload.schedule import Schedule


def test_five_layers_over_two_slots_shorten_the_distance_at_the_wrap():
    s = Schedule([4, 0, 3, 1, 2], 2)                 # any order in: layers run ascending
    assert s.layers == (0, 1, 2, 3, 4)
    assert s.slot_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert s.refill_of == {0: 2, 1: 3, 2: 4, 3: 1, 4: 0}
    # the circular prefetch at the end: started after the slot's last layer, like the others
    assert [s.refill_in_call(layer) for layer in s.layers] == [2, 3, 4, 1, 0]
    assert s.entry_refills() == [] and s.call_entry() == [0, 1] == s.first_fill()


def test_circular_prefetch_at_the_entry_starts_each_slot_when_the_call_begins():
    s = Schedule([4, 0, 3, 1, 2], 2, "entry")
    assert s.refill_of == {0: 2, 1: 3, 2: 4, 3: 1, 4: 0}          # the same slot rule
    assert [s.refill_in_call(layer) for layer in s.layers] == [2, 3, 4, None, None]
    assert s.entry_refills() == [(4, 0), (3, 1)]     # in the order 0 and 1 are read
    assert s.call_entry() == [4, 3]                  # what the previous call left there
    assert s.first_fill() == [0, 1]                  # the first call finds nothing to copy
    assert s.call_exit() == [4, 3]                   # and leaves there at its end
    assert s != Schedule(s.layers, 2) and s == Schedule(s.layers, 2, "entry")


def test_circular_prefetch_chosen_per_call_has_both_starts():
    s = Schedule([4, 0, 3, 1, 2], 2, "either")
    assert s.at_entry and s.at_end
    assert [s.refill_in_call(layer) for layer in s.layers] == [2, 3, 4, 1, 0]   # the end's
    assert s.entry_refills() == [(4, 0), (3, 1)]                              # the entry's
    # a call may begin with the slot's last layer (the end's start stayed idle): the graph
    # must refill it at the entry; it ends with the first layer copying (the end's start)
    assert s.call_entry() == [4, 3] and s.call_exit() == [0, 1]
    assert s.moved_bytes(dict.fromkeys(range(5), 1)) == 5      # each refill copied once
    assert s != Schedule(s.layers, 2, "entry") and s != Schedule(s.layers, 2)
    with pytest.raises(ValueError, match="circular must be one of"):
        Schedule(s.layers, 2, "middle")


def test_a_slot_of_one_layer_is_never_refilled():
    for circular in ("end", "either", "entry"):
        s = Schedule([1, 2, 4, 5], 3, circular)
        assert s.refill_of == {1: 5, 2: None, 4: None, 5: 1}
        assert s.refilled_layers() == [5, 1]
        assert s.moved_bytes({1: 10, 2: 20, 4: 40, 5: 50}) == 60
        assert s.slot_bytes({1: 10, 2: 20, 4: 40, 5: 50}) == 50 + 20 + 40
    assert s.entry_refills() == [(5, 1)] and s.call_entry() == [5, 2, 4]


def test_a_graph_that_starts_mid_call_finds_earlier_refills_done():
    s = Schedule([1, 3, 5, 7], 2)                   # slot 0: 1, 5; slot 1: 3, 7
    assert s.graph_entry(1) == [1, 3]
    assert s.graph_entry(5) == [5, 7]               # after 1 and 3 ran, their refills started
    assert s.graph_entry(7) == [1, 7]               # 5 ran too: slot 0 wraps to the next call
    assert s.ends_call([5, 7]) and not s.ends_call([1, 3]) and not s.ends_call([])
    e = Schedule([1, 3, 5, 7], 2, "entry")
    assert e.graph_entry(1) == [5, 7]               # the graph of 1 starts the entry refills
    assert e.graph_entry(3) == [5, 3]               # they began, and 1's refill (5)
    assert e.graph_entry(5) == [5, 7]
    assert e.graph_entry(7) == [5, 7]               # 5's slot is refilled at the next call
    assert e.starts_call([1, 3]) and not e.starts_call([3, 5])
