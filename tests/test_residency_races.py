"""Races between a lease's owner and what interrupts it, between requests and direct writes,
and between ``read_write`` leases and write-backs, each provoked deterministically.

Interrupts are injected with ``sys.settrace``: a ``KeyboardInterrupt`` raised on entry to
the N-th Python function the owner's thread calls, which is where CPython runs a pending
signal handler (Ctrl-C). Worker threads are paused at a chosen point with
``threading.settrace`` (a debugger's breakpoint): the pool's own code runs unchanged.
Write-backs fail for real: their offload directory is renamed away (ENOENT).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import random
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from breakpoints import Breakpoint, breakpoints_in_new_threads, line_of, paused_in_new_threads
from interrupts import (
    InterruptAt,
    SecondSignalAt,
    collections_by_hand,
    interrupted,
    interrupted_then,
)
from residency_checks import (
    check_invariants,
    io_threads_since,
    on_disk,
    reports_that_raise,
    settle,
)

from torch_to_nnef import _interrupts, _owned
from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    TensorPrefetch,
    TensorResidencyLease,
    TensorResidencyPool,
    _runtime,
    stream_modules,
)
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._requests import Transition

pytestmark = [pytest.mark.timeout(120)]

NUMEL = 4096
NBYTES = NUMEL * 4
_PACKAGE_CODE = "/torch_to_nnef/"


def _tensor(directory: Path, name: str, value: float = 0.0) -> OffloadedTensor:
    return OffloadedTensor.from_original_tensor(
        torch.full((NUMEL,), value), name, offload_dir=directory
    )


def _leased(pool: TensorResidencyPool) -> int:
    check_invariants(pool)  # runs after what threads told the pool without waiting
    return pool._actor.leased_count()


def _stranded_with_a_change(
    pool: TensorResidencyPool, t: OffloadedTensor, value: float
) -> asyncio.Task[None]:
    """Serve ``pool`` on a new loop, whose task changes ``t`` to ``value`` under a
    read_write lease and stays inside `async with pool`; close that loop with the task
    pending. The pool is stranded, its change unwritten. Return the task."""

    async def serve() -> None:
        async with pool:
            async with pool.acquire(t, mode="read_write") as changed:
                changed.fill_(value)
            await asyncio.Event().wait()  # never left

    loop = asyncio.new_event_loop()
    task = loop.create_task(serve())
    loop.run_until_complete(asyncio.sleep(0.05))  # (the load started the workers)
    loop.close()
    return task


def _suspended_inside_with_pool(
    pool: TensorResidencyPool, t: OffloadedTensor, value: float
) -> Generator[None, None, None]:
    """A generator suspended inside `with pool`, having changed ``t`` to ``value`` under a
    read_write lease (ended)."""

    def serve() -> Generator[None, None, None]:
        with pool:
            with pool.acquire(t, mode="read_write") as changed:
                changed.fill_(value)
            yield

    generator = serve()
    next(generator)
    return generator


def _collected_amid_the_pools_code(pool: TensorResidencyPool, close: Callable[[], Any]) -> bool:
    """Run ``close`` (a coroutine's or generator's, as a garbage collection would) in a
    thread holding the pool's lock, as a collection landing amid the pool's code; return
    whether it ended. Stuck, that thread keeps the lock: the pool cannot be closed then.
    ``close`` must not raise (a collection would report the error and skip the rest)."""
    errors: list[BaseException] = []

    def collect() -> None:
        with pool._actor.lock:
            try:
                close()
            except BaseException as error:
                errors.append(error)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    collector.join(10)
    if errors:
        raise AssertionError(f"closing it raised {errors[0]!r}") from errors[0]
    return not collector.is_alive()


def _closes_once_the_loads_ended(pool: TensorResidencyPool) -> bool:
    """Close ``pool`` from another thread, again while it refuses (an acquire awaited: a
    load under way), for 5 s at most; return whether it closed."""

    def close() -> None:
        for _ in range(100):
            with suppress(T2NErrorMisuse):
                return pool.close()
            time.sleep(0.05)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(20)
    return not closer.is_alive() and pool.closed


def _collected_at_a_call(code: CodeType, close: Callable[[], Any], call: Callable[[], Any]) -> bool:
    """Run ``call`` in a thread of its own, during which the first call of ``code`` first
    runs ``close`` (a coroutine's or generator's, as a garbage collection landing there
    would); return whether it did, and that thread ended."""
    closed: list[bool] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code and not closed:
            closed.append(True)
            close()

    def run() -> None:
        sys.settrace(trace)
        try:
            call()
        finally:
            sys.settrace(None)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(10)
    return not caller.is_alive() and bool(closed)


def _freed_by_a_collection_at(
    code: CodeType,
    suspended: Callable[[], Generator[None, None, None]],
    call: Callable[[], Any],
    collect: Callable[[], Any] = gc.collect,
) -> bool:
    """Make the generator ``suspended()`` returns garbage (in a reference cycle, collections
    off meanwhile), then run ``call`` as :func:`_collected_at_a_call` does, a collection
    landing at the first call of ``code``: that collection frees the generator there.
    Return whether it did, and ``call``'s thread ended; fail the test when the collection
    ran but did not free the generator (the test would prove nothing): a collection asked
    for while another thread's runs returns at once, collecting nothing."""
    gc.disable()
    try:
        generator = suspended()
        alive = weakref.ref(generator)
        cycle: list[Any] = [generator]
        cycle.append(cycle)
        del cycle, generator
        freed: list[bool] = []

        def collect_and_look() -> None:
            collect()
            freed.append(alive() is None)

        ended = _collected_at_a_call(code, collect_and_look, call)
        if freed == [False]:
            pytest.fail("the collection did not free the generator (another one was running)")
        return ended
    finally:
        gc.enable()


@contextmanager
def _closed_at_a_workers_write(
    close: Callable[[], Any],
) -> Iterator[Callable[[Callable[[], Any]], bool]]:
    """Trace the threads started inside the block (the pool's workers), and give a function
    that runs ``call`` in a thread of its own, during which the next call of
    ``write_payload`` first runs ``close`` (as a garbage collection landing there would). It
    returns whether that thread ended, and ``close`` ran on another thread (a worker)."""
    from torch_to_nnef.tensor.storage import _io

    write = _io.write_payload.__code__
    armed = threading.Event()
    collected: list[threading.Thread] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code is write and event == "call" and armed.is_set():
            armed.clear()
            collected.append(threading.current_thread())
            close()

    def run(call: Callable[[], Any]) -> bool:
        armed.set()
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(20)
        return not caller.is_alive() and bool(collected) and collected[0] is not caller

    threading.settrace(trace)
    try:
        yield run
    finally:
        threading.settrace(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Interrupts: a KeyboardInterrupt at every function entry of a blocking acquire
# ---------------------------------------------------------------------------------------------
def _interrupted_everywhere(
    pool: TensorResidencyPool, run: Callable[[], None], returns: bool = False
) -> int:
    """Run ``run`` once per function entry it makes (and return of the package's functions,
    with ``returns``), interrupted there; check after each that no lease is left. Return how
    many runs were interrupted.

    Returns are taken in the package's code only: one from the standard library's
    ``Condition.__enter__`` leaves its lock held (Python's own hazard, not the pool's)."""
    within = _PACKAGE_CODE if returns else ""
    handler = signal.getsignal(signal.SIGINT)
    for n in itertools.count(1):
        interrupt = InterruptAt(n, within, returns)
        if not interrupted(interrupt, run):
            return n - 1
        assert _leased(pool) == 0, f"a lease is left after an interrupt at function event {n}"
        held = signal.getsignal(signal.SIGINT)
        if getattr(held, "__func__", None) is _interrupts.InterruptHold._record:
            # Raised while a hold of Ctrl-C was in force (a thread reading a payload it
            # missed holds it as it reads), as the hold ends: its handler stays. A real
            # Ctrl-C never lands there, the hold records it; put Python's handler back.
            _interrupts._replaced.clear()
            signal.signal(signal.SIGINT, handler)
        assert _interrupts._replaced == [], f"an interrupt at {interrupt.where} left a hold"
        assert signal.getsignal(signal.SIGINT) is handler
    raise AssertionError("unreachable")


@pytest.mark.parametrize("returns", [False, True], ids=["calls", "calls and returns"])
@pytest.mark.parametrize("resident", [True, False], ids=["hit", "miss"])
@pytest.mark.parametrize("mode", ["read", "read_write"])
def test_an_interrupt_at_any_call_of_a_blocking_acquire_leaves_no_lease(
    tmp_path: Path, resident: bool, mode: str, returns: bool
) -> None:
    t = _tensor(tmp_path, "t")
    changes = 0

    def run() -> None:
        nonlocal changes
        if not resident:
            pool.evict(t)  # interrupted here too: the next run starts from a miss again
        with pool.acquire(t, mode=mode) as value:  # type: ignore[arg-type]
            if mode == "read_write":
                value.add_(1.0)
                changes += 1

    with TensorResidencyPool() as pool:
        pool.resolve(t)
        interrupted = _interrupted_everywhere(pool, run, returns)
        # The injection reached the pool's code (a read hit makes the fewest calls: nine).
        assert interrupted > 8
        with pool.acquire(t) as value:  # the pool serves, and holds the changes made
            assert float(value[0]) == float(changes)
    assert float(on_disk(t)[0]) == float(changes)


def test_an_interrupt_as_a_blocking_acquire_is_sent_gives_the_lease_back(tmp_path: Path) -> None:
    """Ctrl-C landing as the request of a blocking acquire has just been sent to the loop
    thread (where CPython runs a pending handler, once the call that sent it returned): the
    request is abandoned, so the lease the loop grants is given back at once, even while
    the lease object lives on (its collection used to be the only thing to end it)."""
    t = _tensor(tmp_path, "t")

    def after_sending(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            sends = frame.f_code is _runtime.Runtime.post.__code__
            return after_sending if sends else None
        if event == "return":
            sys.settrace(None)
            raise KeyboardInterrupt
        return after_sending

    with TensorResidencyPool() as pool:
        lease = pool.acquire(t)  # a miss: its request goes to the loop thread
        assert interrupted(after_sending, lease.__enter__)
        settle(pool)  # a request sent after it: the grant and what follows it have run
        assert _leased(pool) == 0
        assert lease.slot is None
        with pool.acquire(t) as value:
            assert bool((value == 0.0).all())


def test_blocking_requests_wait_without_the_standard_librarys_lock_code(tmp_path: Path) -> None:
    """Ctrl-C can cut ``threading.Condition``'s Python code (what the wait of a
    ``concurrent.futures.Future`` runs) between taking its lock and handing it on: the lock
    stays held, and the pool's loop thread, answering the request, blocks forever (or the
    caller gets a RuntimeError in place of its KeyboardInterrupt; the soak met both). The
    blocking requests, the reads of the pool's state, the waits of prefetch handles and of
    leases begun ahead wait in the C acquire of a lock instead: no function of
    ``threading.py`` runs in their thread."""
    t = _tensor(tmp_path, "t")
    entered: list[str] = []

    def watch(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith("threading.py"):
            entered.append(frame.f_code.co_name)

    with TensorResidencyPool(max_cached_bytes=NBYTES) as pool:
        pool.resolve(t)
        sys.settrace(watch)
        try:
            pool.evict(t)
            with pool.acquire(t, mode="read_write") as value:  # a miss: the loop grants it
                value.add_(1.0)
            pool.flush()
            pool.evict(t)
            resolved = pool.resolve(t)
            assert pool.is_resident(t)
            pool.evict(t)
            prefetched = pool.prefetch(t).wait()  # a load started, then waited for
            pool.evict(t)
            lease = pool.acquire(t)
            lease._begin()  # as module streams and read-ahead do: a miss, entered later
            with lease as begun:
                begun_sum = float(begun.sum())
        finally:
            sys.settrace(None)
        assert bool((resolved == 1.0).all())
        assert bool((prefetched == 1.0).all())
        assert begun_sum == float(NUMEL)
    assert entered == []


@pytest.mark.parametrize("returns", [False, True], ids=["calls", "calls and returns"])
def test_an_interrupt_at_any_call_of_a_begun_lease_leaves_no_lease(
    tmp_path: Path, returns: bool
) -> None:
    """A lease begun ahead (as module streams and read-ahead do), then entered."""
    t = _tensor(tmp_path, "t")

    def run() -> None:
        pool.evict(t)
        lease = pool.acquire(t)
        try:  # as the streams do: a begin that an interrupt cut short is cancelled too
            lease._begin()
            with lease:
                pass
        finally:
            lease._cancel()

    with TensorResidencyPool() as pool:
        assert _interrupted_everywhere(pool, run, returns) > 10


def _layers(directory: Path) -> torch.nn.Sequential:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    for index, layer in enumerate(model):
        for name, tensor in list(layer.named_parameters()):
            offloaded = OffloadedTensor.from_original_tensor(
                tensor.detach(), f"{index}.{name}", offload_dir=directory
            )
            setattr(layer, name, torch.nn.Parameter(offloaded, requires_grad=False))
    return model


_POOL_CODE = _PACKAGE_CODE + "tensor/residency/"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("returns", [False, True], ids=["calls", "calls and returns"])
def test_an_interrupt_at_any_call_of_the_pool_in_a_streamed_forward_leaves_no_lease(
    tmp_path: Path, returns: bool
) -> None:
    """Ctrl-C at any entry to (or return from) the pool's code during a forward through
    ``stream_modules`` (loads under way, values read ahead, values entered): once the stream
    is closed, no lease is left, and the pool closes."""
    model, x = _layers(tmp_path), torch.randn(2, 16)
    with TensorResidencyPool(max_cached_bytes=10**6) as pool:
        for n in itertools.count(1):
            for layer in model:
                for tensor in layer.parameters():
                    pool.evict(tensor)  # type: ignore[arg-type]
            stream = stream_modules(pool, list(model), depth=1)
            interrupt = InterruptAt(n, _POOL_CODE, returns)
            try:
                with torch.no_grad():
                    interrupted(interrupt, lambda: model(x))
            finally:
                stream.close()
            assert _leased(pool) == 0, f"a lease is left after an interrupt at entry {n}"
            if not interrupt.fired:  # (one fired in a finalizer is lost: the next entry)
                break
        assert n > 20  # the injection reached the pool's code
    assert pool.closed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("returns", [False, True], ids=["calls", "calls and returns"])
def test_an_interrupt_at_any_call_of_the_pool_in_a_forward_read_ahead_leaves_no_lease(
    tmp_path: Path, returns: bool
) -> None:
    """Ctrl-C at any entry to (or return from) the pool's code during a scoped forward whose
    next values are read ahead: the next forward is right, and the pool closes."""
    model, x = _layers(tmp_path), torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    for n in itertools.count(1):
        pool = TensorResidencyPool(max_cached_bytes=10**6, read_ahead="auto")
        with pool.scope(), torch.no_grad():
            model(x)  # the order is learnt: the next forward reads ahead
            for layer in model:
                for tensor in layer.parameters():
                    pool.evict(tensor)  # type: ignore[arg-type]
            interrupt = InterruptAt(n, _POOL_CODE, returns)
            interrupted(interrupt, lambda: model(x))
            torch.testing.assert_close(model(x), expected)
        pool.close()  # refused while a lease is left
        assert pool.closed
        if not interrupt.fired:
            break
    assert n > 20


# ---------------------------------------------------------------------------------------------
# Cancellations from another event loop, at every point of the await
# ---------------------------------------------------------------------------------------------
def test_cancellations_from_another_loop_at_every_step_leave_no_lease(tmp_path: Path) -> None:
    tensors = [_tensor(tmp_path, f"t{i}") for i in range(4)]
    rng = random.Random(5)

    async def lease(t: OffloadedTensor) -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)

    async def cancel_after(steps: int) -> None:
        t = rng.choice(tensors)
        task = asyncio.ensure_future(lease(t) if steps % 2 else pool.aresolve(t))
        for _ in range(steps // 2):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if steps % 7 == 0:
            await asyncio.wait_for(asyncio.shield(asyncio.sleep(0)), 1)
            pool.evict(rng.choice(tensors))  # misses and hits both

    with TensorResidencyPool(max_cached_bytes=2 * NBYTES) as pool:
        for steps in range(400):
            asyncio.run(cancel_after(steps))
            assert _leased(pool) == 0, f"a lease is left after a cancellation at step {steps}"


# ---------------------------------------------------------------------------------------------
# Cancellations from another event loop while a write-back fails or is recovered
# ---------------------------------------------------------------------------------------------
def _unsaved_change(pool: TensorResidencyPool, t: OffloadedTensor) -> float | None:
    """The first element of ``t``'s value when ``pool`` holds it resident and dirty (its
    change not written), else ``None`` (read on the pool's loop thread)."""

    def look() -> float | None:
        pool._actor.sync()
        entry = pool._actor.entries.get(id(t))
        if entry is None or not entry.resident or entry.value is None:
            return None
        dirty = entry.dirty or (entry.slot is not None and entry.slot.dirty)
        return float(entry.value[0]) if dirty else None

    return pool._runtime.call(Transition(look))  # type: ignore[no-any-return]


@contextmanager
def _failing_writes(directory: Path) -> Iterator[None]:
    """Inside the block, ``directory`` is gone (renamed away): every write-back of a tensor
    offloaded there fails with ENOENT, as on a disk taken away; it is back after it."""
    moved = directory.with_name(directory.name + "-moved")
    os.rename(directory, moved)
    try:
        yield
    finally:
        os.rename(moved, directory)


def _check_change_kept(
    pool: TensorResidencyPool, t: OffloadedTensor, changes: list[float], steps: int
) -> float:
    """Once ``pool`` settled after a write-back of ``t`` failed and its request was
    cancelled after ``steps`` steps: no lease is left, the invariants hold, and the latest
    change (``changes`` counts them) stays resident and dirty, what reads outside the pool
    see. Returns that change's value."""
    settle(pool)
    assert "leased: 0," in repr(pool), f"a lease is left at step {steps}"
    check_invariants(pool)
    latest = float(len(changes))
    assert _unsaved_change(pool, t) == latest, f"the change is lost at step {steps}"
    assert torch.equal(t.reload(), torch.full((NUMEL,), latest))
    return latest


async def _push_out_then_change(
    pool: TensorResidencyPool, t: OffloadedTensor, other: OffloadedTensor, changes: list[float]
) -> None:
    """Lease ``other``, which pushes ``t`` out of a pool with room for one value (its
    write-back starts), then change ``t`` under a ``read_write`` lease, which waits for that
    write-back; ``changes`` counts the changes made."""
    async with pool.acquire(other):
        pass
    async with pool.acquire(t, mode="read_write") as value:
        value.add_(1.0)
        changes.append(1.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_kind", ["aflush", "aevict", "acquire"])
def test_cancellations_from_another_loop_as_a_write_back_fails_lose_no_change(
    tmp_path: Path, request_kind: str
) -> None:
    """A pool served by its private loop, awaited from tasks of other loops: a changed value
    is written back (``aflush``, ``aevict``, or pushed out by a lease of another tensor that
    a ``read_write`` lease on it then waits for) into a directory that is gone, and the
    awaiting task is cancelled after every number of steps of its await. Each time, no lease
    is left, the invariants hold, the change stays resident and dirty (reads outside the
    pool see it), and once the directory is back a flush writes the latest change."""
    directory = tmp_path / "failing"
    t = _tensor(directory, "t")
    other = _tensor(tmp_path, "other")
    changes: list[float] = []

    async def change() -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
            changes.append(1.0)

    async def cancel_after(steps: int) -> None:
        if request_kind == "aflush":
            task = asyncio.ensure_future(pool.aflush())
        elif request_kind == "aevict":
            task = asyncio.ensure_future(pool.aevict(t))
        else:
            task = asyncio.ensure_future(_push_out_then_change(pool, t, other, changes))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        assert outcome is None or isinstance(outcome, (asyncio.CancelledError, T2NErrorStorage)), (
            repr(outcome)
        )

    with TensorResidencyPool(max_cached_bytes=NBYTES) as pool:
        for steps in range(40):
            asyncio.run(change())
            with _failing_writes(directory):
                asyncio.run(cancel_after(steps))
                latest = _check_change_kept(pool, t, changes, steps)
            pool.flush()
            assert torch.equal(on_disk(t), torch.full((NUMEL,), latest)), f"at step {steps}"
            assert _unsaved_change(pool, t) is None
            check_invariants(pool)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), float(len(changes))))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recovery", ["failed", "aborted"])
@pytest.mark.parametrize("request_kind", ["aflush", "aevict", "acquire"])
def test_a_cancellation_from_another_loop_while_a_failed_write_back_is_recovered(
    tmp_path: Path, request_kind: str, recovery: str
) -> None:
    """The pool's loop thread is held where it puts its state right after a write-back
    failed (``_write_failed``; ``_write_aborted`` when the transition reporting the failure
    raised, in an application's logging filter), and the task of another loop awaiting the
    write-back (``aflush``, ``aevict``, or a ``read_write`` acquire of the value a lease of
    another tensor pushed out) is cancelled, before the recovery goes on or a few steps
    after. No lease is left, the change stays resident and dirty, and the close, once the
    directory is back, writes it."""
    directory = tmp_path / "failing"
    t = _tensor(directory, "t")
    other = _tensor(tmp_path, "other")
    code = (Actor._write_failed if recovery == "failed" else Actor._write_aborted).__code__
    raising = reports_that_raise(on=recovery == "aborted")
    changes: list[float] = []

    async def change(pool: TensorResidencyPool) -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
            changes.append(1.0)

    async def lease_other(pool: TensorResidencyPool) -> None:
        async with pool.acquire(other):  # in a pool with room for one value: t goes
            pass

    async def cancelled(pool: TensorResidencyPool, point: Breakpoint, steps: int) -> None:
        started = []
        if request_kind == "aflush":
            started.append(asyncio.ensure_future(pool.aflush()))
        elif request_kind == "aevict":
            started.append(asyncio.ensure_future(pool.aevict(t)))
        else:
            started.append(asyncio.ensure_future(lease_other(pool)))
        try:
            deadline = time.monotonic() + 10
            while not point.paused.is_set():
                assert time.monotonic() < deadline, "no write-back failed"
                await asyncio.sleep(0.001)
            if request_kind == "acquire":  # sent to the loop thread, held in the recovery
                started.append(asyncio.ensure_future(change(pool)))
                await asyncio.sleep(0)
            if steps:  # the recovery goes on, and the task is cancelled as it resumes
                point.go()
            for _ in range(steps):
                await asyncio.sleep(0)
            started[-1].cancel()
        finally:
            point.go()
        for outcome in await asyncio.gather(*started, return_exceptions=True):
            assert outcome is None or isinstance(
                outcome, (asyncio.CancelledError, T2NErrorStorage)
            ), repr(outcome)

    with raising:
        for steps in range(8):
            point = Breakpoint(code, "call")
            with breakpoints_in_new_threads(point):  # (the pool's threads start inside)
                pool = TensorResidencyPool(max_cached_bytes=NBYTES)
                with pool:
                    asyncio.run(change(pool))
                    with _failing_writes(directory):
                        point.armed.set()
                        asyncio.run(cancelled(pool, point, steps))
                        latest = _check_change_kept(pool, t, changes, steps)
            assert pool.closed
            assert torch.equal(on_disk(t), torch.full((NUMEL,), latest)), f"at step {steps}"


# ---------------------------------------------------------------------------------------------
# Requests to a pool served by a loop of the caller's that stops
# ---------------------------------------------------------------------------------------------
def _enter_on(loop: asyncio.AbstractEventLoop, pool: TensorResidencyPool) -> None:
    async def enter() -> None:
        await pool.__aenter__()  # an `async with pool:` block the loop leaves unfinished

    loop.run_until_complete(enter())


async def _in_other_loop(pool: TensorResidencyPool, t: OffloadedTensor, face: str) -> None:
    if face == "aresolve":
        await pool.aresolve(t)
    else:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)


def _request(pool: TensorResidencyPool, t: OffloadedTensor, face: str) -> None:
    if face == "resolve":
        pool.resolve(t)
    elif face == "acquire":
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
    elif face == "prefetch":
        pool.prefetch(t).wait()
    elif face == "begun lease":
        lease = pool.acquire(t)
        assert lease._begin()  # as stream_modules and the read-ahead begin leases
        with lease:
            pass
    else:
        asyncio.run(_in_other_loop(pool, t, face))


FACES = ("resolve", "acquire", "prefetch", "begun lease", "aresolve", "async acquire")


def _request_on_a_stopped_loop(
    t: OffloadedTensor, face: str
) -> tuple[asyncio.AbstractEventLoop, TensorResidencyPool, threading.Thread, list[Any]]:
    """A pool entered on a loop that then stops, and a thread making a request of it through
    ``face``; the thread's outcome (``None`` or the error) goes in the list once it ends."""
    loop = asyncio.new_event_loop()
    pool = TensorResidencyPool(max_cached_bytes=4 * NBYTES)
    _enter_on(loop, pool)  # the loop stops with the pool attached to it
    outcome: list[BaseException | None] = []

    def request() -> None:
        try:
            _request(pool, t, face)
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=request)
    thread.start()
    return loop, pool, thread, outcome


@pytest.mark.parametrize("face", FACES)
def test_a_request_waiting_on_a_stopped_loop_fails_instead_of_hanging(
    tmp_path: Path, face: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_runtime, "STOPPED_LOOP_PATIENCE", 0.3)
    t = _tensor(tmp_path, "t", 1.0)
    loop, pool, thread, outcome = _request_on_a_stopped_loop(t, face)
    thread.join(10.0)
    assert not thread.is_alive(), f"{face} on a pool whose loop stopped hangs"
    (error,) = outcome
    assert isinstance(error, T2NErrorMisuse) and "not been running" in str(error)

    async def close() -> None:
        await asyncio.sleep(0.05)  # the request and its abandon, queued while it stopped
        assert _leased(pool) == 0
        await pool.__aexit__(None, None, None)

    loop.run_until_complete(close())
    loop.close()
    assert torch.equal(t.reload(), torch.full((NUMEL,), 1.0))  # an abandoned lease wrote nothing


@pytest.mark.parametrize("face", ("resolve", "acquire", "aresolve"))
def test_a_loop_that_stops_for_a_moment_still_serves_a_waiting_request(
    tmp_path: Path, face: str
) -> None:
    t = _tensor(tmp_path, "t", 1.0)
    loop, pool, thread, outcome = _request_on_a_stopped_loop(t, face)
    time.sleep(0.2)  # the loop is not running: the request waits for it
    assert thread.is_alive()

    async def serve() -> None:
        while thread.is_alive():
            await asyncio.sleep(0.01)
        await pool.__aexit__(None, None, None)

    loop.run_until_complete(asyncio.wait_for(serve(), 10.0))
    loop.close()
    assert outcome == [None]
    expected = 2.0 if face == "acquire" else 1.0
    assert torch.equal(t.reload(), torch.full((NUMEL,), expected))


def test_a_loop_run_in_short_bursts_serves_a_request_longer_than_the_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop that runs in bursts (one run_until_complete after another) is seldom running
    when looked at; a request waiting longer than the patience is still served."""
    monkeypatch.setattr(_runtime, "STOPPED_LOOP_PATIENCE", 0.3)
    t = _tensor(tmp_path, "t", 1.0)
    with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point:
        point.armed.set()  # the first load pauses until go()
        loop, pool, thread, outcome = _request_on_a_stopped_loop(t, "resolve")
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # five times the patience
            loop.run_until_complete(asyncio.sleep(0))
            time.sleep(0.05)
        point.go()
        while thread.is_alive() and time.monotonic() - started < 10:
            loop.run_until_complete(asyncio.sleep(0.01))
    assert outcome == [None]
    loop.run_until_complete(pool.__aexit__(None, None, None))
    loop.close()


def test_reads_of_the_state_never_wait_for_a_stopped_loop(tmp_path: Path) -> None:
    """A lease ended over the budget while the pool's loop is stopped sends a wake-up that
    only that loop can run; reads of the state from threads answer at once meanwhile."""
    t = _tensor(tmp_path, "t", 1.0)
    loop = asyncio.new_event_loop()
    pool = TensorResidencyPool(max_cached_bytes=0)
    held: list[TensorResidencyLease] = []

    async def enter() -> None:
        await pool.__aenter__()

        def take() -> None:
            lease = pool.acquire(t)
            lease.__enter__()  # a miss, granted by the loop; kept
            held.append(lease)

        await asyncio.to_thread(take)

    loop.run_until_complete(enter())  # then the loop stops, as between two bursts
    took: list[float] = []

    def read() -> None:
        held[0].__exit__(None, None, None)  # over the budget: the wake-up evicts
        started = time.monotonic()
        pool.stats(), pool.resident_bytes, pool.is_resident(t), repr(pool)
        took.append(time.monotonic() - started)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(30)
    assert took and took[0] < 0.5, took
    loop.run_until_complete(pool.__aexit__(None, None, None))
    loop.close()
    assert pool.closed


def _lease_holder(
    pool: TensorResidencyPool, held: OffloadedTensor
) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """A thread (not started) that holds a lease on ``held`` from when it sets the first
    event until the second one is set (or 30 s)."""
    leased, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pool.acquire(held):
            leased.set()
            release.wait(30)

    return threading.Thread(target=hold, daemon=True), leased, release


def _load_ending_after_a_failed_async_with_exit(
    pool: TensorResidencyPool,
    held: OffloadedTensor,
    loaded: OffloadedTensor,
    first: Callable[[], Awaitable[None]] | None = None,
) -> tuple[TensorPrefetch, Callable[[], None]]:
    """Serve ``pool`` in ``async with pool`` (running ``first`` there first), while a thread
    holds a lease on ``held``, which makes the exit fail; ``loaded`` is prefetched, its load
    ending after the exit began. Return its prefetch handle, and what ends the thread's
    lease."""
    holder, leased, release = _lease_holder(pool, held)
    handles: list[TensorPrefetch] = []

    async def serve() -> None:
        async with pool:
            if first is not None:
                await first()
            holder.start()
            while not leased.is_set():
                await asyncio.sleep(0.01)
            point.armed.set()
            handles.append(pool.prefetch(loaded))
            while not point.paused.is_set():
                await asyncio.sleep(0.01)
            threading.Timer(0.2, point.go).start()  # the load ends after the exit began

    with (
        paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point,
        pytest.raises(T2NErrorMisuse, match="cannot close"),
    ):
        asyncio.run(serve())

    def end_lease() -> None:
        release.set()
        holder.join(10)

    return handles[0], end_lease


def test_a_load_under_way_when_an_async_with_exit_fails_still_answers_its_waiters(
    tmp_path: Path,
) -> None:
    """The exit of `async with pool` cannot close it (a thread holds a lease) while a load
    runs: the load ends after the loop stopped serving, and its end is still applied, so
    its prefetch handle, later requests and the close are answered."""
    ts = [_tensor(tmp_path, f"t{i}", float(i)) for i in range(2)]
    pool = TensorResidencyPool(max_cached_bytes=4 * NBYTES)
    _, end_lease = _load_ending_after_a_failed_async_with_exit(pool, ts[0], ts[1])
    waited: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: waited.append(pool.prefetch(ts[1]).wait()))
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and torch.equal(waited[0], torch.full((NUMEL,), 1.0))
    assert torch.equal(pool.resolve(ts[1]), torch.full((NUMEL,), 1.0))
    end_lease()
    pool.close()
    assert pool.closed


class _LeaseHeldAndRequestSent:
    """A pool whose ``async with`` exit fails: one thread holds a lease on ``ts[0]`` from
    inside the block; another asks for ``ts[1]`` (a miss) at a point the test chooses."""

    def __init__(self, tmp_path: Path) -> None:
        self.ts = [_tensor(tmp_path, f"t{i}", float(i)) for i in range(2)]
        self.pool = TensorResidencyPool(max_cached_bytes=4 * NBYTES)
        self.leased, self.release = threading.Event(), threading.Event()
        self.outcome: list[object] = []
        self.holder = threading.Thread(target=self._hold)
        self.requester = threading.Thread(target=self._request)

    def _hold(self) -> None:
        with self.pool.acquire(self.ts[0]):
            self.leased.set()
            self.release.wait(30)

    def _request(self) -> None:
        try:
            self.outcome.append(self.pool.resolve(self.ts[1]).clone())
        except T2NErrorMisuse as error:
            self.outcome.append(error)

    async def hold(self) -> None:
        """Start the holder, from the block; return once it holds its lease."""
        self.holder.start()
        while not self.leased.is_set():
            await asyncio.sleep(0.01)

    def check_served(self, point: Breakpoint) -> None:
        """Let the requester go: it got its value; then the pool closes."""
        point.go()
        self.requester.join(10)
        self.release.set()
        self.holder.join(10)
        assert not self.requester.is_alive() and not self.holder.is_alive()
        outcome = self.outcome
        assert len(outcome) == 1 and isinstance(outcome[0], torch.Tensor), outcome
        assert torch.equal(outcome[0], torch.full((NUMEL,), 1.0))
        self.pool.close()
        assert self.pool.closed


def test_a_threads_request_sent_as_an_async_with_exit_fails_is_served_after_it(
    tmp_path: Path,
) -> None:
    """A thread's request finds the pool served by the loop of `async with pool`, whose exit
    then fails (another thread holds a lease) and stops serving before the request reaches
    it: the pool stays open, usable from threads, and the request is served from a private
    loop instead of failing with "not running; it may be closed"."""
    race = _LeaseHeldAndRequestSent(tmp_path)

    async def serve() -> None:
        async with race.pool:
            await race.hold()
            point.armed.set()
            race.requester.start()  # found the loop serving: paused before it sends the request
            while not point.paused.is_set():
                await asyncio.sleep(0.01)

    with (
        paused_in_new_threads(_runtime.Runtime.ensure_running.__code__) as point,
        pytest.raises(T2NErrorMisuse, match="cannot close"),
    ):
        asyncio.run(serve())
    race.check_served(point)


def test_a_threads_request_waiting_as_an_async_with_exit_fails_is_served_after_it(
    tmp_path: Path,
) -> None:
    """The same with the request sent as the exit fails (its refusal is being logged): the
    request waits in the loop's inbox, which the loop runs once it stopped serving the pool.
    The pool is open: the request goes to a private loop, served, instead of failing with
    "not running; it may be closed"."""
    race = _LeaseHeldAndRequestSent(tmp_path)

    class RequestAsTheRefusalIsLogged(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "stays open" in record.getMessage():
                point.armed.set()
                race.requester.start()  # sends the request, then pauses as it waits
                assert point.paused.wait(10)

    async def serve() -> None:
        async with race.pool:
            await race.hold()
            raise RuntimeError("the request failed")

    logger = logging.getLogger("torch_to_nnef.tensor.residency")
    handler = RequestAsTheRefusalIsLogged()
    logger.addHandler(handler)
    try:
        with (
            paused_in_new_threads(_runtime.Runtime._wait.__code__, on="call") as point,
            pytest.raises(RuntimeError, match="the request failed"),
        ):
            asyncio.run(serve())
    finally:
        logger.removeHandler(handler)
    race.check_served(point)


def test_a_task_collected_on_a_worker_during_the_close_of_its_stranded_pool_does_not_block_it(
    tmp_path: Path,
) -> None:
    """A task left pending inside `async with pool` by a closed loop, whose coroutine is
    closed (as a garbage collection does, on whatever thread it runs) on the worker writing
    the pool's change back for a close from another thread: the coroutine's exit leaves the
    pool to that close instead of waiting for it, which waits for the worker."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()

    def collect() -> None:
        task.get_coro().close()  # type: ignore[union-attr]

    with _closed_at_a_workers_write(collect) as closing:  # the workers start in the block
        task = _stranded_with_a_change(pool, t, 5.0)
        ended = closing(pool.close)
    assert ended, "the close and the task's exit, collected on a worker, wait for each other"
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0))
    task = None  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


@pytest.mark.parametrize("collected", [True, False], ids=["collected", "kept"])
@pytest.mark.parametrize("where", ["serving", "foreign"])
def test_a_task_awaiting_a_load_left_by_its_closed_loop_lets_the_pool_close(
    tmp_path: Path, where: str, collected: bool
) -> None:
    """A task awaiting `pool.acquire(t)` while the value loads, on the loop serving the pool
    or on another, left pending by its closed loop. Its coroutine closed (as a garbage
    collection does) on a thread holding the pool's lock abandons the acquire without a
    wait, at the pool's next step; kept, the value it is granted goes back, as no task of
    that loop can take it. Either way, a close from another thread closes the pool."""
    t, u = _tensor(tmp_path, "t", 1.0), _tensor(tmp_path, "u", 2.0)
    pool = TensorResidencyPool()

    async def hold() -> None:
        async with pool.acquire(t):
            await asyncio.Event().wait()

    with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point:
        if where == "foreign":
            pool.__enter__()  # a private loop serves the pool
            pool.resolve(u)
        loop = asyncio.new_event_loop()
        if where == "serving":
            loop.run_until_complete(pool.__aenter__())
            loop.run_until_complete(pool.aresolve(u))
        point.armed.set()  # the load of t pauses until go()
        task = loop.create_task(hold())
        assert loop.run_until_complete(loop.run_in_executor(None, point.paused.wait, 10))
        loop.close()  # the task stays pending, awaiting the load
        pool.resolve(u)  # a hit, which the actor's next step takes note of under its lock
        close = task.get_coro().close  # type: ignore[union-attr]
        ended = not collected or _collected_amid_the_pools_code(pool, close)
        point.go()
    assert ended, "the abandon waited for the lock its thread held"  # (the pool cannot close)

    # Refused while the acquire's load is under way (as for any acquire awaited), the
    # close closes once the load ended, whatever thread applies its end.
    assert _closes_once_the_loads_ended(pool)
    assert _leased(pool) == 0
    task = None  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


def test_a_generator_inside_with_pool_collected_on_a_worker_leaves_the_pool_to_its_close(
    tmp_path: Path,
) -> None:
    """A generator suspended inside `with pool`, closed (as a garbage collection does) on
    the worker writing the pool's change back for a flush: its exit leaves the pool open
    instead of closing it there, which would wait for that worker's write."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()
    with _closed_at_a_workers_write(lambda: generator.close()) as flushing:
        generator = _suspended_inside_with_pool(pool, t, 8.0)
        ended = flushing(pool.flush)
    assert ended, "the flush and the generator's exit, collected on a worker, wait for each other"
    assert not pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 8.0))
    pool.close()
    assert pool.closed


@pytest.mark.parametrize("request_", ["close", "flush", "resolve"])
def test_a_request_a_finalizer_makes_on_a_worker_is_refused_not_waited_for(
    tmp_path: Path, request_: str
) -> None:
    """A finalizer that a garbage collection runs on the pool's only I/O worker, amid its
    write for a flush, asks the pool for something that waits (an object closing its pool
    as it is dropped): the pool would wait for that worker's job, queued behind it. Refused
    at once; the flush ends, and the pool works on."""
    t, other = _tensor(tmp_path, "t"), _tensor(tmp_path, "other", 3.0)
    refused: list[BaseException] = []

    def finalizer() -> None:
        try:
            getattr(pool, request_)(*([other] if request_ == "resolve" else []))
        except T2NErrorMisuse as error:
            refused.append(error)

    pool = TensorResidencyPool(max_workers=1)
    with _closed_at_a_workers_write(finalizer) as flushing:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(8.0)
        ended = flushing(pool.flush)
    assert ended, "the flush and the finalizer's request on its worker wait for each other"
    assert len(refused) == 1 and "I/O worker thread" in str(refused[0])
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 8.0))
    assert torch.equal(pool.resolve(other), torch.full((NUMEL,), 3.0))
    pool.close()
    assert pool.closed


@pytest.mark.parametrize("mode", ["read", "read_write"])
def test_a_task_inside_a_lease_collected_amid_the_pools_own_code_ends_the_lease_later(
    tmp_path: Path, mode: str
) -> None:
    """A task of a stopped loop, inside `async with pool.acquire(t)`, whose coroutine is
    closed (as a garbage collection does) on a thread inside the pool's code, holding its
    lock: the lease's exit takes no lock; the pool's next step ends the lease, keeping a
    read_write lease's change."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:

        async def hold() -> None:
            async with pool.acquire(t, mode=mode) as value:  # type: ignore[arg-type]
                if mode == "read_write":
                    value.fill_(3.0)
                await asyncio.Event().wait()

        loop = asyncio.new_event_loop()
        task = loop.create_task(hold())
        loop.run_until_complete(asyncio.sleep(0.05))  # stopped, the task inside the lease
        assert pool._actor.leased_count() == 1

        assert _collected_amid_the_pools_code(
            pool,
            task.get_coro().close,  # type: ignore[union-attr]
        ), "the lease's exit waited for the lock its thread held"
        assert _leased(pool) == 0
        task = None  # asyncio logs the pending task's end here, not in a later test
        gc.collect()
        loop.close()
    expected = 3.0 if mode == "read_write" else 0.0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), expected))


@pytest.mark.parametrize("mode", ["read", "read_write"])
def test_a_generator_inside_a_lease_collected_amid_the_pools_own_code_ends_the_lease_later(
    tmp_path: Path, mode: str
) -> None:
    """The sync twin: a generator suspended inside `with pool.acquire(t)`, closed (as a
    garbage collection does) on a thread inside the pool's code, holding its lock: the
    lease's exit waits for no lock; the pool's next step ends the lease, keeping a
    read_write lease's change."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()

    def hold() -> Any:
        with pool.acquire(t, mode=mode) as value:  # type: ignore[arg-type]
            if mode == "read_write":
                value.fill_(4.0)
            yield

    generator = hold()
    next(generator)
    assert pool._actor.leased_count() == 1

    # (No close on failure: the lock stays held by the thread that waits for it.)
    assert _collected_amid_the_pools_code(pool, generator.close), (
        "the lease's exit waited for the lock its thread held"
    )
    assert _leased(pool) == 0
    pool.close()
    expected = 4.0 if mode == "read_write" else 0.0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), expected))


def test_a_reshaping_lease_collected_amid_the_pools_own_code_drops_its_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read_write lease ended without its exit (its generator closed under the pool's
    lock), whose value was reshaped in place: the change is refused as an exit refuses it
    (dropped, the value loaded again), instead of a write-back that fails at every close."""
    t = _tensor(tmp_path, "t", 1.0)
    pool = TensorResidencyPool()

    def hold() -> Any:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(7.0)
            value.unsqueeze_(0)
            yield

    generator = hold()
    next(generator)

    assert _collected_amid_the_pools_code(pool, generator.close)
    with caplog.at_level(logging.WARNING, logger="torch_to_nnef"):
        assert torch.equal(pool.resolve(t), torch.full((NUMEL,), 1.0))
        pool.close()
    assert "reshaped or retyped in place" in caplog.text
    assert t.shape == (NUMEL,)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 1.0))
    assert torch.equal(t.reload(), torch.full((NUMEL,), 1.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reshaped", [False, True], ids=["changed", "reshaped"])
def test_a_read_write_lease_dropped_without_its_exit_ends_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reshaped: bool
) -> None:
    """A read_write lease entered and changed, then dropped without its exit (its object
    freed, as after an interrupt on the way into ``__exit__``), while the pool's loop is
    busy: it ends there and then, as its exit would. Its change is the tensor's latest
    write at once: a read right after sees it, a direct write right after stands on it. A
    change that reshaped the value is dropped, with a warning, as an exit refuses it."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()
    pool.resolve(t)
    busy = threading.Event()
    pool._runtime.loop.call_soon_threadsafe(busy.wait, 10)  # type: ignore[union-attr]
    try:
        lease = pool.acquire(t, mode="read_write")
        value = lease.__enter__()
        value.fill_(5.0)
        if reshaped:
            value.unsqueeze_(0)
        with caplog.at_level(logging.WARNING, logger="torch_to_nnef"):
            del lease, value
        assert ("reshaped or retyped in place" in caplog.text) == reshaped
        expected = 0.0 if reshaped else 5.0
        assert torch.equal(t.reload(), torch.full((NUMEL,), expected))
        t.add_(1.0)
        assert torch.equal(t.reload(), torch.full((NUMEL,), expected + 1.0))
    finally:
        busy.set()
    assert _leased(pool) == 0
    pool.close()
    assert torch.equal(on_disk(t), torch.full((NUMEL,), expected + 1.0))


@pytest.mark.timeout(60)
def test_a_read_write_lease_dropped_on_the_loop_serving_its_pool_ends_at_once(
    tmp_path: Path,
) -> None:
    """A task on the loop serving the pool (``async with pool``) enters a read_write lease,
    changes the value and drops the lease without its exit (its object freed there, on the
    pool's loop thread): its change is the tensor's latest write at once, before the pool's
    next step. A read right after sees it, and so does a read_write lease of another pool
    entered right after, whose change, later in program order, stands."""
    t = _tensor(tmp_path, "t")
    other = TensorResidencyPool()
    seen: list[float] = []

    async def main() -> None:
        async with TensorResidencyPool() as pool:
            lease = pool.acquire(t, mode="read_write")
            value = await lease.__aenter__()
            value.fill_(5.0)
            del lease, value  # freed on the loop thread, the pool's actor not running
            seen.append(t.reload()[0].item())
            with other.acquire(t, mode="read_write") as changed:  # (on its own loop thread)
                seen.append(changed[0].item())
                changed.fill_(6.0)
            await asyncio.sleep(0.05)  # the pool's next steps
            seen.append(t.reload()[0].item())
            assert _leased(pool) == 0
        seen.append(t.reload()[0].item())

    try:
        asyncio.run(main())
    finally:
        other.close()
    assert seen == [5.0, 5.0, 6.0, 6.0]
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))


@pytest.mark.timeout(60)
def test_a_lease_freed_by_a_collection_has_ended_when_the_pools_state_is_read(
    tmp_path: Path,
) -> None:
    """A read_write lease left in a reference cycle, freed by a garbage collection (which
    may land amid any code: the lease ends at the pool's next step): a read of the pool's
    state after the collection waits for that step, and sees the lease ended and its change
    the tensor's latest write."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:
        lease = pool.acquire(t, mode="read_write")
        lease.__enter__().fill_(3.0)
        busy = threading.Event()  # the loop, busy elsewhere, takes no note of it by itself
        pool._runtime.loop.call_soon_threadsafe(busy.wait, 10)  # type: ignore[union-attr]
        gc.disable()
        try:
            cycle: list[Any] = [lease]
            cycle.append(cycle)
            del lease, cycle
            gc.collect()
        finally:
            gc.enable()
        threading.Timer(0.3, busy.set).start()
        assert "leased: 0" in repr(pool)
        assert torch.equal(t.reload(), torch.full((NUMEL,), 3.0))
        t.add_(1.0)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 4.0))


@contextmanager
def _another_thread_holding_the_pools_lock(pool: TensorResidencyPool) -> Iterator[None]:
    """Run the block while another thread holds the pool's lock, as a hit of that thread
    does for a moment: it lets the lock go 0.2 s after taking it, whatever the block does."""
    taken = threading.Event()

    def hold() -> None:
        with pool._actor.lock:
            taken.set()
            time.sleep(0.2)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        holder.join(10)


@pytest.mark.parametrize("locked", [False, True], ids=["alone", "another thread locking"])
def test_a_generator_inside_a_lease_closed_by_its_owner_ends_the_lease_at_once(
    tmp_path: Path, locked: bool
) -> None:
    """A generator closed by its owner, outside the pool's code, ends its lease in the
    close itself, as a plain exit of the block does; so it does while another thread holds
    the pool's lock (a hit there: only a thread that holds it itself must not wait for it).
    A read right after sees the change, and a direct write after it keeps it."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:

        def hold() -> Any:
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(6.0)
                yield

        generator = hold()
        next(generator)
        with _another_thread_holding_the_pools_lock(pool) if locked else nullcontext():
            generator.close()
            assert pool._actor.leased_count() == 0  # no step of the pool's ran since
        assert torch.equal(t.reload(), torch.full((NUMEL,), 6.0))
        t.add_(1.0)
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 7.0))


def test_with_pool_closed_by_its_owner_while_another_thread_holds_the_lock_closes_it(
    tmp_path: Path,
) -> None:
    """The same for a generator inside `with pool`: its owner's close closes the pool,
    writing the change back."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()
    generator = _suspended_inside_with_pool(pool, t, 9.0)
    with _another_thread_holding_the_pools_lock(pool):
        generator.close()
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 9.0))


def test_an_async_generator_closed_on_another_loop_ends_its_lease_at_once(
    tmp_path: Path,
) -> None:
    """The documented pattern of a pool on its own thread used from another loop: an
    async generator inside `async with pool.acquire(t)` closed by `aclose()` on that loop
    ends the lease in the close, as a plain exit does: a read right after sees the change,
    and a direct write after it keeps it."""
    t = _tensor(tmp_path, "t")

    async def use(pool: TensorResidencyPool) -> float:
        async def hold() -> Any:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(5.0)
                yield

        generator = hold()
        await generator.__anext__()
        await generator.aclose()
        leased = pool._actor.leased_count()  # no step of the pool's ran since
        assert torch.equal(t.reload(), torch.full((NUMEL,), 5.0))
        t.add_(1.0)
        return leased

    with TensorResidencyPool() as pool:
        assert asyncio.run(use(pool)) == 0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))


def test_a_task_granted_a_value_before_its_loop_closed_collected_amid_the_pools_code(
    tmp_path: Path,
) -> None:
    """A task of another loop awaiting `pool.acquire(t)`, granted the value while its loop
    was stopped, then left pending by the closed loop, its coroutine closed (as a garbage
    collection does) on a thread holding the pool's lock: the lease it never entered ends
    without a wait, at the pool's next step, and the pool closes."""
    t, u = _tensor(tmp_path, "t", 1.0), _tensor(tmp_path, "u", 2.0)
    pool = TensorResidencyPool()
    lease = pool.acquire(t)

    async def hold() -> None:
        async with lease:
            await asyncio.Event().wait()

    with paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__) as point:
        pool.__enter__()  # a private loop serves the pool
        pool.resolve(u)
        point.armed.set()  # the load of t pauses until go()
        loop = asyncio.new_event_loop()
        task = loop.create_task(hold())
        loop.run_until_complete(asyncio.sleep(0))  # the acquire is sent; the loop stops
        assert point.paused.wait(10)
        point.go()
        for _ in range(500):
            if lease.slot is not None:
                break
            time.sleep(0.01)
        assert lease.slot is not None and not lease.entered  # granted, never entered
    loop.close()
    close = task.get_coro().close  # type: ignore[union-attr]
    assert _collected_amid_the_pools_code(pool, close), "the lease's end waited for its own lock"
    pool.close()
    assert pool.closed and _leased(pool) == 0
    task = None  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


def test_an_interrupt_as_a_stranded_close_ends_a_collected_lease_loses_no_change(
    tmp_path: Path,
) -> None:
    """A pool stranded by its closed loop, with a task inside `async with pool.acquire(t,
    "read_write")` collected amid the pool's code (its lease's end left to the pool's next
    step): a Ctrl-C as the close ends that lease leaves it for the next close, which
    writes the change back."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()

    async def hold() -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.fill_(3.0)
            await asyncio.Event().wait()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(pool.__aenter__())
    task = loop.create_task(hold())
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    assert _collected_amid_the_pools_code(pool, task.get_coro().close)  # type: ignore[union-attr]
    release = Actor.release.__code__

    def at_release(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is release:
            sys.settrace(None)
            raise KeyboardInterrupt

    assert interrupted(at_release, pool.close)
    assert not pool.closed
    pool.close()
    assert pool.closed and _leased(pool) == 0
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 3.0))
    task = None  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


def test_a_lease_collected_amid_a_read_of_its_tensor_ends_at_the_next_step(
    tmp_path: Path,
) -> None:
    """A generator inside `with pool.acquire(t, "read_write")`, freed by a garbage
    collection that lands while its thread copies the pool's unsaved change of ``t`` for a
    ``t.reload()``, under the tensor's lock that the lease's end takes to note its change:
    the lease ends at the pool's next step instead, keeping the change, and the read gets
    the value before it (it began before the collection)."""
    from torch_to_nnef.tensor.offload import _tensor as tensor_module

    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # an unsaved change: a read outside the pool copies it

        def hold() -> Generator[None, None, None]:
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(2.0)
                yield

        def suspended() -> Generator[None, None, None]:
            generator = hold()
            next(generator)
            return generator

        read: list[torch.Tensor] = []
        unchanged: list[bool] = []

        def collect() -> None:  # amid the copy: the section around it sees no change
            unsaved = t._unsaved
            gc.collect()
            unchanged.append(t._unsaved is unsaved)

        copying = tensor_module._copy_of.__code__
        reload = lambda: read.append(t.reload())  # noqa: E731
        assert _freed_by_a_collection_at(copying, suspended, reload, collect)
        assert unchanged == [True], "the lease's end changed the tensor amid its own read"
        assert torch.equal(read[0], torch.full((NUMEL,), 1.0))
        pool.flush()  # a step of the pool's: the lease ended there
        assert _leased(pool) == 0
        assert torch.equal(t.reload(), torch.full((NUMEL,), 2.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))


def test_with_pool_collected_amid_a_direct_write_of_a_tensor_it_changed_stays_open(
    tmp_path: Path,
) -> None:
    """A generator suspended inside `with pool`, whose pool holds a change of ``t``, freed
    by a garbage collection that lands while its thread writes ``t`` directly (``t.add_``),
    holding the tensor's write lock that the pool's write-back takes: the pool stays open
    for `close()` instead of closing there, waiting for that write-back; the direct write,
    made on the change, stands."""
    t = _tensor(tmp_path, "t")
    _stays_open_when_freed_at(OffloadedTensor._write_encoded.__code__, t, lambda: t.add_(1.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 6.0))


def _stays_open_when_freed_at(code: CodeType, t: OffloadedTensor, write: Callable[[], Any]) -> None:
    """A pool whose generator, suspended inside `with pool` with a change of ``t`` to 5, is
    freed by a collection at the first call of ``code`` during ``write``: it stays open,
    and its close (here) writes the change."""
    pool = TensorResidencyPool()
    assert _freed_by_a_collection_at(
        code, lambda: _suspended_inside_with_pool(pool, t, 5.0), write
    ), "the pool's close waited for a lock its thread held"
    assert not pool.closed
    pool.close()


@pytest.mark.parametrize("resident", [True, False], ids=["granted", "loading"])
def test_a_begun_lease_cancelled_amid_the_pools_own_code_ends_at_the_next_step(
    tmp_path: Path, resident: bool
) -> None:
    """The cancel of a begun lease that a stream's collected thread state makes (a
    finalizer: amid the pool's code, its lock held by the collecting thread) changes
    nothing under that lock and waits for nothing: the lease, granted or still loading,
    ends at the pool's next step, and the pool closes."""
    t, u = _tensor(tmp_path, "t", 1.0), _tensor(tmp_path, "u", 2.0)
    pool = TensorResidencyPool()
    pool.resolve(t if resident else u)  # the loop runs
    busy = threading.Event()
    # Loading: the loop is busy meanwhile, so that the abandon left to the next step runs
    # first thing in the acquire's own step (which takes note of the other threads first).
    pool._runtime.loop.call_soon_threadsafe(busy.wait, 10)  # type: ignore[union-attr]
    if resident:
        busy.set()
    lease = pool.acquire(t)
    assert lease._begin()
    slot = lease.slot
    assert (slot is not None) == resident
    unchanged: list[bool] = []

    def cancel() -> None:  # under the lock: the section around it sees no change
        leases = slot.leases if slot is not None else 0
        lease._cancel()
        unchanged.append(slot is None or slot.leases == leases)

    assert _collected_amid_the_pools_code(pool, cancel), "the cancel waited for its lock"
    busy.set()
    assert unchanged == [True], "the cancel changed the lease counts amid the locked code"

    assert _closes_once_the_loads_ended(pool)  # (refused while the abandoned load runs)
    assert _leased(pool) == 0


def test_entering_a_lease_a_close_dropped_says_so(tmp_path: Path) -> None:
    """A begun lease that a close dropped (a stream's, or the pool's releasing what its
    streams began) while a forward in another thread was about to enter it: the forward is
    told the lease was dropped, or that the pool is closing, not that the lease "is already
    held" (what a pool closed under concurrent streamed forwards once said)."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:
        lease = pool.acquire(t)
        assert lease._begin()
        lease._cancel()  # the close, first
        with pytest.raises(T2NErrorMisuse, match="dropped before it was entered"), lease:
            pass
        assert _leased(pool) == 0
    closing = TensorResidencyPool()
    lease = closing.acquire(t)
    assert lease._begin()
    lease._cancel()
    closing.close()
    with pytest.raises(T2NErrorMisuse, match="is closed; create a new pool"), lease:
        pass


def test_with_pool_collected_amid_another_tensors_write_stays_open(tmp_path: Path) -> None:
    """A generator suspended inside `with pool`, whose pool holds a change of ``t``, freed
    by a garbage collection that lands while its thread writes another tensor ``u``
    directly, inside the lock of the storage's table of open files (which the write-back of
    ``t`` takes too): the pool stays open for `close()` instead of closing there."""
    from torch_to_nnef.tensor.storage import _descriptors

    t, u = _tensor(tmp_path, "t"), _tensor(tmp_path, "u")
    retiring = _descriptors.Descriptors._retire_locked.__code__
    _stays_open_when_freed_at(retiring, t, lambda: u.add_(1.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 5.0))
    assert torch.equal(on_disk(u), torch.full((NUMEL,), 1.0))


@pytest.mark.parametrize("request_made", ["close", "evict"])
def test_a_blocking_request_from_a_finalizer_amid_the_pools_code_is_refused(
    tmp_path: Path, request_made: str
) -> None:
    """A finalizer (run by a garbage collection) that closes the pool or evicts a value,
    landing while its thread grants a lease under the pool's lock: the request would wait
    for the code it interrupts, and is refused instead of hanging; the pool goes on."""
    t, u = _tensor(tmp_path, "t", 1.0), _tensor(tmp_path, "u", 2.0)
    pool = TensorResidencyPool()
    pool.resolve(t)
    pool.resolve(u)
    outcome: list[BaseException | None] = []

    def finalizer() -> None:
        try:
            pool.close() if request_made == "close" else pool.evict(t)
            outcome.append(None)
        except T2NErrorMisuse as error:
            outcome.append(error)

    def change() -> None:
        with pool.acquire(u, mode="read_write") as value:
            value.add_(1.0)

    assert _collected_at_a_call(Actor._grant.__code__, finalizer, change)
    assert len(outcome) == 1 and "amid the pool's own code" in str(outcome[0])
    assert pool.is_resident(t) and not pool.closed
    pool.close()
    assert torch.equal(on_disk(u), torch.full((NUMEL,), 3.0))


def test_a_close_from_a_finalizer_amid_a_stranded_close_is_refused(tmp_path: Path) -> None:
    """The same inside the close of a stranded pool, which drives the pool on the calling
    thread: a finalizer's close landing as a write-back ends is refused; the close goes on
    and writes the change."""
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()
    task = _stranded_with_a_change(pool, t, 7.0)
    outcome: list[BaseException | None] = []

    def finalizer() -> None:
        try:
            pool.close()
            outcome.append(None)
        except T2NErrorMisuse as error:
            outcome.append(error)

    written = Actor._on_written.__code__
    assert _collected_at_a_call(written, finalizer, pool.close)
    assert len(outcome) == 1 and "amid the pool's own code" in str(outcome[0])
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 7.0))
    del task  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
def test_ctrl_c_during_the_close_of_a_stranded_pool_lands_after_it(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT) while the main thread closes a pool stranded by its closed
    loop, its write-back under way on a worker: that thread runs the actor's transitions,
    which no interrupt may cut in half, so the close ends (the change written, the pool
    closed) and the KeyboardInterrupt is raised after it."""
    from torch_to_nnef.tensor.storage import _io

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    t = _tensor(tmp_path, "t")
    before = set(threading.enumerate())
    pool = TensorResidencyPool()

    def ctrl_c() -> None:
        if point.paused.wait(10):
            time.sleep(0.2)  # the closing thread waits for the write meanwhile
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        point.go()

    with paused_in_new_threads(_io.write_payload.__code__) as point:
        task = _stranded_with_a_change(pool, t, 4.0)  # its worker is traced
        point.armed.set()
        sender = threading.Thread(target=ctrl_c, daemon=True)
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            pool.close()
        sender.join(10)
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 4.0))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    workers = io_threads_since(before)
    assert not workers, f"the closed pool's I/O workers still run: {workers}"
    del task  # asyncio logs the pending task's end here, not in a later test
    gc.collect()


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_as_a_stranded_pool_s_close_stops_its_workers_leaves_none(
    tmp_path: Path,
) -> None:
    """Two Ctrl-C while the main thread closes a pool stranded by its closed loop, its change
    unwritten: the first as the close begins (held: raised once it ended), the second at
    each point in turn from the stop of the pool's serving on, its I/O workers' stop among
    them. Whichever point it lands at, the change is on disk, the pool is closed and its
    workers are gone: a second Ctrl-C there once left them running for the process's life
    (a later close found the pool closed and stopped nothing), or, landing inside their
    stop, made interpreter exit wait 300 s for them."""
    for n in itertools.count(1):
        t = _tensor(tmp_path, f"t{n}")
        before = set(threading.enumerate())
        pool = TensorResidencyPool()
        task = _stranded_with_a_change(pool, t, float(n))
        signal_at = SecondSignalAt("drive", "detach_current", n, _runtime.__file__)
        sys.setprofile(signal_at)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.close()
        finally:
            sys.setprofile(None)
        assert signal_at.first_where == "Runtime.drive"
        where = signal_at.where or "no point (ran to its end)"
        assert pool.closed, where
        assert torch.equal(on_disk(t), torch.full((NUMEL,), float(n))), where
        assert not io_threads_since(before), f"a Ctrl-C at {where} left the workers running"
        pool.close()  # (a no-op)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
        del task
        gc.collect()
        if not signal_at.fired:
            break
    assert n > 3, "the stop made fewer points than expected: the test proves little"


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_as_asyncio_run_leaves_async_with_pool_leaves_no_worker(
    tmp_path: Path,
) -> None:
    """``asyncio.run``: a first Ctrl-C as the `async with pool` exit's close begins (it
    cancels the main task, once the close ended), a second at each point in turn as the exit
    stops serving the pool (raised there). The change is written and the pool closed; its
    I/O workers are gone, or, the second Ctrl-C having landed before anything of that stop
    ran, go with a ``close()`` of the closed pool, which finishes the stop: they once stayed
    for the process's life."""
    for n in itertools.count(1):
        t = _tensor(tmp_path, f"t{n}")
        before = set(threading.enumerate())
        pool = TensorResidencyPool()
        signal_at = SecondSignalAt("drive", "detach_current", n, _runtime.__file__)

        async def main(
            pool: TensorResidencyPool = pool,
            t: OffloadedTensor = t,
            signal_at: SecondSignalAt = signal_at,
            value: float = float(n),
        ) -> None:
            async with pool:
                async with pool.acquire(t, mode="read_write") as changed:
                    changed.fill_(value)
                sys.setprofile(signal_at)

        try:
            with pytest.raises(KeyboardInterrupt):
                asyncio.run(main())
        finally:
            sys.setprofile(None)
        assert signal_at.first_where == "Runtime.drive"
        where = signal_at.where or "no point (ran to its end)"
        assert pool.closed, where
        assert torch.equal(on_disk(t), torch.full((NUMEL,), float(n))), where
        pool.close()
        assert not io_threads_since(before), f"a Ctrl-C at {where} left the workers running"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, where
        if not signal_at.fired:
            break
    assert n > 3, "the stop made fewer points than expected: the test proves little"


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs SIGINT")
@pytest.mark.timeout(60)
def test_a_close_after_ctrl_c_cut_the_async_exit_s_close_ends_that_close(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT) lands in a loop run without a Runner while the `async with pool`
    exit's close waits for its write-back: that close stays under way, its loop gone. A
    `pool.close()` on the same thread then joins it, applying its jobs' ends itself (nothing
    else would), instead of waiting for ever for the mark of a close no one drives."""
    from torch_to_nnef.tensor.storage import _io

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    t = _tensor(tmp_path, "t")
    pool = TensorResidencyPool()

    async def main() -> None:
        async with pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(3.0)
            point.armed.set()  # the exit's write-back pauses

    def ctrl_c_then_let_the_write_end() -> None:
        if point.paused.wait(10):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # the main thread closes the pool meanwhile
        point.go()

    loop = asyncio.new_event_loop()
    try:
        with paused_in_new_threads(_io.write_payload.__code__) as point:
            sender = threading.Thread(target=ctrl_c_then_let_the_write_end, daemon=True)
            sender.start()
            with pytest.raises(KeyboardInterrupt):
                loop.run_until_complete(main())
            assert not pool.closed  # the exit's close was cut while it waited
            with pytest.raises(T2NErrorMisuse, match=r"closing; .* `pool.close\(\)` finishes it"):
                pool.resolve(t)
            pool.close()
            sender.join(10)
        assert pool.closed
        assert torch.equal(on_disk(t), torch.full((NUMEL,), 3.0))
    finally:
        with suppress(BaseException):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        gc.collect()


@pytest.mark.asyncio
async def test_an_async_generator_closed_on_its_loop_closes_the_pool_it_served(
    tmp_path: Path,
) -> None:
    """The other closing of a coroutine inside `async with pool`: an async generator's
    `aclose()` on the loop serving the pool runs the block's exit, which closes the pool."""
    t = _tensor(tmp_path, "t")

    async def values() -> Any:
        async with TensorResidencyPool() as pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(2.0)
            yield pool

    generator = values()
    pool = await generator.__anext__()
    await generator.aclose()
    assert pool.closed
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))


def test_a_load_ending_after_a_failed_async_with_exit_keeps_the_change_it_would_evict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, and the ended load puts the pool over its budget, where the victim is a
    changed value: no write-back can start while no loop serves the pool, so the value
    stays, changed, and the close writes it; nothing fails on the way."""
    ts = [_tensor(tmp_path, f"t{i}", float(i)) for i in range(3)]
    pool = TensorResidencyPool(max_cached_bytes=NBYTES)

    async def change() -> None:
        async with pool.acquire(ts[2], mode="read_write") as value:
            value.fill_(7.0)  # cached and changed: the next value in makes it leave

    handle, end_lease = _load_ending_after_a_failed_async_with_exit(pool, ts[0], ts[1], change)
    assert torch.equal(handle.wait(), torch.full((NUMEL,), 1.0))
    assert torch.equal(pool.resolve(ts[2]), torch.full((NUMEL,), 7.0))
    end_lease()
    pool.close()
    assert bool((on_disk(ts[2]) == 7.0).all())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_flush_ending_after_a_failed_async_with_exit_keeps_the_value_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush's write-back of a mapped value runs as the exit of ``async with pool`` fails
    (a thread holds a lease): its end, applied once no loop serves the pool, starts no job
    (the remap of the file written): the value stays, and nothing is logged as failed. (It
    started that job, which raised, logged as a failure of the pool, the budget's check after
    it skipped.)"""
    numel = 1 << 18  # 1 MiB: a mapped value
    t = OffloadedTensor.from_original_tensor(torch.zeros(numel), "w", offload_dir=tmp_path)
    other = _tensor(tmp_path, "other", 1.0)
    pool = TensorResidencyPool()
    holder, leased, release = _lease_holder(pool, other)

    async def serve() -> None:
        async with pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(3.0)
            holder.start()
            while not leased.is_set():
                await asyncio.sleep(0.01)
            point.armed.set()
            asyncio.get_running_loop().create_task(pool.aflush(t))
            while not point.paused.is_set():
                await asyncio.sleep(0.01)
            threading.Timer(0.2, point.go).start()  # the write ends after the exit began

    with (
        paused_in_new_threads(OffloadedTensor._write_back.__code__, "call") as point,
        pytest.raises(T2NErrorMisuse, match="cannot close"),
    ):
        asyncio.run(serve())
    assert torch.equal(pool.resolve(t), torch.full((numel,), 3.0))
    check_invariants(pool)
    release.set()
    holder.join(10)
    pool.close()
    assert torch.equal(on_disk(t), torch.full((numel,), 3.0))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    ("hit", "mode"),
    [(False, "read_write"), (False, "read"), (True, "read")],
    ids=["granted on a miss", "a reader on a miss", "a hit"],
)
def test_a_lease_ended_while_the_actor_counts_it_leaves_the_idle_pool_within_its_budget(
    tmp_path: Path, hit: bool, mode: str
) -> None:
    """A thread's lease on ``a`` ends just as the load of ``b``, the last step of all, counts
    it as holding ``a``. A ``read_write`` one granted on a miss (it counts toward the budget)
    ends under the lock the count holds: had the thread seen the value not counted as held
    (no wake-up) and the step counted it after (held, by no lease), the idle pool would stay
    over its budget for good. A ``read`` one, on a hit or granted by the actor on a miss, is
    one of the slot's readers, which end without the lock: the thread finds ``a`` not counted
    yet and tells no one, so the step must see, once it counted it, that the lease is gone.
    A reader granted on a miss counts as no hit."""
    reader = mode == "read"
    a, b = _tensor(tmp_path, "a", 1.0), _tensor(tmp_path, "b", 2.0)
    loaded = Breakpoint(OffloadedTensor._reload_unmanaged.__code__, "return")
    counted = Breakpoint(Actor._hold.__code__, "call", caller=Actor._track.__code__)
    inside, leave, left = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with pool.acquire(a, mode=mode) as value:
            assert value[0].item() == 1.0
            inside.set()
            leave.wait(30)
        left.set()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return loaded._trace(frame, event, arg) or counted._trace(frame, event, arg)

    threading.settrace(trace)  # (for the threads the pool starts)
    try:
        pool = TensorResidencyPool(max_cached_bytes=NBYTES, max_workers=2)
        if hit:
            pool.resolve(a)  # resident: the lease below is a hit
        hits = pool.stats().hits
        loaded.armed.set()
        handle = pool.prefetch(b)
        assert loaded.paused.wait(30)  # b's load ends on a worker, held there
        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(30)  # (on a miss, a was loaded by the other worker, and leased)
        assert bool(pool._actor.published[id(a)].readers) == reader
        counted.armed.set()
        loaded.go()
        assert counted.paused.wait(30)  # b's load ended: its step counts a's lease
        leave.set()
        if reader:
            assert left.wait(30), "the lease's end waited for the actor"
        else:
            holder.join(0.5)  # the lease ends meanwhile, or waits for the count to end
        counted.go()
        holder.join(30)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
        loaded.go()
        counted.go()
    assert torch.equal(handle.wait(), torch.full((NUMEL,), 2.0))
    time.sleep(0.05)
    # Read before any request (check_invariants takes note of what threads did, as a step).
    assert pool._actor.in_use_bytes == 0, "a value no lease holds is counted as in use"
    deadline = time.monotonic() + 10  # (the write-back of a read_write lease's change may run)
    while pool.resident_bytes > NBYTES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.resident_bytes <= NBYTES, "an idle pool is over its budget"
    assert pool.stats().hits == hits + hit
    assert _leased(pool) == 0
    pool.close()


def test_an_acquire_abandoned_while_another_thread_ends_a_lease_gives_back_its_reservation(
    tmp_path: Path,
) -> None:
    """An acquire waiting for its load is abandoned; while the loop thread gives back what it
    holds, another thread ends a lease over the budget, whose wake-up waits behind that. The
    reservation is given back all the same: nothing is left awaited, and the pool closes."""
    held, wanted = _tensor(tmp_path, "held"), _tensor(tmp_path, "wanted")
    code, caller = Actor.sync.__code__, Actor.abandon_acquire.__code__
    with paused_in_new_threads(code, caller=caller) as point:
        pool = TensorResidencyPool(max_cached_bytes=0)
        owned = pool.acquire(held)
        owned.__enter__()  # granted by the loop thread; no budget: counted as held at once
        gate = threading.Event()
        assert pool._runtime.loop is not None
        pool._runtime.loop.call_soon_threadsafe(gate.wait, 30)  # the loop waits for the gate
        abandoned = pool.acquire(wanted)
        abandoned._begin()  # queued: the acquire reserves the value and waits for its load
        abandoned._cancel()  # queued behind it, before the load's end
        point.armed.set()
        gate.set()
        assert point.paused.wait(30)  # the loop thread is giving back what the acquire holds
        owned.__exit__(None, None, None)  # over the budget: a wake-up, queued
        point.go()
        settle(pool)
    assert _leased(pool) == 0
    pool.close()  # refused while a value is still awaited by an acquire
    assert pool.closed


def test_a_read_of_the_state_waits_for_the_wake_up_for_ended_leases_under_way(
    tmp_path: Path,
) -> None:
    """Leases ended over the budget wake the loop; the loop thread is paused while that
    wake-up applies them. A read of the state from another thread then waits for the
    wake-up's end: it never sees the pool over its budget."""
    a, b = _tensor(tmp_path, "a"), _tensor(tmp_path, "b")
    with (
        paused_in_new_threads(Actor._apply.__code__, on="call") as point,
        TensorResidencyPool(max_cached_bytes=NBYTES) as pool,
    ):
        leases = [pool.acquire(a), pool.acquire(b)]
        for lease in leases:
            lease.__enter__()  # two values held: a budget of one, and the first outside it
        point.armed.set()
        for lease in leases:
            lease.__exit__(None, None, None)  # the first puts the pool over its budget
        assert point.paused.wait(30)  # the wake-up is applying them
        seen: list[int] = []
        reader = threading.Thread(target=lambda: seen.append(pool.resident_bytes))
        reader.start()
        reader.join(0.3)
        early = list(seen)
        point.go()
        reader.join(30)
        assert not early, f"a read saw {early[0]} bytes while the wake-up was under way"
        assert seen == [NBYTES]


# ---------------------------------------------------------------------------------------------
# A request joining a load that read the payload before a direct write
# ---------------------------------------------------------------------------------------------
def test_a_request_never_takes_a_load_that_read_before_a_direct_write(tmp_path: Path) -> None:
    t = _tensor(tmp_path, "t", 1.0)
    code = OffloadedTensor._reload_unmanaged.__code__
    with paused_in_new_threads(code) as point, TensorResidencyPool() as pool:
        point.armed.set()
        handle = pool.prefetch(t)  # its load reads 1.0, then pauses before it returns
        assert point.paused.wait(30)
        t.update_values(torch.full((NUMEL,), 2.0))  # a direct write, then a request
        resolved: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: resolved.append(pool.resolve(t)))
        reader.start()
        while pool._actor.stats().misses == 0 and reader.is_alive():  # it joined the load
            reader.join(0.01)
        point.go()
        reader.join(30)
        assert float(resolved[0][0]) == 2.0, "served the value from before the direct write"
        with pool.acquire(t) as value:
            assert float(value[0]) == 2.0
        stats = pool.stats()
        assert (stats.hits, stats.misses) == (1, 1), "a request retried was counted twice"
        # The prefetch came before the write, but is waited for after it: it has the write.
        assert float(handle.wait()[0]) == 2.0


def test_a_resolve_abandoned_while_a_superseded_write_back_ends_is_counted_once(
    tmp_path: Path,
) -> None:
    """A direct write lands once a write-back committed, before the pool heard of its end: a
    resolve then waits for that write-back (to drop the older value after it); cancelled
    meanwhile, it still counts as one request."""
    t = _tensor(tmp_path, "t")
    code = OffloadedTensor._write_back.__code__
    with paused_in_new_threads(code) as point, TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # dirty
        point.armed.set()
        flusher = threading.Thread(target=pool.flush)
        flusher.start()  # the write-back commits, then its worker pauses
        assert point.paused.wait(30)
        t.update_values(torch.full((NUMEL,), 2.0))

        async def resolve_then_cancel() -> None:
            task = asyncio.ensure_future(pool.aresolve(t))
            for _ in range(500):  # until the pool has counted it (or 5 s)
                if pool.stats().misses > 1:  # the first: the acquire above
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

        asyncio.run(resolve_then_cancel())
        point.go()
        flusher.join(30)
        stats = pool.stats()
        assert (stats.hits, stats.misses) == (0, 2), f"two requests, counted {stats}"
        assert float(pool.resolve(t)[0]) == 2.0


def test_a_write_back_never_takes_another_pools_change_made_meanwhile_for_its_own(
    tmp_path: Path,
) -> None:
    """Pool ``b`` changes the value while ``a`` writes its older change back (its worker is
    paused in the write): ``a`` then serves ``b``'s change, not its own older value."""
    t = _tensor(tmp_path, "t")
    code = OffloadedTensor._write_encoded.__code__
    with (
        paused_in_new_threads(code, on="call") as point,
        TensorResidencyPool() as a,
        TensorResidencyPool() as b,
    ):
        with a.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # a's change, unsaved
        with b.acquire(t, mode="read_write") as later:  # reads a's change
            point.armed.set()
            flusher = threading.Thread(target=a.flush)
            flusher.start()
            assert point.paused.wait(30)  # a's write-back of 1.0 is under way
            later.fill_(2.0)  # b's change, later in program order, noted as the lease ends
        point.go()
        flusher.join(30)
        assert float(a.resolve(t)[0]) == 2.0, "a took b's change for its own write"
        with a.acquire(t) as value:
            assert float(value[0]) == 2.0
    assert bool((on_disk(t) == 2.0).all())


# ---------------------------------------------------------------------------------------------
# Write-backs never copy a value while a read_write lease holds it
# ---------------------------------------------------------------------------------------------
def test_a_flush_never_writes_a_change_half_made_under_a_read_write_lease(tmp_path: Path) -> None:
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # dirty once the lease ends
        with pool.acquire(t, mode="read_write") as value:
            value[: NUMEL // 2] = 2.0  # half of the next change
            pool.flush()
            written = on_disk(t)
            assert bool((written == written[0]).all()), "a flush wrote a half-made change"
            value[NUMEL // 2 :] = 2.0
        pool.flush()
        assert bool((on_disk(t) == 2.0).all())


def test_a_read_write_lease_is_never_granted_while_a_write_back_starts(tmp_path: Path) -> None:
    """The loop thread is paused in the middle of starting a write-back (its job submitted):
    a thread asking for a read_write lease then must wait for the write-back's end."""
    t = _tensor(tmp_path, "t")
    # The breakpoint is in the pool's loop thread, started inside the block.
    with paused_in_new_threads(Actor._job.__code__) as point, TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(3.0)  # dirty
        point.armed.set()
        flusher = threading.Thread(target=pool.flush)
        flusher.start()  # the loop thread pauses once the write-back's job is submitted
        assert point.paused.wait(30)
        half_done = threading.Event()

        def writer() -> None:
            with pool.acquire(t, mode="read_write") as value:
                value[: NUMEL // 2] = 4.0
                half_done.set()
                settle(pool)
                value[NUMEL // 2 :] = 4.0

        thread = threading.Thread(target=writer)
        thread.start()
        granted_early = half_done.wait(0.5)
        point.go()
        thread.join(30)
        flusher.join(30)
        assert not granted_early, "a read_write lease was granted while a write-back started"
        assert bool((on_disk(t) == 3.0).all())
    assert bool((on_disk(t) == 4.0).all())


def _lease_paused_at(
    point: Breakpoint, pool: TensorResidencyPool, t: OffloadedTensor, change: Callable[..., Any]
) -> threading.Thread:
    """Start a thread that applies ``change`` to ``t``'s value under a ``read_write`` lease
    of ``pool``; return it once paused at ``point`` (armed here)."""

    def owner() -> None:
        with pool.acquire(t, mode="read_write") as value:
            change(value)

    point.armed.set()
    thread = threading.Thread(target=owner)
    thread.start()
    assert point.paused.wait(30)
    return thread


def test_a_change_is_never_lost_to_a_write_back_as_its_lease_ends(tmp_path: Path) -> None:
    """The owner of a read_write lease is paused as its change becomes the tensor's latest
    write; an eviction then must not write back (or drop) the value without that change."""
    t = _tensor(tmp_path, "t")
    code = OffloadedTensor._note_unsaved.__code__
    with paused_in_new_threads(code, on="call") as point, TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)
        pool.flush()
        thread = _lease_paused_at(point, pool, t, lambda value: value.fill_(2.0))
        with suppress(T2NErrorMisuse):  # the lease still holds the value
            pool.evict(t)
        point.go()
        thread.join(30)
    assert bool((on_disk(t) == 2.0).all()), "the change of a lease ending was lost"


def _run_together(threads: list[threading.Thread], stop: threading.Event, seconds: float) -> None:
    """Start ``threads``, let them run for ``seconds`` (less when one sets ``stop``), then
    set ``stop`` and wait for them."""
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"


def test_read_write_leases_held_at_once_make_one_change_never_seen_half_made(
    tmp_path: Path,
) -> None:
    """Two ``read_write`` leases on one value, the second entered before the first ends:
    reads outside the pool see neither change until the last lease ends, then both, whole;
    a direct write in between stands (the leases' change is dropped, as for one lease)."""
    t = _tensor(tmp_path, "t")
    other = TensorResidencyPool()
    with TensorResidencyPool() as pool:
        first, second = pool.acquire(t, mode="read_write"), pool.acquire(t, mode="read_write")
        first.__enter__().add_(1.0)
        value = second.__enter__()
        value[: NUMEL // 2] += 10.0  # the second change, half made
        first.__exit__(None, None, None)
        assert bool((t.reload() == 0.0).all())
        assert bool((other.resolve(t) == 0.0).all())
        value[NUMEL // 2 :] += 10.0
        second.__exit__(None, None, None)
        assert bool((t.reload() == 11.0).all())
    assert bool((on_disk(t) == 11.0).all())
    other.close()

    u = _tensor(tmp_path, "u")
    with TensorResidencyPool() as pool:
        first, second = pool.acquire(u, mode="read_write"), pool.acquire(u, mode="read_write")
        first.__enter__().add_(1.0)
        value = second.__enter__()
        value[: NUMEL // 2] += 10.0
        first.__exit__(None, None, None)
        u.add_(5.0)  # a direct write, outside any scope: it comes after the leases' value
        value[NUMEL // 2 :] += 10.0
        second.__exit__(None, None, None)
        assert bool((pool.resolve(u) == 5.0).all())
    assert bool((on_disk(u) == 5.0).all())


def test_a_read_write_lease_entered_as_another_ends_is_never_seen_half_made(
    tmp_path: Path,
) -> None:
    """The last ``read_write`` lease on a value ends and is paused before it notes its change;
    another is entered on the value meanwhile and changes half of it. Reads outside the pool
    (``reload``, another pool) never see that half change: the first lease's note, decided
    before the second was entered, would publish the value under way (it once did, and a
    second pool loaded the half-made value and wrote it back as the latest write)."""
    t = _tensor(tmp_path, "t")
    code = OffloadedTensor._note_unsaved.__code__
    other = TensorResidencyPool()
    with paused_in_new_threads(code, on="call") as point, TensorResidencyPool() as pool:
        thread = _lease_paused_at(point, pool, t, lambda value: value.add_(1.0))
        second = pool.acquire(t, mode="read_write")
        value = second.__enter__()
        value[: NUMEL // 2] += 10.0  # the second change, half made
        point.go()
        thread.join(30)
        assert not thread.is_alive()
        for seen in (t.reload(), other.resolve(t)):
            assert bool((seen == seen[0]).all()), f"seen half made: {sorted(set(seen.tolist()))}"
        value[NUMEL // 2 :] += 10.0
        second.__exit__(None, None, None)
        assert bool((t.reload() == 11.0).all())
        assert _leased(pool) == 0
    other.close()
    assert bool((on_disk(t) == 11.0).all())


def test_a_read_write_lease_entered_as_another_notes_its_change_keeps_a_whole_copy(
    tmp_path: Path,
) -> None:
    """A ``read_write`` lease noting its change is paused as it publishes the value (the
    tensor's lock held); another lease entered on the value then must keep a copy of the
    published value for reads outside the pool before it changes anything, not take the
    value for one that holds no unsaved change yet."""
    t = _tensor(tmp_path, "t")
    note = OffloadedTensor._note_unsaved
    code, line = note.__code__, line_of(note, "self._unsaved = (owner")
    half_done = threading.Event()
    finish = threading.Event()
    with paused_in_new_threads(code, on="line", line=line) as point, TensorResidencyPool() as pool:

        def second() -> None:
            with pool.acquire(t, mode="read_write") as value:
                value[: NUMEL // 2] += 10.0  # half made
                half_done.set()
                finish.wait(30)
                value[NUMEL // 2 :] += 10.0

        pool.resolve(t)  # resident: both leases are granted without the loop thread
        noting = _lease_paused_at(point, pool, t, lambda value: value.add_(1.0))
        entering = threading.Thread(target=second)
        entering.start()
        half_done.wait(0.5)  # (with the tensor's lock held, it waits for the note instead)
        point.go()
        noting.join(30)
        assert half_done.wait(30)
        seen = t.reload()
        finish.set()
        entering.join(30)
        assert not noting.is_alive() and not entering.is_alive()
        assert bool((seen == 1.0).all()), f"a change seen half made: {sorted(set(seen.tolist()))}"
        assert bool((t.reload() == 11.0).all())
    assert bool((on_disk(t) == 11.0).all())


@pytest.mark.parametrize("entered_after", [False, True])
def test_a_read_write_lease_granted_and_not_entered_holds_back_no_change(
    tmp_path: Path, entered_after: bool
) -> None:
    """A ``read_write`` lease granted and not entered (begun ahead, as streams and read-ahead
    do, or granted by the loop as its caller abandoned the acquire) has changed nothing: the
    change of a lease entered and ended meanwhile is the tensor's latest write at once, for
    reads outside the pool and another pool (it once waited for the idle lease to end, and
    a write ordered after it in another thread could read the older value). Entered later,
    the idle lease makes a change of its own."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool, TensorResidencyPool() as other:
        pool.resolve(t)
        begun = pool.acquire(t, mode="read_write")
        assert begun._begin()  # granted at once: the value is resident
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
        assert bool((t.reload() == 1.0).all())
        assert bool((other.resolve(t) == 1.0).all())
        if entered_after:
            with begun as value:
                value.add_(1.0)
        else:
            begun._cancel()
        expected = 2.0 if entered_after else 1.0
        assert bool((t.reload() == expected).all())
        assert _leased(pool) == 0
    assert bool((on_disk(t) == expected).all())


def test_threads_sharing_read_write_leases_never_show_a_half_made_change(
    tmp_path: Path,
) -> None:
    """Threads change one value in two halves under overlapping ``read_write`` leases (one
    half at a time, under a lock of their own, so that others end their leases in between);
    reads outside the pool, and the file after the close, always see a whole value."""
    t = _tensor(tmp_path, "t")
    stop = threading.Event()
    change = threading.Lock()
    failures: list[BaseException] = []
    torn: list[list[float]] = []
    done = [0]

    def writer() -> None:
        try:
            while not stop.is_set():
                with pool.acquire(t, mode="read_write") as value:
                    with change:
                        value[: NUMEL // 2] += 1.0
                    time.sleep(0)
                    with change:
                        value[NUMEL // 2 :] += 1.0
                        done[0] += 1
        except BaseException as error:
            failures.append(error)
            stop.set()

    def reader() -> None:
        while not stop.is_set():
            seen = t.reload()
            if not bool((seen == seen[0]).all()):
                torn.append(sorted(set(seen.tolist())))
                stop.set()

    with TensorResidencyPool() as pool:
        threads = [threading.Thread(target=writer) for _ in range(3)]
        _run_together([*threads, threading.Thread(target=reader)], stop, 2.0)
        assert not failures, failures[0]
        assert not torn, f"a read outside the pool saw a change half made: {torn[0]}"
    assert bool((on_disk(t) == float(done[0])).all())


def test_threads_writing_under_leases_while_evictions_write_back_never_tear_a_payload(
    tmp_path: Path,
) -> None:
    """Threads change values in two halves under read_write leases (one writer per tensor)
    while a budget of two values forces write-backs and another thread flushes: every
    payload on disk is always whole (one value in every element)."""
    tensors = [_tensor(tmp_path, f"t{i}") for i in range(6)]
    stop = threading.Event()
    failures: list[BaseException] = []
    torn: list[str] = []

    def guarded(target: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as error:
                failures.append(error)
                stop.set()

        return threading.Thread(target=run)

    def writer(indices: list[int], seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                t = tensors[rng.choice(indices)]
                with pool.acquire(t, mode="read_write") as value:
                    new = float(value[0]) + 1.0
                    value[: NUMEL // 2] = new
                    value[NUMEL // 2 :] = new

        return run

    def flusher() -> None:
        rng = random.Random(9)
        while not stop.is_set():
            pool.flush(rng.choice(tensors) if rng.random() < 0.5 else None)

    def checker() -> None:
        while not stop.is_set():
            for t in tensors:
                try:
                    written = on_disk(t)
                except T2NErrorStorage:
                    continue  # replaced while it was read: read the next one
                if not bool((written == written[0]).all()):
                    torn.append(f"{t.name}: {sorted(set(written.tolist()))}")
                    stop.set()

    with TensorResidencyPool(max_cached_bytes=2 * NBYTES, max_workers=2) as pool:
        threads = [
            guarded(writer([0, 1, 2], 1)),
            guarded(writer([3, 4, 5], 2)),
            guarded(flusher),
            guarded(checker),
        ]
        _run_together(threads, stop, 4.0)
        assert not failures, failures[0]
        assert not torn, f"a write-back copied a value mid-change: {torn[0]}"
        assert _leased(pool) == 0
    for t in tensors:
        written = on_disk(t)
        assert bool((written == written[0]).all())


def test_a_value_whose_eviction_writes_it_back_is_no_victim_again(tmp_path: Path) -> None:
    """A changed value is evicted: it leaves once its write-back ends. Loads meanwhile put
    the pool over its budget of one value: the eviction they start frees a value that stays,
    not the one already on its way out (which frees nothing more)."""
    a, b, c = (_tensor(tmp_path, name) for name in "abc")
    with (
        paused_in_new_threads(OffloadedTensor._write_back.__code__, on="call") as write,
        TensorResidencyPool(max_cached_bytes=NBYTES, max_workers=2) as pool,
    ):
        with pool.acquire(a, mode="read_write") as value:
            value.fill_(1.0)
        write.armed.set()
        evicting = threading.Thread(target=pool.evict, args=(a,))
        evicting.start()
        assert write.paused.wait(30)  # a's write-back has begun
        pool.resolve(b)
        pool.resolve(c)  # b and c cached: one must leave
        check_invariants(pool)
        leaving = pool.resident_bytes
        kept = [pool.is_resident(t) for t in (b, c)]
        write.go()
        evicting.join(30)
        assert leaving == 2 * NBYTES, "a value beyond the budget stayed while one was written"
        assert kept == [False, True]
        assert not pool.is_resident(a) and bool((on_disk(a) == 1.0).all())
        check_invariants(pool)


def test_a_lease_ended_as_an_eviction_looks_leaves_the_value_held_by_nothing(
    tmp_path: Path,
) -> None:
    """A thread ends its ``read_write`` lease just after an eviction of the value looked at
    the leases (still held then): the eviction goes on, and the value on its way out is
    neither counted as held nor as a victim for later evictions."""
    t = _tensor(tmp_path, "t")
    caller = Actor.evict_step.__code__
    with paused_in_new_threads(Actor.sync.__code__, caller=caller) as point:
        pool = TensorResidencyPool(max_cached_bytes=NBYTES)
        lease = pool.acquire(t, mode="read_write")
        lease.__enter__().fill_(1.0)  # granted by the loop thread: counted as held
        point.armed.set()
        evicting = threading.Thread(target=pool.evict, args=(t,))
        evicting.start()
        assert point.paused.wait(30)  # the eviction saw the lease held
        seen: list[BaseException | None] = []

        def look() -> None:  # on the loop thread, before the write-back can end
            try:
                check_invariants(pool)
                seen.append(None)
            except BaseException as error:
                seen.append(error)

        assert pool._runtime.loop is not None
        pool._runtime.loop.call_soon_threadsafe(look)
        lease.__exit__(None, None, None)
        point.go()
        evicting.join(30)
        assert not evicting.is_alive() and seen == [None], seen
    assert not pool.is_resident(t) and bool((on_disk(t) == 1.0).all())
    check_invariants(pool)
    pool.close()


def _pool_works_in_another_thread(directory: Path) -> None:
    """A new pool serves, reports and closes within 10 s (no lock of the process was left
    held by an interrupted pool)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with TensorResidencyPool() as other:
                other.resolve(_tensor(directory, "other"))
                other.stats()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "a new pool hangs after an interrupted close"
    assert not errors, errors


@pytest.mark.timeout(300)
def test_an_interrupt_at_any_call_of_close_then_a_retry_stops_everything(tmp_path: Path) -> None:
    """Ctrl-C at any function entry of ``close()``; the user closes again: the pool ends
    closed, its loop and I/O threads stopped, its change written, and no lock of the process
    is left held (another pool works)."""
    for n in itertools.count(1):
        t = _tensor(tmp_path, f"t{n}")
        pool = TensorResidencyPool()
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1.0)
        runtime = pool._runtime
        was_interrupted = interrupted(InterruptAt(n), pool.close)
        pool.close()
        assert pool.closed
        assert not runtime.private and not runtime.running
        assert float(on_disk(t)[0]) == 1.0, f"interrupt at function entry {n}"
        _pool_works_in_another_thread(tmp_path)
        if not was_interrupted:
            assert n > 10  # the injection reached the pool's code
            return


def _loop_thread_code() -> Any:
    """The code of the private loop thread's function (``run``, inside ``_start_private``)."""
    (code,) = [
        c
        for c in _runtime.Runtime._start_private.__code__.co_consts
        if getattr(c, "co_name", None) == "run"
    ]
    return code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_uvloop", [False, True])
def test_two_closes_stopping_the_private_loop_at_once_end_its_thread_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_uvloop: bool
) -> None:
    """Two threads close a pool at once: each asks its private loop to stop, the second
    after the loop stopped for the first and while its thread runs what was posted before
    (at interpreter exit, a daemon's pool closing while the exit work closes it). That stop
    ends that run early: the thread runs the rest and still stops its workers and closes its
    loop (it died with "Event loop stopped before Future completed", leaving them running)."""
    errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: errors.append(hook.exc_value))
    t = _tensor(tmp_path, "t", 1.0)
    before = set(threading.enumerate())
    line = line_of(_runtime.Runtime._start_private, "workers = self._detach()")
    with paused_in_new_threads(_loop_thread_code(), on="line", line=line) as point:
        pool = TensorResidencyPool(use_uvloop=use_uvloop)
        pool.resolve(t)  # starts the loop thread (and its workers)
        point.armed.set()
        first = threading.Thread(target=pool.close)
        first.start()
        assert point.paused.wait(10)  # run_forever returned: the first stop ran
        loop = pool._runtime.loop
        assert loop is not None
        second = threading.Thread(target=pool.close)  # the pool is closed: it stops the loop
        second.start()
        time.sleep(0.5)  # it posts its stop, then waits for the loop thread
        assert second.is_alive()
        point.go()
        first.join(30)
        second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert errors == []
    started = set(threading.enumerate()) - before
    for thread in started:
        thread.join(10)
    assert not [thread.name for thread in started if thread.is_alive()]
    assert loop.is_closed()


def test_a_lease_collected_amid_its_tensors_code_after_a_ctrl_c_cut_the_collections_callback(
    tmp_path: Path,
) -> None:
    """A generator inside `with pool.acquire(t, "read_write")`, freed by a garbage
    collection that runs while this thread holds the lock its end takes to note its change
    (amid the tensor's own code), a Ctrl-C landing on the collection's first callback: the
    lease still ends at the pool's next step, never amid that code, keeping its change."""
    t = _tensor(tmp_path, "t")
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.fill_(1.0)  # an unsaved change, which the lease's end would replace

        def hold() -> Generator[None, None, None]:
            with pool.acquire(t, mode="read_write") as value:
                value.fill_(2.0)
                yield

        with collections_by_hand() as caught:
            generator = hold()
            next(generator)
            cycle: list[Any] = [generator]
            cycle.append(cycle)
            del cycle, generator
            with t._pending_lock:
                unsaved = t._unsaved
                interrupted_then(gc.collect)  # the Ctrl-C lands as the collection starts
                unchanged = t._unsaved is unsaved
        assert [(report.exc_type, report.object) for report in caught] == [
            (KeyboardInterrupt, _owned._note_collection)
        ], "the Ctrl-C did not land on the package's callback: the test proves nothing"
        assert unchanged, "the lease's end changed the tensor amid its own code"
        pool.flush()  # a step of the pool's: the lease ended there
        assert _leased(pool) == 0
        assert torch.equal(t.reload(), torch.full((NUMEL,), 2.0))
    assert torch.equal(on_disk(t), torch.full((NUMEL,), 2.0))
