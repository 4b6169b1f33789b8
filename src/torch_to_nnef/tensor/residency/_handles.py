"""What the pool hands out: leases, prefetch handles, and the two points every value passes.

:func:`hand_over` is the one place a value goes to a consumer (a lease, ``resolve``, a
prefetch handle, scope ops); :func:`end_lease` the one place a lease ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import PoolSource
from torch_to_nnef.tensor.residency._requests import Acquire
from torch_to_nnef.tensor.residency._runtime import Reply
from torch_to_nnef.tensor.residency._state import Holder, Slot

if TYPE_CHECKING:
    from torch_to_nnef.tensor.residency._pool import TensorResidencyPool

__all__ = [
    "TensorPrefetch",
    "TensorResidencyLease",
    "Uncopyable",
    "end_lease",
    "hand_over",
]


class Uncopyable:
    """An object tied to a pool's threads and to what it holds: a copy would share them (a
    copied lease would end the same lease twice) and a pickle could not carry them, so
    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` refuse, saying what to do instead."""

    __slots__ = ()
    _why_not_copied = "it is tied to its pool's threads: pass the object itself"

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise T2NErrorMisuse(
            f"a {type(self).__name__} cannot be copied or pickled: {self._why_not_copied}"
        )


hand_over: Callable[..., torch.Tensor] = storage.handoff
"""A value leaving the pool for a consumer (the one place to make it safe to use):
``hand_over(value, device=None)``.

On a CUDA device the consumer's current stream waits for the value's copies and owns its
memory until its queued kernels ran (see ``storage.handoff``, bound here without a wrapper:
this runs on every hit). ``device``: where the value lives, when known (a slot's), which
spares asking the tensor. A hit on a slot whose ``as_is`` is set (a value off CUDA, where
this does nothing) skips the call.
"""


def end_lease(
    pool: TensorResidencyPool,
    holder: Holder,
    changed: bool,
    *,
    by_owner: bool = True,
    tell_now: bool = True,
) -> None:
    """End ``holder``'s lease if it holds one (any thread; idempotent); when that puts the
    pool over its budget, the actor hears of it without waiting (a wake-up of its loop).
    ``changed``: a ``read_write`` lease that was entered, whose change is kept; on a CUDA
    value it records an event on the caller's current stream, which the write-back waits
    for. ``by_owner``: its owner ends it, and is told when the value was reshaped (else, the
    lease being collected, the change is dropped with a warning: see ``Actor.release``).
    ``tell_now`` false: the actor hears of the end at its next step (a wake-up of its loop),
    never inline (a lease collected on the pool's loop thread, amid a step perhaps)."""
    slot = holder.slot
    if slot is None:
        return
    refused = None
    if changed and holder.read_write:
        storage.record_writes(slot.value, slot.device)
        if by_owner:
            refused = _undo_reshaping(slot)
            changed = refused is None
    if pool._actor.release(holder, changed):
        if tell_now:
            _tell_leases_ended(pool)
        else:
            pool._runtime.wake()
    if refused is not None:
        raise refused


def _tell_leases_ended(pool: TensorResidencyPool) -> None:
    """Tell the actor that leases ended over the budget, without waiting (see ``end_lease``)."""
    pool._runtime.notify(pool._actor.leases_ended)


def _undo_reshaping(slot: Slot) -> T2NErrorMisuse | None:
    """A ``read_write`` lease's change keeps the value's shape and dtype. A value reshaped
    or retyped in place under the lease (``unsqueeze_``, ``resize_``, ``set_``, ``.data =``)
    is put back as the tensor's latest write, read while the lease still holds it (no
    write-back runs meanwhile); the error to raise says so (``None``: the change fits).
    A direct write that gave the tensor itself a new shape or dtype meanwhile is no
    reshaping of the value: the lease's change is dropped as any change a later write
    supersedes."""
    if not slot.reshaped():
        return None
    value, source = slot.value, slot.entry.source
    shape, dtype = tuple(slot.shape), slot.dtype
    became = f"{tuple(value.shape)} {value.dtype}"
    with torch.no_grad():  # (read into host buffers, not mapped: see Actor._start_load)
        reread = source._reload_unmanaged(slot.device, None, False)
        value.data = storage.handoff(reread, slot.device)
    return T2NErrorMisuse(
        f"{source.name!r} was reshaped in place under a read_write lease (an in-place op "
        f"in a pool's scope takes one) from {shape} {dtype} to {became}; the change is "
        "dropped and the value is back to its latest write. A lease keeps the shape and "
        "dtype: give new ones with update_values(value, strict_shape=False, strict_dtype=False)"
    )


class TensorPrefetch(Uncopyable):
    """Handle on a load started by :meth:`TensorResidencyPool.prefetch` or ``pin``.

    ``handle.wait()`` blocks until the value is loaded and returns it (any thread but the
    pool's loop thread); ``await handle`` does the same in async code; ``handle.done()`` tells
    without blocking. A failed load raises :class:`T2NErrorStorage` from both. A handle on a
    value that was resident already is done at once. The value returned is the tensor's
    latest: when a write came after the prefetch (a direct write, another pool's change, a
    change of this pool's own), the handle serves it through the pool, as a new prefetch
    would (counting no request).

    Handles are not constructed directly: :meth:`TensorResidencyPool.prefetch` and
    :meth:`TensorResidencyPool.pin` return them.
    """

    __slots__ = ("_device", "_future", "_pool", "_source", "_version")
    _why_not_copied = (
        "it is tied to its pool's load: wait for it and pass the value, or prefetch again"
    )

    def __init__(
        self,
        pool: TensorResidencyPool,
        source: PoolSource,
        device: torch.device,
        future: Reply,
        version: object,
    ) -> None:
        self._pool = pool
        self._source = source
        self._device = device
        self._future = future
        # The latest write as of the prefetch (``_hit_state.last_write()``, read before the
        # value was picked): a later one may be missing from the value (another pool's
        # change, or this pool's own made on a value read again after this one was evicted).
        self._version = version

    @classmethod
    def _ready(
        cls,
        pool: TensorResidencyPool,
        source: PoolSource,
        device: torch.device,
        value: torch.Tensor,
        version: object,
    ) -> TensorPrefetch:
        return cls(pool, source, device, Reply.of(value), version)

    def done(self) -> bool:
        """Whether the load has ended (successfully or not)."""
        return self._future.done()

    def _outdated(self, value: torch.Tensor) -> bool:
        """Whether a write came after the prefetch (the pool then serves the latest value,
        which may be ``value`` itself), or ``value`` holds a ``read_write`` lease's change
        that was dropped since (a later write stands)."""
        actor = self._pool._actor
        written = self._source._hit_state.last_write() is not self._version
        return written or actor.holds_dropped_change(value)

    def wait(self) -> torch.Tensor:
        """Block until the value is loaded and return it.

        Raises:
            T2NErrorStorage: the load failed (the cause is chained).
            T2NErrorMisuse: called on the pool's own loop thread before the load ended,
                or after a write came since the prefetch and the value must be read again
                (use ``await handle`` there).
        """
        if not self._future.done() and self._pool._runtime.on_loop_thread():
            raise T2NErrorMisuse(
                "TensorPrefetch.wait() would block the pool's event loop: "
                "use `await handle` in async code"
            )
        value = self._pool._runtime.wait(self._future)
        if self._outdated(value):  # served again as a prefetch: no request is counted
            return self._pool.prefetch(self._source, self._device).wait()  # type: ignore[arg-type]
        return hand_over(value)

    def __await__(self) -> Generator[Any, None, torch.Tensor]:
        return self._await().__await__()

    async def _await(self) -> torch.Tensor:
        if self._future.done():
            value = self._future.result()
        else:
            value = await self._pool._runtime.await_foreign(self._future)
        if self._outdated(value):
            return await self._pool.prefetch(self._source, self._device)  # type: ignore[arg-type]
        return hand_over(value)

    def __repr__(self) -> str:
        return f"<TensorPrefetch {'done' if self.done() else 'pending'}>"


class TensorResidencyLease(Holder, Uncopyable):
    """A scoped claim on a resident value: ``with pool.acquire(t) as v`` or ``async with``.

    While the lease is held the value stays resident. A ``read_write`` lease marks the value
    dirty when it ends, and the pool writes it back before evicting it, on flush and on close.
    A lease is entered once. Entering a lease on a resident value takes no round trip to the
    pool's loop thread.

    The lease is released whatever interrupts its owner: an error, a cancellation or a
    ``KeyboardInterrupt`` while it is being entered gives it back; one landing where no code
    of the lease runs (on the way into ``__exit__``) leaves it to the lease object's
    collection, which ends it as the exit would (a ``read_write`` lease's change is the
    tensor's latest write from then on, on the pool's loop thread too), or at the pool's next
    step where its thread cannot wait for the pool (a garbage collection, the pool's own
    code, its I/O workers). A task inside ``async with`` whose coroutine is collected without
    running (its loop left it pending) ends it at the pool's next step, as does a generator
    suspended inside ``with`` that a collection closes amid the pool's own code. A
    ``read_write`` change ended that way that reshaped the value is dropped, as an exit
    refuses it.

    Leases are not constructed directly: :meth:`TensorResidencyPool.acquire` returns them.
    Entering one raises what :meth:`TensorResidencyPool.resolve` raises, and
    :class:`T2NErrorMisuse` when the lease is already held.
    """

    __slots__ = ("_begun", "_device", "_pool", "_request", "_source", "_used")
    _why_not_copied = "a copy would end the same lease twice: use the lease object itself"

    def __init__(
        self,
        pool: TensorResidencyPool,
        source: PoolSource,
        device: torch.device | None,
        mode: str,
    ) -> None:
        # ``device`` ``None``: the tensor's target device, read as each try needs it (a hit
        # reads it from the tensor's hit state, which it reads anyway). Holder's fields are
        # set here rather than through its __init__: this runs on every acquire.
        self.read_write = mode == "read_write"
        self.entered = False
        self.ahead = False
        self.reader = 0
        self.slot = None
        self._pool = pool
        self._source = source
        self._device = device
        self._used = False
        self._request: Acquire | None = None  # begun and not entered yet
        self._begun: Reply | None = None

    @property
    def mode(self) -> str:
        """``"read"`` or ``"read_write"``."""
        return "read_write" if self.read_write else "read"

    def _dropped(self) -> bool:
        """Whether it was cancelled (:meth:`_cancel`) before it was entered."""
        return self._begun is _CANCELLED

    def _check_unused(self) -> None:
        if self._used:
            if self._dropped():  # by a close, from another thread perhaps
                self._pool._actor.check_open()  # (a pool's close: says it is closing)
                raise T2NErrorMisuse(
                    "this lease was dropped before it was entered (a close of the stream "
                    "that began it, or of its pool, dropped it meanwhile): acquire the value "
                    "again"
                )
            raise T2NErrorMisuse("this lease is already held: a lease can be entered once")
        self._used = True

    def _fast(self) -> bool:
        """Take the lease on a resident value without the loop thread; whether it did."""
        actor = self._pool._actor
        slot = actor.fresh_slot(self._source, self._device)
        if slot is None:
            return False
        if self.read_write or self.ahead:
            return actor.try_lease(slot, self)
        return actor.take_reader(slot, self)

    def _outdated(self) -> bool:
        """Whether the value granted is older than the tensor's latest write (a lease begun
        before that write), holds a ``read_write`` lease's change that was dropped since, or
        was changed in place through a view of it (see ``Actor.fresh_slot``): the holder
        keeps it, but entering reads the latest.

        A lease begun ahead (a stream's, for a forward to come) holds the value before its
        owner has it: a change through a view made meanwhile is not its owner's, yet the
        lease exempts the value from the check of hits. Entering asks the pool again, as any
        read: it loads the value again (or, on its unsaved change, keeps the change with it),
        unless another holder may make the change its own. Only a marked value's version
        counter is read."""
        slot = self.slot
        return slot is not None and (
            slot.dropped
            or slot.version is not slot.hit_state.version_for(self._pool._actor)
            or (slot.aliased and slot.value._version != slot.seen)
        )

    def _acquire(self) -> Acquire:
        device = self._device
        if device is None:  # the tensor's target device, as it is now
            device = self._source.target_device
        return Acquire(self._pool._actor, self._source, device, self)

    def _value(self) -> torch.Tensor:
        """The value of the lease just granted, handed over to the caller."""
        slot = self.slot
        assert slot is not None
        if self.read_write:  # reads outside the pool never see the change under way
            self._pool._actor.enter(self)
            self._source._shelter_unsaved(self._pool._actor, slot.value)
        return slot.value if slot.as_is else hand_over(slot.value, slot.device)

    def _begin(self) -> bool:
        """Start acquiring without waiting, so that ``__enter__`` later finds the value loaded.

        Returns whether it began: not on the pool's loop thread (which cannot wait). A begun
        lease holds its value as soon as it is granted: enter it, or :meth:`_cancel` it.
        """
        runtime = self._pool._runtime
        runtime.ensure_running()
        if self._begun is not None or runtime.on_loop_thread():
            return self._begun is not None
        request = None
        if self._fast():
            begun = _GRANTED
        else:
            request = self._request = self._acquire()  # where a cancel from now on finds it
            begun = runtime.start(request)
        if self._begun is _CANCELLED:
            # Another thread cancelled it meanwhile (a stream's close), perhaps before
            # anything was held: what it holds or will be granted is given back here.
            if request is not None:
                runtime.notify(request.abandon)  # (idempotent)
            end_lease(self._pool, self, False)
            return True
        self._begun = begun
        return True

    def _cancel(self) -> None:
        """Drop a lease begun and not entered (any thread); it cannot be entered after.
        Idempotent, and a call again after an interrupt cut one finishes it."""
        if self._used and self._begun is not _CANCELLED:
            return  # entered: its owner ends it
        self._begun = _CANCELLED  # first: an interrupt right after leaves it to a call again
        self._used = True
        runtime = self._pool._runtime
        request, self._request = self._request, None
        if runtime.may_wait_for_itself():
            # A finalizer's cancel (a stream's thread state collected) amid the pool's code
            # or another's: all is left to the pool's next step, taking no lock.
            if request is not None:
                runtime.abandon_later(request)
            self._drop()
            return
        if request is not None:
            runtime.notify(request.abandon)  # (idempotent)
        end_lease(self._pool, self, False)

    def __enter__(self) -> torch.Tensor:
        begun, request = self._begun, self._request
        if self._used:
            self._check_unused()  # raises
        self._used = True
        try:
            if begun is None:  # _fast and _value, inlined: the path of every hit
                actor = self._pool._actor
                slot = actor.fresh_slot(self._source, self._device)
                if slot is not None:
                    if not self.read_write:
                        if actor.take_reader(slot, self):
                            return slot.value if slot.as_is else hand_over(slot.value, slot.device)
                    elif actor.try_lease(slot, self):
                        actor.enter(self)
                        self._source._shelter_unsaved(actor, slot.value)
                        return slot.value if slot.as_is else hand_over(slot.value, slot.device)
                self._pool._runtime.call(self._acquire())
            else:
                self._begun = self._request = None
                started = time.perf_counter()
                self._pool._runtime.wait(begun)
                if request is not None:  # a wait for its read ahead, if it ran late
                    self._pool._runtime.count_stall(request, started)
                if self._outdated():  # changed since it began: enter the latest value
                    end_lease(self._pool, self, False)
                    if not self._fast():
                        self._pool._runtime.call(self._acquire())
            return self._value()
        except BaseException:
            if request is not None:
                self._pool._runtime.notify(request.abandon)
            end_lease(self._pool, self, False)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self._collected_amid_the_pools_code(exc):
            self._drop()
            return
        try:
            if not self.reader:
                end_lease(self._pool, self, True)
            elif self._pool._actor.end_reader(self):  # a hit's (as end_lease ends it)
                _tell_leases_ended(self._pool)
        except KeyboardInterrupt:  # what it left of the end: at the pool's next step
            self._drop()
            raise

    async def __aenter__(self) -> torch.Tensor:
        self._check_unused()
        try:
            if not self._fast():
                await self._pool._runtime.acall(self._acquire())
            return self._value()
        except BaseException as error:
            if self._collected_amid_the_pools_code(error):
                self._drop()  # (granted before its loop closed, perhaps)
            else:
                end_lease(self._pool, self, False)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self._collected_amid_the_pools_code(exc):
            self._drop()
            return
        # As in __exit__ (not a shared method: its call would be one more point where Python
        # runs a pending handler, before its ``try``).
        try:
            if not self.reader:
                end_lease(self._pool, self, True)
            elif self._pool._actor.end_reader(self):
                _tell_leases_ended(self._pool)
        except KeyboardInterrupt:
            self._drop()
            raise

    def _collected_amid_the_pools_code(self, error: BaseException) -> bool:
        """Whether the block was left by a garbage collection that closed its generator or
        coroutine where the calling thread must not wait (``may_wait_for_itself``): the lease
        then ends without a wait, at the pool's next step (:meth:`_drop`). An owner's
        ``close()`` or ``aclose()`` elsewhere ends it at once."""
        return isinstance(error, GeneratorExit) and self._pool._runtime.may_wait_for_itself()

    def __del__(self) -> None:
        # An interrupt landed where its owner could not end it (or before it was built).
        # Ended here as an exit ends it, its change the tensor's latest write from now on
        # (a direct write after it stands on it), unless this thread cannot wait for the
        # pool: then at the pool's next step. On the pool's loop thread (a task of the loop
        # serving it, or amid a step of the actor's) it ends as another thread's release
        # would, and the actor hears of it at its next step, not inline.
        try:
            slot = self.slot
        except AttributeError:
            return
        if slot is None:
            return
        runtime = self._pool._runtime
        try:
            if not runtime.may_wait_for_itself():
                end_lease(
                    self._pool,
                    self,
                    self.entered,
                    by_owner=False,
                    tell_now=not runtime.on_loop_thread(),
                )
        finally:
            self._drop()  # at the next step: all of it, or what an interrupt left of it

    def _drop(self) -> None:
        """End the lease at the actor's next transition, taking no lock (a finalizer's end,
        whatever its thread holds); an entered ``read_write`` lease's change is kept."""
        slot = self.slot
        if slot is not None:
            dropped = Holder(self.read_write)
            dropped.reader, dropped.entered = self.reader, self.entered
            dropped.slot, self.slot = slot, None
            self._pool._actor.drop(dropped, self.entered)
            self._pool._runtime.wake()

    def __repr__(self) -> str:
        state = "held" if self.slot is not None else "idle"
        return f"<TensorResidencyLease {self._source.name!r} mode={self.mode} {state}>"


_GRANTED = Reply.of(None)
_CANCELLED = Reply.of(None)  # what a cancelled lease has begun: nothing to enter
