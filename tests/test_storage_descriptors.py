"""Descriptors kept open for mapped loads: a replaced or changed file is never read through
an old one, they are bounded, closed once unused, and maps from threads never tear."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import torch
from interrupts import signalled
from open_files import open_descriptors

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.storage import _descriptors
from torch_to_nnef.tensor.storage._descriptors import DESCRIPTORS, KEPT_FILES, Descriptors

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")


def write(path: Path, value: float, count: int = 1024) -> storage.PayloadLayout:
    return storage.write_payload(path, {"x": torch.full((count,), value)})


@needs_proc
def test_a_replaced_file_is_refused_for_its_old_layout_and_its_descriptor_closed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.safetensors"
    old = write(path, 1.0)
    assert torch.equal(storage.map_payload(old)["x"], torch.full((1024,), 1.0))
    assert open_descriptors(path) == [str(path)]  # kept for the next load
    new = write(path, 2.0)  # atomically replaced: same path, same size, another inode
    with pytest.raises(T2NErrorStorage, match="replaced or modified"):
        storage.map_payload(old)
    assert torch.equal(storage.map_payload(new)["x"], torch.full((1024,), 2.0))
    # The replaced file's descriptor is closed: the new file's alone is open.
    assert open_descriptors(path) == [str(path)]


def test_a_file_modified_in_place_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    layout = write(path, 1.0)
    storage.map_payload(layout)
    with path.open("r+b") as file:  # same inode, same size, new bytes and mtime
        file.seek(layout.entries["x"].start)
        file.write(b"\xff" * 8)
    os.utime(path, ns=(layout.identity[3] + 1, layout.identity[3] + 1))  # type: ignore[index]
    with pytest.raises(T2NErrorStorage, match="replaced or modified"):
        storage.map_payload(layout)


@needs_proc
def test_kept_descriptors_are_bounded_and_a_removed_file_is_forgotten(tmp_path: Path) -> None:
    layouts = [write(tmp_path / f"p{index}.safetensors", index) for index in range(KEPT_FILES + 4)]
    for index, layout in enumerate(layouts):
        assert float(storage.map_payload(layout)["x"][0]) == index
    assert len(open_descriptors(tmp_path)) == KEPT_FILES
    last = layouts[-1].path
    os.unlink(last)
    with pytest.raises(T2NErrorStorage, match="cannot open"):
        storage.map_payload(layouts[-1])
    assert not any(target.startswith(str(last)) for target in open_descriptors(tmp_path))


def test_a_retired_descriptor_is_closed_when_its_last_load_releases_it(tmp_path: Path) -> None:
    first, second = write(tmp_path / "a.safetensors", 1.0), write(tmp_path / "b.safetensors", 2.0)
    descriptors = Descriptors(capacity=1)
    kept, size = descriptors.acquire(first)
    assert size == first.file_size and kept.identity == first.identity
    again, _ = descriptors.acquire(first)
    assert again is kept and kept.users == 2  # one descriptor, two loads
    other, _ = descriptors.acquire(second)  # over capacity: the first is retired, in use
    assert kept.retired and os.fstat(kept.fd).st_ino == first.identity[1]  # type: ignore[index]
    descriptors.release(kept)
    assert os.fstat(kept.fd).st_ino == first.identity[1]  # type: ignore[index]
    descriptors.release(kept)  # its last load: closed (the number may name another file now)
    try:
        still = os.fstat(kept.fd).st_ino == first.identity[1]  # type: ignore[index]
    except OSError:
        still = False
    assert not still
    descriptors.release(other)
    assert not other.retired and os.fstat(other.fd).st_ino == second.identity[1]  # type: ignore[index]


@pytest.mark.timeout(60)
def test_maps_from_threads_while_the_file_is_replaced_never_tear(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    count = 256 * 1024  # 1 MiB: mapped, not read
    current = [write(path, 0.0, count)]
    stop = threading.Event()
    torn: list[str] = []
    served = [0, 0]

    def load(slot: int) -> None:
        while not stop.is_set():
            layout = current[0]
            try:
                value = storage.map_payload(layout)["x"]
            except T2NErrorStorage as exc:
                if "replaced or modified" not in str(exc) and "cannot open" not in str(exc):
                    torn.append(str(exc))
                continue
            low, high = float(value.min()), float(value.max())
            if low != high:
                torn.append(f"a mapping holds {low} and {high}")
            served[slot] += 1

    threads = [threading.Thread(target=load, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    try:
        for version in range(1, 40):
            current[0] = write(path, float(version), count)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not torn
    assert all(served)


def test_the_kept_descriptor_of_the_process_is_shared_by_loads(tmp_path: Path) -> None:
    layout = write(tmp_path / "p.safetensors", 3.0)
    storage.map_payload(layout)
    kept, _ = DESCRIPTORS.acquire(layout)
    try:
        again, _ = DESCRIPTORS.acquire(layout)
        DESCRIPTORS.release(again)
        assert again is kept
    finally:
        DESCRIPTORS.release(kept)


@needs_proc
def test_a_tensors_rewritten_or_removed_file_is_not_held_open(tmp_path: Path) -> None:
    """A kept descriptor holds its inode: the disk space of a file an offloaded tensor
    replaced (a write) or removed (the tensor collected) is freed at once, not when the
    descriptor is next looked up or pushed out."""
    import gc

    from torch_to_nnef.tensor.offload import OffloadedTensor

    t = OffloadedTensor.from_original_tensor(torch.ones(1 << 16), "w", offload_dir=tmp_path)
    path = t.offload_path
    assert torch.equal(t.reload(), torch.ones(1 << 16))  # a mapped load keeps a descriptor
    assert open_descriptors(path) == [str(path)]
    t.update_values(torch.full((1 << 16,), 2.0))  # replaced atomically
    assert open_descriptors(path) == []
    assert torch.equal(t.reload(), torch.full((1 << 16,), 2.0))
    del t
    gc.collect()
    assert not path.exists()
    assert open_descriptors(path) == [], "the removed file is still held open"


@needs_proc
def test_forgetting_a_file_while_this_thread_holds_the_lock_waits_for_its_release(
    tmp_path: Path,
) -> None:
    """A tensor's finalizer may run (a collection) while its thread is inside the kept
    descriptors' lock: forgetting then neither deadlocks nor changes the table under the
    holder, and is done when the holder leaves."""
    descriptors = Descriptors()
    path = tmp_path / "p.safetensors"
    kept, _ = descriptors.acquire(write(path, 1.0))
    descriptors.release(kept)
    assert open_descriptors(path) == [str(path)]

    def a_finalizer_inside_the_lock() -> None:
        descriptors.forget(path)
        assert open_descriptors(path) == [str(path)]

    descriptors._locked(a_finalizer_inside_the_lock)
    assert open_descriptors(path) == []


@needs_proc
def test_many_files_forgotten_while_this_thread_holds_the_lock_are_all_forgotten(
    tmp_path: Path,
) -> None:
    """A collection inside the lock may run thousands of tensors' finalizers: every path
    they queue is forgotten on leaving, without the stack growing with their number (it
    once recursed once per path, and a large collection ended in a RecursionError)."""
    descriptors = Descriptors()
    paths = [tmp_path / f"p{index}.safetensors" for index in range(3)]
    for path in paths:
        kept, _ = descriptors.acquire(write(path, 1.0))
        descriptors.release(kept)
    assert len(open_descriptors(tmp_path)) == 3

    def a_collection_inside_the_lock() -> None:
        for index in range(5000):
            descriptors.forget(tmp_path / f"gone{index}.safetensors")
        for path in paths:
            descriptors.forget(path)

    descriptors._locked(a_collection_inside_the_lock)
    assert open_descriptors(tmp_path) == []
    assert not descriptors._forgotten


@pytest.mark.timeout(120)
@pytest.mark.parametrize("operation", ["acquire-release", "forget"])
def test_a_ctrl_c_anywhere_in_the_kept_descriptors_leaves_their_lock_free(
    tmp_path: Path, operation: str
) -> None:
    """A Ctrl-C at each point of a descriptor's acquire and release, or of a forget, in
    turn, its KeyboardInterrupt kept (as a logger or a debugger keeps one): another thread
    then takes and leaves the lock at once. (A context manager written in Python around the
    lock once kept it held from a Ctrl-C in its ``__enter__``: every later load hung.)

    The points of a collection that comes amid one are not the operation's (its callback,
    the forget of a collected tensor's file, where Python loses an interrupt): not counted.
    """
    descriptors = Descriptors()
    layout = write(tmp_path / "p.safetensors", 1.0)

    def run() -> None:
        if operation == "forget":
            descriptors.forget(layout.path)
        else:
            descriptors.release(descriptors.acquire(layout)[0])

    def another_thread_loads() -> None:
        descriptors.release(descriptors.acquire(layout)[0])

    for n in itertools.count(1):
        signal_at, kept = signalled(n, _descriptors.__file__, run, finalizers=False)
        assert (kept is not None) == signal_at.fired
        thread = threading.Thread(target=another_thread_loads, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"a Ctrl-C at event {n} left the lock held"
        del kept
        if not signal_at.fired:
            break
    assert n > 5, "the operation made fewer events than expected: the test proves little"


@needs_proc
@pytest.mark.timeout(120)
def test_a_ctrl_c_anywhere_in_a_forget_leaves_the_descriptor_kept_or_closed(
    tmp_path: Path,
) -> None:
    """A Ctrl-C at each point of a forget in turn (a writer replacing a file): every
    descriptor of the directory still open is one the table keeps. (One landing between
    the descriptor's retirement and its close once left it open for the process's life.)
    A collection's points are not the forget's: not counted."""
    descriptors = Descriptors()
    layout = write(tmp_path / "a.safetensors", 1.0)

    def forget() -> None:
        descriptors.forget(layout.path)

    for n in itertools.count(1):
        descriptors.release(descriptors.acquire(layout)[0])  # kept for the next load
        signal_at = signalled(n, _descriptors.__file__, forget, finalizers=False)[0]
        descriptors.forget(tmp_path / "none")  # a forget the Ctrl-C left queued runs here
        assert len(open_descriptors(tmp_path)) == len(descriptors._kept), (
            f"a Ctrl-C at {signal_at.where} left a descriptor open that no one closes"
        )
        if not signal_at.fired:
            break
    assert n > 5, "the forget made fewer points than expected: the test proves little"
