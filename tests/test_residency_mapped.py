"""The pool's CPU loads map payload files: values equal, no copy kept, mappings end on eviction."""

from __future__ import annotations

import copy
import gc
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from breakpoints import Breakpoint, breakpoints_in_new_threads, line_of, paused_in_new_threads
from forking import FORKS, outcomes
from residency_checks import check_invariants, on_disk
from torch import nn

from torch_to_nnef.tensor import (
    OffloadedTensor,
    ResidencyStrategy,
    TensorResidencyPool,
    offload_module,
    storage,
)
from torch_to_nnef.tensor.residency._actor import Actor

needs_proc_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


def mappings_under(directory: Path) -> int:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(str(directory) in line for line in lines)


@needs_proc_maps
@pytest.mark.timeout(60)
def test_pool_loads_map_the_files_and_unmap_on_eviction(tmp_path: Path) -> None:
    assert storage.mapped_reads()  # the default where private mappings exist
    torch.manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8))).eval().requires_grad_(False)
    x = torch.randn(3, 256)
    expected = dense(x)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    layer = 256 * 256 * 4 + 256 * 4
    with (
        TensorResidencyPool(max_cached_bytes=2 * layer, strategy=ResidencyStrategy.LRU) as pool,
        pool.scope(),
    ):
        for _ in range(3):
            assert torch.equal(model(x), expected)
        stats = pool.stats()
        # A cyclic pass bigger than the budget: loads of weights map (biases, under the
        # mapping threshold, are read), nothing is reused, and at most the retained values
        # (and the ones in use) stay mapped.
        assert stats.loads > 16 and stats.reused_buffers == 0
        gc.collect()
        assert 0 < mappings_under(tmp_path) <= 16
    del model
    gc.collect()
    assert mappings_under(tmp_path) == 0


@pytest.mark.usefixtures("buffered_reads")
@pytest.mark.timeout(60)
def test_switched_off_the_pool_reads_into_reused_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8))).eval().requires_grad_(False)
    x = torch.randn(3, 64)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    with (
        TensorResidencyPool(
            max_cached_bytes=2 * 64 * 64 * 4, strategy=ResidencyStrategy.LRU
        ) as pool,
        pool.scope(),
    ):
        for _ in range(3):
            assert torch.equal(model(x), dense(x))
        assert pool.stats().reused_buffers > 0
        assert mappings_under(tmp_path) == 0


@needs_proc_maps
@pytest.mark.timeout(60)
def test_switching_mapped_reads_while_a_pool_holds_values_reads_into_none_of_their_pages(
    tmp_path: Path,
) -> None:
    """Mapped reads switched off, then on, while a pool holds values loaded the other way:
    a value that maps its file is never read into (the pool once took its pages, evicted
    while mapped reads were off, for the next load's buffer: the pages turned into private
    copies of the next tensor's values, and the mapping stayed), and one read into buffers
    before mapped reads came on is not read into after (loads map then)."""
    layer = 256 * 256 * 4
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((256, 256), float(i)), f"w{i}", tmp_path)
        for i in range(4)
    ]
    with TensorResidencyPool(max_cached_bytes=layer) as pool:
        assert storage.mapped_reads()
        pool.resolve(tensors[0])  # mapped
        assert mappings_under(tmp_path) == 1
        previous = storage.set_mapped_reads(False)
        try:
            pool.resolve(tensors[1])  # read into a buffer; evicts the mapped value
            pool.resolve(tensors[2])  # into a new buffer: tensors[1]'s is still in use
            gc.collect()
            assert mappings_under(tmp_path) == 0  # tensors[0]'s mapping ended with its value
            assert pool.stats().reused_buffers == 0
            assert torch.equal(pool.resolve(tensors[3]), torch.full((256, 256), 3.0))
            assert pool.stats().reused_buffers == 1  # tensors[1]'s buffer
        finally:
            storage.set_mapped_reads(previous)
        assert torch.equal(pool.resolve(tensors[0]), torch.full((256, 256), 0.0))
        assert pool.stats().reused_buffers == 1  # mapped: tensors[2]'s buffer is not read into
        assert mappings_under(tmp_path) == 1


def deleted_files_mapped(directory: Path) -> list[str]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in lines if str(directory) in line and line.endswith("(deleted)")]


def no_deleted_file_mapped_soon(directory: Path) -> bool:
    """Whether no mapping of a replaced file of ``directory`` is left, within 10 s (a pool
    maps the file a write-back wrote in a job of its own)."""
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        if not deleted_files_mapped(directory):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@needs_proc_maps
@pytest.mark.timeout(60)
def add_one_under_a_lease(pool: TensorResidencyPool, tensor: OffloadedTensor) -> None:
    """Change ``tensor`` through a ``read_write`` lease of ``pool``; the value the lease
    handed out is dropped on return (a reference kept would keep the file it maps)."""
    with pool.acquire(tensor, mode="read_write") as value:
        value.add_(1)


def test_a_value_written_back_and_kept_maps_the_new_file_not_the_replaced_one(
    tmp_path: Path,
) -> None:
    """A mapped value changed by a ``read_write`` lease and flushed stays resident: the pool
    serves it from the file written, so that no mapping keeps the replaced file (and its
    disk space) alive. A thread reading it while the flushes run (not while the leases
    change it: leases of one pool share its value) sees each written value whole."""
    numel = storage.MAPPED_MIN_BYTES  # four times the mapping threshold, in float32
    tensors = [
        OffloadedTensor.from_original_tensor(torch.full((numel,), float(i)), f"w{i}", tmp_path)
        for i in range(3)
    ]
    done, changing = threading.Event(), threading.Lock()
    torn: list[str] = []
    reads = 0

    def read() -> None:
        nonlocal reads
        while not done.is_set():
            for tensor in tensors:
                with changing, pool.acquire(tensor) as value:
                    if value.min() != value.max():
                        torn.append(tensor.name)
                    reads += 1

    with TensorResidencyPool(max_cached_bytes=1 << 30) as pool:
        reader = threading.Thread(target=read)
        reader.start()
        try:
            for _ in range(5):
                with changing:
                    for tensor in tensors:
                        add_one_under_a_lease(pool, tensor)
                pool.flush()
        finally:
            done.set()
            reader.join(30)
        assert not reader.is_alive() and not torn and reads
        assert all(pool.is_resident(tensor) for tensor in tensors)
        assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
        for index, tensor in enumerate(tensors):
            expected = torch.full((numel,), float(index + 5))
            assert torch.equal(pool.resolve(tensor), expected)
            assert torch.equal(tensor._reload_unmanaged(), expected)
        assert pool.stats().write_backs == 15


@needs_proc_maps
@pytest.mark.timeout(60)
def test_a_value_leased_through_its_write_back_maps_the_new_file_once_the_lease_ends(
    tmp_path: Path,
) -> None:
    numel = storage.MAPPED_MIN_BYTES
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(numel), "w", tmp_path)
    with TensorResidencyPool(max_cached_bytes=1 << 30) as pool:
        add_one_under_a_lease(pool, tensor)
        with pool.acquire(tensor) as held:
            pool.flush()  # written while the lease holds the value: it keeps the old file
            time.sleep(0.2)
            gc.collect()
            assert len(deleted_files_mapped(tmp_path)) == 1
            assert torch.equal(held, torch.ones(numel))
        del held
        # The lease's end tells the pool, which serves the value mapping the new file.
        assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
        assert torch.equal(pool.resolve(tensor), torch.ones(numel))


@needs_proc_maps
@pytest.mark.timeout(60)
def test_a_value_whose_eviction_a_lease_took_back_maps_the_file_written(tmp_path: Path) -> None:
    """A changed value pushed out by the budget, taken back by a lease while its write-back
    runs: it stays, and maps the file written once the lease ended."""
    numel = storage.MAPPED_MIN_BYTES
    changed = OffloadedTensor.from_original_tensor(torch.zeros(numel), "changed", tmp_path)
    other = OffloadedTensor.from_original_tensor(torch.zeros(numel), "other", tmp_path)
    with (
        paused_in_new_threads(OffloadedTensor._write_back.__code__, on="call") as point,
        TensorResidencyPool(max_cached_bytes=numel * 4) as pool,  # one value
    ):
        add_one_under_a_lease(pool, changed)
        point.armed.set()  # the write-back of the eviction below pauses
        pool.resolve(other)  # pushes the changed value out
        assert point.paused.wait(10)
        with pool.acquire(changed) as held:  # takes it back, its write-back still running
            point.go()
            assert torch.equal(held, torch.ones(numel))
        del held
        assert pool.is_resident(changed)
        assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
        assert torch.equal(pool.resolve(changed), torch.ones(numel))
    assert torch.equal(changed._reload_unmanaged(), torch.ones(numel))


@needs_proc_maps
@pytest.mark.timeout(60)
def test_a_value_loaded_mapped_maps_the_file_written_with_mapped_reads_off_since(
    tmp_path: Path,
) -> None:
    numel = storage.MAPPED_MIN_BYTES
    tensor = OffloadedTensor.from_original_tensor(torch.zeros(numel), "w", tmp_path)
    with TensorResidencyPool() as pool:
        pool.resolve(tensor)  # mapped
        previous = storage.set_mapped_reads(False)
        try:
            add_one_under_a_lease(pool, tensor)
            pool.flush()
            assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
            assert torch.equal(pool.resolve(tensor), torch.ones(numel))
        finally:
            storage.set_mapped_reads(previous)


@needs_proc_maps
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fork", sorted(FORKS))
@pytest.mark.parametrize("moment", ["mapping", "swapping"])
def test_a_child_forked_while_a_written_value_is_mapped_again_serves_and_writes_it(
    tmp_path: Path, fork: str, moment: str
) -> None:
    """The fork comes while the parent's pool maps again a value it wrote back and keeps:
    as a worker maps the file written (``mapping``: it holds the tensor's write lock), or as
    the loop thread swaps the value for that mapping (``swapping``). In the child, the
    parent's pool answers its reads and says it was forked, the tensor reads the value
    written, and a new pool serves it and writes the child's change, which the child reads
    from then on. In the parent, the value maps the new file, and a later change is
    written."""
    numel = storage.MAPPED_MIN_BYTES // 4  # float32: mapped as it loads
    t = OffloadedTensor.from_original_tensor(torch.zeros(numel), "w", tmp_path)
    if moment == "mapping":
        code, text = OffloadedTensor._map_written, "host = storage.load_payload"
    else:
        code, text = Actor._remap, "entry.value = mapping"
    point = Breakpoint(code.__code__, on="line", line=line_of(code, text))
    with breakpoints_in_new_threads(point), TensorResidencyPool(max_cached_bytes=1 << 30) as pool:
        try:
            add_one_under_a_lease(pool, t)
            point.armed.set()
            pool.flush()  # written: the value stays, and is mapped again from the file written
            assert point.paused.wait(10)

            def child() -> str:
                seen = [float(t.reload()[0]), float((t + 0)[-1])]
                with TensorResidencyPool() as own:
                    seen.append(float(own.resolve(t)[0]))
                    add_one_under_a_lease(own, t)
                    own.flush()
                    seen += [float(on_disk(t)[-1]), float(t.reload()[0])]
                    seen.append(float(own.resolve(t)[-1]))
                parents = outcomes(lambda: repr(pool), lambda: pool.is_resident(t))
                return f"{seen},{parents},{outcomes(lambda: pool.resolve(t))}"

            report = FORKS[fork](child)
        finally:
            point.go()
        assert report == f"{[1.0] * 3 + [2.0] * 3},returned,returned,forked"
        assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
        assert pool.is_resident(t) and "leased: 0," in repr(pool)
        check_invariants(pool)
        assert torch.equal(pool.resolve(t), torch.ones(numel))
        add_one_under_a_lease(pool, t)
        pool.flush()
        assert torch.equal(on_disk(t), torch.full((numel,), 2.0))
        assert no_deleted_file_mapped_soon(tmp_path), deleted_files_mapped(tmp_path)
        assert torch.equal(pool.resolve(t), torch.full((numel,), 2.0))
    assert torch.equal(t.reload(), torch.full((numel,), 2.0))
