"""Interrupts injected into a thread's own code: with ``sys.settrace``, a
``KeyboardInterrupt`` raised on entry to a chosen function, where CPython runs a pending
signal handler (Ctrl-C); with ``sys.setprofile``, the SIGINT handler in force run at a chosen
call or return, C functions' included, as a signal arriving there would run it; with C code
alone (:func:`interrupted_then`), a Ctrl-C pending as a call begins, such as a garbage
collection's, whose first Python code runs the handler; from a timer thread
(:class:`CtrlCTimer`), one at a random moment, as a terminal's Ctrl-C arrives."""

from __future__ import annotations

import _thread
import contextlib
import dis
import gc
import inspect
import operator
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

from torch_to_nnef import _owned
from torch_to_nnef._owned import collecting_here

__all__ = [
    "CtrlCTimer",
    "InterruptAt",
    "SecondSignalAt",
    "SignalAt",
    "collections_by_hand",
    "in_finalizer",
    "interrupted",
    "interrupted_then",
    "signalled",
]

Trace = Callable[[FrameType, str, Any], Any]


class InterruptAt:
    """A trace function raising KeyboardInterrupt on entry to the ``n``-th function called
    (counting those of files whose path contains ``within``); ``fired`` once it did. With
    ``returns``, the returns of those functions count too: raised there, the interrupt lands
    in the caller just after the call, as a signal arriving during it would.

    Finalizers are left alone (see :func:`in_finalizer` for which): an exception raised in one is
    lost by Python (reported as unraisable), whatever the code does."""

    def __init__(self, n: int, within: str = "", returns: bool = False) -> None:
        self.n, self.within, self.returns = n, within, returns
        self.calls = 0
        self.fired = False
        self.where = ""  # the qualified name of the function it fired in

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        if event not in ("call", "return") or self.within not in frame.f_code.co_filename:
            return None
        if in_finalizer(frame):
            return None
        if event == "return" and (not self.returns or frame.f_code.co_flags & _SUSPENDS):
            return None  # a generator's yields are no returns
        self.calls += 1
        if self.calls == self.n:
            sys.settrace(None)
            self.fired = True
            self.where = frame.f_code.co_qualname
            raise KeyboardInterrupt
        return self if self.returns else None


class SignalAt:
    """A profile function (``sys.setprofile``) that runs the SIGINT handler in force, as a
    Ctrl-C arriving there would, at the ``n``-th point counted where CPython runs a pending
    handler: the entry to a function of a file whose path contains ``within`` (or one of
    them, given several), and the
    return of a call such a function makes (of a Python or a C function's). Python's default handler
    raises ``KeyboardInterrupt`` there, a hold's records the signal. ``fired`` once it ran,
    ``where`` says where (the event and the function's qualified name: ``"c_return
    Descriptors._held"``, after a C call made by that method), and ``exit_entry`` whether
    it was the entry of an ``__exit__`` or ``__aexit__`` method (where no code can guard it).

    Unlike :class:`InterruptAt`, it counts finalizers' events too (what an interrupt landing
    in one leaves behind is what it may test), unless ``finalizers`` is false: then those
    :func:`in_finalizer` recognises are not counted. Calls of ``ctypes`` functions make no
    events: the point just after one is not counted."""

    def __init__(self, n: int, within: str | tuple[str, ...], finalizers: bool = True) -> None:
        self.n, self.finalizers = n, finalizers
        self.within = (within,) if isinstance(within, str) else within
        self.events = 0
        self.fired = False
        self.exit_entry = False
        self.where = ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event not in _HANDLED_AT:
            return
        if not self._within(code.co_filename) and not (
            event == "return"  # a return lands in its caller: counted where the caller is
            and frame.f_back is not None
            and self._within(frame.f_back.f_code.co_filename)
        ):
            return
        if event == "return" and code.co_name == "__enter__":
            return  # the with statement that called it runs no handler before its block
        if event == "return" and code.co_flags & _AWAITED:
            return  # an await's end or suspension: the awaiting code runs no handler there
        if event == "call" and _resumed_after_an_await(frame):
            return  # no handler runs as a coroutine resumes after an await
        if not self.finalizers and in_finalizer(frame):
            return
        self.events += 1
        if self.events == self.n:
            sys.setprofile(None)
            self.fired = True
            self.where = f"{event} {code.co_qualname}"
            self.exit_entry = event == "call" and code.co_name in ("__exit__", "__aexit__")
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)

    def _within(self, filename: str) -> bool:
        return any(place in filename for place in self.within)


class SecondSignalAt(SignalAt):
    """Two Ctrl-C: a profile function that runs the SIGINT handler in force on entry to the
    first function named ``first`` (of a file whose path contains ``within``), then, as
    :class:`SignalAt` does, at the ``n``-th point counted from the entry to the first
    function named ``second`` on (that entry is the first point). ``first_where``: where the
    first one ran (``""`` while it did not)."""

    def __init__(self, first: str, second: str, n: int, within: str | tuple[str, ...]) -> None:
        super().__init__(n, within)
        self.first, self.second = first, second
        self.first_where = ""
        self.counting = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" and not self.counting:
            return
        if not self.first_where:
            if code.co_name == self.first and self._within(code.co_filename):
                self.first_where = code.co_qualname
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)
            return
        if not self.counting:
            if code.co_name != self.second or not self._within(code.co_filename):
                return
            self.counting = True
        super().__call__(frame, event, arg)


_HANDLED_AT = ("call", "return", "c_return")  # not before a C call: after the previous one

_AWAITED = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR

_RESUME = dis.opmap["RESUME"]


def _resumed_after_an_await(frame: FrameType) -> bool:
    """Whether ``frame``'s call event is a resumption after an ``await`` (``RESUME`` with an
    argument of 2 or more), where CPython 3.11 runs no pending handler, unlike a function's
    start or a generator's resumption after a ``yield``."""
    code, at = frame.f_code.co_code, frame.f_lasti
    return 0 <= at < len(code) - 1 and code[at] == _RESUME and code[at + 1] >= 2


_FINALIZERS = ("weakref.py", "_weakrefset.py")


def in_finalizer(frame: FrameType) -> bool:
    """Whether ``frame`` runs in a finalizer (``__del__``, a ``weakref.finalize`` or a
    callback of ``weakref.py``'s) or a garbage collection's callback, which a collection
    runs amid whatever code: the finalizer's own frame, or any it called (a payload file's
    removal closing its descriptor). An interrupt raised there is lost by Python (reported
    as unraisable), whatever the code does. It looks at the stack, up to the run that
    :func:`interrupted` or :func:`signalled` traces: ask it last.

    Whatever a collection that this thread runs calls is one (the package's collection
    callback tells: ``collecting_here``): the callbacks of the weak references it clears
    too, and the finalizers of objects made by other threads or earlier code, which may
    come amid any call once the collector's counts say so. A bare ``weakref.ref`` callback
    (storage's ``Mappings._gone``) run as its referent's last reference goes leaves no
    frame to tell it by, and is not recognised."""
    if collecting_here():
        return True
    callbacks = {id(getattr(callback, "__code__", None)) for callback in gc.callbacks}
    kinds = _CODE_KINDS
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            kind = kinds[id(code)] = _kind_of(code)
            _KNOWN.append(code)
        if kind == _TRACED_RUN:
            return False  # what called the traced run is the test's own code
        if kind == _FINALIZER or id(code) in callbacks:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_OTHER, _FINALIZER, _TRACED_RUN = range(3)

_CODE_KINDS: dict[int, int] = {}
"""What :func:`in_finalizer` learnt of each code object it met, by its id: a stack's walk
reads few attributes per frame (hashing a code object hashes its constants)."""
_KNOWN: list[CodeType] = []
"""Those code objects, kept: an id stays its own."""


def _kind_of(code: CodeType) -> int:
    if code.co_name == "__del__" or code.co_filename.endswith(_FINALIZERS):
        return _FINALIZER
    if code is interrupted.__code__ or code is signalled.__code__:
        return _TRACED_RUN  # the stack above is a test's and pytest's: no finalizer
    return _OTHER


_SUSPENDS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


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


def signalled(
    n: int,
    within: str | tuple[str, ...],
    run: Callable[[], object],
    finalizers: bool = True,
) -> tuple[SignalAt, KeyboardInterrupt | None]:
    """Run ``run`` with a Ctrl-C at its ``n``-th point (:class:`SignalAt`); return that
    profile function and the ``KeyboardInterrupt`` that ended the run, if one did (a caller
    may keep it, as an interactive session keeps the last one)."""
    signal_at = SignalAt(n, within, finalizers)
    sys.setprofile(signal_at)
    try:
        run()
    except KeyboardInterrupt as interrupt:
        return signal_at, interrupt
    finally:
        sys.setprofile(None)
    return signal_at, None


@contextlib.contextmanager
def collections_by_hand() -> Iterator[list[Any]]:
    """Automatic garbage collections off, earlier garbage gone, the package's collection
    callbacks alone in force (another's written in Python, such as torch's, may come first and
    take a Ctrl-C meant for them); yields what Python reports as unraisable inside the block
    (an interrupt lost in a finalizer or a collection's callback)."""
    caught: list[Any] = []
    gc.collect()
    gc.disable()
    callbacks = gc.callbacks[:]
    gc.callbacks[:] = [
        callback
        for callback in callbacks
        if callback is _owned._note_collection or callback == _owned._phase.move_to_end
    ]
    previous = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        yield caught
    finally:
        sys.unraisablehook = previous
        gc.callbacks[:] = callbacks
        gc.enable()


@contextlib.contextmanager
def finalizer_interrupts_counted() -> Iterator[list[int]]:
    """A Ctrl-C landing in a finalizer or in a collection's callback (any library's: the
    hypothesis tests leave one in force) is reported by Python as unraisable, not raised: for
    the block, such reports are counted (the one item of the list yielded); any other is
    passed on to the hook in force before."""
    landed = [0]
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            landed[0] += 1
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield landed
    finally:
        gc.collect()  # finalizers of the block report here
        sys.unraisablehook = previous


def interrupted_then(call: Callable[[], object]) -> None:
    """Make a Ctrl-C pending and run ``call`` at once, from C: no Python code runs between, so
    the first Python code ``call`` runs (a collection's callback, say) runs the handler."""
    deque(map(operator.call, (_thread.interrupt_main, call)), maxlen=0)


class CtrlCTimer:
    """One Ctrl-C (``_thread.interrupt_main``) ``delay`` seconds after :meth:`arm`, unless
    :meth:`stop` came first. Its thread starts as the timer is made, and waits to be armed:
    an interrupt landing in ``Thread.start`` (its wait on a ``threading.Condition``, whose
    Python code the interrupt cuts) would leave that condition's lock broken."""

    def __init__(self, delay: float) -> None:
        self._go, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(delay,), name="ctrl-c-timer", daemon=True
        )
        self._thread.start()

    def _run(self, delay: float) -> None:
        self._go.wait()
        if not self._stop.wait(delay):
            _thread.interrupt_main()

    def arm(self) -> None:
        self._go.set()

    def stop(self, timeout: float = 60.0) -> None:
        """No Ctrl-C from now on (one that fired is pending or raised); the thread ended
        (an ``AssertionError`` when it has not within ``timeout`` seconds: it hangs)."""
        self._stop.set()
        self._go.set()  # (one never armed ends too)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the Ctrl-C timer thread hangs"
