"""The records a pool's actor keeps: entries, their published slots, disk jobs, counters."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from torch_to_nnef._waiting import Waiters
from torch_to_nnef.exceptions import T2NError, T2NErrorStorage
from torch_to_nnef.tensor.offload._protocol import HitState, PoolSource

__all__ = [
    "CLOSE_UNDER_WAY",
    "CallerRead",
    "Entry",
    "Holder",
    "Job",
    "PoolStats",
    "Slot",
    "Ticket",
    "as_storage_error",
]


class PoolStats(NamedTuple):
    """Counters of a :class:`TensorResidencyPool` since it was created."""

    hits: int
    """Requests served by a resident value at once."""
    misses: int
    """Requests that had to wait: for a load, or for the write-back of a value written over
    meanwhile. Each request counts once, whatever it waits for after, even when its caller
    gives up: ``hits + misses`` is the number of requests."""
    loads: int
    """Payloads read from disk."""
    bytes_read: int
    """Bytes read from disk by those loads."""
    evictions: int
    """Values that left the pool (budget, explicit eviction, close, or the collection of a
    tensor its user dropped while its value was resident)."""
    write_backs: int
    """Dirty values written back to their files."""
    bytes_written: int
    """Bytes written by those write-backs."""
    load_errors: int
    """Loads that failed (missing or corrupt files)."""
    reused_buffers: int = 0
    """Loads that read into the host buffers of an evicted value instead of fresh memory."""
    stall_seconds: float = 0.0
    """Seconds that requests (``resolve``, ``acquire``, scope reloads) spent blocked on a value
    being loaded. A value read ahead in time adds nothing; one read ahead too late adds what is
    left of its read."""
    wasted_prefetches: int = 0
    """Values loaded without a request (``prefetch``, ``pin``, the trace-driven read-ahead)
    that left the pool (evicted, or at its close) before any request used them: reads for
    nothing (a budget too small for the read-ahead window, or a forward that left the learned
    order). A handle's ``wait()`` or ``await`` is no request. The read-ahead's own
    leases are no requests: they count in neither ``hits`` nor ``misses``."""
    pinned_bytes: int = 0
    """Pinned host memory held to stage copies to CUDA devices (process-wide, shared by every
    pool: ``storage.pinned_bytes()``), on top of ``max_cached_bytes``."""
    caller_reads: int = 0
    """Loads that the thread of a sync ``resolve`` or ``acquire`` (a scope's reads among them)
    read itself, without a hand-off to an I/O worker and back: small payloads (up to 1 MiB)
    for the CPU, with mapped reads on (``storage.set_mapped_reads``). Counted in ``loads``
    too."""

    @property
    def bytes_read_per_request(self) -> float:
        """Bytes read from disk per request (``hits + misses``; 0.0 before the first): the
        payload size when every request reads, less when the pool serves values again."""
        requests = self.hits + self.misses
        return self.bytes_read / requests if requests else 0.0


def as_storage_error(error: BaseException) -> BaseException:
    """A load error as the callers see it: a ``T2NError``, the original chained."""
    if isinstance(error, T2NError):
        return error
    wrapped = T2NErrorStorage(f"loading an offloaded tensor failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped


CLOSE_UNDER_WAY = "close under way"
"""The kind of the job that marks a close under way: no worker runs it; the close finishes it
as it ends (closed or aborted), and a second close waits for it."""


class Job:
    """One disk job (a load or a write-back) on an I/O worker, and who waits for its end.

    A worker runs ``function(*args)`` (:meth:`run`) and stores its outcome here (``outcome``,
    or the error in ``failure``), then sets ``ran``; :meth:`complete` runs the actor's
    transition for it on the loop thread, once (scheduled by the runtime, or run at once by
    an inline wait on the loop thread itself). A transition that raises before it ended the
    job hands it to ``recover(job, error)``, which puts the actor's state right and ends the
    job with an error: no waiter waits for a job whose end was not applied.
    """

    __slots__ = (
        "_args",
        "_callbacks",
        "_function",
        "_recover",
        "_transition",
        "done",
        "error",
        "failure",
        "kind",
        "outcome",
        "ran",
        "value",
        "version",
        "waiters",
    )

    def __init__(
        self,
        kind: str,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        transition: Callable[[Job], None],
        recover: Callable[[Job, BaseException], None] | None = None,
    ) -> None:
        self.kind = kind
        self._function: Callable[..., Any] | None = function
        self._args = args
        self.outcome: Any = None
        self.failure: BaseException | None = None
        self.ran = False  # set by the worker (under its lock) once the outcome is stored
        self.waiters: Waiters | None = None  # an inline wait on the loop thread's
        self.done = False
        self.value: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.version: object = None  # a load: the payload version it reads (or a newer one)
        self._transition: Callable[[Job], None] | None = transition
        self._recover = recover
        self._callbacks: list[Callable[[], None]] = []

    def run(self) -> None:
        """Run the job's function and keep its outcome (a worker thread, once)."""
        function, args = self._function, self._args
        self._function, self._args = None, ()
        assert function is not None
        try:
            self.outcome = function(*args)
        except BaseException as error:  # reported by the transition, on the loop thread
            self.failure = error

    def complete(self) -> None:
        """Run the transition of the ended worker job (loop thread; only the first call acts).

        The outcome is dropped then: the transition handed it on (``value``, or the
        entry's state). The job ends whatever the transition does: one that raises before it
        ended the job leaves it to the recovery, then the error is raised.
        """
        transition, self._transition = self._transition, None
        if transition is None:
            return
        try:
            transition(self)
        except BaseException as error:
            if not self.done:
                self._abort(error)
            raise
        finally:
            self.outcome = None

    def _abort(self, error: BaseException) -> None:
        """End the job whose transition raised ``error`` before it ended it: through its
        recovery, and with the error itself (as a ``T2NError``) when there is none or it
        fails in turn."""
        recover, self._recover = self._recover, None
        try:
            if recover is not None:
                recover(self, error)
        finally:
            if not self.done:
                self.finish(None, as_storage_error(error))

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop thread once the job ended (at once if it has)."""
        if self.done:
            callback()
        else:
            self._callbacks.append(callback)

    def finish(self, value: torch.Tensor | None, error: BaseException | None) -> None:
        """End the job and run its callbacks, every one of them: each resumes a waiter,
        which would otherwise wait for ever. The first that raised (a Ctrl-C held through a
        resumed request, raised as it returned) is raised again once they all ran."""
        self.done = True
        self.value = value
        self.error = error
        callbacks, self._callbacks = self._callbacks, []
        raised: BaseException | None = None
        for callback in callbacks:
            try:
                callback()
            except BaseException as failure:
                raised = raised or failure
        if raised is not None:
            raise raised

    def result(self) -> torch.Tensor:
        """The loaded value, or the load error as :class:`T2NErrorStorage`."""
        if self.error is not None:
            raise as_storage_error(self.error)
        assert self.value is not None
        return self.value


class Slot:
    """What other threads see of a resident value, and the leases they hold on it.

    Every field but ``key``, ``value``, ``device``, ``as_is``, ``shape``, ``dtype`` (fixed at
    creation: the value's shape and dtype are what a lease's change must keep),
    ``hit_state`` (the tensor's, which a hit checks) and
    ``aliased`` (a flag any thread sets, never cleared) changes under the actor's lock only,
    but for what a reader changes (below).
    A thread takes or ends a lease here without the loop thread
    (reading and writing the slot only, never its entry); the actor never evicts, reuses or
    replaces a value whose slot has leases, and closes the slot (no new lease) before it
    does. A write-back of the value never runs while a ``read_write`` lease
    is held (``writers``): one is not granted while ``writing``, and the actor sets
    ``writing`` (under the lock, seeing no writer) before the write-back starts copying.

    A ``read`` lease entered on a hit takes no lock: its holder joins ``readers`` (one
    atomic list operation under the GIL), then looks at ``open``; the actor closes the slot,
    then looks at ``readers``. One of the two sees the other, so that a value is never taken
    away from a reader: the reader leaves a closed slot (and asks the actor), or the actor
    counts it and opens the slot again. What a reader sets besides (``used``, ``changed``)
    is set to the same value by whoever sets it, and read again by the actor after it
    clears it (see ``Actor.take_reader``). A ``read`` lease the actor grants on a miss joins
    the readers too, on the loop thread (its owner's request counted as the step found it),
    and ends as any reader does.
    """

    __slots__ = (
        "aliased",
        "as_is",
        "changed",
        "changing",
        "device",
        "dirty",
        "dropped",
        "dtype",
        "enters",
        "entry",
        "granted",
        "hit_state",
        "key",
        "open",
        "readers",
        "seen",
        "shape",
        "tracked",
        "unnoted",
        "used",
        "value",
        "version",
        "writers",
        "writing",
    )

    def __init__(self, entry: Entry, value: torch.Tensor, version: object) -> None:
        self.entry = entry
        self.key = entry.key
        self.hit_state = entry.hit_state
        self.value = value
        self.shape = value.shape
        self.dtype = value.dtype
        self.device = entry.device
        # Handed over as it is: ``hand_over`` has work on CUDA devices only (their streams),
        # and reading ``device.type`` on every hit costs more than the rest of a hit's checks.
        self.as_is = entry.device.type != "cuda"
        self.version = version
        # The value's torch version counter as the pool last knew it changed (loaded, or a
        # read_write lease ended): a count beyond it once no lease holds the value is a
        # change made outside any read_write lease (through a view), which is no write.
        self.seen = value._version
        # A view of the value was handed out (an op of a scope): hits check the counter.
        self.aliased = False
        self.open = True  # leases may be taken without the actor
        self.granted = 0  # leases granted under the lock, held by any thread
        self.readers: list[int] = []  # tokens of read leases taken without the lock (above)
        self.writers = 0  # of which read_write leases (a write-back waits for them)
        # ... and of those, the ones entered: their owners have the value and may change it.
        # Entered read_write leases held at once share the value: their changes are one
        # change, the tensor's latest write once the last of them ends (never half made). A
        # lease granted and never entered (its acquire abandoned) changes nothing and waits
        # for no one. ``unnoted``: a change of one that ended before the others, for the
        # last to note.
        self.changing = 0
        self.unnoted = False
        self.enters = 0  # read_write leases entered so far (see ``Actor.release``)
        self.dirty = False  # a read_write lease ended since the actor last looked
        # A read_write lease's change to the value was dropped (a later direct write stands):
        # the value holds a change that is no write of the tensor, and is served no more.
        self.dropped = False
        self.tracked = False  # the actor counts leases as holding the value (outside the budget)
        self.writing = False  # a write-back runs: read_write leases go to the actor
        self.changed = False  # queued for the actor's next look at its leases
        self.used = False  # a hit without the actor served it (the entry's ``used``)

    @property
    def leases(self) -> int:
        """The leases held on the value (any thread; under the lock, those it counts and the
        readers that joined before the read). A call, where an interrupt may land: the steps
        that must not be cut read ``granted`` and ``readers`` instead."""
        return self.granted + len(self.readers)

    def none_entered_since(self, enters: int) -> bool:
        """Whether no ``read_write`` lease was entered on the value since ``enters`` counted
        them (any thread, no lock: the count only grows)."""
        return self.enters == enters

    def reshaped(self) -> bool:
        """Whether the value was reshaped or retyped in place since it was read (under a
        ``read_write`` lease, which keeps the shape and dtype: such a change is refused)."""
        value = self.value
        return value.shape != self.shape or value.dtype != self.dtype


@dataclass(eq=False)
class Entry:
    """What the pool knows about one tensor.

    The entry holds its tensor (``strong``) while anything may still need it: a load, a
    write-back, a change not written yet (the entry's or its slot's ``dirty``, or a
    ``read_write`` lease entered on the value, which holds it from its entry on), waiters, a
    pin, leases the actor counts. A resident value that is clean and idle holds it weakly
    only (``ref``; ``strong`` is ``None``), so that a tensor its user dropped is collected:
    the callback of ``ref`` unpublishes the value, and the actor's next transition removes
    the entry (see ``Actor._let_go``)."""

    key: int
    strong: PoolSource | None
    device: torch.device
    nbytes: int
    value: torch.Tensor | None = None
    slot: Slot | None = None
    load: Job | None = None
    write: Job | None = None
    waiters: int = 0
    pinned: bool = False
    dirty: bool = False
    retained: bool = False
    evicting: bool = False
    version: object = None  # the source's payload version the value was read from
    stuck: bool = False  # its write-back failed: kept, unevictable, until a flush writes it
    used: bool = False  # a request (not a prefetch) asked for the value since it was loaded
    copied: bool = False  # read into host buffers (not mapped): they may serve a later load
    # The value mapping the file its write-back wrote, and the value's torch version counter
    # then: served instead once no lease holds the value, unless it changed (Actor._remap).
    remapped: tuple[torch.Tensor, int] | None = None
    # The tensor, weakly, keyed by its id (its collection queues it for the actor), and a
    # second reference whose callback wakes the actor: made the first time the entry lets
    # go of the tensor (Actor._let_go).
    ref: weakref.KeyedRef[int, PoolSource] | None = None
    waker: weakref.ref[PoolSource] | None = None
    hit_state: HitState = field(init=False)  # the tensor's, for life (slots refer to it)

    def __post_init__(self) -> None:
        assert self.strong is not None
        self.hit_state = self.strong._hit_state

    @property
    def alive(self) -> PoolSource | None:
        """The tensor, or ``None`` once collected (an entry holding it weakly)."""
        source = self.strong
        if source is None and self.ref is not None:
            source = self.ref()
        return source

    @property
    def source(self) -> PoolSource:
        """The tensor, which the caller knows is alive: it holds it (a request), or the entry
        does (busy: see the class docstring)."""
        source = self.alive
        assert source is not None, "the tensor of a busy entry was collected"
        return source

    def owned_by(self, source: PoolSource) -> bool:
        """Whether this is ``source``'s entry, and not that of a collected tensor whose
        ``id`` ``source`` reuses, left for the actor's next transition to remove (any
        thread)."""
        strong = self.strong
        if strong is not None:
            return strong is source
        return self.ref is not None and self.ref() is source

    @property
    def name(self) -> str:
        """The tensor's name, as messages give it."""
        source = self.alive
        return "a collected tensor" if source is None else source.name

    @property
    def tracked(self) -> bool:
        return self.slot is not None and self.slot.tracked

    def holds(self) -> tuple[bool, bool]:
        """Whether something holds the value (waiters, its pin, a failed write-back, counted
        leases: it is not evictable), and whether it is *in use* (a resident value leased or
        awaited, outside the budget, which bounds what is kept for reuse; a pinned value
        counts toward it even while leased)."""
        slot = self.slot
        leased = slot is not None and slot.tracked
        waited = bool(self.waiters or leased)
        held = waited or self.pinned or self.stuck
        return held, waited and self.value is not None and not self.pinned

    @property
    def held(self) -> bool:
        return self.holds()[0]

    @property
    def resident(self) -> bool:
        """Loaded and not chosen for eviction (what ``is_resident`` reports)."""
        return self.value is not None and not self.evicting


class Holder:
    """Who holds a lease: ``slot`` is set in the step that takes the lease and cleared in the
    step that ends it, both under the actor's lock, with no call in between that an
    interrupt (``KeyboardInterrupt``) or a cancellation could land on. Whatever interrupts
    its owner, ``slot`` tells whether a lease is held, and releasing it is idempotent.
    ``read_write``: the lease's mode; ``entered``: a ``read_write`` lease whose value reached
    its owner, who may change it (the slot's ``changing`` counts it); ``ahead``: a lease the
    read-ahead holds for a forward to come, which is no request (no hit, no miss, no use: a
    value it read and nothing used counts as a wasted prefetch). ``reader``: the token of a
    ``read`` lease taken without the lock, among its slot's ``readers`` (``0``: none; below
    zero: one the actor admitted on a miss, which counts as no hit). It is set before
    ``slot``, which is set before the token joins the readers and cleared after it left, so
    that an end an interrupt cut is finished by a call again (see ``Actor.take_reader``)."""

    __slots__ = ("ahead", "entered", "read_write", "reader", "slot")

    def __init__(self, read_write: bool) -> None:
        self.read_write = read_write
        self.entered = False
        self.ahead = False
        self.reader = 0
        self.slot: Slot | None = None


class CallerRead:
    """A value that the thread making a sync request read itself, before the request reached
    the actor (``_requests.read_by_caller``): the outcome of the load it would start, taken
    unless the tensor was written since ``token`` (its ``_hit_state.last_write()``)."""

    __slots__ = ("token", "value")

    def __init__(self, token: object, value: torch.Tensor) -> None:
        self.token = token
        self.value: torch.Tensor | None = value

    def take(self) -> torch.Tensor:
        """The value, handed over once (the load's outcome)."""
        value, self.value = self.value, None
        assert value is not None
        return value

    @property
    def taken(self) -> bool:
        """Whether the value was handed over: it is the tensor's resident value now."""
        return self.value is None


class Ticket:
    """One acquire: its reservation while it waits for the value; the lease goes to
    ``holder`` (the caller's lease object) in the step that grants it."""

    def __init__(self, source: PoolSource, device: torch.device, holder: Holder) -> None:
        self.source = source
        self.device = device
        self.holder = holder
        self.entry: Entry | None = None
        self.waiting = False  # counted in the entry's waiters
        self.first = True  # the first try (counts the hit or the miss)
        self.read: CallerRead | None = None  # what the caller read itself (its first try)
