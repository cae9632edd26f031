"""``fx_offload.report(model)``: what was offloaded, how many bytes, which slots."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import kv, registry
from ..errors import OffloadError
from ..text import format_bytes, render_table


@dataclasses.dataclass(frozen=True)
class Report:
    model: str
    stack: str                         # dotted path of the layer list
    num_layers: int                    # layers in the stack
    layers: list[int]                  # offloaded layer indices, ascending
    params: dict[int, list[str]]       # layer -> full dotted names of its offloaded parameters
    offloaded_bytes: int
    buffer_bytes: int
    num_slots: int
    device: str
    slot_of: dict[int, int]
    refill_of: dict[int, int | None]   # layer -> the layer copied into its slot after it
    layer_bytes: dict[int, int]
    pinned: bool
    options: str
    planner: object = None             # the planner's result under memory_budget, else None
    circular: str = "end"              # where each slot's first layer is copied back in for
    #                                    the next call: "end", "entry" or "either" (per call)
    circular_text: str = ""            # the same in words, with the per-call choice now
    # compress="lossless": per layer, the bytes one copy moves across the link (compressed
    # chunks' records, the rest raw), and the host memory its compressed copy takes
    call_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    compressed_host_bytes: int = 0
    # the codec of the records: "nvCOMP ANS" (on a GPU with nvCOMP installed) or "fx_offload"
    codec: str = ""
    # of the offloaded bytes, those kept in files rather than in host memory (compressed
    # layers' uncompressed weights: option uncompressed_weights)
    uncompressed_in_file_bytes: int = 0
    # bytes that crossed the link in the most recent call: its copies and gathered expert
    # rows, a CUDA graph's replayed ones included (counted on the device)
    copied_bytes_last_call: int = 0
    # MoE layers: layer -> how its expert tensors move ("routed (128 experts)": only the
    # experts its tokens picked; "whole: <why>")
    experts: dict[int, str] = dataclasses.field(default_factory=dict)
    # option expert_cache: (room in experts per routed layer, device bytes, bytes the last
    # call's picked experts found there instead of crossing the link, experts held now)
    expert_cache: tuple[int, int, int, int] | None = None
    # kv_cache="host": kv.summary() (host and slot bytes; the latest call's cache and what
    # a decode step at its length moves, kept until the next call)
    kv: dict = dataclasses.field(default_factory=dict)
    # routed MoE layers' other weights fetched ahead (runtime.experts.ahead): (buffers, their
    # device bytes, counted in buffer_bytes); None where there is no such ring
    ahead: tuple[int, int] | None = None
    # host_compute: routed MoE layer, or layer with a dense MLP -> where its experts or MLP
    # ran in the latest call ("host", "device", "split <m>": the device took each token's
    # first m picks and the cached ones; "host (CUDA graph)", "split <m> (CUDA graph)": a
    # replay's recorded job), or why they are no host op ("streamed: <why>",
    # "resident: <why>")
    ran_on: dict[int, str] = dataclasses.field(default_factory=dict)
    # bytes of host memory the latest call's host-computed experts and MLPs read in place
    # (beside copied_bytes_last_call, what crossed the link)
    host_read_bytes_last_call: int = 0
    # the latest call's host jobs, queued on the stream or replayed: (how many, bytes they
    # read, seconds they ran, seconds from the first one's start to the last one's end,
    # the Python thread's median seconds to queue one, the median seconds from a job's
    # launch to its start; both None where a CUDA graph's replay ran them all); None: none
    host_jobs_last_call: tuple[int, int, float, float, float | None,
                               float | None] | None = None
    # host_compute="auto": per call size (tokens), the timed calls' medians and what stays
    # (host_compute.trial), in words
    host_timing: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        """Device memory the offload saves: the slots and the expert cache take some back."""
        cache = 0 if self.expert_cache is None else self.expert_cache[1]
        return self.offloaded_bytes - self.buffer_bytes - cache

    # the names of the first releases, kept so that scripts reading them keep working
    slots = property(lambda self: self.num_slots, doc="The same as ``num_slots``.")
    target_of = property(lambda self: self.refill_of, doc="The same as ``refill_of``.")

    @property
    def compressed(self) -> bool:
        return bool(self.call_bytes)

    def __str__(self) -> str:
        rows = [("layer", "slot", "prefetches next", "params", "bytes")]
        if self.compressed:
            rows[0] += ("copied", "ratio")
        if self.experts:
            rows[0] += ("experts",)
        for layer in self.layers:
            refill = self.refill_of[layer]
            rows.append((str(layer), str(self.slot_of[layer]),
                         "-" if refill is None else f"layer {refill}",
                         str(len(self.params[layer])), format_bytes(self.layer_bytes[layer])))
            if self.compressed:
                moved = self.call_bytes[layer]
                rows[-1] += (format_bytes(moved),
                             f"{moved / max(self.layer_bytes[layer], 1):.3f}")
            if self.experts:
                rows[-1] += (self.experts.get(layer, "-"),)
        lines = [f"fx_offload report for {self.model}: {len(self.layers)} of {self.num_layers} "
                 f"layers of {self.stack or '<root>'!r} offloaded ({self.options})"]
        lines += render_table(rows, indent="  ", rule=True)
        if any(r is not None for r in self.refill_of.values()):
            lines.append("  circular prefetch (each slot's first layer, for the next call): "
                         + self.circular_text)
        host = "pinned host memory" if self.pinned else "host memory"
        ahead_text = "" if self.ahead is None else (
            f" and {self.ahead[0]} that fetch routed layers' other weights ahead "
            f"({format_bytes(self.ahead[1])})")
        in_file = self.uncompressed_in_file_bytes
        if in_file:
            host += " and files"
        lines.append(f"  offloaded to {host}: {format_bytes(self.offloaded_bytes)}; "
                     f"{self.num_slots} slot buffer(s)" + ahead_text +
                     f": {format_bytes(self.buffer_bytes)} on "
                     f"{self.device}" + ("" if self.expert_cache is None else
                                         " (and the expert cache below)") +
                     f"; device memory saved: {format_bytes(self.saved_bytes)}")
        if self.compressed:
            raw, moved = sum(self.layer_bytes.values()), sum(self.call_bytes.values())
            lines.append(f"  compressed (lossless, {self.codec} codec): the offloaded layers' "
                         "copies move "
                         f"{format_bytes(moved)} of their {format_bytes(raw)} ({moved / raw:.3f}"
                         "; call_bytes has each layer's); "
                         f"the compressed copies take {format_bytes(self.compressed_host_bytes)}"
                         " of host memory"
                         + (f"; of the uncompressed weights, {format_bytes(in_file)} are kept in "
                            "files (read from disk only when you read the weights) and "
                            f"{format_bytes(raw - in_file)} in host memory" if in_file
                            else " besides the weights"))
        if self.expert_cache is not None:
            rows, nbytes, hit, held = self.expert_cache
            lines.append(f"  expert cache: room for the {rows} most picked expert(s) of each "
                         f"routed layer on the device ({format_bytes(nbytes)}), {held} held "
                         f"now; the last call found {format_bytes(hit)} of its picked "
                         "experts there" + _cache_unread(self.ran_on))
        if self.copied_bytes_last_call:
            lines.append(f"  the last call copied {format_bytes(self.copied_bytes_last_call)}")
        if self.ran_on:
            lines.append(_host_line(self.ran_on, self.host_read_bytes_last_call))
            if self.host_jobs_last_call:
                lines.append(jobs_line(*self.host_jobs_last_call))
            for tokens, timing in self.host_timing.items():
                lines.append(f"    'auto' at {tokens} token(s) a call: {timing}")
        if self.planner is not None:
            lines.append(str(self.planner))
        if self.kv.get("plan"):
            lines.append(f"  {self.kv['plan']}")
        if self.kv.get("layers"):
            kv = self.kv
            lines.append(
                f"  KV cache on the host: layers {kv['layers']}, {format_bytes(kv['host_bytes'])}"
                f" in host memory, {kv['slots']} slot(s) = {format_bytes(kv['slot_bytes'])}; "
                f"at {kv['valid_tokens']} valid tokens a decode step copies "
                f"{format_bytes(kv['copied_per_step'])} in (blocks of {kv['block']} tokens) "
                f"and writes {format_bytes(kv['written_per_step'])} back")
            if kv.get("attended"):
                lines.append(
                    f"    attention over the host cache: the last call computed layers "
                    f"{kv['attended']} on the host, reading {format_bytes(kv['attended_read'])}"
                    " of the cache in place (those layers copy none of it)")
                if kv.get("attended_jobs"):
                    n, ran, span = kv["attended_jobs"]
                    lines.append(
                        f"    its {n} jobs on the host ran {ran * 1e3:.2f} ms at "
                        f"{kv['attended_read'] / max(ran, 1e-9) / 1e9:.1f} GB/s, over "
                        f"{span * 1e3:.2f} ms from the first one's start to the last one's "
                        "end (the rest: the host waited for the device between them)")
            if kv.get("attended_on_device"):
                lines.append(
                    f"    attention over the host cache: the last call computed layers "
                    f"{kv['attended_on_device']} on the device (more query rows than the host "
                    "takes: a prefill), copying each one's valid tokens in")
            for tokens, chosen in sorted(kv.get("hosting", {}).items(), key=str):
                why = sorted({w[len("streamed: "):] for w in chosen.values() if w != "host"
                              and w != "streamed: host_compute='never'"})
                if why:
                    at = "calls of dynamic shapes" if tokens == "dynamic" else \
                        f"{tokens} token(s) a call"
                    lines.append(f"    attention over the host cache at {at}: on the device "
                                 f"({'; '.join(why)})")
        return "\n".join(lines)


def _cache_unread(ran: dict[int, str]) -> str:
    """Why a replayed host job's layers found nothing in the expert cache: a recorded job
    computes every pick its plan leaves the host, cached or not (an eager call gives the
    cached ones to the device beside the host's job; a capture records no such share)."""
    replayed = _replayed(ran)
    if not replayed:
        return ""
    return (f" (layers {replayed} ran as a CUDA graph's host jobs, which compute every pick "
            "left to the host, cached or not; the cache serves the calls that stream)")


def _replayed(ran: dict[int, str]) -> list[int]:
    """The layers a CUDA graph's replay ran as recorded host jobs (split or not)."""
    return [layer for layer, r in ran.items() if r.endswith("(CUDA graph)")]


def _host_line(ran: dict[int, str], read: int) -> str:
    hosted = ("host", "host (CUDA graph)")
    where = {"host": [layer for layer, r in ran.items() if r in hosted],
             "device": [layer for layer, r in ran.items() if r == "device"]}
    replayed = _replayed(ran)
    split = {layer: r.split()[1] for layer, r in ran.items() if r.startswith("split ")}
    line = ("  host compute: the last call computed the experts or MLPs of layers "
            f"{where['host'] + list(split)} on the host (reading {format_bytes(read)} of host "
            f"memory in place) and of layers {where['device']} on the device")
    if replayed:
        line += (f"; layers {replayed} by a CUDA graph's replay (host jobs it recorded; "
                 "their reads from the jobs' records)")
    if split:
        line += ("; split with the device (each token's first picks, and those the expert "
                 "cache holds): " + ", ".join(f"layer {layer} {m}" for layer, m in
                                               split.items()))
    streamed = {layer: r for layer, r in ran.items()
                if r not in (*hosted, "device") and layer not in split}
    if streamed:
        line += "; " + "; ".join(f"layer {layer} {r}" for layer, r in streamed.items())
    return line


def jobs_line(count: int, nbytes: int, ran: float, span: float, queueing: float | None,
              ahead: float | None) -> str:
    """``host_jobs_last_call`` in words (the report's line; the ``moe`` benchmark prints it
    per batch)."""
    rate = f", reading {nbytes / ran / 1e9:.1f} GB/s" if ran > 0 else ""
    line = (f"    its {count} host job(s) on the stream ran {ran * 1e3:.2f} ms{rate}; "
            f"{max(span - ran, 0.0) * 1e3:.2f} ms passed between them (the device's work "
            "between them, the round trips, and any wait for the Python thread's launches); ")
    if queueing is None:
        return line + "a CUDA graph's replay launched them (no Python between them)"
    return line + (f"the Python thread took {queueing * 1e3:.2f} ms to queue one and "
                   f"launched it {ahead * 1e3:.2f} ms before it began (medians; near 0: the "
                   "thread's launches pace the jobs)")


def _ran_on(state) -> dict[int, str]:
    """Layer -> where its experts or dense MLP ran in the latest call, or why they always
    stream."""
    host = getattr(state, "host_experts", None)
    if host is None:
        return {}
    ran = host.last_call()
    return {layer: ran.get(layer, "-" if why == "host" else why)
            for layer, why in sorted(state.learned.hosting.items())}


def _host_timing(state) -> dict[int, str]:
    """Call size -> ``host_compute="auto"``'s timed plans there, in words."""
    host = getattr(state, "host_experts", None)
    timer = getattr(host, "timer", None)
    return {} if timer is None else timer.summary()


def _copied(state) -> int:
    """Bytes the last call moved: its copies (those a replayed CUDA graph ran counted on the
    device) and the expert rows it gathered (counted on the device too); reading them waits
    for the device."""
    if state.buffers is None:
        return 0
    gathered = getattr(state, "routed", None)
    extra = 0 if gathered is None or gathered.gathered is None else int(gathered.gathered)
    return state.buffers.copied_bytes() + extra


def _expert_cache(state) -> tuple[int, int, int, int] | None:
    routed = getattr(state, "routed", None)
    cache = None if routed is None else routed.cache
    if cache is None or not cache.tensors:
        return None
    return cache.rows, cache.nbytes, int(routed.cached_bytes), cache.held_now()


def experts_moved(choice, routing, routed=None) -> dict[int, str]:
    """Layer -> how its expert tensors move, in words, from ``routing`` (what the pass
    found: :class:`~fx_offload.learned.Learned`) (with ``routed``, the state's
    :class:`~fx_offload.runtime.experts.routed.RoutedExperts`: how many the latest call gathered,
    and how many of them its expert cache held)."""
    found = {}
    last = routed.gathered_last_call() if routed is not None and choice.experts else {}
    for layer, tensors in choice.experts.items():
        outcome = routing.get(layer)
        count = max(tensors.values())
        if not outcome:
            found[layer] = f"{count} experts; routed if a graph reads them by its router"
            continue
        why = [w for w in outcome.values() if w != "routed"]
        picked, hits = last.get(layer, (0, 0))
        gathered = "" if not picked else f"; {picked} gathered in the last call" + (
            f", {hits} of them from the expert cache" if hits else "")
        found[layer] = f"routed ({count} experts{gathered})" if not why else f"whole: {why[0]}"
    return found


def report(model: nn.Module) -> Report:
    """What is offloaded of ``model`` (or of the module ``torch.compile`` wrapped)."""
    model = registry.model_arg(model, "fx_offload.report")
    weights = _weights_report(model)
    runtime = kv.runtime_of(model)
    return weights if runtime is None else dataclasses.replace(weights, kv=kv.summary(runtime))


def _options_in_force(state) -> str:
    """The options the model was offloaded with, and the inner compiler of its latest
    compile (a model placed with one inner_backend may be compiled with another)."""
    placed = state.choice.options
    compiled = state.compiled_with
    if compiled is None or (compiled.inner_backend, compiled.mode) == \
            (placed.inner_backend, placed.mode):
        return placed.describe()
    mode = f", mode={compiled.mode!r}" if compiled.mode != "default" else ""
    return (f"{placed.describe(placement_only=True)}, "
            f"inner_backend={compiled.inner_backend!r}{mode}")


def _weights_report(model: nn.Module) -> Report:
    state = registry.state_for_model(model)
    if state is not None:
        choice = state.choice
        packed = None if state.buffers is None else state.buffers.compression
        return Report(
            model=choice.model_name, stack=choice.stack.path,
            num_layers=len(choice.stack.modules), layers=choice.layers,
            params={layer: [p.name for p in choice.params[layer]] for layer in choice.layers},
            offloaded_bytes=choice.offloaded_bytes, buffer_bytes=state.buffer_bytes,
            num_slots=choice.schedule.num_slots, device=str(choice.device),
            slot_of=dict(choice.schedule.slot_of), refill_of=dict(choice.schedule.refill_of),
            layer_bytes=choice.layer_bytes, pinned=state.pinned,
            options=_options_in_force(state), planner=choice.planner,
            circular=choice.schedule.circular, circular_text=state.circular.describe(),
            call_bytes=packed.call_bytes() if packed else {},
            compressed_host_bytes=packed.compressed_host_bytes if packed else 0,
            codec=packed.codec_names() if packed else "",
            uncompressed_in_file_bytes=packed.in_file_bytes if packed else 0,
            copied_bytes_last_call=_copied(state),
            experts=experts_moved(choice, state.learned.routing, getattr(state, "routed", None)),
            expert_cache=_expert_cache(state),
            ahead=None if getattr(state, "ahead", None) is None else
            (len(state.ahead.ring), state.ahead.nbytes),
            ran_on=_ran_on(state),
            host_read_bytes_last_call=0 if getattr(state, "host_experts", None) is None
            else state.host_experts.read_bytes,
            host_jobs_last_call=None if getattr(state, "host_experts", None) is None
            else state.host_experts.jobs_timed,
            host_timing=_host_timing(state))
    kept = registry.nothing_offloaded(model)
    if kept is not None:
        return Report(model=kept.model_name, stack=kept.stack.path,
                      num_layers=len(kept.stack.modules), layers=[], params={},
                      offloaded_bytes=0, buffer_bytes=0, num_slots=0, device="-", slot_of={},
                      refill_of={}, layer_bytes={}, pinned=False,
                      options=kept.options.describe(), planner=kept.planner)
    part = registry.part_of_offloaded(model, "fx_offload.report")
    if part is not None:
        raise part
    hint = ""
    if hasattr(model.__dict__.get("forward"), "_torchdynamo_orig_callable"):
        # its forward is compiled (compile_forward) and was called, yet never reached the
        # backend: Dynamo gives up on a code object after config.recompile_limit entries,
        # which each model of one class compiled in the process adds to, and runs it eagerly
        hint = ("; its forward is compiled, so if it has run, Dynamo may have run it "
                "uncompiled: every model of one class compiled in a process adds to the "
                "compiled entries of one code object, and past torch._dynamo.config."
                f"recompile_limit ({torch._dynamo.config.recompile_limit}) Dynamo stops "
                "compiling it (its log says 'hit config.recompile_limit'). Call "
                "torch._dynamo.reset() before compiling another model, or raise that limit")
    elif callable(getattr(model, "generate", None)):
        hint = ("; `compiled.generate(...)` on a torch.compile wrapper runs the uncompiled "
                "forward: compile the forward itself, fx_offload.compile_forward(model, ...)")
    raise OffloadError(
        f"{type(model).__name__} has no offloaded weights; compile it with "
        "backend='prefetch_offload' and run it once first (compilation happens at the first "
        f"call), or it was restored{hint}", where="fx_offload.report")
