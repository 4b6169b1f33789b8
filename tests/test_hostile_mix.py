"""The hostile mix: seeds of a randomized run where threads, event loops, a Ctrl-C-storm on the
main thread and forked children use a few offloaded tensors through several pools at once,
every read checked against a model of the values it may return, and the durable state
checked after the pools closed (``tests/hostile_world.py`` says what runs and what is checked).

Each seed draws its setup (sizes, budget, strategy, which pools and threads) and the
operations of each thread; the interleaving is the scheduler's, so a rare failure may take a
few replays. Every defect names its seed, and the failure message says how to replay it:
``T2N_HOSTILE_SEED=5252`` runs seed 5252 alone, as many times as the mode runs seeds.

Also checked: what Python reports as unraisable during the run (``sys.unraisablehook``). A
``KeyboardInterrupt`` that lands in a finalizer or a garbage collection callback can only be
reported so: it is counted; anything else is a defect. ``make test`` runs 16 seeds (about
15 s on two cores), ``T2N_STRESS=1`` 200.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile_world import CtrlC, Report, World
from stress.figures import record, scaled

SEEDS = scaled(16, 200)
OPERATIONS = 120
"""Operations per worker thread and per event loop (the main thread runs half as many)."""


def seeds_to_run() -> list[int]:
    """``T2N_HOSTILE_SEED`` repeated :data:`SEEDS` times if set, else seeds 0 to SEEDS - 1."""
    replayed = os.environ.get("T2N_HOSTILE_SEED")
    return [int(replayed)] * SEEDS if replayed else list(range(SEEDS))


class Unraisable:
    """``sys.unraisablehook`` for the run: a ``KeyboardInterrupt`` is counted
    (``interrupts``), any other exception kept for :meth:`hand_over`. It takes no lock: it may
    run in a finalizer while its thread holds one."""

    def __init__(self) -> None:
        self.interrupts = 0
        self.found: list[tuple[str, str]] = []  # (message, traceback)

    def __call__(self, unraisable: Any) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.interrupts += 1
            return
        try:
            culprit = repr(unraisable.object)
        except Exception:
            culprit = type(unraisable.object).__qualname__
        where = f"{unraisable.err_msg or 'Exception ignored in'}: {culprit}"
        message = f"unraisable {unraisable.exc_type.__name__} ({where})"
        details = traceback.format_exception(
            unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback
        )
        self.found.append((message, "".join(details)))

    def hand_over(self, report: Report) -> None:
        """Make what was reported since the last hand-over defects of ``report``."""
        while self.found:
            report.defect(*self.found.pop(0))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The hook in force for the block; the previous one restored after it."""
        previous = sys.unraisablehook
        sys.unraisablehook = self
        try:
            yield
        finally:
            gc.collect()  # finalizers of the run report here, not to pytest
            sys.unraisablehook = previous


@pytest.mark.timeout(scaled(240, 1800))
def test_hostile_mix_reads_only_written_values(tmp_path: Path) -> None:
    """Every seed's reads return values the model allows, its threads end, its pools close
    with every write in place, and nothing but Ctrl-C is lost in a finalizer; the run stops at
    the first seed with a defect."""
    ctrl_c, unraisable = CtrlC(), Unraisable()
    reports: list[Report] = []
    with ctrl_c.installed(), unraisable.installed(), warnings.catch_warnings():
        # Python 3.12 warns that forking a process whose threads run may deadlock the child.
        warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
        for seed in seeds_to_run():
            directory = tmp_path / f"seed-{seed}"
            world = World(seed, directory, ctrl_c, OPERATIONS)
            world.run()
            unraisable.hand_over(world.report)
            reports.append(world.report)
            if world.report.defects:
                break
            shutil.rmtree(directory)
    unraisable.hand_over(reports[-1])  # what the last collection found
    failed = [report for report in reports if report.defects]
    totals = sum((report.counts for report in reports), start=Counter[str]())
    record(
        "hostile_mix",
        seeds=len(reports),
        interrupts=ctrl_c.landed,
        interrupts_in_finalizers=unraisable.interrupts,
        defects=sum(len(report.defects) for report in reports),
        **totals,
    )
    assert not failed, failed[0].summary()
    assert totals["operations"] > len(reports) * OPERATIONS
    assert ctrl_c.landed > 0 or not any(report.setup.ctrl_c for report in reports)
