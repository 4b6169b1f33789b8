"""Steps that Ctrl-C does not cut in half.

Python's default SIGINT handler raises ``KeyboardInterrupt`` in the main thread between any
two bytecodes, and so does ``asyncio.run``'s at a second Ctrl-C. A step that must end once
begun (a payload file renamed over the old one, then the tensor switched to the new file)
runs in an :class:`InterruptHold`: from its :meth:`~InterruptHold.start` to the end of its
``with`` block, a SIGINT is recorded instead, and the handler it held runs as the block ends
(Python's default one raises ``KeyboardInterrupt`` there).

Signal handlers run in the main thread only. A hold holds whatever handler was set from
Python (the default one, ``asyncio.Runner``'s, an application's); in another thread, under a
handler that is none (ignored, or the system's default), or inside a hold already started, it
changes nothing. A child forked (by another thread) while a hold is in force gets the handler
the hold replaced back: the step it held goes on in the parent.
"""

from __future__ import annotations

# The C functions under ``signal``'s wrappers, which convert handlers to and from enum
# members at 2 to 3 us a call: a hold (one per mapped load) takes 1.5 us instead of 10.
import _signal  # type: ignore[import-not-found]  # no stub; the module ``signal`` wraps
import _thread
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

__all__ = ["InterruptHold", "hold_sigint", "restore_sigint"]

_replaced: list[Any] = []
"""The handlers the holds in force replaced, the first one first (main thread only)."""

_main: list[int | None] = [threading.main_thread().ident]
"""The identity of the main thread (that of the thread that forked, in a forked child). Read
instead of asking ``threading``: a hold runs no function of ``threading.py``, whose lock code
a Ctrl-C may cut, in the threads that wait for the pool (a thread reading a payload it missed
holds Ctrl-C as it reads)."""


def _on_main_thread() -> bool:
    """Whether the calling thread is the one signal handlers run on."""
    return _thread.get_ident() == _main[0]


def hold_sigint(handler: Callable[[int, FrameType | None], Any]) -> tuple[bool, Any]:
    """Install ``handler`` for SIGINT, from the main thread only. Return whether it was
    installed, and the handler it replaced (for :func:`restore_sigint`)."""
    if not _on_main_thread():
        return False, None
    try:
        previous = _signal.signal(signal.SIGINT, handler)
    except (ValueError, TypeError):  # no signals here (an embedded interpreter)
        return False, None
    _replaced.append(previous)
    return True, previous


def restore_sigint(previous: Any) -> None:
    """Put back the SIGINT handler :func:`hold_sigint` replaced (``None``: one set from
    outside Python, which Python cannot put back: the system's default then)."""
    if _replaced:  # first: a Ctrl-C raised once the handler is back leaves no stale entry
        _replaced.pop()
    _signal.signal(signal.SIGINT, _handler(previous))


def _handler(previous: Any) -> Any:
    return signal.SIG_DFL if previous is None else previous


def _restore_in_child() -> None:
    """After ``fork``, in the child: no hold is in force there (the thread holding runs in
    the parent only), so the handler the first hold replaced is put back. The thread that
    forked is the child's main thread (``threading``'s own hook, registered first, said so)."""
    _main[0] = threading.main_thread().ident
    if _replaced:
        previous = _replaced[0]
        _replaced.clear()
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, _handler(previous))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_in_child)


class InterruptHold:
    """A ``with`` block whose end Ctrl-C does not cut once :meth:`start` was called.

    :meth:`start` is called where the part that must not be cut begins (at the top of the
    block, or just before an irreversible step inside a callee); a ``KeyboardInterrupt`` before
    it lands as usual. Each SIGINT received after it runs the handler it held when the block
    ends, which raises ``KeyboardInterrupt`` there, in place of any exception the block
    raised, as Ctrl-C would have been (Python's default handler; ``asyncio.run``'s cancels
    its main task at the first and raises at the second).
    """

    # The state of a hold that never started, read from the class: most holds never start
    # (off the main thread), and one made per step of the pool costs no ``__init__`` call.
    _holding = False
    _received = 0
    _previous: Any = None

    def __enter__(self) -> InterruptHold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._holding:
            return
        previous = self._previous
        restore_sigint(previous)
        self._holding = False
        received, self._received = self._received, 0
        for _ in range(received):
            previous(signal.SIGINT, None)

    def start(self) -> None:
        """Hold SIGINT from now to the end of the block (in the main thread, under a handler
        set from Python; a no-op elsewhere, inside a hold in force, and when already
        holding)."""
        if not _on_main_thread():  # first: most holds run on other threads
            return
        if self._holding or _replaced or not callable(_signal.getsignal(signal.SIGINT)):
            return
        self._holding, self._previous = hold_sigint(self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received += 1
