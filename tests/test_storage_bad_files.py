"""Corrupt, truncated, hostile and missing payload files: each raises T2NErrorStorage.

Every rule is checked before anything the header claims is allocated.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.storage import EntrySpec, PayloadLayout


def craft(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write a file with an arbitrary header (a JSON-able value, or raw bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    prefix = struct.pack("<Q", len(raw) if length is None else length)
    path.write_bytes(prefix + raw + data)
    return path


def f32(begin: int, end: int, shape: list[int]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


GOOD_DATA = bytes(range(24))

BAD_FILES: dict[str, tuple[Any, bytes, int | None, str]] = {
    # name: (header, data, forced header length, expected rule in the message)
    "empty-header": (b"", b"", None, "not valid JSON"),
    "length-2**60": ({"a": f32(0, 24, [6])}, GOOD_DATA, 2**60, "exceeds the limit"),
    "length-past-eof": ({"a": f32(0, 24, [6])}, b"", 10_000, "truncated header"),
    "not-utf8": (b"\xff\xfe{}", b"", None, "not UTF-8"),
    "not-json": (b"{'a': 1}", b"", None, "not valid JSON"),
    "truncated-json": (b'{"a": {"dtype": "F3', b"", None, "not valid JSON"),
    "json-array": ([1, 2, 3], b"", None, "JSON list, not an object"),
    "json-string": ("hello", b"", None, "JSON str, not an object"),
    "nan-constant": (b'{"a": NaN}', b"", None, "not valid JSON"),
    "duplicate-key": (
        b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},'
        b' "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}',
        b"",
        None,
        "duplicate key 'a'",
    ),
    "entry-not-object": ({"a": [1]}, b"", None, "entry 'a' is not an object"),
    "missing-key": ({"a": {"dtype": "F32", "shape": [6]}}, GOOD_DATA, None, "missing keys"),
    "extra-key": ({"a": {**f32(0, 24, [6]), "code": "x"}}, GOOD_DATA, None, "unknown keys"),
    "unknown-dtype": (
        {"a": {"dtype": "F24", "shape": [6], "data_offsets": [0, 24]}},
        GOOD_DATA,
        None,
        "unknown dtype 'F24'",
    ),
    "dtype-not-str": (
        {"a": {"dtype": 7, "shape": [6], "data_offsets": [0, 24]}},
        GOOD_DATA,
        None,
        "unknown dtype 7",
    ),
    "negative-shape": ({"a": f32(0, 24, [-6])}, GOOD_DATA, None, "not a list of non-negative"),
    "shape-not-list": ({"a": f32(0, 24, 6)}, GOOD_DATA, None, "not a list of non-negative"),  # type: ignore[arg-type]
    "bool-in-shape": ({"a": f32(0, 4, [True])}, GOOD_DATA[:4], None, "non-negative ints"),
    "float-in-shape": ({"a": f32(0, 24, [6.0])}, GOOD_DATA, None, "non-negative ints"),  # type: ignore[list-item]
    "offsets-three": (
        {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 12, 24]}},
        GOOD_DATA,
        None,
        "not [begin, end] ints",
    ),
    "offset-negative": ({"a": f32(-4, 20, [6])}, GOOD_DATA, None, "not [begin, end] ints"),
    "begin-after-end": ({"a": f32(24, 0, [0])}, GOOD_DATA, None, "begin > end"),
    "overlap": (
        {"a": f32(0, 16, [4]), "b": f32(8, 24, [4])},
        GOOD_DATA,
        None,
        "an overlap",
    ),
    "hole": ({"a": f32(0, 8, [2]), "b": f32(12, 24, [3])}, GOOD_DATA, None, "a hole"),
    "not-from-zero": ({"a": f32(4, 24, [5])}, GOOD_DATA, None, "a hole"),
    "shape-size-mismatch": ({"a": f32(0, 24, [5])}, GOOD_DATA, None, "needs a different size"),
    "huge-shape": ({"a": f32(0, 24, [2**62, 2**62])}, GOOD_DATA, None, "more than 2**63"),
    "empty-with-a-dim-past-int64": ({"a": f32(0, 0, [0, 2**70])}, b"", None, "more than 2**63"),
    "empty-with-dims-past-int64": (
        {"a": f32(0, 0, [0, 2**40, 2**40])},
        b"",
        None,
        "more than 2**63",
    ),
    "empty-with-nonzero-dims-past-int64": (
        {"a": f32(0, 0, [2**62, 0, 4])},
        b"",
        None,
        "more than 2**63",
    ),
    "truncated-data": ({"a": f32(0, 24, [6])}, GOOD_DATA[:20], None, "truncated or trailing"),
    "trailing-data": ({"a": f32(0, 24, [6])}, GOOD_DATA + b"xx", None, "truncated or trailing"),
    "claims-2**40-bytes": (
        {"a": f32(0, 2**40, [2**38])},
        GOOD_DATA,
        None,
        "truncated or trailing",
    ),
    "metadata-not-object": ({"__metadata__": ["x"]}, b"", None, "object of strings"),
    "metadata-int-value": ({"__metadata__": {"k": 1}}, b"", None, "object of strings"),
}


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
def test_bad_file_raises_storage_error_naming_path_and_rule(tmp_path: Path, case: str) -> None:
    header, data, length, rule = BAD_FILES[case]
    path = craft(tmp_path / f"{case}.safetensors", header, data, length=length)
    with pytest.raises(T2NErrorStorage) as info:
        storage.read_layout(path)
    message = str(info.value)
    assert f"'{path}'" in message
    assert rule in message


@pytest.mark.parametrize("size", [0, 5])
def test_file_shorter_than_the_length_field(tmp_path: Path, size: int) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(
        T2NErrorStorage, match=f"'{path}'.* has {size} bytes, fewer than the 8-byte"
    ):
        storage.read_layout(path)


def test_a_valid_handmade_file_passes_the_same_rules(tmp_path: Path) -> None:
    header = {"__metadata__": {"k": "v"}, "b": f32(8, 24, [2, 2]), "a": f32(0, 8, [2])}
    header["e"] = {"dtype": "I8", "shape": [0, 5], "data_offsets": [8, 8]}
    layout = storage.read_layout(craft(tmp_path / "ok.safetensors", header, GOOD_DATA))
    assert list(layout.entries) == ["a", "e", "b"]
    assert layout.metadata == {"k": "v"}
    loaded = storage.read_payload(layout)
    assert loaded["a"].view(torch.uint8).tolist() == list(GOOD_DATA[:8])
    assert loaded["e"].shape == (0, 5)


def test_empty_tensors_with_dims_up_to_the_int64_limit_load(tmp_path: Path) -> None:
    shapes = {"a": [0, 2**63 - 1], "b": [2**62, 0, 1], "c": [0, 2**31, 2**31]}
    header = {name: f32(0, 0, shape) for name, shape in shapes.items()}
    layout = storage.read_layout(craft(tmp_path / "empty.safetensors", header))
    loaded = storage.read_payload(layout)
    assert {name: list(tensor.shape) for name, tensor in loaded.items()} == shapes
    assert all(tensor.numel() == 0 for tensor in loaded.values())


def test_header_claiming_a_huge_tensor_is_rejected_without_allocating_it(tmp_path: Path) -> None:
    path = craft(tmp_path / "huge.safetensors", {"a": f32(0, 2**40, [2**38])}, GOOD_DATA)
    rss_before = psutil.Process().memory_info().rss
    tracemalloc.start()
    try:
        with pytest.raises(T2NErrorStorage, match="truncated or trailing"):
            storage.read_layout(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert psutil.Process().memory_info().rss - rss_before < 64 << 20


def test_header_length_beyond_the_cap_is_rejected_before_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "big-header.safetensors"
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", storage.MAX_HEADER_BYTES + 1))
        file.truncate(8 + storage.MAX_HEADER_BYTES + 1)  # sparse: the length fits the file
    tracemalloc.start()
    try:
        with pytest.raises(T2NErrorStorage, match="exceeds the limit of 104857600 bytes"):
            storage.read_layout(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.safetensors"
    with pytest.raises(T2NErrorStorage, match=f"cannot open payload file '{path}'") as info:
        storage.read_layout(path)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    path = tmp_path / "dir.safetensors"
    path.mkdir()
    with pytest.raises(T2NErrorStorage, match=f"'{path}' is a directory"):
        storage.read_layout(path)


@pytest.mark.timeout(10)
def test_fifo_is_rejected_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "fifo.safetensors"
    os.mkfifo(path)
    with pytest.raises(T2NErrorStorage, match="not a regular file"):
        storage.read_layout(path)


_READ_AS_NOBODY = """
import os, sys
from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
if os.geteuid() == 0:  # root reads any file: become nobody once everything is imported
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
try:
    storage.read_layout(sys.argv[1])
except T2NErrorStorage as exc:
    print("T2NErrorStorage:", exc)
"""


@pytest.mark.timeout(60)
def test_unreadable_file() -> None:
    """A file without read permission raises T2NErrorStorage naming the path and the reason.

    Run in a child process that drops root's privileges before reading (root reads any
    file), so that the case runs on CI. Mutation caught: letting the ``OSError`` of
    ``os.open`` escape unconverted failed this test (a raw ``PermissionError`` traceback
    instead of the message).
    """
    with tempfile.TemporaryDirectory() as directory:  # under /tmp: others may traverse it
        Path(directory).chmod(0o755)
        path = craft(Path(directory) / "locked.safetensors", {}, b"")
        path.chmod(0)
        result = subprocess.run(
            [sys.executable, "-c", _READ_AS_NOBODY, str(path)],
            capture_output=True,
            text=True,
            timeout=50,
        )
    assert result.stdout.strip() == (
        f"T2NErrorStorage: cannot open payload file '{path}': Permission denied"
    ), result.stderr[-3000:]


def test_symlink_to_a_payload_is_followed_for_reading(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    storage.write_payload(target, {"w": torch.arange(3)})
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    assert torch.equal(storage.read_payload(storage.read_layout(link))["w"], torch.arange(3))


def test_file_truncated_after_its_layout_was_read(tmp_path: Path) -> None:
    layout = storage.write_payload(tmp_path / "p.safetensors", {"w": torch.randn(1000)})
    os.truncate(layout.path, layout.file_size - 100)
    with pytest.raises(T2NErrorStorage, match="replaced or modified since its layout was read"):
        storage.read_payload(layout)


def test_short_read_at_end_of_file_is_a_storage_error(tmp_path: Path) -> None:
    # A layout made by hand (no file identity) whose entry runs past the end of the file.
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\0" * 100)
    layout = PayloadLayout(
        path, {"w": EntrySpec("w", torch.float32, (10,), 80, 40)}, {}, file_size=100
    )
    with pytest.raises(T2NErrorStorage, match=f"'{path}' ended at byte 100 .*truncated file"):
        storage.read_payload(layout)


def test_file_removed_after_its_layout_was_read(tmp_path: Path) -> None:
    layout = storage.write_payload(tmp_path / "p.safetensors", {"w": torch.randn(4)})
    layout.path.unlink()
    with pytest.raises(T2NErrorStorage, match=f"cannot open payload file '{layout.path}'"):
        storage.read_payload(layout)


class _Evil:
    """Unpickling this object creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("kind", ["raw-pickle", "torch-save"])
def test_reading_never_unpickles(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.safetensors"
    if kind == "raw-pickle":
        path.write_bytes(pickle.dumps(_Evil(marker)))
    else:
        torch.save({"w": torch.zeros(2), "x": _Evil(marker)}, path)
    with pytest.raises(T2NErrorStorage, match=str(path)):
        storage.read_layout(path)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Fuzzing: any byte soup raises T2NErrorStorage or loads consistently, never anything else
# ---------------------------------------------------------------------------------------------
def _valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "seed.safetensors"
        storage.write_payload(
            path,
            {
                "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                "b": torch.arange(4, dtype=torch.int8),
            },
            {"k": "v"},
        )
        return path.read_bytes()


_SEED = _valid_file_bytes()
_SEED_JSON_END = 8 + len(_SEED[8:4096].rstrip(b" "))


def _check_loads_or_rejects(path: Path) -> bool:
    """Whether ``path`` was accepted (and read as safetensors reads it) or rejected."""
    try:
        layout = storage.read_layout(path)
    except T2NErrorStorage as exc:
        assert f"'{path}'" in str(exc)
        return False
    loaded = storage.read_payload(layout)
    for name, entry in layout.entries.items():
        assert loaded[name].dtype == entry.dtype and tuple(loaded[name].shape) == entry.shape
    assert sum(t.numel() * t.element_size() for t in loaded.values()) == layout.nbytes
    # what we accept, safetensors accepts too, with the same values
    with safe_open(str(path), "pt") as file:
        assert set(file.keys()) == set(loaded)
        assert (file.metadata() or {}) == layout.metadata
        for name, tensor in loaded.items():
            theirs = file.get_tensor(name)
            assert torch.equal(
                theirs.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
            )
    return True


@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    position=st.integers(min_value=0, max_value=_SEED_JSON_END - 1),
    replacement=st.binary(min_size=0, max_size=6),
    cut=st.integers(min_value=0, max_value=6),
)
def test_fuzz_mutated_headers(tmp_path: Path, position: int, replacement: bytes, cut: int) -> None:
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(_SEED[:position] + replacement + _SEED[position + cut :])
    _check_loads_or_rejects(path)


_ITEMSIZES = {"F32": 4, "F16": 2, "I8": 1, "I64": 8}
_DEFECTS = ["none", "none", "length prefix", "truncated", "trailing data", "offsets"]


@st.composite
def _safetensors_like_files(draw: st.DrawFn) -> bytes:
    """A header of consistent entries with their data, then at most one defect."""
    names = draw(st.lists(st.text(max_size=4), max_size=4, unique=True))
    header: dict[str, Any] = {}
    cursor = 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(_ITEMSIZES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        span = _ITEMSIZES[dtype] * int(torch.Size(shape).numel())
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + span]}
        cursor += span
    if draw(st.booleans()):
        header["__metadata__"] = {"k": draw(st.text(max_size=4))}
    data = draw(st.binary(min_size=cursor, max_size=cursor))
    defect = draw(st.sampled_from(_DEFECTS))
    if defect == "offsets" and names:
        header[names[-1]]["data_offsets"][1] += draw(st.sampled_from([-1, 1]))
    raw = json.dumps(header).encode() + b" " * draw(st.integers(0, 8))
    length = len(raw)
    if defect == "length prefix":
        length += draw(st.integers(-length, 64).filter(bool))
    elif defect == "truncated":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif defect == "trailing data":
        data += draw(st.binary(min_size=1, max_size=8))
    return struct.pack("<Q", length) + raw + data


def test_fuzz_random_files(tmp_path: Path) -> None:
    """Random files, consistent or with one defect, load as safetensors reads them or raise
    T2NErrorStorage; both outcomes occur.

    Mutation caught: accepting trailing data after the last entry (``cursor > data_size``
    for ``cursor != data_size`` in the header check) failed this test, safetensors refusing
    the file that was accepted.
    """
    outcomes = {"accepted": 0, "rejected": 0}
    path = tmp_path / "random.safetensors"

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        raw=_safetensors_like_files()
        | st.builds(
            lambda prefix, body: struct.pack("<Q", prefix) + body,
            st.integers(min_value=0, max_value=2**64 - 1),
            st.binary(max_size=64),
        )
    )
    def fuzz(raw: bytes) -> None:
        path.write_bytes(raw)
        outcomes["accepted" if _check_loads_or_rejects(path) else "rejected"] += 1

    fuzz()
    assert outcomes["accepted"] > 0 and outcomes["rejected"] > 0, outcomes
