"""``host_compute="auto"`` checks its rule against the clock: at each call size, the calls
take turns with the rule's split, the host alone and streaming, and the faster stays.

The rule (:func:`.split.device_picks`) weighs rates measured apart from the model: the
link's, the host's reads and arithmetic, a round trip.  A decode step has costs those do
not see: a layer's host job waits for that layer's attention and the next layer waits for
the job, the Python thread's launches, the job's wake-up (on the H200 machine the rule's
split lost to streaming at batch 1 and won at batch 8: docs/host_compute.md).  So the rule
proposes and the calls decide, in ``ROUNDS`` rounds of blocks, a block being one plan's
warm-up call and its timed call, after ``SETTLE`` calls of the rule's plan::

    call:    1-4    5      6      7      8      9      10     11 ... 22     23 ...
    plan:    rule   rule   rule   host   host   stream stream rule ... stream best
    timed:   -      -      yes    -      yes    -      yes    -   ... yes

A call is timed on the device, from an event at its entry to one at its end: the time the
device spent on it, waits for the host's jobs and for the Python thread's launches included.
The events are read once done, never waited for (a block runs on until its timed call is
read; the calls past it are not counted). The plan whose fastest timed call was fastest
wins for that size of call, for good (a new size of call has a trial of its own).

Why settle first: a size's first calls run beside one-time work (the next size's compile,
the host jobs' first thread team, staging grown), which can slow both blocks of a plan and
keep a slower one (docs/host_compute.md, "The trial settles first").  Why blocks: a change
of plan has a cost of its own (the prefetches and slots set up for the plan before), which
the warm-up call takes.  Why rounds and the fastest call: with one block each, the plan
tried first timed slowest by far, even with calls that compiled left out; later blocks of
each plan, after the others, give every plan calls clear of that, and noise only ever
slows a call.  Plans that are the same (the rule says stream, or host alone) are tried
once. Under a CUDA graph capture nothing is timed. Only plans the
rule predicts at most ``TRY_WITHIN`` times slower than its own are tried: a prompt is never
tried on the host alone.  A plan is a call's, named by the rule's ``m`` for its first routed
layer: ``0`` and ``k`` hold for every layer, any other value lets each layer take its own
rule's ``m`` (the layers of one model predict alike). At most ``MAX_SIZES`` call sizes get
a trial; past them a new size runs the rule's plan.

A call during which Dynamo compiled a graph is not timed: the device waits for the compile
(seconds), which says nothing of the plan (under ``dynamic=True`` the second decode step
compiles again).
"""
from __future__ import annotations

import logging

import torch
from torch._dynamo.utils import counters

log = logging.getLogger("fx_offload")

ROUNDS = 3          # blocks of each plan (a warm-up call, then a timed one), plan after plan
SETTLE = 4          # calls of a size that run the rule's plan untimed before its blocks begin
# call sizes tried at most: beyond, a new size runs the rule's plan untimed (a server's
# prompts of every length would otherwise keep a trial each)
MAX_SIZES = 64
# the host alone and streaming are tried against the rule's plan where the rule predicts them
# at most this much slower (a prompt on the host alone is not tried)
TRY_WITHIN = 2.0


class Trial:
    """The calls of one size: which plan the next one runs (in blocks, see the module's
    docstring), and the winner once known.
    Plans are ``m`` values (each token's picks computed on the device; ``k``: stream)."""

    def __init__(self, plans: list[int], unit: str = "picks"):
        self.plans = list(dict.fromkeys(plans))     # in order, once each
        self.unit = unit            # what a plan counts: "picks" (experts) or "MLPs" streamed
        self.times: dict[int, list[float]] = {m: [] for m in self.plans}
        self.best: int | None = self.plans[0] if len(self.plans) == 1 else None
        self.round = 1          # timed calls each plan has once this round is done
        self.block = 0          # the block in progress (numbered from 1), its plan, and how
        self._block_plan: int | None = None     # many of its calls were read so far
        self._read = 0
        self.settling = SETTLE  # calls still to run the rule's plan before the first block

    def next_plan(self) -> tuple[int, int]:
        """The plan of the coming call, and the block it belongs to (-1 once settled)."""
        if self.best is not None:
            return self.best, -1
        if self.settling:       # block 0: no block, not timed
            self.settling -= 1
            return self.plans[0], 0
        plan = next(m for m in self.plans if len(self.times[m]) < self.round)
        if plan != self._block_plan:
            self._block_plan, self.block, self._read = plan, self.block + 1, 0
        return plan, self.block

    def timed(self, plan: int, block: int, seconds: float) -> bool:
        """A call of ``plan`` begun in ``block`` took ``seconds`` on the device; True once
        this settles the trial."""
        if self.best is not None or block <= 0 or block != self.block \
                or plan != self._block_plan:
            return False                # a call of a block already done
        self._read += 1
        if self._read != 2:             # the block's warm-up, or a call past its timed one
            return False                # (read in the same pass as it: not a new block's)
        self.times[plan].append(seconds)
        if any(len(t) < self.round for t in self.times.values()):
            return False
        if self.round < ROUNDS:
            self.round += 1
            return False
        self.best = min(self.plans, key=lambda m: min(self.times[m]))
        return True

    def fastest(self) -> dict[int, float]:
        """Each plan's fastest timed call so far, in seconds."""
        return {m: min(t) for m, t in self.times.items() if t}


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (reset with Dynamo: compared, not
    subtracted)."""
    return counters["stats"]["unique_graphs"]


def describe(plan: int, k: int, unit: str = "picks") -> str:
    """A plan in words: ``split m`` (each token's first ``m`` picks on the device), or for
    dense MLPs ``m of K MLPs streamed``."""
    if plan == k:
        return "streamed"
    if plan == 0:
        return "on the host"
    return f"split {plan}" if unit == "picks" else f"{plan} of {k} {unit} streamed"


class CallTimer:
    """Trials per call size, and the events of the calls still on the device."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.trials: dict[tuple[int, int], Trial] = {}     # (tokens, k) -> its trial
        # (trial, plan, block, start event, k, tokens[, end event]) of the call in progress,
        # and of the calls ended but not yet read; the graphs compiled when the call began
        self._start = None
        self._compiled = 0
        self._pending: list = []

    def begin(self, tokens: int, k: int, rule: int, seconds, stream, near=(),
              unit: str = "picks") -> int:
        """A call of ``tokens`` tokens begins: its plan, and an event at its entry while
        its size is on trial.  ``rule``: the rule's plan; ``seconds``: the rule's
        predictions for it, the host alone and streaming; the other two are tried where
        predicted at most ``TRY_WITHIN`` times slower; ``near``: plans tried besides."""
        self._read_done()
        trial = self.trials.get((tokens, k))
        if trial is None and len(self.trials) >= MAX_SIZES:
            self._start = None
            return rule
        if trial is None:
            plans = [rule, *near] + [p for p, t in zip((0, k), seconds[1:])
                                     if t <= TRY_WITHIN * seconds[0]]
            trial = self.trials[(tokens, k)] = Trial(plans, unit)
        plan, block = trial.next_plan()
        self._start = None
        if trial.best is None and block > 0:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._start = (trial, plan, block, start, k, tokens)
            self._compiled = graphs_compiled()
        return plan

    def discard(self) -> None:
        """The call in progress is not timed (it did not run the plan it was given)."""
        self._start = None

    def end(self, stream) -> None:
        """The call ends: an event at its end (none where a graph was compiled during it)."""
        if self._start is None:
            return
        if graphs_compiled() != self._compiled:
            self._start = None
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((*self._start, end))
        self._start = None

    def _read_done(self) -> None:
        still = []
        for call in self._pending:
            trial, plan, block, start, k, tokens, end = call
            if not end.query():
                still.append(call)
                continue
            if trial.timed(plan, block, start.elapsed_time(end) / 1e3):
                log.info("fx_offload: %s: host_compute='auto' at %d token(s) a call: %s; "
                         "keeps %s", self.model_name, tokens, self.describe(tokens, k),
                         describe(trial.best, k, trial.unit))
        self._pending = still

    def summary(self) -> dict[int, str]:
        """Call size (tokens) -> its plans' fastest timed calls and the plan kept, in words."""
        out = {}
        for (tokens, k), trial in sorted(self.trials.items()):
            if len(trial.plans) == 1:       # nothing else in reach: not timed
                out[tokens] = (f"{describe(trial.best, k, trial.unit)}, the rule's plan (the "
                               f"others predicted over {TRY_WITHIN:g}x as slow: not tried)")
                continue
            kept = (f": keeps {describe(trial.best, k, trial.unit)}" if trial.best is not None
                    else ": still trying")
            out[tokens] = self.describe(tokens, k) + kept
        return out

    def describe(self, tokens: int, k: int) -> str:
        trial = self.trials.get((tokens, k))
        if trial is None:
            return "not tried"
        times = ", ".join(f"{describe(m, k, trial.unit)} {t * 1e3:.2f} ms" for m, t in
                          trial.fastest().items())
        return times or "not timed yet"


class FixedPlan:
    """A stand-in for a model's :class:`CallTimer` that gives every call of ``tokens``
    tokens ``plan`` and times nothing (other sizes: the rule's plan): the ``generate``
    benchmark's ``--host-plans`` forces each plan in turn with it, in one process."""

    def __init__(self, plan: int, tokens: int = 1):
        self.plan, self.tokens = plan, tokens
        self._seen = None       # (k, unit) of the latest call of that size

    def begin(self, tokens: int, k: int, rule: int, seconds, stream, near=(),
              unit: str = "picks") -> int:
        if tokens != self.tokens:
            return rule
        self._seen = (k, unit)
        return min(self.plan, k)

    def end(self, stream) -> None:
        pass

    def discard(self) -> None:
        pass

    def summary(self) -> dict[int, str]:
        if self._seen is None:
            return {}
        k, unit = self._seen
        return {self.tokens: f"{describe(min(self.plan, k), k, unit)}, forced"}
