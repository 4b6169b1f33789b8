"""The public face of the residency pool: validation, then one call to the runtime.

Each public method checks its arguments and either serves a hit from the values the actor
publishes (``resolve``, ``acquire``, ``prefetch`` of a resident value: no round trip to the
loop thread) or hands one operation of :mod:`._requests` to the runtime's driver, through
the face the caller needs (sync, async, or started without waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import anyio
import torch

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NError, T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import (
    ACTIVE_RESIDENCY,
    PoolSource,
    loads_outside_scopes,
)
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._handles import (
    TensorPrefetch,
    TensorResidencyLease,
    Uncopyable,
    hand_over,
)
from torch_to_nnef.tensor.residency._policy import ResidencyStrategy, make_policy
from torch_to_nnef.tensor.residency._requests import (
    Close,
    Evict,
    Flush,
    Prefetch,
    Resolve,
    Transition,
)
from torch_to_nnef.tensor.residency._runtime import (
    Operation,
    Reply,
    Runtime,
    reap_later,
    reap_pending,
)
from torch_to_nnef.tensor.residency._scope import PENDING, leave_left_over, leave_pending
from torch_to_nnef.tensor.residency._state import PoolStats
from torch_to_nnef.tensor.residency._trace import ReadAhead
from torch_to_nnef.tensor.sizing import parse_bytes

if TYPE_CHECKING:
    from torch_to_nnef.tensor.offload import OffloadedTensor
    from torch_to_nnef.tensor.residency._stream import ModuleStream

__all__ = ["TensorPrefetch", "TensorResidencyLease", "TensorResidencyPool"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")

TDevice = torch.device | str | int
LeaseMode = Literal["read", "read_write"]


def _normalize_device(device: TDevice) -> torch.device:
    return storage.resolve_device(device)


class TensorResidencyPool(Uncopyable):
    """Keep a bounded set of :class:`OffloadedTensor` values resident while a model runs.

    One actor owns the pool's state on an event loop: the caller's (``async with pool``) or a
    private daemon thread started by ``with pool`` or the first synchronous call. Every
    operation has a synchronous face, usable from any thread, and an async twin. A pool is
    shared, never copied nor pickled (:class:`T2NErrorMisuse` says so).

    Args:
        max_cached_bytes: soft limit on the bytes of the values kept for reuse, as an int
            or a size such as ``"1.5GB"`` or ``"512MiB"`` (see
            :func:`~torch_to_nnef.tensor.sizing.parse_bytes`). Values in use (leased, or
            awaited by a request) come on top of it; pinned values count toward it and may
            exceed it. ``None``: no limit. Copies to a CUDA device are staged through pinned
            host memory outside this limit: a ring of at most
            ``storage.PINNED_CHUNKS_PER_DEVICE`` chunks of ``storage.PINNED_CHUNK_BYTES``
            (8 chunks of 8 MiB: 64 MiB) per device, shared by the process, reported by
            ``stats().pinned_bytes``.
        max_workers: at most this many disk jobs (loads, write-backs) run at once. A sync
            ``resolve`` or ``acquire`` that misses on a small payload for the CPU (up to
            1 MiB, mapped reads on) reads it on its own thread, beside them
            (``stats().caller_reads``).
        strategy: a :class:`ResidencyStrategy` (``LRU``, ``FIXED`` or ``SCHEDULED``).
        use_uvloop: run the private loop thread on uvloop (default: when importable, unless
            ``T2N_RESIDENCY_UVLOOP=0``).
        read_ahead: inside :meth:`scope`, learn the order in which forwards touch offloaded
            tensors and read ahead along it (see ``residency/_trace.py``): the window, a
            size as ``max_cached_bytes`` is (``"64MiB"``), ``"auto"`` (half the budget; 256
            MiB without one), or ``None`` (off).

    Raises:
        T2NErrorMisuse: a negative or unreadable budget, ``max_workers < 1``, a strategy
            that is not a :class:`ResidencyStrategy`, or a ``use_uvloop`` that is not a
            bool or ``None``.

    Attributes:
        max_cached_bytes: the soft budget given at creation, in bytes.
        max_workers: the bound on concurrent disk jobs given at creation.
        strategy: the retention strategy given at creation.
            These three are fixed for the pool's life: setting one raises
            :class:`T2NErrorMisuse`.
        read_ahead: the trace-driven read-ahead (its ``stats()`` count the accesses read
            ahead and those loaded on demand, and the tensors its learned order holds), or
            ``None``.
    """

    _why_not_copied = (
        "it owns a loop thread, I/O workers and the values it holds: share the pool object "
        "itself, or create another pool"
    )

    def __init__(
        self,
        max_cached_bytes: int | str | None = None,
        max_workers: int = 1,
        strategy: ResidencyStrategy = ResidencyStrategy.LRU,
        *,
        use_uvloop: bool | None = None,
        read_ahead: int | str | None = None,
    ) -> None:
        if max_cached_bytes is not None:
            max_cached_bytes = parse_bytes(max_cached_bytes)
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise T2NErrorMisuse(f"max_workers must be an int >= 1, got {max_workers!r}")
        if not isinstance(strategy, ResidencyStrategy):
            raise T2NErrorMisuse(
                "strategy must be a ResidencyStrategy (e.g. ResidencyStrategy.LRU), "
                f"got {strategy!r}"
            )
        if use_uvloop is not None and not isinstance(use_uvloop, bool):
            raise T2NErrorMisuse(
                f"use_uvloop must be True, False or None (as the environment says), got "
                f"{use_uvloop!r}"
            )
        self.max_cached_bytes = max_cached_bytes
        self.max_workers = max_workers
        self._loads_outside_at_start = loads_outside_scopes()
        self.strategy = strategy
        self._actor = Actor(make_policy(strategy, max_cached_bytes))
        self._runtime = Runtime(self._actor, max_workers, use_uvloop)
        # A pool never closed writes its changes back when collected, or at interpreter exit.
        unclosed = _Unclosed(self, self._runtime)
        weakref.finalize(self, unclosed.collected)
        self._runtime.at_exit = unclosed.at_exit
        # Module streams over this pool: they hold the next forward's first modules, which
        # closing releases first.
        self._streams: weakref.WeakSet[ModuleStream] = weakref.WeakSet()
        self.read_ahead = _read_ahead(self, read_ahead)
        reap_pending()  # pools collected since, which only a thread of their own can close

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED_AT_CREATION and name in self.__dict__:
            raise T2NErrorMisuse(
                f"a TensorResidencyPool's {name} is fixed when it is created: create a new "
                f"pool with the {name} wanted (and close this one)"
            )
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------------
    # Introspection (non-blocking, any thread)
    # ------------------------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Bytes of the values resident in the pool (a maintained counter)."""
        self._runtime.catch_up()
        return self._actor.resident_bytes

    def is_resident(self, source: OffloadedTensor) -> bool:
        """Whether ``source``'s value is loaded and held by the pool.

        A dirty value chosen for eviction is not resident any more, although its write-back
        may still run: reads of the tensor wait for that write.
        """
        self._check_source(source)
        self._runtime.catch_up()
        return self._actor.is_resident(source)

    def is_pinned(self, source: OffloadedTensor) -> bool:
        """Whether ``source`` is pinned (``LRU`` and ``SCHEDULED``; ``FIXED`` raises
        :class:`T2NErrorMisuse`)."""
        self._check_pins("is_pinned")
        self._check_source(source)
        self._runtime.catch_up()
        return self._actor.is_pinned(source)

    def stats(self) -> PoolStats:
        """Counters since the pool was created (see :class:`PoolStats`)."""
        self._runtime.catch_up()
        return self._actor.stats()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` completed."""
        return self._actor.closed

    def __repr__(self) -> str:
        self._runtime.catch_up()
        actor = self._actor
        budget = "unbounded" if self.max_cached_bytes is None else _mib(self.max_cached_bytes)
        resident = sum(1 for e in list(actor.entries.values()) if e.resident)
        state = "closed" if actor.closed else f"resident: {resident}"
        return (
            f"<TensorResidencyPool {self.strategy.name} [{state}, leased: {actor.leased_count()}, "
            f"bytes: {_mib(actor.resident_bytes)} / {budget}]>"
        )

    # ------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_source(source: Any) -> None:
        if not isinstance(source, PoolSource):
            _reject_source(source)

    def _target(self, source: Any, device: TDevice | None) -> torch.device:
        if not isinstance(source, PoolSource):  # _check_source, inlined on the hit path
            _reject_source(source)
        if device is None:
            target: torch.device = source.target_device
            return target
        return _normalize_device(device)

    def _check_pins(self, operation: str) -> None:
        if not self._actor.policy.allows_pins:
            raise T2NErrorMisuse(
                f"{operation} is not supported by ResidencyStrategy.{self.strategy.name}, which "
                "controls admission itself; use ResidencyStrategy.LRU or SCHEDULED for manual pins"
            )

    # ------------------------------------------------------------------------------------------
    # Running
    # ------------------------------------------------------------------------------------------
    def __enter__(self) -> TensorResidencyPool:
        reap_pending()
        self._actor.check_open()
        self._runtime.ensure_running()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is GeneratorExit and self._runtime.may_wait_for_itself():
            # A generator closed inside the block by a garbage collection, amid any code (on
            # a worker whose write a close would wait for, perhaps): the pool stays open,
            # and close() from any thread, or interpreter exit, closes it.
            return
        try:
            self.close()
        except Exception:
            if exc is None:
                raise
            LOGGER.exception("closing the TensorResidencyPool failed")

    async def __aenter__(self) -> TensorResidencyPool:
        reap_pending()
        self._actor.check_open()
        self._runtime.attach_current()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is GeneratorExit and not self._runtime.in_serving_loop():
            # The coroutine is closed without running: a garbage collection of a task its
            # loop left pending, on whatever thread it happens (one of the pool's workers,
            # perhaps, whose write the pool's close waits for). Nothing may wait here: the
            # pool stays open, and close() from any thread, or interpreter exit, closes it.
            return
        runtime = self._runtime
        # In a forked child, the loop serving the pool and the block are the parent's: its
        # exit is refused as the pool's requests are there, and leaves the pool as the fork
        # left it, so that they go on saying so (stopped serving, it would start a loop of
        # the child's for the parent's pool).
        forked = runtime.forked()
        try:
            if forked:
                runtime.check_process()
            if not self._actor.closed:
                # Shielded: an anyio cancel scope cancels every await inside it, and the end
                # of a cancelled block would leave the pool open with its changes unwritten.
                # A cancellation of asyncio's own is raised once the close ended.
                with anyio.CancelScope(shield=True):
                    await _to_its_end(self.aclose())
        except Exception:
            # The pool stays open with its values (dirty ones included): a later `close()`
            # or `flush()` serves it again from a private loop thread.
            if exc is None:
                raise
            LOGGER.exception("closing the TensorResidencyPool failed; it stays open")
        finally:
            if not forked:
                runtime.detach_current()

    def _call_blocking(self, operation: Operation) -> None:
        """The sync face of a write-back operation: nothing to do when nothing was loaded."""
        runtime = self._runtime
        if not runtime.running:
            self._actor.check_open()
            if not self._actor.dirty_entries():
                return
        runtime.call(operation)

    async def _acall_blocking(self, operation: Operation) -> None:
        """The async face of a write-back operation; a pool that no loop serves any more
        (its ``async with`` exit could not close it) is served from a private thread."""
        runtime = self._runtime
        if not runtime.running:
            self._actor.check_open()
            if not self._actor.dirty_entries():
                return
            runtime.ensure_running()
        await runtime.acall(operation)

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
        if not isinstance(source, PoolSource):  # _check_source, inlined on the hit path
            _reject_source(source)
        wanted = None if device is None else _normalize_device(device)  # (None: the target)
        slot = self._actor.fresh_slot(source, wanted)
        if slot is not None and slot.open:
            self._actor.count_hit(slot)
            return slot.value if slot.as_is else hand_over(slot.value, slot.device)
        target = source.target_device if wanted is None else wanted
        return hand_over(self._runtime.call(Resolve(self._actor, source, target)))

    def _scope_resolve(self, source: PoolSource, device: torch.device | None) -> torch.Tensor:
        """The value of ``source`` for a read inside :meth:`scope` (what tensors call)."""
        read_ahead = self.read_ahead
        if read_ahead is None:
            return self.resolve(source, device)  # type: ignore[arg-type]
        held = read_ahead.touched(source, device)
        try:
            return self.resolve(source, device)  # type: ignore[arg-type]
        finally:
            if held is not None:
                read_ahead.let_go(held)

    def _scope_held(self, source: PoolSource, device: torch.device) -> torch.Tensor | None:
        """The value of ``source`` on ``device`` for a read of a few of its rows, when the pool
        holds it or is loading it (a hit, or a wait); ``None`` otherwise, and nothing is
        loaded (what tensors call)."""
        slot = self._actor.fresh_slot(source, device)
        if slot is None or not slot.open:
            entry = self._actor.seen_entry(source)  # (a hint, read without the actor)
            if entry is None or entry.load is None:
                return None
        return self._scope_resolve(source, device)

    def _scope_aliased(
        self, sources: Sequence[PoolSource], results: tuple[torch.Tensor, ...]
    ) -> None:
        """An op of the scope given ``sources`` returned ``results`` (what tensors call)."""
        self._actor.note_alias(sources, results)

    def _scope_left_over(self, scope: tuple[Any, torch.device | None]) -> bool:
        """Whether ``scope``, the innermost in this context, is a stream's of this pool that
        is left over (what tensors call before they use a scope that is not a user's): it is
        left then (see ``_scope.leave_left_over``)."""
        return leave_left_over(scope, self._actor.closed)

    def _scope_lease(self, source: PoolSource, device: torch.device | None) -> TensorResidencyLease:
        """A ``read_write`` lease for an in-place op inside :meth:`scope` (what tensors call)."""
        return self.acquire(source, device, mode="read_write")  # type: ignore[arg-type]

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
        value = await self._runtime.acall(Resolve(self._actor, source, target))
        return hand_over(value)

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
        if mode != "read" and mode != "read_write":
            raise T2NErrorMisuse(f"mode must be 'read' or 'read_write', got {mode!r}")
        if device is None and isinstance(source, PoolSource):  # _target, inlined: a hit's path
            return TensorResidencyLease(self, source, None, mode)  # (None: the target device)
        return TensorResidencyLease(self, source, self._target(source, device), mode)

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
        target = self._target(source, device)
        version = source._hit_state.last_write()  # first: a write after it is one wait() serves
        slot = self._actor.fresh_slot(source, target)
        if slot is not None and slot.open:
            self._actor.touch(slot.entry.key)
            return TensorPrefetch._ready(self, source, target, slot.value, version)
        return self._start_prefetch(source, target, False, version)

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
        target = self._target(source, device)
        return self._start_prefetch(source, target, True, source._hit_state.last_write())

    def _start_prefetch(
        self, source: OffloadedTensor, target: torch.device, pin: bool, version: object
    ) -> TensorPrefetch:
        self._actor.check_open()
        self._runtime.ensure_running()
        prefetch = Prefetch(self._actor, source, target, pin)
        return TensorPrefetch(self, source, target, self._runtime.start(prefetch), version)

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
        self._transition(Transition(lambda: self._actor.unpin_step(source)))

    async def aunpin(self, source: OffloadedTensor) -> None:
        """Async twin of :meth:`unpin`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor.
        """
        self._check_pins("unpin")
        self._check_source(source)
        await self._runtime.acall(Transition(lambda: self._actor.unpin_step(source)))

    def _transition(self, operation: Transition) -> None:
        """A request that never waits: before the pool runs, run it here (no loop starts
        meanwhile), else on the loop."""
        if not self._runtime.run_unstarted(partial(self._step_here, operation)):
            self._runtime.call(operation)

    def _step_here(self, operation: Transition) -> None:
        self._actor.check_open()
        with InterruptHold() as hold:  # (a Ctrl-C is raised once the step ended)
            hold.start()
            operation.step()

    def declare_schedule(self, sources: Iterable[OffloadedTensor]) -> None:
        """Declare the cyclic order in which ``sources`` are used (one pass).

        ``ResidencyStrategy.SCHEDULED`` then evicts the value whose next use is farthest away;
        without a declaration it learns the order from the first pass. Other strategies
        ignore the schedule. :func:`stream_modules` declares it for you.

        Args:
            sources: the offloaded tensors, in the order one pass uses them (repeats ignored).

        Raises:
            T2NErrorMisuse: ``sources`` is no iterable, an element is not an OffloadedTensor,
                or the pool is closed.
        """
        if not isinstance(sources, Iterable) or isinstance(sources, torch.Tensor):
            raise T2NErrorMisuse(
                "declare_schedule takes the offloaded tensors in the order one pass uses them "
                f"(a list, say); got {type(sources).__name__}"
            )
        order = []
        for source in sources:
            self._check_source(source)
            order.append(source)
        self._transition(Transition(lambda: self._actor.declare_schedule(order)))

    # ------------------------------------------------------------------------------------------
    # evict / flush / close
    # ------------------------------------------------------------------------------------------
    def evict(self, source: OffloadedTensor) -> None:
        """Remove ``source``'s value from the pool, writing it back first when dirty.

        Waits for a load or write-back in flight first. A value that is not resident is left
        alone. A value that the trace-driven read-ahead holds for the next forward
        (``read_ahead``) is let go first: no lease of the caller's holds it.

        Args:
            source: the offloaded tensor.

        Raises:
            T2NErrorMisuse: the value is leased or pinned.
            T2NErrorStorage: the write-back failed (the value stays resident and dirty).
        """
        self._check_source(source)
        if self.read_ahead is not None:
            self.read_ahead.drop(source)
        self._call_blocking(Evict(self._actor, source))

    async def aevict(self, source: OffloadedTensor) -> None:
        """Async twin of :meth:`evict`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor.
        """
        self._check_source(source)
        if self.read_ahead is not None:
            self.read_ahead.drop(source)
        await self._acall_blocking(Evict(self._actor, source))

    def flush(self, source: OffloadedTensor | None = None) -> None:
        """Write dirty values back (all, or ``source``'s) and wait for in-flight loads.

        A value under a ``read_write`` lease is written once the lease ends (its change is not
        whole before); the change of the leases that ended before it is written now.

        Args:
            source: the offloaded tensor to flush; ``None`` for every value of the pool.

        Raises:
            T2NErrorStorage: a write-back failed; the value stays resident and dirty, so a
                later flush can retry.
        """
        if source is not None:
            self._check_source(source)
        self._call_blocking(Flush(self._actor, source))

    async def aflush(self, source: OffloadedTensor | None = None) -> None:
        """Async twin of :meth:`flush`, for the pool's loop: same argument, same errors.

        Args:
            source: the offloaded tensor to flush; ``None`` for every value of the pool.
        """
        if source is not None:
            self._check_source(source)
        await self._acall_blocking(Flush(self._actor, source))

    def close(self) -> None:
        """Write dirty values back, release every value and stop the pool.

        A forward through :func:`stream_modules` that Ctrl-C interrupted in the calling thread
        gives back what it held first, as closing its stream would. The leases streams began
        ahead (the next forward's first modules) are given back too, unless a forward is
        inside a streamed module: the close is then refused, and leaves them to the forwards
        they were begun for (a forward finding a lease it began dropped by a close that was
        refused takes it again). A stream through the pool that its caller did not keep then
        goes, with its hooks.

        Raises:
            T2NErrorMisuse: values are still leased (the pool stays usable), or called on the
                pool's own loop thread (use ``await pool.aclose()``).
            T2NErrorStorage: a write-back failed (the pool stays open; retry after fixing).
        """
        if self._actor.closed:
            self._let_go()  # a close that an interrupt cut short stopped nothing
            return
        self._end_interrupted_forwards()
        request = self._close_request()
        if self._runtime.stranded_here():  # its loop of the caller's is gone: close it here
            self._runtime.close_stranded(request)
        else:
            try:
                self._call_blocking(request)
            except T2NErrorMisuse:
                # The loop stopped while this close waited for it; its own thread may have
                # closed the pool meanwhile (a stranded pool's close): then nothing is left.
                if not self._actor.closed:
                    raise
        if not self._actor.closed:  # no loop serves it, nothing to write: its steps run here
            self._runtime.call_stranded(request)
        try:
            self._warn_if_left_out()
        finally:
            self._let_go()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`."""
        if self._actor.closed:
            self._let_go()
            return
        runtime = self._runtime
        if not runtime.running or runtime.stranded_here():
            self.close()
            return
        self._end_interrupted_forwards()
        await runtime.acall(self._close_request())
        try:
            self._warn_if_left_out()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Let go of what a closed pool still holds: the streams through it (one its caller
        did not keep then goes, with its hooks), its private loop thread, if it still runs
        (not from it: a close on the loop thread leaves the loop to stop when the thread's
        callback ends), and the I/O workers of a loop of the caller's that a Ctrl-C stopped
        before the end of ``async with pool`` stopped serving the pool."""
        for stream in list(self._streams):
            stream._let_go()
        runtime = self._runtime
        if runtime.private and not runtime.on_loop_thread():
            runtime.stop_private()
        elif runtime.stranded_here():
            runtime.detach_current()

    def _end_interrupted_forwards(self) -> None:
        """Streamed forwards of the calling thread that Ctrl-C interrupted give back their
        leases (they cannot be running: their thread is closing the pool), and the scopes
        of such forwards that waited to be left are, where they can be now."""
        for stream in list(self._streams):
            stream._end_interrupted_forward()
        if PENDING.scopes:
            leave_pending()

    def _warn_if_left_out(self) -> None:
        """Warn, once closed, when the pool served nothing while offloaded tensors were loaded
        outside any pool: the model ran outside ``pool.scope()``."""
        stats = self._actor.stats()
        unserved = loads_outside_scopes() - self._loads_outside_at_start
        if stats.hits + stats.misses == 0 and unserved:
            LOGGER.warning(
                "TensorResidencyPool closed without serving any value, while %d offloaded "
                "tensor load(s) ran outside any pool: run the model inside `with pool.scope():` "
                "(or `stream_modules(pool, layers)`) so that the pool serves its weights",
                unserved,
            )

    def _close_request(self) -> Close:
        def release_streams() -> None:
            streams = list(self._streams)
            if any(stream._forward_inside() for stream in streams):
                # The close is refused (that forward's leases count): what the streams
                # began ahead stays with the forwards it was begun for.
                return
            for stream in streams:
                stream._release_next_forward()
            if self.read_ahead is not None:
                self.read_ahead.release()

        return Close(self._actor, release_streams)

    # ------------------------------------------------------------------------------------------
    # scope
    # ------------------------------------------------------------------------------------------
    def scope(
        self, device: TDevice | None = None
    ) -> contextlib.AbstractContextManager[TensorResidencyPool]:
        """Route every ``OffloadedTensor`` reload in this context through the pool.

        Inside the block, ``reload()`` and every torch op on an OffloadedTensor resolve through
        this pool (on ``device`` when given). The scope is a contextvar: it follows
        ``anyio.to_thread.run_sync`` workers and stays private to each asyncio task.

        Args:
            device: where values are delivered inside the scope (default: each tensor's
                target device).

        Raises:
            T2NErrorMisuse: the pool is closed (raised on entering the block).
        """
        return _Scope(self, None if device is None else _normalize_device(device))


class _Scope:
    """The ``with`` block of :meth:`TensorResidencyPool.scope`; entered once.

    Written as a class, not a generator: a Ctrl-C landing in a generator context manager's
    ``__enter__`` after its generator set the scope would leave the scope set in the
    caller's context, its ``__exit__`` never run. ``__enter__`` undoes a set that an
    interrupt cut short.
    """

    __slots__ = ("_device", "_entered", "_pool", "_token")

    def __init__(self, pool: TensorResidencyPool, device: torch.device | None) -> None:
        self._pool, self._device = pool, device
        self._entered = False
        self._token: contextvars.Token[Any] | None = None

    def __enter__(self) -> TensorResidencyPool:
        if self._entered:
            raise T2NErrorMisuse(
                "a pool.scope() block is entered once: call pool.scope() again for another"
            )
        self._entered = True
        self._pool._actor.check_open()
        previous = ACTIVE_RESIDENCY.get()
        try:
            self._token = ACTIVE_RESIDENCY.set((self._pool, self._device))
        except BaseException:  # Ctrl-C right after the set: its token is lost, not its value
            ACTIVE_RESIDENCY.set(previous)
            raise
        return self._pool

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        if token is None:
            return
        try:
            ACTIVE_RESIDENCY.reset(token)
        except ValueError:  # left in another context than the one that entered it
            raise T2NErrorMisuse(
                "pool.scope() was left in another asyncio task (or contextvars context) "
                "than the one that entered it: enter and leave it in the same task, "
                "as `with pool.scope():` does"
            ) from None
        if PENDING.scopes:  # a stream's scope this one covered, its forward ended meanwhile
            leave_pending()


def _reject_source(source: Any) -> NoReturn:
    """Raise the error that says what a pool manages, given ``source`` it cannot manage."""
    if isinstance(source, torch.nn.Module):
        raise T2NErrorMisuse(
            "TensorResidencyPool manages OffloadedTensor values; got a module "
            f"({type(source).__name__}): pass its offloaded tensors (for t in "
            "module.parameters(): if isinstance(t, OffloadedTensor): pool.prefetch(t)), or "
            "stream whole layers with stream_modules(pool, [module])"
        )
    raise T2NErrorMisuse(
        "TensorResidencyPool only manages OffloadedTensor values; "
        f"got {type(source).__name__} (plain tensors are already resident)"
    )


class _Unclosed:
    """Writes back the changes of a pool that was never closed, as :meth:`close` would:
    when the pool is garbage collected (in the background: gc may run on any thread, amid
    anything), or at interpreter exit (waited for, before the loop thread stops). Holds the
    pool weakly. A pool collected while stranded on a closed loop of the caller's is closed
    by the reaper (see :func:`reap_later`); one collected while no loop served it (its
    ``async with`` exit failed) is kept for interpreter exit, which closes it."""

    def __init__(self, pool: TensorResidencyPool, runtime: Runtime) -> None:
        self._pool = weakref.ref(pool)
        self._runtime = runtime
        self._closing: Reply | None = None

    def collected(self) -> None:
        """The pool was garbage collected (a finalizer): close it on its loop thread, or on
        the reaper's when that loop is a closed one of the caller's. Nothing here waits nor
        starts a thread: this may run on any thread, amid anything."""
        runtime = self._runtime
        actor = runtime.actor
        if actor.closed:
            return
        dirty = _has_changes(actor)
        if runtime.stranded_on_closed_loop():  # its workers and values stay until closed
            reap_later(self._reap)
        elif not runtime.private:
            if runtime.loop is not None or not dirty:
                return  # a loop of the caller's serves it: closed by it, or at exit
            _ORPHANS.add(self)  # no loop: nothing here can write; interpreter exit will
        else:
            closing = Reply()
            self._closing = closing
            if not runtime.post_lock_free(self._close_collected, closing):
                closing.set_result(None)
        if dirty:  # last: warnings turned into errors must not stop the close
            warnings.warn(
                "a TensorResidencyPool with unsaved changes was garbage collected without "
                "close(); its changes are written back in the background: close the pool (or "
                "use `with pool:`) to know when they are on disk, and whether writing failed",
                ResourceWarning,
                stacklevel=1,
            )

    def _close_collected(self, closing: Reply) -> None:
        """Loop thread: run the close, then stop the loop thread and its workers."""
        done = Reply()
        done.add_done_callback(partial(self._collected_closed, closing))
        self._runtime.drive(Close(self._runtime.actor, _nothing), done)

    def _collected_closed(self, closing: Reply, done: Reply) -> None:
        error = done.exception()
        if error is not None:
            _log_unwritten("garbage collected without close()", error)
        self._runtime.stop_private(wait=False)
        closing.set_result(None)

    def _reap(self) -> None:
        """The reaper's thread: close the collected pool stranded on a closed loop, as
        interpreter exit would (its changes written back, its workers stopped, its values
        released). A close refused (values leased by a thread still running, a daemon say)
        leaves the pool to interpreter exit, which writes back what it can. A failed write
        is logged, and the workers stop all the same, as those of a pool collected on its
        private loop: nobody is left to retry, and the files keep their earlier values."""
        runtime = self._runtime
        try:
            runtime.close_stranded(Close(runtime.actor, _nothing))
        except T2NErrorMisuse:
            _ORPHANS.add(self)
        except Exception as error:
            _log_unwritten("garbage collected without close()", error)
            self._closing = Reply.of(None)  # (interpreter exit has nothing left to do)
            runtime.detach_current()

    def at_exit(self) -> None:
        """Interpreter exit, before the loop thread stops: finish the close of a collected
        pool, or close a pool still open (it writes its changes back; a later use says it is
        closed instead of taking a change nobody would write)."""
        if self._runtime.stranded():
            self._close_stranded()
            return
        if self._runtime.served_by_callers_loop():
            self._close_served_elsewhere()
            return
        closing = self._closing
        if closing is not None:
            try:
                closing.result(timeout=_EXIT_WRITE_TIMEOUT)
            except TimeoutError:
                LOGGER.error(
                    "a TensorResidencyPool garbage collected without close() was still writing "
                    "its changes back after %.0f s at exit; some may be lost",
                    _EXIT_WRITE_TIMEOUT,
                )
            return
        runtime = self._runtime
        actor = runtime.actor
        if actor.closed or (not runtime.running and not _has_changes(actor)):
            return  # closed, or never served: nothing to write
        pool = self._pool()
        try:
            if pool is not None:
                pool.close()
            else:  # collected while no loop served it: a private loop closes it now
                try:
                    runtime.call(Close(runtime.actor, _nothing))
                finally:
                    runtime.stop_private()
        except T2NErrorMisuse as error:  # leased: by a daemon thread, or a block never left
            self._flush_unleased(error, runtime.call)
        except T2NError as error:  # a write failed
            _log_unwritten("open at interpreter exit", error)

    def _flush_unleased(self, refused: T2NErrorMisuse, call: Callable[[Operation], Any]) -> None:
        """Close refused (values leased): write back every change but those under a
        ``read_write`` lease still held, which cannot be whole; of a value under such a
        lease, the change of leases that ended before it is written. ``call`` runs the
        requests (the runtime's sync face, or the exiting thread for a stranded pool)."""
        actor = self._runtime.actor
        try:
            call(Flush(actor, None))
            sources = call(Transition(lambda: [e.alive for e in actor.entries.values()]))
            for source in sources:
                if source is not None:  # (else collected: its value was clean)
                    source._write_unsaved(actor)
        except T2NError as error:
            _log_unwritten("open at interpreter exit", error)
            return
        LOGGER.error(
            "a TensorResidencyPool open at interpreter exit still had values under leases "
            "that never ended, held by a thread still running or by an `acquire` block never "
            "left (a generator suspended inside it, a lease entered without its exit) (%s); "
            "the other changes were written back, those made under read_write leases still "
            "held are lost",
            refused,
        )

    def _close_served_elsewhere(self) -> None:
        """Interpreter exit while a loop of the caller's still serves the pool: a daemon
        thread runs it (the interpreter waited for the others), and nothing will leave its
        ``async with`` block. That loop is sent the close, and waited for a bounded time,
        once per loop (one that let a close wait that long is not waited for again); a
        loop that stops meanwhile leaves the pool stranded, for this thread to close."""
        runtime, actor = self._runtime, self._runtime.actor
        if actor.closed or not _has_changes(actor):
            return
        loop = runtime.loop
        if id(loop) in _LOOPS_PAST_EXIT_WAIT:
            LOGGER.error(
                "a TensorResidencyPool served on a daemon thread by an event loop that does "
                "not answer could not write its changes back at interpreter exit"
            )
            return
        pool = self._pool()
        close = pool._close_request() if pool is not None else Close(actor, _nothing)
        call = partial(runtime.call, timeout=_EXIT_WRITE_TIMEOUT)
        try:
            call(close)
        except TimeoutError:
            _LOOPS_PAST_EXIT_WAIT.add(id(loop))
            LOGGER.error(
                "the event loop serving a TensorResidencyPool on a daemon thread did not close "
                "it within %.0f s at interpreter exit; its changes may be lost",
                _EXIT_WRITE_TIMEOUT,
            )
        except T2NErrorMisuse as error:
            if runtime.stranded():  # that loop stopped meanwhile
                self._close_stranded()
            else:  # leased: by the daemon thread's tasks, say
                self._flush_unleased(error, call)
        except T2NError as error:  # a write failed
            _log_unwritten("served on a daemon thread at interpreter exit", error)

    def _close_stranded(self) -> None:
        """Close a pool whose ``async with`` block on a loop of the caller's was never left,
        that loop no longer running: the exiting thread drives the close itself, as the
        loop thread would, its writes still on the workers (which stop after this)."""
        runtime, actor = self._runtime, self._runtime.actor
        if actor.closed or not _has_changes(actor):
            return
        pool = self._pool()
        close = pool._close_request() if pool is not None else Close(actor, _nothing)
        try:
            runtime.close_stranded(close)
        except T2NErrorMisuse as error:  # leased by a thread still running (a daemon)
            self._flush_unleased(error, runtime.call_stranded)
        except Exception as error:
            _log_unwritten("whose `async with` block was never left", error)


def _log_unwritten(which: str, error: BaseException) -> None:
    LOGGER.error(
        "a TensorResidencyPool %s could not write its changes back; the files keep their "
        "earlier values: %s",
        which,
        error,
    )


def _has_changes(actor: Actor) -> bool:
    """Whether ``actor`` holds unsaved changes, asked from any thread (read without the loop:
    a change under way counts as one)."""
    try:
        return actor.dirty_entries()
    except RuntimeError:  # the loop thread changed the entries meanwhile
        return True


_ORPHANS: set[_Unclosed] = set()
"""Pools collected with changes while no loop served them, or stranded with values leased,
closed at interpreter exit."""

_FIXED_AT_CREATION = frozenset({"max_cached_bytes", "max_workers", "strategy"})
"""Attributes of a pool that its actor and runtime were built with: read-only."""

_EXIT_WRITE_TIMEOUT = 300.0
"""Seconds interpreter exit waits for the write-backs of a collected pool."""

_LOOPS_PAST_EXIT_WAIT: set[int] = set()
"""The loops (by id) that let a close at interpreter exit wait :data:`_EXIT_WRITE_TIMEOUT`."""


async def _to_its_end(coroutine: Coroutine[Any, Any, None]) -> None:
    """Await ``coroutine`` to its end in a task of its own: a cancellation of the caller's
    (asyncio's own; the caller shields it from anyio's) is raised once it ended."""
    task = asyncio.ensure_future(coroutine)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError as error:
            if task.done():
                raise
            cancelled = error
    if cancelled is not None:
        raise cancelled


def _nothing() -> None:
    pass


def _read_ahead(pool: TensorResidencyPool, window: int | str | None) -> ReadAhead | None:
    if window is None:
        return None
    if window == "auto":
        budget = pool.max_cached_bytes
        return ReadAhead(pool, 256 << 20 if budget is None else budget // 2)
    if isinstance(window, bool) or not isinstance(window, (int, str)):
        raise T2NErrorMisuse(
            "read_ahead must be None, 'auto' or a size (bytes, or a str such as '64MiB'), "
            f"got {window!r}"
        )
    return ReadAhead(pool, parse_bytes(window))  # (a size as the budget's, checked alike)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"
