"""Reload throughput of payload files, side by side with torch.load and safetensors.

Writes 16 payloads of 32 MiB (float32) to a temporary directory in three formats (ours,
``torch.save`` ``.pt``, ``safetensors.torch.save_file``), warms the page cache, then times
each way of loading all of them back:

- ``f.readinto (reference)``: the physical reference, one ``readinto`` of the data section
  into a preallocated tensor per payload;
- ``sync, fresh buffers`` / ``sync, reused buffers``: :func:`read_payload` without and with
  ``out=``;
- ``async, N worker(s)``: :func:`aread_payload` of all payloads at once on an executor of N
  threads (fresh buffers; and reused buffers with 2 workers);
- ``torch.load (weights_only)``;
- ``safetensors load_file`` with its ``pread`` backend (copies like ours) and its default
  ``mmap`` backend, which maps the file lazily: shown with every page faulted in, and as
  is (no data read at all; not a comparable figure).

Our readers get the layouts read beforehand (an offloaded tensor keeps its layout); the cost
of :func:`read_layout` is reported on its own line. The synchronous readers drop each result
before the next read, while the async rows hold every buffer until the last read ends (all
reads run at once), which costs fresh-buffer reads some throughput. Throughput is in GB/s
(10**9 bytes), the best of the timed repetitions, with the median beside it. Targets: reused
buffers at >= 90% of the reference, fresh buffers at least as fast as torch.load.

Run: ``python benchmarks/bench_storage.py [--quick] [--output PATH] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, measure, write_results

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.storage._buffers import byte_view

REFERENCE = "f.readinto (reference)"
PAGE_FLOATS = 4096 // 4


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 payloads of 1 MiB (smoke test)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions per method")
    return parser.parse_args(argv)


def prepare_files(directory: Path, count: int, nbytes: int) -> dict[str, list[Path]]:
    """Write ``count`` payloads of ``nbytes`` in the three formats; return their paths."""
    generator = torch.Generator().manual_seed(0)
    paths: dict[str, list[Path]] = {"ours": [], "pt": [], "safetensors": []}
    for index in range(count):
        tensor = torch.rand(nbytes // 4, generator=generator)
        ours = directory / f"p{index}.t2n.safetensors"
        storage.write_payload(ours, {"w": tensor}, fsync=False)
        pt = directory / f"p{index}.pt"
        torch.save({"w": tensor}, pt)
        theirs = directory / f"p{index}.st.safetensors"
        safetensors.torch.save_file({"w": tensor}, str(theirs))
        paths["ours"].append(ours)
        paths["pt"].append(pt)
        paths["safetensors"].append(theirs)
    return paths


def reference_reader(
    layouts: list[storage.PayloadLayout], buffers: list[torch.Tensor]
) -> Callable[[], None]:
    """The physical reference: ``readinto`` of each data section into a preallocated tensor."""
    jobs = [
        (layout.path, layout.entries["w"].start, byte_view(buffer))
        for layout, buffer in zip(layouts, buffers, strict=True)
    ]

    def run() -> None:
        for path, start, view in jobs:
            with open(path, "rb", buffering=0) as file:
                file.seek(start)
                done = 0
                while done < len(view):
                    count = file.readinto(view[done:])
                    if not count:
                        raise EOFError(path)
                    done += count

    return run


def async_reader(
    runner: asyncio.Runner,
    layouts: list[storage.PayloadLayout],
    workers: int,
    buffers: list[dict[str, torch.Tensor]] | None = None,
) -> Callable[[], None]:
    """All payloads read at once with :func:`aread_payload` on ``workers`` threads."""
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    async def read_all() -> None:
        outs = buffers or [None] * len(layouts)
        await asyncio.gather(
            *(
                storage.aread_payload(layout, out=out, executor=executor)
                for layout, out in zip(layouts, outs, strict=True)
            )
        )

    def run() -> None:
        runner.run(read_all())

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    count, nbytes = (4, 1 << 20) if arguments.quick else (16, 32 << 20)
    repeat = arguments.repeat or (2 if arguments.quick else 5)
    total = count * nbytes
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="t2n-bench-storage-") as directory:
        paths = prepare_files(Path(directory), count, nbytes)
        layouts = [storage.read_layout(path) for path in paths["ours"]]
        reused = [storage.allocate(layout) for layout in layouts]
        preallocated = [torch.empty(nbytes // 4) for _ in layouts]
        for buffer in (*preallocated, *(out["w"] for out in reused)):
            buffer.zero_()  # touch every page, so that no timed read pays for page faults

        def sync_reused() -> None:
            for layout, out in zip(layouts, reused, strict=True):
                storage.read_payload(layout, out=out)

        def sync_fresh() -> None:
            for layout in layouts:
                storage.read_payload(layout)

        def torch_load() -> None:
            for path in paths["pt"]:
                torch.load(path, weights_only=True)

        def safetensors_load(backend: str, touch: bool) -> Callable[[], None]:
            def run() -> None:
                for path in paths["safetensors"]:
                    loaded = safetensors.torch.load_file(str(path), backend=backend)
                    if touch:  # fault in every page of the lazily mapped file
                        loaded["w"].view(-1)[::PAGE_FLOATS].sum()

            return run

        with asyncio.Runner() as runner:
            methods: dict[str, Callable[[], None]] = {
                REFERENCE: reference_reader(layouts, preallocated),
                "sync, reused buffers": sync_reused,
                "sync, fresh buffers": sync_fresh,
                "async, 1 worker": async_reader(runner, layouts, 1),
                "async, 2 workers": async_reader(runner, layouts, 2),
                "async, 2 workers, reused": async_reader(runner, layouts, 2, reused),
                "torch.load (weights_only)": torch_load,
                "safetensors load_file (pread)": safetensors_load("pread", touch=False),
                "safetensors load_file (mmap, pages touched)": safetensors_load("mmap", touch=True),
                "safetensors load_file (mmap, lazy)": safetensors_load("mmap", touch=False),
            }
            timings = {name: measure(run, repeat=repeat) for name, run in methods.items()}
        layout_timing = measure(
            lambda: [storage.read_layout(p) for p in paths["ours"]], repeat=repeat
        )

    reference = total / timings[REFERENCE].best
    rows = []
    results = []
    for name, timing in timings.items():
        best, median = total / timing.best / 1e9, total / timing.median / 1e9
        ratio = total / timing.best / reference
        rows.append([name, f"{best:.2f}", f"{median:.2f}", f"{ratio:.2f}"])
        results.append(
            {"method": name, "gbps_best": best, "gbps_median": median, "ratio_vs_reference": ratio}
        )
    layout_us = layout_timing.best / count * 1e6
    gbps = {item["method"]: item["gbps_best"] for item in results}
    targets = {
        "reused_at_least_0.9_of_reference": gbps["sync, reused buffers"] >= 0.9 * gbps[REFERENCE],
        "fresh_at_least_torch_load": gbps["sync, fresh buffers"]
        >= gbps["torch.load (weights_only)"],
    }
    document = {
        "config": {
            "payloads": count,
            "payload_bytes": nbytes,
            "repeat": repeat,
            "quick": arguments.quick,
        },
        "results": results,
        "read_layout_us_per_file": layout_us,
        "targets": targets,
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("storage", document, arguments.output)

    print(f"Reload of {count} payloads of {nbytes >> 20} MiB (warm page cache), best of {repeat}")
    print(format_table(["method", "GB/s best", "GB/s median", "vs reference"], rows))
    print(f"read_layout: {layout_us:.1f} us per file")
    for target, met in targets.items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    return document


if __name__ == "__main__":
    main()
