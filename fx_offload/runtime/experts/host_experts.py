"""The ``host_experts`` op at run time (option ``host_compute``): a routed MoE layer's experts
computed on the host from their weights' host block, or streamed, call by call.

On the host (``"always"``, or ``"auto"`` where its rule says so), on a CUDA device, for
transformers' fused experts layout, everything is enqueued on streams and the caller never
waits::

    compute stream: x, ids, gates -> fp32/int64 buffers of ours        -> event
    job stream:     (waits the event) -> page-locked staging copies
                    host function (cuLaunchHostFunc): the C kernel on the staging and the
                    host block; y (fp32) -> the device                 -> event
    compute stream: the device's share of the picks, if any (split.py)
                    (waits the event) y + that share -> x's dtype

The stream runs the kernel on a driver thread once the copies before it landed, and the
copy back waits for it; meanwhile the caller goes on enqueuing the next layers' work (their
attention kernels, their weights' prefetches), so a decode step's Python and kernel launches
hide behind the host's arithmetic instead of adding to it.  Staging, scratch and each job's
arguments are reused layer after layer: stream order keeps a layer's job from reading what
the next layer's copies write.  Elsewhere (a CPU device, another layout, no C compiler)
the op stages, waits for the stream once, computes with :mod:`~fx_offload.host_compute.
kernels` (or the module's own ``forward`` on host views) and copies back.

The expert tensors' chunk is not copied for such a call (its prefetch is skipped, see
:meth:`HostExperts.skips`).  An experts module of another layout or activation runs its own
``forward`` on the host tensors instead.  Streamed, the op does what the graph did without
it: a routed wait for each chunk (the picked experts cross the link, or the whole chunk was
prefetched), then the experts module's own ``forward``, whose parameters point at the slot
during a call.

``"auto"``'s rule, per layer and call shape (:func:`~fx_offload.host_compute.split.
device_picks`), from the call's tokens, the layer's expert sizes, the bytes of its other
chunks and the rates of :mod:`fx_offload.host_compute.rates` (measured once per machine and
cached beside the device's): of each token's ``k`` picks the device takes the first ``m``
(gathered over the link, or from the expert cache) and the host the rest, ``m`` chosen so
that the link and the host finish together; ``m = k`` streams the layer (a prompt: the
host's arithmetic is the cost), ``m = 0`` computes it wholly on the host.  The rule's
choice is then checked against the clock (:mod:`~fx_offload.host_compute.trial`): at each
call size the calls take turns with the rule's split, the host alone and streaming, timed
on the device, and the fastest stays.
"""
from __future__ import annotations

import ctypes
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import OffloadError
from ...host_compute import kernels
from ...host_compute.kernels import job_threads
from ...host_compute import native
from ...host_compute import split
from ...host_compute.rates import host_rates
from ...host_compute.trial import CallTimer
from ...selection.mlps import mlp_path
from ..memory.contents import capturing
from ..phase import Phase

log = logging.getLogger("fx_offload")



def _laid_out_as(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` with ``torch.empty_like(x)``'s dtype and strides, what the op's fake kernel
    promised the compiler."""
    if out.dtype == x.dtype and (out.stride() == x.stride() or
                                 (out.is_contiguous() and x.is_contiguous())):
        return out
    return torch.empty_like(x).copy_(out)


def for_state(state) -> "HostExperts | None":
    """The runtime of ``state``'s ``host_experts`` ops (None under host_compute="never"),
    made as its memory is (``placement.activate``)."""
    mode = state.choice.options.host_compute
    return None if mode == "never" else HostExperts(state, mode)


class _Layer:
    """One layer's experts module and what its host computation needs."""

    def __init__(self, module: nn.Module, params, masters, experts: int, mlp=None):
        self.module = module
        self.suffixes = mlp or tuple(p.suffix for p in params)
        self.views = tuple(masters[s] for s in self.suffixes)
        self.host = {p.attr: masters[p.suffix] for p in params}     # attribute -> host view
        self.experts = experts
        if mlp is not None:     # a dense MLP (selection.mlps): one expert, the pass proved it
            gate, up, down = (masters[s] for s in mlp)
            self.host = {"gate": gate, "up": up, "down": down}
            self.gate_up, self.down = (gate, up), down
            self.expert_bytes = sum(t.numel() * t.element_size() for t in self.host.values())
        else:
            self.gate_up, self.down = self.host.get("gate_up_proj"), self.host.get("down_proj")
            self.expert_bytes = sum(t[0].numel() * t.element_size()
                                    for t in self.host.values())
        self.dtype = next(iter(self.host.values())).dtype
        self.element_size = next(iter(self.host.values())).element_size()
        self.fused = mlp is not None or _fused_silu(module, self.host, experts)
        # the C kernel can be queued on the stream for it (weights it reads as they are)
        self.queueable = self.fused and self.dtype in native.WEIGHT_CODES and \
            all(t.is_contiguous() for t in self.host.values())

    def reads(self, masters) -> bool:
        """Its host views are still the layer's (a weight given new storage, a new dtype,
        a host block made again: made anew, never read stale)."""
        return all(masters.get(s) is v for s, v in zip(self.suffixes, self.views))


def _fused_silu(module: nn.Module, host: dict, experts: int) -> bool:
    """The layout :func:`kernels.routed_experts` computes: ``gate_up_proj [E, 2I, H]`` (the
    gate's rows first), ``down_proj [E, H, I]``, no bias, a SiLU between."""
    gate_up, down = host.get("gate_up_proj"), host.get("down_proj")
    if set(host) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3:
        return False
    flags = (getattr(module, "has_gate", True), not getattr(module, "has_bias", False),
             not getattr(module, "is_transposed", False),
             getattr(module, "is_concatenated", True),
             not getattr(module, "has_post_expert_norm", False))
    gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    shapes = gate_up.shape[0] == down.shape[0] == experts and \
        gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
    return all(flags) and silu and shapes and \
        (gate is None or gate.__name__ == "_default_apply_gate")


class _StreamJobs:
    """What the host functions a stream runs need: page-locked staging and scratch (grown
    as calls grow), a ring of job arguments, a counter of the experts each layer read."""

    RING = 64       # jobs in flight before one is written again (it waits if not done)

    def __init__(self, lib, threads: int):
        self.lib = lib
        self.threads = threads      # read once, at the model's first call on the host
        self.jobs = [native.ExpertsJob() for _ in range(self.RING)]
        self.queued = [False] * self.RING
        self.next = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.picked: dict[int, ctypes.c_int64] = {}
        # the jobs' stream, and the events between it and the compute stream
        self.stream = self.entered = self.left = None

    def buffer(self, name: str, numel: int, dtype: torch.dtype, stream,
               pinned: bool = True, device=None) -> torch.Tensor:
        """Buffer ``name``'s first ``numel`` elements (on ``device``, else on the host:
        staging page-locked, so that copies of it run asynchronously, the kernel's scratch
        not)."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:         # a queued job may still read the smaller one
                torch.cuda.synchronize(stream.device)
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device,
                              pin_memory=pinned and device is None)
            self.buffers[name] = buf
        return buf[:numel]

    def pending(self) -> bool:
        """A job queued on a stream has not finished."""
        return any(q and not j.done for q, j in zip(self.queued, self.jobs))

    def __del__(self):
        # a queued job reads this object's buffers and arguments: never free them under it
        try:
            if self.pending():
                torch.cuda.synchronize()
        except Exception:       # (interpreter shutdown: CUDA may be gone already)
            pass

    def job(self, stream) -> native.ExpertsJob:
        i, self.next = self.next, (self.next + 1) % self.RING
        job = self.jobs[i]
        if self.queued[i] and not job.done:     # 64 layers behind: wait for it
            stream.synchronize()
        self.queued[i] = True
        return job

    def run(self, entry, layer: int, x, ids, gates, device_part=None) -> torch.Tensor:
        """Queue ``layer``'s host job for ``x``, ``ids``, ``gates`` on a stream of its own and
        return its result on the compute stream, plus ``device_part()`` (an fp32 (T, H)
        the compute stream makes meanwhile; :mod:`~fx_offload.host_compute.split`)."""
        main = torch.cuda.current_stream(x.device)
        side = self._side(x.device)
        (T, H), k = x.shape, ids.shape[1]
        gate_up, down = entry.gate_up, entry.down
        floats, ints = native.scratch_sizes(T * k, H, down.shape[-1], entry.experts)
        # converted on the compute stream into buffers of ours (the side stream reads them
        # after the caching allocator could hand a temporary to someone else)
        ready = []
        for name, t, dtype in (("x", x, torch.float32), ("ids", ids, torch.int64),
                               ("gates", gates, torch.float32)):
            there = self.buffer("dev_" + name, t.numel(), dtype, main, device=x.device)
            ready.append((name, there.view(t.shape).copy_(t)))
        y_there = self.buffer("dev_y", T * H, torch.float32, main, device=x.device).view(T, H)
        self.entered.record(main)
        with torch.cuda.stream(side):
            side.wait_event(self.entered)
            staged = []
            for name, there in ready:
                view = self.buffer(name, there.numel(), there.dtype, side).view(there.shape)
                view.copy_(there, non_blocking=True)
                staged.append(view)
            y = self.buffer("y", T * H, torch.float32, side).view(T, H)
            picked = self.picked.setdefault(layer, ctypes.c_int64(0))
            job = self.job(side)
            native.fill_job(job, gate_up, down, "silu", *staged,
                            self.buffer("floats", floats, torch.float32, side, False),
                            self.buffer("ints", ints, torch.int64, side, False), y, picked,
                            self.threads)
            native.launch_host_function(self.lib, side.cuda_stream, job)
            y_there.copy_(y, non_blocking=True)
            self.left.record(side)
        mine = device_part() if device_part is not None else None
        main.wait_event(self.left)
        total = y_there if mine is None else mine.add_(y_there)
        return torch.empty_like(x).copy_(total)

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
        self._layers: dict[int, _Layer] = {}
        self._staging: dict[tuple, torch.Tensor] = {}
        self._rates = None          # HostRates, measured (or read) at the first need
        self._k = None              # top-k of the latest call's routers
        self.on_host_now = mode == "always"     # this call's prediction, for the prefetches
        self.ran: dict[int, str] = {}   # layer -> "host", "device", "split <m>", latest call
        self._read = 0              # host memory the latest call's kernels read (waited)
        self._queued_reads: list = []   # (counter, bytes an expert) of its queued jobs
        self._jobs = None           # _StreamJobs, made at the first queued call
        self._predictions: dict[tuple, tuple] = {}    # (layer, tokens, k) -> _predicted's
        # "auto": the rule's choice timed against the host alone and streaming, per call
        # size; the plan of the call in progress (k: stream, 0: host, else the rule's)
        self.timer = CallTimer(state.model_name) if mode == "auto" else None
        self._call = None           # (tokens, plan) of the call in progress
        # dense MLPs (host_mlp ops): their runtime by layer, the layers hosted in order,
        # and this call's plan (tokens, m): m of them stream (split.streamed_mlps)
        self._mlps: dict[int, _Layer] = {}
        self._hosted: list[int] = []
        self._mlp_plan: tuple[int | None, int] | None = None
        self._units: dict = {}      # (tokens, device) -> the ids and gates of one expert
        self._streamed: dict = {}   # (m, hosted count) -> the layers whose MLPs stream

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
        self._call = self._mlp_plan = None
        self._hosted = self._hosted_mlps()
        # one plan a call is timed: the experts' where a layer has them on the host (its
        # dense MLPs, if any, then follow the rule untimed)
        experts = any(why == "host" and layer not in self._state.choice.mlps
                      for layer, why in self._state.learned.hosting.items())
        if self.mode == "auto" and tokens and self._hosted and not experts:
            plan, *seconds = self._mlp_predicted(tokens)
            device, count = self._state.device, len(self._hosted)
            if capturing():         # the op streams in a capture: so do the prefetches
                plan = count
            elif device.type == "cuda":
                # the rule's host rate is the probe's, on experts; an MLP's rows are wider
                # and the chain between layers costs more: one or two more streamed are tried
                plan = self.timer.begin(tokens, count, plan, seconds,
                                        torch.cuda.current_stream(device),
                                        near=[min(plan + 1, count), min(plan + 2, count)],
                                        unit="MLPs")
                self._call = (tokens, plan)
            self._mlp_plan = (tokens, plan)
        elif self.mode == "auto" and tokens and self._k and self._layers:
            layer, entry = next(iter(self._layers.items()))
            plan, *seconds = self._predicted(entry, layer, tokens, self._k)
            device = self._state.device
            if device.type == "cuda" and not capturing():
                plan = self.timer.begin(tokens, self._k, plan, seconds,
                                        torch.cuda.current_stream(device))
                self._call = (tokens, plan)
            self.on_host_now = plan < self._k

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
        if self._jobs is not None and self._jobs.pending():
            torch.cuda.synchronize(self._state.device)

    @property
    def read_bytes(self) -> int:
        """Host memory the latest call's kernels read; waits for its queued jobs."""
        self.synchronize()
        return self._read + sum(c.value * b for c, b in self._queued_reads)

    def skips(self, layer: int, chunk) -> bool:
        """The prefetch of ``layer``'s ``chunk`` copies nothing: its experts, or its dense
        MLP, are predicted to run on the host in this call."""
        learned = self._state.learned
        if learned.hosting.get(layer) != "host":
            return False
        names = self._state.choice.mlps.get(layer)
        if names is not None:
            return set(chunk.suffixes) <= set(names) and self._mlp_on_host(layer, None)
        return self.on_host_now and learned.routing.get(layer, {}).get(chunk.index) == "routed"

    def run_mlp(self, layer: int, chunks, x: torch.Tensor) -> torch.Tensor:
        """The ``host_mlp`` op's kernel: ``layer``'s dense MLP on ``x``, here or there."""
        state = self._state
        entry = self._mlp(layer)
        if state.phase is Phase.RESTORED:
            return _laid_out_as(x, entry.module(x))
        tokens = x.numel() // max(x.shape[-1], 1)
        if (capturing() and self.mode == "auto") or not self._mlp_on_host(layer, tokens):
            for chunk in chunks:
                state.wait(layer, chunk)
            self.ran[layer] = "device"
            return _laid_out_as(x, entry.module(x))
        self.refuse_capture()
        self.ran[layer] = "host"
        flat = x.reshape(tokens, x.shape[-1])
        key = (tokens, x.device)
        if key not in self._units:      # every token picks the one expert with weight 1
            self._units[key] = (torch.zeros(tokens, 1, dtype=torch.int64, device=x.device),
                                torch.ones(tokens, 1, dtype=torch.float32, device=x.device))
        ids, gates = self._units[key]
        self._start_over(layer, chunks)
        if x.device.type == "cuda" and entry.queueable and native.library() is not None:
            if self._jobs is None:
                self._jobs = _StreamJobs(native.library(), job_threads())
            out = self._jobs.run(entry, layer, flat, ids, gates)
            self._queued_reads.append((self._jobs.picked[layer], entry.expert_bytes))
        else:
            out = self._on_host(entry, flat, ids, gates)
        return _laid_out_as(x, out.view(x.shape))

    def _start_over(self, layer: int, chunks) -> None:
        """Begin now the refills of the slot bytes only this MLP's ``chunks`` hold: the host
        reads the MLP from host memory, so the link fills them with the next occupant's
        weights while the host computes (the graph's own starts, after the op's result,
        then find them begun).  The copies still wait for every kernel queued before."""
        state = self._state
        refill = state.schedule.refill_in_call(layer)
        if refill is None:
            return
        mine = state.learned.layout[layer]
        for target in state.learned.layout[refill]:
            under = [c for c in mine if c.overlaps(target)]
            if under and all(c.index in chunks for c in under):
                state.start(layer, refill, target.index)

    def _hosted_mlps(self) -> list[int]:
        """The layers whose dense MLP is a ``host_mlp`` op, in order."""
        hosting = self._state.learned.hosting
        return [layer for layer in sorted(self._state.choice.mlps)
                if hosting.get(layer) == "host"]

    def _mlp_on_host(self, layer: int, tokens: int | None) -> bool:
        """``layer``'s MLP computes on the host in this call (``tokens``: the op's; None: a
        prefetch asking, which never predicts a call not begun).  Weights the host kernel
        cannot read as they are (given non-contiguous storage since) stream."""
        if not self._mlp(layer).queueable:
            return False
        if self.mode == "always":
            return True
        if layer not in self._hosted:
            self._hosted = self._hosted_mlps()
        plan = self._mlp_plan
        if tokens is not None and (plan is None or plan[0] != tokens):
            if self._call is not None:      # miscounted tokens: this call is not timed
                self.timer.discard()
                self._call = None
            plan = self._mlp_plan = (tokens, self._mlp_predicted(tokens)[0])
        if plan is None or layer not in self._hosted:
            return False
        key = (plan[1], len(self._hosted))
        streamed = self._streamed.get(key)
        if streamed is None:
            schedule = self._state.schedule
            streamed = self._streamed[key] = split.streamed_mlps(
                plan[1], self._hosted, schedule.layers, schedule.num_slots)
        return layer not in streamed

    def _mlp_predicted(self, tokens: int):
        """(the rule's ``m``, the call's predicted seconds with ``m``, ``0``, all streamed):
        ``m`` of the hosted MLPs stream, the link carrying them and every other offloaded
        chunk while the host computes the rest."""
        key = ("mlp", tokens, len(self._hosted))
        found = self._predictions.get(key)
        if found is not None:
            return found
        if self._rates is None:
            self._rates = host_rates(self._state.device)
        hosted, layout = self._hosted, self._state.learned.layout
        mlps = self._state.choice.mlps
        each = [sum(c.end - c.start for c in layout[layer] if set(c.suffixes) <= set(mlps[layer]))
                for layer in hosted]
        total = sum(c.end - c.start for chunks in layout.values() for c in chunks)
        size = sum(each) / max(len(each), 1)
        shape = (tokens, len(hosted), size, self._mlp(hosted[0]).element_size if hosted else 2,
                 total - sum(each), self._rates)
        best = split.mlps_streamed(*shape)
        found = self._predictions[key] = (best, *(split.mlps_seconds(m, *shape)
                                                  for m in (best, 0, len(hosted))))
        return found

    def _mlp(self, layer: int) -> _Layer:
        entry = self._mlps.get(layer)
        if entry is None or not entry.reads(self._state.masters[layer]):
            state = self._state
            names = state.choice.mlps[layer]
            module = state.choice.stack.modules[layer].get_submodule(mlp_path(names))
            entry = self._mlps[layer] = _Layer(module, [], state.masters[layer], 1, mlp=names)
        return entry

    def run(self, layer: int, chunks, x: torch.Tensor, ids: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
        """The op's kernel: ``layer``'s experts on ``x``, here or there."""
        state = self._state
        entry = self._layer(layer, chunks)
        tokens, k = x.shape[0], ids.shape[-1] if ids.dim() else 1
        self._k = k
        if state.phase is Phase.RESTORED:
            return _laid_out_as(x, entry.module(x, ids, gates))
        # (under capture "auto" streams: a graph cannot record the host's part)
        m = k if capturing() and self.mode == "auto" else self._plan(entry, layer, tokens, k)
        host = m < k
        if host:
            self.refuse_capture()
        if not host:
            for chunk in chunks:
                state.wait_routed(layer, chunk, ids)
            self.ran[layer] = "device"
            return _laid_out_as(x, entry.module(x, ids, gates))
        self.ran[layer] = "host"
        if x.device.type == "cuda" and entry.queueable and x.dim() == 2 and ids.dim() == 2:
            lib = native.library()
            if lib is not None:
                if self._jobs is None:
                    self._jobs = _StreamJobs(lib, job_threads())
                out = self._queued(entry, layer, chunks, x, ids, gates, m)
                self._queued_reads.append((self._jobs.picked[layer], entry.expert_bytes))
                return out
        return self._on_host(entry, x, ids, gates)

    def _queued(self, entry: _Layer, layer: int, chunks, x, ids, gates, m: int) -> torch.Tensor:
        """The host job queued on a stream; where ``m`` (``"auto"``'s rule) or the expert
        cache give the device picks of its own, they split (:mod:`~fx_offload.host_compute.
        split`), which needs the routed gather."""
        routed = getattr(self._state, "routed", None)
        if routed is None or not routed.usable:
            m, where = 0, None
        else:
            where = routed.cache_rows(layer)
        if not m and where is None:
            return self._jobs.run(entry, layer, x, ids, gates)
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
                                        module.down_proj, keep)
        return self._jobs.run(entry, layer, x, ids_host, gates, device_part)

    def _plan(self, entry: _Layer, layer: int, tokens: int, k: int) -> int:
        """How many of each token's ``k`` picks the device computes: the rule's
        (:func:`~fx_offload.host_compute.split.device_picks`), or the timer's plan."""
        if self.mode == "always":
            return 0
        if self._call is not None and self._call[0] != tokens:
            # the call's first argument miscounted its tokens: this call is not timed
            self.timer.discard()
            self._call = None
        if self._call is not None and self._call[1] in (0, k):
            return self._call[1]
        return self._predicted(entry, layer, tokens, k)[0]

    def _predicted(self, entry: _Layer, layer: int, tokens: int, k: int):
        """(the rule's ``m``, the layer's predicted seconds with ``m``, ``0``, ``k``)."""
        key = (layer, tokens, k)
        found = self._predictions.get(key)
        if found is None:
            if self._rates is None:
                self._rates = host_rates(self._state.device)
            # the layer's other chunks cross the link meanwhile (attention, norms, router)
            chunks = {c for c, how in self._state.learned.routing.get(layer, {}).items()
                      if how == "routed"}
            others = sum(c.end - c.start for c in self._state.learned.layout[layer]
                         if c.index not in chunks)
            shape = (tokens, k, entry.experts, entry.expert_bytes, entry.element_size,
                     others, self._rates.link_rate, self._rates)
            m = split.device_picks(*shape)
            found = (m, *(split.layer_seconds(p, *shape) for p in (m, 0, k)))
            self._predictions[key] = found
        return found

    def _on_host(self, entry: _Layer, x, ids, gates) -> torch.Tensor:
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
        elif entry.fused:
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

    def _layer(self, layer: int, chunks) -> _Layer:
        entry = self._layers.get(layer)
        if entry is None or not entry.reads(self._state.masters[layer]):
            state = self._state
            suffixes = {s for c in chunks for s in state.learned.layout[layer][c].suffixes}
            params = [p for p in state.params[layer] if p.suffix in suffixes]
            experts = state.choice.experts[layer][params[0].suffix]
            entry = _Layer(params[0].owner, params, state.masters[layer], experts)
            self._layers[layer] = entry
        return entry

    def last_call(self) -> dict[int, str]:
        """Layer -> where its experts ran in the latest call ("host", "device", or "split
        <m>": each token's first m picks and the cached ones on the device)."""
        return dict(self.ran)
