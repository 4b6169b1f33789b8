"""Errors at the public boundary: each says what was wrong and what to do."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import TensorResidencyPool, offload_module, stream_modules


def test_stream_modules_given_one_module_asks_for_its_layers(tmp_path: Path) -> None:
    model = offload_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tmp_path)
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorMisuse) as raised:
            stream_modules(pool, model[0])  # type: ignore[arg-type]
        message = str(raised.value)
        for words in ("got a single Linear", "list(model)", "[module]"):
            assert words in message, message
        with pytest.raises(T2NErrorMisuse, match=r"got a list holding \['OffloadedTensor'\]"):
            stream_modules(pool, [model[0].weight])  # type: ignore[list-item]
        with stream_modules(pool, model), stream_modules(pool, [model[0]]):
            pass  # a Sequential and a list of one module are layers


def test_prefetch_of_a_module_names_its_tensors(tmp_path: Path) -> None:
    layer = nn.Linear(4, 4)
    with TensorResidencyPool() as pool, pytest.raises(T2NErrorMisuse) as raised:
        pool.prefetch(layer)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "already resident" not in message
    for words in ("a module (Linear)", "parameters()", "stream_modules"):
        assert words in message, message


def test_budgets_are_read_from_sizes_in_words() -> None:
    assert TensorResidencyPool(max_cached_bytes="1.5GB").max_cached_bytes == 1_500_000_000
    assert TensorResidencyPool(max_cached_bytes="512MiB").max_cached_bytes == 512 << 20
    with pytest.raises(T2NErrorMisuse) as raised:
        TensorResidencyPool(max_cached_bytes="1.5 gigs")
    for words in ("cannot read '1.5 gigs' as a size", "'1.5GB'", "'512MiB'"):
        assert words in str(raised.value)


@pytest.mark.timeout(30)
def test_async_acquire_on_a_closed_pool_says_closed(tmp_path: Path) -> None:
    model = offload_module(nn.Linear(4, 4), tmp_path)

    async def main() -> None:
        async with TensorResidencyPool() as pool:
            pass
        with pytest.raises(T2NErrorMisuse) as raised:
            async with pool.acquire(model.weight):
                pass
        assert str(raised.value) == "the TensorResidencyPool is closed; create a new pool"

    anyio.run(main)
