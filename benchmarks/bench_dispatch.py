"""Per-op dispatch overhead of an OffloadedTensor whose value is already resident.

Times one small operation (``F.linear`` of a 64 x 64 weight, and an ``nn.Linear`` forward) on:

- ``resident tensor``: the plain weight (the baseline);
- ``offloaded, resident cache``: an OffloadedTensor whose reload returns a value kept in memory
  (a subclass caching its first load): the cost of the tensor subclass dispatch alone;
- ``offloaded, pool scope (hit)``: an OffloadedTensor inside ``pool.scope()`` of a
  :class:`TensorResidencyPool` holding its value: dispatch plus a pool hit from the caller's
  thread;
- ``offloaded, no cache``: an OffloadedTensor read from its file at every op (page cache warm),
  for scale.

Figures are microseconds per op (median of the repetitions, best beside it); the overhead is
the difference with the baseline. Target: < 50 us for the resident-cache and pool-hit rows.

Run: ``python benchmarks/bench_dispatch.py [--quick] [--output PATH] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, measure, write_results

from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

BASELINE = "resident tensor"
TARGET_US = 50.0
WIDTH = 64


class ResidentCacheTensor(OffloadedTensor):
    """An OffloadedTensor that keeps its first load in memory: dispatch cost without I/O."""

    def _reload_unmanaged(self, device: Any = None) -> torch.Tensor:
        cached: torch.Tensor | None = self.__dict__.get("_bench_cached")
        if cached is None:
            cached = super()._reload_unmanaged(device)
            self.__dict__["_bench_cached"] = cached
        return cached


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few calls (smoke test)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions per case")
    return parser.parse_args(argv)


def linear_with(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(WIDTH, WIDTH)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def per_call(run: Callable[[], object], calls: int) -> Callable[[], None]:
    def loop() -> None:
        for _ in range(calls):
            run()

    return loop


@contextlib.contextmanager
def pool_scope() -> Iterator[None]:
    with TensorResidencyPool(max_cached_bytes=64 << 20) as pool, pool.scope():
        yield


def main(argv: list[str] | None = None) -> dict[str, Any]:
    arguments = parse_arguments(argv)
    calls = 200 if arguments.quick else 2000
    repeat = arguments.repeat or (3 if arguments.quick else 7)
    started = time.perf_counter()
    torch.set_num_threads(1)  # the op itself stays small and steady; dispatch is what we time
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(WIDTH, WIDTH, generator=generator)
    bias = torch.randn(WIDTH, generator=generator)
    x = torch.randn(1, WIDTH, generator=generator)

    with tempfile.TemporaryDirectory(prefix="t2n-bench-dispatch-") as directory:
        cached_w = ResidentCacheTensor.from_original_tensor(weight, "cached.w", directory)
        cached_b = ResidentCacheTensor.from_original_tensor(bias, "cached.b", directory)
        pooled_w = OffloadedTensor.from_original_tensor(weight, "pooled.w", directory)
        pooled_b = OffloadedTensor.from_original_tensor(bias, "pooled.b", directory)
        disk_w = OffloadedTensor.from_original_tensor(weight, "disk.w", directory)
        disk_b = OffloadedTensor.from_original_tensor(bias, "disk.b", directory)
        cases: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], Callable[[], Any]]] = {
            BASELINE: ((weight, bias), contextlib.nullcontext),
            "offloaded, resident cache": ((cached_w, cached_b), contextlib.nullcontext),
            "offloaded, pool scope (hit)": ((pooled_w, pooled_b), pool_scope),
            "offloaded, no cache": ((disk_w, disk_b), contextlib.nullcontext),
        }
        timings: dict[tuple[str, str], float] = {}
        bests: dict[tuple[str, str], float] = {}
        with torch.no_grad():
            for case, ((w, b), context) in cases.items():
                layer = linear_with(w, b)
                ops = {
                    "F.linear": lambda w=w, b=b: F.linear(x, w, b),
                    "nn.Linear forward": lambda layer=layer: layer(x),
                }
                for op, run in ops.items():
                    expected = F.linear(x, weight, bias)
                    with context():
                        if not torch.equal(run(), expected):
                            raise AssertionError(f"{case} / {op} computed a wrong value")
                        case_calls = calls // 10 if case == "offloaded, no cache" else calls
                        timing = measure(per_call(run, case_calls), repeat=repeat)
                    timings[(case, op)] = timing.median / case_calls * 1e6
                    bests[(case, op)] = timing.best / case_calls * 1e6

    rows = []
    results = []
    for (case, op), median_us in timings.items():
        overhead = median_us - timings[(BASELINE, op)]
        rows.append(
            [f"{op}: {case}", f"{median_us:.1f}", f"{bests[(case, op)]:.1f}", f"{overhead:+.1f}"]
        )
        results.append(
            {
                "case": case,
                "op": op,
                "us_per_op_median": median_us,
                "us_per_op_best": bests[(case, op)],
                "overhead_us_vs_resident": overhead,
            }
        )
    cached_cases = ("offloaded, resident cache", "offloaded, pool scope (hit)")
    targets = {
        f"{case} / {item['op']} overhead < {TARGET_US:.0f} us": item["overhead_us_vs_resident"]
        < TARGET_US
        for item in results
        for case in cached_cases
        if item["case"] == case
    }
    document = {
        "config": {"width": WIDTH, "calls": calls, "repeat": repeat, "quick": arguments.quick},
        "results": results,
        "targets": targets,
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("dispatch", document, arguments.output)

    print(f"Per-op time of a {WIDTH}x{WIDTH} linear, {calls} calls, median of {repeat}")
    print(format_table(["op: weight", "us median", "us best", "overhead us"], rows))
    for target, met in targets.items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    return document


if __name__ == "__main__":
    main()
