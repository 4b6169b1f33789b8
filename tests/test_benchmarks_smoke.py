"""The benchmark suite runs end to end at tiny sizes and writes every result it promises.

Times are never asserted here: ``--quick`` figures mean nothing. What is checked is that each
benchmark script runs against the real library, writes its JSON document with the expected
figures, and that ``run_all.py`` gathers them into ``summary.md`` (and the overlap benchmark
draws its timeline), in a temporary results directory.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

RUN_ALL = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py"
SUMMARY_KEYS = {"figure", "value", "reference", "target", "met"}
BENCHMARKS = (
    "storage",
    "dispatch",
    "hit_latency",
    "churn",
    "churn_upstream",
    "bulk_prefetch",
    "overlap",
    "memory",
    "mapped",
    "hf",
    "gpu",
)


# The tests of this module share a module fixture: with workers (pytest-xdist), they run
# on one, which builds it once.
pytestmark = pytest.mark.xdist_group("test_benchmarks_smoke")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bench-results")
    done = subprocess.run(
        [sys.executable, str(RUN_ALL), "--quick", "--results-dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return directory


def load(results: Path, name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    assert document["benchmark"] == name
    assert {"torch", "cpus"} <= set(document["machine"])
    assert document["config"]["quick"] is True
    return document


def check_summary_rows(document: dict[str, Any]) -> None:
    assert document["summary"], "a benchmark without headline figures"
    for row in document["summary"]:
        assert set(row) == SUMMARY_KEYS
        assert row["met"] in (True, False, None)


@pytest.mark.timeout(300)
def test_every_result_file_is_written(results: Path) -> None:
    assert sorted(p.stem for p in results.glob("*.json")) == sorted(BENCHMARKS)


@pytest.mark.timeout(300)
def test_storage_and_dispatch_results(results: Path) -> None:
    storage = load(results, "storage")
    methods = {item["method"] for item in storage["results"]}
    assert {"sync, reused buffers", "sync, fresh buffers"} <= methods
    assert all(item["gbps_best"] > 0 for item in storage["results"])
    dispatch = load(results, "dispatch")
    cases = {item["case"] for item in dispatch["results"]}
    assert {"resident tensor", "offloaded, pool scope (hit)"} <= cases


@pytest.mark.timeout(300)
def test_hit_latency_results(results: Path) -> None:
    document = load(results, "hit_latency")
    check_summary_rows(document)
    configurations = document["results"]
    assert {(c["entries"], c["budget_bytes"] is None) for c in configurations} == {
        (n, b) for n in document["config"]["sizes"] for b in (True, False)
    }
    for config in configurations:
        figures = config["figures"]
        for name in ("dict lookup", "sync resolve", "sync acquire"):
            assert figures[name]["median_us"] > 0
            per_pool = figures[name]["per_pool_us"]  # the figure: the median over fresh pools
            assert len(per_pool) == document["config"]["pools"] >= 2
            assert per_pool[0] <= figures[name]["median_us"] <= per_pool[-1]
        for name in ("plain torch op", "torch op in scope"):  # no target: the first pool's
            assert figures[name]["per_pool_us"] == [figures[name]["median_us"]]
            assert figures[name]["median_us"] > 0
        assert figures["async acquire (asyncio)"]["median_us"] > 0
        assert figures["misses_while_timed"] == 0, "hit latency was timed on misses"


@pytest.mark.timeout(300)
def test_churn_results(results: Path) -> None:
    document = load(results, "churn")
    check_summary_rows(document)
    patterns = {(r["tensors"], r["pattern"]) for r in document["results"]}
    assert patterns == {
        (n, p) for n in document["config"]["sizes"] for p in ("cyclic", "random", "hot-set")
    }
    for result in document["results"]:
        figures = result["figures"]
        reference = figures["reference"]
        for face in ("pool, sync face", "pool, async face"):
            assert figures[face]["ops_per_s"] > 0
            # Same LRU semantics on the same sequence: the pool hits exactly as the reference.
            assert figures[face]["hit_ratio"] == pytest.approx(reference["hit_ratio"])
        if result["pattern"] == "cyclic":
            assert reference["hit_ratio"] == 0.0


@pytest.mark.timeout(300)
def test_overlap_results_and_timeline(results: Path) -> None:
    document = load(results, "overlap")
    check_summary_rows(document)
    for run in document["results"]:
        assert set(run["seconds"]) >= {
            "sequential_load",
            "sequential_compute",
            "pool_pipeline",
            "pool_pipeline_cached",
        }
        assert isinstance(run["overlap_efficiency"], float)
        assert isinstance(run["cached_pool_efficiency"], float)
        assert isinstance(run["prefetch_ahead_copying_efficiency"], float)
        # Copying reads land in the buffers of evicted layers; mapped ones have none.
        assert run["prefetch_ahead_copying_stats"]["reused_buffers"] > 0
        assert run["prefetch_ahead_stats"]["reused_buffers"] == 0
        # The ceiling replaces the ideal's compute by that on weights read long before.
        seconds = run["seconds"]
        slower = max(seconds["sequential_load"], seconds["compute_alone"])
        expected = (seconds["sequential"] - slower) / (seconds["sequential"] - seconds["ideal"])
        assert run["efficiency_ceiling"] == pytest.approx(expected)
        # Without a cache, every layer of every streamed forward is read.
        assert run["pool_stats"]["loads"] >= run["layers"] * 3
        timeline = run["timeline"]
        assert [entry["layer"] for entry in timeline["layers"]] == list(range(run["layers"]))
        for entry in timeline["layers"]:
            assert entry["entered"] <= entry["compute_start"] <= entry["compute_end"]
        read = {read["layer"] for read in timeline["reads"]}
        assert read <= set(range(run["layers"]))
        # A cyclic pass over more layers than the budget holds reads what was evicted.
        assert len(read) >= run["layers"] - run["budget_layers"] - 1
    chart = results / "timeline.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_memory_results(results: Path) -> None:
    document = load(results, "memory")
    check_summary_rows(document)
    assert document["baseline_peak_rss_bytes"] > 0
    assert document["bound_bytes"] == (
        document["baseline_peak_rss_bytes"]
        + document["config"]["budget_bytes"]
        + 2 * document["config"]["layer_bytes"]
    )
    assert document["growth_bound_bytes"] == (
        document["config"]["budget_bytes"] + 2 * document["config"]["layer_bytes"] + (64 << 20)
    )
    assert {(r["strategy"], r["mapped"]) for r in document["results"]} >= {
        ("LRU", True),
        ("LRU", False),
    }
    for result in document["results"]:
        assert result["peak_rss_bytes"] > 0
        assert result["loads"] >= document["config"]["layers"]
        if result["growth_bytes"] is not None:
            assert result["growth_met"] == (
                result["growth_bytes"] <= document["growth_bound_bytes"]
            )


@pytest.mark.timeout(300)
def test_mapped_results(results: Path) -> None:
    document = load(results, "mapped")
    check_summary_rows(document)
    for cache in ("warm", "cold"):
        timing = document["seconds_per_token"][cache]
        assert set(timing) == {"compute only", "buffered read", "mapped read"}
        assert all(seconds > 0 for seconds in timing.values())


@pytest.mark.timeout(300)
def test_hf_results(results: Path) -> None:
    document = load(results, "hf")
    check_summary_rows(document)
    assert set(document["results"]) == {"Llama-style", "Qwen2-style"}
    for runs in document["results"].values():
        assert [r["mode"] for r in runs] == [
            "dense",
            "accelerate",
            "pool",
            "pool-upstream",
            "pool-readahead",
        ]
        assert all(r["tokens"] == runs[0]["tokens"] for r in runs)
        assert all(r["s_per_token"] > 0 for r in runs)
    figures = [row["figure"] for row in document["summary"]]
    assert "Llama-style, warm: pool tokens/s over accelerate's" in figures
    assert "Qwen2-style: tokens of every mode" in figures


@pytest.mark.timeout(300)
def test_gpu_check_runs_here(results: Path) -> None:
    document = load(results, "gpu")
    assert document["cuda"] is torch.cuda.is_available()
    check_summary_rows(document)


@pytest.mark.timeout(60)
def test_gpu_check_says_it_needs_a_device_and_fails_without_one() -> None:
    if torch.cuda.is_available():  # pragma: no cover - GPU machines run the check itself
        pytest.skip("this machine has a CUDA device")
    script = RUN_ALL.parent / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("no CUDA device")


@pytest.mark.timeout(60)
def test_the_summary_shows_why_a_captured_benchmark_failed(tmp_path: Path) -> None:
    """A benchmark that fails (here: one that runs no benchmark and exits 1) has its last
    lines in the summary, under its status, so a failure says why where it is read."""
    script = tmp_path / "failing.py"
    script.write_text("for i in range(50):\n    print(f'line {i}')\nraise SystemExit(1)\n")
    sys.path.insert(0, str(RUN_ALL.parent))
    try:
        import run_all
    finally:
        sys.path.remove(str(RUN_ALL.parent))
    benchmark = dataclasses.replace(run_all.BENCHMARKS[0], name="failing", script=str(script))
    outcome = run_all.run_benchmark(benchmark, tmp_path, quick=True, capture=True)
    assert outcome.status == "failed (exit code 1)"
    machine = {**run_all.machine_description(), "load_average": "-", "parallel_speedup": "-"}
    machine.update(one_thread_gflops="-", interpreter_us="-")
    text = run_all.summary_markdown([outcome], True, 1.0, machine)
    assert "**failed (exit code 1)**" in text
    assert "```text\nline 20\n" in text and "line 49\n```" in text
    assert "line 19\n" not in text  # the last 30 lines only


@pytest.mark.timeout(300)
def test_summary_gathers_every_benchmark(results: Path) -> None:
    text = (results / "summary.md").read_text()
    assert text.startswith("# Benchmark results")
    for name in BENCHMARKS:
        assert f"(`{name}`)" in text
    assert "| figure | value | reference (same run) | target | status |" in text
    assert "| CPUs |" in text and f"| torch | {torch.__version__} |" in text
    assert "![timeline of one streamed forward](timeline.png)" in text
    assert "did not complete" not in text


def test_the_benchmarks_readme_describes_every_benchmark() -> None:
    readme = (RUN_ALL.parent / "README.md").read_text()
    described = [
        line.split("|")[1].strip().strip("`")
        for line in readme.splitlines()
        if line.startswith("| `")
    ]
    assert sorted(described) == sorted(BENCHMARKS)
