"""Locks that a forked child gets afresh.

A thread of the parent may hold a lock at the moment another thread forks; the child has
only the forking thread, so a lock held by any other stays held in the child for ever and its
first user hangs. :class:`ForkSafeLock` is a plain mutex that an ``os.register_at_fork`` hook
replaces, in the child, by a new one. The state it guards is left as it is: a critical section
only ever makes small, self-contained changes (a set, a counter, a weak reference).
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` (``with`` only) that is unlocked in a forked child."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_in_child() -> None:
    for lock in list(_LOCKS):
        lock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_in_child)
