"""Leaks: pools and offloaded tensors give back every thread, descriptor, byte and file.

A thousand pools are created, used a little and closed, through ``with pool:`` (each starts
and stops its own loop thread) and ``async with pool:`` (each runs in the caller's loop).
Afterwards no pool object survives a garbage collection, no thread or file descriptor is left,
and the resident memory does not grow from the 100th pool to the 1000th beyond noise. An
``OffloadedTensor`` that is garbage collected removes its own payload file and only it. Pools
dropped inside an ``async with`` block whose loop closed are closed by the next pool created:
their workers stop, their values go and their changes reach the files.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch
from breakpoints import Breakpoint, line_of, paused_in_new_threads
from forking import in_forked_child
from residency_checks import check_invariants, io_threads_since, on_disk
from stress.figures import record, scaled

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool, _runtime
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._state import Job

POOLS = scaled(1000, 5000)
FIRST = 100
NUMEL = 64
RSS_NOISE = 6 << 20
"""Growth of the resident set from the 100th pool to the last that counts as noise: about
7 KiB per pool over 900 pools (measured: about 2 MiB for sync pools, whose loop threads come
and go, none for async ones). A planted leak of 16 KiB per pool (random bytes kept in a module
list at each ``close()``: 14 MiB) failed both tests."""
OBJECT_NOISE = 500
"""Growth of the number of gc-tracked objects from the 100th pool to the last, likewise (the
probe's own weak references not counted)."""


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def settled(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    """Whether ``condition`` holds within ``seconds`` (threads take a moment to end, longer
    on a loaded machine; a condition that holds returns at once)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


_PREEXISTING: set[int] = set()


def pool_threads() -> list[threading.Thread]:
    """Pool loop threads started by this module's tests (not ones other tests left running)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("t2n-") and t.ident not in _PREEXISTING
    ]


@pytest.fixture(autouse=True)
def _existing_threads() -> None:
    _PREEXISTING.clear()
    _PREEXISTING.update(t.ident for t in threading.enumerate() if t.ident is not None)


def make_tensors(directory: Path) -> list[OffloadedTensor]:
    return [
        OffloadedTensor.from_original_tensor(torch.full((NUMEL,), float(i)), f"w{i}", directory)
        for i in range(3)
    ]


class Probe:
    """Samples threads, descriptors, RSS and gc objects, and keeps weak references to pools."""

    def __init__(self) -> None:
        self.pools: list[weakref.ref[TensorResidencyPool]] = []
        self.rss_first = self.objects_first = 0

    def track(self, pool: TensorResidencyPool, number: int) -> None:
        self.pools.append(weakref.ref(pool))
        if number == FIRST:
            gc.collect()
            self.rss_first = psutil.Process().memory_info().rss
            self.objects_first = len(gc.get_objects())

    def growth(self) -> tuple[int, int]:
        gc.collect()
        rss = psutil.Process().memory_info().rss - self.rss_first
        own = len(self.pools) - FIRST  # weak references taken since the first sample
        return rss, len(gc.get_objects()) - self.objects_first - own


def one_sync_pool(tensors: list[OffloadedTensor], number: int) -> TensorResidencyPool:
    with TensorResidencyPool(max_cached_bytes=2 * NUMEL * 4) as pool:
        assert torch.equal(pool.resolve(tensors[0]), torch.zeros(NUMEL))
        with pool.acquire(tensors[1]) as value:
            assert value[0].item() == 1.0
        pool.prefetch(tensors[2]).wait()
        if number % 50 == 0:  # now and then a write-back
            with pool.acquire(tensors[2], mode="read_write") as value:
                value.add_(0)
            pool.flush()
    return pool


async def one_async_pool(tensors: list[OffloadedTensor], number: int) -> TensorResidencyPool:
    async with TensorResidencyPool(max_cached_bytes=2 * NUMEL * 4) as pool:
        assert torch.equal(await pool.aresolve(tensors[0]), torch.zeros(NUMEL))
        async with pool.acquire(tensors[1]) as value:
            assert value[0].item() == 1.0
        await pool.prefetch(tensors[2])
        if number % 50 == 0:
            async with pool.acquire(tensors[2], mode="read_write") as value:
                value.add_(0)
            await pool.aflush()
    return pool


def check_no_leak(probe: Probe, fds: set[str], threads: int, face: str) -> None:
    assert settled(lambda: not pool_threads()), f"threads left: {pool_threads()}"
    assert settled(lambda: threading.active_count() <= threads), threading.enumerate()
    assert settled(lambda: all(ref() is None for ref in probe.pools)), "pools survive gc"
    leaked = open_fds() - fds
    assert settled(lambda: not open_fds() - fds), f"descriptors left: {leaked}"
    rss, objects = probe.growth()
    assert rss < RSS_NOISE, f"RSS grew by {rss >> 20} MiB from pool {FIRST} to pool {POOLS}"
    assert objects < OBJECT_NOISE, f"{objects} more gc objects from pool {FIRST} to {POOLS}"
    record(
        f"leaks_{face}",
        pools=POOLS,
        operations=POOLS * 3 + POOLS // 50,
        rss_growth_kib=rss >> 10,
        object_growth=objects,
    )


@pytest.mark.timeout(120 + POOLS // 20)
def test_a_thousand_sync_pools_leave_nothing_behind(tmp_path: Path) -> None:
    """No thread, descriptor, pool object or memory left (a 16 KiB leak per pool fails it:
    see ``RSS_NOISE``)."""
    tensors = make_tensors(tmp_path)
    one_sync_pool(tensors, 0)  # warm-up: lazily created module state is not a leak
    assert settled(lambda: not pool_threads())
    fds, threads = open_fds(), threading.active_count()
    probe = Probe()
    for number in range(1, POOLS + 1):
        probe.track(one_sync_pool(tensors, number), number)
        assert not pool_threads() or settled(lambda: not pool_threads(), 1.0)
    check_no_leak(probe, fds, threads, "sync")


@pytest.mark.timeout(120 + POOLS // 20)
def test_a_thousand_async_pools_leave_nothing_behind(tmp_path: Path) -> None:
    """Likewise for pools run in the caller's loop (``RSS_NOISE`` says what fails it)."""
    tensors = make_tensors(tmp_path)

    async def main() -> tuple[Probe, set[str], int]:
        await one_async_pool(tensors, 0)  # warm-up: the loop's worker threads start here
        fds, threads = open_fds(), threading.active_count()
        probe = Probe()
        for number in range(1, POOLS + 1):
            probe.track(await one_async_pool(tensors, number), number)
        assert threading.active_count() <= threads + 1, threading.enumerate()
        return probe, fds, threads

    probe, fds, threads = anyio.run(main)
    check_no_leak(probe, fds, threads, "async")


# ---------------------------------------------------------------------------------------------
# Files of garbage-collected tensors
# ---------------------------------------------------------------------------------------------
def test_a_collected_tensor_removes_its_own_file_and_only_it(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    first, second = make_tensors(offload_dir)[:2]
    checkpoint = tmp_path / "model.safetensors"
    storage.write_payload(checkpoint, {"a": torch.ones(4), "b": torch.zeros(4)})
    pointer = OffloadedTensor.from_safetensors(checkpoint, "a", offload_dir=offload_dir)
    copied = OffloadedTensor.from_safetensors(checkpoint, "b", offload_dir=offload_dir)
    copied.update_values(torch.full((4,), 7.0))  # copy on write into offload_dir
    bystander = offload_dir / "notes.txt"
    bystander.write_text("not a payload")
    files = {name: t.offload_path for name, t in [("first", first), ("second", second)]}
    files["copied"] = copied.offload_path
    assert files["copied"].parent == offload_dir.resolve()

    def present() -> set[str]:
        return {name for name, path in files.items() if path.exists()}

    del first
    gc.collect()
    assert present() == {"second", "copied"}
    del copied
    gc.collect()
    assert present() == {"second"}
    del pointer
    gc.collect()
    assert checkpoint.exists() and bystander.exists()
    assert torch.equal(storage.read_payload(storage.read_layout(checkpoint))["b"], torch.zeros(4))

    # A pool does not keep a tensor (or its file) alive once closed.
    with TensorResidencyPool() as pool, pool.acquire(second, mode="read_write") as value:
        value.add_(1)
    reference = weakref.ref(second)
    del second, pool, value
    gc.collect()
    assert reference() is None
    assert present() == set()
    assert sorted(os.listdir(offload_dir)) == ["notes.txt"]


def test_private_directory_lives_as_long_as_its_tensors() -> None:
    first = OffloadedTensor.from_original_tensor(torch.zeros(2), "a")
    second = OffloadedTensor.from_original_tensor(torch.ones(2), "b")
    directory = first.offload_path.parent
    assert second.offload_path.parent == directory
    del first
    gc.collect()
    owner_lock = ".t2n-owner.lock"  # held while the process lives (see storage)
    assert sorted(os.listdir(directory)) == sorted([owner_lock, second.offload_path.name])
    del second
    gc.collect()
    assert not directory.exists()


def test_a_thousand_tensors_created_and_collected_leave_no_file(tmp_path: Path) -> None:
    fds = open_fds()
    for index in range(scaled(1000, 5000)):
        tensor = OffloadedTensor.from_original_tensor(torch.full((4,), float(index)), "w", tmp_path)
        if index % 100 == 0:
            assert tensor.reload()[0].item() == index
        del tensor
    gc.collect()
    assert os.listdir(tmp_path) == []
    assert settled(lambda: not open_fds() - fds)


# ---------------------------------------------------------------------------------------------
# Pools dropped inside an `async with` block whose loop closed
# ---------------------------------------------------------------------------------------------
STRANDED = 5


def strand_and_drop(tensors: list[OffloadedTensor], mode: str) -> list[weakref.ref[torch.Tensor]]:
    """Serve a new pool per tensor with ``async with pool`` in a task of a loop that is then
    closed with the task still inside the block (its lease of the tensor ended: with
    ``read_write``, after adding 1), then drop the pools and tasks, all at once (a pool
    created or entered meanwhile would close those dropped before). Returns weak references
    to the values the leases handed out."""
    pools = [TensorResidencyPool() for _ in tensors]
    held: list[weakref.ref[torch.Tensor]] = []

    async def serve(pool: TensorResidencyPool, tensor: OffloadedTensor, inside: Any) -> None:
        async with pool:
            async with pool.acquire(tensor, mode=mode) as value:  # type: ignore[arg-type]
                if mode == "read_write":
                    value.add_(1)
                held.append(weakref.ref(value))
            inside.set()
            await asyncio.Event().wait()

    for pool, tensor in zip(pools, tensors, strict=True):
        loop = asyncio.new_event_loop()
        inside = asyncio.Event()
        task = loop.create_task(serve(pool, tensor, inside))
        loop.run_until_complete(inside.wait())
        loop.close()  # the task is left pending inside `async with pool`
        task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
        del task
    del pools, pool
    gc.collect()
    return held


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_stranded_pools_dropped_with_changes_write_them_back_and_stop(tmp_path: Path) -> None:
    """A finalizer closes nothing itself (it may run on any thread, amid anything): it leaves
    the pool to the reaper that the next pool created starts. Their workers then stop and
    their changes reach the files, long before interpreter exit."""
    tensors = [
        OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), f"s{i}", tmp_path)
        for i in range(STRANDED)
    ]
    before = set(threading.enumerate())
    strand_and_drop(tensors, "read_write")
    workers = io_threads_since(before)
    assert len(workers) == STRANDED  # still running: nothing closed them yet
    TensorResidencyPool().close()
    assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    for tensor in tensors:
        assert torch.equal(on_disk(tensor), torch.ones(NUMEL))
        assert torch.equal(tensor.reload(), torch.ones(NUMEL))
    assert settled(lambda: not pool_threads()), pool_threads()  # the reaper ended too


@pytest.mark.timeout(60)
def test_stranded_pools_dropped_read_only_release_their_values(tmp_path: Path) -> None:
    """Nothing to write: the reaper still stops their workers and drops their values."""
    tensor = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "r", tmp_path)
    before = set(threading.enumerate())
    values = strand_and_drop([tensor] * STRANDED, "read")
    workers = io_threads_since(before)
    assert len(workers) == STRANDED
    assert all(value() is not None for value in values)  # each held by its dropped pool
    with TensorResidencyPool():
        pass
    assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    assert settled(lambda: all(value() is None for value in values))
    assert settled(lambda: not pool_threads()), pool_threads()


def task_until_paused(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, None], point: Breakpoint
) -> asyncio.Task[None]:
    """``coroutine`` as a task of ``loop``, run until a new thread pauses at ``point``."""
    point.armed.set()
    task = loop.create_task(coroutine)
    while not point.paused.is_set():
        loop.run_until_complete(asyncio.sleep(0.01))
    return task


def strand_with_a_load_end(
    pool: TensorResidencyPool,
    tensor: OffloadedTensor,
    while_loading: Callable[[], None] = lambda: None,
) -> asyncio.Task[None]:
    """A task inside ``async with pool, pool.acquire(tensor)`` whose loop is closed as the
    lease's load runs (``while_loading`` runs then), the load's end then left for a thread
    to apply (the reaper, once a pool is made): the task, pending for good."""
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        async with pool, pool.acquire(tensor):
            await asyncio.Event().wait()

    with paused_in_new_threads(Job.run.__code__, on="call") as load:
        task = task_until_paused(loop, serve(), load)
        loop.close()
        while_loading()
        load.go()
        assert settled(partial(bool, pool._runtime._ended))
    return task


@contextmanager
def reaper_paused_amid_a_load_end() -> Iterator[Breakpoint]:
    """The reaper, started by a pool's creation, paused amid its transition of a stranded
    pool's load end (see :func:`strand_with_a_load_end`) until the breakpoint's ``go``."""
    line = line_of(Actor._on_loaded, "value = self._keep_loaded(entry, value)")
    with paused_in_new_threads(Actor._on_loaded.__code__, on="line", line=line) as transition:
        transition.armed.set()
        TensorResidencyPool().close()  # starts the reaper
        assert transition.paused.wait(10)
        yield transition


def strand_awaiting_a_load(
    tensor: OffloadedTensor, load_ends: str
) -> tuple[weakref.ref[TensorResidencyPool], list[threading.Thread]]:
    """A task inside ``async with pool`` awaits a lease's load when its loop is closed, the
    load ending after that or before (its end posted to the stopped loop, which never serves
    it). Returns a weak reference to the pool, dropped with the task, and its workers."""
    before = set(threading.enumerate())
    pool = TensorResidencyPool()
    loop = asyncio.new_event_loop()

    async def serve(pool: TensorResidencyPool) -> None:
        async with pool, pool.acquire(tensor):
            await asyncio.Event().wait()

    runtime = pool._runtime
    with paused_in_new_threads(Job.run.__code__, on="call") as load:
        task = task_until_paused(loop, serve(pool), load)
        if load_ends == "after its loop closed":
            loop.close()
        load.go()
        assert settled(partial(bool, runtime._ended))  # the load ended
        loop.close()
    del task, runtime
    return weakref.ref(pool), io_threads_since(before)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("load_ends", ["after its loop closed", "before its loop closed"])
def test_a_stranded_pool_whose_task_awaited_a_load_is_still_closed_once_dropped(
    tmp_path: Path, load_ends: str
) -> None:
    """The end of a load that no loop applies held its waiter (the closed loop's task), and
    so the pool, from the pool's own workers: dropped, the pool was never collected, and its
    workers and values stayed for the process's life. The next pool created hands that end
    to the reaper; the pool is then collected, and the pool created after closes it."""
    tensor = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "w", tmp_path)
    collected, workers = strand_awaiting_a_load(tensor, load_ends)
    assert workers
    gc.collect()
    TensorResidencyPool().close()  # hands the load's end to the reaper
    assert settled(lambda: collected() is None)
    TensorResidencyPool().close()  # starts the reaper for the pool's close
    assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    assert settled(lambda: not pool_threads()), pool_threads()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_stranded_pool_whose_close_was_writing_as_its_loop_closed_stops_its_workers(
    tmp_path: Path,
) -> None:
    """A task awaits ``pool.aclose()`` inside ``async with pool``, its write-back running,
    when the loop closes; everything is dropped. The reaper applies the write's end, which
    ends the close: the change is on disk, and the pool stops serving the closed loop, its
    workers too (they once ran for the process's life, the pool closed but attached)."""
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "w", tmp_path)
    before = set(threading.enumerate())
    pool = TensorResidencyPool()
    loop = asyncio.new_event_loop()

    async def serve(pool: TensorResidencyPool) -> None:
        async with pool:
            async with pool.acquire(tensor, mode="read_write") as value:
                value.add_(1)
            await pool.aclose()
            await asyncio.Event().wait()

    runtime = pool._runtime
    with paused_in_new_threads(OffloadedTensor._write_back.__code__, on="call") as write:
        task = task_until_paused(loop, serve(pool), write)
        loop.close()
        write.go()
        assert settled(partial(bool, runtime._ended))  # the write ended, unapplied
    workers = io_threads_since(before)
    assert workers
    del pool, task, runtime
    gc.collect()
    TensorResidencyPool().close()  # hands the write's end to the reaper
    assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    assert torch.equal(on_disk(tensor), torch.ones(NUMEL))
    assert settled(lambda: not pool_threads()), pool_threads()


@pytest.mark.timeout(60)
def test_the_reaper_applying_a_kept_stranded_pools_job_end_holds_off_its_loops_thread(
    tmp_path: Path,
) -> None:
    """A pool stranded on a closed loop, still referenced: the end of a load that ended after
    the loop closed goes to the reaper. The loop's thread, which may still drive the pool
    itself, asks for the value while the reaper is amid that end's transition: it waits for
    it, and the value is loaded once (the two once drove the pool at once: two loads)."""
    tensor = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "w", tmp_path)
    pool = TensorResidencyPool()
    task = strand_with_a_load_end(pool, tensor)
    with reaper_paused_amid_a_load_end() as transition:
        threading.Timer(0.3, transition.go).start()
        assert torch.equal(pool.resolve(tensor), torch.ones(NUMEL))
    reaping = [t for t in threading.enumerate() if t.name == "t2n-residency-reaper"]
    assert settled(lambda: not any(t.is_alive() for t in reaping))
    assert pool.stats().loads == 1
    check_invariants(pool)
    pool.close()
    task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
    del task
    gc.collect()


@pytest.mark.timeout(60)
def test_pools_whose_async_with_block_was_left_are_no_longer_looked_at(tmp_path: Path) -> None:
    """Each pool created or entered looks at the pools served by a loop of the caller's, for
    job ends the reaper must apply: one whose block was left is served by none and drops out
    (kept referenced, it once stayed, making each creation slower than the last)."""
    tensor = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "w", tmp_path)
    kept = [TensorResidencyPool() for _ in range(3)]

    async def serve(pool: TensorResidencyPool) -> None:
        async with pool:
            await pool.aresolve(tensor)

    for pool in kept:
        asyncio.run(serve(pool))
    assert not any(pool._runtime in _runtime._on_callers_loops for pool in kept)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_forked_child_leaves_the_parents_dropped_pools_to_it(tmp_path: Path) -> None:
    """The pools left to the reaper are the parent's, their workers there only: a pool
    created in a forked child starts no reaper; the parent's next pool closes them."""
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "f", tmp_path)
    before = set(threading.enumerate())
    strand_and_drop([tensor], "read_write")
    workers = io_threads_since(before)

    def child() -> str:
        TensorResidencyPool()
        time.sleep(0.2)
        return repr([t.name for t in threading.enumerate() if t.name.startswith("t2n-")])

    assert in_forked_child(child) == "[]"
    assert torch.equal(on_disk(tensor), torch.zeros(NUMEL))  # the child wrote nothing
    TensorResidencyPool()
    assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    assert torch.equal(on_disk(tensor), torch.ones(NUMEL))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_stranded_pool_dropped_whose_write_back_fails_says_so_and_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nobody is left to retry: the failure is logged, the workers stop all the same, and
    the file keeps its earlier, whole value."""
    directory, moved = tmp_path / "d", tmp_path / "moved"
    directory.mkdir()
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "w", directory)
    before = set(threading.enumerate())
    strand_and_drop([tensor], "read_write")
    workers = io_threads_since(before)
    os.rename(directory, moved)  # the directory is gone: the write-back fails with ENOENT
    try:
        TensorResidencyPool()
        assert settled(lambda: not any(t.is_alive() for t in workers)), workers
    finally:
        os.rename(moved, directory)
    assert "could not write its changes back" in caplog.text
    assert torch.equal(on_disk(tensor), torch.zeros(NUMEL))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ender", ["another thread", "the closed loop's thread"])
def test_a_lease_ended_amid_the_reapers_transition_of_a_stranded_pool_waits_for_it(
    tmp_path: Path, ender: str
) -> None:
    """A pool stranded on a closed loop, still referenced: the reaper applies the end of a
    load that ended after the loop closed. A lease ended meanwhile, whose value must leave
    (budget 0), tells the actor once that transition ended, not amid it (the two threads
    once ran the actor at once), on any thread, the closed loop's own included."""
    tensor = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "w", tmp_path)
    other = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "o", tmp_path)
    pool = TensorResidencyPool(0, max_workers=2)
    lease = pool.acquire(other)

    def lease_other() -> None:  # a miss: this thread drives the pool, counts the lease
        assert torch.equal(lease.__enter__(), torch.zeros(NUMEL))

    task = strand_with_a_load_end(pool, tensor, lease_other)
    with reaper_paused_amid_a_load_end() as transition:
        if ender == "another thread":
            ending = threading.Thread(target=lease.__exit__, args=(None, None, None))
            ending.start()
            ending.join(0.3)
            assert ending.is_alive(), "the lease's end ran a transition amid the reaper's"
            transition.go()
            ending.join(10)
            assert not ending.is_alive()
        else:
            threading.Timer(0.3, transition.go).start()
            lease.__exit__(None, None, None)
            assert transition._go.is_set(), "the lease's end ran a transition amid the reaper's"
    assert not pool.is_resident(other)  # not retained: it left as its lease ended
    check_invariants(pool)
    pool.close()
    task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
    del task
    gc.collect()
