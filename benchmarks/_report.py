"""Summary rows shared by the benchmark scripts and ``run_all.py``.

A benchmark's JSON document may carry a ``"summary"`` list: one row per headline figure,
with the reference it is compared to and its target. ``run_all.py`` turns these rows into
the Markdown tables of ``summary.md``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import format_table, write_results

Row = dict[str, Any]


def summary_row(
    figure: str, value: str, reference: str = "", target: str = "", met: bool | None = None
) -> Row:
    """One headline figure.

    Args:
        figure: what is measured.
        value: the measured value, formatted with its unit.
        reference: what it is compared to, measured in the same run (with its value).
        target: the goal, in words (``""`` when the figure is reported only).
        met: whether the target is met (``None`` when there is no target).
    """
    return {"figure": figure, "value": value, "reference": reference, "target": target, "met": met}


def verdict(met: bool | None) -> str:
    """``met``, ``missed`` or ``-`` (no target)."""
    return "-" if met is None else ("met" if met else "missed")


def print_summary(rows: Sequence[Row]) -> None:
    """Print the summary rows as a plain-text table."""
    headers = ["figure", "value", "reference", "target", "status"]
    body = [
        [row["figure"], row["value"], row["reference"], row["target"], verdict(row["met"])]
        for row in rows
    ]
    print(format_table(headers, body))


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep the collector off while timing (as ``timeit`` does)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_survivors() -> None:
    """Collect garbage, then move every object left to the collector's permanent generation.

    The objects left are those of the imports (torch's modules, the library's, their
    dependencies'): hundreds of thousands, which every full collection walks (about a fifth
    of a second on a small machine). Frozen, they are left out of the collections that
    precede each timed block. The ``--quick`` runs freeze them; the full runs keep the
    collector as any process has it.
    """
    gc.collect()
    gc.freeze()


def per_call_us(run: Callable[[], object], calls: int, repeat: int) -> tuple[float, float, float]:
    """Median and best microseconds per call of ``run``, a loop making ``calls`` calls, and
    the median CPU microseconds of the calling thread per call (which time spent waiting for
    a core on a busy machine does not inflate).

    ``run`` is called once untimed, then ``repeat`` times with the garbage collector paused.
    """
    run()
    samples = []
    cpu_samples = []
    with gc_paused():
        for _ in range(repeat):
            start, cpu = time.perf_counter(), time.thread_time()
            run()
            samples.append((time.perf_counter() - start) / calls * 1e6)
            cpu_samples.append((time.thread_time() - cpu) / calls * 1e6)
    samples.sort()
    cpu_samples.sort()
    return samples[len(samples) // 2], samples[0], cpu_samples[len(cpu_samples) // 2]


def publish(name: str, document: dict[str, Any], output: Path | None) -> Path:
    """Write a benchmark's document, then print its detail table and summary rows."""
    path = write_results(name, document, output)
    details = document["details"]
    print(format_table(details["headers"], details["rows"]))
    print()
    print_summary(document["summary"])
    print(f"wrote {path} in {document['wall_seconds']:.1f} s")
    return path
