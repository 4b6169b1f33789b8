"""Fuzzing the payload reader with mutated and random files.

Every input either loads tensors that are exactly what its header describes (dtype, shape and
the bytes at the offsets it names) or raises ``T2NErrorStorage`` naming the file; never another
exception, a crash, a hang, nor an allocation beyond what the file holds. The inputs are
valid files (ours, the ``safetensors`` library's, an opaque Q4_0 payload) mutated at the byte
level (bit flips in the length prefix and the header, truncation, extension, insertions) and at
the JSON level (dtypes, shapes, offsets and metadata replaced by junk, huge or negative numbers,
deep nesting), plus random documents and byte soup. A sample is also read with the async
reader, and accepted opaque payloads are decoded.

``T2N_STRESS=1`` runs many more examples; the number of files fuzzed is recorded for the
stress report (see ``tests/stress/figures.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import struct
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from stress.figures import record, scaled

from torch_to_nnef.exceptions import T2NError, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration
from torch_to_nnef.tensor.storage._format import DTYPE_BY_CODE

PER_FILE_SECONDS = 5.0
"""A single file taking longer than this to accept or reject counts as a hang."""

PYTHON_HEAP_FACTOR = 64
"""Python heap allowed per byte of file while reading it (JSON objects are bigger than text)."""

HEAP_SLACK = 256 << 10


# ---------------------------------------------------------------------------------------------
# Seeds: valid files of every flavour the reader meets
# ---------------------------------------------------------------------------------------------
class Seed:
    """A valid file: its bytes, the end of its JSON text, and its parsed header."""

    def __init__(self, name: str, raw: bytes) -> None:
        self.name = name
        self.raw = raw
        (length,) = struct.unpack("<Q", raw[:8])
        self.header_length = length
        self.json_end = 8 + len(raw[8 : 8 + length].rstrip(b" "))
        self.document: dict[str, Any] = json.loads(raw[8 : 8 + length])
        self.data = raw[8 + length :]


def _build_seeds(directory: Path) -> list[Seed]:
    generator = torch.Generator().manual_seed(0)
    plain = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.arange(-2, 2, dtype=torch.int8),
        "c": torch.randn(3, generator=generator).half(),
        "empty": torch.zeros(0, 5, dtype=torch.int64),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
    }
    paths: dict[str, Path] = {}
    paths["ours"] = directory / "ours.safetensors"
    storage.write_payload(paths["ours"], plain, {"k": "v", "format": "pt"})
    paths["single"] = directory / "single.safetensors"
    storage.write_payload(paths["single"], {"tensor": torch.arange(16, dtype=torch.float32)})
    paths["nothing"] = directory / "nothing.safetensors"
    storage.write_payload(paths["nothing"], {})
    quantized = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(4, 32, generator=generator))
    paths["opaque"] = directory / "opaque.safetensors"
    storage.write_payload(paths["opaque"], *storage.encode_opaque(quantized))
    paths["library"] = directory / "library.safetensors"
    save_file(
        {"x": torch.randn(3, 4, generator=generator), "y": torch.arange(5, dtype=torch.int32)},
        str(paths["library"]),
        metadata={"m": "1"},
    )
    return [Seed(name, path.read_bytes()) for name, path in paths.items()]


SEED_DIR = Path(os.environ.get("TMPDIR", "/tmp"))
_SEEDS_DIR = SEED_DIR / f"t2n-fuzz-seeds-{os.getpid()}"
_SEEDS_DIR.mkdir(exist_ok=True)
try:
    SEEDS = _build_seeds(_SEEDS_DIR)
finally:
    for _path in _SEEDS_DIR.iterdir():
        _path.unlink()
    _SEEDS_DIR.rmdir()


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------
class Tally:
    """Counts of what the fuzzers fed and what happened, for the stress report."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()

    @property
    def files(self) -> int:
        return sum(self.outcomes.values())


TALLY = Tally()
_COUNTER = itertools.count()


# The tests of this module share a module fixture: with workers (pytest-xdist), they run
# on one, which builds it once.
pytestmark = pytest.mark.xdist_group("test_fuzz_storage")


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz")
    record(
        "fuzz_storage",
        files_fuzzed=TALLY.files,
        faults=TALLY.files,
        **{f"files_{key}": value for key, value in sorted(TALLY.outcomes.items())},
    )


def write_case(directory: Path, raw: bytes) -> Path:
    path = directory / f"case-{next(_COUNTER) % 4}.safetensors"
    path.write_bytes(raw)
    return path


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def check_against_header(path: Path, raw: bytes, layout: storage.PayloadLayout) -> None:
    """An accepted file is exactly what its header says (checked without the reader's code)."""
    (length,) = struct.unpack("<Q", raw[:8])
    document = json.loads(raw[8 : 8 + length])
    assert isinstance(document, dict)
    assert layout.metadata == (document.pop("__metadata__", None) or {})  # null: none
    assert set(layout.entries) == set(document)
    data_start = 8 + length
    spans = []
    for name, info in document.items():
        spec = layout.entries[name]
        assert spec.dtype == DTYPE_BY_CODE[info["dtype"]]
        assert spec.shape == tuple(info["shape"])
        begin, end = info["data_offsets"]
        assert spec.start == data_start + begin and spec.nbytes == end - begin
        assert spec.nbytes == math.prod(spec.shape) * spec.dtype.itemsize
        spans.append((begin, end))
    cursor = 0
    for begin, end in sorted(spans):
        assert begin == cursor, "accepted a hole or an overlap"
        cursor = end
    assert data_start + cursor == len(raw), "accepted trailing or missing data"
    assert layout.file_size == len(raw)


def check_tensors(
    raw: bytes, layout: storage.PayloadLayout, loaded: dict[str, torch.Tensor]
) -> None:
    assert list(loaded) == list(layout.entries)
    total = 0
    for name, spec in layout.entries.items():
        tensor = loaded[name]
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu"
        assert tensor.dtype == spec.dtype and tuple(tensor.shape) == spec.shape
        assert _raw_bytes(tensor) == raw[spec.start : spec.start + spec.nbytes]
        total += tensor.numel() * tensor.element_size()
    assert total <= len(raw), "more tensor memory than the file holds"


def check_adoption(directory: Path, raw: bytes, loaded: dict[str, torch.Tensor]) -> str | None:
    """An OffloadedTensor adopting an accepted plain file reads its single entry, or refuses
    it with a T2NError (several entries); never another exception."""
    adopt_dir = directory / "adopt"
    adopt_dir.mkdir(exist_ok=True)
    storage.payload_path(adopt_dir, "w", "fuzz").write_bytes(raw)
    try:
        tensor = OffloadedTensor(None, "cpu", adopt_dir, "w", storage_id="fuzz")
    except T2NError:
        assert len(loaded) != 1
        return None
    (expected,) = loaded.values()
    value = tensor.reload()
    assert value.dtype == expected.dtype and _raw_bytes(value) == _raw_bytes(expected)
    del tensor  # owns the adopted file: removes it
    return "adopted"


def load_or_reject(directory: Path, raw: bytes, *, use_async: bool = False) -> str:
    """Feed ``raw`` to the reader and check the outcome; return it for the tally."""
    path = write_case(directory, raw)
    started = time.perf_counter()
    tracemalloc.start()
    try:
        try:
            layout = storage.read_layout(path)
            loaded = storage.read_payload(layout)
        except T2NErrorStorage as exc:
            assert f"'{path}'" in str(exc), f"the error does not name the file: {exc}"
            outcome = "rejected"
        else:
            outcome = "loaded"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - started
    assert elapsed < PER_FILE_SECONDS, f"reading took {elapsed:.1f} s"
    assert peak <= HEAP_SLACK + PYTHON_HEAP_FACTOR * len(raw), f"{peak} bytes of heap"
    if outcome == "loaded":
        check_against_header(path, raw, layout)
        check_tensors(raw, layout, loaded)
        if use_async:
            again = asyncio.run(storage.aread_payload(layout, chunk_bytes=7))
            check_tensors(raw, layout, again)
            outcome = "loaded_async"
        if storage.is_opaque_payload(layout.metadata):
            try:
                value = storage.decode_opaque(loaded, layout.metadata)
            except T2NErrorStorage:
                outcome = "opaque_rejected"
            else:
                assert isinstance(value, torch.Tensor)
                outcome = "opaque_loaded"
        else:
            outcome = check_adoption(directory, raw, loaded) or outcome
            with safe_open(str(path), "pt") as file:  # what we accept, safetensors reads alike
                assert set(file.keys()) == set(loaded)
                for name, tensor in loaded.items():
                    assert _raw_bytes(file.get_tensor(name)) == _raw_bytes(tensor)
    elif use_async:
        outcome = "rejected_async"
    TALLY.outcomes[outcome] += 1
    return outcome


def _json_object(text: object) -> dict[str, Any] | None:
    """``text`` parsed, when it is a string holding a JSON object; ``None`` otherwise."""
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


FUZZ_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "database": None,
}
use_async_sample = st.integers(0, 7).map(lambda n: n == 0)


# ---------------------------------------------------------------------------------------------
# Byte-level mutations
# ---------------------------------------------------------------------------------------------
INTERESTING_LENGTHS = [
    0,
    1,
    2,
    7,
    8,
    4088,
    storage.MAX_HEADER_BYTES,
    storage.MAX_HEADER_BYTES + 1,
    2**31 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    seed = draw(st.sampled_from(SEEDS))
    data = bytearray(seed.raw)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(
            st.sampled_from(
                ["flip", "flip", "set", "prefix", "truncate", "extend", "insert", "delete"]
            )
        )
        # Mostly in the length prefix and the JSON text, sometimes anywhere.
        end = min(len(data), seed.json_end + 8)
        limit = draw(st.sampled_from([end, end, len(data)]))
        position = draw(st.integers(0, max(0, limit - 1)))
        if kind == "flip" and position < len(data):
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and position < len(data):
            data[position] = draw(st.sampled_from(b'{}[]",:-0 9e\x00\xff'))
        elif kind == "prefix":
            length = draw(
                st.sampled_from(INTERESTING_LENGTHS)
                | st.integers(0, 2**64 - 1)
                | st.integers(-16, 16).map(lambda d: max(0, seed.header_length + d))
            )
            data[:8] = struct.pack("<Q", length)
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif kind == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif kind == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[position : position + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=scaled(700, 8000), **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(raw=byte_mutations(), use_async=use_async_sample)
def test_fuzz_byte_mutations(fuzz_dir: Path, raw: bytes, use_async: bool) -> None:
    load_or_reject(fuzz_dir, raw, use_async=use_async)


# ---------------------------------------------------------------------------------------------
# JSON-level mutations
# ---------------------------------------------------------------------------------------------
huge_ints = st.sampled_from(
    [-1, -(2**63), 2**31, 2**32 - 1, 2**53 + 1, 2**62, 2**63, 2**64, 2**64 + 1, 10**30, 10**400]
)
small_ints = st.integers(-4, 64)
numbers = huge_ints | small_ints | st.sampled_from([0.0, 1.0, 1e308, -0.0, 3.5])
scalars = numbers | st.none() | st.booleans() | st.text(max_size=8)


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


junk = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
) | st.integers(1, 200).map(nested)
dtype_values = st.sampled_from(sorted(DTYPE_BY_CODE)) | st.sampled_from(
    ["F24", "", "f32", "float32", "U128", "F32 ", "BOOL\x00", "__metadata__"]
)
shape_values = st.lists(small_ints | huge_ints, max_size=5) | junk
offset_values = (
    st.tuples(small_ints | huge_ints, small_ints | huge_ints).map(list)
    | st.lists(small_ints, max_size=4)
    | junk
)


@st.composite
def json_mutations(draw: st.DrawFn) -> bytes:
    seed = draw(st.sampled_from(SEEDS))
    document: Any = json.loads(json.dumps(seed.document))
    data = seed.data
    for _ in range(draw(st.integers(1, 3))):
        if not isinstance(document, dict):
            break  # replaced by junk: nothing left to edit
        names = [name for name in document if name != "__metadata__"]
        kind = draw(
            st.sampled_from(
                ["dtype", "shape", "offsets", "shift", "field", "metadata", "entry", "document"]
                + ["benign"] * 4
            )
        )
        if kind == "benign":
            document = benign_edit(draw, document)
            continue
        if kind in ("dtype", "shape", "offsets", "shift", "field") and names:
            info = document[draw(st.sampled_from(names))]
            if not isinstance(info, dict):
                continue
            if kind == "dtype":
                info["dtype"] = draw(dtype_values | junk)
            elif kind == "shape":
                info["shape"] = draw(shape_values)
            elif kind == "offsets":
                info["data_offsets"] = draw(offset_values)
            elif kind == "shift" and isinstance(info.get("data_offsets"), list):
                info["data_offsets"] = [
                    value + draw(st.integers(-3, 3)) if type(value) is int else value
                    for value in info["data_offsets"]
                ]
            else:
                key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
                if draw(st.booleans()):
                    info.pop(key, None)
                else:
                    info[key] = draw(junk)
        elif kind == "metadata":
            metadata = document.get("__metadata__")
            if isinstance(metadata, dict) and metadata and draw(st.booleans()):
                key = draw(st.sampled_from(sorted(metadata)))
                # An earlier mutation may have left anything there: edit a JSON object only.
                attributes = _json_object(metadata[key]) if key == "t2n.attributes" else None
                if attributes and draw(st.booleans()):
                    attributes[draw(st.sampled_from(sorted(attributes)))] = draw(junk)
                    metadata[key] = json.dumps(attributes)
                else:
                    metadata[key] = draw(junk | st.text(max_size=40))
            else:
                document["__metadata__"] = draw(
                    junk | st.dictionaries(st.text(max_size=8), junk, max_size=3)
                )
        elif kind == "entry":
            action = draw(st.sampled_from(["delete", "duplicate", "add"]))
            if action == "delete" and names:
                del document[draw(st.sampled_from(names))]
            elif action == "duplicate" and names:
                document[draw(st.text(max_size=4))] = json.loads(
                    json.dumps(document[draw(st.sampled_from(names))])
                )
            else:
                document[draw(st.text(max_size=6))] = {
                    "dtype": draw(dtype_values),
                    "shape": draw(st.lists(st.integers(0, 4), max_size=3)),
                    "data_offsets": draw(st.lists(st.integers(0, 256), min_size=2, max_size=2)),
                }
        else:
            document = draw(junk)
    return encode(draw, document, data)


SAME_ITEMSIZE = [
    sorted(code for code, dtype in DTYPE_BY_CODE.items() if dtype.itemsize == size)
    for size in (1, 2, 4, 8)
]


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


def benign_edit(draw: st.DrawFn, document: dict[str, Any]) -> dict[str, Any]:
    """An edit that keeps the file valid: the reader must load the new description exactly."""
    names = [name for name in document if name != "__metadata__"]
    action = draw(st.sampled_from(["dtype", "shape", "rename", "metadata", "order"]))
    if action == "metadata":
        document["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3)
        )
        return document
    if action == "order":
        items = list(document.items())
        return dict(draw(st.permutations(items)))
    if not names:
        return document
    name = draw(st.sampled_from(names))
    info = document[name]
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return document
    if info["dtype"] not in DTYPE_BY_CODE:
        return document
    if action == "dtype":
        itemsize = DTYPE_BY_CODE[info["dtype"]].itemsize
        group = next(g for g in SAME_ITEMSIZE if DTYPE_BY_CODE[g[0]].itemsize == itemsize)
        info["dtype"] = draw(st.sampled_from(group))
    elif action == "shape" and _is_int_list(info.get("shape")):
        numel = math.prod(info["shape"])
        info["shape"] = draw(
            st.sampled_from([[numel], [1, numel], [numel, 1], [1, 1, numel], list(info["shape"])])
        )
    elif action == "rename":
        new_name = draw(st.text(max_size=6).filter(lambda n: n not in document))
        if new_name != "__metadata__":
            document[new_name] = document.pop(name)
    return document


def encode(draw: st.DrawFn, document: Any, data: bytes) -> bytes:
    """Encode a header document with some padding and prefix, followed by (altered) data."""
    text = json.dumps(document, allow_nan=True).encode("utf-8", "surrogatepass")
    padding = draw(st.sampled_from(["none", "aligned", "some"]))
    if padding == "aligned":
        text += b" " * (-(8 + len(text)) % 4096)
    elif padding == "some":
        text += b" " * draw(st.integers(1, 64))
    length = len(text) + draw(st.sampled_from([0] * 9 + [-1, 1, 2**40]))
    tail = draw(st.sampled_from(["keep"] * 6 + ["cut", "grow", "fit", "fit"]))
    if tail == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif tail == "grow":
        data += draw(st.binary(min_size=1, max_size=32))
    elif tail == "fit":  # as many bytes as the entries claim, when that is small
        ends = [
            info["data_offsets"][1]
            for info in (document.values() if isinstance(document, dict) else [])
            if isinstance(info, dict)
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and type(info["data_offsets"][1]) is int
        ]
        wanted = max(ends, default=0)
        if 0 <= wanted <= 1 << 16:
            data = (data * (wanted // max(1, len(data)) + 1))[:wanted] if data else b"\0" * wanted
    return struct.pack("<Q", max(0, length) % 2**64) + text + data


@settings(max_examples=scaled(700, 8000), **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(raw=json_mutations(), use_async=use_async_sample)
def test_fuzz_json_mutations(fuzz_dir: Path, raw: bytes, use_async: bool) -> None:
    load_or_reject(fuzz_dir, raw, use_async=use_async)


# ---------------------------------------------------------------------------------------------
# Random documents and byte soup
# ---------------------------------------------------------------------------------------------
@st.composite
def random_documents(draw: st.DrawFn) -> bytes:
    entries = draw(
        st.dictionaries(
            st.text(max_size=4),
            st.fixed_dictionaries(
                {
                    "dtype": dtype_values,
                    "shape": st.lists(st.integers(0, 3), max_size=3),
                    "data_offsets": st.lists(st.integers(0, 40), min_size=2, max_size=2),
                }
            ),
            max_size=4,
        )
    )
    data = draw(st.binary(max_size=48))
    return encode(draw, entries, data)


def deeply_nested_file(depth: int) -> bytes:
    """A header nesting lists ``depth`` deep (or unbalanced: more opening than closing)."""
    text = b'{"a":' + b"[" * depth + b"]" * (depth - depth % 3) + b"}"
    return struct.pack("<Q", len(text)) + text


@settings(max_examples=scaled(400, 5000), **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(
    raw=random_documents()
    | st.builds(
        lambda prefix, body: struct.pack("<Q", prefix) + body,
        st.sampled_from(INTERESTING_LENGTHS) | st.integers(0, 2**64 - 1) | st.integers(0, 80),
        st.binary(max_size=96),
    )
    | st.binary(max_size=24)
    | st.integers(100, 200_000).map(deeply_nested_file),
    use_async=use_async_sample,
)
def test_fuzz_random_files(fuzz_dir: Path, raw: bytes, use_async: bool) -> None:
    load_or_reject(fuzz_dir, raw, use_async=use_async)


def test_the_fuzzers_reach_both_outcomes(fuzz_dir: Path) -> None:
    # Runs after the fuzzers of this module: they fed accepted and rejected files alike, so
    # both paths of the oracle were exercised.
    if TALLY.files == 0:
        pytest.skip("run with the fuzz tests of this module")
    assert TALLY.outcomes["rejected"] + TALLY.outcomes["rejected_async"] > 0
    assert TALLY.outcomes["loaded"] + TALLY.outcomes["loaded_async"] > 0
    assert TALLY.outcomes["loaded_async"] > 0
    assert TALLY.outcomes["opaque_loaded"] + TALLY.outcomes["opaque_rejected"] > 0


# ---------------------------------------------------------------------------------------------
# Files that change after their layout was read
# ---------------------------------------------------------------------------------------------
@settings(max_examples=scaled(60, 1000), **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(
    seed=st.sampled_from([s for s in SEEDS if s.data]),
    change=st.sampled_from(["truncate", "extend", "replace", "remove"]),
    amount=st.integers(1, 64),
    use_async=st.booleans(),
)
def test_files_changed_after_the_layout_was_read(
    fuzz_dir: Path, seed: Seed, change: str, amount: int, use_async: bool
) -> None:
    path = write_case(fuzz_dir, seed.raw)
    layout = storage.read_layout(path)
    if change == "truncate":
        os.truncate(path, max(0, len(seed.raw) - amount))
    elif change == "extend":
        with open(path, "ab") as file:
            file.write(b"\0" * amount)
    elif change == "replace":
        replacement = path.with_name(path.name + ".new")
        replacement.write_bytes(seed.raw)
        os.replace(replacement, path)
    else:
        path.unlink()
    with pytest.raises(T2NErrorStorage, match=str(path)):
        if use_async:
            asyncio.run(storage.aread_payload(layout))
        else:
            storage.read_payload(layout)
    TALLY.outcomes["changed_rejected"] += 1
