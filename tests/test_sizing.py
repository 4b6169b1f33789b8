"""Sizes for choosing a budget: a model's offloaded footprint, and byte counts written as text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import TensorResidencyPool, offload_module, storage
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration
from torch_to_nnef.tensor.sizing import ModuleFootprint, module_footprint, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5GB", 1_500_000_000),
        ("1.1GB", 1_100_000_000),  # exact: no float rounding
        ("512MiB", 512 << 20),
        ("512 mib", 512 << 20),
        ("2 GiB", 2 << 30),
        ("0.5KB", 500),
        (".5kib", 512),
        ("1TB", 10**12),
        ("100", 100),
        ("100 B", 100),
        ("0", 0),
        (4096, 4096),
    ],
)
def test_sizes_in_bytes_and_units(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("size", "words"),
    [
        ("1.5 gigabytes", "cannot read '1.5 gigabytes' as a size"),
        ("GB", "cannot read 'GB'"),
        ("-1GB", "cannot read '-1GB'"),
        ("1k", "KiB"),
        (-5, "cannot be negative, got -5"),
        (1.5, "must be an int (bytes) or a str such as '1.5GB' or '512MiB', got float"),
        (True, "got bool"),
    ],
)
def test_sizes_that_cannot_be_read_say_the_accepted_forms(size: object, words: str) -> None:
    with pytest.raises(T2NErrorMisuse) as raised:
        parse_bytes(size)  # type: ignore[arg-type]
    assert words in str(raised.value)


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 32)  # 12800 bytes
        self.block = torch.nn.Linear(32, 32)  # 4096 + 128 bytes
        self.norm = torch.nn.LayerNorm(32)  # 2 x 128 bytes, kept resident below
        self.head = torch.nn.Linear(32, 100, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once, under `embed`


def test_footprint_counts_each_offloaded_tensor_once_and_finds_the_largest_layer(
    tmp_path: Path,
) -> None:
    model = offload_module(TiedLM(), tmp_path, min_bytes=1024)
    footprint = module_footprint(model)
    assert footprint == ModuleFootprint(
        offloaded_bytes=12800 + 4096,
        resident_bytes=128 + 2 * 128,  # the block's bias and the norm's weight and bias
        largest_layer="embed",
        largest_layer_bytes=12800,
        layers=2,
    )


def test_footprint_counts_payload_bytes(tmp_path: Path) -> None:
    """Offloaded bytes are payload bytes: a Q4_0 weight counts its packed codes and scales;
    the pool counts what the loaded value holds (its codes one per byte)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    model[0].weight = torch.nn.Parameter(
        fp_to_tract_q4_0_with_min_max_calibration(model[0].weight.detach()),
        requires_grad=False,
    )
    offload_module(model, tmp_path)
    footprint = module_footprint(model)
    assert footprint.offloaded_bytes == 64 * 64 // 2 + 64 * 64 // 32 * 2  # 4 bits + f16 scales
    with TensorResidencyPool() as pool:
        value = pool.prefetch(model[0].weight).wait()
        assert pool.resident_bytes == storage.value_nbytes(value) == 64 * 64 + 64 * 64 // 32 * 2


def test_footprint_of_a_model_without_offloaded_tensors() -> None:
    assert module_footprint(torch.nn.Linear(4, 4)) == ModuleFootprint(0, 80, "", 0, 0)


def test_footprint_of_something_else_says_what_it_needs() -> None:
    with pytest.raises(T2NErrorMisuse, match=r"measures a torch\.nn\.Module, got list"):
        module_footprint([torch.nn.Linear(4, 4)])  # type: ignore[arg-type]
