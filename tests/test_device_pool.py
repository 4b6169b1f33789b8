"""The pool's CUDA hand-outs, through a fake of the CUDA calls (any machine).

Values the pool hands out for a CUDA device are made safe on the consumer's current stream
(the copy's ready event waited for, the memory recorded), a ``read_write`` lease's kernels are
waited for by the write-back, ``"cuda"`` is resolved in the thread that called, and the pinned
staging memory shows in ``stats()``. The fake "device" memory is CPU memory, so values and
outputs are checked too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda
from torch import nn

from torch_to_nnef.tensor import (
    OffloadedTensor,
    TensorResidencyPool,
    offload_module,
    storage,
    stream_modules,
)
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

CUDA0 = torch.device("cuda", 0)

pytestmark = pytest.mark.timeout(60)


def in_thread(function: Any, *args: Any) -> Any:
    with ThreadPoolExecutor(1) as executor:
        return executor.submit(function, *args).result(timeout=30)


def recorded_on(fake: FakeCuda, value: torch.Tensor) -> list[Any]:
    return [stream for tensor, stream in fake.calls("record_stream") if tensor is value]


def test_every_hand_out_is_safe_on_the_consumers_stream(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    original = torch.randn(300)
    tensor = OffloadedTensor.from_original_tensor(original, "w", tmp_path)
    sides = [fake_cuda.new_stream(0) for _ in range(4)]
    with TensorResidencyPool() as pool:

        def consume(side: Any) -> torch.Tensor:
            with fake_cuda.use_stream(side):
                if side is sides[0]:
                    return pool.prefetch(tensor, CUDA0).wait()
                if side is sides[1]:
                    return pool.resolve(tensor, CUDA0)
                if side is sides[2]:
                    with pool.acquire(tensor, CUDA0) as value:
                        return value
                with pool.scope(CUDA0):
                    return tensor.reload()

        values = [in_thread(consume, side) for side in sides]
    value = values[0]
    assert all(other is value for other in values)
    assert torch.equal(value, original)
    assert recorded_on(fake_cuda, value) == sides
    ready = fake_cuda.calls("record_event")[-1][1]
    waits = fake_cuda.calls("wait_event")
    assert waits and all(event is ready for _, event in waits)
    assert [stream for stream, _ in waits] == sides[: len(waits)]


@pytest.mark.parametrize("reader", ["write-back", "read outside the pool"])
def test_what_reads_a_changed_value_waits_for_the_kernels_of_its_lease(
    fake_cuda: FakeCuda, tmp_path: Path, reader: str
) -> None:
    original = torch.randn(300)
    tensor = OffloadedTensor.from_original_tensor(original, "w", tmp_path)
    side = fake_cuda.new_stream(0)
    with TensorResidencyPool() as pool:

        def write() -> None:
            with fake_cuda.use_stream(side), pool.acquire(tensor, CUDA0, mode="read_write") as v:
                v.add_(1)

        in_thread(write)
        exit_event = fake_cuda.calls("record_event")[-1][1]
        assert exit_event.stream is side and not exit_event.done
        if reader == "write-back":
            pool.flush()
        else:  # a copy of the pool's unsaved change
            assert torch.equal(tensor.reload("cpu"), original + 1)
        assert exit_event.done, f"the {reader} did not wait for the lease's kernels"
    assert torch.equal(tensor.reload("cpu"), original + 1)


def test_cuda_is_resolved_in_the_thread_that_called(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    torch.manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = dense(x)
    model = offload_module(dense, tmp_path / "model")
    fake_cuda.set_device(1)  # the caller's device; worker threads' current device is 0
    with (
        TensorResidencyPool() as pool,
        stream_modules(pool, list(model), depth=1, device="cuda"),
        pool.scope(device="cuda"),
    ):

        def forward() -> torch.Tensor:
            with torch.no_grad():
                output: torch.Tensor = model(x)
            return output

        got = in_thread(forward)
    assert torch.allclose(got, expected)
    assert {index for index, _ in fake_cuda.calls("empty")} == {1}


def test_a_quantized_value_is_decoded_on_the_device_and_recorded_whole(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    quantized = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 64))
    tensor = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    with TensorResidencyPool() as pool:
        value = pool.resolve(tensor, CUDA0)
        assert torch.equal(value.decompress(), quantized.decompress())
        recorded = {id(t) for t, _ in fake_cuda.calls("record_stream")}
        assert recorded == {id(value.u8_blob), id(value.qscheme.scale)}
        assert pool.stats().pinned_bytes == storage.pinned_bytes() > 0


@pytest.mark.asyncio
async def test_async_hand_outs_are_safe_on_the_awaiting_threads_stream(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    original = torch.randn(300)
    tensor = OffloadedTensor.from_original_tensor(original, "w", tmp_path)
    side = fake_cuda.new_stream(0)
    async with TensorResidencyPool() as pool:
        with fake_cuda.use_stream(side):
            async with pool.acquire(tensor, CUDA0, mode="read_write") as value:
                value.mul_(2)
            assert await pool.aresolve(tensor, CUDA0) is value
            assert await pool.prefetch(tensor, CUDA0) is value
        exit_event = next(e for s, e in fake_cuda.calls("record_event") if s is side)
        await pool.aflush()
        assert exit_event.done
    assert recorded_on(fake_cuda, value) == [side, side, side]
    assert torch.equal(tensor.reload("cpu"), original * 2)


def test_an_in_place_op_outside_a_scope_waits_for_the_load(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(4), "w", tmp_path).to("cuda:0")
    tensor.add_(1)
    ready = fake_cuda.calls("record_event")[-1][1]
    ((_, stream),) = fake_cuda.calls("record_stream")
    assert fake_cuda.calls("wait_event") == [(stream, ready)]
    assert stream is fake_cuda.defaults[0]
    assert torch.equal(tensor.reload("cpu"), torch.ones(4))
