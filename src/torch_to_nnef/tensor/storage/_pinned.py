"""Pinned staging memory: a bounded ring of fixed-size page-locked chunks per CUDA device.

A host-to-device transfer from pageable memory (a file, an ordinary tensor) goes through page-
locked *chunks*: the bytes are read or copied into a chunk, the chunk is copied to the device
asynchronously, and the next chunk is filled while that copy runs. A chunk goes back to its
ring with the event recorded after its copy; it is handed out again only once that event has
completed, so a copy never reads a chunk that is being refilled.

Each CUDA device has one ring, shared by every thread and pool of the process: at most
:data:`CHUNKS_PER_DEVICE` chunks of :data:`CHUNK_BYTES` bytes, allocated on first use and kept
for the life of the process (page-locking memory is slow; the ring reuses it). Fixed, power-of-
two chunk sizes also keep PyTorch's pinned-memory cache from rounding each staging buffer up to
the next power of two. :func:`pinned_bytes` reports what the rings hold.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef._waiting import LOOK, Waiters
from torch_to_nnef.exceptions import T2NErrorMisuse

__all__ = ["CHUNKS_PER_DEVICE", "CHUNK_BYTES", "PinnedRing", "pinned_bytes", "ring_for"]

CHUNK_BYTES = 8 * 1024 * 1024
"""Size of one pinned staging chunk."""

CHUNKS_PER_DEVICE = 8
"""Most chunks a device's ring holds: its pinned memory stays under ``8 x 8 MiB = 64 MiB``."""


class CopyEvent(Protocol):
    """What the ring needs from the event recorded after a chunk's copy (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedRing:
    """At most ``max_chunks`` staging chunks of ``chunk_bytes`` bytes, reused in turn.

    :meth:`acquire` hands out a chunk whose last copy has completed: a free one, a new one
    while fewer than ``max_chunks`` exist, or else the chunk released first, after waiting for
    its copy event. :meth:`release` returns a chunk with the event recorded after its copy
    (``None``: no copy was queued). Safe to use from any thread; a caller holds one chunk at a
    time, so callers only wait for each other's copies, never for each other.

    Args:
        chunk_bytes: the size of each chunk.
        max_chunks: the most chunks that may exist at once (>= 1).
        allocate: makes a chunk of the given size (page-locked ``uint8`` memory).
    """

    def __init__(
        self, chunk_bytes: int, max_chunks: int, allocate: Callable[[int], torch.Tensor]
    ) -> None:
        if chunk_bytes <= 0 or max_chunks <= 0:
            raise T2NErrorMisuse(
                f"a pinned ring needs chunk_bytes > 0 and max_chunks > 0, got {chunk_bytes} "
                f"and {max_chunks}"
            )
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_chunks
        self._allocate = allocate
        self._free: deque[tuple[torch.Tensor, CopyEvent | None]] = deque()  # oldest copy first
        self._chunks = 0
        self._out = 0
        self._lock = threading.Lock()
        self._changed = Waiters()  # threads waiting for a chunk
        self.waits = 0
        """How many times a caller waited for a chunk's copy to complete before reusing it."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned memory the ring holds (its chunks, free or in use)."""
        return self._chunks * self.chunk_bytes

    @property
    def chunks_out(self) -> int:
        """Chunks handed out and not yet released."""
        return self._out

    def acquire(self) -> torch.Tensor:
        """A chunk (``chunk_bytes`` bytes of ``uint8``) that no queued copy reads any more."""
        chunk: torch.Tensor | None
        event: CopyEvent | None
        while True:  # (a wait Ctrl-C cuts cleanly: see torch_to_nnef._waiting)
            with self._lock:
                if self._free and (
                    self._free[0][1] is None
                    or self._chunks >= self.max_chunks
                    or self._free[0][1].query()
                ):
                    chunk, event = self._free.popleft()
                    self._out += 1
                    break
                if self._chunks < self.max_chunks:
                    chunk, event = None, None
                    self._chunks += 1
                    self._out += 1
                    break
                gate = self._changed.enlist()
            gate.acquire(timeout=LOOK)
        try:
            if chunk is None:
                chunk = self._allocate(self.chunk_bytes)
            elif event is not None and not event.query():
                with self._lock:
                    self.waits += 1
                event.synchronize()
        except BaseException:
            with self._lock:
                self._out -= 1
                if chunk is None:
                    self._chunks -= 1
                else:
                    self._free.appendleft((chunk, event))
                self._changed.release()
            raise
        return chunk

    def release(self, chunk: torch.Tensor, event: CopyEvent | None) -> None:
        """Give ``chunk`` back; ``event`` completes when the copy that reads it has run."""
        with self._lock:
            self._free.append((chunk, event))
            self._out -= 1
            self._changed.release()


_RINGS: dict[int, PinnedRing] = {}
_RINGS_LOCK = fork_safe_lock()


def ring_for(index: int, allocate: Callable[[int], torch.Tensor]) -> PinnedRing:
    """The process-wide ring of CUDA device ``index`` (created on first use with ``allocate``)."""
    with _RINGS_LOCK:
        ring = _RINGS.get(index)
        if ring is None:
            ring = _RINGS[index] = PinnedRing(CHUNK_BYTES, CHUNKS_PER_DEVICE, allocate)
        return ring


def pinned_bytes() -> int:
    """Bytes of pinned staging memory held by the rings of all devices in this process."""
    with _RINGS_LOCK:
        return sum(ring.pinned_bytes for ring in _RINGS.values())
