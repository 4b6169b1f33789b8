"""Where a pool's actor runs: the caller's event loop, or a private daemon loop thread.

The private thread is a daemon and owns nothing that interpreter shutdown waits for, so an
unclosed pool never hangs exit. uvloop drives it when importable, unless disabled by the pool's
``use_uvloop=False`` or the environment variable ``T2N_RESIDENCY_UVLOOP=0``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from torch_to_nnef.exceptions import T2NErrorMisuse

__all__ = ["LoopHost", "uvloop_wanted"]


def uvloop_wanted(use_uvloop: bool | None) -> bool:
    """Whether a private loop should run on uvloop (the option, then the environment)."""
    if use_uvloop is None:
        use_uvloop = os.environ.get("T2N_RESIDENCY_UVLOOP", "1").lower() not in ("0", "false", "no")
    if not use_uvloop:
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


class LoopHost:
    """The event loop an actor runs on, and the thread-safe way to reach it."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread_id: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.loop is not None

    @property
    def private(self) -> bool:
        return self._thread is not None

    def on_loop_thread(self) -> bool:
        return self.thread_id == threading.get_ident()

    def attach_current(self) -> None:
        """Use the running loop of the calling task (``async with pool``)."""
        self.loop = asyncio.get_running_loop()
        self.thread_id = threading.get_ident()

    def detach(self) -> None:
        self.loop = None
        self.thread_id = None

    def start_private(
        self, main: Callable[[Callable[[], None]], Awaitable[None]], *, use_uvloop: bool
    ) -> None:
        """Run ``main(started)`` on a new daemon loop thread; return once it called ``started``."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = _new_loop(use_uvloop)
            asyncio.set_event_loop(loop)

            def started() -> None:  # published once the actor serves, never before
                self.thread_id = threading.get_ident()
                self.loop = loop
                ready.set()

            try:
                loop.run_until_complete(main(started))
            except BaseException as error:  # reported to the starting thread
                failure.append(error)
            finally:
                self.loop = None
                self.thread_id = None
                ready.set()
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        thread = threading.Thread(target=run, name="t2n-residency-loop", daemon=True)
        self._thread = thread
        thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def join(self, timeout: float = 30.0) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    def call(self, callback: Callable[..., Any], *args: Any) -> None:
        """Schedule ``callback(*args)`` on the loop thread, from any thread."""
        loop = self.loop
        if loop is None:
            raise T2NErrorMisuse("the TensorResidencyPool is not running; it may be closed")
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError as error:  # loop closed underneath us
            raise T2NErrorMisuse("the TensorResidencyPool's event loop has stopped") from error


def wait_reply(reply: concurrent.futures.Future[Any]) -> Any:
    """Block the calling (foreign) thread until the actor completes ``reply``."""
    return reply.result()
