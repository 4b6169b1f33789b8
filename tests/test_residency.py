"""The residency pool's documented semantics, through its sync and async faces."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import gc
import itertools
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from breakpoints import paused_in_new_threads
from forking import in_forked_child
from interrupts import signalled
from residency_checks import check_invariants

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    PoolStats,
    ResidencyStrategy,
    TensorResidencyPool,
    _pool,
    _runtime,
    active_tensor_residency,
)
from torch_to_nnef.tensor.residency._runtime import Runtime

NUMEL = 256  # float32: 1 KiB per tensor
KIB = NUMEL * 4


def make_tensors(directory: Path, count: int, numel: int = NUMEL) -> list[OffloadedTensor]:
    return [
        OffloadedTensor.from_original_tensor(
            torch.full((numel,), float(i)), f"layer.{i}.weight", offload_dir=directory
        )
        for i in range(count)
    ]


# ---------------------------------------------------------------------------------------------
# One adapter per face, so that each semantic test runs through both.
# ---------------------------------------------------------------------------------------------
class AsyncFace:
    """The async twins, awaited in the loop the pool runs on (`async with pool`)."""

    name = "async"

    def __init__(self, pool: TensorResidencyPool) -> None:
        self.pool = pool

    async def resolve(self, t: OffloadedTensor, device: Any = None) -> torch.Tensor:
        return await self.pool.aresolve(t, device)

    @contextlib.asynccontextmanager
    async def acquire(self, t: OffloadedTensor, mode: str = "read") -> AsyncIterator[torch.Tensor]:
        async with self.pool.acquire(t, mode=mode) as value:  # type: ignore[arg-type]
            yield value

    async def prefetch(self, t: OffloadedTensor) -> torch.Tensor:
        return await self.pool.prefetch(t)

    async def pin(self, t: OffloadedTensor) -> torch.Tensor:
        return await self.pool.pin(t)

    async def unpin(self, t: OffloadedTensor) -> None:
        await self.pool.aunpin(t)

    async def evict(self, t: OffloadedTensor) -> None:
        await self.pool.aevict(t)

    async def flush(self, t: OffloadedTensor | None = None) -> None:
        await self.pool.aflush(t)

    async def close(self) -> None:
        await self.pool.aclose()


class SyncFace:
    """The sync methods, called from a worker thread while the pool runs its own loop thread."""

    name = "sync"

    def __init__(self, pool: TensorResidencyPool) -> None:
        self.pool = pool

    @staticmethod
    async def _run(func: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(func)

    async def resolve(self, t: OffloadedTensor, device: Any = None) -> torch.Tensor:
        return await self._run(lambda: self.pool.resolve(t, device))  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def acquire(self, t: OffloadedTensor, mode: str = "read") -> AsyncIterator[torch.Tensor]:
        lease = self.pool.acquire(t, mode=mode)  # type: ignore[arg-type]
        value = await self._run(lease.__enter__)
        try:
            yield value
        finally:
            await self._run(lambda: lease.__exit__(None, None, None))

    async def prefetch(self, t: OffloadedTensor) -> torch.Tensor:
        return await self._run(lambda: self.pool.prefetch(t).wait())  # type: ignore[no-any-return]

    async def pin(self, t: OffloadedTensor) -> torch.Tensor:
        return await self._run(lambda: self.pool.pin(t).wait())  # type: ignore[no-any-return]

    async def unpin(self, t: OffloadedTensor) -> None:
        await self._run(lambda: self.pool.unpin(t))

    async def evict(self, t: OffloadedTensor) -> None:
        await self._run(lambda: self.pool.evict(t))

    async def flush(self, t: OffloadedTensor | None = None) -> None:
        await self._run(lambda: self.pool.flush(t))

    async def close(self) -> None:
        await self._run(self.pool.close)


@contextlib.asynccontextmanager
async def open_pool(face_name: str, **options: Any) -> AsyncIterator[AsyncFace | SyncFace]:
    pool = TensorResidencyPool(**options)
    if face_name == "async":
        async with pool:
            yield AsyncFace(pool)
            check_invariants(pool)
    else:
        with pool:
            yield SyncFace(pool)
            check_invariants(pool)
    assert pool.closed


faces = pytest.mark.parametrize("face_name", ["async", "sync"])
pytestmark = [pytest.mark.timeout(60)]


# ---------------------------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_cached_bytes": -1}, "a size cannot be negative, got -1"),
        ({"max_cached_bytes": True}, "a size must be an int (bytes) or a str such as"),
        ({"max_cached_bytes": 1.5}, "a size must be an int (bytes) or a str such as"),
        ({"max_workers": 0}, "max_workers must be an int >= 1, got 0"),
        ({"max_workers": True}, "max_workers must be an int >= 1, got True"),
        ({"strategy": "lru"}, "strategy must be a ResidencyStrategy"),
        (
            {"use_uvloop": "no"},
            "use_uvloop must be True, False or None (as the environment says), got 'no'",
        ),
    ],
)
def test_constructor_validates_its_arguments(options: dict[str, Any], message: str) -> None:
    with pytest.raises(T2NErrorMisuse, match=re.escape(message)):
        TensorResidencyPool(**options)


def test_requests_validate_mode_and_source(tmp_path: Path) -> None:
    (t,) = make_tensors(tmp_path, 1)
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorMisuse, match=r"^mode must be 'read' or 'read_write', got 'w'$"):
            pool.acquire(t, mode="w")  # type: ignore[arg-type]
        plain = torch.zeros(3)
        for call in (pool.resolve, pool.prefetch, pool.acquire, pool.evict, pool.pin, pool.unpin):
            with pytest.raises(
                T2NErrorMisuse,
                match=r"^TensorResidencyPool only manages OffloadedTensor values; got Tensor",
            ):
                call(plain)  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# LRU
# ---------------------------------------------------------------------------------------------
@faces
@pytest.mark.asyncio
async def test_lru_caches_and_evicts_least_recently_used(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 4)
    async with open_pool(face_name, max_cached_bytes=2 * KIB) as face:
        pool = face.pool
        assert torch.equal(await face.resolve(ts[0]), torch.full((NUMEL,), 0.0))
        await face.resolve(ts[1])
        await face.resolve(ts[0])  # hit: t0 becomes most recently used
        await face.resolve(ts[2])  # evicts t1
        check_invariants(pool)
        assert [pool.is_resident(t) for t in ts] == [True, False, True, False]
        assert pool.resident_bytes == 2 * KIB
        stats = pool.stats()
        assert isinstance(stats, PoolStats)
        assert (stats.hits, stats.misses, stats.loads, stats.evictions) == (1, 3, 3, 1)
        assert stats.bytes_read == 3 * KIB and stats.load_errors == 0


@faces
@pytest.mark.asyncio
async def test_unbounded_pool_keeps_everything(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 5)
    async with open_pool(face_name) as face:
        for t in ts:
            await face.resolve(t)
        assert all(face.pool.is_resident(t) for t in ts)
        assert face.pool.resident_bytes == 5 * KIB


@faces
@pytest.mark.asyncio
async def test_leased_values_stay_above_the_soft_budget(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 3)
    async with open_pool(face_name, max_cached_bytes=KIB) as face:
        pool = face.pool
        async with face.acquire(ts[0]) as v0, face.acquire(ts[1]) as v1:
            assert float(v0[0]) == 0.0 and float(v1[0]) == 1.0
            assert pool.resident_bytes == 2 * KIB  # above budget: both are leased
            check_invariants(pool)
            with pytest.raises(T2NErrorMisuse, match="while it is leased: release its lease"):
                await face.evict(ts[0])
        check_invariants(pool)
        assert pool.resident_bytes == KIB


@faces
@pytest.mark.asyncio
async def test_pins_are_idempotent_and_survive_pressure(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 3)
    async with open_pool(face_name, max_cached_bytes=KIB) as face:
        pool = face.pool
        assert float((await face.pin(ts[0]))[0]) == 0.0
        await face.pin(ts[0])
        assert pool.is_pinned(ts[0])
        await face.resolve(ts[1])
        await face.resolve(ts[2])
        assert pool.is_resident(ts[0]) and pool.is_pinned(ts[0])
        with pytest.raises(T2NErrorMisuse, match="while it is pinned: unpin it first"):
            await face.evict(ts[0])
        await face.unpin(ts[0])
        assert not pool.is_pinned(ts[0])
        check_invariants(pool)
        assert pool.resident_bytes <= KIB


@faces
@pytest.mark.asyncio
async def test_oversized_values_are_delivered_but_not_retained(
    tmp_path: Path, face_name: str
) -> None:
    small, big = make_tensors(tmp_path, 1)[0], make_tensors(tmp_path / "big", 1, numel=4 * NUMEL)[0]
    async with open_pool(face_name, max_cached_bytes=2 * KIB) as face:
        pool = face.pool
        await face.resolve(small)
        async with face.acquire(big) as value:
            assert value.numel() == 4 * NUMEL
            # Kept while leased, outside the budget: the cached small value stays.
            assert pool.is_resident(big) and pool.is_resident(small)
            check_invariants(pool)
        assert not pool.is_resident(big)
        assert pool.is_resident(small), "releasing an oversized value must not flush the cache"
        prefetched = await face.prefetch(big)
        assert prefetched.numel() == 4 * NUMEL and not pool.is_resident(big)
        assert pool.is_resident(small), "an unretained value must leave before retained ones"
        await face.pin(big)
        assert pool.is_resident(big)
        await face.unpin(big)
        assert not pool.is_resident(big)
        check_invariants(pool)


# ---------------------------------------------------------------------------------------------
# FIXED
# ---------------------------------------------------------------------------------------------
@faces
@pytest.mark.asyncio
async def test_fixed_keeps_its_first_fit_set(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 4)
    async with open_pool(
        face_name, max_cached_bytes=2 * KIB, strategy=ResidencyStrategy.FIXED
    ) as face:
        pool = face.pool
        for _ in range(3):
            for t in ts:
                await face.resolve(t)
        assert [pool.is_resident(t) for t in ts] == [True, True, False, False]
        async with face.acquire(ts[3]) as value:
            assert float(value[0]) == 3.0 and pool.is_resident(ts[3])
        assert not pool.is_resident(ts[3])
        stats = pool.stats()
        assert stats.hits == 4 and stats.loads == 2 + 3 * 2 + 1
        for method in (pool.pin, pool.unpin, pool.is_pinned):
            with pytest.raises(T2NErrorMisuse, match=r"not supported by ResidencyStrategy\.FIXED"):
                method(ts[0])
        await face.evict(ts[0])  # frees capacity for a later admission
        await face.resolve(ts[2])
        assert pool.is_resident(ts[2])
        check_invariants(pool)


# ---------------------------------------------------------------------------------------------
# read_write leases and write-back
# ---------------------------------------------------------------------------------------------
@faces
@pytest.mark.asyncio
async def test_read_write_values_are_written_back_on_eviction_flush_and_close(
    tmp_path: Path, face_name: str
) -> None:
    ts = make_tensors(tmp_path, 3)
    async with open_pool(face_name, max_cached_bytes=KIB) as face:
        pool = face.pool
        async with face.acquire(ts[0], mode="read_write") as value:
            value.add_(10)
        await face.resolve(ts[1])  # evicts t0: written back first, then dropped
        await face.flush()  # waits for that write-back
        assert not pool.is_resident(ts[0])
        assert torch.equal(ts[0]._reload_unmanaged(), torch.full((NUMEL,), 10.0))
        async with face.acquire(ts[1], mode="read_write") as value:
            value.add_(20)
        await face.flush()
        assert torch.equal(ts[1]._reload_unmanaged(), torch.full((NUMEL,), 21.0))
        assert pool.is_resident(ts[1])
        async with face.acquire(ts[1], mode="read_write") as value:
            value.mul_(2)
        stats = pool.stats()
        assert stats.write_backs == 2 and stats.bytes_written == 2 * KIB
    assert torch.equal(ts[1]._reload_unmanaged(), torch.full((NUMEL,), 42.0))


@faces
@pytest.mark.asyncio
async def test_read_leases_never_write(tmp_path: Path, face_name: str) -> None:
    ts = make_tensors(tmp_path, 2)
    async with open_pool(face_name, max_cached_bytes=KIB) as face:
        async with face.acquire(ts[0]) as value:
            value.add_(5)  # a read lease: the change is not persisted
        await face.resolve(ts[1])
        assert face.pool.stats().write_backs == 0
    assert torch.equal(ts[0]._reload_unmanaged(), torch.full((NUMEL,), 0.0))


# ---------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------
@faces
@pytest.mark.asyncio
async def test_close_with_leases_raises_and_keeps_the_pool_usable(
    tmp_path: Path, face_name: str
) -> None:
    ts = make_tensors(tmp_path, 2)
    async with open_pool(face_name) as face:
        async with face.acquire(ts[0]):
            with pytest.raises(T2NErrorMisuse, match=r"while 1 value\(s\) are leased"):
                await face.close()
            assert float((await face.resolve(ts[1]))[0]) == 1.0
        await face.close()
        pool = face.pool
        for call in (
            lambda: pool.resolve(ts[0]),
            lambda: pool.prefetch(ts[0]),
            lambda: pool.acquire(ts[0]).__enter__(),
            lambda: pool.scope().__enter__(),
        ):
            with pytest.raises(T2NErrorMisuse, match="TensorResidencyPool is closed"):
                call()
        with pytest.raises(T2NErrorMisuse, match="TensorResidencyPool is closed"):
            await face.resolve(ts[1])


@pytest.mark.asyncio
async def test_two_closes_at_once_both_return_once_the_pool_closed(tmp_path: Path) -> None:
    """A shutdown task awaits aclose() while the `async with` block ends: the later close
    waits for the one under way (its write-backs), and both return with the pool closed."""
    ts = make_tensors(tmp_path, 4)
    pool = TensorResidencyPool(max_workers=1)
    closes: list[str] = []

    async def shutdown() -> None:
        await pool.aclose()
        closes.append("shutdown")

    async with anyio.create_task_group() as group:
        async with pool:
            for t in ts:  # dirty values: the close has write-backs to wait for
                async with pool.acquire(t, mode="read_write") as value:
                    value.mul_(2)
            group.start_soon(shutdown)
            await anyio.sleep(0)  # the shutdown's close begins first
        closes.append("exit")
    assert pool.closed and sorted(closes) == ["exit", "shutdown"]
    assert [float(t.reload()[0]) for t in ts] == [0.0, 2.0, 4.0, 6.0]
    # From threads too: each sync close returns once the pool is closed.
    others = make_tensors(tmp_path / "threads", 4)
    pool = TensorResidencyPool(max_workers=1)
    for t in others:
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1)
    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(anyio.to_thread.run_sync, pool.close)
    assert pool.closed
    assert [float(t.reload()[0]) for t in others] == [1.0, 2.0, 3.0, 4.0]


@faces
@pytest.mark.asyncio
async def test_one_tensor_cannot_be_resident_on_two_devices(tmp_path: Path, face_name: str) -> None:
    (t,) = make_tensors(tmp_path, 1)
    async with open_pool(face_name) as face:
        await face.resolve(t)
        with pytest.raises(T2NErrorMisuse, match="cannot be resident on two devices"):
            await face.resolve(t, "cuda:0")


@faces
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_cpu_with_an_index_is_the_one_cpu_device(tmp_path: Path, face_name: str) -> None:
    first, second = make_tensors(tmp_path, 2)
    second.to("cpu:0")  # a target named with an index
    assert second.target_device == torch.device("cpu")
    async with open_pool(face_name) as face:
        await face.resolve(first)
        for device in ("cpu:0", torch.device("cpu", 0), "cpu"):
            assert torch.equal(await face.resolve(first, device), torch.zeros(NUMEL))
        assert torch.equal(await face.resolve(second, "cpu"), torch.ones(NUMEL))
        assert face.pool.stats().loads == 2  # one value each, served again on "cpu:0"


@faces
@pytest.mark.asyncio
async def test_load_errors_reach_every_waiter_and_leave_no_entry(
    tmp_path: Path, face_name: str
) -> None:
    (t,) = make_tensors(tmp_path, 1)
    (path,) = tmp_path.glob("*.safetensors")
    moved = path.with_name("elsewhere")
    path.rename(moved)  # a missing payload file
    async with open_pool(face_name) as face:
        pool = face.pool
        results: list[BaseException] = []

        async def waiter() -> None:
            try:
                await face.resolve(t)
            except T2NErrorStorage as error:
                results.append(error)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(waiter)
        assert len(results) == 4
        assert not pool.is_resident(t) and pool._actor.entries == {}
        assert pool.stats().load_errors >= 1
        assert all(str(path) in str(e) for e in results)
        moved.rename(path)
        assert float((await face.resolve(t))[0]) == 0.0  # the next request retries


def test_repr_is_readable(tmp_path: Path) -> None:
    ts = make_tensors(tmp_path, 2)
    with TensorResidencyPool(max_cached_bytes=1 << 20) as pool:
        pool.resolve(ts[0])
        with pool.acquire(ts[1]):
            assert repr(pool) == (
                "<TensorResidencyPool LRU [resident: 2, leased: 1, bytes: 0.0 MiB / 1.0 MiB]>"
            )
    assert repr(pool).startswith("<TensorResidencyPool LRU [closed")


# ---------------------------------------------------------------------------------------------
# Scope and the sync shim on the loop thread
# ---------------------------------------------------------------------------------------------
def test_scope_routes_ops_through_the_pool(tmp_path: Path) -> None:
    weight = OffloadedTensor.from_original_tensor(torch.randn(4, 8), "w", offload_dir=tmp_path)
    dense = weight._reload_unmanaged()
    x = torch.randn(2, 8)
    assert active_tensor_residency() is None
    with TensorResidencyPool() as pool, pool.scope():
        assert active_tensor_residency() == (pool, None)
        for _ in range(3):
            assert torch.allclose(F.linear(x, weight), x @ dense.T)
        stats = pool.stats()
        assert (stats.misses, stats.hits, stats.loads) == (1, 2, 1)
    assert active_tensor_residency() is None


@pytest.mark.asyncio
async def test_a_scope_left_in_another_task_says_so_and_stays_in_its_own(tmp_path: Path) -> None:
    async with TensorResidencyPool(max_cached_bytes=1 << 20) as pool:
        scope = pool.scope()
        scope.__enter__()

        async def leave() -> None:
            scope.__exit__(None, None, None)

        with pytest.raises(T2NErrorMisuse, match="left in another asyncio task"):
            await asyncio.create_task(leave())
        assert active_tensor_residency() == (pool, None)  # the entering task's scope is intact
        with pool.scope():  # and nests as before
            assert active_tensor_residency() == (pool, None)


@pytest.mark.timeout(60)
def test_a_ctrl_c_anywhere_in_a_scope_leaves_it_unset() -> None:
    """A Ctrl-C at each point of a ``with pool.scope():`` block's code in turn, its
    KeyboardInterrupt kept (as an interactive session keeps the last one): no scope stays
    set. (As a generator, the scope once stayed set from a Ctrl-C landing just after it was
    set, or in the context manager's ``__enter__``.)

    Not checked: the one point where Python runs a pending handler before any code of
    ``__exit__`` (its entry), which no code of ``__exit__`` can guard."""
    with TensorResidencyPool() as pool:
        fired = []

        def block() -> None:
            with pool.scope():
                pass

        for n in itertools.count(1):
            context = contextvars.copy_context()
            signal_at, kept = context.run(signalled, n, _pool.__file__, block, False)
            assert (kept is not None) == signal_at.fired
            if not signal_at.fired:
                break
            fired.append(signal_at.where)
            if not signal_at.exit_entry:
                scope = context.run(active_tensor_residency)
                assert scope is None, f"a Ctrl-C at {signal_at.where} left the scope set"
        assert "c_return _Scope.__enter__" in fired and "c_return _Scope.__exit__" in fired


def test_a_scope_is_entered_once(tmp_path: Path) -> None:
    with TensorResidencyPool() as pool:
        scope = pool.scope()
        with scope:
            assert active_tensor_residency() == (pool, None)
            with pytest.raises(T2NErrorMisuse, match="entered once"), scope:
                pass
            assert active_tensor_residency() == (pool, None)
        assert active_tensor_residency() is None


@pytest.mark.asyncio
async def test_scope_follows_worker_threads_and_forwards_run_in_both_places(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    expected = model(x)
    for name, param in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        offloaded = OffloadedTensor.from_original_tensor(param.data, name, offload_dir=tmp_path)
        setattr(module, attr, torch.nn.Parameter(offloaded, requires_grad=False))
    async with TensorResidencyPool(max_cached_bytes=1 << 20) as pool:
        with pool.scope():
            # In a worker thread: the context (and the scope) follows it.
            in_thread = await anyio.to_thread.run_sync(model, x)
            assert torch.allclose(in_thread, expected, atol=1e-6)
            loads = pool.stats().loads
            assert loads == 4
            # On the loop thread: hits served inline, no deadlock.
            with caplog.at_level(logging.WARNING, "torch_to_nnef.tensor.residency"):
                assert torch.allclose(model(x), expected, atol=1e-6)
            assert pool.stats().loads == loads
            await pool.aevict(model[0].weight)
            with caplog.at_level(logging.WARNING, "torch_to_nnef.tensor.residency"):
                assert torch.allclose(model(x), expected, atol=1e-6)  # inline miss
                assert torch.allclose(model(x), expected, atol=1e-6)
            warnings = [r for r in caplog.records if "anyio.to_thread.run_sync" in r.getMessage()]
            assert len(warnings) == 1
        for blocking, twin in ((pool.flush, "aflush"), (pool.close, "aclose")):
            with pytest.raises(T2NErrorMisuse, match=rf"use `await pool\.{twin}\(\)`"):
                blocking()
        with pool.acquire(model[2].weight) as value:  # sync acquire on the loop thread
            assert value.shape == (4, 8)
        check_invariants(pool)


@pytest.mark.timeout(60)
def test_a_load_for_a_stranded_pool_says_nothing_of_a_blocked_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread of a loop closed inside `async with` drives the pool it left stranded,
    waiting for its own load: no loop is blocked, and no warning says one is."""
    t = OffloadedTensor.from_original_tensor(torch.ones(8), "t", offload_dir=tmp_path)
    pool = TensorResidencyPool()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(pool.__aenter__())
    loop.close()  # the block is never left
    with caplog.at_level(logging.WARNING, "torch_to_nnef.tensor.residency"):
        assert torch.equal(pool.resolve(t), torch.ones(8))
    assert not [r for r in caplog.records if "event-loop thread" in r.getMessage()]
    pool.close()
    assert pool.closed


@pytest.mark.asyncio
async def test_async_and_thread_faces_share_one_pool(tmp_path: Path) -> None:
    ts = make_tensors(tmp_path, 20)
    async with TensorResidencyPool(max_cached_bytes=5 * KIB, max_workers=2) as pool:

        def in_thread(i: int) -> float:
            with pool.acquire(ts[i]) as value:
                return float(value[0])

        async def request(i: int) -> None:
            if i % 2:
                assert await anyio.to_thread.run_sync(in_thread, i) == float(i)
            else:
                async with pool.acquire(ts[i]) as value:
                    assert float(value[0]) == float(i)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                for i in range(20):
                    tg.start_soon(request, i)
        check_invariants(pool)
        assert pool.stats().hits + pool.stats().misses == 60


# ---------------------------------------------------------------------------------------------
# Concurrency, cancellation, exit
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_threads_and_tasks_hammering_one_pool(tmp_path: Path) -> None:
    """Threads and tasks lease, resolve and prefetch 200 tensors of one small pool; every
    increment made through a ``read_write`` lease reaches the disk.

    Leases are shared, ``read_write`` ones included: two holders of one value (a thread and a
    task, or two threads) may run ``value.add_(1)`` at the same moment, and torch's kernel,
    which runs without the GIL, may then lose one of the two increments (four threads adding
    to one tensor 2000 times each were measured to end at 7998). Each increment holds its
    tensor's lock, as the soak's do, so that a mismatch on disk can only be the pool's.
    """
    import random
    import threading
    import time

    count = 200
    ts = make_tensors(tmp_path, count, numel=64)
    nbytes = 64 * 4
    increments = [0] * count
    locks = [threading.Lock() for _ in range(count)]  # one writer of a value at a time
    deadline = time.monotonic() + 3.0
    errors: list[BaseException] = []

    async with TensorResidencyPool(max_cached_bytes=40 * nbytes, max_workers=2) as pool:

        def thread_worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < deadline:
                    i = rng.randrange(count)
                    if rng.random() < 0.2:
                        with pool.acquire(ts[i], mode="read_write") as value, locks[i]:
                            value.add_(1)
                            increments[i] += 1
                    else:
                        assert float(pool.resolve(ts[i])[0]) >= i
            except BaseException as error:
                errors.append(error)

        async def task_worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                i = rng.randrange(count)
                if rng.random() < 0.2:
                    async with pool.acquire(ts[i], mode="read_write") as value:
                        with locks[i]:  # held for a moment: no await inside
                            value.add_(1)
                            increments[i] += 1
                elif rng.random() < 0.5:
                    pool.prefetch(ts[rng.randrange(count)])
                    await anyio.sleep(0)
                else:
                    assert float((await pool.aresolve(ts[i]))[0]) >= i

        async with anyio.create_task_group() as tg:
            for seed in range(4):
                tg.start_soon(anyio.to_thread.run_sync, thread_worker, seed)
            for seed in range(4):
                tg.start_soon(task_worker, 100 + seed)
        assert not errors
        check_invariants(pool)
    for i, t in enumerate(ts):
        assert torch.equal(t._reload_unmanaged(), torch.full((64,), float(i + increments[i])))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_cancelled_waiters_leave_no_lease_and_the_pool_keeps_serving(tmp_path: Path) -> None:
    import random

    ts = make_tensors(tmp_path, 30, numel=16 * 1024)
    rng = random.Random(7)
    async with TensorResidencyPool(max_cached_bytes=5 * 64 * 1024, max_workers=1) as pool:

        async def impatient(i: int) -> None:
            with anyio.move_on_after(rng.random() * 0.004):
                if i % 3 == 0:
                    await pool.aresolve(ts[i % 30])
                elif i % 3 == 1:
                    await pool.prefetch(ts[i % 30])
                else:
                    async with pool.acquire(ts[i % 30]):
                        await anyio.sleep(rng.random() * 0.002)

        for _ in range(5):
            async with anyio.create_task_group() as tg:
                for i in range(60):
                    tg.start_soon(impatient, i)
            check_invariants(pool)
        await pool.aflush()  # wait for the loads cancelled waiters left behind
        check_invariants(pool)
        assert all(
            (e.slot is None or e.slot.leases == 0) and e.waiters == 0
            for e in pool._actor.entries.values()
        )
        for i, t in enumerate(ts):
            async with pool.acquire(t) as value:
                assert float(value[0]) == float(i)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_async_with_pool_block_an_anyio_scope_cancels_still_closes_the_pool(
    tmp_path: Path,
) -> None:
    """An anyio cancel scope cancels every await inside it, the close of the block's exit
    included: the end of ``async with pool`` still closes the pool, its changes written.
    (The close was cancelled in turn: the pool stayed open, silently.)"""
    ts = make_tensors(tmp_path, 8, numel=1 << 16)
    pool = TensorResidencyPool()
    with anyio.CancelScope() as scope:
        async with pool:
            for t in ts:
                async with pool.acquire(t, mode="read_write") as value:
                    value.fill_(7.0)
            scope.cancel()  # a request's deadline, a server's shutdown
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert pool.closed and "leased: 0," in repr(pool)
    for t in ts:
        assert torch.equal(t.reload(), torch.full((1 << 16,), 7.0))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_cancel_of_asyncio_s_own_during_the_exit_s_close_is_raised_once_it_closed(
    tmp_path: Path,
) -> None:
    """A ``task.cancel()`` (an ``asyncio.timeout`` deadline, a failed sibling) landing while
    the end of ``async with pool`` closes the pool: the close runs to its end, then the
    cancellation goes on. (It cut the close: the pool stayed open, silently.)"""
    ts = make_tensors(tmp_path, 8, numel=1 << 16)
    pool = TensorResidencyPool(max_workers=1)

    async def serve() -> None:
        async with pool:
            for t in ts:
                async with pool.acquire(t, mode="read_write") as value:
                    value.fill_(7.0)
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_soon(task.cancel)  # at the close's first await

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(serve())
    assert pool.closed and "leased: 0," in repr(pool)
    for t in ts:
        assert torch.equal(t.reload(), torch.full((1 << 16,), 7.0))


def test_unclosed_sync_pool_does_not_hang_interpreter_exit(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    script = f"""
import torch
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
t = OffloadedTensor.from_original_tensor(torch.ones(1000), "w", offload_dir={str(tmp_path)!r})
pool = TensorResidencyPool(max_cached_bytes=1 << 20)
pool.resolve(t)
pool.prefetch(t)
print("ok", flush=True)
"""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert time.monotonic() - start < 30


def _saved_at_exit(tmp_path: Path, numel: int, fill: float, then: str) -> torch.Tensor:
    """Run a script that fills a tensor of ``numel`` zeros with ``fill`` under a
    ``read_write`` lease of a pool, runs the lines ``then`` and returns; give back the tensor's
    file as it was at exit (copied by a finalizer made after the tensor: finalizers pending at
    exit run after the pool's exit work, newest first, so before the tensor's file is
    removed)."""
    import subprocess
    import sys

    saved = tmp_path / "saved.bin"
    script = f"""
import gc, shutil, threading, time, weakref
import torch
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
t = OffloadedTensor.from_original_tensor(torch.zeros({numel}), "w", offload_dir={str(tmp_path)!r})
pool = TensorResidencyPool()
with pool.acquire(t, mode="read_write") as value:
    value.fill_({fill})
del value
class Anchor: pass
anchor = Anchor()
weakref.finalize(anchor, shutil.copy, t.offload_path, {str(saved)!r})
{then}
print("ok", flush=True)
"""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    (written,) = storage.read_payload(storage.read_layout(saved)).values()
    return written


@pytest.mark.timeout(120)
def test_a_write_back_queued_at_interpreter_exit_runs_to_its_end(tmp_path: Path) -> None:
    """A script that returns while the pool's workers are writing a value back exits only once
    the write reached the file (the workers are joined at exit; the loop thread is not)."""
    then = """
threading.Thread(target=pool.evict, args=(t,), daemon=True).start()
while pool.is_resident(t):  # false once the write-back is on its way
    time.sleep(0.001)
"""
    written = _saved_at_exit(tmp_path, 1 << 25, 7.0, then)
    assert torch.equal(written, torch.full((1 << 25,), 7.0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["", "del pool\ngc.collect()"], ids=["open", "dropped"])
def test_a_pool_never_closed_writes_its_changes_back_at_exit(tmp_path: Path, then: str) -> None:
    """A script that ends with its pool open (or dropped, collected just before exit) keeps
    the changes made under read_write leases, as a file object flushes its buffer."""
    written = _saved_at_exit(tmp_path, 1 << 22, 9.0, then)
    assert torch.equal(written, torch.full((1 << 22,), 9.0))


_EXIT_PROLOGUE = """
import asyncio, gc, os, shutil, sys, threading, time, weakref
import torch
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
directory = sys.argv[1]
ts = [OffloadedTensor.from_original_tensor(torch.zeros(1024), f"t{i}", offload_dir=directory)
      for i in range(3)]
def save():  # the files as they are at exit: after the pools' exit work, before removal
    for i, t in enumerate(ts):
        while True:
            try:
                shutil.copy(t.offload_path, os.path.join(directory, f"saved{i}.bin"))
                break
            except KeyboardInterrupt:  # one a test sent, landing here: copy again
                pass
class Anchor: pass
anchor = Anchor()  # finalizers pending at exit run after the pools' exit work, newest first
weakref.finalize(anchor, save)
"""


def _files_at_exit(
    tmp_path: Path, body: str
) -> tuple[list[float], subprocess.CompletedProcess[str]]:
    """Run ``body`` after :data:`_EXIT_PROLOGUE` in a fresh interpreter; the first value of
    each of its three tensors' files at exit, and the process (its output)."""
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore::ResourceWarning",
            "-c",
            _EXIT_PROLOGUE + body,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    values = []
    for i in range(3):
        (saved,) = storage.read_payload(storage.read_layout(tmp_path / f"saved{i}.bin")).values()
        values.append(float(saved[0]))
    leftovers = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".bin"))
    assert leftovers == [], leftovers  # every payload file removed with its tensor
    return values, result


@pytest.mark.timeout(120)
def test_threads_that_outlive_the_main_thread_use_pools_and_their_changes_are_kept(
    tmp_path: Path,
) -> None:
    """Python waits for the threads that are not daemons before it exits: they go on using
    the pool the main thread left open, or a new one, and every change reaches its file."""
    values, result = _files_at_exit(
        tmp_path,
        """
pool = TensorResidencyPool()
with pool.acquire(ts[0], mode="read_write") as value:
    value.fill_(9.0)
def later():
    time.sleep(0.3)  # the main thread has ended
    for _ in range(3):
        with pool.acquire(ts[1], mode="read_write") as value:
            value.add_(1.0)
    fresh = TensorResidencyPool()
    with fresh.acquire(ts[2], mode="read_write") as value:
        value.fill_(5.0)
threading.Thread(target=later).start()
""",
    )
    assert values == [9.0, 3.0, 5.0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


_SERVED_FOR_GOOD = """
pool = TensorResidencyPool()
ready = threading.Event()
async def serve():  # the pool's `async with` block, which nothing leaves
    async with pool:
        async with pool.acquire(ts[0], mode="read_write") as value:
            value.fill_(7.0)
        ready.set()
        await asyncio.Event().wait()
"""


@pytest.mark.timeout(120)
def test_a_pool_served_by_a_loop_of_a_daemon_thread_is_written_back_at_exit(
    tmp_path: Path,
) -> None:
    """A background loop thread (a daemon) serves the pool in `async with pool` for the life
    of the process: nothing leaves that block. At exit, the pool is closed through that
    loop, which still runs: its changes, and those other threads made, reach their files."""
    values, result = _files_at_exit(
        tmp_path,
        _SERVED_FOR_GOOD
        + """
threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
assert ready.wait(30)
with pool.acquire(ts[1], mode="read_write") as value:  # served by that loop
    value.fill_(6.0)
""",
    )
    assert values == [7.0, 6.0, 0.0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_a_pool_whose_daemon_loop_stops_as_exit_waits_for_it_is_closed_by_exit(
    tmp_path: Path,
) -> None:
    """The daemon thread's loop serving the pool is busy as the interpreter exits, then
    stops: the close sent to it is abandoned once it has not run for a while, and exit
    closes the pool it left stranded."""
    values, result = _files_at_exit(
        tmp_path,
        _SERVED_FOR_GOOD
        + """
def run():
    loop = asyncio.new_event_loop()
    loop.create_task(serve())
    def busy_then_stop():
        time.sleep(1.0)  # the main thread ends meanwhile
        loop.stop()
    loop.call_later(0.2, busy_then_stop)
    loop.run_forever()
    time.sleep(3600)
threading.Thread(target=run, daemon=True).start()
assert ready.wait(30)
time.sleep(0.4)  # the loop is busy now
""",
    )
    assert values == [7.0, 0.0, 0.0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["", "del pool\ngc.collect()"], ids=["kept", "dropped"])
def test_a_pool_whose_async_with_exit_failed_is_written_back_at_exit(
    tmp_path: Path, then: str
) -> None:
    """A request timed out while a thread held a lease: the `async with` exit cannot close
    the pool, which no loop serves any more. The thread goes on with it; kept or dropped,
    the pool is closed at exit and every change reaches its file."""
    values, result = _files_at_exit(
        tmp_path,
        """
pool = TensorResidencyPool()
def work():
    for _ in range(10):
        for t in ts:
            with pool.acquire(t, mode="read_write") as value:
                value.add_(1.0)
                time.sleep(0.01)
async def serve():
    async with pool:
        await asyncio.wait_for(asyncio.to_thread(work), timeout=0.1)
try:
    asyncio.run(serve())
except TimeoutError:
    pass
"""
        + then,
    )
    assert values == [10.0, 10.0, 10.0], result.stderr


@pytest.mark.timeout(120)
def test_a_pool_collected_just_before_exit_closes_and_the_interpreter_exits_cleanly(
    tmp_path: Path,
) -> None:
    """Its close runs on its loop thread, which stops itself without being waited for:
    interpreter exit waits for it, so that it runs no code while the interpreter tears
    down (which aborted the process while the script's own exit work ran)."""
    import subprocess
    import sys

    script = f"""
import atexit, gc, os, torch
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
directory = {str(tmp_path)!r}
ts = [OffloadedTensor.from_original_tensor(torch.zeros(1 << 20), f"t{{i}}", offload_dir=directory)
      for i in range(3)]
atexit.register(lambda: [os.link(t.offload_path, t.offload_path.with_suffix(".link")) for t in ts])
pool = TensorResidencyPool(max_cached_bytes=2 * (1 << 22))
for t in ts:
    with pool.acquire(t, mode="read_write") as value:
        value.fill_(7.0)
del value, pool
gc.collect()
"""
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", script], capture_output=True, timeout=100
        )
        assert result.returncode == 0, result.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_during_the_exit_write_back_leaves_every_file_whole_and_written(
    tmp_path: Path,
) -> None:
    """A storm of SIGINTs while the pools' exit work writes back: it is reported, not
    raised, so every write ends whole (no temporary file left), no pool thread outlives it
    (which aborted the process), and every change reaches its file."""
    import subprocess
    import sys

    script = (
        _EXIT_PROLOGUE.replace("torch.zeros(1024)", "torch.zeros(1 << 22)")
        + """
import atexit, signal
pool = TensorResidencyPool(max_cached_bytes=1 << 24)
for i, t in enumerate(ts):
    with pool.acquire(t, mode="read_write") as value:
        value.fill_(float(i + 1))
def storm():  # a burst of Ctrl-C once a write-back's temporary file is there
    # ... during the pools' exit work (it holds Ctrl-C: another SIGINT handler is in place),
    # not during a write-back still under way as this function starts.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        if held and any(name.endswith(".tmp") for name in os.listdir(directory)):
            for _ in range(5):  # while the exit work holds Ctrl-C
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    return
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.002)
            return
        time.sleep(0.0005)
# Runs just before the pools' exit work (atexit functions run last registered first).
atexit.register(lambda: threading.Thread(target=storm, daemon=True).start())
"""
    )
    result = subprocess.run(
        [sys.executable, "-W", "ignore::ResourceWarning", "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode in (0, -2), result.stderr  # never an abort (-6)
    assert "interrupted at exit" in result.stderr, result.stderr
    for i in range(3):
        (saved,) = storage.read_payload(storage.read_layout(tmp_path / f"saved{i}.bin")).values()
        assert torch.equal(saved, torch.full((1 << 22,), float(i + 1)))
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".bin")]


@pytest.mark.timeout(120)
def test_pools_refuse_to_start_threads_once_their_exit_work_began(tmp_path: Path) -> None:
    """A daemon thread starting pools over and over while the exit work runs is refused
    (its threads would run while the interpreter tears down) instead of racing the exit
    work, which writes every change back; use after the exit work says why it fails."""
    body = """
import atexit
pool = TensorResidencyPool()
for i, t in enumerate(ts):
    with pool.acquire(t, mode="read_write") as value:
        value.fill_(float(i + 1))
spare = OffloadedTensor.from_original_tensor(torch.ones(4), "spare", offload_dir=directory)
refusals = []
refused = threading.Event()
def churn():
    while True:
        try:
            with TensorResidencyPool() as other:
                other.resolve(spare)
        except Exception as error:
            refusals.append(error)
            refused.set()
            return
def report():  # a finalizer: after the pools' exit work
    refused.wait(10)  # a busy machine may not have run the daemon since the exit work began
    print("daemon:", refusals[0] if refusals else "never refused", flush=True)
    try:
        pool.resolve(ts[0])
    except Exception as error:
        print("after exit:", error, flush=True)
    try:
        TensorResidencyPool().resolve(ts[0])
    except Exception as error:
        print("new pool after exit:", error, flush=True)
keep = Anchor()
weakref.finalize(keep, report)
atexit.register(lambda: threading.Thread(target=churn, daemon=True).start())
"""
    values, result = _files_at_exit(tmp_path, body)
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    # Refused at its next start, or its pool closed under it by the exit work.
    daemon = r"daemon: the (interpreter is exiting|TensorResidencyPool is closed)"
    assert re.search(daemon, result.stdout), result.stdout
    assert "after exit: the TensorResidencyPool is closed" in result.stdout, result.stdout
    assert "new pool after exit: the interpreter is exiting" in result.stdout, result.stdout
    assert values == [1.0, 2.0, 3.0]


# What a daemon thread runs to hold a read_write lease on the first tensor at exit, its
# change under way (not whole: never written).
_DAEMON_HOLDING_THE_FIRST = """
held = threading.Event()
def hold():
    with pool.acquire(ts[0], mode="read_write") as value:
        value.fill_(100.0)
        held.set()
        time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_a_pool_leased_by_a_daemon_thread_at_exit_writes_every_other_change(
    tmp_path: Path,
) -> None:
    values, result = _files_at_exit(
        tmp_path,
        """
pool = TensorResidencyPool()
for i, t in enumerate(ts[1:], start=1):
    with pool.acquire(t, mode="read_write") as value:
        value.fill_(float(i + 1))
with pool.acquire(ts[0], mode="read_write") as value:
    value.fill_(7.0)  # a whole change of the value the daemon holds next
"""
        + _DAEMON_HOLDING_THE_FIRST
        + """
threading.Thread(target=hold, daemon=True).start()
held.wait()
""",
    )
    # The daemon's change under way is not whole: dropped; the change before it is written.
    assert values == [7.0, 2.0, 3.0]
    assert "still had values under leases that never ended" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("holder", ["generator", "lease"])
def test_a_read_write_lease_the_main_thread_never_ended_at_exit_writes_every_other_change(
    tmp_path: Path, holder: str
) -> None:
    """A ``read_write`` lease of the main thread that never ended at exit (a generator
    suspended in its ``acquire`` block, a lease entered without its exit): its change is not
    known to be whole, so it is dropped as a running thread's is; every other change is
    written, and the log names the lease that never ended, not a running thread only."""
    hold = {
        "generator": """
def changes():
    with pool.acquire(ts[0], mode="read_write") as value:
        value.fill_(100.0)
        yield
suspended = changes()
next(suspended)
""",
        "lease": """
held = pool.acquire(ts[0], mode="read_write")  # kept: a lease collected ends, kept whole
held.__enter__().fill_(100.0)
""",
    }[holder]
    values, result = _files_at_exit(
        tmp_path,
        """
pool = TensorResidencyPool()
for i, t in enumerate(ts):
    with pool.acquire(t, mode="read_write") as value:
        value.fill_(float(i + 1))
"""
        + hold,
    )
    assert values == [1.0, 2.0, 3.0]
    assert "still had values under leases that never ended" in result.stderr
    assert "an `acquire` block never left" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop_closed", [False, True], ids=["loop-stopped", "loop-closed"])
def test_a_block_never_left_and_leased_by_a_daemon_thread_at_exit_writes_every_other_change(
    tmp_path: Path, loop_closed: bool
) -> None:
    """A pool whose `async with` block was never left, a daemon thread holding a lease at
    exit: its close is refused, and the exiting thread writes what a leased pool writes (the
    others' changes, and the change of the leased value made before the lease)."""
    values, result = _files_at_exit(
        tmp_path,
        f"""
pool = TensorResidencyPool()
{_DAEMON_HOLDING_THE_FIRST}
async def serve():
    async with pool:
        for i, t in enumerate(ts):
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(float(i + 1))
        threading.Thread(target=hold, daemon=True).start()
        await asyncio.to_thread(held.wait)
        await asyncio.Event().wait()  # the block is never left
loop = asyncio.new_event_loop()
task = loop.create_task(serve())
loop.run_until_complete(asyncio.sleep(0.3))
if {loop_closed}:
    loop.close()
""",
    )
    assert values == [1.0, 2.0, 3.0]
    assert "still had values under leases that never ended" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop_closed", [False, True], ids=["loop-left", "loop-closed"])
def test_an_async_with_block_never_left_writes_its_changes_back_at_exit(
    tmp_path: Path, loop_closed: bool
) -> None:
    """A script that runs its event loop by hand and ends while a task is still inside
    `async with pool` (the task destroyed, pending, at exit): nothing drives the pool's
    actor any more, so the exiting thread closes it, writes on the workers, before they
    stop. The change reaches the file, and no close fails."""
    import subprocess
    import sys

    saved = tmp_path / "saved.bin"
    script = f"""
import asyncio, shutil, torch, weakref
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
t = OffloadedTensor.from_original_tensor(torch.zeros(1024), "w", offload_dir={str(tmp_path)!r})
class Anchor: pass
anchor = Anchor()  # its finalizer runs at exit after the pool's exit work, before t's
weakref.finalize(anchor, shutil.copy, t.offload_path, {str(saved)!r})
pool = TensorResidencyPool()
async def serve():
    async with pool:
        async with pool.acquire(t, mode="read_write") as value:
            value.fill_(5.0)
        await asyncio.Event().wait()  # the block is never left
loop = asyncio.new_event_loop()
task = loop.create_task(serve())
loop.run_until_complete(asyncio.sleep(0.1))
if {loop_closed}:
    loop.close()
print("ok", flush=True)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "failed" not in result.stderr, result.stderr
    (written,) = storage.read_payload(storage.read_layout(saved)).values()
    assert torch.equal(written, torch.full((1024,), 5.0))


def _stranded(tmp_path: Path) -> tuple[TensorResidencyPool, OffloadedTensor, Any, Any]:
    """A pool whose `async with` block, on a loop run by hand in this thread, is never left
    (the loop stopped, not closed), after a change of its tensor; and that loop's task."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(NUMEL), "t", offload_dir=tmp_path)
    pool = TensorResidencyPool()

    async def serve() -> None:
        async with pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.fill_(5.0)
            await asyncio.Event().wait()

    loop = asyncio.new_event_loop()
    task = loop.create_task(serve())
    loop.run_until_complete(asyncio.sleep(0.05))
    return pool, t, loop, task


def _file_value(t: OffloadedTensor) -> torch.Tensor:
    (value,) = storage.read_payload(storage.read_layout(t.offload_path)).values()
    return value


@pytest.mark.timeout(60)
def test_another_loop_on_the_thread_of_a_stopped_serving_loop_is_served_inline(
    tmp_path: Path,
) -> None:
    """No other thread can drive the pool while the loop serving it is stopped: a task of
    another loop on that thread runs its requests there (asyncio's futures of the stopped
    loop cannot be awaited from it), and closes it; the first loop then leaves its block."""
    pool, t, loop, task = _stranded(tmp_path)
    try:

        async def use() -> None:
            assert torch.equal(await pool.aresolve(t), torch.full((NUMEL,), 5.0))
            await pool.aevict(t)
            assert torch.equal(await pool.prefetch(t), torch.full((NUMEL,), 5.0))
            async with pool.acquire(t) as value:
                assert float(value[0]) == 5.0
            await pool.aflush()
            assert torch.equal(_file_value(t), torch.full((NUMEL,), 5.0))
            await pool.aclose()

        asyncio.run(use())
        assert pool.closed
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        assert task.cancelled()
    finally:
        loop.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["this-thread", "another-thread"])
def test_a_pool_whose_serving_loop_closed_inside_its_block_closes(
    tmp_path: Path, where: str
) -> None:
    """Its `async with` block can no longer be left: close() closes it from the caller,
    writing its change back, so that the caller knows it is on disk."""
    before = set(threading.enumerate())
    pool, t, loop, task = _stranded(tmp_path)
    loop.close()
    if where == "this-thread":
        pool.close()
    else:
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            executor.submit(pool.close).result(30)
    assert pool.closed
    assert torch.equal(_file_value(t), torch.full((NUMEL,), 5.0))
    _assert_ended(set(threading.enumerate()) - before)  # its workers stopped
    pool.close()  # again: nothing to do
    task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
    del task  # asyncio logs the pending task's end here, not in a later test's log capture
    gc.collect()


@pytest.mark.timeout(60)
def test_a_request_from_another_thread_to_a_pool_whose_loop_closed_says_what_to_do(
    tmp_path: Path,
) -> None:
    """Refused, it says that the loop is closed (not merely stopped) and what is left to do:
    close the pool, which writes its changes back, and create another."""
    pool, t, loop, task = _stranded(tmp_path)
    loop.close()
    other = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "other", offload_dir=tmp_path)
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        for request in (lambda: pool.resolve(other), pool.acquire(other).__enter__):
            with pytest.raises(T2NErrorMisuse, match=r"loop serving .* is closed.*pool\.close\(\)"):
                executor.submit(request).result(30)
    pool.close()
    assert torch.equal(_file_value(t), torch.full((NUMEL,), 5.0))
    task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
    del task
    gc.collect()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_forked_child_closing_its_parents_pool_stranded_on_a_closed_loop_is_refused(
    tmp_path: Path,
) -> None:
    """The child's close of a pool with a change to write, stranded on a closed loop of its
    parent's, is refused as a forked child's request (it once drove the close there and
    waited for its parent's workers for ever); the parent then closes it, the change
    written."""
    pool, t, loop, task = _stranded(tmp_path)
    loop.close()

    def child() -> str:
        try:
            pool.close()
        except T2NErrorMisuse as error:
            return "refused" if "forked" in str(error) else str(error)
        return "closed"

    assert in_forked_child(child, seconds=20) == "refused"
    pool.close()
    assert torch.equal(_file_value(t), torch.full((NUMEL,), 5.0))
    task.get_coro().close()  # as the closed loop's collection would: the block ends quietly
    del task
    gc.collect()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("request_", ["close", "resolve"])
def test_a_request_from_another_thread_ends_at_once_when_the_loops_thread_closed_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request_: str
) -> None:
    """Another thread's request waits for the stopped loop; the loop's own thread closes the
    pool meanwhile (the caller's close of a stranded pool). The wait ends at once, without
    waiting out the patience for a stopped loop (made far longer than the join here): a
    close has nothing left to do and returns, the pool closed; a read is refused, the pool
    being closed."""
    monkeypatch.setattr(_runtime, "STOPPED_LOOP_PATIENCE", 60.0)
    pool, t, loop, task = _stranded(tmp_path)
    other = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "other", offload_dir=tmp_path)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            pool.close() if request_ == "close" else pool.resolve(other)
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        time.sleep(0.2)
        assert thread.is_alive()  # waiting for the stopped loop
        pool.close()  # on the loop's thread: closes it here
        thread.join(10)
        assert not thread.is_alive()
        if request_ == "close":
            assert outcome == [None]
        else:
            (error,) = outcome
            assert isinstance(error, T2NErrorMisuse)
            assert "closed" in str(error)
        assert pool.closed
        assert torch.equal(_file_value(t), torch.full((NUMEL,), 5.0))
    finally:
        thread.join(10)
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.close()


def _assert_ended(threads: set[threading.Thread]) -> None:
    for thread in threads:
        thread.join(10)
    assert not [thread.name for thread in threads if thread.is_alive()]


@pytest.mark.timeout(60)
def test_async_with_and_a_first_sync_call_at_once_never_both_serve(tmp_path: Path) -> None:
    """One of them serves the pool: the other is refused (here the async with, paused
    between its look at the pool and its start, while the sync call starts the pool's
    thread). Closing the pool stops every thread it started."""
    t = OffloadedTensor.from_original_tensor(torch.ones(NUMEL), "t", offload_dir=tmp_path)
    pool = TensorResidencyPool()
    outcome: list[BaseException | None] = []

    async def enter() -> None:
        try:
            async with pool:
                outcome.append(None)
        except T2NErrorMisuse as error:
            outcome.append(error)

    before = set(threading.enumerate())
    with paused_in_new_threads(Runtime.attach_current.__code__, on="call") as point:
        point.armed.set()
        entering = threading.Thread(target=asyncio.run, args=(enter(),))
        entering.start()
        assert point.paused.wait(30)
        assert torch.equal(pool.resolve(t), torch.ones(NUMEL))  # starts the pool's thread
        point.go()
        entering.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], T2NErrorMisuse), outcome
    assert "already runs" in str(outcome[0])
    assert torch.equal(pool.resolve(t), torch.ones(NUMEL))
    pool.close()
    _assert_ended(set(threading.enumerate()) - before)


# ---------------------------------------------------------------------------------------------
# Buffer reuse
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
async def test_evicted_buffers_are_reused_but_never_while_referenced(tmp_path: Path) -> None:
    """Three values evicted while the test holds them (one whole, one through a view, one
    through a tensor sharing its storage only, as a NumPy round trip makes) keep their
    buffers and their values: no later load reads into them. Every other value is dropped
    once read, and once the first pass has evicted some, each load reads into the buffer of
    one of them: it counts as reused, and its value lies where a value handed out and
    dropped before lay. (A live buffer's address is never handed out again, by the pool or
    by the allocator: the first check cannot pass by chance.)"""
    ts = make_tensors(tmp_path, 12, numel=4096)
    async with TensorResidencyPool(max_cached_bytes=2 * 4096 * 4) as pool:
        whole = await pool.aresolve(ts[0])
        view = (await pool.aresolve(ts[1]))[10:20]
        alias = torch.empty(0).set_((await pool.aresolve(ts[2])).untyped_storage(), 10, (10,))
        held = [(whole, torch.zeros(4096)), (view, torch.ones(10)), (alias, torch.full((10,), 2.0))]
        buffers = {h.untyped_storage().data_ptr() for h, _ in held}
        dropped: set[int] = set()  # where the values handed out and dropped since lay
        for round_index in range(3):
            for i, t in enumerate(ts[3:], start=3):
                reused = pool.stats().reused_buffers
                value = await pool.aresolve(t)
                assert float(value[0]) == float(i) and float(value[-1]) == float(i)
                where = value.data_ptr()
                assert where not in buffers, f"load {i} read into a buffer still referenced"
                assert all(torch.equal(h, v) for h, v in held), f"load {i} changed a held value"
                if pool.stats().reused_buffers > reused:
                    assert where in dropped, f"load {i} counted as reused, read into new memory"
                else:
                    assert round_index == 0, f"load {i} of pass {round_index} reused no buffer"
                dropped.add(where)
                del value
        assert not any(pool.is_resident(t) for t in ts[:3])  # evicted while held
        del held, whole, view, alias
        check_invariants(pool)


@pytest.mark.parametrize(
    ("option", "env", "expected"),
    [
        (None, None, "uvloop"),
        (False, None, "asyncio"),
        (None, "0", "asyncio"),
        (True, None, "uvloop"),
    ],
)
def test_private_loop_runs_on_uvloop_unless_opted_out(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    option: bool | None,
    env: str | None,
    expected: str,
) -> None:
    if env is not None:
        monkeypatch.setenv("T2N_RESIDENCY_UVLOOP", env)
    (t,) = make_tensors(tmp_path, 1)
    with TensorResidencyPool(use_uvloop=option) as pool:
        pool.resolve(t)
        loop = pool._runtime.loop
        assert loop is not None
        assert type(loop).__module__.split(".")[0] == expected


_FORK_AS_THE_FIRST_POOL_STARTS = """
import faulthandler, importlib.abc, os, sys, threading, time, torch
importing = threading.Event()
class SlowInThreads(importlib.abc.MetaPathFinder):  # a thread's import of uvloop takes 0.5 s
    def find_spec(self, name, path, target=None):
        if name == "uvloop" and threading.current_thread() is not threading.main_thread():
            importing.set()
            time.sleep(0.5)
        return None
sys.meta_path.insert(0, SlowInThreads())
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
t = OffloadedTensor.from_original_tensor(torch.zeros(8), "w", offload_dir=sys.argv[1])
pool = TensorResidencyPool()
starter = threading.Thread(target=pool.resolve, args=(t,))  # the process's first pool starts
starter.start()
importing.wait(0.3)
child = os.fork()
if child == 0:
    faulthandler.dump_traceback_later(10, exit=True)  # a hang ends the child with status 1
    with TensorResidencyPool() as own:
        own.resolve(t)
    os._exit(0)
_, status = os.waitpid(child, 0)
starter.join()
pool.close()
print("child's exit status:", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_child_forked_as_another_thread_starts_the_first_pool_starts_pools(
    tmp_path: Path,
) -> None:
    """A fork while another thread starts the process's first pool: the child's pools start.
    (That start once imported uvloop: forked amid the import, the child inherited the
    module's import lock held, and every pool it started waited for it for ever.)"""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AS_THE_FIRST_POOL_STARTS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert "child's exit status: 0" in done.stdout, done.stdout + done.stderr


@faces
@pytest.mark.asyncio
async def test_direct_writes_are_seen_by_the_pool(tmp_path: Path, face_name: str) -> None:
    (t,) = make_tensors(tmp_path, 1)
    async with open_pool(face_name) as face:
        assert float((await face.resolve(t))[0]) == 0.0
        await anyio.to_thread.run_sync(t.update_values, torch.full((NUMEL,), 7.0))
        assert float((await face.resolve(t))[0]) == 7.0
        stats = face.pool.stats()
        assert (stats.loads, stats.evictions) == (2, 1)
        with face.pool.scope():
            # In a scope, an in-place op changes the pool's value under a read_write lease.
            await anyio.to_thread.run_sync(t.add_, 1.0)
            assert float((await face.resolve(t))[0]) == 8.0
        assert face.pool.stats().loads == 2
        await face.flush()
        assert float(t._reload_unmanaged()[0]) == 8.0
        check_invariants(face.pool)


def test_first_calls_from_many_threads_start_one_loop(tmp_path: Path) -> None:
    import threading

    ts = make_tensors(tmp_path, 8)
    pool = TensorResidencyPool()
    barrier = threading.Barrier(8)
    results: list[float] = []

    def first_call(i: int) -> None:
        barrier.wait()
        results.append(float(pool.resolve(ts[i])[0]))

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(results) == [float(i) for i in range(8)]
    loops = [t for t in threading.enumerate() if t.name == "t2n-residency-loop"]
    assert len(loops) == 1
    pool.close()
    assert pool.closed


@pytest.mark.asyncio
async def test_a_failed_close_at_async_exit_keeps_dirty_values(tmp_path: Path) -> None:
    import shutil

    directory = tmp_path / "payloads"
    directory.mkdir()
    (t,) = make_tensors(directory, 1)
    pool = TensorResidencyPool()
    with pytest.raises(T2NErrorStorage, match="write-back"):
        async with pool:
            async with pool.acquire(t, mode="read_write") as value:
                value.add_(3)
            saved = directory.with_name("saved")
            shutil.copytree(directory, saved)
            shutil.rmtree(directory)  # the write-back at exit cannot happen
    assert not pool.closed and pool.is_resident(t)
    shutil.copytree(saved, directory)
    await anyio.to_thread.run_sync(pool.close)  # served again, from a private loop thread
    assert pool.closed
    assert torch.equal(t._reload_unmanaged(), torch.full((NUMEL,), 3.0))


@pytest.mark.parametrize("via", ["acquire", "resolve", "stream"])
@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
def test_foreign_requests_leave_no_reference_cycles(tmp_path: Path, via: str) -> None:
    """Evicted values die with their last reference, so their buffers are reused at once."""
    import gc

    ts = make_tensors(tmp_path, 10, numel=4096)
    model = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    with TensorResidencyPool(max_cached_bytes=2 * 4096 * 4) as pool:
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                for t in ts:
                    if via == "acquire":
                        with pool.acquire(t) as value:
                            assert value.numel() == 4096
                    elif via == "resolve":
                        assert pool.resolve(t).numel() == 4096
                    else:
                        lease = pool.acquire(t)
                        lease._begin()
                        with lease as value:
                            assert value.numel() == 4096
            stats = pool.stats()
        finally:
            gc.enable()
    assert stats.loads == 30
    assert stats.reused_buffers >= stats.loads - 4, stats
    del model


@pytest.mark.asyncio
async def test_a_failed_write_back_is_retried_by_flush_not_by_every_eviction(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    directory = tmp_path / "payloads"
    directory.mkdir()
    (dirty,) = make_tensors(directory, 1)
    others = make_tensors(tmp_path / "others", 20)
    async with TensorResidencyPool(max_cached_bytes=2 * KIB) as pool:
        async with pool.acquire(dirty, mode="read_write") as value:
            value.add_(1)
        shutil.copytree(directory, tmp_path / "saved")
        shutil.rmtree(directory)  # the write-back of `dirty` fails from now on
        with caplog.at_level(logging.WARNING, "torch_to_nnef.tensor.residency"):
            for t in others:  # pressure: every load wants room
                await pool.aresolve(t)
            await pool.aflush(others[0])  # wait for the pool to settle
        failures = [r for r in caplog.records if "write-back of" in r.getMessage()]
        assert len(failures) == 1, "a failed write-back must not be retried on every eviction"
        assert pool.is_resident(dirty), "the dirty value is kept, not lost"
        check_invariants(pool)
        with pytest.raises(T2NErrorStorage, match="write-back"):
            await pool.aflush()
        shutil.copytree(tmp_path / "saved", directory)
        await pool.aflush()  # space is back: the flush writes it
    assert torch.equal(dirty._reload_unmanaged(), torch.full((NUMEL,), 1.0))


@pytest.mark.timeout(60)
def test_a_burst_of_requests_from_a_thread_is_served_in_order(tmp_path: Path) -> None:
    """Hundreds of queued requests are drained by a loop, not a recursion as deep as the queue."""
    ts = make_tensors(tmp_path, 2000, numel=4)
    with TensorResidencyPool(max_cached_bytes=100 * 16) as pool:
        handles = [pool.prefetch(t) for t in ts]
        assert [float(h.wait()[0]) for h in handles] == [float(i) for i in range(2000)]
        check_invariants(pool)
    assert pool.closed


@pytest.mark.timeout(60)
def test_jobs_that_ended_while_the_loop_was_busy_are_applied_by_a_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Thousands of loads end while the loop thread is busy: the first application of their
    ends drains them all, and the drives it resumes leave the rest to it instead of each
    applying the next one (a recursion as deep as the queue)."""
    count = 1200  # the loop applies some ends as they come: enough must be left waiting
    ts = make_tensors(tmp_path, count, numel=4)
    released = threading.Event()
    queued: list[int] = []

    def busy() -> None:  # on the loop thread, queued behind the prefetches' drives
        # Loads that ended before it ran were applied already: those count as ended too.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            waiting = len(runtime._ended)
            if waiting + pool.stats().loads >= count:
                break
            time.sleep(0.01)
        queued.append(waiting)
        released.set()

    with TensorResidencyPool(max_cached_bytes=None, max_workers=2) as pool:
        runtime = pool._runtime
        handles = [pool.prefetch(t) for t in ts]
        runtime.post(busy)
        assert released.wait(40)
        # Enough ends waited for the loop that applying them by recursion (some 8 frames
        # each) would pass Python's limit of frames.
        assert queued[0] * 8 > sys.getrecursionlimit(), f"only {queued[0]} ends waited"
        with caplog.at_level(logging.ERROR):
            values = [float(h.wait()[0]) for h in handles]
        assert values == [float(i) for i in range(count)]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        check_invariants(pool)
    assert pool.closed


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
def test_a_lease_ended_without_waiting_frees_its_room_before_the_next_load(
    tmp_path: Path,
) -> None:
    """With no room for cached values, ending a lease evicts its value at once, so the next
    load, sent right behind, reads into its buffer instead of fresh memory."""
    ts = make_tensors(tmp_path, 40)
    with TensorResidencyPool(max_cached_bytes=0) as pool:
        for index, t in enumerate(ts):
            with pool.acquire(t) as value:
                assert float(value[0]) == float(index)
            del value  # nothing references it any more: its buffer may be reused
        stats = pool.stats()
        assert stats.loads == len(ts)
        assert stats.reused_buffers == len(ts) - 1
        check_invariants(pool)
