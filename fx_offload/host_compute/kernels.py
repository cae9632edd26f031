"""Kernels that compute with weights in host memory on the host's cores.

``routed_experts`` runs a token's routed experts (a Qwen3-MoE layer's, rows ``[gate; up]``
of ``gate_up`` then ``down``) and ``linear`` a dense layer, both reading the weights where
they are (bf16, fp16 or fp32) and accumulating every product in fp32; both return fp32.

Paths (``path=``; ``None`` picks per shape, see :func:`pick`):

``loops``
    a C kernel built for this CPU on first use (:mod:`.native`): one parallel region per
    matmul over blocks of rows of every routed expert together; each weight is read once,
    widened to fp32 in registers and meets every token routed to its expert there.  It asks
    for the weights 4 KiB ahead of the row being read (software prefetch, see
    ``native.PREFETCH``).
``loops-hardware``
    ``loops`` without the software prefetch: the hardware's prefetcher alone, to compare.
``upcast``
    each distinct expert's weights converted to fp32, then torch's fp32 matmuls (MKL).
    Exact fp32 accumulation, but the conversion writes and reads the expert again.
``native``
    torch's ``F.linear`` in the weights' own dtype (oneDNN for bf16, AMX where present);
    its outputs are rounded to that dtype between the two matmuls of an expert.
``inductor`` (experts only)
    the experts as gathers and reductions compiled by Inductor's C++ backend
    (:mod:`.compiled`): fused, vectorized and parallel, but each (token, slot) pair reads
    its expert, so an expert picked by two tokens is read twice.

The choice: ``loops`` everywhere, except fp32 weights at one token, where MKL's fp32
matrix-vector product (``native``) reads at the memory's rate already.  Why: torch's paths
run one matmul after another, and at decode an expert's matmul (1.5 to 3 MiB) is too small
to keep every core busy; one region over the row blocks of all the experts keeps them all
streaming, each block handed to a thread as it frees up.  The paths' measured rates are in
docs/host_compute.md (Host kernels); ``python -m fx_offload host --paths all`` times them.

Threads: every path runs on torch's intra-op pool (OpenMP), whose size is
``torch.get_num_threads()``; torch sizes it to the physical cores by default and
``torch.set_num_threads(n)`` resizes it for these kernels as for every other CPU op.
:func:`host_threads` says its size now.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ..errors import OffloadError
from . import compiled as _compiled
from . import native as _native

log = logging.getLogger("fx_offload")

WHERE = "fx_offload.host_compute"
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
               "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu}
EXPERT_PATHS = ("upcast", "native", "loops", "loops-hardware", "inductor")
LINEAR_PATHS = ("upcast", "native", "loops", "loops-hardware")
# the 'loops' kernels and the bytes ahead of the weights they ask the memory for
LOOPS = {"loops": _native.PREFETCH, "loops-hardware": 0}


def host_threads() -> int:
    """The threads these kernels run on: torch's intra-op pool (``torch.get_num_threads()``,
    the physical cores unless ``torch.set_num_threads`` or ``OMP_NUM_THREADS`` said
    otherwise)."""
    return torch.get_num_threads()


def job_threads(spare: bool = True) -> int:
    """Threads of a job the stream runs: ``FX_OFFLOAD_HOST_THREADS`` where set, else torch's
    pool, less an eighth of it (at least one fewer) where ``spare``.  An experts job runs
    while the Python thread enqueues the next layers and the driver's threads serve the
    copies of the layers' other weights; a team on every core slows all three.  An attention
    job read the cache faster with every core, and the kernel probe that ``"auto"`` weighs
    runs with every core too (both measured: docs/host_compute.md, threads of a queued
    job)."""
    value = os.environ.get("FX_OFFLOAD_HOST_THREADS", "").strip()
    if value:
        try:
            if int(value) >= 1:
                return int(value)
        except ValueError:
            pass
        log.warning("fx_offload: FX_OFFLOAD_HOST_THREADS=%r is no count of threads (a whole "
                    "number of at least 1); using the default", value)
    pool = host_threads()
    return max(1, pool - max(1, pool // 8)) if spare else pool


def physical_cores() -> int:
    """The physical cores this process may run on (hyperthread siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("?", cpu))
    return len(cores) or (os.cpu_count() or 1)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                   path: str | None = None) -> torch.Tensor:
    """``sum_j gates[t, j] * down[e] @ (act(gate) * up)`` with ``gate, up = (gate_up[e] @
    x[t]).chunk(2)`` and ``e = ids[t, j]``, for every token ``t``: a (T, H) fp32 tensor.

    ``x`` (T, H) fp32/bf16/fp16, ``ids`` (T, k) integer expert ids, ``gates`` (T, k) float
    routing weights, ``gate_up`` (E, 2I, H) and ``down`` (E, H, I) in one of bf16, fp16,
    fp32, contiguous, all on the CPU.  An id outside ``[0, E)`` (such as the sentinel ``E``)
    contributes nothing."""
    _check_experts(x, ids, gates, gate_up, down, act, path)
    T, H = x.shape
    if T == 0 or ids.shape[1] == 0 or 0 in gate_up.shape:     # nothing to compute
        return torch.zeros(T, H, dtype=torch.float32)
    path = path or pick(T, gate_up.dtype, experts=True)
    lib = _native.library(LOOPS[path]) if path in LOOPS else None
    if lib is not None:
        return _native.experts(lib, x.float().contiguous(), ids.long().contiguous(),
                               gates.float().contiguous(), gate_up, down, act)
    if path == "inductor":
        return _compiled.experts(x.float(), ids.long(), gates, gate_up, down, act)
    if path == "upcast" or path in LOOPS:          # loops where the kernel cannot be built
        return per_expert(x, ids, gates, gate_up.shape[0], act,
                          lambda e, v: F.linear(v.float(), gate_up[e].float()),
                          lambda e, v: F.linear(v, down[e].float()))
    dt = gate_up.dtype
    return per_expert(x, ids, gates, gate_up.shape[0], act,
                      lambda e, v: F.linear(v.to(dt), gate_up[e]).float(),
                      lambda e, v: F.linear(v.to(dt), down[e]).float())


def per_expert(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, experts: int, act: str,
               first, second) -> torch.Tensor:
    """The routed experts one distinct expert after another, its matmuls by ``first(e, x)``
    (the (rows, 2I) ``[gate, up]`` outputs, fp32) and ``second(e, h)`` (rows, H) fp32: torch's
    paths, and the benchmark's with weights packed ahead."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    fn = ACTIVATIONS[act]
    valid = (ids >= 0) & (ids < experts)
    for e in torch.unique(ids[valid]).tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        g, u = first(e, x[rows]).chunk(2, -1)
        y = second(e, fn(g) * u)
        out.index_add_(0, rows, y * gates[rows, slot, None].float())
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           path: str | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in fp32: ``x`` (..., in), ``w`` (out, in) contiguous in bf16,
    fp16 or fp32, ``bias`` (out,) or None, all on the CPU."""
    _check_linear(x, w, bias, path)
    path = path or pick(x.numel() // max(x.shape[-1], 1), w.dtype, experts=False)
    b = None if bias is None else bias.float().contiguous()
    if 0 in w.shape or x.numel() == 0:      # torch's own answer: no rows to split up
        return F.linear(x.float(), w.float(), b)
    lib = _native.library(LOOPS[path]) if path in LOOPS else None
    if lib is not None:
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        return _native.linear(lib, x2, w, b).reshape(*x.shape[:-1], w.shape[0])
    if path == "upcast" or path in LOOPS or w.dtype == torch.float32:
        return F.linear(x.float(), w.float(), b)
    y = F.linear(x.to(w.dtype), w).float()
    return y if b is None else y + b


def pick(tokens: int, dtype: torch.dtype, experts: bool) -> str:
    """The path ``path=None`` takes for ``tokens`` tokens of weights in ``dtype``."""
    if dtype == torch.float32 and tokens == 1 and not experts:
        return "native"
    return "loops" if _native.library() is not None else "upcast"


def _fail(function: str, message: str) -> None:
    raise OffloadError(message, where=f"{WHERE}.{function}")


def _check_host(function: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(function, f"{name} must be a tensor, got {type(t).__name__}")
        if t is not None and t.device.type != "cpu":
            _fail(function, f"{name} is on {t.device}; these kernels compute on the host: "
                            "give tensors on the CPU")


def _check_weight(function: str, name: str, w: torch.Tensor, dims: int) -> None:
    if w.dim() != dims:
        _fail(function, f"{name} must have {dims} dimensions, got shape {tuple(w.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        _fail(function, f"{name} must be bf16, fp16 or fp32, got {w.dtype}")
    if not w.is_contiguous():
        _fail(function, f"{name} (shape {tuple(w.shape)}, strides {w.stride()}) is not "
                        "contiguous: a copy per call would cost more than the compute; call "
                        ".contiguous() once where the weights are placed")


def _check_path(function: str, path: str | None, known: tuple[str, ...]) -> None:
    if path is not None and path not in known:
        _fail(function, f"path must be None (the fastest for the shape) or one of "
                        f"{list(known)}, got {path!r}")


def _check_experts(x, ids, gates, gate_up, down, act, path) -> None:
    fn = "routed_experts"
    _check_host(fn, x=x, ids=ids, gates=gates, gate_up=gate_up, down=down)
    _check_weight(fn, "gate_up", gate_up, 3)
    _check_weight(fn, "down", down, 3)
    E, I2, H = gate_up.shape
    if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
        _fail(fn, f"gate_up (E, 2I, H) and down (E, H, I) disagree: got gate_up "
                  f"{tuple(gate_up.shape)} and down {tuple(down.shape)}")
    if down.dtype != gate_up.dtype:
        _fail(fn, f"gate_up and down must share a dtype, got {gate_up.dtype} and {down.dtype}")
    if x.dim() != 2 or x.shape[1] != H or not x.is_floating_point():
        _fail(fn, f"x must be a (tokens, {H}) float tensor, got {x.dtype} of shape "
                  f"{tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.is_floating_point() \
            or ids.dtype == torch.bool or ids.is_complex():
        _fail(fn, f"ids must be a ({x.shape[0]}, k) integer tensor, got {ids.dtype} of shape "
                  f"{tuple(ids.shape)}")
    if tuple(gates.shape) != tuple(ids.shape) or not gates.is_floating_point():
        _fail(fn, f"gates must be a float tensor of ids' shape {tuple(ids.shape)}, got "
                  f"{gates.dtype} of shape {tuple(gates.shape)}")
    if act not in ACTIVATIONS:
        _fail(fn, f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    _check_path(fn, path, EXPERT_PATHS)


def _check_linear(x, w, bias, path) -> None:
    fn = "linear"
    _check_host(fn, x=x, w=w, bias=bias)
    _check_weight(fn, "w", w, 2)
    if x.dim() < 1 or x.shape[-1] != w.shape[1] or not x.is_floating_point():
        _fail(fn, f"x must be a float tensor (..., {w.shape[1]}) for w of shape "
                  f"{tuple(w.shape)}, got {x.dtype} of shape {tuple(x.shape)}")
    if bias is not None and (tuple(bias.shape) != (w.shape[0],) or not bias.is_floating_point()):
        _fail(fn, f"bias must be a float tensor of shape ({w.shape[0]},), got "
                  f"{bias.dtype} of shape {tuple(bias.shape)}")
    _check_path(fn, path, LINEAR_PATHS)
