"""The CUDA rules on a real GPU (skipped without one; ``benchmarks/gpu_check.py`` runs them).

Copies that never wait for compute, values safe on the stream they are handed to even when
their memory is freed and reused at once, write-backs that wait for the kernels that changed
a value, and the bounded pinned ring. ``test_device.py`` checks the same bookkeeping through a
fake of the CUDA calls on any machine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool, storage
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

DEVICE = torch.device("cuda", 0)
SLEEP_CYCLES = 10**8  # a kernel of some 50-100 ms


def filled(path: Path, value: float, numel: int) -> storage.PayloadLayout:
    return storage.write_payload(path, {"w": torch.full((numel,), value)}, fsync=False)


def test_a_copy_does_not_wait_for_queued_compute() -> None:  # pragma: no cover - GPU
    host = torch.randn(1 << 20)
    # The process's first side stream (the copy stream, made on the first copy) waits for the
    # queued kernels once, whoever makes it: make it before queuing any.
    storage.to_device(host, DEVICE)
    torch.cuda.synchronize()
    torch.cuda._sleep(20 * SLEEP_CYCLES)
    compute_done = torch.cuda.Event()
    compute_done.record()
    value = storage.to_device(host, DEVICE)
    assert not compute_done.query(), "to_device waited for the compute queued before it"
    with torch.cuda.stream(torch.cuda.Stream()):  # complete: readable from any stream at once
        assert torch.equal(value.cpu(), host)
    torch.cuda.synchronize()


def test_a_pending_load_is_ready_on_the_stream_it_is_handed_to(
    tmp_path: Path,
) -> None:  # pragma: no cover - GPU
    layouts = [filled(tmp_path / f"w{i}.safetensors", i + 1.0, 4 << 20) for i in range(8)]
    side = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(side):
        for layout in layouts:
            value = storage.read_to_device(layout, DEVICE, lambda tensors: tensors["w"])
            storage.handoff(value, DEVICE)
            torch.cuda._sleep(SLEEP_CYCLES)  # the value is still read long after it is dropped
            seen.append(torch.stack([value.min(), value.max()]))
            del value  # its memory is free for the next load, which must not overwrite it early
    torch.cuda.synchronize()
    assert [pair.tolist() for pair in seen] == [[i + 1.0, i + 1.0] for i in range(8)]


def test_a_quantized_value_is_decoded_on_the_device(tmp_path: Path) -> None:  # pragma: no cover
    quantized = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(256, 256))
    tensors, metadata = storage.encode_opaque(quantized)
    layout = storage.write_payload(tmp_path / "q.safetensors", tensors, metadata, fsync=False)
    value = storage.read_to_device(
        layout, DEVICE, lambda read: storage.decode_opaque(read, layout.metadata)
    )
    storage.handoff(value, DEVICE)
    assert value.u8_blob.device == value.qscheme.scale.device == DEVICE
    assert torch.equal(value.decompress().cpu(), quantized.decompress())


def test_a_write_back_waits_for_the_kernels_of_the_lease(  # pragma: no cover - GPU
    tmp_path: Path,
) -> None:
    value = torch.zeros(1 << 20, device=DEVICE)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(5 * SLEEP_CYCLES)
        value.add_(1)
        storage.record_writes(value, DEVICE)

    def write_back() -> float:
        storage.wait_for_writes(value)
        return float(value.cpu().min())

    with ThreadPoolExecutor(1) as executor:
        assert executor.submit(write_back).result(timeout=60) == 1.0


def test_pinned_staging_stays_within_its_ring(tmp_path: Path) -> None:  # pragma: no cover - GPU
    numel = 3 * storage.PINNED_CHUNK_BYTES // 4 + 5
    layout = filled(tmp_path / "big.safetensors", 7.0, numel)
    for _ in range(3):
        value = storage.read_to_device(layout, DEVICE, lambda tensors: tensors["w"])
        storage.handoff(value, DEVICE)
        assert bool((value == 7.0).all())
    assert (
        0 < storage.pinned_bytes() <= storage.PINNED_CHUNK_BYTES * storage.PINNED_CHUNKS_PER_DEVICE
    )


def test_reload_values_on_the_device(tmp_path: Path) -> None:  # pragma: no cover - GPU
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        original = (torch.randn(257, 129) * 50).to(dtype)
        offloaded = OffloadedTensor.from_original_tensor(original, f"t.{dtype}", tmp_path)
        value = offloaded.reload(DEVICE)
        assert value.device == DEVICE
        assert torch.equal(value.cpu(), original)
        with TensorResidencyPool() as pool:
            assert torch.equal(pool.resolve(offloaded, DEVICE).cpu(), original)


def test_pool_values_stay_valid_on_their_stream_after_eviction(
    tmp_path: Path,
) -> None:  # pragma: no cover - GPU
    numel = 16 << 20  # 64 MiB of float32: the budget holds one
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((numel,), i + 1.0), f"e{i}", tmp_path)
        for i in range(8)
    ]
    side = torch.cuda.Stream()
    pairs = []
    with TensorResidencyPool(max_cached_bytes=numel * 4) as pool:
        with torch.cuda.stream(side):
            for tensor in tensors:
                value = pool.resolve(tensor, DEVICE)
                torch.cuda._sleep(SLEEP_CYCLES)
                pairs.append(torch.stack([value.min(), value.max()]))
                del value
        torch.cuda.synchronize()
        assert pool.stats().evictions >= 6
    assert [pair.tolist() for pair in pairs] == [[i + 1.0, i + 1.0] for i in range(8)]


def test_pool_write_back_sees_the_kernels_of_a_side_stream(
    tmp_path: Path,
) -> None:  # pragma: no cover - GPU
    original = torch.arange(1 << 22, dtype=torch.float32)
    tensor = OffloadedTensor.from_original_tensor(original, "wb", tmp_path)
    side = torch.cuda.Stream()
    pool = TensorResidencyPool()
    try:
        with pool.scope(DEVICE), torch.cuda.stream(side):
            torch.cuda._sleep(5 * SLEEP_CYCLES)
            tensor.add_(1)
    finally:
        pool.close()
    assert torch.equal(tensor.reload("cpu"), original + 1)


def test_prefetch_does_not_wait_for_queued_compute(tmp_path: Path) -> None:  # pragma: no cover
    tensor = OffloadedTensor.from_original_tensor(torch.randn(1 << 24), "p", tmp_path)
    side = torch.cuda.Stream()
    with TensorResidencyPool() as pool:
        torch.cuda._sleep(20 * SLEEP_CYCLES)
        compute_done = torch.cuda.Event()
        compute_done.record()
        with torch.cuda.stream(side):
            value = pool.prefetch(tensor, DEVICE).wait()
            loaded = torch.cuda.Event()
            loaded.record(side)
        loaded.synchronize()
        assert not compute_done.query(), "the load waited for compute queued before it"
        assert value.device == DEVICE
    torch.cuda.synchronize()
