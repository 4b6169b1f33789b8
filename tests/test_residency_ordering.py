"""Writes land in program order; nothing hangs or leaks under cancellation and interrupts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from residency_checks import on_disk

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

pytestmark = [pytest.mark.timeout(120)]

NUMEL = 256
BIG = 1 << 22  # float32: 16 MiB, so that a load or a write-back takes a while


def _tensor(directory: Path, name: str = "t", numel: int = NUMEL) -> OffloadedTensor:
    return OffloadedTensor.from_original_tensor(torch.zeros(numel), name, offload_dir=directory)


DIRECT_WRITES: dict[str, Callable[[OffloadedTensor], None]] = {
    "copy_": lambda t: t.copy_(torch.full((NUMEL,), 5.0)),
    "set_": lambda t: t.set_(torch.full((NUMEL,), 5.0)),
    "data": lambda t: setattr(t, "data", torch.full((NUMEL,), 5.0)),
    "update_values": lambda t: t.update_values(torch.full((NUMEL,), 5.0)),
}


# ---------------------------------------------------------------------------------------------
# 1. A later direct write wins over an older dirty value of the pool
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("write", sorted(DIRECT_WRITES))
@pytest.mark.parametrize("then", ["close", "flush", "evict"])
def test_a_later_direct_write_is_never_overwritten_by_the_pool(
    tmp_path: Path, write: str, then: str
) -> None:
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        with pool.scope():
            t.add_(1.0)  # a change held by the pool (dirty)
            DIRECT_WRITES[write](t)  # later in program order: it wins
        if then == "flush":
            pool.flush()
        elif then == "evict":
            pool.evict(t)
        if then != "close":  # (close: nothing reads t before the pool closes)
            assert torch.equal(pool.resolve(t), torch.full((NUMEL,), 5.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0))
    assert torch.equal(t.reload(), torch.full((NUMEL,), 5.0))


def test_a_write_of_another_pool_wins_over_an_older_dirty_value(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    with TensorResidencyPool() as first, TensorResidencyPool() as second:
        with first.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        with second.acquire(t, mode="read_write") as value:
            assert float(value[0]) == 1.0, "another pool read an older value"
            value.fill_(2.0)
        second.flush()
        first.flush()
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))


# ---------------------------------------------------------------------------------------------
# 2. A dtype change while the pool holds a dirty value
# ---------------------------------------------------------------------------------------------
def test_a_dtype_change_sees_the_dirty_value_and_the_pool_still_closes(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    pool = TensorResidencyPool()
    with pool:
        with pool.scope():
            t.add_(1.0)
        t.to(torch.float64)  # reads the latest value: the pool's
        assert torch.equal(t.reload(), torch.ones(NUMEL, dtype=torch.float64))
        with pool.scope():
            assert t.reload().dtype == torch.float64
    assert pool.closed
    assert torch.equal(on_disk(t), torch.ones(NUMEL, dtype=torch.float64))


def test_a_reload_outside_the_pool_sees_its_dirty_value(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(4.0)
        assert torch.equal(t.reload(), torch.full((NUMEL,), 4.0))
        assert torch.equal(t + 0, torch.full((NUMEL,), 4.0))
        t.mul_(2.0)  # an in-place op outside any scope starts from the pool's value
        assert torch.equal(pool.resolve(t), torch.full((NUMEL,), 8.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 8.0))


# ---------------------------------------------------------------------------------------------
# 3. close() while a read_write acquire waits for its load
# ---------------------------------------------------------------------------------------------
def test_close_never_strands_a_waiting_read_write_acquire(tmp_path: Path) -> None:
    t = _tensor(tmp_path, numel=BIG)
    pool = TensorResidencyPool()
    pool.__enter__()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(9.0)
        except BaseException as error:  # the close may win: the acquire is refused then
            errors.append(error)

    for _ in range(20):
        thread = threading.Thread(target=writer)
        thread.start()
        while pool.stats().misses == 0 and thread.is_alive():
            time.sleep(0.0005)
        with contextlib.suppress(T2NErrorMisuse):  # refused while the acquire waits
            pool.close()
        thread.join(30)
        assert not thread.is_alive()
        if pool.closed:
            break
        pool.close()
        break
    assert pool.closed
    if not errors:
        assert torch.equal(on_disk(t), torch.full((BIG,), 9.0)), "a granted change was lost"
    else:
        assert isinstance(errors[0], T2NErrorMisuse)


# ---------------------------------------------------------------------------------------------
# 4. A direct write between the pool's commit and its completion
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_direct_write_right_after_a_write_back_commits_is_served(tmp_path: Path) -> None:
    t = _tensor(tmp_path, numel=BIG)
    async with TensorResidencyPool() as pool:
        async with pool.acquire(t, mode="read_write") as value:
            value.fill_(2.0)
        before = t.payload_version
        flushing = threading.Thread(target=pool.flush)
        flushing.start()
        deadline = time.monotonic() + 30
        while t.payload_version is before and time.monotonic() < deadline:
            await asyncio.sleep(0) if not t._pending_writes else time.sleep(0.0005)
        # The write-back committed; its completion has not run on this (the pool's) loop.
        t.update_values(torch.full((BIG,), 7.0))
        await asyncio.to_thread(flushing.join, 30)
        assert torch.equal(await pool.aresolve(t), torch.full((BIG,), 7.0))
    assert torch.equal(on_disk(t), torch.full((BIG,), 7.0))
