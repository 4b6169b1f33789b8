"""Peak memory while streaming a model four times larger than the pool's budget.

A checkpoint of 24 linear layers of 2048 x 2048 float32 (384 MiB) is written once, read once
(warm page cache), then fresh subprocesses run on it. Each imports torch and the library,
builds the model on the meta device and binds it to the checkpoint with
``load_offloaded_checkpoint``, starts a pool whose budget is a quarter of the model, runs one
small matmul (so that the BLAS library is loaded), frees a tensor the size of a layer (as
building or running any model does: glibc's mmap threshold then rises past the layers' size)
and loads one 4 KiB tensor through the pool (so that its loop and I/O threads run). Then:

- ``idle`` (context): nothing more;
- ``baseline``: two forwards streamed exactly as below, over the same 24 layers made 64 x 64
  (16 KiB each): everything the interpreter, torch and the library need to stream a forward,
  without the weights;
- ``stream``: two forwards of the model streamed through the pool
  (``stream_modules(pool, layers, depth=1)`` inside ``pool.scope()``), once per retention
  strategy (LRU and SCHEDULED) with mapped reads (the CPU default), and once (LRU) reading
  into buffers (``storage.set_mapped_reads(False)``).

No ``MALLOC_*`` variable reaches the subprocesses. Each reports its peak resident set
(``VmHWM`` on Linux, ``ru_maxrss`` elsewhere), how far it rose above the resident set just
before the forwards (where ``/proc/self/clear_refs`` can reset the peak), and what was left
above that once the pool was closed. Targets: the streaming peak stays under baseline +
budget + the two largest layers (the layer computing and the one being read ahead); its rise
during the forwards under budget + those two layers + 64 MiB (the bound of the project's
memory contract); and closing the pool gives back all but 16 MiB.

Run: ``python benchmarks/bench_memory.py [--quick] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results
from _report import print_summary, summary_row

MIB = 1 << 20
CHILD_TIMEOUT_S = 300
RUNS = (("LRU", True), ("SCHEDULED", True), ("LRU", False))  # (strategy, mapped reads)
SKELETON_WIDTH = 64
SLACK = 64 * MIB
"""Allowed above the budget and what is leased at once, for everything else the process does."""
LEFT_AFTER_CLOSE = 16 * MIB
"""Allowed above the resident set before the forwards once the pool is closed."""
CLEAR_REFS = "/proc/self/clear_refs"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--child",
        nargs=7,
        metavar=("MODE", "CHECKPOINT", "LAYERS", "WIDTH", "BUDGET", "STRATEGY", "MAPPED"),
        help=argparse.SUPPRESS,
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# In the subprocess
# ---------------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """The peak resident set of this process.

    On Linux, ``VmHWM`` of ``/proc/self/status``: the high-water mark of this process's own
    memory, whereas ``ru_maxrss`` keeps the parent's peak across ``fork`` and ``exec``.
    Elsewhere, ``ru_maxrss``.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def resident_bytes() -> int:
    """The resident set of this process now (``/proc/self/statm`` on Linux, else 0)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` from the current resident set (Linux); whether it could."""
    try:
        with open(CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def child(
    mode: str, checkpoint: str, layers: int, width: int, budget: int, strategy: str, mapped: bool
) -> None:
    """Run one measured process; print its figures as one JSON line."""
    import torch
    from torch import nn

    from torch_to_nnef.tensor import (
        OffloadedTensor,
        ResidencyStrategy,
        TensorResidencyPool,
        load_offloaded_checkpoint,
        storage,
        stream_modules,
    )

    storage.set_mapped_reads(mapped)
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    load_offloaded_checkpoint(model, checkpoint)
    x = torch.randn(8, width)
    pool = TensorResidencyPool(max_cached_bytes=budget, strategy=ResidencyStrategy[strategy])
    with pool, torch.no_grad(), tempfile.TemporaryDirectory() as directory:
        # Everything but the weights: the BLAS library loaded as a forward would, the pool's
        # loop and I/O threads started by one tiny load.
        (x @ torch.ones(width, 8)).sum()
        torch.ones(width, width).sum()  # a layer-sized tensor freed
        pool.resolve(OffloadedTensor.from_original_tensor(torch.zeros(1024), "warm", directory))
        before = resident_bytes()
        reset = reset_peak_rss()
        if mode != "idle":
            with stream_modules(pool, list(model), depth=1), pool.scope():
                for _ in range(2):
                    y = model(x)
                if not torch.isfinite(y).all():
                    raise AssertionError("the streamed forward produced non-finite values")
        stats = pool.stats()
        peak = peak_rss_bytes()
    figures = {
        "peak_rss_bytes": peak,
        "growth_bytes": peak - before if reset and before else None,
        "left_after_close_bytes": resident_bytes() - before if before else None,
        "loads": stats.loads,
    }
    print(json.dumps(figures))


# ---------------------------------------------------------------------------------------------
# In the benchmark process
# ---------------------------------------------------------------------------------------------
def write_checkpoint(path: Path, layers: int, width: int) -> None:
    import safetensors.torch
    import torch

    generator = torch.Generator().manual_seed(0)
    weights = {
        f"{i}.weight": torch.randn(width, width, generator=generator) / width**0.5
        for i in range(layers)
    }
    safetensors.torch.save_file(weights, str(path))
    with open(path, "rb") as file:  # warm the page cache
        while file.read(64 << 20):
            pass


def run_child(
    mode: str,
    checkpoint: Path,
    layers: int,
    width: int,
    budget: int,
    strategy: str = "LRU",
    mapped: bool = True,
) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        str(checkpoint),
        str(layers),
        str(width),
        str(budget),
        strategy,
        str(int(mapped)),
    ]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
        env=environment,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} subprocess failed ({done.returncode}):\n{done.stderr}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    arguments = parse_arguments(argv)
    if arguments.child:
        mode, checkpoint, layers, width, budget, strategy, mapped = arguments.child
        child(mode, checkpoint, int(layers), int(width), int(budget), strategy, mapped == "1")
        return None
    started = time.perf_counter()
    layers, width = (8, 256) if arguments.quick else (24, 2048)
    layer_bytes = width * width * 4
    model_bytes = layers * layer_bytes
    budget = model_bytes // 4
    with tempfile.TemporaryDirectory(prefix="t2n-bench-memory-") as directory:
        checkpoint = Path(directory) / "model.safetensors"
        write_checkpoint(checkpoint, layers, width)
        skeleton = Path(directory) / "skeleton.safetensors"
        write_checkpoint(skeleton, layers, SKELETON_WIDTH)
        idle = run_child("idle", checkpoint, layers, width, budget)
        baseline = run_child("baseline", skeleton, layers, SKELETON_WIDTH, budget)
        runs = RUNS[::2] if arguments.quick else RUNS
        streams = {
            (strategy, mapped): run_child(
                "stream", checkpoint, layers, width, budget, strategy, mapped
            )
            for strategy, mapped in runs
        }
    allowance = budget + 2 * layer_bytes
    bound = baseline["peak_rss_bytes"] + allowance
    growth_bound = allowance + SLACK
    results = []
    summary = []
    for (strategy, mapped), figures in streams.items():
        label = f"{strategy}, {'mapped' if mapped else 'buffered'} reads"
        peak = figures["peak_rss_bytes"]
        above = peak - baseline["peak_rss_bytes"]
        growth, left = figures["growth_bytes"], figures["left_after_close_bytes"]
        results.append(
            {
                "strategy": strategy,
                "mapped": mapped,
                "peak_rss_bytes": peak,
                "above_baseline_bytes": above,
                "growth_bytes": growth,
                "left_after_close_bytes": left,
                "loads": figures["loads"],
                "met": peak <= bound,
                "growth_met": None if growth is None else growth <= growth_bound,
                "left_met": None if left is None else left <= LEFT_AFTER_CLOSE,
            }
        )
        summary.append(
            summary_row(
                f"peak RSS streaming {model_bytes / MIB:.0f} MiB, budget "
                f"{budget / MIB:.0f} MiB, {label}",
                f"{peak / MIB:.0f} MiB (baseline + {above / MIB:.0f} MiB)",
                f"baseline {baseline['peak_rss_bytes'] / MIB:.0f} MiB",
                f"<= baseline + {allowance / MIB:.0f} MiB (budget + 2 layers)",
                peak <= bound,
            )
        )
        if growth is not None and left is not None:
            summary.append(
                summary_row(
                    f"peak RSS growth during the forwards, {label}",
                    f"{growth / MIB:.0f} MiB ({left / MIB:.0f} MiB left after close)",
                    f"budget {budget / MIB:.0f} MiB, layer {layer_bytes / MIB:.0f} MiB",
                    f"<= {growth_bound / MIB:.0f} MiB (budget + 2 layers leased + 64 MiB), "
                    f"<= {LEFT_AFTER_CLOSE / MIB:.0f} MiB left",
                    growth <= growth_bound and left <= LEFT_AFTER_CLOSE,
                )
            )
    details: dict[str, Any] = {
        "headers": [
            "process",
            "peak RSS MiB",
            "above baseline MiB",
            "growth MiB",
            "left after close MiB",
            "layer loads",
        ],
        "rows": [
            [
                "idle (no forward)",
                f"{idle['peak_rss_bytes'] / MIB:.1f}",
                f"{(idle['peak_rss_bytes'] - baseline['peak_rss_bytes']) / MIB:.1f}",
                mib(idle["growth_bytes"]),
                mib(idle["left_after_close_bytes"]),
                str(idle["loads"]),
            ],
            [
                f"baseline (same forwards, {SKELETON_WIDTH} x {SKELETON_WIDTH} weights)",
                f"{baseline['peak_rss_bytes'] / MIB:.1f}",
                "0.0",
                mib(baseline["growth_bytes"]),
                mib(baseline["left_after_close_bytes"]),
                str(baseline["loads"]),
            ],
            *(
                [
                    f"stream, {r['strategy']}, {'mapped' if r['mapped'] else 'buffered'} reads",
                    f"{r['peak_rss_bytes'] / MIB:.1f}",
                    f"{r['above_baseline_bytes'] / MIB:.1f}",
                    mib(r["growth_bytes"]),
                    mib(r["left_after_close_bytes"]),
                    str(r["loads"]),
                ]
                for r in results
            ),
        ],
    }
    document = {
        "config": {
            "layers": layers,
            "width": width,
            "layer_bytes": layer_bytes,
            "model_bytes": model_bytes,
            "budget_bytes": budget,
            "forwards": 2,
            "quick": arguments.quick,
        },
        "baseline_peak_rss_bytes": baseline["peak_rss_bytes"],
        "idle_peak_rss_bytes": idle["peak_rss_bytes"],
        "bound_bytes": bound,
        "growth_bound_bytes": growth_bound,
        "left_after_close_bound_bytes": LEFT_AFTER_CLOSE,
        "results": results,
        "summary": summary,
        "details": details,
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("memory", document, arguments.output)
    print(format_table(details["headers"], details["rows"]))
    print()
    print_summary(summary)
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    return document


if __name__ == "__main__":
    main()
