"""Payload files: round trips, safetensors interop, atomic writes, names, buffers, opaque values."""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from stress import children

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.opaque import OFFLOAD_STATE_KEY, OpaqueTensor, SupportsOffloadState
from torch_to_nnef.tensor.storage import _kernel
from torch_to_nnef.tensor.storage._buffers import (
    MAPPED_BUFFER_MIN_BYTES,
    STAGING_BYTES,
    advise_huge_pages,
    byte_view,
    empty_buffer,
    tensor_pieces,
)
from torch_to_nnef.tensor.storage._format import DTYPE_BY_CODE

ALL_DTYPES = sorted(set(DTYPE_BY_CODE.values()), key=str)
SHAPES = {
    "scalar": (),
    "empty": (0, 3),
    "vector": (7,),
    "matrix": (5, 6),
    "rank4": (2, 3, 1, 4),
}


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Deterministic values of any storable dtype."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 4).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes in row-major order (works for every dtype)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert torch.equal(raw_bytes(actual), raw_bytes(expected))


def data_start(layout: storage.PayloadLayout) -> int:
    with open(layout.path, "rb") as file:
        return 8 + int.from_bytes(file.read(8), "little")


# ---------------------------------------------------------------------------------------------
# Round trips and interop
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_of_every_dtype_and_shape(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {
        name: make_tensor(dtype, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())
    }
    tensors["transposed"] = make_tensor(dtype, (4, 6), seed=9).t()
    assert not tensors["transposed"].is_contiguous()
    path = tmp_path / "payload.safetensors"

    written = storage.write_payload(path, tensors)
    layout = storage.read_layout(path)
    loaded = storage.read_payload(layout)

    assert layout == written
    assert list(loaded) == list(layout.entries)
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)
        assert loaded[name].is_contiguous()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_safetensors_reads_our_files_and_we_read_theirs(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {name: make_tensor(dtype, shape, seed=3) for name, shape in SHAPES.items()}
    ours = tmp_path / "ours.safetensors"
    storage.write_payload(ours, tensors, {"origin": "t2n", "note": "ünïcode"})

    with safe_open(str(ours), "pt") as file:
        assert file.metadata() == {"origin": "t2n", "note": "ünïcode"}
        assert set(file.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert_same(file.get_tensor(name), tensor)

    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(theirs), metadata={"format": "pt"})
    layout = storage.read_layout(theirs)
    assert layout.metadata == {"format": "pt"}
    loaded = storage.read_payload(layout)
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)


def test_safetensors_file_with_unaligned_data_loads(tmp_path: Path) -> None:
    tensors = {"odd": torch.arange(3, dtype=torch.uint8), "x": torch.randn(5, dtype=torch.float64)}
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    layout = storage.read_layout(path)

    assert data_start(layout) % 8 == 0 and data_start(layout) % storage.DATA_ALIGNMENT != 0
    loaded = storage.read_payload(layout)
    assert_same(loaded["odd"], tensors["odd"])
    assert_same(loaded["x"], tensors["x"])


def test_data_section_is_page_aligned_and_entries_aligned_to_itemsize(tmp_path: Path) -> None:
    tensors = {
        "byte": torch.arange(3, dtype=torch.uint8),
        "half": torch.randn(5).half(),
        "double": torch.randn(3, dtype=torch.float64),
        "float": torch.randn(7),
    }
    layout = storage.write_payload(tmp_path / "p.safetensors", tensors, {"k": "v" * 5000})

    start = data_start(layout)
    assert start % storage.DATA_ALIGNMENT == 0
    assert start == 8192  # the long metadata pushes the data to the second page
    assert min(entry.start for entry in layout.entries.values()) == start
    assert list(layout.entries) == ["double", "float", "half", "byte"]
    for entry in layout.entries.values():
        assert entry.start % entry.dtype.itemsize == 0
    assert layout.file_size == os.path.getsize(layout.path) == start + layout.nbytes
    with open(layout.path, "rb") as file:
        header = file.read(start)[8:]
    assert header.rstrip(b" ").endswith(b"}")
    assert json.loads(header)["__metadata__"] == {"k": "v" * 5000}


PEAK_RSS_RESET = Path("/proc/self/clear_refs")


def _peak_rss_growth(action: Any) -> int:
    """Bytes by which the process's peak resident set grew while ``action()`` ran (Linux)."""

    def peak() -> int:
        status = Path("/proc/self/status").read_text(encoding="ascii")
        return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024  # type: ignore[index]

    PEAK_RSS_RESET.write_text("5")  # the peak restarts from the current resident set
    before = peak()
    action()
    return peak() - before


@pytest.mark.skipif(
    not os.access(PEAK_RSS_RESET, os.W_OK), reason="needs Linux's resettable peak RSS"
)
def test_large_non_contiguous_tensor_is_written_through_staging(tmp_path: Path) -> None:
    """Writing a 48 MiB transposed tensor allocates one staging buffer, not a full copy.

    Mutation caught: writing ``tensor.contiguous()`` (a 48 MiB copy) instead of streaming
    through the staging buffer raised the peak resident set by 48 MiB and failed this test.
    """
    big = torch.randn(1536, 8192).t()  # 48 MiB, three staging slabs
    grew = _peak_rss_growth(
        lambda: storage.write_payload(tmp_path / "big.safetensors", {"w": big}, fsync=False)
    )
    assert grew <= STAGING_BYTES + (4 << 20), f"peak memory grew by {grew / 2**20:.1f} MiB"
    layout = storage.read_layout(tmp_path / "big.safetensors")
    assert_same(storage.read_payload(layout)["w"], big)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(40, 30).t(),
        torch.randn(9, 50, 3).permute(2, 0, 1),
        torch.randn(300)[::3],
        torch.randn(4, 3, 64)[:, :, ::2],
    ],
    ids=["transposed", "permuted", "strided-vector", "strided-rows"],
)
@pytest.mark.parametrize("staging_bytes", [1, 64, 1000, 1 << 20])
def test_tensor_pieces_stream_non_contiguous_tensors_in_order(
    tensor: torch.Tensor, staging_bytes: int
) -> None:
    pieces = [bytes(piece) for piece in tensor_pieces(tensor, staging_bytes)]
    assert b"".join(pieces) == bytes(byte_view(tensor.contiguous()))
    assert max(len(piece) for piece in pieces) <= max(
        staging_bytes, tensor[0].numel() * tensor.element_size(), tensor.element_size()
    )


def test_conjugate_and_negative_views_are_written_resolved(tmp_path: Path) -> None:
    value = torch.randn(4, dtype=torch.complex64)
    tensors = {"conj": value.conj(), "neg": torch._neg_view(torch.randn(3))}
    assert tensors["conj"].is_conj() and tensors["neg"].is_neg()
    loaded = storage.read_payload(storage.write_payload(tmp_path / "c.safetensors", tensors))
    assert torch.equal(loaded["conj"], tensors["conj"].resolve_conj())
    assert torch.equal(loaded["neg"], tensors["neg"].resolve_neg())


def test_tensors_that_require_grad_and_parameters_are_written(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.randn(3, 2))
    loaded = storage.read_payload(storage.write_payload(tmp_path / "p.safetensors", {"w": weight}))
    assert type(loaded["w"]) is torch.Tensor
    assert torch.equal(loaded["w"], weight.detach())


# ---------------------------------------------------------------------------------------------
# Reading: names, buffers, stale layouts
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def three(tmp_path: Path) -> tuple[storage.PayloadLayout, dict[str, torch.Tensor]]:
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int16), "c": torch.randn(2)}
    return storage.write_payload(tmp_path / "three.safetensors", tensors), tensors


def test_read_selected_names_in_requested_order(three: Any) -> None:
    layout, tensors = three
    loaded = storage.read_payload(layout, names=["c", "a"])
    assert list(loaded) == ["c", "a"]
    assert torch.equal(loaded["c"], tensors["c"]) and torch.equal(loaded["a"], tensors["a"])


def test_unknown_name_raises_storage_error_listing_entries(three: Any) -> None:
    layout, _ = three
    with pytest.raises(T2NErrorStorage, match=r"has no entry 'zz'; it holds \['a', 'b', 'c'\]"):
        storage.read_payload(layout, names=["a", "zz"])
    with pytest.raises(T2NErrorStorage, match=str(layout.path)):
        storage.allocate(layout, ["zz"])


def test_out_buffers_are_filled_in_place(three: Any) -> None:
    layout, tensors = three
    buffers = storage.allocate(layout)
    pointers = {name: buffer.data_ptr() for name, buffer in buffers.items()}

    for _ in range(2):  # the same buffers serve repeated reads
        loaded = storage.read_payload(layout, out=buffers)
        for name, tensor in tensors.items():
            assert loaded[name] is buffers[name]
            assert loaded[name].data_ptr() == pointers[name]
            assert torch.equal(loaded[name], tensor)


def test_partial_out_allocates_the_rest(three: Any) -> None:
    layout, tensors = three
    only_a = storage.allocate(layout, ["a"])
    loaded = storage.read_payload(layout, out=only_a)
    assert loaded["a"] is only_a["a"]
    assert torch.equal(loaded["b"], tensors["b"])


@pytest.mark.parametrize(
    ("buffer", "problem"),
    [
        (torch.empty(3, 4, dtype=torch.float64), "dtype torch.float64"),
        (torch.empty(4, 3), r"shape \(4, 3\)"),
        (torch.empty(4, 3).t(), "non-contiguous"),
        (torch.empty(3, 4, device="meta"), "device meta"),
        ("not a tensor", "got str"),
    ],
    ids=["dtype", "shape", "non-contiguous", "device", "type"],
)
def test_mismatched_out_buffer_is_misuse_naming_both_sides(
    three: Any, buffer: Any, problem: str
) -> None:
    layout, _ = three
    with pytest.raises(T2NErrorMisuse) as info:
        storage.read_payload(layout, out={"a": buffer})
    message = str(info.value)
    assert "torch.float32 tensor of shape (3, 4)" in message
    assert str(layout.path) in message
    assert re.search(problem, message)


def test_out_buffer_for_an_entry_not_read_is_misuse(three: Any) -> None:
    layout, _ = three
    with pytest.raises(T2NErrorMisuse, match=r"out holds buffers for \['b'\]"):
        storage.read_payload(layout, names=["a"], out={"b": torch.empty(6, dtype=torch.int16)})


def test_names_must_not_be_a_string(three: Any) -> None:
    layout, _ = three
    with pytest.raises(T2NErrorMisuse, match="not the str 'abc'"):
        storage.read_payload(layout, names="abc")


def test_stale_layout_is_refused_after_the_file_is_replaced(three: Any) -> None:
    layout, _ = three
    storage.write_payload(layout.path, {"a": torch.zeros(3, 4)})
    with pytest.raises(T2NErrorStorage, match="replaced or modified since its layout was read"):
        storage.read_payload(layout)


def test_allocate_honours_pin_memory_only_with_cuda(three: Any) -> None:
    layout, _ = three
    buffers = storage.allocate(layout, pin_memory=True)
    assert {name: (b.dtype, tuple(b.shape)) for name, b in buffers.items()} == {
        name: (e.dtype, e.shape) for name, e in layout.entries.items()
    }
    for buffer in buffers.values():
        assert buffer.is_pinned() == torch.cuda.is_available()
        assert buffer.device.type == "cpu"
    assert not any(b.is_pinned() for b in storage.allocate(layout, pin_memory=False).values())


def test_huge_page_hint_applies_to_large_fresh_buffers_only() -> None:
    assert advise_huge_pages(torch.empty(1000)) is False
    large = torch.arange(4 << 20, dtype=torch.float32)
    hinted = advise_huge_pages(large)
    assert hinted is (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").exists()
        and not _kernel.host_takes_back_free_memory()
    )
    assert torch.equal(large, torch.arange(4 << 20, dtype=torch.float32))  # values untouched


def _virtio_device(root: Path, name: str, kind: str, features: str) -> None:
    device = root / name
    device.mkdir(parents=True)
    (device / "device").write_text(kind + "\n")
    (device / "features").write_text(features + "\n")


def test_a_host_taking_back_free_memory_is_told_by_its_balloon(tmp_path: Path) -> None:
    """Free page reporting is bit 5 of a virtio balloon's (device 0x0005) features: only
    that bit, of that device, says the host takes back freed memory."""
    reporting = "0110010100000000000000000000000010000000"  # (a Firecracker guest's balloon)
    silent = "0110000100000000000000000000000010000000"
    root = tmp_path / "devices"
    assert not _kernel.host_takes_back_free_memory(str(root))  # no virtio bus at all
    _virtio_device(root, "virtio0", "0x0002", reporting)  # a block device: same bit, no balloon
    _virtio_device(root, "virtio1", "0x0005", silent)
    (root / "virtio2").mkdir()  # a device whose files cannot be read
    assert not _kernel.host_takes_back_free_memory(str(root))
    _virtio_device(root, "virtio3", "0x0005", reporting)
    assert _kernel.host_takes_back_free_memory(str(root))


def _mapped(address: int, nbytes: int) -> bool:
    """Whether any byte of ``[address, address + nbytes)`` is mapped in this process (Linux)."""
    for line in Path("/proc/self/maps").read_text(encoding="ascii").splitlines():
        start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
        if start < address + nbytes and address < end:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc maps")
def test_large_read_buffers_are_unmapped_with_their_last_tensor(tmp_path: Path) -> None:
    """A read buffer of 1 MiB lives as long as a view of it, then leaves the process at once.

    Mutation caught: buffers from ``torch.empty`` stayed mapped in glibc's heap once a larger
    tensor had been freed first (glibc's mmap threshold then rises past it), failing the test.
    """
    torch.ones(1 << 20).sum()  # a 4 MiB tensor freed: glibc serves 1 MiB from its heaps now
    value = torch.randn(512, 512)
    layout = storage.write_payload(tmp_path / "p.safetensors", {"w": value}, fsync=False)
    read = storage.read_payload(layout)["w"]
    address, nbytes = read.data_ptr(), read.nbytes
    view = read[100:101]
    del read
    gc.collect()
    assert torch.equal(view, value[100:101])  # the view keeps the buffer alive
    assert _mapped(address, nbytes)
    del view
    gc.collect()
    assert not _mapped(address, nbytes)


def _resident_fraction(address: int, nbytes: int) -> float:
    """The fraction of the pages of ``[address, address + nbytes)`` in memory (``mincore``)."""
    page = mmap.PAGESIZE
    start = address // page * page
    pages = -(-(address + nbytes - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * page, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's mincore")
@pytest.mark.parametrize(
    "nbytes", [4 << 20, 5 * _kernel.POPULATE_CHUNK + 3 * 4096 + 100], ids=["4 MiB", "ragged"]
)
def test_a_fresh_read_buffer_is_faulted_in_at_once(nbytes: int) -> None:
    """A mapped read buffer is about to be written whole: its pages are in before the read
    (a call per chunk, not a fault per page as the read reaches it), to its last page, on
    kernels that can (5.14+)."""
    buffer = empty_buffer((nbytes,), torch.uint8)
    kernel = _kernel.KERNEL
    if kernel is None or not kernel.populates_for_writing:
        pytest.skip("the kernel cannot populate memory for writing (MADV_POPULATE_WRITE)")
    assert _resident_fraction(buffer.data_ptr(), nbytes) == 1.0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7


def test_buffers_come_from_torch_when_no_mapping_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the system refuses a new mapping (too many mappings), the buffer is still made."""

    def refuse(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    buffer = empty_buffer((MAPPED_BUFFER_MIN_BYTES // 4,), torch.float32)
    buffer.fill_(2.0)
    assert buffer.sum().item() == MAPPED_BUFFER_MIN_BYTES // 2
    small = empty_buffer((3,), torch.float64)  # small buffers never ask for a mapping
    assert small.shape == (3,) and small.dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------
def test_to_device_cpu_returns_the_host_tensor() -> None:
    host = torch.randn(3)
    assert storage.to_device(host, "cpu") is host
    assert storage.to_device(host, torch.device("cpu")) is host


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12.0).reshape(3, 4),  # small: torch's memory
        torch.arange(1 << 16, dtype=torch.float64),  # 512 KiB: a mapping of its own
        torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256).t(),  # not contiguous
        torch.complex(torch.ones(4), torch.ones(4)).conj(),  # a pending conjugate bit
    ],
    ids=["small", "large", "transposed", "conjugate"],
)
def test_copy_to_the_cpu_is_an_equal_tensor_that_never_aliases(value: torch.Tensor) -> None:
    copy = storage.copy_to(value, torch.device("cpu"))
    assert copy.dtype == value.dtype and copy.shape == value.shape
    assert torch.equal(copy.resolve_conj(), value.resolve_conj())
    assert copy.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    expected = value.resolve_conj().clone()
    copy.zero_()
    assert torch.equal(value.resolve_conj(), expected)  # the original is untouched


def test_to_device_other_devices_copy() -> None:
    moved = storage.to_device(torch.randn(2, 3), "meta")
    assert moved.device.type == "meta" and tuple(moved.shape) == (2, 3)


# ---------------------------------------------------------------------------------------------
# Writing: atomicity, symlinks, errors
# ---------------------------------------------------------------------------------------------
def test_symlink_at_destination_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_bytes(b"precious")
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    destination = offload_dir / "w.safetensors"
    destination.symlink_to(victim)

    layout = storage.write_payload(destination, {"w": torch.ones(4)})

    assert victim.read_bytes() == b"precious"
    assert not destination.is_symlink() and destination.is_file()
    assert torch.equal(storage.read_payload(layout)["w"], torch.ones(4))
    assert sorted(p.name for p in offload_dir.iterdir()) == ["w.safetensors"]


def test_rewrite_replaces_content_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    storage.write_payload(path, {"w": torch.zeros(10)})
    layout = storage.write_payload(path, {"w": torch.ones(3), "extra": torch.arange(2)})
    assert torch.equal(storage.read_payload(storage.read_layout(path))["w"], torch.ones(3))
    assert layout == storage.read_layout(path)
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


def test_write_into_missing_directory_raises_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "p.safetensors"
    with pytest.raises(T2NErrorStorage, match=f"cannot write payload file '{path}'") as info:
        storage.write_payload(path, {"w": torch.zeros(2)})
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_write_onto_a_directory_fails_and_removes_the_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "p.safetensors"
    target.mkdir()
    with pytest.raises(T2NErrorStorage, match=str(target)) as info:
        storage.write_payload(target, {"w": torch.zeros(2)})
    assert isinstance(info.value.__cause__, OSError)
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]
    assert target.is_dir()


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ({"__metadata__": torch.zeros(1)}, None, "reserved"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, None, "complex128"),
        ({"m": torch.zeros(2, device="meta")}, None, "meta device"),
        ({"s": torch.eye(2).to_sparse()}, None, "sparse"),
        ({"x": [1.0, 2.0]}, None, "must be a torch.Tensor, got list"),
        ({3: torch.zeros(1)}, None, "names must be str"),
        ({"bad\udc80": torch.zeros(1)}, None, "valid Unicode"),
        ({"w": torch.zeros(1)}, {"k": 1}, "str to str"),
        ([torch.zeros(1)], None, "mapping of names"),
    ],
    ids=[
        "reserved",
        "complex128",
        "meta",
        "sparse",
        "list",
        "int-name",
        "surrogate",
        "meta-int",
        "seq",
    ],
)
def test_unstorable_input_is_misuse(
    tmp_path: Path, tensors: Any, metadata: Any, message: str
) -> None:
    with pytest.raises(T2NErrorMisuse, match=message):
        storage.write_payload(tmp_path / "p.safetensors", tensors, metadata)
    assert list(tmp_path.iterdir()) == []


def test_header_over_the_reader_limit_is_refused_by_the_writer(tmp_path: Path) -> None:
    metadata = {"big": "x" * storage.MAX_HEADER_BYTES}
    with pytest.raises(T2NErrorMisuse, match="over the 104857600 bytes readers accept"):
        storage.write_payload(tmp_path / "p.safetensors", {"w": torch.zeros(1)}, metadata)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(90)
def test_killed_writer_leaves_the_old_or_the_new_payload(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        ready = children.context().Event()
        process = children.start_worker("payload_writer", path=str(path), ready=ready)
        try:
            # The first start also starts the forkserver, which imports torch.
            assert ready.wait(timeout=60), "the writer process did not start"
            time.sleep(float(torch.rand((), generator=generator)) * 0.4)
        finally:
            process.kill()
            process.join(timeout=30)
        assert process.exitcode == -signal.SIGKILL, "the writer must die by SIGKILL"
        loaded = storage.read_payload(storage.read_layout(path))
        assert loaded["w"].shape == (4 << 20,)
        assert torch.unique(loaded["w"]).tolist() in ([1.0], [2.0])


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------
HOSTILE_NAMES = [
    "model.layers.0.weight",
    "../../../etc/passwd",
    "/absolute/path",
    "..",
    ".",
    ".hidden",
    "",
    "a/../../b",
    "back\\slash\\..\\x",
    "nul\x00byte",
    "dots...in..middle",
    "ünïcödé名前",
    "x" * 5000,
    "/" * 300,
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_payload_paths_stay_inside_the_offload_directory(tmp_path: Path, name: str) -> None:
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    path = storage.payload_path(offload_dir, name, "id42")

    assert path.parent == offload_dir.resolve()
    assert path.name.endswith(".id42.safetensors")
    assert not path.name.startswith(".")
    assert ".." not in path.name
    assert len(path.name) <= 120 + len(".id42.safetensors")
    assert set(path.name) <= set(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
    )

    storage.write_payload(path, {"w": torch.zeros(1)})
    assert [p.name for p in offload_dir.iterdir()] == [path.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offload"]


def test_payload_path_keeps_plain_names_readable_and_long_names_distinct(tmp_path: Path) -> None:
    plain = storage.payload_path(tmp_path, "model.layers.0.weight", "abc")
    assert plain.name == "model.layers.0.weight.abc.safetensors"
    first = storage.payload_path(tmp_path, "y" * 500 + "1", "abc")
    second = storage.payload_path(tmp_path, "y" * 500 + "2", "abc")
    assert first != second
    assert storage.payload_path(tmp_path, "rel", "abc").is_absolute()


@pytest.mark.parametrize("storage_id", ["", "../x", "a/b", "a.b", "x" * 65, "nul\x00", 7])
def test_invalid_storage_id_is_misuse(tmp_path: Path, storage_id: Any) -> None:
    with pytest.raises(T2NErrorMisuse, match="storage_id must be"):
        storage.payload_path(tmp_path, "w", storage_id)


def test_non_string_name_is_misuse(tmp_path: Path) -> None:
    with pytest.raises(T2NErrorMisuse, match="must be a str, got int"):
        storage.payload_path(tmp_path, 5, "abc")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Opaque payloads
# ---------------------------------------------------------------------------------------------
class ScaledInt8(OpaqueTensor, SupportsOffloadState):
    """A tiny opaque tensor: int8 values times a float scale."""

    OFFLOAD_STATE_TAG = "tests.test_storage.ScaledInt8"
    values: torch.Tensor
    scale: float

    @staticmethod
    def __new__(cls, values: torch.Tensor, scale: float) -> ScaledInt8:
        shell: ScaledInt8 = OpaqueTensor._make_shell(cls, values.shape, torch.float32, "cpu")
        shell.values = values
        shell.scale = scale
        return shell

    def __init__(self, values: torch.Tensor, scale: float) -> None:
        super().__init__()

    def _to_base_tensor(self) -> torch.Tensor:
        return self.values.float() * self.scale

    def to_offload_state(self) -> dict[str, Any]:
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "values": self.values,
            "scale": self.scale,
            "kind": ["int8", 1],
        }

    @classmethod
    def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> ScaledInt8:
        assert cls.is_offload_state(state) and state["kind"] == ["int8", 1]
        return cls(state["values"], state["scale"])


class NotJsonAble(ScaledInt8):
    OFFLOAD_STATE_TAG = "tests.test_storage.NotJsonAble"

    def to_offload_state(self) -> dict[str, Any]:
        return {"values": self.values, "scale": float("nan")}


def test_opaque_value_round_trips_through_a_payload_file(tmp_path: Path) -> None:
    value = ScaledInt8(torch.randint(-128, 127, (4, 5), dtype=torch.int8), 0.25)
    tensors, metadata = storage.encode_opaque(value)
    assert metadata == {
        "t2n.class": "tests.test_storage.ScaledInt8",
        "t2n.attributes": '{"kind": ["int8", 1], "scale": 0.25}',
    }
    assert storage.is_opaque_payload(metadata)

    layout = storage.write_payload(tmp_path / "q.safetensors", tensors, metadata)
    layout = storage.read_layout(layout.path)
    rebuilt = storage.decode_opaque(storage.read_payload(layout), layout.metadata)

    assert type(rebuilt) is ScaledInt8
    assert torch.equal(rebuilt.values, value.values) and rebuilt.scale == 0.25
    assert torch.equal(rebuilt.to_base_tensor(), value.to_base_tensor())


def test_plain_payloads_are_not_opaque() -> None:
    assert not storage.is_opaque_payload({})
    assert not storage.is_opaque_payload({"format": "pt"})


def test_encode_rejects_values_without_offload_state_and_non_json_attributes() -> None:
    with pytest.raises(T2NErrorMisuse, match="does not implement SupportsOffloadState"):
        storage.encode_opaque(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match="must be JSON-able"):
        storage.encode_opaque(NotJsonAble(torch.zeros(2, dtype=torch.int8), 1.0))


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"t2n.class": "tests.test_storage.ScaledInt8", "t2n.attributes": "{not json"},
            "not valid JSON",
        ),
        ({"t2n.class": "tests.test_storage.ScaledInt8", "t2n.attributes": "[1, 2]"}, "JSON object"),
        ({"t2n.class": "tests.test_storage.ScaledInt8"}, "lacks"),
        ({"t2n.class": "no.such.Class", "t2n.attributes": "{}"}, "unknown offload class tag"),
    ],
    ids=["bad-json", "not-object", "missing", "unknown-tag"],
)
def test_decode_rejects_bad_metadata_with_storage_error(
    metadata: dict[str, str], message: str
) -> None:
    with pytest.raises(T2NErrorStorage, match=message):
        storage.decode_opaque({"values": torch.zeros(2, dtype=torch.int8)}, metadata)


def test_changed_since_read_tells_a_replaced_or_rewritten_file(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    layout = storage.write_payload(path, {"t": torch.zeros(4)})
    assert not storage.changed_since_read(layout)
    storage.write_payload(path, {"t": torch.ones(4)})  # replaced: another file
    assert storage.changed_since_read(layout)
    layout = storage.read_layout(path)
    assert not storage.changed_since_read(layout)
    path.unlink()
    assert not storage.changed_since_read(layout)  # gone: its read says so


def test_public_api_is_exactly_exported() -> None:
    assert sorted(storage.__all__) == sorted(
        [
            "DATA_ALIGNMENT",
            "MAX_HEADER_BYTES",
            "EntrySpec",
            "PayloadLayout",
            "dtype_code",
            "read_layout",
            "changed_since_read",
            "read_payload",
            "aread_payload",
            "map_payload",
            "advise_payload",
            "load_payload",
            "mapped_reads",
            "set_mapped_reads",
            "MAPPED_MIN_BYTES",
            "allocate",
            "copy_to",
            "open_regular_file",
            "placement_refused",
            "resolve_device",
            "to_device",
            "read_to_device",
            "handoff",
            "record_writes",
            "wait_for_writes",
            "pinned_bytes",
            "PINNED_CHUNK_BYTES",
            "PINNED_CHUNKS_PER_DEVICE",
            "write_payload",
            "forget_file",
            "awrite_payload",
            "encode_opaque",
            "decode_opaque",
            "decode_offload_state",
            "value_nbytes",
            "is_opaque_payload",
            "payload_path",
            "make_private_dir",
        ]
    )
    assert storage.DATA_ALIGNMENT == 4096
    assert storage.MAX_HEADER_BYTES == 100 * 1024 * 1024


@pytest.mark.timeout(60)
def test_storage_benchmark_runs_in_quick_mode(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_storage.py"
    output = tmp_path / "storage.json"
    completed = subprocess.run(
        [sys.executable, str(script), "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "f.readinto (reference)" in completed.stdout
    document = json.loads(output.read_text())
    assert document["benchmark"] == "storage" and document["config"]["quick"] is True
    methods = {row["method"]: row for row in document["results"]}
    assert {
        "sync, fresh buffers",
        "sync, reused buffers",
        "async, 1 worker",
        "async, 2 workers",
    } <= set(methods)
    assert all(row["gbps_best"] > 0 for row in methods.values())
    assert methods["f.readinto (reference)"]["ratio_vs_reference"] == 1.0
