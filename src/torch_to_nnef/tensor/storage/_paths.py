"""Payload file names: tensor names are sanitized, never used as paths.

A payload of tensor ``name`` with storage id ``storage_id`` is stored in ``offload_dir`` as
``<sanitized name>.<storage_id>.safetensors``. The sanitized name keeps ASCII letters, digits,
``.``, ``_`` and ``-`` (everything else, path separators and NUL included, becomes ``_``),
never starts with a dot and never holds ``..``, and is bounded in length (a long name is cut
and suffixed with a hash of the full name, so distinct long names stay distinct).

Temporaries are named after the process that owns them, so that those of a killed process can
be told from those of a live one: a payload being written is
``.<destination name>.t2n-<pid>-<random>.tmp`` next to its destination, a private offload
directory is ``t2n_offload_<pid>_<random>`` in the system's temporary directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

from torch_to_nnef.exceptions import T2NErrorMisuse

__all__ = ["payload_path"]

PAYLOAD_SUFFIX = ".safetensors"
MAX_NAME_CHARS = 120
_HASH_CHARS = 16
MAX_STORAGE_ID_CHARS = 64
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_DOT_RUNS = re.compile(r"\.{2,}")
_STORAGE_ID = re.compile(r"[A-Za-z0-9_-]+")
_TEMP_NAME = re.compile(r"\..+\.t2n-([0-9]{1,10})-[0-9a-f]{16}\.tmp")
PRIVATE_DIR_PREFIX = "t2n_offload_"
_PRIVATE_DIR_NAME = re.compile(r"t2n_offload_([0-9]{1,10})_[a-z0-9_]+")


def path_argument(
    value: object, argument: str, meaning: str, *, function: str = "", optional: bool = False
) -> Path:
    """``value``, an argument that names a file or a directory, as a path.

    Args:
        value: what the caller passed.
        argument: the argument's name, as the caller wrote it.
        meaning: what the path must lead to (``"a directory's path"``).
        function: the function the argument belongs to, named first; ``""``: none named.
        optional: ``None`` is accepted by the caller too (said in the message; the caller
            handles it before this check).

    Raises:
        T2NErrorMisuse: ``value`` is not a ``str`` or an ``os.PathLike``, or is an empty
            string (which ``Path`` takes for the working directory); the message names the
            argument, what it must be and what was received.
    """
    named = f"{function}(): " if function else ""
    if not isinstance(value, str | os.PathLike):
        raise T2NErrorMisuse(
            f"{named}{argument} must be {meaning} (a str or os.PathLike)"
            f"{' or None' if optional else ''}, got {type(value).__name__}"
        )
    if isinstance(value, str) and not value:
        raise T2NErrorMisuse(
            f"{named}{argument} is an empty string, which names no path: pass {meaning} "
            f"('.' for the working directory){' or None' if optional else ''}"
        )
    return Path(value)


def sanitize_name(name: str) -> str:
    """Turn a tensor name into a safe file-name stem (see the module documentation)."""
    if not isinstance(name, str):
        raise T2NErrorMisuse(f"a payload name must be a str, got {type(name).__name__}")
    safe = _DOT_RUNS.sub(".", _UNSAFE_CHARS.sub("_", name))
    if safe.startswith("."):
        safe = "_" + safe[1:]
    if not safe:
        safe = "_"
    if len(safe) > MAX_NAME_CHARS:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
        safe = f"{safe[: MAX_NAME_CHARS - _HASH_CHARS - 1]}-{digest}"
    return safe


def check_storage_id(storage_id: str) -> str:
    """Return ``storage_id`` if it is 1 to 64 of ``[A-Za-z0-9_-]``; raise otherwise."""
    if (
        not isinstance(storage_id, str)
        or len(storage_id) > MAX_STORAGE_ID_CHARS
        or _STORAGE_ID.fullmatch(storage_id) is None
    ):
        raise T2NErrorMisuse(
            f"storage_id must be 1 to {MAX_STORAGE_ID_CHARS} characters among A-Z, a-z, 0-9, "
            f"'_' and '-', got {storage_id!r}; use e.g. uuid.uuid4().hex"
        )
    return storage_id


def payload_path(offload_dir: str | os.PathLike[str], name: str, storage_id: str) -> Path:
    """The path of the payload file of tensor ``name`` with id ``storage_id`` in ``offload_dir``.

    The file name is ``<sanitized name>.<storage_id>.safetensors``; whatever ``name`` holds
    (separators, ``..``, NUL, thousands of characters), the file is directly inside
    ``offload_dir``. The directory is resolved to an absolute path; it need not exist yet.

    Args:
        offload_dir: the directory of payload files.
        name: the tensor name (any string).
        storage_id: a unique id of the payload, 1 to 64 of ``[A-Za-z0-9_-]``.

    Returns:
        the absolute path of the payload file.

    Raises:
        T2NErrorMisuse: ``name`` is not a str, or ``storage_id`` is not a valid id.
    """
    directory = Path(offload_dir).resolve()
    file_name = f"{sanitize_name(name)}.{check_storage_id(storage_id)}{PAYLOAD_SUFFIX}"
    path = directory / file_name
    if path.parent != directory or not path.is_relative_to(directory):
        raise AssertionError(f"payload file name {file_name!r} escapes {directory}")
    return path


def temp_name(destination_name: str) -> str:
    """A fresh name for a temporary file of this process next to ``destination_name``."""
    return f".{destination_name[:100]}.t2n-{os.getpid()}-{secrets.token_hex(8)}.tmp"


def private_dir_prefix() -> str:
    """The prefix of this process's private offload directories (``tempfile.mkdtemp``)."""
    return f"{PRIVATE_DIR_PREFIX}{os.getpid()}_"


def temp_owner(name: str) -> int | None:
    """The pid of the process that named the temporary file ``name``; ``None``: not ours."""
    match = _TEMP_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))


def private_dir_owner(name: str) -> int | None:
    """The pid of the process that named the private directory ``name``; ``None``: not ours."""
    match = _PRIVATE_DIR_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))
