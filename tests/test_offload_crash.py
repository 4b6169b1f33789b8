"""Crash safety: a writer killed (SIGKILL) at random moments of update_values never tears a file.

Writers are forked from a forkserver that imported torch once, so that each of the many short
writer processes starts in milliseconds.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from stress import children

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor

ELEMENTS = 8 << 20  # 32 MiB of float32
KILLS = 20
NAME = "big.weight"
STORAGE_ID = "crash"


@pytest.mark.timeout(180)
def test_killed_writers_leave_the_old_or_the_new_values(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    old = torch.arange(ELEMENTS, dtype=torch.float32)  # the writer's two values: this and -this
    new = -old
    owner = OffloadedTensor(old, "cpu", offload_dir, NAME, torch.Tensor, storage_id=STORAGE_ID)
    path = owner.offload_path
    started = time.perf_counter()
    owner.update_values(old)
    write_seconds = time.perf_counter() - started

    chooser = random.Random(1234)
    outcomes = {"old": 0, "new": 0}
    interrupted_writes = 0
    for _ in range(KILLS):
        ready = children.context().Event()
        process = children.start_worker(
            "tensor_writer",
            offload_dir=str(offload_dir),
            name=NAME,
            storage_id=STORAGE_ID,
            elements=ELEMENTS,
            ready=ready,
        )
        try:
            # The first start also starts the forkserver, which imports torch: slow under load.
            assert ready.wait(timeout=120), "the writer process did not start"
            time.sleep(chooser.uniform(0.0, 2.5 * write_seconds))
        finally:
            process.kill()
            process.join(timeout=10)
        assert process.exitcode == -9, "the writer must die by SIGKILL, not on its own"

        # A fresh reader: the file is valid and holds exactly one of the two values.
        value = OffloadedTensor.from_safetensors(path, "tensor").reload()
        if torch.equal(value, old):
            outcomes["old"] += 1
        else:
            assert torch.equal(value, new), "the payload holds neither the old nor the new values"
            outcomes["new"] += 1
        assert storage.read_layout(path).nbytes == ELEMENTS * 4
        leftovers = [p for p in offload_dir.iterdir() if p != path]
        interrupted_writes += bool(leftovers)
        for leftover in leftovers:  # temporary files of interrupted writes
            assert leftover.name.startswith(".") and leftover.name.endswith(".tmp")
            leftover.unlink()

    assert sum(outcomes.values()) == KILLS
    # The kills did land in the middle of writes: the property was really exercised.
    assert interrupted_writes > 0
