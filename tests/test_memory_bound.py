"""The budget bounds the process: streaming a model through a pool raises the peak resident set
by at most the budget, what is leased at once and 64 MiB, and closing the pool gives the memory
back to the operating system.

Each case runs in a fresh interpreter with no ``MALLOC_*`` variable in its environment (glibc's
tunables would hide what the allocator keeps), frees a layer-sized tensor first (as building
or running any model does), binds 24 layers of up to 16 MiB to a checkpoint, and streams two
forwards through a 64 MiB budget with 4 I/O workers (``stream_modules`` with ``depth=1``: the
layer computing and the one read ahead are leased at once): buffered reads of layers of one
shape (the pool reuses evicted buffers) and of distinct shapes (no evicted buffer fits), and
mapped reads (evicted values must be unmapped).

Seen failing before host buffers were mappings of their own: with buffered reads, 56 MiB
(one shape) and 169 MiB (distinct shapes) stayed after ``close()``, and the peak of the
distinct shapes rose by 210 MiB, above the bound of 160 MiB (glibc served the buffers from its
per-thread heaps once its mmap threshold had risen past them, and kept them when freed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_to_nnef.tensor import storage

MIB = 1 << 20
LAYERS = 24
WIDTH = 2048  # 16 MiB of float32 per layer
LAYER_BYTES = WIDTH * WIDTH * 4
BUDGET = 64 * MIB
LEASED_AT_ONCE = 2 * LAYER_BYTES  # the layer computing and the one read ahead
SLACK = 64 * MIB
LEFT_AFTER_CLOSE = LAYER_BYTES
"""What the resident set may keep above its level before the forwards once the pool is closed:
less than one layer (measured: 2 to 10 MiB, the interpreter's and torch's own)."""

CLEAR_REFS = Path("/proc/self/clear_refs")


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident() -> int:
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def widths(distinct: bool) -> list[int]:
    """The layers' input and output widths: one width, or one per layer (no two layers of a
    shape, so that no spare buffer fits a later load)."""
    return [WIDTH - 16 * i * distinct for i in range(LAYERS + 1)]


def child(checkpoint: str, mapped: bool, distinct: bool) -> None:
    """Stream the checkpoint's model through a pool; print the figures as one JSON line."""
    from torch import nn

    from torch_to_nnef.tensor import (
        OffloadedTensor,
        TensorResidencyPool,
        load_offloaded_checkpoint,
        stream_modules,
    )

    storage.set_mapped_reads(mapped)
    torch.set_num_threads(1)
    with torch.device("meta"):
        sizes = widths(distinct)
        model = nn.Sequential(
            *(nn.Linear(sizes[i], sizes[i + 1], bias=False) for i in range(LAYERS))
        )
    load_offloaded_checkpoint(model, checkpoint)
    x = torch.randn(8, WIDTH)
    pool = TensorResidencyPool(max_cached_bytes=BUDGET, max_workers=4)
    with torch.no_grad():
        (x @ torch.ones(WIDTH, 8)).sum()  # the BLAS library loaded, as a forward would
        # A layer-sized tensor freed, as building a model or any forward with large
        # activations does: glibc then raises its mmap threshold past it.
        torch.ones(WIDTH, WIDTH).sum()
        warm = OffloadedTensor.from_original_tensor(
            torch.zeros(1024), "warm", Path(checkpoint).parent
        )
        pool.resolve(warm)  # the pool's loop and I/O threads started
        before = _resident()
        CLEAR_REFS.write_text("5")  # the peak restarts from the current resident set
        for _ in range(2):
            with stream_modules(pool, list(model), depth=1), pool.scope():
                y = model(x)
            if not torch.isfinite(y).all():
                raise AssertionError("the streamed forward produced non-finite values")
        peak = _peak_resident()
        loads = pool.stats().loads
        pool.close()
    print(json.dumps({"growth": peak - before, "left": _resident() - before, "loads": loads}))


# The tests of this module share a module fixture: with workers (pytest-xdist), they run
# on one, which builds it once.
pytestmark = pytest.mark.xdist_group("test_memory_bound")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """A checkpoint per layout (one shape or distinct shapes), by ``distinct``."""
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(WIDTH * WIDTH, generator=generator) / WIDTH**0.5
    directory = tmp_path_factory.mktemp("memory")
    paths = {}
    for distinct in (False, True):
        sizes = widths(distinct)
        # Every layer a view of one 16 MiB tensor: 384 MiB on disk, 16 MiB here.
        layers = {
            f"{i}.weight": flat[: sizes[i + 1] * sizes[i]].view(sizes[i + 1], sizes[i])
            for i in range(LAYERS)
        }
        paths[distinct] = directory / f"distinct-{distinct}.safetensors"
        storage.write_payload(paths[distinct], layers, fsync=False)
    return paths


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access(CLEAR_REFS, os.W_OK),
    reason="needs Linux's resettable peak RSS",
)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mapped", "distinct"),
    [(False, False), (False, True), (True, True)],
    ids=["buffered-one-shape", "buffered-distinct-shapes", "mapped"],
)
def test_streaming_stays_within_the_budget_and_close_gives_memory_back(
    checkpoints: dict[bool, Path], mapped: bool, distinct: bool
) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            str(checkpoints[distinct]),
            str(int(mapped)),
            str(int(distinct)),
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["loads"] >= LAYERS  # the model was streamed, not held
    bound = BUDGET + LEASED_AT_ONCE + SLACK
    assert figures["growth"] <= bound, (
        f"peak RSS grew by {figures['growth'] / MIB:.0f} MiB, above the bound of "
        f"{bound / MIB:.0f} MiB (budget + 2 layers leased + 64 MiB)"
    )
    assert figures["left"] <= LEFT_AFTER_CLOSE, (
        f"RSS stayed {figures['left'] / MIB:.0f} MiB above its level before streaming after "
        "the pool was closed"
    )


if __name__ == "__main__":
    child(sys.argv[1], bool(int(sys.argv[2])), bool(int(sys.argv[3])))
