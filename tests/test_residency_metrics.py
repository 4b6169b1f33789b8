"""What ``stats()`` says about prefetching (stall time, wasted reads, bytes per request), and
the warning of a pool that served nothing while its model ran outside it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from torch_to_nnef.tensor import TensorResidencyPool, offload_module
from torch_to_nnef.tensor.offload import OffloadedTensor

NUMEL = 256
NBYTES = NUMEL * 4


def tensors(directory: Path, count: int) -> list[OffloadedTensor]:
    return [
        OffloadedTensor.from_original_tensor(torch.full((NUMEL,), float(i)), f"w{i}", directory)
        for i in range(count)
    ]


def test_a_prefetch_evicted_before_any_request_is_a_wasted_read(tmp_path: Path) -> None:
    a, b, c = tensors(tmp_path, 3)
    with TensorResidencyPool(max_cached_bytes=NBYTES) as pool:
        pool.prefetch(a).wait()
        pool.prefetch(b).wait()  # evicts a, never requested: one read for nothing
        assert pool.resolve(b)[0].item() == 1.0  # a hit: b's read served a request
        pool.prefetch(c).wait()  # evicts b, which was used
        assert pool.stats().wasted_prefetches == 1
        with pool.acquire(c) as value:  # a hit on the prefetched c
            assert value[0].item() == 2.0
        stats = pool.stats()
    assert (stats.loads, stats.hits, stats.misses) == (3, 2, 0)
    assert stats.wasted_prefetches == 1
    assert stats.stall_seconds == 0.0  # every request found its value resident
    assert stats.bytes_read_per_request == 3 * NBYTES / 2


def test_a_prefetch_used_by_hits_then_written_over_is_no_wasted_read(tmp_path: Path) -> None:
    (a,) = tensors(tmp_path, 1)
    with TensorResidencyPool() as pool:
        pool.prefetch(a).wait()
        assert pool.resolve(a)[0].item() == 0.0  # a hit, served without the loop thread
        with pool.acquire(a) as value:  # another
            assert value[0].item() == 0.0
        a.update_values(torch.full((NUMEL,), 5.0))  # the prefetched value is now stale
        assert pool.resolve(a)[0].item() == 5.0  # drops it, loads the new payload
        assert pool.stats().wasted_prefetches == 0


def test_a_prefetch_left_unused_at_close_is_wasted_too(tmp_path: Path) -> None:
    (a,) = tensors(tmp_path, 1)
    pool = TensorResidencyPool()
    with pool:
        pool.prefetch(a).wait()
    assert pool.stats().wasted_prefetches == 1
    assert pool.stats().bytes_read_per_request == 0.0  # no request


def test_stall_counts_the_time_requests_wait_for_loads(tmp_path: Path) -> None:
    a, b = tensors(tmp_path, 2)
    with TensorResidencyPool() as pool:
        started = time.perf_counter()
        assert pool.resolve(a)[0].item() == 0.0  # a miss, from this thread
        with pool.acquire(b) as value:  # another miss
            waited = time.perf_counter() - started
            assert value[0].item() == 1.0
        stall = pool.stats().stall_seconds
        assert 0.0 < stall <= waited
        pool.resolve(a)
        with pool.acquire(b):
            pass
        assert pool.stats().stall_seconds == stall  # hits wait for no load
        assert pool.stats().wasted_prefetches == 0


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_stall_of_async_requests(tmp_path: Path) -> None:
    a, b = tensors(tmp_path, 2)
    async with TensorResidencyPool() as pool:
        started = time.perf_counter()
        assert (await pool.aresolve(a))[0].item() == 0.0
        async with pool.acquire(b) as value:
            waited = time.perf_counter() - started
            assert value[0].item() == 1.0
        stall = pool.stats().stall_seconds
        assert 0.0 < stall <= waited
        await pool.aresolve(a)
        assert pool.stats().stall_seconds == stall


def test_a_pool_that_served_nothing_while_its_model_ran_outside_it_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = offload_module(torch.nn.Linear(8, 8), tmp_path)
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, "torch_to_nnef.tensor.residency"):
        with TensorResidencyPool():
            model(x)  # forgot `pool.scope()`: the weights are read from disk, unserved
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1
        for words in ("closed without serving any value", "2 offloaded tensor load(s)"):
            assert words in warnings[0]
        assert "`with pool.scope():`" in warnings[0]

        caplog.clear()
        with TensorResidencyPool() as pool, pool.scope():
            model(x)  # served: no warning
        with TensorResidencyPool():
            pass  # nothing ran: no warning
        assert caplog.records == []
