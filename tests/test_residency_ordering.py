"""Writes land in program order; nothing hangs or leaks under cancellation and interrupts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import errno
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from breakpoints import Breakpoint, breakpoints_in_new_threads, line_of, paused_in_new_threads
from forking import FORKS, in_forked_child, in_forked_child_while_held
from forking import outcomes as _outcomes
from interrupts import CtrlCTimer, InterruptAt, interrupted
from residency_checks import check_invariants, on_disk, reports_that_raise
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool, _handles, stream_modules
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._runtime import Runtime
from torch_to_nnef.tensor.storage import _io as storage_io

pytestmark = [pytest.mark.timeout(120)]

NUMEL = 256
BIG = 1 << 22  # float32: 16 MiB, so that a load or a write-back takes a while


def _read_then_changed_by_a_new_pool(t: OffloadedTensor) -> list[float]:
    """In a forked child: ``t``'s first element as ``reload``, an op and a new pool read it,
    then on disk once that pool added 8 to it under a ``read_write`` lease and flushed."""
    seen = [float(t.reload()[0]), float((t + 0)[0])]
    with TensorResidencyPool() as own:
        seen.append(float(own.resolve(t)[0]))
        with own.acquire(t, mode="read_write") as changed:
            changed.add_(8.0)
        own.flush()
        seen.append(float(on_disk(t)[0]))
    return seen


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


@pytest.mark.parametrize("read", ["resolve", "acquire", "thread", "scope"])
def test_a_pool_holding_an_older_value_serves_another_pools_later_change(
    tmp_path: Path, read: str
) -> None:
    """Pool ``b`` holds the value when pool ``a`` changes it: every read through ``b`` (a
    hit path included) sees the change, before and after ``a`` writes it back."""
    t = _tensor(tmp_path)

    def through(pool: TensorResidencyPool) -> float:
        if read == "resolve":
            return float(pool.resolve(t)[0])
        if read == "acquire":
            with pool.acquire(t) as value:
                return float(value[0])
        if read == "thread":  # a hit taken by another thread, without the loop
            with concurrent.futures.ThreadPoolExecutor(1) as executor:
                return executor.submit(lambda: float(pool.resolve(t)[0])).result(30)
        with pool.scope():
            return float(t[0])

    with TensorResidencyPool() as a, TensorResidencyPool() as b:
        assert float(b.resolve(t)[0]) == 0.0  # resident in b
        with a.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        assert through(b) == 1.0, "b served its value from before a's change"
        with b.acquire(t, mode="read_write") as value:  # b's change builds on a's
            value.add_(1.0)
        assert through(a) == 2.0, "a served its own value from before b's change"
        a.flush()  # a's write-back is superseded: it writes nothing
        b.flush()
        assert through(a) == through(b) == 2.0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))


def test_two_pools_a_dtype_change_and_in_place_ops_follow_program_order(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    half = torch.float16
    with TensorResidencyPool() as a, TensorResidencyPool() as b:
        for pool in (a, b):
            pool.resolve(t)  # resident in both
        with a.acquire(t, mode="read_write") as value:
            value.fill_(1.5)
        t.to(half)  # a direct write of a's change, cast
        assert torch.equal(b.resolve(t), torch.full((NUMEL,), 1.5, dtype=half))
        with b.scope():
            t.add_(1.0)  # b's change
        assert torch.equal(a.resolve(t), torch.full((NUMEL,), 2.5, dtype=half))
        with a.acquire(t, mode="read_write") as value:
            value.mul_(2.0)  # a's change, on b's
        assert torch.equal(b.resolve(t), torch.full((NUMEL,), 5.0, dtype=half))
        b.flush()  # superseded by a's change: writes nothing
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0, dtype=half))


def _in_thread(run: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _direct_write_paused(tensor: OffloadedTensor) -> Iterator[threading.Thread]:
    """``tensor.mul_(2.0)`` outside any scope, in a thread paused as it writes its file (it
    holds the tensor's write lock, its value derived from the write before); the write lands
    as the block ends. Yields that thread, joined then."""
    with paused_in_new_threads(
        OffloadedTensor._write_encoded.__code__,
        on="call",
        caller=OffloadedTensor._rewrite.__code__,
    ) as point:
        point.armed.set()
        thread = _in_thread(lambda: tensor.mul_(2.0))
        assert point.paused.wait(10)
        try:
            yield thread
        finally:
            point.go()
            thread.join(10)


def test_in_place_ops_outside_a_scope_in_two_threads_keep_both_writes(tmp_path: Path) -> None:
    """An in-place op outside any scope reads the value, changes it and writes it: a write
    of another thread landing in between is kept, as on a plain tensor (the op runs again
    from it), never overwritten by a value derived from the write before it."""
    t = _tensor(tmp_path)
    with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point:
        point.armed.set()
        adder = _in_thread(lambda: t.add_(1.0))  # pauses after reading 0
        assert point.paused.wait(10)
        t[0:2] = 10.0  # another thread's write, in between
        point.go()
        adder.join(10)
    assert not adder.is_alive()
    want = torch.ones(NUMEL)
    want[0:2] = 11.0
    assert torch.equal(t.reload(), want)
    assert torch.equal(on_disk(t), want)


def test_a_dtype_change_keeps_a_pools_change_that_ends_while_it_casts(tmp_path: Path) -> None:
    """``t.to(dtype)`` changes the dtype, not the value: a ``read_write`` lease's change
    noted while the cast runs is cast too, not silently lost."""
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        pool.resolve(t)  # the pool's threads start outside the breakpoint's block
        with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point:
            point.armed.set()
            caster = _in_thread(lambda: t.to(torch.float64))  # pauses after reading 0
            assert point.paused.wait(10)
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
            point.go()
            caster.join(10)
        assert not caster.is_alive()
        assert torch.equal(pool.resolve(t), torch.ones(NUMEL, dtype=torch.float64))
    assert torch.equal(on_disk(t), torch.ones(NUMEL, dtype=torch.float64))


def test_a_lease_ending_while_an_in_place_op_writes_is_never_silently_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An in-place op outside any scope found its value current and writes it: a
    ``read_write`` lease taken on the older value then ends while the file is written. Its
    change is kept, or dropped with the warning that says so; never noted as the latest
    write and then overwritten by the op's value, which does not hold it."""
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        pool.resolve(t)  # resident: the lease is a hit on the value before the op
        with paused_in_new_threads(storage_io.write_payload.__code__, on="call") as point:
            point.armed.set()
            adder = _in_thread(lambda: t.add_(1000.0))  # pauses as it writes 1000
            assert point.paused.wait(10)

            def lease() -> None:
                with pool.acquire(t, mode="read_write") as value:
                    value.add_(1.0)

            leaser = _in_thread(lease)
            leaser.join(0.5)
            point.go()
            adder.join(10)
            leaser.join(10)
        assert not adder.is_alive() and not leaser.is_alive()
        value = float(pool.resolve(t)[0])
        assert value == 1001.0 or (value == 1000.0 and "change is dropped" in caplog.text)
        assert torch.equal(pool.resolve(t), torch.full((NUMEL,), value))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), value))


def test_a_change_dropped_while_an_in_place_op_writes_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An in-place op outside any scope (``mul_(2)``, 3 -> 6) is writing its value when a
    ``read_write`` lease on the older value ends: the lease's change (3 -> 4) is dropped.
    Until the op's write lands, the pool serves the tensor's latest write (3), never the
    value holding the dropped change, which is no write of the tensor; nor does a new
    ``read_write`` lease build on it."""
    t = OffloadedTensor.from_original_tensor(torch.full((NUMEL,), 3.0), "t", offload_dir=tmp_path)
    with TensorResidencyPool() as pool:
        pool.resolve(t)  # resident: the lease is a hit on the value before the op
        with _direct_write_paused(t) as multiplier:  # paused as it writes 6
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
            assert "the lease's change is dropped" in caplog.text
            assert float(pool.resolve(t)[0]) == 3.0
            with pool.acquire(t) as value:
                assert float(value[0]) == 3.0
            with pool.acquire(t, mode="read_write") as value:
                assert float(value[0]) == 3.0
        assert not multiplier.is_alive()
        assert torch.equal(pool.resolve(t), torch.full((NUMEL,), 6.0))
        check_invariants(pool)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))


def test_a_prefetch_handle_never_returns_a_change_dropped_after_its_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefetch's value is loaded (3), then an in-place op outside any scope writes 6 while
    a ``read_write`` lease adds 1 to that value: the lease's change is dropped. The handle,
    waited for then, gives the tensor's latest write (3 while the op's write is under way),
    never the value holding the dropped change (4)."""
    t = OffloadedTensor.from_original_tensor(torch.full((NUMEL,), 3.0), "t", offload_dir=tmp_path)
    with TensorResidencyPool() as pool:
        handle = pool.prefetch(t)
        assert float(handle.wait()[0]) == 3.0
        with _direct_write_paused(t) as multiplier:  # paused as it writes 6
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
            assert "the lease's change is dropped" in caplog.text
            assert float(handle.wait()[0]) == 3.0
        assert not multiplier.is_alive()
        assert float(handle.wait()[0]) == 6.0
        check_invariants(pool)


def test_a_streamed_module_never_computes_on_a_change_dropped_after_its_read_ahead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the first module of a stream runs, the second's weight (3) is leased ahead; an
    in-place op outside any scope then writes 6 while a ``read_write`` lease adds 1 to the
    value read ahead: that change is dropped. The second module computes on the tensor's
    latest write (3 while the op's write is under way), never on the value holding the
    dropped change (4)."""
    from torch_to_nnef.tensor.checkpoint import offload_module

    model = nn.Sequential(nn.Linear(NUMEL, NUMEL, bias=False), nn.Linear(NUMEL, NUMEL, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(NUMEL))
        model[1].weight.fill_(3.0)
    offload_module(model, tmp_path)
    weight = model[1].weight
    threads: list[threading.Thread] = []

    with TensorResidencyPool() as pool, stream_modules(pool, list(model), depth=1):

        def write_meanwhile(module: nn.Module, args: object) -> None:
            threads.append(_in_thread(lambda: weight.mul_(2.0)))  # pauses as it writes 6
            assert point.paused.wait(10)
            with pool.acquire(weight, mode="read_write") as value:
                value.add_(1.0)

        with paused_in_new_threads(
            OffloadedTensor._write_encoded.__code__,
            on="call",
            caller=OffloadedTensor._rewrite.__code__,
        ) as point:
            handle = model[0].register_forward_pre_hook(write_meanwhile)  # after the stream's
            point.armed.set()
            try:
                with torch.no_grad():
                    out = model(torch.ones(1, NUMEL))
            finally:
                handle.remove()
                point.go()
                for thread in threads:
                    thread.join(10)
        assert "the lease's change is dropped" in caplog.text
        assert torch.equal(out, torch.full((1, NUMEL), 3.0 * NUMEL))
        assert not any(thread.is_alive() for thread in threads)
        check_invariants(pool)
    assert torch.equal(on_disk(weight), torch.full((NUMEL, NUMEL), 6.0))


def test_loads_of_two_pools_never_wait_for_each_others_queued_write_backs(
    tmp_path: Path,
) -> None:
    """Each pool's only worker loads a tensor whose write-back the other pool announced
    (and queued behind that other worker's load): the loads read the unsaved change, the
    latest write, without waiting for those write-backs, and everything ends."""
    t0, t1, t2 = (_tensor(tmp_path, f"t{i}") for i in range(3))
    with TensorResidencyPool() as a, TensorResidencyPool() as b:
        for pool, t in ((b, t0), (b, t1), (a, t2)):  # unsaved changes of each pool
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
        with _direct_write_paused(t0) as direct:  # holds t0's write lock
            # Both workers wait behind that write: b's write-back of t0, a's load of t0.
            flush_t0 = _in_thread(lambda: b.flush(t0))
            time.sleep(0.2)
            loaded_t0 = a.prefetch(t0)
            time.sleep(0.2)
            loaded_t1, loaded_t2 = a.prefetch(t1), b.prefetch(t2)  # queued on each worker
            flushes = [_in_thread(lambda: a.flush(t2)), _in_thread(lambda: b.flush(t1))]
            time.sleep(0.2)  # each flush announced its write-back, queued behind a load
        for thread in [direct, flush_t0, *flushes]:
            thread.join(10)
            assert not thread.is_alive(), "the workers of the two pools deadlocked"
        assert float(loaded_t0.wait()[0]) == 2.0
        assert float(loaded_t1.wait()[0]) == float(loaded_t2.wait()[0]) == 1.0
        check_invariants(a)
        check_invariants(b)
    assert [float(on_disk(t)[0]) for t in (t0, t1, t2)] == [2.0, 1.0, 1.0]


def test_loads_of_two_pools_never_wait_for_write_backs_a_direct_write_superseded(
    tmp_path: Path,
) -> None:
    """As above, but a direct write replaced each announced value before the other pool's
    worker loads it: no unsaved change is left to read, and the write-back that was
    announced (queued behind this pool's own waiting load) would write nothing. The loads
    read the file, the latest write, and everything ends. (In a forked child, killed if
    the two workers deadlock.)"""

    def race() -> str:
        w, x, y = (_tensor(tmp_path, n) for n in "wxy")
        a, b = TensorResidencyPool(max_workers=1), TensorResidencyPool(max_workers=1)
        for pool, t in ((a, w), (a, x), (b, y)):  # unsaved changes of each pool
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
        with _direct_write_paused(w) as direct:  # holds w's write lock
            flush_w = _in_thread(lambda: a.flush(w))  # a's worker waits for that lock
            time.sleep(0.2)
            loaded_y = a.prefetch(y)  # queued on a's worker
            time.sleep(0.1)
            flush_x = _in_thread(lambda: a.flush(x))  # announced, queued behind the load
            time.sleep(0.2)
            x.add_(1.0)  # replaces a's unsaved change of x
            loaded_x = b.prefetch(x)  # b's worker loads x at once
            time.sleep(0.2)
            flush_y = _in_thread(lambda: b.flush(y))  # announced, queued behind that load
            time.sleep(0.2)
            y.add_(1.0)  # replaces b's unsaved change of y
        for thread in [direct, flush_w, flush_x, flush_y]:
            thread.join(10)
            if thread.is_alive():
                return "the workers of the two pools deadlocked"
        loaded = [float(loaded_x.wait()[0]), float(loaded_y.wait()[0])]
        check_invariants(a)
        check_invariants(b)
        a.close()
        b.close()
        return repr((loaded, [float(on_disk(t)[0]) for t in (w, x, y)]))

    assert in_forked_child(race, seconds=60) == repr(([2.0, 2.0], [2.0, 2.0, 2.0]))


def test_a_change_made_on_a_value_older_than_another_pools_change_is_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``a`` leased the value before ``b`` changed it: ``a``'s change, made on the older
    value, ends after ``b``'s and is dropped, with a warning (``b``'s is the later write)."""
    t = _tensor(tmp_path)
    with TensorResidencyPool() as a, TensorResidencyPool() as b:
        with a.acquire(t, mode="read_write") as older:
            with b.acquire(t, mode="read_write") as value:
                value.fill_(5.0)
            older.fill_(1.0)
        assert "the later write stands" in caplog.text
        assert float(a.resolve(t)[0]) == float(b.resolve(t)[0]) == 5.0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0))


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [NUMEL, BIG], ids=["small", "mapped copy"])
def test_flush_writes_the_change_made_before_a_read_write_lease_still_held(
    tmp_path: Path, numel: int
) -> None:
    """The change of an ended lease is whole: flush writes it, while another thread's lease
    changes the value; that change is written once its lease ends. (A large value's copy,
    which reads outside the pool see meanwhile, is made in memory mapped for it.)"""
    t = _tensor(tmp_path, numel=numel)
    changing, go_on = threading.Event(), threading.Event()

    def change() -> None:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(-1.0)
            changing.set()
            go_on.wait(30)

    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(4.0)
        thread = threading.Thread(target=change)
        thread.start()
        try:
            assert changing.wait(30)
            pool.flush()
            assert torch.equal(on_disk(t), torch.full((numel,), 4.0))
            pool.flush(t)  # nothing more to write; the lease's change stays its own
            assert torch.equal(t.reload(), torch.full((numel,), 4.0))
        finally:
            go_on.set()
            thread.join(30)
        pool.flush()
        assert torch.equal(on_disk(t), torch.full((numel,), -1.0))
        check_invariants(pool)


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


# ---------------------------------------------------------------------------------------------
# 8. Timeouts from another event loop
# ---------------------------------------------------------------------------------------------
def test_a_timeout_from_another_loop_leaves_the_pool_serving(tmp_path: Path) -> None:
    big = _tensor(tmp_path, "big", numel=BIG)
    small = _tensor(tmp_path, "small")
    # The load of `big` pauses before it returns, so each timeout below fires while the pool
    # still works on the request, whatever the machine's speed.
    code = OffloadedTensor._reload_unmanaged.__code__
    with paused_in_new_threads(code) as load, TensorResidencyPool() as pool:

        async def impatient() -> None:
            load.armed.set()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.aresolve(big), 0.01)
            assert load.paused.wait(30)
            handle = pool.prefetch(big)  # joins the paused load
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(handle, 0.01)
            load.go()
            assert torch.equal(await handle, torch.zeros(BIG))
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.01):
                    async with pool.acquire(big):
                        await asyncio.sleep(1)

        asyncio.run(impatient())
        assert torch.equal(pool.resolve(small), torch.zeros(NUMEL))
        assert torch.equal(pool.prefetch(big).wait(), torch.zeros(BIG))
        check_invariants(pool)
    assert pool.closed


@contextlib.contextmanager
def _a_paused_prefetch(
    directory: Path,
) -> Iterator[tuple[TensorResidencyPool, OffloadedTensor, Any, Any]]:
    """A pool, a big tensor and the handle of its prefetch, whose load a worker holds paused
    until ``load.go()`` (the last item)."""
    big = _tensor(directory, "big", numel=BIG)
    code = OffloadedTensor._reload_unmanaged.__code__
    with paused_in_new_threads(code) as load, TensorResidencyPool() as pool:
        load.armed.set()
        handle = pool.prefetch(big)
        assert load.paused.wait(30)
        yield pool, big, handle, load


def test_a_load_awaited_from_a_loop_closed_before_it_ended_serves_its_other_waiters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop gave up awaiting a prefetch, another was closed while awaiting it, the load
    paused all along: settling the load later has nowhere to send the value for them, and
    goes on to its other waiters."""
    with _a_paused_prefetch(tmp_path) as (pool, big, handle, load):

        async def gives_up() -> None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(handle, 0.01)  # cancels what it awaited

        async def awaits() -> torch.Tensor:
            return await handle

        loop = asyncio.new_event_loop()
        loop.run_until_complete(gives_up())
        task = loop.create_task(awaits())
        loop.run_until_complete(asyncio.sleep(0.01))
        assert not task.done()
        loop.close()  # with the task still awaiting the load
        load.go()
        assert torch.equal(handle.wait(), torch.zeros(BIG))
        assert torch.equal(pool.resolve(big), torch.zeros(BIG))
        check_invariants(pool)
    assert "failed" not in caplog.text


def test_awaits_of_a_handle_that_time_out_leave_nothing_behind_on_it(tmp_path: Path) -> None:
    """A loop polls a prefetch handle with short timeouts while its load is paused: each
    given-up await takes back what it hung on the load's completion, so polling for as long
    as a load lasts does not grow the memory it holds."""
    with _a_paused_prefetch(tmp_path) as (pool, _big, handle, load):

        async def polls() -> int:
            for _ in range(300):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(handle, 0.0001)
            await asyncio.sleep(0)  # the cancelled awaits' callbacks run
            return len(handle._future._callbacks or ())

        assert asyncio.run(polls()) == 0
        load.go()
        assert torch.equal(handle.wait(), torch.zeros(BIG))
        check_invariants(pool)


# ---------------------------------------------------------------------------------------------
# 9. Blocking calls from another thread while `async with pool` exits
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_calls_from_a_thread_during_the_async_exit_end(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    outcomes: list[str] = []
    async with TensorResidencyPool() as pool:
        await pool.aresolve(t)

        def hammer() -> None:
            for _ in range(100_000):
                try:
                    pool.flush()
                    pool.evict(t)
                except T2NErrorMisuse as error:
                    outcomes.append(str(error))
                    return

        thread = threading.Thread(target=hammer)
        thread.start()
        await asyncio.sleep(0.01)
    await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive(), "a call from another thread never ended"
    assert outcomes, "the pool closed and no call said so"
    assert "closed" in outcomes[0] or "not running" in outcomes[0]


# ---------------------------------------------------------------------------------------------
# 12. Ctrl-C during a blocking acquire
# ---------------------------------------------------------------------------------------------
def _checkpoint() -> None:
    """Run some bytecode: a pending (simulated) interrupt is raised here at the latest."""
    sum(range(10))


def _checkpoint_quietly() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        _checkpoint()


# An interrupt may also land in the weak reference callback that unmaps a mapped value as it
# dies, where Python reports it as unraisable and drops it (see storage's ``Mappings``): not
# what this test checks, and not a failure of it.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*Mappings._gone:pytest.PytestUnraisableExceptionWarning"
)
def test_an_interrupt_during_a_blocking_acquire_leaks_no_lease(tmp_path: Path) -> None:
    # Earlier tests' garbage goes first: its finalizers, run amid the rounds by a collection,
    # would lose an interrupt landing in them and report it as unraisable (a failure).
    gc.collect()
    ts = [_tensor(tmp_path, f"t{i}", numel=1 << 16) for i in range(8)]
    with TensorResidencyPool(max_cached_bytes=0) as pool:
        interrupted = 0
        for round_index in range(60):
            timer = CtrlCTimer(0.0001 * (round_index % 10))
            try:  # an interrupt may land anywhere in the round, even once the acquires ended
                try:
                    timer.arm()
                    for t in ts:
                        with pool.acquire(t):
                            pass
                finally:
                    timer.stop()
                time.sleep(0.002)
                _checkpoint()
            except KeyboardInterrupt:
                interrupted += 1
                _checkpoint_quietly()
        assert interrupted > 0, "no interrupt landed: the test proves nothing"
        check_invariants(pool)
        assert "leased: 0," in repr(pool)
    assert pool.closed


def _wait_for_a_miss(pool: TensorResidencyPool, t: OffloadedTensor, how: str) -> None:
    if how == "prefetch-wait":
        pool.prefetch(t).wait()
    elif how == "resolve":
        pool.resolve(t)
    elif how == "acquire":
        with pool.acquire(t):
            pass
    else:  # a lease begun ahead, as stream_modules begins them, entered while it loads
        lease = pool.acquire(t)
        assert lease._begin()
        with lease:
            pass


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["prefetch-wait", "resolve", "acquire", "begun-lease"])
def test_a_real_sigint_during_a_wait_for_a_load_interrupts_it_and_leaks_nothing(
    tmp_path: Path, how: str
) -> None:
    """Ctrl-C (a real SIGINT, which interrupts the wait in C) while the main thread waits
    for a load that a worker holds paused: the wait raises KeyboardInterrupt at once, no
    lease is left, and the pool serves the value and closes once the load goes on. (A
    payload over 1 MiB: the main thread would read a smaller one itself.)"""
    t = _tensor(tmp_path, numel=1 << 19)
    code = OffloadedTensor._reload_unmanaged.__code__
    with paused_in_new_threads(code, on="call") as load, TensorResidencyPool() as pool:
        load.armed.set()
        ctrl_c = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                _wait_for_a_miss(pool, t, how)
        finally:
            ctrl_c.join()
        assert load.paused.is_set()
        load.go()
        assert torch.equal(pool.resolve(t), torch.zeros(1 << 19))
        check_invariants(pool)
        assert "leased: 0," in repr(pool)
    assert pool.closed


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.timeout(60)
def test_a_real_sigint_while_a_pool_starts_its_loop_thread_leaves_that_one_thread(
    tmp_path: Path,
) -> None:
    """Ctrl-C (a real SIGINT) while a pool's first call waits for its new loop thread to
    serve it: the interrupt is raised once that thread serves, so that the next call finds
    the loop (it started a second thread, the first left running, before), and close stops
    that thread."""
    from torch_to_nnef.tensor.residency._runtime import Runtime

    t = _tensor(tmp_path)
    pool = TensorResidencyPool()
    with paused_in_new_threads(Runtime._attach.__code__, on="call") as attach:
        attach.armed.set()

        def ctrl_c() -> None:
            if attach.paused.wait(30):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)  # delivered while the main thread waits for the loop thread
            attach.go()

        interrupter = threading.Thread(target=ctrl_c)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.resolve(t)
        finally:
            interrupter.join(30)
    runtime = pool._runtime
    loop_thread = runtime._thread
    assert loop_thread is not None and runtime.loop is not None
    assert torch.equal(pool.resolve(t), torch.zeros(NUMEL))
    assert runtime._thread is loop_thread  # no second loop thread
    pool.close()
    loop_thread.join(10)
    assert not loop_thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_loop_thread_that_cannot_start_its_loop_fails_the_call_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """Out of file descriptors, a pool's new loop thread cannot create its event loop: the
    call that started it raises that error (it waited forever before), and the pool starts
    once descriptors are free again. In a forked child, whose limits are its own."""
    import resource

    t = _tensor(tmp_path)

    def child() -> str:
        warm = TensorResidencyPool()  # what a pool imports, imported with descriptors free
        warm.resolve(t)
        warm.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        pool = TensorResidencyPool()
        try:
            pool.resolve(t)
            outcome = "returned"
        except OSError as error:
            outcome = f"errno {error.errno}"
        for fd in held:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the loop half made
            served = float(pool.resolve(t)[0])
        pool.close()
        return f"{outcome}, then {served}"

    assert in_forked_child(child, seconds=20) == f"errno {errno.EMFILE}, then 0.0"


# ---------------------------------------------------------------------------------------------
# 13. stream_modules with forwards that stop early, from worker threads
# ---------------------------------------------------------------------------------------------
def _offloaded_layers(directory: Path, count: int) -> nn.ModuleList:
    layers = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(count))
    for index, layer in enumerate(layers):
        layer.weight = nn.Parameter(
            OffloadedTensor.from_original_tensor(
                layer.weight.detach(), f"l{index}", offload_dir=directory
            ),
            requires_grad=False,
        )
    return layers


def _forward_until(layers: nn.ModuleList, stop_at: int) -> None:
    x = torch.randn(2, 16)
    for index, layer in enumerate(layers):
        if index == stop_at:
            return  # a forward that ends early (an early exit, a shorter input)
        x = layer(x)


def test_forwards_that_stop_early_in_ended_threads_leave_no_lease(tmp_path: Path) -> None:
    layers = _offloaded_layers(tmp_path, 12)
    pool = TensorResidencyPool(max_cached_bytes=2 * 16 * 16 * 4)
    with pool, stream_modules(pool, list(layers), depth=2):
        threads = [
            threading.Thread(target=_forward_until, args=(layers, stop)) for stop in (3, 5, 7, 9)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        gc.collect()
        assert "leased: 0," in repr(pool)
    assert pool.closed


def test_forwards_that_stop_early_in_live_threads_let_the_pool_close(tmp_path: Path) -> None:
    layers = _offloaded_layers(tmp_path, 12)
    pool = TensorResidencyPool(max_cached_bytes=2 * 16 * 16 * 4)
    with pool, concurrent.futures.ThreadPoolExecutor(2) as workers:
        stream = stream_modules(pool, list(layers), depth=2)
        for stop in (3, 5, 7, 9, 4, 6):
            workers.submit(_forward_until, layers, stop).result(timeout=30)
        # The threads live on; their last forwards began leases for modules never run.
        pool.close()  # nothing the user holds: the pool closes
        stream.close()
    assert pool.closed


# ---------------------------------------------------------------------------------------------
# 7. An in-place op in a coroutine while that tensor's write-back runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_in_place_op_on_the_loop_waits_for_the_write_back(tmp_path: Path) -> None:
    t = _tensor(tmp_path, "t", numel=BIG)
    other = _tensor(tmp_path, "other", numel=BIG)
    async with TensorResidencyPool(max_cached_bytes=BIG * 4) as pool:
        async with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        await pool.aresolve(other)  # pushes t out: its write-back runs
        with pool.scope():
            t.add_(1.0)  # on the pool's loop thread: waits for the write-back, then leases
        await pool.aflush()
    assert torch.equal(on_disk(t), torch.full((BIG,), 2.0))


# ---------------------------------------------------------------------------------------------
# 11. aflush on a pool that no loop serves any more
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_aflush_writes_when_no_loop_serves_the_pool(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    pool = TensorResidencyPool()
    kept = pool.acquire(t)
    with pytest.raises(T2NErrorMisuse, match="leased"):
        async with pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(6.0)
            await kept.__aenter__()  # a lease held past the block: its exit cannot close
    await kept.__aexit__(None, None, None)
    assert not pool.closed  # open, with a dirty value, and no loop serves it
    await pool.aflush()  # served again, from a private loop thread
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))
    pool.close()
    assert pool.closed


# ---------------------------------------------------------------------------------------------
# 14. Pools dropped without close()
# ---------------------------------------------------------------------------------------------
def _loop_threads() -> set[threading.Thread]:
    """The pools' threads alive now. A test looks for those it started that are left: others
    may end meanwhile (those of a pool an earlier test dropped, closed by the reaper)."""
    return {t for t in threading.enumerate() if t.name.startswith("t2n-residency")}


def test_pools_dropped_without_close_stop_their_threads(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    before = _loop_threads()
    for _ in range(10):
        pool = TensorResidencyPool(max_workers=2)
        pool.resolve(t)
        del pool
    gc.collect()
    _wait_for_loop_threads(before)
    assert not _loop_threads() - before


def _wait_for_loop_threads(before: set[threading.Thread]) -> None:
    deadline = time.monotonic() + 30
    while _loop_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)


def _pool_with_a_change(t: OffloadedTensor, value: float) -> TensorResidencyPool:
    """A pool holding an unsaved change of ``t`` (filled with ``value``), no lease left."""
    pool = TensorResidencyPool()
    with pool.acquire(t, mode="read_write") as changed:
        changed.fill_(value)
    return pool


def test_a_dropped_pool_writes_its_unsaved_changes_back_and_warns(tmp_path: Path) -> None:
    ts = [_tensor(tmp_path, f"t{i}") for i in range(3)]
    before = _loop_threads()
    pool = TensorResidencyPool(max_workers=2)
    for i, t in enumerate(ts):
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(float(i + 1))
    del value
    with pytest.warns(ResourceWarning, match="written back in the background"):
        del pool
        gc.collect()
    _wait_for_loop_threads(before)  # the loop thread stops once the changes are written
    assert not _loop_threads() - before
    for i, t in enumerate(ts):
        assert torch.equal(on_disk(t), torch.full((NUMEL,), float(i + 1)))
        assert torch.equal(t.reload(), torch.full((NUMEL,), float(i + 1)))


def test_a_dropped_pool_writes_back_when_its_warning_is_an_error(tmp_path: Path) -> None:
    """Test suites often turn warnings into errors: the finalizer's warning then raises
    inside it (printed, ignored), after the close is on its way."""
    t = _tensor(tmp_path)
    before = _loop_threads()
    pool = _pool_with_a_change(t, 5.0)
    unraised: list[type[BaseException] | None] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: unraised.append(u.exc_type)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            del pool
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraised == [ResourceWarning]
    _wait_for_loop_threads(before)
    assert not _loop_threads() - before
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0))


def test_a_pool_dropped_by_a_collection_on_its_own_loop_thread_writes_back(
    tmp_path: Path,
) -> None:
    """The collection that finds the pool may run on the pool's loop thread, amid the
    actor's work: the close runs after it, on that thread, never inside it."""
    t = _tensor(tmp_path)
    before = _loop_threads()
    pool = _pool_with_a_change(t, 3.0)
    runtime = pool._runtime
    collected = concurrent.futures.Future[None]()

    def drop_on_loop_thread() -> None:
        nonlocal pool
        with pytest.warns(ResourceWarning):
            del pool
            gc.collect()
        collected.set_result(None)

    runtime.post(drop_on_loop_thread)
    collected.result(timeout=30)
    _wait_for_loop_threads(before)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 3.0))


def test_a_dropped_pool_whose_write_back_fails_says_so_and_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory, moved = tmp_path / "d", tmp_path / "moved"
    directory.mkdir()
    t = _tensor(directory)
    before = _loop_threads()
    pool = _pool_with_a_change(t, 4.0)
    os.rename(directory, moved)  # the directory is gone: the write-back fails with ENOENT
    try:
        with pytest.warns(ResourceWarning):
            del pool
            gc.collect()
        _wait_for_loop_threads(before)
    finally:
        os.rename(moved, directory)
    assert not _loop_threads() - before
    assert "could not write its changes back" in caplog.text
    assert torch.equal(on_disk(t), torch.zeros(NUMEL))  # nothing torn: the old values
    assert torch.equal(t.reload(), torch.full((NUMEL,), 4.0))  # the process still reads them


# ---------------------------------------------------------------------------------------------
# 10. A fork after the pool started
# ---------------------------------------------------------------------------------------------
def _first_step(request: Coroutine[Any, Any, object]) -> None:
    """Run ``request`` to its first suspension, then close it: a forked child runs on inside
    its parent's loop callback, where a request's first step raises, or suspends the task
    (for a load nobody will run)."""
    try:
        request.send(None)
    finally:
        request.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_told_to_create_its_own_pool(tmp_path: Path) -> None:
    ts = [_tensor(tmp_path, f"t{i}") for i in range(2)]
    with TensorResidencyPool() as pool:
        pool.resolve(ts[0])

        def child() -> str:
            return _outcomes(
                lambda: pool.resolve(ts[0]),  # resident in the parent
                lambda: pool.resolve(ts[1]),
                lambda: pool.acquire(ts[0]).__enter__(),
                lambda: pool.prefetch(ts[0]),
                pool.close,
            )

        with pool._actor.lock:  # as a thread of the pool may hold it at the fork
            outcomes = in_forked_child(child)
        assert outcomes == ",".join(["forked"] * 5)
        assert torch.equal(pool.resolve(ts[1]), torch.zeros(NUMEL))  # the parent serves on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.asyncio
async def test_a_child_forked_from_the_loop_serving_the_pool_is_told_to_create_its_own(
    tmp_path: Path,
) -> None:
    """Forked inside `async with pool`, on the loop's own thread (a process started from an
    async handler): the child's thread bears the parent's loop thread's id, but it is no
    thread of the pool's; its requests, sync or async, hit or miss, say it was forked."""
    ts = [_tensor(tmp_path, f"t{i}") for i in range(2)]
    async with TensorResidencyPool() as pool:
        await pool.aresolve(ts[0])

        def child() -> str:
            return _outcomes(
                lambda: pool.resolve(ts[0]),  # resident in the parent
                lambda: pool.resolve(ts[1]),
                lambda: _first_step(pool.aresolve(ts[1])),
                lambda: pool.acquire(ts[0]).__enter__(),
            )

        assert in_forked_child(child, seconds=20) == ",".join(["forked"] * 4)
        assert torch.equal(await pool.aresolve(ts[1]), torch.zeros(NUMEL))  # the parent serves on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_a_child_forked_inside_async_with_pool_is_told_so_as_it_leaves_the_block(
    tmp_path: Path,
) -> None:
    """Forked inside `async with pool`, on the loop serving it: in the child, leaving the
    block says the pool is the parent's, as every request of it there does (anyio's
    NoEventLoopError came out instead: asyncio runs no loop in a forked child). The pool is
    left as the fork left it, so that a request after it says so too, rather than start a
    loop of the child's for the parent's pool; the parent leaves the block as usual, its
    change written back."""
    t = _tensor(tmp_path)
    async with TensorResidencyPool() as pool:
        async with pool.acquire(t, mode="read_write") as value:
            value.fill_(2.0)

        def child() -> str:
            return _outcomes(
                lambda: _first_step(pool.__aexit__(None, None, None)),  # the block's exit
                lambda: pool.resolve(t),
            )

        assert in_forked_child(child, seconds=20) == "forked,forked"
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_waiting_for_a_load_its_parent_started_is_told_so(
    tmp_path: Path,
) -> None:
    """A prefetch and a lease begun ahead in the parent, their load paused at the fork: in
    the child, no thread would ever settle them, and waits for them say so at once."""
    ts = [_tensor(tmp_path, f"t{i}") for i in range(2)]
    code = OffloadedTensor._reload_unmanaged.__code__
    with paused_in_new_threads(code) as load, TensorResidencyPool() as pool:
        load.armed.set()
        handle = pool.prefetch(ts[0])
        assert load.paused.wait(30)
        lease = pool.acquire(ts[1])
        assert lease._begin()

        def child() -> str:
            async def awaited() -> None:
                await handle

            return _outcomes(handle.wait, lambda: asyncio.run(awaited()), lease.__enter__)

        outcomes = in_forked_child(child)
        load.go()
        assert outcomes == ",".join(["forked"] * 3)
        assert torch.equal(handle.wait(), torch.zeros(NUMEL))  # the parent serves on
        with lease as value:
            assert torch.equal(value, torch.zeros(NUMEL))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["stream", "read-ahead"])
def test_a_forward_forked_while_a_thread_held_the_readers_lock_says_it_was_forked(
    tmp_path: Path, reader: str
) -> None:
    """The fork comes while a thread of the parent holds the lock of a module stream, or of
    the pool's read-ahead: in the child, a forward through them says the pool was started in
    the parent (it hung on that lock before)."""
    layers = _offloaded_layers(tmp_path, 3)
    read_ahead = "auto" if reader == "read-ahead" else None
    with TensorResidencyPool(read_ahead=read_ahead) as pool, contextlib.ExitStack() as stack:
        if reader == "stream":
            lock = stack.enter_context(stream_modules(pool, list(layers), depth=1))._lock
        else:
            assert pool.read_ahead is not None
            lock = pool.read_ahead._lock
        with pool.scope():
            _forward_until(layers, len(layers))

        def child() -> str:
            def forward() -> None:
                with pool.scope():
                    _forward_until(layers, len(layers))

            return _outcomes(forward)

        assert in_forked_child_while_held([lock], child, seconds=15) == "forked"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_child_forked_while_a_thread_settles_a_reply_serves_from_a_new_pool(
    tmp_path: Path,
) -> None:
    """The fork comes while a thread of the parent holds the lock that settling a reply
    takes: in the child, that lock is free, and a new pool's requests are answered."""
    from torch_to_nnef.tensor.residency import _runtime

    t = _tensor(tmp_path)

    def child() -> str:
        with TensorResidencyPool() as pool:
            return repr(bool(torch.equal(pool.prefetch(t).wait(), torch.zeros(NUMEL))))

    lock = _runtime._REPLY_CALLBACKS
    assert in_forked_child_while_held([lock], child, seconds=15) == "True"
    assert not lock.locked()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_write_back_reads_the_latest_value(tmp_path: Path) -> None:
    """The fork comes while a worker of the parent's pool writes a changed value back (it
    holds the tensor's write lock, and reads wait for its end): in the child, which has no
    such worker, reads and a new pool serve the change at once, and writes do not hang."""
    t = _tensor(tmp_path)
    code = OffloadedTensor._write_encoded.__code__
    with paused_in_new_threads(code, on="call") as point, TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # dirty
        point.armed.set()
        flusher = threading.Thread(target=pool.flush)
        flusher.start()
        assert point.paused.wait(30)  # the write-back is under way

        def child() -> str:
            seen = [float(t.reload()[0]), float((t + 0)[0])]
            with TensorResidencyPool() as own:
                seen.append(float(own.resolve(t)[0]))
            t.update_values(torch.full((NUMEL,), 3.0))  # a later write, in the child
            seen.append(float(t.reload()[0]))
            return repr(seen)

        try:
            assert in_forked_child(child, seconds=20) == repr([1.0, 1.0, 1.0, 3.0])
        finally:
            point.go()
            flusher.join(30)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))  # the parent's, renamed last


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_kind", ["flush", "evict"])
@pytest.mark.parametrize("moment", ["failing", "recovering", "aborting"])
def test_a_child_forked_while_a_write_back_fails_reads_the_change_the_parent_writes_later(
    tmp_path: Path, moment: str, request_kind: str
) -> None:
    """The fork comes while the parent's pool writes a changed value back into a directory
    that is gone: as the write fails on the worker (``failing``: it holds the tensor's write
    lock), or as the loop thread recovers from the failure (``recovering``: the value kept
    dirty; ``aborting``: the transition reporting it raised, in a logging filter, and the
    job's recovery ends it), another thread holding the pool's lock. In the child, reads and
    a new pool serve the parent's unsaved change; the child's own change and direct write
    go to a file of its own. In the parent, the request fails, the change stays resident and
    dirty, and once the directory is back a flush writes it."""
    directory, moved = tmp_path / "d", tmp_path / "moved"
    t = _tensor(directory)
    code = {
        "failing": storage_io.write_error,
        "recovering": Actor._write_failed,
        "aborting": Actor._write_aborted,
    }[moment].__code__
    point = Breakpoint(code, "call")
    errors: list[BaseException] = []
    try:
        with (
            reports_that_raise(on=moment == "aborting"),
            breakpoints_in_new_threads(point),
            TensorResidencyPool() as pool,
        ):
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(1.0)
            os.rename(directory, moved)  # the write-back fails with ENOENT
            point.armed.set()

            def write_back() -> None:
                try:
                    pool.flush() if request_kind == "flush" else pool.evict(t)
                except BaseException as error:
                    errors.append(error)

            writer = threading.Thread(target=write_back)
            writer.start()
            assert point.paused.wait(30)

            def child() -> str:
                seen = _read_then_changed_by_a_new_pool(t)
                t.update_values(torch.full((NUMEL,), 4.0))
                with TensorResidencyPool() as own:
                    seen.append(float(own.resolve(t)[0]))
                return repr(seen) + "," + repr(t.offload_path.parent == directory)

            try:
                outcome = in_forked_child_while_held([pool._actor.lock], child, seconds=20)
            finally:
                point.go()
                writer.join(30)
            assert outcome == repr([1.0, 1.0, 1.0, 9.0, 4.0]) + ",True"
            assert len(errors) == 1 and isinstance(errors[0], T2NErrorStorage), errors
            assert pool.is_resident(t) and pool._actor.leased_count() == 0
            check_invariants(pool)
            assert torch.equal(t.reload(), torch.full((NUMEL,), 1.0))  # the parent's change
            # The child's files (the directory its writes made anew) are its own.
            assert t.offload_path.name not in os.listdir(directory)
            shutil.rmtree(directory)
            os.rename(moved, directory)
            pool.flush()
            assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))
            check_invariants(pool)
    finally:
        if moved.exists():
            shutil.rmtree(directory, ignore_errors=True)
            os.rename(moved, directory)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))
    assert sorted(os.listdir(directory)) == [t.offload_path.name]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_child_forked_inside_a_lease_granted_on_a_miss_ends_it_and_reads_its_change(
    tmp_path: Path,
) -> None:
    """Forked inside ``with pool.acquire(t, mode="read_write")`` on a miss (a lease the
    actor has not looked at yet), the pool full: in the child, the lease ends without
    waiting for the parent's loop, every read sees the change, and a new pool serves it; in
    the parent, the lease ends as usual and the change is written back."""
    ts = [_tensor(tmp_path, f"t{i}") for i in range(2)]
    with TensorResidencyPool(max_cached_bytes=NUMEL * 4) as pool:
        pool.resolve(ts[1])
        lease = pool.acquire(ts[0], mode="read_write")
        lease.__enter__().fill_(7.0)

        def child() -> str:
            lease.__exit__(None, None, None)
            with TensorResidencyPool() as own:
                seen = [
                    float(ts[0].reload()[0]),
                    float((ts[0] + 0)[0]),
                    float(own.resolve(ts[0])[0]),
                ]
            return repr(seen) + "," + _outcomes(lambda: pool.resolve(ts[0]), pool.close)

        assert in_forked_child(child, seconds=20) == repr([7.0] * 3) + ",forked,forked"
        lease.__exit__(None, None, None)
    assert torch.equal(on_disk(ts[0]), torch.full((NUMEL,), 7.0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_child_forked_while_another_thread_holds_a_read_write_lease_reads_the_value_before(
    tmp_path: Path,
) -> None:
    """Forked while another thread holds a ``read_write`` lease with a change under way: that
    lease never ends in the child, so the child reads, and a new pool serves, the value from
    before it; in the parent, the change is written back once the lease ends."""
    ts = [_tensor(tmp_path, f"t{i}") for i in range(2)]
    with TensorResidencyPool(max_cached_bytes=NUMEL * 4) as pool:
        pool.resolve(ts[1])

        @contextlib.contextmanager
        def changing() -> Iterator[None]:
            with pool.acquire(ts[0], mode="read_write") as value:
                value.fill_(5.0)
                yield

        def child() -> str:
            with TensorResidencyPool() as own:
                served = float(own.resolve(ts[0])[0])
            return repr([float(ts[0].reload()[0]), float((ts[0] + 0)[0]), served])

        assert in_forked_child_while_held([changing()], child, seconds=20) == repr([0.0] * 3)
        assert torch.equal(ts[0].reload(), torch.full((NUMEL,), 5.0))
    assert torch.equal(on_disk(ts[0]), torch.full((NUMEL,), 5.0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fork", sorted(FORKS))
@pytest.mark.parametrize("moment", ["before its note", "after its note"])
def test_a_child_forked_while_the_actor_applies_a_lease_end_left_to_it_serves_and_writes(
    tmp_path: Path, fork: str, moment: str
) -> None:
    """A Ctrl-C cuts a ``read_write`` lease's exit: its end, the change kept, is left to the
    actor's next step, which the loop thread runs at once. The fork comes while that step
    applies it (a deferred call under way), before or after it made the change the tensor's
    latest write. In the child, the parent's pool answers its reads and says it was forked,
    the tensor reads the value as the step left it at the fork, and a new pool serves it and
    writes the child's change, which the child reads from then on: nothing waits for the
    step, which never ends there. In the parent, the lease ends, and a flush writes its
    change."""
    t = _tensor(tmp_path)
    if moment == "before its note":
        point = Breakpoint(Actor.release.__code__, on="call")
    else:
        point = Breakpoint(
            OffloadedTensor._note_unsaved.__code__, on="return", caller=Actor.release.__code__
        )
    with breakpoints_in_new_threads(point), TensorResidencyPool() as pool:
        try:
            pool.resolve(t)  # a hit from now on
            lease = pool.acquire(t, mode="read_write")
            lease.__enter__().fill_(1.0)
            point.armed.set()
            # The second call counted in the lease's module: end_lease, from __exit__.
            cut = InterruptAt(2, within=_handles.__file__)
            assert interrupted(cut, lambda: lease.__exit__(None, None, None))
            assert cut.where == "end_lease"
            assert point.paused.wait(10)  # the loop thread is applying the lease's end
            assert pool._actor._later_running == 1

            def child() -> str:
                seen = [*_read_then_changed_by_a_new_pool(t), float(t.reload()[0])]
                parents = _outcomes(lambda: repr(pool), lambda: pool.is_resident(t))
                return f"{seen},{parents},{_outcomes(lambda: pool.resolve(t))}"

            report = FORKS[fork](child)
        finally:
            point.go()
        before = 1.0 if moment == "after its note" else 0.0
        changed = before + 8.0
        assert report == f"{[before] * 3 + [changed] * 2},returned,returned,forked"
        assert "leased: 0," in repr(pool)
        assert pool._actor._later_running == 0
        check_invariants(pool)
        assert torch.equal(t.reload(), torch.full((NUMEL,), 1.0))
        pool.flush()
        assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))


# ---------------------------------------------------------------------------------------------
# 6. copy.deepcopy inside a scope
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", ["owned", "checkpoint"])
def test_deepcopy_in_a_scope_copies_the_latest_value(tmp_path: Path, bound: str) -> None:
    """A copy (deep or shallow) takes the change a pool holds, for a tensor owning its
    payload as for one reading a checkpoint in place (copied as a pointer otherwise)."""
    if bound == "owned":
        weight = OffloadedTensor.from_original_tensor(torch.zeros(4, 4), "w", tmp_path)
    else:
        safetensors.torch.save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "m.safetensors"))
        weight = OffloadedTensor.from_safetensors(tmp_path / "m.safetensors", "w")
        assert not copy.copy(weight).owns_payload  # no change yet: another pointer
    model = nn.Linear(4, 4, bias=False)
    model.weight = nn.Parameter(weight, requires_grad=False)
    with TensorResidencyPool() as pool, pool.scope():
        model.weight.add_(1.0)  # a change the pool holds
        duplicate = copy.deepcopy(model)
        shallow = copy.copy(model.weight)
        assert torch.equal(duplicate.weight.reload(), torch.ones(4, 4))
        assert torch.equal(shallow.reload(), torch.ones(4, 4))
        assert torch.equal(model.weight.clone(), torch.ones(4, 4))


COPIES: dict[str, Callable[[OffloadedTensor], OffloadedTensor]] = {
    "deepcopy": copy.deepcopy,
    "to_copy": lambda t: t.to("cpu", copy=True),
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("then", ["close", "flush", "evict"])
def test_a_copy_during_a_write_back_of_a_checkpoint_tensor_has_the_change(
    tmp_path: Path, how: str, then: str
) -> None:
    """A copy started while a pool writes back its change of a tensor reading a checkpoint
    in place: the write-back moves the tensor to a file of its own and drops the unsaved
    value at once, and the copy takes that file's value, never the checkpoint's."""
    safetensors.torch.save_file({"w": torch.zeros(NUMEL)}, str(tmp_path / "m.safetensors"))
    t = OffloadedTensor.from_safetensors(tmp_path / "m.safetensors", "w", offload_dir=tmp_path)
    code = OffloadedTensor._write_encoded.__code__
    copies: list[OffloadedTensor] = []
    with paused_in_new_threads(code, on="call") as point:
        pool = TensorResidencyPool()
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(7.0)  # the latest write, not written back yet
        point.armed.set()
        writer = threading.Thread(target=getattr(pool, then), args=(t,) if then == "evict" else ())
        writer.start()
        try:
            assert point.paused.wait(30)  # the write-back is under way
            copier = threading.Thread(target=lambda: copies.append(COPIES[how](t)))
            copier.start()
            time.sleep(0.2)  # the copy waits for the write-back's end
        finally:
            point.go()
            writer.join(30)
        copier.join(30)
        pool.close()
    assert t.owns_payload  # the write-back moved it to its own file
    assert torch.equal(copies[0].reload(), torch.full((NUMEL,), 7.0)), "the copy is stale"


# ---------------------------------------------------------------------------------------------
# 5. A direct write reaches new requests while an older value is pinned or leased
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("holder", ["pin", "lease"])
def test_new_requests_see_a_direct_write_while_the_old_value_is_held(
    tmp_path: Path, holder: str
) -> None:
    t = _tensor(tmp_path)
    new = torch.full((NUMEL,), 5.0)
    with TensorResidencyPool() as pool:
        held = threading.Event()
        release = threading.Event()
        seen: list[torch.Tensor] = []

        def hold_a_lease() -> None:
            with pool.acquire(t) as value:
                held.set()
                assert release.wait(30)
                seen.append(value.clone())

        holder_thread = threading.Thread(target=hold_a_lease)
        if holder == "pin":
            old = pool.pin(t).wait()
        else:
            holder_thread.start()
            assert held.wait(30)
        t.update_values(new)
        assert torch.equal(pool.resolve(t), new), "a new request got the older held value"
        with pool.acquire(t) as value:
            assert torch.equal(value, new)
        check_invariants(pool)
        if holder == "pin":
            assert pool.is_pinned(t), "the pin is on the tensor: it stays"
            assert torch.equal(old, torch.zeros(NUMEL)), "the holder's value changed under it"
            pool.unpin(t)
        else:
            with pytest.raises(T2NErrorMisuse, match="leased"):
                pool.close()  # the old value's lease still counts
            release.set()
            holder_thread.join(30)
            assert torch.equal(seen[0], torch.zeros(NUMEL)), "the holder's value changed"
        assert torch.equal(pool.resolve(t), new)
        check_invariants(pool)
    assert torch.equal(on_disk(t), new)


# ---------------------------------------------------------------------------------------------
# 15. A prefetch handle waited after a later write
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("write", sorted(DIRECT_WRITES))
@pytest.mark.parametrize("resident", [False, True], ids=["loaded", "resident"])
def test_a_prefetch_handle_waited_after_a_direct_write_returns_the_write(
    tmp_path: Path, write: str, resident: bool
) -> None:
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        if resident:
            pool.resolve(t)
        handle = pool.prefetch(t)
        assert torch.equal(handle.wait(), torch.zeros(NUMEL))
        DIRECT_WRITES[write](t)
        assert torch.equal(handle.wait(), torch.full((NUMEL,), 5.0))
        check_invariants(pool)


def test_a_prefetch_handle_awaited_after_another_pools_change_returns_it(tmp_path: Path) -> None:
    t = _tensor(tmp_path)

    async def main() -> None:
        async with TensorResidencyPool() as pool, TensorResidencyPool() as other:
            handle = pool.prefetch(t)
            assert torch.equal(await handle, torch.zeros(NUMEL))
            async with other.acquire(t, mode="read_write") as value:
                value.fill_(6.0)
            assert torch.equal(await handle, torch.full((NUMEL,), 6.0))
            assert torch.equal(handle.wait(), torch.full((NUMEL,), 6.0))

    asyncio.run(main())
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))


@pytest.mark.parametrize("resident", [True, False], ids=["a hit", "a miss"])
def test_a_prefetch_cut_by_another_pools_change_returns_that_change_when_waited(
    tmp_path: Path, resident: bool
) -> None:
    """Another pool's change lands while the prefetch is being made: between the pick of the
    resident value and the handle's making (a hit), or once the load it asked for ended and
    before the handle's making (a miss). A wait begun once that change ended returns it. (The
    handle took the change for one made before it, and served the value it had for good.)"""
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool, TensorResidencyPool() as other:
        if resident:
            pool.resolve(t)
            point = paused_in_new_threads(
                Actor.touch.__code__, "call", caller=TensorResidencyPool.prefetch.__code__
            )
        else:
            point = paused_in_new_threads(Runtime.start.__code__, "return")
        handles: list[Any] = []
        with point as picked:
            picked.armed.set()
            prefetching = threading.Thread(target=lambda: handles.append(pool.prefetch(t)))
            prefetching.start()
            assert picked.paused.wait(30), "the prefetch never picked its value"
            deadline = time.monotonic() + 10
            while not pool.is_resident(t) and time.monotonic() < deadline:
                time.sleep(0.001)  # (a miss: its load ends first)
            with other.acquire(t, mode="read_write") as value:
                value.fill_(6.0)
            picked.go()
            prefetching.join(30)
        assert torch.equal(handles[0].wait(), torch.full((NUMEL,), 6.0))
        check_invariants(pool)


def test_a_prefetch_handle_waited_after_its_pool_changed_a_value_read_again_returns_it(
    tmp_path: Path,
) -> None:
    """The prefetched value was evicted, and the pool's change was made on the value it read
    again: waiting returns that change, the latest write, not the value prefetched."""
    t = _tensor(tmp_path)
    with TensorResidencyPool(0) as pool:
        handle = pool.prefetch(t)
        deadline = time.monotonic() + 10
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        pool.evict(t)
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
        assert torch.equal(handle.wait(), torch.ones(NUMEL))
        check_invariants(pool)
    assert torch.equal(on_disk(t), torch.ones(NUMEL))


def test_a_prefetch_handle_keeps_its_own_pools_change(tmp_path: Path) -> None:
    t = _tensor(tmp_path)
    with TensorResidencyPool() as pool:
        handle = pool.prefetch(t)
        handle.wait()
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(2.0)
        assert torch.equal(handle.wait(), torch.full((NUMEL,), 2.0))
        assert pool.stats().loads == 1, "the pool's own change needs no new load"


# ---------------------------------------------------------------------------------------------
# 16. An opaque value (a QTensor) changed under a read_write lease
# ---------------------------------------------------------------------------------------------
def test_reads_outside_the_pool_see_an_opaque_values_unsaved_change(tmp_path: Path) -> None:
    from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

    weight = torch.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)
    original = fp_to_tract_q4_0_with_min_max_calibration(weight)
    t = OffloadedTensor.from_original_tensor(original, "q", offload_dir=tmp_path)
    with TensorResidencyPool() as pool, TensorResidencyPool() as other:
        with pool.acquire(t, mode="read_write") as value:
            value.qscheme.scale.mul_(2.0)  # an in-place change of its state
            changed = value.decompress().clone()
        assert not torch.equal(changed, original.decompress()), "nothing changed"
        for seen in (t.reload(), other.resolve(t)):  # outside the pool, and another pool
            assert type(seen) is type(value)
            assert torch.equal(seen.decompress(), changed), "read the file's older value"
            assert seen.qscheme.scale.data_ptr() != value.qscheme.scale.data_ptr()
        seen.qscheme.scale.mul_(3.0)  # a copy: the pool's value stays as it was
        assert torch.equal(value.decompress(), changed)
    assert torch.equal(t.reload().decompress(), changed)


@pytest.mark.timeout(60)
def test_a_read_in_another_pool_as_a_change_is_noted_is_never_kept_older_than_it(
    tmp_path: Path,
) -> None:
    """A read_write lease of one pool ends: its change becomes the tensor's latest write (a
    new write token, and the unsaved value that reads outside the pool copy). Another pool
    misses the tensor at that moment, its thread reading it (the token, then the unsaved
    value, without the tensor's lock): it may read the older value, but never keeps it as
    current at the new token, which would serve it on every hit after the lease ended."""
    from torch_to_nnef.tensor.offload import _protocol, _tensor
    from torch_to_nnef.tensor.residency._requests import read_by_caller

    t = OffloadedTensor.from_original_tensor(torch.zeros(1024), "t", tmp_path)
    noted = Breakpoint(_protocol.HitState.count_write.__code__, "return")
    read = Breakpoint(read_by_caller.__code__, "return")
    copy = _tensor.OffloadedTensor._unsaved_copy
    locking = Breakpoint(copy.__code__, "line", line=line_of(copy, "with self._pending_lock"))
    got: list[float] = []
    with TensorResidencyPool() as pool, TensorResidencyPool() as other:

        def change() -> None:
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(7.0)

        with breakpoints_in_new_threads(noted, read, locking):
            noted.armed.set()
            writer = threading.Thread(target=change)
            writer.start()
            assert noted.paused.wait(30)  # the new token counted, under the tensor's lock
            read.armed.set()
            locking.armed.set()
            reader = threading.Thread(target=lambda: got.append(other.resolve(t)[0].item()))
            reader.start()
            deadline = time.monotonic() + 30
            while not (read.paused.is_set() or locking.paused.is_set()):
                assert time.monotonic() < deadline
                time.sleep(0.001)
            for point in (noted, read, locking):
                point.go()
            writer.join(30)
            reader.join(30)
        assert not writer.is_alive() and not reader.is_alive()
        assert got[0] in (0.0, 7.0)
        assert other.resolve(t)[0].item() == 7.0, "the other pool kept the older value"
        check_invariants(other)
    assert torch.equal(on_disk(t), torch.full((1024,), 7.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("written_back", [False, True])
def test_a_read_during_a_second_read_write_lease_sees_the_first_change_only(
    tmp_path: Path, written_back: bool
) -> None:
    """Program order, in one thread: a lease changed the value and ended (its change is the
    latest write, unsaved or written back), a second read_write lease is changing the same
    value. A read outside the pool sees the first change whole, never the second's half; a
    direct write then builds on the first change, stands over the second lease's change,
    and reaches the file."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(8), "t", tmp_path)
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        if written_back:
            pool.flush()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pool.acquire(t, mode="read_write") as value:
                value[:4] = 2.0  # under way
                assert torch.equal(t.reload(), torch.ones(8))
                assert torch.equal(t * 1, torch.ones(8))
                t.add_(10.0)  # a direct write, later in program order
                assert torch.equal(t.reload(), torch.full((8,), 11.0))
        assert torch.equal(pool.resolve(t), torch.full((8,), 11.0))
        check_invariants(pool)
    assert torch.equal(on_disk(t), torch.full((8,), 11.0))


@pytest.mark.timeout(60)
def test_a_read_copying_the_first_change_as_a_second_lease_enters_copies_it_whole(
    tmp_path: Path,
) -> None:
    """A read outside the pool has taken the first change (unsaved) and is about to copy it
    when another thread enters a second read_write lease on that value: the lease waits for
    the copy, so the read returns the first change, never the second's changes under way."""
    from torch_to_nnef.tensor.offload import _tensor

    t = OffloadedTensor.from_original_tensor(torch.zeros(BIG), "t", tmp_path)
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        read: list[torch.Tensor] = []
        with paused_in_new_threads(_tensor._copy_of.__code__, on="call") as copy:
            copy.armed.set()
            reader = threading.Thread(target=lambda: read.append(t.reload()))
            reader.start()
            assert copy.paused.wait(30)
            resume = threading.Timer(0.3, copy.go)
            resume.start()
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(2.0)
                reader.join(30)
                assert torch.equal(read[0], torch.ones(BIG))
            resume.join()
        assert torch.equal(t.reload(), torch.full((BIG,), 2.0))
    assert torch.equal(on_disk(t), torch.full((BIG,), 2.0))


@pytest.mark.timeout(60)
def test_another_pool_reads_the_first_change_while_a_second_lease_runs(tmp_path: Path) -> None:
    """The same through another pool, and with the second lease's change kept: the other pool
    sees the first change while the lease runs, the second change once it ended."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(8), "t", tmp_path)
    with TensorResidencyPool() as pool, TensorResidencyPool() as other:
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
            assert torch.equal(other.resolve(t), torch.ones(8))
        assert torch.equal(t.reload(), torch.full((8,), 2.0))
        other.evict(t)
        assert torch.equal(other.resolve(t), torch.full((8,), 2.0))
    assert torch.equal(on_disk(t), torch.full((8,), 2.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["unsqueeze_", "resize_", "set_", "data", "scope"])
@pytest.mark.parametrize("dirty", [False, True])
def test_a_read_write_lease_that_reshapes_the_value_in_place_is_refused(
    tmp_path: Path, how: str, dirty: bool
) -> None:
    """A lease's change keeps the tensor's shape and dtype. One that reshapes or retypes
    the value in place raises T2NErrorMisuse when it ends, and the value is back to the
    tensor's latest write (an earlier lease's unsaved change included): reads agree, the
    pool closes and writes that change."""
    t = OffloadedTensor.from_original_tensor(torch.arange(8.0), "t", tmp_path)
    latest = torch.arange(8.0) + (1.0 if dirty else 0.0)
    with TensorResidencyPool() as pool:
        if dirty:
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
        with pytest.raises(T2NErrorMisuse, match="reshaped in place under a read_write lease"):
            if how == "scope":
                with pool.scope():
                    t.unsqueeze_(0)
            else:
                with pool.acquire(t, mode="read_write") as value:
                    if how == "unsqueeze_":
                        value.unsqueeze_(0)
                    elif how == "resize_":
                        value.resize_(3)
                    elif how == "set_":
                        value.set_(torch.zeros(5))
                    else:
                        value.data = torch.zeros(8, dtype=torch.float64)
        assert torch.equal(pool.resolve(t), latest)
        assert torch.equal(t.reload(), latest)
        with pool.acquire(t, mode="read_write") as value:
            value.mul_(2.0)  # the pool goes on serving leases on the value
        check_invariants(pool)
    assert pool.closed
    assert torch.equal(on_disk(t), latest * 2.0)
    assert t.shape == (8,) and t.dtype == torch.float32


@pytest.mark.timeout(60)
@pytest.mark.parametrize("new", ["dtype", "shape"])
def test_a_direct_write_of_a_new_dtype_or_shape_under_a_read_write_lease_drops_its_change(
    tmp_path: Path, new: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A direct write giving the tensor a new dtype or shape while a read_write lease holds
    it supersedes the lease's change, as a write of the same dtype does: the lease ends
    without error, its value is left as the lease made it, and every read sees the write."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(16), "t", tmp_path)
    written = torch.full((16,), 5.0, dtype=torch.float16) if new == "dtype" else torch.ones(32)
    with TensorResidencyPool() as pool:
        with caplog.at_level(logging.WARNING), pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
            t.update_values(written, strict_shape=False, strict_dtype=False)
        assert "the lease's change is dropped, the later write stands" in caplog.text
        assert value.dtype == torch.float32 and value.shape == (16,)  # the caller's, untouched
        assert torch.equal(value, torch.ones(16))
        assert torch.equal(pool.resolve(t), written)
        assert torch.equal(t.reload(), written)
        check_invariants(pool)
    assert torch.equal(on_disk(t), written)


@pytest.mark.timeout(60)
def test_an_in_place_op_on_a_view_in_a_scope_is_no_write_and_every_read_agrees(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A view of an offloaded tensor is a view of a loaded value, in a scope as outside one:
    an in-place op on it writes the view, not the tensor. The pool does not serve the value
    so changed: it loads it again, and says why once."""
    t = OffloadedTensor.from_original_tensor(torch.arange(6.0), "t", tmp_path)
    with TensorResidencyPool() as pool:
        with pool.scope():
            view = t[3:]
            view.mul_(0)
            assert torch.equal(view, torch.zeros(3))  # the view keeps its own change
            assert torch.equal(t * 1, torch.arange(6.0))
        assert torch.equal(pool.resolve(t), torch.arange(6.0))
        with pool.scope():
            torch.split(t, 2)[1].add_(1.0)  # views in a tuple
        with pool.acquire(t) as value:
            assert torch.equal(value, torch.arange(6.0))
        assert torch.equal(t.reload(), torch.arange(6.0))
        assert pool.stats().loads == 3
        check_invariants(pool)
    assert torch.equal(on_disk(t), torch.arange(6.0))
    assert sum("changed in place outside a read_write lease" in m for m in caplog.messages) == 1


@pytest.mark.parametrize(
    "take",
    [
        lambda t: t.float(),
        lambda t: t.contiguous(),
        lambda t: t.cpu(),
        lambda t: torch.Tensor.to(t, torch.float32),
        lambda t: t.data.float(),  # (t.data is t: an in-place op on it writes t)
        lambda t: torch.flatten(input=t),  # (given by keyword)
        lambda t: t.T,  # (a property)
        lambda t: t.mT,
    ],
    ids=["float", "contiguous", "cpu", "to", "data-float", "keyword", "T", "mT"],
)
@pytest.mark.timeout(60)
def test_an_op_that_returns_the_value_itself_in_a_scope_is_no_write_either(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, take: Any
) -> None:
    """An op that returns its input itself (``t.float()`` of a float tensor), or a view of
    it through a property (``t.T``), hands out the value the pool served, not a copy: an
    in-place op on it is one on a view, no write. The pool does not serve the value so
    changed, and every read agrees."""
    value = torch.arange(6.0).reshape(2, 3)
    t = OffloadedTensor.from_original_tensor(value, "t", tmp_path)
    with TensorResidencyPool() as pool:
        with pool.scope():
            taken = take(t)
            taken.add_(10.0)
            assert torch.equal(t * 1, value)
        assert torch.equal(pool.resolve(t), value)
        assert torch.equal(t.reload(), value)
        check_invariants(pool)
    assert torch.equal(on_disk(t), value)
    assert sum("changed in place outside a read_write lease" in m for m in caplog.messages) == 1


@pytest.mark.timeout(60)
def test_an_in_place_op_on_a_view_of_a_changed_value_joins_the_unsaved_change(
    tmp_path: Path,
) -> None:
    """On a value holding the pool's unsaved change (which reads outside the pool already
    share), such a change is kept with it: every read sees it, and the write-back writes it."""
    t = OffloadedTensor.from_original_tensor(torch.arange(6.0), "t", tmp_path)
    expected = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
        with pool.scope():
            t[3:].mul_(0)
            assert torch.equal(t * 1, expected)
        assert torch.equal(t.reload(), expected)
        assert torch.equal(pool.resolve(t), expected)
        check_invariants(pool)
    assert torch.equal(on_disk(t), expected)


# ---------------------------------------------------------------------------------------------
# 17. A mapped value's remap ending while its eviction writes it back
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_remap_ending_while_the_value_is_evicted_leaves_it_unpublished(
    tmp_path: Path,
) -> None:
    """A mapped value that stays after a flush is mapped again from the file written (the
    remap job). The value changes and is chosen for eviction (its write-back runs) before
    that job ends: the remap then leaves it on its way out, never handed out again without
    the actor, and the value changed last is the one written."""
    t = _tensor(tmp_path, numel=1 << 16)  # 256 KiB: loaded as a mapping of its file
    u = _tensor(tmp_path, "u")
    remap = Breakpoint(OffloadedTensor._map_written.__code__, on="return")
    write_back = Breakpoint(OffloadedTensor._write_back.__code__, on="call")
    remapped = Breakpoint(Actor._on_remapped.__code__, on="return")
    with (
        breakpoints_in_new_threads(remap, write_back, remapped),
        TensorResidencyPool(max_cached_bytes=t.payload_nbytes, max_workers=2) as pool,
    ):
        try:
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
            remap.armed.set()
            pool.flush()  # written; the value stays, and a job maps the file written
            assert remap.paused.wait(10)  # (that mapping made, before the change below)
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
            write_back.armed.set()
            pool.resolve(u)  # over the budget: t goes, its write-back starts
            assert write_back.paused.wait(10)
            assert not pool.is_resident(t)
            remapped.armed.set()
            remap.go()
            assert remapped.paused.wait(10)
            remapped.go()
            check_invariants(pool)  # t is on its way out: not published
            assert not pool.is_resident(t)
            assert torch.equal(pool.resolve(t), torch.full((1 << 16,), 2.0))
        finally:
            for point in (remap, write_back, remapped):
                point.go()
        assert torch.equal(pool.resolve(t), torch.full((1 << 16,), 2.0))
        check_invariants(pool)
    assert torch.equal(on_disk(t), torch.full((1 << 16,), 2.0))


# ---------------------------------------------------------------------------------------------
# 18. A read of the pool's state while the end of a lease left to the actor is applied
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_read_of_the_pool_waits_for_a_lease_end_left_to_the_actor_under_way(
    tmp_path: Path,
) -> None:
    """A Ctrl-C as a lease's exit begins to end it leaves the end to the actor's next step
    (which a wake-up runs at once). A read of the pool's state from another thread
    (``repr``, ``leased``) made while that step applies the end waits for it: it never
    counts the lease as held once its exit returned."""
    t = _tensor(tmp_path)
    applied = Breakpoint(Actor.release.__code__, on="call")
    with breakpoints_in_new_threads(applied), TensorResidencyPool() as pool:
        try:
            pool.resolve(t)  # a hit from now on
            lease = pool.acquire(t)
            lease.__enter__()
            applied.armed.set()
            # The second call counted in the pool's modules, from __exit__: the end of the
            # hit's lease, one of its slot's readers.
            cut = InterruptAt(2, within=str(Path(_handles.__file__).parent))
            assert interrupted(cut, lambda: lease.__exit__(None, None, None))
            assert cut.where == "Actor.end_reader"
            assert applied.paused.wait(10)  # the loop thread is applying it
            read: concurrent.futures.Future[str] = concurrent.futures.Future()
            threading.Thread(target=lambda: read.set_result(repr(pool)), daemon=True).start()
            with contextlib.suppress(concurrent.futures.TimeoutError):
                read.result(0.2)  # (before the fix: answered at once, "leased: 1")
            applied.go()
            assert "leased: 0," in read.result(10)
        finally:
            applied.go()
        check_invariants(pool)
    assert pool.closed
