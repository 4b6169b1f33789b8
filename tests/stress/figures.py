"""Settings and figures shared by the reliability tests and ``tests/stress/run.py``.

The bounded tests of ``make test`` read their sizes from the environment, so that the stress
runner can run the same tests for longer:

- ``T2N_STRESS=1``: the long versions (more examples, more kills, longer soak);
- ``T2N_SOAK_SECONDS``: the soak's duration in seconds (10, or 60 under ``T2N_STRESS``);
- ``T2N_STRESS_FIGURES``: a file to which every test appends one JSON line of figures
  (operations run, faults injected, files fuzzed, ...), aggregated by the runner.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

__all__ = ["record", "scaled", "soak_seconds", "stress_mode"]

_WRITE_LOCK = threading.Lock()


def stress_mode() -> bool:
    """Whether the long versions run (``T2N_STRESS`` set to something other than 0)."""
    return os.environ.get("T2N_STRESS", "0") not in ("", "0", "false", "no")


def scaled(normal: int, stress: int) -> int:
    """``stress`` under :func:`stress_mode`, ``normal`` otherwise."""
    return stress if stress_mode() else normal


def soak_seconds() -> float:
    """The soak's duration: ``T2N_SOAK_SECONDS``, else 60 s in stress mode and 10 s otherwise."""
    value = os.environ.get("T2N_SOAK_SECONDS")
    if value:
        return float(value)
    return 60.0 if stress_mode() else 10.0


def record(test: str, **figures: Any) -> None:
    """Append ``{"test": test, **figures}`` as a JSON line to ``T2N_STRESS_FIGURES``, if set."""
    target = os.environ.get("T2N_STRESS_FIGURES")
    if not target:
        return
    line = json.dumps({"test": test, **figures}, sort_keys=True)
    with _WRITE_LOCK, open(target, "a", encoding="utf-8") as file:
        file.write(line + "\n")
