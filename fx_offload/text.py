"""Text shared by reports, logs and errors: byte sizes and aligned tables."""
from __future__ import annotations

from typing import Sequence

_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int, as_option: bool = False) -> str:
    """``1.50 GiB`` for people; ``as_option``: ``1.5GiB``, the compact form an option value
    is written in (``memory_budget=1.5GiB``), which :func:`fx_offload.options.parse_size`
    reads back."""
    if n < 0:       # a difference that came out negative (device memory "saved")
        return "-" + format_bytes(-n, as_option)
    for unit, size in _BINARY_UNITS:
        if n >= size and (as_option or unit != "TiB"):
            return f"{n / size:.4g}{unit}" if as_option else f"{n / size:.2f} {unit}"
    return f"{n}B" if as_option else f"{n} B"


def format_numbers(numbers: Sequence[int]) -> str:
    """Sorted numbers, runs shortened: ``[1, 2, 3, 5]`` -> ``1-3, 5``; an evenly spaced list
    of more than four -> ``1, 3, ..., 59``."""
    numbers = sorted(numbers)
    steps = {b - a for a, b in zip(numbers, numbers[1:])}
    if len(numbers) > 4 and len(steps) == 1 and steps != {1}:
        return f"{numbers[0]}, {numbers[1]}, ..., {numbers[-1]}"
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def render_table(rows: Sequence[Sequence[str]], indent: str = "", rule: bool = False,
                 ) -> list[str]:
    """Rows of cells as left-aligned columns, two spaces apart; ``rule`` underlines the
    first row with dashes."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if rule and i == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines
