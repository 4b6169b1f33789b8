"""``make stress``: the long runs of the reliability tests, and a report of their figures.

Runs the fault, fuzz, crash, disk-full, soak, hostile-mix, leak and no-code-execution tests
with ``T2N_STRESS=1`` (many more fuzzed files, 200 killed pools, 200 seeds of the hostile mix,
5000 pools and tensors for the leak checks, a 60 s soak), collects the figures each test
records (one JSON line per test, see ``tests/stress/figures.py``) and prints the totals:
operations run, faults injected, files fuzzed, crashes survived, payloads verified, Ctrl-C
interrupts and forks survived, and whether anything was lost.

Usage: ``python tests/stress/run.py [--soak-seconds N] [--figures FILE] [pytest args...]``.
The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/test_fuzz_storage.py",
    "tests/test_hostile_paths.py",
    "tests/test_crash_writeback.py",
    "tests/test_disk_full.py",
    "tests/test_soak.py",
    "tests/test_hostile_mix.py",
    "tests/test_leaks.py",
    "tests/test_no_code_execution.py",
]
TOTALS = [
    ("operations", "operations run"),
    ("faults", "faults injected"),
    ("files_fuzzed", "files fuzzed"),
    ("crashes_survived", "crashes survived (SIGKILL during write-back)"),
    ("interrupted_writes", "writes interrupted by those kills"),
    ("payloads_checked", "payloads checked after a crash (checksums)"),
    ("payloads_verified", "payloads verified against the soak's reference model"),
    ("increments", "read_write increments in the soak"),
    ("cancelled", "cancelled requests in the soak"),
    ("invariant_checks", "pool invariant checks in the soak"),
    ("seconds", "seconds of soak"),
    ("pools", "pools created and closed in the leak runs"),
    ("seeds", "seeds of the hostile mix"),
    ("interrupts", "Ctrl-C interrupts landed in the hostile mix"),
    ("interrupts_in_finalizers", "of them in finalizers (reported as unraisable)"),
    ("forks", "forked children checked in the hostile mix"),
    ("reads_checked", "reads checked against the hostile mix's model"),
    ("defects", "defects found by the hostile mix"),
    ("lost", "values lost"),
]


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--soak-seconds",
        type=float,
        default=float(os.environ.get("T2N_SOAK_SECONDS", "60")),
        help="duration of the soak (default: $T2N_SOAK_SECONDS or 60)",
    )
    parser.add_argument(
        "--figures", type=Path, default=None, help="keep the raw figures (JSON lines) here"
    )
    return parser.parse_known_args()


def run_tests(figures: Path, soak_seconds: float, extra: list[str]) -> int:
    environment = dict(os.environ)
    environment.update(
        T2N_STRESS="1",
        T2N_SOAK_SECONDS=str(soak_seconds),
        T2N_STRESS_FIGURES=str(figures),
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *extra]
    print("$", " ".join(command[2:]), flush=True)
    return subprocess.call(command, cwd=REPO, env=environment)


def load_figures(figures: Path) -> list[dict[str, Any]]:
    if not figures.exists():
        return []
    with figures.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def report(lines: list[dict[str, Any]], status: int, seconds: float) -> str:
    totals: dict[str, float] = defaultdict(float)
    for line in lines:
        for key, value in line.items():
            if key != "test" and isinstance(value, int | float) and not isinstance(value, bool):
                totals[key] += value
    width = max(len(label) for _, label in TOTALS)
    out = ["", "=" * 72, "Stress report", "=" * 72]
    for key, label in TOTALS:
        out.append(f"  {label:<{width}}  {totals.get(key, 0):>10,.0f}")
    lost = totals.get("lost", 0) + totals.get("defects", 0)
    verdict = "nothing lost" if status == 0 and lost == 0 else "FAILURES: see the pytest output"
    out += [
        f"  {'tests':<{width}}  {'passed' if status == 0 else 'FAILED':>10}",
        f"  {'wall time':<{width}}  {seconds:>9.0f}s",
        "",
        f"  verdict: {verdict}",
        "",
        "Per test:",
    ]
    for line in lines:
        details = ", ".join(f"{k}={v}" for k, v in sorted(line.items()) if k != "test")
        out.append(f"  {line['test']}: {details}")
    return "\n".join(out)


def main() -> int:
    arguments, extra = parse_arguments()
    with tempfile.TemporaryDirectory(prefix="t2n-stress-") as scratch:
        figures = arguments.figures or Path(scratch) / "figures.jsonl"
        figures.unlink(missing_ok=True)
        started = time.perf_counter()
        status = run_tests(figures, arguments.soak_seconds, extra)
        elapsed = time.perf_counter() - started
        print(report(load_figures(figures), status, elapsed), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
