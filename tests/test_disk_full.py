"""Disk full: write-backs failing with EFBIG raise to the caller and lose nothing.

A child process lowers its file size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored) below
the size of a payload file, so every write-back fails with ``EFBIG`` as on a full disk. Then
``flush``, ``evict`` and ``close`` raise ``T2NErrorStorage``; the dirty values stay resident and
readable, the payload files keep their previous values, and no temporary file is left behind.
Once the limit is lifted, the next flush writes everything. The same holds for a direct
``update_values`` and, in this process, for a pool whose write-back fails for another reason.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from residency_checks import check_invariants, on_disk, settle
from stress.children import context, start_worker
from stress.figures import record

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

NUMEL = 64 * 1024  # 256 KiB payloads
SIZE_LIMIT = 64 * 1024  # bytes a process may write into one file: a quarter of a payload


def run_disk_full_child(offload_dir: Path) -> dict[str, Any]:
    specs = [(f"w{i}", f"full{i}") for i in range(3)]
    for index, (name, sid) in enumerate(specs):
        path = storage.payload_path(offload_dir, name, sid)
        storage.write_payload(path, {"tensor": torch.full((NUMEL,), float(index))})
    receiver, sender = context().Pipe(duplex=False)
    process = start_worker(
        "disk_full",
        offload_dir=str(offload_dir),
        specs=specs,
        size_limit=SIZE_LIMIT,
        reply=sender,
    )
    sender.close()
    try:
        assert receiver.poll(60), "the child sent no report"
        facts: dict[str, Any] = receiver.recv()
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert "worker_error" not in facts, facts["worker_error"]
    return facts


def assert_failed_write(facts: dict[str, Any]) -> None:
    assert facts["type"] == "T2NErrorStorage", facts
    assert facts["efbig"], f"EFBIG is not in the cause chain {facts['chain']}"
    assert "File too large" in facts["message"] or "write-back" in facts["message"]


@pytest.mark.timeout(90)
def test_write_backs_failing_with_efbig_keep_the_values_until_space_is_back(
    tmp_path: Path,
) -> None:
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    facts = run_disk_full_child(offload_dir)

    # flush, evict and close raise to their caller, with the OSError chained.
    for step in ("flush", "evict", "close"):
        assert_failed_write(facts[step])
    assert "flush again" in facts["flush"]["message"]
    assert facts["closed_after_failed_close"] is False
    # The dirty value stays resident and readable; the file keeps the previous value.
    assert facts["resident_after_flush"] and facts["resident_after_evict"]
    assert facts["kept_after_flush"] and facts["disk_after_flush"]
    # Evictions under pressure fail alike: both dirty values stay, clean reads still work.
    assert facts["third_readable"]
    assert facts["pressure_resident"] == [True, True]
    assert facts["pressure_kept"] == [True, True]
    assert_failed_write(facts["direct_update"])
    assert facts["disk_under_limit"] == [True, True, True]
    # No temporary file is left behind by the failed writes.
    assert facts["temps_after_flush"] == [] and facts["temps_under_limit"] == []
    # Space is back: the next flush writes both values; close then succeeds.
    assert facts["flush_again"] == {"type": None}
    assert facts["write_backs"] == 2
    assert facts["closed"] is True
    assert facts["disk_final"] == [True, True, True]
    assert facts["layouts_valid"] and facts["temps_final"] == []
    record("disk_full", faults=5, operations=12, lost=0)


def test_a_failed_write_back_in_async_code_is_retried_by_aflush(tmp_path: Path) -> None:
    """The async face: aflush/aclose raise, the value stays dirty, a later aflush succeeds."""
    offload_dir = tmp_path / "offload"
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "w", offload_dir)
    path = tensor.offload_path
    moved = tmp_path / "moved"

    async def main() -> None:
        async with TensorResidencyPool(max_cached_bytes=1 << 30) as pool:
            async with pool.acquire(tensor, mode="read_write") as value:
                value.add_(5)
            os.rename(offload_dir, moved)  # the directory is gone: writes fail with ENOENT
            with pytest.raises(T2NErrorStorage, match="flush again") as info:
                await pool.aflush()
            assert isinstance(info.value.__cause__.__cause__, OSError)  # type: ignore[union-attr]
            assert info.value.__cause__.__cause__.errno == errno.ENOENT  # type: ignore[union-attr]
            with pytest.raises(T2NErrorStorage, match="pool stays open"):
                await pool.aclose()
            assert pool.is_resident(tensor) and not pool.closed
            assert torch.equal(await pool.aresolve(tensor), torch.full((NUMEL,), 5.0))
            check_invariants(pool)
            os.rename(moved, offload_dir)
            await pool.aflush()
            check_invariants(pool)
        assert pool.closed

    anyio.run(main)
    assert torch.equal(tensor._reload_unmanaged(), torch.full((NUMEL,), 5.0))
    assert sorted(os.listdir(offload_dir)) == [path.name]
    record("disk_full_async", faults=2, operations=6, lost=0)


@pytest.mark.timeout(60)
def test_a_failed_write_back_leaves_the_other_values_within_the_budget(tmp_path: Path) -> None:
    """An eviction whose write-back fails keeps the dirty value, out of the eviction order:
    the clean values that the budget has no room for go, as they would had it succeeded."""
    failing, working = tmp_path / "failing", tmp_path / "working"
    dirty = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "dirty", failing)
    clean = [
        OffloadedTensor.from_original_tensor(torch.full((NUMEL,), float(i)), f"c{i}", working)
        for i in (1, 2)
    ]
    with TensorResidencyPool(max_cached_bytes=2 * NUMEL * 4) as pool:
        with pool.acquire(dirty, mode="read_write") as value:
            value.add_(5)
        pool.resolve(clean[0])
        os.rename(failing, tmp_path / "moved")  # its write-back fails with ENOENT
        pool.resolve(clean[1])  # evicts the dirty value, the least recently used
        settle(pool)
        assert pool.is_resident(dirty)  # stays, dirty, for a flush to retry
        assert not pool.is_resident(clean[0])  # goes: the budget holds two values
        assert pool.resident_bytes == 2 * NUMEL * 4
        check_invariants(pool)
        for tensor in clean:  # hits and misses go on as before
            assert torch.equal(pool.resolve(tensor), tensor._reload_unmanaged())
        check_invariants(pool)
        os.rename(tmp_path / "moved", failing)
    assert torch.equal(on_disk(dirty), torch.full((NUMEL,), 5.0))


@pytest.mark.timeout(60)
def test_a_failed_flush_names_the_files_it_could_not_write(tmp_path: Path) -> None:
    failing = tmp_path / "failing"
    tensors = [
        OffloadedTensor.from_original_tensor(torch.zeros(16), f"w{i}", failing) for i in range(4)
    ]
    with TensorResidencyPool() as pool:
        for tensor in tensors:
            with pool.acquire(tensor, mode="read_write") as value:
                value.add_(1)
        os.rename(failing, tmp_path / "moved")
        for call in (pool.flush, pool.close):
            with pytest.raises(T2NErrorStorage) as info:
                call()
            message = str(info.value)
            assert message.startswith(("4 write-back(s) failed (", "closing the pool: 4"))
            named = [tensor for tensor in tensors if tensor.offload_path.name in message]
            assert len(named) == 3 and "and 1 more" in message, message
        os.rename(tmp_path / "moved", failing)
    assert all(torch.equal(on_disk(tensor), torch.ones(16)) for tensor in tensors)
