"""Run a function in a forked child of the test process and get back what it reported."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse


def _report(body: Callable[[], str], seconds: float) -> str:
    """What ``body`` returned in the child, or the ``repr`` of what it raised."""
    # Where it hangs goes to stderr before the parent kills it.
    faulthandler.dump_traceback_later(max(seconds - 2, 1), exit=True)
    torch.set_num_threads(1)  # as data-loading workers do: OpenMP is not fork-safe
    try:
        return body()
    except BaseException as error:
        return repr(error)


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
        os.write(write, _report(body, seconds).encode())
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


def in_multiprocessing_child(body: Callable[[], str], seconds: float = 30) -> str:
    """:func:`in_forked_child`, the child started by multiprocessing's ``"fork"`` context (a
    data-loading worker's way): its bootstrap runs multiprocessing's after-fork hooks, and
    threading's shutdown once ``body`` returned (which waits for the threads the child
    started)."""
    context = multiprocessing.get_context("fork")
    read, write = context.Pipe(duplex=False)
    process = context.Process(target=lambda: write.send(_report(body, seconds)), daemon=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        process.start()
    write.close()
    try:
        if not read.poll(seconds):
            process.kill()
            process.join(10)
            pytest.fail("the forked child hung")
        report: str = read.recv()
    finally:
        read.close()
    process.join(seconds)
    if process.is_alive():
        process.kill()
        process.join(10)
        pytest.fail("the forked child hung as it ended")
    assert process.exitcode == 0, f"the forked child ended with {process.exitcode}"
    return report


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


FORKS: dict[str, Callable[[Callable[[], str]], str]] = {
    "os.fork": in_forked_child,
    "multiprocessing": in_multiprocessing_child,
}
"""The ways to fork a child that runs a function: ``FORKS[way](body)``."""


def outcomes(*calls: Callable[[], object]) -> str:
    """What each call did, in a forked child: "forked" when it refused to use the parent's
    pool, "returned", or the error."""
    done = []
    for call in calls:
        try:
            call()
            done.append("returned")
        except T2NErrorMisuse as error:
            done.append("forked" if "forked" in str(error) else str(error))
        except BaseException as error:
            done.append(repr(error))
    return ",".join(done)
