"""Mapped reads: CPU tensors that are views of a payload file's pages, without a copy.

:func:`map_payload` maps the region of a file that holds the requested entries (private,
copy-on-write: writing to a mapped tensor changes the process's copy of the page, never the
file) and asks the kernel to populate the mapping (``MADV_POPULATE_READ``; ``MADV_WILLNEED``
readahead where the kernel lacks it), so that the cost of faulting the pages in is paid where
the map is made, typically in an I/O worker, not by the compute that reads the tensor. The
pages belong to the page cache: a mapped tensor takes no anonymous memory, and when the last
tensor of a mapping is freed the region is unmapped and its pages leave the process's RSS.

Setting up and tearing down page tables is the cost of a mapped read on a warm page cache,
and it is paid per page: 4 KiB pages cost about 15 ms per 188 MB to populate and 5 ms to
unmap. On Linux a region of at least one huge page is therefore widened at each end that
covers most of a huge page to that whole page, and mapped at an address congruent to its
file offset modulo the huge page size (2 MiB), with ``MADV_HUGEPAGE``: the kernel then maps
each huge folio of the page cache with one entry (populating and unmapping 188 MB take a
fraction of a millisecond) and reads a cold file in huge folios, which also reads it twice
as fast as ``POSIX_FADV_WILLNEED`` readahead did (measured on the generation job of
``benchmarks/bench_hf.py``, cold: 0.35 against 0.95 s per 800 MB). Where the page cache
holds a region in smaller folios (the first ~30 MB of a file read sequentially, while the
kernel's readahead grows), it is still mapped 4 KiB at a time: 0.45 to 0.7 ms per 10 MB.

A load is otherwise a handful of system calls, all through ``ctypes`` (which releases the
GIL: the compute thread runs Python while an I/O worker waits for the kernel; ``mmap``
objects hold it): a ``stat`` of the path against the layout's identity, with the file's
descriptor kept open (``_descriptors``); one ``mmap``, placed by the kernel (file systems
with huge page support place it congruent to its offset; elsewhere it is remapped over an
anonymous reservation); ``madvise`` twice; the ``munmap`` when its last tensor is freed (a
finalizer of the ``memoryview`` the tensors are built on). Opening and closing the file per
load and always going through a reservation cost 15 to 20 us more per load (65 against 80
us of a worker's CPU per 4 to 10 MB entry mapped from huge folios).

:func:`advise_payload` starts the kernel's readahead of entries without mapping them (a
prefetch that costs no memory of the process). ``load_payload(..., on_demand=True)`` maps
without populating or reading ahead (``MADV_RANDOM``): only the pages read come in, for a
lookup of a few rows of a large table.

A mapped file must not be truncated while mapped (a read of the missing pages would raise
``SIGBUS``): payload files of this package are replaced atomically, never truncated, and a
checkpoint changed since its layout was read is refused, before the mapping is made and again
once its pages are in (a file truncated or rewritten in place meanwhile is unmapped unread).
"""

from __future__ import annotations

import errno
import functools
import itertools
import mmap
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.storage import _kernel
from torch_to_nnef.tensor.storage._buffers import MAPPED_BUFFER_MIN_BYTES, select_entries
from torch_to_nnef.tensor.storage._descriptors import DESCRIPTORS, Kept
from torch_to_nnef.tensor.storage._folios import SLOW_REGIONS, evict
from torch_to_nnef.tensor.storage._format import EntrySpec, PayloadLayout
from torch_to_nnef.tensor.storage._io import (
    check_unchanged_after_read,
    os_error_message,
    read_entries,
    read_payload,
    reading,
)

__all__ = [
    "advise_payload",
    "load_payload",
    "map_payload",
    "mapped_reads",
    "set_mapped_reads",
]

_MAPPED_READS = [hasattr(mmap, "MAP_PRIVATE")]  # one switch for the process

MAPPED_MIN_BYTES = MAPPED_BUFFER_MIN_BYTES
"""Loads of fewer bytes are read, not mapped, even when :func:`mapped_reads` is on: below it
a read lands in a heap buffer and costs 0.6x the CPU time of creating and dropping a mapping
(4 KiB to 64 KiB entries, warm page cache); above it a read needs a fresh mapping of its own
anyway."""


def mapped_reads() -> bool:
    """Whether :func:`load_payload` maps entries when not told (the switch of CPU loads).

    On by default where private mappings exist. Measured by ``benchmarks/bench_mapped.py``:
    on a warm page cache a mapped read takes a third to two thirds of the time of a read into
    a reused buffer (the copy out of the page cache is gone); on a cold one both wait for the
    disk and measure the same within noise.
    """
    return _MAPPED_READS[0]


def set_mapped_reads(enabled: bool) -> bool:
    """Turn mapped loads on or off for the process; return the previous setting.

    Raises:
        T2NErrorMisuse: ``enabled`` is not a bool, or mapping is asked where the platform
            has no private mappings.
    """
    if not isinstance(enabled, bool):
        raise T2NErrorMisuse(f"set_mapped_reads takes a bool, got {enabled!r}")
    if enabled and not hasattr(mmap, "MAP_PRIVATE"):
        raise T2NErrorMisuse("this platform has no private mappings; reads cannot be mapped")
    previous, _MAPPED_READS[0] = _MAPPED_READS[0], enabled
    return previous


_PROT = mmap.PROT_READ | mmap.PROT_WRITE  # private: writes copy the page
_PAGE = mmap.ALLOCATIONGRANULARITY

Faulting = Literal["populate", "readahead", "on_demand"]
"""How the pages of a new mapping come in: all at once where it is made (``populate``); read
ahead in the background, faulted in where first read (``readahead``); or only where read, one
page at a time, nothing read ahead (``on_demand``: a lookup of a few rows of a large table
reads those rows and no more)."""


def _span(specs: list[EntrySpec]) -> tuple[int, int]:
    """The page-aligned start and the length of the file region holding ``specs``."""
    start = min(spec.start for spec in specs) // _PAGE * _PAGE
    end = max(spec.start + spec.nbytes for spec in specs)
    return start, end - start


def map_payload(
    layout: PayloadLayout,
    *,
    names: Iterable[str] | None = None,
    populate: bool = True,
) -> dict[str, torch.Tensor]:
    """Entries of a payload file as CPU tensors mapping the file's pages (no copy).

    Args:
        layout: the file's layout, from ``read_layout`` or ``write_payload``.
        names: the entries to map (all when ``None``); one mapping covers them all.
        populate: fault the pages in now (reading them from disk if they are not cached),
            so that the first use of the tensors does not; otherwise only start readahead.

    Returns:
        the tensors by entry name, in the order of ``names`` (file order by default). They
        are writable; writes are private to the process (copy on write) and never reach the
        file. The mapping lives as long as one of the tensors does.

    Raises:
        T2NErrorStorage: the file is missing, changed since ``layout`` was read, shorter
            than its layout says, or cannot be mapped; or it lacks a requested entry.
    """
    faulting: Faulting = "populate" if populate else "readahead"
    return _map_entries(layout, select_entries(layout, names), faulting)


def _map_entries(
    layout: PayloadLayout, specs: list[EntrySpec], faulting: Faulting
) -> dict[str, torch.Tensor]:
    """:func:`map_payload` of the entries ``specs`` of ``layout``."""
    present = [spec for spec in specs if spec.nbytes]
    if not present:
        return {spec.name: torch.empty(spec.shape, dtype=spec.dtype) for spec in specs}
    start, length = _span(present)
    # Ctrl-C (main thread) is raised once the descriptor is released and the mapping is
    # registered: landing in between, it would leak either.
    with InterruptHold() as hold:
        hold.start()
        kept, file_size = DESCRIPTORS.acquire(layout)
        try:
            if file_size < start + length:
                raise T2NErrorStorage(
                    f"payload file '{layout.path}' has {file_size} bytes, fewer than the "
                    f"{start + length} its entries need (truncated file)"
                )
            start, length = _whole_huge_pages(start, length, file_size)
            region, shift = _map_refolding(kept, start, length, faulting, file_size)
            try:
                check_unchanged_after_read(layout, kept.fd)
            except BaseException:
                del region  # (unmapped: nothing reads a page the file may no longer have)
                raise
        except OSError as exc:
            raise T2NErrorStorage(
                f"cannot map payload file '{layout.path}': {os_error_message(exc)}{_remedy(exc)}"
            ) from exc
        finally:
            DESCRIPTORS.release(kept)
    shift -= start
    return {
        spec.name: torch.frombuffer(
            region,
            dtype=spec.dtype,
            count=spec.nbytes // spec.dtype.itemsize,
            offset=shift + spec.start,
        ).view(spec.shape)
        if spec.nbytes
        else torch.empty(spec.shape, dtype=spec.dtype)
        for spec in specs
    }


def _remedy(error: OSError) -> str:
    """What to do when the kernel refuses a mapping for want of room."""
    if error.errno != errno.ENOMEM:
        return ""
    return (
        "; the process may have as many mappings as the kernel allows (vm.max_map_count, "
        "65530 by default; every value of 128 KiB or more held in memory takes one or two, "
        "mapped or read): give the residency pool a budget, or raise vm.max_map_count"
    )


def _map_refolding(
    kept: Kept, start: int, length: int, faulting: Faulting, file_size: int
) -> tuple[mmap.mmap | memoryview, int]:
    """:func:`_map`; a large region whose populate took the CPU time of small page cache
    folios is unmapped, evicted and mapped again, once: read in huge folios (``_folios``)."""
    kernel = _kernel.KERNEL
    huge = 0 if kernel is None else kernel.huge_page
    if (
        kernel is None
        or huge == 0
        or length < huge
        or faulting != "populate"
        or not hasattr(os, "posix_fadvise")
    ):
        return _map(kept.fd, start, length, faulting)
    began = time.thread_time_ns()
    mapped = _map(kept.fd, start, length, faulting)
    spent = time.thread_time_ns() - began
    # Only a populate's time tells the folios apart (asked after the call: the kernel may
    # have just refused it); readahead costs what the disk costs.
    huge_pages = -(-length // huge)
    if not kernel.populates or not SLOW_REGIONS.first_slow(
        (kept.identity, start, length), huge_pages, spent
    ):
        return mapped
    del mapped  # no tensor uses the mapping yet: unmapped here
    evict(kept.fd, start, length, huge, file_size)
    return _map(kept.fd, start, length, faulting)


_WIDEN_AT_MOST = 2  # an end of a region is widened by at most 1/2 of a huge page

SWEEP_EVERY = 256
"""Mappings made between two sweeps of :class:`Mappings` for ones left mapped."""


class _Mapping:
    """A payload mapping: its view (weakly), its range, and whether its unmap has begun."""

    __slots__ = ("base", "span", "unmapped", "view")

    def __init__(self, view: weakref.ref[memoryview], base: int, span: int) -> None:
        self.view, self.base, self.span = view, base, span
        self.unmapped = False


class Mappings:
    """The payload mappings made through the kernel's calls, each unmapped when the view
    that owns it is gone.

    A weak reference callback unmaps a mapping as its view dies. That callback is Python
    code, run wherever the view dies: a ``KeyboardInterrupt`` landing in it is lost by Python
    (reported as unraisable), and so may be the unmap. So every :data:`SWEEP_EVERY` mappings
    made, those whose view is gone are unmapped, and an interrupt cannot make a mapping be
    unmapped twice (its address may hold a later mapping by then) or never:

    - each mapping has a number of its own, never reused (an address is), under which it is
      found;
    - :meth:`_unmap` marks a mapping as unmapped and calls ``munmap`` with no call between
      the two: Python runs a signal handler, or switches threads, only at a function's
      entry and after a call returns. So exactly one of a callback and a sweep unmaps it,
      and an interrupt lands either before the mark (the mapping is left to a sweep) or after
      the unmap (a sweep only forgets it).

    A mapping whose view is dropped before it is handed out (a map that fails) is unmapped
    through :meth:`discard`, so that its view's callback does not unmap the address again.
    """

    def __init__(self) -> None:
        self._table: dict[int, _Mapping] = {}
        self._numbers = itertools.count()

    def number(self) -> int:
        """The number of a new mapping, to :meth:`add` it or :meth:`discard` it."""
        return next(self._numbers)

    def add(
        self, kernel: _kernel.Kernel, number: int, view: memoryview, base: int, span: int
    ) -> None:
        """Unmap ``span`` bytes at ``base`` once ``view`` is gone."""
        callback = functools.partial(self._gone, kernel, number)
        self._table[number] = _Mapping(weakref.ref(view, callback), base, span)
        if number % SWEEP_EVERY == SWEEP_EVERY - 1:
            self.sweep(kernel)

    def _gone(self, kernel: _kernel.Kernel, number: int, _reference: object) -> None:
        self._unmap(kernel, number)

    def _unmap(self, kernel: _kernel.Kernel, number: int) -> None:
        """Unmap mapping ``number`` unless that has begun, then forget it."""
        mapping = self._table.get(number)
        if mapping is not None and not mapping.unmapped:
            mapping.unmapped = True  # and no call before munmap's (see the class)
            kernel.munmap(mapping.base, mapping.span)
        self._table.pop(number, None)

    def discard(self, kernel: _kernel.Kernel, number: int, base: int, span: int) -> None:
        """Unmap the mapping ``number`` now, its view being dropped, whether :meth:`add`
        registered it or not."""
        if number in self._table:
            self._unmap(kernel, number)
        else:
            kernel.munmap(base, span)

    def sweep(self, kernel: _kernel.Kernel) -> None:
        """Unmap the mappings whose view is gone (their callback was lost)."""
        for number, mapping in self._table.copy().items():
            if mapping.view() is None:
                self._unmap(kernel, number)

    def __len__(self) -> int:
        return len(self._table)


MAPPINGS = Mappings()
"""The process's payload mappings."""


def _whole_huge_pages(start: int, length: int, file_size: int) -> tuple[int, int]:
    """The region ``start``, ``length`` widened, at each end that covers half a huge page of
    the file or more, to that whole page (not past the file's end); unchanged below a huge
    page or without the kernel's calls.

    The kernel maps a huge folio of the page cache with one entry only where the mapping
    covers it whole: the partial huge pages at the two ends of an entry's region would be
    populated, and later unmapped, 4 KiB at a time. Widening an end that covers half a huge
    page or more saves most of those 4 KiB entries (the ends that cover less have fewer) for
    at most half a huge page of resident file pages per end (pages of the page cache, not
    anonymous memory; a quarter of a huge page per mapping on average).
    """
    kernel = _kernel.KERNEL
    huge = 0 if kernel is None else kernel.huge_page
    if huge == 0 or length < huge:
        return start, length
    most = huge // _WIDEN_AT_MOST
    end = start + length
    if 0 < start % huge <= most:
        start -= start % huge
    if 0 < -end % huge <= most:
        end = min(end + -end % huge, file_size)
    return start, end - start


def _map(
    fd: int, start: int, length: int, faulting: Faulting
) -> tuple[mmap.mmap | memoryview, int]:
    """Map ``length`` bytes of ``fd`` from ``start`` (private), its pages faulted in as
    ``faulting`` says.

    Returns the mapping (a buffer whose last export unmaps it) and where the file region
    starts in it. A region of a huge page or more must start at an address congruent to
    ``start`` modulo the huge page size: file systems that place mappings for huge pages
    (``thp_get_unmapped_area``: ext4, xfs, tmpfs, ...) do so, and the mapping is used as it
    is; elsewhere it is remapped over an anonymous reservation one huge page longer, at the
    first such address (the reservation's range is unmapped whole). No
    ``POSIX_FADV_WILLNEED`` precedes a large region: that readahead would fill the page
    cache with small folios, where populating the ``MADV_HUGEPAGE`` mapping reads huge ones.
    An ``on_demand`` mapping gets ``MADV_RANDOM`` instead: a fault reads its page only.
    """
    kernel = _kernel.KERNEL
    on_demand = faulting == "on_demand"
    if kernel is None:
        if hasattr(os, "posix_fadvise") and not on_demand:  # one readahead, not one per fault
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
        mapping = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=_PROT, offset=start)
        _advise_without_kernel(mapping, faulting)
        return mapping, 0
    number = MAPPINGS.number()  # taken before mapping: nothing to undo if interrupted
    huge = kernel.huge_page
    large = huge != 0 and length >= huge
    if not large and hasattr(os, "posix_fadvise") and not on_demand:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
    address = kernel.map(None, length, _PROT, mmap.MAP_PRIVATE, fd, start)
    base, span = address, length
    if large and (address - start) % huge:
        kernel.munmap(address, length)
        base, span = _reserve(kernel, length + huge), length + huge
        address = base + (start - base) % huge
        try:
            kernel.map(address, length, _PROT, mmap.MAP_PRIVATE | _kernel.MAP_FIXED, fd, start)
        except BaseException:
            kernel.munmap(base, span)
            raise
    try:
        region = kernel.view(base, span)
        MAPPINGS.add(kernel, number, region, base, span)
    except BaseException:
        MAPPINGS.discard(kernel, number, base, span)
        raise
    if on_demand:
        kernel.madvise(address, length, _kernel.MADV_RANDOM)
    else:
        if large:  # refused where transparent huge pages are off: no matter
            kernel.madvise(address, length, _kernel.MADV_HUGEPAGE)
        kernel.advise(address, length, faulting == "populate")
    return region, address - base


def _reserve(kernel: _kernel.Kernel, length: int) -> int:
    """The address of ``length`` bytes of anonymous address space, no memory committed."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _kernel.MAP_NORESERVE
    return kernel.map(None, length, _PROT, flags, -1, 0)


def _advise_without_kernel(region: mmap.mmap, faulting: Faulting) -> None:
    """Advise the kernel through ``mmap.madvise`` (platforms without ``Kernel``)."""
    if faulting == "on_demand":
        if hasattr(mmap, "MADV_RANDOM"):
            region.madvise(mmap.MADV_RANDOM)
        return
    if faulting == "populate":
        try:
            region.madvise(_kernel.MADV_POPULATE_READ)
            return
        except (OSError, ValueError, AttributeError):
            pass  # no such advice: readahead only
    if hasattr(mmap, "MADV_WILLNEED"):
        region.madvise(mmap.MADV_WILLNEED)


def advise_payload(layout: PayloadLayout, *, names: Iterable[str] | None = None) -> None:
    """Start reading entries into the page cache in the background (``POSIX_FADV_WILLNEED``).

    Returns at once; a later read or mapping of the entries finds them cached. Does nothing
    where the platform has no ``posix_fadvise``.

    Args:
        layout: the file's layout, from ``read_layout`` or ``write_payload``.
        names: the entries to read ahead (all when ``None``).

    Raises:
        T2NErrorStorage: the file is missing or unreadable, or lacks a requested entry.
    """
    specs = [spec for spec in select_entries(layout, names) if spec.nbytes]
    if not specs or not hasattr(os, "posix_fadvise"):
        return
    with reading(layout.path) as (fd, _stat):
        for spec in specs:
            os.posix_fadvise(fd, spec.start, spec.nbytes, os.POSIX_FADV_WILLNEED)


def load_payload(
    layout: PayloadLayout,
    *,
    names: Iterable[str] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    mapped: bool | None = None,
    on_demand: bool = False,
) -> dict[str, torch.Tensor]:
    """Entries of a payload file as CPU tensors, mapped or read, whichever is asked or faster.

    When not told, entries totalling :data:`MAPPED_MIN_BYTES` or more are mapped if
    :func:`mapped_reads` is on; smaller ones are read.

    Args:
        layout: the file's layout.
        names: the entries (all when ``None``).
        out: buffers to read into when reading (ignored when mapping).
        mapped: map (:func:`map_payload`) or read (``read_payload``); ``None``: as
            :func:`mapped_reads` and the size say.
        on_demand: a mapping reads only the pages that are read (see :data:`Faulting`),
            nothing when it is made; for a value of which only a few rows will be read.

    Raises:
        T2NErrorStorage: see :func:`map_payload` and ``read_payload``.
        T2NErrorMisuse: a buffer of ``out`` does not match its entry (when reading).
    """
    if mapped is False or (mapped is None and not mapped_reads()):
        return read_payload(layout, out=out, names=names)
    specs = select_entries(layout, names)
    if mapped is None and sum(spec.nbytes for spec in specs) < MAPPED_MIN_BYTES:
        return read_entries(layout, specs, out)
    return _map_entries(layout, specs, "on_demand" if on_demand else "populate")
