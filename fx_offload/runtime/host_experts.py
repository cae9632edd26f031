"""The ``host_experts`` op at run time (option ``host_compute``): a routed MoE layer's experts
computed on the host from their weights' host block, or streamed, call by call.

On the host (``"always"``, or ``"auto"`` where :func:`prefers_host` says so)::

    x, ids, gates -> staging (page-locked on CUDA)     device to host, stream-ordered
    synchronize the compute stream                      one host wait per layer and call
    y = kernels.routed_experts(x, ids, gates, gate_up_host, down_host)    the host's cores
    y -> the device                                      host to device, stream-ordered

The expert tensors' chunk is not copied for such a call (its prefetch is skipped, see
:meth:`HostExperts.skips`).  An experts module of another layout or activation runs its own
``forward`` on the host tensors instead.  Streamed, the op does what the graph did without
it: a routed wait for each chunk (the picked experts cross the link, or the whole chunk was
prefetched), then the experts module's own ``forward``, whose parameters point at the slot
during a call.

``"auto"``'s rule, per layer and call, from the call's tokens ``T`` (top-``k`` of ``E``
experts of ``b`` bytes each)::

    bytes  = E * expected_share(E, k, T) * b      the distinct experts the call picks
    host   = bytes / host read rate + 2 * T * k * (b / element size) / host FLOP rate
             + host latency (a round trip and a kernel launch on tiny tensors)
    stream = bytes / link rate                    (E * b where the chunk moves whole)
    host computes when host < stream

Decode (few tokens) reads few experts once each, which the host's memory serves faster
than the link; a prompt's many tokens make the host's arithmetic the cost, so it streams.
The rates come from :mod:`fx_offload.host_compute.rates` (measured once per machine and
cached beside the device's rates).
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from ..copy_rules import WHOLE_ABOVE, expected_share
from ..errors import OffloadError
from ..host_compute import kernels
from ..host_compute.rates import host_rates
from .contents import capturing
from .phase import Phase

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


def prefers_host(tokens: int, k: int, experts: int, expert_bytes: int, element_size: int,
                 link_rate: float, host) -> bool:
    """``"auto"``'s rule (the module's docstring): host time below stream time.  ``host``:
    :class:`~fx_offload.host_compute.rates.HostRates`."""
    share = expected_share(experts, k, max(tokens, 1))
    picked = experts * share * expert_bytes
    host_time = picked / host.read_rate + \
        2 * tokens * k * (expert_bytes / element_size) / host.flop_rate + host.latency
    streamed = picked if share <= WHOLE_ABOVE else experts * expert_bytes
    return host_time < streamed / link_rate


class _Layer:
    """One layer's experts module and what its host computation needs."""

    def __init__(self, module: nn.Module, params, masters, experts: int):
        self.module = module
        self.host = {p.attr: masters[p.suffix] for p in params}     # attribute -> host view
        self.experts = experts
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self.dtype = next(iter(self.host.values())).dtype
        self.element_size = next(iter(self.host.values())).element_size()
        self.fused = _fused_silu(module, self.host, experts)


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
        self.ran: dict[int, str] = {}           # layer -> "host" or "device", latest call
        self.read_bytes = 0                     # host memory the latest call's kernels read

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
        self.ran, self.read_bytes = {}, 0
        if self.mode == "auto" and tokens and self._k and self._layers:
            layer = next(iter(self._layers.values()))
            self.on_host_now = self._prefers(layer, tokens, self._k)

    def skips(self, layer: int, chunk) -> bool:
        """The prefetch of ``layer``'s ``chunk`` copies nothing: its experts are predicted
        to run on the host in this call."""
        choice = self._state.choice
        return self.on_host_now and choice.hosting.get(layer) == "host" and \
            choice.routing.get(layer, {}).get(chunk.index) == "routed"

    def run(self, layer: int, chunks, x: torch.Tensor, ids: torch.Tensor,
            gates: torch.Tensor) -> torch.Tensor:
        """The op's kernel: ``layer``'s experts on ``x``, here or there."""
        state = self._state
        entry = self._layer(layer, chunks)
        tokens, k = x.shape[0], ids.shape[-1] if ids.dim() else 1
        self._k = k
        if state.phase is Phase.RESTORED:
            return _laid_out_as(x, entry.module(x, ids, gates))
        host = self.mode == "always" or (not capturing() and self._prefers(entry, tokens, k))
        if host:
            self.refuse_capture()
        if not host:
            for chunk in chunks:
                state.wait_routed(layer, chunk, ids)
            self.ran[layer] = "device"
            return _laid_out_as(x, entry.module(x, ids, gates))
        self.ran[layer] = "host"
        return self._on_host(entry, x, ids, gates)

    def _on_host(self, entry: _Layer, x, ids, gates) -> torch.Tensor:
        xh, idh, gh = (self._stage(t, i) for i, t in enumerate((x, ids, gates)))
        if x.device.type == "cuda":     # the staging copies land (one wait per layer)
            torch.cuda.current_stream(x.device).synchronize()
        picked = idh.unique()
        self.read_bytes += int(((picked >= 0) & (picked < entry.experts)).sum()) * \
            entry.expert_bytes
        if entry.fused:
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
        if entry is None:
            state = self._state
            suffixes = {s for c in chunks for s in state.choice.layout[layer][c].suffixes}
            params = [p for p in state.params[layer] if p.suffix in suffixes]
            experts = state.choice.experts[layer][params[0].suffix]
            entry = _Layer(params[0].owner, params, state.masters[layer], experts)
            self._layers[layer] = entry
        return entry

    def _prefers(self, entry: _Layer, tokens: int, k: int) -> bool:
        if self.mode == "always":
            return True
        if self._rates is None:
            self._rates = host_rates(self._state.device)
        host = self._rates
        return prefers_host(tokens, k, entry.experts, entry.expert_bytes, entry.element_size,
                            host.link_rate, host)

    def last_call(self) -> dict[int, str]:
        """Layer -> where its experts ran in the latest call ("host" or "device")."""
        return dict(self.ran)
