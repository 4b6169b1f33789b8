"""Run every benchmark of the project and write a Markdown summary of their figures.

Each benchmark script runs in its own subprocess, in sequence (with ``--quick``, two at a
time, as their figures mean nothing; ``--jobs`` sets how many), and writes
``<results-dir>/<name>.json``; the overlap benchmark also draws ``timeline.png`` there. Then
``<results-dir>/summary.md`` gathers one table per benchmark (each headline figure with the
reference it is compared to, measured in the same run, its target, and met/missed), the
benchmark's detail table, and the machine the figures come from. The summary is printed too.

Run: ``python benchmarks/run_all.py [--quick] [--results-dir DIR] [--only NAME ...]
[--jobs N]``
(``make bench``). ``--quick`` runs every benchmark at tiny sizes, to check that they work;
its figures mean nothing. Exits 1 when a benchmark fails or times out (a missed target is
reported, not an error).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Row, summary_row, verdict

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS_DIR = HERE / "results"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script run, writing ``<name>.json``."""

    name: str
    title: str
    script: str
    arguments: tuple[str, ...] = ()
    timeout_s: int = 300
    about: str = ""


BENCHMARKS = (
    Benchmark(
        "storage",
        "Reload throughput of payload files",
        "bench_storage.py",
        timeout_s=240,
        about="16 payloads of 32 MiB, warm page cache; GB/s, best of the repetitions.",
    ),
    Benchmark(
        "dispatch",
        "Dispatch overhead of an OffloadedTensor",
        "bench_dispatch.py",
        timeout_s=120,
        about="64 x 64 linear; microseconds per op over the same op on a resident tensor.",
    ),
    Benchmark(
        "hit_latency",
        "Resident-hit latency of the pool",
        "bench_residency.py",
        ("--part", "latency"),
        timeout_s=300,
        about="Pools of 10 to 10,000 entries, without and with a budget; us per call, median.",
    ),
    Benchmark(
        "churn",
        "LRU churn",
        "bench_residency.py",
        ("--part", "churn"),
        timeout_s=300,
        about="4 KiB tensors, budget of a tenth of them; the reference is a single-threaded "
        "OrderedDict LRU reading misses synchronously.",
    ),
    Benchmark(
        "churn_upstream",
        "LRU churn beside upstream torch-to-nnef 0.24.12",
        "bench_residency.py",
        ("--part", "upstream"),
        timeout_s=420,
        about="2,000 tensors of 4 KiB, budget of 200, random access, each library in a fresh "
        "process (upstream from a scratch environment), three rounds in alternation; medians.",
    ),
    Benchmark(
        "bulk_prefetch",
        "Bulk prefetch",
        "bench_residency.py",
        ("--part", "bulk"),
        timeout_s=240,
        about="16 payloads of 32 MiB prefetched at once (max_workers=2), then waited for; the "
        "reference is two threads reading them with readinto into fresh buffers.",
    ),
    Benchmark(
        "overlap",
        "Overlap of reads with compute (prefetch-ahead)",
        "bench_overlap.py",
        timeout_s=300,
        about="Layers streamed with stream_modules(depth=1) through a pool with no cache (and, "
        "for context, one caching 3 layers), compute on one torch thread calibrated to last as "
        "long as a read; timeline.png shows one streamed forward.",
    ),
    Benchmark(
        "memory",
        "Peak memory while streaming a model 4x larger than the budget",
        "bench_memory.py",
        timeout_s=300,
        about="24 x 2048 x 2048 float32 (384 MiB), budget 96 MiB, fresh subprocesses.",
    ),
    Benchmark(
        "mapped",
        "Mapped reads against reads into reused buffers (CPU)",
        "bench_mapped.py",
        timeout_s=300,
        about="16 float32 matrices of 32 MiB read then used once per token, warm page cache and "
        "cold (pages evicted before every token); median ms per token.",
    ),
    Benchmark(
        "hf",
        "Generation with transformers models bigger than the budget",
        "bench_hf.py",
        timeout_s=1200,
        about="Llama-style and Qwen2-style (tied embeddings, attention biases) models of about "
        "1 GB float32, 12 greedy tokens, budget a quarter of the model; dense, accelerate's disk "
        "offload and the pool, warm and cold page cache, each in a fresh process.",
    ),
    Benchmark(
        "gpu",
        "GPU check (cuda:0)",
        "gpu_check.py",
        ("--skip-without-cuda",),
        timeout_s=900,
        about="The CUDA path on cuda:0: CUDA tests, stream races, overlap, parallel loads, "
        "host-to-device GB/s, pinned footprint; skipped without CUDA.",
    ),
)


LONGEST_QUICK = ("memory", "hf")
"""The benchmarks whose ``--quick`` runs take longest (five processes importing torch; the
imports of transformers): when several run at once, these start first, so that none is left
running alone at the end."""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the JSON files, summary.md and timeline.png go "
        f"(default: {DEFAULT_RESULTS_DIR})",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[b.name for b in BENCHMARKS],
        help="run only these benchmarks",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="benchmarks run at once (default: 2 with --quick, else 1, as timings need the "
        "machine to themselves)",
    )
    arguments = parser.parse_args(argv)
    if arguments.jobs is None:
        arguments.jobs = 2 if arguments.quick else 1
    if arguments.jobs < 1:
        parser.error("--jobs must be at least 1")
    return arguments


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
FAILED_OUTPUT_LINES = 30
"""Lines of a failed benchmark's output that the summary shows (when it was captured)."""


@dataclass
class Outcome:
    benchmark: Benchmark
    status: str  # "ok", "failed (exit code N)" or "timed out after N s"
    seconds: float
    document: dict[str, Any] | None
    load_average: float | None  # 1-minute load average when it ended
    output_tail: str = ""  # the last lines it printed, kept when it failed and was captured


def load_average() -> float | None:
    """The 1-minute load average (other work on the machine skews timings), if known."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def compute_speed(products: int = 1500) -> tuple[float, float]:
    """One thread's speed at compute-bound matmuls (GFLOP/s), and the throughput of two
    threads over one thread's.

    The first tells one run's machine from another's (a host that lends the virtual machine
    less of its CPU slows every figure, ratios less so). The second is about 2 on an idle
    machine with two free cores; about 1 when the benchmarks effectively get one core (other
    processes running, or two hyper-threads of one core), in which case no pipeline can
    overlap reads with compute. Each thread computes ``products`` products of 256 x 256
    matrices.
    """
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def work() -> None:
        for _ in range(products):
            torch.mm(a, b)

    work()
    start = time.perf_counter()
    work()
    one = time.perf_counter() - start
    threads = [threading.Thread(target=work) for _ in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    both = time.perf_counter() - start
    return products * 2 * 256**3 / one / 1e9, 2 * one / both


def interpreter_speed() -> float:
    """Microseconds for the interpreter to sum ``range(1000)``, best of 20 runs of 1,000: the
    pool's hit paths run Python, whose speed a host can change from one run to the next
    as much as the CPU's."""
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(1000):
            sum(range(1000))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_benchmark(
    benchmark: Benchmark, results_dir: Path, quick: bool, capture: bool = False
) -> Outcome:
    """Run one benchmark script; with ``capture``, its output is printed once it ended (for
    benchmarks running at once, whose lines would otherwise interleave)."""
    output = results_dir / f"{benchmark.name}.json"
    output.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / benchmark.script), *benchmark.arguments]
    command += ["--output", str(output)]
    if benchmark.name == "overlap":
        command += ["--chart", str(results_dir / "timeline.png")]
    if quick:
        command.append("--quick")
    heading = f"\n=== {benchmark.name}: {benchmark.title}"
    if not capture:
        print(heading, flush=True)
    started = time.perf_counter()
    output_text: str | bytes | None = None
    try:
        done = subprocess.run(
            command,
            timeout=benchmark.timeout_s,
            check=False,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
        )
    except subprocess.TimeoutExpired as error:
        status = f"timed out after {benchmark.timeout_s} s"
        output_text = error.output
    else:
        status = "ok" if done.returncode == 0 else f"failed (exit code {done.returncode})"
        output_text = done.stdout
    seconds = time.perf_counter() - started
    if capture:
        if isinstance(output_text, bytes):
            output_text = output_text.decode(errors="replace")
        print(heading + "\n" + (output_text or ""), end="", flush=True)
    document = None
    if status == "ok":
        try:
            document = json.loads(output.read_text())
        except (OSError, ValueError) as error:
            status = f"failed (no readable result file: {error})"
    print(f"=== {benchmark.name}: {status} in {seconds:.1f} s", flush=True)
    tail = ""
    if status != "ok" and isinstance(output_text, str):
        tail = "\n".join(output_text.rstrip().splitlines()[-FAILED_OUTPUT_LINES:])
    return Outcome(benchmark, status, seconds, document, load_average(), tail)


# ---------------------------------------------------------------------------------------------
# Summary rows of the benchmarks that do not write their own
# ---------------------------------------------------------------------------------------------
def storage_rows(document: dict[str, Any]) -> list[Row]:
    gbps = {item["method"]: item["gbps_best"] for item in document["results"]}
    reference_name = next(name for name in gbps if "reference" in name)
    reference = gbps[reference_name]
    torch_load = next(v for name, v in gbps.items() if name.startswith("torch.load"))
    targets = document["targets"]
    rows = [
        summary_row(
            "sync read, reused buffers",
            f"{gbps['sync, reused buffers']:.2f} GB/s "
            f"({gbps['sync, reused buffers'] / reference:.2f}x)",
            f"{reference_name} {reference:.2f} GB/s",
            ">= 0.9x the reference",
            targets.get("reused_at_least_0.9_of_reference"),
        ),
        summary_row(
            "sync read, fresh buffers",
            f"{gbps['sync, fresh buffers']:.2f} GB/s",
            f"torch.load {torch_load:.2f} GB/s",
            ">= torch.load",
            targets.get("fresh_at_least_torch_load"),
        ),
    ]
    for name, value in gbps.items():
        if name.startswith("async"):
            rows.append(summary_row(name, f"{value:.2f} GB/s", f"{reference:.2f} GB/s"))
    return rows


def storage_details(document: dict[str, Any]) -> dict[str, Any]:
    return {
        "headers": ["method", "GB/s best", "GB/s median", "vs reference"],
        "rows": [
            [
                item["method"],
                f"{item['gbps_best']:.2f}",
                f"{item['gbps_median']:.2f}",
                f"{item['ratio_vs_reference']:.2f}",
            ]
            for item in document["results"]
        ],
    }


def dispatch_rows(document: dict[str, Any]) -> list[Row]:
    items = document["results"]
    baseline = {i["op"]: i["us_per_op_median"] for i in items if i["case"] == "resident tensor"}
    rows = []
    for item in items:
        if item["case"] == "resident tensor":
            continue
        cached = "cache" in item["case"] and "no cache" not in item["case"]
        pooled = "pool" in item["case"]
        has_target = cached or pooled
        overhead = item["overhead_us_vs_resident"]
        rows.append(
            summary_row(
                f"{item['op']}: {item['case']}",
                f"+{overhead:.1f} us over the plain op",
                f"plain op {baseline[item['op']]:.1f} us",
                "< 50 us" if has_target else "",
                overhead < 50 if has_target else None,
            )
        )
    return rows


def generic_rows(document: dict[str, Any]) -> list[Row]:
    """Rows from a ``targets`` mapping of name to met (for documents without ``summary``)."""
    return [
        summary_row(name, "", met=bool(met)) for name, met in document.get("targets", {}).items()
    ]


ADAPTERS: dict[str, tuple[Callable[[dict[str, Any]], list[Row]], Callable[..., Any] | None]] = {
    "storage": (storage_rows, storage_details),
    "dispatch": (dispatch_rows, None),
}


def rows_of(name: str, document: dict[str, Any]) -> tuple[list[Row], dict[str, Any] | None]:
    """The summary rows and detail table of a benchmark's document."""
    if "summary" in document:
        return document["summary"], document.get("details")
    rows_function, details_function = ADAPTERS.get(name, (generic_rows, None))
    try:
        rows = rows_function(document)
        details = details_function(document) if details_function else None
    except (KeyError, StopIteration, TypeError, ZeroDivisionError):
        return generic_rows(document), None  # an unfamiliar layout: show its targets only
    return rows, details


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join(" --- " for _ in headers) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ram_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return int(psutil.virtual_memory().total)


def machine_description() -> dict[str, Any]:
    import torch

    ram = _ram_bytes()
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "ram": "unknown" if ram is None else f"{ram / (1 << 30):.1f} GiB",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }


def summary_markdown(
    outcomes: list[Outcome], quick: bool, seconds: float, machine: dict[str, Any]
) -> str:
    met = missed = 0
    sections = []
    for outcome in outcomes:
        benchmark = outcome.benchmark
        lines = [f"## {benchmark.title} (`{benchmark.name}`)", ""]
        if benchmark.about:
            lines += [benchmark.about, ""]
        if outcome.document is None:
            lines += [f"**{outcome.status}** after {outcome.seconds:.0f} s.", ""]
            if outcome.output_tail:  # why, in the summary itself
                lines += ["Its last lines:", "", "```text", outcome.output_tail, "```", ""]
            sections.append("\n".join(lines))
            continue
        rows, details = rows_of(benchmark.name, outcome.document)
        met += sum(row["met"] is True for row in rows)
        missed += sum(row["met"] is False for row in rows)
        lines.append(
            markdown_table(
                ["figure", "value", "reference (same run)", "target", "status"],
                [
                    [r["figure"], r["value"], r["reference"], r["target"], verdict(r["met"])]
                    for r in rows
                ],
            )
        )
        if details:
            lines += ["", markdown_table(details["headers"], details["rows"])]
        if benchmark.name == "overlap" and outcome.document.get("chart"):
            lines += ["", "![timeline of one streamed forward](timeline.png)"]
        load = outcome.load_average
        lines += [
            "",
            f"Ran in {outcome.seconds:.0f} s"
            + ("." if load is None else f" (load average {load:.2f} when it ended)."),
            "",
        ]
        sections.append("\n".join(lines))
    failed = [o.benchmark.name for o in outcomes if o.status != "ok"]
    header = [
        "# Benchmark results",
        "",
        "Produced by `make bench` (`python benchmarks/run_all.py"
        + (" --quick`): tiny sizes, the figures mean nothing." if quick else "`).")
        + " Every ratio compares figures measured in the same run.",
        "",
        markdown_table(
            ["machine", ""],
            [
                ["date", machine["date"]],
                ["CPUs", machine["cpus"]],
                ["RAM", machine["ram"]],
                ["torch", machine["torch"]],
                ["Python", machine["python"]],
                ["platform", machine["platform"]],
                ["CUDA device", machine["cuda"]],
                ["load average at start (1 min)", machine["load_average"]],
                ["one compute thread (256 x 256 matmuls), at start", machine["one_thread_gflops"]],
                ["Python: sum(range(1000)), at start", machine["interpreter_us"]],
                ["speed-up of 2 compute threads over 1, at start", machine["parallel_speedup"]],
            ],
        ),
        "",
        f"Targets met: {met}, missed: {missed}"
        + (f"; benchmarks that did not complete: {', '.join(failed)}" if failed else "")
        + f". Total time {seconds / 60:.1f} min.",
        "",
    ]
    return "\n".join(header + sections)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    results_dir: Path = arguments.results_dir.resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in BENCHMARKS if not arguments.only or b.name in arguments.only]
    started = time.perf_counter()
    machine = machine_description()
    load = load_average()
    machine["load_average"] = "unknown" if load is None else f"{load:.2f}"
    gflops, speedup = compute_speed(300 if arguments.quick else 1500)
    machine["one_thread_gflops"] = f"{gflops:.1f} GFLOP/s"
    machine["interpreter_us"] = f"{interpreter_speed():.1f} us"
    machine["parallel_speedup"] = f"{speedup:.2f}x"
    print(
        f"machine: {machine['cpus']} CPUs, load average {machine['load_average']}, "
        f"2 threads run {machine['parallel_speedup']} as fast as 1",
        flush=True,
    )
    if arguments.jobs == 1:
        outcomes = [run_benchmark(b, results_dir, arguments.quick) for b in chosen]
    else:
        first = sorted(chosen, key=lambda b: b.name not in LONGEST_QUICK)
        with ThreadPoolExecutor(arguments.jobs) as executor:
            futures = {
                b.name: executor.submit(run_benchmark, b, results_dir, arguments.quick, True)
                for b in first
            }
            outcomes = [futures[b.name].result() for b in chosen]
    text = summary_markdown(outcomes, arguments.quick, time.perf_counter() - started, machine)
    summary = results_dir / "summary.md"
    summary.write_text(text)
    print("\n" + text)
    print(f"wrote {summary}")
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
