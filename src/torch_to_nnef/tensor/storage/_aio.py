"""Asynchronous payload I/O with aiofiles: reads and atomic writes in bounded chunks.

aiofiles runs each file call in a worker thread (``loop.run_in_executor``). Cancelling the
``await`` of such a call does not stop the thread: a cancelled read could still be writing
into its buffer, a cancelled write still reading tensor memory. Every worker call here is
therefore awaited to completion even when the caller is cancelled (shielded from anyio cancel
scopes, and waited for after a native ``Task.cancel()``), and the cancellation is raised once
the thread is done. Data moves in chunks of ``chunk_bytes``, so a cancelled read or write stops
after at most one chunk and, when it raises, no worker thread touches its buffers any more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import io
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.threadpool
import anyio
import anyio.lowlevel
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.storage._buffers import plan_read, select_entries, tensor_pieces
from torch_to_nnef.tensor.storage._format import PayloadLayout
from torch_to_nnef.tensor.storage._io import (
    AtomicFile,
    check_unchanged,
    check_unchanged_after_read,
    committed_layout,
    open_for_reading,
    os_error_message,
    prepare_write,
    short_read,
    write_error,
)

__all__ = ["aread_payload", "awrite_payload"]

DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes moved per worker-thread call: the granularity at which cancellation takes effect."""

_T = TypeVar("_T")


async def _uncancellable(
    awaitable: Awaitable[_T], *, release: Callable[[_T], object] | None = None
) -> _T:
    """Await ``awaitable`` to completion, then re-raise any cancellation that arrived meanwhile.

    anyio cancel scopes are held off by a shield; a native ``Task.cancel()`` interrupts the
    wait, which then resumes until the work is done before ``CancelledError`` propagates. When
    the result of completed work is dropped that way, ``release`` is called with it.
    """
    future = asyncio.ensure_future(awaitable)
    with anyio.CancelScope(shield=True):
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            await _wait_done(future)
            if release is not None and not future.cancelled() and future.exception() is None:
                release(future.result())
            raise
    return result


async def _wait_done(future: asyncio.Future[Any]) -> None:
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue  # one cancellation is re-raised by the caller once the work is done
    if not future.cancelled():
        future.exception()  # retrieved: the cancellation supersedes a failure of the work


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise T2NErrorMisuse(
            f"chunk_bytes must be a positive int number of bytes, got {chunk_bytes!r}"
        )


def _open_reader(path: Path) -> tuple[io.FileIO, os.stat_result]:
    fd, stat = open_for_reading(path)
    return io.FileIO(fd, "rb", closefd=True), stat


def _close_reader(opened: tuple[io.FileIO, os.stat_result]) -> None:
    opened[0].close()


async def aread_payload(
    layout: PayloadLayout,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    names: Iterable[str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    executor: concurrent.futures.Executor | None = None,
) -> dict[str, torch.Tensor]:
    """Read entries of a payload file straight into CPU tensors, without blocking the loop.

    The asynchronous twin of :func:`read_payload` (same arguments, results and errors),
    reading with aiofiles in chunks of ``chunk_bytes`` in worker threads.

    Cancellation takes effect between chunks. The chunk in flight is always awaited to its
    end first, so when this coroutine raises (cancelled or not) or returns, no worker thread
    writes into the buffers any more: ``out`` may be reused or freed right away.

    Args:
        layout: the file's layout, from :func:`read_layout` or a writer.
        out: buffers to read into instead of allocating, by entry name.
        names: the entries to read (all when ``None``).
        chunk_bytes: bytes read per worker-thread call.
        executor: the executor running the file calls (the loop's default when ``None``);
            its size bounds how many reads run at once.

    Returns:
        the tensors by entry name in the order of ``names`` (file order by default).

    Raises:
        T2NErrorStorage: the file is missing, changed since ``layout`` was read, truncated or
            unreadable, or lacks a requested entry.
        T2NErrorMisuse: a buffer of ``out`` does not match its entry or is not requested.
    """
    _check_chunk_bytes(chunk_bytes)
    if not isinstance(layout, PayloadLayout):
        raise T2NErrorMisuse(
            f"aread_payload reads a PayloadLayout, got {type(layout).__name__}; get one with "
            "read_layout(path)"
        )
    path = layout.path
    loop = asyncio.get_running_loop()
    raw, stat = await _uncancellable(
        loop.run_in_executor(executor, _open_reader, path), release=_close_reader
    )
    file = aiofiles.threadpool.wrap(raw, loop=loop, executor=executor)
    try:
        check_unchanged(layout, stat)
        plan = plan_read(layout, out, select_entries(layout, names))
        position = 0
        for offset, view in plan.jobs:
            if offset != position:
                position = await _uncancellable(file.seek(offset))
            done = 0
            while done < len(view):
                await anyio.lowlevel.checkpoint_if_cancelled()
                count = await _uncancellable(file.readinto(view[done : done + chunk_bytes]))
                if not count:
                    raise short_read(path, position, "tensor data")
                done += count
                position += count
        await _uncancellable(
            loop.run_in_executor(executor, check_unchanged_after_read, layout, raw.fileno())
        )
    except T2NErrorStorage:
        raise  # already names the file and the rule (it is an OSError too)
    except OSError as exc:
        raise T2NErrorStorage(
            f"cannot read payload file '{path}': {os_error_message(exc)}"
        ) from exc
    finally:
        await _uncancellable(file.close())
    return plan.result


async def awrite_payload(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    executor: concurrent.futures.Executor | None = None,
) -> PayloadLayout:
    """Write a payload file atomically, without blocking the loop.

    The asynchronous twin of :func:`write_payload` (same arguments but the ``before_replace``
    and ``after_replace`` hooks, same result and errors): data is written with aiofiles in
    chunks of ``chunk_bytes`` to a temporary file next to ``path``, which is then forced to
    disk and renamed over ``path`` in a worker thread.

    Cancellation before the final rename removes the temporary file and leaves ``path``
    unchanged; once the rename has started it completes, and the cancellation is raised after
    it (``path`` then holds the new payload). The tensors must not be modified until this
    coroutine returns or raises.

    Args:
        path: the destination file; its directory must exist.
        tensors: the entries to write, by name.
        metadata: strings stored as the header's ``__metadata__``.
        fsync: force data and directory entry to disk before returning.
        chunk_bytes: bytes written per worker-thread call.
        executor: the executor running the file calls (the loop's default when ``None``).

    Returns:
        the layout of the written file.

    Raises:
        T2NErrorMisuse: a tensor, name or metadata item cannot be stored.
        T2NErrorStorage: the file cannot be written (the ``OSError`` is chained); ``path`` is
            unchanged.
    """
    _check_chunk_bytes(chunk_bytes)
    path = Path(path)
    plan, by_name = prepare_write(tensors, metadata)
    loop = asyncio.get_running_loop()
    atomic = AtomicFile(path)
    try:
        await _uncancellable(loop.run_in_executor(executor, atomic.create))
        assert atomic.fd is not None
        # A second file object on the temporary descriptor, which stays owned by ``atomic``.
        raw = io.FileIO(atomic.fd, "wb", closefd=False)
        try:
            file = aiofiles.threadpool.wrap(raw, loop=loop, executor=executor)
            await _write_chunked(file, memoryview(plan.header), chunk_bytes)
            for name in plan.entries:
                for piece in tensor_pieces(by_name[name]):
                    await _write_chunked(file, piece, chunk_bytes)
        finally:
            raw.close()  # no system call: the descriptor is closed by ``atomic``
        await anyio.lowlevel.checkpoint_if_cancelled()
        stat = await _uncancellable(
            loop.run_in_executor(executor, functools.partial(atomic.commit, fsync=fsync))
        )
    except OSError as exc:
        raise write_error(path, exc, replaced=atomic.replaced) from exc
    finally:
        await _uncancellable(loop.run_in_executor(executor, atomic.discard))
    return committed_layout(path, plan, stat)


async def _write_chunked(file: Any, view: memoryview, chunk_bytes: int) -> None:
    while len(view):
        await anyio.lowlevel.checkpoint_if_cancelled()
        written = await _uncancellable(file.write(view[:chunk_bytes]))
        view = view[written:]
