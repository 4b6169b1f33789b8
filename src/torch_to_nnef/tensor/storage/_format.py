"""The payload file format: the safetensors layout with a page-aligned data section.

A payload file is::

    u64 little-endian N | N bytes of UTF-8 JSON header (space padded) | raw little-endian data

The header maps each entry name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data section) and may hold a ``"__metadata__"`` object of
strings. Our writer pads the header so that ``8 + N`` is a multiple of :data:`DATA_ALIGNMENT`;
the reader accepts any padding, so plain ``safetensors`` files load too.

This module is pure: it encodes headers and validates parsed ones, without any I/O. Every rule
of the reference ``validate()`` of safetensors is applied before anything is allocated.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage

__all__ = [
    "DATA_ALIGNMENT",
    "MAX_HEADER_BYTES",
    "EntrySpec",
    "PayloadLayout",
]

DATA_ALIGNMENT = 4096
"""Our writer starts the data section at a multiple of this many bytes."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest JSON header accepted by the reader (the cap safetensors applies)."""

_LENGTH_PREFIX = struct.Struct("<Q")
PREFIX_BYTES = _LENGTH_PREFIX.size
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def _dtype_table() -> dict[str, torch.dtype]:
    """Names safetensors gives to the dtypes this torch build has."""
    candidates = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "C64": "complex64",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
    }
    table: dict[str, torch.dtype] = {}
    for code, attribute in candidates.items():
        dtype = getattr(torch, attribute, None)
        if isinstance(dtype, torch.dtype):
            table[code] = dtype
    return table


DTYPE_BY_CODE: Mapping[str, torch.dtype] = _dtype_table()
CODE_BY_DTYPE: Mapping[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """Return the safetensors name of ``dtype``; raise :class:`T2NErrorMisuse` if it has none."""
    try:
        return CODE_BY_DTYPE[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in CODE_BY_DTYPE)
        raise T2NErrorMisuse(
            f"dtype {dtype} cannot be stored in a payload file; supported dtypes: {known}"
        ) from None


@dataclass(frozen=True)
class EntrySpec:
    """Where one tensor of a payload file lives.

    Attributes:
        name: the entry name in the header.
        dtype: the element type.
        shape: the tensor shape.
        start: absolute byte offset in the file where the entry's data begins.
        nbytes: size of the entry's data in bytes (``numel * itemsize``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class PayloadLayout:
    """The validated description of a payload file, enough to read it without parsing again.

    Attributes:
        path: the file, made absolute (later reads find it whatever the working directory
            is by then).
        entries: the entries by name, in file order (increasing ``start``).
        metadata: the header's ``"__metadata__"`` strings (``{}`` when absent).
        file_size: the file size in bytes when the layout was read or written.
        identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of that file, set by the readers
            and writers of this package; reads refuse a file whose identity differs (it was
            replaced or modified since). ``None`` (a layout built by hand) checks the size only.
    """

    path: Path
    entries: Mapping[str, EntrySpec]
    metadata: Mapping[str, str]
    file_size: int
    identity: tuple[int, int, int, int] | None = field(
        default=None, repr=False, compare=False, kw_only=True
    )

    def __post_init__(self) -> None:
        if not self.path.is_absolute():
            object.__setattr__(self, "path", self.path.absolute())

    @property
    def nbytes(self) -> int:
        """Sum of the sizes of all entries, in bytes."""
        return sum(entry.nbytes for entry in self.entries.values())


def file_identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """The fields of ``stat`` that change when a file is replaced or rewritten."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeaderPlan:
    """The encoded header and the entries it describes, for a file about to be written."""

    header: bytes  # length prefix, JSON and padding: the data section starts right after it
    entries: dict[str, EntrySpec]
    metadata: dict[str, str]

    @property
    def file_size(self) -> int:
        """Size of the complete file in bytes."""
        return len(self.header) + sum(entry.nbytes for entry in self.entries.values())


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Return ``metadata`` as a dict; raise :class:`T2NErrorMisuse` unless it maps str to str."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise T2NErrorMisuse(
            f"payload metadata must be a mapping of str to str, got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise T2NErrorMisuse(
                f"payload metadata must map str to str; got {key!r}: {value!r} "
                f"({type(key).__name__}: {type(value).__name__})"
            )
    return dict(metadata)


def plan_header(
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> HeaderPlan:
    """Lay out the entries ``(name, dtype, shape)`` and encode the header describing them.

    Entries are placed by decreasing element size (stable for equal sizes), so that each one
    starts at a multiple of its element size, and the header is padded with spaces so that the
    data section starts at a multiple of :data:`DATA_ALIGNMENT`.

    Raises:
        T2NErrorMisuse: a name is reserved or not valid Unicode, a dtype has no file code, or
            the header would exceed :data:`MAX_HEADER_BYTES`.
    """
    ordered = sorted(specs, key=lambda spec: -_itemsize(spec[1]))
    offsets: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    cursor = 0
    for name, dtype, shape in ordered:
        if name == METADATA_KEY:
            raise T2NErrorMisuse(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        nbytes = _numel(shape) * _itemsize(dtype)
        offsets.append((name, dtype, shape, cursor, cursor + nbytes))
        cursor += nbytes
    document: dict[str, Any] = {}
    if metadata:
        document[METADATA_KEY] = dict(metadata)
    for name, dtype, shape, begin, end in offsets:
        document[name] = {
            "dtype": dtype_code(dtype),
            "shape": list(shape),
            "data_offsets": [begin, end],
        }
    try:
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise T2NErrorMisuse(
            f"payload names and metadata must be valid Unicode text: {exc.reason} "
            f"in {exc.object[exc.start : exc.end]!r}"
        ) from exc
    padded = -(-(PREFIX_BYTES + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - PREFIX_BYTES
    if padded > MAX_HEADER_BYTES:
        raise T2NErrorMisuse(
            f"the payload header would take {padded} bytes, over the {MAX_HEADER_BYTES} bytes "
            "readers accept; store fewer entries or less metadata per file"
        )
    header = _LENGTH_PREFIX.pack(padded) + text + b" " * (padded - len(text))
    data_start = len(header)
    entries = {
        name: EntrySpec(name, dtype, shape, data_start + begin, end - begin)
        for name, dtype, shape, begin, end in offsets
    }
    return HeaderPlan(header, entries, dict(metadata))


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _invalid(path: Path, rule: str) -> NoReturn:
    raise T2NErrorStorage(
        f"invalid payload file '{path}': {rule}; the file is corrupt or not in the "
        "safetensors format"
    )


def header_length(path: Path, prefix: bytes, file_size: int) -> int:
    """Decode and bound the header length read from the first 8 bytes of the file.

    Raises:
        T2NErrorStorage: the file is shorter than 8 bytes, or the length exceeds
            :data:`MAX_HEADER_BYTES` or what the file holds.
    """
    if file_size < PREFIX_BYTES or len(prefix) < PREFIX_BYTES:
        _invalid(
            path,
            f"the file has {file_size} bytes, fewer than the {PREFIX_BYTES}-byte header length",
        )
    (length,) = _LENGTH_PREFIX.unpack(prefix[:PREFIX_BYTES])
    if length > MAX_HEADER_BYTES:
        _invalid(path, f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if length > file_size - PREFIX_BYTES:
        _invalid(
            path,
            f"header length {length} exceeds the {file_size - PREFIX_BYTES} bytes that follow "
            "the length field (truncated header)",
        )
    return int(length)


def parse_header(
    path: Path, raw: bytes | bytearray, file_size: int
) -> tuple[dict[str, EntrySpec], dict[str, str]]:
    """Validate the JSON header ``raw`` of a file of ``file_size`` bytes.

    Applies, in order: UTF-8 JSON object without duplicate keys; ``__metadata__`` maps str to
    str; each entry has exactly ``dtype``, ``shape`` and ``data_offsets``, a known dtype, a list
    of non-negative int dimensions whose product, zeros left out, fits int64, and
    ``[begin, end]`` ints with ``0 <= begin <= end``; the
    entries sorted by offsets cover the data section from 0 to its end without holes or
    overlaps; each span equals ``numel * itemsize``.

    Returns:
        the entries (absolute start offsets, in file order) and the metadata.

    Raises:
        T2NErrorStorage: naming ``path`` and the first rule broken.
    """
    data_start = PREFIX_BYTES + len(raw)
    data_size = file_size - data_start
    document = _decode_json(path, raw)
    metadata = _check_file_metadata(path, document.pop(METADATA_KEY, None))
    spans: list[tuple[int, int, str, torch.dtype, tuple[int, ...]]] = []
    for name, info in document.items():
        dtype, shape, begin, end = _check_entry(path, name, info)
        spans.append((begin, end, name, dtype, shape))
    spans.sort(key=lambda span: (span[0], span[1]))
    cursor = 0
    entries: dict[str, EntrySpec] = {}
    for begin, end, name, dtype, shape in spans:
        if begin != cursor:
            kind = "a hole" if begin > cursor else "an overlap"
            _invalid(
                path,
                f"entry {name!r} starts at data offset {begin} but the previous entry ends at "
                f"{cursor} ({kind} in the data section)",
            )
        span = end - begin
        if not _numel_times_itemsize_is(shape, _itemsize(dtype), span):
            _invalid(
                path,
                f"entry {name!r} spans {span} bytes but its shape {list(shape)} of "
                f"{CODE_BY_DTYPE[dtype]} needs a different size",
            )
        entries[name] = EntrySpec(name, dtype, shape, data_start + begin, span)
        cursor = end
    if cursor != data_size:
        _invalid(
            path,
            f"the entries cover {cursor} bytes but the data section holds {data_size} bytes "
            "(truncated or trailing data)",
        )
    return entries, metadata


def _reject_constant(token: str) -> NoReturn:
    raise ValueError(f"non-standard JSON constant {token}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _decode_json(path: Path, raw: bytes | bytearray) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _invalid(path, f"the header is not UTF-8 text ({exc.reason} at byte {exc.start})")
    try:
        document = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        _invalid(path, f"the header is not valid JSON ({exc})")
    if not isinstance(document, dict):
        _invalid(path, f"the header is a JSON {type(document).__name__}, not an object")
    return document


def _check_file_metadata(path: Path, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(key, str) and isinstance(item, str) for key, item in value.items()
    ):
        _invalid(path, f"{METADATA_KEY!r} must be an object of strings")
    return value


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_entry(path: Path, name: str, info: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        _invalid(path, f"entry {name!r} is not an object")
    if info.keys() != _ENTRY_KEYS:
        missing = sorted(_ENTRY_KEYS - info.keys())
        extra = sorted(info.keys() - _ENTRY_KEYS)
        _invalid(path, f"entry {name!r} has missing keys {missing} or unknown keys {extra}")
    code = info["dtype"]
    dtype = DTYPE_BY_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        _invalid(
            path, f"entry {name!r} has unknown dtype {code!r} (known: {sorted(DTYPE_BY_CODE)})"
        )
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(dim) and dim >= 0 for dim in shape):
        _invalid(path, f"entry {name!r} has shape {shape!r}, not a list of non-negative ints")
    if _product_of_nonzero(shape) > _INT64_MAX:
        # An empty tensor passes the size rule whatever its other dimensions; torch cannot
        # describe one whose strides overflow int64.
        _invalid(
            path,
            f"entry {name!r} has shape {shape!r}, whose dimensions (zeros left out) multiply "
            "to more than 2**63 - 1",
        )
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(offset) and offset >= 0 for offset in offsets)
    ):
        _invalid(path, f"entry {name!r} has data_offsets {offsets!r}, not [begin, end] ints")
    begin, end = offsets
    if begin > end:
        _invalid(path, f"entry {name!r} has data_offsets [{begin}, {end}] with begin > end")
    return dtype, tuple(shape), begin, end


_INT64_MAX = 2**63 - 1


def _product_of_nonzero(shape: Sequence[int]) -> int:
    """The product of ``shape``'s non-zero dimensions, stopping once it exceeds int64."""
    product = 1
    for dim in shape:
        product *= dim or 1
        if product > _INT64_MAX:
            break
    return product


def _numel_times_itemsize_is(shape: Sequence[int], itemsize: int, span: int) -> bool:
    """``numel(shape) * itemsize == span``, stopping as soon as the product exceeds ``span``."""
    if 0 in shape:
        return span == 0
    product = itemsize
    for dim in shape:
        product *= dim
        if product > span:
            return False
    return product == span
