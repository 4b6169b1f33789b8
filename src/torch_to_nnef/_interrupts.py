"""Steps that Ctrl-C does not cut in half.

Python's default SIGINT handler raises ``KeyboardInterrupt`` in the main thread between any
two bytecodes. A step that must end once begun (a payload file renamed over the old one, then
the tensor switched to the new file) runs in an :class:`InterruptHold`: from its
:meth:`~InterruptHold.start` to the end of its ``with`` block, a SIGINT is recorded instead,
and ``KeyboardInterrupt`` is raised as the block ends.

Only the main thread receives ``KeyboardInterrupt``, and only while Python's default handler is
installed: in another thread, under a handler the application installed, or inside a hold
already started, a hold changes nothing. A child forked (by another thread) while a hold is
in force gets the handler the hold replaced back: the step it held goes on in the parent.
"""

from __future__ import annotations

# The C functions under ``signal``'s wrappers, which convert handlers to and from enum
# members at 2 to 3 us a call: a hold (one per mapped load) takes 1.5 us instead of 10.
import _signal  # type: ignore[import-not-found]  # no stub; the module ``signal`` wraps
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


def hold_sigint(handler: Callable[[int, FrameType | None], Any]) -> tuple[bool, Any]:
    """Install ``handler`` for SIGINT, from the main thread only. Return whether it was
    installed, and the handler it replaced (for :func:`restore_sigint`)."""
    if threading.current_thread() is not threading.main_thread():
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
    the parent only), so the handler the first hold replaced is put back."""
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
    it lands as usual. A SIGINT received after it is raised as ``KeyboardInterrupt`` when the
    block ends, in place of any exception the block raised, as Ctrl-C would have been.
    """

    def __init__(self) -> None:
        self._holding = False
        self._received = False

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
        restore_sigint(signal.default_int_handler)
        self._holding = False
        if self._received:
            self._received = False
            raise KeyboardInterrupt

    def start(self) -> None:
        """Hold SIGINT from now to the end of the block (in the main thread, under Python's
        default handler; a no-op elsewhere, and when already holding)."""
        if self._holding or _signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self._holding = hold_sigint(self._record)[0]

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received = True
