"""Attention over a host KV cache layer computed on the host, where the cache lives
(``kv_cache="host"`` with ``host_compute``): only the step's query, tokens and output
cross the link, never the cache.

In a graph where the pass chooses it (:func:`choose`), a host layer's writes and the
attention that reads its cache become one op::

    K.index_copy_(2, idx, k)                   o = kv_attend(a, q, k, v, idx, K, V, mask,
    V.index_copy_(2, idx, v)          ==>                    h, L, scale)
    k2 = repeat_kv(K); v2 = repeat_kv(V)
    o = sdpa(q, k2, v2, mask, scale=scale)

(``repeat_kv``: the view nodes between the cache and the attention, checked to repeat
each KV head as transformers' ``repeat_kv`` or ``repeat_interleave`` do; the attention must
follow both writes).  At run time (:class:`HostAttention`) the op writes the step's tokens
into the host cache through its mapped address and, on a GPU, queues a job on a stream of
its own (:class:`_Jobs`: staging copies, :mod:`fx_offload.host_compute.attention` as a host
function over the valid tokens, the output copied back; under CUDA graphs a host node of
the graph); on a CPU it computes in place.  Such a layer takes no slot: nothing is filled
for it.

The choice is per graph, from its shapes, and per call in a graph of dynamic shapes: under
``"auto"`` a decode-shaped call (at most ``ROWS`` query rows read each KV head) on a host
whose kernel reads the cache ``FASTER`` times as fast as the link copies it (both measured
once per machine); ``"always"``: every call the kernel takes.  Why, and what was measured:
docs/host_compute.md, "Attention over the host KV cache".
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import time
import weakref

import torch
import torch.nn.functional as F
from torch import fx

from ..errors import OffloadError
from ..graph_inputs import value_of
from ..host_compute import attention as kernel
from ..host_compute import native
from ..host_compute.kernels import job_threads
from ..runtime.memory.streams import capturing
from . import copies

log = logging.getLogger("fx_offload")
_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_VIEWS = {"expand", "reshape", "view", "contiguous", "repeat_interleave", operator.getitem,
          torch.reshape, torch.repeat_interleave}
ROWS = 8        # query rows per KV head up to which "auto" attends on the host
# how much faster than the link the host's kernel must read for "auto" to take it: each
# layer's attention then waits for the device and back (streaming overlaps its copies), and
# a decode step's jobs read slower than the probe does.  On a 16-core H200 host the probe
# read 68.7 GB/s (1.24x the link's 55.3), the jobs 58, and streaming was the faster (81.95
# against 91.89 ms a token, 16 layers at 64k); on 32 cores the probe reads 2.0-2.2x the link
FASTER = 1.5


@dataclasses.dataclass
class Found:
    """One host layer's attention: the sdpa node, the view nodes between the cache and it,
    its query and mask nodes and its scale."""
    sdpa: fx.Node
    views: list
    query: fx.Node
    mask: fx.Node | None
    scale: float | fx.Node | None   # a node: a float the graph reads (a SymFloat)
    rows: int           # query rows per KV head (as traced)
    dynamic: bool = False   # shapes that vary by call: the rule is applied call by call


def _reads_size(node: fx.Node) -> bool:
    """``node`` reads a tensor's sizes only (``x.size(-2)``, ``x.shape``): no data."""
    return (node.op == "call_method" and node.target in ("size", "dim")) or (
        node.op == "call_function" and (node.target is torch.ops.aten.sym_size.int or (
            node.target is getattr and node.args[1:] == ("shape",))))


def _chain(start: fx.Node, avoid: fx.Node):
    """(the node ``start``'s single chain of views ends in, the views) or a reason.  Nodes
    that read the cache's sizes alone stay: the placeholder stays an input of the graph."""
    views, node = [], start
    while True:
        users = [u for u in node.users if u is not avoid and not
                 (node is start and _reads_size(u))]
        if len(users) != 1:
            return (f"its cache is read by {len(users)} nodes, not one attention: "
                    f"{sorted(str(u.target) for u in users)}")
        (user,) = users
        if user.op == "call_function" and user.target in _SDPA:
            return user, views
        target = user.target
        if user.op not in ("call_method", "call_function") or target not in _VIEWS:
            return f"its cache is read by {user.name} ({target}), not an attention"
        views.append(user)
        node = user


def _hint(value) -> int:
    """A size as an int: a symbolic one by the value it was traced with (read, not guarded
    on: ``int()`` would specialize the graph)."""
    if isinstance(value, int):
        return value
    hint = value.node.hint
    if hint is None:
        raise LookupError("a size with no traced value")
    return int(hint)


def _repeats(views: list, start: fx.Node, shape: tuple, rep: int) -> bool:
    """The views turn ``start`` (``[B, KVH, T, D]``) into each KV head repeated ``rep``
    times in place, as transformers' ``repeat_kv`` (``x[:, :, None].expand(B, KVH, rep, T,
    D).reshape(B, KVH * rep, T, D)``) or ``repeat_interleave(rep, dim=1)`` do; no views:
    ``rep`` 1.  Read from the views' arguments (sizes computed in the graph by their traced
    values): replaying them on a tensor of the cache's size would cost gigabytes."""
    b, kvh, t, d = shape

    def sizes(args):
        try:
            flat = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            return tuple(_hint(value_of(a) if isinstance(a, fx.Node) else a) for a in flat)
        except (LookupError, AttributeError, TypeError):
            return None
    kinds = [(v.target if v.op == "call_method" else getattr(v.target, "__name__", v.target))
             for v in views]
    if not views:
        return rep == 1
    if kinds == ["repeat_interleave"] and views[0].op == "call_method":
        args = list(views[0].args[1:]) + [views[0].kwargs.get("dim")]
        return views[0].args[0] is start and args[:1] == [rep] and 1 in args[1:]
    if kinds[0] != "getitem" or kinds[1:2] != ["expand"] or \
            kinds[2:] not in (["reshape"], ["view"], ["contiguous", "view"]):
        return False
    index = views[0].args[1]        # x[:, :, None] or x[:, :, None, :, :]
    if views[0].args[0] is not start or not isinstance(index, tuple) or \
            len(index) not in (3, 5) or index[2] is not None or \
            any(i != slice(None) for i in index[:2] + index[3:]):
        return False
    if sizes(views[1].args[1:]) != (b, kvh, rep, t, d):
        return False
    return sizes(views[-1].args[1:]) == (b, kvh * rep, t, d)


def find(kl) -> Found | str:
    """Layer ``kl``'s attention, where it can run on the host; else why not."""
    got = [_chain(src, write) for src, write in ((kl.keys, kl.writes[0]),
                                                 (kl.values, kl.writes[1]))]
    for g in got:
        if isinstance(g, str):
            return g
    (sdpa, k_views), (sdpa_v, v_views) = got
    if sdpa is not sdpa_v:
        return "its keys and values are read by two attentions"
    # the op writes, then attends: the attention and every view before it must follow both
    # writes in the graph (one that reads the cache before the step's write stays as it is
    # and the reroute refuses it), and what the op takes must be there before the attention
    order = {n: i for i, n in enumerate(sdpa.graph.nodes)}
    written = max(order[w] for w in kl.writes)
    if any(order[n] < written for n in (sdpa, *k_views, *v_views)):
        return "its attention reads the cache before the step writes it"
    params = dict(zip(_SDPA_ARGS, sdpa.args)) | dict(sdpa.kwargs)
    if params.get("key") is not (k_views[-1] if k_views else kl.keys) or \
            params.get("value") is not (v_views[-1] if v_views else kl.values):
        return "its attention does not take the keys and values in their places"
    if params.get("dropout_p", 0.0) != 0.0 or params.get("is_causal", False) is not False:
        return "its attention drops out or is causal over the whole cache"
    scale = params.get("scale")
    # a float that Dynamo took as an input (it may, for a module's float attribute) comes
    # as the node that reads it: the op then reads it at each call
    if not (scale is None or isinstance(scale, float) or (
            isinstance(scale, fx.Node) and isinstance(value_of(scale), torch.SymFloat))) or \
            not isinstance(params.get("enable_gqa", False), bool):
        return "its attention's scale is not a constant"
    query, mask = params["query"], params.get("attn_mask")
    if not isinstance(query, fx.Node) or not (mask is None or isinstance(mask, fx.Node)):
        return "its attention's query or mask is not a tensor of the graph"
    q, keys, values = value_of(query), value_of(kl.keys), value_of(kl.values)
    dynamic = any(not isinstance(s, int) for t in (q, keys, values) for s in t.shape)
    try:
        shapes = [tuple(_hint(s) for s in t.shape) for t in (q, keys, values)]
    except LookupError:
        return "its shapes depend on data (unbacked sizes)"
    why = kernel.unsupported(*shapes, keys.dtype, rows=not dynamic)
    if why:
        return why
    (b, h, nq, _), (_, kvh, t, _) = shapes[0], shapes[1]
    for views, start, shape in ((k_views, kl.keys, shapes[1]), (v_views, kl.values,
                                                                shapes[2])):
        if not (_repeats(views, start, shape, h // kvh) or (
                params.get("enable_gqa") is True and _repeats(views, start, shape, 1))):
            return "the views between its cache and its attention do not repeat the KV " \
                   "heads as grouped-query attention does"
    if mask is not None:
        m = value_of(mask)
        if m.dim() != 4 or _hint(m.shape[-1]) != t or any(
                _hint(s) not in (1, full) for s, full in zip(m.shape[:3], (b, h, nq))) or \
                not (m.dtype == torch.bool or m.dtype.is_floating_point):
            return "its attention mask is not a bool or float [batch, heads, query, cache]"
    return Found(sdpa, k_views + v_views, query, mask, scale, h // kvh * nq, dynamic)


def call_tokens(gm: fx.GraphModule) -> int | str:
    """The tokens a call of this graph writes into its cache (what ``report`` keys the
    choice by): the length of the first write's positions, or "dynamic"."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "index_copy_" or \
                node.target is torch.ops.aten.index_copy_.default:
            n = value_of(node.args[2]).numel()
            return n if isinstance(n, int) else "dynamic"
    return "dynamic"


def rows_for(mode: str) -> int:
    """Query rows per KV head up to which a call attends on the host under ``mode``; a call
    of more, in a graph of dynamic shapes, attends on the device."""
    return ROWS if mode == "auto" else kernel.MAX_ROWS


def choose(options, runtime, found: dict) -> dict[int, str]:
    """Per layer of ``found`` (layer -> :class:`Found` or why not): "host", or "streamed: why"
    (the graph's layers all stream, or all that can attend on the host do)."""
    mode = options.host_compute
    device = runtime.device or torch.device("cpu")
    out = {layer: f"streamed: {f}" for layer, f in found.items() if isinstance(f, str)}
    ready = [layer for layer, f in found.items() if not isinstance(f, str)]
    why = None
    if mode == "never":
        why = "host_compute='never'"
    elif options.mode == "reduce-overhead" and any(found[l].dynamic for l in ready):
        why = ("a graph of dynamic shapes under CUDA graphs (mode='reduce-overhead'): a "
               "prefill's call would copy the cache in from inside a capture")
    elif mode == "auto" and device.type != "cuda":
        why = "host_compute='auto' on a CPU device (there is no link to spare)"
    elif mode == "auto" and any(found[l].rows > ROWS and not found[l].dynamic
                                for l in ready):
        why = (f"host_compute='auto' keeps a call of more than {ROWS} query rows per KV head "
               "on the device (a prefill)")
    elif kernel.library() is None:
        if mode == "always":
            raise OffloadError("host_compute='always' needs a C compiler for the host's "
                               "attention kernel; install gcc, or use host_compute='auto'",
                               where="kv_cache='host'")
        why = "no C compiler for the host's attention kernel"
    elif mode == "auto" and device.type == "cuda":
        from ..host_compute.rates import host_rates
        link, host = host_rates(device).link_rate, kernel.rate()
        if host < FASTER * link:
            why = (f"the host's attention reads the cache at {host / 1e9:.0f} GB/s, not "
                   f"{FASTER}x the link's {link / 1e9:.0f} GB/s")
    for layer in ready:
        out[layer] = "host" if why is None else f"streamed: {why}"
    if mode == "always" and any(w != "host" for w in out.values()):
        log.warning("fx_offload: host_compute='always', yet the attention of host KV layer(s) "
                    "%s stays on the device: %s", sorted(l for l, w in out.items()
                                                         if w != "host"),
                    sorted({w for w in out.values() if w != "host"}))
    return out


def rewrite(graph: fx.Graph, kl, found: Found, anchor: fx.Node, handle: int,
            op) -> fx.Node:
    """Replace layer ``kl``'s two writes and its attention by one ``kv_attend``."""
    wk, wv = kl.writes
    with graph.inserting_before(found.sdpa):
        node = graph.call_function(op, (anchor, found.query, wk.args[3], wv.args[3],
                                        wk.args[2], kl.keys, kl.values, found.mask, handle,
                                        kl.layer, found.scale))
    node.meta.update({k: v for k, v in found.sdpa.meta.items()
                      if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    q, v = value_of(found.query), value_of(kl.values)
    with q.fake_mode:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    node.meta["val"] = node.meta["example_value"] = out
    found.sdpa.replace_all_uses_with(node)
    graph.erase_node(found.sdpa)
    for view in reversed(found.views):
        if not view.users:
            graph.erase_node(view)
    for write in (wk, wv):
        write.replace_all_uses_with(kl.keys if write is wk else kl.values)
        graph.erase_node(write)
    return node


class _Fixed:
    """The buffers of the jobs CUDA graphs record for one layer and shapes, never grown or
    used for another, alive as long as the runtime (every replay of a graph runs its job on
    these addresses).  Graphs recorded for other caches of the same shapes share them (their
    jobs run one at a time on the stream), each with job arguments and a record of its own
    (:attr:`jobs`: the arguments name the cache; plain host memory, made even inside a
    capture)."""

    def __init__(self, sizes: dict):
        self.buffers = {name: torch.empty(max(numel, 1), dtype=dtype, pin_memory=pinned)
                        for name, (numel, dtype, pinned) in sizes.items()}
        # (cache keys' address, values', scale) -> (job, record, the cache keys)
        self.jobs: dict[tuple, tuple] = {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype,
               pinned: bool = True) -> torch.Tensor:
        return self.buffers[name][:numel]

    def job_for(self, host_k, host_v, scale, stream) -> tuple:
        """(job, record) of the graphs that read this cache; the jobs of caches that are
        gone are dropped (no graph replays them again), once ``stream`` has run those
        queued."""
        key = (host_k.data_ptr(), host_v.data_ptr(), scale)
        held = self.jobs.get(key)
        if held is None or held[2]() is not host_k:
            if not capturing() and any(j[2]() is None for j in self.jobs.values()):
                stream.synchronize()
                self.jobs = {k: j for k, j in self.jobs.items() if j[2]() is not None}
            held = self.jobs[key] = (kernel.AttendJob(), native.JobRecord(),
                                     weakref.ref(host_k))
        return held[:2]


class _Jobs:
    """The attention jobs of one host KV runtime on a CUDA device, each queued on a stream
    of its own as a host function (the experts' pattern, :mod:`fx_offload.runtime.experts.
    host_experts`)::

        compute stream: cache writes (mapped), q fp32, bias, positions          -> event
        job stream:     (waits the event) -> page-locked staging copies
                        host function: the kernel over the valid tokens it reads from
                        the positions and the bias; out (fp32) -> the device      -> event
        compute stream: (waits the event) out -> the query's dtype

    The Python thread never waits: it goes on queueing the next layers' work while the job
    runs.  Jobs run one at a time in stream order, so one set of staging buffers serves
    them all; a buffer grows only once the stream is idle.

    Under CUDA graphs (``mode="reduce-overhead"``) the same pattern is recorded, the host
    function a host node of the graph, and each job takes buffers, arguments and a record of
    its own (:class:`_Fixed`, per layer and shapes), made at an earlier call outside the
    capture (the warm-up every CUDA graph runs first), since every replay runs the job on
    the addresses it was recorded with.  The valid tokens are read by the job itself, from
    the positions the replay copied in."""

    RING = 64       # jobs in flight before one's arguments are written again

    def __init__(self, device: torch.device):
        self.lib = kernel.library()
        # every core: measured faster on 32 cores (docs/host_compute.md), and the kernel's
        # probe that 'auto' weighs runs with every core too
        self.threads = job_threads(spare=False)
        self.stream = torch.cuda.Stream(device)
        self.entered, self.left = torch.cuda.Event(), torch.cuda.Event()
        self.ring = native.JobRing(kernel.AttendJob, self.RING)
        self.buffers: dict[str, torch.Tensor] = {}
        self.records: dict[int, object] = {}    # layer -> its latest job's record
        self.fixed: dict[tuple, _Fixed] = {}    # (layer, shapes, ...) -> what a graph records

    def buffer(self, name: str, numel: int, dtype: torch.dtype,
               pinned: bool = True) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:         # a queued job may still read the smaller one
                self.stream.synchronize()
            buf = self.buffers[name] = torch.empty(max(numel, 1), dtype=dtype,
                                                   pin_memory=pinned)
        return buf[:numel]

    def __del__(self):
        # a queued job reads this object's buffers and arguments (a recorded one, at every
        # replay): never free them under it
        try:
            if self.ring.pending() or self.fixed:
                self.stream.synchronize()
        except Exception:       # (interpreter shutdown: CUDA may be gone already)
            pass

    def run(self, layer: int, q, bias, index, host_k, host_v, scale, fixed: bool = False):
        """Queue ``layer``'s job (``q`` fp32, ``bias`` fp32 or None, ``index`` int64: device
        tensors of the compute stream; ``host_k``/``host_v`` the page-locked cache) and
        return (its output, fp32 on the compute stream, the job's record).  ``fixed``: the
        job of a :class:`_Fixed` of its own (under CUDA graphs; inside a capture, one an
        earlier call made)."""
        dv = host_v.shape[-1]
        floats, chunks = kernel.scratch_floats(q.shape, host_k.shape[1], host_k.shape[2],
                                               dv, self.threads)
        mine = None
        if fixed:
            key = (layer, tuple(q.shape), None if bias is None else tuple(bias.shape),
                   index.numel(), tuple(host_k.shape), tuple(host_v.shape), host_k.dtype)
            mine = self.fixed.get(key)
            if mine is None:
                if capturing():
                    raise OffloadError(
                        f"host KV layer {layer}'s attention on the host is being captured "
                        "into a CUDA graph with no call of its shapes before: the graph's "
                        "job would have no buffers of its own. Let torch run the graph once "
                        "before its capture (torch.compile's mode='reduce-overhead' does), "
                        "or use host_compute='never'", where="kv_cache='host'")
                f32 = torch.float32
                mine = self.fixed[key] = _Fixed({
                    "q": (q.numel(), f32, True),
                    "bias": (0 if bias is None else bias.numel(), f32, True),
                    "index": (index.numel(), torch.int64, True),
                    "out": (q.numel() // q.shape[-1] * dv, f32, True),
                    "scratch": (floats, f32, False)})
        main = torch.cuda.current_stream(q.device)
        side = self.stream
        b, h, nq, _ = q.shape
        out_there = torch.empty(b, h, nq, dv, dtype=torch.float32, device=q.device)
        # temporaries of the compute stream the job stream reads (or writes): the caching
        # allocator hands them to no one else before it is done
        for t in (q, bias, index, out_there):
            if t is not None:
                t.record_stream(side)
        buffer = self.buffer if mine is None else mine.buffer
        self.entered.record(main)
        with torch.cuda.stream(side):
            side.wait_event(self.entered)
            staged = []
            for name, t in (("q", q), ("bias", bias), ("index", index)):
                if t is None:
                    staged.append(None)
                    continue
                view = buffer(name, t.numel(), t.dtype).view(t.shape)
                view.copy_(t, non_blocking=True)
                staged.append(view)
            out = buffer("out", out_there.numel(), torch.float32).view(out_there.shape)
            scratch = buffer("scratch", floats, torch.float32, False)
            if mine is None:
                record = self.records.setdefault(layer, native.JobRecord())
                job = self.ring.take(side)
            else:
                job, record = mine.job_for(host_k, host_v, scale, side)
            kernel.fill_job(job, staged[0], host_k, host_v, staged[2], staged[1], scale, out,
                            scratch, chunks, record, self.threads)
            native.launch_host_function(self.lib, side.cuda_stream, job, "fx_attend_run")
            out_there.copy_(out, non_blocking=True)
            self.left.record(side)
        main.wait_event(self.left)
        return out_there, record


class HostAttention:
    """The ``kv_attend`` op at run time, for one host KV runtime: the queued jobs, and what
    the latest call did."""

    def __init__(self, graphs: bool = False):
        self.rows = kernel.MAX_ROWS     # query rows per KV head the host takes (rows_for)
        self.graphs = graphs            # under CUDA graphs: every job a _Fixed of its own
        self._layers: list[int] = []    # attended on the host in the latest call, the op ran
        self.on_device: list[int] = []  # attended on the device: the call had more rows
        self._read = 0                  # bytes of host cache they read, waited for
        self._queued: list = []         # (record, bytes a token) of this call's queued jobs
        self._jobs: _Jobs | None = None     # on a CUDA device, made at the first job
        # jobs recorded into CUDA graphs: (layer, its record, bytes a token); a replay runs
        # no Python, so what it attended is read from the records
        self.recorded: list[tuple] = []
        self._began = 0                 # the host's monotonic clock (ns) at the call hook

    def begin_call(self) -> None:
        """The call's begin op (not run by a replay)."""
        self._layers, self.on_device, self._read, self._queued = [], [], 0, []

    def call_began(self) -> None:
        """The model's call hook (run before a replay too): a new call."""
        self.begin_call()
        self._began = time.monotonic_ns()

    def _replayed(self) -> list[tuple]:
        """(layer, record, bytes a token) of the recorded jobs a replay ran in the latest
        call: those started since its call hook, of layers its op did not run.  Waits for
        them."""
        if not self.recorded:
            return []
        self._jobs.stream.synchronize()
        live = {id(j[1]) for f in self._jobs.fixed.values()     # (a dead cache's: gone)
                for j in f.jobs.values()}
        self.recorded = [held for held in self.recorded if id(held[1]) in live]
        return [(layer, r, n) for layer, r, n in self.recorded
                if r[1] >= self._began and layer not in self._layers]

    @property
    def layers(self) -> list[int]:
        """The layers the latest call attended on the host (a replay's too)."""
        return sorted({*self._layers, *(layer for layer, _, _ in self._replayed())})

    def _records(self) -> list[tuple]:
        if self._queued:
            self._jobs.stream.synchronize()
        return self._queued + [(r, n) for _, r, n in self._replayed()]

    @property
    def read(self) -> int:
        """Bytes of host cache the latest call's attention read (waits for its jobs)."""
        return self._read + sum(record[0] * per_token for record, per_token in self._records())

    @property
    def jobs_timed(self) -> tuple[int, float, float] | None:
        """The latest call's jobs on a stream (queued, or replayed from a CUDA graph): (how
        many, seconds they ran, seconds from the first one's start to the last one's end),
        None where none ran; waits for them.  They run one after another on one stream: the
        span less the time they ran is the time the host's cores waited for the device
        between them."""
        records = [record for record, _ in self._records()]
        if not records:
            return None
        return (len(records), sum(r[2] - r[1] for r in records) / 1e9,
                (max(r[2] for r in records) - min(r[1] for r in records)) / 1e9)

    def device_path(self, runtime, layer, query, key, value, index, keys, values, mask,
                    scale) -> torch.Tensor:
        """A call of more query rows than the host takes (a prefill in a graph of dynamic
        shapes), or of shapes its kernel does not take: the cache's valid prefix copied to
        the device, the step's tokens written there and to the host, torch's attention, as
        the graph had it."""
        self.on_device.append(layer)
        rep = query.shape[1] // keys.shape[1]
        if query.device.type != "cuda":
            keys.index_copy_(2, index, key)
            values.index_copy_(2, index, value)
            full = keys, values
        else:
            start = int(index.min()) if index.numel() else 0
            full = []
            for cache, new in ((keys, key), (values, value)):
                host = runtime.pinned[cache.data_ptr()]()
                there = torch.zeros(cache.shape, dtype=cache.dtype, device=query.device)
                copies.fill_known(host, there, start)       # by the copy engine, row by row
                there.index_copy_(2, index, new)
                cache.index_copy_(2, index, new)    # the host: through its mapped address
                full.append(there)
        k, v = (t.repeat_interleave(rep, 1) if rep > 1 else t for t in full)
        # contiguous, as the op's fake declares (a GPU's kernels return other strides)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask,
                                              scale=scale).contiguous()

    def run(self, runtime, layer: int, query, key, value, index, keys, values, mask,
            scale) -> torch.Tensor:
        if query.shape[1] // keys.shape[1] * query.shape[2] > self.rows or \
                kernel.unsupported(query.shape, keys.shape, values.shape, keys.dtype):
            return self.device_path(runtime, layer, query, key, value, index, keys, values,
                                    mask, scale)
        keys.index_copy_(2, index, key)         # the host cache: through its mapped address
        values.index_copy_(2, index, value)     # on a GPU, in place on a CPU
        q = query.float().contiguous()
        bias = None
        if mask is not None:
            full = (keys.shape[0], mask.shape[1], query.shape[2], keys.shape[2])
            bias = mask.expand(full)
            bias = torch.zeros(full, device=mask.device).masked_fill(~bias, float("-inf")) \
                if mask.dtype == torch.bool else bias.float().contiguous()
        per_token = sum(t.numel() // t.shape[2] * t.element_size() for t in (keys, values))
        if query.device.type == "cuda":     # queued on a stream: the thread never waits
            if self._jobs is None:
                self._jobs = _Jobs(query.device)
            host_k, host_v = (runtime.pinned[t.data_ptr()]() for t in (keys, values))
            out, record = self._jobs.run(layer, q, bias, index.reshape(-1).long(), host_k,
                                         host_v, scale, fixed=self.graphs)
            if capturing():     # its replays run no Python: what they read, from the record
                if not any(r is record for _, r, _ in self.recorded):
                    self.recorded.append((layer, record, per_token))
            else:
                self._layers.append(layer)
                self._queued.append((record, per_token))
            return out.to(query.dtype)
        self._layers.append(layer)
        tokens = int(index.max()) + 1 if index.numel() else 0
        if bias is None or (tokens < keys.shape[2] and
                            not torch.isneginf(bias[..., tokens:]).all()):
            tokens = keys.shape[2]              # the attention reads further: the whole cache
        out = kernel.attend(kernel.library(), q, keys, values, tokens, bias, scale)
        self._read += tokens * per_token
        return out.to(query.dtype)
