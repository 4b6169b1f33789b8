"""The pool's core: leases without the loop thread, read-your-writes, downward imports."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import random
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from breakpoints import line_of, paused_in_new_threads
from residency_checks import check_invariants, io_threads_since
from test_residency import faces, make_tensors, open_pool

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorResource
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    ResidencyStrategy,
    TensorPrefetch,
    TensorResidencyLease,
    TensorResidencyPool,
)
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._policy import ScheduledPolicy
from torch_to_nnef.tensor.residency._requests import read_by_caller

pytestmark = [pytest.mark.timeout(90)]

SRC = Path(__file__).resolve().parents[1] / "src"
BIG = 1 << 22  # float32: 16 MiB, so that a write-back takes a while


def _churn(
    pool: TensorResidencyPool, others: list[OffloadedTensor], seed: int, stop: threading.Event
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        t = rng.choice(others)
        kind = rng.randrange(4)
        if kind == 0:
            pool.resolve(t)
        elif kind == 1:
            with pool.acquire(t, mode="read_write") as value:
                value.add_(0.0)  # a write: dirty values are written back on eviction
        elif kind == 2:
            pool.prefetch(t).wait()
        else:
            with contextlib.suppress(T2NErrorMisuse):  # another thread holds it
                pool.evict(t)


@pytest.mark.parametrize("resident_first", [True, False])
def test_a_held_lease_never_changes_while_other_threads_churn(
    tmp_path: Path, resident_first: bool
) -> None:
    ts = make_tensors(tmp_path, 12, numel=1024)
    held, others = ts[0], ts[1:]
    with TensorResidencyPool(max_cached_bytes=2 * 4096, max_workers=2) as pool:
        if resident_first:
            pool.resolve(held)  # the lease below is taken without the loop thread
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn(seed: int) -> None:
            try:
                _churn(pool, others, seed, stop)
            except BaseException as error:
                errors.append(error)

        with pool.acquire(held) as value:
            pointer = value.data_ptr()
            threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(3)]
            for thread in threads:
                thread.start()
            try:
                for _ in range(300):
                    assert value.data_ptr() == pointer
                    assert torch.equal(value, torch.zeros(1024)), "a held value changed"
                    assert pool.is_resident(held), "a held value lost its residency"
                    with pytest.raises(T2NErrorMisuse, match="while it is leased"):
                        pool.evict(held)
                    assert pool.resolve(held) is value
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
        assert not errors, errors
        check_invariants(pool)
        assert pool.stats().evictions > 0, "the other threads did not churn the pool"


@pytest.mark.parametrize("closing", ["evict", "close"])
def test_a_reader_that_joins_as_the_actor_closes_its_slot_keeps_its_value(
    tmp_path: Path, closing: str
) -> None:
    """The actor found no lease on a value and is about to close its slot (paused there), to
    evict the value or to close the pool. A thread's hit lease joins the readers meanwhile,
    finds the slot open and enters. The actor, once it closed the slot, looks at the readers
    again: it finds that one, opens the slot again and refuses (the value is leased). Had it
    not looked again, the value would leave under the lease."""
    (t,) = make_tensors(tmp_path, 1, numel=256)
    if closing == "evict":
        code, text = Actor._close_slot, "slot.open = False"
    else:
        code, text = Actor.begin_close, "for slot in self.published.values():"
    inside, leave = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with pool.acquire(t) as value:
                inside.set()
                assert leave.wait(30)
                assert torch.equal(value, torch.zeros(256)), "a held value changed"
                assert pool.is_resident(t), "a held value lost its residency"
        except BaseException as error:
            errors.append(error)

    def close_it() -> None:
        try:
            with pytest.raises(T2NErrorMisuse, match="leased"):
                pool.evict(t) if closing == "evict" else pool.close()
        except BaseException as error:
            errors.append(error)

    with paused_in_new_threads(code.__code__, on="line", line=line_of(code, text)) as point:
        pool = TensorResidencyPool()  # its loop thread starts here: the point is in it
        pool.resolve(t)  # resident: the lease below is a hit
        point.armed.set()
        closer = threading.Thread(target=close_it)
        closer.start()
        assert point.paused.wait(30), "the actor did not reach the close of the slot"
        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(30), "the lease waited for the actor"
        point.go()
        closer.join(30)
        leave.set()
        holder.join(30)
    assert not errors, errors
    assert pool.stats().hits >= 1
    pool.evict(t)  # the lease ended: nothing holds the value now
    assert not pool.is_resident(t)
    pool.close()


@pytest.mark.usefixtures("buffered_reads")  # an evicted value's buffers serve later loads
def test_hit_leases_taken_without_the_lock_keep_their_values_through_evictions_and_a_close(
    tmp_path: Path,
) -> None:
    """Threads enter and leave leases on hits, each one of its slot's readers (no lock),
    while other threads' loads evict those values and the main thread closes the pool. The
    actor closes a slot, then looks for readers; a reader joins, then looks whether the slot
    is open. Had either looked first, a value would leave under a reader: evicted, its buffer
    refilled by another load, or the pool closed while a lease holds it. Thread switches
    come every few microseconds here, so that the two meet often."""
    ts = make_tensors(tmp_path, 10, numel=1024)
    hot, others = ts[:3], ts[3:]
    errors: list[BaseException] = []
    stop = threading.Event()
    entered = [0]
    pool = TensorResidencyPool(max_cached_bytes=3 * 4096, max_workers=2)
    actor = pool._actor

    def read(index: int) -> None:
        expected = float(index)
        try:
            while not stop.is_set():
                try:
                    with pool.acquire(hot[index]) as value:
                        entered[0] += 1
                        assert not (actor.closing or actor.closed), "closed under a lease"
                        first = float(value[0])
                        time.sleep(0)
                        assert first == expected == float(value[-1]), "a held value changed"
                        assert bool((value == expected).all()), "a held value changed"
                except T2NErrorMisuse as error:
                    assert "closed" in str(error) or "closing" in str(error), error
                    return
        except BaseException as error:
            errors.append(error)

    def churn() -> None:
        try:
            rng = random.Random(7)
            while not stop.is_set():
                try:
                    value = pool.resolve(rng.choice(others))
                except T2NErrorMisuse as error:
                    assert "closed" in str(error) or "closing" in str(error), error
                    return
                assert float(value[0]) == float(value[-1])
        except BaseException as error:
            errors.append(error)

    for t in hot:
        pool.resolve(t)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=churn))
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        refused = 0
        deadline = time.monotonic() + 30
        while not pool.closed and time.monotonic() < deadline:
            try:
                pool.close()
            except T2NErrorMisuse as error:
                assert "leased" in str(error), error
                refused += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert pool.closed, "the pool never closed: a lease was left held"
    assert entered[0] > 1000, "the readers took too few leases: the test proves little"
    assert pool.stats().evictions > 0, "nothing was evicted: the test proves little"


def _release(
    lease: TensorResidencyLease, barrier: threading.Barrier, errors: list[BaseException]
) -> None:
    try:
        barrier.wait(10)
        lease.__exit__(None, None, None)
    except BaseException as error:
        errors.append(error)


@pytest.mark.parametrize("rounds", [5])
def test_leases_ended_at_once_by_many_threads_leave_the_pool_within_its_budget(
    tmp_path: Path, rounds: int
) -> None:
    # Each thread's value was loaded for its lease (held outside the budget). The releases
    # race: each alone would fit the budget as the actor last counted it, together they do
    # not; the actor must hear of it (one wake-up at a time), and evict down to the budget.
    ts = make_tensors(tmp_path, 16, numel=1024)
    budget = 2 * 4096
    with TensorResidencyPool(max_cached_bytes=budget, max_workers=2) as pool:
        for round_index in range(rounds):
            chosen = ts[round_index % 2 :: 2]
            leases = [pool.acquire(t) for t in chosen]
            for lease in leases:
                lease.__enter__()
            assert pool.resident_bytes >= len(chosen) * 4096  # all held, over the budget
            barrier = threading.Barrier(len(leases))
            errors: list[BaseException] = []
            threads = [
                threading.Thread(target=_release, args=(lease, barrier, errors)) for lease in leases
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert not errors, errors
            assert pool.resident_bytes <= budget, "leases ended over the budget were not heard"
            check_invariants(pool)


def test_a_lease_ended_over_the_budget_is_heard_with_no_request_after_it(tmp_path: Path) -> None:
    # Leases granted by the actor on misses and ended at once: with nothing asked of the
    # pool after them, it is within its budget.
    ts = make_tensors(tmp_path, 8, numel=1024)
    budget = 2 * 4096
    with TensorResidencyPool(max_cached_bytes=budget) as pool:
        for t in ts:
            with pool.acquire(t):
                pass
        actor = pool._actor  # read as is: what the actor did unasked
        deadline = time.monotonic() + 30
        while actor.resident_bytes > budget and time.monotonic() < deadline:
            time.sleep(0.001)
        assert actor.resident_bytes <= budget, "an ended lease over the budget was never heard"
        check_invariants(pool)


def test_a_lease_held_across_a_step_and_ended_over_the_budget_is_heard_with_no_request_after_it(
    tmp_path: Path,
) -> None:
    # A lease still held when the actor next takes note holds its value outside the budget.
    # Ended over the budget, it wakes the actor itself: with nothing asked of the pool
    # after it, the pool comes back within its budget.
    ts = make_tensors(tmp_path, 3, numel=1024)
    budget = 2 * 4096
    with TensorResidencyPool(max_cached_bytes=budget) as pool:
        pool.resolve(ts[0])
        actor = pool._actor  # read as is: what the actor did unasked
        with pool.acquire(ts[1]):  # a miss, granted by the actor
            pool.resolve(ts[2])  # a miss: its step counts the lease as holding ts[1]
            assert actor.resident_bytes == 3 * 4096  # the leased value is on top of the budget
        deadline = time.monotonic() + 30
        while actor.resident_bytes > budget and time.monotonic() < deadline:
            time.sleep(0.001)
        assert actor.resident_bytes <= budget, "a lease ended over the budget was never heard"
        assert not pool.is_resident(ts[0])  # the least recently used value left
        check_invariants(pool)


class _CountingLoop(asyncio.SelectorEventLoop):
    """An event loop counting the callbacks other threads send it and the timers it arms."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.timers = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.sent += 1
        return super().call_soon_threadsafe(*args, **kwargs)

    def call_at(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.timers += 1
        return super().call_at(*args, **kwargs)


@pytest.mark.parametrize(("numel", "calls_per_miss"), [(1024, 1), ((1 << 18) + 256, 2)])
def test_a_sync_acquire_that_misses_and_ends_at_once_costs_the_loop_what_a_resolve_costs(
    tmp_path: Path, numel: int, calls_per_miss: int
) -> None:
    # Every request misses (8 tensors cycled through a budget of 2). A miss of either face
    # sends the loop the request, and, for a payload over 1 MiB, which an I/O worker reads,
    # the load's end (a smaller one, the requesting thread reads, and the step that takes it
    # applies its end); a lease ended at once adds nothing: no wake-up and no timer.
    ts = make_tensors(tmp_path, 8, numel=numel)
    loop = _CountingLoop()
    sent: dict[str, tuple[int, int, int]] = {}

    def run(pool: TensorResidencyPool, face: str) -> None:
        misses, calls, timers = pool.stats().misses, loop.sent, loop.timers
        for _ in range(3):
            for t in ts:
                if face == "resolve":
                    pool.resolve(t)
                else:
                    with pool.acquire(t):
                        pass
        # (read before stats(), which may send the loop a call of its own)
        calls, timers = loop.sent - calls, loop.timers - timers
        sent[face] = (pool.stats().misses - misses, calls, timers)

    async def main() -> None:
        async with TensorResidencyPool(max_cached_bytes=2 * 4 * numel) as pool:
            await asyncio.to_thread(run, pool, "resolve")
            await asyncio.to_thread(run, pool, "acquire")
            check_invariants(pool)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert sent["resolve"] == (24, 24 * calls_per_miss, 0), sent
    assert sent["acquire"] == sent["resolve"]


@pytest.mark.asyncio
@pytest.mark.parametrize("face_name", ["thread", "loop"])
async def test_state_read_right_after_a_lease_ended_sees_its_eviction(
    tmp_path: Path, face_name: str
) -> None:
    # The third value, back in the cache, pushes the first out: reads of the state right
    # after the release see it gone, from another thread or on the pool's own loop.
    ts = make_tensors(tmp_path, 3, numel=1024)
    budget = 2 * 4096

    def acquire_all(pool: TensorResidencyPool) -> None:
        for t in ts:
            with pool.acquire(t):
                pass

    if face_name == "thread":
        with TensorResidencyPool(max_cached_bytes=budget) as pool:
            await asyncio.to_thread(acquire_all, pool)
            assert not pool.is_resident(ts[0])
            assert pool.resident_bytes == budget
    else:
        async with TensorResidencyPool(max_cached_bytes=budget) as pool:
            for t in ts:
                async with pool.acquire(t):
                    pass
            assert not pool.is_resident(ts[0])
            assert pool.resident_bytes == budget


def test_a_read_write_lease_taken_without_the_loop_is_written_back(tmp_path: Path) -> None:
    ts = make_tensors(tmp_path, 4)
    with TensorResidencyPool(max_cached_bytes=2 * 1024) as pool:
        pool.resolve(ts[0])
        with pool.acquire(ts[0], mode="read_write") as value:
            value.fill_(7.0)
        for t in ts[1:]:
            pool.resolve(t)  # pushes ts[0] out: written back first
        pool.flush()
        assert not pool.is_resident(ts[0])
    assert torch.equal(ts[0].reload(), torch.full((256,), 7.0))


@faces
@pytest.mark.parametrize("pushed_by", ["a large value", "a small value"])
@pytest.mark.asyncio
async def test_an_evicted_dirty_value_is_read_as_written(
    tmp_path: Path, face_name: str, pushed_by: str
) -> None:
    # A small value for the CPU that a thread misses is read by that thread, and the step
    # that keeps it evicts what it pushed out before answering; a large one is a worker's.
    numel = BIG if pushed_by == "a large value" else 1024
    a = OffloadedTensor.from_original_tensor(torch.zeros(BIG), "a", offload_dir=tmp_path)
    b = OffloadedTensor.from_original_tensor(torch.ones(numel), "b", offload_dir=tmp_path)
    async with open_pool(face_name, max_cached_bytes=BIG * 4) as face:
        async with face.acquire(a, mode="read_write") as value:
            value.fill_(3.0)
        await face.resolve(b)  # pushes the dirty value of a out: its write-back starts
        assert not face.pool.is_resident(a), "a value chosen for eviction is still resident"
        if face_name == "sync" and pushed_by == "a small value":
            assert face.pool.stats().caller_reads == 1  # (the path this case is for)
        expected = torch.full((BIG,), 3.0)
        assert torch.equal(a.reload(), expected)  # outside the pool: waits for the write
        assert torch.equal(a + 0, expected)  # an op outside any scope
        with TensorResidencyPool() as other:  # another pool
            assert torch.equal(other.resolve(a), expected)
        await face.flush()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_kind", ["resolve", "acquire"])
@pytest.mark.parametrize("numel", [BIG, 1024], ids=["loaded by a worker", "read by the caller"])
def test_a_read_of_the_state_after_an_answer_waits_for_the_eviction_left_due(
    tmp_path: Path, request_kind: str, numel: int
) -> None:
    # A load's end (a worker's, or the step keeping what a thread read itself) answers its
    # waiters before it evicts what the value pushed over the budget. The thread its answer
    # wakes asks at once whether the dirty value pushed out is resident, while that eviction
    # has not run (held here as it starts): the read waits for it, and says no.
    a = OffloadedTensor.from_original_tensor(torch.zeros(numel), "a", offload_dir=tmp_path)
    b = OffloadedTensor.from_original_tensor(torch.ones(numel), "b", offload_dir=tmp_path)
    answered = threading.Event()
    resident: list[bool] = []

    def reader() -> None:
        if request_kind == "resolve":
            pool.resolve(b)
            answered.set()
            resident.append(pool.is_resident(a))
        else:
            with pool.acquire(b):
                answered.set()
                resident.append(pool.is_resident(a))

    enforce = Actor.enforce.__code__
    with (
        paused_in_new_threads(enforce, on="call") as point,
        TensorResidencyPool(max_cached_bytes=numel * 4) as pool,
    ):
        with pool.acquire(a, mode="read_write") as value:
            value.fill_(3.0)
        caller_reads = pool.stats().caller_reads  # (the lease's end applied: nothing to evict)
        point.armed.set()
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert point.paused.wait(30), "no eviction started"
        assert answered.wait(30), "the request was not answered before its eviction"
        thread.join(0.5)  # its read of the state, meanwhile
        point.go()
        thread.join(30)
        assert not thread.is_alive(), "the read of the state never ended"
        assert resident == [False], "the value pushed out was still resident"
        check_invariants(pool)
        assert pool.stats().caller_reads == caller_reads + (numel != BIG)
    assert torch.equal(a.reload(), torch.full((numel,), 3.0))


@faces
@pytest.mark.asyncio
async def test_prefetch_of_a_resident_value_is_done_at_once(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 2)
    async with open_pool(face_name) as face:
        await face.resolve(ts[0])
        handle = face.pool.prefetch(ts[0])
        assert handle.done()
        assert torch.equal(handle.wait(), torch.zeros(256))
        assert torch.equal(await handle, torch.zeros(256))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_prefetches_awaited_on_the_serving_loop_arm_no_timer_each(tmp_path: Path) -> None:
    """A task on the loop serving the pool awaits a prefetch without looking at that loop
    (it runs): the tasks of a ``gather`` of many pending prefetches arm no timer each, which
    the loop would keep re-arming while the loads last."""
    loop = asyncio.get_running_loop()
    if not hasattr(loop, "_scheduled"):
        pytest.skip("counts the timers of asyncio's own loop (uvloop shows none)")
    ts = make_tensors(tmp_path, 200)
    async with TensorResidencyPool(max_workers=1) as pool:
        with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__, "call") as load:
            load.armed.set()
            waiting = asyncio.gather(*(pool.prefetch(t) for t in ts))
            assert await asyncio.to_thread(load.paused.wait, 30)  # the first load is held
            await asyncio.sleep(0.25)  # every task awaits its prefetch (past two looks)
            assert not waiting.done()
            timers = len(loop._scheduled)  # type: ignore[attr-defined]
            load.go()
            values = await waiting
    assert timers < 20, f"{timers} timers armed while 200 prefetches were awaited"
    assert all(torch.equal(v, torch.full((256,), float(i))) for i, v in enumerate(values))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_tasks_awaiting_prefetches_on_the_serving_loop_cancelled_from_a_thread(
    tmp_path: Path,
) -> None:
    """Tasks of the serving loop awaiting prefetch handles, cancelled from another thread
    while the loads are held: each task ends cancelled, the loads go on (a cancel never
    cancels the pool's completion), and the handles and the pool serve the values after,
    with no load again."""
    ts = make_tensors(tmp_path, 8)
    loop = asyncio.get_running_loop()
    async with TensorResidencyPool(max_workers=1) as pool:
        with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__, "call") as load:
            load.armed.set()
            handles = [pool.prefetch(t) for t in ts]

            async def take(handle: TensorPrefetch) -> torch.Tensor:
                return await handle

            tasks = [asyncio.ensure_future(take(h)) for h in handles]
            assert await asyncio.to_thread(load.paused.wait, 30)  # the first load is held
            await asyncio.sleep(0.05)  # every task awaits its handle

            def cancel_all() -> None:
                for task in tasks:
                    loop.call_soon_threadsafe(task.cancel)

            await asyncio.to_thread(cancel_all)
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            assert not any(h.done() for h in handles), "a cancel ended a load"
            load.go()
        for i, handle in enumerate(handles):
            assert torch.equal(await handle, torch.full((256,), float(i)))
        for i, t in enumerate(ts):
            assert torch.equal(await pool.aresolve(t), torch.full((256,), float(i)))
        stats = pool.stats()
        assert stats.loads == len(ts), f"{stats.loads} loads for {len(ts)} tensors"
        check_invariants(pool)


def test_a_burst_of_loads_runs_on_every_worker_after_loads_taken_one_at_a_time(
    tmp_path: Path,
) -> None:
    """A pool that ran its loads one at a time has one worker, idle; a burst of prefetches
    then starts the second: one of the burst's loads ends while the other is held in its
    read. (The workers woken by a burst run after it was queued: counting them idle until
    they took a job kept the pool on one worker.)"""
    first, held, other = make_tensors(tmp_path, 3, numel=BIG)  # loaded by workers
    with (
        paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__, "call") as load,
        TensorResidencyPool(max_workers=2) as pool,
    ):
        pool.prefetch(first).wait()  # the first worker starts, loads, and waits for a job
        time.sleep(0.1)
        load.armed.set()
        burst = [pool.prefetch(held), pool.prefetch(other)]
        assert load.paused.wait(30), "no load started"
        deadline = time.monotonic() + 10
        while not any(handle.done() for handle in burst) and time.monotonic() < deadline:
            time.sleep(0.01)
        ended_beside = any(handle.done() for handle in burst)
        load.go()
        values = [handle.wait() for handle in burst]
    assert ended_beside, "the burst's loads waited for each other: one worker ran both"
    assert torch.equal(values[0], torch.full((BIG,), 1.0))
    assert torch.equal(values[1], torch.full((BIG,), 2.0))


def test_bursts_of_loads_never_start_more_than_max_workers_threads(tmp_path: Path) -> None:
    """Bursts of loads, each over the budget, through a pool of two workers: both start, no
    third ever does, and every value is read right."""
    numel = 1 << 19  # float32: 2 MiB, loaded by a worker
    tensors = make_tensors(tmp_path, 12, numel=numel)
    before = set(threading.enumerate())
    counts = []
    with TensorResidencyPool(max_cached_bytes=4 * numel * 4, max_workers=2) as pool:
        for _ in range(5):
            handles = [pool.prefetch(t) for t in tensors]
            for i, handle in enumerate(handles):
                assert torch.equal(handle.wait(), torch.full((numel,), float(i)))
            del handles
            counts.append(len(io_threads_since(before)))
    assert counts == [2] * 5


class _ThreadsRefused:
    """``threading.Thread.start`` refusing the pool's threads whose name starts with a
    prefix while :attr:`refusing` (as the system does at its limit of threads), and the
    errors raised in threads meanwhile (``threading.excepthook``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
        self.refusing = True
        self.thread_errors: list[BaseException | None] = []
        start = threading.Thread.start

        def refusing_start(thread: threading.Thread) -> None:
            if self.refusing and thread.name.startswith(prefix):
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", refusing_start)
        monkeypatch.setattr(
            threading, "excepthook", lambda args: self.thread_errors.append(args.exc_value)
        )


@faces
@pytest.mark.asyncio
@pytest.mark.parametrize("request_kind", ["resolve", "acquire", "prefetch"])
async def test_a_request_whose_first_worker_the_system_refused_fails_and_the_pool_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, face_name: str, request_kind: str
) -> None:
    """A load that needs the pool's first I/O worker, which the system refuses to start,
    fails with ``T2NErrorResource`` and leaves nothing behind; once threads start again, the
    same request is served and the pool closes cleanly. (The job was queued for a thread that
    never ran: the request hung, the next one waited behind it, and the close raised in the
    loop thread, joining a thread never started.)"""
    (big,) = make_tensors(tmp_path, 1, numel=BIG)  # loaded by a worker
    expected = torch.full((BIG,), 0.0)
    refused = _ThreadsRefused(monkeypatch, "t2n-residency-io")

    async def request(face: Any) -> torch.Tensor:
        if request_kind == "resolve":
            return await face.resolve(big)
        if request_kind == "acquire":
            async with face.acquire(big) as value:
                return value.clone()
        return await face.prefetch(big)

    async with open_pool(face_name, max_cached_bytes=2 * BIG * 4) as face:
        with pytest.raises(T2NErrorResource, match="could not start an I/O worker thread"):
            await asyncio.wait_for(request(face), 30)
        assert not face.pool.is_resident(big)
        assert face.pool.resident_bytes == 0
        check_invariants(face.pool)
        refused.refusing = False
        assert torch.equal(await asyncio.wait_for(request(face), 30), expected)
        assert face.pool.is_resident(big)
    assert refused.thread_errors == []


def test_a_second_worker_refused_leaves_the_burst_to_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one worker running, a refused second one costs nothing but parallelism: a burst
    of loads runs on the first, and every value is read right."""
    tensors = make_tensors(tmp_path, 4, numel=BIG)
    before = set(threading.enumerate())
    with TensorResidencyPool(max_workers=2) as pool:
        assert torch.equal(pool.resolve(tensors[0]), torch.full((BIG,), 0.0))
        refused = _ThreadsRefused(monkeypatch, "t2n-residency-io")
        handles = [pool.prefetch(t) for t in tensors[1:]]
        for i, handle in enumerate(handles, start=1):
            assert torch.equal(handle.wait(), torch.full((BIG,), float(i)))
        assert len(io_threads_since(before)) == 1
    assert refused.thread_errors == []


def test_a_write_back_refused_a_worker_keeps_the_change_until_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change read by its own thread (no worker yet) whose write-back cannot start a
    worker: the eviction and the close fail with ``T2NErrorResource``, every read still sees
    the change, and once threads start again the close writes it to the file."""
    (small,) = make_tensors(tmp_path, 1, numel=1024)  # read by the caller: no worker
    pool = TensorResidencyPool(max_cached_bytes=1 << 20)
    with pool.acquire(small, mode="read_write") as value:
        value.fill_(7.0)
    refused = _ThreadsRefused(monkeypatch, "t2n-residency-io")
    with pytest.raises(T2NErrorResource, match="could not start an I/O worker thread"):
        pool.evict(small)
    assert not pool.is_resident(small)  # chosen for eviction: its write is due
    assert torch.equal(small.reload(), torch.full((1024,), 7.0))
    with pytest.raises(T2NErrorResource):
        pool.flush()
    with pytest.raises(T2NErrorResource):
        pool.close()
    assert not pool.closed
    assert torch.equal(pool.resolve(small), torch.full((1024,), 7.0))
    refused.refusing = False
    pool.close()
    assert pool.stats().write_backs == 1
    assert torch.equal(small.reload(), torch.full((1024,), 7.0))
    assert refused.thread_errors == []


def test_a_pool_whose_loop_thread_the_system_refused_starts_it_at_the_next_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (small,) = make_tensors(tmp_path, 1, numel=1024)
    refused = _ThreadsRefused(monkeypatch, "t2n-residency-loop")
    pool = TensorResidencyPool()
    with pytest.raises(T2NErrorResource, match="could not start its event loop thread"):
        pool.resolve(small)
    with pytest.raises(T2NErrorResource), pool:  # the entry starts it
        pass
    refused.refusing = False
    with pool:
        assert torch.equal(pool.resolve(small), torch.zeros(1024))
    assert pool.closed
    assert refused.thread_errors == []


def test_a_sync_miss_on_a_small_payload_is_read_by_its_own_thread(tmp_path: Path) -> None:
    # A payload of up to 1 MiB for the CPU: the thread that missed reads it, with no hand-off
    # to an I/O worker; a larger one goes to the workers; a prefetch never reads on its
    # caller's thread.
    small = make_tensors(tmp_path, 3, numel=1024)
    big = OffloadedTensor.from_original_tensor(
        torch.full(((1 << 20) // 4 + 1,), 5.0), "big", offload_dir=tmp_path
    )
    with TensorResidencyPool() as pool:
        assert torch.equal(pool.resolve(small[0]), torch.zeros(1024))
        with pool.acquire(small[1]) as value:
            assert torch.equal(value, torch.ones(1024))
        assert torch.equal(pool.resolve(big), torch.full(((1 << 20) // 4 + 1,), 5.0))
        pool.prefetch(small[2]).wait()
        stats = pool.stats()
        assert (stats.loads, stats.caller_reads, stats.misses) == (4, 2, 3)
        assert stats.bytes_read == 2 * 4096 + (1 << 20) + 4 + 4096
        check_invariants(pool)


def test_a_sync_acquire_miss_read_by_its_own_thread_is_leased_at_once(tmp_path: Path) -> None:
    # The pool keeps what the thread read as a load's end keeps it, and the step that kept it
    # leases it: one request (a miss) and one load each. The value leased outlasts the
    # requests that push the pool over its budget, is cached once the lease ended, and a
    # read_write lease's change is written back.
    ts = make_tensors(tmp_path, 5, numel=1024)
    with TensorResidencyPool(max_cached_bytes=2 * 4096) as pool:
        with pool.acquire(ts[0]) as value:
            stats = pool.stats()
            assert (stats.hits, stats.misses, stats.loads, stats.caller_reads) == (0, 1, 1, 1)
            for t in ts[1:4]:
                pool.resolve(t)
            assert pool.is_resident(ts[0])
            assert torch.equal(value, torch.zeros(1024))
            check_invariants(pool)
        assert torch.equal(pool.resolve(ts[0]), torch.zeros(1024))
        stats = pool.stats()
        assert (stats.hits, stats.misses, stats.loads) == (1, 4, 4)
        with pool.acquire(ts[4], mode="read_write") as value:
            value.fill_(7.0)
        pool.flush()
        stats = pool.stats()
        assert (stats.hits, stats.misses, stats.loads, stats.caller_reads) == (1, 5, 5, 5)
        check_invariants(pool)
    assert torch.equal(ts[4].reload(), torch.full((1024,), 7.0))


@pytest.mark.parametrize("room_taken_by", ["a pin", "the schedule", "fixed admissions"])
def test_a_sync_acquire_miss_whose_value_would_not_stay_cached_is_read_once(
    tmp_path: Path, room_taken_by: str
) -> None:
    # Where the value would leave as soon as it arrived (a pin fills the budget; a known
    # schedule evicts the value just used first; FIXED admitted others up to the budget), the
    # acquire reserves it while its thread's read is applied: one load, not a second one
    # after the value left.
    ts = make_tensors(tmp_path, 3, numel=1024)
    strategy = {
        "a pin": ResidencyStrategy.LRU,
        "the schedule": ResidencyStrategy.SCHEDULED,
        "fixed admissions": ResidencyStrategy.FIXED,
    }[room_taken_by]
    with TensorResidencyPool(max_cached_bytes=4096, strategy=strategy) as pool:
        if room_taken_by == "a pin":
            pool.pin(ts[0]).wait()
        else:
            pool.declare_schedule(ts)
            pool.resolve(ts[0])
        for t in ts[1:]:
            with pool.acquire(t) as value:
                assert torch.equal(value, t.reload())
                assert pool.is_resident(t)
                check_invariants(pool)
        stats = pool.stats()
        assert stats.loads == 3, f"{stats.loads} loads for 3 tensors"
        check_invariants(pool)


def test_a_sync_miss_read_by_a_thread_in_inference_mode_is_a_plain_value(tmp_path: Path) -> None:
    # A forward under torch.inference_mode() in a thread misses a small payload, which that
    # thread reads itself: the pool keeps a value as a worker's load makes it, not an
    # inference tensor (which has no version counter: the load's end would fail, leaving
    # the request, and every later one, waiting), and other threads can change it in place
    # or use it under autograd.
    t = make_tensors(tmp_path, 1, numel=1024)[0]
    got: list[torch.Tensor] = []

    def forward() -> None:
        with torch.inference_mode():
            got.append(pool.resolve(t) * 1)

    with TensorResidencyPool() as pool:
        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the request never ended"
        assert torch.equal(got[0], torch.zeros(1024))
        assert pool.stats().caller_reads == 1
        value = pool.resolve(t)
        assert not value.is_inference()
        x = torch.ones(1024, requires_grad=True)
        (x * value).sum().backward()
        with pool.acquire(t, mode="read_write") as changed:
            changed.add_(1.0)
        check_invariants(pool)
    assert torch.equal(t.reload(), torch.ones(1024))


@pytest.mark.parametrize("request_kind", ["resolve", "acquire"])
@pytest.mark.parametrize("writer", ["direct", "this pool"])
def test_a_read_of_its_own_thread_that_a_write_overtook_is_not_served(
    tmp_path: Path, writer: str, request_kind: str
) -> None:
    # The thread that missed read the old value; before its request reached the pool, the
    # tensor was written: by update_values, or by a read_write lease of the same pool whose
    # value was then evicted (written back). The pool reads the value again: the request, and
    # every later one, sees the write.
    t = make_tensors(tmp_path, 1, numel=1024)[0]
    got: list[torch.Tensor] = []

    def read() -> None:
        if request_kind == "resolve":
            got.append(pool.resolve(t).clone())
        else:
            with pool.acquire(t) as value:
                got.append(value.clone())

    with TensorResidencyPool() as pool:
        with paused_in_new_threads(read_by_caller.__code__, on="return") as point:
            point.armed.set()
            reader = threading.Thread(target=read)
            reader.start()
            assert point.paused.wait(30)
            if writer == "direct":
                t.update_values(torch.full((1024,), 9.0))
            else:
                with pool.acquire(t, mode="read_write") as value:
                    value.fill_(9.0)
                pool.evict(t)
            point.go()
            reader.join(30)
        assert not reader.is_alive()
        assert torch.equal(got[0], torch.full((1024,), 9.0))
        assert torch.equal(pool.resolve(t), torch.full((1024,), 9.0))
        check_invariants(pool)
    assert torch.equal(t.reload(), torch.full((1024,), 9.0))


@pytest.mark.asyncio
async def test_hits_from_threads_never_wait_for_the_loop(tmp_path: Path) -> None:
    ts = make_tensors(tmp_path, 2)
    async with TensorResidencyPool() as pool:
        await pool.aresolve(ts[0])
        results: list[object] = []

        def hits() -> None:
            results.append(pool.prefetch(ts[0]).done())
            results.append(float(pool.resolve(ts[0])[0]))
            with pool.acquire(ts[0]) as value:
                results.append(float(value[0]))
            with pool.acquire(ts[0], mode="read_write") as value:
                results.append(float(value[0]))

        thread = threading.Thread(target=hits)
        thread.start()
        thread.join(20)  # blocks the pool's loop: a hit that needs it would never end
        assert not thread.is_alive(), "a hit waited for the pool's loop thread"
        assert results == [True, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Imports point down
# ---------------------------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "torch_to_nnef").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


PUBLIC_MODULES = sorted(m for m in _modules() if not any(p.startswith("_") for p in m.split(".")))


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_each_public_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def _imports_at_import_time(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``module`` imports when it is imported (not in functions
    nor under ``TYPE_CHECKING``), each with the packages above it, which Python runs first."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.If | ast.Try | ast.With):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, block, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)

    visit(tree.body)
    closed: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            candidate = ".".join(parts[:end])
            if candidate in known and candidate != module:
                closed.add(candidate)
    return closed


def test_no_import_circle_in_the_package() -> None:
    modules = _modules()
    known = set(modules)
    graph = {m: _imports_at_import_time(m, p, known) for m, p in modules.items()}
    # A package imports its own submodules; those import the package first: no circle.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circle = [*stack[stack.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


# SCHEDULED retention through a pool (the policy's own tests drive it by hand, every hit an
# ``access``): hits served without the actor must move the consumer's position too.
def _hit(pool: TensorResidencyPool, t: OffloadedTensor, how: str) -> None:
    if how == "resolve":
        pool.resolve(t)
    elif how == "scope":
        with pool.scope():
            torch.add(t, 0)
    else:
        with pool.acquire(t, mode=how):
            pass


@pytest.mark.parametrize("how", ["resolve", "scope", "read", "read_write"])
def test_a_scheduled_pool_moves_its_position_on_hits_served_without_the_actor(
    tmp_path: Path, how: str
) -> None:
    """Schedule t0..t4, room for three: t0, t1, t2 read, then t0 again (a hit, served
    without the actor). A prefetch of t3 must evict t0, whose next use is a whole pass away,
    not t2, used two steps later (the hit once left the position at t2)."""
    ts = make_tensors(tmp_path, 5, numel=64)
    with TensorResidencyPool(3 * 256, strategy=ResidencyStrategy.SCHEDULED) as pool:
        pool.declare_schedule(ts)
        for t in ts[:3]:
            pool.resolve(t)
        misses = pool.stats().misses
        _hit(pool, ts[0], how)
        assert pool.stats().misses == misses
        pool.prefetch(ts[3]).wait()
        assert [pool.is_resident(t) for t in ts] == [False, True, True, True, False]


@pytest.mark.parametrize("how", ["resolve", "read"])
def test_a_scheduled_pool_learns_its_pass_from_hits_as_well(tmp_path: Path, how: str) -> None:
    """No schedule declared, room for three: t0 t1 t2 read (misses), then t0 again, a hit
    served without the actor, ends the pass: t0 t1 t2 is the schedule, and t3, outside it,
    is the first to go. A use again of the value just used (two ops on one weight) ends no
    pass. (Learning from misses alone, the pool still knew no schedule and evicted t1 as LRU
    does; a pass ended by a use again would be t0 alone.)"""
    ts = make_tensors(tmp_path, 4, numel=64)
    with TensorResidencyPool(3 * 256, strategy=ResidencyStrategy.SCHEDULED) as pool:
        for t in ts[:3]:
            pool.resolve(t)
            _hit(pool, t, how)
        assert pool.stats().misses == 3
        _hit(pool, ts[0], how)
        pool.resolve(ts[3])
        assert [pool.is_resident(t) for t in ts] == [True, True, True, False]


def test_a_schedule_declared_before_the_pool_runs_holds_off_its_first_request(
    tmp_path: Path,
) -> None:
    """A schedule declared before the pool runs is declared on its caller's thread; a first
    request of another thread meanwhile waits for it (it once started the loop, whose steps
    then changed the policy amid the declaration: a scheduled value its tree did not count
    raised at the next eviction, and the pool stayed over its budget)."""
    a, b, c = make_tensors(tmp_path, 3, numel=64)
    pool = TensorResidencyPool(256, strategy=ResidencyStrategy.SCHEDULED)
    try:
        with paused_in_new_threads(ScheduledPolicy.declare.__code__, on="call") as point:
            point.armed.set()
            declaring = threading.Thread(target=pool.declare_schedule, args=([b, c, a],))
            declaring.start()
            assert point.paused.wait(10)
            resolving = threading.Thread(target=pool.resolve, args=(a,))
            resolving.start()
            resolving.join(0.3)
            assert resolving.is_alive(), "a first request ran amid the declaration"
            point.go()
            declaring.join(10)
            resolving.join(10)
        assert not declaring.is_alive() and not resolving.is_alive()
        pool.pin(b).wait()  # counts toward the budget: a, the only value evictable, goes
        assert [pool.is_resident(t) for t in (a, b, c)] == [False, True, False]
        check_invariants(pool)
    finally:
        pool.close()


@pytest.mark.parametrize("strategy", [ResidencyStrategy.LRU, ResidencyStrategy.SCHEDULED])
def test_values_whose_leases_end_between_two_steps_take_the_order_their_leases_ended(
    tmp_path: Path, strategy: ResidencyStrategy
) -> None:
    """Room for three; a and b leased (counted by the actor as held), a's slot queued again
    by a hit; b's lease ends, then a's: b is the less recent, and goes before a. (Released
    in the order their slots were queued, a looked older.) Under SCHEDULED, outside the
    schedule: LRU order."""
    a, b, c, d, e, f = make_tensors(tmp_path, 6, numel=64)
    with TensorResidencyPool(3 * 256, strategy=strategy) as pool:
        if strategy is ResidencyStrategy.SCHEDULED:
            pool.declare_schedule([f])
        with pool.acquire(a), pool.acquire(b):
            pool.resolve(c)  # a step: both leases counted as holding their values
            with pool.acquire(a):  # a hit: a's slot queued again
                pass
        # b's lease ended, then a's
        pool.resolve(d)  # evicts c, the least recent
        pool.resolve(e)  # evicts b, whose lease ended first
        assert [pool.is_resident(t) for t in (a, b, c, d, e)] == [True, False, False, True, True]


def test_an_await_where_no_asyncio_loop_runs_is_refused_as_a_misuse(tmp_path: Path) -> None:
    """Each await of the pool, its coroutine driven by something other than an asyncio
    loop (another async library's, trio's say): a ``T2NErrorMisuse`` naming what runs the
    pool, not a raw ``RuntimeError`` from asyncio; the pool then closes as usual."""
    a, b = make_tensors(tmp_path, 2, numel=64)
    pool = TensorResidencyPool()

    def refused(awaitable: Any) -> None:
        steps = awaitable.__await__()
        with pytest.raises(T2NErrorMisuse, match=r"asyncio event loop.*trio"):
            steps.send(None)

    refused(pool.__aenter__())
    refused(pool.acquire(a).__aenter__())
    pool.resolve(a)  # the private loop runs: the async methods, from any asyncio loop
    refused(pool.aresolve(b))
    refused(pool.acquire(b).__aenter__())
    refused(pool.prefetch(b))
    refused(pool.aflush())
    refused(pool.aclose())
    pool.close()
    check_invariants(pool)


def test_a_hit_queued_after_a_step_took_its_touch_is_replayed_by_the_next_step(
    tmp_path: Path,
) -> None:
    """Learning a pass: another thread's hit on a queues its touch, and a step (the miss of
    c) takes it before the hit's key joins the queue of consumers' hits. The next step (the
    miss of d) replays that hit, which ends the pass a b c (it once returned early, no touch
    being queued, and learnt a b c d)."""
    a, b, c, d = make_tensors(tmp_path, 4, numel=64)
    line = line_of(Actor.count_hit, "self._consumer_hits.append(slot.key)")
    with TensorResidencyPool(strategy=ResidencyStrategy.SCHEDULED) as pool:
        pool.resolve(a)
        pool.resolve(b)
        with paused_in_new_threads(Actor.count_hit.__code__, on="line", line=line) as point:
            point.armed.set()
            hit = threading.Thread(target=pool.resolve, args=(a,))
            hit.start()
            assert point.paused.wait(10)
            pool.resolve(c)  # its step takes the hit's touch
            point.go()
            hit.join(10)
        pool.resolve(d)
        policy = pool._actor.policy
        assert isinstance(policy, ScheduledPolicy)
        assert policy._order == [id(a), id(b), id(c)]


def test_a_new_schedule_keeps_the_values_it_leaves_out_in_lru_order(tmp_path: Path) -> None:
    """Room for two: ``a`` (scheduled) then ``b`` (not) read; a new schedule leaves both out;
    reading ``c`` evicts ``a``, the least recently used. (The values scheduled before went
    behind every other, whatever their use: ``b`` went.)"""
    a, b, c = make_tensors(tmp_path, 3, numel=64)
    with TensorResidencyPool(2 * 256, strategy=ResidencyStrategy.SCHEDULED) as pool:
        pool.declare_schedule([a])
        pool.resolve(a)
        pool.resolve(b)
        pool.declare_schedule([c])
        pool.resolve(c)
        assert [pool.is_resident(t) for t in (a, b, c)] == [False, True, True]


@pytest.mark.parametrize("learnt", [False, True])
def test_a_scheduled_pool_forgets_a_collected_tensor(tmp_path: Path, learnt: bool) -> None:
    """Schedule a0 a1 d a3 (declared, or learnt from a pass); d leaves the pool and is
    collected: the next step leaves its key out of the schedule, and the pass goes on over
    the others (a new tensor may be given d's id, and inherited its place in the schedule:
    see test_residency_policy for what the policy then does with it)."""
    a0, a1, d, a3 = make_tensors(tmp_path, 4, numel=64)
    with TensorResidencyPool(2 * 256, strategy=ResidencyStrategy.SCHEDULED) as pool:
        if learnt:
            for t in (a0, a1, d, a3, a0):
                pool.resolve(t)
        else:
            pool.declare_schedule([a0, a1, d, a3])
            pool.resolve(d)
        pool.evict(d)  # out of the pool: nothing holds d but this test
        policy = pool._actor.policy
        assert isinstance(policy, ScheduledPolicy)
        assert policy._order == [id(a0), id(a1), id(d), id(a3)]
        del d
        pool.stats()  # a step
        assert policy._order == [id(a0), id(a1), id(a3)]
        for t in (a1, a3, a0):  # room for two: a0, used again a pass later, goes
            pool.resolve(t)
        assert [pool.is_resident(t) for t in (a0, a1, a3)] == [False, True, True]
        check_invariants(pool)


def test_a_hit_on_a_tensor_collected_before_the_next_step_is_not_learnt(
    tmp_path: Path,
) -> None:
    """No schedule yet: a0 a1 d read. A hit on d lands while a step evicts it; d is then
    collected. The next step forgets d, then replays the hit, which must not put d's key
    back into the pass being learnt (a new tensor may be given that id)."""
    a0, a1, d = make_tensors(tmp_path, 3, numel=64)
    with (
        paused_in_new_threads(Actor._close_slot.__code__, on="call") as point,
        TensorResidencyPool(None, strategy=ResidencyStrategy.SCHEDULED) as pool,
    ):
        pool.resolve(a0)
        pool.resolve(a1)
        pool.resolve(d)
        policy = pool._actor.policy
        assert isinstance(policy, ScheduledPolicy)
        point.armed.set()
        evicting = threading.Thread(target=pool.evict, args=(d,))
        evicting.start()
        assert point.paused.wait(10)
        hits = pool.stats().hits
        pool.resolve(d)  # a hit: d is still served
        assert pool.stats().hits == hits + 1
        point.go()
        evicting.join(10)
        assert not evicting.is_alive()
        collected = weakref.ref(d)
        del evicting, d
        assert collected() is None
        pool.stats()  # a step
        assert policy._learning == [id(a0), id(a1)]
        pool.resolve(a0)  # a hit: the pass is over at the next step
        pool.flush()
        assert policy._order == [id(a0), id(a1)]
        check_invariants(pool)


def test_a_handle_waited_on_the_loop_thread_after_a_write_says_to_await_it(
    tmp_path: Path,
) -> None:
    """A prefetch's handle whose load ended, then a write of the tensor: the value is read
    again, which ``wait()`` on the pool's own loop thread cannot block for; ``await`` can,
    and gives the written value."""
    (t,) = make_tensors(tmp_path, 1, numel=64)

    async def main() -> None:
        async with TensorResidencyPool() as pool:
            handle = pool.prefetch(t)
            assert (await handle)[0].item() == 0.0
            t.update_values(torch.full((64,), 7.0))
            assert handle.done()
            with pytest.raises(T2NErrorMisuse, match="use `await handle`"):
                handle.wait()
            assert (await handle)[0].item() == 7.0

    asyncio.run(main())
