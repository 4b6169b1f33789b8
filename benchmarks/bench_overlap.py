"""Overlap of reads with compute when streaming layers through a residency pool.

Two workloads, run separately: 16 layers of 2048 x 2048 and 6 layers of 4096 x 4096 float32
weights, offloaded to payload files (page cache warm: every file is read once first). Each
layer computes ``F.linear(x, w)`` on one torch thread, with a batch chosen so that it takes
about as long as reading the layer's weight (calibrated in the run). Three figures per
workload, each the median of the timed forwards:

- ``sequential``: no pool, each layer's weight read (``_reload_unmanaged``) then used;
- ``pipelined``: the layers streamed through a ``TensorResidencyPool`` (budget of three
  layers) with ``stream_modules(pool, layers, depth=1)``, so that layer i+1 is read while
  layer i computes;
- ``ideal``: ``max(total load, total compute)``, the loads and the compute timed alone.

Overlap efficiency = (sequential - pipelined) / (sequential - ideal): 1 when the pipeline hides
every read (or all compute), 0 when it overlaps nothing. Target: >= 0.8 for both workloads.

One streamed forward per workload is recorded: the read intervals (``_aload`` of each weight,
patched in this process only) and, through forward hooks, when each layer was entered, when
its compute started (after waiting for its weight) and ended. ``timeline.png`` draws them: a
lane of reads and a lane of compute per workload, one bar per layer.

Run: ``python benchmarks/bench_overlap.py [--quick] [--output PATH] [--chart PATH]
[--repeat N]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results
from _report import gc_paused, print_summary, summary_row

from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool, stream_modules

EFFICIENCY_TARGET = 0.8
BUDGET_LAYERS = 3
MAX_BATCH = 8192


@dataclass(frozen=True)
class Workload:
    """``layers`` square float32 weights of ``width`` x ``width``."""

    layers: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.layers} x {self.width}x{self.width}"

    @property
    def layer_bytes(self) -> int:
        return self.width * self.width * 4


class Layer(nn.Module):
    """``F.linear(x, weight)``: one read of the weight per forward, one matmul."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@dataclass
class Timeline:
    """Intervals of one streamed forward, in seconds since its start."""

    start: float = 0.0
    reads: list[tuple[int, float, float]] = field(default_factory=list)
    entered: dict[int, float] = field(default_factory=dict)
    computing: dict[int, float] = field(default_factory=dict)
    computed: dict[int, float] = field(default_factory=dict)
    released: dict[int, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        layers = sorted(self.entered)
        return {
            "reads": [
                {"layer": layer, "start": a - self.start, "end": b - self.start}
                for layer, a, b in sorted(self.reads, key=lambda r: r[1])
            ],
            "layers": [
                {
                    "layer": i,
                    "entered": self.entered[i] - self.start,
                    "compute_start": self.computing[i] - self.start,
                    "compute_end": self.computed[i] - self.start,
                    "released": self.released[i] - self.start,
                }
                for i in layers
            ],
        }


# ---------------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------------
def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers (smoke test)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--chart", type=Path, default=None, help="timeline PNG (default: beside the JSON)"
    )
    parser.add_argument("--repeat", type=int, default=None, help="timed forwards per mode")
    return parser.parse_args(argv)


def offload_layers(workload: Workload, directory: Path) -> list[OffloadedTensor]:
    """Write the workload's weights to payload files, then read each file once (warm cache)."""
    generator = torch.Generator().manual_seed(workload.width)
    weights = []
    for index in range(workload.layers):
        dense = torch.randn(workload.width, workload.width, generator=generator)
        dense /= workload.width**0.5
        weights.append(
            OffloadedTensor.from_original_tensor(dense, f"layer{index}.weight", directory)
        )
    for weight in weights:
        with open(weight.offload_path, "rb") as file:
            while file.read(64 << 20):
                pass
    return weights


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    run()
    samples = []
    with gc_paused():
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def calibrate_batch(weight: torch.Tensor, seconds: float) -> int:
    """The batch for which ``F.linear(x, weight)`` takes about ``seconds`` (one thread)."""

    def cost(batch: int) -> float:
        x = torch.randn(batch, weight.shape[1])
        return median_seconds(lambda: F.linear(x, weight), 3)

    low, high = 1, 16
    while cost(high) < seconds and high < MAX_BATCH:
        low, high = high, high * 2
    for _ in range(5):
        middle = (low + high) // 2
        if middle in (low, high):
            break
        if cost(middle) < seconds:
            low = middle
        else:
            high = middle
    return high


# ---------------------------------------------------------------------------------------------
# The three modes
# ---------------------------------------------------------------------------------------------
def sequential_forward(weights: list[OffloadedTensor], x: torch.Tensor) -> torch.Tensor:
    for weight in weights:
        x = F.linear(x, weight._reload_unmanaged())
    return x


def loads_only(weights: list[OffloadedTensor]) -> None:
    for weight in weights:
        weight._reload_unmanaged()


def compute_only(dense: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for weight in dense:
        x = F.linear(x, weight)
    return x


@contextmanager
def recorded_reads(timeline: Timeline, index_of: dict[int, int]) -> Iterator[None]:
    """Record every ``OffloadedTensor._aload`` (the pool's reads) while the block runs."""
    original = OffloadedTensor._aload

    async def timed_aload(self: OffloadedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return await original(self, *args, **kwargs)
        finally:
            timeline.reads.append((index_of.get(id(self), -1), start, time.perf_counter()))

    OffloadedTensor._aload = timed_aload  # type: ignore[method-assign]
    try:
        yield
    finally:
        OffloadedTensor._aload = original  # type: ignore[method-assign]


def timing_hooks(layers: list[Layer], timeline: Timeline) -> list[Any]:
    """Hooks stamping, per layer: entered (before the stream's pre-hook), compute start
    (after it: the weight is leased), compute end, and released (after the stream's
    post-hook). Register them after ``stream_modules``."""
    handles = []
    for index, layer in enumerate(layers):

        def stamp(table: dict[int, float], index: int = index) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                table[index] = time.perf_counter()

            return hook

        handles.append(layer.register_forward_pre_hook(stamp(timeline.entered), prepend=True))
        handles.append(layer.register_forward_pre_hook(stamp(timeline.computing)))
        handles.append(layer.register_forward_hook(stamp(timeline.computed), prepend=True))
        handles.append(layer.register_forward_hook(stamp(timeline.released)))
    return handles


def run_workload(workload: Workload, directory: Path, repeat: int) -> dict[str, Any]:
    """Calibrate, then time the modes in turn, ``repeat`` rounds (noise hits them alike)."""
    weights = offload_layers(workload, directory)
    total_bytes = workload.layers * workload.layer_bytes

    load_seconds = median_seconds(lambda: loads_only(weights), 3)
    dense = [w._reload_unmanaged() for w in weights]
    batch = calibrate_batch(dense[0], load_seconds / workload.layers)
    x = torch.randn(batch, workload.width, generator=torch.Generator().manual_seed(1))
    expected = compute_only(dense, x)
    if not torch.equal(sequential_forward(weights, x), expected):
        raise AssertionError("the sequential forward computed a wrong value")

    layers = [Layer(w) for w in weights]
    model = nn.Sequential(*layers)
    timeline = Timeline()
    index_of = {id(w): i for i, w in enumerate(weights)}
    pool = TensorResidencyPool(max_cached_bytes=BUDGET_LAYERS * workload.layer_bytes)
    modes: dict[str, Callable[[], object]] = {
        "total_load": lambda: loads_only(weights),
        "total_compute": lambda: compute_only(dense, x),
        "sequential": lambda: sequential_forward(weights, x),
        "pipelined": lambda: model(x),
    }
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    with pool, stream_modules(pool, layers, depth=1), pool.scope(), torch.no_grad():
        if not torch.equal(model(x), expected):
            raise AssertionError("the pipelined forward computed a wrong value")
        for round_index in range(repeat + 1):
            for mode, run in modes.items():
                gc.collect()
                start = time.perf_counter()
                run()
                if round_index:  # the first round warms up
                    samples[mode].append(time.perf_counter() - start)
        handles = timing_hooks(layers, timeline)
        with recorded_reads(timeline, index_of):
            timeline.start = time.perf_counter()
            model(x)
            recorded_seconds = time.perf_counter() - timeline.start
        for handle in handles:
            handle.remove()
        stats = pool.stats()

    load_seconds, compute_seconds, sequential_seconds, pipelined_seconds = (
        statistics.median(samples[mode]) for mode in modes
    )
    per_round = [(s - p) / (s - max(lo, c)) for lo, c, s, p in zip(*samples.values(), strict=True)]
    ideal_seconds = max(load_seconds, compute_seconds)
    efficiency = (sequential_seconds - pipelined_seconds) / (sequential_seconds - ideal_seconds)
    recorded = timeline.as_json()
    read_time = sum(r["end"] - r["start"] for r in recorded["reads"])
    read_bytes = len(recorded["reads"]) * workload.layer_bytes
    stall = sum(r["compute_start"] - r["entered"] for r in recorded["layers"])
    hooks = sum(r["released"] - r["compute_end"] for r in recorded["layers"])
    return {
        "workload": workload.name,
        "layers": workload.layers,
        "width": workload.width,
        "layer_bytes": workload.layer_bytes,
        "batch": batch,
        "budget_layers": BUDGET_LAYERS,
        "seconds": {
            "total_load": load_seconds,
            "total_compute": compute_seconds,
            "ideal": ideal_seconds,
            "sequential": sequential_seconds,
            "pipelined": pipelined_seconds,
            "recorded_forward": recorded_seconds,
        },
        "samples_seconds": samples,
        "overlap_efficiency_per_round": per_round,
        "overlap_efficiency": efficiency,
        "fresh_read_gbps": total_bytes / load_seconds / 1e9,
        "pool_read_gbps": read_bytes / read_time / 1e9 if read_time else None,
        "recorded_stall_seconds": stall,
        "recorded_release_seconds": hooks,
        "pool_stats": stats._asdict(),
        "timeline": recorded,
    }


# ---------------------------------------------------------------------------------------------
# Chart
# ---------------------------------------------------------------------------------------------
def draw_timeline(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Draw the recorded forwards (reads lane, compute lane) into ``path``; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timeline chart (pip install '.[bench]')")
        return None
    figure, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    colors = plt.get_cmap("tab20")
    for axis, run in zip(axes[:, 0], runs, strict=True):
        timeline = run["timeline"]
        for read in timeline["reads"]:
            layer = read["layer"]
            axis.broken_barh(
                [(read["start"] * 1e3, (read["end"] - read["start"]) * 1e3)],
                (1.1, 0.8),
                facecolors=colors(layer % 20),
                edgecolors="black",
                linewidth=0.4,
            )
            axis.text(
                (read["start"] + read["end"]) / 2 * 1e3,
                1.5,
                str(layer),
                ha="center",
                va="center",
                fontsize=7,
            )
        for entry in timeline["layers"]:
            layer = entry["layer"]
            stall = entry["compute_start"] - entry["entered"]
            if stall > 0:
                axis.broken_barh(
                    [(entry["entered"] * 1e3, stall * 1e3)], (0.25, 0.5), facecolors="lightgray"
                )
            axis.broken_barh(
                [
                    (
                        entry["compute_start"] * 1e3,
                        (entry["compute_end"] - entry["compute_start"]) * 1e3,
                    )
                ],
                (0.1, 0.8),
                facecolors=colors(layer % 20),
                edgecolors="black",
                linewidth=0.4,
            )
            axis.text(
                (entry["compute_start"] + entry["compute_end"]) / 2 * 1e3,
                0.5,
                str(layer),
                ha="center",
                va="center",
                fontsize=7,
            )
        axis.set_yticks([0.5, 1.5], ["compute", "reads"])
        axis.set_ylim(0, 2)
        axis.set_xlabel("ms since the forward started")
        axis.set_title(
            f"{run['workload']} float32, budget {run['budget_layers']} layers, depth 1: "
            f"overlap efficiency {run['overlap_efficiency']:.2f} "
            "(gray: waiting for the weight)",
            fontsize=9,
        )
        axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    if arguments.quick:
        workloads = [Workload(6, 256), Workload(4, 512)]
    else:
        workloads = [Workload(16, 2048), Workload(6, 4096)]
    repeat = arguments.repeat or (3 if arguments.quick else 7)
    runs = []
    for workload in workloads:
        with tempfile.TemporaryDirectory(prefix="t2n-bench-overlap-") as directory:
            runs.append(run_workload(workload, Path(directory), repeat))
        print(f"  {workload.name}: done", flush=True)

    output_path = arguments.output
    chart_path = arguments.chart or (
        (output_path.parent if output_path else Path(__file__).resolve().parent / "results")
        / "timeline.png"
    )
    chart = draw_timeline(runs, chart_path)

    summary = []
    rows = []
    for run in runs:
        s = run["seconds"]
        summary.append(
            summary_row(
                f"overlap efficiency, {run['workload']}",
                f"{run['overlap_efficiency']:.2f} (pipelined {s['pipelined'] * 1e3:.0f} ms)",
                f"sequential {s['sequential'] * 1e3:.0f} ms, ideal {s['ideal'] * 1e3:.0f} ms",
                f">= {EFFICIENCY_TARGET:g}",
                run["overlap_efficiency"] >= EFFICIENCY_TARGET,
            )
        )
        pool_gbps = run["pool_read_gbps"]
        summary.append(
            summary_row(
                f"read throughput, {run['workload']}",
                "pool " + (f"{pool_gbps:.2f} GB/s" if pool_gbps else "n/a"),
                f"sequential fresh reads {run['fresh_read_gbps']:.2f} GB/s",
            )
        )
        rows.append(
            [
                run["workload"],
                str(run["batch"]),
                *(
                    f"{s[k] * 1e3:.0f}"
                    for k in ("total_load", "total_compute", "ideal", "sequential", "pipelined")
                ),
                f"{run['overlap_efficiency']:.2f}",
                f"{run['recorded_stall_seconds'] * 1e3:.0f}",
            ]
        )
    details: dict[str, Any] = {
        "headers": [
            "workload (ms per forward)",
            "batch",
            "load",
            "compute",
            "ideal",
            "sequential",
            "pipelined",
            "efficiency",
            "stall",
        ],
        "rows": rows,
    }
    document = {
        "config": {
            "workloads": [w.name for w in workloads],
            "repeat": repeat,
            "budget_layers": BUDGET_LAYERS,
            "depth": 1,
            "torch_threads": torch.get_num_threads(),
            "quick": arguments.quick,
        },
        "results": runs,
        "summary": summary,
        "details": details,
        "chart": None if chart is None else str(chart),
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("overlap", document, output_path)
    print(format_table(details["headers"], details["rows"]))
    print()
    print_summary(summary)
    if chart is not None:
        print(f"timeline chart: {chart}")
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    return document


if __name__ == "__main__":
    main()
