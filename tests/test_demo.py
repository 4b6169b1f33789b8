"""The ``t2n-residency demo`` command: its tables, its sanity and its verification."""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_to_nnef._demo import DemoConfig, Overlap, format_table
from torch_to_nnef.cli import main

SERVING_HEADERS = [
    "strategy",
    "prefetch",
    "requests/s",
    "layers/s",
    "GB read",
    "read GB/s",
    "hit ratio",
    "stall s",
    "stall %",
    "peak RSS MB",
    "RSS/budget",
]
ONE_AT_A_TIME_HEADERS = [
    "one request at a time",
    "strategy",
    "prefetch",
    "forward s",
    "overlap efficiency",
    "hit ratio",
    "GB read/forward",
]


def table_rows(output: str, first_header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``first_header``, split on 2+ spaces."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return [re.split(r"\s{2,}", lines[start].strip()), *rows]


@pytest.fixture(scope="module")
def quick_run() -> tuple[int, str, int]:
    """``main(["demo", "--quick"])`` in this process: exit status, stdout, torch threads after."""
    threads = torch.get_num_threads()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["demo", "--quick", "--no-progress"])
    assert torch.get_num_threads() == threads, "the demo restores torch's thread count"
    return status, out.getvalue(), threads


@pytest.mark.timeout(60)
def test_quick_demo_succeeds_and_prints_every_metric(quick_run: tuple[int, str, int]) -> None:
    status, output, _ = quick_run
    assert status == 0, output
    header, *rows = table_rows(output, "strategy ")
    assert header == SERVING_HEADERS
    assert [(row[0], row[1]) for row in rows] == [
        (strategy, prefetch)
        for strategy in ("LRU", "FIXED", "SCHEDULED")
        for prefetch in ("depth 1", "none")
    ]
    for row in rows:
        requests_s, layers_s, gb_read, read_gbs, hit, stall_s, stall_pct, rss, rss_budget = map(
            float, row[2:]
        )
        assert requests_s > 0 and layers_s > 0 and gb_read > 0 and read_gbs > 0
        assert layers_s == pytest.approx(requests_s * 32, rel=0.05)  # 16 blocks of 2 layers
        assert -0.1 <= hit <= 1.0
        assert stall_s >= 0 and 0 <= stall_pct <= 100
        assert rss >= 0 and rss_budget >= 0
    assert "hit ratio = 1 - loads / (tensors per forward x forwards)" in output


@pytest.mark.timeout(60)
def test_quick_demo_ranks_the_strategies_on_the_cyclic_workload(
    quick_run: tuple[int, str, int],
) -> None:
    _, output, _ = quick_run
    header, *rows = table_rows(output, "one request at a time")
    assert header == ONE_AT_A_TIME_HEADERS
    by_mode = {(row[1], row[2]): row for row in rows if row[0] == "pool"}
    assert rows[0][0] == "no pool: load, then compute"
    assert rows[-1][0].startswith("ideal: max(load ")
    uncached = rows[-2]
    assert uncached[:3] == ["pool caching nothing", "LRU", "depth 1"]
    assert -0.05 <= float(uncached[5]) <= 0.05 and math.isfinite(float(uncached[4]))
    hit = {mode: float(row[5]) for mode, row in by_mode.items()}
    lru, fixed, scheduled = (
        hit["LRU", "depth 1"],
        hit["FIXED", "depth 1"],
        hit["SCHEDULED", "depth 1"],
    )
    # Nearly every access misses (a lease released a moment late may give LRU a rare hit).
    assert -0.05 <= lru <= 0.05, "a cyclic scan bigger than the budget defeats LRU"
    assert hit["LRU", "none"] <= 0.05
    assert fixed >= 0.15 and scheduled >= 0.15
    assert scheduled >= fixed - 0.05
    for mode in (("LRU", "none"), ("LRU", "depth 1")):
        assert math.isfinite(float(by_mode[mode][4])), "overlap efficiency of a pool reading all"
    seconds = [float(row[3]) for row in rows]
    assert all(s > 0 for s in seconds)


@pytest.mark.timeout(60)
def test_quick_demo_verifies_streamed_outputs_against_the_dense_forward(
    quick_run: tuple[int, str, int],
) -> None:
    _, output, _ = quick_run
    match = re.search(
        r"verification: (\d+) streamed outputs vs the dense forward, max \|diff\| = (\S+) "
        r"\(tolerance (\S+)\): (\w+)",
        output,
    )
    assert match is not None, output
    count, diff, tolerance, verdict = match.groups()
    # 3 sequential forwards, 5 pools x 4 forwards, 6 serving runs x 6 requests.
    assert int(count) == 3 + 5 * 4 + 6 * 6
    assert verdict == "OK" and float(diff) <= float(tolerance)


@pytest.mark.timeout(60)
def test_quick_demo_explains_and_removes_its_offload_directory(
    quick_run: tuple[int, str, int],
) -> None:
    _, output, _ = quick_run
    offload_dir = re.search(r"offloading it to (\S+)", output)
    assert offload_dir is not None
    assert not Path(offload_dir.group(1)).exists(), "the payload files are removed"
    explanation = " ".join(output.strip().split("\n\n")[-1].split())
    assert "LRU evicts each layer just before it is needed again" in explanation
    assert "overlap efficiency" in explanation
    assert "A pool caching nothing" in explanation
    assert re.search(r"time: setup [\d.]+ s, total [\d.]+ s", output)


@pytest.mark.timeout(90)
def test_console_script_runs_the_quick_demo(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("t2n-residency")
    if not script.exists():
        pytest.skip("the t2n-residency console script is not installed in this environment")
    done = subprocess.run(
        [str(script), "demo", "--quick", "--strategy", "scheduled", "--requests", "4"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    header, *rows = table_rows(done.stdout, "strategy ")
    assert header == SERVING_HEADERS
    assert [(row[0], row[1]) for row in rows] == [("SCHEDULED", "depth 1"), ("SCHEDULED", "none")]
    assert "Serving 4 concurrent requests, 2 in flight, from async code on cpu" in done.stdout
    assert ": OK" in done.stdout
    assert "100%" in done.stderr, "the progress bar ran to the end"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--quick", "--requests", "0"], "requests must be positive, got 0"),
        (["demo", "--quick", "--budget-gb", "-1"], "budget_gb must be positive, got -1.0"),
        (["demo", "--quick", "--device", "tpu"], "device must be 'cpu' or 'cuda:N', got 'tpu'"),
        (["demo", "--quick", "--device", "cuda:99"], "cuda:99"),
    ],
)
def test_bad_options_are_refused_with_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("t2n-residency: error: ")
    assert message in err


def test_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err
    assert main(["demo", "--strategy", "mru"]) == 2
    assert "invalid choice: 'mru'" in capsys.readouterr().err
    assert main(["demo", "--help"]) == 0
    assert "--model-gb" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("t2n-residency ")


def test_default_configuration_is_a_1_gb_model_with_a_quarter_budget() -> None:
    config = DemoConfig()
    assert (config.blocks, config.width) == (24, 2304)
    assert config.model_bytes == 2 * 24 * 2304 * 2304 * 4
    assert 0.95e9 < config.model_bytes < 1.1e9
    assert config.budget_bytes == config.model_bytes // 4
    assert DemoConfig(budget_gb=0.5).budget_bytes == 500_000_000
    bigger = DemoConfig(model_gb=4.0)
    assert bigger.width % 64 == 0
    assert bigger.model_bytes == pytest.approx(4e9, rel=0.02)


def test_overlap_efficiency_is_one_for_the_ideal_and_zero_for_sequential() -> None:
    overlap = Overlap(load_s=2.0, compute_s=3.0, sequential_s=5.0)
    assert overlap.ideal_s == 3.0
    assert overlap.efficiency(3.0) == 1.0
    assert overlap.efficiency(5.0) == 0.0
    assert overlap.efficiency(4.0) == 0.5
    assert math.isnan(Overlap(1.0, 0.0, 1.0).efficiency(1.0)), "nothing to overlap"


def test_format_table_aligns_columns() -> None:
    table = format_table(["name", "value"], [["a", "1.5"], ["longer", "10"]])
    assert table.splitlines() == [
        "name    value",
        "------  -----",
        "a         1.5",
        "longer     10",
    ]
