"""Overlap of reads with compute when streaming layers through a residency pool.

Two workloads, run separately: 16 layers of 2048 x 2048 and 6 layers of 4096 x 4096 float32
weights, offloaded to payload files (page cache warm: every file is read once first). Each
layer computes ``F.linear(x, w)`` on one torch thread, with a batch calibrated in the run so
that it takes about as long as reading the layer's weight. The modes take turns for several
rounds (so that noise from the rest of the machine hits them alike), each running three
forwards in a row per round, the first not kept (the steady state of back-to-back forwards, as
a server runs them); medians kept:

- ``sequential`` (no pool): read each weight into a reused, already touched buffer
  (``storage.read_payload(..., out=)``, the fastest synchronous read), then compute; the
  read and compute phases are timed inside it, giving ``load`` and ``compute``;
- ``ideal``: ``max(load, compute)``;
- ``pool pipeline``: the layers streamed through a ``TensorResidencyPool`` with
  ``stream_modules(pool, layers, depth=1)``, so that layer i+1 is read while layer i
  computes, and the next forward's first layer while the last one does. Its budget is 0: it
  caches nothing and holds two layers, as the hand pipeline does;
- ``pool pipeline, cached`` (context): the same through a second pool that also keeps the
  last three layers (LRU). A cyclic pass over more layers than the budget hits none of them,
  so it reads as much; the cache only costs memory bandwidth (each read lands in the
  coldest buffer, that of the layer evicted);
- ``prefetch ahead``: the pool's documented sync pattern written by hand, without hooks:
  ``pool.prefetch(w[i + 1])`` then ``with pool.acquire(w[i]) as v: F.linear(x, v)``, the last
  layer prefetching the next forward's first, through a pool with a budget of three layers
  (LRU). Target: efficiency >= 0.8 on 16 x 2048x2048, >= 0.5 on 6 x 4096x4096;
- ``prefetch ahead, copying reads`` (context): the same through a pool of its own while
  mapped reads are off (``storage.set_mapped_reads(False)``): each load copies the layer into
  a reused buffer, as the hand pipeline does, instead of mapping its pages. Which of the two
  runs faster depends on the machine: a copy costs the reader memory bandwidth, and leaves
  the weight in the processor's cache, where the compute then finds it (see below);
- ``hand pipeline`` (reference, no pool): one reader thread fills two reused buffers a layer
  ahead of the compute, each forward starting with a read;
- ``naive reload()`` (context): each weight reloaded into fresh memory, then used, as code
  without a pool would do; fresh memory costs page faults, so the pool (which reuses
  buffers) also beats it on reads.

Overlap efficiency = (sequential - pipelined) / (sequential - ideal): 1 when the pipeline hides
every read (or all compute), 0 when it overlaps nothing. Target: >= 0.8 for both workloads.
Each kept forward of a mode is paired with the sequential forward of the same round (moments
apart, under the same load): the figure is the median of those per-forward efficiencies,
reported with their quartiles (the efficiency of the medians is in the JSON too).
Also reported: the read throughput of the pool's loads, of the sequential reads and of fresh
reloads, and ``compute alone``: the forward over weights read long before, as in any
pipeline, where a layer's weight was read while the previous one computed. The sequential
``compute`` phase runs on a weight just read, still in the processor's cache; in a pipeline
the weight is no longer there (a mapped load does not even bring it: its pages are mapped,
not read), no pipeline computes that fast, and the ideal is out of reach (memory bandwidth
and cores shared with the rest of the machine bound the rest). The efficiency of a forward
that hides every read but computes at the speed of ``compute alone`` is reported beside the
targets, as the ceiling a pipeline reaches on the machine of the run.

One streamed forward per workload is recorded: the read intervals (the ``_reload_unmanaged``
jobs of the I/O workers, patched in this process only) and, through forward hooks, when each
layer was entered, when its compute started (after waiting for its weight), ended, and when
its leases were released.
``timeline.png`` draws them: a lane of reads and a lane of compute per workload, one bar per
layer, waits in gray.

Run: ``python benchmarks/bench_overlap.py [--quick] [--output PATH] [--chart PATH]
[--repeat N]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import queue
import statistics
import sys
import tempfile
import threading
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
from _report import freeze_survivors, gc_paused, print_summary, summary_row

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool, stream_modules

EFFICIENCY_TARGET = 0.8
AHEAD_TARGETS = {2048: 0.8, 4096: 0.5}
"""Efficiency targets of the prefetch-ahead pattern, by layer width."""
AHEAD_BUDGET_LAYERS = 3
CACHED_LAYERS = 3
BLOCK = 3  # forwards of a mode in a row, per round; the first is not kept
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
# The modes without a pool
# ---------------------------------------------------------------------------------------------
class Reader:
    """Reads the layers' payloads synchronously into two reused, already touched buffers."""

    def __init__(self, weights: list[OffloadedTensor]) -> None:
        self.layouts = [storage.read_layout(w.offload_path) for w in weights]
        self.entry = next(iter(self.layouts[0].entries))
        self.buffers = [storage.allocate(self.layouts[0]) for _ in range(2)]
        for buffers in self.buffers:
            for buffer in buffers.values():
                buffer.zero_()  # touch every page once

    def __len__(self) -> int:
        return len(self.layouts)

    def read(self, index: int, slot: int) -> torch.Tensor:
        """Read layer ``index`` into buffer ``slot``; return the buffer."""
        storage.read_payload(self.layouts[index], out=self.buffers[slot])
        return self.buffers[slot][self.entry]

    def read_all(self) -> None:
        for index in range(len(self)):
            self.read(index, 0)


def sequential_forward(
    reader: Reader, x: torch.Tensor, phases: list[float] | None = None
) -> torch.Tensor:
    """Read each weight, then use it; add the seconds of each phase to ``phases``."""
    load = compute = 0.0
    for index in range(len(reader)):
        start = time.perf_counter()
        weight = reader.read(index, 0)
        loaded = time.perf_counter()
        x = F.linear(x, weight)
        compute += time.perf_counter() - loaded
        load += loaded - start
    if phases is not None:
        phases[0] += load
        phases[1] += compute
    return x


def hand_pipeline(reader: Reader, x: torch.Tensor) -> torch.Tensor:
    """A reader thread fills the two buffers one layer ahead of the compute on this thread."""
    ready: queue.Queue[tuple[int, torch.Tensor]] = queue.Queue()
    free: queue.Queue[int] = queue.Queue()
    for slot in range(len(reader.buffers)):
        free.put(slot)

    def read_ahead() -> None:
        for index in range(len(reader)):
            slot = free.get()
            ready.put((slot, reader.read(index, slot)))

    thread = threading.Thread(target=read_ahead, name="hand-pipeline-reader")
    thread.start()
    for _ in range(len(reader)):
        slot, weight = ready.get()
        x = F.linear(x, weight)
        free.put(slot)
    thread.join()
    return x


def naive_forward(weights: list[OffloadedTensor], x: torch.Tensor) -> torch.Tensor:
    """Reload each weight into fresh memory, then use it."""
    for weight in weights:
        x = F.linear(x, weight._reload_unmanaged())
    return x


def prefetch_ahead(
    pool: TensorResidencyPool, weights: list[OffloadedTensor], x: torch.Tensor
) -> torch.Tensor:
    """The sync prefetch-ahead pattern: prefetch layer i+1, lease layer i, compute."""
    count = len(weights)
    pool.prefetch(weights[0])
    for index, weight in enumerate(weights):
        pool.prefetch(weights[(index + 1) % count])
        with pool.acquire(weight) as value:
            x = F.linear(x, value)
    return x


def compute_only(dense: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for weight in dense:
        x = F.linear(x, weight)
    return x


def compute_under_reads(reader: Reader, dense: list[torch.Tensor], x: torch.Tensor) -> float:
    """Seconds of ``compute_only`` while a thread reads the layers in a loop."""
    stop = threading.Event()

    def read_in_loop() -> None:
        while not stop.is_set():
            for index in range(len(reader)):
                if stop.is_set():
                    return
                reader.read(index, 1)

    thread = threading.Thread(target=read_in_loop, name="background-reader")
    thread.start()
    try:
        start = time.perf_counter()
        compute_only(dense, x)
        return time.perf_counter() - start
    finally:
        stop.set()
        thread.join()


@contextmanager
def recorded_reads(timeline: Timeline, index_of: dict[int, int]) -> Iterator[None]:
    """Record every ``OffloadedTensor._reload_unmanaged`` (the job the pool's I/O workers
    run for a load) while the block runs."""
    original = OffloadedTensor._reload_unmanaged

    def timed_load(self: OffloadedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            timeline.reads.append((index_of.get(id(self), -1), start, time.perf_counter()))

    OffloadedTensor._reload_unmanaged = timed_load  # type: ignore[method-assign]
    try:
        yield
    finally:
        OffloadedTensor._reload_unmanaged = original  # type: ignore[method-assign]


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


def efficiency(sequential: float, pipelined: float, ideal: float) -> float:
    """(sequential - pipelined) / (sequential - ideal)."""
    return (sequential - pipelined) / (sequential - ideal)


def paired_efficiency(samples: list[float]) -> dict[str, float]:
    """The median and quartiles of per-sample efficiencies: each sample pairs a forward of a
    mode with the sequential forward of the same round (moments apart, under the same load),
    which a burst of load on the machine moves less than a ratio of separate medians."""
    ordered = sorted(samples)
    if len(ordered) < 2:
        value = ordered[0] if ordered else float("nan")
        return {"median": value, "q1": value, "q3": value}
    q1, _, q3 = statistics.quantiles(ordered, n=4)
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3}


MODES = (
    "sequential",
    "sequential_load",
    "sequential_compute",
    "hand_pipeline",
    "pool_pipeline",
    "pool_pipeline_cached",
    "prefetch_ahead",
    "prefetch_ahead_copying",
    "naive_reload",
    "compute_alone",
    "compute_under_reads",
)


PIPELINES = (
    "pool_pipeline",
    "pool_pipeline_cached",
    "prefetch_ahead",
    "prefetch_ahead_copying",
    "hand_pipeline",
)
"""The modes whose efficiency is measured against the sequential forward of their round."""


def run_workload(workload: Workload, directory: Path, repeat: int) -> dict[str, Any]:
    """Calibrate, then time every mode in turn for ``repeat`` rounds."""
    weights = offload_layers(workload, directory)
    reader = Reader(weights)
    total_bytes = workload.layers * workload.layer_bytes
    read_seconds = median_seconds(reader.read_all, 5)
    dense = [w._reload_unmanaged() for w in weights]
    batch = calibrate_batch(dense[0], read_seconds / workload.layers)
    x = torch.randn(batch, workload.width, generator=torch.Generator().manual_seed(1))
    expected = compute_only(dense, x)
    for name, check in (
        ("sequential", lambda: sequential_forward(reader, x)),
        ("hand pipeline", lambda: hand_pipeline(reader, x)),
        ("naive reload", lambda: naive_forward(weights, x)),
    ):
        if not torch.equal(check(), expected):
            raise AssertionError(f"the {name} forward computed a wrong value")

    # Two models over the same offloaded weights, each streamed through its own pool (the
    # stream's hooks enter the pool's scope for each layer).
    layers = [Layer(w) for w in weights]
    model = nn.Sequential(*layers)
    cached_layers = [Layer(w) for w in weights]
    cached_model = nn.Sequential(*cached_layers)
    timeline = Timeline()
    index_of = {id(w): i for i, w in enumerate(weights)}
    pool = TensorResidencyPool(max_cached_bytes=0)
    cached_pool = TensorResidencyPool(max_cached_bytes=CACHED_LAYERS * workload.layer_bytes)
    ahead_pool = TensorResidencyPool(max_cached_bytes=AHEAD_BUDGET_LAYERS * workload.layer_bytes)
    copying_pool = TensorResidencyPool(max_cached_bytes=AHEAD_BUDGET_LAYERS * workload.layer_bytes)
    samples: dict[str, list[float]] = {name: [] for name in MODES}

    kept = False

    def timed(name: str, run: Callable[[], object], keep: bool) -> None:
        nonlocal kept
        gc.collect()
        for index in range(BLOCK):
            kept = keep and index > 0
            start = time.perf_counter()
            run()
            if kept:
                samples[name].append(time.perf_counter() - start)

    copying_ahead = functools.partial(prefetch_ahead, copying_pool, weights, x)

    @contextmanager
    def copying_reads() -> Iterator[None]:
        """Mapped reads off for ``copying_pool``'s forwards. The reads of the next forward's
        first layer that the last forwards started end before the switch turns, and the
        evictions they make (a pool's ``flush`` reaches its loop after them), so that every
        load of that pool is a copy, none of the others' is, and only that pool keeps the
        buffers of its evicted values for reuse."""

        def settle(pools: tuple[TensorResidencyPool, ...]) -> None:
            for started in pools:
                started.prefetch(weights[0]).wait()
                started.flush()

        settle((pool, cached_pool, ahead_pool))
        mapped = storage.set_mapped_reads(False)
        try:
            yield
            settle((copying_pool,))
        finally:
            storage.set_mapped_reads(mapped)

    def sequential() -> None:
        phases = [0.0, 0.0]
        sequential_forward(reader, x, phases)
        if kept:
            samples["sequential_load"].append(phases[0])
            samples["sequential_compute"].append(phases[1])

    with (
        pool,
        cached_pool,
        ahead_pool,
        copying_pool,
        stream_modules(pool, layers, depth=1),
        stream_modules(cached_pool, cached_layers, depth=1),
        torch.no_grad(),
    ):
        for name, check in (
            ("pool", functools.partial(model, x)),
            ("cached pool", functools.partial(cached_model, x)),
            ("prefetch-ahead pool", functools.partial(prefetch_ahead, ahead_pool, weights, x)),
        ):
            if not torch.equal(check(), expected):
                raise AssertionError(f"the {name}'s pipelined forward computed a wrong value")
        with copying_reads():
            if not torch.equal(copying_ahead(), expected):
                raise AssertionError("the copying pool's forward computed a wrong value")
        for round_index in range(repeat + 1):
            keep = round_index > 0  # the first round warms up
            timed("sequential", sequential, keep)
            timed("hand_pipeline", functools.partial(hand_pipeline, reader, x), keep)
            timed("pool_pipeline", functools.partial(model, x), keep)
            timed("pool_pipeline_cached", functools.partial(cached_model, x), keep)
            timed("prefetch_ahead", functools.partial(prefetch_ahead, ahead_pool, weights, x), keep)
            with copying_reads():
                timed("prefetch_ahead_copying", copying_ahead, keep)
            timed("naive_reload", functools.partial(naive_forward, weights, x), keep)
            timed("compute_alone", functools.partial(compute_only, dense, x), keep)
            gc.collect()
            under_reads = compute_under_reads(reader, dense, x)
            if keep:
                samples["compute_under_reads"].append(under_reads)
        handles = timing_hooks(layers, timeline)
        with recorded_reads(timeline, index_of):
            timeline.start = time.perf_counter()
            model(x)
            recorded_seconds = time.perf_counter() - timeline.start
        for handle in handles:
            handle.remove()
        stats = pool.stats()
        cached_stats = cached_pool.stats()
        ahead_stats = ahead_pool.stats()
        copying_stats = copying_pool.stats()

    seconds = {name: statistics.median(values) for name, values in samples.items()}
    seconds["ideal"] = max(seconds["sequential_load"], seconds["sequential_compute"])
    seconds["recorded_forward"] = recorded_seconds
    per_round = {
        mode: [
            efficiency(s, p, max(lo, c))
            for s, p, lo, c in zip(
                samples["sequential"],
                samples[mode],
                samples["sequential_load"],
                samples["sequential_compute"],
                strict=True,
            )
        ]
        for mode in PIPELINES
    }
    paired = {mode: paired_efficiency(values) for mode, values in per_round.items()}
    recorded = timeline.as_json()
    read_time = sum(r["end"] - r["start"] for r in recorded["reads"])
    read_bytes = len(recorded["reads"]) * workload.layer_bytes
    return {
        "workload": workload.name,
        "layers": workload.layers,
        "width": workload.width,
        "layer_bytes": workload.layer_bytes,
        "batch": batch,
        "budget_layers": 0,
        "cached_budget_layers": CACHED_LAYERS,
        "seconds": seconds,
        "samples_seconds": samples,
        "overlap_efficiency": paired["pool_pipeline"]["median"],
        "cached_pool_efficiency": paired["pool_pipeline_cached"]["median"],
        "prefetch_ahead_efficiency": paired["prefetch_ahead"]["median"],
        "prefetch_ahead_copying_efficiency": paired["prefetch_ahead_copying"]["median"],
        "hand_pipeline_efficiency": paired["hand_pipeline"]["median"],
        "efficiency_per_sample": per_round,
        "efficiency_spread": paired,
        "efficiency_of_medians": {
            mode: efficiency(seconds["sequential"], seconds[mode], seconds["ideal"])
            for mode in per_round
        },
        # What a pipeline reaches when every read is hidden but each layer computes on a
        # weight read while the previous one computed (see the module's docstring).
        "efficiency_ceiling": efficiency(
            seconds["sequential"],
            max(seconds["sequential_load"], seconds["compute_alone"]),
            seconds["ideal"],
        ),
        "speedup_over_naive_reload": seconds["naive_reload"] / seconds["pool_pipeline"],
        "compute_slowdown_under_reads": seconds["compute_under_reads"] / seconds["compute_alone"],
        "read_gbps": {
            "sequential_reused_buffer": total_bytes / seconds["sequential_load"] / 1e9,
            "pool_recorded_forward": read_bytes / read_time / 1e9 if read_time else None,
        },
        "recorded_stall_seconds": sum(
            r["compute_start"] - r["entered"] for r in recorded["layers"]
        ),
        "recorded_release_seconds": sum(
            r["released"] - r["compute_end"] for r in recorded["layers"]
        ),
        "pool_stats": stats._asdict(),
        "cached_pool_stats": cached_stats._asdict(),
        "prefetch_ahead_stats": ahead_stats._asdict(),
        "prefetch_ahead_copying_stats": copying_stats._asdict(),
        "timeline": recorded,
    }


# ---------------------------------------------------------------------------------------------
# Chart
# ---------------------------------------------------------------------------------------------
def _labelled_bar(
    axis: Any, start: float, end: float, bottom: float, layer: int, colors: Any
) -> None:
    """One bar of a timeline lane (seconds in, milliseconds drawn), labelled by its layer."""
    axis.broken_barh(
        [(start * 1e3, (end - start) * 1e3)],
        (bottom, 0.8),
        facecolors=colors(layer % 20),
        edgecolors="black",
        linewidth=0.4,
    )
    axis.text(
        (start + end) / 2 * 1e3, bottom + 0.4, str(layer), ha="center", va="center", fontsize=7
    )


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
            _labelled_bar(axis, read["start"], read["end"], 1.1, read["layer"], colors)
        for entry in timeline["layers"]:
            stall = entry["compute_start"] - entry["entered"]
            if stall > 0:
                axis.broken_barh(
                    [(entry["entered"] * 1e3, stall * 1e3)], (0.25, 0.5), facecolors="lightgray"
                )
            _labelled_bar(
                axis, entry["compute_start"], entry["compute_end"], 0.1, entry["layer"], colors
            )
        axis.set_yticks([0.5, 1.5], ["compute", "reads"])
        axis.set_ylim(0, 2)
        axis.set_xlabel("ms since the forward started")
        axis.set_title(
            f"{run['workload']} float32, budget 0, depth 1: "
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


def spread(run: dict[str, Any], mode: str) -> str:
    """The quartiles of a mode's per-forward efficiencies, as text."""
    quartiles = run["efficiency_spread"][mode]
    return f"{quartiles['q1']:.2f}-{quartiles['q3']:.2f}"


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    if arguments.quick:
        freeze_survivors()
        workloads = [Workload(8, 256), Workload(6, 512)]
    else:
        workloads = [Workload(16, 2048), Workload(6, 4096)]
    repeat = arguments.repeat or (2 if arguments.quick else 4)
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
        gbps = run["read_gbps"]
        pool_gbps = gbps["pool_recorded_forward"]
        summary += [
            summary_row(
                f"overlap efficiency, {run['workload']}",
                f"{run['overlap_efficiency']:.2f} "
                f"(pool pipeline {s['pool_pipeline'] * 1e3:.0f} ms; quartiles "
                f"{spread(run, 'pool_pipeline')})",
                f"sequential {s['sequential'] * 1e3:.0f} ms, ideal {s['ideal'] * 1e3:.0f} ms; "
                f"hand-written pipeline {run['hand_pipeline_efficiency']:.2f}",
                f">= {EFFICIENCY_TARGET:g}",
                run["overlap_efficiency"] >= EFFICIENCY_TARGET,
            ),
            summary_row(
                f"overlap efficiency with an LRU cache of {CACHED_LAYERS} layers, "
                f"{run['workload']}",
                f"{run['cached_pool_efficiency']:.2f} ({s['pool_pipeline_cached'] * 1e3:.0f} ms)",
                f"{run['cached_pool_stats']['loads']} layer loads in all, against "
                f"{run['pool_stats']['loads']} without the cache",
            ),
            summary_row(
                f"overlap efficiency, sync prefetch(i+1) + acquire(i), budget "
                f"{AHEAD_BUDGET_LAYERS} layers, {run['workload']}",
                f"{run['prefetch_ahead_efficiency']:.2f} ({s['prefetch_ahead'] * 1e3:.0f} ms; "
                f"quartiles {spread(run, 'prefetch_ahead')} over "
                f"{len(run['efficiency_per_sample']['prefetch_ahead'])} forwards)",
                f"stream_modules {run['overlap_efficiency']:.2f}, "
                f"hand-written pipeline {run['hand_pipeline_efficiency']:.2f}",
                f">= {AHEAD_TARGETS.get(run['width'], EFFICIENCY_TARGET):g}",
                run["prefetch_ahead_efficiency"]
                >= AHEAD_TARGETS.get(run["width"], EFFICIENCY_TARGET),
            ),
            summary_row(
                f"overlap efficiency, sync prefetch(i+1) + acquire(i), copying reads, "
                f"{run['workload']}",
                f"{run['prefetch_ahead_copying_efficiency']:.2f} "
                f"({s['prefetch_ahead_copying'] * 1e3:.0f} ms; quartiles "
                f"{spread(run, 'prefetch_ahead_copying')})",
                f"mapped reads (the default) {run['prefetch_ahead_efficiency']:.2f}",
            ),
            summary_row(
                f"speed-up over naive reload(), {run['workload']}",
                f"{run['speedup_over_naive_reload']:.2f}x",
                f"naive reload() then compute {s['naive_reload'] * 1e3:.0f} ms",
            ),
            summary_row(
                f"read throughput, {run['workload']}",
                "pool " + (f"{pool_gbps:.2f} GB/s" if pool_gbps else "n/a"),
                f"sequential reads {gbps['sequential_reused_buffer']:.2f} GB/s",
            ),
            summary_row(
                f"compute on weights read long before, {run['workload']}",
                f"{s['compute_alone'] * 1e3:.0f} ms "
                f"({run['compute_slowdown_under_reads']:.2f}x that while reads run)",
                f"just read (sequential) {s['sequential_compute'] * 1e3:.0f} ms",
            ),
            summary_row(
                f"efficiency of a forward as long as compute on weights read long before, "
                f"{run['workload']}",
                f"{run['efficiency_ceiling']:.2f} (max(load, compute on weights read long "
                f"before) = {max(s['sequential_load'], s['compute_alone']) * 1e3:.0f} ms)",
                f"prefetch ahead {s['prefetch_ahead'] * 1e3:.0f} ms, "
                f"pool pipeline {s['pool_pipeline'] * 1e3:.0f} ms",
            ),
        ]
        rows.append(
            [
                run["workload"],
                str(run["batch"]),
                *(
                    f"{s[k] * 1e3:.0f}"
                    for k in (
                        "sequential_load",
                        "sequential_compute",
                        "ideal",
                        "sequential",
                        "hand_pipeline",
                        "pool_pipeline",
                        "pool_pipeline_cached",
                        "prefetch_ahead",
                        "prefetch_ahead_copying",
                        "naive_reload",
                    )
                ),
                f"{run['overlap_efficiency']:.2f}",
                f"{run['recorded_stall_seconds'] * 1e3:.0f}",
                f"{run['recorded_release_seconds'] * 1e3:.0f}",
            ]
        )
    details: dict[str, Any] = {
        "headers": [
            "workload (ms per forward, median)",
            "batch",
            "load",
            "compute",
            "ideal",
            "sequential",
            "hand pipeline",
            "pool pipeline",
            f"pool, LRU cache of {CACHED_LAYERS}",
            "prefetch ahead (sync)",
            "prefetch ahead, copying reads",
            "naive reload()",
            "efficiency",
            "stall (recorded)",
            "lease release (recorded)",
        ],
        "rows": rows,
    }
    document = {
        "config": {
            "workloads": [w.name for w in workloads],
            "repeat": repeat,
            "budget_layers": 0,
            "cached_budget_layers": CACHED_LAYERS,
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
