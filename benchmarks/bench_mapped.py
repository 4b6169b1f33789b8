"""Mapped reads against reads into reused buffers, for CPU targets, warm and cold page cache.

A payload file of 16 float32 matrices of 2048 x 4096 (32 MiB each, 512 MiB) stands for the
layers of a model streamed once per token. One "token" goes through every matrix in order:
get its value (``storage.read_payload`` into a buffer allocated once and reused, or
``storage.map_payload``, the pages of the file mapped in place), then use it (a matrix-vector
product, as a decoding step does). Warm: the file stays in the page cache; cold: its pages are
evicted before every token (``posix_fadvise(POSIX_FADV_DONTNEED)``), as for a model bigger
than the machine's RAM. The compute alone, on resident buffers, is the reference.

Target: the mapped read at least as fast as the buffered one, warm and cold (the pool's
default for CPU targets follows this figure).

Run: ``python benchmarks/bench_mapped.py [--quick] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _hf_job import drop_page_cache
from _report import publish, summary_row

from torch_to_nnef.tensor import storage


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny file (smoke test)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    return parser.parse_args(argv)


def tokens_per_second(run: Callable[[], None], repeat: int, cold_dir: Path | None) -> float:
    """Median seconds of ``run`` (one token) over ``repeat`` runs after one untimed run."""
    run()
    seconds = []
    for _ in range(repeat):
        if cold_dir is not None:
            drop_page_cache(cold_dir)
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    count, rows, cols = (4, 64, 128) if arguments.quick else (16, 2048, 4096)
    repeat = 2 if arguments.quick else 5
    torch.manual_seed(0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="t2n-bench-mapped-") as directory:
        folder = Path(directory)
        layout = storage.write_payload(
            folder / "layers.safetensors", {f"w{i}": torch.randn(rows, cols) for i in range(count)}
        )
        names = list(layout.entries)
        x = torch.randn(1, cols)
        buffers = storage.allocate(layout)

        def compute_only() -> None:
            for name in names:
                (x @ buffers[name].T).sum()

        def buffered() -> None:
            for name in names:
                value = storage.read_payload(layout, out={name: buffers[name]}, names=[name])
                (x @ value[name].T).sum()

        def mapped() -> None:
            for name in names:
                value = storage.map_payload(layout, names=[name])
                (x @ value[name].T).sum()

        figures: dict[str, dict[str, float]] = {}
        for cache in ("warm", "cold"):
            cold_dir = folder if cache == "cold" else None
            figures[cache] = {
                "compute only": tokens_per_second(compute_only, repeat, None),
                "buffered read": tokens_per_second(buffered, repeat, cold_dir),
                "mapped read": tokens_per_second(mapped, repeat, cold_dir),
            }
    summary = []
    for cache, timing in figures.items():
        ratio = timing["buffered read"] / timing["mapped read"]
        summary.append(
            summary_row(
                f"{cache}: mapped read speed over buffered read",
                f"{ratio:.2f}x ({timing['mapped read'] * 1e3:.0f} ms/token)",
                f"buffered {timing['buffered read'] * 1e3:.0f} ms/token, compute alone "
                f"{timing['compute only'] * 1e3:.0f} ms",
                ">= 1.0x",
                ratio >= 1.0,
            )
        )
    details = {
        "headers": ["cache", "compute only ms", "buffered read ms", "mapped read ms"],
        "rows": [
            [cache, *(f"{timing[k] * 1e3:.1f}" for k in timing)]
            for cache, timing in figures.items()
        ],
    }
    document = {
        "config": {
            "matrices": count,
            "shape": [rows, cols],
            "file_bytes": layout.nbytes,
            "quick": arguments.quick,
        },
        "seconds_per_token": figures,
        "summary": summary,
        "details": details,
        "wall_seconds": time.perf_counter() - started,
    }
    publish("mapped", document, arguments.output)
    return document


if __name__ == "__main__":
    main()
