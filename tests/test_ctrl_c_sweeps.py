"""Ctrl-C at each point of an operation in turn (``SignalAt``): whatever it interrupts, no
file, descriptor or SIGINT handler is left behind, and the value on disk is whole."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import inspect
import itertools
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from breakpoints import Breakpoint, breakpoints_in_new_threads
from interrupts import signalled
from open_files import open_descriptors
from residency_checks import check_invariants, on_disk, settle

from torch_to_nnef import _interrupts
from torch_to_nnef.tensor import load_offloaded_checkpoint, storage
from torch_to_nnef.tensor.hf import t2n_load_checkpoint_and_dispatch
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    ResidencyStrategy,
    TensorResidencyPool,
    _handles,
    _runtime,
    _stream,
    _workers,
    active_tensor_residency,
    stream_modules,
)
from torch_to_nnef.tensor.residency._policy import ScheduledPolicy
from torch_to_nnef.tensor.residency._state import Job

SOURCE = str(Path(storage.__file__).parents[1])  # the package's tensor code

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")

# Each point ends with full collections: they walk only what the sweep made.
pytestmark = pytest.mark.usefixtures("young_collections")


def left_in(directory: Path) -> set[str]:
    """The files under ``directory``, and what the process's descriptors open in it (or of
    it) point to."""
    left = {str(path) for path in directory.rglob("*")}
    return left | {f"descriptor of {target}" for target in open_descriptors(directory)}


@contextlib.contextmanager
def unswept() -> Iterator[None]:
    """A block that a sweep running around it does not sweep: its set-up, say."""
    profiler = sys.getprofile()
    sys.setprofile(None)
    try:
        yield
    finally:
        sys.setprofile(profiler)


def sweep(
    run: Callable[[], object],
    directory: Path,
    check: Callable[[str], None] = lambda where: None,
    within: str = SOURCE,
    tidy: Callable[[], None] = lambda: None,
) -> int:
    """Run ``run`` with a Ctrl-C at its n-th point, for n = 1, 2, ... until one runs without
    it. After each, with the KeyboardInterrupt dropped and a collection made: no file or
    descriptor is left in ``directory`` that was not there before, Python's SIGINT handler is
    in force with no stale one recorded, and ``check(where)`` holds; then ``tidy()`` ends
    what the run began (checked or not). Return the number of points interrupted.

    Not counted: the points of finalizers (a file's removal as its tensor dies), where
    Python loses an interrupt whatever the code does. Not checked: a Ctrl-C at the entry to
    an ``__exit__`` method, where Python runs a pending handler before any of its code,
    which therefore cannot guard it."""
    handler = signal.getsignal(signal.SIGINT)  # (Python's default one, or the test's)
    for n in itertools.count(1):
        before = left_in(directory)
        signal_at = signalled(n, within, run, finalizers=False)[0]  # the interrupt dropped
        gc.collect(1)  # the young generations: what the interrupted run dropped
        where = signal_at.where or "no point (ran to its end)"
        if not signal_at.exit_entry:
            assert left_in(directory) - before == set(), f"a Ctrl-C at {where} left them"
            check(where)
        tidy()
        assert _interrupts._replaced == [], f"a Ctrl-C at {where} left a stale handler"
        assert signal.getsignal(signal.SIGINT) is handler
        if not signal_at.fired:
            return n - 1
    raise AssertionError("unreachable")


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_write_leaves_no_temporary_and_the_old_or_new_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.safetensors"
    old, new = torch.zeros(1000), torch.ones(1000)
    storage.write_payload(path, {"x": old})

    def check(where: str) -> None:
        value = safetensors.torch.load_file(path)["x"]
        assert torch.equal(value, old) or torch.equal(value, new), f"torn at {where}"

    points = sweep(lambda: storage.write_payload(path, {"x": new}), tmp_path, check)
    assert points > 50, "the write made fewer points than expected: the test proves little"


@pytest.mark.timeout(180)
def test_an_interrupt_anywhere_in_a_write_in_another_thread_leaves_the_tensor_readable(
    tmp_path: Path,
) -> None:
    """An interrupt that no hold holds off (an asynchronous exception raised in a thread
    other than the main one, as thread-killing helpers raise it) at each point of a direct
    write made in that thread: the tensor reads its old value or its new one, a pool serves
    the same, and the tensor can be written again. One landing just after the new file was
    renamed over the old once left the tensor bound to the replaced file: every read failed
    ("another process replaced its payload file") until the next write, while the pool
    served the old value."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(1000), "t", offload_dir=tmp_path)
    with TensorResidencyPool() as pool:
        for n in itertools.count(1):
            before = t.reload()
            pool.resolve(t)
            new = before + 1
            swept: list[Any] = []

            def write(n: int = n, new: torch.Tensor = new, swept: list[Any] = swept) -> None:
                swept.append(signalled(n, SOURCE, lambda: t.update_values(new), False)[0])

            writer = threading.Thread(target=write)
            writer.start()
            writer.join(30)
            where = swept[0].where or "no point (ran to its end)"
            value = t.reload()
            assert torch.equal(value, before) or torch.equal(value, new), f"torn at {where}"
            assert torch.equal(pool.resolve(t), value), f"an interrupt at {where}"
            if not swept[0].fired:
                break
        t.update_values(torch.full((1000,), -1.0))
        assert torch.equal(pool.resolve(t), torch.full((1000,), -1.0))
    assert n > 50, f"the write made fewer points ({n - 1}) than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_an_offload_leaves_nothing_once_the_tensor_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new offloaded tensor's file and private directory go with the tensor, wherever a
    Ctrl-C cut its creation: between the rename and the file's owner, or between the making
    of the directory and its remover, they once stayed for the process's life."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # private directories land here
    value = torch.arange(1000, dtype=torch.float32)
    points = sweep(lambda: OffloadedTensor.from_original_tensor(value, "w"), tmp_path)
    assert points > 50, "the offload made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_read_leaves_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    value = torch.arange(1000, dtype=torch.float32)
    storage.write_payload(path, {"x": value})

    def read() -> None:
        got = storage.read_payload(storage.read_layout(path))["x"]
        assert torch.equal(got, value)

    points = sweep(read, tmp_path)
    assert points > 20, "the read made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(60)
def test_a_ctrl_c_anywhere_in_opening_a_checkpoint_file_leaves_no_descriptor(
    tmp_path: Path,
) -> None:
    """``open_regular_file`` (a checkpoint's index, a pickle check): one landing between the
    open and the file object's making once leaked the descriptor for the process's life."""
    path = tmp_path / "model.safetensors.index.json"
    path.write_text("{}")

    def read() -> None:
        with storage.open_regular_file(path) as file:
            assert file.read() == b"{}"

    points = sweep(read, tmp_path)
    assert points > 10, "the open made fewer points than expected: the test proves little"


def test_a_ctrl_c_anywhere_in_a_hold_leaves_python_s_handler_and_no_stale_one(
    tmp_path: Path,
) -> None:
    """A Ctrl-C raised just as a hold put Python's handler back once left the replaced
    handler recorded, which every child forked later got back in place of its own."""

    def hold() -> None:
        with _interrupts.InterruptHold() as held:
            held.start()

    assert sweep(hold, tmp_path, within=_interrupts.__file__) > 3


@pytest.mark.timeout(60)
def test_a_hold_defers_a_handler_set_from_python_and_runs_it_once_per_sigint_as_it_ends() -> None:
    """``asyncio.run``'s handler (cancel at the first Ctrl-C, raise at the second), or an
    application's, is held as Python's default one is: it runs as the block ends, once per
    SIGINT received meanwhile, and is in force again after."""
    calls: list[int] = []

    def counting(signum: int, frame: Any) -> None:
        calls.append(signum)
        if len(calls) == 3:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, counting)
    try:
        with _interrupts.InterruptHold() as held:
            held.start()
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert calls == []  # recorded, not run
        assert calls == [signal.SIGINT, signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is counting
        with pytest.raises(KeyboardInterrupt), _interrupts.InterruptHold() as held:
            held.start()
            signal.raise_signal(signal.SIGINT)
        assert len(calls) == 3 and signal.getsignal(signal.SIGINT) is counting
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no handler to hold: nothing changes
        with _interrupts.InterruptHold() as held:
            held.start()
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _interrupts._replaced == []


# ---------------------------------------------------------------------------------------------
# The residency pool and its streams
# ---------------------------------------------------------------------------------------------
def offloaded_model(directory: Path, layers: int = 3) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(layers)))
    for index, layer in enumerate(model):
        for name, tensor in list(layer.named_parameters()):
            offloaded = OffloadedTensor.from_original_tensor(
                tensor.detach().clone(), f"{index}.{name}", offload_dir=directory
            )
            setattr(layer, name, torch.nn.Parameter(offloaded, requires_grad=False))
    return model, torch.randn(2, 16)


def leased(pool: TensorResidencyPool) -> str:
    """How many values of ``pool`` are leased, as its ``repr`` says."""
    return repr(pool).split("leased: ")[1].split(",")[0]


def hooks_on(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_read_write_lease_leaves_no_lease_even_kept(
    tmp_path: Path,
) -> None:
    """A Ctrl-C past the entry of a lease's exit once left the lease held for as long as its
    KeyboardInterrupt lived: kept (by an interactive session), the pool refused to close.
    The change is kept or not, never torn."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(256), "t", offload_dir=tmp_path)
    with TensorResidencyPool() as pool:
        pool.resolve(t)  # a hit from now on

        def add_one() -> None:
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1)

        def check(where: str) -> None:
            assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
            value = pool.resolve(t)
            assert bool((value == value[0]).all()), f"torn at {where}"

        kept: list[BaseException] = []  # the last interrupt, as an interactive session keeps it

        def keeping() -> None:
            kept.clear()
            try:
                add_one()
            except KeyboardInterrupt as interrupt:
                kept.append(interrupt)
                raise

        points = sweep(keeping, tmp_path, check, within=str(Path(_handles.__file__).parent))
        assert points > 20, "the lease made fewer points than expected: the test proves little"
        kept.clear()
    assert pool.closed


@needs_proc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["read", "read_write"])
def test_a_ctrl_c_anywhere_in_a_lease_leaves_its_value_to_the_budget(
    tmp_path: Path, mode: str
) -> None:
    """A Ctrl-C at each point of a lease on a value that the pool's budget holds alone: once
    the lease ended, that value is cached again, and a load of another value evicts it. (One
    landing as the lease's end queued its value for the pool's loop, after the lease let go
    of it, left it counted as in use for good: over the budget, never evicted.)"""
    ts = [
        OffloadedTensor.from_original_tensor(torch.zeros(256), f"t{i}", offload_dir=tmp_path)
        for i in range(2)
    ]
    with TensorResidencyPool(max_cached_bytes=256 * 4) as pool:  # one value

        def lease() -> None:
            with pool.acquire(ts[0], mode=mode) as value:
                value.add_(0)
                settle(pool)  # the pool's loop counts the lease

        def check(where: str) -> None:
            settle(pool)
            assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
            pool.resolve(ts[1])  # evicts the other value
            settle(pool)
            assert not pool.is_resident(ts[0]), f"a Ctrl-C at {where} left the value in use"
            check_invariants(pool)

        def tidy() -> None:
            pool.resolve(ts[0])  # a hit at the next point

        tidy()
        points = sweep(lease, tmp_path, check, str(Path(_handles.__file__).parent), tidy)
        assert points > 10, "the lease made fewer points than expected: the test proves little"
    assert pool.closed


class _HeldUpWriteBack:
    """A flush of ``pool`` (in a thread of its own) whose write-back of ``t`` is announced,
    then held up until :meth:`let_go`, and ``seconds`` more: a thread holds the tensor's write
    lock meanwhile, as a direct write of it does."""

    def __init__(self, pool: TensorResidencyPool, t: OffloadedTensor, seconds: float) -> None:
        self.go, locked = threading.Event(), threading.Event()

        def hold() -> None:
            with t._write_lock:
                locked.set()
                self.go.wait(10)
                time.sleep(seconds)

        self.holder = threading.Thread(target=hold)
        self.holder.start()
        locked.wait(10)
        self.flusher = threading.Thread(target=pool.flush)
        self.flusher.start()
        deadline = time.monotonic() + 10
        while not t._pending_writes and time.monotonic() < deadline:
            time.sleep(0.001)
        assert t._pending_writes, "the write-back was not announced"

    def let_go(self) -> None:
        self.go.set()

    def ended(self) -> bool:
        """Whether the write-back and the flush ended (within 10 s)."""
        self.go.set()
        self.holder.join(10)
        self.flusher.join(10)
        return not self.flusher.is_alive()


@pytest.mark.timeout(60)
def test_a_ctrl_c_anywhere_in_a_wait_for_a_reply_leaves_its_other_waiters_answered() -> None:
    """Two threads wait for one request's reply (a prefetch handle waited for in two
    places), the main thread first. Settling the reply opens its gate for one waiter, who
    opens it for the next. A Ctrl-C landing in the main thread's wait just as it took the
    gate, before it opened it again, once left the other thread waiting for ever."""
    within = _runtime.__file__
    for n in itertools.count(1):
        reply = _runtime.Reply()
        answered: list[object] = []

        def second(reply: _runtime.Reply = reply, answered: list[object] = answered) -> None:
            time.sleep(0.05)  # at the gate after the main thread
            answered.append(reply.result())

        waiter = threading.Thread(target=second, daemon=True)
        settler = threading.Timer(0.15, reply.set_result, ("value",))
        waiter.start()
        settler.start()
        signal_at, interrupt = signalled(n, within, reply.result)
        if interrupt is None:  # not cut: it waited at the gate and was answered
            assert reply.result() == "value"
        settler.join(10)
        waiter.join(10)
        assert answered == ["value"], f"a Ctrl-C at {signal_at.where} left a waiter waiting"
        if not signal_at.fired:
            break
    assert n > 2, "the wait made fewer points than expected: the test proves little"


@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_stop_of_the_io_workers_leaves_the_next_stop_to_end_them() -> None:
    """The stop of a pool's I/O workers, cut by a Ctrl-C at each point in turn (the close of
    a pool stranded by its closed loop stops them on the main thread): a stop again (the one
    at interpreter exit, say) ends the threads. A Ctrl-C landing once the workers were marked
    stopped and before their stop marks were queued once left them waiting for good, and
    the stop at interpreter exit waited 300 s for each."""
    within = _workers.__file__
    for n in itertools.count(1):
        workers = _workers.Workers(2, lambda job: None)
        for _ in range(2):
            workers.submit(Job("load", time.sleep, (0.01,), lambda job: None))
        threads = list(workers._threads)
        signal_at, _ = signalled(n, within, workers.shutdown)
        stopper = threading.Thread(target=workers.shutdown, daemon=True)
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive(), f"a Ctrl-C at {signal_at.where} left a stop waiting"
        assert not any(thread.is_alive() for thread in threads), signal_at.where
        if not signal_at.fired:
            break
    assert n > 3, "the stop made fewer points than expected: the test proves little"


@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_a_copy_waiting_for_a_write_back_leaves_it_free_to_end(
    tmp_path: Path,
) -> None:
    """A copy of a tensor (``copy.deepcopy``) waits for the write-back of it that a pool
    announced. A Ctrl-C anywhere in that wait, ``threading``'s own code included, leaves
    nothing held: the write-back ends, and the flush that waits for it. A
    ``threading.Condition`` stood there once, whose ``__enter__`` a Ctrl-C cut with its lock
    held: the pool's I/O worker then waited for that lock for ever, and flush and close with
    it."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(256), "t", offload_dir=tmp_path)
    pool = TensorResidencyPool()  # left open on a failure: its close would wait for ever
    for n in itertools.count(1):
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1)
        write_back = _HeldUpWriteBack(pool, t, seconds=0.02)

        latest = torch.full((256,), float(n))

        def copy_while_written(latest: torch.Tensor = latest) -> None:
            assert torch.equal(copy.deepcopy(t), latest), "not the latest write"

        write_back.let_go()  # (before the sweep: an Event's own code is threading's)
        signal_at = signalled(n, (SOURCE, "threading.py"), copy_while_written, finalizers=False)[0]
        assert write_back.ended(), f"a Ctrl-C at {signal_at.where} left the write-back waiting"
        assert torch.equal(copy.deepcopy(t), latest)
        if not signal_at.fired:
            break
    pool.close()
    assert n > 10, "the copy made fewer points than expected: the test proves little"


class _CallersLoop:
    """A loop of the caller's on the main thread, run as a script runs one
    (``run_until_complete``, Python's own SIGINT handler in force), serving ``pool``."""

    def __init__(self, pool: TensorResidencyPool) -> None:
        self.pool = pool
        self.loop = asyncio.new_event_loop()
        self.reported: list[dict[str, Any]] = []  # what the loop's exception handler got
        self.loop.set_exception_handler(lambda loop, context: self.reported.append(context))
        self.loop.run_until_complete(pool.__aenter__())

    def run(self, coroutine: Any) -> None:
        """Run ``coroutine`` as a task. Interrupted, the task is cancelled and run to its end,
        as a program stopping on Ctrl-C does; neither may take more than 10 s (a hang)."""
        task = self.loop.create_task(asyncio.wait_for(coroutine, 10))
        try:
            self.loop.run_until_complete(task)
        finally:
            task.cancel()
            ended = asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
            self._run_to_its_end(self.loop.create_task(ended))

    def _run_to_its_end(self, task: asyncio.Task[Any]) -> None:
        """``run_until_complete(task)``, run again when the loop stops first: an interrupt
        raised out of ``run_until_complete`` just as the task it ran ended leaves that run's
        stop queued (asyncio's own callback, scheduled as the task ended), and the next run
        obeys it."""
        for attempt in range(3):
            try:
                self.loop.run_until_complete(task)
                return
            except RuntimeError:
                if task.done() or self.loop.is_closed() or attempt == 2:
                    raise

    def settle(self) -> None:
        """Let the loop apply what was left to the pool's next transition, leases dropped
        with what an interrupted task left (cycles through its frames) included."""
        gc.collect()
        self.loop.run_until_complete(asyncio.wait_for(self.pool.aflush(), 10))

    def close(self) -> None:
        self.loop.run_until_complete(asyncio.wait_for(self.pool.__aexit__(None, None, None), 10))
        self.loop.close()

    @classmethod
    def unswept(cls) -> _CallersLoop:
        """One serving a new pool, made outside a sweep's profile: its start is not swept."""
        with unswept():
            return cls(TensorResidencyPool())

    def tidy(self) -> None:
        """Close the pool and the loop if a check did not (the Ctrl-C was at an exit's
        entry, which keeps the lease until its task, referenced by the loop's pending steps,
        goes): the pending steps run, and no pool outlives its point."""
        if not self.loop.is_closed():
            self.loop.run_until_complete(asyncio.sleep(0))
            self.settle()
            self.close()

    def check_usable(self, where: str, request: Callable[[], Any]) -> None:
        """Once what was left to the pool's next step is applied, the pool holds no lease,
        serves ``request()`` (a coroutine) and closes, and the loop reported no error."""
        self.settle()
        assert "leased: 0," in repr(self.pool), f"a Ctrl-C at {where} left a lease"
        self.run(request())
        self.close_checked(where)

    def close_checked(self, where: str) -> None:
        """Close: the pool closes, and the loop reported no error meanwhile."""
        self.close()
        assert self.pool.closed, f"a Ctrl-C at {where} left the pool open"
        gc.collect()
        assert self.reported == [], f"a Ctrl-C at {where}: {self.reported}"


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_an_async_read_write_lease_leaves_no_lease_even_kept(
    tmp_path: Path,
) -> None:
    """The async face of the same, on a loop of the caller's on the main thread: a Ctrl-C
    in its exit (``end_lease``) once left the lease held while its KeyboardInterrupt lived,
    and the pool could not close."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(256), "t", offload_dir=tmp_path)
    serving = _CallersLoop(TensorResidencyPool())
    pool = serving.pool

    async def add_one() -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1)

    serving.run(add_one())  # a hit from now on
    kept: list[BaseException] = []  # the last interrupt, as an interactive session keeps it

    def keeping() -> None:
        kept.clear()
        try:
            serving.run(add_one())
        except KeyboardInterrupt as interrupt:
            kept.append(interrupt)
            raise

    def check(where: str) -> None:
        serving.settle()
        assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
        value = pool.resolve(t)
        assert bool((value == value[0]).all()), f"torn at {where}"

    points = sweep(keeping, tmp_path, check, within=str(Path(_handles.__file__).parent))
    assert points > 20, "the lease made fewer points than expected: the test proves little"
    serving.close()
    assert pool.closed


def _raising(signum: int, frame: Any) -> None:
    """A SIGINT handler that raises ``KeyboardInterrupt``, as ``asyncio.run``'s does at the
    second Ctrl-C."""
    raise KeyboardInterrupt


@pytest.fixture(params=["default handler", "asyncio.run's second Ctrl-C"])
def sigint_handler(request: pytest.FixtureRequest) -> Iterator[str]:
    """The SIGINT handler in force: Python's default one, or one set from Python that raises
    (holds held only the default one once, and a second Ctrl-C under ``asyncio.run`` could
    lose a job's end: the value's requests and the pool's close then waited for ever)."""
    previous = signal.getsignal(signal.SIGINT)
    if request.param != "default handler":
        signal.signal(signal.SIGINT, _raising)
    try:
        yield request.param
    finally:
        signal.signal(signal.SIGINT, previous)


@needs_proc
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("sigint_handler")
def test_a_ctrl_c_anywhere_in_an_async_miss_on_the_callers_loop_leaves_the_pool_usable(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of an async acquire that loads its value, on a loop of the
    caller's on the main thread, which runs the pool's steps and the ends of its jobs: the
    cancelled task ends, the pool holds no lease, serves the value, and closes, and the loop
    reports no error. (One in a step once left a waiter count at -1, and the pool refused to
    close for good; one as the loop began applying a load's end lost it, and every later
    request for the value, and the pool's close, waited for ever; one raised as a step's
    driver returned left the abandoned request's error in a future nobody awaited.)"""
    nothing = tmp_path / "nothing"  # files are not checked: loads may still run in workers
    nothing.mkdir()
    t = OffloadedTensor.from_original_tensor(torch.arange(64.0), "t", offload_dir=tmp_path)
    servings: list[_CallersLoop] = []

    async def acquire() -> None:
        async with servings[-1].pool.acquire(t) as value:
            assert torch.equal(value, torch.arange(64.0))

    def miss() -> None:
        servings.append(_CallersLoop.unswept())
        servings[-1].run(acquire())

    def check(where: str) -> None:
        servings[-1].check_usable(where, acquire)

    within = str(Path(_handles.__file__).parent)
    points = sweep(miss, nothing, check, within, tidy=lambda: servings[-1].tidy())
    assert points > 50, "the acquire made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(300)
# A Ctrl-C before the task's first step cancels it unstarted.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_ctrl_c_anywhere_in_a_step_ending_a_collected_lease_leaves_no_lease(
    tmp_path: Path,
) -> None:
    """A lease whose holder was collected where its thread could not wait for the pool ends at
    the pool's next step (``Actor.later``). A Ctrl-C at each point of that step, on a loop of
    the caller's on the main thread: once the loop runs again, the pool holds no lease and
    closes. (The loop runs what other threads post under a hold of Ctrl-C: without it, one
    landing just as the step took the lease's end out of its queue lost that end, the value
    stayed leased for good and the pool could not close.)"""
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    t = OffloadedTensor.from_original_tensor(torch.arange(64.0), "t", offload_dir=tmp_path)
    servings: list[_CallersLoop] = []

    async def resolve() -> None:
        assert torch.equal(await servings[-1].pool.aresolve(t), torch.arange(64.0))

    def step() -> None:
        with unswept():
            servings.append(_CallersLoop(TensorResidencyPool()))
            servings[-1].run(resolve())  # resident from now on
            lease = servings[-1].pool.acquire(t)
            lease.__enter__()
            lease._drop()  # as its collection amid the pool's code ends it
            assert "leased: 1," in repr(servings[-1].pool)
        servings[-1].run(resolve())  # its first step ends the lease

    def check(where: str) -> None:
        servings[-1].check_usable(where, resolve)

    within = str(Path(_handles.__file__).parent)
    points = sweep(step, nothing, check, within, tidy=lambda: servings[-1].tidy())
    assert points > 20, "the step made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(300)
# A Ctrl-C in a serve that runs before the waiting task's first step cancels the task unstarted.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_ctrl_c_anywhere_in_a_threads_miss_served_by_the_callers_loop_loses_no_request(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of the steps that a loop of the caller's on the main thread runs
    for another thread's resolve (a miss): once the loop runs again, the thread gets its
    value, the pool holds no lease and closes. (One as the loop began the request's drive
    lost the request, and the thread waited for ever while the loop ran.)"""
    nothing = tmp_path / "nothing"  # files are not checked: loads may still run in workers
    nothing.mkdir()
    t = OffloadedTensor.from_original_tensor(torch.arange(64.0), "t", offload_dir=tmp_path)
    servings: list[_CallersLoop] = []
    answers: list[list[Any]] = []

    async def answered() -> None:
        while not answers[-1]:
            await asyncio.sleep(0.001)

    def resolve(pool: TensorResidencyPool, answer: list[Any]) -> None:
        try:
            answer.append(pool.resolve(t).clone())
        except BaseException as error:  # the test reads it
            answer.append(error)

    def miss() -> None:
        servings.append(_CallersLoop.unswept())
        answers.append([])
        thread = threading.Thread(target=resolve, args=(servings[-1].pool, answers[-1]))
        thread.daemon = True  # (a lost request would keep it waiting)
        thread.start()
        servings[-1].run(answered())

    def check(where: str) -> None:
        serving = servings[-1]
        serving.run(answered())  # the loop runs again
        answer = answers[-1][0]
        assert isinstance(answer, torch.Tensor), f"a Ctrl-C at {where}: {answer!r}"
        assert torch.equal(answer, torch.arange(64.0)), f"a Ctrl-C at {where}: wrong value"
        serving.settle()
        assert "leased: 0," in repr(serving.pool), f"a Ctrl-C at {where} left a lease"
        serving.close_checked(where)

    within = str(Path(_handles.__file__).parent)
    points = sweep(miss, nothing, check, within, tidy=lambda: servings[-1].tidy())
    assert points > 20, "the miss made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(180)
# A Ctrl-C in a serve that runs before the waiting task's first step cancels the task unstarted.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_a_ctrl_c_anywhere_as_the_callers_loop_maps_a_written_value_again_keeps_it_whole(
    tmp_path: Path,
) -> None:
    """A value a ``read_write`` lease changed, written back by a flush and kept, is mapped
    again from the file written by a job of the pool's; a loop of the caller's on the main
    thread applies the job's end, swapping the value for that mapping. A Ctrl-C at each
    point of that: once the pool's next request ran, the value was swapped (nothing keeps
    the replaced value, which maps the replaced file), it reads the latest write whole, the
    pool holds no lease, its counts hold, and it closes."""
    numel = storage.MAPPED_MIN_BYTES // 4  # float32: mapped as it loads
    t = OffloadedTensor.from_original_tensor(torch.zeros(numel), "t", offload_dir=tmp_path)
    mapping = Breakpoint(OffloadedTensor._map_written.__code__, on="call")
    with breakpoints_in_new_threads(mapping):
        serving = _CallersLoop.unswept()
        pool = serving.pool
        replaced: list[weakref.ref[torch.Tensor]] = []

        async def add_one() -> None:
            async with pool.acquire(t, mode="read_write") as value:
                value.add_(1)

        def written_and_mapped() -> None:
            """Change and flush the value; the job mapping the file written is left to end
            while the loop is stopped, its end for the loop's next run to apply."""
            mapping.rearm()
            serving.run(add_one())
            serving.run(pool.aflush())
            assert mapping.paused.wait(10), "no job maps the file written"
            replaced[:] = [weakref.ref(pool._actor.entries[id(t)].value)]
            mapping.go()
            deadline = time.monotonic() + 10
            while not any(job.kind == "remap" for job in pool._runtime._ended):
                assert time.monotonic() < deadline, "the job mapping the file never ended"
                time.sleep(0.001)

        def swapped() -> bool:
            entry = pool._actor.entries.get(id(t))
            return entry is not None and entry.value is not replaced[0]()

        async def until_swapped() -> None:
            while not swapped():
                await asyncio.sleep(0.001)

        def check(where: str) -> None:
            serving.settle()  # (its request applies the ends a Ctrl-C left queued)
            assert swapped(), f"a Ctrl-C at {where} left the value mapping the replaced file"
            gc.collect()
            assert replaced[0]() is None, f"a Ctrl-C at {where} kept the replaced value"
            assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
            check_invariants(pool)
            value = pool.resolve(t)
            assert torch.equal(value, torch.full((numel,), value[0].item())), f"torn at {where}"
            assert torch.equal(t.reload(), value), f"a Ctrl-C at {where}: not the latest write"

        written_and_mapped()
        within = str(Path(_handles.__file__).parent)
        points = sweep(
            lambda: serving.run(until_swapped()), tmp_path, check, within, written_and_mapped
        )
        assert points > 10, "the swap made fewer points than expected: the test proves little"
        serving.close_checked("the end")
    assert torch.equal(on_disk(t), torch.full((numel,), float(points + 2)))


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_a_lease_end_that_maps_a_written_value_again_loses_no_change(
    tmp_path: Path,
) -> None:
    """A lease held a value through its write-back, so the mapping of the file written waits
    for its end: the lease's exit, on a loop of the caller's on the main thread, swaps the
    value for it. A Ctrl-C at each point of that exit: the lease ends, the value reads the
    latest write whole, the pool's counts hold, and a change made after is written back.
    Once the pool's next request ran, nothing keeps the replaced value."""
    numel = storage.MAPPED_MIN_BYTES // 4  # float32: mapped as it loads
    t = OffloadedTensor.from_original_tensor(torch.zeros(numel), "t", offload_dir=tmp_path)
    serving = _CallersLoop.unswept()
    pool = serving.pool
    leases: list[Any] = []
    # The replaced value, held through the exit: its mapping ends in a weak reference's
    # callback as it goes, which loses a Ctrl-C landing in it (see in_finalizer).
    replaced: list[torch.Tensor] = []
    written = [0.0]

    async def add_one() -> None:
        async with pool.acquire(t, mode="read_write") as value:
            value.add_(1)

    async def entered(lease: Any) -> None:
        await lease.__aenter__()

    async def until_mapped() -> None:
        """Until the mapping of the file just written waits for the lease's end, and no job
        runs (a remap of an earlier write-back, late on a loaded machine, maps nothing)."""
        entry = pool._actor.entries[id(t)]
        while (
            entry.remapped is None or entry.remapped[1] != entry.value._version or pool._actor.jobs
        ):
            await asyncio.sleep(0.001)

    def written_while_leased() -> None:
        """Change the value, lease it, flush it, and let its mapping of the file written
        wait for the lease's end."""
        serving.run(add_one())
        written[0] += 1
        leases[:] = [pool.acquire(t)]
        serving.run(entered(leases[0]))
        serving.run(pool.aflush())
        serving.run(until_mapped())
        replaced[:] = [pool._actor.entries[id(t)].value]

    exits: list[bool] = []  # whether the exit's task began

    async def exit_lease() -> None:
        exits.append(True)
        await leases[0].__aexit__(None, None, None)

    def run_exit() -> None:
        exits.clear()
        serving.run(exit_lease())

    def check(where: str) -> None:
        if not exits:  # a Ctrl-C before the exit's task began: it runs as its owner unwinds
            serving.run(leases[0].__aexit__(None, None, None))
        serving.settle()
        assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
        entry = pool._actor.entries[id(t)]
        assert entry.slot is not None and entry.slot.value is entry.value, where
        check_invariants(pool)
        expected = torch.full((numel,), written[0])
        assert torch.equal(pool.resolve(t), expected), f"a Ctrl-C at {where}: not the latest"
        gone = weakref.ref(replaced.pop())
        gc.collect()
        assert gone() is None, f"a Ctrl-C at {where} kept the replaced value"
        serving.run(add_one())
        written[0] += 1
        serving.run(pool.aflush())
        expected = torch.full((numel,), written[0])
        assert torch.equal(on_disk(t), expected), f"a Ctrl-C at {where} lost a later change"

    def tidy() -> None:
        if leases[0].slot is not None:  # (a Ctrl-C at its exit's entry: ended again)
            serving.run(leases[0].__aexit__(None, None, None))
        serving.settle()
        replaced.clear()
        written_while_leased()

    written_while_leased()
    within = str(Path(_handles.__file__).parent)
    points = sweep(run_exit, tmp_path, check, within, tidy)
    assert points > 10, "the exit made fewer points than expected: the test proves little"
    leases.clear()
    serving.close_checked("the end")
    assert torch.equal(on_disk(t), torch.full((numel,), written[0]))


LOST = ("return ModuleStream.__init__", "return stream_modules", "call ModuleStream.__enter__")
"""Where a Ctrl-C loses a stream made whole: its caller never holds it (the last one, the
entry of the ``with`` block's ``__enter__``, cannot be guarded). It streams while its pool is
open (its hooks hold it), as one its caller did not keep does, and goes with its hooks once
the pool closed."""


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_while_a_stream_registers_its_hooks_leaves_none(tmp_path: Path) -> None:
    """A Ctrl-C at each point of a stream's making: no hook stays on the model once the
    streams made are closed, but those of streams lost as they were returned, which go once
    the pool closed. (Hooks registered before the Ctrl-C once stayed for good, with no stream
    returned to close them, and so did a lost stream's.)"""
    model, x = offloaded_model(tmp_path)
    expected = model(x)
    made: list[Any] = []
    lost = [0]
    with TensorResidencyPool() as pool:

        def check(where: str) -> None:
            for stream in made:
                stream.close()
            made.clear()
            lost[0] += where in LOST
            assert hooks_on(model) == 2 * len(model) * lost[0], f"a Ctrl-C at {where} left a hook"

        points = sweep(
            lambda: made.append(stream_modules(pool, list(model))),
            tmp_path,
            check,
            within=_stream.__file__,
        )
        assert points > 10, "the stream made fewer points than expected: the test proves little"
        assert lost[0] == 2  # as __init__ and stream_modules return
    assert hooks_on(model) == 0
    assert torch.equal(model(x), expected)  # without the closed pool


class _AddsThenStops(torch.nn.Module):
    """A layer that changes its weight in place, then is interrupted (Ctrl-C) before it
    returns: torch runs no forward hook after it, so the stream's close ends its lease."""

    def __init__(self, weight: OffloadedTensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.add_(1)
        raise KeyboardInterrupt


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_stream_s_close_is_finished_by_a_second_close(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of the close of a stream whose forward Ctrl-C stopped inside
    a module: once closed again, no hook, lease or scope stays, the module holds its tensor,
    and the forward's change is kept. (A close cut midway once left the hooks it had taken
    out of the stream on the model for good.)"""
    model, x = offloaded_model(tmp_path, layers=2)
    weight = OffloadedTensor.from_original_tensor(torch.zeros(16, 16), "w", offload_dir=tmp_path)
    model.insert(1, _AddsThenStops(weight))
    nothing = tmp_path / "nothing"  # files are not checked: loads may still run in workers
    nothing.mkdir()
    streams: list[Any] = []
    forwards = [0]
    with TensorResidencyPool(max_cached_bytes=0) as pool:

        def interrupted_forward_then_close() -> None:
            with unswept():  # the forward is not swept: the close is
                streams.append(stream_modules(pool, list(model), depth=1))
                with pytest.raises(KeyboardInterrupt):
                    model(x)
                forwards[0] += 1
                assert active_tensor_residency() is not None  # the scope the stream opened
            streams[-1].close()

        def check(where: str) -> None:
            for stream in streams:
                stream.close()
            streams.clear()
            assert hooks_on(model) == 0, f"a Ctrl-C at {where} left a hook"
            assert "leased: 0," in repr(pool), f"a Ctrl-C at {where} left a lease"
            assert active_tensor_residency() is None, f"a Ctrl-C at {where} left the scope"
            assert model[1].weight is weight, f"a Ctrl-C at {where} left the value bound"
            assert torch.equal(weight.reload(), torch.full((16, 16), float(forwards[0]))), (
                f"a Ctrl-C at {where} lost the forward's change"
            )

        points = sweep(interrupted_forward_then_close, nothing, check, within=_stream.__file__)
        assert points > 20, "the close made fewer points than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_a_streamed_forward_leaves_no_scope_hook_or_lease(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of a stream's making and hooks, in a forward outside
    ``pool.scope()``, in ``with pool, stream_modules(pool, layers):``: once the block is left,
    the pool closed (no lease stayed), no scope stays set, no hook stays (a lost stream's, see
    ``LOST``, went as the pool closed), and the model runs without the pool. (One right after
    the pre-hook set the scope once left it set for good: every plain forward then failed.
    One right after a post-hook reset it once kept its token, and with it the module's
    post-hook, after the stream closed.)"""
    model, x = offloaded_model(tmp_path)
    nothing = tmp_path / "nothing"  # files are not checked: loads may still run in workers
    nothing.mkdir()
    expected = model(x)
    pools: list[TensorResidencyPool] = []

    def forward() -> None:
        with TensorResidencyPool(max_cached_bytes=3 << 10) as pool:
            pools.append(pool)
            with stream_modules(pool, list(model)):
                assert torch.equal(model(x), expected)

    def check(where: str) -> None:
        assert pools[-1].closed, f"a Ctrl-C at {where} left the pool open"
        assert active_tensor_residency() is None, f"a Ctrl-C at {where} left the scope"
        assert hooks_on(model) == 0, f"a Ctrl-C at {where} left a hook"
        assert torch.equal(model(x), expected), f"a Ctrl-C at {where} left the model broken"

    points = sweep(forward, nothing, check, within=_stream.__file__)
    assert points > 100, "the forward made fewer points than expected: the test proves little"


class _Adds(torch.nn.Module):
    """A layer that adds one to its weight in place each forward, and counts the adds (the
    add and its count in one hold: a Ctrl-C lands before or after both)."""

    def __init__(self, weight: OffloadedTensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.adds = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), _interrupts.InterruptHold() as hold:
            hold.start()
            self.weight.add_(1)
            self.adds += 1
        return x


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_a_streamed_forward_is_ended_by_the_next_and_keeps_its_change(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of a forward through an open stream, its layers changing a
    weight in place: the thread's next forward ends what the interrupted one left (leases,
    bound places, the scope), and every change made is kept once. (One in the module's exit,
    which may wait for a lease to keep the change, once gave the values back unkept; one
    there or in the pre-hook's error path once left an entry no later forward ended.)"""
    model, x = offloaded_model(tmp_path, layers=2)
    weight = OffloadedTensor.from_original_tensor(torch.zeros(16, 16), "w", offload_dir=tmp_path)
    adds = _Adds(weight)
    model.insert(1, adds)
    nothing = tmp_path / "nothing"  # files are not checked: loads may still run in workers
    nothing.mkdir()
    with TensorResidencyPool(max_cached_bytes=0) as pool:
        with stream_modules(pool, list(model), depth=1):
            model(x)
            settle(pool)
            clean = leased(pool)  # what it read ahead for the next forward

            def check(where: str) -> None:
                model(x)  # the next forward
                settle(pool)
                assert leased(pool) == clean, f"a Ctrl-C at {where} left {pool!r}"
                assert active_tensor_residency() is None, f"a Ctrl-C at {where} left the scope"
                assert adds.weight is weight, f"a Ctrl-C at {where} left the value bound"
                assert torch.equal(weight.reload(), torch.full((16, 16), float(adds.adds))), (
                    f"a Ctrl-C at {where} lost or doubled a change"
                )

            points = sweep(lambda: model(x), nothing, check, within=_stream.__file__)
        assert points > 50, "the forward made fewer points than expected: the test proves little"
    assert torch.equal(weight.reload(), torch.full((16, 16), float(adds.adds)))


# ---------------------------------------------------------------------------------------------
# Binding a model to a checkpoint
# ---------------------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    """An embedding, its head (tied to it by ``tie_weights``), a layer and a buffer."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32))
        if tied:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.head.weight = self.embed.weight


def tiny_checkpoint(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of ``_Tiny`` whose embedding is stored in float16 (cast on load to the
    model's float32: written into the offload directory), the rest in float32 (read in
    place); and the values bound from it."""
    torch.manual_seed(0)
    dense = _Tiny()
    state = {k: v.detach().clone() for k, v in dense.state_dict().items() if k != "head.weight"}
    state["embed.weight"] = state["embed.weight"].half()
    path = directory / "model.safetensors"
    safetensors.torch.save_file(state, path)
    values = {k: v.float() for k, v in state.items()}
    values["head.weight"] = values["embed.weight"]
    return path, values


def tiny_skeleton(tied: bool = True) -> torch.nn.Module:
    with torch.device("meta"):
        model = _Tiny(tied)
    model.scale = torch.zeros(4)  # a real buffer, as accelerate.init_empty_weights() keeps it
    return model


BINDING = tuple(str(Path(SOURCE) / name) for name in ("checkpoint.py", "hf.py", "updater.py"))
"""The binding's own code: the points of what it calls (storage, offloaded tensors) are
those of their own sweeps."""


class _LostInAGeneratorsClose:
    """Records the exceptions Python reports as unraisable (``sys.unraisablehook``) in the
    block; on leaving it, refuses any but a KeyboardInterrupt raised as a generator left
    suspended (by ``any()``) is closed as it goes: Python loses it whatever the code does,
    and the operation goes on (to its end, checked as any other)."""

    def __enter__(self) -> _LostInAGeneratorsClose:
        self.refused: list[str] = []
        self.lost = 0
        self.hook = sys.unraisablehook
        sys.unraisablehook = self._record
        return self

    def _record(self, unraisable: Any) -> None:
        # Nothing of it is kept: its traceback holds the frames of the operation.
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and inspect.isgenerator(
            unraisable.object
        ):
            self.lost += 1
        else:
            self.refused.append(f"{unraisable.exc_value!r} in {unraisable.object!r}")

    def __exit__(self, *exc_info: object) -> None:
        sys.unraisablehook = self.hook
        assert self.refused == []


def tensors_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model``, under each of its names (tied ones too)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


class _BindingChecks:
    """What a binding of ``model`` that a Ctrl-C may have cut leaves: the model holds the
    very tensors it held before it (:meth:`start`; its head tied to its embedding or not),
    or is wholly bound to ``values`` (its head tied), never a mix; the offload directory
    holds the files it held that no tensor owned and those of the tensors the model holds,
    no other; no descriptor of it or of the checkpoint's directory is left open. (One opened
    before a Ctrl-C at the entry of the ``__exit__`` that would close it stays open: no code
    can guard that point, which ``sweep`` does not check.)"""

    def __init__(
        self,
        model: torch.nn.Module,
        values: dict[str, torch.Tensor],
        offload_dir: Path,
        checkpoint_dir: Path,
    ) -> None:
        self.model, self.values = model, values
        self.offload_dir, self.checkpoint_dir = offload_dir, checkpoint_dir
        self.foreign = set(offload_dir.iterdir()) - self.owned()
        self.before: list[tuple[str, torch.Tensor]] = []
        self.open_before: list[str] = []
        self.wheres: list[str] = []
        self.last = ""
        self.outcomes = {"as before": 0, "bound": 0}

    def owned(self) -> set[Path]:
        return {
            t.offload_path
            for _, t in tensors_of(self.model)
            if isinstance(t, OffloadedTensor) and t.owns_payload
        }

    def start(self) -> torch.nn.Module:
        self.before = tensors_of(self.model)
        self.open_before = self.open_now()
        return self.model

    def open_now(self) -> list[str]:
        return open_descriptors(self.offload_dir) + open_descriptors(self.checkpoint_dir)

    def __call__(self, where: str) -> None:
        opened = self.open_now()
        assert opened == self.open_before, f"a Ctrl-C at {where} left {opened} open"
        now = tensors_of(self.model)
        assert [name for name, _ in now] == [name for name, _ in self.before]
        self.wheres.append(where)
        kept = [name for (name, t), (_, old) in zip(now, self.before, strict=True) if t is old]
        self.before = []  # (the tensors replaced go with their files)
        if len(kept) == len(now):
            self.last = "as before"
        else:
            assert kept == [], f"a Ctrl-C at {where} left the model partly bound: {kept} kept"
            self.last = "bound"
            assert self.model.head.weight is self.model.embed.weight, f"a Ctrl-C at {where}"
            for name, t in now:
                value = t.reload() if isinstance(t, OffloadedTensor) else t
                assert torch.equal(value, self.values[name]), f"a Ctrl-C at {where}: {name}"
        self.outcomes[self.last] += 1
        files = set(self.offload_dir.iterdir())
        assert files == self.foreign | self.owned(), f"a Ctrl-C at {where} left {files}"


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_binding_a_bound_model_again_leaves_it_whole_and_its_files(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of ``load_offloaded_checkpoint`` binding again a model bound
    before (its embedding cast on load: a payload file of the offload directory that the
    model's tensor owns): the model holds its earlier tensors, their files still there, or
    is wholly bound again; no file of the offload directory is lost, no other is left.
    (A Ctrl-C between two tensors once left the model partly bound.)"""
    checkpoint_dir, offload_dir = tmp_path / "checkpoint", tmp_path / "offload"
    checkpoint_dir.mkdir()
    offload_dir.mkdir()
    nothing = tmp_path / "nothing"  # files are checked by the checks: the bound ones stay
    nothing.mkdir()
    (offload_dir / "notes.txt").write_text("the user's")
    path, values = tiny_checkpoint(checkpoint_dir)
    model = load_offloaded_checkpoint(
        tiny_skeleton(), path, dtype=torch.float32, offload_dir=offload_dir
    )
    checks = _BindingChecks(model, values, offload_dir, checkpoint_dir)

    def bind() -> None:
        load_offloaded_checkpoint(
            checks.start(), path, dtype=torch.float32, offload_dir=offload_dir
        )

    with _LostInAGeneratorsClose():
        points = sweep(bind, nothing, checks, within=BINDING)
    assert points > 300, "the binding made fewer points than expected: the test proves little"
    assert checks.outcomes["bound"] > 0 and checks.outcomes["as before"] > 300
    assert (offload_dir / "notes.txt").read_text() == "the user's"


@needs_proc
@pytest.mark.timeout(180)
def test_a_ctrl_c_anywhere_in_dispatching_a_skeleton_leaves_it_as_it_was_or_wholly_bound(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of ``t2n_load_checkpoint_and_dispatch`` binding a meta skeleton
    whose head is not tied yet, a layer read into memory and the rest offloaded (the
    embedding cast on load into the offload directory): the skeleton holds its own tensors
    again (untied), or is wholly bound; no file is left in the offload directory but those
    of the tensors bound. (A Ctrl-C between two tensors once left the model partly bound:
    some tensors offloaded, others on the meta device.)"""
    checkpoint_dir, offload_dir = tmp_path / "checkpoint", tmp_path / "offload"
    checkpoint_dir.mkdir()
    offload_dir.mkdir()
    nothing = tmp_path / "nothing"  # files are checked by the checks: the bound ones stay
    nothing.mkdir()
    path, values = tiny_checkpoint(checkpoint_dir)
    checks = _BindingChecks(tiny_skeleton(tied=False), values, offload_dir, checkpoint_dir)
    device_map = {"body": "cpu", "": "disk"}

    def bind() -> None:
        t2n_load_checkpoint_and_dispatch(checks.start(), path, device_map, offload_dir)

    def tidy() -> None:
        if not checks.model.body.weight.is_meta:  # bound (checked or not): a skeleton again
            checks.model = tiny_skeleton(tied=False)

    with _LostInAGeneratorsClose():
        points = sweep(bind, nothing, checks, within=BINDING, tidy=tidy)
    assert points > 300, "the binding made fewer points than expected: the test proves little"
    assert checks.outcomes["bound"] > 0 and checks.outcomes["as before"] > 300


@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_schedule_declared_before_the_pool_runs_declares_it_whole(
    tmp_path: Path,
) -> None:
    """Declared before the pool runs, on the caller's thread: a Ctrl-C landing amid the
    policy's declaration is raised once it ended, the schedule whole (it once left it half
    made: the order set, no positions, learning off)."""
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((8,), float(i)), f"s{i}", tmp_path)
        for i in range(4)
    ]
    policy_code = str(Path(_runtime.__file__).with_name("_policy.py"))
    fired = 0
    for n in itertools.count(1):
        pool = TensorResidencyPool(strategy=ResidencyStrategy.SCHEDULED)
        signal_at, _ = signalled(n, policy_code, partial(pool.declare_schedule, tensors))
        policy = pool._actor.policy
        assert isinstance(policy, ScheduledPolicy)
        assert policy._order == [id(t) for t in tensors], signal_at.where
        assert sorted(policy._position.values()) == list(range(len(tensors))), signal_at.where
        check_invariants(pool)
        pool.close()
        if not signal_at.fired:
            break
        fired += 1
    assert fired > 3
