"""The ``host_experts`` op at run time (option ``host_compute``): a routed MoE layer's
experts computed on the host from their weights' host block, or streamed, call by call.

:class:`HostExperts` holds one model's ops: where each layer's experts ran, the staging
buffers, what the latest call read on the host and ``"auto"``'s plan for the call
(:func:`~fx_offload.host_compute.split.device_picks`, checked against the clock by
:mod:`~fx_offload.host_compute.trial`).  On a CUDA device, for transformers' fused experts
layout, :class:`_StreamJobs` queues each host job on a stream of its own and the caller
never waits::

    compute stream: x, ids, gates -> fp32/int64 buffers of ours        -> event
    job stream:     (waits the event) -> page-locked staging copies
                    host function (cuLaunchHostFunc): the C kernel on the staging and the
                    host block; y (fp32) -> the device                 -> event
    compute stream: the device's share of the picks, if any (split.py)
                    (waits the event) y + that share -> x's dtype

Under CUDA graphs (``mode="reduce-overhead"``) the same pattern is recorded: the host
function becomes a host node of the graph, and every replay runs the job with no Python
between the layers.  A recorded job takes buffers, job arguments and a record of its own
(:class:`_Fixed`), made at an earlier call of the same size outside the capture (the
warm-up every CUDA graph runs first), for its graph's replays to find in place.  What
``"auto"`` records for the call's size (:meth:`HostExperts.recorded_plan`): the host alone,
a split (the device's share gathered on the compute stream while the host job runs) where
the rule finds it clearly faster than both, or streaming.

Elsewhere (a CPU device, another layout, no C compiler) :meth:`HostExperts.on_host` stages,
waits for the stream once, computes and copies back.  A call predicted to run on the host
skips its expert chunks' prefetches (:meth:`HostExperts.skips`).

Why the stream, the reused staging, the plain path, what streaming does, the rule and the
trial: docs/host_compute.md, "Routed experts on the host", "Split between the device and
the host (``"auto"``)" and "The rule checked against the clock".
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref

import torch
import torch.nn.functional as F

from ...errors import OffloadError
from ...host_compute import kernels
from ...host_compute.kernels import job_threads
from ...host_compute import native
from ...host_compute import split
from ...host_compute.rates import host_rates
from ...host_compute.trial import CallTimer
from ..memory.streams import capturing
from ..phase import Phase
from .host_mlps import HostMlps
from .host_weights import HostWeights, laid_out_as

log = logging.getLogger("fx_offload")



def for_state(state) -> "HostExperts | None":
    """The runtime of ``state``'s ``host_experts`` ops (None under host_compute="never"),
    made as its memory is (``placement.activate``)."""
    mode = state.choice.options.host_compute
    return None if mode == "never" else HostExperts(state, mode)


class _Fixed:
    """A job a CUDA graph records: its buffers, arguments and record, made outside the
    capture and never grown or reused by another call, since every replay of the graph runs
    the job on these addresses (they live as long as the model's offload state, as the slot
    buffers the graph's copies use do)."""

    def __init__(self, sizes: dict):
        self.buffers = {name: torch.empty(max(numel, 1), dtype=dtype, pin_memory=pinned)
                        for name, (numel, dtype, pinned) in sizes.items()}
        self.job = native.ExpertsJob()
        self.record = native.JobRecord()

    def buffer(self, name: str, numel: int, dtype: torch.dtype, stream=None,
               pinned: bool = True) -> torch.Tensor:
        return self.buffers[name][:numel]


class _StreamJobs:
    """What the host functions a stream runs need: page-locked staging and scratch (grown
    as calls grow), a ring of job arguments, a counter of the experts each layer read; and
    the jobs CUDA graphs record (:class:`_Fixed`)."""

    RING = 64       # jobs in flight before one is written again (it waits if not done)
    # token picks (tokens x top-k) up to which a call outside a capture makes the buffers a
    # capture of its size takes (decode steps of up to 8 tokens at top-8: 90 KB a layer at
    # Qwen3-30B-A3B's shapes)
    FIXED_PAIRS = 64

    def __init__(self, lib, threads: int):
        self.lib = lib
        self.threads = threads      # read once, at the model's first call on the host
        self.ring = native.JobRing(native.ExpertsJob, self.RING)
        self.buffers: dict[str, torch.Tensor] = {}
        self.records: dict[int, native.JobRecord] = {}   # layer -> its latest job's record
        # the jobs' stream, and the events between it and the compute stream
        self.stream = self.entered = self.left = None
        self.launched = 0           # the host's monotonic clock (ns) at the latest launch
        self.fixed: dict[tuple, _Fixed] = {}    # (layer, tokens, k) -> what a graph records

    def buffer(self, name: str, numel: int, dtype: torch.dtype, stream,
               pinned: bool = True) -> torch.Tensor:
        """Host buffer ``name``'s first ``numel`` elements (staging page-locked, so that
        copies of it run asynchronously, the kernel's scratch not)."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:         # a queued job may still read the smaller one
                torch.cuda.synchronize(stream.device)
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=pinned)
            self.buffers[name] = buf
        return buf[:numel]

    def pending(self) -> bool:
        """A job queued on a stream has not finished."""
        return self.ring.pending()

    def __del__(self):
        # a queued job reads this object's buffers and arguments: never free them under it
        try:
            if self.pending() or self.fixed:
                torch.cuda.synchronize()
        except Exception:       # (interpreter shutdown: CUDA may be gone already)
            pass

    @staticmethod
    def _sizes(entry, x, ids) -> dict:
        """Name -> (elements, dtype, page-locked) of every host buffer a job uses."""
        (T, H), k = x.shape, ids.shape[1]
        floats, ints = native.scratch_sizes(T * k, H, entry.down.shape[-1], entry.experts)
        f32, i64 = torch.float32, torch.int64
        return {"x": (T * H, f32, True), "ids": (T * k, i64, True), "gates": (T * k, f32, True),
                "y": (T * H, f32, True), "floats": (floats, f32, False),
                "ints": (ints, i64, False)}

    def run(self, entry, layer: int, x, ids, gates, device_part=None, fix: bool = False):
        """Queue ``layer``'s host job for ``x``, ``ids``, ``gates`` on a stream of its own and
        return (its result on the compute stream, plus ``device_part()`` (an fp32 (T, H)
        the compute stream makes meanwhile; :mod:`~fx_offload.host_compute.split`), the
        job's record).  Inside a capture the job is the :class:`_Fixed` of its layer and
        size (the caller checked it is there); ``fix``: a call outside a capture makes what
        a capture of its size would record, if not made yet."""
        main = torch.cuda.current_stream(x.device)
        side = self._side(x.device)
        (T, H), k = x.shape, ids.shape[1]
        gate_up, down = entry.gate_up, entry.down
        sizes = self._sizes(entry, x, ids)
        fixed = self.fixed[(layer, T, k)] if capturing() else None
        if fix and fixed is None and T * k <= self.FIXED_PAIRS and \
                (layer, T, k) not in self.fixed:
            self.fixed[(layer, T, k)] = _Fixed(sizes)
        buffer = self.buffer if fixed is None else fixed.buffer
        # converted on the compute stream into temporaries the side stream is recorded to
        # use (the caching allocator hands them to no one else before it is done).  None
        # is kept: a device buffer made in a warm-up under CUDA graphs would be a live
        # block of their pool that no graph output owns, which they refuse.
        ready = []
        for name, t, dtype in (("x", x, torch.float32), ("ids", ids, torch.int64),
                               ("gates", gates, torch.float32)):
            there = torch.empty(t.shape, dtype=dtype, device=x.device).copy_(t)
            there.record_stream(side)
            ready.append((name, there))
        y_there = torch.empty(T, H, dtype=torch.float32, device=x.device)
        y_there.record_stream(side)
        self.entered.record(main)
        with torch.cuda.stream(side):
            side.wait_event(self.entered)
            staged = []
            for name, there in ready:
                view = buffer(name, there.numel(), there.dtype, side).view(there.shape)
                view.copy_(there, non_blocking=True)
                staged.append(view)
            y = buffer("y", T * H, torch.float32, side).view(T, H)
            if fixed is None:
                record = self.records.setdefault(layer, native.JobRecord())
                job = self.ring.take(side)
            else:
                record, job = fixed.record, fixed.job
            native.fill_job(job, gate_up, down, "silu", *staged,
                            buffer("floats", sizes["floats"][0], torch.float32, side, False),
                            buffer("ints", sizes["ints"][0], torch.int64, side, False), y,
                            record, self.threads)
            native.launch_host_function(self.lib, side.cuda_stream, job)
            self.launched = time.monotonic_ns()     # the clock the jobs note
            y_there.copy_(y, non_blocking=True)
            self.left.record(side)
        mine = device_part() if device_part is not None else None
        main.wait_event(self.left)
        total = y_there if mine is None else mine.add_(y_there)
        return torch.empty_like(x).copy_(total), record

    def _side(self, device) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
            self.entered, self.left = torch.cuda.Event(), torch.cuda.Event()
        return self.stream


class HostExperts:
    """The ``host_experts`` ops of one model: where each layer's experts run, the staging
    buffers, and what the latest call read on the host."""

    def __init__(self, state, mode: str):
        self._state = weakref.proxy(state)     # the OffloadState that holds this object
        self.mode = mode            # "always" or "auto" (the placement's host_compute)
        self._layers: dict[int, HostWeights] = {}
        self._staging: dict[tuple, torch.Tensor] = {}
        self._rates = None          # HostRates, measured (or read) at the first need
        self._k = None              # top-k of the latest call's routers
        self.on_host_now = mode == "always"     # this call's prediction, for the prefetches
        self.ran: dict[int, str] = {}   # layer -> "host", "device", "split <m>", latest call
        self._read = 0              # host memory the latest call's kernels read (waited)
        # its queued jobs: (job record, bytes an expert, the Python thread's monotonic clock
        # (ns) as it began queueing the job and once it had launched it)
        self._queued_reads: list = []
        self._jobs = None           # _StreamJobs, made at the first queued call
        self._predictions: dict[tuple, tuple] = {}    # (layer, tokens, k) -> _predicted's
        # "auto": the rule's choice timed against the host alone and streaming, per call
        # size; the plan of the call in progress (k: stream, 0: host, else the rule's)
        self.timer = CallTimer(state.model_name) if mode == "auto" else None
        self._call = None           # (tokens, plan) of the call in progress
        self._tokens = None         # the call in progress's tokens, as its entry saw them
        self._began = 0             # the host's monotonic clock (ns) as it began
        # jobs recorded into CUDA graphs: call tokens -> layer -> (its record, bytes an
        # expert, the picks a token the device took: 0 or a split's m); a replay runs no
        # Python, so what its jobs read is read from their records
        self.recorded: dict[int, dict[int, tuple]] = {}
        self.mlps = HostMlps(self)  # the dense MLPs' host_mlp ops

    def refuse_capture(self) -> None:
        """Under "always", a call inside a CUDA graph capture is refused: at the call's
        entry, before anything is enqueued (a capture left with forked copies would end
        with CUDA's own error instead of this one), and again at the op."""
        if self.mode == "always" and capturing():
            raise OffloadError(
                "host_compute='always' computes the experts on the host, which a CUDA graph "
                "capture cannot record: capture with host_compute='auto' (it streams the "
                "experts in a capture)", where="fx_offload.host_experts")

    def begin_call(self, tokens: int | None) -> None:
        """A call of ``tokens`` tokens begins: predict whether its layers compute on the
        host (their prefetches then copy nothing), and count anew."""
        self.ran, self._read, self._queued_reads = {}, 0, []
        self.call_tokens(tokens)
        # one plan a call is timed: the experts' where a layer has them on the host (its
        # dense MLPs, if any, then follow the rule untimed)
        experts = any(why == "host" and layer not in self._state.choice.mlps
                      for layer, why in self._state.learned.hosting.items())
        self._call = self.mlps.begin_call(tokens, timed=not experts)
        if self.mlps.hosted and not experts:
            return
        if self.mode == "auto" and tokens and self._k and self._layers:
            layer, entry = next(iter(self._layers.items()))
            plan, *seconds = self._predicted(entry, layer, tokens, self._k)
            if self._state.hook_copies.under_cuda_graphs:
                plan = self._graphed(entry, layer, tokens, self._k)
            device = self._state.device
            # (under CUDA graphs a call may be a replay, which runs what was recorded: the
            # rule decides, untimed)
            if device.type == "cuda" and not capturing() and \
                    not self._state.hook_copies.under_cuda_graphs:
                plan = self.timer.begin(tokens, self._k, plan, seconds,
                                        torch.cuda.current_stream(device))
                self._call = (tokens, plan)
            self.on_host_now = plan < self._k

    def call_tokens(self, tokens: int | None) -> None:
        """The call in progress has ``tokens`` tokens (also said by a call whose capture
        takes it in whole, which begins nothing else), and began now: a recorded job that
        a replay ran in it started since."""
        self._tokens, self._began = tokens, time.monotonic_ns()

    def end_call(self, completed: bool) -> None:
        """The model's call ends (outside a capture): the timed call's end event; a call
        that raised is not timed (its time is no plan's)."""
        if self._call is not None:
            if completed:
                self.timer.end(torch.cuda.current_stream(self._state.device))
            else:
                self.timer.discard()
            self._call = None

    def synchronize(self) -> None:
        """Wait for the host jobs queued on the streams: they read the host blocks (the
        state's ``synchronize``, before the masters change or are freed)."""
        # (a CUDA graph's replay runs recorded jobs no ring entry tracks)
        if self._jobs is not None and (self._jobs.pending() or self.recorded):
            torch.cuda.synchronize(self._state.device)

    @property
    def read_bytes(self) -> int:
        """Host memory the latest call's kernels read; waits for its queued jobs.  A replay
        of a CUDA graph: what its recorded jobs read (their records)."""
        self.synchronize()
        replayed = sum(r[0] * b for r, b, _ in self._replayed().values())
        return self._read + sum(r[0] * b for r, b, _, _ in self._queued_reads) + replayed

    def _replayed(self) -> dict[int, tuple]:
        """The jobs recorded into CUDA graphs that a replay ran in the latest call: layer ->
        (record, bytes an expert, the device's picks a token), those of the call's size
        whose records say they started since the call began (another graph of that size
        may have streamed a layer).  Waits for the device."""
        recorded = self.recorded.get(self._tokens, {})
        if recorded:
            torch.cuda.synchronize(self._state.device)
        return {layer: held for layer, held in recorded.items()
                if layer not in self.ran and held[0][1] >= self._began}

    @property
    def jobs_timed(self) -> tuple[int, int, float, float, float | None,
                                  float | None] | None:
        """The latest call's host jobs, queued on the stream or replayed from a CUDA graph:
        (how many, bytes they read, seconds they ran, seconds from the first one's start
        to the last one's end, the median seconds the Python thread took to launch one, the
        median seconds from its launch to its start), None where none ran; waits for them.
        They run one after another on one stream, so the span less the time they ran is
        the time the host's cores waited between them; a job that begins as soon as it is
        launched waited for the Python thread (both clocks are the host's monotonic clock).
        A replay launches its jobs without Python: the last two are None where every job
        was replayed."""
        self.synchronize()
        done = [(r[0] * size, r[1], r[2], began, queued)
                for r, size, began, queued in self._queued_reads if r[2] >= r[1] > 0]
        done += [(r[0] * size, r[1], r[2], None, None)
                 for r, size, _ in self._replayed().values() if r[2] >= r[1] > 0]
        if not done:
            return None
        launched = [(g, q, b) for _, b, _, g, q in done if g is not None]
        return (len(done), sum(n for n, *_ in done),
                sum(e - b for _, b, e, _, _ in done) / 1e9,
                (max(e for _, _, e, _, _ in done) - min(b for _, b, _, _, _ in done)) / 1e9,
                statistics.median(q - g for g, q, _ in launched) / 1e9 if launched else None,
                statistics.median(b - q for _, q, b in launched) / 1e9 if launched else None)

    def skips(self, layer: int, chunk) -> bool:
        """The prefetch of ``layer``'s ``chunk`` copies nothing: its experts, or its dense
        MLP, are predicted to run on the host in this call."""
        learned = self._state.learned
        if learned.hosting.get(layer) != "host":
            return False
        names = self._state.choice.mlps.get(layer)
        if names is not None:
            return self.mlps.skips(layer, chunk, names)
        on_host = self.on_host_now
        if capturing() and self.mode == "auto":     # what the capture of its op records
            on_host = self._k is not None and \
                self.recorded_plan(layer, self._tokens, self._k) < self._k
        return on_host and learned.routing.get(layer, {}).get(chunk.index) == "routed"

    def recorded_plan(self, layer: int, tokens: int | None, k: int) -> int:
        """Inside a capture under ``"auto"``: how many of each token's ``k`` picks the
        device takes in what the capture records for ``layer`` at this call size; below
        ``k``, a host job (a host node of the graph) computes the rest.  So the plan of
        :meth:`_graphed` where a call of this size outside the capture made the job's
        buffers (:class:`_Fixed`), else ``k`` (streamed).  The expert cache takes no
        picks of a recorded layer: the host computes every pick the plan leaves it.  (Only
        the queued path on a CUDA device makes those buffers, so their presence says the
        kernel can be queued.)"""
        entry, jobs = self._layers.get(layer), self._jobs
        if not tokens or entry is None or jobs is None or (layer, tokens, k) not in jobs.fixed:
            return k
        return self._graphed(entry, layer, tokens, k)

    # Under CUDA graphs a split is recorded only for calls of several tokens, where the
    # rule predicts it at most this share of the better of the host alone and streaming:
    # no trial times a replay, and the rule has predicted one-token splits much faster
    # than they ran (docs/host_compute.md, "Under CUDA graphs").
    GRAPH_SPLIT_SHARE = 0.85

    def _graphed(self, entry: HostWeights, layer: int, tokens: int, k: int) -> int:
        """``"auto"``'s plan under CUDA graphs: the rule's split ``m`` where the call has
        several tokens and the rule predicts it clearly faster (:attr:`GRAPH_SPLIT_SHARE`),
        else 0 (the host alone) or ``k`` (streamed), whichever it predicts faster.  A size
        a capture cannot record as a host job (more token picks than
        :attr:`_StreamJobs.FIXED_PAIRS`, a layout the queued kernel does not take, no C
        compiler) streams, as its capture does, so that the prefetches the hooks begin
        match what the graph recorded."""
        if tokens * k > _StreamJobs.FIXED_PAIRS or not entry.queueable or \
                native.library() is None:
            return k
        m, split_seconds, host, streamed = self._predicted(entry, layer, tokens, k)
        if 0 < m < k and tokens > 1 and \
                split_seconds <= self.GRAPH_SPLIT_SHARE * min(host, streamed):
            return m
        return 0 if host < streamed else k

    @property
    def state(self):
        """The OffloadState this runtime belongs to."""
        return self._state

    def rates(self):
        """The host's rates (:mod:`~fx_offload.host_compute.rates`), read at the first need."""
        if self._rates is None:
            self._rates = host_rates(self._state.device)
        return self._rates

    def discard_timing(self) -> None:
        """The call in progress is not timed (an op saw another size of call than its
        entry did)."""
        if self._call is not None:
            self.timer.discard()
            self._call = None

    def queue(self, entry: HostWeights, layer: int, x, ids, gates,
              device_part=None, fix: bool = False, m: int = 0) -> torch.Tensor:
        """``layer``'s host job queued on a stream (:class:`_StreamJobs`), its read counted;
        ``fix``: see :meth:`_StreamJobs.run`; ``m``: the picks a token the device takes
        (``device_part``), noted for the report of a capture's replays."""
        if self._jobs is None:
            self._jobs = _StreamJobs(native.library(), job_threads())
        began = time.monotonic_ns()     # the clock the jobs note (CLOCK_MONOTONIC)
        out, record = self._jobs.run(entry, layer, x, ids, gates, device_part, fix)
        if capturing():     # its replays run no Python: their reads come from the record
            self.recorded.setdefault(x.shape[0], {})[layer] = (record, entry.expert_bytes, m)
        else:
            self._queued_reads.append((record, entry.expert_bytes, began,
                                       self._jobs.launched))
        return out

    def run_mlp(self, layer: int, chunks, x: torch.Tensor) -> torch.Tensor:
        """The ``host_mlp`` op's kernel (:meth:`.host_mlps.HostMlps.run`)."""
        return self.mlps.run(layer, chunks, x)

    def run(self, layer: int, chunks, x: torch.Tensor, ids: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
        """The op's kernel: ``layer``'s experts on ``x``, here or there."""
        state = self._state
        entry = self._layer(layer, chunks)
        tokens, k = x.shape[0], ids.shape[-1] if ids.dim() else 1
        self._k = k
        if state.phase is Phase.RESTORED:
            return laid_out_as(x, entry.module(x, ids, gates))
        if capturing() and self.mode == "auto":
            m = self.recorded_plan(layer, tokens, k)
        else:
            m = self._plan(entry, layer, tokens, k)
        host = m < k
        if host:
            self.refuse_capture()
        if not host:
            for chunk in chunks:
                state.wait_routed(layer, chunk, ids)
            self.ran[layer] = "device"
            return laid_out_as(x, entry.module(x, ids, gates))
        self.ran[layer] = "host"
        if x.device.type == "cuda" and entry.queueable and x.dim() == 2 and ids.dim() == 2:
            if native.library() is not None:
                return self._queued(entry, layer, chunks, x, ids, gates, m)
        return self.on_host(entry, x, ids, gates)

    def _queued(self, entry: HostWeights, layer: int, chunks, x, ids, gates,
                m: int) -> torch.Tensor:
        """The host job queued on a stream; where ``m`` (``"auto"``'s rule) or the expert
        cache give the device picks of its own, they split (:mod:`~fx_offload.host_compute.
        split`), which needs the routed gather.  A capture records the plan's ``m`` alone:
        the expert cache takes no picks there (it learns nothing from a replay), the host
        computes every pick the plan leaves it."""
        # under CUDA graphs (where "auto" plans with _graphed) a call on the host makes
        # what its size's capture will record (recorded_plan)
        fix = self.mode == "auto" and self._state.hook_copies.under_cuda_graphs
        routed = getattr(self._state, "routed", None)
        if routed is None or not routed.usable:
            m, where = 0, None
        else:
            where = None if capturing() else routed.cache_rows(layer)
        if not m and where is None:
            return self.queue(entry, layer, x, ids, gates, fix=fix)
        self.ran[layer] = f"split {m}"
        keep = split.keep_on_device(ids, m, where)
        sentinel = torch.full_like(ids, entry.experts)
        ids_device = torch.where(keep, ids, sentinel)
        ids_host = torch.where(keep, sentinel, ids)
        if where is not None:       # the cache learns from every pick, the host's too
            routed.count_picks(layer, ids_host)

        def device_part() -> torch.Tensor:
            for chunk in chunks:
                self._state.wait_routed(layer, chunk, ids_device)
            module = entry.module
            return split.device_experts(x, ids_device, gates, module.gate_up_proj,
                                        module.down_proj, keep, None if where is not None
                                        else m)
        return self.queue(entry, layer, x, ids_host, gates, device_part, fix=fix, m=m)

    def _plan(self, entry: HostWeights, layer: int, tokens: int, k: int) -> int:
        """How many of each token's ``k`` picks the device computes: the rule's
        (:func:`~fx_offload.host_compute.split.device_picks`), or the timer's plan."""
        if self.mode == "always":
            return 0
        if self._state.hook_copies.under_cuda_graphs:    # what a capture of it records
            return self._graphed(entry, layer, tokens, k)
        if self._call is not None and self._call[0] != tokens:
            # the call's first argument miscounted its tokens: this call is not timed
            self.timer.discard()
            self._call = None
        if self._call is not None and self._call[1] in (0, k):
            return self._call[1]
        return self._predicted(entry, layer, tokens, k)[0]

    def _predicted(self, entry: HostWeights, layer: int, tokens: int, k: int):
        """(the rule's ``m``, the layer's predicted seconds with ``m``, ``0``, ``k``)."""
        key = (layer, tokens, k)
        found = self._predictions.get(key)
        if found is None:
            # the layer's other chunks cross the link meanwhile (attention, norms, router)
            chunks = {c for c, how in self._state.learned.routing.get(layer, {}).items()
                      if how == "routed"}
            others = sum(c.end - c.start for c in self._state.learned.layout[layer]
                         if c.index not in chunks)
            shape = (tokens, k, entry.experts, entry.expert_bytes, entry.element_size,
                     others, self.rates().link_rate, self.rates())
            m = split.device_picks(*shape)
            found = (m, *(split.layer_seconds(p, *shape) for p in (m, 0, k)))
            self._predictions[key] = found
        return found

    def on_host(self, entry: HostWeights, x, ids, gates) -> torch.Tensor:
        """The host computation without the stream (a CPU device, no C kernel, another
        layout): staged, one wait for the stream, computed, copied back."""
        xh, idh, gh = (self._stage(t, i) for i, t in enumerate((x, ids, gates)))
        if x.device.type == "cuda":     # the staging copies land (one wait per layer)
            torch.cuda.current_stream(x.device).synchronize()
        picked = idh.unique()
        self._read += int(((picked >= 0) & (picked < entry.experts)).sum()) * \
            entry.expert_bytes
        if isinstance(entry.gate_up, tuple):       # a dense MLP
            gate, up = entry.gate_up
            h = F.silu(kernels.linear(xh, gate)) * kernels.linear(xh, up)
            out = kernels.linear(h, entry.down)
        elif entry.fused and entry.contiguous:
            out = kernels.routed_experts(xh, idh, gh, entry.host["gate_up_proj"],
                                         entry.host["down_proj"], act="silu")
        else:
            out = torch.func.functional_call(entry.module, entry.host, (xh, idh, gh))
        back = self._stage(out.to(x.dtype), 3)     # rounded here: fewer bytes cross
        # laid out as the fake kernel says (empty_like(x)): a compiler relies on its strides
        return torch.empty_like(x).copy_(back, non_blocking=x.device.type == "cuda")

    def _stage(self, t: torch.Tensor, which: int) -> torch.Tensor:
        """``t`` copied into staging buffer ``which`` (grown as needed; page-locked on
        CUDA), a view shaped like it."""
        key = (which, t.dtype)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = torch.empty(max(t.numel(), 1), dtype=t.dtype,
                              pin_memory=t.device.type == "cuda" or
                              (which == 3 and self._state.device.type == "cuda"))
            self._staging[key] = buf
        view = buf[:t.numel()].view(t.shape)
        view.copy_(t, non_blocking=t.device.type == "cuda")
        return view

    def _layer(self, layer: int, chunks) -> HostWeights:
        entry = self._layers.get(layer)
        if entry is None or not entry.reads(self._state.masters[layer]):
            state = self._state
            suffixes = {s for c in chunks for s in state.learned.layout[layer][c].suffixes}
            params = [p for p in state.params[layer] if p.suffix in suffixes]
            experts = state.choice.experts[layer][params[0].suffix]
            entry = HostWeights(params[0].owner, params, state.masters[layer], experts)
            self._layers[layer] = entry
        return entry

    def last_call(self) -> dict[int, str]:
        """Layer -> where its experts ran in the latest call ("host", "device", "split
        <m>": each token's first m picks and the cached ones on the device; "host (CUDA
        graph)" or "split <m> (CUDA graph)": a replay's recorded job)."""
        ran = dict(self.ran)
        ran.update({layer: f"split {m} (CUDA graph)" if m else "host (CUDA graph)"
                    for layer, (_, _, m) in self._replayed().items()})
        return ran
