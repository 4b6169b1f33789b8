"""The CUDA path on ``cuda:0``: correctness under any stream, overlap, throughput, pinned memory.

One prepared run (under a minute on an H200), printing one summary table and exiting 1 when
any check of correctness fails (a missed speed target is reported as missed, as in every
benchmark, and does not fail the run):

- ``device``: the GPU, its memory, torch and CUDA versions;
- ``CUDA tests``: ``tests/test_cuda.py`` in a subprocess, none skipped;
- ``reload values``: offloaded tensors of several dtypes reloaded on the GPU (unmanaged and
  through a pool, from CPU and from GPU targets) equal the originals; a model streamed with
  ``pool.scope`` and ``stream_modules`` gives the dense output (sync and from async code);
- ``eviction race``: a budget of one 64 MiB tensor, 8 tensors filled with ``i + 1``; under
  ``torch.cuda.stream(s)`` each is resolved, a long kernel (``torch.cuda._sleep``) queued,
  its min and max recorded and the value dropped (so the next load reuses its memory); after
  a synchronize every recorded pair equals ``i + 1``;
- ``write-back race``: in a scope on a side stream, a long kernel then ``t.add_(1)``; the
  pool is closed at once; the file holds the original plus one;
- both races again in a subprocess with ``TORCH_CUDA_SANITIZER=1`` (no race reported);
- ``overlap``: a 256 MiB prefetch-and-wait (to its values on a side stream) while some
  300 ms of kernels are queued on the default stream, against the same on an idle GPU: it
  must not include the queued kernels;
- ``parallel workers``: 8 x 256 MiB loaded by a pool with ``max_workers=4``: GB/s at least
  the ``max_workers=1`` figure;
- throughput: ``storage.to_device`` from pinned memory against a plain pinned
  ``.to(non_blocking=True)`` (the link's ceiling; target >= 0.9x), from pageable memory
  against ``pin_memory().to()`` (target >= 1x), file-to-GPU (``reload`` and a pool miss,
  beside safetensors' ``load_file(device="cuda:0")`` on the same bytes);
- ``pinned footprint``: the pinned staging memory held (``storage.pinned_bytes()``, also in
  ``pool.stats()``) within its bound.

Run: ``python benchmarks/gpu_check.py [--quick] [--output JSON] [--markdown [MD]]``
(``--markdown`` alone writes ``benchmarks/results/gpu_check.md``). Without a CUDA device it
says "no CUDA device" and exits 2 (``--skip-without-cuda``: writes a "skipped" document and
exits 0, as ``run_all.py`` does).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, format_table, write_results
from _report import Row, print_summary, summary_row, verdict

DEVICE = torch.device("cuda", 0)
ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
PINNED_TARGET = 0.9
PAGEABLE_TARGET = 1.0
NO_DEVICE = "no CUDA device: this check needs a GPU (torch.cuda.is_available() is False)"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tensors, few repetitions")
    parser.add_argument("--output", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--markdown",
        type=Path,
        nargs="?",
        const=RESULTS_DIR / "gpu_check.md",
        default=None,
        help="write the summary table as Markdown (default path: results/gpu_check.md)",
    )
    parser.add_argument(
        "--skip-without-cuda",
        action="store_true",
        help="without a CUDA device, write a 'skipped' document and exit 0",
    )
    parser.add_argument(
        "--races-only", action="store_true", help="run the two race checks only (sanitizer run)"
    )
    return parser.parse_args(argv)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Checks:
    """Named checks, each recorded as a summary row (an exception fails the check)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.failed: list[str] = []

    def run(
        self, name: str, check: Callable[[], Row | list[Row] | None], speed: bool = False
    ) -> None:
        """Run ``check``: it returns its rows, or ``None`` for a plain "ok".

        A check that raises fails the run; so does a missed row, unless ``speed`` says the
        rows are speed targets (reported, as in every benchmark, without failing the run).
        """
        started = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # reported; the script fails at the end
            result = summary_row(name, f"FAILED: {type(error).__name__}: {error}", met=False)
            self.failed.append(name)
        if result is None:
            result = summary_row(name, "ok", met=True)
        rows = result if isinstance(result, list) else [result]
        self.rows.extend(rows)
        if not speed and any(row["met"] is False for row in rows) and name not in self.failed:
            self.failed.append(name)
        elapsed = time.perf_counter() - started
        for row in rows:
            print(f"{row['figure']}: {row['value']} [{verdict(row['met'])}]", flush=True)
        print(f"  ({name}: {elapsed:.1f} s)", flush=True)

    @property
    def passed(self) -> bool:
        return not self.failed


def sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU."""
    cycles = 10**7
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10 * cycles)
    torch.cuda.synchronize()
    return 10 * cycles / ((time.perf_counter() - start) * 1e3)


def offload(directory: Path, name: str, value: torch.Tensor) -> Any:
    from torch_to_nnef.tensor import OffloadedTensor

    tensor = OffloadedTensor.from_original_tensor(value, name, directory)
    with open(tensor.offload_path, "rb") as file:  # warm the page cache
        while file.read(64 * MIB):
            pass
    return tensor


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------
def check_cuda_tests(directory: Path) -> Row:
    report = directory / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-rs"]
    command += [f"--junitxml={report}", "tests/test_cuda.py"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    met = done.returncode == 0 and counts["skipped"] == 0 and counts["tests"] > 0
    value = f"{ran} passed" if met else f"{counts} (pytest exit code {done.returncode})"
    return summary_row("CUDA tests", value, "", "all pass, none skipped", met)


def check_values(directory: Path) -> None:
    from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        original = (torch.randn(257, 129, generator=generator) * 50).to(dtype)
        on_cpu = OffloadedTensor.from_original_tensor(original, f"cpu.{dtype}", directory)
        value = on_cpu.reload(DEVICE)
        expect(value.device == DEVICE, f"reload({DEVICE}) gave {value.device}")
        expect(torch.equal(value.cpu(), original), f"{dtype}: reloaded values differ")
        on_gpu = OffloadedTensor.from_original_tensor(
            original.to(DEVICE), f"gpu.{dtype}", directory
        )
        expect(on_gpu.device.type == "cuda", f"target of a GPU tensor is {on_gpu.device}")
        expect(torch.equal(on_gpu.reload().cpu(), original), f"{dtype}: GPU-target values differ")
        with TensorResidencyPool(max_workers=2) as pool:
            got = pool.resolve(on_cpu, DEVICE)
            expect(torch.equal(got.cpu(), original), f"{dtype}: pool values differ")


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

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x is ready for the side stream too
    with (
        TensorResidencyPool(max_cached_bytes=budget) as pool,
        stream_modules(pool, blocks, depth=1, device="cuda"),
        pool.scope(device="cuda"),
    ):
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                got = forward()
            torch.cuda.synchronize()
            expect(
                torch.allclose(got, expected, rtol=1e-5, atol=1e-6),
                f"streamed output differs by {(got - expected).abs().max().item():.3g}",
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


def check_eviction_race(directory: Path, cycles: int) -> Row:
    from torch_to_nnef.tensor import TensorResidencyPool

    numel = 64 * MIB // 4
    tensors = [offload(directory, f"race{i}", torch.full((numel,), i + 1.0)) for i in range(8)]
    side = torch.cuda.Stream()
    pairs = []
    with TensorResidencyPool(max_cached_bytes=64 * MIB) as pool:
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for tensor in tensors:
                value = pool.resolve(tensor, DEVICE)
                torch.cuda._sleep(cycles)
                pairs.append(torch.stack([value.min(), value.max()]))
                del value
        torch.cuda.synchronize()
        evictions = pool.stats().evictions
    got = [pair.tolist() for pair in pairs]
    wrong = [(i, pair) for i, pair in enumerate(got) if pair != [i + 1.0, i + 1.0]]
    return summary_row(
        "eviction race",
        "ok" if not wrong else f"wrong values (index, [min, max]): {wrong}",
        f"{evictions} evictions",
        "every [min, max] equals i + 1",
        not wrong and evictions >= 6,
    )


def check_write_back_race(directory: Path, cycles: int) -> Row:
    from torch_to_nnef.tensor import TensorResidencyPool

    original = torch.arange(16 * MIB // 4, dtype=torch.float32)
    tensor = offload(directory, "write-race", original)
    side = torch.cuda.Stream()
    pool = TensorResidencyPool()
    try:
        with pool.scope(DEVICE), torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            tensor.add_(1)
    finally:
        pool.close()
    written = tensor.reload("cpu")
    differ = int((written != original + 1).sum())
    return summary_row(
        "write-back race",
        "ok" if differ == 0 else f"{differ} values of the file are not the original + 1",
        "",
        "the file holds the original + 1",
        differ == 0,
    )


def check_races_with_sanitizer(arguments: argparse.Namespace) -> Row:
    command = [sys.executable, str(Path(__file__).resolve()), "--races-only"]
    if arguments.quick:
        command.append("--quick")
    environment = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    output = done.stdout + done.stderr
    print(output[-3000:])
    reported = "CSAN detected" in output or "data race" in output.lower()
    met = done.returncode == 0 and not reported
    value = "no race reported" if met else f"exit code {done.returncode}; race reported: {reported}"
    return summary_row("races under TORCH_CUDA_SANITIZER=1", value, "", "no race reported", met)


# ---------------------------------------------------------------------------------------------
# Overlap, parallel workers, throughput
# ---------------------------------------------------------------------------------------------
def prefetch_and_wait_s(pool: Any, tensor: Any, side: torch.cuda.Stream) -> float:
    """Seconds from ``prefetch`` until the value is complete on ``side`` (not on the default
    stream, where other kernels may be queued)."""
    start = time.perf_counter()
    handle = pool.prefetch(tensor, DEVICE)
    with torch.cuda.stream(side):
        value = handle.wait()
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    elapsed = time.perf_counter() - start
    del value
    pool.evict(tensor)
    return elapsed


def check_overlap(directory: Path, numel: int, cycles_per_ms: float, repeat: int) -> Row:
    from torch_to_nnef.tensor import TensorResidencyPool

    tensor = offload(directory, "overlap", torch.randn(numel))
    side = torch.cuda.Stream()
    sleep_ms = 300.0
    with TensorResidencyPool() as pool:
        prefetch_and_wait_s(pool, tensor, side)  # warm: ring, allocator, page cache
        idle = min(prefetch_and_wait_s(pool, tensor, side) for _ in range(repeat))
        busy_times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))  # queued on the default stream
            busy_times.append(prefetch_and_wait_s(pool, tensor, side))
            torch.cuda.synchronize()
        busy = min(busy_times)
    met = busy < idle + 0.5 * sleep_ms / 1e3
    return summary_row(
        "overlap: prefetch-and-wait behind queued kernels",
        f"{busy * 1e3:.1f} ms",
        f"idle GPU {idle * 1e3:.1f} ms; {sleep_ms:.0f} ms of kernels queued",
        "< idle + half the queued kernels",
        met,
    )


def load_all_gbps(tensors: list[Any], workers: int, repeat: int) -> float:
    from torch_to_nnef.tensor import TensorResidencyPool

    nbytes = sum(tensor.payload_nbytes for tensor in tensors)
    best = float("inf")
    for _ in range(repeat + 1):  # the first run warms up
        with TensorResidencyPool(max_workers=workers) as pool:
            torch.cuda.synchronize()
            start = time.perf_counter()
            handles = [pool.prefetch(tensor, DEVICE) for tensor in tensors]
            values = [handle.wait() for handle in handles]
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
            del values
    return nbytes / best / 1e9


def check_parallel_workers(
    directory: Path, numel: int, repeat: int
) -> tuple[Row, dict[str, float]]:
    tensors = [offload(directory, f"parallel{i}", torch.randn(numel)) for i in range(8)]
    one = load_all_gbps(tensors, 1, repeat)
    four = load_all_gbps(tensors, 4, repeat)
    for tensor in tensors:
        tensor.offload_path.unlink(missing_ok=True)
    row = summary_row(
        "parallel workers: 8 loads, max_workers=4",
        f"{four:.2f} GB/s ({four / one:.2f}x)",
        f"max_workers=1 {one:.2f} GB/s",
        ">= the 1-worker figure",
        four >= one,
    )
    return row, {"max_workers=1": one, "max_workers=4": four}


def gbps(nbytes: int, run: Callable[[], object], repeat: int) -> float:
    """Best throughput of ``run`` (then a device synchronize) over ``repeat`` timed calls."""
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def throughput(directory: Path, numel: int, repeat: int) -> dict[str, float]:
    from torch_to_nnef.tensor import TensorResidencyPool, storage

    pageable = torch.randn(numel)
    pinned = pageable.pin_memory()
    nbytes = numel * 4
    offloaded = offload(directory, "throughput", pageable)

    def pool_miss() -> None:
        with TensorResidencyPool() as pool:
            pool.resolve(offloaded, DEVICE)

    from safetensors.torch import load_file, save_file

    checkpoint = directory / "throughput.safetensors"
    save_file({"w": pageable}, str(checkpoint))
    checkpoint.read_bytes()  # warm the page cache, as offload() does for the pool's file
    return {
        "reference: safetensors load_file(device=cuda:0)": gbps(
            nbytes, lambda: load_file(str(checkpoint), device=f"cuda:{DEVICE.index}"), repeat
        ),
        "ceiling: pinned .to(non_blocking)": gbps(
            nbytes, lambda: pinned.to(DEVICE, non_blocking=True), repeat
        ),
        "storage.to_device, pinned": gbps(
            nbytes, lambda: storage.to_device(pinned, DEVICE), repeat
        ),
        "reference: pin_memory().to(non_blocking)": gbps(
            nbytes, lambda: pageable.pin_memory().to(DEVICE, non_blocking=True), repeat
        ),
        "storage.to_device, pageable": gbps(
            nbytes, lambda: storage.to_device(pageable, DEVICE), repeat
        ),
        "file -> cuda: reload(cuda:0)": gbps(nbytes, lambda: offloaded.reload(DEVICE), repeat),
        "file -> cuda: pool miss": gbps(nbytes, pool_miss, repeat),
    }


def throughput_rows(figures: dict[str, float]) -> list[Row]:
    ceiling = figures["ceiling: pinned .to(non_blocking)"]
    reference = figures["reference: pin_memory().to(non_blocking)"]
    pinned = figures["storage.to_device, pinned"]
    pageable = figures["storage.to_device, pageable"]
    rows = [
        summary_row(
            "pinned H2D: storage.to_device",
            f"{pinned:.2f} GB/s ({pinned / ceiling:.2f}x)",
            f"pinned .to(non_blocking) {ceiling:.2f} GB/s",
            f">= {PINNED_TARGET:g}x the ceiling",
            pinned / ceiling >= PINNED_TARGET,
        ),
        summary_row(
            "pageable H2D: storage.to_device (pinned ring)",
            f"{pageable:.2f} GB/s ({pageable / reference:.2f}x)",
            f"pin_memory().to(non_blocking) {reference:.2f} GB/s",
            f">= {PAGEABLE_TARGET:g}x the reference",
            pageable / reference >= PAGEABLE_TARGET,
        ),
    ]
    competitor = figures["reference: safetensors load_file(device=cuda:0)"]
    for name in ("file -> cuda: reload(cuda:0)", "file -> cuda: pool miss"):
        rows.append(
            summary_row(
                name,
                f"{figures[name]:.2f} GB/s ({figures[name] / competitor:.2f}x)",
                f"safetensors load_file(device=cuda) {competitor:.2f} GB/s",
            )
        )
    return rows


def pinned_footprint_row() -> Row:
    from torch_to_nnef.tensor import TensorResidencyPool, storage

    bound = storage.PINNED_CHUNK_BYTES * storage.PINNED_CHUNKS_PER_DEVICE
    held = storage.pinned_bytes()
    with TensorResidencyPool() as pool:
        reported = getattr(pool.stats(), "pinned_bytes", None)
    return summary_row(
        "pinned footprint",
        f"{held / MIB:.0f} MiB (stats(): {reported if reported is None else reported // MIB} MiB)",
        f"bound {bound / MIB:.0f} MiB per device",
        "within the bound, reported by stats()",
        0 < held <= bound * torch.cuda.device_count() and reported == held,
    )


# ---------------------------------------------------------------------------------------------
def device_line() -> str:
    properties = torch.cuda.get_device_properties(DEVICE)
    return (
        f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
        f"{torch.cuda.device_count()} device(s); torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}"
    )


def source_revision() -> str:
    """The checkout's commit (``+ changes`` when its tracked files differ), or ``unknown``."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{commit} + changes" if commit and changed else commit or "unknown"


def markdown(rows: list[Row], device: str, details: list[list[str]]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = ["# GPU check", "", f"Device: {device}", "", f"Run: {when}, {source_revision()}", ""]
    lines += [
        "| figure | value | reference (same run) | target | status |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row["figure"], row["value"], row["reference"], row["target"], verdict(row["met"])]
        lines.append("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |")
    lines += ["", "| host-to-device path | GB/s |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in details]
    return "\n".join(lines) + "\n"


def races_only(quick: bool) -> int:
    cycles = int(sleep_cycles_per_ms() * (20 if quick else 50))
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="t2n-gpu-races-") as name:
        directory = Path(name)
        checks.run("eviction race", lambda: check_eviction_race(directory, cycles))
        checks.run("write-back race", lambda: check_write_back_race(directory, cycles))
    print_summary(checks.rows)
    return 0 if checks.passed else 1


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    if not torch.cuda.is_available():
        print(NO_DEVICE)
        if not arguments.skip_without_cuda:
            return 2
        document = {
            "config": {"quick": arguments.quick},
            "cuda": False,
            "summary": [summary_row("GPU check", "skipped", target=NO_DEVICE)],
            "wall_seconds": time.perf_counter() - started,
        }
        write_results("gpu", document, arguments.output)
        return 0
    if arguments.races_only:
        return races_only(arguments.quick)
    device = device_line()
    print(f"device: {device}", flush=True)
    numel = (16 * MIB if arguments.quick else 256 * MIB) // 4
    repeat = 2 if arguments.quick else 4
    cycles_per_ms = sleep_cycles_per_ms()
    race_cycles = int(cycles_per_ms * (20 if arguments.quick else 50))
    checks = Checks()
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="t2n-gpu-check-") as name:
        directory = Path(name)
        checks.run("CUDA tests", lambda: check_cuda_tests(directory))
        checks.run("reload values", lambda: check_values(directory))
        checks.run("streamed model, any stream", lambda: check_pool_model(directory, 1024, 8))
        checks.run("eviction race", lambda: check_eviction_race(directory, race_cycles))
        checks.run("write-back race", lambda: check_write_back_race(directory, race_cycles))
        checks.run("sanitizer", lambda: check_races_with_sanitizer(arguments))
        checks.run("overlap", lambda: check_overlap(directory, numel, cycles_per_ms, repeat))

        def parallel() -> Row:
            row, measured = check_parallel_workers(directory, numel, max(1, repeat // 2))
            figures.update(measured)
            return row

        checks.run("parallel workers", parallel, speed=True)

        def measured_throughput() -> list[Row]:
            figures.update(throughput(directory, numel, repeat))
            return throughput_rows(figures)

        checks.run("throughput", measured_throughput, speed=True)
        checks.run("pinned footprint", pinned_footprint_row)
        gc.collect()

    rows = checks.rows
    details = [[name, f"{value:.2f}"] for name, value in figures.items()]
    document = {
        "config": {"quick": arguments.quick, "tensor_bytes": numel * 4, "repeat": repeat},
        "cuda": True,
        "device": device,
        "throughput_gbps": figures,
        "summary": rows,
        "details": {"headers": ["host-to-device path", "GB/s"], "rows": details},
        "wall_seconds": time.perf_counter() - started,
    }
    output = write_results("gpu", document, arguments.output)
    print()
    print(f"device: {device}")
    print(format_table(["host-to-device path", "GB/s"], details))
    print()
    print_summary(rows)
    if arguments.markdown is not None:
        arguments.markdown.parent.mkdir(parents=True, exist_ok=True)
        arguments.markdown.write_text(markdown(rows, device, details))
        print(f"wrote {arguments.markdown}")
    print(f"wrote {output} in {document['wall_seconds']:.1f} s")
    if not checks.passed:
        print(f"FAILED: {', '.join(checks.failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
