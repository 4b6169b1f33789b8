"""The tract Q4_0 flavour of the NNEF tensor file (``.dat``) and its atomic writer.

File layout (all integers little-endian)::

    offset  size  field
    0       2     magic 0x4E 0xEF
    2       1     version major (1)
    3       1     version minor (0)
    4       4     data length in bytes (u32)
    8       4     rank (u32)
    12      32    8 dims (u32 each, unused ones 0)
    44      4     bits per item (u32): 0xFFFFFFFF, "not a fixed bit width"
    48      2     item type (u16): 0x3040, or 0x2040 for the legacy nibble order
    50      2     item type vendor (u16): 'T' << 8 | 'R' (tract)
    52      76    reserved, zero (deprecated quantization parameters and padding)
    128     ...   one 18-byte block per group of 32 values, in row-major order

The item type is written as the bytes ``40 30`` (``40 20`` legacy), which torch-to-nnef spells
"4030" (resp. "4020"). Each block is the group's float16 scale followed by 16 bytes of
4-bit codes: in the current layout byte ``j`` holds code ``j`` in its low nibble and code
``j + 16`` in its high nibble (GGML's order, read by tract >= 0.21.11); in the legacy layout
byte ``j`` holds codes ``2j`` (low) and ``2j + 1`` (high).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import struct
import sys
import tempfile
from pathlib import Path

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.storage._paths import path_argument

__all__ = ["Q40Layout", "label_path", "q40_dat_bytes", "write_dat_file"]

Q40_GROUP_SIZE = 32
Q40_BLOCK_BYTES = 2 + Q40_GROUP_SIZE // 2
_HEADER = struct.Struct("<2sBBII8IIHH76x")
_MAGIC = b"\x4e\xef"
_BITS_PER_ITEM_OPAQUE = 0xFFFF_FFFF
_TRACT_VENDOR = (ord("T") << 8) | ord("R")
_MAX_RANK = 8
_U32_MAX = 0xFFFF_FFFF
_COMPARE_CHUNK = 1 << 20


class Q40Layout(enum.Enum):
    """Order of the 4-bit codes inside a Q4_0 block of a tract ``.dat`` file.

    ``CURRENT`` is read by tract 0.21.11 and later; ``LEGACY`` by earlier versions (later
    versions still read it and reorder it on load).
    """

    CURRENT = 0x3040
    LEGACY = 0x2040

    @property
    def item_type(self) -> int:
        """The u16 item type written in the file header."""
        return self.value

    @classmethod
    def for_tract_version(cls, version: str) -> Q40Layout:
        """Return the layout a given tract version reads (``"0.21.10"`` -> ``LEGACY``).

        Raises:
            T2NErrorMisuse: ``version`` is not a dotted version number.
        """
        try:
            parts = tuple(int(p) for p in version.strip().lstrip("v").split(".")[:3])
        except ValueError:
            raise T2NErrorMisuse(
                f"tract version must look like '0.21.11', got {version!r}"
            ) from None
        return cls.CURRENT if parts >= (0, 21, 11) else cls.LEGACY


def _header(shape: tuple[int, ...], data_length: int, layout: Q40Layout) -> bytes:
    if not 1 <= len(shape) <= _MAX_RANK:
        raise T2NErrorMisuse(f"an NNEF tensor has rank 1 to {_MAX_RANK}, got shape {shape}")
    if data_length > _U32_MAX or any(d > _U32_MAX for d in shape):
        raise T2NErrorMisuse(
            f"tensor of shape {shape} ({data_length} bytes of blocks) does not fit the 32-bit "
            "sizes of an NNEF tensor header; split it into smaller tensors"
        )
    dims = list(shape) + [0] * (_MAX_RANK - len(shape))
    return _HEADER.pack(
        _MAGIC,
        1,
        0,
        data_length,
        len(shape),
        *dims,
        _BITS_PER_ITEM_OPAQUE,
        layout.item_type,
        _TRACT_VENDOR,
    )


def _blocks(codes: torch.Tensor, scale: torch.Tensor, layout: Q40Layout) -> torch.Tensor:
    """Return the ``(n_groups, 18)`` uint8 blocks of 4-bit ``codes`` with f16 ``scale``."""
    groups = codes.reshape(-1, Q40_GROUP_SIZE).to(device="cpu", dtype=torch.uint8)
    if layout is Q40Layout.CURRENT:
        low, high = groups[:, :16], groups[:, 16:]
    else:
        low, high = groups[:, 0::2], groups[:, 1::2]
    packed = low | (high << 4)
    scale_bytes = scale.reshape(-1, 1).to(device="cpu", dtype=torch.float16).view(torch.uint8)
    if sys.byteorder == "big":
        scale_bytes = scale_bytes.flip(1)
    return torch.cat([scale_bytes, packed], dim=1)


def q40_dat_bytes(
    codes: torch.Tensor, scale: torch.Tensor, layout: Q40Layout = Q40Layout.CURRENT
) -> tuple[bytes, torch.Tensor]:
    """Return the header and the block payload of a Q4_0 ``.dat`` file.

    Args:
        codes: uint8 codes from 0 to 15, shape of the tensor (rank 1 to 8), whose row-major
            order is cut into groups of 32.
        scale: the float16 scale of each group (``codes.numel() / 32`` values).
        layout: nibble order of the blocks.

    Returns:
        ``(header, blocks)``: the 128-byte header and a contiguous CPU uint8 tensor of
        ``(n_groups, 18)`` blocks.

    Raises:
        T2NErrorMisuse: shapes do not agree, codes exceed 4 bits, or sizes overflow the header.
    """
    shape = tuple(int(d) for d in codes.shape)
    if codes.dtype != torch.uint8:
        raise T2NErrorMisuse(f"Q4_0 codes must be torch.uint8, got {codes.dtype}")
    if codes.is_meta or scale.is_meta:
        raise T2NErrorMisuse("a meta tensor holds no values to write: write the loaded tensor")
    if codes.numel() % Q40_GROUP_SIZE != 0:
        raise T2NErrorMisuse(
            f"Q4_0 needs a volume divisible by {Q40_GROUP_SIZE}, got shape {shape}"
        )
    n_groups = codes.numel() // Q40_GROUP_SIZE
    if scale.numel() != n_groups:
        raise T2NErrorMisuse(
            f"Q4_0 tensor of shape {shape} has {n_groups} groups but {scale.numel()} scales"
        )
    if codes.numel() and int(codes.max()) > 15:
        raise T2NErrorMisuse(f"Q4_0 codes must be below 16, found {int(codes.max())}")
    header = _header(shape, n_groups * Q40_BLOCK_BYTES, layout)
    return header, _blocks(codes, scale, layout).contiguous()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """Return a zero-copy view of the bytes of a contiguous CPU uint8 tensor.

    The view does not own the memory: the caller keeps ``tensor`` alive while using it.
    """
    if tensor.device.type != "cpu" or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise T2NErrorMisuse("expected a contiguous CPU uint8 tensor of bytes")
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


def _same_content(path: Path, header: bytes, payload: memoryview) -> bool:
    if path.stat().st_size != len(header) + len(payload):
        return False
    with path.open("rb") as fh:
        if fh.read(len(header)) != header:
            return False
        position = 0
        while position < len(payload):
            chunk = fh.read(_COMPARE_CHUNK)
            if not chunk or chunk != payload[position : position + len(chunk)]:
                return False
            position += len(chunk)
    return True


def label_path(dirpath: str | os.PathLike[str], label: str) -> Path:
    """Return ``<dirpath>/<label>.dat``; ``label`` may name sub-folders with ``/``.

    Raises:
        T2NErrorMisuse: ``label`` is not a str, is empty or absolute, or has empty, ``.`` or
            ``..`` components, backslashes or NUL characters (it must stay inside ``dirpath``).
    """
    directory = path_argument(dirpath, "dirpath", "the model folder's path")
    parts = label.split("/") if isinstance(label, str) else [""]
    if any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in parts):
        raise T2NErrorMisuse(
            f"variable label {label!r} is not a relative path inside the model folder; "
            "use names like 'encoder/layer0.weight'"
        )
    return directory.joinpath(*parts[:-1], parts[-1] + ".dat")


_NAME_MAX = 255
"""The longest file name of common file systems, in bytes (a label's ``.dat`` name may use
it all)."""


def write_dat_file(path: Path, header: bytes, blocks: torch.Tensor) -> Path:
    """Write ``header`` then ``blocks`` to ``path`` atomically; return ``path``.

    The data goes to a temporary file in the same folder, is flushed to disk, then published
    under ``path`` with an exclusive hard link (``os.replace`` where the file system has no
    hard links), so readers never see a partial file. If ``path`` already holds exactly these
    bytes, nothing is written.

    Raises:
        T2NErrorMisuse: ``path`` already exists with different content (two tensors written
            under one label).
        T2NErrorStorage: the file could not be written.
    """
    payload = _byte_view(blocks)
    try:
        exists = path.exists()
    except OSError as exc:  # a name the file system refuses (too long)
        raise T2NErrorStorage(f"cannot write {path}: {exc}") from exc
    if exists:
        if not path.is_file():
            raise T2NErrorMisuse(f"{path} exists and is not a file: write into another folder")
        _check_existing(path, header, payload)
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Named after the label within the longest name the file system allows it.
        name = os.fsencode(path.name)[: _NAME_MAX - 16].decode(errors="ignore")
        prefix = f".{name}."
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise T2NErrorStorage(f"cannot create {path}: {exc}") from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header)
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        _publish(tmp, path, header, payload)
    except T2NErrorStorage:
        raise  # already names the file (it is an OSError too)
    except OSError as exc:
        raise T2NErrorStorage(f"cannot write {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path


def _publish(tmp: Path, path: Path, header: bytes, payload: memoryview) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        # Another writer published the same label meanwhile: same rule as before writing.
        _check_existing(path, header, payload)
    except OSError as exc:
        if exc.errno not in (
            errno.EPERM,
            errno.ENOTSUP,
            errno.EOPNOTSUPP,
            errno.EXDEV,
            errno.EMLINK,
        ):
            raise
        os.replace(tmp, path)


def _check_existing(path: Path, header: bytes, payload: memoryview) -> None:
    try:
        same = _same_content(path, header, payload)
    except OSError as exc:
        raise T2NErrorStorage(f"cannot read existing {path}: {exc}") from exc
    if not same:
        raise T2NErrorMisuse(
            f"{path} already holds different data: two different tensors were written under "
            "the same label; give each tensor its own label or write into an empty folder"
        )


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
