"""Run a function in a forked child of the test process and get back what it reported."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch


def in_forked_child(body: Callable[[], str], seconds: float = 30) -> str:
    """Run ``body`` in a forked child (the threads of this process go on here) and return
    what it returned, or the ``repr`` of what it raised. The child leaves with ``os._exit``,
    as multiprocessing's forked workers do; past ``seconds`` it shows its threads' stacks on
    stderr, it is killed and the test fails.
    """
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child = os.fork()
    if child == 0:
        os.close(read)
        # Where it hangs goes to stderr before the parent kills it.
        faulthandler.dump_traceback_later(max(seconds - 2, 1), exit=True)
        torch.set_num_threads(1)  # as data-loading workers do: OpenMP is not fork-safe
        try:
            report = body()
        except BaseException as error:
            report = repr(error)
        os.write(write, report.encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, _ = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child hung")
    with os.fdopen(read) as pipe:
        return pipe.read()


def in_forked_child_while_held(
    locks: Sequence[Any], body: Callable[[], str], seconds: float = 30
) -> str:
    """:func:`in_forked_child`, forked while another thread of this process holds ``locks``
    (as a thread inside a critical section would at the moment of the fork), or is inside
    any other context managers given there (a lease); that thread lets them go once the
    child ended."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        return in_forked_child(body, seconds)
    finally:
        release.set()
        holder.join(30)


def put_values(tensor: torch.Tensor, queue: Any) -> None:
    """Put the values of ``tensor`` on ``queue`` as nested lists: a process target, so that
    what a child received comes back without sharing the child's memory (gone once it
    exits)."""
    queue.put(tensor.tolist())
