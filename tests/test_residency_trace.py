"""Trace-driven read-ahead: the learned order, the window, loads read ahead vs on demand."""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import ResidencyStrategy, TensorResidencyPool, offload_module
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyLease, _trace
from torch_to_nnef.tensor.residency._trace import AccessTrace, ReadAhead

WIDTH, LAYERS = 64, 8
LAYER_BYTES = WIDTH * WIDTH * 4 + WIDTH * 4


def test_the_order_is_learned_in_one_pass_and_wraps_to_the_next_forward() -> None:
    trace = AccessTrace(window_bytes=20)
    order = [1, 2, 3, 4, 5]
    first = [trace.touched(key, 10) for key in order]
    assert first == [[], [], [], [], []]  # nothing learned yet
    second = [trace.touched(key, 10) for key in order]
    assert second[0] == [2, 3]
    assert second[-1] == [1, 2]  # the next forward's first tensors
    assert trace.relearned == 0


def test_the_window_bounds_the_bytes_read_ahead() -> None:
    trace = AccessTrace(window_bytes=15)
    for key in [1, 2, 3, 4, 1]:
        trace.touched(key, 10)
    assert trace.touched(2, 10) == [3]
    assert AccessTrace(window_bytes=5).touched(1, 10) == []


def test_a_changed_order_is_relearned() -> None:
    trace = AccessTrace(window_bytes=100)
    for key in [1, 2, 3, 1]:
        trace.touched(key, 1)
    for key in [3, 2, 1]:
        trace.touched(key, 1)
    assert trace.relearned >= 2
    assert trace.touched(3, 1)[:2] == [2, 1]


@pytest.mark.timeout(60)
def test_a_reused_key_inherits_nothing_from_the_forgotten_one() -> None:
    """A tensor dies (its key is forgotten) while it is another thread's last access, and a
    new tensor reuses its key (ids are reused): the other thread's next access is no
    successor of the new tensor (it was, and the new tensor read ahead what followed the
    dead one)."""
    trace = AccessTrace(window_bytes=100)
    with ThreadPoolExecutor(1) as other:  # one thread throughout: its last access stays
        for key in [1, 2, 3]:
            other.submit(trace.touched, key, 1).result(10)
        trace.forget(3)  # the tensor of key 3 died; a new one gets its id
        trace.touched(3, 1)
        trace.touched(4, 1)
        other.submit(trace.touched, 9, 1).result(10)
    assert trace.touched(3, 1) == [4]
    assert trace.relearned == 0
    assert len(trace) == 5  # 1, 2, 3, 4, 9


def test_a_forgotten_key_ends_the_window_of_those_before_it() -> None:
    trace = AccessTrace(window_bytes=100)
    for key in [1, 2, 3, 4, 1]:
        trace.touched(key, 1)
    trace.forget(3)
    assert trace.touched(1, 1) == [2]
    assert len(trace) == 3


def model_and_input(
    tmp_path: Path, layers: int = LAYERS
) -> tuple[nn.Sequential, nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    dense = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    dense = dense.eval().requires_grad_(False)
    return dense, offload_module(copy.deepcopy(dense), tmp_path), torch.randn(2, WIDTH)


def counts(pool: TensorResidencyPool) -> tuple[int, int]:
    assert pool.read_ahead is not None
    stats = pool.read_ahead.stats()
    return stats.read_ahead, stats.on_demand


@pytest.mark.timeout(60)
def test_forwards_read_ahead_in_the_recorded_order_and_relearn_a_new_one(
    tmp_path: Path,
) -> None:
    dense, model, x = model_and_input(tmp_path)
    reversed_dense = nn.Sequential(*reversed(list(dense)))
    reversed_model = nn.Sequential(*reversed(list(model)))
    # LRU with a budget of two layers: without read-ahead, a cyclic pass misses every time.
    with (
        TensorResidencyPool(
            max_cached_bytes=2 * LAYER_BYTES,
            max_workers=2,
            strategy=ResidencyStrategy.LRU,
            read_ahead=3 * LAYER_BYTES,
        ) as pool,
        pool.scope(),
    ):
        assert torch.equal(model(x), dense(x))  # the first forward: learned, loaded on demand
        assert counts(pool)[1] >= LAYERS  # weights and biases, not known yet
        before = counts(pool)
        assert torch.equal(model(x), dense(x))  # learns the wrap to the next forward
        assert counts(pool)[1] - before[1] <= 1
        for _ in range(3):
            before = counts(pool)
            assert torch.equal(model(x), dense(x))
            after = counts(pool)
            assert after[1] == before[1], "every load of a learned forward was read ahead"
            assert after[0] - before[0] >= 2 * LAYERS - 4  # the rest were still resident
        # Another order: the first forward relearns it, the next ones read ahead again.
        assert torch.equal(reversed_model(x), reversed_dense(x))
        assert pool.read_ahead is not None and pool.read_ahead.stats().relearned > 0
        assert torch.equal(reversed_model(x), reversed_dense(x))  # and its wrap
        before = counts(pool)
        assert torch.equal(reversed_model(x), reversed_dense(x))
        assert counts(pool)[1] == before[1]
    # Leases held for the next forward are released when the pool closes: no error above.


def test_read_ahead_options(tmp_path: Path) -> None:
    with TensorResidencyPool(max_cached_bytes=1000, read_ahead="auto") as pool:
        assert pool.read_ahead is not None
    assert TensorResidencyPool(max_cached_bytes=1000).read_ahead is None
    # A window is a size as the budget is: bytes, or a str with a unit.
    with (
        TensorResidencyPool(read_ahead="64MiB") as pool,
        TensorResidencyPool(read_ahead=500) as exact,
    ):
        assert pool.read_ahead is not None and exact.read_ahead is not None
        assert pool.read_ahead.window_bytes == 64 << 20 and exact.read_ahead.window_bytes == 500
    with pytest.raises(T2NErrorMisuse, match="a size cannot be negative"):
        TensorResidencyPool(read_ahead=-1)
    with pytest.raises(T2NErrorMisuse, match="cannot read 'AUTO' as a size"):
        TensorResidencyPool(read_ahead="AUTO")
    with pytest.raises(T2NErrorMisuse, match="read_ahead must be None, 'auto' or a size"):
        TensorResidencyPool(read_ahead=1.5)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_concurrent_forwards_reading_ahead_leave_no_lease_behind(tmp_path: Path) -> None:
    """Two scoped forwards at once, in worker threads of an async server: both read ahead
    the same tensors, and a lease one begins while the other has begun its own is dropped
    (it was kept over the other's, which then held its value for ever: the pool went over
    its budget and refused to close). Every output is the dense model's."""
    torch.manual_seed(0)
    width = 64
    dense = nn.Sequential(*(nn.Linear(width, width) for _ in range(12)))
    model = offload_module(copy.deepcopy(dense), tmp_path)
    x = torch.randn(2, width)
    with torch.no_grad():
        expected = dense(x)
    layer = (width * width + width) * 4
    pool = TensorResidencyPool(max_cached_bytes=4 * layer, read_ahead="auto")

    async def serve() -> None:
        async with pool:

            def forward() -> torch.Tensor:
                with torch.no_grad():  # grad mode is the thread's: set it in the worker
                    output: torch.Tensor = model(x)
                return output

            async def request() -> torch.Tensor:
                with pool.scope():  # a contextvar: the worker thread runs in the scope
                    return await asyncio.to_thread(forward)

            for _ in range(8):
                for output in await asyncio.gather(request(), request(), request()):
                    assert torch.equal(output, expected)
            assert pool.resident_bytes <= 4 * layer + 2 * layer  # budget + the window

    asyncio.run(serve())
    assert pool.closed


@pytest.mark.timeout(120)
def test_concurrent_forwards_keep_each_others_reads_ahead(tmp_path: Path) -> None:
    """Two threads run two models through one pool in lockstep: each read ahead is held while
    some thread's window needs it, so the read-ahead adds no loads to those the forwards need
    (it dropped the other thread's values, which were then read again on demand)."""
    torch.manual_seed(0)
    models = [offload_module(nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))), tmp_path)]
    models.append(offload_module(nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))), tmp_path))
    layer = (32 * 32 + 32) * 4
    x = torch.randn(2, 32)
    step = threading.Barrier(2)

    def lockstep(module: nn.Module, args: object) -> None:
        step.wait(10)

    hooks = [m.register_forward_pre_hook(lockstep) for model in models for m in model]
    passes, uses = 5, 5 * 2 * 2 * 6
    errors: list[BaseException] = []
    with TensorResidencyPool(max_cached_bytes=0, read_ahead=layer) as pool:

        def forwards(model: nn.Sequential) -> None:
            try:
                with pool.scope(), torch.no_grad():
                    for _ in range(passes):
                        model(x)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=forwards, args=(m,)) for m in models]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        stats = pool.stats()
        read_ahead, on_demand = counts(pool)
    for hook in hooks:
        hook.remove()
    assert not errors
    assert stats.loads <= uses + 4, stats  # and each thread's next forward's first layer
    assert read_ahead > 3 * on_demand, (read_ahead, on_demand)
    assert stats.hits + stats.misses == uses  # the read-ahead's own leases are no requests


def test_reads_ahead_nothing_used_are_wasted_prefetches(tmp_path: Path) -> None:
    """Learn an order, then run the layers the other way round: what was read ahead along
    the learned order and never used is counted as wasted, and requests are the uses."""
    dense, model, x = model_and_input(tmp_path)
    with TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES) as pool:
        with pool.scope(), torch.no_grad():
            model(x)
            model(x)
            before = pool.stats()
            y = x
            for layer in reversed(list(model)):
                y = layer(y)
        after = pool.stats()
    expected = x
    with torch.no_grad():
        for layer in reversed(list(dense)):
            expected = layer(expected)
    assert torch.allclose(y, expected, atol=1e-6)
    assert (after.hits + after.misses) - (before.hits + before.misses) == 2 * LAYERS
    assert after.wasted_prefetches > before.wasted_prefetches


@pytest.mark.timeout(120)
def test_ctrl_c_at_any_call_of_the_read_ahead_leaves_no_lease(tmp_path: Path) -> None:
    """A KeyboardInterrupt lands, in turn, on each call the read-ahead's bookkeeping makes
    or right after it returns (where a Ctrl-C's handler runs: a lease popped from its table
    and not recorded yet as leaving was lost, leased for ever, and the close refused): the
    next forward is right and the pool closes, holding nothing. Four layers: the window
    (two layers) reads ahead within the forward and across its wrap to the next one."""
    dense, model, x = model_and_input(tmp_path, layers=4)
    with torch.no_grad():
        expected = dense(x)
    codes = {
        function.__code__ for function in (ReadAhead.touched, ReadAhead._leave, ReadAhead.let_go)
    } | {TensorResidencyLease._cancel.__code__}
    interrupts = quiet = 0
    for n in itertools.count(1):
        pool = TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES)
        with pool:
            with pool.scope(), torch.no_grad():
                model(x)  # learns the order
                was_interrupted = _interrupted_at(codes, n, lambda: model(x))
            with pool.scope(), torch.no_grad():
                assert torch.equal(model(x), expected), n
        assert pool.closed and pool.resident_bytes == 0, n
        interrupts += was_interrupted
        quiet = 0 if was_interrupted else quiet + 1
        if quiet == 3:
            break
    assert interrupts > 50


def _interrupted_at(codes: set[CodeType], n: int, run: Callable[[], object]) -> bool:
    """Run ``run``, raising KeyboardInterrupt at the ``n``-th call made from one of ``codes``
    (on its entry, or as a builtin returns); whether it did."""
    seen = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal seen
        if event in ("c_call", "c_return"):
            caller = frame.f_code
        elif event == "call" and frame.f_back is not None:
            caller = frame.f_back.f_code
        else:
            return
        if caller in codes and event != "c_call":
            seen += 1
            if seen == n:
                sys.setprofile(None)
                raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        run()
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


@pytest.mark.timeout(60)
def test_evict_lets_go_of_what_the_read_ahead_holds(tmp_path: Path) -> None:
    """Once every forward and its scope ended, the read-ahead still holds the next forward's
    first tensors; ``pool.evict`` of one of them evicts it (it was refused: "while it is
    leased: release its lease first", a lease the caller never held), sync and async, and
    the next forward is still right."""
    dense, model, x = model_and_input(tmp_path)
    with torch.no_grad():
        expected = dense(x)
    first = model[0].weight
    with TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES) as pool:
        with pool.scope(), torch.no_grad():
            model(x)
            model(x)  # learns the wrap: the next forward's first layer is held
        assert _loaded_soon(pool, first)  # (its load may still run as the forward ends)
        pool.evict(first)
        assert not pool.is_resident(first)
        with pool.scope(), torch.no_grad():
            assert torch.equal(model(x), expected)

    async def evict_async() -> None:
        pool = TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES)
        async with pool:

            def forwards() -> None:
                with pool.scope(), torch.no_grad():
                    model(x)
                    model(x)

            await asyncio.to_thread(forwards)
            for _ in range(500):
                if pool.is_resident(first):
                    break
                await asyncio.sleep(0.01)
            assert pool.is_resident(first)
            await pool.aevict(first)
            assert not pool.is_resident(first)

    asyncio.run(evict_async())


def _loaded_soon(pool: TensorResidencyPool, source: OffloadedTensor) -> bool:
    """Whether ``source`` is resident within 5 s: the read-ahead loads in the background."""
    for _ in range(500):
        if pool.is_resident(source):
            return True
        time.sleep(0.01)
    return False


def learned(pool: TensorResidencyPool) -> int:
    """How many tensors the read-ahead's learned order holds (and its table of tensors)."""
    assert pool.read_ahead is not None
    tensors = pool.read_ahead.stats().tensors
    assert len(pool.read_ahead._sources) == tensors
    return tensors


@pytest.mark.timeout(60)
def test_the_learned_order_drops_the_tensors_of_a_dropped_model(tmp_path: Path) -> None:
    """Two models run through one pool; one is dropped: at the next forward, the learned
    order holds the other's tensors only (it kept every tensor it ever saw), and the read
    ahead along it still serves the forwards."""
    dense, model, x = model_and_input(tmp_path)
    other = offload_module(copy.deepcopy(dense), tmp_path / "other")
    with torch.no_grad():
        expected = dense(x)
    with TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES) as pool:
        with pool.scope(), torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), expected)
                assert torch.equal(other(x), expected)
        assert learned(pool) == 2 * 2 * LAYERS
        del model
        gc.collect()
        with pool.scope(), torch.no_grad():
            for _ in range(2):
                assert torch.equal(other(x), expected)
            before = counts(pool)
            assert torch.equal(other(x), expected)
        assert counts(pool)[1] == before[1]  # no load on demand: the order is relearned
        assert learned(pool) == 2 * LAYERS


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("young_collections")  # a collection per cycle
def test_a_pool_serving_model_after_model_does_not_grow(tmp_path: Path) -> None:
    """A long-lived pool runs 50 models in turn, each twice then dropped: the read-ahead
    holds the living model's tensors only, and its memory does not grow (every cycle added
    its tensors to the learned order for good)."""
    dense, _, x = model_and_input(tmp_path)
    with torch.no_grad():
        expected = dense(x)
    tracemalloc.start()
    try:
        with TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES) as pool:
            for cycle in range(50):
                model = offload_module(copy.deepcopy(dense), tmp_path / str(cycle))
                with pool.scope(), torch.no_grad():
                    for _ in range(2):
                        assert torch.equal(model(x), expected)
                del model
                gc.collect()
                assert learned(pool) <= 2 * 2 * LAYERS, cycle  # the last model's, at most
                if cycle == 9:
                    first = _trace_bytes()
            grown = _trace_bytes() - first
    finally:
        tracemalloc.stop()
    assert grown < 4096, grown


def _trace_bytes() -> int:
    """The bytes allocated by ``residency/_trace.py`` that are alive now."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, _trace.__file__)]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.timeout(60)
def test_tensors_that_die_while_the_read_ahead_holds_its_locks(tmp_path: Path) -> None:
    """The tensors of a model die in a garbage collection that runs while the thread holds
    the read-ahead's and the trace's locks (as one may, inside them): their callbacks take
    no lock (they would wait for ever), and the next access drops them."""
    dense, model, x = model_and_input(tmp_path)
    other = offload_module(copy.deepcopy(dense), tmp_path / "other")
    with TensorResidencyPool(max_cached_bytes=0, read_ahead=2 * LAYER_BYTES) as pool:
        read_ahead = pool.read_ahead
        assert read_ahead is not None
        with pool.scope(), torch.no_grad():
            model(x)
            other(x)
        assert learned(pool) == 2 * 2 * LAYERS
        with read_ahead._lock, read_ahead._trace._lock:
            del model
            gc.collect()
        with pool.scope(), torch.no_grad():
            assert torch.equal(other(x), dense(x))
        assert learned(pool) == 2 * LAYERS
