"""The actor: the one owner of a pool's state and byte accounting.

Every method named ``*_step`` or ``_on_*`` is a synchronous state transition: it runs on the
pool's event-loop thread, never awaits, and leaves the invariants true. A step that must wait
for I/O returns the :class:`~torch_to_nnef.tensor.residency._state.Job` to wait for; the
runtime's driver waits, then runs the step again. Disk reads and writes run as jobs on the
runtime's I/O workers; their completions come back as transitions on the loop thread.

Other threads never call a transition. They read :attr:`Actor.published` (resident values,
one :class:`~torch_to_nnef.tensor.residency._state.Slot` each) and take or end leases on a
slot under :attr:`Actor.lock`, the only state they share with the actor, or, for a ``read``
lease (taken on a hit, or granted by the actor on a miss), as one of the slot's readers,
without the lock (see ``Slot``); the actor closes a slot under the same lock before it
evicts, replaces or drops its value, and never does while the slot has leases.
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from torch_to_nnef._owned import owned_lock
from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import PoolSource
from torch_to_nnef.tensor.residency._policy import RetentionPolicy, ScheduledPolicy
from torch_to_nnef.tensor.residency._spares import SpareBuffers
from torch_to_nnef.tensor.residency._state import (
    CLOSE_UNDER_WAY,
    CallerRead,
    Entry,
    Holder,
    Job,
    PoolStats,
    Slot,
    Ticket,
)

__all__ = ["Actor", "SubmitJob"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")

SubmitJob = Callable[[Job], None]
"""How the actor starts a disk job: ``submit(job)`` (one that ran already is only ended)."""

LOCK_FREE_READERS = getattr(sys, "_is_gil_enabled", lambda: True)()
"""Whether ``read`` leases on hits are taken without the lock (:meth:`Actor.take_reader`):
that relies on the GIL, which makes a list's ``append`` and ``remove`` atomic and every
thread see the others' writes in order. Without it (a free-threaded build that runs with
the GIL off), they take the lock as every other lease does."""


class Actor:
    """Owner of a pool's entries, counters and jobs (see the module docstring)."""

    def __init__(self, policy: RetentionPolicy) -> None:
        self.policy = policy
        self.entries: dict[int, Entry] = {}
        self.published: dict[int, Slot] = {}  # open slots, read lock-free by other threads
        # Values holding a read_write lease's change that was dropped (by id, weakly): no
        # handle that got one before the change hands it out (see holds_dropped_change).
        self.dropped_values: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        # Slot fields, hit counters and touches of other threads (a finalizer asks whether
        # its own thread holds it: see Runtime.may_wait_for_itself).
        self.lock = owned_lock()
        self.resident_bytes = 0
        self.evicting_bytes = 0  # resident bytes already on their way out (write-back running)
        self.in_use_bytes = 0  # resident bytes leased or awaited (outside the budget)
        self.pins = 0  # pinned entries (their values count toward the budget)
        self.loading_bytes = 0  # bytes of the loads running
        # The most the values in use and the loads have held at once: spare buffers fill at
        # most the part of it they do not hold now (see _spare_room).
        self.active_peak = 0
        self.closing = False
        self.closed = False
        # Ends when the close under way ends (or gives up): another close waits for it.
        self.close_ended: Job | None = None
        self.submit: SubmitJob | None = None  # set by the runtime while it serves
        # A transition is applying what other threads did (set as the wake-up flag below is
        # cleared, so that reads of the state from other threads wait for its end).
        self.syncing = False
        self.jobs: set[Job] = set()
        self.spares = SpareBuffers()
        self._hits = self._misses = self._loads = self._bytes_read = 0
        self._evictions = self._write_backs = self._bytes_written = self._load_errors = 0
        self._reused_buffers = self._wasted_prefetches = self._caller_reads = 0
        self._stall_seconds = 0.0  # added by any thread, under the lock
        self._lock_hits = 0  # hits served without the actor, counted under the lock
        # ... and without it (each counter atomic): hits of resolve, and those of readers,
        # the tokens drawn less those of readers refused. A token stands for its reader among
        # a slot's readers.
        self._free_hits = itertools.count()
        self._reader_tokens = itertools.count(1)
        self._readers_refused = itertools.count()
        # Tokens of the readers the actor admits on a miss (_admit_reader): below zero, no hits.
        self._admitted_tokens = itertools.count(-1, -1)
        # Recency of those hits, replayed by the next transition (bounded: only the most
        # recent matter).
        self._touches: deque[int] = deque(maxlen=8192)
        # The keys of those hits that were a consumer's, for a policy that follows them
        # (RetentionPolicy.follows_hits; None for the others, which the touches serve).
        self._consumer_hits: deque[int] | None = deque(maxlen=8192) if policy.follows_hits else None
        # Slots whose leases went from none to some or back, by other threads.
        self._changed: deque[Slot] = deque()
        # A wake-up for leases ended over the budget is on its way to the loop: later ones
        # ride on it (its sync sees every slot queued before it ran).
        self._wake_pending = False
        # Bytes of values in use whose last lease other threads ended since the last sync:
        # back in the cache as far as those threads can tell.
        self._released_bytes = 0
        # An eviction due once the request the driver runs is answered (see enforce_soon), or
        # once a load's waiters are (_on_loaded): reads of the state from other threads,
        # which an answer may wake before it ran, wait for it (Runtime.catch_up).
        self.enforce_due = False
        # Leased slots of values a direct write superseded: their holders keep them; new
        # requests get the new payload (see _supersede). Dropped once their leases ended.
        self.superseded: set[Slot] = set()
        # What finalizers left for the next transition (see later): the ends of leases whose
        # holders were collected, and abandons of requests whose coroutines were.
        self._later: deque[Callable[[], object]] = deque()
        self._later_running = 0  # of those, taken out and running (nested: an abandon's sync)
        # Tensors whose keys the policy remembers beyond their values (a schedule), weakly:
        # one collected is forgotten by the next transition (see watch).
        self._watched: dict[int, weakref.KeyedRef[int, PoolSource]] | None = (
            {} if policy.remembers_keys else None
        )
        # The weak references (keyed by the tensor's id) of the tensors watched (above) or held
        # weakly by their entries (see _let_go) that were collected since the last transition,
        # which forgets them first thing (see sync). Appended by the references' callback, a
        # C call that no Ctrl-C can cut, on whatever thread the collection runs.
        self._collected: deque[weakref.KeyedRef[int, PoolSource]] = deque()
        # Wakes the loop that serves the pool, taking no lock (set by the runtime, weakly):
        # a collection asks for that transition soon, not at the next request.
        self.waker: weakref.WeakMethod[Callable[[], None]] | None = None
        self._warned_outside_leases = False  # a change outside leases was logged once
        # What a collection wakes the loop through (see _let_go): a reference to the actor
        # would keep it alive through its entries.
        self._wake_on_collection = partial(_wake, weakref.ref(self))

    # ------------------------------------------------------------------------------------------
    # Introspection and hits without the actor (any thread)
    # ------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        return PoolStats(
            hits=self._hits
            + self._lock_hits
            + _counted(self._free_hits)
            + _counted(self._reader_tokens)
            - 1
            - _counted(self._readers_refused),
            misses=self._misses,
            loads=self._loads,
            bytes_read=self._bytes_read,
            evictions=self._evictions,
            write_backs=self._write_backs,
            bytes_written=self._bytes_written,
            load_errors=self._load_errors,
            reused_buffers=self._reused_buffers,
            stall_seconds=self._stall_seconds,
            wasted_prefetches=self._wasted_prefetches,
            caller_reads=self._caller_reads,
            pinned_bytes=storage.pinned_bytes(),
        )

    def add_stall(self, seconds: float) -> None:
        """Count ``seconds`` a request spent blocked on a load (any thread)."""
        with self.lock:
            self._stall_seconds += seconds

    def leased_count(self) -> int:
        leased = sum(1 for e in self.entries.values() if e.slot is not None and e.slot.leases)
        return leased + sum(1 for slot in self.superseded if slot.leases)

    def fresh_slot(self, source: PoolSource, device: torch.device | None) -> Slot | None:
        """The published slot of ``source`` when it holds the current value on ``device``
        (``None``: the tensor's target device), and is ``source``'s own: not that of a
        collected tensor whose ``id`` ``source`` was given (see :meth:`_let_go`). Reads the
        slot and the tensor's hit state, nothing else of the tensor."""
        slot = self.published.get(id(source))
        if slot is None:
            return None
        state = slot.hit_state
        if state is not source._hit_state:  # (each tensor has its own, for life)
            return None  # a collected tensor's, whose entry the next transition removes
        if slot.version is not state.version_for(self):
            return None
        if slot.aliased and not slot.leases and slot.value._version != slot.seen:
            return None  # changed through a view, outside any lease: see _stale
        if device is None:
            device = state.device
        # Requests usually carry the very device object the slot was created with.
        if slot.device is not device and slot.device != device:
            return None
        return slot

    def note_alias(self, sources: Sequence[PoolSource], results: tuple[torch.Tensor, ...]) -> None:
        """An op given ``sources`` returned ``results`` (any thread): for each resident value
        of theirs that a view among the results, or a result that is the value itself
        (``t.float()`` of a float tensor), may alias, hits check from now on that it was not
        changed through it (see :meth:`fresh_slot`). A mark is never taken back: a value
        marked once is not looked at again."""
        published = self.published
        for source in sources:
            slot = published.get(id(source))
            if slot is not None and not slot.aliased and _aliases(results, slot.value):
                slot.aliased = True

    def count_hit(self, slot: Slot) -> None:
        """Count a hit served from ``slot``, found in :attr:`published` (any thread): without
        the lock where readers take none (see :data:`LOCK_FREE_READERS`)."""
        if LOCK_FREE_READERS:
            next(self._free_hits)
            self._touches.append(slot.key)
            if self._consumer_hits is not None:
                self._consumer_hits.append(slot.key)
            slot.used = True
            return
        with self.lock:
            self._lock_hits += 1
            self._touches.append(slot.key)
            if self._consumer_hits is not None:
                self._consumer_hits.append(slot.key)
            slot.used = True

    def touch(self, key: int) -> None:
        """Note a use of a published value that is no request (a prefetch; any thread)."""
        self._touches.append(key)  # (atomic: the actor takes touches one by one)

    def try_lease(self, slot: Slot, holder: Holder, count: bool = True) -> bool:
        """Take a lease on an open slot for ``holder`` without the actor (any thread); counts
        the hit, unless ``count`` is false (a request counted already), and the value's use
        (its recency is the lease's end: :meth:`release` notes it). A ``read_write`` lease
        waits for a write-back of the value (refused here)."""
        with self.lock:
            if not slot.open or (holder.read_write and slot.writing):
                return False
            self._grant(slot, holder)
            if not holder.ahead:
                self._lock_hits += count
                if count and self._consumer_hits is not None:
                    self._consumer_hits.append(slot.key)
                slot.used = True
        return True

    def _grant(self, slot: Slot, holder: Holder, note: bool = True) -> None:
        """Give ``holder`` a lease on ``slot`` (under the lock). The count and the holder
        change together, before any call an interrupt could land on. ``note``: queue the
        slot for the actor's next transition, which counts its leases (the actor taking a
        value back for a lease counts it at once instead)."""
        slot.granted += 1
        slot.writers += holder.read_write
        holder.slot = slot
        holder.reader = 0
        if note and not slot.changed:
            self._changed.append(slot)
            slot.changed = True

    def take_reader(self, slot: Slot, holder: Holder) -> bool:
        """Take a ``read`` lease on ``slot`` for ``holder`` (a request's, not a read-ahead's)
        without the lock (any thread), counting the hit, as :meth:`try_lease` takes one;
        whether it did. The holder joins the slot's readers, then looks whether the slot is
        open: once closed, the actor looked at the readers (see ``Slot``), and the holder
        leaves (the actor may have counted it as holding the value).

        Whoever queues the slot for the actor sets ``changed``, and the actor clears it
        before it counts the leases: a holder that finds it set joined before that count."""
        if not LOCK_FREE_READERS:
            return self.try_lease(slot, holder)
        holder.reader = next(self._reader_tokens)  # (not the holder: its collection ends it)
        holder.slot = slot
        slot.readers.append(holder.reader)
        if slot.open:
            slot.used = True
            if self._consumer_hits is not None:
                self._consumer_hits.append(slot.key)
            if not slot.changed:
                slot.changed = True
                self._changed.append(slot)
            return True
        next(self._readers_refused)
        self.end_reader(holder)
        return False

    def _admit_reader(self, slot: Slot, holder: Holder) -> None:
        """:meth:`take_reader` on the loop thread, for a lease the actor grants on an open
        slot (no other thread closes one). Its request was counted as the miss or hit it was:
        its token, drawn below zero, counts as no hit."""
        holder.reader = next(self._admitted_tokens)
        holder.slot = slot
        slot.readers.append(holder.reader)
        if not slot.changed:
            slot.changed = True
            self._changed.append(slot)

    def end_reader(self, holder: Holder) -> bool:
        """End the lease of a reader (:meth:`take_reader`; any thread; idempotent, and a call
        again finishes an end an interrupt cut): as :meth:`release` returns, whether the
        actor must hear of it now. It leaves the readers first, then looks at the other
        leases: of two holders ending the last leases at once, one sees the other gone and
        queues the slot. Only the last lease of a value the actor counts as in use (or of one
        to remap) takes the lock, for the part :meth:`release` takes it for."""
        slot, token = holder.slot, holder.reader
        if slot is None:
            return False
        try:  # (not contextlib.suppress: its calls are points an interrupt lands on)  # noqa: SIM105
            slot.readers.remove(token)
        except ValueError:
            pass  # left already: this finishes an end an interrupt cut
        self._touches.append(slot.key)
        wake = False
        if not slot.readers and not slot.granted:
            if not slot.changed:
                slot.changed = True
                self._changed.append(slot)
            if slot.tracked or slot.entry.remapped is not None:
                with self.lock:
                    wake = not slot.leases and self._last_ended(slot)
        if holder.reader == token:  # (else its owner took another lease since: a cancel's)
            holder.slot = None
            holder.reader = 0
        return wake

    def enter(self, holder: Holder) -> None:
        """``holder``'s ``read_write`` lease reaches its owner, who may change the value from
        now on (any thread): its change and those of the other entered leases are one."""
        with self.lock:
            slot = holder.slot
            if slot is not None and not holder.entered:
                holder.entered = True
                slot.changing += 1
                slot.enters += 1
                entry = slot.entry
                if entry.strong is None:  # a change to write back: the entry holds the tensor
                    entry.strong = entry.alive  # (the lease's owner holds it)

    def changed_under_read_lease(self, slot: Slot, version: int | None) -> bool:
        """Whether the holder of a read lease on ``slot`` (a streamed forward, which got the
        value when its torch version counter read ``version``) changed the value in place
        since: a change of its own, which it keeps as a ``read_write`` lease would (any
        thread, the lease still held). ``version`` ``None``: changed where the counter does
        not see it (a batch norm's running statistics), so taken as changed.

        The ``read_write`` leases of the pool share that value: what the counter moved by
        under them is theirs, never the holder's. Up to ``seen``, recorded as each ended
        (a change the holder made before is in the value their end noted); all of it while
        one is entered, as the last of them to end notes the value as it is then, with
        whatever the holder changed before that."""
        with self.lock:
            if slot.changing:
                return False
            current = slot.value._version
            return version is None or current != max(version, slot.seen)

    def release(self, holder: Holder, changed: bool) -> bool:
        """End ``holder``'s lease, if it holds one (any thread; idempotent). Return whether
        the actor must hear of it now: this was the last lease of a value it counts as in
        use, that value must leave (it was not retained, or back in the cache it puts the
        pool over its budget, with the values other threads released since the actor last
        looked), and no wake-up for ended leases is on its way already. Otherwise the actor's
        next transition (or the wake-up on its way) takes note.

        ``changed``: the holder may have changed the value (a ``read_write`` lease that was
        entered). The change becomes the latest write of the tensor before the lease ends, so
        that no write-back of the value can start in between; a direct write since the value
        was read stands instead (the change is dropped). While other entered ``read_write``
        leases hold the value, the change is theirs too: the last of them to end notes it. A
        lease never entered (an abandoned acquire's) changed nothing and notes nothing.

        The last lease decides to note under the lock and notes under the tensor's; a lease
        entered in between (``slot.enters`` moved) may be changing the value already, so the
        note does not happen: the change is handed to that lease, or, if it ended meanwhile
        and handed it back, noted again.
        """
        if holder.reader:
            return self.end_reader(holder)
        slot = holder.slot
        if slot is None:
            return False
        changed = changed and holder.read_write
        if holder.read_write:
            with self.lock:
                if holder.slot is None:  # released meanwhile by another thread
                    return False
                if not holder.entered:
                    return self._ended(slot, holder, changed=False)
                if slot.changing > 1:
                    # Another entered read_write lease is changing the value: the change is
                    # not whole yet, and the last of them to end notes it. All in this step,
                    # with no call an interrupt could land on.
                    slot.unnoted = slot.unnoted or changed
                    return self._ended(slot, holder, changed=False)
                changed, slot.unnoted = changed or slot.unnoted, False
                enters = slot.enters
        dropped = False
        while changed:
            source = slot.entry.source
            if slot.reshaped():  # a lease ended without its exit, which puts the value back
                changed, dropped = False, True
                LOGGER.warning(
                    "%r was reshaped or retyped in place under a read_write lease that "
                    "ended without its exit (its owner was collected): the change is "
                    "dropped, and the pool loads the latest write again",
                    source.name,
                )
                break
            noted = source._note_unsaved(
                self, slot.value, slot.version, partial(slot.none_entered_since, enters)
            )
            if noted is not None:
                changed, dropped = noted, not noted
                if dropped:
                    LOGGER.warning(
                        "%r was written while a read_write lease held its older value: "
                        "the lease's change is dropped, the later write stands",
                        source.name,
                    )
                break
            with self.lock:  # a lease entered since: its change now, or back to this one
                if holder.slot is None:  # released meanwhile by another thread
                    return False
                if slot.changing > 1:
                    slot.unnoted = True
                    return self._ended(slot, holder, changed=False)
                slot.unnoted, enters = False, slot.enters
        with self.lock:
            if dropped:
                # The value holds the dropped change, which is no write of the tensor (the
                # direct write that stands may still be under way, the version unchanged):
                # no new hit or lease takes it, and the actor's next request drops it.
                slot.dropped = True
                self.dropped_values[id(slot.value)] = slot.value
                slot.open = False
                if self.published.get(slot.key) is slot:
                    self.published.pop(slot.key, None)
            if holder.slot is None:  # released meanwhile by another thread
                return False
            return self._ended(slot, holder, changed)

    def _ended(self, slot: Slot, holder: Holder, changed: bool) -> bool:
        """The end of :meth:`release` for the lease ``holder`` holds on ``slot`` (under the
        lock): the counts, and whether the actor must hear of it. The holder lets go of the
        slot, the counts drop and the slot whose last lease this was is queued for the
        actor's next transition in one step, with no call an interrupt could land on before
        the last of them (once the holder let go, a Ctrl-C leaves nothing for its exit to
        end: a slot left unqueued would stay counted as leased, its value in use for good)."""
        holder.slot = None
        slot.granted -= 1
        slot.writers -= holder.read_write
        if holder.entered:
            holder.entered = False
            slot.changing -= 1
        if holder.read_write:
            slot.seen = slot.value._version  # what the lease did is its change
        if changed:
            slot.dirty = True
        # (Counted without a call: see Slot.leases.)
        leased = slot.granted or slot.readers
        if not leased and not slot.changed:
            slot.changed = True
            self._changed.append(slot)
        self._touches.append(slot.key)
        if leased:
            return False
        # The slot was queued before this: a pending wake-up sees it.
        return self._last_ended(slot)

    def _last_ended(self, slot: Slot) -> bool:
        """The last lease on ``slot`` ended (under the lock, the slot queued): whether the
        actor must hear of it now (see :meth:`release`)."""
        entry = slot.entry
        wake = entry.remapped is not None  # the file written is mapped now (see _remap)
        if slot.tracked:
            self._released_bytes += entry.nbytes
            # Else a value the policy did not retain leaves with its last holder.
            if entry.retained:
                budget = self.policy.budget
                cached = self.resident_bytes - self.evicting_bytes - self.in_use_bytes
                if budget is not None and cached + self._released_bytes > budget:
                    wake = True
            else:
                wake = True
        if not wake:
            return False
        pending, self._wake_pending = self._wake_pending, True
        return not pending

    def drop(self, holder: Holder, changed: bool) -> None:
        """End the lease of a holder being collected, at the next transition (any thread, at
        any moment: takes no lock)."""
        slot = holder.slot
        if changed and holder.read_write and slot is not None and slot.reshaped():
            slot.open = False  # hits go to the actor, whose step drops the refused change
        self.later(partial(self.release, holder, changed))

    def later(self, call: Callable[[], object]) -> None:
        """Run ``call`` at the start of the next transition (any thread, at any moment: takes
        no lock): what a finalizer must not wait for, wherever a collection runs it."""
        self._later.append(call)

    def watch(self, source: PoolSource) -> None:
        """Have the policy forget ``source``'s key once the tensor is collected, before a new
        tensor given its id is asked for: the next transition does (see :attr:`_collected`).
        Only where the policy remembers keys beyond their values
        (:attr:`RetentionPolicy.remembers_keys`)."""
        watched = self._watched
        key = id(source)
        if watched is not None and key not in watched:
            watched[key] = weakref.KeyedRef(source, self._collected.append, key)

    def deferred(self) -> bool:
        """Whether calls wait for the next transition (:meth:`later`) or run now (any
        thread: the queue is read first, then the count of those taken out of it)."""
        return bool(self._later or self._collected) or self._later_running > 0

    def sync(self) -> None:
        """Take note of what other threads did since the last transition (first thing of
        each): the recency of their hits, and the leases they took or ended, which hold a
        value out of the budget while they last."""
        later = self._later
        while later:
            # Counted before it leaves the queue, so that a read of the state meanwhile
            # (``deferred``) waits for it: no pending handler runs before the ``try``.
            self._later_running += 1
            call = None
            try:
                call = later.popleft()
                call()
            except BaseException as error:
                if call is not None and not isinstance(error, Exception):
                    later.appendleft(call)  # an interrupt cut it: run again (idempotent)
                raise
            finally:
                self._later_running -= 1
        collected = self._collected
        if collected:
            while collected:
                self._forget_collected(collected[0])  # (idempotent: interrupted, runs again)
                collected.popleft()
            if not self.entries:
                self._forget_buffers()
        if not (self._touches or self._changed or self._consumer_hits):
            return
        with self.lock:
            # Readers append without the lock (see take_reader): a touch appended between
            # the copy and the clear is lost (a hint of recency), a queued slot never.
            keys = list(self._touches)
            self._touches.clear()
            # Taken one by one: a policy learning its pass needs every hit (bounded all the
            # same: of more hits between two steps, it learns the latest).
            hits = [] if self._consumer_hits is None else _take_all(self._consumer_hits)
            changed = _take_all(self._changed)
            self.syncing = True  # before the flag a reader looks at first
            self._wake_pending = False  # what a wake-up on its way would see is taken here
            self._released_bytes = 0
            for slot in changed:
                slot.changed = False
        try:
            self._apply(hits, keys, changed)
        finally:
            self.syncing = False

    def _apply(self, hits: list[int], keys: list[int], changed: list[Slot]) -> None:
        """The part of :meth:`sync` that applies what it took (loop thread)."""
        released = False
        superseded = self.superseded
        remaps = []  # (a removed entry holds no remapped value)
        for slot in changed:
            if not (slot.tracked or slot.granted or slot.readers or superseded) and (
                slot.entry.remapped is None
            ):
                # Leases taken and ended since the last look (most hits): nothing to do,
                # read without the lock, as a lease taken from now on queues the slot again.
                continue
            # The leases are counted and acted on in one hold of the lock: a lease that
            # ends meanwhile finds the value counted as held (and tells the actor if it
            # must), or not, never counted after it ended. A later change is queued behind.
            with self.lock:
                leased = slot.leases > 0
                if superseded and not leased:
                    superseded.discard(slot)
                entry = slot.entry
                if not leased and entry.remapped is not None:
                    remaps.append(entry)
                if leased == slot.tracked:
                    continue  # e.g. a lease taken and ended since the last look
                if self.entries.get(entry.key) is entry and entry.slot is slot:
                    leased = self._track(entry, leased)
                    released = released or not leased
        for entry in remaps:
            self._remap(entry)
        for slot in changed:  # (an entered read_write lease held the tensor, say)
            if slot.entry.strong is not None:
                self._let_go(slot.entry)
        # Uses last: a value the end of its leases released takes its place from their
        # touches, in the order they ended (touches of held values are no-ops).
        access, watched = self.policy.access, self._watched
        for key in hits:
            if watched is None or key in watched:  # (not that of a tensor collected since)
                access(key)
        touch = self.policy.touch
        for key in keys:
            touch(key)
        if released:
            self.enforce()

    def leases_ended(self) -> None:
        """Leases ended by other threads put the pool over its budget (told without waiting)."""
        with self.lock:  # before sync: a lease ended after this point sends its own wake-up
            self.syncing = True
            self._wake_pending = False
            self._released_bytes = 0
        try:
            self.sync()
        finally:
            self.syncing = False

    def check_open(self) -> None:
        if self.closed:
            raise T2NErrorMisuse("the TensorResidencyPool is closed; create a new pool")
        if self.closing:
            raise T2NErrorMisuse(
                "the TensorResidencyPool is closing; create a new pool (if Ctrl-C stopped "
                "that close with its loop, `pool.close()` finishes it)"
            )

    def is_pinned(self, source: PoolSource) -> bool:
        entry = self.seen_entry(source)
        return entry is not None and entry.pinned

    def is_resident(self, source: PoolSource) -> bool:
        entry = self.seen_entry(source)
        return entry is not None and entry.resident

    def seen_entry(self, source: PoolSource) -> Entry | None:
        """``source``'s entry as a lock-free reader sees it (any thread: a hint), never that
        of a collected tensor whose ``id`` ``source`` was given, which the next transition
        removes."""
        entry = self.entries.get(id(source))
        return entry if entry is not None and entry.owned_by(source) else None

    def entry_of(self, source: PoolSource) -> Entry | None:
        """``source``'s entry, if any (loop thread): that of a collected tensor whose ``id``
        it was given is removed now, if the transition that removes it has not run yet."""
        entry = self.entries.get(id(source))
        if entry is not None and not entry.owned_by(source):
            assert entry.ref is not None
            self._forget_collected(entry.ref)
            return None
        return entry

    def dirty_entries(self) -> bool:
        return any(e.dirty or (e.slot is not None and e.slot.dirty) for e in self.entries.values())

    # ------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------
    def _entry_for(
        self, source: PoolSource, device: torch.device, read: CallerRead | None = None
    ) -> Entry:
        """The entry of ``source`` on ``device``, created (and its load started) when absent;
        ``read``: what the caller read itself, the load's outcome unless a write came since."""
        key = id(source)
        entry = self.entry_of(source)
        pinned = entry is not None and entry.pinned
        if entry is not None and self._stale(entry):
            entry = None
        else:
            pinned = False
        if entry is None:
            entry = Entry(key, source, device, source.payload_nbytes)
            self.entries[key] = entry
            self.watch(source)
            if pinned:  # a pin is on the tensor: it holds the new value
                self._hold(entry, pinned=True)
        elif entry.device != device:
            raise T2NErrorMisuse(
                f"{source.name!r} is resident on {entry.device}; a tensor cannot be resident on "
                f"two devices at once: evict it first or request it on {entry.device}"
            )
        if entry.value is None and entry.load is None:
            entry.strong = source  # (a new entry's is already)
            try:
                self._start_load(entry, read)
            except BaseException:  # (no worker to be had, say): the request fails, and
                self._drop_valueless(entry)  # the next one loads again
                raise
        return entry

    def _stale(self, entry: Entry) -> bool:
        """Drop a value whose tensor someone else wrote since it was read (``update_values``,
        an in-place op on the tensor itself, another pool's change); return whether it was
        dropped.

        New requests load the latest value; whoever holds the old value (a lease, a pin)
        keeps it. Leases still held on it count for ``close`` until they end; the caller
        moves the pin to the next entry (a pin is on the tensor).

        A value changed in place outside any ``read_write`` lease (through a view of it: see
        :meth:`_changed_outside_leases`) is dropped the same way: that change was no write
        of the tensor."""
        if entry.value is None:
            return False
        written = self._outdated(entry)
        if not written and not self._changed_outside_leases(entry):
            return False
        if entry.write is not None:
            return False  # requests wait for the write-back (_superseded_write), then drop it
        slot = entry.slot
        assert slot is not None
        with self.lock:
            slot.open = False
            self.published.pop(entry.key, None)
            self._take_dirty(entry)
            if slot.leases:
                self.superseded.add(slot)
        if entry.dirty:
            LOGGER.debug(
                "%r was written after the pool's unsaved change: that later write stands",
                entry.name,
            )
            entry.dirty = False
        if entry.pinned:
            self._hold(entry, pinned=False)
        if entry.tracked:
            self._hold(entry, track=False)
        entry.used = entry.used or slot.used  # hits served from the slot count as uses
        entry.slot = None  # the leases keep their slot; it no longer stands for the tensor
        self._remove(entry, reuse=not slot.leases)
        return True

    def _changed_outside_leases(self, entry: Entry) -> bool:
        """Whether ``entry``'s value was changed in place outside any ``read_write`` lease
        (its torch version counter moved since the load or the last such lease), now that
        no lease holds it (a holder may still make the change its own: a streamed forward
        keeps what it changed in place through a ``read_write`` lease as it ends).

        Such a change is no write: the value is dropped and loaded again (the change stays
        with whoever made it, as a view of a value loaded outside any pool keeps its own).
        On a dirty value, one whose pool's change reads outside the pool already see, it is
        kept as part of that change, which the write-back writes."""
        slot = entry.slot
        if slot is None:
            return False
        with self.lock:
            if slot.leases or slot.value._version == slot.seen:
                return False
            if not (entry.dirty or slot.dirty):
                if not self._warned_outside_leases:
                    self._warned_outside_leases = True
                    LOGGER.warning(
                        "the value of %r was changed in place outside a read_write lease (an "
                        "in-place op on a view of it, or on a value resolve() returned): that "
                        "is no write of the tensor, and the pool loads it again; write "
                        "through the tensor itself (`t[3:] = v`, `t.mul_(2)`) or a "
                        "read_write lease",
                        entry.name,
                    )
                return True
            slot.seen = slot.value._version
        return False

    def _superseded_write(self, entry: Entry) -> Job | None:
        """The write-back to wait for before ``entry``'s value, written over since it was
        read, can be dropped: a request waits for it rather than take the older value."""
        if entry.write is not None and self._outdated(entry):
            return entry.write
        return None

    def holds_dropped_change(self, value: torch.Tensor) -> bool:
        """Whether ``value`` (a value this pool loaded) holds a ``read_write`` lease's change
        that was dropped: it is no value of the tensor (any thread)."""
        return self.dropped_values.get(id(value)) is value

    def _outdated(self, entry: Entry) -> bool:
        """Whether ``entry``'s value is no longer the tensor's latest write: someone else
        wrote the tensor since it was read, or it holds a ``read_write`` lease's change that
        was dropped (see :meth:`release`), whatever its version says."""
        if entry.version is not entry.hit_state.version_for(self):
            return True
        slot = entry.slot
        return slot is not None and slot.dropped

    def resolve_step(
        self, source: PoolSource, device: torch.device, first: bool, read: CallerRead | None
    ) -> torch.Tensor | Job:
        """Serve a resident value, or return the job to wait for. ``first``: the request's
        first step, which counts it once, whatever comes after (a hit when it serves the
        value at once, else a miss) and notes the access. ``read``: what the caller read."""
        self.sync()
        self.check_open()
        entry = self._entry_for(source, device, read)
        taken = read is not None and read.taken
        write = self._superseded_write(entry)
        entry.used = True
        if first:
            if write is None and entry.value is not None and not taken:
                self._hits += 1
            else:
                self._misses += 1
            self.policy.access(entry.key)
        if write is not None:
            return write
        value = entry.value
        if value is not None:
            if taken:  # (just released to the policy: the most recent already)
                self.enforce_soon()  # what its arrival put over the budget, as a load's end
            else:
                self.policy.touch(entry.key)
            return value
        assert entry.load is not None
        return entry.load

    def prefetch_step(
        self, source: PoolSource, device: torch.device, pin: bool
    ) -> torch.Tensor | Job:
        """Start (or join) a load; with ``pin``, pin the value (idempotent)."""
        self.sync()
        self.check_open()
        entry = self._entry_for(source, device)
        write = self._superseded_write(entry)
        if write is not None:
            return write
        if pin and not entry.pinned:
            self._hold(entry, pinned=True)
            self.enforce()  # a pinned value counts toward the budget, even one taken back
        if entry.value is not None:
            self.policy.touch(entry.key)
            return entry.value
        assert entry.load is not None
        return entry.load

    def acquire_step(self, ticket: Ticket) -> torch.Tensor | Job:
        """Grant a lease on a resident value to ``ticket.holder``, or reserve it and return
        the job to wait for."""
        self.sync()
        if not ticket.waiting:
            self.check_open()
        entry: Entry | None = ticket.entry
        if entry is not None and (self.entries.get(entry.key) is not entry or self._stale(entry)):
            ticket.waiting = False  # its reservation left with that value
            entry = None
        read = None
        if entry is None:
            read, ticket.read = ticket.read, None
            entry = ticket.entry = self._entry_for(ticket.source, ticket.device, read)
        taken = read is not None and read.taken
        request = not ticket.holder.ahead  # a read-ahead's lease is no request
        if request:
            entry.used = True
            if ticket.first:
                self.policy.access(entry.key)
        write = entry.write
        if entry.value is not None and (
            write is None
            or not (ticket.holder.read_write or self._superseded_write(entry) is not None)
        ):
            if ticket.first:
                if taken:
                    self._misses += request
                else:
                    self._hits += request
            slot = entry.slot
            assert slot is not None
            if slot.open:
                # Taken as a thread takes a lease on a hit: the next transition counts it
                # as holding the value if it still does, and one ended before then costs
                # the actor nothing more. Meanwhile the value counts toward the budget (an
                # eviction skips it, and counts it as held then). A plain read lease joins
                # the readers, as a hit's does, so that its owner ends it without the lock.
                holder = ticket.holder
                if LOCK_FREE_READERS and not (holder.read_write or holder.ahead):
                    self._admit_reader(slot, holder)
                else:
                    with self.lock:
                        self._grant(slot, holder)
                if ticket.waiting:  # its reservation ends with the grant
                    self._hold(entry, waiters=-1)
                    self.enforce_soon()
            else:  # a value on its way out (a write-back runs): the lease takes it back
                with self.lock:
                    self._grant(slot, ticket.holder, note=False)
                self._hold(entry, waiters=-1 if ticket.waiting else 0, track=True)
            ticket.waiting = False
            value = entry.value
            if taken:
                self.enforce_soon()  # once leased: the value it just took is no victim
            # No touch: the lease's end touches the value.
            return value
        if ticket.first:
            self._misses += request
            ticket.first = False
        if not ticket.waiting:
            ticket.waiting = True
            self._hold(entry, waiters=1)
        pending = write if entry.value is not None else entry.load
        assert pending is not None
        return pending

    def abandon_acquire(self, ticket: Ticket) -> None:
        """Undo what an acquire whose value nobody will take holds (idempotent): its lease,
        unchanged, or its reservation."""
        self.sync()
        if self.release(ticket.holder, changed=False):
            self.leases_ended()
        if ticket.waiting:
            ticket.waiting = False
            held = ticket.entry
            if held is not None and self.entries.get(held.key) is held:
                self._hold(held, waiters=-1)
                self.enforce()

    def unpin_step(self, source: PoolSource) -> None:
        self.sync()
        self.check_open()
        entry = self.entry_of(source)
        if entry is None or not entry.pinned:
            return
        self._hold(entry, pinned=False)
        self.enforce()

    def declare_schedule(self, sources: Sequence[PoolSource]) -> None:
        self.sync()
        self.check_open()
        if isinstance(self.policy, ScheduledPolicy):
            for source in sources:
                self.watch(source)
            self.policy.declare([id(source) for source in sources])

    # ------------------------------------------------------------------------------------------
    # Loads
    # ------------------------------------------------------------------------------------------
    def _job(
        self,
        kind: str,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        transition: Callable[[Job], None],
        recover: Callable[[Job, BaseException], None],
    ) -> Job:
        """Start a job; ``recover``: what ends it when its ``transition`` raises before it
        did (see :meth:`Job.complete`)."""
        if self.submit is None:
            raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
        job = Job(kind, function, args, transition, recover)
        self.submit(job)
        self.jobs.add(job)
        return job

    def _start_load(self, entry: Entry, read: CallerRead | None = None) -> None:
        source = entry.source
        version = source._hit_state.version_for(self)  # the load reads this version or a newer one
        entry.version = version
        if read is not None and read.token is source._hit_state.last_write():
            # The caller read it (no write since): the load's outcome, kept at once. (One
            # the pool cannot serve is read again, by a load that reports why.)
            value = read.value
            if value is not None and (
                type(value) is torch.Tensor or _unservable(source, value) is None
            ):
                entry.copied = False
                self._caller_reads += 1
                self._keep_read(entry, read.take())
                return
        # Mapped reads off: the value is read into host buffers (those of a value evicted
        # before, if free), which may serve a later load in turn. Decided here, once: a
        # value whose pages are the file's is never read into.
        copied = entry.copied = entry.device.type == "cpu" and not storage.mapped_reads()
        out = self.spares.take(source.storage_key) if copied else None
        # The whole load (read into the host buffers, copy to the device, decode) is one
        # job of the I/O workers; it runs to its end whatever happens to its waiters.
        entry.load = self._job(
            "load",
            source._reload_unmanaged,
            (entry.device, out, False if copied else None),
            partial(self._on_loaded, entry),
            partial(self._load_aborted, entry),
        )
        self._reused_buffers += out is not None
        entry.load.version = version
        self.loading_bytes += entry.nbytes
        self._note_active()

    def _on_loaded(self, entry: Entry, job: Job) -> None:
        self.sync()
        self._end_load(entry, job)
        value: torch.Tensor = job.outcome
        error = job.failure
        if error is None and type(value) is not torch.Tensor:
            error = _unservable(entry.source, value)
        if error is not None:
            self._load_failed(entry, job, error)
            return
        value = self._keep_loaded(entry, value)  # (a load whose end raised counts as failed)
        # Due as its waiters are answered: a thread that then reads the state waits for the
        # eviction (Runtime.catch_up), which runs once they were.
        self.enforce_soon()
        job.finish(value, None)
        self.enforce()

    def _keep_read(self, entry: Entry, value: torch.Tensor) -> None:
        """Keep ``value``, what the caller read, as the end of the load of ``entry`` it stands
        for (:meth:`_keep_loaded`). One the pool cannot apply fails as such a load's end
        fails (:meth:`_load_aborted`), its error raised to the request that took the read."""
        try:
            self._keep_loaded(entry, value)
        except BaseException as error:
            if entry.value is value and self.entries.get(entry.key) is entry:
                self._remove(entry, reuse=False, evicted=False)
            failure = _not_applied(entry.source, "load", error)
            self._drop_failed_load(entry, failure)
            if isinstance(error, Exception):
                raise failure from error
            raise

    def _keep_loaded(self, entry: Entry, value: torch.Tensor) -> torch.Tensor:
        """Make ``value``, what a load of ``entry`` read, its resident value, unless the entry
        left or has a value already, and count the load; the value its requests get. The
        caller evicts what it puts over the budget (:meth:`enforce`) once its requests have
        what they hold on to."""
        read = entry.nbytes
        if self.entries.get(entry.key) is entry and entry.value is None:
            nbytes = read
            if type(value) is not torch.Tensor:  # may hold more than its file (Q4_0 codes)
                nbytes = storage.value_nbytes(value)
            self._make_resident(entry, value, nbytes)
        elif entry.value is not None:
            value = entry.value
        self._loads += 1
        self._bytes_read += read
        return value

    def _end_load(self, entry: Entry, job: Job) -> None:
        """``entry``'s load ``job`` runs no more (once: a recovery may ask again)."""
        if job in self.jobs:
            self.jobs.discard(job)
            self.loading_bytes -= entry.nbytes
            if entry.load is job:
                entry.load = None

    def _load_failed(self, entry: Entry, job: Job, error: BaseException) -> None:
        """``entry``'s load ``job`` brought no value: its waiters get ``error``."""
        self._drop_failed_load(entry, error)
        job.finish(None, error)

    def _drop_failed_load(self, entry: Entry, error: BaseException) -> None:
        """A load of ``entry`` brought no value (``error``): an entry left without a value
        goes (the next request loads again)."""
        self._load_errors += 1
        self._drop_valueless(entry)
        LOGGER.debug("load of %r failed: %r", entry.source.name, error)

    def _drop_valueless(self, entry: Entry) -> None:
        """Forget ``entry`` if it is the tensor's and holds no value."""
        if entry.value is None and self.entries.get(entry.key) is entry:
            self._forget(entry)
            self.policy.forget(entry.key, entry.nbytes, entry.retained)

    def _load_aborted(self, entry: Entry, job: Job, error: BaseException) -> None:
        """The transition of ``entry``'s load ``job`` raised ``error`` before it ended the job:
        the load fails as one that failed on its worker, and a value it made resident goes."""
        self._end_load(entry, job)
        value = job.outcome
        if value is not None and entry.value is value and self.entries.get(entry.key) is entry:
            self._remove(entry, reuse=False, evicted=False)
        self._load_failed(entry, job, _aborted(entry.source, job, error))

    def _make_resident(self, entry: Entry, value: torch.Tensor, nbytes: int) -> None:
        slot = Slot(entry, value, entry.version)  # reads the value: before any change
        entry.nbytes = nbytes
        entry.value, entry.slot = value, slot
        self.resident_bytes += nbytes
        held, in_use = entry.holds()
        if in_use:
            self.in_use_bytes += nbytes
        self._note_active()
        with self.lock:
            self._publish(entry, slot)
        entry.retained = self.policy.admit(entry.key, nbytes)
        if not entry.retained:
            LOGGER.debug(
                "%r (%d bytes) is delivered without cache retention under %s",
                entry.name,
                nbytes,
                self.policy.strategy.name,
            )
        if not held:
            self._to_eviction_order(entry)

    # ------------------------------------------------------------------------------------------
    # Holds and byte accounting
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _in_use(entry: Entry) -> bool:
        """Whether a resident value is in use (leased or awaited) rather than cached
        (:meth:`Entry.holds`)."""
        return entry.holds()[1]

    def _hold(
        self,
        entry: Entry,
        *,
        waiters: int = 0,
        pinned: bool | None = None,
        track: bool | None = None,
    ) -> None:
        """Change what holds ``entry`` (waiters, its pin, counted leases), keeping every
        count right."""
        if entry.value is None:  # not loaded yet: neither in use nor known to the policy
            entry.waiters += waiters
            if pinned is not None:
                self._pin(entry, pinned)
            return
        was_held, was_in_use = entry.holds()
        entry.waiters += waiters
        if pinned is not None:
            self._pin(entry, pinned)
        slot = entry.slot
        if track is not None and slot is not None:
            with self.lock:
                slot.tracked = track
                self._take_dirty(entry)
        held, in_use = entry.holds()
        if held and entry.strong is None:  # busy again: the entry holds the tensor
            entry.strong = entry.alive  # (None: collected, its removal queued)
        if in_use != was_in_use:
            self.in_use_bytes += entry.nbytes if in_use else -entry.nbytes
            if in_use:  # less in use changes neither the peak nor the spares' room
                self._note_active()
        if held == was_held:
            return
        if held:
            self.policy.hold(entry.key)
            if entry.evicting:  # a value on its way out is wanted again
                self._set_evicting(entry, False)
                self._reopen(entry)
        else:
            self._to_eviction_order(entry)

    def _pin(self, entry: Entry, pinned: bool) -> None:
        self.pins += pinned - entry.pinned
        entry.pinned = pinned

    def _forget(self, entry: Entry) -> None:
        """Take ``entry`` out of :attr:`entries` (with its pin, if any)."""
        del self.entries[entry.key]
        self.pins -= entry.pinned

    def _maybe_release(self, entry: Entry) -> None:
        if entry.value is not None and not entry.held:
            self._to_eviction_order(entry)

    def _to_eviction_order(self, entry: Entry) -> None:
        """A resident value no longer held goes (back) into the policy's eviction order,
        unless it is on its way out already: a victim is a value whose eviction frees its
        bytes. Its entry lets go of the tensor if the value is clean and idle (the tensor
        may be collected at once: the caller reads it no more)."""
        if not entry.evicting:
            self.policy.release(entry.key, entry.nbytes, entry.retained)
            self._let_go(entry)

    def _let_go(self, entry: Entry) -> None:
        """Hold ``entry``'s tensor weakly if its value is resident, clean and idle: nothing
        holds it (waiters, a pin, counted leases), no load, write-back or eviction of it
        runs, no change of it waits to be written (``dirty``, the slot's ``dirty``), and no
        ``read_write`` lease is entered on it (which holds the tensor again from its entry
        on: :meth:`enter`). Whoever makes the entry busy again holds the tensor again first
        (:meth:`_hold`, :meth:`_entry_for`), as one who holds it (a request, a lease) does.

        Once the tensor's user dropped it, the tensor is collected, on whatever thread the
        collection runs (amid a transition perhaps, whatever locks are held): the callback
        of the weak reference queues it (:attr:`_collected`, a C call that takes no lock
        and that no Ctrl-C can cut), and a second one wakes the loop (best effort), whose
        transition removes the entry first thing (:meth:`_forget_collected`). Until then a
        new tensor given that ``id`` finds the value published: hits, and the lock-free
        readers of :attr:`entries`, check that a slot or an entry is their tensor's
        (:meth:`fresh_slot`, :meth:`seen_entry`)."""
        slot = entry.slot
        if (
            entry.strong is None
            or slot is None
            or entry.value is None
            or entry.load is not None
            or entry.write is not None
            or entry.evicting
            or entry.dirty
            or entry.held
            or self.entries.get(entry.key) is not entry
        ):
            return
        source = entry.strong
        with self.lock:  # (a read_write lease enters, and marks the slot dirty, under it)
            if slot.dirty or slot.changing or slot.writing:
                return
            if entry.ref is None:
                # The queue's reference is made last, so that its callback runs first
                # (CPython calls the newest reference's first): the wake-up finds it queued.
                entry.waker = weakref.ref(source, self._wake_on_collection)
                entry.ref = weakref.KeyedRef(source, self._collected.append, entry.key)
            entry.strong = None
        # (``source`` goes as this returns: the tensor is collected then if nothing else
        # holds it.)

    def _forget_collected(self, ref: weakref.KeyedRef[int, PoolSource]) -> None:
        """A tensor watched by ``ref`` was collected (see :attr:`_collected`): the policy
        forgets its key (:meth:`watch`), and its entry, if it still holds the tensor by
        ``ref``, leaves the pool with its value, counted as an eviction (idempotent). Its
        value was clean and idle as the entry let go of the tensor; a lease left over is one
        whose holder was collected too, ended by a call queued beside this one."""
        key = ref.key
        watched = self._watched
        if watched is not None and watched.get(key) is ref:
            del watched[key]
            self.policy.forget_keys((key,))
        entry = self.entries.get(key)
        if entry is None or entry.ref is not ref or entry.alive is not None:
            return
        slot = entry.slot
        if slot is not None:
            with self.lock:
                slot.open = False
                if self.published.get(key) is slot:
                    self.published.pop(key, None)
            if entry.tracked:
                self._hold(entry, track=False)
        self._remove(entry, reuse=False)  # (its buffers go with it: the tensor never loads)

    @staticmethod
    def _take_dirty(entry: Entry) -> None:
        """Move the dirty mark left by leases on the slot to the entry (under the lock)."""
        slot = entry.slot
        if slot is not None and slot.dirty:
            slot.dirty = False
            entry.dirty = True

    def _close_slot(self, entry: Entry) -> bool:
        """Stop handing ``entry``'s value out without the actor, unless a lease holds it:
        then count those leases as holding it and return ``False``. Leases counted before
        that ended since the actor last looked hold it no more: an evicted value is held by
        nothing."""
        slot = entry.slot
        if slot is None:
            return True
        with self.lock:  # counted and acted on at once, as in _apply
            leased = bool(slot.leases)
            if not leased:
                slot.open = False
                if slot.readers:  # joined before the close: it holds the value
                    slot.open = leased = True
                else:
                    self.published.pop(entry.key, None)
            self._take_dirty(entry)
            if leased != slot.tracked:
                leased = self._track(entry, leased)
                if not leased:  # the last reader left as it was counted
                    return self._close_slot(entry)
        return not leased

    def _track(self, entry: Entry, leased: bool) -> bool:
        """Count the leases on ``entry``'s slot as holding its value, or no longer
        (``leased``; under the lock); whether they do. Readers leave without the lock: once
        counted, one that left before it looked at ``tracked`` is seen gone here, and one
        that leaves after sees it set (and tells the actor)."""
        self._hold(entry, track=leased)
        slot = entry.slot
        if leased and slot is not None and not slot.leases:
            self._hold(entry, track=False)
            return False
        return leased

    def _reopen(self, entry: Entry) -> None:
        slot = entry.slot
        if slot is not None and entry.value is not None and not self.closing and not slot.dropped:
            with self.lock:
                self._publish(entry, slot)

    def _publish(self, entry: Entry, slot: Slot) -> None:
        """Open ``slot`` and publish it (under the lock), unless ``entry``'s tensor was
        collected (its entry's removal is queued: see :meth:`_let_go`)."""
        if entry.alive is None:
            slot.open = False  # (its removal is queued)
            return
        slot.open = True
        self.published[entry.key] = slot

    def enforce(self) -> None:
        """Evict what the policy names so that unheld values fit the budget; no eviction is
        due once it returned (``enforce_due``)."""
        budget = self.policy.budget
        cached = self.resident_bytes - self.evicting_bytes - self.in_use_bytes
        excess = 0 if budget is None else cached - budget
        for key in self.policy.victims(excess):
            entry = self.entries.get(key)
            if entry is not None and entry.value is not None and not entry.held:
                self._evict(entry)
        self.enforce_due = False

    def enforce_soon(self) -> None:
        """:meth:`enforce` once the driver answered the request whose step calls this (or the
        load's end answered its waiters), in the same transition: the caller's wake-up, which
        takes a while to land, goes first, and the eviction runs meanwhile instead of before
        it (a lease granted on a value just loaded then costs no more than a ``resolve`` of
        it). Reads of the state from other threads wait for it (``Runtime.catch_up``)."""
        self.enforce_due = True

    def _note_active(self) -> None:
        """After values or loads were added: raise the peak in use, shrink the spares' room."""
        active = self.in_use_bytes + self.loading_bytes
        if active > self.active_peak:
            self.active_peak = active
        if self.spares.nbytes:
            self.spares.shrink(self.spare_room())

    def _forget_buffers(self) -> None:
        """Every tensor the pool served is gone (the last ones collected): no load it knows
        of will come, and the spare buffers and the peak that sized them were the dropped
        model's. Both go, so that the pool keeps none of that model's memory, nor sizes the
        next model's spares by it."""
        self.spares.clear()
        self.active_peak = 0

    def spare_room(self) -> int:
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

    # ------------------------------------------------------------------------------------------
    # Eviction and write-back
    # ------------------------------------------------------------------------------------------
    def _evict(self, entry: Entry) -> None:
        """Remove an unheld value, writing it back first when it is dirty."""
        if not self._close_slot(entry):
            return  # leased by a thread: counted as held now
        if entry.dirty and entry.write is None and self.submit is None:
            # No loop serves the pool (an `async with` exit that failed): no write-back can
            # start, so the changed value stays, for the close to write.
            self._reopen(entry)
            self._to_eviction_order(entry)
            return
        if entry.dirty or entry.write is not None:
            self._set_evicting(entry, True)
            if entry.write is None:
                self._start_write(entry)
            return
        self._remove(entry)

    def _set_evicting(self, entry: Entry, evicting: bool) -> None:
        if entry.evicting != evicting:
            entry.evicting = evicting
            self.evicting_bytes += entry.nbytes if evicting else -entry.nbytes
            if evicting:  # out of the eviction order (see _to_eviction_order)
                self.policy.hold(entry.key)

    def _remove(self, entry: Entry, reuse: bool = True, evicted: bool = True) -> None:
        """Forget ``entry``; with ``reuse``, its CPU buffers may serve a later load. A value
        that was never served (``evicted`` false) counts as no eviction."""
        if entry.evicting:
            self._set_evicting(entry, False)
        if self._in_use(entry):
            self.in_use_bytes -= entry.nbytes
        self._forget(entry)
        slot, entry.slot = entry.slot, None  # the slot refers to the entry: no cycle left
        if slot is not None and slot.open:  # (an eviction closed it already)
            with self.lock:
                slot.open = False
                self.published.pop(entry.key, None)
        self.policy.forget(entry.key, entry.nbytes, entry.retained)
        value, entry.value, entry.remapped = entry.value, None, None
        if value is not None:
            self.resident_bytes -= entry.nbytes
            if evicted:
                self._evictions += 1
                self._wasted_prefetches += not (entry.used or (slot is not None and slot.used))
            source = entry.alive if reuse and entry.copied else None
            buffers = None if source is None else source._host_buffers(value)
            if source is not None and buffers is not None:
                self.spares.offer(
                    source.storage_key, entry.nbytes, value, buffers, self.spare_room()
                )

    def _start_write(self, entry: Entry) -> Job | None:
        """Start writing ``entry``'s value back; ``None`` while a ``read_write`` lease holds
        it (its change is not whole yet: it is written once the lease ended).

        New ``read_write`` leases are refused (``writing``) before the write-back can copy
        the value, and only when none is held, in one step under the lock.
        """
        value = entry.value
        assert value is not None
        slot = entry.slot
        if slot is not None:
            with self.lock:
                if slot.writers:
                    return None
                slot.writing = True
        source = entry.source
        source._announce_write()  # copies of the tensor wait for this write from now on
        try:
            job = self._job(
                "write",
                source._write_back,
                (value, self),
                partial(self._on_written, entry, value),
                partial(self._write_aborted, entry),
            )
        except BaseException:
            source._end_write()
            if slot is not None:
                with self.lock:
                    slot.writing = False
            raise
        entry.write = job
        entry.dirty = False
        if entry.stuck:  # a failed write-back retried: evictable again (evicting waits for it)
            entry.stuck = False
            self._maybe_release(entry)
        return job

    def _on_written(self, entry: Entry, written: torch.Tensor, job: Job) -> None:
        self.sync()
        self._end_write(entry, job)
        error = job.failure
        if error is not None:
            LOGGER.warning("write-back of %r failed: %r", entry.source.name, error)
            self._write_failed(entry, job, error)
            return
        slot = entry.slot
        current = self.entries.get(entry.key) is entry
        version = job.outcome
        if version is not None:  # else a later write superseded the value: nothing written
            self._write_backs += 1
            self._bytes_written += entry.source.payload_nbytes  # the file's (see _on_loaded)
            entry.version = version  # the file holds the pool's value (or a later write)
            if slot is not None:
                with self.lock:
                    slot.version = version
        job.finish(None, None)
        if entry.evicting and current:
            with self.lock:
                self._take_dirty(entry)
            if entry.dirty:  # written to again meanwhile
                self._start_write(entry)
            else:
                self._remove(entry)
        elif current:
            if version is not None and entry.value is written:
                self._start_remap(entry, version)
            self._maybe_release(entry)  # back in the eviction order (after a failed write-back)
        self.enforce()

    def _end_write(self, entry: Entry, job: Job) -> None:
        """``entry``'s write-back ``job`` runs no more: ``read_write`` leases are granted
        again (idempotent: a recovery may ask again)."""
        self.jobs.discard(job)
        if entry.write is job:
            entry.write = None
        slot = entry.slot
        if slot is not None:
            with self.lock:
                slot.writing = False

    def _write_failed(self, entry: Entry, job: Job, error: BaseException) -> None:
        """``entry``'s write-back ``job`` wrote nothing: the value stays resident and dirty,
        out of the eviction order (no retry on every transition while the disk is full), for
        a flush to write; its waiters get ``error``."""
        entry.dirty = True
        if self.entries.get(entry.key) is entry:
            was_held = entry.held
            entry.stuck = True
            if not was_held:
                self.policy.hold(entry.key)
            self._set_evicting(entry, False)
            self._reopen(entry)
        job.finish(None, error)
        self.enforce()  # the value stays, out of the order: others may have to go

    def _write_aborted(self, entry: Entry, job: Job, error: BaseException) -> None:
        """The transition of ``entry``'s write-back ``job`` raised ``error`` before it ended
        the job: the write-back fails as one that failed on its worker (the value stays dirty:
        what it holds is written by the next flush, never lost)."""
        self._end_write(entry, job)
        self._write_failed(entry, job, _aborted(entry.source, job, error))

    def _job_aborted(self, source: PoolSource, job: Job, error: BaseException) -> None:
        """The transition of ``job``, a job of ``source`` that no entry waits for, raised
        ``error`` before it ended the job: the job ends with the error."""
        self.jobs.discard(job)
        job.finish(None, _aborted(source, job, error))

    def _start_remap(self, entry: Entry, version: object) -> None:
        """A value that stays after its write-back (a flush, or an eviction a lease took
        back), loaded as a mapping of the file the write replaced, keeps that file and its
        disk space alive: a job maps the file written, which :meth:`_remap` serves instead."""
        if entry.copied or entry.device.type != "cpu" or self.closing or self.submit is None:
            return  # (not loaded as a mapping, about to go, or no loop serves the pool)
        value = entry.value
        assert value is not None
        self._job(
            "remap",
            entry.source._map_written,
            (version, self),
            partial(self._on_remapped, entry, value, value._version),
            partial(self._job_aborted, entry.source),
        )

    def _on_remapped(self, entry: Entry, written: torch.Tensor, counter: int, job: Job) -> None:
        self.sync()
        self.jobs.discard(job)
        mapping: torch.Tensor | None = job.outcome if job.failure is None else None
        job.finish(None, None)
        if mapping is not None and self.entries.get(entry.key) is entry and entry.value is written:
            entry.remapped = (mapping, counter)
            self._remap(entry)

    def _remap(self, entry: Entry) -> None:
        """Serve the value mapping the file a write-back wrote (``entry.remapped``) instead
        of the value written, which maps the replaced file: as long as a mapping of that file
        lives, its disk space stays in use. Not while a lease holds the value: then at the
        transition that sees its last lease end (:meth:`_apply`). Not once the value changed
        again either (it goes with its eviction then, or a later write-back remaps it), nor
        while it is on its way out (its write-back runs): its slot stays closed, so that
        nothing takes it without the actor."""
        remapped = entry.remapped
        if remapped is None or self.closing or entry.evicting or not self._close_slot(entry):
            return
        entry.remapped = None
        mapping, counter = remapped
        old = entry.slot
        assert old is not None and entry.value is not None
        # (_close_slot took the change of the leases that ended since into ``dirty``.)
        if entry.dirty or old.dropped or old.writing or entry.value._version != counter:
            self._reopen(entry)
            return
        entry.value = mapping
        entry.slot = Slot(entry, mapping, entry.version)
        entry.slot.used = old.used
        self._reopen(entry)

    def evict_step(self, source: PoolSource) -> Job | None:
        """Evict ``source`` now; return the job to wait for (a load or a write-back) first."""
        self.sync()
        self.check_open()
        entry = self.entry_of(source)
        if entry is None:
            return None
        leased = entry.slot is not None and entry.slot.leases > 0
        if leased:
            raise _leased_eviction(source)
        if entry.pinned:
            raise T2NErrorMisuse(f"cannot evict {source.name!r} while it is pinned: unpin it first")
        if entry.load is not None:
            return entry.load
        if entry.write is not None:
            return entry.write
        if entry.waiters:
            return None  # a waiter is about to take it; nothing to evict
        if not self._close_slot(entry):
            raise _leased_eviction(source)
        if entry.dirty:
            self._set_evicting(entry, True)
            return self._start_write(entry)
        self._remove(entry)
        return None

    def flush_step(self, source: PoolSource | None) -> list[Job]:
        """Start write-backs of dirty values (all, or ``source``'s); return jobs to wait for.

        A value under a ``read_write`` lease is left for later (its eviction, the next flush
        or close): its change is not whole while the lease is held. The change of the
        leases that ended before it is written now (the tensor keeps it aside)."""
        self.sync()
        if source is None:
            entries = list(self.entries.values())
        else:
            found = self.entry_of(source)
            entries = [] if found is None else [found]
        jobs: list[Job] = []
        for entry in entries:
            if entry.slot is not None:
                with self.lock:
                    self._take_dirty(entry)
            if entry.load is not None:
                jobs.append(entry.load)
            elif entry.write is not None:
                jobs.append(entry.write)
            elif entry.dirty and entry.value is not None:
                job = self._start_write(entry)
                if job is None:  # the value, once its read_write lease ends; the earlier now
                    job = self._job(
                        "write",
                        entry.source._write_unsaved,
                        (self,),
                        self._on_job,
                        partial(self._job_aborted, entry.source),
                    )
                jobs.append(job)
        return jobs

    def _on_job(self, job: Job) -> None:
        """A job no entry waits for ended: its waiters take its outcome."""
        self.jobs.discard(job)
        job.finish(None, job.failure)

    def begin_close(self) -> None:
        self.sync()
        if self.closed:
            return
        self.check_open()
        with self.lock:
            leased = self._leased_names()
            if not leased:
                for slot in self.published.values():
                    slot.open = False
                leased = self._leased_names()  # readers that joined before the close
                if leased:
                    for slot in self.published.values():
                        slot.open = True
                else:
                    self.closing = True
                    self.close_ended = Job(CLOSE_UNDER_WAY, _nothing, (), _nothing)
                    self.published.clear()
        if leased:
            raise T2NErrorMisuse(
                f"cannot close the TensorResidencyPool while {len(leased)} value(s) are leased "
                f"or awaited by an acquire ({', '.join(map(repr, leased[:5]))}): exit their "
                "`acquire` blocks first (a forward through `stream_modules` that Ctrl-C "
                "interrupted in another thread holds its module's leases until its stream is "
                "closed)"
            )

    def _leased_names(self) -> list[str]:
        """The tensors whose values are leased or awaited by an acquire (under the lock)."""
        return [
            e.name
            for e in self.entries.values()
            if (e.slot is not None and e.slot.leases) or e.waiters
        ] + [slot.entry.name for slot in self.superseded if slot.leases]

    def abort_close(self) -> None:
        self.closing = False
        for entry in self.entries.values():
            if entry.resident:
                self._reopen(entry)
        self._close_ended()

    def finish_close(self) -> None:
        for entry in list(self.entries.values()):
            self._remove(entry)
        self.spares.clear()
        self.closing = False
        self.closed = True
        self._close_ended()

    def _close_ended(self) -> None:
        ended, self.close_ended = self.close_ended, None
        if ended is not None:
            ended.finish(None, None)


def _aliases(results: tuple[torch.Tensor, ...], value: torch.Tensor) -> bool:
    """Whether one of an op's ``results`` may alias ``value``: a view (of it or not), or it
    itself."""
    for result in results:
        if result is value or result._is_view():
            return True
        try:
            if result.data_ptr() == value.data_ptr():
                return True
        except RuntimeError:  # no storage to read (a sparse or fake tensor): not the value
            pass
    return False


def _aborted(source: PoolSource, job: Job, error: BaseException) -> BaseException:
    """What the waiters of ``source``'s ``job`` get when its transition raised ``error``
    before it ended the job: the job's own failure, if it failed (its transition failed as it
    told it), else a ``T2NErrorStorage`` saying what failed, chaining ``error``."""
    if job.failure is not None:
        return job.failure
    return _not_applied(source, job.kind, error)


def _not_applied(source: PoolSource, kind: str, error: BaseException) -> T2NErrorStorage:
    """The error of a ``kind`` of ``source`` (a job) that ended, whose end the pool could not
    apply (``error``, chained)."""
    aborted = T2NErrorStorage(
        f"the {kind} of {source.name!r} ended, but the pool could not apply its end: "
        f"{type(error).__name__}: {error}"
    )
    aborted.__cause__ = error
    return aborted


def _unservable(source: PoolSource, value: torch.Tensor) -> T2NErrorStorage | None:
    """Why the pool cannot serve ``value``, an opaque value that its class's
    ``from_offload_state`` built, or ``None``. An inference tensor (built under
    ``torch.inference_mode()``) keeps no version counter, which the pool reads of every value
    it serves (to tell a change made in place)."""
    with torch._C.DisableTorchFunctionSubclass():  # the tensor's flag, not its class's answer
        inference = value.is_inference()
    if not inference:
        return None
    return T2NErrorStorage(
        f"loading {source.name!r} built an inference tensor ({type(value).__name__}."
        "from_offload_state() ran under torch.inference_mode()), which a pool cannot serve: it "
        "tells changes made in place by the version counter that inference tensors lack; "
        "build the value outside inference mode (torch.no_grad() is enough)"
    )


def _nothing(*args: Any) -> None:
    """What the marker job of a close runs: nothing (it is never submitted)."""


def _counted(counter: itertools.count[int]) -> int:
    """The next number ``counter`` gives (read without drawing it)."""
    return int(repr(counter)[6:-1])


def _leased_eviction(source: PoolSource) -> T2NErrorMisuse:
    return T2NErrorMisuse(
        f"cannot evict {source.name!r} while it is leased: release its lease first (a "
        "stream_modules stream holds the first layers of its next forward until it is closed)"
    )


def _take_all(queue: deque[Any]) -> list[Any]:
    """Take every item out of ``queue``, which other threads append to meanwhile (one at a
    time: a copy and a ``clear`` would lose an append made in between)."""
    take = queue.popleft
    return [take() for _ in range(len(queue))]


def _wake(actor_ref: weakref.ref[Actor], _collected: weakref.ref[PoolSource]) -> None:
    """The callback of an entry's second weak reference to its tensor (see
    ``Actor._let_go``): the tensor was collected; its entry's removal (queued already) is
    asked of the loop now rather than at the pool's next request (best effort: any thread,
    no lock, and a Ctrl-C may cut it)."""
    actor = actor_ref()
    waker = None if actor is None or actor.waker is None else actor.waker()
    if waker is not None:
        waker()
