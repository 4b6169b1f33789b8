"""The actor: the one owner of a pool's state.

Every method named ``*_step`` or ``_on_*`` is a synchronous state transition: it runs on the
pool's event-loop thread, never awaits, and leaves the invariants true. A transition that must
wait for I/O returns the :class:`_IO` to wait for; the caller waits, then runs the step again.
Disk reads and writes run as jobs on the actor's I/O workers (``max_workers`` threads, one job
per load or write-back); their completions come back as transitions on the loop thread.

Requests reach the actor in two ways, both served by the same transitions: callers on the loop
thread call them directly (a function call is the cheapest message), other threads send a
:class:`_Message` over an anyio memory-object stream, run in the order sent as they arrive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from torch_to_nnef.exceptions import T2NError, T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.residency._policy import RetentionPolicy, ScheduledPolicy
from torch_to_nnef.tensor.residency._spares import SpareBuffers

if TYPE_CHECKING:
    from torch_to_nnef.tensor.offload import OffloadedTensor

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")


class PoolStats(NamedTuple):
    """Counters of a :class:`TensorResidencyPool` since it was created."""

    hits: int
    """Requests served by a resident value."""
    misses: int
    """Requests that had to wait for a load."""
    loads: int
    """Payloads read from disk."""
    bytes_read: int
    """Bytes read from disk by those loads."""
    evictions: int
    """Values that left the pool (budget, explicit eviction or close)."""
    write_backs: int
    """Dirty values written back to their files."""
    bytes_written: int
    """Bytes written by those write-backs."""
    load_errors: int
    """Loads that failed (missing or corrupt files)."""
    reused_buffers: int = 0
    """Loads that read into the host buffers of an evicted value instead of fresh memory."""


class _IO:
    """One disk job (a load or a write-back) and the callbacks waiting for its end."""

    __slots__ = ("_callbacks", "done", "error", "kind", "value")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = False
        self.value: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread once the job ended (at once if it has)."""
        if self.done:
            callback()
        else:
            self._callbacks.append(callback)

    def finish(self, value: torch.Tensor | None, error: BaseException | None) -> None:
        self.done = True
        self.value = value
        self.error = error
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    async def wait(self) -> None:
        """Wait on the loop thread for the job to end."""
        if not self.done:
            event = anyio.Event()
            self.add_callback(event.set)
            await event.wait()

    def result(self) -> torch.Tensor:
        """The loaded value, or the load error as :class:`T2NErrorStorage`."""
        if self.error is not None:
            raise _as_storage_error(self.error)
        assert self.value is not None
        return self.value


def _as_storage_error(error: BaseException) -> BaseException:
    if isinstance(error, T2NError):
        return error
    wrapped = T2NErrorStorage(f"loading an offloaded tensor failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped


@dataclass(eq=False)
class _Entry:
    """What the pool knows about one tensor."""

    key: int
    source: OffloadedTensor
    device: torch.device
    nbytes: int
    value: torch.Tensor | None = None
    load: _IO | None = None
    write: _IO | None = None
    leases: int = 0
    waiters: int = 0
    pinned: bool = False
    dirty: bool = False
    retained: bool = False
    evicting: bool = False
    binding: object = None  # the source's payload version the value was read from
    stuck: bool = False  # its write-back failed: kept, unevictable, until a flush writes it

    @property
    def held(self) -> bool:
        return bool(self.leases or self.waiters or self.pinned or self.stuck)


@dataclass(eq=False)
class _Ticket:
    """One acquire: its reservation while it waits for the load, then its lease."""

    source: OffloadedTensor
    device: torch.device
    read_write: bool
    entry: _Entry | None = None
    waiting: bool = False
    granted: bool = False
    first_try: bool = True
    abandoned: bool = False


@dataclass(eq=False)
class _Message:
    """A request sent by a thread other than the loop thread."""

    run: Callable[[], Any]
    reply: concurrent.futures.Future[Any] | None = field(default=None)


class _Actor:
    """Owner of a pool's entries, counters and I/O jobs (see the module docstring)."""

    def __init__(self, policy: RetentionPolicy, max_workers: int) -> None:
        self.policy = policy
        self.entries: dict[int, _Entry] = {}
        # Resident values published for lock-free hits from other threads:
        # key -> (device, value, payload version).
        self.published: dict[int, tuple[torch.device, torch.Tensor, object]] = {}
        self.resident_bytes = 0
        self.evicting_bytes = 0  # resident bytes already on their way out (write-back running)
        self.in_use_bytes = 0  # resident bytes leased or awaited (outside the budget)
        self.loading_bytes = 0  # bytes of the loads running
        # The most the values in use and the loads have held at once: spare buffers fill at
        # most the part of it they do not hold now (see _spare_room).
        self.active_peak = 0
        self.leased_entries = 0
        self.closing = False
        self.closed = False
        self._max_workers = max_workers
        self._jobs: set[_IO] = set()
        self._task_group: anyio.abc.TaskGroup | None = None
        # The loop-bound parts, made anew by each run of serve() (a pool whose `async with`
        # exit could not close it keeps its state and serves again from a later loop).
        self._workers: concurrent.futures.ThreadPoolExecutor
        self._call_soon: Callable[..., Any]
        self._send: MemoryObjectSendStream[_Message]
        self._receive: MemoryObjectReceiveStream[_Message]
        self._mailbox = 0
        self._stopped: anyio.Event
        self._draining = False
        # Counters; foreign-thread hits are counted under a lock and their recency replayed.
        self._hits = self._misses = self._loads = self._bytes_read = 0
        self._evictions = self._write_backs = self._bytes_written = self._load_errors = 0
        self._reused_buffers = 0
        self.spares = SpareBuffers()
        self._foreign_lock = threading.Lock()
        self._foreign_hits = 0
        # Bounded: between two transitions only the most recent hits matter for recency.
        self._foreign_touches: deque[int] = deque(maxlen=8192)

    # ------------------------------------------------------------------------------------------
    # Running
    # ------------------------------------------------------------------------------------------
    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the actor: foreign requests from the stream, disk jobs on the I/O workers,
        waits (flush, close) in a task group."""
        self._send, self._receive = anyio.create_memory_object_stream[_Message](float("inf"))
        self._mailbox = 0
        self._stopped = anyio.Event()
        self._call_soon = asyncio.get_running_loop().call_soon_threadsafe
        self._workers = concurrent.futures.ThreadPoolExecutor(
            self._max_workers, thread_name_prefix="t2n-residency-io"
        )
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                task_status.started()
                async with self._receive:
                    # Requests run as they arrive (post), read from the stream without waiting
                    # by drain(): a task blocked in receive() would be handed the next request
                    # directly, and a drain() run meanwhile would serve those behind it first.
                    await self._stopped.wait()
                    self.drain()
                task_group.cancel_scope.cancel()
        finally:
            self._task_group = None
            self._workers.shutdown(wait=True)  # jobs run to their end; nothing is left behind

    def _submit(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run a disk job on the I/O workers (at most ``max_workers`` at once)."""
        if self._task_group is None:
            raise T2NErrorMisuse("the residency pool is not running")
        return self._workers.submit(function, *args)

    def _completion(
        self, transition: Callable[..., None], *args: Any
    ) -> Callable[[concurrent.futures.Future[Any]], None]:
        """A callback for a worker's job that runs ``transition(*args, job)`` on the loop."""

        def done(job: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to tell
                self._call_soon(transition, *args, job)

        return done

    def post(self, message: _Message) -> None:
        """Queue a foreign request and run the queue (on the loop thread: foreign threads
        schedule this with ``call_soon_threadsafe``)."""
        self._mailbox += 1
        try:
            self._send.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._mailbox -= 1
            self._run_message(message)
            return
        self.drain()

    def stop(self) -> None:
        """Stop serving foreign requests once the queued ones ran (loop thread)."""
        self._send.close()
        self._stopped.set()

    def drain(self) -> None:
        """Replay the recency of lock-free hits made by other threads, then run the queued
        foreign requests in the order they were sent. :meth:`post` calls it when a request
        arrives, and every transition calls it first, so that it follows them.

        Not re-entrant: the transitions of the requests it runs find it already running and
        go on, so a long queue is drained by one loop, not by a recursion as deep as itself.
        """
        if self._draining:
            return
        self._draining = True
        try:
            if self._foreign_touches:
                self._replay_touches()
            while self._mailbox:
                try:
                    message = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    return
                self._mailbox -= 1
                self._run_message(message)
        finally:
            self._draining = False

    @staticmethod
    def _run_message(message: _Message) -> None:
        reply = message.reply
        try:
            result = message.run()
        except BaseException as error:  # the caller re-raises it in its own thread
            if reply is None:
                LOGGER.error("residency request failed", exc_info=error)
            elif not reply.done():
                reply.set_exception(error)
            return
        if reply is not None and not reply.done() and result is not _PENDING:
            reply.set_result(result)

    def spawn(self, job: Callable[[], Any]) -> None:
        """Start an async job in the actor's task group (loop thread)."""
        if self._task_group is None:
            raise T2NErrorMisuse("the residency pool is not running")
        self._task_group.start_soon(job)

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        return PoolStats(
            hits=self._hits + self._foreign_hits,
            misses=self._misses,
            loads=self._loads,
            bytes_read=self._bytes_read,
            evictions=self._evictions,
            write_backs=self._write_backs,
            bytes_written=self._bytes_written,
            load_errors=self._load_errors,
            reused_buffers=self._reused_buffers,
        )

    def count_foreign_hit(self, key: int) -> None:
        """Record a hit served from :attr:`published` by another thread (any thread)."""
        with self._foreign_lock:
            self._foreign_hits += 1
            self._foreign_touches.append(key)

    def _replay_touches(self) -> None:
        touches = self._foreign_touches
        while touches:
            self.policy.touch(touches.popleft())

    def check_open(self) -> None:
        if self.closed:
            raise T2NErrorMisuse("the TensorResidencyPool is closed; create a new pool")
        if self.closing:
            raise T2NErrorMisuse("the TensorResidencyPool is closing; create a new pool")

    # ------------------------------------------------------------------------------------------
    # Transitions
    # ------------------------------------------------------------------------------------------
    def _entry_for(self, source: OffloadedTensor, device: torch.device) -> _Entry:
        """The entry of ``source`` on ``device``, created (and its load started) when absent."""
        key = id(source)
        entry = self.entries.get(key)
        if entry is not None and self._stale(entry):
            entry = None
        if entry is None:
            entry = _Entry(key, source, device, source.payload_nbytes)
            self.entries[key] = entry
        elif entry.device != device:
            raise T2NErrorMisuse(
                f"{source.name!r} is resident on {entry.device}; a tensor cannot be resident on "
                f"two devices at once: evict it first or request it on {entry.device}"
            )
        if entry.value is None and entry.load is None:
            self._start_load(entry)
        return entry

    def _stale(self, entry: _Entry) -> bool:
        """Drop an unheld value whose payload was rewritten since it was read (``update_values``
        or an in-place op on the tensor itself); return whether it was dropped."""
        if entry.binding is entry.source._binding or entry.value is None:
            return False
        if entry.held or entry.write is not None:
            return False  # holders keep the value they have; it is refreshed once released
        if entry.dirty:
            LOGGER.warning(
                "%r was rewritten directly while the pool held unsaved changes; the direct write "
                "wins and the pool's changes are dropped",
                entry.source.name,
            )
            entry.dirty = False
        self._remove(entry)
        return True

    def resolve_step(self, source: OffloadedTensor, device: torch.device) -> torch.Tensor | _IO:
        """Serve a resident value, or return the load to wait for (counting a miss)."""
        self.drain()
        self.check_open()
        entry = self._entry_for(source, device)
        self.policy.access(entry.key)
        if entry.value is not None:
            self._hits += 1
            self.policy.touch(entry.key)
            return entry.value
        self._misses += 1
        assert entry.load is not None
        return entry.load

    def prefetch_step(
        self, source: OffloadedTensor, device: torch.device, pin: bool
    ) -> torch.Tensor | _IO:
        """Start (or join) a load; with ``pin``, pin the value (idempotent)."""
        self.drain()
        self.check_open()
        entry = self._entry_for(source, device)
        if pin and not entry.pinned:
            self._hold(entry, pinned=True)
            self.enforce()  # a pinned value counts toward the budget, even one taken back
        if entry.value is not None:
            self.policy.touch(entry.key)
            return entry.value
        assert entry.load is not None
        return entry.load

    def acquire_step(self, ticket: _Ticket) -> torch.Tensor | _IO:
        """Grant a lease on a resident value, or reserve it and return the job to wait for."""
        self.drain()
        if not ticket.waiting:
            self.check_open()
        entry = ticket.entry
        if entry is None or self.entries.get(entry.key) is not entry:
            entry = ticket.entry = self._entry_for(ticket.source, ticket.device)
        if ticket.first_try:
            self.policy.access(entry.key)
        if entry.value is not None and not (ticket.read_write and entry.write is not None):
            if ticket.first_try:
                self._hits += 1
            self._hold(entry, leases=1, waiters=-1 if ticket.waiting else 0)
            ticket.waiting = False
            ticket.granted = True
            self.policy.touch(entry.key)
            return entry.value
        if ticket.first_try:
            self._misses += 1
            ticket.first_try = False
        if not ticket.waiting:
            ticket.waiting = True
            self._hold(entry, waiters=1)
        pending = entry.write if entry.value is not None else entry.load
        assert pending is not None
        return pending

    def abandon(self, ticket: _Ticket) -> None:
        """Undo what an acquire that will never be used holds (its waiter was cancelled)."""
        self.drain()
        ticket.abandoned = True
        entry = ticket.entry
        if ticket.granted:
            ticket.granted = False
            assert entry is not None
            self.release_lease(entry, dirty=False)
        elif ticket.waiting:
            ticket.waiting = False
            if entry is not None and self.entries.get(entry.key) is entry:
                self._hold(entry, waiters=-1)
                self.enforce()

    def release_lease(self, entry: _Entry, dirty: bool) -> None:
        """End one lease; a ``read_write`` lease marks the value dirty."""
        self.drain()
        if entry.leases < 1:
            raise T2NErrorMisuse("this lease is not active: it was already released")
        entry.dirty = entry.dirty or dirty
        self.policy.touch(entry.key)
        self._hold(entry, leases=-1)
        self.enforce()

    def unpin_step(self, source: OffloadedTensor) -> None:
        self.drain()
        self.check_open()
        entry = self.entries.get(id(source))
        if entry is None or not entry.pinned:
            return
        self._hold(entry, pinned=False)
        self.enforce()

    def declare_schedule(self, keys: list[int]) -> None:
        self.drain()
        self.check_open()
        if isinstance(self.policy, ScheduledPolicy):
            self.policy.declare(keys)

    def is_pinned(self, source: OffloadedTensor) -> bool:
        entry = self.entries.get(id(source))
        return entry is not None and entry.pinned

    def adopt(
        self, source: OffloadedTensor, device: torch.device, value: torch.Tensor, binding: object
    ) -> _Entry | None:
        """Insert a value loaded inline on the loop thread (sync call inside a coroutine).

        ``binding`` is the payload version read before the load started. Returns the entry
        now holding ``source``'s value (the adopted one, or a resident value that another
        request loaded meanwhile), or ``None`` when it cannot be adopted.
        """
        self.drain()
        self.check_open()
        self._loads += 1
        self._misses += 1
        self._bytes_read += source.payload_nbytes
        self.policy.access(id(source))
        key = id(source)
        entry = self.entries.get(key)
        if entry is not None and self._stale(entry):
            entry = None
        if entry is None:
            entry = _Entry(key, source, device, source.payload_nbytes)
            self.entries[key] = entry
        elif entry.device != device:
            return None
        if entry.value is None:
            entry.binding = binding
            self._make_resident(entry, value)
        return entry

    def fresh_value(self, source: OffloadedTensor, device: torch.device) -> torch.Tensor | None:
        """Serve a resident, up-to-date value as a hit, or return ``None`` (nothing counted)."""
        entry = self.entries.get(id(source))
        if entry is None or entry.value is None or entry.device != device or self._stale(entry):
            return None
        result = self.resolve_step(source, device)
        assert not isinstance(result, _IO)
        return result

    # ------------------------------------------------------------------------------------------
    # Loads
    # ------------------------------------------------------------------------------------------
    def _start_load(self, entry: _Entry) -> None:
        io = _IO("load")
        binding = entry.source._binding  # the load reads this version or a newer one
        out = None
        if entry.device.type == "cpu":
            out = self.spares.take(entry.source.storage_key)

        # The whole load (read into the host buffers, copy to the device, decode) is one job
        # of the I/O workers; it runs to its end whatever happens to its waiters, and queued
        # loads follow each other on a worker without a round trip through the loop.
        job = self._submit(entry.source._reload_unmanaged, entry.device, out)
        job.add_done_callback(self._completion(self._loaded, entry, io))
        entry.load = io
        entry.binding = binding
        self._jobs.add(io)
        self._reused_buffers += out is not None
        self.loading_bytes += entry.nbytes
        self._note_active()

    def _loaded(self, entry: _Entry, io: _IO, job: concurrent.futures.Future[Any]) -> None:
        error = job.exception()
        self._on_loaded(entry, io, None if error is not None else job.result(), error)

    def _on_loaded(
        self, entry: _Entry, io: _IO, value: torch.Tensor | None, error: BaseException | None
    ) -> None:
        self.drain()
        self._jobs.discard(io)
        self.loading_bytes -= entry.nbytes
        if entry.load is io:
            entry.load = None
        if error is not None:
            self._load_errors += 1
            LOGGER.debug("load of %r failed: %r", entry.source.name, error)
            if entry.value is None and self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
                self.policy.forget(entry.key, entry.nbytes, entry.retained)
            io.finish(None, error)
            return
        assert value is not None
        self._loads += 1
        self._bytes_read += entry.nbytes
        if self.entries.get(entry.key) is entry and entry.value is None:
            self._make_resident(entry, value)
        elif entry.value is not None:
            value = entry.value  # adopted inline meanwhile: deliver the resident value
        io.finish(value, None)
        self.enforce()

    def _make_resident(self, entry: _Entry, value: torch.Tensor) -> None:
        entry.value = value
        self.resident_bytes += entry.nbytes
        if self._in_use(entry):
            self.in_use_bytes += entry.nbytes
        self._note_active()
        self.published[entry.key] = (entry.device, value, entry.binding)
        entry.retained = self.policy.admit(entry.key, entry.nbytes)
        if not entry.retained:
            LOGGER.debug(
                "%r (%d bytes) is delivered without cache retention under %s",
                entry.source.name,
                entry.nbytes,
                self.policy.strategy.name,
            )
        self._maybe_release(entry)

    # ------------------------------------------------------------------------------------------
    # Eviction and write-back
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _in_use(entry: _Entry) -> bool:
        """Whether a resident value is in use (leased or awaited) rather than cached.

        In-use values are outside the budget, which bounds what is kept for reuse; a pinned
        value counts toward it even while leased.
        """
        return entry.value is not None and not entry.pinned and bool(entry.leases or entry.waiters)

    def _hold(
        self, entry: _Entry, *, leases: int = 0, waiters: int = 0, pinned: bool | None = None
    ) -> None:
        """Change what holds ``entry`` (leases, waiters, its pin), keeping every count right."""
        was_leased, was_in_use, was_held = bool(entry.leases), self._in_use(entry), entry.held
        entry.leases += leases
        entry.waiters += waiters
        if pinned is not None:
            entry.pinned = pinned
        if bool(entry.leases) != was_leased:
            self.leased_entries += 1 if entry.leases else -1
        if self._in_use(entry) != was_in_use:
            self.in_use_bytes += -entry.nbytes if was_in_use else entry.nbytes
            self._note_active()
        if entry.held and not was_held:
            self.policy.hold(entry.key)
            self._set_evicting(entry, False)  # a value on its way out is wanted again
        elif was_held and not entry.held:
            self._maybe_release(entry)

    def _maybe_release(self, entry: _Entry) -> None:
        if entry.value is not None and not entry.held:
            self.policy.release(entry.key, entry.nbytes, entry.retained)

    def enforce(self) -> None:
        """Evict what the policy names so that unheld values fit the budget."""
        budget = self.policy.budget
        cached = self.resident_bytes - self.evicting_bytes - self.in_use_bytes
        excess = 0 if budget is None else cached - budget
        for key in self.policy.victims(excess):
            entry = self.entries.get(key)
            if entry is not None and entry.value is not None and not entry.held:
                self._evict(entry)

    def _note_active(self) -> None:
        """After values or loads were added: raise the peak in use, shrink the spares' room."""
        self.active_peak = max(self.active_peak, self.in_use_bytes + self.loading_bytes)
        self.spares.shrink(self._spare_room())

    def _spare_room(self) -> int:
        """How many bytes of spare buffers the pool may keep.

        What is left of the budget plus the peak of values in use and loads running at once
        (without a budget: of that peak) once resident values and loads are counted. A spare
        stands for a value that left and that the next load replaces: a streamed forward reads
        each layer into the buffer of one evicted before, instead of faulting fresh pages in,
        and the pool never holds more than its budget plus that peak (the layer computing and
        the one read ahead).
        """
        budget = self.policy.budget
        if budget is None:
            return max(0, self.active_peak - self.in_use_bytes - self.loading_bytes)
        return max(0, budget + self.active_peak - self.resident_bytes - self.loading_bytes)

    def _evict(self, entry: _Entry) -> None:
        """Remove an unheld value, writing it back first when it is dirty."""
        if entry.dirty or entry.write is not None:
            self._set_evicting(entry, True)
            if entry.write is None:
                self._start_write(entry)
            return
        self._remove(entry)

    def _set_evicting(self, entry: _Entry, evicting: bool) -> None:
        if entry.evicting != evicting:
            entry.evicting = evicting
            self.evicting_bytes += entry.nbytes if evicting else -entry.nbytes

    def _remove(self, entry: _Entry) -> None:
        self._set_evicting(entry, False)
        del self.entries[entry.key]
        self.published.pop(entry.key, None)
        self.policy.forget(entry.key, entry.nbytes, entry.retained)
        if self._in_use(entry):
            self.in_use_bytes -= entry.nbytes
        value, entry.value = entry.value, None
        if value is not None:
            self.resident_bytes -= entry.nbytes
            self._evictions += 1
            if entry.device.type == "cpu":
                buffers = entry.source._host_buffers(value)
                if buffers is not None:
                    self.spares.offer(
                        entry.source.storage_key, entry.nbytes, value, buffers, self._spare_room()
                    )

    def _start_write(self, entry: _Entry) -> _IO:
        io = entry.write = _IO("write")
        self._jobs.add(io)
        value = entry.value
        assert value is not None
        entry.dirty = False
        entry.stuck = False

        # One job of the I/O workers, run to its end: the entry changes only once it is done.
        job = self._submit(entry.source.update_values, value)
        job.add_done_callback(self._completion(self._written, entry, io))
        return io

    def _written(self, entry: _Entry, io: _IO, job: concurrent.futures.Future[Any]) -> None:
        self._on_written(entry, io, job.exception())

    def _on_written(self, entry: _Entry, io: _IO, error: BaseException | None) -> None:
        self.drain()
        self._jobs.discard(io)
        entry.write = None
        if error is not None:
            # The value stays resident and dirty, out of the eviction order (no retry on every
            # transition while the disk is full); a flush retries it.
            entry.dirty = True
            entry.stuck = True
            self.policy.hold(entry.key)
            self._set_evicting(entry, False)
            LOGGER.warning("write-back of %r failed: %r", entry.source.name, error)
            io.finish(None, error)
            return
        self._write_backs += 1
        self._bytes_written += entry.nbytes
        entry.binding = entry.source._binding  # the file now holds the pool's value
        if entry.value is not None and self.entries.get(entry.key) is entry:
            self.published[entry.key] = (entry.device, entry.value, entry.binding)
        io.finish(None, None)
        if entry.evicting and self.entries.get(entry.key) is entry:
            if entry.dirty:  # written to again meanwhile
                self._start_write(entry)
            else:
                self._remove(entry)
        else:
            self._maybe_release(entry)  # back in the eviction order (after a failed write-back)
        self.enforce()

    def evict_step(self, source: OffloadedTensor) -> _IO | None:
        """Evict ``source`` now; return the job to wait for (a load or a write-back) first."""
        self.drain()
        self.check_open()
        entry = self.entries.get(id(source))
        if entry is None:
            return None
        if entry.leases or entry.pinned:
            what = "leased" if entry.leases else "pinned"
            hint = "release its lease" if entry.leases else "unpin it"
            raise T2NErrorMisuse(f"cannot evict {source.name!r} while it is {what}: {hint} first")
        if entry.load is not None:
            return entry.load
        if entry.write is not None:
            return entry.write
        if entry.dirty:
            self._set_evicting(entry, True)
            return self._start_write(entry)
        if entry.waiters:
            return None  # a waiter is about to take it; nothing to evict
        self._remove(entry)
        return None

    def flush_step(self, source: OffloadedTensor | None) -> list[_IO]:
        """Start write-backs of dirty values (all, or ``source``'s); return jobs to wait for."""
        self.drain()
        if source is None:
            entries = [e for e in self.entries.values() if e.dirty or e.write or e.load]
        else:
            found = self.entries.get(id(source))
            entries = [] if found is None else [found]
        jobs: list[_IO] = []
        for entry in entries:
            if entry.load is not None:
                jobs.append(entry.load)
            elif entry.write is not None:
                jobs.append(entry.write)
            elif entry.dirty and entry.value is not None:
                jobs.append(self._start_write(entry))
        return jobs

    def begin_close(self) -> None:
        self.drain()
        if self.closed:
            return
        self.check_open()
        if self.leased_entries:
            leased = [e.source.name for e in self.entries.values() if e.leases]
            raise T2NErrorMisuse(
                f"cannot close the TensorResidencyPool while {len(leased)} value(s) are leased "
                f"({', '.join(map(repr, leased[:5]))}): exit their `acquire` blocks first"
            )
        self.closing = True

    def pending_jobs(self) -> list[_IO]:
        return list(self._jobs)

    def dirty_entries(self) -> bool:
        return any(e.dirty for e in self.entries.values())

    def abort_close(self) -> None:
        self.closing = False

    def finish_close(self) -> None:
        for entry in list(self.entries.values()):
            self._remove(entry)
        self.spares.clear()
        self.closing = False
        self.closed = True


class _Pending:
    """Marker returned by a message whose reply is completed later by a callback."""


_PENDING: Any = _Pending()
