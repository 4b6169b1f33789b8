"""Trace-driven read-ahead: learn the order in which forwards touch offloaded tensors.

Inside ``pool.scope()`` of a pool made with ``read_ahead=``, every offloaded tensor a
forward touches is recorded, per thread, in the order of the touches. :class:`AccessTrace`
keeps, for each tensor, the one touched right after it the last time (its successor): a
forward's order, and the wrap from its last tensor to the next forward's first, is learned in
one pass, and a change of order (prefill then decode, another model in the same pool) is
learned the first time it happens. From the tensor just touched, the tensors to read ahead are
its successors, in order, as long as their bytes fit in the window.

The learned order holds only tensors that exist: :class:`ReadAhead` watches each tensor it
records through a weak reference whose callback queues it when it dies (``deque.append``: no
lock, no Python code, so it is safe in a garbage collection that runs while a lock here is
held, in a forked child and at exit), and drops the queued ones from its tables and the trace
at its next access. A long-lived pool that serves model after model holds what the living
ones need, and a new tensor that reuses a dead one's ``id`` learns its own successors: it
inherits none of the dead one's, even from a thread whose last access was the dead one.

:class:`ReadAhead` acts on it for a pool: it begins leases on the tensors of the window that
are not resident (their loads start at once, in order) and holds them until they are touched,
or until they leave the window; a held value is never evicted, so nothing the window needs
next is evicted to make room for what it needs later. Its counters tell the accesses that
found their value read ahead from those that had to load it on demand.
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torch_to_nnef._forksafe import fork_safe_lock

if TYPE_CHECKING:
    from torch_to_nnef.tensor.offload._protocol import PoolSource
    from torch_to_nnef.tensor.residency._handles import TensorResidencyLease
    from torch_to_nnef.tensor.residency._pool import TensorResidencyPool

__all__ = ["AccessTrace", "ReadAhead", "ReadAheadStats"]


class _Step:
    """A tensor of the learned order: its key, its size and the tensor touched right after
    it the last time. A forgotten one is marked gone: a thread whose last access it was, or a
    tensor whose successor it was, learns nothing through it."""

    __slots__ = ("gone", "key", "nbytes", "successor")

    def __init__(self, key: int, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.successor: _Step | None = None
        self.gone = False


class AccessTrace:
    """The learned access order of tensors (by key) and the read-ahead window over it.

    Pure: no pool, no I/O. Thread-safe; each thread has its own "previous access". Its
    memory is that of the keys it holds (``len(trace)``): its user forgets the keys of the
    tensors that no longer exist (:meth:`forget`), and a key touched again afterwards starts
    afresh, whatever a thread touched before it was forgotten.

    Args:
        window_bytes: how many bytes the read-ahead may cover beyond the tensor touched.

    Attributes:
        window_bytes: as given.
        relearned: how many successors changed after they were first learned.
    """

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.relearned = 0
        self._steps: dict[int, _Step] = {}
        self._lock = fork_safe_lock()  # a forked child's forward says it was forked
        self._local = threading.local()

    def __len__(self) -> int:
        """How many keys the learned order holds."""
        return len(self._steps)

    def touched(self, key: int, nbytes: int) -> list[int]:
        """Record that this thread touched ``key``; return the keys to read ahead, in order."""
        previous: _Step | None = getattr(self._local, "previous", None)
        with self._lock:
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = _Step(key, nbytes)
            else:
                step.nbytes = nbytes
            self._local.previous = step
            if previous is not None and previous is not step and not previous.gone:
                known = previous.successor
                if known is not step:
                    if known is not None and not known.gone:
                        self.relearned += 1
                    previous.successor = step
            return self._ahead(step)

    def forget(self, key: int) -> None:
        """Drop ``key`` (a tensor that no longer exists) from the learned order.

        Constant time: the tensors whose successor it was, and the threads whose last
        access it was, find it gone and learn nothing through it.
        """
        with self._lock:
            step = self._steps.pop(key, None)
            if step is not None:
                step.gone = True
                step.successor = None  # a gone step keeps nothing else alive

    def _ahead(self, step: _Step) -> list[int]:
        planned: list[int] = []
        room = self.window_bytes
        current = step.successor
        while (
            current is not None
            and not current.gone
            and current is not step
            and current.key not in planned
        ):
            if current.nbytes > room:
                break
            room -= current.nbytes
            planned.append(current.key)
            current = current.successor
        return planned


@dataclass(frozen=True)
class ReadAheadStats:
    """What the read-ahead did (see :class:`ReadAhead`).

    Attributes:
        read_ahead: accesses whose value had been read ahead (loaded, or loading, before it
            was needed).
        on_demand: accesses whose value was neither resident nor read ahead: loaded when
            needed, the caller waiting.
        relearned: successors of the learned order that changed.
        tensors: the tensors the learned order holds: those the scoped forwards touched
            that still exist (a dead tensor's are dropped at the next scoped access).
    """

    read_ahead: int
    on_demand: int
    relearned: int
    tensors: int


class _Window:
    """The tensors one thread's forward reads ahead now (its thread keeps it, the read-ahead
    only weakly: when the thread ends, its window goes)."""

    __slots__ = ("__weakref__", "keys")

    def __init__(self) -> None:
        self.keys: frozenset[int] = frozenset()


class ReadAhead:
    """Reads ahead, for one pool, along the order its scoped forwards touch tensors in.

    Each thread's forward has its own window (the tensors after the one it touched last); a
    value read ahead is held while it is in some thread's window, so that concurrent
    forwards (requests served at once) do not drop what the others read ahead.

    Args:
        pool: the pool.
        window_bytes: the bytes read ahead of the tensor touched, at most.
    """

    def __init__(self, pool: TensorResidencyPool, window_bytes: int) -> None:
        self._pool = weakref.ref(pool)
        self._trace = AccessTrace(window_bytes)
        # The tensors recorded, by id. A weak reference's callback appends it to ``_dead``
        # when its tensor dies (deque.append: atomic, no lock, no Python code); the next
        # access drops it from here and from the trace, under the lock (``_forget_dead``).
        self._sources: dict[int, weakref.KeyedRef[int, PoolSource]] = {}
        self._dead: collections.deque[weakref.KeyedRef[int, PoolSource]] = collections.deque()
        self._held: dict[int, TensorResidencyLease] = {}
        # Leases out of the windows that a thread is dropping (or holding while it resolves),
        # with that thread: whatever interrupts it, its next access or the pool's close drops
        # them. A lease is recorded here before it leaves ``_held``: it is never in neither.
        self._leaving: dict[TensorResidencyLease, int] = {}
        self._windows: weakref.WeakSet[_Window] = weakref.WeakSet()
        self._local = threading.local()
        self._lock = fork_safe_lock()  # a forked child's forward says it was forked
        self._read_ahead = 0
        self._on_demand = 0

    @property
    def window_bytes(self) -> int:
        """The bytes read ahead of the tensor touched, at most."""
        return self._trace.window_bytes

    def stats(self) -> ReadAheadStats:
        """The counters so far."""
        with self._lock:
            if self._dead:
                self._forget_dead()
            tensors = len(self._trace)
        return ReadAheadStats(self._read_ahead, self._on_demand, self._trace.relearned, tensors)

    def _source(self, key: int) -> PoolSource | None:
        """The living tensor recorded as ``key``, if any."""
        ref = self._sources.get(key)
        return None if ref is None else ref()

    def _forget_dead(self) -> None:
        """Drop the tensors that died from the tables and the trace (under the lock).

        A reference is dropped only while it is still the one recorded for its key (a new
        tensor reusing the id replaced it, and what the trace learned since is the new
        one's); it leaves the queue last, so that an interrupt anywhere leaves it to the
        next call.
        """
        dead = self._dead
        while dead:
            ref = dead[0]
            if self._sources.get(ref.key) is ref:
                self._trace.forget(ref.key)
                del self._sources[ref.key]
            dead.popleft()

    def _window(self) -> _Window:
        window: _Window | None = getattr(self._local, "window", None)
        if window is None:
            window = self._local.window = _Window()
            with self._lock:
                self._windows.add(window)
        return window

    def _leave(self, key: int, thread: int) -> TensorResidencyLease:
        """Move the held lease of ``key`` to those ``thread`` is dropping (under the lock)."""
        lease = self._held[key]
        self._leaving[lease] = thread
        del self._held[key]
        return lease

    def touched(
        self, source: PoolSource, device: torch.device | None
    ) -> TensorResidencyLease | None:
        """Record an access of ``source`` by a scoped forward and read ahead of it.

        Returns the lease that held ``source``'s value when it was read ahead: the caller
        lets it go (:meth:`let_go`) once it has resolved the value. A value that another
        thread's window holds stays held for that thread (``None`` is returned).
        """
        pool = self._pool()
        if pool is None:
            return None
        key = id(source)
        thread = threading.get_ident()
        window = self._window()
        held: TensorResidencyLease | None = None
        with self._lock:
            # What an interrupt left this thread dropping: it is no longer used.
            left = [lease for lease, owner in self._leaving.items() if owner == thread]
            if self._dead:
                self._forget_dead()
            ref = self._sources.get(key)
            if ref is None or ref() is not source:
                self._trace.forget(key)  # a new tensor reusing a dead one's id
                self._sources[key] = weakref.KeyedRef(source, self._dead.append, key)
            # The other threads' windows (none, usually: iterating them costs a few µs).
            others = [w for w in self._windows if w is not window] if len(self._windows) > 1 else []
            was_read_ahead = key in self._held
            if was_read_ahead and not any(key in other.keys for other in others):
                held = self._leave(key, thread)
        for lease in left:
            self.let_go(lease)
        resident = pool.is_resident(source)  # type: ignore[arg-type]
        with self._lock:
            if was_read_ahead:
                self._read_ahead += 1
            elif not resident:
                self._on_demand += 1
        planned = self._trace.touched(key, source.payload_nbytes)
        begin: list[PoolSource] = []
        with self._lock:
            window.keys = frozenset(planned)
            wanted = window.keys.union(*(other.keys for other in others))
            dropped = [self._leave(k, thread) for k in list(self._held) if k not in wanted]
            for k in planned:
                ahead = self._source(k)
                if k not in self._held and ahead is not None:
                    begin.append(ahead)
        for lease in dropped:  # left every window: the order changed
            self.let_go(lease)
        for ahead in begin:
            if pool.is_resident(ahead):  # type: ignore[arg-type]
                continue
            lease = pool.acquire(ahead, device)  # type: ignore[arg-type]
            lease.ahead = True  # no request: a value read and never used is a wasted read
            with self._lock:
                # Another forward may have begun one meanwhile: the first stands. A lease is
                # held here before it begins, where release() finds it whatever comes.
                if self._held.setdefault(id(ahead), lease) is not lease:
                    continue
                began = False
                try:
                    began = lease._begin()
                finally:
                    if not began:  # refused, or failed: it holds nothing
                        del self._held[id(ahead)]
                        lease._cancel()
            if not began:
                break  # on the pool's loop thread: no read-ahead there
        return held

    def drop(self, source: PoolSource) -> None:
        """Let go of the value of ``source`` that a window holds (an explicit eviction: the
        pool's user holds no lease on it to release); it is read ahead again when needed."""
        with self._lock:
            lease = self._held.get(id(source))
            if lease is None or self._source(id(source)) is not source:
                return
            lease = self._leave(id(source), threading.get_ident())
        self.let_go(lease)

    def let_go(self, lease: TensorResidencyLease) -> None:
        """Drop a lease taken out of the window (idempotent)."""
        lease._cancel()
        with self._lock:
            self._leaving.pop(lease, None)

    def release(self) -> None:
        """Drop every held lease (before the pool closes)."""
        with self._lock:
            held = [*self._held.values(), *self._leaving]
            self._held, self._leaving = {}, {}
        for lease in held:
            lease._cancel()
