"""The runtime of a pool: its event loop, its I/O workers, and the one driver of requests.

**Loop.** The actor runs on an asyncio event loop: the caller's (``async with pool``), or a
private daemon thread's (``with pool`` or the first synchronous call), on uvloop when it is
importable unless ``use_uvloop=False`` or ``T2N_RESIDENCY_UVLOOP=0``. Other backends (trio)
are not supported. Calls from other threads (requests, notifications, the ends of jobs) wait
in the runtime's inbox, in the order they were posted; each post also schedules a serve
(``call_soon_threadsafe``), which takes out and runs every call waiting. A Ctrl-C that cuts a
serve off as it begins, on a loop of the caller's on the main thread, loses no call: the next
serve runs it, that of the next post or of a waiting thread's next look at the loop.

**Workers.** Disk jobs run on ``max_workers`` threads of the pool's own
(:mod:`._workers`: a queue, no futures); each completion is posted to the loop as the actor's
transition for that job. A sync call on the loop thread itself waits for a job inline. At
interpreter exit, once the interpreter waited for the threads that are not daemons (a thread
of yours may use a pool after the main thread ended), an ``atexit`` hook runs the ``at_exit``
of each pool that no running loop of the caller's serves (the pool writes back what it never
closed), then stops the private loops (each runs what was posted, then its workers' queued
jobs to their end), and waits for those a collected pool's close was stopping, before the
interpreter tears down. A pool collected while stranded on a closed loop of the caller's is
closed sooner, by the reaper (:class:`_Reaper`), which that hook waits for first.

**Ended leases.** The actor grants a lease on a loaded value as a thread takes one on a hit:
its next transition counts the lease as holding the value if it still does. A thread ending a
lease the actor counts so wakes the loop when the value, back in the cache, puts the pool over
its budget (one wake-up at a time: later releases ride on it). Reads of the state from other
threads (:meth:`Runtime.catch_up`) wait for those wake-ups, and for the end of a transition
applying them.

**The driver.** Every request is an :class:`Operation` whose ``step`` runs on the loop thread
and returns a value, or a :class:`~torch_to_nnef.tensor.residency._state.Job` to wait for.
:meth:`Runtime.drive` runs the step, retries it after the job, abandons the operation on
error, and settles the caller's completion: a :class:`Reply` for a thread or another loop, an
``asyncio.Future`` for a task of the pool's loop. The faces differ only in
how they wait for that completion (:meth:`Runtime.call`, :meth:`Runtime.acall`,
:meth:`Runtime.start`). A completion cancelled by its waiter is never set; what the
operation holds is undone instead.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef._owned import collecting_here, held_here, owned_lock
from torch_to_nnef._waiting import LOOK, Waiters
from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._state import CLOSE_UNDER_WAY, Job
from torch_to_nnef.tensor.residency._workers import (
    Workers,
    exit_interrupts,
    join_at_exit,
    on_worker_thread,
    thread_refused,
)

__all__ = ["Operation", "Runtime", "reap_later", "reap_pending", "uvloop_wanted"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")

_INVALID_STATE = (concurrent.futures.InvalidStateError, asyncio.InvalidStateError)


class Operation:
    """One request, run by :meth:`Runtime.drive` on the loop thread.

    Attributes:
        twin: for a blocking operation, the name of its async twin: its sync face refuses to
            run on the loop thread. ``None``: the sync face may wait for jobs there inline.
        inline: the name shown in the one-time warning when the sync face loads inline.
    """

    twin: str | None = None
    inline: str = ""
    consumer: bool = False  # a request for a value: its waits for loads are stall time

    # Its state as it is made, read from the class until set (one is made per request, and
    # costs no ``__init__`` call).
    abandoned = False
    waited: Job | None = None  # the job the step returned last
    loading = False  # it had to wait for a load

    def step(self) -> Any:
        """Advance (loop thread): return the result, or a :class:`Job` to wait for."""
        raise NotImplementedError

    def prepare(self) -> None:
        """What the calling thread does before the request goes to the loop thread (a sync
        call from another thread; see :meth:`Runtime.call`)."""

    def abandon(self) -> None:
        """Undo what the operation holds: it failed or its caller left (idempotent)."""
        self.abandoned = True

    def undo(self, result: Any) -> None:
        """The result was produced but its caller left: give back what it holds."""
        self.abandon()


STOPPED_LOOP_PATIENCE = 2.0
"""Seconds a request from another thread (or loop) waits on a loop of the caller's
(``async with pool``) that is not running before it is abandoned with
:class:`~torch_to_nnef.exceptions.T2NErrorMisuse`: nothing would ever answer it otherwise.
A loop that runs again within that time (one ``run_until_complete`` after another) serves
the request as usual."""

_WATCH_INTERVAL = 0.1
"""Seconds between two looks at that loop while such a request waits."""

_stopping: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
"""Private loop threads told to stop without being waited for (a collected pool's close):
interpreter exit waits for them."""

_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()
"""Every runtime of this process."""


def _forget_threads_in_child() -> None:
    """After ``fork``, in the child: see :meth:`Runtime.forget_threads`."""
    for runtime in list(_runtimes):
        runtime.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_in_child)


def _transition(callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run ``callback(*args)``, a transition of the actor's, on the calling thread (the loop's,
    or any once no loop serves the pool). A Ctrl-C on a loop of the caller's on the main
    thread (a lease's exit there tells the actor at once) is raised once it ended, as one in
    a serve is: landing in it, it would leave the actor half-way through it (the slots whose
    leases ended taken out of their queue, and never applied: their values counted as in use
    for good)."""
    with InterruptHold() as hold:
        hold.start()
        callback(*args)


def _synced(actor: Actor, done: Reply) -> None:
    """On the loop thread: take note of other threads (what finalizers deferred included),
    then settle ``done``."""
    try:
        actor.sync()
    finally:
        done.set_result(None)


class _Exit:
    """Where interpreter exit stands for the pools: their threads may start until their
    exit work begins, then only on the thread doing it, and never after it."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None  # the one doing the exit work
        self.done = False

    def check_start(self) -> None:
        """Refuse to start a pool's threads where they could run while the interpreter
        tears down."""
        if self.done or (self.thread is not None and self.thread is not threading.current_thread()):
            raise T2NErrorMisuse(
                "the interpreter is exiting: a TensorResidencyPool cannot start its threads "
                "any more (they would run while the interpreter tears down); use pools before "
                "the end of the program, or in atexit functions registered after importing "
                "torch_to_nnef"
            )


_exit = _Exit()


class _Reaper:
    """Closes the pools that their finalizers left to it, on a short-lived daemon thread of
    its own (``t2n-residency-reaper``): pools garbage collected while stranded on a closed
    loop of the caller's (:meth:`Runtime.stranded_on_closed_loop`), whose workers and values
    would otherwise stay until interpreter exit.

    A finalizer runs on any thread, amid anything (on one of the pool's own workers, whose
    job a close waits for; inside ``threading``'s own locks, which starting a thread takes):
    it may neither close the pool nor start a thread. It only queues the close
    (:meth:`add`, lock-free); the next pool created or entered, ordinary code, starts the
    reaper (:meth:`start`), which runs the queued closes and ends when none is left. One
    reaper runs at a time. Interpreter exit waits for it before its own work
    (:meth:`join_at_exit`), which closes what is still queued: those pools' runtimes are
    still referenced, so their ``at_exit`` runs.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = fork_safe_lock()  # the reaper's end against its start
        self._thread: threading.Thread | None = None

    def add(self, close: Callable[[], None]) -> None:
        """Queue ``close`` for the reaper (any thread, at any moment: takes no lock)."""
        self._pending.append(close)

    def start(self) -> None:
        """Start the reaper when closes are queued and none runs (a pool's creation or entry).
        Not once interpreter exit began: its work closes them. Ctrl-C is held over the
        thread's start, so that the reaper started is the one recorded."""
        if not self._pending or _exit.thread is not None or _exit.done:
            return
        with self._lock:
            if self._thread is not None or not self._pending:
                return
            thread = threading.Thread(target=self._run, name="t2n-residency-reaper", daemon=True)
            with InterruptHold() as hold:
                hold.start()
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now: the next start, or exit
                    return
                self._thread = thread

    def _run(self) -> None:
        while (close := self._next()) is not None:
            try:
                close()
            except Exception:
                LOGGER.exception("closing a collected TensorResidencyPool failed")

    def _next(self) -> Callable[[], None] | None:
        """The next queued close, or ``None``: the reaper ends, which it records under the
        lock its start takes, so that a close queued meanwhile starts another one. None once
        interpreter exit began: its work closes the rest."""
        with self._lock:
            if self._pending and _exit.thread is None:
                return self._pending.popleft()
            self._thread = None
            return None

    def join_at_exit(self) -> None:
        """Interpreter exit, once it began (the reaper takes no more closes): wait for the
        reaper's close under way, so that no exit work runs with it (bounded)."""
        thread = self._thread
        if thread is not None:
            join_at_exit(thread)

    def forget_in_child(self) -> None:
        """After ``fork``, in the child: the queued pools are the parent's, their threads
        there only; no reaper runs here."""
        self._pending.clear()
        self._thread = None


_reaper = _Reaper()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reaper.forget_in_child)


def reap_later(close: Callable[[], None]) -> None:
    """Have ``close`` run by the reaper, started by the next pool created or entered (a
    finalizer's call: takes no lock, starts nothing)."""
    _reaper.add(close)


_on_callers_loops: weakref.WeakSet[Runtime] = weakref.WeakSet()
"""The runtimes ever served on a loop of the caller's (``async with pool``): one stranded on
it once it closed may hold job ends that no loop will apply (see
:meth:`Runtime.hand_ends_to_reaper`)."""
_on_callers_loops_lock = fork_safe_lock()


def reap_pending() -> None:
    """Start the reaper when closes wait for it (a pool's creation or entry: never a
    finalizer, nor a caller holding a pool's lock), after handing it the job ends that
    pools stranded on a closed loop hold."""
    with _on_callers_loops_lock:
        runtimes = list(_on_callers_loops)
    for runtime in runtimes:
        runtime.hand_ends_to_reaper()
    _reaper.start()


def _close_and_stop_at_exit() -> None:
    """Once the interpreter waited for the threads that are not daemons, and before the
    workers stop: run the exit work (``at_exit``) of every pool (served by a private loop; by
    a loop of the caller's that still runs, on a daemon thread then; by one that no longer
    runs, see :meth:`Runtime.stranded`; by none, after an ``async with`` exit that failed),
    then stop private loop threads (they are daemons): each runs what was posted, then its
    workers' jobs to their end; then wait for the loop threads a collected pool's close
    stops. No thread of a pool is left running Python or torch code while the interpreter
    tears down."""
    exit_interrupts.hold()  # until the workers' hook ends
    _exit.thread = threading.current_thread()
    try:
        _reaper.join_at_exit()  # never two threads closing a pool at once
        _close_and_stop_pools()
    finally:
        _exit.done = True


def _close_and_stop_pools() -> None:
    for runtime in list(_runtimes):
        if runtime._pid != os.getpid():  # a forked child has none of its parent's threads
            continue
        if runtime.at_exit is not None:
            try:
                runtime.at_exit()
            except BaseException:  # the loops still stop
                LOGGER.exception("a TensorResidencyPool's work at interpreter exit failed")
        if runtime.private:
            runtime.stop_private(wait=False)
    for thread in list(_stopping):
        if thread is not threading.current_thread():
            join_at_exit(thread)


# Registered after the workers' hook (imported above), so it runs before it.
atexit.register(_close_and_stop_at_exit)


# Imported with this module, not as the first pool starts: a fork while another thread is
# inside that import would leave the child the module's import lock held, and every pool the
# child started would wait for it for ever.
_new_uvloop: Callable[[], asyncio.AbstractEventLoop] | None
try:
    import uvloop
except ImportError:  # uvloop is a dependency on Linux and macOS only
    _new_uvloop = None
else:
    _new_uvloop = uvloop.new_event_loop


def uvloop_wanted(use_uvloop: bool | None) -> bool:
    """Whether a private loop should run on uvloop (the option, then the environment)."""
    if use_uvloop is None:
        use_uvloop = os.environ.get("T2N_RESIDENCY_UVLOOP", "1").lower() not in ("0", "false", "no")
    return use_uvloop and _new_uvloop is not None


def _run_posted(loop: asyncio.AbstractEventLoop) -> None:
    """Run the callbacks posted to the stopped private ``loop`` before its detach, to the end.

    A stop posted after the one that ended its ``run_forever`` (two threads closing the pool
    at once each stop it) ends a run early, before what follows it ran: run again until a run
    completes. Detached, the loop receives no more stops, so this ends.
    """
    while True:
        try:
            loop.run_until_complete(asyncio.sleep(0))
            return
        except RuntimeError:  # "Event loop stopped before Future completed"
            if loop.is_closed() or loop.is_running():
                raise


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop and _new_uvloop is not None:
        return _new_uvloop()
    return asyncio.new_event_loop()


class Reply:
    """The completion the driver settles for everything but a task of the pool's loop: the
    sync face (from any thread), ``start`` and the handles built on it, awaits from another
    loop, the close of a collected pool.

    Its waiter blocks in the C ``acquire`` of a lock that settling it releases, and runs no
    Python code that holds a lock of the pool's: Ctrl-C cuts it cleanly (see :meth:`result`
    for the gate it leaves closed). The wait of a
    ``concurrent.futures.Future`` runs ``threading.Condition``'s Python code, which Ctrl-C can
    cut between taking its lock and handing it on: the lock is then left held (the loop
    thread settling the future would block forever) or released twice (a ``RuntimeError``
    in place of the ``KeyboardInterrupt``). Another loop awaits it through :meth:`wrap`.
    """

    __slots__ = ("_callbacks", "_error", "_gate", "_settled", "_value")

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()
        self._settled = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Reply], None]] | None = None  # until one is added

    @classmethod
    def of(cls, value: Any) -> Reply:
        """A reply settled with ``value`` already."""
        reply = cls()
        reply.set_result(value)
        return reply

    def done(self) -> bool:
        return self._settled

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        with _REPLY_CALLBACKS:
            if self._settled:
                raise concurrent.futures.InvalidStateError("the request was answered already")
            self._value, self._error = value, error
            self._settled = True
            callbacks, self._callbacks = self._callbacks, None
        self._gate.release()
        for callback in callbacks or ():
            try:
                callback(self)
            except BaseException:  # the settling thread is the loop's: it goes on
                LOGGER.exception("a callback on a settled request failed")

    def add_done_callback(self, callback: Callable[[Reply], None]) -> None:
        """Call ``callback(reply)`` once settled: at once when it is, else in the thread that
        settles it."""
        with _REPLY_CALLBACKS:
            if not self._settled:
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        callback(self)

    def remove_done_callback(self, callback: Callable[[Reply], None]) -> None:
        """Forget ``callback`` if it was added and has not run."""
        with _REPLY_CALLBACKS:
            if self._callbacks is not None and callback in self._callbacks:
                self._callbacks = [added for added in self._callbacks if added is not callback]

    def result(self, timeout: float | None = None) -> Any:
        """The result once settled, waiting ``timeout`` seconds at most (``None``: for as
        long as it takes), or raise the error; ``TimeoutError`` when it is not settled by
        then (as ``concurrent.futures.Future.result``).

        Each waiter opens the gate again for the next one; one that Ctrl-C cut just as it
        took the gate leaves it closed, so waiters look at the reply again every
        :data:`~torch_to_nnef._waiting.LOOK` seconds."""
        if not self._settled:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._settled:
                left = LOOK if deadline is None else max(0.0, deadline - time.monotonic())
                if self._gate.acquire(timeout=min(LOOK, left)):
                    self._gate.release()  # for the next waiter
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if not self._settled:
                raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        """The error of a settled reply, ``None`` for a value."""
        assert self._settled
        return self._error

    def wrap(self, orphaned: Callable[[], None] | None = None) -> asyncio.Future[Any]:
        """An ``asyncio.Future`` of the running loop settled as this reply is (the
        ``asyncio.wrap_future`` of a reply). Cancelling it leaves the reply alone, but for
        the callback that would have settled it. ``orphaned``: called (on the settling
        thread) when the reply settles after that loop closed: no task of it takes the
        result."""
        loop = asyncio_loop()
        future = loop.create_future()

        def copy() -> None:
            if future.cancelled():
                return
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._value)

        def settled(_: Reply) -> None:
            try:
                loop.call_soon_threadsafe(copy)
            except RuntimeError:  # that loop closed: nobody awaits it
                if orphaned is not None:
                    orphaned()

        def forget(_: asyncio.Future[Any]) -> None:
            if future.cancelled():
                self.remove_done_callback(settled)

        self.add_done_callback(settled)
        future.add_done_callback(forget)
        return future


# Settling a reply against adding a callback to it; released in a forked child, whose new
# pools settle replies of their own.
_REPLY_CALLBACKS = fork_safe_lock()

Completion = asyncio.Future[Any] | Reply


def asyncio_loop(runtime: Runtime | None = None) -> asyncio.AbstractEventLoop:
    """The running asyncio event loop of the calling task, which every await of a pool
    needs; refused as a misuse where none runs (a task of another async library), in a
    forked child as such first when ``runtime`` is given."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        if runtime is not None:
            runtime.check_process()
        raise T2NErrorMisuse(
            "TensorResidencyPool's async methods need a running asyncio event loop (asyncio "
            "or uvloop, anyio's asyncio backend included) and none runs here: other async "
            "libraries (trio) are not supported; call the pool's synchronous methods from a "
            "worker thread instead (`trio.to_thread.run_sync`)"
        ) from None


def _set_result(done: Completion, value: Any) -> bool:
    """Settle ``done`` with ``value``; ``False`` when no waiter will take it: cancelled by
    its waiter meanwhile, or a future of a loop closed since (its task never runs again)."""
    try:
        done.set_result(value)
    except _INVALID_STATE:
        return False
    except RuntimeError:
        if not _of_closed_loop(done):
            raise
        return False
    return True


def _set_exception(done: Completion, error: BaseException) -> None:
    if not done.done():
        try:
            done.set_exception(error)
        except _INVALID_STATE:
            pass
        except RuntimeError:
            if not _of_closed_loop(done):
                raise


def _of_closed_loop(done: Completion) -> bool:
    return isinstance(done, asyncio.Future) and done.get_loop().is_closed()


def _abandon(operation: Operation) -> None:
    try:
        operation.abandon()
    except BaseException:  # its caller has its own error already
        LOGGER.exception("giving back what a failed request held failed")


class _LoopWatch:
    """Looks, between waits, at a loop of the caller's that a request waits for. A loop run
    in short bursts (one ``run_until_complete`` after another) may never be running when
    looked at: a beat posted to it, run by the next burst, says it still runs."""

    __slots__ = ("beat", "loop", "stopped_since")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stopped_since: float | None = None
        self.beat: list[bool] | None = None  # [ran], once posted

    def look(self, closed: bool) -> None:
        """Raise once the loop has neither been running nor run a beat for
        :data:`STOPPED_LOOP_PATIENCE` seconds, or at once when the pool is ``closed`` (by
        the loop's own thread, say) while its loop is stopped: nothing is left to wait for."""
        beat = self.beat
        if self.loop.is_running() or (beat is not None and beat[0]):
            self.stopped_since = None
            self.beat = None
            return
        if closed:
            raise T2NErrorMisuse(
                "the TensorResidencyPool was closed while this request waited for the stopped "
                "event loop serving it: the request is abandoned; create a new pool"
            )
        if beat is None:
            beat = self.beat = [False]
            with contextlib.suppress(RuntimeError):  # a closed loop runs nothing
                self.loop.call_soon_threadsafe(beat.__setitem__, 0, True)
        now = time.monotonic()
        if self.stopped_since is None:
            self.stopped_since = now
        elif now - self.stopped_since >= STOPPED_LOOP_PATIENCE:
            raise T2NErrorMisuse(
                f"the event loop serving this TensorResidencyPool (`async with pool` in that "
                f"loop) has not been running for {STOPPED_LOOP_PATIENCE:g} s while this "
                f"request waited for it: the request is abandoned. Keep that loop running "
                f"while other threads or loops use the pool, or serve it on its own thread "
                f"with `with pool:`"
            )


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: nobody waits for it any more


class _Posted:
    """A call waiting in a runtime's inbox (compared by identity)."""

    __slots__ = ("args", "callback")

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.callback = callback
        self.args = args


class Runtime:
    """The loop, the I/O workers and the driver of one pool's actor (see the module doc)."""

    def __init__(self, actor: Actor, max_workers: int, use_uvloop: bool | None) -> None:
        self.actor = actor
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread_id: int | None = None
        self._max_workers = max_workers
        self._use_uvloop = use_uvloop
        self._workers: Workers | None = None
        self._thread: threading.Thread | None = None
        self._lock = owned_lock()  # the loop's publication, against posts
        self._start_lock = owned_lock()
        self._warned_inline = False
        # Calls posted for the loop thread, in order (see _serve).
        self._inbox: collections.deque[_Posted] = collections.deque()
        # Notifications sent without waiting (under _lock), and how many ran (loop thread).
        self._sent = 0
        self._ran = 0
        self._pid = os.getpid()  # the process whose threads serve the pool
        # Jobs the workers ended, whose transitions wait for the actor's thread (in order).
        self._ended: collections.deque[Job] = collections.deque()
        self._applying = False  # in _apply_ended: a loop, never a recursion, applies them
        self._ends_handed = False  # to the reaper (see hand_ends_to_reaper)
        # Notified as a job ends, while an inline wait for a close under way listens.
        self._end_lock = fork_safe_lock()  # a job's end against a close-join's look
        self._end_waiters = Waiters()
        self._listening = False
        # Run at interpreter exit before the private loop stops (the pool writes back what
        # it never closed).
        self.at_exit: Callable[[], None] | None = None
        actor.waker = weakref.WeakMethod(self.wake)
        _runtimes.add(self)

    def forget_threads(self) -> None:
        """In a forked child, which has none of the threads of its parent's pools: renew the
        locks those threads may have held at the fork, and stop serving resident values
        without the loop, so that every request of a started pool says it was forked (see
        :meth:`check_process`) instead of waiting for a thread that is not there."""
        self._lock = owned_lock()
        self._start_lock = owned_lock()
        self.actor.lock = owned_lock()
        # Forked from the loop's thread, the child's thread bears its id: it is no loop
        # thread of the pool's for all that (it would drive the actor inline, for workers
        # that are not there).
        self.thread_id = None
        if self.running:
            self.actor.published = {}

    # ------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.loop is not None

    def run_unstarted(self, step: Callable[[], object]) -> bool:
        """Run ``step`` on the calling thread while no loop serves the pool, under the lock
        that starting one takes: no loop thread runs a step meanwhile. Whether it ran."""
        if self.loop is not None:
            return False
        with self._start_lock:
            if self.loop is not None:
                return False
            step()
        return True

    @property
    def private(self) -> bool:
        return self._thread is not None

    def served_by_callers_loop(self) -> bool:
        """Served on a loop of the caller's (``async with pool``) that runs: whoever runs
        that loop drives the pool."""
        loop = self.loop
        return self._thread is None and loop is not None and loop.is_running()

    def _loop_runs(self) -> bool:
        loop = self.loop
        return loop is not None and loop.is_running()

    def stranded(self) -> bool:
        """Served on a loop of the caller's (``async with pool``) that no longer runs: the
        block was never left (its task pending, or destroyed with the loop). Nothing drives
        the actor any more; only the calling thread can."""
        loop = self.loop
        return self._thread is None and loop is not None and not loop.is_running()

    def stranded_on_closed_loop(self) -> bool:
        """Stranded on a loop that is closed: it will never run the pool again, and any
        thread may drive the actor (one at a time)."""
        loop = self.loop
        return self.stranded() and loop is not None and loop.is_closed()

    def stranded_here(self) -> bool:
        """Stranded, and the calling thread may drive the actor: that loop is closed, or this
        is its thread (where it cannot run meanwhile)."""
        loop = self.loop
        return self.stranded() and loop is not None and (loop.is_closed() or self.on_loop_thread())

    def on_loop_thread(self) -> bool:
        return self.thread_id == threading.get_ident()

    def in_serving_loop(self) -> bool:
        """Whether the calling task runs on the loop that serves the pool (not merely on its
        thread: another loop may run there while that one is stopped)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def may_wait_for_itself(self) -> bool:
        """Whether a wait for the pool on the calling thread might wait for that thread: it
        holds a lock of the pool's (a garbage collection landed amid the pool's code), it
        runs a garbage collection (landed amid any code, whose locks a write-back may need),
        or it is an I/O worker (whose job the pool may be waiting for). A finalizer ends what
        it must without waiting when this is true. A lock another thread holds is no reason:
        that thread lets it go."""
        return self._amid_its_own_code() or collecting_here() or on_worker_thread()

    def _amid_its_own_code(self) -> bool:
        """Whether the calling thread holds a lock of the pool's."""
        return held_here(self.actor.lock) or held_here(self._lock) or held_here(self._start_lock)

    def _refuse_a_wait_for_itself(self) -> None:
        """A blocking request made amid the pool's own code on this thread, or on an I/O
        worker (by a finalizer that a garbage collection ran there), would wait for that
        very code, or for a job queued behind it: refused."""
        if self._amid_its_own_code() or on_worker_thread():
            where = (
                "on a pool's I/O worker thread"
                if on_worker_thread()
                else "amid the pool's own code on this thread"
            )
            raise T2NErrorMisuse(
                f"a TensorResidencyPool request that may wait was made {where} (by a "
                "finalizer a garbage collection ran there, say): it would wait for itself; "
                "make it outside finalizers"
            )

    def forked(self) -> bool:
        """Whether this process is a forked child of the one whose threads serve the pool."""
        return os.getpid() != self._pid

    def check_process(self) -> None:
        if self.forked():
            raise T2NErrorMisuse(
                "this TensorResidencyPool was started in the parent of this forked process: its "
                "loop thread and workers do not exist here; create a new pool in the child"
            )

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pid = os.getpid()
        self._workers = Workers(self._max_workers, self._job_ended)
        self.actor.submit = self._submit
        with self._lock:
            self.thread_id = threading.get_ident()
            self.loop = loop

    def _detach(self) -> Workers | None:
        with self._lock:
            self.loop = None
            self.thread_id = None
        self.actor.submit = None
        workers, self._workers = self._workers, None
        return workers

    def attach_current(self) -> None:
        """Serve on the running loop of the calling task (``async with pool``); refused when
        a loop serves the pool already (checked under the lock that a first sync call takes
        to start the private loop, so that never both serve it)."""
        with self._start_lock:
            if self.loop is not None:
                raise T2NErrorMisuse(
                    "this TensorResidencyPool already runs (on its own thread or another loop); "
                    "enter `async with pool` once, before any synchronous use"
                )
            self._attach(asyncio_loop())
        with _on_callers_loops_lock:
            _on_callers_loops.add(self)

    def call_stranded(self, operation: Operation) -> Any:
        """Run ``operation`` to its end on the calling thread, for a pool that only this
        thread drives (:meth:`stranded_here`, the exiting thread, or a close with no loop
        serving the pool and nothing to write): as the loop thread would, its jobs on the
        workers. The actor's transitions run here, where no Ctrl-C may cut one in half: it
        is raised once the operation ended (a close, a flush: the pool then stands as they
        left it). Refused in a forked child, as any request (the workers are its parent's)."""
        self.check_process()
        self._refuse_a_wait_for_itself()
        done = Reply()
        with InterruptHold() as hold:
            hold.start()
            with self._start_lock:
                self._apply_ended()  # jobs that ended since the loop stopped serving
                self.drive(operation, done, inline=True)
        return done.result()

    def close_stranded(self, close: Operation) -> None:
        """Close a stranded pool from the calling thread (:meth:`call_stranded`), then stop
        serving on its loop. Raises what the close raises (the pool stays open). A Ctrl-C
        held through the close is raised once the pool stopped serving: raised before, it
        would leave the closed pool's I/O workers running for the process's life. Held from
        the close's start to that end: a second Ctrl-C between the two is held too."""
        with InterruptHold() as hold:
            hold.start()
            try:
                self.call_stranded(close)
            finally:
                if self.actor.closed:
                    self.detach_current()

    def detach_current(self) -> None:
        """Stop serving on the caller's loop (end of ``async with pool``). No private loop
        starts meanwhile (a thread's request to a pool whose exit failed): the ends of the
        jobs under way are applied here first, the actor being this thread's alone.

        Ctrl-C is held from the start to the end (raised after): landing once the pool was
        detached and before its workers were told to stop, it would leave them running for
        the process's life, no later close knowing of them. One landing before the hold
        leaves the pool as it was: a ``close()`` again stops serving it
        (:meth:`TensorResidencyPool._let_go`)."""
        with InterruptHold() as hold:
            hold.start()
            with self._start_lock:
                workers = self._detach()
                if workers is not None:
                    workers.shutdown()  # jobs run to their end; nothing is left behind
                self._apply_ended()
        with _on_callers_loops_lock:
            _on_callers_loops.discard(self)

    def ensure_running(self) -> None:
        """Start the private loop thread unless the actor is served already."""
        if self.loop is not None:
            self.check_process()
            return
        with self._start_lock:  # two threads' first calls start one loop
            if self.loop is not None:
                return
            self.actor.check_open()
            _exit.check_start()
            self._start_private()

    def _start_private(self) -> None:
        """Start the private loop thread and wait until it serves the pool. Ctrl-C is held
        from the thread's start to then (raised after): interrupted in between, the next
        call would find no loop and start a second thread, the first one left running."""
        ready = threading.Event()
        failed: list[BaseException] = []
        use_uvloop = uvloop_wanted(self._use_uvloop)

        def run() -> None:
            try:
                loop = _new_loop(use_uvloop)
                asyncio.set_event_loop(loop)
                self._attach(loop)
            except BaseException as error:  # the starting thread raises it
                failed.append(error)
                return
            finally:
                ready.set()
            try:
                loop.run_forever()
            finally:
                workers = self._detach()
                # Requests posted before the detach are in the ready queue: run them (they
                # find the pool closed and say so) rather than leave their callers waiting.
                _run_posted(loop)
                if workers is not None:
                    workers.shutdown()
                self._apply_ended()
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        thread = threading.Thread(target=run, name="t2n-residency-loop", daemon=True)
        with InterruptHold() as hold:
            hold.start()
            try:
                thread.start()
            except RuntimeError as error:  # "can't start new thread": nothing started
                raise thread_refused("its event loop thread", error) from error
            self._thread = thread
            ready.wait()
        if failed:
            thread.join()
            self._thread = None
            raise failed[0]

    def stop_private(self, wait: bool = True) -> None:
        """Stop the private loop thread (it stops its workers), waiting for it with ``wait``
        unless called on it."""
        if self._thread is None:
            return
        with self._start_lock:  # a start under way ends first: its thread is started
            thread = self._thread
        if thread is None:
            return
        with self._lock:
            loop = self.loop
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)
        if wait and thread is not threading.current_thread():
            thread.join(30.0)
        else:
            _stopping.add(thread)
        self._thread = None

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the loop thread, after what was posted before."""
        self.check_process()
        with self._lock:
            loop = self.loop
            if loop is None:
                raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
            if not self._send(loop, callback, args):
                if self.private:
                    raise T2NErrorMisuse("the TensorResidencyPool's event loop has stopped")
                raise T2NErrorMisuse(
                    "the event loop serving this TensorResidencyPool is closed (its `async with "
                    "pool` block was never left): `pool.close()` writes its changes back; create "
                    "a new pool to go on"
                )

    def _send(
        self, loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], args: tuple[Any, ...]
    ) -> bool:
        """Put ``callback(*args)`` in the inbox and schedule a serve on ``loop`` (any thread,
        taking no lock). ``False`` when ``loop`` is closed: the call is taken back out."""
        posted = _Posted(callback, args)
        inbox = self._inbox
        inbox.append(posted)
        try:
            loop.call_soon_threadsafe(self._serve)
        except RuntimeError:  # the loop closed underneath us
            for index in range(len(inbox) - 1, -1, -1):  # (by identity: no call compared)
                if inbox[index] is posted:
                    del inbox[index]
                    break
            return False
        return True

    def _serve(self) -> None:
        """Run every call waiting in the inbox, in the order they were posted (loop thread).

        A Ctrl-C on a loop of the caller's on the main thread is raised once they ran. One
        landing as a serve begins, before its hold, takes no call out: the serve of the next
        post runs it, or the one a waiting thread schedules as it looks at the loop
        (:meth:`_serve_soon`), so that no call posted is lost to an interrupt. A call's error
        goes to the loop's exception handler, as that of a callback of the loop's would.

        A serve on a loop that stopped serving the pool leaves them to the loop that serves
        it now (never two threads at once): one that serves already, or the private loop it
        starts when the pool stays open (an ``async with`` exit that could not close it).
        Once the pool closed, it runs them: they find it closed."""
        if self.loop is None and self._inbox and not self.actor.closed:
            with contextlib.suppress(Exception):  # (refused: they run here, and say why)
                self.ensure_running()
        loop = self.loop
        if loop is not None and self.thread_id != threading.get_ident():
            if loop is not asyncio.get_running_loop():
                self._serve_soon(loop)
            return
        inbox = self._inbox
        with InterruptHold() as hold:
            hold.start()
            while inbox:
                posted = inbox.popleft()
                try:
                    posted.callback(*posted.args)
                except Exception as error:
                    loop = asyncio.get_running_loop()  # (a serve runs on a running loop)
                    loop.call_exception_handler(
                        {"message": f"Exception in {posted.callback!r}", "exception": error}
                    )

    def _serve_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule a serve on ``loop`` when calls wait in the inbox (any thread; what a
        thread waiting on a loop of the caller's does between its looks at it)."""
        if self._inbox:
            with contextlib.suppress(RuntimeError):  # a closed loop serves nothing
                loop.call_soon_threadsafe(self._serve)

    def _post_request(self, callback: Callable[..., Any], *args: Any) -> None:
        """:meth:`post` a request (a thread other than the loop's, after
        :meth:`ensure_running`). The loop of the caller's that served the pool may have
        stopped serving it since, its ``async with`` exit having failed: the pool stays open,
        and the request goes to the private loop that starts then."""
        while True:
            try:
                self.post(callback, *args)
                return
            except T2NErrorMisuse:
                if self.loop is not None or os.getpid() != self._pid or self.actor.closed:
                    raise
            self.ensure_running()

    def notify(self, callback: Callable[..., Any], *args: Any) -> None:
        """Tell the actor something without waiting for the loop (any thread); reads of the
        pool's state from other threads see it (:meth:`catch_up`). Where no loop will run it
        (none started, or it closed), the calling thread runs it, as the threads that drive
        such a pool do (:meth:`_unserved_transition`)."""
        if self.on_loop_thread() and not self.stranded_on_closed_loop():
            _transition(callback, args)
            return
        if self.running and os.getpid() == self._pid:
            with self._lock:
                loop = self.loop
                if loop is not None:
                    self._sent += 1
                    if self._send(loop, self._counted, (callback, args)):
                        return
                    self._sent -= 1
        self._unserved_transition(callback, args)

    def _unserved_transition(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run ``callback(*args)``, a transition no loop will run, on the calling thread under
        the lock of the threads that drive such a pool (a loop's start, a stranded pool's
        drivers, the reaper): never amid one of theirs. Where this thread must not wait for
        another (a finalizer, a thread holding a lock of the pool's, an I/O worker), and one
        holds that lock, the transition is left to the next (``Actor.later``). A loop started
        meanwhile is told instead."""
        lock = self._start_lock
        if not lock.acquire(blocking=not self.may_wait_for_itself()):
            self.actor.later(partial(callback, *args))
            return
        try:
            if self._loop_runs() and not self.forked() and not self.on_loop_thread():
                started = True
            else:
                started = False
                _transition(callback, args)
        finally:
            lock.release()
        if started:
            self.notify(callback, *args)

    def _counted(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            callback(*args)
        finally:
            self._ran += 1

    def wake(self) -> None:
        """Have the actor take note of other threads soon (any thread, at any moment)."""
        self.post_lock_free(self.actor.sync)

    def post_lock_free(self, callback: Callable[..., Any], *args: Any) -> bool:
        """Run ``callback(*args)`` on the loop thread, after what was posted before, taking
        no lock, so that a finalizer may call it whatever its thread holds. ``False`` when
        the loop is gone (or belongs to the parent of this forked process)."""
        loop = self.loop
        if loop is None or os.getpid() != self._pid:
            return False
        return self._send(loop, callback, args)

    def catch_up(self) -> None:
        """Wait until the notifications sent so far ran, a transition applying them ended,
        and no eviction is due (``Actor.enforce_due``: one left for after an answer, which may
        have woken this thread already) (reads of state from other threads). Reads never
        block: on a loop of the caller's that is not running, they answer at once, with the
        state as that loop left it. What finalizers left to the next transition
        (``Actor.later``) is applied first."""
        actor = self.actor
        if (
            self._sent == self._ran
            and not actor.syncing
            and not actor.enforce_due
            and not actor.deferred()
        ) or not self.running:
            return
        if self.on_loop_thread():
            return  # they are queued behind the running callback; the state is consistent
        if self.stranded():
            return  # nothing would run them before that loop runs again
        done = Reply()
        with contextlib.suppress(T2NErrorMisuse):
            self.post(_synced, actor, done)
            self.wait(done)

    # ------------------------------------------------------------------------------------------
    # Workers
    # ------------------------------------------------------------------------------------------
    def _submit(self, job: Job) -> None:
        """Queue ``job`` for the I/O workers."""
        workers = self._workers
        if workers is None:
            raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
        workers.submit(job)

    def _job_ended(self, job: Job) -> None:
        """A worker ran ``job`` (worker thread): its transition is queued for the actor's
        thread, and the loop told to apply it. When the loop stopped serving meanwhile, the
        thread that stopped it applies it once the workers ended: its waiters are answered."""
        self._ended.append(job)
        if self._listening:  # (read after the append: see _apply_ends_until)
            with self._end_lock:
                self._end_waiters.release()
        try:
            self.post(self._apply_ended)
        except T2NErrorMisuse:
            self.hand_ends_to_reaper()

    def hand_ends_to_reaper(self) -> None:
        """Stranded on a closed loop (any thread, taking no lock), have the reaper apply the
        job ends no loop will: their waiters (that loop's tasks, whose frames hold the
        pool) would keep the pool from its collection, and so from the reaper's close. Told
        by a job ending after that loop closed, or by the next pool created or entered (a
        loop closed with a serve of the pool pending)."""
        if (
            self._ended
            and not self._ends_handed
            and self._pid == os.getpid()
            and self.stranded_on_closed_loop()
        ):
            self._ends_handed = True
            reap_later(self._apply_stranded)

    def _apply_stranded(self) -> None:
        """The reaper's thread: apply the job ends of a pool stranded on a closed loop, as
        a thread driving it would (one at a time), and what the closed loop's tasks left to
        the next step (``Actor.later``: what they gave up on, which holds the pool)."""
        self._ends_handed = False
        with self._start_lock:
            if not self.stranded_on_closed_loop():
                return
            self._apply_ended()
            if self.actor.closed:  # a close under way as the loop closed, ended by them
                self.detach_current()  # (its workers stop, as a stranded close's do)
            else:
                self.actor.sync()  # what the closed loop's tasks gave up on goes back

    def _apply_ended(self) -> None:
        """Apply the transitions of the ended jobs, in order (the loop thread, or the thread
        that stopped it once the workers ended: nothing else runs the actor then).

        A Ctrl-C on a loop of the caller's on the main thread is raised once they are
        applied: one landing in a transition would leave the pool half-way through it. One
        landing as this call begins, where no hold can start yet, leaves the jobs queued:
        the next call applies them, or the next request's driver (:meth:`drive`), so that no
        request waits for a job whose end was lost."""
        with InterruptHold() as hold:
            hold.start()
            self._applying = True  # the drives its transitions resume leave the rest here
            try:
                while self._ended:
                    self._complete(self._ended.popleft())
            finally:
                self._applying = False

    @staticmethod
    def _complete(job: Job) -> None:
        """Apply the end of ``job`` (:meth:`Job.complete`). A transition that raises fails
        the pool, not the request applying it: the error is logged, and the job ended all
        the same (its waiters get the error of a job whose end could not be applied)."""
        try:
            job.complete()
        except Exception:
            LOGGER.exception("applying the end of a TensorResidencyPool's job failed")

    # ------------------------------------------------------------------------------------------
    # The driver
    # ------------------------------------------------------------------------------------------
    def drive(self, operation: Operation, done: Completion, inline: bool = False) -> None:
        """Run ``operation`` to its end on the loop thread and settle ``done``.

        ``inline``: wait for jobs by blocking the loop thread (the sync face called on it).

        A Ctrl-C on a loop of the caller's on the main thread is raised once the operation
        waits for a job or ended: one landing in a step would leave the actor half-way
        through a transition (a waiter counted, the lease not yet taken).
        """
        if self._ended and not self._applying:  # ends a Ctrl-C kept from being applied
            self._apply_ended()
        with InterruptHold() as hold:
            hold.start()
            try:
                self._drive(operation, done, inline)
            finally:
                if self.actor.enforce_due:  # (see Actor.enforce_soon)
                    self._enforce()

    def _enforce(self) -> None:
        """The eviction a step left due once its request was answered (loop thread): its
        failure is the pool's, not that request's (as a job's transition's)."""
        try:
            self.actor.enforce()
        except Exception:
            LOGGER.exception("evicting values over a TensorResidencyPool's budget failed")

    def _drive_here(self, operation: Operation, done: Reply, inline: bool) -> None:
        """:meth:`drive` on the loop thread for a caller given ``done`` once it returns: one
        it left with an error (a Ctrl-C its hold raised as it returned) abandons the
        operation, which may hold what ``done`` would have handed over."""
        try:
            self.drive(operation, done, inline)
        except BaseException:
            self.notify(operation.abandon)
            raise

    def _drive(self, operation: Operation, done: Completion, inline: bool) -> None:
        while True:
            if operation.abandoned:
                _set_exception(done, T2NErrorMisuse("this request was abandoned by its caller"))
                return
            if done.done():  # cancelled by its waiter
                _abandon(operation)
                return
            try:
                result = operation.step()
                if isinstance(result, Job) and inline and not result.done:
                    self._wait_inline(operation, result)
            except BaseException as error:
                _set_exception(done, error)
                _abandon(operation)
                return
            if operation.abandoned:  # by a call its own step ran first (Actor.later)
                _abandon(operation)  # again: what the step took since goes back too
                continue
            if isinstance(result, Job):
                operation.waited = result
                operation.loading = operation.loading or result.kind == "load"
                if not result.done:
                    if inline:
                        continue
                    result.add_callback(partial(self.drive, operation, done))
                    return
                continue
            if not _set_result(done, result):
                try:
                    operation.undo(result)
                except BaseException:
                    LOGGER.exception("giving back what an abandoned request held failed")
            return

    def _wait_inline(self, operation: Operation, job: Job) -> None:
        # Said of a load that blocks the running loop only: a thread driving a stranded
        # pool waits for its own request.
        if job.kind == "load" and not self._warned_inline and self._loop_runs():
            self._warned_inline = True
            LOGGER.warning(
                "TensorResidencyPool.%s loaded a value synchronously on the pool's event-loop "
                "thread, blocking it; run torch forwards in a worker thread with "
                "`await anyio.to_thread.run_sync(...)`",
                operation.inline,
            )
        if job.kind == CLOSE_UNDER_WAY:
            self._apply_ends_until(job)
            return
        workers = self._workers
        if workers is not None:
            workers.wait(job)
        self._complete(job)

    def _apply_ends_until(self, mark: Job) -> None:
        """Wait inline for ``mark``, the close under way that a new close joins: no worker
        runs it; it ends with that close, which waits for its jobs' ends. Those ends are
        applied here as they come, since this thread alone drives the actor (a close that a
        Ctrl-C cut off its loop would otherwise wait for ever). Workers notify only while
        this listens: one that appended its job before the flag was up, and did not notify,
        left the job where the check under the lock finds it."""
        self._listening = True
        try:
            while True:
                self._apply_ended()
                if mark.done:
                    return
                self._end_waiters.wait(self._end_lock, lambda: self._ended)  # (see _waiting)
        finally:
            self._listening = False

    def call(self, operation: Operation, timeout: float | None = None) -> Any:
        """The sync face: run ``operation`` and block until it ends (any thread). On the
        loop's thread, it runs inline: while that loop runs (a callback of it), only what
        does not wait for a write; while it is stopped, everything. From another thread,
        with ``timeout``: ``TimeoutError`` once it has waited that long (see :meth:`wait`)."""
        self._refuse_a_wait_for_itself()  # (on the loop's thread: a step inside a step)
        if self.on_loop_thread():
            if operation.twin is not None and self._loop_runs():
                name = operation.twin[1:]
                raise T2NErrorMisuse(
                    f"pool.{name}() would block the pool's event loop: "
                    f"use `await pool.{operation.twin}()`"
                )
            done = Reply()
            started = time.perf_counter()
            self._drive_on_loop_thread(operation, done, inline=True)
            self.count_stall(operation, started)
            return done.result()
        self.ensure_running()
        started = time.perf_counter()
        reply = Reply()
        if not self.stranded():
            operation.prepare()
        try:
            self._post_request(self.drive, operation, reply)  # start(), knowing the thread
            result = self._wait(reply, timeout)  # (checked as it began)
            self.count_stall(operation, started)
        except BaseException:
            # Interrupted (or failed): whatever it holds is given back, in order after it
            # (an operation never posted holds nothing: its abandon does nothing).
            self.notify(operation.abandon)
            raise
        return result

    def wait(self, done: Reply, timeout: float | None = None) -> Any:
        """Block until ``done`` is settled and return its result (a thread other than the
        loop's); with ``timeout``, raise ``TimeoutError`` once it has waited that long. On a
        loop of the caller's, raise :class:`T2NErrorMisuse` once that loop has not been
        running for :data:`STOPPED_LOOP_PATIENCE` seconds (at once when the pool is closed
        meanwhile), and at once in a forked child (the threads that would settle ``done`` are
        its parent's): the request would wait forever. The caller abandons what the request
        holds, in order after it."""
        if done.done():
            return done.result()
        self.check_process()
        self._refuse_a_wait_for_itself()
        return self._wait(done, timeout)

    def _wait(self, done: Reply, timeout: float | None) -> Any:
        """:meth:`wait`, once the caller was checked (a request's own thread, in ``call``)."""
        loop = self.loop
        if self.private or loop is None:
            return done.result(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = _LoopWatch(loop)
        while True:
            interval = _WATCH_INTERVAL
            if deadline is not None:
                interval = min(interval, deadline - time.monotonic())
                if interval <= 0:
                    raise TimeoutError
            with contextlib.suppress(TimeoutError):
                return done.result(timeout=interval)
            watch.look(self.actor.closed)
            self._serve_soon(loop)

    def count_stall(self, operation: Operation, started: float) -> None:
        """Count the time since ``started`` as stall when ``operation`` is a request that had
        to wait for a load (any thread)."""
        if operation.consumer and operation.loading:
            self.actor.add_stall(time.perf_counter() - started)

    def start(self, operation: Operation) -> Reply:
        """Send ``operation`` to the loop without waiting (any thread); its completion. On
        the loop's thread while that loop is stopped, it runs to its end there: nothing
        else would apply the end of its job."""
        done = Reply()
        if self.on_loop_thread():
            self._drive_on_loop_thread(operation, done, inline=not self._loop_runs())
        else:
            self._post_request(self.drive, operation, done)
        return done

    def _drive_on_loop_thread(self, operation: Operation, done: Reply, inline: bool) -> None:
        """:meth:`_drive_here` on the loop's thread: on a stranded pool, under the lock of
        the other threads that drive one (:meth:`call_stranded`, the reaper applying the
        job ends of one stranded on a closed loop): one at a time."""
        if not self.stranded():
            self._drive_here(operation, done, inline)
            return
        with self._start_lock:
            self._drive_here(operation, done, inline)

    async def acall(self, operation: Operation) -> Any:
        """The async face: run ``operation`` and await it (the pool's loop or another). A
        task of another loop on the thread of the pool's, which is stopped then, runs it
        inline, as a sync call there: no other thread can."""
        asyncio_loop(self)  # (a task of another async library is refused)
        if self.on_loop_thread() and not self.in_serving_loop():
            return self.call(operation)
        if self.on_loop_thread():
            assert self.loop is not None
            here: asyncio.Future[Any] = self.loop.create_future()
            started = time.perf_counter()
            try:
                self.drive(operation, here)  # (a Ctrl-C it held is raised as it returns)
                result = await here
            except BaseException as error:
                if here.done():  # settled: nobody retrieves what it holds but this
                    _consume(here)
                elif not here.get_loop().is_closed():
                    # (A cancel schedules the task's wake-up, which a closed loop refuses:
                    # a coroutine it left pending, closed by a collection, just gives up.)
                    here.cancel()
                self._give_up(operation, error)
                raise
            self.count_stall(operation, started)
            return result
        if not self.running:
            self.actor.check_open()  # a closed pool says so
            raise T2NErrorMisuse(
                "the TensorResidencyPool is not running: use `async with pool:` in this loop, "
                "or `with pool:` before awaiting it from another loop"
            )
        started = time.perf_counter()
        done = self.start(operation)
        result = await self.await_foreign(done, operation)
        self.count_stall(operation, started)
        return result

    async def await_foreign(self, done: Reply, operation: Operation | None = None) -> Any:
        """Await a completion from a loop other than the pool's, or on the loop serving it
        (refused in a forked child, as :meth:`wait`). Cancelling the awaiting task never
        cancels ``done``: the operation is abandoned in order instead.

        Only a task of another loop looks, every :data:`_WATCH_INTERVAL`, at the loop it
        waits for: one on the serving loop runs only while that loop runs. Each look arms a
        timer on the task's own loop: the tasks of a ``gather`` of thousands of prefetches
        on the serving loop would keep it busy re-arming them."""
        if not done.done():
            self.check_process()
        orphaned = None
        if operation is not None:
            orphaned = partial(self.abandon_later, operation)
        wrapped = done.wrap(orphaned)
        try:
            loop = self.loop
            if self.private or loop is None or self.in_serving_loop():
                return await asyncio.shield(wrapped)
            watch = _LoopWatch(loop)
            while True:  # as wait(): asyncio.wait never cancels what it waits for
                await asyncio.wait((wrapped,), timeout=_WATCH_INTERVAL)
                if wrapped.done():
                    return wrapped.result()
                watch.look(self.actor.closed)
                self._serve_soon(loop)
        except BaseException as error:
            # Cancelled, it takes its callback off ``done``; settled, its error (if any) was
            # never retrieved. A coroutine closed after its loop leaves nothing to run there.
            if not wrapped.get_loop().is_closed() and not wrapped.cancel():
                wrapped.add_done_callback(_consume)
            if operation is not None:
                self._give_up(operation, error)
            raise

    def _give_up(self, operation: Operation, error: BaseException) -> None:
        """Abandon ``operation``, whose awaiting coroutine left with ``error``, in order. A
        coroutine closed off the serving loop (a collection, on any thread, amid anything:
        the pool's lock held, perhaps) leaves it to the actor's next transition instead,
        taking no lock."""
        if isinstance(error, GeneratorExit) and not self.in_serving_loop():
            self.abandon_later(operation)
        else:
            self.notify(operation.abandon)

    def abandon_later(self, operation: Operation) -> None:
        """Abandon ``operation`` at the actor's next transition (any thread, at any moment:
        takes no lock)."""
        self.actor.later(operation.abandon)
        self.wake()
