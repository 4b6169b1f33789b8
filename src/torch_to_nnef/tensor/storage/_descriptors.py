"""Descriptors of payload files kept open for mapped loads, one per file while it is unchanged.

A mapped load needs a descriptor of its file only for the ``mmap`` call. Opening, checking
and closing the file for every load cost a worker three system calls (about 14 us of a
100 us load on a warm page cache); a kept descriptor costs one ``stat`` of the path per load.
That ``stat`` is also the check that the file is the one the layout describes, as the
``fstat`` of a fresh descriptor was: its identity (device, inode, size, modification time,
see ``file_identity``) must equal the layout's, or the load is refused. A kept descriptor is
reused only for the identity it was opened with, and while it is open its inode cannot be
freed nor its number reused: the same device and inode name the same file. A file replaced
atomically (a new inode at the path) or modified in place (a new size or modification time)
is therefore never read through an old descriptor.

At most :data:`KEPT_FILES` files are kept open, the least recently used closed first; a
descriptor is closed once no load uses it (a load holds it from its lookup to the end of its
``mmap`` call), when its path shows another identity, or when the path is gone. Writers and
removers of payload files say so (:func:`forget`): a descriptor of a replaced or removed file
is closed at once, so that the old file's disk space is freed (a kept descriptor holds its
inode, as a live mapping of it does). A forked child closes its copies and starts afresh.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.tensor.storage._format import PayloadLayout, file_identity
from torch_to_nnef.tensor.storage._io import (
    check_regular,
    check_unchanged,
    open_error,
    open_for_reading,
)

__all__ = ["DESCRIPTORS", "KEPT_FILES", "Descriptors", "Kept", "forget"]

_T = TypeVar("_T")

KEPT_FILES = 32
"""Payload files kept open at most (a sharded checkpoint has a few dozen shards)."""


class Kept:
    """A descriptor kept open for the file of one identity."""

    __slots__ = ("fd", "identity", "retired", "users")

    def __init__(self, fd: int, identity: tuple[int, int, int, int]) -> None:
        self.fd = fd
        self.identity = identity
        self.users = 1
        self.retired = False


class Descriptors:
    """Kept descriptors by path (see the module's documentation); safe across threads."""

    def __init__(self, capacity: int = KEPT_FILES) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread holding _lock
        self._kept: OrderedDict[Path, Kept] = OrderedDict()
        self._forgotten: deque[Path] = deque()  # paths to forget, by any thread

    def _locked(self, step: Callable[..., _T], *args: Any) -> _T:
        """``step(*args)`` under the lock; then forget the paths a finalizer of this thread
        queued meanwhile (see :meth:`forget`)."""
        try:
            return self._held(step, *args)
        finally:
            if self._forgotten:
                self._forget_queued()

    def _held(self, step: Callable[..., _T], *args: Any) -> _T:
        """``step(*args)`` under the lock.

        A plain ``with`` of the lock, not a context manager written in Python: a Ctrl-C
        landing in such a manager's ``__enter__`` after it took the lock would leave the lock
        held (its ``__exit__`` never runs), and every later load would wait for it forever.
        """
        with self._lock:
            self._holder = threading.get_ident()
            try:
                return step(*args)
            finally:
                self._holder = None

    def forget(self, path: Path) -> None:
        """``path`` was replaced or removed: close its descriptor (once no load uses it).

        Any thread, at any moment: a finalizer (a tensor's file removal) may run while its
        own thread holds the lock, in which case that thread does it on leaving the lock.
        """
        self._forgotten.append(path)
        if self._holder != threading.get_ident():
            self._forget_queued()

    def _forget_queued(self) -> None:
        """Forget every queued path, in one hold of the lock per round: however many a
        collection queued, the stack does not grow with them.

        A Ctrl-C is raised once a round's descriptors are closed: one in between would leave
        them open for the process's life, out of the table and closed by no one. (Loads need
        no such hold here: a map holds one from its acquire to its release.)"""
        while self._forgotten:
            with InterruptHold() as hold:
                hold.start()
                for fd in self._held(self._retire_queued_locked):
                    os.close(fd)

    def _retire_queued_locked(self) -> list[int]:
        """:meth:`_forget_queued`'s round under the lock: the descriptors to close."""
        closing = []
        while self._forgotten:
            closing += self._retire_locked(self._forgotten.popleft(), None)
        return closing

    def acquire(self, layout: PayloadLayout) -> tuple[Kept, int]:
        """A descriptor of the file of ``layout`` and the file's size; :meth:`release` it.

        Called in a started ``InterruptHold`` that lasts to the release: a Ctrl-C between
        the two would leave the descriptor in use for good.

        Raises:
            T2NErrorStorage: the file is missing, not a regular file, or not the one
                ``layout`` was read from (replaced or modified since).
        """
        path = layout.path
        try:
            stat = os.stat(path)
        except OSError as exc:
            self._retire(path, None)
            raise open_error(path, exc) from exc
        identity = file_identity(stat)
        if identity != layout.identity:
            check_regular(path, stat)
            check_unchanged(layout, stat)  # a layout made by hand: its size alone is checked
        kept = self._locked(self._reuse_locked, path, identity)
        if kept is not None:
            return kept, stat.st_size
        fd, stat = open_for_reading(path)
        try:
            check_unchanged(layout, stat)  # replaced between the stat and the open
        except BaseException:
            os.close(fd)
            raise
        kept = Kept(fd, file_identity(stat))
        self._retire(path, kept)
        return kept, stat.st_size

    def release(self, kept: Kept) -> None:
        """The load that acquired ``kept`` is done with it."""
        if self._locked(self._release_locked, kept):
            os.close(kept.fd)

    def _reuse_locked(self, path: Path, identity: tuple[int, int, int, int]) -> Kept | None:
        """The descriptor kept for ``path`` if it is of ``identity``, with one more user."""
        kept = self._kept.get(path)
        if kept is None or kept.identity != identity:
            return None
        kept.users += 1
        self._kept.move_to_end(path)
        return kept

    @staticmethod
    def _release_locked(kept: Kept) -> bool:
        """One user less for ``kept``: whether it is to be closed (retired, unused)."""
        kept.users -= 1
        return kept.retired and not kept.users

    def _retire(self, path: Path, replacement: Kept | None) -> None:
        """Keep ``replacement`` for ``path`` (none: forget the path), retiring what it
        replaces and, over capacity, the least recently used descriptors."""
        for fd in self._locked(self._retire_locked, path, replacement):
            os.close(fd)

    def _retire_locked(self, path: Path, replacement: Kept | None) -> list[int]:
        """:meth:`_retire` under the lock; returns the descriptors to close once it is left."""
        retired = []
        old = self._kept.pop(path, None)
        if old is not None:
            retired.append(old)
        if replacement is not None:
            self._kept[path] = replacement
            while len(self._kept) > self._capacity:
                retired.append(self._kept.popitem(last=False)[1])
        for kept in retired:
            kept.retired = True
        return [kept.fd for kept in retired if not kept.users]

    def _forget_in_child(self) -> None:
        """After ``fork``, in the child: close the inherited copies, start afresh."""
        self._lock = threading.Lock()
        self._holder = None
        self._forgotten = deque()
        kept, self._kept = self._kept, OrderedDict()
        for entry in kept.values():
            with contextlib.suppress(OSError):
                os.close(entry.fd)


DESCRIPTORS = Descriptors()
"""The process's kept descriptors."""


def forget(path: Path) -> None:
    """The payload file at ``path`` was replaced or removed: close the descriptor kept for
    it, once no load uses it (any thread; a finalizer may call it)."""
    DESCRIPTORS.forget(path)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DESCRIPTORS._forget_in_child)
