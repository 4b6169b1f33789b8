"""A debugger-style breakpoint for tests: pause a thread of the pool at a chosen function,
so that a race happens in the same order on every run. The pool's own code runs unchanged:
the pause comes from ``threading.settrace``."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any


class Breakpoint:
    """Pause the next thread that calls (``on="call"``) or returns from (``on="return"``)
    ``code``, or reaches its line ``line`` (``on="line"``), once armed, until :meth:`go`; with
    ``caller``, only a call made from that function's code."""

    def __init__(
        self, code: CodeType, on: str, caller: CodeType | None = None, line: int | None = None
    ) -> None:
        self.code = code
        self.on = on
        self.caller = caller
        self.line = line
        self.armed = threading.Event()
        self.paused = threading.Event()
        self._go = threading.Event()
        self._lock = threading.Lock()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        at = self.line is None or frame.f_lineno == self.line
        if event == self.on and at and self.armed.is_set():
            with self._lock:
                hit = self.armed.is_set()
                self.armed.clear()
            if hit:
                self.paused.set()
                self._go.wait(60)
        return self._local

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not self.code:
            return None
        if self.caller is not None and (
            frame.f_back is None or frame.f_back.f_code is not self.caller
        ):
            return None
        return self._local(frame, event, arg)

    def go(self) -> None:
        self._go.set()

    def rearm(self) -> None:
        """Pause the next thread again, once :meth:`go` let the last one go."""
        self.paused.clear()
        self._go.clear()
        self.armed.set()


@contextmanager
def paused_in_new_threads(
    code: CodeType, on: str = "return", caller: CodeType | None = None, line: int | None = None
) -> Iterator[Breakpoint]:
    """A :class:`Breakpoint` in the threads started inside the block."""
    point = Breakpoint(code, on, caller, line)
    with breakpoints_in_new_threads(point):
        yield point


@contextmanager
def breakpoints_in_new_threads(*points: Breakpoint) -> Iterator[None]:
    """Several :class:`Breakpoint` (of different functions) in the threads started inside
    the block; each is released as the block ends."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        for point in points:
            local = point._trace(frame, event, arg)
            if local is not None:
                return local
        return None

    threading.settrace(trace)
    try:
        yield
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
        for point in points:
            point.go()


def line_of(function: Any, text: str) -> int:
    """The number of the first line of ``function``'s source that holds ``text`` (where a
    ``on="line"`` breakpoint pauses, before that line runs)."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, source in enumerate(lines) if text in source)
