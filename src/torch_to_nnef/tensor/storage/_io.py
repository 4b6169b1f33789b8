"""Synchronous payload I/O: layout parsing, reads into tensor buffers, atomic writes.

Reads use ``os.preadv`` at absolute offsets straight into the destination tensors, one system
call for each run of adjacent entries, looping on short reads. Writes go to a temporary file
created next to the destination (``O_CREAT | O_EXCL | O_NOFOLLOW``), which is flushed to disk
and renamed over the destination: a crash leaves either the old or the new payload.

A writer holds an advisory lock (``flock``) on its temporary file, and names it after its pid
(see ``_paths``). The first write of a process in a directory removes the temporaries that
killed writers left there: those named as ours whose process is gone and that no one locks.
Private offload directories are cleaned the same way (:func:`make_private_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import shutil
import stat as stat_module
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import torch

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor.storage._buffers import (
    byte_view,
    plan_read,
    prepare_tensors,
    select_entries,
    tensor_pieces,
)
from torch_to_nnef.tensor.storage._device import Transfer, mark_pending, resolve_device
from torch_to_nnef.tensor.storage._format import (
    PREFIX_BYTES,
    EntrySpec,
    HeaderPlan,
    PayloadLayout,
    check_metadata,
    file_identity,
    header_length,
    parse_header,
    plan_header,
)
from torch_to_nnef.tensor.storage._paths import (
    private_dir_owner,
    private_dir_prefix,
    temp_name,
    temp_owner,
)

__all__ = [
    "make_private_dir",
    "open_regular_file",
    "read_layout",
    "read_payload",
    "read_to_device",
    "write_payload",
]

_T = TypeVar("_T", bound=torch.Tensor)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # so that opening a FIFO never blocks
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
READ_FLAGS = os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK
_IOV_MAX = 1024  # buffers per vectored read: the POSIX minimum of IOV_MAX
SEQUENTIAL_MIN_BYTES = 128 * 1024
"""Reads of fewer bytes tell the kernel nothing of their pattern (``POSIX_FADV_SEQUENTIAL``):
the readahead of the read itself covers them, and small loads save a system call."""
_TEMP_ATTEMPTS = 8


# ---------------------------------------------------------------------------------------------
# Opening and checking
# ---------------------------------------------------------------------------------------------
def os_error_message(exc: OSError) -> str:
    """The readable part of an ``OSError``."""
    return exc.strerror or str(exc)


def open_error(path: Path, exc: OSError) -> T2NErrorStorage:
    """The error for a payload file that cannot be opened (or found)."""
    return T2NErrorStorage(f"cannot open payload file '{path}': {os_error_message(exc)}")


def open_for_reading(path: Path) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only and check that it is a regular file.

    Returns:
        the file descriptor (the caller closes it) and the file's ``stat``.

    Raises:
        T2NErrorStorage: the file cannot be opened or is not a regular file.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        raise open_error(path, exc) from exc
    try:
        stat = check_regular_file(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, stat


class reading:  # named as it is used, like contextlib.closing
    """``with reading(path) as (fd, stat):``: :func:`open_for_reading`, its descriptor closed
    as the block ends.

    Ctrl-C (main thread) is held from the open until the descriptor is recorded for the
    close, and raised then, the descriptor closed: a KeyboardInterrupt landing between an
    ``open`` and the ``try`` that closes its descriptor would leak it (and, once the file is
    replaced, the old file's disk space with it). A class, not a generator, for the same
    reason: its ``__enter__`` closes what it opened if an interrupt cuts it.
    """

    __slots__ = ("_fd", "_path")

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> tuple[int, os.stat_result]:
        try:
            with InterruptHold() as hold:
                hold.start()
                self._fd, stat = open_for_reading(self._path)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self._fd, stat

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        fd, self._fd = self._fd, None  # no call before the close's: nothing to interrupt
        if fd is not None:
            os.close(fd)


def open_regular_file(path: str | os.PathLike[str]) -> io.FileIO:
    """Open ``path`` for reading as every reader of payload files does: without blocking
    (a FIFO nobody writes to is refused at once) and only when it is a regular file.

    Args:
        path: the file to open (a payload, a checkpoint shard or index).

    Ctrl-C (main thread) is held from the open until the descriptor is owned by the file
    object, which closes it as it goes: a KeyboardInterrupt landing between the ``open`` and
    the file object's making would leak the descriptor (see :class:`reading`).

    Returns:
        the open file, unbuffered; the caller closes it.

    Raises:
        T2NErrorStorage: the file cannot be opened or is not a regular file (a directory, a
            device, a FIFO); the message names the path.
    """
    path = Path(path)
    with InterruptHold() as hold:
        hold.start()
        fd, _stat = open_for_reading(path)
        try:
            return io.FileIO(fd, "rb", closefd=True)
        except BaseException:
            os.close(fd)
            raise


def check_regular_file(path: Path, fd: int) -> os.stat_result:
    """``fstat`` the open ``fd``; raise :class:`T2NErrorStorage` unless it is a regular file."""
    try:
        stat = os.fstat(fd)
    except OSError as exc:
        raise T2NErrorStorage(
            f"cannot inspect payload file '{path}': {os_error_message(exc)}"
        ) from exc
    check_regular(path, stat)
    return stat


def check_regular(path: Path, stat: os.stat_result) -> None:
    """Raise :class:`T2NErrorStorage` unless ``stat`` is that of a regular file."""
    if not stat_module.S_ISREG(stat.st_mode):
        kind = "a directory" if stat_module.S_ISDIR(stat.st_mode) else "not a regular file"
        raise T2NErrorStorage(f"payload path '{path}' is {kind}; a payload must be a regular file")


def _changed(layout: PayloadLayout, stat: os.stat_result) -> bool:
    """Whether ``stat`` is not that of the file ``layout`` was made from."""
    if layout.identity is not None:
        return file_identity(stat) != layout.identity
    return stat.st_size != layout.file_size


def check_unchanged(layout: PayloadLayout, stat: os.stat_result) -> None:
    """Raise :class:`T2NErrorStorage` if the file is not the one ``layout`` was made from."""
    if _changed(layout, stat):
        raise T2NErrorStorage(
            f"payload file '{layout.path}' was replaced or modified since its layout was read "
            f"({stat.st_size} bytes now, {layout.file_size} then); call read_layout() again"
        )


def check_unchanged_after_read(layout: PayloadLayout, fd: int) -> None:
    """Raise :class:`T2NErrorStorage` if the open file ``fd`` of ``layout`` was written in
    place while it was read (its identity checked before the read no longer holds): what was
    read may be half old, half new."""
    if _changed(layout, check_regular_file(layout.path, fd)):
        raise T2NErrorStorage(
            f"payload file '{layout.path}' was modified in place while it was read (what was "
            "read may be half old, half new); a payload file must only be replaced, never "
            "rewritten in place: read it again once its writer is done"
        )


def changed_since_read(layout: PayloadLayout) -> bool:
    """Whether the file at ``layout``'s path is not the one ``layout`` was made from (replaced
    or rewritten since); ``False`` when it cannot be looked at (its read says why)."""
    try:
        stat = os.stat(layout.path)
    except OSError:
        return False
    try:
        check_unchanged(layout, stat)
    except T2NErrorStorage:
        return True
    return False


def short_read(path: Path, offset: int, what: str) -> T2NErrorStorage:
    """The error for a file that ends before ``offset`` while reading ``what``."""
    return T2NErrorStorage(
        f"payload file '{path}' ended at byte {offset} while reading {what} (truncated file)"
    )


def _seek_and_readv(fd: int, views: list[memoryview], offset: int) -> int:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.readv(fd, views)


_preadv: Callable[[int, list[memoryview], int], int] = getattr(os, "preadv", _seek_and_readv)


def pread_exact(fd: int, path: Path, views: list[memoryview], offset: int, what: str) -> None:
    """Fill ``views`` with the bytes of ``fd`` that start at ``offset``, in order.

    Loops on short reads; a read that returns nothing before the views are full means the
    file is shorter than expected.

    Raises:
        T2NErrorStorage: the file is too short, or the read failed.
    """
    pending = [view for view in views if len(view)]
    while pending:
        batch = pending[:_IOV_MAX]
        try:
            count = _preadv(fd, batch, offset)
        except OSError as exc:
            raise T2NErrorStorage(
                f"cannot read payload file '{path}' at byte {offset}: {os_error_message(exc)}"
            ) from exc
        if count == 0:
            raise short_read(path, offset, what)
        offset += count
        while count:
            head = pending[0]
            if count >= len(head):
                count -= len(head)
                pending.pop(0)
            else:
                pending[0] = head[count:]
                count = 0


def contiguous_runs(jobs: list[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Group ``(offset, view)`` jobs sorted by offset into runs of adjacent file ranges."""
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, view in jobs:
        if runs and offset == end:
            runs[-1][1].append(view)
        else:
            runs.append((offset, [view]))
        end = offset + len(view)
    return runs


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def read_layout(path: str | os.PathLike[str]) -> PayloadLayout:
    """Read and validate the header of the payload file ``path``.

    Nothing is allocated for the data: the header is checked against the file size first
    (length field at most :data:`MAX_HEADER_BYTES` and within the file, UTF-8 JSON object,
    known dtypes, non-negative shapes, offsets contiguous from 0 up to the end of the file,
    each span equal to ``numel * itemsize``, ``__metadata__`` mapping str to str).

    Args:
        path: the payload file (ours, or any ``.safetensors`` file).

    Returns:
        the layout of the file.

    Raises:
        T2NErrorStorage: the file is missing, not a regular file, unreadable or invalid; the
            message names the path and the rule broken.
    """
    path = Path(path)
    with reading(path) as (fd, stat):
        prefix = bytearray(PREFIX_BYTES)
        if stat.st_size >= PREFIX_BYTES:
            pread_exact(fd, path, [memoryview(prefix)], 0, "the header length")
        length = header_length(path, bytes(prefix), stat.st_size)
        raw = bytearray(length)
        pread_exact(fd, path, [memoryview(raw)], PREFIX_BYTES, "the header")
    entries, metadata = parse_header(path, raw, stat.st_size)
    return PayloadLayout(path, entries, metadata, stat.st_size, identity=file_identity(stat))


def read_payload(
    layout: PayloadLayout,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Read entries of a payload file straight into CPU tensors.

    Args:
        layout: the file's layout, from :func:`read_layout` or :func:`write_payload`.
        out: buffers to read into instead of allocating, by entry name (buffer reuse); each
            must be a contiguous CPU tensor of the entry's dtype and shape. Entries without a
            buffer here get a fresh one.
        names: the entries to read (all when ``None``).

    Returns:
        the tensors by entry name in the order of ``names`` (file order by default); the
        tensors of ``out`` are returned themselves, filled. A fresh buffer of 128 KiB or more
        maps memory of its own, given back to the system when its last tensor is freed (its
        storage cannot be resized).

    Raises:
        T2NErrorStorage: the file is missing, changed since ``layout`` was read, truncated or
            unreadable, or lacks a requested entry.
        T2NErrorMisuse: a buffer of ``out`` does not match its entry or is not requested.
    """
    return read_entries(layout, select_entries(layout, names), out)


def read_entries(
    layout: PayloadLayout, specs: list[EntrySpec], out: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """:func:`read_payload` of the entries ``specs`` (from ``select_entries``)."""
    with reading(layout.path) as (fd, stat):
        check_unchanged(layout, stat)
        plan = plan_read(layout, out, specs)
        if plan.nbytes >= SEQUENTIAL_MIN_BYTES and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for offset, views in contiguous_runs(plan.jobs):
            pread_exact(fd, layout.path, views, offset, "tensor data")
        check_unchanged_after_read(layout, fd)
    return plan.result


def read_to_device(
    layout: PayloadLayout,
    device: torch.device | str,
    build: Callable[[dict[str, torch.Tensor]], _T],
    *,
    names: Iterable[str] | None = None,
) -> _T:
    """Read entries of a payload file straight to a CUDA device; return ``build(tensors)``.

    The file is read chunk by chunk into the device's ring of pinned chunks, and each chunk
    is copied on the device's copy stream while the next is read: no pinned buffer the size
    of the payload, and the copies never wait for compute. ``build`` (decoding an opaque
    payload, say) runs with the copy stream current, so its kernels follow the copies. The
    function returns once the file is read and the copies are queued: the value is *pending*
    until :func:`handoff` hands it to a consumer, whose stream then waits for the copies.
    Meant for worker threads (the pool's loads); resolve ``"cuda"`` where the user called.

    Args:
        layout: the file's layout.
        device: a CUDA device.
        build: makes the value from the device tensors, by entry name.
        names: the entries to read (all when ``None``), in the order given to ``build``.

    Raises:
        T2NErrorStorage: the file is missing, changed since ``layout`` was read, truncated or
            unreadable, or lacks a requested entry.
    """
    transfer = Transfer(resolve_device(device))
    specs = select_entries(layout, names)
    with reading(layout.path) as (fd, stat):
        check_unchanged(layout, stat)
        if hasattr(os, "posix_fadvise") and specs:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        tensors: dict[str, torch.Tensor] = {}
        for spec in specs:
            tensors[spec.name] = target = transfer.empty(spec.shape, spec.dtype)

            def fill(offset: int, chunk: torch.Tensor, start: int = spec.start) -> None:
                pread_exact(fd, layout.path, [byte_view(chunk)], start + offset, "tensor data")

            transfer.stage(target, fill)
        check_unchanged_after_read(layout, fd)
    value = transfer.on_stream(lambda: build(tensors))
    mark_pending(value, transfer.ready())
    return value


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def write_error(path: Path, exc: OSError, *, replaced: bool) -> T2NErrorStorage:
    """The error for a failed write of the payload ``path`` (``replaced``: after the rename)."""
    outcome = (
        "the new content is in place but may not survive a power loss"
        if replaced
        else "the previous content of the file, if any, is unchanged"
    )
    return T2NErrorStorage(
        f"cannot write payload file '{path}': {os_error_message(exc)}; {outcome}"
    )


class AtomicFile:
    """A temporary file next to ``destination`` that replaces it atomically on :meth:`commit`.

    Use: :meth:`create`, :meth:`write` the content, :meth:`commit`; :meth:`discard` in every
    case (a no-op after a commit). The directory is opened once with ``O_NOFOLLOW`` and every
    later step works relative to that descriptor, so a directory swapped for a symbolic link
    (to write elsewhere) is refused, and a directory swapped after the opening is not written
    through either. The temporary file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under
    a random hidden name, so a symbolic link planted at that name is never followed. The
    methods raise ``OSError``; callers turn it into :class:`T2NErrorStorage` and call
    :meth:`discard`.
    """

    def __init__(self, destination: Path) -> None:
        self.destination = destination
        self.temp: str | None = None
        self.fd: int | None = None
        self.dir_fd: int | None = None
        self.replaced = False

    def create(self) -> None:
        """Open the directory, then create the temporary file under a fresh random name.

        Ctrl-C (main thread) is raised once what was opened and created is recorded, for
        :meth:`discard` to close and remove: landing in between, it would leak them.
        """
        with InterruptHold() as hold:
            hold.start()
            self.dir_fd = os.open(
                self.destination.parent, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
            )
            self.fd, self.temp = self._create_temporary(self.dir_fd)
        _lock(self.fd, blocking=True)  # held until the file is closed: a live writer's
        remove_stale_temporaries(self.dir_fd)

    def _create_temporary(self, dir_fd: int) -> tuple[int, str]:
        """The descriptor and name of a new temporary file in the directory ``dir_fd``."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        for _attempt in range(_TEMP_ATTEMPTS - 1):
            candidate = temp_name(self.destination.name)
            with contextlib.suppress(FileExistsError):
                return os.open(candidate, flags, 0o644, dir_fd=dir_fd), candidate
        candidate = temp_name(self.destination.name)  # the last attempt raises
        return os.open(candidate, flags, 0o644, dir_fd=dir_fd), candidate

    def write(self, view: memoryview) -> None:
        """Write all of ``view``, looping on partial writes."""
        assert self.fd is not None
        while len(view):
            view = view[os.write(self.fd, view) :]

    def commit(
        self,
        *,
        fsync: bool,
        before_replace: Callable[[], object] | None = None,
        after_replace: Callable[[os.stat_result], object] | None = None,
    ) -> os.stat_result:
        """Flush, close and rename the temporary file over the destination.

        With ``fsync`` the data and then the directory entry are forced to disk;
        ``before_replace`` is called right before the rename, ``after_replace`` (given the
        file's ``stat``) right after it, before the directory entry is forced to disk.

        Returns:
            the ``stat`` of the committed file.
        """
        assert self.fd is not None and self.temp is not None and self.dir_fd is not None
        if fsync:
            os.fsync(self.fd)
        stat = os.fstat(self.fd)
        fd, self.fd = self.fd, None
        os.close(fd)
        if before_replace is not None:
            before_replace()
        os.replace(self.temp, self.destination.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.temp = None
        self.replaced = True
        if after_replace is not None:
            after_replace(stat)
        if fsync:
            _fsync_descriptor(self.dir_fd)
        self._close_directory()
        return stat

    def discard(self) -> None:
        """Close and remove the temporary file, if still there; never raises ``OSError``.

        Each descriptor and name is taken out of the object, then closed or removed, with no
        call in between (a ``try``, not ``contextlib.suppress``, whose ``__init__`` is one):
        a Ctrl-C cannot land between the two and leave it open or in place.
        """
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:  # noqa: SIM105 (see above)
                os.close(fd)
            except OSError:
                pass
        if self.temp is not None:
            temp, self.temp = self.temp, None
            try:  # noqa: SIM105 (see above)
                os.unlink(temp, dir_fd=self.dir_fd)
            except OSError:
                pass
        self._close_directory()

    def _close_directory(self) -> None:
        if self.dir_fd is not None:
            dir_fd, self.dir_fd = self.dir_fd, None
            try:  # noqa: SIM105 (see discard)
                os.close(dir_fd)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# Temporaries of killed processes
# ---------------------------------------------------------------------------------------------
_CLEANED: set[tuple[int, int]] = set()  # directories this process cleaned (device, inode)
_CLEANED_LOCK = fork_safe_lock()
_PRIVATE_LOCK_NAME = ".t2n-owner.lock"


def _first_visit(stat: os.stat_result) -> bool:
    """Whether this process visits the directory of ``stat`` for cleaning the first time."""
    key = (stat.st_dev, stat.st_ino)
    with _CLEANED_LOCK:
        if key in _CLEANED:
            return False
        _CLEANED.add(key)
        return True


def _lock(fd: int, *, blocking: bool) -> bool:
    """Take the advisory lock of ``fd``; return whether it was taken (never raises)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another, or a file system without locks
        return False
    return True


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` may be running (this one, or any that a signal can reach)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. a process of another user: alive
        return True
    return True


def remove_stale_temporaries(dir_fd: int) -> None:
    """Remove the temporary files killed writers left in the directory ``dir_fd`` (once per
    directory and process; never raises ``OSError``).

    A file is removed only when it is named as ours, its writer's pid is not running, it is
    a regular file, no one holds its lock, and it is still the file that was checked.
    """
    try:
        if not _first_visit(os.fstat(dir_fd)):
            return
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        pid = temp_owner(name)
        if pid is None or process_alive(pid):
            continue
        try:
            fd = os.open(name, READ_FLAGS | _O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            stat = os.fstat(fd)
            if stat_module.S_ISREG(stat.st_mode) and _lock(fd, blocking=False):
                now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (stat.st_dev, stat.st_ino):
                    os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def remove_stale_private_dirs(parent: Path) -> None:
    """Remove the private offload directories that killed processes left in ``parent`` (once
    per process; never raises ``OSError``): named as ours, their pid not running, a directory
    (not a link), and their owner's lock file free or never created."""
    try:
        if not _first_visit(os.stat(parent)):
            return
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        pid = private_dir_owner(entry.name)
        if pid is None or process_alive(pid):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd: int | None = os.open(
                Path(entry.path) / _PRIVATE_LOCK_NAME, READ_FLAGS | _O_NOFOLLOW
            )
        except FileNotFoundError:
            fd = None  # killed before it locked the directory
        except OSError:
            continue
        try:
            if fd is None or _lock(fd, blocking=False):
                shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)


def make_private_dir() -> tuple[Path, int]:
    """Create a private offload directory in the system's temporary directory, locked by
    this process, after removing those that killed processes left there.

    Returns:
        the directory and the descriptor of its lock (close it when the directory goes).
    """
    parent = Path(tempfile.gettempdir())
    remove_stale_private_dirs(parent)
    path = Path(tempfile.mkdtemp(prefix=private_dir_prefix(), dir=parent))
    fd = os.open(
        path / _PRIVATE_LOCK_NAME,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
        0o600,
    )
    _lock(fd, blocking=True)
    return path, fd


def _fsync_descriptor(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems without dir fsync
            raise


def prepare_write(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[HeaderPlan, dict[str, torch.Tensor]]:
    """Check what is to be written and lay it out: the header and the CPU tensors by name."""
    prepared = dict(prepare_tensors(tensors))
    plan = plan_header(
        [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in prepared.items()],
        check_metadata(metadata),
    )
    return plan, prepared


def committed_layout(path: Path, plan: HeaderPlan, stat: os.stat_result) -> PayloadLayout:
    """The layout of a file just committed from ``plan``."""
    if stat.st_size != plan.file_size:
        raise T2NErrorStorage(
            f"payload file '{path}' has {stat.st_size} bytes after writing, "
            f"expected {plan.file_size}"
        )
    return PayloadLayout(
        path, plan.entries, plan.metadata, stat.st_size, identity=file_identity(stat)
    )


def write_payload(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
    before_replace: Callable[[], object] | None = None,
    after_replace: Callable[[PayloadLayout], object] | None = None,
) -> PayloadLayout:
    """Write ``tensors`` and ``metadata`` to the payload file ``path``, atomically.

    The file is written next to ``path`` under a temporary name, forced to disk, and renamed
    over ``path``: readers and crashes see the old file or the new one, never a mix. A symbolic
    link at ``path`` is replaced, not followed. Tensor data goes to the file from the tensors'
    own memory; non-contiguous tensors are streamed through a bounded staging buffer, tensors
    on other devices are copied to the CPU first.

    Args:
        path: the destination file; its directory must exist.
        tensors: the entries to write, by name (any order; the file orders them by decreasing
            element size).
        metadata: strings stored as the header's ``__metadata__``.
        fsync: force data and directory entry to disk before returning (turn off only for
            scratch files that need not survive a power loss).
        before_replace: called right before the new file is renamed over ``path``, once
            everything else is written; for a caller that must not be interrupted from the
            rename to its own switch to the new file (an ``InterruptHold`` started there).
        after_replace: called with the new file's layout right after the rename, before
            the directory entry is forced to disk: a caller switching to the new file there
            has switched even when forcing it fails (the error is raised after).

    Returns:
        the layout of the written file.

    Raises:
        T2NErrorMisuse: a tensor, name or metadata item cannot be stored.
        T2NErrorStorage: the file cannot be written (the ``OSError`` is chained); the
            temporary file is removed and ``path`` is unchanged.
    """
    path = Path(path)
    plan, by_name = prepare_write(tensors, metadata)
    atomic = AtomicFile(path)
    layouts: list[PayloadLayout] = []

    def replaced(stat: os.stat_result) -> None:
        layouts.append(committed_layout(path, plan, stat))
        if after_replace is not None:
            after_replace(layouts[0])

    try:
        atomic.create()
        atomic.write(memoryview(plan.header))
        for name in plan.entries:
            for piece in tensor_pieces(by_name[name]):
                atomic.write(piece)
        atomic.commit(fsync=fsync, before_replace=before_replace, after_replace=replaced)
    except OSError as exc:
        raise write_error(path, exc, replaced=atomic.replaced) from exc
    finally:
        atomic.discard()
    return layouts[0]
