"""Hostile names and paths: nothing is ever written (or removed) outside the offload directory.

Tensor names that try to escape, symbolic links planted where the writer will write, and
offload directories that cannot be written or vanish mid-run: each either works inside the
offload directory or raises a clear ``T2NError``, and a snapshot of the surrounding tree taken
before and after shows that nothing outside changed.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from residency_checks import check_invariants
from stress.figures import record

from torch_to_nnef.exceptions import T2NError, T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

VICTIM_BYTES = b"precious data that must survive\n"

HOSTILE_NAMES = {
    "parent": "../x",
    "deep-parent": "../../../../../../tmp/escaped",
    "absolute": "/etc/passwd",
    "dot-dot-inside": "a/../../b",
    "dot-dot": "..",
    "dot": ".",
    "empty": "",
    "nul": "x\x00y",
    "backslashes": "..\\..\\windows\\system32",
    "home": "~/.bashrc",
    "hidden": ".hidden",
    "newline": "line\nbreak",
    "shell": "$(touch pwned)",
    "long-ascii": "a" * 10_000,
    "long-unicode": "é" * 3_000,
    "lone-surrogate": "w\udcff",
    "emoji-and-rtl": "weight\u202e\U0001f600",
    "slashes-only": "////",
}


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[str, str]]:
    """Every path under ``root`` (except under ``skip``) with its kind and content digest."""
    state: dict[str, tuple[str, str]] = {}
    for directory, subdirs, files in os.walk(root, followlinks=False):
        here = Path(directory)
        if skip is not None and (here == skip or skip in here.parents):
            subdirs[:] = []
            continue
        for name in subdirs + files:
            path = here / name
            if skip is not None and path == skip:
                continue
            relative = str(path.relative_to(root))
            if path.is_symlink():
                state[relative] = ("link", os.readlink(path))
            elif path.is_dir():
                state[relative] = ("dir", "")
            else:
                state[relative] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return state


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An offload directory next to a victim file; asserts at the end that only the offload
    directory changed."""
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(VICTIM_BYTES)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_bytes(VICTIM_BYTES)
    before = snapshot(tmp_path, skip=offload_dir)
    yield offload_dir, victim
    gc.collect()
    assert snapshot(tmp_path, skip=offload_dir) == before, "something changed outside"
    assert victim.read_bytes() == VICTIM_BYTES


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ---------------------------------------------------------------------------------------------
# Names are not paths
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(HOSTILE_NAMES.values()), ids=list(HOSTILE_NAMES))
def test_hostile_names_are_written_inside_the_offload_directory(
    arena: tuple[Path, Path], name: str
) -> None:
    offload_dir, _ = arena
    value = torch.arange(6, dtype=torch.float32)
    tensor = OffloadedTensor.from_original_tensor(value, name, offload_dir=offload_dir)
    path = tensor.offload_path
    assert path.parent == offload_dir.resolve()
    assert not path.name.startswith(".") and ".." not in path.name
    assert len(path.name.encode()) <= 255
    assert entries(offload_dir) == [path.name]
    assert tensor.name == name
    assert torch.equal(tensor.reload(), value)
    tensor.update_values(value * 2)
    assert entries(offload_dir) == [path.name]
    assert torch.equal(tensor.reload(), value * 2)
    del tensor
    gc.collect()
    assert entries(offload_dir) == []


def test_hostile_names_through_a_pool_write_back(arena: tuple[Path, Path]) -> None:
    offload_dir, _ = arena
    tensors = [
        OffloadedTensor.from_original_tensor(torch.zeros(4), name, offload_dir=offload_dir)
        for name in HOSTILE_NAMES.values()
    ]
    with TensorResidencyPool(max_cached_bytes=64) as pool:
        for tensor in tensors:
            with pool.acquire(tensor, mode="read_write") as value:
                value.add_(3)
        check_invariants(pool)
    assert all(torch.equal(t._reload_unmanaged(), torch.full((4,), 3.0)) for t in tensors)
    assert len(entries(offload_dir)) == len(tensors)
    record("hostile_names", names=len(HOSTILE_NAMES), faults=len(HOSTILE_NAMES))


def test_long_names_sharing_a_prefix_get_distinct_files(arena: tuple[Path, Path]) -> None:
    offload_dir, _ = arena
    prefix = "model." * 100
    first = OffloadedTensor.from_original_tensor(torch.zeros(2), prefix + "a", offload_dir)
    second = OffloadedTensor.from_original_tensor(torch.ones(2), prefix + "b", offload_dir)
    stem = storage.payload_path(offload_dir, prefix + "a", "id")
    other = storage.payload_path(offload_dir, prefix + "b", "id")
    assert stem != other
    assert first.offload_path != second.offload_path
    assert torch.equal(first.reload(), torch.zeros(2))
    assert torch.equal(second.reload(), torch.ones(2))


@pytest.mark.parametrize(
    "storage_id", ["../../victim", "a/b", "", "x" * 65, "nul\x00", ".", "..", "id.safetensors"]
)
def test_hostile_storage_ids_are_refused(arena: tuple[Path, Path], storage_id: str) -> None:
    offload_dir, _ = arena
    with pytest.raises(T2NErrorMisuse, match="storage_id"):
        storage.payload_path(offload_dir, "w", storage_id)
    with pytest.raises(T2NErrorMisuse, match="storage_id"):
        OffloadedTensor(torch.zeros(2), "cpu", offload_dir, "w", storage_id=storage_id)
    with pytest.raises(T2NErrorMisuse, match="storage_id"):
        OffloadedTensor(None, "cpu", offload_dir, "w", storage_id=storage_id)
    assert entries(offload_dir) == []


def test_adopting_a_hostile_name_never_reaches_outside(arena: tuple[Path, Path]) -> None:
    offload_dir, victim = arena
    # The raw name designates the victim; the sanitized one designates nothing.
    hostile = os.path.relpath(victim.with_suffix(""), offload_dir)
    with pytest.raises(T2NErrorStorage, match="cannot open payload file"):
        OffloadedTensor(None, "cpu", offload_dir, hostile, storage_id="sid")
    # Adopting takes ownership: the adopted file is removed with the tensor, and only it.
    storage.write_payload(storage.payload_path(offload_dir, hostile, "sid"), {"t": torch.ones(1)})
    adopted = OffloadedTensor(None, "cpu", offload_dir, hostile, storage_id="sid")
    assert adopted.offload_path.parent == offload_dir.resolve()
    del adopted
    gc.collect()
    assert entries(offload_dir) == []


# ---------------------------------------------------------------------------------------------
# Symbolic links planted in the offload directory
# ---------------------------------------------------------------------------------------------
def test_link_planted_at_the_destination_is_never_followed(arena: tuple[Path, Path]) -> None:
    offload_dir, victim = arena
    destination = storage.payload_path(offload_dir, "w", "planted")
    destination.symlink_to(victim)
    with pytest.raises(T2NErrorMisuse, match="already exists"):
        OffloadedTensor(torch.zeros(4), "cpu", offload_dir, "w", storage_id="planted")
    # A dangling link to a file outside: the writer replaces the link, never creates the target.
    elsewhere = victim.parent / "created-outside.safetensors"
    destination.unlink()
    destination.symlink_to(elsewhere)
    layout = storage.write_payload(destination, {"t": torch.zeros(4)})
    assert not destination.is_symlink() and destination.is_file()
    assert not elsewhere.exists()
    assert layout.path == destination


def test_payload_swapped_for_a_link_is_replaced_not_followed(arena: tuple[Path, Path]) -> None:
    offload_dir, victim = arena
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(4), "w", offload_dir=offload_dir)
    path = tensor.offload_path
    path.unlink()
    path.symlink_to(victim)
    tensor.update_values(torch.ones(4))  # rename over the link
    assert not path.is_symlink()
    assert torch.equal(tensor.reload(), torch.ones(4))
    # A file swapped for a link is refused for reading (it is not the file of the layout).
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(T2NErrorStorage, match="another process replaced its payload file"):
        tensor._reload_unmanaged()
    tensor.update_values(torch.ones(4))
    # The same through a pool write-back (the link is planted while the value is leased),
    # then removal with the tensor.
    with TensorResidencyPool() as pool:
        with pool.acquire(tensor, mode="read_write") as value:
            path.unlink()
            path.symlink_to(victim)
            value.add_(1)
        pool.flush()
    assert not path.is_symlink()
    assert torch.equal(tensor._reload_unmanaged(), torch.full((4,), 2.0))
    path.unlink()
    path.symlink_to(victim)
    del tensor
    gc.collect()  # the finalizer removes the link, not what it points to
    assert not path.is_symlink() and not path.exists()


def test_link_planted_at_the_temporary_name_is_never_followed(
    arena: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    offload_dir, victim = arena
    destination = offload_dir / "w.safetensors"
    # Temporary names are random; make the first one predictable to plant a link there.
    planted_token = "0123456789abcdef"
    planted = offload_dir / f".{destination.name}.{planted_token}.tmp"
    planted.symlink_to(victim)
    tokens = iter([planted_token])
    real_token_hex = secrets.token_hex
    monkeypatch.setattr(
        secrets, "token_hex", lambda n=None: next(tokens, None) or real_token_hex(n)
    )
    layout = storage.write_payload(destination, {"t": torch.arange(3)})
    assert torch.equal(storage.read_payload(layout)["t"], torch.arange(3))
    assert planted.is_symlink() and os.readlink(planted) == str(victim)  # not ours: left alone
    assert entries(offload_dir) == sorted([destination.name, planted.name])
    planted.unlink()


def test_every_temporary_name_taken_is_a_clean_storage_error(
    arena: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    offload_dir, victim = arena
    destination = offload_dir / "w.safetensors"
    planted = offload_dir / f".{destination.name}.t2n-{os.getpid()}-{'f' * 16}.tmp"
    planted.symlink_to(victim)
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "f" * 16)
    with pytest.raises(T2NErrorStorage, match="cannot write payload file"):
        storage.write_payload(destination, {"t": torch.arange(3)})
    assert entries(offload_dir) == [planted.name]
    planted.unlink()


def test_directory_swapped_for_a_link_is_not_written_through(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(4), "w", offload_dir=offload_dir)
    shutil.rmtree(offload_dir)
    offload_dir.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(T2NErrorStorage, match="cannot write payload file") as info:
        tensor.update_values(torch.ones(4))
    assert isinstance(info.value.__cause__, OSError)
    with TensorResidencyPool() as pool:  # the same through a pool write-back
        offload_dir.unlink()
        offload_dir.mkdir()
        tensor.update_values(torch.zeros(4))
        with pool.acquire(tensor, mode="read_write") as value:
            value.add_(2)
        shutil.rmtree(offload_dir)
        offload_dir.symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(T2NErrorStorage, match="write-back"):
            pool.flush()
        assert pool.is_resident(tensor)
        offload_dir.unlink()
        offload_dir.mkdir()
    assert entries(elsewhere) == [], "a write went through the swapped-in directory link"
    assert torch.equal(tensor._reload_unmanaged(), torch.full((4,), 2.0))


# ---------------------------------------------------------------------------------------------
# Offload directories that cannot be written, or vanish mid-run
# ---------------------------------------------------------------------------------------------
def test_offload_directory_under_a_regular_file(arena: tuple[Path, Path]) -> None:
    _, victim = arena
    with pytest.raises(T2NErrorStorage, match="cannot create the offload directory") as info:
        OffloadedTensor.from_original_tensor(torch.zeros(2), "w", offload_dir=victim / "sub")
    assert isinstance(info.value.__cause__, NotADirectoryError)
    with pytest.raises(
        T2NErrorStorage, match=re.escape(f"offload_dir '{victim}' exists and is not a directory")
    ):
        OffloadedTensor.from_original_tensor(torch.zeros(2), "w", offload_dir=victim)


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs sysfs")
def test_offload_directory_refusing_writes_even_to_root() -> None:
    # sysfs refuses new files to everyone, root included: a directory that cannot be written.
    before = set(os.listdir("/sys/kernel"))
    refused = r"cannot write payload file '/sys/kernel/w\."
    with pytest.raises(T2NErrorStorage, match=refused) as info:
        OffloadedTensor.from_original_tensor(torch.zeros(2), "w", offload_dir="/sys/kernel")
    assert "previous content of the file, if any, is unchanged" in str(info.value)
    assert set(os.listdir("/sys/kernel")) == before


@pytest.mark.parametrize("replacement", ["removed", "file"])
def test_offload_directory_vanishing_mid_run(arena: tuple[Path, Path], replacement: str) -> None:
    offload_dir, _ = arena
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((8,), float(i)), f"w{i}", offload_dir)
        for i in range(3)
    ]
    names = [t.offload_path.name for t in tensors]
    with TensorResidencyPool(max_cached_bytes=1 << 20) as pool:
        for tensor in tensors[:2]:
            with pool.acquire(tensor, mode="read_write") as value:
                value.add_(10)
        shutil.rmtree(offload_dir)
        if replacement == "file":
            offload_dir.write_bytes(b"not a directory")
        faults = 0
        attempts: list[Callable[[], None]] = [
            pool.flush,
            lambda: pool.evict(tensors[0]),
            pool.close,
        ]
        for attempt in attempts:
            with pytest.raises(T2NErrorStorage, match=r"write-back|writing") as info:
                attempt()
            faults += 1
            assert isinstance(info.value.__cause__, T2NError)
            assert not pool.closed
            assert pool.is_resident(tensors[0]) and pool.is_resident(tensors[1])
            check_invariants(pool)
        # The dirty values are kept: reads still see them.
        assert torch.equal(pool.resolve(tensors[0]), torch.full((8,), 10.0))
        with pytest.raises(T2NErrorStorage, match="its payload file was deleted"):
            pool.resolve(tensors[2])  # its file is gone: a load error, no entry left
        faults += 1
        check_invariants(pool)
        with pytest.raises(T2NErrorStorage):
            tensors[2].update_values(torch.zeros(8))
        # Once the directory is back, the write-backs succeed.
        if replacement == "file":
            offload_dir.unlink()
        offload_dir.mkdir()
        pool.flush()
        check_invariants(pool)
    assert sorted(os.listdir(offload_dir)) == sorted(names[:2])
    for i, tensor in enumerate(tensors[:2]):
        assert torch.equal(tensor._reload_unmanaged(), torch.full((8,), float(i + 10)))
    record("vanishing_directory", faults=faults, operations=faults + 4)
