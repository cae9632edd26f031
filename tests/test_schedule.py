"""The slot rule, written once in fx_offload.schedule, on the cases docs/design.md describes."""
from fx_offload.schedule import Schedule


def test_five_layers_over_two_slots_shorten_the_distance_at_the_wrap():
    s = Schedule([4, 0, 3, 1, 2], 2)                 # any order in: layers run ascending
    assert s.layers == (0, 1, 2, 3, 4)
    assert s.slot_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert s.refill_of == {0: 2, 1: 3, 2: 4, 3: 1, 4: 0}
    assert s.call_entry() == [0, 1]


def test_a_slot_of_one_layer_is_never_refilled():
    s = Schedule([1, 2, 4, 5], 3)
    assert s.refill_of == {1: 5, 2: None, 4: None, 5: 1}
    assert s.refilled_layers() == [5, 1]
    assert s.moved_bytes({1: 10, 2: 20, 4: 40, 5: 50}) == 60
    assert s.slot_bytes({1: 10, 2: 20, 4: 40, 5: 50}) == 50 + 20 + 40


def test_a_graph_that_starts_mid_call_finds_earlier_refills_done():
    s = Schedule([1, 3, 5, 7], 2)                   # slot 0: 1, 5; slot 1: 3, 7
    assert s.graph_entry(1) == [1, 3]
    assert s.graph_entry(5) == [5, 7]               # after 1 and 3 ran, their refills started
    assert s.graph_entry(7) == [1, 7]               # 5 ran too: slot 0 wraps to the next call
    assert s.ends_call([5, 7]) and not s.ends_call([1, 3]) and not s.ends_call([])
