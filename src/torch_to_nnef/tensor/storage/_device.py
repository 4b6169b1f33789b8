"""Host-to-device copies, and the rules that make a CUDA value safe for whoever uses it.

- **Copies overlap compute.** A copy to a CUDA device runs on the device's dedicated copy
  stream, into memory allocated on that stream; it never waits for work queued on other
  streams. After the copies of a value the copy stream records the value's *ready event*. A
  thread that must know a copy is done waits for that copy's own event, never for the stream.
- **Pageable memory is staged through a bounded ring** of pinned chunks (see
  :mod:`._pinned`): a chunk is filled, its copy is queued, the next chunk is filled while the
  copy runs; a chunk is refilled only after its copy event.
- **Hand-out.** :func:`handoff`, called in the consumer's thread where a value is handed out,
  makes the consumer's current stream wait for the value's ready event (on the GPU: the
  thread does not block) and records each tensor of the value (each inner tensor of a
  quantized value) on that stream, so that the caching allocator never gives the memory to a
  later allocation while kernels queued there may still read it.
- **Writes.** :func:`record_writes`, at the exit of a ``read_write`` lease in the caller's
  thread, records an event on the caller's current stream; :func:`wait_for_writes`, before a
  write-back reads the value, waits for those events, so the write-back sees every kernel
  that changed the value.
- **Devices.** :func:`resolve_device` turns ``"cuda"`` into ``cuda:<current device>`` of the
  calling thread: call it where the user called, never in a worker thread (whose current
  device is not the user's).

Every CUDA call of the package goes through :data:`RUNTIME` (a :class:`CudaRuntime`), the
boundary that tests replace on machines without a GPU.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.opaque import OpaqueTensor
from torch_to_nnef.tensor.storage._pinned import PinnedRing, ring_for

__all__ = [
    "CudaRuntime",
    "handoff",
    "inner_tensors",
    "placement_refused",
    "record_writes",
    "resolve_device",
    "to_device",
    "wait_for_writes",
]

_V = TypeVar("_V", bound=torch.Tensor)
_R = TypeVar("_R")


class CudaRuntime:
    """The CUDA calls this package makes, in one place."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, index: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=torch.device("cuda", index))

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def device_of(self, value: torch.Tensor) -> torch.device:
        return value.device


RUNTIME = CudaRuntime()
_CPU = torch.device("cpu")

_STREAMS: dict[int, Any] = {}
_STREAMS_LOCK = fork_safe_lock()


# ---------------------------------------------------------------------------------------------
# Devices and streams
# ---------------------------------------------------------------------------------------------
def resolve_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``; ``"cuda"`` becomes ``cuda:<current device>``, and
    ``"cpu:0"`` is ``"cpu"`` (the one CPU device, as every CPU tensor reports it).

    The current device is the calling thread's: call this where the user called (the public
    method), and pass the resolved device to worker threads.

    Raises:
        T2NErrorMisuse: ``device`` names no device, or a backend that torch cannot place
            tensors on here (one this build lacks, such as ``"mps"`` or ``"xpu"``; CUDA's
            availability is checked where values are copied to it).
    """
    try:
        target = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise T2NErrorMisuse(f"{device!r} is not a device: {exc}") from exc
    if target.type == "cuda":
        if target.index is None and RUNTIME.is_available():
            target = torch.device("cuda", RUNTIME.current_device())
    elif target.type == "cpu":
        target = _CPU
    elif target.type != "meta" and (why := placement_refused(target)) is not None:
        raise T2NErrorMisuse(
            f"device {device!r}: torch cannot place tensors on {target} on this machine "
            f"({why}); use 'cpu' or a device this machine has"
        )
    return target


_REFUSED: dict[torch.device, str | None] = {}


def placement_refused(target: torch.device) -> str | None:
    """Why torch cannot place a tensor on ``target`` on this machine (a backend this build
    lacks, an index beyond the devices present), or ``None``; asked of torch once per device
    (a CUDA device's first ask starts CUDA)."""
    if target not in _REFUSED:
        try:
            torch.empty(0, device=target)
            _REFUSED[target] = None
        except Exception as exc:  # each backend fails its own way (RuntimeError, ...)
            first = (str(exc).splitlines() or [""])[0].split(". ")[0][:160]
            _REFUSED[target] = f"{type(exc).__name__}: {first}"
    return _REFUSED[target]


def pin_host_memory(requested: bool) -> bool:
    """Whether host buffers can honour a request for pinned memory (only with CUDA)."""
    return requested and RUNTIME.is_available()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else RUNTIME.current_device()


def copy_stream(index: int) -> Any:
    """The dedicated host-to-device copy stream of CUDA device ``index`` (one per device).

    It is made on the first copy to the device. Making a process's first CUDA side stream
    waits for every kernel already queued on the device (PyTorch sets up its stream pool then),
    so that first copy waits for them too; later copies never do.
    """
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = RUNTIME.new_stream(index)
        return stream


# ---------------------------------------------------------------------------------------------
# Events attached to values
# ---------------------------------------------------------------------------------------------
class _EventTable:
    """Events still pending for values, by value object; a value that dies drops its events."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # weakref callbacks may run on any line, even here
        self._items: dict[int, tuple[weakref.ref[Any], list[Any]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, value: torch.Tensor, event: Any) -> None:
        key = id(value)
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0]() is not value:
                item = (weakref.ref(value, functools.partial(self._forget, key)), [])
                self._items[key] = item
            item[1].append(event)

    def pending(self, value: torch.Tensor) -> list[Any]:
        """The events of ``value`` not completed yet (completed ones are forgotten)."""
        key = id(value)
        if key not in self._items:  # the common case, without the lock
            return []
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0]() is not value:
                return []
            events = [event for event in item[1] if not event.query()]
            if events:
                item[1][:] = events
            else:
                del self._items[key]
            return events

    def take(self, value: torch.Tensor) -> list[Any]:
        """All the events of ``value``, forgetting them."""
        key = id(value)
        if key not in self._items:
            return []
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0]() is not value:
                return []
            del self._items[key]
            return item[1]

    def _forget(self, key: int, ref: weakref.ref[Any]) -> None:
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0] is ref:
                del self._items[key]


_READY = _EventTable()  # copies a value was made from, until they are seen complete
_WRITES = _EventTable()  # kernels that changed a value under a read_write lease


def inner_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``value``'s memory: itself, or an opaque value's inner tensors.

    An opaque value (a ``QTensor``) holds its memory in tensor attributes, possibly inside
    attribute objects (its scheme's scales, its compressors); they are collected a few levels
    deep, each once.
    """
    if not isinstance(value, OpaqueTensor):
        return [value]
    found: dict[int, torch.Tensor] = {}
    _collect(vars(value), found, depth=4)
    return list(found.values())


def _collect(item: Any, found: dict[int, torch.Tensor], depth: int) -> None:
    if isinstance(item, OpaqueTensor):
        _collect(vars(item), found, depth - 1)
    elif isinstance(item, torch.Tensor):
        found.setdefault(id(item), item)
    elif depth <= 0:
        return
    elif isinstance(item, dict):
        for member in item.values():
            _collect(member, found, depth - 1)
    elif isinstance(item, (list, tuple)):
        for member in item:
            _collect(member, found, depth - 1)
    elif hasattr(item, "__dict__") and not isinstance(item, type):
        _collect(vars(item), found, depth - 1)


def handoff(value: _V, device: torch.device | None = None) -> _V:
    """Make ``value`` (on ``device``) safe to use on the calling thread's current stream.

    Call it in the consumer's thread, wherever a value is handed out. On a CUDA device, the
    current stream waits for the copies that made ``value`` (their ready event; the thread
    does not block) and each inner tensor is recorded on the stream (``record_stream``), so
    its memory is not reused before the kernels queued there ran. Other devices: nothing.

    Args:
        value: the value handed out (a plain tensor or an opaque one such as a ``QTensor``).
        device: the device ``value`` lives on (default: ``value.device``).

    Returns:
        ``value`` itself.
    """
    if device is None:
        device = RUNTIME.device_of(value)
    if device.type != "cuda":
        return value
    stream = RUNTIME.current_stream(_index(device))
    for event in _READY.pending(value):
        RUNTIME.wait_event(stream, event)
    for tensor in inner_tensors(value):
        RUNTIME.record_stream(tensor, stream)
    return value


def record_writes(value: torch.Tensor, device: torch.device | None = None) -> None:
    """Note that kernels queued on the calling thread's current stream may change ``value``.

    Call it in the caller's thread at the exit of a ``read_write`` lease: an event is recorded
    on its current stream of ``device``, which :func:`wait_for_writes` waits for. Other
    devices: nothing.

    Args:
        value: the value the kernels may change (the object a write-back will read).
        device: the device ``value`` lives on (default: ``value.device``).
    """
    if device is None:
        device = RUNTIME.device_of(value)
    if device.type == "cuda":
        _WRITES.add(value, RUNTIME.record_event(RUNTIME.current_stream(_index(device))))


def wait_for_writes(value: torch.Tensor) -> None:
    """Block until the kernels noted by :func:`record_writes` for ``value`` have run.

    Call it before a write-back reads ``value`` (in the worker that writes it back).
    """
    for event in _WRITES.take(value):
        event.synchronize()


def mark_pending(value: torch.Tensor, event: Any) -> None:
    """Attach the ready event of the copies that made ``value``; :func:`handoff` waits for it."""
    _READY.add(value, event)


# ---------------------------------------------------------------------------------------------
# Transfers
# ---------------------------------------------------------------------------------------------
def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense, contiguous tensor, as a flat ``uint8`` view."""
    return tensor.reshape(-1).view(torch.uint8)


class Transfer:
    """Copies to one CUDA device: on its copy stream, staged through its pinned ring.

    Copies are queued and the methods return at once (a pinned chunk is waited for only when
    the ring is full); :meth:`ready` records the event after everything queued so far.
    """

    def __init__(self, device: torch.device) -> None:
        if not RUNTIME.is_available():
            raise T2NErrorMisuse(
                f"cannot copy to {device}: CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); deliver values to 'cpu' instead"
            )
        self.index = _index(device)
        self.stream = copy_stream(self.index)
        self.ring: PinnedRing = ring_for(self.index, RUNTIME.pinned)

    def on_stream(self, work: Callable[[], _R]) -> _R:
        """Run ``work`` with the copy stream current: its kernels follow the queued copies."""
        with RUNTIME.use_stream(self.stream):
            return work()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Device memory allocated on the copy stream (recorded on consumers at hand-out)."""
        return self.on_stream(lambda: RUNTIME.empty(shape, dtype, self.index))

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``target.copy_(source)`` on the copy stream (``source`` pinned or on device)."""
        self.on_stream(lambda: target.copy_(source, non_blocking=True))

    def stage(self, target: torch.Tensor, fill: Callable[[int, torch.Tensor], None]) -> None:
        """Queue the copy of ``target``'s bytes chunk by chunk through the pinned ring.

        ``fill(offset, chunk)`` writes the bytes of ``target`` that start at ``offset`` into
        ``chunk`` (a pinned ``uint8`` tensor); the chunk's copy is then queued and the chunk
        goes back to the ring with its copy event, so the next fill overlaps that copy.
        """
        flat = _flat_bytes(target)
        total = flat.numel()
        for start in range(0, total, self.ring.chunk_bytes):
            size = min(self.ring.chunk_bytes, total - start)
            chunk = self.ring.acquire()
            event = None
            try:
                part = chunk[:size]
                fill(start, part)
                self.copy(flat[start : start + size], part)
                event = RUNTIME.record_event(self.stream)
            finally:
                self.ring.release(chunk, event)

    def put(self, host: torch.Tensor) -> torch.Tensor:
        """Queue the copy of the dense CPU tensor ``host``; return its device tensor.

        A pinned ``host`` is copied directly (it must not change before the copy ran);
        pageable memory is staged through the ring.
        """
        source = host.detach().resolve_conj().resolve_neg().contiguous()
        target = self.empty(tuple(source.shape), source.dtype)
        if source.numel() == 0:
            return target
        if RUNTIME.is_pinned(source):
            self.copy(target, source)
            return target
        flat = _flat_bytes(source)

        def fill(start: int, chunk: torch.Tensor) -> None:
            chunk.copy_(flat[start : start + chunk.numel()])

        self.stage(target, fill)
        return target

    def ready(self) -> Any:
        """The event after every copy queued so far on the copy stream."""
        return RUNTIME.record_event(self.stream)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy the CPU tensor ``host`` to ``device`` and return it once the copy is complete.

    A CPU target returns ``host`` itself. For a CUDA target (``"cuda"`` is the calling
    thread's current device), the copy runs on the device's dedicated copy stream, directly
    from a pinned ``host`` or staged chunk by chunk through the device's bounded ring of
    pinned chunks; it does not wait for work queued on other streams (but for the first
    copy to the device in the process: see :func:`copy_stream`). The function waits for
    its own copy only, then records the result on the calling thread's current stream, where
    it is safe to use (on another stream, call ``Tensor.record_stream`` on it first). Other
    devices (and a ``host`` that is not a dense CPU tensor) use a plain ``Tensor.to``.

    Args:
        host: a CPU tensor (a buffer filled by :func:`read_payload`, say).
        device: the target device.

    Returns:
        the tensor on ``device``, its values complete.
    """
    target = resolve_device(device)
    if target.type == "cpu" and host.device.type == "cpu":
        return host
    if (
        target.type != "cuda"
        or host.device.type != "cpu"
        or host.layout != torch.strided
        or isinstance(host, OpaqueTensor)
    ):
        return host.to(target)
    transfer = Transfer(target)
    value = transfer.put(host)
    transfer.ready().synchronize()
    return handoff(value, target)
