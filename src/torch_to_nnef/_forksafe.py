"""Locks that a forked child gets unlocked.

A thread of the parent may hold a lock at the moment another thread forks; the child has
only the forking thread, so a lock held by any other stays held in the child for ever and its
first user hangs. :func:`fork_safe_lock` makes a plain ``threading.Lock`` that an
``os.register_at_fork`` hook releases in the child. The state it guards is left as it is: a
critical section only ever makes small, self-contained changes (a set, a counter, a weak
reference).

The lock itself is returned, not a wrapper: its ``with`` runs no Python code of its own, so a
``KeyboardInterrupt`` cannot land between taking it and the block that gives it back (one
landing at the entry of a Python ``__exit__`` left a wrapper's lock held for ever).
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["fork_safe_lock"]

_LOCKS: weakref.WeakSet[threading.Lock] = weakref.WeakSet()


def fork_safe_lock() -> threading.Lock:
    """A new ``threading.Lock``, released in a forked child if a thread held it at the fork."""
    lock = threading.Lock()
    _LOCKS.add(lock)
    return lock


def _release_in_child() -> None:
    # Only the forking thread runs here, and it holds none of these (no critical section
    # forks): one held now was held by a thread the child does not have.
    for lock in list(_LOCKS):
        if lock.locked():
            lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_release_in_child)
