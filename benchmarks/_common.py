"""Helpers shared by the benchmark scripts: timing, machine description, result files, tables.

Each benchmark script writes ``benchmarks/results/<name>.json`` (or the path given with
``--output``) and prints a table of its figures.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the timed repetitions of one measurement."""

    seconds: tuple[float, ...]

    @property
    def best(self) -> float:
        """The fastest repetition."""
        return min(self.seconds)

    @property
    def median(self) -> float:
        """The median repetition."""
        return statistics.median(self.seconds)


def measure(run: Callable[[], object], *, repeat: int, warmup: int = 1) -> Timing:
    """Time ``run()`` ``repeat`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return Timing(tuple(seconds))


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_results(name: str, results: dict[str, Any], path: str | Path | None = None) -> Path:
    """Write ``results`` with the machine description as JSON; return the file's path.

    Args:
        name: the benchmark name; the default file is ``benchmarks/results/<name>.json``.
        results: JSON-able figures.
        path: another destination.
    """
    destination = Path(path) if path is not None else RESULTS_DIR / f"{name}.json"
    destination.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": name, "machine": machine_info(), **results}
    destination.write_text(json.dumps(document, indent=2) + "\n")
    return destination


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(cell) for cell in headers]] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        return "  ".join([first, *rest])

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])
