"""The few Linux calls that Python's ``mmap`` module lacks or makes hold the GIL.

``mmap``, ``munmap`` and ``madvise`` go through ``ctypes``, which releases the GIL while the
kernel works: the compute thread keeps running Python while an I/O worker maps and
populates a region. :meth:`Kernel.view` makes the writable ``memoryview`` of such a region
that tensors are built on (through Python's C API: no buffer object of its own, no ``ctypes``
array type per length). :data:`KERNEL` is ``None`` off Linux; callers then use the ``mmap``
module.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MAP_FIXED = 0x10  # Linux, every architecture
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux, x86 and arm64
_MAP_FAILED = ctypes.c_void_p(-1).value
POPULATE_CHUNK = 2 << 20
"""Bytes populated per call: the process's memory map is held for a call's whole range (see
``Kernel.populate_for_writing``)."""
_PYBUF_WRITE = 0x200


def _huge_page_size() -> int:
    """The size of a PMD-mapped huge page (0 where the kernel has no transparent huge pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as size:
            return int(size.read())
    except (OSError, ValueError):
        return 0


_VIRTIO_BALLOON = "0x0005"
_VIRTIO_BALLOON_F_REPORTING = 5


def host_takes_back_free_memory(devices: str = "/sys/bus/virtio/devices") -> bool:
    """Whether this Linux guest reports its free memory to the host: a virtio memory balloon
    with free page reporting (``VIRTIO_BALLOON_F_REPORTING``, as Firecracker and QEMU offer).

    The guest then hands each free block of 2 MiB or more back to the host a few seconds
    after it was freed, and the host drops its memory: a transparent huge page is taken from
    such blocks, and faulting one in again costs the host a fault for each of its small pages.
    On such a guest a read into a fresh buffer advised to use huge pages ran at 0.16 to
    0.28 GB/s once the memory freed before had been reported, against 1.4 to 1.9 GB/s into
    small pages (and 5 to 6 GB/s only while it reused blocks freed within those seconds).
    """
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        device = os.path.join(devices, name)
        try:
            with open(os.path.join(device, "device")) as kind:
                if kind.read().strip() != _VIRTIO_BALLOON:
                    continue
            with open(os.path.join(device, "features")) as bits:
                features = bits.read().strip()
        except OSError:
            continue
        if features[_VIRTIO_BALLOON_F_REPORTING : _VIRTIO_BALLOON_F_REPORTING + 1] == "1":
            return True
    return False


class Kernel:
    """The C library's ``mmap``, ``munmap`` and ``madvise`` (Linux), called without the GIL."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        memory = ctypes.pythonapi.PyMemoryView_FromMemory
        memory.restype = ctypes.py_object
        memory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
        self._memory = memory
        self.huge_page = _huge_page_size()
        # Whether fresh anonymous memory gains from huge pages (see host_takes_back_free_memory).
        self.fresh_huge_pages = self.huge_page > 0 and not host_takes_back_free_memory()
        self.populates = True  # until the kernel refuses MADV_POPULATE_READ
        self.populates_for_writing = True  # until it refuses MADV_POPULATE_WRITE

    def map(
        self, address: int | None, length: int, prot: int, flags: int, fd: int, offset: int
    ) -> int:
        """``mmap``: the address of the new mapping.

        Raises:
            OSError: the kernel refused (its ``errno``).
        """
        placed = self.mmap(address, length, prot, flags, fd, offset)
        if placed is None or placed == _MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return int(placed)

    def view(self, address: int, length: int) -> memoryview:
        """A writable ``memoryview`` of ``length`` bytes at ``address`` (it owns nothing:
        the caller unmaps the memory once the view and its exports are gone)."""
        view: memoryview = self._memory(address, length, _PYBUF_WRITE)
        return view

    def advise(self, address: int, length: int, populate: bool) -> None:
        """Populate ``length`` bytes at ``address`` (readahead where the kernel cannot)."""
        if populate and self.populates:
            if self.madvise(address, length, MADV_POPULATE_READ) == 0:
                return
            if ctypes.get_errno() == errno.EINVAL:  # a kernel older than 5.14
                self.populates = False
        self.madvise(address, length, MADV_WILLNEED)

    def populate_for_writing(self, address: int, length: int) -> None:
        """Fault in the pages of ``length`` bytes of new memory at ``address``, all about to be
        written, a call per ``POPULATE_CHUNK`` (a read into a fresh buffer: 1.2x to 1.4x the
        throughput of letting each page fault in as the read reaches it). The kernel holds
        the process's memory map for the whole range of a call, and another thread's
        ``mmap`` or ``munmap`` waits for it: with two workers reading 32 MiB payloads into
        fresh buffers, one call per buffer ran at 0.8x the throughput of calls of 2 MiB. A
        kernel that refuses it (older than 5.14) leaves the pages to fault in as they are
        written."""
        end = address + length
        while address < end and self.populates_for_writing:
            chunk = min(POPULATE_CHUNK, end - address)
            if self.madvise(address, chunk, MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:
                    self.populates_for_writing = False
                return  # (out of memory, say: the read faults the rest in)
            address += chunk


def _kernel() -> Kernel | None:
    if sys.platform != "linux":
        return None
    try:
        return Kernel()
    except (OSError, AttributeError):
        return None


KERNEL = _kernel()
"""The C library's calls, or ``None`` off Linux or where it cannot be loaded."""
