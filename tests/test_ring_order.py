"""The ring that fetches routed MoE layers' other chunks ahead (``runtime/experts/ahead.py``), checked
for its stream order on the CPU: CUDA's streams and events are replaced by a simulator that
runs every queued copy only once what it was ordered after has run, in a random order
otherwise, so that a copy ordered after too little reads or overwrites the wrong bytes.  It
records CUDA-graph captures and replays them (each replay after the work queued before it
on its stream, an external event's wait node after the event's record at launch, the
stream's later work after the whole replay), and refuses what a capture refuses: a wait for
an event last recorded outside it (unless external) or in another capture, work on a
stream that has not joined it, and a capture that ends with a stream not joined back.

The runtime's pattern is driven by hand, as ``runtime/state.py`` does it: per call,
``begin_call``; per start of ``S[i]``, a fork recorded on the compute stream, the copy into
the slot from the ring (or from the host where the ring holds no usable fill), ``consumed``,
and the compute stream's wait and read of the slot; then ``end_call``.  Each host block's
bytes are its layer's number, so every read says which layer it got."""
from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fx_offload.runtime.experts import ahead

SIZE = 64           # bytes of a layer's other chunk


class IsolationError(RuntimeError):
    """What CUDA raises for a wait a capture may not hold."""


@dataclasses.dataclass(eq=False)
class Op:
    stream: "FakeStream"
    fn: object
    deps: list
    ran: bool = False
    external: list = dataclasses.field(default_factory=list)   # events (captured ops only)


class Sim:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pending: list[Op] = []
        self.capture: int | None = None     # the capture under way
        self.captures = 0
        self.compute = FakeStream()
        self.streams: list[FakeStream] = [self.compute]
        self.current = self.compute

    def enqueue(self, stream, fn=None, deps=(), external=()) -> Op:
        if self.capture is not None:        # recorded: run by replays
            deps = [d for d in [stream.captured_tail, *deps] if d is not None]
            if not deps and stream is not self.compute:
                raise IsolationError("work on a stream that has not joined the capture")
            op = Op(stream, fn, deps, external=list(external))
            stream.captured_tail = op
            self.recorded.append(op)
            return op
        op = Op(stream, fn, [d for d in [stream.tail, *deps] if d is not None])
        stream.tail = op
        self.pending.append(op)
        return op

    def run(self, count: int | None = None, until: Op | None = None) -> None:
        """Run queued ops whose order allows, picked at random: ``count`` of them, until
        ``until`` has run, or all."""
        while self.pending and (count is None or count > 0) and not (until and until.ran):
            ready = [op for op in self.pending if all(d.ran for d in op.deps)]
            assert ready, "a cycle in the stream order"
            op = self.rng.choice(ready)
            self.pending.remove(op)
            if op.fn is not None:
                op.fn()
            op.ran = True
            count = None if count is None else count - 1

    def begin_capture(self) -> None:
        """A capture on the compute stream begins."""
        self.captures += 1
        self.capture = self.captures
        self.recorded = []
        for s in self.streams:
            s.captured_tail = None

    def end_capture(self, aborted: bool = False) -> list[Op]:
        """The capture ends: its graph (every recorded op must lead to the compute
        stream's last one), or nothing where it ``aborted``."""
        self.capture = None
        if aborted:
            return []
        joined, todo = set(), [self.compute.captured_tail]
        while todo:
            op = todo.pop()
            if op is not None and op not in joined:
                joined.add(op)
                todo += op.deps
        left = [op for op in self.recorded if op not in joined]
        if left:
            raise IsolationError(f"a capture ended with {len(left)} ops not joined back")
        return self.recorded

    def replay(self, graph: list[Op]) -> None:
        """Launch ``graph`` on the compute stream."""
        launch, copies = self.compute.tail, {}
        for op in graph:
            deps = [copies[d] for d in op.deps] or ([launch] if launch else [])
            deps += [e.latest[1] for e in op.external]      # as recorded at launch
            copies[op] = Op(op.stream, op.fn, deps)
            self.pending.append(copies[op])
        end = Op(self.compute, None, list(copies.values()) + ([launch] if launch else []))
        self.pending.append(end)
        self.compute.tail = end


SIM: Sim | None = None


class FakeStream:
    def __init__(self, device=None, **kwargs):
        self.tail = self.captured_tail = None
        if SIM is not None:
            SIM.streams.append(self)

    def wait_event(self, event) -> None:
        latest = event.latest
        if latest is None:
            return                          # never recorded: waits for nothing
        where, op = latest
        if SIM.capture is not None:
            if where == SIM.capture:
                SIM.enqueue(self, deps=[op])
            elif where == "outside" and event.external:
                SIM.enqueue(self, external=[event])     # an event-wait node
            else:
                raise IsolationError(f"a wait in capture {SIM.capture} for an event last "
                                     f"recorded {where!r}")
        else:
            if where != "outside":
                raise IsolationError(f"a wait outside any capture for an event last "
                                     f"recorded in capture {where}")
            SIM.enqueue(self, deps=[op])

    def wait_stream(self, other) -> None:
        event = FakeEvent()
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        SIM.run(until=self.tail)


class FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False,
                 external=False):
        self.external = external
        self.latest = None          # (capture id or "outside", the record's op)

    def record(self, stream=None) -> None:
        stream = stream or SIM.current
        if SIM.capture is None:
            self.latest = ("outside", SIM.enqueue(stream))
        else:       # in a capture a record adds no node: it marks the stream's last one
            op = stream.captured_tail
            if op is None:
                op = SIM.enqueue(stream)
            self.latest = (SIM.capture, op)


class Deferred(TorchFunctionMode):
    """Inside ``torch.cuda.stream(s)``: a ``copy_`` is queued on ``s``, run later."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            SIM.enqueue(self.stream, lambda: dst.copy_(src))
            return dst
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_stream(stream):
    before, SIM.current = SIM.current, stream
    try:
        with Deferred(stream):
            yield
    finally:
        SIM.current = before


@dataclasses.dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    end: int


class Buffers:
    """What the ring reads of the slot buffers: ``slots`` slots taken in turn, a host block
    per layer."""

    def __init__(self, layers, slots):
        self.blocks = {layer: torch.full((SIZE,), layer, dtype=torch.uint8) for layer in layers}
        self.flat = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(slots)]
        slot_of = {layer: i % slots for i, layer in enumerate(layers)}
        self.schedule = type("Schedule", (), {"slot_of": slot_of})()
        self.pinned = True

    def block_of(self, layer):
        return self.blocks[layer]

    def count_copied(self, n):
        pass


@pytest.fixture
def sim(monkeypatch):
    global SIM
    SIM = Sim(0)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SIM.current)
    monkeypatch.setattr(ahead, "capturing", lambda: SIM.capture is not None)
    yield SIM
    SIM = None


def make_ring(layers: int, depth: int, slots: int = 1):
    sequence = [(layer, Chunk(0, 0, SIZE)) for layer in range(1, layers + 1)]
    buffers = Buffers([layer for layer, _ in sequence], slots)
    choice = type("Choice", (), {"device": torch.device("cpu")})()
    return ahead.AheadCopies(choice, buffers, sequence, depth), buffers, FakeStream()


def call(sim, ring, buffers, copy_stream, reads, stop_at=None, interleave=3):
    """One call: the starts of the ring's sequence and the compute stream's reads of the
    slots, each read's bytes appended to ``reads`` as ``(layer, what the slot held)`` once it
    runs; ``stop_at``: the call raises before that read (nothing more of it is queued; its
    end runs, as the model's always-called hook runs it).  With several slots a start comes
    as soon as its slot's layer before has been read: that many layers ahead of its read."""
    ring.begin_call(fill=sim.capture is None, changed=unchanged)
    forward(sim, ring, buffers, copy_stream, reads, stop_at, interleave)
    if sim.capture is None:
        ring.end_call(versions=lambda layer: None)


def unchanged(layer, versions) -> bool:
    return False


def forward(sim, ring, buffers, copy_stream, reads, stop_at=None, interleave=3):
    """The graph's part of a call (:func:`call`)."""
    slots, sequence = len(buffers.flat), ring.sequence
    done = {}

    def start(i):
        layer, _ = sequence[i]
        slot = buffers.flat[buffers.schedule.slot_of[layer]]
        fork, done[i] = FakeEvent(), FakeEvent()
        fork.record(sim.compute)
        if not ring.copy_into_slot(i, copy_stream, fork, done[i]):
            copy_stream.wait_event(fork)        # from the host, as slots.begin_copy does
            with torch.cuda.stream(copy_stream):
                slot.copy_(buffers.block_of(layer))
                done[i].record(copy_stream)
        ring.consumed(i)

    started = 0
    for i, (layer, _) in enumerate(sequence):
        if i == stop_at:
            break
        while started < len(sequence) and started < i + slots:
            start(started)
            started += 1
        slot = buffers.flat[buffers.schedule.slot_of[layer]]
        sim.compute.wait_event(done[i])
        sim.enqueue(sim.compute, lambda layer=layer, slot=slot:
                    reads.append((layer, set(slot.tolist()))))
        sim.run(count=sim.rng.randrange(interleave + 1))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("layers, depth", [(6, 2), (9, 4), (3, 2)])
def test_every_start_reads_its_own_layer_whatever_order_the_copies_run_in(
        sim, seed, slots, layers, depth):
    """Eager calls, one after another with work left in flight between them, one of them
    raising part-way: every read of a slot finds the layer it waited for, and the ring
    serves every start."""
    sim.rng.seed(seed)
    ring, buffers, copy_stream = make_ring(layers, depth, slots)
    hits = []
    real = ring.copy_into_slot

    def counted(*args):
        hits.append(real(*args))
        return hits[-1]
    ring.copy_into_slot = counted
    reads = []
    for n in range(4):
        call(sim, ring, buffers, copy_stream, reads, stop_at=2 if n == 1 else None)
        sim.run(count=sim.rng.randrange(8))
    sim.run()
    assert len(reads) == 3 * layers + 2
    assert all(held == {layer} for layer, held in reads), reads
    assert all(hits), hits


def test_the_ring_has_a_buffer_more_than_it_fetches_ahead(sim):
    ring, _, _ = make_ring(9, 4)
    assert ring.depth == 4 and len(ring.ring) == 5 and ring.nbytes == 5 * SIZE


def test_a_capture_that_raised_leaves_no_wait_the_next_capture_cannot_hold(sim):
    """Under ``reduce-overhead`` (the model's hook runs before the capture): a capture that
    raised before its graph's end (no join) recorded the copies out of the ring it began;
    the next capture must not wait for those events, which CUDA refuses (here:
    ``IsolationError``); a capture that ends normally joins its fills."""
    ring, buffers, copy_stream = make_ring(6, 2)
    reads = []
    call(sim, ring, buffers, copy_stream, reads)            # eager: fills held by the hook
    sim.run()
    ring.begin_call(fill=True, changed=unchanged)
    sim.begin_capture()
    forward(sim, ring, buffers, copy_stream, reads, stop_at=4)    # raises after four reads
    sim.end_capture(aborted=True)                           # no join
    ring.end_call(versions=lambda layer: None)
    graph = capture(sim, ring, buffers, copy_stream, reads, whole_call=False)
    call(sim, ring, buffers, copy_stream, reads)            # eager again after it
    ring.begin_call(fill=True, changed=unchanged)
    sim.replay(graph)
    ring.end_call(versions=lambda layer: None)
    sim.run()
    assert len(reads) == 4 * 6
    assert all(held == {layer} for layer, held in reads), reads


def capture(sim, ring, buffers, copy_stream, reads, whole_call: bool) -> list[Op]:
    """A graph of one call: under ``reduce-overhead`` the model's hooks run outside it (and
    around each replay), in a user's ``torch.cuda.graph`` around the call inside it."""
    if not whole_call:
        ring.begin_call(fill=True, changed=unchanged)
    sim.begin_capture()
    if whole_call:
        ring.begin_call(fill=False, changed=unchanged)
    forward(sim, ring, buffers, copy_stream, reads)
    ring.join(sim.compute)
    graph = sim.end_capture()
    if not whole_call:
        sim.replay(graph)           # the recording call's own run
        ring.end_call(versions=lambda layer: None)
    return graph


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("whole_call", [False, True], ids=["reduce-overhead", "user-graph"])
@pytest.mark.parametrize("slots", [1, 2])
def test_replays_and_eager_calls_between_them_read_their_own_layers(sim, seed, whole_call,
                                                                    slots):
    """A captured call replayed again and again, eager calls (a shape not captured) between
    the replays in a random pattern: every read of a slot finds its layer.  In a user's
    graph around the whole call the ring is not used (runtime.experts.ahead: its replays run none
    of the hooks); with fills in it, eager calls between its replays read other layers."""
    sim.rng.seed(seed)
    ring, buffers, copy_stream = make_ring(9, 4, slots)
    reads = []
    call(sim, ring, buffers, copy_stream, reads)        # warm-up
    sim.run(count=sim.rng.randrange(8))
    graph = capture(sim, ring, buffers, copy_stream, reads, whole_call)
    expected = 9 if whole_call else 18      # the warm-up's reads, the recording run's
    for n in range(8):
        sim.run(count=sim.rng.randrange(12))
        if sim.rng.random() < 0.5:      # eager
            call(sim, ring, buffers, copy_stream, reads)
            expected += 9
            continue
        if whole_call:
            sim.replay(graph)
        else:
            ring.begin_call(fill=True, changed=unchanged)
            sim.replay(graph)
            ring.end_call(versions=lambda layer: None)
        expected += 9
    sim.run()
    assert len(reads) == expected
    wrong = [(layer, held) for layer, held in reads if held != {layer}]
    assert not wrong, wrong
