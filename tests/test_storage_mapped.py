"""Mapped reads of payload files: values, copy on write, lifetime of the mapping, errors."""

from __future__ import annotations

import ctypes
import errno
import gc
import itertools
import mmap
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import safetensors.torch
import torch
from breakpoints import paused_in_new_threads
from forking import in_forked_child
from interrupts import SignalAt

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.storage import _folios, _kernel, _mapped


def mapped_regions(path: Path) -> int:
    """How many mappings of ``path`` the process holds."""
    text = Path("/proc/self/maps").read_text()
    return sum(line.endswith(str(path)) for line in text.splitlines())


@pytest.fixture
def payload(tmp_path: Path) -> tuple[storage.PayloadLayout, dict[str, torch.Tensor]]:
    tensors = {
        "a": torch.arange(3000, dtype=torch.float32).reshape(30, 100),
        "b": torch.arange(7, dtype=torch.int16),
        "empty": torch.zeros(0, 4),
    }
    return storage.write_payload(tmp_path / "p.safetensors", tensors), tensors


@pytest.mark.parametrize("populate", [True, False])
def test_mapped_entries_hold_the_file_values(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]], populate: bool
) -> None:
    layout, tensors = payload
    mapped = storage.map_payload(layout, populate=populate)
    assert list(mapped) == list(layout.entries)
    for name, value in tensors.items():
        assert mapped[name].dtype == value.dtype and torch.equal(mapped[name], value)
    only = storage.map_payload(layout, names=["b"])
    assert list(only) == ["b"] and torch.equal(only["b"], tensors["b"])


@pytest.mark.skipif(
    _kernel.KERNEL is None or not Path("/proc/self/maps").exists(),
    reason="needs the kernel's calls and /proc",
)
def test_a_mapping_whose_unmap_an_interrupt_lost_is_unmapped_by_a_later_sweep(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    """A Ctrl-C landing in the callback that unmaps a mapping as its tensors die is lost by
    Python, and the unmap with it: the mapping stays (a replaced file's disk space with it)
    until a sweep, after at most SWEEP_EVERY more mappings, unmaps it."""
    layout, _tensors = payload

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "_gone":
            sys.settrace(None)
            raise KeyboardInterrupt

    lost: list[type[BaseException]] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: lost.append(unraisable.exc_type)
    try:
        mapped = storage.map_payload(layout)
        assert mapped_regions(layout.path) == 1
        sys.settrace(trace)
        try:
            del mapped
            gc.collect()
        finally:
            sys.settrace(None)
    finally:
        sys.unraisablehook = hook
    assert lost == [KeyboardInterrupt]
    assert mapped_regions(layout.path) == 1  # its unmap was lost
    for _ in range(_mapped.SWEEP_EVERY):
        storage.map_payload(layout, names=["b"])  # each gone at once
    assert mapped_regions(layout.path) == 0


@pytest.mark.skipif(
    _kernel.KERNEL is None or not Path("/proc/self/maps").exists() or not hasattr(os, "fork"),
    reason="needs the kernel's calls, /proc and os.fork",
)
@pytest.mark.timeout(60)
def test_an_error_in_the_sweep_of_a_new_mapping_unmaps_it_once(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    """An error raised in the sweep that a new mapping runs (one in SWEEP_EVERY; a
    MemoryError, say: a Ctrl-C is held there) fails the map, which unmaps it: its view, kept
    by the traceback, unmaps nothing when it dies, since its address, free again, holds a
    later mapping by then. (In a forked child: an unmap of the wrong range would break the
    process.)"""
    layout, tensors = payload

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "sweep":
            sys.settrace(None)
            raise MemoryError

    def child() -> str:
        sys.settrace(trace)
        try:
            for _ in range(_mapped.SWEEP_EVERY):
                storage.map_payload(layout, names=["b"])  # each gone at once
            return "no sweep ran"
        except MemoryError as error:
            failed = error  # its traceback keeps the failed map's view
        finally:
            sys.settrace(None)
        unmapped = mapped_regions(layout.path) == 0
        later = storage.map_payload(layout, names=["b"])  # at the address freed, as a rule
        del failed
        gc.collect()  # the failed map's view dies
        return repr([unmapped, mapped_regions(layout.path), torch.equal(later["b"], tensors["b"])])

    assert in_forked_child(child) == "[True, 1, True]"


_NEEDS_KERNEL_AND_PROC = pytest.mark.skipif(
    _kernel.KERNEL is None or not Path("/proc/self/maps").exists(),
    reason="needs the kernel's calls and /proc",
)


@_NEEDS_KERNEL_AND_PROC
@pytest.mark.usefixtures("young_collections")  # no earlier test's mapping goes meanwhile
def test_a_ctrl_c_anywhere_in_the_unmap_of_a_dead_mapping_leaves_it_to_a_sweep(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    """A Ctrl-C at each point of the callback unmapping a mapping as its tensors die, in
    turn: Python loses the interrupt (reported as unraisable), but never the mapping, which
    is unmapped there or by the next sweep, and only once. The points of a collection that
    comes amid one are not the callback's: not counted."""
    layout, _tensors = payload
    baseline = len(_mapped.MAPPINGS)
    lost: list[type[BaseException]] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: lost.append(unraisable.exc_type)
    try:
        for n in itertools.count(1):
            mapped = storage.map_payload(layout)
            signal_at = SignalAt(n, within=_mapped.__file__, finalizers=False)
            sys.setprofile(signal_at)
            try:
                del mapped  # the callback runs here
            finally:
                sys.setprofile(None)
            if not signal_at.fired:
                break
            _mapped.MAPPINGS.sweep(_kernel.KERNEL)
            assert mapped_regions(layout.path) == 0, f"a Ctrl-C at event {n} left the mapping"
            assert len(_mapped.MAPPINGS) == baseline
    finally:
        sys.unraisablehook = hook
    assert n > 4, "the callback made fewer events than expected: the test proves little"
    assert lost == [KeyboardInterrupt] * (n - 1)
    assert mapped_regions(layout.path) == 0 and len(_mapped.MAPPINGS) == baseline


@_NEEDS_KERNEL_AND_PROC
@pytest.mark.usefixtures("young_collections")  # a collection per point
@pytest.mark.parametrize("numel", [3000, 3 << 20], ids=["small", "huge-page-sized"])
def test_a_ctrl_c_anywhere_in_a_map_leaks_no_mapping_and_is_raised(
    tmp_path: Path, numel: int
) -> None:
    """A Ctrl-C at each point of a map in turn (its storage calls, the kernel's included)
    is raised by the map, once its mapping is registered where it lands after the mapping
    is made: the mapping is unmapped as the interrupted map's values die. The points of a
    collection that comes amid one are not the map's: not counted."""
    value = torch.arange(numel, dtype=torch.float32)
    layout = storage.write_payload(tmp_path / "p.safetensors", {"x": value})
    baseline = len(_mapped.MAPPINGS)
    within = str(Path(_mapped.__file__).parent)
    for n in itertools.count(1):
        signal_at = SignalAt(n, within=within, finalizers=False)
        sys.setprofile(signal_at)
        try:
            mapped = storage.map_payload(layout)
        except KeyboardInterrupt:
            assert signal_at.fired
        else:
            assert not signal_at.fired, f"a Ctrl-C at event {n} was lost"
            assert torch.equal(mapped["x"], value)
            break
        finally:
            sys.setprofile(None)
        gc.collect()  # the interrupt's traceback, and the values it kept
        assert mapped_regions(layout.path) == 0, f"a Ctrl-C at event {n} left a mapping"
        assert len(_mapped.MAPPINGS) == baseline
    assert n > 10, "the map made fewer events than expected: the test proves little"
    del mapped
    assert mapped_regions(layout.path) == 0 and len(_mapped.MAPPINGS) == baseline


def test_a_checkpoint_written_by_safetensors_maps_at_unaligned_offsets(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    tensors = {"x": torch.randn(5, 3), "y": torch.randn(11, dtype=torch.float64)}
    safetensors.torch.save_file(tensors, str(path))
    mapped = storage.map_payload(storage.read_layout(path))
    assert all(torch.equal(mapped[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_writes_stay_private_and_the_mapping_ends_with_its_tensors(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    layout, tensors = payload
    before = layout.path.read_bytes()
    mapped = storage.map_payload(layout)
    assert mapped_regions(layout.path) == 1
    mapped["a"].mul_(2)  # copy on write: the file keeps its bytes
    assert torch.equal(mapped["a"], tensors["a"] * 2)
    assert layout.path.read_bytes() == before
    assert torch.equal(storage.map_payload(layout)["a"], tensors["a"])
    gc.collect()
    del mapped
    gc.collect()
    assert mapped_regions(layout.path) == 0


def test_a_changed_or_missing_file_is_refused(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    layout, _ = payload
    with pytest.raises(T2NErrorStorage, match="no entry 'c'"):
        storage.map_payload(layout, names=["c"])
    with layout.path.open("ab") as file:
        file.write(b"x")
    with pytest.raises(T2NErrorStorage, match="changed"):
        storage.map_payload(layout)
    os.unlink(layout.path)
    with pytest.raises(T2NErrorStorage, match="cannot open"):
        storage.map_payload(layout)
    with pytest.raises(T2NErrorStorage, match="cannot open"):
        storage.advise_payload(layout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["truncated", "rewritten"])
@pytest.mark.parametrize("on_demand", [False, True], ids=["populated", "on_demand"])
def test_a_file_changed_in_place_while_it_is_mapped_is_refused(
    tmp_path: Path, change: str, on_demand: bool
) -> None:
    """Another process truncates the file, or rewrites it in place, after a load checked it
    and before its pages came in: the load raises, and hands out no mapping (a read of a
    truncated file's missing pages is a SIGBUS, the end of the process; a rewritten one's
    pages hold the new bytes)."""
    layout = storage.write_payload(
        tmp_path / "p.safetensors",
        {"w": torch.zeros(1 << 18)},  # 1 MiB
    )
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(storage.load_payload(layout, mapped=True, on_demand=on_demand))
        except T2NErrorStorage as error:
            outcome.append(error)

    with paused_in_new_threads(_mapped._map.__code__, on="call") as point:
        point.armed.set()
        thread = threading.Thread(target=load)
        thread.start()
        assert point.paused.wait(30)
        if change == "truncated":
            os.truncate(layout.path, 4096)
        else:
            with layout.path.open("r+b") as file:  # same size, new bytes
                file.seek(layout.file_size - 4096)
                file.write(b"\x7f" * 4096)
        point.go()
        thread.join(30)
    assert not thread.is_alive()
    # (A mapping handed out is dropped unread: a report showing it would read it.)
    messages = [str(item) if isinstance(item, T2NErrorStorage) else None for item in outcome]
    outcome.clear()
    assert len(messages) == 1 and messages[0] is not None, "a mapping of it was handed out"
    assert "modified in place while it was read" in messages[0]
    assert mapped_regions(layout.path) == 0


def test_advise_starts_readahead_and_returns(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    layout, tensors = payload
    storage.advise_payload(layout, names=["a", "empty"])
    assert torch.equal(storage.read_payload(layout, names=["a"])["a"], tensors["a"])


@pytest.mark.parametrize("mapped", [True, False, None])
def test_load_payload_maps_or_reads(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]], mapped: bool | None
) -> None:
    layout, tensors = payload
    out = {"a": torch.empty(30, 100)}
    loaded = storage.load_payload(layout, names=["a"], out=out, mapped=mapped)
    assert torch.equal(loaded["a"], tensors["a"])
    maps = bool(mapped)  # when not told: 12 KB are read, below the mapping threshold
    assert (loaded["a"] is out["a"]) is not maps
    assert (mapped_regions(layout.path) == 1) is maps


@pytest.mark.parametrize("mapped_reads", [True, False])
def test_loads_map_large_entries_and_read_small_ones(tmp_path: Path, mapped_reads: bool) -> None:
    """Mutation check: mapping whatever the size (the rule before the threshold) fails the
    small case; never mapping fails the large one."""
    threshold = storage.MAPPED_MIN_BYTES
    tensors = {
        "small": torch.arange(threshold // 4 - 1, dtype=torch.float32),
        "large": torch.arange(threshold // 4, dtype=torch.float32),
    }
    layout = storage.write_payload(tmp_path / "sizes.safetensors", tensors)
    previous = storage.set_mapped_reads(mapped_reads)
    try:
        for name, maps in (("small", False), ("large", mapped_reads)):
            loaded = storage.load_payload(layout, names=[name])
            assert torch.equal(loaded[name], tensors[name])
            assert mapped_regions(layout.path) == int(maps), name
            del loaded
            gc.collect()
    finally:
        storage.set_mapped_reads(previous)


def test_the_switch_of_mapped_loads(tmp_path: Path) -> None:
    large = torch.zeros(storage.MAPPED_MIN_BYTES // 4)
    layout = storage.write_payload(tmp_path / "large.safetensors", {"a": large})
    previous = storage.set_mapped_reads(False)
    try:
        assert storage.mapped_reads() is False
        out = {"a": torch.empty_like(large)}
        assert storage.load_payload(layout, names=["a"], out=out)["a"] is out["a"]
        assert storage.set_mapped_reads(True) is False
        assert storage.load_payload(layout, names=["a"], out=out)["a"] is not out["a"]
        with pytest.raises(T2NErrorMisuse, match="takes a bool"):
            storage.set_mapped_reads("yes")  # type: ignore[arg-type]
    finally:
        storage.set_mapped_reads(previous)


# -- populating and placing large regions (Linux) ---------------------------------------------
linux_only = pytest.mark.skipif(
    _kernel.KERNEL is None or not Path("/proc/thread-self/stat").exists(),
    reason="needs Linux's madvise and /proc",
)


def minor_faults() -> int:
    """Minor page faults taken by the calling thread so far."""
    fields = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def touch_every_page(value: torch.Tensor) -> int:
    """Read one element of every 4 KiB page of ``value``; the minor faults it took."""
    flat = value.view(-1)
    step = 4096 // value.element_size()
    float(flat[0] + 0)  # the interpreter's first-call allocations, outside the count
    before = minor_faults()
    total = 0.0
    for index in range(0, flat.numel(), step):  # element reads allocate nothing
        total += float(flat[index])
    return minor_faults() - before


def is_mapped(address: int) -> bool:
    """Whether a mapping of the process covers ``address``."""
    spans = [
        line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
    ]
    return any(int(low, 16) <= address < int(high, 16) for low, high in spans)


def kernel_with_huge_pages() -> tuple[_kernel.Kernel, int]:
    """The C library's calls and the huge page size; the test is skipped without them."""
    kernel = _kernel.KERNEL
    if kernel is None or not kernel.huge_page:
        pytest.skip("no transparent huge pages")
    return kernel, kernel.huge_page


@pytest.fixture
def large_payload(tmp_path: Path) -> storage.PayloadLayout:
    """A payload of 16 MiB after a 12 KiB entry (an offset that is neither page nor huge page
    aligned)."""
    tensors = {"head": torch.arange(3000, dtype=torch.float32), "big": torch.randn(4 << 20)}
    layout = storage.write_payload(tmp_path / "large.safetensors", tensors)
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read back through the mapping, cold
    finally:
        os.close(fd)
    return layout


@linux_only
def test_a_populated_mapping_takes_no_faults_when_touched(
    large_payload: storage.PayloadLayout,
) -> None:
    lazy = storage.map_payload(large_payload, names=["big"], populate=False)["big"]
    # The best of three fresh mappings: under memory pressure (another process of the suite)
    # the kernel may take back a few clean pages of one between its population and the touch.
    counts = []
    for _ in range(3):
        populated = storage.map_payload(large_payload, names=["big"])["big"]
        counts.append(touch_every_page(populated))
    faults = min(counts)
    assert faults <= 4, f"{counts} faults on populated mappings"
    assert touch_every_page(lazy) > faults  # the unpopulated one faults its pages in
    expected = storage.read_payload(large_payload, names=["big"])["big"]
    assert torch.equal(populated, expected) and torch.equal(lazy, expected)


@linux_only
def test_a_large_region_is_placed_for_huge_pages_and_unmapped_whole(
    large_payload: storage.PayloadLayout,
) -> None:
    huge = _kernel.KERNEL.huge_page if _kernel.KERNEL is not None else 0
    if not huge:
        pytest.skip("no transparent huge pages")
    spec = large_payload.entries["big"]
    value = storage.map_payload(large_payload, names=["big"])["big"]
    # The address is congruent to the file offset modulo the huge page size: the kernel can
    # map the page cache's huge folios with one entry each.
    assert (value.data_ptr() - spec.start) % huge == 0
    assert mapped_regions(large_payload.path) == 1
    address = f"{value.data_ptr() // huge * huge:x}"
    del value
    gc.collect()
    assert mapped_regions(large_payload.path) == 0
    # The reservation around it is gone too: no mapping covers the address any more.
    assert not is_mapped(int(address, 16))


@linux_only
def test_where_the_file_system_places_mappings_anywhere_a_reservation_places_the_region(
    large_payload: storage.PayloadLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel, huge = kernel_with_huge_pages()
    real = kernel.mmap
    misplaced: list[int] = []

    def anywhere(address: int | None, length: int, prot: int, flags: int, fd: int, off: int) -> int:
        """mmap of a file system without placement for huge pages: a file mapping the
        kernel places lands one page past an address congruent to its offset."""
        if address is not None or fd < 0:
            return int(real(address, length, prot, flags, fd, off))
        room = length + 2 * huge
        anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _kernel.MAP_NORESERVE
        base = int(real(None, room, prot, anonymous, -1, 0))
        target = base + (off - base) % huge + mmap.PAGESIZE
        placed = int(real(target, length, prot, flags | _kernel.MAP_FIXED, fd, off))
        kernel.munmap(base, target - base)
        kernel.munmap(target + length, base + room - target - length)
        misplaced.append(placed)
        return placed

    monkeypatch.setattr(kernel, "mmap", anywhere)
    spec = large_payload.entries["big"]
    value = storage.map_payload(large_payload, names=["big"])["big"]
    assert misplaced and (misplaced[0] - spec.start) % huge  # the first placement was wrong
    assert (value.data_ptr() - spec.start) % huge == 0
    assert mapped_regions(large_payload.path) == 1  # the misplaced mapping is gone
    assert torch.equal(value, storage.read_payload(large_payload, names=["big"])["big"])
    target = value.data_ptr()
    del value
    gc.collect()
    assert mapped_regions(large_payload.path) == 0
    assert not is_mapped(target)  # the reservation around it too


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """(file offset, length) of each mapping of ``path`` the process holds."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if line.endswith(str(path)):
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            found.append((int(fields[2], 16), high - low))
    return found


def page_span(start: int, end: int, unit: int) -> tuple[int, int]:
    """(offset, length) of the ``unit``-aligned span holding bytes ``start`` to ``end``."""
    first = start // unit * unit
    return first, -(-end // unit) * unit - first


@linux_only
def test_the_ends_of_a_large_entry_covering_most_of_a_huge_page_are_widened_to_it(
    tmp_path: Path,
) -> None:
    huge = _kernel.KERNEL.huge_page if _kernel.KERNEL is not None else 0
    if not huge:
        pytest.skip("no transparent huge pages")
    # "big" starts just after a small entry (its first huge page mostly covered) and ends 3/4
    # into a huge page; "tail" starts there (1/4 of that page covered) and ends the file 1/4
    # into another one.
    start = 0
    for _ in range(3):
        tensors = {
            "head": torch.arange(3000, dtype=torch.float32),
            "big": torch.randn((2 * huge + huge * 3 // 4 - start) // 4),
            "tail": torch.randn(huge * 3 // 8),
        }
        layout = storage.write_payload(tmp_path / "p.safetensors", tensors)
        if layout.entries["big"].start == start:
            break
        start = layout.entries["big"].start
    big, tail = layout.entries["big"], layout.entries["tail"]
    assert 0 < big.start % huge < huge // 2 and (big.start + big.nbytes) % huge == huge * 3 // 4
    assert layout.file_size % huge == huge // 4

    value = storage.map_payload(layout, names=["big"])["big"]
    assert file_mappings(layout.path) == [page_span(big.start, big.start + big.nbytes, huge)]
    assert torch.equal(value, tensors["big"])
    del value
    gc.collect()
    # The ends of "tail" cover a quarter of their huge pages: mapped as they are.
    value = storage.map_payload(layout, names=["tail"])["tail"]
    page = mmap.PAGESIZE
    assert file_mappings(layout.path) == [page_span(tail.start, layout.file_size, page)]
    assert torch.equal(value, tensors["tail"])


@linux_only
def test_a_kernel_without_populate_falls_back_to_readahead(
    large_payload: storage.PayloadLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _kernel.KERNEL
    assert kernel is not None
    calls: list[int] = []
    real = kernel.madvise

    def older_kernel(address: int, length: int, advice: int) -> int:
        """madvise of a kernel before 5.14: MADV_POPULATE_READ is unknown (EINVAL)."""
        calls.append(advice)
        if advice == _kernel.MADV_POPULATE_READ:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return int(real(address, length, advice))

    monkeypatch.setattr(kernel, "madvise", older_kernel)
    monkeypatch.setattr(kernel, "populates", True)
    # However long readahead takes (a slow disk or a busy machine), its time is not a
    # populate's, so it never tells small folios: the region is not read again.
    monkeypatch.setattr(_folios, "SMALL_FOLIO_NS", 0)
    expected = storage.read_payload(large_payload)
    for _ in range(2):
        mapped = storage.map_payload(large_payload)
        assert all(torch.equal(mapped[k], v) for k, v in expected.items())
    # Asked once, refused: readahead from then on, without asking again.
    assert calls.count(_kernel.MADV_POPULATE_READ) == 1
    assert calls.count(_kernel.MADV_WILLNEED) == 2
    assert kernel.populates is False


def test_without_the_c_library_mapping_goes_through_the_mmap_module(
    large_payload: storage.PayloadLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_kernel, "KERNEL", None)
    expected = storage.read_payload(large_payload)
    for populate in (True, False):
        mapped = storage.map_payload(large_payload, populate=populate)
        assert all(torch.equal(mapped[k], v) for k, v in expected.items())


# -- regions held in small page cache folios ---------------------------------------------------
def pmd_mapped_bytes(address: int) -> int:
    """``FilePmdMapped`` of the mapping holding ``address``: bytes mapped by huge entries."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == "FilePmdMapped:":
            return int(line.split()[1]) * 1024
    return 0


def in_small_folios(path: Path) -> None:
    """Put ``path`` in the page cache in 4 KiB folios: evicted, then read page by page
    without readahead."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, path.stat().st_size, mmap.PAGESIZE):
            os.pread(fd, 1, offset)
    finally:
        os.close(fd)


def region_of(layout: storage.PayloadLayout, name: str) -> _folios.Region:
    """The region a load of entry ``name`` maps (page aligned, widened to huge pages)."""
    spec = layout.entries[name]
    start = spec.start // mmap.PAGESIZE * mmap.PAGESIZE
    length = spec.start + spec.nbytes - start
    start, length = _mapped._whole_huge_pages(start, length, layout.file_size)
    assert layout.identity is not None
    return layout.identity, start, length


@linux_only
def test_a_region_in_small_folios_is_read_again_once_in_huge_ones(tmp_path: Path) -> None:
    huge = _kernel.KERNEL.huge_page if _kernel.KERNEL is not None else 0
    if not huge:
        pytest.skip("no transparent huge pages")
    tensors = {"head": torch.arange(3000, dtype=torch.float32), "big": torch.randn(3 << 20)}
    cold = storage.write_payload(tmp_path / "cold.safetensors", tensors)
    fd = os.open(cold.path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    value = storage.map_payload(cold, names=["big"])["big"]
    if not pmd_mapped_bytes(value.data_ptr()):
        pytest.skip("this file system reads no huge folios through a mapping")
    del value

    kept, fresh = (
        storage.write_payload(tmp_path / f"{name}.safetensors", tensors)
        for name in ("kept", "fresh")
    )
    for layout in (kept, fresh):
        in_small_folios(layout.path)
    # A region already read again once is not read again: it stays in small folios.
    assert _folios.SLOW_REGIONS.first_slow(region_of(kept, "big"), 1, 1 << 40)
    value = storage.map_payload(kept, names=["big"])["big"]
    if pmd_mapped_bytes(value.data_ptr()):
        pytest.skip("the page cache did not keep the file in small folios")
    assert torch.equal(value, tensors["big"])
    del value
    # Another one is read again as it is mapped: its tensor maps huge folios.
    value = storage.map_payload(fresh, names=["big"])["big"]
    assert pmd_mapped_bytes(value.data_ptr()) >= huge
    assert torch.equal(value, tensors["big"])
    assert not _folios.SLOW_REGIONS.first_slow(region_of(fresh, "big"), 1, 1 << 40)  # noted


def test_slow_regions_are_remembered_once_and_bounded() -> None:
    regions = _folios.SlowRegions(capacity=2)
    identity = (1, 2, 3, 4)
    fast = _folios.SMALL_FOLIO_NS * 3
    assert not regions.first_slow((identity, 0, 1), 3, fast)  # huge folios: not noted
    assert regions.first_slow((identity, 0, 1), 3, fast + 1)
    assert not regions.first_slow((identity, 0, 1), 3, fast + 1)  # once
    assert regions.first_slow((identity, 4, 1), 3, fast + 1)
    assert regions.first_slow((identity, 8, 1), 3, fast + 1)  # over capacity: the oldest goes
    assert regions.first_slow((identity, 0, 1), 3, fast + 1)
    assert not regions.first_slow((identity, 8, 1), 3, fast + 1)


@pytest.mark.skipif(
    not Path("/proc/sys/vm/max_map_count").exists()
    or int(Path("/proc/sys/vm/max_map_count").read_text()) > 300_000,
    reason="needs Linux with a max_map_count a test can reach",
)
def test_a_process_out_of_mappings_is_told_what_to_do(tmp_path: Path) -> None:
    """Every mapped value takes a mapping of the process: past vm.max_map_count the kernel
    refuses new ones, and the error says why and what to do rather than only ENOMEM."""
    import subprocess
    import sys

    script = f"""
import mmap, torch
from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor.offload import OffloadedTensor
t = OffloadedTensor.from_original_tensor(torch.ones(1 << 20), "w", offload_dir={str(tmp_path)!r})
held = []
while True:  # use up the process's mappings (alternate protections: no two merge)
    try:
        held.append(mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (len(held) % 2 and mmap.PROT_WRITE)))
    except OSError:
        break
try:
    t.reload()
except T2NErrorStorage as error:
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert "vm.max_map_count" in result.stdout, result.stdout
    assert "give the residency pool a budget" in result.stdout
