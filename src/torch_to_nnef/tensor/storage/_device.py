"""Host-to-device copies: pinned host buffers and one dedicated copy stream per CUDA device.

:func:`to_device` is meant to run in a worker thread: it blocks until the copy is complete, so
the tensor it returns can be used on any stream without further synchronisation.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["to_device"]

_STREAMS: dict[int, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def pin_host_memory(requested: bool) -> bool:
    """Whether host buffers can honour a request for pinned memory (only with CUDA)."""
    return requested and torch.cuda.is_available()


def _should_pin(device: torch.device | str) -> bool:
    """Whether a host buffer bound for ``device`` should be pinned: CUDA targets, with CUDA."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _copy_stream(device: torch.device | str) -> torch.cuda.Stream | None:
    """The dedicated host-to-device copy stream of ``device``; ``None`` for non-CUDA devices.

    Streams are created on first use and cached, one per CUDA device, safely from any thread.
    """
    target = torch.device(device)
    if target.type != "cuda":
        return None
    index = _cuda_index(target)
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _STREAMS[index] = stream
        return stream


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy the CPU tensor ``host`` to ``device`` and return it once the copy is complete.

    A CPU target returns ``host`` itself. For a CUDA target the copy runs with
    ``non_blocking=True`` on the device's dedicated copy stream from a pinned host buffer (a
    pageable ``host`` is first staged into pinned memory), after the stream has waited for the
    work already queued on the current stream; the function synchronises that stream before
    returning. Other devices (and a ``host`` that is not on the CPU) use a plain blocking
    ``Tensor.to``. Safe to call from worker threads.

    Args:
        host: a CPU tensor (typically a buffer filled by :func:`read_payload`).
        device: the target device.

    Returns:
        the tensor on ``device``, its values complete.
    """
    target = torch.device(device)
    if target.type == "cpu" and host.device.type == "cpu":
        return host
    stream = _copy_stream(target)
    if stream is None or host.device.type != "cpu":
        return host.to(target)
    index = _cuda_index(target)
    source = host if host.is_pinned() else _pinned_copy(host)
    with torch.cuda.device(index):
        # Allocated on the current stream, so that the caching allocator hands the block to
        # later work on that stream; the copy stream first waits for the work queued there.
        result = torch.empty_like(source, device=target)
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            result.copy_(source, non_blocking=True)
        stream.synchronize()
    return result


def _pinned_copy(host: torch.Tensor) -> torch.Tensor:
    staging = torch.empty_like(host, pin_memory=True)
    staging.copy_(host)
    return staging
