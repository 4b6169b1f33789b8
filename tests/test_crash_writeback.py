"""Crash during write-back: a pool killed (SIGKILL) at random moments never tears a payload.

A child process leases offloaded tensors ``read_write`` through a pool with a small budget,
adds 1 to each, and flushes (or closes the pool and opens a new one), generation after
generation, through the sync face or the async one: dirty values are written back as the pool
evicts them and on every flush or close. The parent kills it at random moments (half of them while
a flush runs), then reads every payload file back: each is a valid file holding exactly the
previous or the new generation of its tensor (its checksum is that of one of the two), never a
mix, and the next child carries on from there. ``T2N_STRESS=1`` kills 200 children instead of 15.
"""

from __future__ import annotations

import hashlib
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from stress.children import context, start_worker
from stress.figures import record, scaled
from stress.workers import DURABLE, FLUSHING, PHASE, STARTED

from torch_to_nnef.tensor import storage

NUMEL = 64 * 1024  # 256 KiB of float32 per payload
TENSORS = 6
BUDGET = 3 * NUMEL * 4  # half of the values fit: evictions write dirty values back
KILLS = scaled(15, 200)


def base(index: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + index * NUMEL


def checksum(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def generation_on_disk(path: Path, index: int, allowed: range) -> int:
    """The generation a payload holds; fails unless it is whole and one of ``allowed``."""
    layout = storage.read_layout(path)
    spec = layout.entries["tensor"]
    assert list(layout.entries) == ["tensor"]
    assert (spec.dtype, spec.shape) == (torch.float32, (NUMEL,))
    value = storage.read_payload(layout)["tensor"]
    found = checksum(value)
    matches = [g for g in allowed if checksum(base(index) + g) == found]
    assert matches, (
        f"payload {index} is torn or unexpected: first element {value[0].item()}, last "
        f"{value[-1].item()}, expected generations {list(allowed)}"
    )
    with safe_open(str(path), "pt") as file:  # and any safetensors reader agrees
        assert checksum(file.get_tensor("tensor")) == found
    return matches[0]


@pytest.mark.timeout(60 + 2 * KILLS)
def test_killed_write_backs_leave_the_previous_or_the_new_value(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    specs = [(f"layer.{i}.weight", f"crash{i}") for i in range(TENSORS)]
    paths = [storage.payload_path(offload_dir, name, sid) for name, sid in specs]
    for index, path in enumerate(paths):
        storage.write_payload(path, {"tensor": base(index)})
    error_file = tmp_path / "worker-error.txt"
    forkserver = context()
    chooser = random.Random(20240607)
    generations = [0] * TENSORS
    outcomes: Counter[str] = Counter()
    kills_in_flush = interrupted = durable_total = 0
    seconds_per_generation = 0.2
    for kill in range(KILLS):
        # No lock: a kill landing while the child holds one would leave it held for good,
        # and the reads below would wait for ever (each 8-byte slot is stored whole).
        progress = forkserver.Array("q", 3, lock=False)
        ready = forkserver.Event()
        process = start_worker(
            "crash_writer",
            offload_dir=str(offload_dir),
            specs=specs,
            budget=BUDGET,
            face="async" if kill % 4 >= 2 else "sync",
            progress=progress,
            ready=ready,
            error_file=str(error_file),
        )
        try:
            assert ready.wait(timeout=60), "the child did not start"
            started_at = time.perf_counter()
            if kill % 2:  # in the middle of a flush
                deadline = started_at + 10
                target = chooser.randint(1, 3)
                while not (progress[STARTED] >= target and progress[PHASE] == FLUSHING) and (
                    time.perf_counter() < deadline and process.is_alive()
                ):
                    time.sleep(0.0005)
                time.sleep(chooser.uniform(0, 0.1 * seconds_per_generation))
            else:  # anywhere in the first generations
                time.sleep(chooser.uniform(0, 3 * seconds_per_generation))
            kills_in_flush += progress[PHASE] == FLUSHING
        finally:
            process.kill()
            process.join(timeout=30)
        if process.exitcode != -signal.SIGKILL:
            report = error_file.read_text() if error_file.exists() else "no report"
            pytest.fail(f"the child ended with {process.exitcode} before the kill:\n{report}")
        started, durable = progress[STARTED], progress[DURABLE]
        if durable:
            elapsed = time.perf_counter() - started_at
            seconds_per_generation = 0.5 * seconds_per_generation + 0.5 * elapsed / started
        assert 0 <= started - durable <= 1
        durable_total += durable
        for index, path in enumerate(paths):
            previous = generations[index]
            allowed = range(previous + durable, previous + started + 1)
            found = generation_on_disk(path, index, allowed)
            outcomes["previous" if found == previous + durable else "new"] += 1
            generations[index] = found
        leftovers = [p for p in offload_dir.iterdir() if p not in paths]
        interrupted += len(leftovers)
        for leftover in leftovers:  # temporary files of writes the kill interrupted
            assert leftover.name.startswith(".") and leftover.name.endswith(".tmp")
            leftover.unlink()

    assert sum(outcomes.values()) == KILLS * TENSORS
    # The kills landed in the middle of write-backs: the property was really exercised.
    assert kills_in_flush > 0 and interrupted + outcomes["new"] > 0
    assert durable_total > 0
    record(
        "crash_writeback",
        crashes_survived=KILLS,
        faults=KILLS,
        kills_during_flush=kills_in_flush,
        interrupted_writes=interrupted,
        payloads_checked=KILLS * TENSORS,
        payloads_previous=outcomes["previous"],
        payloads_new=outcomes["new"],
        generations_flushed=durable_total,
        operations=sum(generations),
        lost=0,
    )
