"""``host_compute="auto"`` checks its rule against the clock: at each call size, the calls
take turns with the rule's split, the host alone and streaming, and the faster stays.

The rule (:func:`.split.device_picks`) weighs rates measured apart from the model: the
link's, the host's reads and arithmetic, a round trip.  A decode step has costs those do
not see: a layer's host job waits for that layer's attention and the next layer waits for
the job, the Python thread's launches, the job's wake-up.  On the H200 machine the rule's
split at batch 1 took 20.97 ms a token against 18.51 streamed (8 layers of Qwen3-30B-A3B),
while at batch 8 it took 58.23 against 89.98.  So the rule proposes and the calls decide::

    call:    1      2      3      4      5      6      7      8      9     10 ...
    plan:    rule   rule   rule   host   host   host   stream stream stream best
    timed:   -      yes    yes    -      yes    yes    -      yes    yes

A call is timed on the device, from an event at its entry to one at its end: the time the
device spent on it, waits for the host's jobs and for the Python thread's launches included.
The events are read once done, never waited for. Each plan runs for ``SAMPLES`` timed calls
in a row after a warm-up call. (A first version changed plan every call; on the H200 machine
its timed decode calls came out about 45 ms longer than the decode steps of the plan once
kept, the same for every plan: a change of plan has a cost of its own, likely the prefetches
and slots set up for the plan before, which the warm-up call now takes. Its ranking matched
the rows measured apart.) The plan with the smaller median wins for that size of call, for
good (a new size of call has a trial of its own). Plans that are the same (the rule says
stream, or host alone) are tried once. Under a CUDA graph capture nothing is timed. Only
plans the rule predicts at most ``TRY_WITHIN`` times slower than its own are tried: a
prompt is never tried on the host alone.
A plan is a call's, named by the rule's ``m`` for its first routed layer: ``0`` and ``k``
hold for every layer, any other value lets each layer take its own rule's ``m`` (the layers
of one model predict alike). At most ``MAX_SIZES`` call sizes get a trial; past them a new
size runs the rule's plan.
"""
from __future__ import annotations

import logging
import statistics

import torch

log = logging.getLogger("fx_offload")

SAMPLES = 2         # timed calls of each plan after its warm-up
# call sizes tried at most: beyond, a new size runs the rule's plan untimed (a server's
# prompts of every length would otherwise keep a trial each)
MAX_SIZES = 64
# the host alone and streaming are tried against the rule's plan where the rule predicts them
# at most this much slower (a prompt on the host alone is not tried)
TRY_WITHIN = 2.0


class Trial:
    """The calls of one size: which plan the next one runs (each plan's calls in a row),
    and the winner once known.
    Plans are ``m`` values (each token's picks computed on the device; ``k``: stream)."""

    def __init__(self, plans: list[int]):
        self.plans = list(dict.fromkeys(plans))     # in order, once each
        self.times: dict[int, list[float]] = {m: [] for m in self.plans}
        self.seen: dict[int, int] = {m: 0 for m in self.plans}
        self.best: int | None = self.plans[0] if len(self.plans) == 1 else None

    def next_plan(self) -> int:
        """The plan of the coming call."""
        if self.best is not None:
            return self.best
        # each plan in a block of calls, until its timed calls are in (they are read a
        # call or two late: the block runs on meanwhile, and a call left untimed is
        # made up for)
        return next(m for m in self.plans if len(self.times[m]) < SAMPLES)

    def timed(self, plan: int, seconds: float) -> bool:
        """A call of ``plan`` took ``seconds`` on the device; True once this settles it."""
        if self.best is not None or plan not in self.times:
            return False
        self.seen[plan] += 1
        if self.seen[plan] == 1:         # its warm-up
            return False
        if len(self.times[plan]) < SAMPLES:
            self.times[plan].append(seconds)
        if all(len(t) >= SAMPLES for t in self.times.values()):
            self.best = min(self.plans, key=lambda m: statistics.median(self.times[m]))
            return True
        return False

    def medians(self) -> dict[int, float]:
        return {m: statistics.median(t) for m, t in self.times.items() if t}


def describe(plan: int, k: int) -> str:
    return "streamed" if plan == k else "on the host" if plan == 0 else f"split {plan}"


class CallTimer:
    """Trials per call size, and the events of the calls still on the device."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.trials: dict[tuple[int, int], Trial] = {}     # (tokens, k) -> its trial
        # (trial, plan, start event, k, tokens[, end event]) of the call in progress, and of
        # the calls ended but not yet read
        self._start = None
        self._pending: list = []

    def begin(self, tokens: int, k: int, rule: int, seconds, stream) -> int:
        """A call of ``tokens`` tokens begins: its plan, and an event at its entry while
        its size is on trial.  ``rule``: the rule's plan; ``seconds``: the rule's
        predictions for it, the host alone and streaming; the other two are tried where
        predicted at most ``TRY_WITHIN`` times slower."""
        self._read_done()
        trial = self.trials.get((tokens, k))
        if trial is None and len(self.trials) >= MAX_SIZES:
            self._start = None
            return rule
        if trial is None:
            plans = [rule] + [p for p, t in zip((0, k), seconds[1:])
                              if t <= TRY_WITHIN * seconds[0]]
            trial = self.trials[(tokens, k)] = Trial(plans)
        plan = trial.next_plan()
        self._start = None
        if trial.best is None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._start = (trial, plan, start, k, tokens)
        return plan

    def discard(self) -> None:
        """The call in progress is not timed (it did not run the plan it was given)."""
        self._start = None

    def end(self, stream) -> None:
        """The call ends: an event at its end."""
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((*self._start, end))
        self._start = None

    def _read_done(self) -> None:
        still = []
        for trial, plan, start, k, tokens, end in self._pending:
            if not end.query():
                still.append((trial, plan, start, k, tokens, end))
                continue
            if trial.timed(plan, start.elapsed_time(end) / 1e3):
                log.info("fx_offload: %s: host_compute='auto' at %d token(s) a call: %s; "
                         "keeps %s", self.model_name, tokens, self.describe(tokens, k),
                         describe(trial.best, k))
        self._pending = still

    def summary(self) -> dict[int, str]:
        """Call size (tokens) -> its plans' medians and the plan kept, in words."""
        out = {}
        for (tokens, k), trial in sorted(self.trials.items()):
            if len(trial.plans) == 1:       # nothing else in reach: not timed
                out[tokens] = (f"{describe(trial.best, k)}, the rule's plan (the others "
                               f"predicted over {TRY_WITHIN:g}x as slow: not tried)")
                continue
            kept = (f": keeps {describe(trial.best, k)}" if trial.best is not None
                    else ": still trying")
            out[tokens] = self.describe(tokens, k) + kept
        return out

    def describe(self, tokens: int, k: int) -> str:
        trial = self.trials.get((tokens, k))
        if trial is None:
            return "not tried"
        times = ", ".join(f"{describe(m, k)} {t * 1e3:.2f} ms" for m, t in
                          trial.medians().items())
        return times or "not timed yet"
