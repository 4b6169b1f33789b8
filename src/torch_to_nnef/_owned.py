"""What the calling thread is amid: a lock it holds, a garbage collection it runs.

A garbage collection runs finalizers (and closes abandoned generators and coroutines) on
whatever thread allocates, amid whatever that thread is doing: inside a critical section,
perhaps, of this package's or of any other code. Such a finalizer must not wait for anything
that needs a lock its own thread holds. :func:`owned_lock` makes a reentrant lock, only so
that :func:`held_here` can ask whether the calling thread holds it: nothing relies on taking
one twice. :func:`collecting_here` says whether the calling thread runs a collection (its
finalizers), whatever locks it holds: the answer for locks that cannot be asked.

The lock itself is returned, not a wrapper: its ``with`` runs no Python code of its own, so a
``KeyboardInterrupt`` cannot land between taking it and the block that gives it back.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["collecting_here", "held_here", "owned_lock"]


def owned_lock() -> threading.RLock:
    """A new lock that knows the thread holding it (see :func:`held_here`)."""
    return threading.RLock()


def held_here(lock: threading.RLock) -> bool:
    """Whether the calling thread holds ``lock``, made by :func:`owned_lock`."""
    return bool(lock._is_owned())  # type: ignore[attr-defined]


_collector: int | None = None
"""The thread running a garbage collection, if any (one at a time: collections do not nest),
as the collection's first callback named it; ``None`` when none does, or when a Ctrl-C cut
that callback."""

_phase = OrderedDict.fromkeys(("start", "stop"))
"""The phase of the latest collection, as its last key: ``"start"`` while one runs. Kept by
a callback written in C (``move_to_end``, given the phase and the collection's details, a
true ``last``), which runs no Python code: Python runs a pending Ctrl-C's handler at the
start of the first Python code a collection calls, a callback of it perhaps, and discards the
``KeyboardInterrupt`` (reported as unraisable), so that a Python callback may not run at all."""


def collecting_here() -> bool:
    """Whether the calling thread runs a garbage collection (a finalizer of it, then)."""
    if next(reversed(_phase)) != "start":
        return False
    # A collection whose callback naming its thread was cut runs on the main thread: that is
    # the only thread a Ctrl-C lands on. (A name left by a cut end of the collection before
    # is the main thread's too.)
    collector = _collector or threading.main_thread().ident
    return collector == threading.get_ident()


def _note_collection(phase: str, info: dict[str, Any]) -> None:
    global _collector
    _collector = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_phase.move_to_end)  # type: ignore[arg-type]  # (the details as ``last``)
gc.callbacks.append(_note_collection)
