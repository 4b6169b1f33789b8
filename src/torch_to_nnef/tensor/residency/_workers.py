"""The I/O workers of a pool: at most ``max_workers`` threads running disk jobs in order.

A job is put on a ``queue.SimpleQueue``; a worker thread (``t2n-residency-io``, started when
a job finds no idle worker and fewer than ``max_workers`` run) takes it, runs its function,
stores the outcome on the job (:meth:`Job.ran`) and hands the job to ``ended``, which posts its
completion to the loop. Nothing else runs on a worker, and no future or condition variable is
involved: a job costs one queue put, one queue get and one post.

Stopping (:meth:`Workers.shutdown`) queues one stop mark per thread behind the jobs already
queued, so every job sent runs to its end, then joins the threads. Worker threads are not
daemons: at interpreter exit, a hook registered with ``threading`` (run before threads are
joined, as ``concurrent.futures`` does) stops every pool's workers the same way, so that
write-backs queued then still reach their files.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.residency._state import Job

__all__ = ["Workers"]

_STOP = None
_running: weakref.WeakSet[Workers] = weakref.WeakSet()
_exiting = False


def _stop_all_at_exit() -> None:
    global _exiting
    _exiting = True
    for workers in list(_running):
        if workers.pid == os.getpid():  # a forked child has none of its parent's threads
            workers.shutdown()


threading._register_atexit(_stop_all_at_exit)  # type: ignore[attr-defined]


class Workers:
    """At most ``max_workers`` threads running :class:`Job` functions (see the module doc)."""

    def __init__(self, max_workers: int, ended: Callable[[Job], None]) -> None:
        self._max = max_workers
        self._ended = ended
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the idle count, and a job's end against its waiter
        self._idle = 0
        self._stopped = False
        self.pid = os.getpid()
        _running.add(self)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (one thread at a time: the pool's loop thread)."""
        with self._lock:  # against shutdown: no job is queued behind the stop marks
            if self._stopped or _exiting:
                raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
            self._queue.put(job)
            if not self._idle and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._serve, name=f"t2n-residency-io_{len(self._threads)}"
                )
                self._threads.append(thread)
                thread.start()  # under the lock: a shutdown joins started threads only

    def _serve(self) -> None:
        lock, get = self._lock, self._queue.get
        while True:
            with lock:
                self._idle += 1
            job = get()
            with lock:
                self._idle -= 1
            if job is _STOP:
                return
            job.run()
            with lock:
                job.ran = True
                waiter = job.waiter
            if waiter is not None:
                waiter.set()
            self._ended(job)
            del job, waiter  # an idle worker keeps no value alive (its buffer may be reused)

    def wait(self, job: Job) -> None:
        """Block until ``job``'s function has run (the loop thread's inline wait)."""
        with self._lock:
            if job.ran:
                return
            waiter = job.waiter = threading.Event()
        waiter.wait()

    def shutdown(self) -> None:
        """Run the jobs queued so far to their end, then stop and join the threads
        (idempotent; not on a worker thread)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            threads = list(self._threads)
        _running.discard(self)
        for _ in threads:
            self._queue.put(_STOP)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join()
