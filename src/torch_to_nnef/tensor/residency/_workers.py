"""The I/O workers of a pool: at most ``max_workers`` threads running disk jobs in order.

A job is put on a ``queue.SimpleQueue``; a worker thread (``t2n-residency-io``, started
before the job is queued when it finds no idle worker to claim and fewer than ``max_workers``
run) takes it, runs its function, stores the outcome on the job (:meth:`Job.ran`) and hands
the job to ``ended``, which posts its completion to the loop. Nothing else runs on a worker,
and no future or condition variable is involved: a job costs one queue put, one queue get
and one post. Where the system refuses a thread, the job waits for the workers that run; a
job that no thread could ever take (the first worker refused) is refused, never queued.

Stopping (:meth:`Workers.shutdown`) queues one stop mark per thread behind the jobs already
queued, so every job sent runs to its end, then joins the threads. Worker threads are
daemons, so that the interpreter's wait for non-daemon threads at exit does not wait for
them: a thread of yours still using a pool after the main thread ended is served. An
``atexit`` hook, run once those threads ended (and after the pools' own exit work, see
:mod:`._runtime`), stops every pool's workers the same way, so that write-backs queued then
still reach their files, and no worker runs while the interpreter tears down.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch_to_nnef._interrupts import hold_sigint, restore_sigint
from torch_to_nnef._waiting import Waiters
from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorResource
from torch_to_nnef.tensor.residency._state import Job

__all__ = ["Workers", "on_worker_thread", "thread_refused"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")

EXIT_JOIN_TIMEOUT = 300.0
"""Seconds interpreter exit waits, at most, for each thread of a pool to end its work."""

_STOP = None
_running: weakref.WeakSet[Workers] = weakref.WeakSet()
_exiting = False


_worker_thread = threading.local()


def on_worker_thread() -> bool:
    """Whether the calling thread is an I/O worker (of any pool)."""
    return getattr(_worker_thread, "serving", False)


def thread_refused(which: str, error: RuntimeError) -> T2NErrorResource:
    """The error of a pool whose thread ``which`` the system refused to start (``error``)."""
    return T2NErrorResource(
        f"a TensorResidencyPool could not start {which} ({error}): the process is at its "
        "limit of threads; end threads or pools it no longer needs, or raise the limit, and "
        "retry"
    )


def join_at_exit(thread: threading.Thread) -> None:
    """Join ``thread`` at interpreter exit, for at most :data:`EXIT_JOIN_TIMEOUT` seconds."""
    if thread.ident is not None:  # started
        thread.join(EXIT_JOIN_TIMEOUT)


class _ExitInterrupts:
    """From the pools' first exit hook to their last, Ctrl-C in the main thread is reported
    instead of raised: a write under way ends whole instead of leaving its temporary file,
    and no pool thread is left running while the interpreter tears down (a
    ``KeyboardInterrupt`` in ``Thread.join`` may even take a running thread for ended)."""

    def __init__(self) -> None:
        self.previous: Any = None
        self.held = False

    def hold(self) -> None:
        if not self.held:
            self.held, self.previous = hold_sigint(self._report)

    def release(self) -> None:
        if self.held:
            self.held = False
            restore_sigint(self.previous)

    @staticmethod
    def _report(signum: int, frame: Any) -> None:
        LOGGER.warning(
            "interrupted at exit: the TensorResidencyPool disk work under way ends first "
            "(at most %.0f s)",
            EXIT_JOIN_TIMEOUT,
        )


exit_interrupts = _ExitInterrupts()


def _stop_all_at_exit() -> None:
    global _exiting
    _exiting = True
    exit_interrupts.hold()  # held since the pools' first hook, usually
    try:
        for workers in list(_running):
            if workers.pid == os.getpid():  # a forked child has none of its parent's threads
                workers.shutdown(at_exit=True)
    finally:
        exit_interrupts.release()


class _Anchor:
    """Something to attach a weak reference finalizer to."""


# weakref.finalize runs the finalizers still pending at exit (the removal of offloaded
# tensors' payload files among them) from an atexit function it registers with the first
# finalizer of the process. One made here registers it before the pools' hooks, so that it
# runs after them: a file written back at exit is removed with its tensor after, not before.
weakref.finalize(_Anchor(), int)
atexit.register(_stop_all_at_exit)


class Workers:
    """At most ``max_workers`` threads running :class:`Job` functions (see the module doc)."""

    def __init__(self, max_workers: int, ended: Callable[[Job], None]) -> None:
        self._max = max_workers
        self._ended = ended
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the idle count, and a job's end against its waiter
        # Workers free for a job no queued job has claimed: a worker counts itself once it
        # ended a job, and each job queued claims one. A burst of jobs finds the count
        # right even before the woken workers run (one idle worker, two jobs: the second
        # starts a thread). Below ``max_workers`` every queued job claimed a worker or
        # started one, so the count is exact there; at the limit, where no thread starts,
        # workers that take jobs queued behind busy ones leave it ahead, which is harmless.
        self._idle = 0
        self._stopped = False
        self._marks = 0  # stop marks queued
        self.pid = os.getpid()
        _running.add(self)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (one thread at a time: the pool's loop thread)."""
        with self._lock:  # against shutdown: no job is queued behind the stop marks
            if self._stopped or _exiting:
                raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._max:
                self._start_thread()
            self._queue.put(job)

    def _start_thread(self) -> None:
        """Start one more worker (under the lock: a shutdown joins started threads only).
        Where the system refuses a thread, the job waits for the workers that run; with none,
        it could never run: refused, and nothing is queued."""
        thread = threading.Thread(
            target=self._serve, name=f"t2n-residency-io_{len(self._threads)}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as error:  # "can't start new thread"
            if self._threads:
                return
            raise thread_refused("an I/O worker thread", error) from error
        self._threads.append(thread)

    def _serve(self) -> None:
        _worker_thread.serving = True
        lock, get = self._lock, self._queue.get
        while True:
            job = get()
            if job is _STOP:
                return
            job.run()
            with lock:
                job.ran = True
                if job.waiters is not None:
                    job.waiters.release()
                self._idle += 1
            self._ended(job)
            del job  # an idle worker keeps no value alive (its buffer may be reused)

    def wait(self, job: Job) -> None:
        """Block until ``job``'s function has run (the loop thread's inline wait)."""
        with self._lock:
            if job.ran:
                return
            if job.waiters is None:
                job.waiters = Waiters()
        job.waiters.wait(self._lock, lambda: job.ran)  # (Ctrl-C cuts it cleanly: see _waiting)

    def shutdown(self, at_exit: bool = False) -> None:
        """Run the jobs queued so far to their end, then stop and join the threads
        (idempotent: a second call, from another thread too, waits for the same end);
        ``at_exit``: for at most :data:`EXIT_JOIN_TIMEOUT` seconds each."""
        with self._lock:
            self._stopped = True
            threads = list(self._threads)
            # The marks owed, queued with the stop under the lock: a call that an interrupt
            # cut short leaves the rest to the next one (at exit, say), never a thread that
            # no mark would ever reach. (An interrupt between a put and its count queues one
            # mark too many, which no thread takes.)
            while self._marks < len(threads):
                self._queue.put(_STOP)
                self._marks += 1
        current = threading.current_thread()
        for thread in threads:
            if thread is current:
                continue
            if at_exit:
                join_at_exit(thread)
            else:
                thread.join()
        _running.discard(self)
