"""Interrupts injected into a thread's own code with ``sys.settrace``: a
``KeyboardInterrupt`` raised on entry to a chosen function, where CPython runs a pending
signal handler (Ctrl-C)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["InterruptAt", "interrupted"]

Trace = Callable[[FrameType, str, Any], Any]


class InterruptAt:
    """A trace function raising KeyboardInterrupt on entry to the ``n``-th function called
    (counting those of files whose path contains ``within``); ``fired`` once it did.

    Finalizers and weak reference callbacks are left alone: an exception raised in one is
    lost by Python (reported as unraisable), whatever the code does."""

    def __init__(self, n: int, within: str = "") -> None:
        self.n, self.within = n, within
        self.calls = 0
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name == "__del__":
            return
        finalizers = ("weakref.py", "_weakrefset.py")
        if frame.f_code.co_filename.endswith(finalizers) or (
            frame.f_back is not None and frame.f_back.f_code.co_filename.endswith(finalizers)
        ):
            return
        if self.within not in frame.f_code.co_filename:
            return
        self.calls += 1
        if self.calls == self.n:
            sys.settrace(None)
            self.fired = True
            raise KeyboardInterrupt


def interrupted(trace: Trace, run: Callable[[], object]) -> bool:
    """Run ``run`` with ``trace`` as this thread's trace function; return whether a
    ``KeyboardInterrupt`` ended it."""
    sys.settrace(trace)
    try:
        run()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False
