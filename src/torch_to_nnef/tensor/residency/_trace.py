"""Trace-driven read-ahead: learn the order in which forwards touch offloaded tensors.

Inside ``pool.scope()`` of a pool made with ``read_ahead=``, every offloaded tensor a
forward touches is recorded, per thread, in the order of the touches. :class:`AccessTrace`
keeps, for each tensor, the one touched right after it the last time (its successor): a
forward's order, and the wrap from its last tensor to the next forward's first, is learned in
one pass, and a change of order (prefill then decode, another model in the same pool) is
learned the first time it happens. From the tensor just touched, the tensors to read ahead are
its successors, in order, as long as their bytes fit in the window.

:class:`ReadAhead` acts on it for a pool: it begins leases on the tensors of the window that
are not resident (their loads start at once, in order) and holds them until they are touched,
or until they leave the window; a held value is never evicted, so nothing the window needs
next is evicted to make room for what it needs later. Its counters tell the accesses that
found their value read ahead from those that had to load it on demand.
"""

from __future__ import annotations

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


class AccessTrace:
    """The learned access order of tensors (by key) and the read-ahead window over it.

    Pure: no pool, no I/O. Thread-safe; each thread has its own "previous access".

    Args:
        window_bytes: how many bytes the read-ahead may cover beyond the tensor touched.

    Attributes:
        window_bytes: as given.
        relearned: how many successors changed after they were first learned.
    """

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.relearned = 0
        self._successor: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._lock = fork_safe_lock()  # a forked child's forward says it was forked
        self._local = threading.local()

    def touched(self, key: int, nbytes: int) -> list[int]:
        """Record that this thread touched ``key``; return the keys to read ahead, in order."""
        previous = getattr(self._local, "previous", None)
        self._local.previous = key
        with self._lock:
            self._sizes[key] = nbytes
            if previous is not None and previous != key:
                known = self._successor.get(previous)
                if known is not None and known != key:
                    self.relearned += 1
                self._successor[previous] = key
            return self._ahead(key)

    def forget(self, key: int) -> None:
        """Drop ``key`` (a tensor that no longer exists) from the learned order."""
        with self._lock:
            self._sizes.pop(key, None)
            self._successor.pop(key, None)
            for before in [b for b, after in self._successor.items() if after == key]:
                del self._successor[before]

    def _ahead(self, key: int) -> list[int]:
        planned: list[int] = []
        room = self.window_bytes
        current = self._successor.get(key)
        while current is not None and current != key and current not in planned:
            size = self._sizes.get(current, 0)
            if size > room:
                break
            room -= size
            planned.append(current)
            current = self._successor.get(current)
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
    """

    read_ahead: int
    on_demand: int
    relearned: int


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
        self._sources: weakref.WeakValueDictionary[int, PoolSource] = weakref.WeakValueDictionary()
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
        return ReadAheadStats(self._read_ahead, self._on_demand, self._trace.relearned)

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
            if self._sources.get(key) is not source:
                self._trace.forget(key)  # a new tensor reusing a dead one's id
                self._sources[key] = source
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
                ahead = self._sources.get(k)
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
            if lease is None or self._sources.get(id(source)) is not source:
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
