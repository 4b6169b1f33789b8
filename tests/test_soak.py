"""Load under pressure: a bounded soak of async tasks and threads sharing one small pool.

Thousands of small offloaded tensors, a budget of a few dozen of them, and workers of both
faces (tasks on the pool's loop, threads through the sync shim) doing random leases (``read``
and ``read_write`` ones adding a known increment), resolves, prefetches, pins, unpins,
evictions, flushes and cancelled requests (``anyio.move_on_after``). A reference model counts
the increments. Checks, during the run: every lease sees exactly the reference value, every
resolve a value between the reference before and after the request, the pool invariants hold
(checked on the loop thread every 50 ms); after it: every payload on disk equals the
reference, ``resident_bytes`` is exact and ``stats()`` agrees with what the workers did.

``T2N_SOAK_SECONDS`` sets the duration (10 s, or 60 s under ``T2N_STRESS=1``), split between
asyncio and uvloop and between the LRU and SCHEDULED strategies.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from interrupts import CtrlCTimer, finalizer_interrupts_counted
from residency_checks import check_invariants, on_disk
from stress.figures import record, scaled, soak_seconds

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import ResidencyStrategy, TensorResidencyPool

NUMEL = 64
NBYTES = NUMEL * 4
TENSORS = scaled(2000, 4000)
HOT = 40  # half of the requests go to these, so that hits happen
BUDGET = 48 * NBYTES
MAX_PINS = 6
ASYNC_WORKERS = 4
THREAD_WORKERS = 2

LONG_CASES = [
    ("asyncio", ResidencyStrategy.LRU),
    ("uvloop", ResidencyStrategy.LRU),
    ("asyncio", ResidencyStrategy.SCHEDULED),
]
CASES = LONG_CASES
"""Every case runs in ``make test`` too (a few seconds each): a race that only uvloop's
scheduling or SCHEDULED's evictions expose is not left to the long mode."""

WEIGHTS = {
    "read": 24,
    "read_write": 26,
    "resolve": 14,
    "prefetch": 8,
    "pin": 3,
    "unpin": 4,
    "evict": 5,
    "flush_one": 2,
    "flush_all": 1,
    "inline": 1,  # async workers only: a sync call on the loop thread
    "scope": 4,  # async workers only: a torch op in a worker thread, inside pool.scope()
}
ASYNC_ONLY = frozenset({"inline", "scope"})


@dataclass
class World:
    """The tensors, the reference model and what the workers did."""

    tensors: list[OffloadedTensor]
    locks: list[threading.Lock]
    expected: list[int]
    pins: set[int] = field(default_factory=set)
    pins_lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)
    counts_lock: threading.Lock = field(default_factory=threading.Lock)
    modified: set[int] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, worker_counts: Counter[str]) -> None:
        with self.counts_lock:
            self.counts.update(worker_counts)

    def check_leased(self, index: int, value: torch.Tensor) -> None:
        """A leased value is the reference value exactly (mutations hold the same lock)."""
        with self.locks[index]:
            wanted = float(index + self.expected[index])
            assert value.shape == (NUMEL,) and bool((value == wanted).all()), (
                f"tensor {index}: leased value {value[0].item()} (min {value.min().item()}, "
                f"max {value.max().item()}), reference {wanted}"
            )

    def increment(self, index: int, value: torch.Tensor, amount: int) -> None:
        with self.locks[index]:
            wanted = float(index + self.expected[index])
            assert bool((value == wanted).all()), f"tensor {index}: lost update before writing"
            value.add_(amount)
            self.expected[index] += amount
            self.modified.add(index)

    def check_resolved(self, index: int, value: torch.Tensor, before: int) -> None:
        """A resolved value reflects a state between the request and now (never older)."""
        with self.locks[index]:
            first = value[0].item()
            assert bool((value == first).all()), f"tensor {index}: torn value"
            assert index + before <= first <= index + self.expected[index], (
                f"tensor {index}: resolved {first}, reference went {index + before} -> "
                f"{index + self.expected[index]}"
            )


def make_world(directory: Path) -> World:
    tensors = []
    for index in range(TENSORS):
        name, sid = f"layer.{index}.weight", f"soak{index}"
        path = storage.payload_path(directory, name, sid)
        storage.write_payload(path, {"tensor": torch.full((NUMEL,), float(index))}, fsync=False)
        tensors.append(OffloadedTensor(None, "cpu", directory, name, storage_id=sid))
    return World(tensors, [threading.Lock() for _ in tensors], [0] * TENSORS)


def pick(rng: random.Random) -> int:
    return rng.randrange(HOT) if rng.random() < 0.5 else rng.randrange(TENSORS)


def pick_op(rng: random.Random, in_loop: bool) -> str:
    names = [n for n in WEIGHTS if in_loop or n not in ASYNC_ONLY]
    return rng.choices(names, weights=[WEIGHTS[n] for n in names])[0]


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------
async def async_worker(pool: TensorResidencyPool, world: World, seed: int) -> None:
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    try:
        while not world.stop.is_set():
            op = pick_op(rng, in_loop=True)
            index = pick(rng)
            tensor = world.tensors[index]
            cancel = rng.random() < 0.3
            with anyio.move_on_after(rng.uniform(0, 0.003) if cancel else None) as scope:
                await run_async_op(pool, world, op, index, tensor, rng, counts)
            counts[op] += 1
            counts["cancelled"] += scope.cancelled_caught
            await anyio.lowlevel.checkpoint()
    finally:
        world.count(counts)


async def run_async_op(
    pool: TensorResidencyPool,
    world: World,
    op: str,
    index: int,
    tensor: OffloadedTensor,
    rng: random.Random,
    counts: Counter[str],
) -> None:
    if op in ("read", "read_write", "resolve", "inline"):
        counts["requests"] += 1  # counted by the pool before any await: cancelled or not
    if op == "read":
        async with pool.acquire(tensor) as value:
            world.check_leased(index, value)
    elif op == "read_write":
        async with pool.acquire(tensor, mode="read_write") as value:
            world.increment(index, value, rng.randint(1, 3))
            counts["increments"] += 1
    elif op == "resolve":
        before = world.expected[index]
        world.check_resolved(index, await pool.aresolve(tensor), before)
    elif op == "inline":  # a torch forward run directly on the loop thread
        with pool.acquire(tensor) as value:
            world.check_leased(index, value)
    elif op == "scope":
        before = world.expected[index]

        def forward() -> torch.Tensor:
            counts["requests"] += 1  # a cancellation may come before the thread starts
            return torch.clone(tensor)

        with pool.scope():
            result = await anyio.to_thread.run_sync(forward)
        world.check_resolved(index, result, before)
    elif op == "prefetch":
        counts["loads_requested"] += 1
        handle = pool.prefetch(tensor)
        if rng.random() < 0.5:
            await handle
    elif op == "pin":
        await pin(pool, world, index, counts)
    elif op == "unpin":
        await unpin(pool, world, rng, counts)
    elif op == "evict":
        try:
            await pool.aevict(tensor)
        except T2NErrorMisuse:
            counts["evict_refused"] += 1  # leased or pinned by another worker
    elif op == "flush_one":
        await pool.aflush(tensor)
    else:
        await pool.aflush()


async def pin(pool: TensorResidencyPool, world: World, index: int, counts: Counter[str]) -> None:
    with world.pins_lock:
        if len(world.pins) >= MAX_PINS:
            return
        world.pins.add(index)
    counts["loads_requested"] += 1
    await pool.pin(world.tensors[index])


async def unpin(
    pool: TensorResidencyPool, world: World, rng: random.Random, counts: Counter[str]
) -> None:
    with world.pins_lock:
        if not world.pins:
            return
        index = rng.choice(sorted(world.pins))
        world.pins.discard(index)
    await pool.aunpin(world.tensors[index])


def thread_worker(pool: TensorResidencyPool, world: World, seed: int) -> None:
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    try:
        while not world.stop.is_set():
            op = pick_op(rng, in_loop=False)
            index = pick(rng)
            tensor = world.tensors[index]
            if op in ("read", "read_write", "resolve"):
                counts["requests"] += 1
            if op == "read":
                with pool.acquire(tensor) as value:
                    world.check_leased(index, value)
            elif op == "read_write":
                with pool.acquire(tensor, mode="read_write") as value:
                    world.increment(index, value, rng.randint(1, 3))
                    counts["increments"] += 1
            elif op == "resolve":
                before = world.expected[index]
                world.check_resolved(index, pool.resolve(tensor), before)
            elif op == "prefetch":
                counts["loads_requested"] += 1
                handle = pool.prefetch(tensor)
                if rng.random() < 0.5:
                    handle.wait()
            elif op == "pin":
                with world.pins_lock:
                    if len(world.pins) >= MAX_PINS:
                        continue
                    world.pins.add(index)
                counts["loads_requested"] += 1
                pool.pin(tensor).wait()
            elif op == "unpin":
                with world.pins_lock:
                    if not world.pins:
                        continue
                    chosen = rng.choice(sorted(world.pins))
                    world.pins.discard(chosen)
                pool.unpin(world.tensors[chosen])
            elif op == "evict":
                try:
                    pool.evict(tensor)
                except T2NErrorMisuse:
                    counts["evict_refused"] += 1
            elif op == "flush_one":
                pool.flush(tensor)
            else:
                pool.flush()
            counts[op] += 1
    finally:
        world.count(counts)


# ---------------------------------------------------------------------------------------------
# The soak
# ---------------------------------------------------------------------------------------------
def reporting(
    failures: list[BaseException], stop: threading.Event, target: Callable[..., None], *args: Any
) -> Callable[[], None]:
    """``target(*args)`` for a worker thread: what it raises is kept, and stops the others."""

    def run() -> None:
        try:
            target(*args)
        except BaseException as error:
            failures.append(error)
            stop.set()

    return run


async def soak(
    pool: TensorResidencyPool, world: World, seconds: float, seed: int
) -> dict[str, Any]:
    failures: list[BaseException] = []
    invariant_checks = 0

    def guarded(target: Callable[..., None], *args: Any) -> Callable[[], None]:
        return reporting(failures, world.stop, target, *args)

    async def guarded_async(factory: Callable[[], Awaitable[None]]) -> None:
        try:
            await factory()
        except BaseException as error:
            failures.append(error)
            world.stop.set()

    async with pool:
        threads = [
            threading.Thread(
                target=guarded(thread_worker, pool, world, seed * 100 + n), name=f"soak-{n}"
            )
            for n in range(THREAD_WORKERS)
        ]
        for thread in threads:
            thread.start()
        async with anyio.create_task_group() as group:
            for n in range(ASYNC_WORKERS):
                group.start_soon(
                    guarded_async,
                    lambda n=n: async_worker(pool, world, seed * 100 + 50 + n),
                )
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not world.stop.is_set():
                await anyio.sleep(0.05)
                check_invariants(pool)
                invariant_checks += 1
            world.stop.set()
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join, 30)
            assert not thread.is_alive()
        if failures:
            raise failures[0]
        for tensor in world.tensors:
            if pool.is_pinned(tensor):
                await pool.aunpin(tensor)
        await pool.aflush()
        check_invariants(pool)
        invariant_checks += 1
        resident = pool.resident_bytes
        entries = [e for e in pool._actor.entries.values() if e.value is not None]
        assert resident == NBYTES * len(entries) == sum(e.nbytes for e in entries)
        assert resident <= BUDGET
    return {"invariant_checks": invariant_checks}


@pytest.mark.parametrize(("loop", "strategy"), CASES, ids=[f"{lp}-{s.name}" for lp, s in CASES])
@pytest.mark.timeout(int(soak_seconds()) + 120)
def test_soak_mixed_tasks_and_threads(
    tmp_path: Path, loop: str, strategy: ResidencyStrategy
) -> None:
    seconds = soak_seconds() / len(CASES)
    world = make_world(tmp_path)
    pool = TensorResidencyPool(max_cached_bytes=BUDGET, max_workers=2, strategy=strategy)
    seed = 1 + CASES.index((loop, strategy))
    started = time.perf_counter()
    figures = anyio.run(
        soak,
        pool,
        world,
        seconds,
        seed,
        backend="asyncio",
        backend_options={"use_uvloop": loop == "uvloop"},
    )
    elapsed = time.perf_counter() - started
    counts = world.counts

    # After close: nothing resident, every payload on disk is the reference value.
    assert pool.closed and pool.resident_bytes == 0
    for index, tensor in enumerate(world.tensors):
        value = storage.read_payload(storage.read_layout(tensor.offload_path))["tensor"]
        assert torch.equal(value, torch.full((NUMEL,), float(index + world.expected[index]))), (
            f"tensor {index}: {value[0].item()} on disk, reference {index + world.expected[index]}"
        )

    # The counters agree with what the workers did.
    stats = pool.stats()
    assert stats.load_errors == 0
    assert stats.hits + stats.misses == counts["requests"]
    assert stats.bytes_read == stats.loads * NBYTES
    assert stats.loads <= stats.misses + counts["loads_requested"]
    assert stats.evictions <= stats.loads
    assert stats.bytes_written == stats.write_backs * NBYTES
    assert len(world.modified) <= stats.write_backs <= counts["increments"]
    assert counts["increments"] > 0 and stats.hits > 0 and stats.evictions > 0
    operations = sum(counts[op] for op in WEIGHTS)
    assert operations > 20 * seconds
    record(
        f"soak_{loop}_{strategy.name}",
        seconds=round(elapsed, 1),
        tensors=TENSORS,
        operations=operations,
        increments=counts["increments"],
        cancelled=counts["cancelled"],
        faults=counts["cancelled"],
        evict_refused=counts["evict_refused"],
        hits=stats.hits,
        misses=stats.misses,
        loads=stats.loads,
        evictions=stats.evictions,
        write_backs=stats.write_backs,
        reused_buffers=stats.reused_buffers,
        invariant_checks=figures["invariant_checks"],
        payloads_verified=TENSORS,
        lost=0,
    )


# ---------------------------------------------------------------------------------------------
# The budget while a value is taken back from its eviction (a race the soak found)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rescue", ["lease", "pin"])
@pytest.mark.asyncio
async def test_taking_back_a_value_being_evicted_keeps_the_budget(
    tmp_path: Path, rescue: str
) -> None:
    a, b, c = (
        OffloadedTensor.from_original_tensor(torch.full((NUMEL,), float(i)), f"w{i}", tmp_path)
        for i in range(3)
    )
    async with TensorResidencyPool(max_cached_bytes=2 * NBYTES) as pool:
        async with pool.acquire(a, mode="read_write") as value:
            value.add_(1)
        async with pool.acquire(b):
            pass
        async with pool.acquire(c):  # loading c evicts a, the least recent: a write-back starts
            pass
        check_invariants(pool)
        entry = pool._actor.entries[id(a)]
        assert entry.evicting and entry.write is not None
        # No await from here on: the write-back cannot complete before the checks.
        if rescue == "lease":
            async with pool.acquire(a) as value:
                assert not entry.evicting and value[0].item() == 1.0
                check_invariants(pool)
        else:
            pool.pin(a)
            assert not entry.evicting
            check_invariants(pool)
    assert torch.equal(a._reload_unmanaged(), torch.full((NUMEL,), 1.0))


# ---------------------------------------------------------------------------------------------
# Program order under direct writes, dtype changes, cancellations from another loop, interrupts
# ---------------------------------------------------------------------------------------------
ORDER_TENSORS = 8
ORDER_NUMEL = 256
DTYPES = (torch.float32, torch.float64)


@dataclass
class Ordered:
    """The reference model: each tensor's latest write, in program order.

    Every operation that writes a tensor (a ``read_write`` lease, ``update_values``,
    ``copy_``, ``to(dtype)``) runs under that tensor's lock, which orders it; the model
    records its result. Reads outside the locks (the interrupted worker's) check that a value
    is whole and of a known dtype.
    """

    tensors: list[OffloadedTensor]
    locks: list[threading.Lock]
    values: list[int]
    dtypes: list[torch.dtype]
    counts: Counter[str] = field(default_factory=Counter)
    counts_lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, name: str) -> None:
        with self.counts_lock:
            self.counts[name] += 1

    def expect(self, index: int, value: torch.Tensor, what: str) -> None:
        wanted = torch.full((ORDER_NUMEL,), float(self.values[index]), dtype=self.dtypes[index])
        assert value.dtype == wanted.dtype and torch.equal(value, wanted), (
            f"tensor {index} after {what}: {value.dtype} {value[0].item()}, program order "
            f"says {wanted.dtype} {self.values[index]}"
        )


def ordered_step(pool: TensorResidencyPool, world: Ordered, rng: random.Random) -> None:
    """One operation of a writer thread, under the lock of the tensor it writes."""
    index = rng.randrange(ORDER_TENSORS)
    tensor = world.tensors[index]
    op = rng.choice(["read_write", "read_write", "update_values", "copy_", "to", "resolve"])
    op = op if rng.random() < 0.9 else rng.choice(["flush", "evict"])
    with world.locks[index]:
        if op == "read_write":
            with pool.acquire(tensor, mode="read_write") as value:
                world.expect(index, value, "a read_write lease")
                value.add_(1)
                world.values[index] += 1
        elif op in ("update_values", "copy_"):
            new = rng.randrange(1000)
            full = torch.full((ORDER_NUMEL,), float(new), dtype=world.dtypes[index])
            tensor.update_values(full) if op == "update_values" else tensor.copy_(full)
            world.values[index] = new
        elif op == "to":
            other = DTYPES[1 - DTYPES.index(world.dtypes[index])]
            tensor.to(other)
            world.dtypes[index] = other
        elif op == "resolve":
            world.expect(index, pool.resolve(tensor), "resolve")
        elif op == "flush":
            pool.flush(tensor)
        else:
            try:
                pool.evict(tensor)
            except T2NErrorMisuse:
                world.count("evict_refused")  # leased by the interrupted worker
    world.count(op)


def ordered_writer(pool: TensorResidencyPool, world: Ordered, seed: int) -> None:
    rng = random.Random(seed)
    while not world.stop.is_set():
        ordered_step(pool, world, rng)


def impatient_loop(pool: TensorResidencyPool, world: Ordered, seed: int) -> None:
    """A second event loop whose requests time out at random (cancelled from its side)."""
    rng = random.Random(seed)

    async def increment(index: int) -> None:
        async with pool.acquire(world.tensors[index], mode="read_write") as value:
            world.expect(index, value, "a read_write lease from another loop")
            value.add_(1)
            world.values[index] += 1

    async def run() -> None:
        while not world.stop.is_set():
            index = rng.randrange(ORDER_TENSORS)
            resolving = rng.random() < 0.5
            with world.locks[index]:  # this loop runs this task only: blocking it is fine
                request = pool.aresolve(world.tensors[index]) if resolving else increment(index)
                try:
                    result = await asyncio.wait_for(request, rng.uniform(0, 0.002))
                except TimeoutError:
                    world.count("timed_out")
                    continue
                if resolving:
                    world.expect(index, result, "a resolve from another loop")
            world.count("other_loop")

    asyncio.run(run())


def interrupted_reads(pool: TensorResidencyPool, world: Ordered, seconds: float) -> int:
    """Blocking leases in the main thread, with Ctrl-C (KeyboardInterrupt) landing anywhere."""
    rng = random.Random(7)
    interrupted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not world.stop.is_set():
        timer = CtrlCTimer(rng.uniform(0, 0.002))
        try:  # an interrupt may land anywhere in the round, even once the leases ended
            try:
                timer.arm()
                for index in rng.sample(range(ORDER_TENSORS), 3):
                    with pool.acquire(world.tensors[index]) as value:
                        first = value.flatten()[0]
                        assert value.dtype in DTYPES and bool((value == first).all())
            finally:
                timer.stop()
            time.sleep(0.001)
            sum(range(10))  # a pending interrupt is raised here at the latest
        except KeyboardInterrupt:
            interrupted += 1
            with contextlib.suppress(KeyboardInterrupt):
                sum(range(10))
    return interrupted


def ordered_world(directory: Path) -> Ordered:
    tensors = [
        OffloadedTensor.from_original_tensor(torch.zeros(ORDER_NUMEL), f"o{i}", directory)
        for i in range(ORDER_TENSORS)
    ]
    return Ordered(
        tensors,
        [threading.Lock() for _ in tensors],
        [0] * ORDER_TENSORS,
        [torch.float32] * ORDER_TENSORS,
    )


ORDER_BUDGET = 3 * ORDER_NUMEL * 4  # three float32 values: evictions and write-backs happen


@pytest.mark.parametrize("pools", [1, 2])
@pytest.mark.parametrize("seed", [1, 3, 5])
@pytest.mark.timeout(60)
def test_one_thread_of_writes_lands_in_program_order(tmp_path: Path, seed: int, pools: int) -> None:
    """Leases, direct writes and dtype changes in one thread, each step through one of
    ``pools`` pools, while their I/O workers load and write back: every request and every
    file sees the latest write."""
    world = ordered_world(tmp_path)
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        opened = [
            stack.enter_context(TensorResidencyPool(max_cached_bytes=ORDER_BUDGET, max_workers=2))
            for _ in range(pools)
        ]
        for _ in range(scaled(1200, 10000)):
            ordered_step(rng.choice(opened), world, rng)
        for pool in opened:
            check_invariants(pool)
    for index, tensor in enumerate(world.tensors):
        world.expect(index, on_disk(tensor), "close")
    assert min(world.counts[op] for op in ("read_write", "update_values", "copy_", "to")) > 0


@pytest.mark.timeout(int(soak_seconds()) + 60)
def test_soak_writes_land_in_program_order(tmp_path: Path) -> None:
    seconds = max(2.0, soak_seconds() * 0.4)
    world = ordered_world(tmp_path)
    tensors = world.tensors
    failures: list[BaseException] = []

    def guarded(target: Callable[..., None], *args: Any) -> threading.Thread:
        return threading.Thread(target=reporting(failures, world.stop, target, *args))

    with (
        TensorResidencyPool(max_cached_bytes=ORDER_BUDGET, max_workers=2) as pool,
        TensorResidencyPool(max_cached_bytes=ORDER_BUDGET, max_workers=2) as other,
        TensorResidencyPool(max_cached_bytes=ORDER_BUDGET, max_workers=2) as reading,
    ):
        # The second writer writes through another pool: each pool sees the other's changes.
        workers = [guarded(ordered_writer, used, world, n) for n, used in ((1, pool), (2, other))]
        workers.append(guarded(impatient_loop, pool, world, 3))
        for worker in workers:
            worker.start()
        try:
            # Through a pool of their own: a read lease shares its value with the same pool's
            # read_write leases, whose changes it sees as they are made (torn, mid-add_).
            with finalizer_interrupts_counted() as in_finalizers:
                interrupted = interrupted_reads(reading, world, seconds)
        finally:
            world.stop.set()
            for worker in workers:
                worker.join(30)
        assert not any(worker.is_alive() for worker in workers), "a worker hangs"
        if failures:
            raise failures[0]
        for used in (pool, other, reading):
            check_invariants(used)
            assert "leased: 0," in repr(used), "an interrupted or cancelled request leaked a lease"
    # After close: every file holds the latest write of its tensor, in its latest dtype.
    for index, tensor in enumerate(tensors):
        world.expect(index, on_disk(tensor), "close")
    counts = world.counts
    assert interrupted > 0 and counts["timed_out"] > 0 and counts["other_loop"] > 0
    assert min(counts[op] for op in ("read_write", "update_values", "copy_", "to")) > 0
    record(
        "soak_program_order",
        seconds=seconds,
        interrupted=interrupted,
        interrupts_in_finalizers=in_finalizers[0],
        **{name: counts[name] for name in sorted(counts)},
    )
