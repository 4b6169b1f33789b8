"""Mapped reads of payload files: values, copy on write, lifetime of the mapping, errors."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage


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
    maps = storage.mapped_reads() if mapped is None else mapped
    assert (loaded["a"] is out["a"]) is not maps
    assert (mapped_regions(layout.path) == 1) is maps


def test_the_switch_of_mapped_loads(
    payload: tuple[storage.PayloadLayout, dict[str, torch.Tensor]],
) -> None:
    layout, _ = payload
    previous = storage.set_mapped_reads(False)
    try:
        assert storage.mapped_reads() is False
        out = {"a": torch.empty(30, 100)}
        assert storage.load_payload(layout, names=["a"], out=out)["a"] is out["a"]
        assert storage.set_mapped_reads(True) is False
        assert storage.load_payload(layout, names=["a"], out=out)["a"] is not out["a"]
        with pytest.raises(T2NErrorMisuse, match="takes a bool"):
            storage.set_mapped_reads("yes")  # type: ignore[arg-type]
    finally:
        storage.set_mapped_reads(previous)
