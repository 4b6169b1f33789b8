"""Embedding lookups in an offloaded table read the rows they gather, not the table.

A decoding step looks up one row per token; a CPU table of a mapped payload is mapped without
reading anything, and the lookup faults in the pages of its rows only. Every read still sees
the latest written value, and a value the pool holds or is loading is taken from the pool.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import gc
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from breakpoints import paused_in_new_threads
from torch import nn

from torch_to_nnef.tensor import (
    ResidencyStrategy,
    TensorResidencyPool,
    offload_module,
    stream_modules,
)
from torch_to_nnef.tensor.offload import OffloadedTensor

ROWS, WIDTH = 4096, 256  # a 4 MiB table: mapped, not read, by default
IDS = torch.tensor([[3, 4095, 17, 3]])


def table(tmp_path: Path, seed: int = 0) -> tuple[torch.Tensor, OffloadedTensor]:
    torch.manual_seed(seed)
    dense = torch.randn(ROWS, WIDTH)
    return dense, OffloadedTensor.from_original_tensor(dense.clone(), "table", tmp_path)


def cached_fraction(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as view:
        page = mmap.PAGESIZE
        pages = -(-size // page)
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        try:
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0
        finally:
            del address
        return sum(byte & 1 for byte in vector) / pages


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_a_lookup_equals_the_dense_one_in_every_form(tmp_path: Path) -> None:
    dense, offloaded = table(tmp_path)
    expected = F.embedding(IDS, dense)
    module = nn.Embedding(ROWS, WIDTH, padding_idx=4095)
    module.weight = nn.Parameter(offloaded, requires_grad=False)
    with torch.no_grad():
        padded = F.embedding(IDS, dense, padding_idx=4095)
        assert torch.equal(module(IDS), padded)
    assert torch.equal(F.embedding(IDS, offloaded), expected)
    assert torch.equal(F.embedding(IDS, weight=offloaded), expected)
    assert torch.equal(F.embedding(input=IDS, weight=offloaded), expected)
    with (
        TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool,
        pool.scope(),
    ):
        assert torch.equal(F.embedding(IDS, offloaded), expected)
        assert torch.equal(module(IDS), padded)
        stats = pool.stats()
        assert (stats.misses, stats.loads, stats.bytes_read) == (0, 0, 0)
        assert not pool.is_resident(offloaded)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.timeout(60)
def test_a_lookup_reads_its_rows_from_the_disk_not_the_table(tmp_path: Path) -> None:
    rows, width = 16384, 1024  # 64 MiB
    weight = OffloadedTensor.from_original_tensor(torch.randn(rows, width), "big", tmp_path)
    path = weight.offload_path
    drop_from_page_cache(path)
    if cached_fraction(path) > 0.01:
        pytest.skip("this file system keeps the file's pages cached")
    ids = torch.tensor([0, 5000, 16383])
    gathered = F.embedding(ids, weight)
    assert cached_fraction(path) < 0.1  # three rows, each read with its page (or huge page)
    assert torch.equal(gathered, weight.reload()[ids])
    # The control: a load of the value reads the table.
    drop_from_page_cache(path)
    weight.reload().sum()
    assert cached_fraction(path) > 0.9


@pytest.mark.timeout(60)
def test_lookups_see_direct_writes_and_the_pools_changes(tmp_path: Path) -> None:
    dense, offloaded = table(tmp_path)
    offloaded[3] = 7.0  # a direct write, to the file
    dense[3] = 7.0
    assert torch.equal(F.embedding(IDS, offloaded), F.embedding(IDS, dense))
    with TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool:
        with pool.acquire(offloaded, mode="read_write") as value:
            value[17] = -1.0
        dense[17] = -1.0
        expected = F.embedding(IDS, dense)
        with pool.scope():  # the pool holds the changed value: the lookup takes it
            assert torch.equal(F.embedding(IDS, offloaded), expected)
        assert torch.equal(F.embedding(IDS, offloaded), expected)  # the unsaved change
        pool.evict(offloaded)  # written back (a job of the pool) while the next lookups run
        assert not pool.is_resident(offloaded)
        assert torch.equal(F.embedding(IDS, offloaded), expected)
        with pool.scope():
            assert torch.equal(F.embedding(IDS, offloaded), expected)
        pool.flush()
    assert torch.equal(F.embedding(IDS, offloaded), expected)
    assert torch.equal(offloaded.reload(), dense)


@pytest.mark.timeout(60)
def test_a_value_the_pool_is_loading_is_taken_from_the_pool(tmp_path: Path) -> None:
    dense, offloaded = table(tmp_path)
    with (
        paused_in_new_threads(OffloadedTensor._reload_unmanaged.__code__, on="call") as load,
        TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool,
        pool.scope(),
    ):
        load.armed.set()
        handle = pool.prefetch(offloaded)
        assert load.paused.wait(30)  # a worker is loading the value
        resume = threading.Timer(0.2, load.go)
        resume.start()
        try:
            assert torch.equal(F.embedding(IDS, offloaded), F.embedding(IDS, dense))
        finally:
            resume.join()
        handle.wait()
        stats = pool.stats()
        assert stats.loads == 1 and stats.hits + stats.misses == 1  # the lookup waited
        assert pool.is_resident(offloaded)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["outside", "scope"])
@pytest.mark.parametrize(
    "lookup",
    [F.embedding, functools.partial(F.embedding_bag, mode="sum")],
    ids=["embedding", "embedding_bag"],
)
def test_a_lookup_with_max_norm_writes_the_rows_it_renormalizes(
    tmp_path: Path, where: str, lookup: Callable[..., torch.Tensor]
) -> None:
    """max_norm renormalizes the rows a lookup gathers, in the table: an in-place write of
    the offloaded table, kept as any in-place op's (to the file outside a scope, as a
    read_write lease's change in one)."""
    dense, offloaded = table(tmp_path)
    with (
        TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool,
        pool.scope() if where == "scope" else contextlib.nullcontext(),
    ):
        got = lookup(IDS, offloaded, max_norm=1.0)
        assert torch.equal(got, lookup(IDS, dense, max_norm=1.0))  # dense renormed
        assert pool.stats().loads == (where == "scope")
        assert torch.equal(offloaded.reload(), dense)
    assert torch.equal(offloaded.reload(), dense)
    assert dense[IDS[0]].norm(dim=1).max() <= 1.0 + 1e-6  # the test's own premise


@pytest.mark.timeout(60)
def test_a_lookup_of_many_rows_reads_the_table_through_the_pool(tmp_path: Path) -> None:
    """A long prompt's prefill gathers many rows: one sequential read of the table costs less
    than a page fault per row, on a cold page cache."""
    dense, offloaded = table(tmp_path)
    many = torch.arange(ROWS // 64 + 1)
    with TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool, pool.scope():
        assert torch.equal(F.embedding(many, offloaded), F.embedding(many, dense))
        assert pool.stats().loads == 1
        assert torch.equal(F.embedding(IDS, offloaded), F.embedding(IDS, dense))  # held: a hit
        assert pool.stats().loads == 1


@pytest.mark.usefixtures("buffered_reads")
@pytest.mark.timeout(60)
def test_without_mapped_reads_the_pool_serves_the_table(tmp_path: Path) -> None:
    dense, offloaded = table(tmp_path)
    with TensorResidencyPool(max_cached_bytes=10 * 2**20) as pool, pool.scope():
        for _ in range(2):
            assert torch.equal(F.embedding(IDS, offloaded), F.embedding(IDS, dense))
        stats = pool.stats()
        assert (stats.loads, stats.hits) == (1, 1)


class TiedLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, ROWS, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.timeout(60)
def test_a_module_stream_reads_ahead_no_table_that_is_only_looked_up(
    tmp_path: Path, tied: bool
) -> None:
    torch.manual_seed(0)
    dense = TiedLM(tied).eval().requires_grad_(False)
    expected = dense(IDS)
    model = offload_module(TiedLM(tied).eval().requires_grad_(False), tmp_path)
    model.load_state_dict(dense.state_dict(), strict=True)
    table_bytes = ROWS * WIDTH * 4
    with (
        TensorResidencyPool(
            max_cached_bytes=3 * table_bytes, strategy=ResidencyStrategy.SCHEDULED
        ) as pool,
        stream_modules(pool, [model.embed, model.body, model.head], depth=1) as stream,
        pool.scope(),
    ):
        assert stream.groups[0] == []
        assert any(t is model.embed.weight for t in stream.groups[2]) is tied
        for _ in range(3):
            assert torch.equal(model(IDS), expected)
        read = pool.stats().bytes_read
        # The head's weight (the table itself when tied) and the body are read; an untied
        # table never is.
        body = WIDTH * WIDTH * 4 + WIDTH * 4
        assert read == table_bytes + body


@pytest.mark.timeout(60)
def test_a_trace_records_the_tables_expansion(tmp_path: Path) -> None:
    """Under torch.jit.trace a lookup expands the table as every op does: the graph holds an
    expansion of each offloaded tensor (the export reads them), not a mapped constant."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Embedding(ROWS, WIDTH), nn.Linear(WIDTH, 8)).eval()
    dense.requires_grad_(False)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, IDS)
    assert str(traced.inlined_graph).count("opaque_tensor_expand") == 3
    assert torch.equal(traced(IDS), dense(IDS))


@pytest.mark.timeout(60)
def test_a_lookup_in_a_table_with_force_gc_collect_collects(tmp_path: Path) -> None:
    dense = torch.randn(ROWS, WIDTH)
    eager = OffloadedTensor(dense, "cpu", tmp_path, "eager", torch.Tensor, force_gc_collect=True)
    collections: list[str] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(phase)

    gc.disable()
    gc.callbacks.append(on_gc)
    try:
        assert torch.equal(F.embedding(IDS, eager), F.embedding(IDS, dense))
        assert len(collections) == 1
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
