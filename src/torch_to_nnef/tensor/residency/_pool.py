"""The public face of the residency pool: sync shim, async twins, handles and scope."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Generator, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import offload as _offload
from torch_to_nnef.tensor.residency._actor import (
    _IO,
    _PENDING,
    PoolStats,
    _Actor,
    _Entry,
    _Message,
    _Ticket,
)
from torch_to_nnef.tensor.residency._loop import LoopHost, uvloop_wanted
from torch_to_nnef.tensor.residency._policy import ResidencyStrategy, make_policy
from torch_to_nnef.tensor.residency._scope import _ACTIVE_RESIDENCY

if TYPE_CHECKING:
    from torch_to_nnef.tensor.offload import OffloadedTensor
    from torch_to_nnef.tensor.residency._stream import ModuleStream

__all__ = ["TensorPrefetch", "TensorResidencyLease", "TensorResidencyPool"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")

TDevice = torch.device | str | int
LeaseMode = Literal["read", "read_write"]


def _normalize_device(device: TDevice) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _settle(reply: concurrent.futures.Future[Any], io: _IO) -> None:
    if reply.done():
        return
    try:
        reply.set_result(io.result())
    except BaseException as error:
        reply.set_exception(error)


class _Unwaited:
    """How many requests were sent without waiting for them (under ``lock``, from any
    thread), and how many of them ran (on the loop thread only)."""

    __slots__ = ("lock", "ran", "sent")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.ran = 0


class _ForeignAcquire:
    """An acquire sent by another thread, retried on the loop thread after each job it awaits.

    A class rather than a recursive closure: a closure that calls itself is a reference cycle,
    which would keep the reply, and so the loaded value, alive until the cycle collector runs
    (and evicted buffers from being reused).
    """

    __slots__ = ("actor", "reply", "ticket")

    def __init__(
        self, actor: _Actor, ticket: _Ticket, reply: concurrent.futures.Future[Any]
    ) -> None:
        self.actor = actor
        self.ticket = ticket
        self.reply = reply

    def attempt(self) -> None:
        actor, ticket, reply = self.actor, self.ticket, self.reply
        if ticket.abandoned or reply.done():
            return
        try:
            result = actor.acquire_step(ticket)
        except BaseException as error:
            actor.abandon(ticket)
            reply.set_exception(error)
            return
        if isinstance(result, _IO):
            result.add_callback(lambda: self._after(result))
        else:
            reply.set_result((result, ticket.entry))

    def _after(self, job: _IO) -> None:
        if job.kind == "load" and job.error is not None:
            self.actor.abandon(self.ticket)
            _settle(self.reply, job)
        else:
            self.attempt()


class TensorPrefetch:
    """Handle on a load started by :meth:`TensorResidencyPool.prefetch` or ``pin``.

    ``handle.wait()`` blocks until the value is loaded and returns it (any thread but the
    pool's loop thread); ``await handle`` does the same in async code; ``handle.done()`` tells
    without blocking. A failed load raises :class:`T2NErrorStorage` from both.

    Handles are not constructed directly: :meth:`TensorResidencyPool.prefetch` and
    :meth:`TensorResidencyPool.pin` return them.
    """

    __slots__ = ("_future", "_io", "_pool", "_value")

    def __init__(
        self,
        pool: TensorResidencyPool,
        *,
        value: torch.Tensor | None = None,
        io: _IO | None = None,
        future: concurrent.futures.Future[Any] | None = None,
    ) -> None:
        self._pool = pool
        self._value = value
        self._io = io  # the load itself, awaited on the loop thread
        if future is None:  # settled by the load, for waiters on other threads
            future = concurrent.futures.Future()
            if value is not None:
                future.set_result(value)
            elif io is not None:
                io.add_callback(lambda: _settle(future, io))
        self._future = future

    def done(self) -> bool:
        """Whether the load has ended (successfully or not)."""
        return self._future.done()

    def wait(self) -> torch.Tensor:
        """Block until the value is loaded and return it.

        Raises:
            T2NErrorStorage: the load failed (the cause is chained).
            T2NErrorMisuse: called on the pool's own loop thread before the load ended
                (use ``await handle`` there).
        """
        if not self._future.done() and self._pool._host.on_loop_thread():
            raise T2NErrorMisuse(
                "TensorPrefetch.wait() would block the pool's event loop: "
                "use `await handle` in async code"
            )
        value: torch.Tensor = self._future.result()
        return value

    def __await__(self) -> Generator[Any, None, torch.Tensor]:
        return self._await().__await__()

    async def _await(self) -> torch.Tensor:
        if self._io is not None and self._pool._host.on_loop_thread():
            await self._io.wait()
            return self._io.result()
        value: torch.Tensor = await asyncio.wrap_future(self._future)
        return value

    def __repr__(self) -> str:
        return f"<TensorPrefetch {'done' if self.done() else 'pending'}>"


class TensorResidencyLease:
    """A scoped claim on a resident value: ``with pool.acquire(t) as v`` or ``async with``.

    While the lease is held the value stays resident. A ``read_write`` lease marks the value
    dirty when it ends, and the pool writes it back before evicting it, on flush and on close.
    A lease is entered once.

    Leases are not constructed directly: :meth:`TensorResidencyPool.acquire` returns them.
    Entering one raises what :meth:`TensorResidencyPool.resolve` raises, and
    :class:`T2NErrorMisuse` when the lease is already held.
    """

    __slots__ = ("_device", "_entry", "_mode", "_pool", "_reply", "_source", "_ticket")

    def __init__(
        self, pool: TensorResidencyPool, source: OffloadedTensor, device: torch.device, mode: str
    ) -> None:
        self._pool = pool
        self._source = source
        self._device = device
        self._mode = mode
        self._entry: _Entry | None = None
        self._ticket: _Ticket | None = None
        self._reply: concurrent.futures.Future[Any] | None = None

    @property
    def mode(self) -> str:
        """``"read"`` or ``"read_write"``."""
        return self._mode

    def _check_unused(self) -> _Ticket:
        if self._entry is not None:
            raise T2NErrorMisuse("this lease is already held: a lease can be entered once")
        return _Ticket(self._source, self._device, self._mode == "read_write")

    def _begin(self) -> None:
        """Start acquiring without waiting, so that ``__enter__`` later finds the value loaded.

        Only from a thread other than the pool's loop thread (elsewhere it does nothing). A
        begun lease holds its value as soon as it is loaded: enter it, or :meth:`_cancel` it.
        """
        pool = self._pool
        pool._ensure_running()
        if self._ticket is None and not pool._host.on_loop_thread():
            self._ticket = self._check_unused()
            self._reply = pool._acquire_begin(self._ticket)

    def _cancel(self) -> None:
        """Drop a begun lease that will not be entered."""
        ticket, self._ticket, self._reply = self._ticket, None, None
        if ticket is not None and self._entry is None:
            self._pool._acquire_cancel(ticket)

    def __enter__(self) -> torch.Tensor:
        if self._reply is not None and self._ticket is not None:
            ticket, reply, self._reply = self._ticket, self._reply, None
            value, self._entry = self._pool._acquire_wait(ticket, reply)
            return value
        ticket = self._check_unused()
        value, self._entry = self._pool._acquire_sync(ticket)
        return value

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entry, self._entry = self._entry, None
        self._ticket = None
        if entry is not None:
            self._pool._release(entry, self._mode == "read_write")

    async def __aenter__(self) -> torch.Tensor:
        ticket = self._check_unused()
        value, self._entry = await self._pool._acquire_async(ticket)
        return value

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        state = "held" if self._entry is not None else "idle"
        return f"<TensorResidencyLease {self._source.name!r} mode={self._mode} {state}>"


class TensorResidencyPool:
    """Keep a bounded set of :class:`OffloadedTensor` values resident while a model runs.

    One actor owns the pool's state on an event loop: the caller's (``async with pool``) or a
    private daemon thread started by ``with pool`` or the first synchronous call. Every
    operation has a synchronous face, usable from any thread, and an async twin.

    Args:
        max_cached_bytes: soft limit on the bytes of the values kept for reuse. Values in use
            (leased, or awaited by a request) come on top of it; pinned values count toward
            it and may exceed it. ``None``: no limit.
        max_workers: at most this many disk jobs (loads, write-backs) run at once.
        strategy: a :class:`ResidencyStrategy` (``LRU``, ``FIXED`` or ``SCHEDULED``).
        use_uvloop: run the private loop thread on uvloop (default: when importable, unless
            ``T2N_RESIDENCY_UVLOOP=0``).

    Raises:
        T2NErrorMisuse: a negative budget, ``max_workers < 1``, or a strategy that is not a
            :class:`ResidencyStrategy`.

    Attributes:
        max_cached_bytes: the soft budget given at creation.
        max_workers: the bound on concurrent disk jobs given at creation.
        strategy: the retention strategy given at creation.
    """

    def __init__(
        self,
        max_cached_bytes: int | None = None,
        max_workers: int = 1,
        strategy: ResidencyStrategy = ResidencyStrategy.LRU,
        *,
        use_uvloop: bool | None = None,
    ) -> None:
        if max_cached_bytes is not None and (
            not isinstance(max_cached_bytes, int) or max_cached_bytes < 0
        ):
            raise T2NErrorMisuse(
                f"max_cached_bytes must be None or a non-negative int, got {max_cached_bytes!r}"
            )
        if not isinstance(max_workers, int) or max_workers < 1:
            raise T2NErrorMisuse(f"max_workers must be an int >= 1, got {max_workers!r}")
        if not isinstance(strategy, ResidencyStrategy):
            raise T2NErrorMisuse(
                "strategy must be a ResidencyStrategy (e.g. ResidencyStrategy.LRU), "
                f"got {strategy!r}"
            )
        self.max_cached_bytes = max_cached_bytes
        self.max_workers = max_workers
        self.strategy = strategy
        self._use_uvloop = use_uvloop
        self._actor = _Actor(make_policy(strategy, max_cached_bytes), max_workers)
        self._host = LoopHost()
        self._warned_inline = False
        self._task_group: anyio.abc.TaskGroup | None = None
        self._start_lock = threading.Lock()
        self._unwaited = _Unwaited()
        # Module streams over this pool: they hold the next forward's first modules, which
        # closing releases first.
        self._streams: weakref.WeakSet[ModuleStream] = weakref.WeakSet()

    # ------------------------------------------------------------------------------------------
    # Introspection (non-blocking, any thread)
    # ------------------------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Bytes of the values resident in the pool (a maintained counter)."""
        self._catch_up()
        return self._actor.resident_bytes

    def is_resident(self, source: OffloadedTensor) -> bool:
        """Whether ``source``'s value is loaded and held by the pool."""
        self._check_source(source)
        self._catch_up()
        entry = self._actor.entries.get(id(source))
        return entry is not None and entry.value is not None

    def is_pinned(self, source: OffloadedTensor) -> bool:
        """Whether ``source`` is pinned (LRU only; FIXED raises :class:`T2NErrorMisuse`)."""
        self._check_pins("is_pinned")
        self._check_source(source)
        self._catch_up()
        return self._actor.is_pinned(source)

    def stats(self) -> PoolStats:
        """Counters since the pool was created (see :class:`PoolStats`)."""
        self._catch_up()
        return self._actor.stats()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` completed."""
        return self._actor.closed

    def __repr__(self) -> str:
        self._catch_up()
        actor = self._actor
        budget = "unbounded" if self.max_cached_bytes is None else _mib(self.max_cached_bytes)
        state = "closed" if actor.closed else f"resident: {len(actor.published)}"
        return (
            f"<TensorResidencyPool {self.strategy.name} [{state}, leased: {actor.leased_entries}, "
            f"bytes: {_mib(actor.resident_bytes)} / {budget}]>"
        )

    # ------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_source(source: Any) -> None:
        if not isinstance(source, _offload.OffloadedTensor):
            raise T2NErrorMisuse(
                "TensorResidencyPool only manages OffloadedTensor values; "
                f"got {type(source).__name__} (plain tensors are already resident)"
            )

    def _target(self, source: OffloadedTensor, device: TDevice | None) -> torch.device:
        self._check_source(source)
        if device is None:
            return _normalize_device(source.target_device)
        return _normalize_device(device)

    def _check_pins(self, operation: str) -> None:
        if not self._actor.policy.allows_pins:
            raise T2NErrorMisuse(
                f"{operation} is not supported by ResidencyStrategy.{self.strategy.name}, which "
                "controls admission itself; use ResidencyStrategy.LRU for manual pins"
            )

    # ------------------------------------------------------------------------------------------
    # Running
    # ------------------------------------------------------------------------------------------
    def _ensure_running(self) -> None:
        if self._host.running:
            return
        with self._start_lock:  # two threads' first calls start one loop
            if self._host.running:
                return
            self._actor.check_open()

            async def main(started: Callable[[], None]) -> None:
                async with anyio.create_task_group() as task_group:
                    await task_group.start(self._actor.serve)
                    started()

            self._host.start_private(main, use_uvloop=uvloop_wanted(self._use_uvloop))

    def __enter__(self) -> TensorResidencyPool:
        self._actor.check_open()
        self._ensure_running()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            LOGGER.exception("closing the TensorResidencyPool failed")

    async def __aenter__(self) -> TensorResidencyPool:
        self._actor.check_open()
        if self._host.running:
            raise T2NErrorMisuse(
                "this TensorResidencyPool already runs (on its own thread or another loop); "
                "enter `async with pool` once, before any synchronous use"
            )
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        await task_group.start(self._actor.serve)
        self._host.attach_current()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task_group, self._task_group = self._task_group, None
        try:
            if not self._actor.closed:
                await self.aclose()
        except Exception:
            # The pool stays open with its values (dirty ones included): a later `close()`
            # or `flush()` serves it again from a private loop thread.
            if exc is None:
                raise
            LOGGER.exception("closing the TensorResidencyPool failed; it stays open")
        finally:
            self._actor.stop()
            if task_group is not None:
                await task_group.__aexit__(None, None, None)
            self._host.detach()

    # ------------------------------------------------------------------------------------------
    # Requests from other threads
    # ------------------------------------------------------------------------------------------
    def _send(
        self, run: Callable[[concurrent.futures.Future[Any]], Any]
    ) -> concurrent.futures.Future[Any]:
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._host.call(self._actor.post, _Message(lambda: run(reply), reply))
        return reply

    def _post(self, run: Callable[[], Any]) -> None:
        self._host.call(self._actor.post, _Message(run))

    def _post_unwaited(self, run: Callable[[], Any]) -> None:
        """Send a request nobody waits for, counted for :meth:`_catch_up`."""
        unwaited = self._unwaited
        with unwaited.lock:
            unwaited.sent += 1

        def counted() -> Any:
            try:
                return run()
            finally:
                unwaited.ran += 1  # on the loop thread only

        self._post(counted)

    def _catch_up(self) -> None:
        """Make reads of the pool's state see every request sent before them without waiting
        (a lease ended by another thread, say): when some have not run yet, wait for them, or
        on the loop thread, run those queued."""
        unwaited = self._unwaited
        host = self._host
        if unwaited.sent == unwaited.ran or not host.running:
            return
        if host.on_loop_thread():
            self._actor.drain()
        else:
            self._send(lambda reply: None).result()  # runs after them: requests are FIFO

    def _warn_inline(self, operation: str) -> None:
        if not self._warned_inline:
            self._warned_inline = True
            LOGGER.warning(
                "TensorResidencyPool.%s loaded a value synchronously on the pool's event-loop "
                "thread, blocking it; run torch forwards in a worker thread with "
                "`await anyio.to_thread.run_sync(...)`",
                operation,
            )

    def _start_on_loop(self, coroutine: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Start ``coroutine()`` in the actor's task group from another thread; its future."""
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start() -> None:
            async def job() -> None:
                try:
                    reply.set_result(await coroutine())
                except BaseException as error:
                    reply.set_exception(error)

            self._actor.spawn(job)

        self._post(start)
        return reply

    async def _run_on_loop(self, coroutine: Callable[[], Any]) -> Any:
        """Run ``coroutine()`` on the pool's loop from a task of another loop."""
        return await asyncio.wrap_future(self._start_on_loop(coroutine))

    # ------------------------------------------------------------------------------------------
    # resolve
    # ------------------------------------------------------------------------------------------
    def resolve(self, source: OffloadedTensor, device: TDevice | None = None) -> torch.Tensor:
        """Return ``source``'s value, loading it when it is not resident.

        This is the read-only path :class:`OffloadedTensor` takes inside :meth:`scope`. Hits
        from any thread are served without a round trip to the loop thread. On the pool's own
        loop thread a miss is loaded inline (blocking), with a one-time warning.

        Args:
            source: the offloaded tensor.
        device: where the value is wanted (default: ``source``'s target device).

        Raises:
            T2NErrorMisuse: ``source`` is not an OffloadedTensor, the pool is closed, or the
                value is resident on another device.
            T2NErrorStorage: the payload could not be loaded.
        """
        target = self._target(source, device)
        actor = self._actor
        published = actor.published.get(id(source))
        if (
            published is not None
            and published[0] == target
            and published[2] is source._binding
            and not actor.closing
        ):
            if self._host.on_loop_thread():
                return self._resolve_inline(source, target)
            actor.count_foreign_hit(id(source))
            return published[1]
        self._ensure_running()
        if self._host.on_loop_thread():
            return self._resolve_inline(source, target)

        def run(reply: concurrent.futures.Future[Any]) -> Any:
            result = actor.resolve_step(source, target)
            if isinstance(result, _IO):
                result.add_callback(lambda: _settle(reply, result))
                return _PENDING
            return result

        return self._send(run).result()  # type: ignore[no-any-return]

    def _resolve_inline(self, source: OffloadedTensor, target: torch.device) -> torch.Tensor:
        actor = self._actor
        actor.check_open()
        hit = actor.fresh_value(source, target)
        if hit is not None:
            return hit
        self._warn_inline("resolve")
        binding = source._binding
        value = source._reload_unmanaged(target)
        adopted = actor.adopt(source, target, value, binding)
        actor.enforce()
        if adopted is None or adopted.value is None:
            return value
        return adopted.value

    async def aresolve(
        self, source: OffloadedTensor, device: TDevice | None = None
    ) -> torch.Tensor:
        """Async twin of :meth:`resolve`: await the value without blocking the loop.

        Args:
            source: the offloaded tensor.
        device: where the value is wanted (default: ``source``'s target device).

        Raises:
            T2NErrorMisuse: as :meth:`resolve`, or the pool runs on no event loop (use
                ``async with pool`` in this loop, or ``with pool`` before awaiting from another).
            T2NErrorStorage: the payload could not be loaded.
        """
        target = self._target(source, device)
        if not self._host.on_loop_thread():
            value: torch.Tensor = await self._foreign_async(lambda: self.aresolve(source, target))
            return value
        result = self._actor.resolve_step(source, target)
        if isinstance(result, _IO):
            await result.wait()
            return result.result()
        return result

    async def _foreign_async(self, coroutine: Callable[[], Any]) -> Any:
        if not self._host.running:
            raise T2NErrorMisuse(
                "the TensorResidencyPool is not running: use `async with pool:` in this loop, "
                "or `with pool:` before awaiting it from another loop"
            )
        return await self._run_on_loop(coroutine)

    # ------------------------------------------------------------------------------------------
    # acquire
    # ------------------------------------------------------------------------------------------
    def acquire(
        self, source: OffloadedTensor, device: TDevice | None = None, mode: LeaseMode = "read"
    ) -> TensorResidencyLease:
        """Return a lease on ``source``: ``with pool.acquire(t) as v`` or ``async with``.

        The value stays resident while the lease is held. ``mode="read_write"`` marks it dirty
        when the lease ends: the pool writes it back before eviction, on flush and on close.

        Args:
            source: the offloaded tensor.
        device: where the value is wanted (default: ``source``'s target device).
            mode: ``"read"``, or ``"read_write"`` to have changes made to the value written back.

        Raises:
            T2NErrorMisuse: ``mode`` is not ``"read"``/``"read_write"``, or ``source`` is not
                an OffloadedTensor.
        """
        if mode not in ("read", "read_write"):
            raise T2NErrorMisuse(f"mode must be 'read' or 'read_write', got {mode!r}")
        return TensorResidencyLease(self, source, self._target(source, device), mode)

    def _acquire_sync(self, ticket: _Ticket) -> tuple[torch.Tensor, _Entry]:
        self._ensure_running()
        actor = self._actor
        if self._host.on_loop_thread():
            entry = actor.entries.get(id(ticket.source))
            if entry is None or entry.value is None or actor._stale(entry):
                self._warn_inline("acquire")
                binding = ticket.source._binding
                value = ticket.source._reload_unmanaged(ticket.device)
                actor.adopt(ticket.source, ticket.device, value, binding)
                ticket.first_try = False
            result = actor.acquire_step(ticket)
            if isinstance(result, _IO):  # a read_write lease waiting for a write-back
                actor.abandon(ticket)
                raise T2NErrorMisuse(
                    "a read_write lease must wait for a write-back, which would block the "
                    "pool's event loop: use `async with pool.acquire(...)`"
                )
            assert ticket.entry is not None
            return result, ticket.entry

        return self._acquire_wait(ticket, self._acquire_begin(ticket))

    def _acquire_begin(self, ticket: _Ticket) -> concurrent.futures.Future[Any]:
        """Send an acquire from a foreign thread; its reply completes once the lease is granted."""
        actor = self._actor

        def run(reply: concurrent.futures.Future[Any]) -> Any:
            _ForeignAcquire(actor, ticket, reply).attempt()
            return _PENDING

        return self._send(run)

    def _acquire_wait(
        self, ticket: _Ticket, reply: concurrent.futures.Future[Any]
    ) -> tuple[torch.Tensor, _Entry]:
        try:
            return reply.result()  # type: ignore[no-any-return]
        except BaseException:
            if not reply.done():  # interrupted while waiting: drop the reservation or lease
                self._post(lambda: self._actor.abandon(ticket))
            raise

    def _acquire_cancel(self, ticket: _Ticket) -> None:
        """Drop an acquire that was begun and will never be entered (any thread)."""
        if self._host.running:
            self._simple(lambda: self._actor.abandon(ticket))

    async def _acquire_async(self, ticket: _Ticket) -> tuple[torch.Tensor, _Entry]:
        actor = self._actor
        if not self._host.on_loop_thread():
            try:
                return await self._foreign_async(lambda: self._acquire_async(ticket))  # type: ignore[no-any-return]
            except BaseException:
                self._post(lambda: actor.abandon(ticket))
                raise
        try:
            while True:
                if ticket.abandoned:
                    raise T2NErrorMisuse("this acquire was abandoned by its caller")
                result = actor.acquire_step(ticket)
                if not isinstance(result, _IO):
                    assert ticket.entry is not None
                    return result, ticket.entry
                await result.wait()
                if result.kind == "load" and result.error is not None:
                    result.result()
        except BaseException:
            actor.abandon(ticket)
            raise

    def _release(self, entry: _Entry, dirty: bool) -> None:
        # From another thread the release is sent without waiting (a streamed forward ends a
        # lease per layer); the thread's later requests queue behind it, and its reads of the
        # pool's state wait for it (see _catch_up).
        if self._host.on_loop_thread() or not self._host.running:
            self._actor.release_lease(entry, dirty)
        else:
            self._post_unwaited(lambda: self._actor.release_lease(entry, dirty))

    # ------------------------------------------------------------------------------------------
    # prefetch / pin / unpin
    # ------------------------------------------------------------------------------------------
    def prefetch(self, source: OffloadedTensor, device: TDevice | None = None) -> TensorPrefetch:
        """Start loading ``source`` without waiting; return a :class:`TensorPrefetch` handle.

        The value is retained under the strategy's rules; a value larger than the budget goes
        to the handle's waiter without retention. A failed load is reported by the handle.

        Args:
            source: the offloaded tensor.
        device: where the value is wanted (default: ``source``'s target device).

        Raises:
            T2NErrorMisuse: ``source`` is not an OffloadedTensor, the pool is closed, or the
                value is resident on another device.
        """
        return self._prefetch(source, device, pin=False)

    def pin(self, source: OffloadedTensor, device: TDevice | None = None) -> TensorPrefetch:
        """Load ``source`` (or reuse its load) and keep it resident until :meth:`unpin` or close.

        Idempotent. Pinned values count toward the budget and may exceed it (``LRU`` and
        ``SCHEDULED`` only). A failed load is reported by the handle.

        Args:
            source: the offloaded tensor.
        device: where the value is wanted (default: ``source``'s target device).

        Raises:
            T2NErrorMisuse: the strategy is FIXED, or as :meth:`prefetch`.
        """
        self._check_pins("pin")
        return self._prefetch(source, device, pin=True)

    def _prefetch(
        self, source: OffloadedTensor, device: TDevice | None, pin: bool
    ) -> TensorPrefetch:
        target = self._target(source, device)
        self._ensure_running()
        actor = self._actor
        if self._host.on_loop_thread():
            result = actor.prefetch_step(source, target, pin)
            if isinstance(result, _IO):
                return TensorPrefetch(self, io=result)
            return TensorPrefetch(self, value=result)

        def run(reply: concurrent.futures.Future[Any]) -> Any:
            result = actor.prefetch_step(source, target, pin)
            if isinstance(result, _IO):
                result.add_callback(lambda: _settle(reply, result))
                return _PENDING
            return result

        return TensorPrefetch(self, future=self._send(run))

    def unpin(self, source: OffloadedTensor) -> None:
        """Stop pinning ``source``; it becomes evictable. Unpinning a value not pinned does nothing.

        Args:
            source: the offloaded tensor.

        Raises:
            T2NErrorMisuse: the strategy is FIXED, the pool is closed, or ``source`` is not an
                OffloadedTensor.
        """
        self._check_pins("unpin")
        self._check_source(source)
        self._simple(lambda: self._actor.unpin_step(source))

    async def aunpin(self, source: OffloadedTensor) -> None:
        """Async twin of :meth:`unpin`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor.
        """
        self._check_pins("unpin")
        self._check_source(source)
        if self._host.on_loop_thread():
            self._actor.unpin_step(source)
        else:
            await self._foreign_async(self._async_of(lambda: self._actor.unpin_step(source)))

    @staticmethod
    def _async_of(step: Callable[[], Any]) -> Callable[[], Any]:
        async def run() -> Any:
            return step()

        return run

    def _simple(self, step: Callable[[], Any]) -> Any:
        """Run a transition that never waits, from any thread."""
        if self._host.on_loop_thread():
            return step()
        if not self._host.running:
            self._actor.check_open()
            return step()  # nothing is loaded yet: no loop, no contention
        return self._send(lambda reply: step()).result()

    def declare_schedule(self, sources: Iterable[OffloadedTensor]) -> None:
        """Declare the cyclic order in which ``sources`` are used (one pass).

        ``ResidencyStrategy.SCHEDULED`` then evicts the value whose next use is farthest away;
        without a declaration it learns the order from the first pass. Other strategies
        ignore the schedule. :func:`stream_modules` declares it for you.

        Args:
            sources: the offloaded tensors, in the order one pass uses them (repeats ignored).

        Raises:
            T2NErrorMisuse: an element is not an OffloadedTensor, or the pool is closed.
        """
        keys = []
        for source in sources:
            self._check_source(source)
            keys.append(id(source))
        self._simple(lambda: self._actor.declare_schedule(keys))

    # ------------------------------------------------------------------------------------------
    # evict / flush / close
    # ------------------------------------------------------------------------------------------
    def _blocking(self, operation: str, twin: str, coroutine: Callable[[], Any]) -> Any:
        if self._host.on_loop_thread():
            raise T2NErrorMisuse(
                f"pool.{operation}() would block the pool's event loop: use `await pool.{twin}()`"
            )
        if not self._host.running:
            self._actor.check_open()
            if not self._actor.dirty_entries():
                return None  # nothing loaded, nothing to write
            self._ensure_running()  # dirty values left by a failed close: serve them again
        return self._start_on_loop(coroutine).result()

    def evict(self, source: OffloadedTensor) -> None:
        """Remove ``source``'s value from the pool, writing it back first when dirty.

        Waits for a load or write-back in flight first. A value that is not resident is left
        alone.

        Args:
            source: the offloaded tensor.

        Raises:
            T2NErrorMisuse: the value is leased or pinned.
            T2NErrorStorage: the write-back failed (the value stays resident and dirty).
        """
        self._check_source(source)
        self._blocking("evict", "aevict", lambda: self._aevict(source))

    async def aevict(self, source: OffloadedTensor) -> None:
        """Async twin of :meth:`evict`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor.
        """
        self._check_source(source)
        if not self._host.on_loop_thread():
            await self._foreign_async(lambda: self._aevict(source))
            return
        await self._aevict(source)

    async def _aevict(self, source: OffloadedTensor) -> None:
        while True:
            job = self._actor.evict_step(source)
            if job is None:
                return
            await job.wait()
            if job.kind == "write" and job.error is not None:
                raise _write_error(source, job.error)

    def flush(self, source: OffloadedTensor | None = None) -> None:
        """Write dirty values back (all, or ``source``'s) and wait for in-flight loads.

        Args:
            source: the offloaded tensor to flush; ``None`` for every value of the pool.

        Raises:
            T2NErrorStorage: a write-back failed; the value stays resident and dirty, so a
                later flush can retry.
        """
        if source is not None:
            self._check_source(source)
        self._blocking("flush", "aflush", lambda: self._aflush(source))

    async def aflush(self, source: OffloadedTensor | None = None) -> None:
        """Async twin of :meth:`flush`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor to flush; ``None`` for every value of the pool.
        """
        if source is not None:
            self._check_source(source)
        if not self._host.on_loop_thread():
            if self._host.running:
                await self._foreign_async(lambda: self._aflush(source))
            return
        await self._aflush(source)

    async def _aflush(self, source: OffloadedTensor | None) -> None:
        self._actor.check_open()
        jobs = self._actor.flush_step(source)
        for job in jobs:
            await job.wait()
        failed = [job for job in jobs if job.kind == "write" and job.error is not None]
        if failed:
            raise T2NErrorStorage(
                f"{len(failed)} write-back(s) failed; the dirty values stay resident, "
                "free space or fix the offload directory and flush again"
            ) from failed[0].error

    def close(self) -> None:
        """Write dirty values back, release every value and stop the pool.

        Raises:
            T2NErrorMisuse: values are still leased (the pool stays usable), or called on the
                pool's own loop thread (use ``await pool.aclose()``).
            T2NErrorStorage: a write-back failed (the pool stays open; retry after fixing).
        """
        if self._actor.closed:
            return
        if not self._host.running and not self._actor.dirty_entries():
            self._actor.begin_close()
            self._actor.finish_close()
            return
        private = self._host.private or not self._host.running
        self._blocking("close", "aclose", self._aclose)
        if private:
            self._host.join()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`."""
        if self._actor.closed:
            return
        if not self._host.on_loop_thread():
            if self._host.running:
                await self._foreign_async(self._aclose)
                self._host.join()
            else:
                self.close()
            return
        await self._aclose()

    async def _aclose(self) -> None:
        actor = self._actor
        if actor.closed:
            return
        for stream in list(self._streams):
            stream._release_next_forward()
        actor.begin_close()
        try:
            while True:
                jobs = actor.pending_jobs()
                if not jobs:
                    jobs = actor.flush_step(None)
                    if not jobs:
                        break
                for job in jobs:
                    await job.wait()
                failed = [job for job in jobs if job.kind == "write" and job.error is not None]
                if failed:
                    raise T2NErrorStorage(
                        f"closing the pool: {len(failed)} write-back(s) failed; the dirty values "
                        "stay resident and the pool stays open: fix the cause and close again"
                    ) from failed[0].error
        except BaseException:
            actor.abort_close()
            raise
        actor.finish_close()
        if self._host.private:
            actor.stop()

    # ------------------------------------------------------------------------------------------
    # scope
    # ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, device: TDevice | None = None) -> Generator[TensorResidencyPool, None, None]:
        """Route every ``OffloadedTensor`` reload in this context through the pool.

        Inside the block, ``reload()`` and every torch op on an OffloadedTensor resolve through
        this pool (on ``device`` when given). The scope is a contextvar: it follows
        ``anyio.to_thread.run_sync`` workers and stays private to each asyncio task.

        Args:
            device: where values are delivered inside the scope (default: each tensor's
                target device).

        Raises:
            T2NErrorMisuse: the pool is closed.
        """
        self._actor.check_open()
        token = _ACTIVE_RESIDENCY.set((self, None if device is None else _normalize_device(device)))
        try:
            yield self
        finally:
            _ACTIVE_RESIDENCY.reset(token)


def _write_error(source: OffloadedTensor, error: BaseException) -> T2NErrorStorage:
    wrapped = T2NErrorStorage(
        f"writing {source.name!r} back failed; the value stays resident and dirty: {error}"
    )
    wrapped.__cause__ = error
    return wrapped


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
