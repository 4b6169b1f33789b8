"""A hostile mix of everything that uses offloaded tensors at once, checked by a model of the
values each read may return.

One :class:`World` per seed: a few offloaded tensors and the pools that serve them, drawn from
the seed (:meth:`Setup.draw`): their size, budget, strategy and I/O workers; one or two pools
served by private threads (one started by its first request, one entered), often one served
by an event loop running in a thread of its own; every fifth seed, two large tensors and a
budget that holds one (:meth:`Setup.tight`). At once:

- worker threads run random operations through those pools: ``read_write`` leases (some
  dropped without their exit), direct writes (``update_values``, changing the shape and dtype
  where the setup allows it; ``copy_`` inside or outside a pool's scope), resolves, read
  leases, prefetches, pins, evictions, flushes, closes (the pool is replaced), reads
  (``reload()`` or a torch op on the tensor) inside a pool's scope and outside any pool, deep
  copies, reads of the payload file, invariant checks, cancellations of the event loops'
  tasks and, rarely, a fork whose child reads every tensor and writes one (a read that finds
  the file replaced by the parent since the fork raises, as documented);
- the event loop thread, and in half the setups a second event loop, run tasks doing leases,
  resolves, prefetches, evictions and flushes, some under ``asyncio.wait_for`` timeouts, some
  cancelled at once, some later by a thread;
- the main thread, in half the setups and the tight ones, runs leases, resolves, prefetches,
  evictions and flushes, each with a Ctrl-C (``KeyboardInterrupt``) coming at a random delay:
  it lands where the operation calls the library, never in the model's bookkeeping
  (:class:`CtrlC`).

The model (:class:`Model`): each write fills its tensor with a constant never used before, and
a tensor has one writer at a time, so a read may return the values the tensor could hold when
it began and those written since; one of them only, in the shape and dtype it was written
with, unless a ``read_write`` lease of the same pool was open on the tensor during the read
(the read then shares the value the lease fills). A write cut by an interrupt or a
cancellation may have landed or not; a lease's change that its exit (with the error, as a
``with`` statement's) or its collection ended has landed. After the run every pool is flushed
and closed, and the tensor, its payload file and a fresh tensor bound to that file hold one of
the values the tensor may hold, with its shape and dtype.

A defect (a read outside the model, an unexpected error, a broken invariant, a thread that does
not end, a lease still held at the end, a forked child that hangs or reads a value outside the
model) is recorded with the seed, the setup and, for a tensor, its state in the tensor and in
every pool and its recent history: the model's events and the library's warnings
(:meth:`World.dump`). The run never stops at a defect.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import faulthandler
import functools
import gc
import itertools
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple, NoReturn

import torch
from interrupts import CtrlCTimer
from residency_checks import check_invariants, on_disk

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    ResidencyStrategy,
    TensorResidencyLease,
    TensorResidencyPool,
)

__all__ = ["CtrlC", "Report", "Setup", "World"]

JOIN_SECONDS = 60.0
"""How long the threads and event loops of a run get to end once their work is done."""
FORK_SECONDS = 30.0
"""How long a forked child gets to check the tensors and write its own."""
CHILD_CONSTANT = 2**24 - 1
"""What the forked child writes: exact in float32, and never a constant of the parent's."""
TIGHT_EVERY = 5
"""Every fifth seed runs the tight setup (:meth:`Setup.tight`)."""
INTERRUPT_DELAYS = (0.00002, 0.0001, 0.0005, 0.002)
"""When the Ctrl-C of a main thread operation comes, in seconds after it began."""
HISTORY_LINES = 90
"""The events of a tensor's history kept, and shown with a defect."""
DEFECTS_SHOWN = 5
"""The defects of a seed that its failure message shows in full (the others are counted)."""
SLOT_FIELDS = (
    "leases",
    "enters",
    "changing",
    "changed",
    "writers",
    "unnoted",
    "dirty",
    "open",
    "writing",
    "dropped",
)
"""The fields of a pool's slot that a dump shows."""


def distinct(value: torch.Tensor) -> list[float]:
    """The distinct values of ``value``, in increasing order."""
    values: list[float] = torch.unique(value.reshape(-1).double()).tolist()
    return values


def thread_stacks(directory: Path) -> str:
    """The stacks of every thread of this process (``faulthandler`` writes them to a file)."""
    with open(directory / "stacks.txt", "w+", encoding="utf-8") as file:
        faulthandler.dump_traceback(file)
        file.seek(0)
        return file.read()


# ---------------------------------------------------------------------------------------------
# What a run found
# ---------------------------------------------------------------------------------------------
class Report:
    """What the run of one seed found: its defects (messages that start with the seed) and
    counts of what ran. A defect is appended without a lock: it may be found in a finalizer
    that runs while this thread holds one."""

    def __init__(self, seed: int, setup: Setup) -> None:
        self.seed = seed
        self.setup = setup
        self.defects: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def defect(self, message: str, details: str = "") -> None:
        indented = "".join(f"\n    {line}" for line in details.rstrip().splitlines())
        self.defects.append(f"seed {self.seed}: {message}{indented}")

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[name] += amount

    def summary(self) -> str:
        """The seed, its setup, how to replay it and its first defects."""
        more = len(self.defects) - DEFECTS_SHOWN
        return "\n".join(
            [
                f"seed {self.seed} ({self.setup.describe()}): {len(self.defects)} defect(s); "
                f"replay it alone with T2N_HOSTILE_SEED={self.seed}",
                *self.defects[:DEFECTS_SHOWN],
                *([f"... and {more} more defects of seed {self.seed}"] if more > 0 else []),
            ]
        )


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
@dataclass
class Tracked:
    """The model of one tensor."""

    possible: set[int]  # what it may hold: more than one after a write cut short
    written_as: dict[int, tuple[tuple[int, ...], torch.dtype]]  # constant -> shape, dtype
    in_progress: set[int] = field(default_factory=set)
    history: list[int] = field(default_factory=list)  # every write begun, in order
    writer: threading.Lock = field(default_factory=threading.Lock)  # one writer at a time
    log: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_LINES)
    )


class ReadStart(NamedTuple):
    """What the model allowed when a read began."""

    tensor: int  # its index
    pool: int | None  # the pool read through; None: outside any pool
    allowed: frozenset[int]
    writes: int  # the length of the history then
    leases_open: int  # ``read_write`` leases of that pool open on the tensor then
    lease_epoch: int  # how many had been taken then
    began: float


class Model:
    """The values each tensor may hold, and the writes in progress."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.began = time.monotonic()
        self.states: list[Tracked] = []
        # (pool key, tensor index) -> read_write leases (and scoped copies) open, and taken.
        self.leases_open: collections.Counter[tuple[int, int]] = collections.Counter()
        self.lease_epochs: collections.Counter[tuple[int, int]] = collections.Counter()

    def add(self, constant: int, value: torch.Tensor) -> None:
        self.states.append(Tracked({constant}, {constant: (tuple(value.shape), value.dtype)}))
        self.event(len(self.states) - 1, f"created with {constant}")

    def event(self, index: int, what: str) -> None:
        """Add ``what`` to the tensor's history (a deque's append: no lock to take, so that a
        warning logged while the model's lock is held, or in a forked child, can be added)."""
        name = threading.current_thread().name
        self.states[index].log.append(f"{time.monotonic() - self.began:10.6f} {name} {what}")

    def begin_write(
        self, index: int, constant: int, value: torch.Tensor, pool: int | None, kind: str
    ) -> None:
        """A write of ``constant`` begins; ``pool``: the pool whose value it changes in place
        (its readers may see it half done)."""
        with self.lock:
            state = self.states[index]
            self.event(index, f"begin {kind} of {constant} pool={pool} {tuple(value.shape)}")
            state.in_progress.add(constant)
            state.history.append(constant)
            state.written_as[constant] = (tuple(value.shape), value.dtype)
            if pool is not None:
                self.leases_open[(pool, index)] += 1
                self.lease_epochs[(pool, index)] += 1

    def end_write(
        self, index: int, constant: int, pool: int | None, landed: bool, how: str = ""
    ) -> None:
        """The write ended: it landed (the tensor holds ``constant`` now), or it may have."""
        with self.lock:
            state = self.states[index]
            self.event(index, f"{'landed' if landed else 'maybe landed'} {constant} {how}")
            state.in_progress.discard(constant)
            if landed:
                state.possible = {constant}
            else:
                state.possible.add(constant)
            if pool is not None:
                self.leases_open[(pool, index)] -= 1

    @contextlib.contextmanager
    def writing(
        self, index: int, constant: int, value: torch.Tensor, pool: int | None, kind: str
    ) -> Iterator[None]:
        """A write of ``constant`` made by the block: it landed if the block ends without an
        error, else it may have (an interrupt may come after the write itself)."""
        self.begin_write(index, constant, value, pool, kind)
        landed = False
        try:
            yield
            landed = True
        finally:
            self.end_write(index, constant, pool, landed)

    def read_start(self, index: int, pool: int | None) -> ReadStart:
        with self.lock:
            state = self.states[index]
            key = (pool, index) if pool is not None else None
            return ReadStart(
                index,
                pool,
                frozenset(state.possible | state.in_progress),
                len(state.history),
                0 if key is None else self.leases_open[key],
                0 if key is None else self.lease_epochs[key],
                time.monotonic() - self.began,
            )

    def read_problem(self, start: ReadStart, value: torch.Tensor, label: str) -> str | None:
        """What is wrong with ``value``, read since ``start``; None: nothing."""
        values = distinct(value)
        if not values:
            return None
        index = start.tensor
        with self.lock:
            state = self.states[index]
            allowed = start.allowed | set(state.history[start.writes :]) | state.in_progress
            shared = start.pool is not None and (
                start.leases_open > 0
                or self.leases_open[(start.pool, index)] > 0
                or self.lease_epochs[(start.pool, index)] != start.lease_epoch
            )
            written_as = state.written_as.get(int(values[0]))
        if len(values) > 1 and not shared:
            return f"{label}: torn value of t{index}: {values[:6]}, allowed {sorted(allowed)[-6:]}"
        for read in values:
            if read not in allowed:
                return (
                    f"{label}: t{index} read {read}, allowed {sorted(allowed)[-8:]} (pool "
                    f"{start.pool}, shared with a read_write lease: {shared}; began at "
                    f"{start.began:.6f}, ended at {time.monotonic() - self.began:.6f})"
                )
        if not shared and written_as != (tuple(value.shape), value.dtype):
            return (
                f"{label}: t{index} read {values[0]} as {tuple(value.shape)} {value.dtype}, "
                f"written as {written_as}"
            )
        return None


class _History(logging.Handler):
    """The library's warnings, added to every tensor's history."""

    def __init__(self, model: Model) -> None:
        super().__init__(logging.WARNING)
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        line = f"LOG {record.getMessage()[:110]}"
        for index in range(len(self.model.states)):
            self.model.event(index, line)


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------
class CtrlC:
    """Ctrl-C on the main thread, landing inside its windows (``with ctrl_c:``) only, so that it
    never cuts the model's bookkeeping: the SIGINT handler (:meth:`installed`) raises
    ``KeyboardInterrupt`` there, once per window, and ignores the signal elsewhere. A window
    opened on another thread arms nothing (signal handlers run on the main thread).
    ``landed``: how many interrupts were raised."""

    def __init__(self) -> None:
        self.armed = False
        self.landed = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False  # what follows the window's interrupt cannot be cut
            self.landed += 1
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.armed = True

    def __exit__(self, *exc_info: object) -> None:
        if threading.current_thread() is threading.main_thread():
            self.armed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handler in force for the block; the previous one restored after it."""
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def interrupting(self, rng: random.Random) -> Iterator[None]:
        """One Ctrl-C during the block, at a random delay (``_thread.interrupt_main`` from a
        timer thread, as a terminal's Ctrl-C runs the handler); none is pending after it."""
        timer = CtrlCTimer(rng.choice(INTERRUPT_DELAYS))
        timer.arm()
        try:
            yield
        finally:
            timer.stop(JOIN_SECONDS)
            self.armed = False
            with contextlib.suppress(KeyboardInterrupt):
                sum(range(10))  # a pending interrupt runs the handler here at the latest


# ---------------------------------------------------------------------------------------------
# The setup of a seed
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What a seed draws: the tensors, the pools, and who uses them."""

    numel: int
    tensors: int
    strategy: ResidencyStrategy
    budget: int | None  # the pools' max_cached_bytes
    io_workers: int
    loop_pool: bool  # a pool served by the event loop thread
    second_pool: bool  # a second pool served by a private thread
    second_loop: bool  # a second event loop running tasks, in a thread of its own
    threads: int  # worker threads
    shape_changes: bool  # direct writes may change a tensor's shape and dtype
    wait_for_rate: float  # the share of tasks run under asyncio.wait_for
    canceller: bool  # a thread cancels random tasks all along
    ctrl_c: bool  # the main thread runs operations under Ctrl-C

    @classmethod
    def draw(cls, seed: int) -> Setup:
        rng = random.Random(f"setup {seed}")
        if seed % TIGHT_EVERY == TIGHT_EVERY - 1:
            return cls.tight(rng)
        numel = rng.choice([16, 256, 4096, 65536])
        return cls(
            numel=numel,
            tensors=rng.randint(2, 5),
            strategy=rng.choice(list(ResidencyStrategy)),
            budget=rng.choice([None, 0, numel * 4, numel * 8, numel * 12]),
            io_workers=rng.choice([1, 1, 2, 3]),
            loop_pool=rng.random() < 0.6,
            second_pool=rng.random() < 0.5,
            second_loop=rng.random() < 0.5,
            threads=rng.choice([2, 3]),
            shape_changes=rng.random() < 0.4,
            wait_for_rate=rng.choice([0.1, 0.2, 0.5]),
            canceller=rng.random() < 0.5,
            ctrl_c=rng.random() < 0.5,
        )

    @classmethod
    def tight(cls, rng: random.Random) -> Setup:
        """Two tensors of 256 KiB through pools served by private threads, whose budget holds
        one: each request of one evicts the other, write-backs and loads overlap the leases,
        direct writes (reshaping ones too) and Ctrl-C of the main thread."""
        numel = 65536
        return cls(
            numel=numel,
            tensors=2,
            strategy=ResidencyStrategy.LRU,
            budget=numel * 4,
            io_workers=2,
            loop_pool=False,
            second_pool=rng.random() < 0.5,
            second_loop=rng.random() < 0.5,
            threads=2,
            shape_changes=True,
            wait_for_rate=rng.choice([0.1, 0.2, 0.5]),
            canceller=rng.random() < 0.5,
            ctrl_c=True,
        )

    def describe(self) -> str:
        pools = ["private"] + ["private, entered"] * self.second_pool + ["loop"] * self.loop_pool
        return (
            f"{self.tensors} tensors of {self.numel}, {self.strategy.name}, budget "
            f"{self.budget}, {self.io_workers} I/O workers, pools: {' + '.join(pools)}, "
            f"{self.threads} threads, second loop: {self.second_loop}, shape changes: "
            f"{self.shape_changes}, wait_for: {self.wait_for_rate}, canceller: "
            f"{self.canceller}, Ctrl-C: {self.ctrl_c}"
        )


@dataclass(frozen=True)
class UsedPool:
    """A pool in use, with the key the model knows it by."""

    key: int
    pool: TensorResidencyPool
    served_by: str


Operation = Callable[[random.Random], None]
Task = Callable[[random.Random], Coroutine[Any, Any, None]]


# ---------------------------------------------------------------------------------------------
# The world of one seed
# ---------------------------------------------------------------------------------------------
class World:
    """The tensors, pools, threads and event loops of one seed, and its run (:meth:`run`)."""

    def __init__(self, seed: int, directory: Path, ctrl_c: CtrlC, operations: int) -> None:
        self.seed = seed
        self.setup = Setup.draw(seed)
        self.report = Report(seed, self.setup)
        self.directory = directory
        self.ctrl_c = ctrl_c
        self.operations = operations  # per worker thread and per event loop
        self.model = Model()
        self.constants = itertools.count(1)
        directory.mkdir(parents=True, exist_ok=True)
        self.tensors: list[OffloadedTensor] = []
        for index in range(self.setup.tensors):
            constant = next(self.constants)
            value = torch.full((self.setup.numel,), float(constant))
            self.tensors.append(
                OffloadedTensor.from_original_tensor(value, f"l.{index}.w", directory)
            )
            self.model.add(constant, value)
        self.pools_lock = threading.Lock()
        self.closing = threading.Lock()  # held by a close, and by an invariant check
        self.pools: list[UsedPool] = []
        self.all_pools: list[TensorResidencyPool] = []
        self.pool_keys = itertools.count()
        self.tasks: set[asyncio.Task[None]] = set()
        self.tasks_lock = threading.Lock()
        self.stop = threading.Event()  # set when a thread hangs: the others end early
        self.workers_done = threading.Event()
        self.end_loop: Callable[[], object] | None = None  # set by the event loop thread
        self.worker_operations: list[tuple[str, Operation, float]] = [
            ("read_write", self.read_write, 10),
            ("read_write_dropped", lambda rng: self.read_write(rng, drop=True), 2),
            ("update_values", self.update_values, 6),
            ("resolve", self.resolve, 8),
            ("read_lease", self.read_lease, 6),
            ("prefetch", self.prefetch, 4),
            ("evict", self.evict, 6),
            ("flush", self.flush, 4),
            ("reload", self.reload, 6),
            ("scope_read", self.scope_read, 3),
            ("pin", self.pin, 2),
            ("invariants", self.invariants, 2),
            ("close", self.close, 0.2),
            ("cancel", self.cancel_task, 6),
            ("copy", self.copy, 3),
            ("deepcopy", self.deepcopy, 2),
            ("disk", self.disk, 2),
            ("fork", self.fork, 0.5),
        ]
        self.main_operations: list[tuple[str, Operation]] = [
            ("read_write", self.read_write),
            ("resolve", self.resolve),
            ("read_lease", self.read_lease),
            ("prefetch", self.prefetch),
            ("evict", self.evict),
            ("flush", self.flush),
        ]
        self.tasks_run: list[tuple[str, Task, float]] = [
            ("async read_write", lambda rng: self.aread_write(rng, drop=False), 10),
            ("async read_write_dropped", lambda rng: self.aread_write(rng, drop=True), 2),
            ("aresolve", self.aresolve, 8),
            ("async read_lease", self.aread_lease, 6),
            ("async prefetch", self.aprefetch, 4),
            ("aevict", self.aevict, 6),
            ("aflush", self.aflush, 4),
        ]

    # -- defects ----------------------------------------------------------------------------
    def defect(self, message: str, index: int | None = None, details: str = "") -> None:
        """Record a defect, with the state and history of tensor ``index`` if given."""
        if index is not None:
            details += "\n" + self.dump(index)
        self.report.defect(message, details)

    def dump(self, index: int) -> str:
        """Tensor ``index``: its unsaved value, latest write, pending write-backs and payload
        file, its entry and slot in every pool in use, and its recent history."""
        tensor = self.tensors[index]
        lines = [f"state of t{index}:"]
        try:
            unsaved = tensor._unsaved
            if unsaved is not None:
                owner, token, value = unsaved
                lines.append(f"  unsaved: {distinct(value)[:4]} of {id(owner)} ({id(token)})")
            else:
                lines.append("  unsaved: None")
            latest, by, before = tensor._hit_state.latest
            lines.append(
                f"  latest write: {id(latest)} by {None if by is None else id(by)}, before it "
                f"{id(before)}; pending write-backs: {tensor._pending_writes}"
            )
            try:
                lines.append(f"  payload file: {distinct(on_disk(tensor))[:4]}")
            except Exception as error:
                lines.append(f"  payload file: {error!r}")
            with self.pools_lock:
                pools = list(self.pools)
            for used in pools:
                actor = used.pool._actor
                entry = actor.entries.get(id(tensor))
                published = actor.published.get(id(tensor))
                lines.append(
                    f"  pool {used.key} ({used.served_by}), actor {id(actor)}: entry "
                    f"{entry is not None}, published {published is not None}"
                )
                for slot in {s for s in (published, getattr(entry, "slot", None)) if s is not None}:
                    fields = {name: getattr(slot, name, None) for name in SLOT_FIELDS}
                    lines.append(
                        f"    slot {fields} version {id(slot.version)} value "
                        f"{distinct(slot.value)[:4]} ({id(slot.value)})"
                    )
        except Exception as error:
            lines.append(f"  (the dump failed: {error!r})")
        lines.append(f"history of t{index}:")
        lines += [f"  {line}" for line in list(self.model.states[index].log)]
        return "\n".join(lines)

    def entries(self, used: UsedPool) -> str:
        """What the pool knows of each tensor: whether its value is resident, retained,
        held, on its way out, and its slot's leases."""
        names = {id(tensor): f"t{index}" for index, tensor in enumerate(self.tensors)}
        lines = [f"entries of pool {used.key} ({used.served_by}):"]
        for entry in list(used.pool._actor.entries.values()):
            slot = entry.slot
            leases = None if slot is None else (slot.leases, slot.tracked, slot.open)
            lines.append(
                f"  {names.get(entry.key, entry.key)}: resident {entry.value is not None}, "
                f"retained {entry.retained}, held {entry.held}, evicting {entry.evicting}, "
                f"pinned {entry.pinned}, waiters {entry.waiters}, dirty {entry.dirty}, "
                f"slot (leases, tracked, open) {leases}"
            )
        return "\n".join(lines)

    def check_read(self, start: ReadStart, value: torch.Tensor, label: str) -> None:
        self.report.count("reads_checked")
        problem = self.model.read_problem(start, value, label)
        if problem is not None:
            self.defect(problem, start.tensor)

    def failed(self, name: str, error: BaseException) -> None:
        """Count an error the operation ``name`` may raise; any other is a defect."""
        if isinstance(error, asyncio.CancelledError | TimeoutError):
            self.report.count("cancelled_or_timed_out")
        elif isinstance(error, KeyboardInterrupt) and (
            threading.current_thread() is threading.main_thread()
        ):
            self.report.count("interrupted_operations")
        elif isinstance(error, T2NErrorMisuse):  # a closed pool, an eviction of a leased value
            self.report.count("refused")
        else:
            details = "".join(traceback.format_exception(error))
            self.defect(f"{name}: unexpected {type(error).__name__}: {error}", details=details)

    def guarded(self, name: str, operation: Operation, rng: random.Random) -> None:
        self.report.count("operations")
        try:
            operation(rng)
        except BaseException as error:
            self.failed(name, error)

    # -- pools and tensors ------------------------------------------------------------------
    def new_pool(self, served_by: str, entered: bool) -> UsedPool:
        pool = TensorResidencyPool(
            max_cached_bytes=self.setup.budget,
            max_workers=self.setup.io_workers,
            strategy=self.setup.strategy,
        )
        self.all_pools.append(pool)
        if entered:
            pool.__enter__()
        return UsedPool(next(self.pool_keys), pool, served_by)

    def add_pool(self, used: UsedPool) -> None:
        with self.pools_lock:
            self.pools.append(used)

    def pick_pool(self, rng: random.Random) -> UsedPool:
        with self.pools_lock:
            return rng.choice(self.pools)

    def pick_tensor(self, rng: random.Random) -> int:
        return rng.randrange(len(self.tensors))

    def new_constant(self) -> int:
        return next(self.constants)

    # -- sync operations --------------------------------------------------------------------
    def read_write(self, rng: random.Random, drop: bool = False) -> None:
        """A ``read_write`` lease filling the tensor with a new constant. With ``drop``, the
        lease is dropped without its exit when nothing else holds it: its collection ends it."""
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        state = self.model.states[index]
        if not state.writer.acquire(blocking=False):
            return
        written: int | None = None
        ended = False
        lease: TensorResidencyLease | None = None
        value: torch.Tensor | None = None
        try:
            before = self.model.read_start(index, None)
            lease = used.pool.acquire(self.tensors[index], mode="read_write")
            with self.ctrl_c:
                value = lease.__enter__()
            written = self.new_constant()
            self.model.begin_write(index, written, value, used.key, "read_write")
            self.check_read(before, value.clone(), "read_write lease entered")
            filled = False
            try:
                with self.ctrl_c:
                    value.fill_(written)
                    filled = True
                    if rng.random() < 0.3:
                        time.sleep(rng.random() * 0.002)
            except BaseException:
                lease.__exit__(*sys.exc_info())  # as a with statement would
                if filled:
                    self.model.end_write(index, written, used.key, True, "exit with the error")
                    written = None
                raise
            if drop and sys.getrefcount(lease) == 2:
                lease = value = None  # no exit: its collection, here, ends it
                self.report.count("dropped_leases")
                how = "dropped"
            else:
                with self.ctrl_c:
                    lease.__exit__(None, None, None)
                how = "exit"
            self.model.end_write(index, written, used.key, True, how)
            written, ended = None, True
        finally:
            lease = value = None
            if not ended:  # cut short: its exit ended the lease, or its collection does now
                gc.collect()
            if written is not None:
                self.model.end_write(index, written, used.key, False, "cut short")
            state.writer.release()

    def update_values(self, rng: random.Random) -> None:
        """``update_values`` with a new constant, with a new shape and dtype at times."""
        index = self.pick_tensor(rng)
        state = self.model.states[index]
        if not state.writer.acquire(blocking=False):
            return
        try:
            tensor = self.tensors[index]
            written = self.new_constant()
            strict = not (self.setup.shape_changes and rng.random() < 0.3)
            if strict:
                new = torch.full(tuple(tensor.shape), written, dtype=tensor.dtype)
            else:
                numel = rng.choice([self.setup.numel, self.setup.numel // 2, self.setup.numel * 2])
                shape = rng.choice([(numel,), (2, max(numel // 2, 1))])
                dtype = rng.choice([torch.float32, torch.float64, torch.int64])
                new = torch.full(shape, written, dtype=dtype)
            with self.model.writing(index, written, new, None, "update_values"):
                tensor.update_values(new, strict_shape=strict, strict_dtype=strict)
        finally:
            state.writer.release()

    def copy(self, rng: random.Random) -> None:
        """``copy_`` of a new constant into the tensor, inside a pool's scope half the time."""
        index = self.pick_tensor(rng)
        state = self.model.states[index]
        if not state.writer.acquire(blocking=False):
            return
        used = self.pick_pool(rng) if rng.random() < 0.5 else None
        key = None if used is None else used.key
        try:
            tensor = self.tensors[index]
            written = self.new_constant()
            new = torch.full(tuple(tensor.shape), written, dtype=tensor.dtype)
            with (
                self.model.writing(index, written, new, key, "copy_"),
                contextlib.nullcontext() if used is None else used.pool.scope(),
            ):
                tensor.copy_(new)
        finally:
            state.writer.release()

    def resolve(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        with self.ctrl_c:
            value = used.pool.resolve(self.tensors[index]).clone()
        self.check_read(before, value, "resolve")

    def read_lease(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        with self.ctrl_c, used.pool.acquire(self.tensors[index]) as leased:
            value = leased.clone()
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
        self.check_read(before, value, "read lease")

    def prefetch(self, rng: random.Random) -> None:
        """A prefetch, waited for seven times in ten."""
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        with self.ctrl_c:
            handle = used.pool.prefetch(self.tensors[index])
            value = handle.wait().clone() if rng.random() < 0.7 else None
        if value is not None:
            self.check_read(before, value, "prefetch")

    def evict(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        self.model.event(index, f"evict pool={used.key}")
        with self.ctrl_c:
            used.pool.evict(self.tensors[index])
        self.model.event(index, f"evicted pool={used.key}")

    def flush(self, rng: random.Random) -> None:
        used = self.pick_pool(rng)
        tensor = self.tensors[self.pick_tensor(rng)] if rng.random() < 0.5 else None
        with self.ctrl_c:
            used.pool.flush(tensor)

    def reload(self, rng: random.Random) -> None:
        """A read outside any pool: ``reload()``, or a torch op on the tensor."""
        index = self.pick_tensor(rng)
        tensor = self.tensors[index]
        before = self.model.read_start(index, None)
        self.model.event(index, "reload outside the pools")
        value = tensor.reload() if rng.random() < 0.6 else torch.as_tensor(tensor + 0)
        self.check_read(before, value.clone(), "reload outside the pools")

    def scope_read(self, rng: random.Random) -> None:
        """A read inside a pool's scope: ``reload()``, or a torch op on the tensor."""
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        tensor = self.tensors[index]
        before = self.model.read_start(index, used.key)
        with used.pool.scope():
            value = tensor.reload().clone() if rng.random() < 0.5 else torch.as_tensor(tensor + 0)
        self.check_read(before, value, "read in a scope")

    def pin(self, rng: random.Random) -> None:
        """A pin, waited for, or an unpin (a FIXED pool has nothing to pin)."""
        if self.setup.strategy == ResidencyStrategy.FIXED:
            return
        used, tensor = self.pick_pool(rng), self.tensors[self.pick_tensor(rng)]
        if rng.random() < 0.5:
            used.pool.pin(tensor).wait()
        else:
            used.pool.unpin(tensor)

    def invariants(self, rng: random.Random) -> None:
        """The invariants of a pool, checked on its loop thread. A pool no loop serves (not
        started yet, or closed) is left alone: ``check_invariants`` would check it on this
        thread, while another's request may start its loop; no close runs meanwhile."""
        used = self.pick_pool(rng)
        with self.closing:
            if not used.pool._runtime.running:
                return
            try:
                check_invariants(used.pool)
            except AssertionError as error:
                details = [traceback.format_exc(), self.entries(used)]
                details += [self.dump(index) for index in range(len(self.tensors))]
                self.defect(f"invariants of pool {used.key}: {error}", details="\n".join(details))

    def close(self, rng: random.Random) -> None:
        """Close a pool in use (whatever uses it), and put a new entered one in its place."""
        used = self.pick_pool(rng)
        try:
            with self.closing:
                used.pool.close()
        finally:
            with self.pools_lock:
                if used in self.pools and used.pool.closed:
                    new = self.new_pool("a private thread, entered", entered=True)
                    self.pools[self.pools.index(used)] = new

    def cancel_task(self, rng: random.Random) -> None:
        with self.tasks_lock:
            tasks = list(self.tasks)
        if tasks:
            task = rng.choice(tasks)
            with contextlib.suppress(RuntimeError):  # its loop has closed
                task.get_loop().call_soon_threadsafe(task.cancel)

    def deepcopy(self, rng: random.Random) -> None:
        index = self.pick_tensor(rng)
        before = self.model.read_start(index, None)
        value = copy.deepcopy(self.tensors[index]).reload()
        self.check_read(before, value.clone(), "deepcopy")

    def disk(self, rng: random.Random) -> None:
        """The payload file holds a single value written before (not necessarily the latest:
        the pools write back when they please)."""
        index = self.pick_tensor(rng)
        try:
            value = on_disk(self.tensors[index])
        except T2NErrorStorage:  # the file replaced under the read: a retry's business
            self.report.count("files_replaced_under_a_read")
            return
        values = distinct(value)
        with self.model.lock:
            known = set(self.model.states[index].written_as)
        if len(values) > 1 or (values and values[0] not in known):
            self.defect(f"payload file of t{index}: torn or unknown values {values[:6]}", index)

    def fork(self, rng: random.Random) -> None:
        """Fork amid everything: the child reads every tensor, writes one and reads it back
        (the parent's writes after the fork are not its business). The snapshot of what the
        tensors may hold is taken under the model's lock, which the fork keeps held in the
        child: the child never takes it."""
        with self.model.lock:
            allowed = [state.possible | state.in_progress for state in self.model.states]
            writing = [bool(state.in_progress) for state in self.model.states]
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                self.forked_child(read, write, allowed, writing)
            os.close(write)  # before another fork: its child would keep the pipe open
        self.report.count("forks")
        deadline = time.monotonic() + FORK_SECONDS
        while not (ended := os.waitpid(child, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                os.close(read)
                self.defect(f"a forked child hung for {FORK_SECONDS:.0f} s")
                return
            time.sleep(0.005)
        with os.fdopen(read, encoding="utf-8") as pipe:
            found = pipe.read()
        status = os.waitstatus_to_exitcode(ended[1])
        if found or status:
            self.defect(f"forked child (exit status {status}): {found}")

    def forked_child(
        self, read: int, write: int, allowed: list[set[int]], writing: list[bool]
    ) -> NoReturn:
        """The forked child's checks; what it finds goes to the pipe's ``write`` end, then it
        leaves with ``os._exit``, as multiprocessing's forked workers do."""
        found: list[str] = []
        try:
            os.close(read)
            faulthandler.dump_traceback_later(FORK_SECONDS - 5, exit=True)
            torch.set_num_threads(1)  # OpenMP is not fork-safe
            for index, tensor in enumerate(self.tensors):
                try:
                    values = distinct(tensor.reload())
                except T2NErrorStorage as error:
                    if "forked from wrote or freed it after the fork" in str(error):
                        continue  # documented: the parent replaced the file since
                    raise
                torn = len(values) > 1 and not writing[index]
                if torn or any(seen not in allowed[index] for seen in values):
                    found.append(f"t{index} read {values[:4]}, allowed {sorted(allowed[index])}")
            tensor = self.tensors[0]
            tensor.update_values(
                torch.full(tuple(tensor.shape), CHILD_CONSTANT, dtype=tensor.dtype)
            )
            back = distinct(tensor.reload())
            if back != [CHILD_CONSTANT]:
                found.append(f"its own write of {CHILD_CONSTANT} read back as {back[:4]}")
        except BaseException as error:
            found.append("raised " + "".join(traceback.format_exception(error)))
        finally:
            os.write(write, "\n".join(found)[:4000].encode())
            os._exit(0)

    # -- async operations -------------------------------------------------------------------
    async def aread_write(self, rng: random.Random, drop: bool) -> None:
        """:meth:`read_write` in a task: cancelled at its awaits rather than interrupted."""
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        state = self.model.states[index]
        if not state.writer.acquire(blocking=False):
            return
        try:
            before = self.model.read_start(index, None)
            lease = used.pool.acquire(self.tensors[index], mode="read_write")
            value = await lease.__aenter__()
            written = self.new_constant()
            self.model.begin_write(index, written, value, used.key, "async read_write")
            try:
                self.check_read(before, value.clone(), "async read_write lease entered")
                value.fill_(written)
                await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002]))
            except BaseException:
                try:
                    await lease.__aexit__(*sys.exc_info())
                except BaseException:
                    self.model.end_write(index, written, used.key, False, "exit cut short")
                    raise
                self.model.end_write(index, written, used.key, True, "exit with the error")
                raise
            if drop and sys.getrefcount(lease) == 2:
                del lease, value  # no exit: its collection, here, ends it
                self.report.count("dropped_leases")
                self.model.end_write(index, written, used.key, True, "dropped")
                return
            try:
                await lease.__aexit__(None, None, None)
            except BaseException:
                self.model.end_write(index, written, used.key, False, "exit cut short")
                raise
            self.model.end_write(index, written, used.key, True, "exit")
        finally:
            state.writer.release()

    async def aresolve(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        value = (await used.pool.aresolve(self.tensors[index])).clone()
        self.check_read(before, value, "aresolve")

    async def aread_lease(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        async with used.pool.acquire(self.tensors[index]) as leased:
            value = leased.clone()
            await asyncio.sleep(rng.choice([0, 0.001]))
        self.check_read(before, value, "async read lease")

    async def aprefetch(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        before = self.model.read_start(index, used.key)
        value = (await used.pool.prefetch(self.tensors[index])).clone()
        self.check_read(before, value, "async prefetch")

    async def aevict(self, rng: random.Random) -> None:
        used, index = self.pick_pool(rng), self.pick_tensor(rng)
        self.model.event(index, f"aevict pool={used.key}")
        await used.pool.aevict(self.tensors[index])
        self.model.event(index, f"aevicted pool={used.key}")

    async def aflush(self, rng: random.Random) -> None:
        await self.pick_pool(rng).pool.aflush(None if rng.random() < 0.5 else self.tensors[0])

    async def run_task(self, name: str, request: Coroutine[Any, Any, None]) -> None:
        self.report.count("operations")
        try:
            await request
        except BaseException as error:
            self.failed(name, error)

    async def spawn_tasks(self, which: str) -> None:
        """Start the operations of an event loop as tasks, some under a timeout, some
        cancelled at once; then wait for them to end."""
        rng = random.Random(f"{self.seed} {which}")
        choices = [(name, factory) for name, factory, _ in self.tasks_run]
        weights = [weight for _, _, weight in self.tasks_run]
        for _ in range(self.operations):
            if self.stop.is_set():
                break
            name, factory = rng.choices(choices, weights)[0]
            request = factory(rng)
            if rng.random() < self.setup.wait_for_rate:
                request = asyncio.wait_for(request, rng.choice([0, 0.0001, 0.001, 0.005]))
            task = asyncio.ensure_future(self.run_task(name, request))
            with self.tasks_lock:
                self.tasks.add(task)
            task.add_done_callback(self.forget_task)
            draw = rng.random()
            if draw < 0.15:
                await asyncio.sleep(0)
                task.cancel()
            elif draw < 0.5:
                await asyncio.sleep(rng.choice([0, 0.0005, 0.002]))
            if len(self.tasks) > 12:
                await asyncio.sleep(0.002)
        here = asyncio.get_running_loop()
        with self.tasks_lock:
            pending = [task for task in self.tasks if task.get_loop() is here]
        if pending:
            _, late = await asyncio.wait(pending, timeout=JOIN_SECONDS)
            if late:
                self.defect(f"{len(late)} tasks of the {which} did not end in {JOIN_SECONDS} s")

    def forget_task(self, task: asyncio.Task[None]) -> None:
        with self.tasks_lock:
            self.tasks.discard(task)

    # -- the threads ------------------------------------------------------------------------
    def start_thread(self, name: str, target: Callable[..., None], *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def join(self, threads: list[threading.Thread], what: str) -> None:
        """Wait for ``threads`` to end; one that does not within :data:`JOIN_SECONDS` hangs:
        a defect, with every thread's stack, and the others are asked to stop."""
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0))
        late = [thread.name for thread in threads if thread.is_alive()]
        if late:
            self.stop.set()
            self.defect(
                f"{what} did not end within {JOIN_SECONDS:.0f} s: {late}",
                details=thread_stacks(self.directory),
            )

    def work(self, number: int) -> None:
        rng = random.Random(f"{self.seed} worker {number}")
        choices = [(name, operation) for name, operation, _ in self.worker_operations]
        weights = [weight for _, _, weight in self.worker_operations]
        for _ in range(self.operations):
            if self.stop.is_set():
                break
            name, operation = rng.choices(choices, weights)[0]
            self.guarded(name, operation, rng)

    def cancel_all_along(self) -> None:
        rng = random.Random(f"{self.seed} canceller")
        while not self.stop.is_set() and not self.workers_done.is_set():
            time.sleep(rng.choice([0, 0.00005, 0.0002, 0.001]))
            self.cancel_task(rng)

    def interrupted_main(self) -> None:
        """The main thread's operations, each under a Ctrl-C."""
        rng = random.Random(f"{self.seed} main")
        for _ in range(self.operations // 2):
            if self.stop.is_set():
                break
            name, operation = rng.choice(self.main_operations)
            with self.ctrl_c.interrupting(rng):
                self.guarded(name, operation, rng)

    def serve_loop(self, ready: threading.Event) -> None:
        """The event loop thread: serves the loop pool, if any, while its tasks run; flushes
        it from the loop once told to end (:attr:`end_loop`), and closes it."""

        async def serve() -> None:
            loop, end = asyncio.get_running_loop(), asyncio.Event()
            self.end_loop = lambda: loop.call_soon_threadsafe(end.set)
            if not self.setup.loop_pool:
                ready.set()
                await self.spawn_tasks("event loop thread")
                await end.wait()
                return
            used = self.new_pool("the event loop thread", entered=False)
            async with used.pool:
                self.add_pool(used)
                ready.set()
                await self.spawn_tasks("event loop thread")
                await end.wait()
                if not used.pool.closed:
                    await used.pool.aflush()

        try:
            asyncio.run(serve())
        except BaseException as error:
            self.failed("the event loop thread", error)
        finally:
            ready.set()

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        """Run the seed and check the durable state; defects go to :attr:`report`."""
        history = _History(self.model)
        logger = logging.getLogger("torch_to_nnef")
        logger.addHandler(history)
        try:
            self.run_threads()
            self.finish()
        except Exception as error:  # a timeout's or a Ctrl-C's BaseException goes through
            self.defect(f"the run raised {type(error).__name__}", details=traceback.format_exc())
            self.stop.set()
        finally:
            logger.removeHandler(history)
            for pool in self.all_pools:  # after a defect: let no thread of the run go on
                with contextlib.suppress(Exception):
                    pool.close()

    def run_threads(self) -> None:
        self.add_pool(self.new_pool("a private thread, started by a request", entered=False))
        if self.setup.second_pool:
            self.add_pool(self.new_pool("a private thread, entered", entered=True))
        ready = threading.Event()
        loop_thread = self.start_thread("hostile-loop", self.serve_loop, ready)
        if not ready.wait(JOIN_SECONDS):
            self.defect(
                "the event loop thread did not start", details=thread_stacks(self.directory)
            )
        others = []
        if self.setup.second_loop:
            second = lambda: asyncio.run(self.spawn_tasks("second event loop"))  # noqa: E731
            others.append(self.start_thread("hostile-second-loop", second))
        workers = [
            self.start_thread(f"hostile-worker-{n}", self.work, n)
            for n in range(self.setup.threads)
        ]
        if self.setup.canceller:
            others.append(self.start_thread("hostile-canceller", self.cancel_all_along))
        if self.setup.ctrl_c:
            self.interrupted_main()
        self.join(workers, "worker threads")
        self.workers_done.set()
        self.join(others, "the second event loop or the canceller")
        deadline = time.monotonic() + JOIN_SECONDS
        while self.tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.end_loop is not None:
            self.end_loop()
        self.join([loop_thread], "the event loop thread")

    def finish(self) -> None:
        """Every pool holds no lease, keeps its invariants, flushes and closes; then each
        tensor, its payload file and a fresh tensor bound to that file hold a value it may
        hold, in the shape and dtype written."""
        gc.collect()  # leases dropped in reference cycles end
        for pool in self.all_pools:
            if pool.closed:
                continue
            try:
                check_invariants(pool)
                if "leased: 0," not in repr(pool):
                    dumps = "\n".join(self.dump(index) for index in range(len(self.tensors)))
                    self.defect(f"a lease is still held at the end: {pool!r}", details=dumps)
                pool.flush()
                pool.close()
            except BaseException as error:
                details = "".join(traceback.format_exception(error))
                self.defect(
                    f"final flush and close: {type(error).__name__}: {error}", None, details
                )
        for index, tensor in enumerate(self.tensors):
            state = self.model.states[index]
            if state.in_progress:
                self.defect(f"t{index}: writes still in progress at the end: {state.in_progress}")
            reads: list[tuple[str, Callable[[], torch.Tensor]]] = [
                ("reload", tensor.reload),
                ("payload file", functools.partial(on_disk, tensor)),
                ("fresh tensor", functools.partial(fresh_reload, tensor)),
            ]
            for label, read in reads:
                try:
                    value = read()
                except BaseException as error:
                    self.defect(f"final {label} of t{index}: {type(error).__name__}: {error}")
                    continue
                values = distinct(value)
                if len(values) != 1 or values[0] not in state.possible:
                    self.defect(
                        f"final {label} of t{index}: {values[:6]}, expected one of "
                        f"{sorted(state.possible)}",
                        index,
                    )
                elif state.written_as[int(values[0])] != (tuple(value.shape), value.dtype):
                    self.defect(
                        f"final {label} of t{index}: {tuple(value.shape)} {value.dtype}, "
                        f"written as {state.written_as[int(values[0])]}"
                    )


def fresh_reload(tensor: OffloadedTensor) -> torch.Tensor:
    """The value of a new tensor bound to ``tensor``'s payload file."""
    layout = storage.read_layout(tensor.offload_path)
    key = next(iter(layout.entries))
    return OffloadedTensor.from_safetensors(tensor.offload_path, key).reload()
