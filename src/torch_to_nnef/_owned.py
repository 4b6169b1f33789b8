"""Locks that tell whether the calling thread holds them.

A garbage collection runs finalizers (and closes abandoned generators and coroutines) on
whatever thread allocates, amid whatever that thread is doing: inside a critical section,
perhaps. Such a finalizer must not wait for anything that needs a lock its own thread holds.
:func:`owned_lock` makes a reentrant lock, only so that :func:`held_here` can ask whether the
calling thread holds it: nothing relies on taking one twice.

The lock itself is returned, not a wrapper: its ``with`` runs no Python code of its own, so a
``KeyboardInterrupt`` cannot land between taking it and the block that gives it back.
"""

from __future__ import annotations

import threading

__all__ = ["held_here", "owned_lock"]


def owned_lock() -> threading.RLock:
    """A new lock that knows the thread holding it (see :func:`held_here`)."""
    return threading.RLock()


def held_here(lock: threading.RLock) -> bool:
    """Whether the calling thread holds ``lock``, made by :func:`owned_lock`."""
    return bool(lock._is_owned())  # type: ignore[attr-defined]
