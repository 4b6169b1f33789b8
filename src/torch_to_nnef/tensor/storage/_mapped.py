"""Mapped reads: CPU tensors that are views of a payload file's pages, without a copy.

:func:`map_payload` maps the region of a file that holds the requested entries (private,
copy-on-write: writing to a mapped tensor changes the process's copy of the page, never the
file) and asks the kernel to populate the mapping (``MADV_POPULATE_READ``; ``MADV_WILLNEED``
readahead where the kernel lacks it), so that the cost of faulting the pages in is paid where
the map is made, typically in an I/O worker, not by the compute that reads the tensor. The
pages belong to the page cache: a mapped tensor takes no anonymous memory, and when the last
tensor of a mapping is freed the region is unmapped and its pages leave the process's RSS.

:func:`advise_payload` starts the kernel's readahead of entries without mapping them (a
prefetch that costs no memory of the process).

A mapped file must not be truncated while mapped (a read of the missing pages would raise
``SIGBUS``): payload files of this package are replaced atomically, never truncated, and a
checkpoint changed since its layout was read is refused.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.storage._buffers import select_entries
from torch_to_nnef.tensor.storage._format import EntrySpec, PayloadLayout
from torch_to_nnef.tensor.storage._io import (
    check_unchanged,
    open_for_reading,
    os_error_message,
    read_payload,
)

__all__ = [
    "advise_payload",
    "load_payload",
    "map_payload",
    "mapped_reads",
    "set_mapped_reads",
]

_MAPPED_READS = [hasattr(mmap, "MAP_PRIVATE")]  # one switch for the process


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


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_PAGE = mmap.ALLOCATIONGRANULARITY


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
    specs = select_entries(layout, names)
    present = [spec for spec in specs if spec.nbytes]
    result = {spec.name: torch.empty(spec.shape, dtype=spec.dtype) for spec in specs}
    if not present:
        return result
    start, length = _span(present)
    fd, stat = open_for_reading(layout.path)
    try:
        check_unchanged(layout, stat)
        if stat.st_size < start + length:
            raise T2NErrorStorage(
                f"payload file '{layout.path}' has {stat.st_size} bytes, fewer than the "
                f"{start + length} its entries need (truncated file)"
            )
        if hasattr(os, "posix_fadvise"):  # one large readahead rather than one per fault
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
        region = mmap.mmap(
            fd,
            length,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start,
        )
    except OSError as exc:
        raise T2NErrorStorage(
            f"cannot map payload file '{layout.path}': {os_error_message(exc)}"
        ) from exc
    finally:
        os.close(fd)
    _advise(region, populate)
    for spec in present:
        result[spec.name] = torch.frombuffer(
            region,
            dtype=spec.dtype,
            count=spec.nbytes // spec.dtype.itemsize,
            offset=spec.start - start,
        ).view(spec.shape)
    return result


def _advise(region: mmap.mmap, populate: bool) -> None:
    if populate:
        try:
            region.madvise(_MADV_POPULATE_READ)
            return
        except (OSError, ValueError):
            pass  # an older kernel: readahead only
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
    fd, _stat = open_for_reading(layout.path)
    try:
        for spec in specs:
            os.posix_fadvise(fd, spec.start, spec.nbytes, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def load_payload(
    layout: PayloadLayout,
    *,
    names: Iterable[str] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    mapped: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Entries of a payload file as CPU tensors, mapped or read, whichever is asked or faster.

    Args:
        layout: the file's layout.
        names: the entries (all when ``None``).
        out: buffers to read into when reading (ignored when mapping).
        mapped: map (:func:`map_payload`) or read (``read_payload``); ``None``: as
            :func:`mapped_reads` says.

    Raises:
        T2NErrorStorage: see :func:`map_payload` and ``read_payload``.
        T2NErrorMisuse: a buffer of ``out`` does not match its entry (when reading).
    """
    if mapped_reads() if mapped is None else mapped:
        return map_payload(layout, names=names)
    return read_payload(layout, out=out, names=names)
