"""The CUDA rules of the storage layer, checked through a fake of the CUDA calls.

Device resolution per thread, which stream waits for which copy event, which memory is
recorded on which stream, write events, and the bounded ring of pinned chunks. Real-GPU twins
of these checks are in ``test_cuda.py``.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda, FakeEvent

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration
from torch_to_nnef.tensor.storage import _device, _pinned
from torch_to_nnef.tensor.storage._pinned import PinnedRing

CUDA0 = torch.device("cuda", 0)


def in_thread(function: Any, *args: Any) -> Any:
    with ThreadPoolExecutor(1) as executor:
        return executor.submit(function, *args).result(timeout=30)


def copy_stream(fake: FakeCuda, index: int = 0) -> Any:
    streams = [stream for device, stream in fake.calls("new_stream") if device == index]
    assert len(streams) == 1, f"expected one copy stream for device {index}, got {streams}"
    return streams[0]


# ---------------------------------------------------------------------------------------------
# Devices are resolved in the calling thread
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_cuda_without_index_is_the_calling_threads_device(fake_cuda: FakeCuda) -> None:
    fake_cuda.set_device(1)
    assert storage.resolve_device("cuda") == torch.device("cuda", 1)
    assert in_thread(storage.resolve_device, "cuda") == torch.device("cuda", 0)
    assert storage.resolve_device("cuda:0") == CUDA0
    assert storage.resolve_device("cpu") == torch.device("cpu")


def test_cuda_resolves_to_itself_without_cuda() -> None:
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        pytest.skip("checks a machine without CUDA")
    assert storage.resolve_device("cuda") == torch.device("cuda")


@pytest.mark.timeout(30)
def test_to_device_copies_on_the_callers_device(fake_cuda: FakeCuda) -> None:
    fake_cuda.set_device(1)
    host = torch.arange(10.0)
    value = storage.to_device(host, "cuda")
    assert torch.equal(value, host)
    assert [index for index, _ in fake_cuda.calls("new_stream")] == [1]
    assert {index for index, _ in fake_cuda.calls("empty")} == {1}


# ---------------------------------------------------------------------------------------------
# Copies: on the copy stream, never waiting for compute; the caller waits for its own event
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_to_device_allocates_and_copies_on_the_copy_stream(fake_cuda: FakeCuda) -> None:
    host = torch.randn(700)  # 2800 bytes: three chunks of 1 KiB
    value = storage.to_device(host, CUDA0)
    assert torch.equal(value, host)
    stream = copy_stream(fake_cuda)
    assert fake_cuda.calls("empty") == [(0, stream)]
    recorded = [event for s, event in fake_cuda.calls("record_event")]
    assert all(s is stream for s, _ in fake_cuda.calls("record_event"))
    # One event per chunk, then the transfer's own: that one (only) is waited for.
    assert len(recorded) == 4
    assert recorded[-1].done
    assert ("synchronize", recorded[-1]) in fake_cuda.log
    # The caller's current stream (its default one) owns the value now.
    assert fake_cuda.calls("record_stream") == [(value, fake_cuda.defaults[0])]
    assert fake_cuda.calls("wait_event") == []  # complete: nothing to wait for


@pytest.mark.timeout(30)
def test_to_device_copies_a_pinned_source_directly(fake_cuda: FakeCuda) -> None:
    host = fake_cuda.pinned(64).view(torch.float32)
    host.copy_(torch.arange(16.0))
    value = storage.to_device(host, CUDA0)
    assert torch.equal(value, torch.arange(16.0))
    assert len(fake_cuda.calls("record_event")) == 1  # the transfer's event; no chunk used
    assert storage.pinned_bytes() == 0


def test_a_copy_to_cuda_without_cuda_says_so() -> None:
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        pytest.skip("checks a machine without CUDA")
    with pytest.raises(T2NErrorMisuse, match=r"cannot copy to cuda:0: CUDA is not available"):
        storage.to_device(torch.randn(3), "cuda:0")


def test_to_device_leaves_other_devices_and_cpu_alone(fake_cuda: FakeCuda) -> None:
    host = torch.randn(3)
    assert storage.to_device(host, "cpu") is host
    assert storage.to_device(host, "meta").device.type == "meta"
    assert fake_cuda.log == []


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> storage.PayloadLayout:
    return storage.write_payload(path, tensors, fsync=False)


@pytest.mark.timeout(30)
def test_read_to_device_returns_a_pending_value_that_handoff_makes_safe(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    original = torch.randn(600)
    layout = write_file(tmp_path / "w.safetensors", {"w": original})
    value = storage.read_to_device(layout, CUDA0, lambda tensors: tensors["w"])
    assert torch.equal(value, original)
    stream = copy_stream(fake_cuda)
    ready = fake_cuda.calls("record_event")[-1][1]
    assert not ready.done, "a load must not wait for its own copies: its consumer does"
    assert (ready,) not in fake_cuda.calls("synchronize")

    side = fake_cuda.new_stream(0)

    def consume() -> None:
        with fake_cuda.use_stream(side):
            assert storage.handoff(value, CUDA0) is value

    in_thread(consume)
    assert fake_cuda.calls("wait_event") == [(side, ready)]
    assert fake_cuda.calls("record_stream") == [(value, side)]
    assert stream is not side

    ready.done = True  # the copies ran: later hand-outs only record the memory
    storage.handoff(value, CUDA0)
    assert fake_cuda.calls("wait_event") == [(side, ready)]
    assert fake_cuda.calls("record_stream")[-1] == (value, fake_cuda.defaults[0])
    assert len(_device._READY) == 0


@pytest.mark.timeout(30)
def test_read_to_device_builds_on_the_copy_stream(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    quantized = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 64))
    tensors, metadata = storage.encode_opaque(quantized)
    layout = storage.write_payload(tmp_path / "q.safetensors", tensors, metadata, fsync=False)
    streams_seen = []

    def build(read: dict[str, torch.Tensor]) -> torch.Tensor:
        streams_seen.append(fake_cuda.current_stream(0))
        return storage.decode_opaque(read, layout.metadata)

    value = storage.read_to_device(layout, CUDA0, build)
    stream = copy_stream(fake_cuda)
    assert streams_seen == [stream]
    assert torch.equal(value.decompress(), quantized.decompress())

    storage.handoff(value)  # the device is the value's
    recorded = {id(tensor) for tensor, _ in fake_cuda.calls("record_stream")}
    assert recorded == {id(value.u8_blob), id(value.qscheme.scale)}
    assert len(fake_cuda.calls("wait_event")) == 1  # one ready event for the whole value


@pytest.mark.timeout(30)
def test_read_to_device_reports_a_truncated_file_and_frees_its_chunks(
    fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    path = tmp_path / "w.safetensors"
    layout = write_file(path, {"w": torch.randn(1000)})
    with open(path, "r+b") as file:
        file.truncate(layout.file_size - 100)
    with pytest.raises(T2NErrorStorage):
        storage.read_to_device(layout, CUDA0, lambda tensors: tensors["w"])
    ring = _pinned._RINGS[0]
    assert ring.chunks_out == 0


def test_handoff_on_the_cpu_does_nothing(fake_cuda: FakeCuda) -> None:
    value = torch.randn(3)
    assert storage.handoff(value, torch.device("cpu")) is value
    assert storage.handoff(value) is value
    storage.record_writes(value)
    storage.wait_for_writes(value)
    assert fake_cuda.log == []


@pytest.mark.timeout(30)
def test_a_dropped_value_forgets_its_events(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    layout = write_file(tmp_path / "w.safetensors", {"w": torch.randn(10)})
    value = storage.read_to_device(layout, CUDA0, lambda tensors: tensors["w"])
    storage.record_writes(value, CUDA0)
    assert len(_device._READY) == len(_device._WRITES) == 1
    del value
    gc.collect()
    assert len(_device._READY) == len(_device._WRITES) == 0


# ---------------------------------------------------------------------------------------------
# Write-backs wait for the kernels that changed the value
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_write_back_waits_for_the_events_of_every_writer(fake_cuda: FakeCuda) -> None:
    value = torch.randn(4)
    side = fake_cuda.new_stream(0)

    def writer() -> None:
        with fake_cuda.use_stream(side):
            storage.record_writes(value, CUDA0)

    in_thread(writer)
    storage.record_writes(value, CUDA0)  # on this thread's default stream
    events = [event for _, event in fake_cuda.calls("record_event")]
    assert [event.stream for event in events] == [side, fake_cuda.defaults[0]]
    assert not any(event.done for event in events)

    in_thread(storage.wait_for_writes, value)
    assert all(event.done for event in events)
    assert fake_cuda.calls("synchronize") == [(events[0],), (events[1],)]
    storage.wait_for_writes(value)  # nothing left to wait for
    assert len(fake_cuda.calls("synchronize")) == 2


# ---------------------------------------------------------------------------------------------
# Inner tensors
# ---------------------------------------------------------------------------------------------
def test_inner_tensors_of_plain_and_quantized_values() -> None:
    plain = torch.randn(3)
    assert _device.inner_tensors(plain) == [plain]
    quantized = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 64))
    found = {id(tensor) for tensor in _device.inner_tensors(quantized)}
    assert found == {id(quantized.u8_blob), id(quantized.qscheme.scale)}


# ---------------------------------------------------------------------------------------------
# The pinned ring
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_chunk_is_reused_only_after_its_copy_event(fake_cuda: FakeCuda) -> None:
    host = torch.arange(1024, dtype=torch.float32)  # 4 KiB: four chunks through a ring of two
    value = storage.to_device(host, CUDA0)
    assert torch.equal(value, host)
    ring = _pinned._RINGS[0]
    assert ring.pinned_bytes == storage.pinned_bytes() == 2 * 1024
    assert len(fake_cuda.pinned_chunks) == 2
    chunk_events = [event for _, event in fake_cuda.calls("record_event")][:4]
    # The third and fourth chunks reuse the first two, after waiting for their copies.
    syncs = [entry[1] for entry in fake_cuda.log if entry[0] == "synchronize"]
    assert syncs[:2] == chunk_events[:2]
    order = [entry for entry in fake_cuda.log if entry[0] in ("synchronize", "record_event")]
    assert order.index(("synchronize", chunk_events[0])) < order.index(
        ("record_event", chunk_events[2].stream, chunk_events[2])
    )
    assert ring.waits == 2
    assert ring.chunks_out == 0


@pytest.mark.timeout(30)
def test_the_ring_does_not_grow_while_a_free_chunk_is_done(fake_cuda: FakeCuda) -> None:
    fake_cuda.complete_events = True
    for _ in range(3):
        storage.to_device(torch.randn(1000), CUDA0)
    assert storage.pinned_bytes() == 1024
    assert _pinned._RINGS[0].waits == 0


class Event:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


@pytest.mark.timeout(30)
def test_ring_bound_and_accounting_under_threads() -> None:
    allocated: list[int] = []
    ring = PinnedRing(16, 3, lambda nbytes: allocated.append(nbytes) or torch.empty(nbytes))
    most_out = 0
    lock = threading.Lock()

    def use(round_: int) -> None:
        nonlocal most_out
        for _ in range(50):
            chunk = ring.acquire()
            with lock:
                most_out = max(most_out, ring.chunks_out)
                assert ring.pinned_bytes <= 3 * 16
            chunk.fill_(round_)
            ring.release(chunk, Event())

    with ThreadPoolExecutor(8) as executor:
        for future in [executor.submit(use, i) for i in range(8)]:
            future.result(timeout=20)
    assert allocated == [16, 16, 16]
    assert ring.pinned_bytes == 48
    assert most_out <= 3
    assert ring.chunks_out == 0
    assert ring.waits > 0


def test_ring_gives_back_its_place_when_allocation_fails() -> None:
    def fail(nbytes: int) -> torch.Tensor:
        raise RuntimeError("out of pinned memory")

    ring = PinnedRing(16, 1, fail)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        ring.acquire()
    assert ring.pinned_bytes == 0 and ring.chunks_out == 0


def test_ring_refuses_an_empty_bound() -> None:
    with pytest.raises(T2NErrorMisuse, match="max_chunks > 0"):
        PinnedRing(16, 0, torch.empty)


def test_fake_events_complete_when_synchronized(fake_cuda: FakeCuda) -> None:
    event = fake_cuda.record_event(fake_cuda.defaults[0])
    assert isinstance(event, FakeEvent) and not event.query()
    event.synchronize()
    assert event.query()
