"""Host buffers: byte views over tensor memory, allocation and validation of read targets.

Readers fill tensors through :func:`byte_view`, a writable ``memoryview`` over the tensor's own
memory (no numpy, no intermediate ``bytes``); writers send tensor memory to the file the same
way, staging non-contiguous tensors through a bounded buffer instead of a full copy.

Buffers of 128 KiB or more are anonymous private mappings of their own (``mmap``), not memory
of the C allocator: when the last tensor using one is freed, it is unmapped and its pages
return to the operating system at once. Through ``malloc`` (torch's CPU allocator), glibc
serves such sizes from its heaps once its dynamic mmap threshold has risen past them (after the
process freed any tensor that large, as every model does), and keeps the freed buffers there:
streaming 24 layers of 16 MiB through a 64 MiB budget then raised the resident set by 210 MiB
and left 169 MiB behind after ``close()``, against 111 MiB and 8 MiB for mapped buffers
(``tests/test_memory_bound.py``). The price is that a fresh buffer always faults its pages in,
where glibc would have handed back memory freed before: on the development machine a read of
16 MiB into a fresh buffer took 1.45x the time of one into recycled ``malloc`` memory. The pool
avoids it where it matters: it reads into the buffers of values it evicted (spares, bounded by
its budget). Smaller buffers, and pinned ones (page-locked by the CUDA runtime's allocator),
come from torch's allocators.

Fresh buffers of a few MiB or more are advised to use transparent huge pages on Linux: filling
new memory then costs one page fault per 2 MiB instead of one per 4 KiB, which more than
doubles the throughput of reads into fresh buffers. Except on a virtual machine whose host
takes back the memory the guest frees (a memory balloon with free page reporting): there a huge
page made of memory freed a few seconds before faults in 6 to 10 times slower than small pages.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Iterable, Iterator, Mapping
from operator import itemgetter
from typing import NamedTuple

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.opaque import OpaqueTensor
from torch_to_nnef.tensor.storage import _kernel
from torch_to_nnef.tensor.storage._device import pin_host_memory
from torch_to_nnef.tensor.storage._format import EntrySpec, PayloadLayout, dtype_code

__all__ = ["allocate", "copy_to"]

STAGING_BYTES = 16 * 1024 * 1024
"""Size of the staging buffer through which non-contiguous tensors are written."""

MAPPED_BUFFER_MIN_BYTES = 128 * 1024
"""Host buffers at least this large are mappings of their own: glibc's own mmap threshold
before it moves."""

HUGE_PAGE_BYTES = 2 * 1024 * 1024
HUGE_PAGE_MIN_BUFFER_BYTES = 2 * HUGE_PAGE_BYTES
"""Fresh buffers at least this large are advised to use transparent huge pages."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat, writable ``memoryview`` of the bytes of a dense CPU tensor, without copying.

    The view keeps ``tensor`` alive. ``tensor`` must be on the CPU, contiguous and have no
    pending conjugate or negative bit (the callers check it).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._t2n_owner = tensor  # type: ignore[attr-defined]  # the view's base keeps it alive
    return memoryview(array).cast("B")


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Hint Linux to back the 2 MiB-aligned interior of a large CPU buffer with huge pages.

    Only a hint (``madvise(MADV_HUGEPAGE)``): it changes no value and its failure is ignored.
    Not given on a virtual machine whose host takes back the guest's free memory, where huge
    pages fault in several times slower than small ones (``_kernel.host_takes_back_free_memory``).

    Returns:
        whether the hint was given.
    """
    kernel = _kernel.KERNEL
    nbytes = tensor.numel() * tensor.element_size()
    if (
        kernel is None
        or not kernel.fresh_huge_pages
        or nbytes < HUGE_PAGE_MIN_BUFFER_BYTES
        or tensor.device.type != "cpu"
    ):
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (tensor.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return end > start and kernel.madvise(start, end - start, _kernel.MADV_HUGEPAGE) == 0


def empty_buffer(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor to read into (pinned when ``pin``).

    Unpinned buffers of :data:`MAPPED_BUFFER_MIN_BYTES` or more map anonymous memory of their
    own, unmapped when the last tensor on it is freed (see the module's documentation), its
    pages faulted in at once: the caller is about to write all of them.
    """
    if pin:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * dtype.itemsize
    region = map_anonymous(nbytes) if nbytes >= MAPPED_BUFFER_MIN_BYTES else None
    if region is None:
        return torch.empty(shape, dtype=dtype)
    # The tensor's storage holds the only reference to the mapping, so that nothing can close
    # it under the tensor; it is unmapped when that storage is freed.
    buffer = torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
    advise_huge_pages(buffer)
    if _kernel.KERNEL is not None:  # (after the hint: populated in the pages it asks for)
        _kernel.KERNEL.populate_for_writing(buffer.data_ptr(), nbytes)
    return buffer


def refuse_unstorable(tensor: torch.Tensor, what: str) -> None:
    """Refuse a tensor that no payload stores as it is: a nested tensor, which has no single
    shape (checked before its shape is read, which torch refuses from deep inside), or one of
    another layout than the dense, strided one (sparse). ``what`` names it."""
    if tensor.is_nested:
        raise T2NErrorMisuse(
            f"{what} cannot be a nested tensor (layout {tensor.layout}): a payload holds dense "
            "values; store each of its parts (value.unbind()) as a tensor of its own, or pad "
            "it into one with value.to_padded_tensor(0.0)"
        )
    if tensor.layout != torch.strided:
        raise T2NErrorMisuse(
            f"{what} has layout {tensor.layout}; a payload holds dense values: convert it "
            "with .to_dense() first"
        )


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``, never an alias of it.

    A contiguous CPU tensor copied to the CPU lands in a buffer of :func:`empty_buffer`'s:
    a large one maps memory of its own, advised to use huge pages where they help, which a
    copy fills several times faster than torch's fresh memory where each page faults in on
    its own.
    """
    if (
        device.type != "cpu"
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or not tensor.is_contiguous()
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return tensor.to(device, copy=True)
    copy = empty_buffer(tuple(tensor.shape), tensor.dtype)
    copy.copy_(tensor)
    return copy


def map_anonymous(nbytes: int) -> mmap.mmap | None:
    """A new private anonymous mapping of ``nbytes``; ``None`` where the platform has none or
    the system refuses one (the number of mappings of a process is bounded: Linux's
    ``vm.max_map_count``), so that the caller takes memory from torch's allocator instead."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Read targets
# ---------------------------------------------------------------------------------------------
def select_entries(layout: PayloadLayout, names: Iterable[str] | None) -> list[EntrySpec]:
    """The entries named by ``names`` (all entries when ``None``), in the requested order.

    Raises:
        T2NErrorStorage: a name is not an entry of the file.
    """
    if names is None:
        return list(layout.entries.values())
    if isinstance(names, str):
        raise T2NErrorMisuse(f"names must be an iterable of entry names, not the str {names!r}")
    selected: dict[str, EntrySpec] = {}
    for name in names:
        spec = layout.entries.get(name)
        if spec is None:
            raise T2NErrorStorage(
                f"payload file '{layout.path}' has no entry {name!r}; it holds "
                f"{sorted(layout.entries)}"
            )
        selected[name] = spec
    return list(selected.values())


def allocate(
    layout: PayloadLayout, names: Iterable[str] | None = None, *, pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """Allocate uninitialised CPU tensors matching entries of ``layout``.

    Args:
        layout: the payload the buffers are for.
        names: the entries to allocate (all when ``None``).
        pin_memory: allocate page-locked memory, for fast copies to a CUDA device. Honoured
            only when CUDA is available (pinning needs a CUDA runtime); otherwise ordinary
            memory is returned.

    Returns:
        the buffers by entry name, in the order of ``names`` (file order by default). An
        unpinned buffer of 128 KiB or more maps memory of its own, given back to the system
        when its last tensor is freed (its storage cannot be resized).

    Raises:
        T2NErrorStorage: a name is not an entry of the payload.
    """
    pin = pin_host_memory(pin_memory)
    return {
        spec.name: empty_buffer(spec.shape, spec.dtype, pin=pin)
        for spec in select_entries(layout, names)
    }


class ReadPlan(NamedTuple):
    """What a read produces and where each byte goes."""

    result: dict[str, torch.Tensor]  # by entry name, in the requested order
    jobs: list[tuple[int, memoryview]]  # (absolute file offset, destination), by offset
    nbytes: int  # read in all


def plan_read(
    layout: PayloadLayout,
    out: Mapping[str, torch.Tensor] | None,
    specs: list[EntrySpec],
) -> ReadPlan:
    """Pick (and check) or allocate a buffer per requested entry (``specs``, from
    :func:`select_entries`), before any I/O.

    Raises:
        T2NErrorMisuse: ``out`` holds a name that is not requested, or a buffer that does not
            match its entry (dtype, shape, CPU, contiguity).
    """
    provided = dict(out) if out else {}  # (every load of a pool plans here: kept lean)
    if provided:
        wanted = {spec.name for spec in specs}
        unexpected = sorted(name for name in provided if name not in wanted)
        if unexpected:
            raise T2NErrorMisuse(
                f"out holds buffers for {unexpected}, which are not read from '{layout.path}' "
                f"(reading {sorted(wanted)}); pass only buffers for the requested entries"
            )
    result: dict[str, torch.Tensor] = {}
    jobs: list[tuple[int, memoryview]] = []
    nbytes = 0
    for spec in specs:
        if spec.name in provided:
            buffer = provided[spec.name]
            _check_out_buffer(layout, spec, buffer)
        else:
            buffer = empty_buffer(spec.shape, spec.dtype)
        result[spec.name] = buffer
        if spec.nbytes:
            jobs.append((spec.start, byte_view(buffer)))
            nbytes += spec.nbytes
    jobs.sort(key=itemgetter(0))
    return ReadPlan(result, jobs, nbytes)


def _check_out_buffer(layout: PayloadLayout, spec: EntrySpec, buffer: object) -> None:
    expected = f"a contiguous cpu {spec.dtype} tensor of shape {spec.shape}"
    if not isinstance(buffer, torch.Tensor) or isinstance(buffer, OpaqueTensor):
        raise T2NErrorMisuse(
            f"out[{spec.name!r}] must be {expected} to receive entry {spec.name!r} of "
            f"'{layout.path}', got {type(buffer).__name__}"
        )
    problems = []
    if buffer.dtype != spec.dtype:
        problems.append(f"dtype {buffer.dtype}")
    if tuple(buffer.shape) != spec.shape:
        problems.append(f"shape {tuple(buffer.shape)}")
    if buffer.device.type != "cpu":
        problems.append(f"device {buffer.device}")
    if buffer.layout != torch.strided or not buffer.is_contiguous():
        problems.append("a non-contiguous layout")
    if buffer.is_conj() or buffer.is_neg():
        problems.append("a pending conjugate or negative bit")
    if problems:
        raise T2NErrorMisuse(
            f"out[{spec.name!r}] must be {expected} to receive entry {spec.name!r} of "
            f"'{layout.path}', but it has {', '.join(problems)}; allocate it with "
            "storage.allocate(layout)"
        )


# ---------------------------------------------------------------------------------------------
# Write sources
# ---------------------------------------------------------------------------------------------
def prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Check the tensors to write and bring them to the CPU (other devices are copied).

    Non-contiguous CPU tensors are kept as they are; :func:`tensor_pieces` streams them.

    Raises:
        T2NErrorMisuse: not a mapping of str to plain strided tensors of a storable dtype.
    """
    if not isinstance(tensors, Mapping):
        raise T2NErrorMisuse(
            f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}"
        )
    prepared: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise T2NErrorMisuse(f"tensor names must be str, got {name!r}")
        if isinstance(tensor, OpaqueTensor):
            raise T2NErrorMisuse(
                f"tensor {name!r} is a {type(tensor).__name__}: write its offload state with "
                "storage.encode_opaque(value), or expand it with opaque_to_final_tensor() first"
            )
        if not isinstance(tensor, torch.Tensor):
            raise T2NErrorMisuse(
                f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        refuse_unstorable(tensor, f"tensor {name!r}")
        if tensor.device.type == "meta":
            raise T2NErrorMisuse(f"tensor {name!r} is on the meta device and holds no data")
        dtype_code(tensor.dtype)
        value = tensor.detach()
        if value.device.type != "cpu":
            value = value.to("cpu")
        if value.is_conj():
            value = value.resolve_conj()
        if value.is_neg():
            value = value.resolve_neg()
        prepared.append((name, value))
    return prepared


def tensor_pieces(tensor: torch.Tensor, staging_bytes: int = STAGING_BYTES) -> Iterator[memoryview]:
    """The bytes of a CPU tensor in logical (row-major) order, as successive byte views.

    A contiguous tensor is one view of its own memory. A non-contiguous one is copied slab by
    slab through a staging buffer of at most ``staging_bytes`` (or one row of it), which is
    reused: consume each view before asking for the next.
    """
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        yield byte_view(tensor)
        return
    rows = tensor.shape[0]
    row_bytes = tensor[0].numel() * tensor.element_size()
    if row_bytes > staging_bytes and tensor.dim() > 1:
        for index in range(rows):
            yield from tensor_pieces(tensor[index], staging_bytes)
        return
    rows_per_slab = max(1, staging_bytes // row_bytes)
    staging = empty_buffer((min(rows_per_slab, rows), *tensor.shape[1:]), tensor.dtype)
    for first in range(0, rows, rows_per_slab):
        count = min(rows_per_slab, rows - first)
        slab = staging[:count]
        slab.copy_(tensor[first : first + count])
        yield byte_view(slab)
