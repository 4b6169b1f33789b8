"""Regions of the page cache held in small folios, read again once in huge ones.

A mapped load of a region that the page cache holds in huge folios (2 MiB) costs the kernel
one page table entry per huge page: 10 to 20 us to populate 10 MB. Where the page cache holds
it in smaller folios, every 4 KiB page takes an entry: 450 to 700 us, and about a fifth of
that again to unmap. A file read sequentially (``cat``, ``read()`` in a loop) lands in small
folios while the kernel's readahead grows, over its first ~30 MB (measured on ext4, Linux
6.18: 11 to 12 of the ~80 loads per token of the generation job of ``benchmarks/bench_hf.py``
mapped such regions, 8 to 10 ms of the I/O workers' CPU per token); a region read by
populating a ``MADV_HUGEPAGE`` mapping lands in huge ones.

A load whose populate took the CPU time of small folios (more than :data:`SMALL_FOLIO_NS` per
huge page; huge folios take a tenth of it) unmaps the region, evicts its clean, unmapped page
cache pages (``POSIX_FADV_DONTNEED``, whole huge pages) and maps it again: populating reads it
from disk in huge folios, and later loads of the region take the cheap path. The first load
pays that read (about 8 ms per 10 MB on the machine measured); it is done once per region of
a file identity (:data:`SLOW_REGIONS` remembers which). Pages mapped by anyone stay, and a
file system without large folios reads small ones again: nothing is lost but that one read.
A cold read through the mapping takes little CPU time (the thread sleeps), so cold loads
are not taken for small folios.
"""

from __future__ import annotations

import os

from torch_to_nnef._forksafe import fork_safe_lock

__all__ = ["SLOW_REGIONS", "SMALL_FOLIO_NS", "Region", "SlowRegions", "evict"]

SMALL_FOLIO_NS = 40_000
"""Populate CPU time per huge page above which a region is taken to be in small folios
(measured: 2 to 4 us per huge page in huge folios, 90 to 140 us in small ones)."""

Region = tuple[tuple[int, int, int, int], int, int]
"""A file identity (``file_identity``), the start and the length of a mapped region."""


class SlowRegions:
    """The regions read again in huge folios (see the module's documentation)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._lock = fork_safe_lock()  # a worker may hold it at a fork
        self._read_again: dict[Region, None] = {}  # insertion ordered: the oldest first

    def first_slow(self, region: Region, huge_pages: int, spent_ns: int) -> bool:
        """Whether populating the ``huge_pages`` of ``region`` in ``spent_ns`` of CPU time
        took small folios, for the first time: the caller reads it again (it is remembered
        from now on; the oldest of :attr:`capacity` regions is forgotten first)."""
        if spent_ns <= SMALL_FOLIO_NS * huge_pages:
            return False
        with self._lock:
            if region in self._read_again:
                return False
            while len(self._read_again) >= self._capacity:
                del self._read_again[next(iter(self._read_again))]
            self._read_again[region] = None
        return True

    @property
    def capacity(self) -> int:
        """How many regions are remembered at most."""
        return self._capacity


def evict(fd: int, start: int, length: int, huge: int, file_size: int) -> None:
    """Evict the clean, unmapped page cache pages of the whole huge pages (of ``huge`` bytes)
    that hold bytes ``start`` to ``start + length`` of the open ``fd``."""
    first = start // huge * huge
    end = min(-(-(start + length) // huge) * huge, file_size)
    os.posix_fadvise(fd, first, end - first, os.POSIX_FADV_DONTNEED)


SLOW_REGIONS = SlowRegions()
"""The process's regions read again."""
