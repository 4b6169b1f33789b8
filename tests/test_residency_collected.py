"""A pool holds the tensors of clean, idle values weakly: a tensor its user dropped is
collected, and its entry, value and payload file go, while the pool stays open."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from residency_checks import check_invariants, settle
from test_residency import make_tensors

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

pytestmark = [pytest.mark.timeout(90)]

NUMEL = 1 << 15  # float32: 128 KiB, a mapped value when mapped reads are on


@pytest.fixture(params=[True, False], ids=["mapped", "buffered"])
def mapped(request: pytest.FixtureRequest) -> object:
    previous = storage.set_mapped_reads(request.param)
    yield request.param
    storage.set_mapped_reads(previous)


def _tensor(directory: Path, fill: float, name: str = "w") -> OffloadedTensor:
    return OffloadedTensor.from_original_tensor(
        torch.full((NUMEL,), fill), name, offload_dir=directory
    )


def _collected(ref: weakref.ref[OffloadedTensor]) -> bool:
    gc.collect()
    return ref() is None


def _emptied_without_a_request(pool: TensorResidencyPool) -> None:
    """Wait, calling nothing of the pool's, until the collections woke its loop and it
    removed every entry; check it holds nothing."""
    deadline = time.monotonic() + 10
    while pool._actor.entries and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pool._actor.entries
    assert pool.resident_bytes == 0
    check_invariants(pool)


def _keys(pool: TensorResidencyPool) -> set[int]:
    pool.stats()  # a step: what collections left to it ran
    return set(pool._actor.entries)


def test_a_dropped_tensor_whose_clean_value_is_resident_is_collected(
    tmp_path: Path, mapped: bool
) -> None:
    """An unbounded pool serves two tensors (a lease each); the user drops one: it is
    collected, its payload file removed, its value out of the pool (an eviction), and the
    other is still served. With mapped reads off, the dead value's host buffer goes with it:
    no later load reads into it."""
    keep, drop = _tensor(tmp_path, 1.0, "keep"), _tensor(tmp_path, 2.0, "drop")
    path, nbytes = drop.offload_path, drop.payload_nbytes
    with TensorResidencyPool(None) as pool:
        for t in (keep, drop):
            with pool.acquire(t) as value:
                assert float(value[0]) == float(t.reload()[0])
        assert pool.resident_bytes == 2 * nbytes
        before = pool.stats()
        dropped = weakref.ref(drop)
        del drop, t, value
        assert _collected(dropped)
        assert not path.exists()
        assert _keys(pool) == {id(keep)}
        assert pool.resident_bytes == nbytes
        stats = pool.stats()
        assert stats.evictions == before.evictions + 1
        assert stats.wasted_prefetches == before.wasted_prefetches  # (it was used)
        check_invariants(pool)
        assert pool._actor.spares.nbytes == 0
        other = _tensor(tmp_path, 3.0, "other")  # of that shape
        assert torch.equal(pool.resolve(other), torch.full((NUMEL,), 3.0))
        assert pool.stats().reused_buffers == stats.reused_buffers
        assert torch.equal(pool.resolve(keep), torch.full((NUMEL,), 1.0))
        check_invariants(pool)


@pytest.mark.asyncio
async def test_a_dropped_tensor_leased_through_the_async_face_is_collected(
    tmp_path: Path, mapped: bool
) -> None:
    """As above, through the async face: ``async with pool.acquire(t)``, the pool served by
    the caller's loop (whose next step removes the entry)."""
    keep, drop = _tensor(tmp_path, 1.0, "keep"), _tensor(tmp_path, 2.0, "drop")
    path, nbytes = drop.offload_path, drop.payload_nbytes
    async with TensorResidencyPool(None) as pool:
        for t in (keep, drop):
            async with pool.acquire(t) as value:
                assert float(value[0]) == float(t.reload()[0])
        before = pool.stats()
        dropped = weakref.ref(drop)
        del drop, t, value
        assert _collected(dropped)
        assert not path.exists()
        await pool.aflush()  # a step
        assert set(pool._actor.entries) == {id(keep)}
        assert pool.resident_bytes == nbytes
        stats = pool.stats()
        assert stats.evictions == before.evictions + 1
        check_invariants(pool)
        other = _tensor(tmp_path, 3.0, "other")
        async with pool.acquire(other) as value:
            assert torch.equal(value, torch.full((NUMEL,), 3.0))
        async with pool.acquire(keep) as value:
            assert torch.equal(value, torch.full((NUMEL,), 1.0))
        check_invariants(pool)


def _change_and_drop(
    pool: TensorResidencyPool, box: list[OffloadedTensor], resident_first: bool
) -> tuple[weakref.ref[OffloadedTensor], Path]:
    """Change the value of the tensor ``box`` holds through a read_write lease (on a hit,
    taken and ended without the actor, or on a miss), then drop the tensor: the pool holds
    it, its change not written yet."""
    t = box.pop()
    ref, path = weakref.ref(t), t.offload_path
    if resident_first:
        pool.resolve(t)
    with pool.acquire(t, mode="read_write") as value:
        value.add_(1.0)
    del t, value
    gc.collect()
    assert ref() is not None, "a tensor whose change is not written yet was collected"
    assert path.exists()
    return ref, path


@pytest.mark.parametrize("resident_first", [True, False])
def test_a_change_of_a_tensor_dropped_as_its_lease_ended_is_written_back_first(
    tmp_path: Path, resident_first: bool, mapped: bool
) -> None:
    """Tensors whose values a read_write lease changed are dropped right after: the pool
    holds each until its change is written back (a flush, an eviction for the budget, the
    close), then lets it be collected. No other object reads a tensor's own payload file (a
    copy gets one of its own), so the writes are seen through the counters: one write-back
    of its bytes each, then the tensor, its file and its entry are gone."""
    box = [_tensor(tmp_path, float(i), f"t{i}") for i in range(3)]
    others = [_tensor(tmp_path, 5.0, "o1"), _tensor(tmp_path, 6.0, "o2")]
    nbytes = others[0].payload_nbytes
    with TensorResidencyPool(2 * nbytes) as pool:
        # A flush writes the change: the tensor goes, while the pool stays open.
        ref, path = _change_and_drop(pool, box, resident_first)
        before = pool.stats()
        pool.flush()
        settle(pool)  # (a job mapping the file written holds the tensor while it runs)
        stats = pool.stats()
        assert stats.write_backs == before.write_backs + 1
        assert stats.bytes_written == before.bytes_written + nbytes
        assert _collected(ref)
        assert not path.exists()
        assert _keys(pool) == set()
        check_invariants(pool)
        # Values read after it push it out: written back first.
        ref, path = _change_and_drop(pool, box, resident_first)
        for other in others:
            pool.resolve(other)
        settle(pool)
        assert pool.stats().write_backs == stats.write_backs + 1
        assert _collected(ref)
        assert not path.exists()
        assert _keys(pool) == {id(other) for other in others}
        check_invariants(pool)
        # Left to the close.
        ref, path = _change_and_drop(pool, box, resident_first)
        writes = pool.stats().write_backs
    assert pool.stats().write_backs == writes + 1
    assert _collected(ref)
    assert not path.exists()


@pytest.mark.parametrize("mode", ["read", "read_write"])
@pytest.mark.parametrize("resident_first", [True, False])
def test_a_tensor_dropped_while_another_thread_leases_it_lives_until_the_lease_ends(
    tmp_path: Path, mode: str, resident_first: bool
) -> None:
    """Another thread holds a lease (taken on a hit, without the actor, or on a miss) on a
    tensor that only that lease holds now: the tensor lives while the lease is held, and is
    collected once it ended (a read lease), or once its change is written (a read_write
    lease)."""
    box = [_tensor(tmp_path, 1.0, "t")]
    ref = weakref.ref(box[0])
    path = box[0].offload_path
    inside, leave = threading.Event(), threading.Event()
    seen: list[float] = []
    errors: list[BaseException] = []
    with TensorResidencyPool(None) as pool:
        if resident_first:
            pool.resolve(box[0])
            pool.stats()

        def hold() -> None:
            try:
                with pool.acquire(box.pop(), mode=mode) as value:  # type: ignore[arg-type]
                    inside.set()
                    assert leave.wait(30)
                    seen.append(float(value[0]))
                    if mode == "read_write":
                        value.mul_(3.0)
            except BaseException as error:
                errors.append(error)
                inside.set()

        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(30)
        gc.collect()
        assert ref() is not None
        pool.stats()  # a step takes note of the lease
        gc.collect()
        assert ref() is not None
        leave.set()
        holder.join(30)
        assert not holder.is_alive() and not errors, errors
        assert seen == [1.0]
        del holder
        if mode == "read_write":
            gc.collect()
            assert ref() is not None  # its change is not written yet
            writes = pool.stats().write_backs
            pool.flush()
            assert pool.stats().write_backs == writes + 1
            settle(pool)  # (a job mapping the file written holds the tensor while it runs)
        assert _collected(ref)
        assert not path.exists()
        assert _keys(pool) == set()
        assert pool.resident_bytes == 0
        check_invariants(pool)


def _serve(pool: TensorResidencyPool, t: OffloadedTensor, how: int) -> torch.Tensor:
    if how == 0:
        return pool.resolve(t)
    if how == 1:
        with pool.acquire(t) as value:
            return value.clone()
    return pool.prefetch(t).wait()


def _occupy(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Keep ``loop``'s thread busy for ``seconds``, from now on."""
    busy = threading.Event()

    def sleep() -> None:
        busy.set()
        time.sleep(seconds)

    loop.call_soon_threadsafe(sleep)
    assert busy.wait(10)


def test_a_new_tensor_given_a_dead_ones_id_gets_its_own_value(tmp_path: Path) -> None:
    """Batches of tensors are made, served and dropped one after the other, new ones often
    given the ids of those collected just before (CPython reuses the memory; how often is
    not deterministic). The loop thread is kept busy meanwhile, so that no step removes the
    dead entries before the new tensors' first requests: a new tensor given a dead one's id
    finds its value published (a hit path looks there first), and gets its own value, never
    the dead one's; no dead entry stays in the pool."""
    reused = 0
    batch = 8
    with TensorResidencyPool(None) as pool:
        actor = pool._actor
        loop = pool._runtime.loop
        assert loop is not None
        tensors = [_tensor(tmp_path, float(i), f"t{i}") for i in range(batch)]
        for t in tensors:
            pool.resolve(t)
        for round_ in range(1, 20):
            _occupy(loop, 0.2)
            dead = {id(t) for t in tensors}
            refs = [weakref.ref(t) for t in tensors]
            del tensors, t
            gc.collect()
            assert all(ref() is None for ref in refs)
            fills = [float(round_ * batch + i) for i in range(batch)]
            tensors = [_tensor(tmp_path, fill, f"t{fill}") for fill in fills]
            for i, (t, fill) in enumerate(zip(tensors, fills, strict=True)):
                reused += id(t) in dead and id(t) in actor.published  # a dead one's value
                value = _serve(pool, t, (round_ + i) % 3)
                assert torch.equal(value, torch.full((NUMEL,), fill)), (fill, float(value[0]))
                assert pool.is_resident(t)
            assert _keys(pool) == {id(t) for t in tensors}
            assert pool.resident_bytes == batch * tensors[0].payload_nbytes
        check_invariants(pool)
    print(f"new tensors that found a dead one's value published: {reused}/{19 * batch}")


@pytest.mark.asyncio
async def test_a_new_tensor_given_a_dead_ones_id_gets_its_own_value_async(tmp_path: Path) -> None:
    """As above, through the async face (``async with pool.acquire(t)``)."""
    async with TensorResidencyPool(None) as pool:
        previous = _tensor(tmp_path, 0.0, "t0")
        async with pool.acquire(previous):
            pass
        for i in range(1, 20):
            ref = weakref.ref(previous)
            del previous
            assert _collected(ref)
            previous = _tensor(tmp_path, float(i), f"t{i}")
            async with pool.acquire(previous) as value:
                assert torch.equal(value, torch.full((NUMEL,), float(i)))
            assert pool.is_resident(previous)
            await pool.aflush()  # a step
            assert set(pool._actor.entries) == {id(previous)}
        check_invariants(pool)


def test_many_dropped_models_leave_an_unbounded_pool(tmp_path: Path) -> None:
    """A pool kept open across models: each model's values are resident while it lives;
    once dropped, none of its tensors, values or files stays."""
    refs: list[weakref.ref[OffloadedTensor]] = []
    with TensorResidencyPool(None) as pool:
        for round_ in range(5):
            model = make_tensors(tmp_path / str(round_), 4, numel=1024)
            for t in model:
                pool.resolve(t)
            refs += [weakref.ref(t) for t in model]
            del model, t
            gc.collect()
            assert all(ref() is None for ref in refs)
            assert _keys(pool) == set()
            assert pool.resident_bytes == 0
            assert not any((tmp_path / str(round_)).iterdir())
        check_invariants(pool)


def test_an_idle_pool_lets_go_of_a_dropped_tensors_value_without_a_request(
    tmp_path: Path, mapped: bool
) -> None:
    """Nothing asks the pool anything after the user dropped a tensor: its collection wakes
    the pool's loop, whose step removes the entry and its value (they stayed until the
    pool's next request: a server that dropped a model and went idle kept its memory, and
    with mapped reads the space of its deleted files)."""
    t = _tensor(tmp_path, 3.0)
    with TensorResidencyPool(None) as pool:
        pool.resolve(t)
        ref = weakref.ref(t)
        del t
        assert _collected(ref)
        _emptied_without_a_request(pool)


def test_a_dropped_model_leaves_an_idle_pool_whole(tmp_path: Path) -> None:
    """Many tensors collected at once, by two threads, while nothing asks the pool anything:
    every entry leaves, the last tensor's too (each collection queues the tensor before it
    wakes the loop)."""
    models = [make_tensors(tmp_path / str(i), 200, numel=256) for i in range(2)]
    with TensorResidencyPool(None) as pool:
        for model in models:
            for t in model:
                pool.resolve(t)
        refs = [weakref.ref(t) for model in models for t in model]
        del t, model
        start = threading.Barrier(2)

        def drop(index: int) -> None:
            start.wait()
            models[index].clear()

        threads = [threading.Thread(target=drop, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert _collected(refs[0]) and all(ref() is None for ref in refs)
        _emptied_without_a_request(pool)


def test_a_dropped_models_buffers_leave_the_pool_with_it(tmp_path: Path) -> None:
    """Mapped reads off, a pool kept open: a model streamed through a budget leaves spare
    buffers (the values it evicted), sized by its layers; once it is dropped, every tensor
    the pool served is gone, and so are those buffers and the peak that sized them. The
    next model, of smaller layers, holds no more than its own budget and peak (the first
    model's buffers, of another shape, stayed for the pool's life: 3x that)."""
    previous = storage.set_mapped_reads(False)
    budget = 2 * NUMEL * 4
    try:
        with TensorResidencyPool(budget) as pool:
            for model_numel, count in ((NUMEL, 8), (NUMEL // 8, 16)):
                model = make_tensors(tmp_path / str(model_numel), count, numel=model_numel)
                for _ in range(2):  # a cyclic pass over more than the budget: evictions
                    for i, t in enumerate(model):
                        with pool.acquire(t) as value:
                            assert float(value[0]) == float(i)
                layer = model_numel * 4
                assert pool.resident_bytes + pool._actor.spares.nbytes <= budget + layer
                refs = [weakref.ref(t) for t in model]
                del model, t, value
                assert _collected(refs[0]) and all(ref() is None for ref in refs)
                assert _keys(pool) == set()
                assert pool._actor.spares.nbytes == 0 and pool._actor.active_peak == 0
                check_invariants(pool)
    finally:
        storage.set_mapped_reads(previous)
