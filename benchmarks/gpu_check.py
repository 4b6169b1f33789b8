"""Correctness and host-to-device throughput on ``cuda:0`` (a short check for CUDA machines).

Checks, each printed as ``ok`` or ``FAILED`` with the reason:

- ``values``: offloaded tensors of several dtypes reloaded on ``cuda:0`` (``reload("cuda:0")``,
  and tensors offloaded from the GPU, whose target stays ``cuda:0``) equal the originals;
- ``pinned staging``: ``storage.allocate(..., pin_memory=True)`` returns page-locked buffers
  and ``storage.to_device`` delivers equal values from pinned and from pageable memory;
- ``stream synchronisation``: a value returned by ``storage.to_device`` and by the pool is
  complete: read at once on another stream (no wait), after a long kernel was queued on the
  current stream, it equals the source;
- ``pool on cuda:0``: a model of linear layers offloaded on the CPU, run with
  ``pool.scope(device="cuda:0")`` and ``stream_modules(..., device="cuda:0")``, sync and from
  async code (``anyio.to_thread.run_sync``), gives the dense model's output on the GPU.

Then it reports host-to-device throughput (GB/s) of 256 MiB float32 tensors, side by side:
``storage.to_device`` from pageable and from pinned memory, the reference
``tensor.pin_memory().to("cuda", non_blocking=True)`` + synchronize, a plain copy from an
already pinned tensor (the link's ceiling), and whole loads from a payload file
(``reload("cuda:0")`` and a pool miss). Targets: ``to_device`` from pageable memory at least
as fast as the reference; from pinned memory at >= 90% of the ceiling.

Without CUDA it says so and exits 0. Exits 1 when a correctness check fails.
Run: ``python benchmarks/gpu_check.py [--quick] [--output PATH]`` (under 5 minutes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, write_results
from _report import print_summary, summary_row

DEVICE = "cuda:0"
PAGEABLE_TARGET = 1.0
PINNED_TARGET = 0.9


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tensors")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    return parser.parse_args(argv)


class Checks:
    """Runs named correctness checks, recording each outcome."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def run(self, name: str, check: Callable[[], None]) -> None:
        try:
            check()
        except Exception as error:  # reported, and the script fails at the end
            self.outcomes[name] = f"FAILED: {type(error).__name__}: {error}"
        else:
            self.outcomes[name] = "ok"
        print(f"{name}: {self.outcomes[name]}", flush=True)

    @property
    def passed(self) -> bool:
        return all(outcome == "ok" for outcome in self.outcomes.values())


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------
def check_values(directory: Path) -> None:
    from torch_to_nnef.tensor import OffloadedTensor

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        original = (torch.randn(257, 129, generator=generator) * 50).to(dtype)
        on_cpu = OffloadedTensor.from_original_tensor(original, f"cpu.{dtype}", directory)
        value = on_cpu.reload(DEVICE)
        expect(value.device == torch.device(DEVICE), f"reload({DEVICE!r}) gave {value.device}")
        expect(torch.equal(value.cpu(), original), f"{dtype}: reloaded values differ")
        on_gpu = OffloadedTensor.from_original_tensor(
            original.to(DEVICE), f"gpu.{dtype}", directory
        )
        expect(on_gpu.device.type == "cuda", f"target of a GPU tensor is {on_gpu.device}")
        value = on_gpu.reload()
        expect(value.device.type == "cuda", f"reload() of a GPU tensor gave {value.device}")
        expect(torch.equal(value.cpu(), original), f"{dtype}: GPU-target values differ")


def check_pinned(directory: Path) -> None:
    from torch_to_nnef.tensor import storage

    original = torch.randn(1 << 20)
    path = directory / "pinned.safetensors"
    layout = storage.write_payload(path, {"w": original}, fsync=False)
    buffers = storage.allocate(layout, pin_memory=True)
    expect(buffers["w"].is_pinned(), "allocate(pin_memory=True) returned pageable memory")
    storage.read_payload(layout, out=buffers)
    from_pinned = storage.to_device(buffers["w"], DEVICE)
    from_pageable = storage.to_device(original.clone(), DEVICE)
    for value in (from_pinned, from_pageable):
        expect(value.device == torch.device(DEVICE), f"to_device gave {value.device}")
        expect(torch.equal(value.cpu(), original), "to_device values differ")


def check_stream_sync(numel: int, rounds: int) -> None:
    from torch_to_nnef.tensor import storage

    other = torch.cuda.Stream(DEVICE)
    for index in range(rounds):
        host = torch.full((numel,), float(index + 1)).pin_memory()
        torch.cuda._sleep(50_000_000)  # a long kernel queued on the current stream
        value = storage.to_device(host, DEVICE)
        with torch.cuda.stream(other):  # read at once, without waiting for any stream
            low, high = value.min().item(), value.max().item()
        expect(
            low == high == float(index + 1),
            f"round {index}: values read right after to_device returned are incomplete "
            f"(min {low}, max {high}, expected {index + 1})",
        )


def check_pool_stream_sync(directory: Path, numel: int, rounds: int) -> None:
    from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool

    other = torch.cuda.Stream(DEVICE)
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((numel,), float(i + 1)), f"s{i}", directory)
        for i in range(rounds)
    ]
    with TensorResidencyPool(max_cached_bytes=2 * numel * 4) as pool:
        for index, tensor in enumerate(tensors):
            value = pool.resolve(tensor, DEVICE)
            with torch.cuda.stream(other):
                low, high = value.min().item(), value.max().item()
            expect(
                low == high == float(index + 1),
                f"pool value {index} incomplete when returned (min {low}, max {high})",
            )


def check_pool_model(directory: Path, width: int, layers: int) -> None:
    import anyio
    from torch import nn

    from torch_to_nnef.tensor import TensorResidencyPool, offload_module, stream_modules

    torch.manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).eval()
    x = torch.randn(16, width, device=DEVICE)
    with torch.no_grad():
        expected = dense.to(DEVICE)(x)
        dense.cpu()
    model = offload_module(dense, directory / "model")
    blocks = list(model)
    budget = 3 * width * width * 4

    def forward() -> torch.Tensor:
        with torch.no_grad():
            output: torch.Tensor = model(x)
        return output

    with (
        TensorResidencyPool(max_cached_bytes=budget) as pool,
        stream_modules(pool, blocks, depth=1, device=DEVICE),
        pool.scope(device=DEVICE),
    ):
        for _ in range(2):
            got = forward()
            expect(got.device.type == "cuda", f"the streamed output is on {got.device}")
            expect(
                torch.allclose(got, expected, rtol=1e-5, atol=1e-6),
                f"sync streamed output differs by {(got - expected).abs().max().item():.3g}",
            )

    async def serve() -> torch.Tensor:
        async with TensorResidencyPool(max_cached_bytes=budget) as pool:
            with stream_modules(pool, blocks, depth=1, device=DEVICE), pool.scope(device=DEVICE):
                return await anyio.to_thread.run_sync(forward)

    got = anyio.run(serve)
    expect(
        torch.allclose(got, expected, rtol=1e-5, atol=1e-6),
        f"async streamed output differs by {(got - expected).abs().max().item():.3g}",
    )


# ---------------------------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------------------------
def gbps(nbytes: int, run: Callable[[], object], repeat: int) -> float:
    """Best throughput of ``run`` (synchronised) over ``repeat`` timed calls."""
    run()
    torch.cuda.synchronize(DEVICE)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(DEVICE)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def throughput(directory: Path, numel: int, repeat: int) -> dict[str, float]:
    from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool, storage

    pageable = torch.randn(numel)
    pinned = pageable.pin_memory()
    nbytes = numel * 4
    offloaded = OffloadedTensor.from_original_tensor(pageable, "throughput", directory)
    with open(offloaded.offload_path, "rb") as file:  # warm the page cache
        while file.read(64 << 20):
            pass

    def pool_miss() -> None:
        with TensorResidencyPool() as pool:
            pool.resolve(offloaded, DEVICE)

    return {
        "storage.to_device, pageable": gbps(
            nbytes, lambda: storage.to_device(pageable, DEVICE), repeat
        ),
        "storage.to_device, pinned": gbps(
            nbytes, lambda: storage.to_device(pinned, DEVICE), repeat
        ),
        "reference: pin_memory().to(non_blocking) + sync": gbps(
            nbytes, lambda: pageable.pin_memory().to(DEVICE, non_blocking=True), repeat
        ),
        "ceiling: pinned .to(non_blocking) + sync": gbps(
            nbytes, lambda: pinned.to(DEVICE, non_blocking=True), repeat
        ),
        "file -> cuda: reload(cuda:0)": gbps(nbytes, lambda: offloaded.reload(DEVICE), repeat),
        "file -> cuda: pool miss": gbps(nbytes, pool_miss, repeat),
    }


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    if not torch.cuda.is_available():
        message = "CUDA is not available: nothing to check on this machine (run it on a GPU)"
        print(message)
        document = {
            "config": {"quick": arguments.quick},
            "cuda": False,
            "summary": [summary_row("GPU check", "skipped", target=message)],
            "wall_seconds": time.perf_counter() - started,
        }
        write_results("gpu", document, arguments.output)
        return 0
    numel = (16 << 20) // 4 if arguments.quick else (256 << 20) // 4
    repeat = 3 if arguments.quick else 5
    print(f"checking on {torch.cuda.get_device_name(DEVICE)}", flush=True)
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="t2n-gpu-check-") as name:
        directory = Path(name)
        checks.run("values", lambda: check_values(directory))
        checks.run("pinned staging", lambda: check_pinned(directory))
        checks.run("stream synchronisation (to_device)", lambda: check_stream_sync(numel, 8))
        checks.run(
            "stream synchronisation (pool)",
            lambda: check_pool_stream_sync(directory, numel // 4, 8),
        )
        checks.run("pool on cuda:0", lambda: check_pool_model(directory, 1024, 8))
        figures = throughput(directory, numel, repeat)

    reference = figures["reference: pin_memory().to(non_blocking) + sync"]
    ceiling = figures["ceiling: pinned .to(non_blocking) + sync"]
    pageable_ratio = figures["storage.to_device, pageable"] / reference
    pinned_ratio = figures["storage.to_device, pinned"] / ceiling
    summary = [
        summary_row(name, outcome, met=outcome == "ok") for name, outcome in checks.outcomes.items()
    ]
    summary += [
        summary_row(
            "to_device from pageable memory",
            f"{figures['storage.to_device, pageable']:.2f} GB/s ({pageable_ratio:.2f}x)",
            f"pin_memory().to(non_blocking) {reference:.2f} GB/s",
            f">= {PAGEABLE_TARGET:g}x the reference",
            pageable_ratio >= PAGEABLE_TARGET,
        ),
        summary_row(
            "to_device from pinned memory",
            f"{figures['storage.to_device, pinned']:.2f} GB/s ({pinned_ratio:.2f}x)",
            f"pinned .to(non_blocking) {ceiling:.2f} GB/s",
            f">= {PINNED_TARGET:g}x the ceiling",
            pinned_ratio >= PINNED_TARGET,
        ),
    ]
    rows = [[name, f"{value:.2f}", f"{value / reference:.2f}"] for name, value in figures.items()]
    document = {
        "config": {"quick": arguments.quick, "tensor_bytes": numel * 4, "repeat": repeat},
        "cuda": True,
        "checks": checks.outcomes,
        "throughput_gbps": figures,
        "summary": summary,
        "details": {"headers": ["host-to-device path", "GB/s", "vs reference"], "rows": rows},
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("gpu", document, arguments.output)
    print(format_table(["host-to-device path", "GB/s", "vs reference"], rows))
    print()
    print_summary(summary)
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    if not checks.passed:
        print("some correctness checks FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
