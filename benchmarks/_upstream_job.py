"""One round of the side-by-side measurements, in a fresh process, for this project's pool
or upstream's: LRU churn, then resident hits.

``bench_residency.py --part upstream`` runs this script twice per round, with this project's
Python and with a scratch Python where upstream torch-to-nnef 0.24.12 is installed: the
same workload through the API both share (``OffloadedTensor.from_original_tensor``,
``TensorResidencyPool(max_cached_bytes=...)``, ``pool.resolve``, ``with pool.acquire``),
each tensor in its own payload file written the library's own way (warm page cache).

- Churn: random reads through a pool whose budget holds a tenth of the tensors.
- Hits: calls from the main thread on a pool holding every value of a few tensors (no
  budget), over a random sequence of them.

Prints one JSON object: for each face, the seconds of the timed churn operations and the
process CPU seconds they took; the hit ratio an exact LRU has on the sequence (both pools are
LRU); and the microseconds per hit of each face, the median of the repetitions.

Run: ``python benchmarks/_upstream_job.py --count 2000 --budget-tensors 200 --operations 6000``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

FACES = ("resolve", "acquire")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="tensors")
    parser.add_argument("--numel", type=int, default=1024, help="float32 values per tensor")
    parser.add_argument("--budget-tensors", type=int, default=200, help="budget, in tensors")
    parser.add_argument("--operations", type=int, default=6000, help="timed reads")
    parser.add_argument("--warmup", type=int, default=2000, help="untimed reads first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hit-entries", type=int, default=10, help="tensors of the hit pool")
    parser.add_argument("--hit-calls", type=int, default=20_000, help="calls per repetition")
    parser.add_argument("--hit-repeat", type=int, default=7, help="repetitions of the calls")
    return parser.parse_args(argv)


def run_face(
    face: str, tensors: list[OffloadedTensor], indices: list[int], warmup: int, budget: int
) -> dict[str, Any]:
    """Reads of ``tensors[i]`` for ``i`` in ``indices`` through a fresh pool's ``face``."""
    sequence = [tensors[i] for i in indices]
    with TensorResidencyPool(max_cached_bytes=budget) as pool:
        if face == "resolve":
            resolve = pool.resolve
            for tensor in sequence[:warmup]:
                resolve(tensor)
            timed = sequence[warmup:]
            start, cpu = time.perf_counter(), time.process_time()
            for tensor in timed:
                resolve(tensor)
        else:
            acquire = pool.acquire
            for tensor in sequence[:warmup]:
                with acquire(tensor):
                    pass
            timed = sequence[warmup:]
            start, cpu = time.perf_counter(), time.process_time()
            for tensor in timed:
                with acquire(tensor):
                    pass
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "operations": len(timed)}


def per_call_us(run: Callable[[], None], calls: int, repeat: int) -> float:
    """Microseconds per call of ``run()`` (``calls`` calls), the median of ``repeat`` runs
    after an untimed one, the collector paused."""
    run()
    samples = []
    gc.disable()
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            samples.append((time.perf_counter() - start) / calls * 1e6)
    finally:
        gc.enable()
    return statistics.median(samples)


def hit_latency(
    tensors: list[OffloadedTensor], calls: int, repeat: int, seed: int
) -> dict[str, float]:
    """Microseconds per hit of each face on a pool holding every value of ``tensors``."""
    rng = random.Random(seed)
    sequence = [tensors[rng.randrange(len(tensors))] for _ in range(calls)]
    with TensorResidencyPool() as pool:
        resolve, acquire = pool.resolve, pool.acquire
        for tensor in tensors:
            resolve(tensor)

        def resolve_all() -> None:
            for tensor in sequence:
                resolve(tensor)

        def acquire_all() -> None:
            for tensor in sequence:
                with acquire(tensor):
                    pass

        return {
            "resolve": per_call_us(resolve_all, calls, repeat),
            "acquire": per_call_us(acquire_all, calls, repeat),
        }


def expected_hits(indices: list[int], warmup: int, capacity: int) -> float:
    """The hit ratio of an exact LRU of ``capacity`` values over the timed reads."""
    cache: dict[int, None] = {}
    hits = 0
    for position, index in enumerate(indices):
        if index in cache:
            del cache[index]
            hits += position >= warmup
        elif len(cache) >= capacity:
            del cache[next(iter(cache))]
        cache[index] = None
    return hits / max(1, len(indices) - warmup)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    torch.set_num_threads(1)
    rng = random.Random(arguments.seed)
    total = arguments.warmup + arguments.operations
    indices = [rng.randrange(arguments.count) for _ in range(total)]
    budget = arguments.budget_tensors * arguments.numel * 4
    with tempfile.TemporaryDirectory(prefix="t2n-churn-job-") as directory:
        tensors = [
            OffloadedTensor.from_original_tensor(
                torch.full((arguments.numel,), float(i)), f"t{i}", offload_dir=Path(directory)
            )
            for i in range(arguments.count)
        ]
        for tensor in tensors:  # warm the page cache
            tensor._reload_unmanaged()
        document: dict[str, Any] = {
            "lru_hit_ratio": expected_hits(indices, arguments.warmup, arguments.budget_tensors),
            "faces": {
                face: run_face(face, tensors, indices, arguments.warmup, budget) for face in FACES
            },
            "hit_us": hit_latency(
                tensors[: arguments.hit_entries],
                arguments.hit_calls,
                arguments.hit_repeat,
                arguments.seed,
            ),
        }
        del tensors
    print(json.dumps(document))
    return document


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
