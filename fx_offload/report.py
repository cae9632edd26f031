"""``fx_offload.report(model)``: what was offloaded, how many bytes, which slots."""
from __future__ import annotations

import dataclasses

from torch import nn

from . import runtime


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Report:
    model: str
    stack: str                         # dotted path of the layer list
    num_layers: int                    # layers in the stack
    layers: list[int]                  # offloaded layer indices, ascending
    params: dict[int, list[str]]       # layer -> full dotted names of its offloaded parameters
    offloaded_bytes: int
    buffer_bytes: int
    slots: int
    device: str
    slot_of: dict[int, int]
    target_of: dict[int, int | None]
    layer_bytes: dict[int, int]
    pinned: bool
    options: str
    planner: object = None             # planner.PlannerResult under memory_budget, else None

    @property
    def saved_bytes(self) -> int:
        return self.offloaded_bytes - self.buffer_bytes

    def __str__(self) -> str:
        rows = [("layer", "slot", "prefetches next", "params", "bytes")]
        for layer in self.layers:
            target = self.target_of[layer]
            rows.append((str(layer), str(self.slot_of[layer]),
                         "-" if target is None else f"layer {target}",
                         str(len(self.params[layer])), format_bytes(self.layer_bytes[layer])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"fx_offload report for {self.model}: {len(self.layers)} of {self.num_layers} "
                 f"layers of {self.stack or '<root>'!r} offloaded ({self.options})"]
        for i, row in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        host = "pinned host memory" if self.pinned else "host memory"
        lines.append(f"  offloaded to {host}: {format_bytes(self.offloaded_bytes)}; "
                     f"{self.slots} slot buffer(s): {format_bytes(self.buffer_bytes)} on "
                     f"{self.device}; device memory saved: {format_bytes(self.saved_bytes)}")
        if self.planner is not None:
            lines.append(str(self.planner))
        return "\n".join(lines)


def report(model: nn.Module) -> Report:
    state = runtime.state_for_model(model)
    if state is None:
        from .compiler import _NOT_OFFLOADED
        kept = _NOT_OFFLOADED.get(model)
        if kept is not None:
            return Report(model=kept.model_name, stack=kept.stack.path,
                          num_layers=len(kept.stack.layers), layers=[], params={},
                          offloaded_bytes=0, buffer_bytes=0, slots=0, device="-", slot_of={},
                          target_of={}, layer_bytes={}, pinned=False,
                          options=kept.options.describe(), planner=kept.planner)
        raise ValueError(
            f"fx_offload.report: {type(model).__name__} has no offloaded weights; compile it "
            "with backend='prefetch_offload' and run it once first (compilation happens at the "
            "first call), or it was restored")
    return Report(
        model=state.model_name,
        stack=state.stack.path,
        num_layers=len(state.stack.layers),
        layers=list(state.layers),
        params={layer: [p.name for p in state.params[layer]] for layer in state.layers},
        offloaded_bytes=state.offloaded_bytes,
        buffer_bytes=state.buffer_bytes,
        slots=state.num_slots,
        device=str(state.device),
        slot_of=dict(state.slot_of),
        target_of=dict(state.target_of),
        layer_bytes={layer: sum(p.param.numel() * p.param.element_size()
                                for p in state.params[layer]) for layer in state.layers},
        pinned=state.pinned,
        options=state.options.describe(),
        planner=state.planner,
    )
