"""Waits for another thread's change that Ctrl-C cuts cleanly.

A ``threading.Condition`` runs Python code of its own while it holds its lock: its
``__enter__`` once the lock is taken, its ``wait`` between giving the lock back and taking it
again. Ctrl-C in the main thread lands between any two lines of it; landing there, it leaves
the lock held by a thread that has left the ``with`` block (every thread that changes what
the condition guards then blocks for ever) or released twice (a ``RuntimeError`` in place of
the ``KeyboardInterrupt``).

Here the lock guarding the change is a plain lock, taken with a C-level ``with`` (Python runs
no handler between taking it and entering the block), and each waiter blocks in the C
``acquire`` of a lock of its own, a *gate*, which the thread making the change releases.
A waiter interrupted anywhere leaves nothing held: at worst a gate is released that nobody
waits at any more. A release lost to an interrupt of the changing thread (between its change
and the gates' release) costs a waiter one look at the state :data:`LOOK` seconds later,
never a wait for ever. A waiter calls ``waiters.wait(lock, ready)`` (or, to act on the
state under the lock as it finds it ready, loops on :meth:`Waiters.enlist` itself); where the
change is made: ``with lock: change(); waiters.release()``.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable

__all__ = ["LOOK", "Waiters"]

LOOK = 0.1
"""Seconds a waiter blocks at its gate before it looks at the state again."""


class Waiters:
    """The gates of the threads waiting for a change (used under the lock guarding it)."""

    __slots__ = ("_gates",)

    def __init__(self) -> None:
        self._gates: list[_thread.LockType] = []

    def wait(self, lock: threading.Lock | threading.RLock, ready: Callable[[], object]) -> None:
        """Block until ``ready()``, asked under ``lock`` (the lock the change is made under),
        is true."""
        while True:
            with lock:
                if ready():
                    return
                gate = self.enlist()
            gate.acquire(timeout=LOOK)

    def enlist(self) -> _thread.LockType:
        """A new gate, closed, that :meth:`release` opens: the calling thread waits at it
        (``gate.acquire(timeout=LOOK)``) once it let go of the lock."""
        gate = _thread.allocate_lock()
        gate.acquire()
        self._gates.append(gate)
        return gate

    def release(self) -> None:
        """Open every gate enlisted so far: their waiters look at the state again."""
        gates, self._gates = self._gates, []
        for gate in gates:
            gate.release()
