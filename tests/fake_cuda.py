"""A stand-in for the CUDA runtime, for machines without a GPU.

It replaces the boundary of ``storage._device`` (``RUNTIME``: the CUDA calls of the package)
and nothing else: "device" memory is CPU memory, copies run at once, and every stream, event
and ``record_stream`` call is logged, so that tests can check which stream waited for which
event, which memory was recorded on which stream, and when staging chunks were reused. Events
complete only when synchronized (or when ``complete_events`` is set), like copies still
queued on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torch_to_nnef.tensor.storage import _device, _pinned


class FakeStream:
    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name

    def __repr__(self) -> str:
        return f"<stream {self.name} of device {self.index}>"


class FakeEvent:
    _numbers = itertools.count(1)

    def __init__(self, runtime: FakeCuda, stream: FakeStream) -> None:
        self.runtime = runtime
        self.stream = stream
        self.number = next(self._numbers)
        self.done = runtime.complete_events

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.runtime.log.append(("synchronize", self))
        self.done = True

    def __repr__(self) -> str:
        return f"<event {self.number} on {self.stream.name}>"


class FakeCuda(_device.CudaRuntime):
    """``devices`` fake GPUs; a current device and current streams per thread."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.local = threading.local()
        self.lock = threading.Lock()
        self.log: list[tuple[Any, ...]] = []
        self.defaults = {i: FakeStream(i, f"default{i}") for i in range(devices)}
        self.complete_events = False
        self.pinned_chunks: list[torch.Tensor] = []
        self.allocated: dict[int, int] = {}  # device index of the "device" memory, by address
        self._names = itertools.count(1)

    # -- per-thread state ----------------------------------------------------------------------
    def _streams(self) -> dict[int, FakeStream]:
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        streams: dict[int, FakeStream] = self.local.streams
        return streams

    def set_device(self, index: int) -> None:
        self.local.device = index

    def _record(self, *entry: Any) -> None:
        with self.lock:
            self.log.append(entry)

    # -- the boundary --------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return int(getattr(self.local, "device", 0))

    def current_stream(self, index: int) -> FakeStream:
        return self._streams().get(index, self.defaults[index])

    def new_stream(self, index: int) -> FakeStream:
        stream = FakeStream(index, f"s{next(self._names)}")
        self._record("new_stream", index, stream)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        streams = self._streams()
        previous = streams.get(stream.index)
        streams[stream.index] = stream
        try:
            yield stream
        finally:
            if previous is None:
                del streams[stream.index]
            else:
                streams[stream.index] = previous

    def record_event(self, stream: Any) -> FakeEvent:
        event = FakeEvent(self, stream)
        self._record("record_event", stream, event)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self._record("wait_event", stream, event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self._record("record_stream", tensor, stream)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, index: int) -> torch.Tensor:
        self._record("empty", index, self.current_stream(index))
        tensor = torch.empty(shape, dtype=dtype)
        with self.lock:
            self.allocated[tensor.untyped_storage().data_ptr()] = index
        return tensor

    def pinned(self, nbytes: int) -> torch.Tensor:
        chunk = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.pinned_chunks.append(chunk)
        return chunk

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(tensor.data_ptr() == chunk.data_ptr() for chunk in self.pinned_chunks)

    def device_of(self, value: torch.Tensor) -> torch.device:
        """``cuda:N`` for a value held (even partly) in memory of the fake device ``N``."""
        for tensor in _device.inner_tensors(value):
            index = self.allocated.get(tensor.untyped_storage().data_ptr())
            if index is not None:
                return torch.device("cuda", index)
        return value.device

    # -- reading the log -----------------------------------------------------------------------
    def calls(self, name: str) -> list[tuple[Any, ...]]:
        with self.lock:
            return [entry[1:] for entry in self.log if entry[0] == name]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A fresh fake runtime, copy streams, pinned rings (2 chunks of 1 KiB) and event tables."""
    runtime = FakeCuda()
    monkeypatch.setattr(_device, "RUNTIME", runtime)
    monkeypatch.setattr(_device, "_STREAMS", {})
    monkeypatch.setattr(_device, "_READY", _device._EventTable())
    monkeypatch.setattr(_device, "_WRITES", _device._EventTable())
    monkeypatch.setattr(_pinned, "_RINGS", {})
    monkeypatch.setattr(_pinned, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(_pinned, "CHUNKS_PER_DEVICE", 2)
    return runtime
