"""Options of the ``prefetch_offload`` backend: names, defaults and validation.

Every route into the backend (``options={...}``, a configured :func:`fx_offload.backend`
object, the bare backend name) ends in :func:`parse_options`, so all of them accept and
refuse exactly the same things.  Each refusal is an :class:`~fx_offload.errors.OffloadError`
(a ``ValueError``) that names the option and says what to change.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import operator
import os
import re
from typing import Any, Iterable, Mapping

from .errors import OffloadError
from .text import format_bytes

INNER_BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CIRCULAR_PREFETCH = ("auto", "end", "entry")
COMPRESS = ("none", "lossless")
EXPERTS = ("routed", "whole")
KV_CACHE = ("auto", "device", "host")
HOST_COMPUTE = ("auto", "never", "always")
KV_TILE = 16    # tokens: kv_block_size is a multiple of it (the attention kernels' key tiles
#                 are multiples of 16 tokens, so a block never splits one)


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """Validated options; see ``docs/usage.md`` for what each one does."""

    group_size: int = 2
    num_in_group: int = 1
    prefetch_step: int = 1
    offload_params: tuple[str, ...] | None = None
    layers: str | tuple[str, ...] | None = None    # one layer list, or several in run order
    inner_backend: str = "inductor"
    mode: str = "default"
    copy_chunks: int = 8        # a layer's copy is split into at most this many chunks
    circular_prefetch: str = "auto"     # where each slot's first layer is copied back in
    compress: str = "none"      # "lossless": bf16 weights cross the link compressed
    # where compressed layers' uncompressed weights live: "auto" (in a file in the temporary
    # folder where that is on a disk), "memory", or a folder (runtime.memory.file_backed)
    uncompressed_weights: str = "auto"
    experts: str = "routed"     # an MoE layer's experts: only those its tokens picked move
    # device bytes for each routed MoE layer's most-picked experts (runtime.experts.expert_cache);
    # "auto": what memory_budget's plan leaves of it, none without memory_budget
    expert_cache: int | str = "auto"
    # routed MoE layers' experts computed on the host, their weights read in place
    # (runtime.experts.host_experts): "auto" where predicted faster per call, "always", "never"
    host_compute: str = "auto"
    # the planner (used instead of group_size/num_in_group/prefetch_step)
    memory_budget: int | None = None
    plan_tokens: tuple[int, ...] | None = None
    flop_rate: float | None = None
    memory_bandwidth: float | None = None
    h2d_bandwidth: float | None = None
    launch_overhead: float | None = None
    # the KV cache (fx_offload.kv): a static cache's layers in host memory
    kv_cache: str = "auto"      # under memory_budget the planner may move layers (kv.host_layers)
    kv_layers: tuple[int, ...] | None = None    # None: every layer of the cache
    kv_block_size: int = 256    # tokens: the valid prefix crosses the link in whole blocks
    kv_slots: int = 2

    @property
    def planned(self) -> bool:
        """True when the planner chooses the layers and the slot count."""
        return self.memory_budget is not None

    @property
    def expert_cache_asked(self) -> int:
        """The device bytes ``expert_cache`` asks for (0: ``"auto"``, which takes only what
        the plan leaves)."""
        return 0 if self.expert_cache == "auto" else self.expert_cache

    @property
    def circular_start(self) -> str:
        """Where the circular prefetch starts (``fx_offload.schedule``): as asked, or under
        ``auto`` at the entry with CUDA graphs (``reduce-overhead``), whose captured forward
        waits for every copy it began before it ends, and otherwise chosen call by call
        (``"either"``) from what the caller does between calls."""
        if self.circular_prefetch != "auto":
            return self.circular_prefetch
        return "entry" if self.mode == "reduce-overhead" else "either"

    @property
    def hook_starts_entry(self) -> bool:
        """True when the model's call hook begins the entry refills, ahead of the graph (and
        of Dynamo's guards): wherever they exist.  Under CUDA graphs too: the hook's copies
        run outside the replayed graph, which waits for them through external events
        (``runtime.memory.contents.Pending.by_hook``), so they overlap the guards and the launch."""
        return self.circular_start != "end"

    def host_compute_in(self, device_type: str, mode: str) -> str:
        """What ``host_compute`` means for a graph compiled for ``device_type`` in ``mode``:
        "auto" is "never" on a CPU (there is no link to spare) and with compress (not
        combined yet).  Under CUDA graphs (``reduce-overhead``) a capture records routed
        experts as host jobs (``runtime.experts.host_experts``); dense MLPs stream there
        (:meth:`mlps_on_host_in`)."""
        if self.host_compute == "auto" and (device_type == "cpu" or self.compress != "none"):
            return "never"
        return self.host_compute

    def mlps_on_host_in(self, device_type: str, mode: str) -> bool:
        """Dense MLPs become host ops: as routed experts, but not under CUDA graphs (a
        capture of their op streams, and so must its prefetches: not recorded yet)."""
        return self.host_compute_in(device_type, mode) != "never" and \
            mode != "reduce-overhead"

    def offloads_layer(self, index: int) -> bool:
        """True for the last ``num_in_group`` layers of each group of ``group_size``."""
        return index % self.group_size >= self.group_size - self.num_in_group

    def placement_key(self) -> tuple:
        """The options that decide what is offloaded and where; the inner compiler is not
        part of it, so one model may be compiled by several inner backends."""
        return tuple(getattr(self, name) for name in PLACEMENT_KEYS)

    def describe(self, placement_only: bool = False) -> str:
        if self.planned:
            parts = [f"memory_budget={format_bytes(self.memory_budget, as_option=True)}"]
            parts += [f"{name}={getattr(self, name)!r}" for name in PLANNER_KEYS[1:]
                      if getattr(self, name) is not None]
        else:
            parts = [f"group_size={self.group_size}", f"num_in_group={self.num_in_group}",
                     f"prefetch_step={self.prefetch_step}"]
        if self.offload_params is not None:
            parts.append(f"offload_params={list(self.offload_params)}")
        if self.layers is not None:
            shown = self.layers if isinstance(self.layers, str) else list(self.layers)
            parts.append(f"layers={shown!r}")
        parts += [f"{name}={getattr(self, name)!r}" for name in _SHOWN_WHEN_SET
                  if getattr(self, name) != getattr(OffloadOptions, name)]
        if self.expert_cache_asked:
            parts.append(f"expert_cache={format_bytes(self.expert_cache, as_option=True)}")
        if self.host_compute != OffloadOptions.host_compute:
            parts.append(f"host_compute={self.host_compute!r}")
        if self.kv_cache != OffloadOptions.kv_cache:
            parts.append(f"kv_cache={self.kv_cache!r}, kv_block_size={self.kv_block_size}, "
                         f"kv_slots={self.kv_slots}")
            if self.kv_layers is not None:
                parts.append(f"kv_layers={list(self.kv_layers)}")
        if placement_only:
            return ", ".join(parts)
        parts.append(f"inner_backend={self.inner_backend!r}")
        if self.mode != "default":
            parts.append(f"mode={self.mode!r}")
        return ", ".join(parts)


VALID_KEYS = tuple(f.name for f in dataclasses.fields(OffloadOptions))
PLANNER_KEYS = ("memory_budget", "plan_tokens", "flop_rate", "memory_bandwidth",
                "h2d_bandwidth", "launch_overhead")
HAND_PICKED_KEYS = ("group_size", "num_in_group", "prefetch_step")
# described only where they differ from the default, in this order
_SHOWN_WHEN_SET = ("copy_chunks", "circular_prefetch", "compress", "uncompressed_weights",
                   "experts")
PLACEMENT_KEYS = HAND_PICKED_KEYS + ("offload_params", "layers", "copy_chunks",
                                     "circular_prefetch", "compress", "uncompressed_weights",
                                     "experts", "expert_cache", "host_compute") + PLANNER_KEYS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e\+?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def as_int(value: Any) -> int | None:
    """``value`` as an int where it is one: an int, or anything else that says it is a whole
    number through ``__index__`` (numpy's integers, a one-element integer tensor); None for
    anything else, and for a bool (True is not a count)."""
    if isinstance(value, bool):     # (numpy's bool has no __index__)
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def parse_size(name: str, value: Any) -> int:
    """Bytes from an int (or a whole float, ``40e9``; numpy's numbers too) or a string such
    as ``"40GiB"``, ``"512 MiB"``, ``"1.5e9"``."""
    whole = as_int(value)
    if whole is None and isinstance(value, numbers.Real) and not isinstance(value, bool) \
            and math.isfinite(value) and float(value).is_integer():
        whole = int(value)
    if whole is not None and whole >= 1:
        return whole
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            size = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if size >= 1 and math.isfinite(size):
                return int(size)
    raise OffloadError(
        f"option {name!r} must be a positive number of bytes (an int) or a "
        f"string such as '40GiB', '512MiB' or '2.5GB', got {value!r}")


def _check_rate(name: str, value: Any, unit: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value > 0):
        raise OffloadError(
            f"option {name!r} must be a positive number ({unit}), "
            f"got {value!r}")
    return float(value)


def _check_plan_tokens(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = (value,) if as_int(value) is not None else value
    try:
        values = tuple(as_int(v) for v in values)
    except TypeError:
        values = ()
    if not values or any(v is None or v < 1 for v in values):
        raise OffloadError(
            "option 'plan_tokens' must be a token count >= 1 or a list of "
            f"them (the workload the plan is chosen for), got {value!r}")
    return tuple(sorted(set(values)))


def _check_int(name: str, value: Any, minimum: int) -> int:
    given, value = value, as_int(value)
    if value is None:
        raise OffloadError(
            f"option {name!r} must be an int >= {minimum}, "
            f"got {given!r} of type {type(given).__name__}")
    if value < minimum:
        raise OffloadError(
            f"option {name!r} must be >= {minimum}, got {value}")
    return value


def _check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise OffloadError(
            f"option {name!r} must be one of {list(choices)}, got {value!r}")
    return value


def _check_meaning(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> None:
    """A choice among ``choices``, refused with what they mean."""
    if value not in choices:
        raise OffloadError(f"option {name!r} must be one of {list(choices)} ({meaning}), "
                           f"got {value!r}")


UNCOMPRESSED_WEIGHTS = ("option 'uncompressed_weights' says where compress='lossless' keeps "
                        "the uncompressed weights: 'auto' (a file in the temporary folder, "
                        "where that is on a disk), 'memory', or a folder on a disk")


def _check_uncompressed(value: Any) -> str:
    """``uncompressed_weights``: "auto", "memory" or a folder (a str or a path), returned as
    its absolute path.  That the folder exists is checked where a file is made
    (``runtime.memory.file_backed.folder_for``): a recompile of a model already offloaded must not
    fail because the folder went away since."""
    if value in ("auto", "memory"):
        return value
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise OffloadError(f"{UNCOMPRESSED_WEIGHTS}; got {value!r}")
    return os.path.abspath(os.fspath(value))


def _check_offload_params(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise OffloadError(
            "option 'offload_params' must be an iterable of parameter-name "
            f"segments such as ['w13_weight'], not the single string {value!r}: "
            f"write [{value!r}]")
    try:
        names = tuple(value)
    except TypeError:
        raise OffloadError(
            "option 'offload_params' must be an iterable of str, "
            f"got {type(value).__name__}") from None
    if not names:
        raise OffloadError(
            "option 'offload_params' is empty, so nothing would be "
            "offloaded: leave it out to offload every parameter of the chosen layers")
    for name in names:
        if not isinstance(name, str) or not name or name.startswith(".") or name.endswith("."):
            raise OffloadError(
                "option 'offload_params' entries must be non-empty dotted "
                f"names such as 'w13_weight' or 'mlp.experts.w2_weight', got {name!r}")
    return names


def parse_options(options: Mapping[str, Any] | None = None, *, mode: str | None = None,
                  ) -> OffloadOptions:
    """Validate user options (and torch.compile's own ``mode=``) into :class:`OffloadOptions`."""
    if options is not None and not isinstance(options, Mapping):
        raise OffloadError(f"options must be a dict of option names to values, such as "
                           f"{{'group_size': 4}}, got {type(options).__name__} {options!r}")
    options = dict(options or {})
    unknown = sorted((k for k in options if k not in VALID_KEYS), key=repr)
    if unknown:
        hints = [f"{k!r}: did you mean {near[0]!r}?" for k in unknown if isinstance(k, str)
                 for near in [difflib.get_close_matches(k.replace("-", "_").lower(),
                                                        VALID_KEYS, n=1)] if near]
        if "options" in unknown:
            hints.append("'options': give the options themselves as keywords, "
                         "backend(**options)")
        raise OffloadError(
            f"unknown option(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
            + f"; valid options are {list(VALID_KEYS)}")
    # an option given as None is left at its default, as for every option alike
    options = {k: v for k, v in options.items() if v is not None}
    if mode is not None and options.get("mode") not in (None, mode):
        raise OffloadError(
            f"got mode={mode!r} from torch.compile and "
            f"mode={options['mode']!r} in its options: give the mode once")
    if mode is not None:
        options["mode"] = mode

    planner = _check_planner_options(options)
    group_size = _check_int("group_size", options.get("group_size", 2), 1)
    num_in_group = _check_int("num_in_group", options.get("num_in_group", 1), 1)
    if num_in_group > group_size:
        raise OffloadError(
            f"option 'num_in_group' ({num_in_group}) must not exceed "
            f"'group_size' ({group_size}): it counts the offloaded layers in each group")
    prefetch_step = _check_int("prefetch_step", options.get("prefetch_step", 1), 1)
    copy_chunks = _check_int("copy_chunks", options.get("copy_chunks", 8), 1)
    circular = _check_choice("circular_prefetch", options.get("circular_prefetch", "auto"),
                             CIRCULAR_PREFETCH)
    compress = options.get("compress", "none")
    _check_meaning("compress", compress, COMPRESS,
                   "'lossless': bfloat16 weights cross the link compressed and are decoded on "
                   "the device, bitwise the same")
    uncompressed = _check_uncompressed(options.get("uncompressed_weights", "auto"))
    if uncompressed != "auto" and compress != "lossless":
        raise OffloadError(
            f"option 'uncompressed_weights' ({uncompressed!r}) applies with "
            "compress='lossless' only: uncompressed layers are copied from their weights, "
            "which stay in page-locked host memory. Add compress='lossless' or drop it")
    experts = options.get("experts", "routed")
    _check_meaning("experts", experts, EXPERTS,
                   "'routed': an MoE layer's expert tensors move only the experts its tokens "
                   "were routed to; 'whole': every expert, every call")
    expert_cache = _check_expert_cache(options, experts)
    inner_backend = _check_choice("inner_backend", options.get("inner_backend", "inductor"),
                                  INNER_BACKENDS)
    mode_name = _check_choice("mode", options.get("mode") or "default", MODES)
    if mode_name != "default" and inner_backend != "inductor":
        raise OffloadError(
            f"option 'mode' ({mode_name!r}) is an Inductor mode, but "
            f"inner_backend is {inner_backend!r}: drop the mode or use inner_backend='inductor'")
    host_compute = _check_host_compute(options, experts, expert_cache, compress, mode_name)
    layers = options.get("layers")
    if isinstance(layers, (list, tuple)) and layers and all(isinstance(p, str) for p in layers):
        layers = layers[0] if len(layers) == 1 else tuple(layers)
    elif layers is not None and not isinstance(layers, str):
        raise OffloadError(
            "option 'layers' must be the dotted path of the layer list, such as "
            "'model.layers', or a list of paths of lists that run one after the other, such "
            f"as ['encoder.block', 'decoder.block'], got {layers!r}")
    return OffloadOptions(
        group_size=group_size,
        num_in_group=num_in_group,
        prefetch_step=prefetch_step,
        offload_params=_check_offload_params(options.get("offload_params")),
        layers=layers,
        inner_backend=inner_backend,
        mode=mode_name,
        copy_chunks=copy_chunks,
        circular_prefetch=circular,
        compress=compress,
        uncompressed_weights=uncompressed,
        experts=experts,
        expert_cache=expert_cache,
        host_compute=host_compute,
        **planner,
        **_check_kv_options(options),
    )


def _check_expert_cache(options: Mapping[str, Any], experts: str) -> int | str:
    value = options.get("expert_cache", "auto")
    if value == "auto":
        return value
    if _is_zero(value):
        return 0
    try:
        size = parse_size("expert_cache", value)
    except OffloadError:
        raise OffloadError(
            "option 'expert_cache' must be 'auto' (what memory_budget's plan leaves of it; "
            "none without memory_budget), 0 (none), or a positive number of bytes (an int) "
            f"or a string such as '4GiB', '512MiB' or '2.5GB', got {value!r}") from None
    if experts != "routed":
        raise OffloadError(
            f"option 'expert_cache' ({format_bytes(size, as_option=True)}) keeps the most "
            "picked experts of each routed MoE layer on the device, and applies with "
            f"experts='routed' only, got experts={experts!r}: drop one of them")
    return size


def _check_host_compute(options: Mapping[str, Any], experts: str, expert_cache, compress: str,
                        mode: str) -> str:
    """``host_compute``: "auto", "never" or "always"; "always" refused where it cannot hold
    for every call (CUDA graphs cannot capture a host computation) or where what it would
    leave unused was asked for (the expert cache, the compressed copies)."""
    value = options.get("host_compute", "auto")
    _check_meaning("host_compute", value, HOST_COMPUTE,
                   "'always': routed MoE layers' experts and dense gated MLPs are computed on "
                   "the host's cores from their weights in host memory, only activations cross "
                   "the link; 'auto': "
                   "where that is predicted faster, call by call; 'never': their weights "
                   "stream to the device")
    if value != "always":
        return value
    if experts != "routed":
        raise OffloadError(
            "option host_compute='always' computes routed MoE layers' experts on the host, "
            f"and applies with experts='routed' only, got experts={experts!r}: drop one of "
            "them")
    check_host_compute_mode(value, mode, options.get("kv_cache", "auto"))
    if expert_cache not in ("auto", 0):
        raise OffloadError(
            f"option expert_cache ({format_bytes(expert_cache, as_option=True)}) keeps "
            "experts on the device for the calls that stream them, but host_compute="
            "'always' streams none: drop expert_cache, or use host_compute='auto'")
    if compress != "none":
        raise OffloadError(
            f"option compress={compress!r} compresses what crosses the link, which "
            "host_compute='always' does not combine with yet: drop one of them")
    return value


def check_host_compute_mode(host_compute: str, mode: str, kv_cache: str = "auto") -> None:
    """Refuse host_compute='always' under CUDA graphs (also where the model was placed with
    it and a later compile asks for mode='reduce-overhead'), but with kv_cache='host': a
    capture records the attention over the host cache as host jobs (the experts and MLPs
    'always' would take are refused at their capture, by the runtime)."""
    if host_compute == "always" and mode == "reduce-overhead" and kv_cache != "host":
        raise OffloadError(
            "option host_compute='always' runs the experts on the host in every call, which "
            "CUDA graphs (mode='reduce-overhead') do not promise: use host_compute='auto' "
            "(a capture records the routed experts as host jobs where its rule keeps them on "
            "the host, and streams the rest) or another mode")


def _is_zero(value: Any) -> bool:
    """``value`` is a size of nothing: ``0``, ``0.0``, ``"0"``, ``"0B"``, ``"0 GiB"``."""
    if isinstance(value, bool):
        return False
    if as_int(value) is not None or isinstance(value, numbers.Real):
        return value == 0
    match = _SIZE.match(value) if isinstance(value, str) else None
    return bool(match and match.group(2).lower() in _UNITS and float(match.group(1)) == 0)


def _check_kv_options(options: Mapping[str, Any]) -> dict[str, Any]:
    kv_cache = options.get("kv_cache", "auto")
    _check_meaning("kv_cache", kv_cache, KV_CACHE,
                   "'host': a static KV cache's layers live in page-locked host memory and "
                   "stream through device slots; 'device': it stays on the device; 'auto': "
                   "on the device unless memory_budget leaves it too little")
    if "kv_layers" in options and kv_cache != "host":
        raise OffloadError("option 'kv_layers' only applies with kv_cache='host' (under "
                           "memory_budget, kv_cache='auto' chooses the layers): give "
                           "kv_cache='host' too, or leave kv_layers out")
    given = [k for k in ("kv_block_size", "kv_slots") if k in options]
    if given and not (kv_cache == "host" or
                      (kv_cache == "auto" and options.get("memory_budget") is not None)):
        raise OffloadError(f"option(s) {given} only apply where the KV cache may go to the "
                           "host: with kv_cache='host', or with memory_budget (kv_cache "
                           "'auto'); give one of them, or leave these out")
    block = _check_int("kv_block_size", options.get("kv_block_size", 256), KV_TILE)
    if block % KV_TILE:
        raise OffloadError(
            f"option 'kv_block_size' must be a multiple of {KV_TILE} tokens (the attention "
            f"kernels' key tile), got {block}: use {block - block % KV_TILE} or "
            f"{block - block % KV_TILE + KV_TILE}")
    layers = options.get("kv_layers")
    if layers is not None:
        try:
            layers = tuple(as_int(i) for i in layers)
        except TypeError:
            layers = (as_int(layers),)
        if not layers or any(i is None or i < 0 for i in layers) or \
                len(set(layers)) != len(layers):
            raise OffloadError(
                "option 'kv_layers' must be a list of distinct layer indices (ints >= 0) "
                f"of the cache, such as [0, 1, 2], got {options.get('kv_layers')!r}")
        layers = tuple(sorted(layers))
    return dict(kv_cache=kv_cache, kv_layers=layers, kv_block_size=block,
                kv_slots=_check_int("kv_slots", options.get("kv_slots", 2), 1))


def _check_planner_options(options: Mapping[str, Any]) -> dict[str, Any]:
    given = [k for k in PLANNER_KEYS if options.get(k) is not None]
    if options.get("memory_budget") is None:
        if given:
            raise OffloadError(
                f"option(s) {given} only apply to the planner: give "
                "'memory_budget' too, or leave them out")
        return {}
    hand = [k for k in HAND_PICKED_KEYS if k in options]
    if hand:
        raise OffloadError(
            f"options {hand} and 'memory_budget' both decide what is "
            "offloaded: give 'memory_budget' and let the planner choose the layers and the "
            f"slot count, or drop 'memory_budget' and pick {hand} by hand")
    return dict(
        memory_budget=parse_size("memory_budget", options["memory_budget"]),
        plan_tokens=_check_plan_tokens(options.get("plan_tokens")),
        flop_rate=_check_rate("flop_rate", options.get("flop_rate"), "FLOP/s"),
        memory_bandwidth=_check_rate("memory_bandwidth", options.get("memory_bandwidth"),
                                     "bytes/s"),
        h2d_bandwidth=_check_rate("h2d_bandwidth", options.get("h2d_bandwidth"), "bytes/s"),
        launch_overhead=_check_rate("launch_overhead", options.get("launch_overhead"),
                                    "seconds per kernel"),
    )
