"""Prefetch-ahead streaming of a model bigger than the pool's budget."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import copy
import gc
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType
from typing import Literal, NamedTuple

import anyio
import pytest
import torch
from breakpoints import Breakpoint, breakpoints_in_new_threads, line_of, paused_in_new_threads
from forking import in_forked_child
from residency_checks import check_invariants, settle

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.checkpoint import offload_module
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.offload._protocol import ACTIVE_RESIDENCY
from torch_to_nnef.tensor.residency import (
    ModuleStream,
    ResidencyStrategy,
    TensorResidencyLease,
    TensorResidencyPool,
    active_tensor_residency,
    stream_modules,
)
from torch_to_nnef.tensor.residency._scope import PENDING, StreamScope, leave_pending

pytestmark = [pytest.mark.timeout(60)]
WIDTH = 64
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


class Blocks(torch.nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def offloaded_blocks(tmp_path: Path, count: int = 12) -> tuple[Blocks, Blocks]:
    dense = Blocks(count)
    model = Blocks(count)
    offload_module(model, tmp_path)
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())
    return dense, model


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_sync_forward_streams_under_the_budget(tmp_path: Path, depth: int) -> None:
    dense, model = offloaded_blocks(tmp_path)
    x = torch.randn(4, WIDTH)
    with TensorResidencyPool(max_cached_bytes=3 * LAYER_BYTES) as pool:
        with stream_modules(pool, model.blocks, depth=depth) as stream:
            for _ in range(3):
                assert torch.allclose(model(x), dense(x), atol=1e-6)
                # Between forwards the stream holds the next one's first `depth` modules
                # (weight and bias each), on top of the budget, once they are loaded.
                for block in model.blocks[:depth]:
                    for t in block.parameters():
                        pool.prefetch(t).wait()
                assert f"leased: {2 * depth}," in repr(pool)
                assert pool.resident_bytes <= (3 + depth) * LAYER_BYTES
                assert active_tensor_residency() is None  # the hooks restore the context
        assert "leased: 0," in repr(pool)
        assert pool.resident_bytes <= 3 * LAYER_BYTES
        stats = pool.stats()
        assert stats.loads >= 24 * 3 * 2 // 3  # most values were read again each pass
        hooks = [m._forward_pre_hooks for m in model.blocks] + [
            m._forward_hooks for m in model.blocks
        ]
        assert not any(hooks), "closing the stream removes its hooks"
        stream.close()  # idempotent


def test_forward_in_worker_threads_and_concurrent_requests(tmp_path: Path) -> None:
    dense, model = offloaded_blocks(tmp_path)
    inputs = [torch.randn(2, WIDTH) for _ in range(8)]

    async def serve() -> list[torch.Tensor]:
        async with TensorResidencyPool(max_cached_bytes=4 * LAYER_BYTES, max_workers=2) as pool:
            results: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
            with stream_modules(pool, model.blocks, depth=1):

                async def request(i: int) -> None:
                    results[i] = await anyio.to_thread.run_sync(model, inputs[i])

                async with anyio.create_task_group() as tg:
                    for i in range(len(inputs)):
                        tg.start_soon(request, i)
            assert "leased: 0," in repr(pool)
            return results

    for x, y in zip(inputs, anyio.run(serve), strict=True):
        assert torch.allclose(y, dense(x), atol=1e-6)


def test_leases_are_released_when_a_layer_raises(tmp_path: Path) -> None:
    """The layer's own error reaches the caller, and its leases are released.

    Mutation caught: the stream's pre-hook raising ``T2NErrorNotImplemented`` (a
    ``RuntimeError`` too, which the former bare ``pytest.raises(RuntimeError)`` accepted)
    failed this test.
    """
    _, model = offloaded_blocks(tmp_path, count=3)
    with TensorResidencyPool() as pool, stream_modules(pool, model.blocks):
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
            model(torch.randn(2, WIDTH + 1))
        assert type(raised.value) is RuntimeError
        assert "leased: 0," in repr(pool)
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())


@pytest.mark.parametrize("strategy", list(ResidencyStrategy))
def test_strategies_on_the_streaming_workload(tmp_path: Path, strategy: ResidencyStrategy) -> None:
    dense, model = offloaded_blocks(tmp_path, count=16)
    x = torch.randn(2, WIDTH)
    budget = 6 * LAYER_BYTES
    passes, accesses = 6, 6 * 32
    with TensorResidencyPool(max_cached_bytes=budget, strategy=strategy) as pool:
        with pool.scope(), stream_modules(pool, model.blocks, depth=1):
            for _ in range(passes):
                assert torch.allclose(model(x), dense(x), atol=1e-6)
        stats = pool.stats()
    # Accesses served without a disk read.
    served = 1 - stats.loads / accesses
    if strategy is ResidencyStrategy.LRU:
        assert served < 0.05, "a cyclic scan bigger than the budget defeats LRU"
    else:
        assert served > 0.15, f"{strategy}: only {served:.2f} of accesses served from memory"


@pytest.mark.parametrize("budget_layers", [0, 2])
@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
def test_streaming_reads_each_layer_once_per_forward(tmp_path: Path, budget_layers: int) -> None:
    """Past the last module, the stream leases the next forward's first module: it is read
    while the last one computes, and held until the next forward runs it, whatever the
    budget. Closing the stream releases it."""
    dense, model = offloaded_blocks(tmp_path, count=6)
    x = torch.randn(2, WIDTH)
    forwards = 4
    pool = TensorResidencyPool(max_cached_bytes=budget_layers * LAYER_BYTES)
    with pool:
        with stream_modules(pool, model.blocks, depth=1):
            for _ in range(forwards):
                assert torch.allclose(model(x), dense(x), atol=1e-6)
                for t in model.blocks[0].parameters():
                    pool.prefetch(t).wait()  # joins the load begun during the last module
                assert "leased: 2," in repr(pool)  # the first module's weight and bias
            stats = pool.stats()
        assert "leased: 0," in repr(pool)
    tensors_per_layer = 2  # weight and bias
    # Each layer is read once per forward; the first one of the next forward once more.
    assert stats.loads == (forwards * 6 + 1) * tensors_per_layer
    # The first forward reads into fresh memory; later loads reuse the evicted buffers.
    assert stats.reused_buffers >= (forwards - 1) * 6 * tensors_per_layer


def test_closing_the_pool_releases_what_a_stream_holds_ahead(tmp_path: Path) -> None:
    _, model = offloaded_blocks(tmp_path, count=3)
    pool = TensorResidencyPool(max_cached_bytes=0)
    stream = stream_modules(pool, model.blocks, depth=1)
    model(torch.randn(2, WIDTH))
    for t in model.blocks[0].parameters():
        pool.prefetch(t).wait()
    assert "leased: 2," in repr(pool)
    pool.close()  # no "values are still leased" error: the stream's look-ahead is dropped
    assert pool.closed
    stream.close()


def test_a_forward_after_the_pool_closed_fails_clearly(tmp_path: Path) -> None:
    _, model = offloaded_blocks(tmp_path, count=3)
    pool = TensorResidencyPool(max_cached_bytes=0)
    with stream_modules(pool, model.blocks, depth=1):
        model(torch.randn(2, WIDTH))
        pool.close()
        with pytest.raises(T2NErrorMisuse, match=r"streamed .* closed: close the stream"):
            model(torch.randn(2, WIDTH))
    assert pool.closed
    model(torch.randn(2, WIDTH))  # the stream closed: the tensors load from their files


@pytest.mark.parametrize("depth", [0, 2])
def test_a_failed_load_in_a_streamed_forward_leaves_no_lease(tmp_path: Path, depth: int) -> None:
    """A module's weight cannot be loaded (its payload file went missing): the forward fails
    with that error, and the leases begun for the module's other tensors are dropped."""
    _, model = offloaded_blocks(tmp_path, count=6)
    model.blocks[3].weight.offload_path.unlink()
    pool = TensorResidencyPool(max_cached_bytes=10**6)
    with (
        stream_modules(pool, model.blocks, depth=depth),
        pytest.raises(T2NErrorStorage, match="its payload file was deleted"),
    ):
        model(torch.randn(2, WIDTH))
    assert pool._actor.leased_count() == 0
    pool.close()  # refused while a lease is left
    assert pool.closed


def test_a_copy_of_a_streamed_model_is_not_streamed(tmp_path: Path) -> None:
    dense, model = offloaded_blocks(tmp_path, count=3)
    x = torch.randn(2, WIDTH)
    expected = dense(x)
    pool = TensorResidencyPool(max_cached_bytes=0)
    with stream_modules(pool, model.blocks, depth=1):
        assert torch.allclose(model(x), expected)
        copied = copy.deepcopy(model)
        path = tmp_path / "model.pt"
        torch.save(model, path)  # the hooks pickle as hooks that do nothing
        loaded = torch.load(path, weights_only=False)
        loads = pool.stats().loads
        assert torch.allclose(copied(x), expected)
        assert torch.allclose(loaded(x), expected)
        assert pool.stats().loads == loads  # neither copy runs through the stream's pool
    pool.close()
    assert torch.allclose(copied(x), expected)  # nor needs it open
    assert torch.allclose(loaded(x), expected)


# ---------------------------------------------------------------------------------------------
# Values bound in place of their tensors while a streamed module runs
# ---------------------------------------------------------------------------------------------
class Probe(torch.nn.Module):
    """A linear layer that records what its weight is while it runs, and may change it in
    place, wait for an event, or raise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH), requires_grad=False)
        self.seen: list[type] = []
        self.add_in_place = 0.0
        self.entered: threading.Event | None = None
        self.go_on: threading.Event | None = None
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(self.weight))
        if self.entered is not None and self.go_on is not None:
            self.entered.set()
            assert self.go_on.wait(10)
        if self.add_in_place:
            self.weight.add_(self.add_in_place)
        if self.interrupt:
            raise KeyboardInterrupt
        return x @ self.weight.t()


def leased(pool: TensorResidencyPool) -> int:
    """How many values of ``pool`` are leased, as its ``repr`` says."""
    found = re.search(r"leased: (\d+),", repr(pool))
    assert found is not None, repr(pool)
    return int(found.group(1))


def offloaded_probe(tmp_path: Path) -> tuple[Probe, OffloadedTensor]:
    probe = Probe()
    offload_module(probe, tmp_path)
    weight = probe.weight
    assert isinstance(weight, OffloadedTensor)
    return probe, weight


def test_a_streamed_module_runs_on_plain_values_and_gets_its_tensors_back(
    tmp_path: Path,
) -> None:
    probe, weight = offloaded_probe(tmp_path)
    expected = weight.reload()
    x = torch.randn(2, WIDTH)
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [probe]):
        assert torch.equal(probe(x), x @ expected.t())
        with pool.scope():
            assert torch.equal(probe(x), x @ expected.t())
        with TensorResidencyPool() as other, other.scope():  # the scope's pool serves its ops
            assert torch.equal(probe(x), x @ expected.t())
            assert other.stats().hits + other.stats().misses == 1
    assert probe.seen[:2] == [torch.Tensor, torch.Tensor]
    assert issubclass(probe.seen[2], OffloadedTensor)
    assert probe.weight is weight  # the tensor is back once the module returned


def test_a_change_in_place_during_a_streamed_forward_is_written_back(tmp_path: Path) -> None:
    probe, weight = offloaded_probe(tmp_path)
    before = weight.reload()
    probe.add_in_place = 1.0
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [probe]):
        probe(torch.randn(2, WIDTH))
        assert torch.equal(weight.reload(), before + 1)  # read-your-writes, pool still open
        probe(torch.randn(2, WIDTH))
    assert torch.equal(weight.reload(), before + 1 + 1)  # on disk once the pool closed
    assert probe.weight is weight


def test_a_model_half_after_a_forward_interrupted_inside_a_module_converts_it_whole(
    tmp_path: Path,
) -> None:
    """Ctrl-C inside a streamed module leaves its place bound to the pool's value until the
    stream closes; ``model.half()`` meanwhile assigns ``.data`` there. That must not change
    the pool's value under the tensor (it turned it float16 while the tensor said float32,
    and every read through the pool saw it), and the conversion must reach the tensor once
    the place gets it back (it was dropped, and the next forward mixed dtypes)."""
    probe, weight = offloaded_probe(tmp_path)
    expected = weight.reload().half()
    probe.interrupt = True
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe])
    with pytest.raises(KeyboardInterrupt):
        probe(torch.randn(2, WIDTH))
    probe.interrupt = False
    assert probe.weight is not weight  # still bound: the post-hook does not run on Ctrl-C
    probe.half()
    assert pool.resolve(weight).dtype == torch.float32  # the pool's value is left alone
    assert weight.reload().dtype == torch.float32
    stream.close()
    assert probe.weight is weight
    assert weight.dtype == torch.float16  # the conversion reached the tensor
    assert torch.equal(weight.reload(), expected)
    x = torch.randn(2, WIDTH).half()
    assert torch.equal(probe(x), x @ expected.t())
    pool.close()
    assert torch.equal(weight.reload(), expected)


def _forward_paused_while(
    probe: Probe, x: torch.Tensor, meanwhile: Callable[[Callable[[], None]], None]
) -> torch.Tensor:
    """Run ``probe(x)`` in a thread, and ``meanwhile(finish)`` while it is inside the module
    (its weight bound, before it computes); ``finish()`` lets the forward end and waits for
    it (done after ``meanwhile`` otherwise). Return its output."""
    results: list[torch.Tensor] = []
    go_on = threading.Event()
    probe.entered, probe.go_on = threading.Event(), go_on
    forward = threading.Thread(target=lambda: results.append(probe(x)))

    def finish() -> None:
        go_on.set()
        forward.join(10)

    forward.start()
    try:
        assert probe.entered.wait(10)
        meanwhile(finish)
    finally:
        finish()
    assert not forward.is_alive() and results
    probe.entered = probe.go_on = None
    return results[0]


def _probe_values_and_input(
    tmp_path: Path,
) -> tuple[Probe, OffloadedTensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A probe module with an offloaded weight, the weight's value, another value for it,
    and an input."""
    probe, weight = offloaded_probe(tmp_path)
    return probe, weight, weight.reload(), torch.randn(WIDTH, WIDTH), torch.randn(2, WIDTH)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["flush", "update_values"])
def test_a_change_of_another_read_write_lease_during_a_streamed_forward_is_not_the_forwards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    """While a streamed forward that never writes its weight is inside its module, a
    ``read_write`` lease of the same pool changes that weight (the value the forward holds):
    the change is the lease's, kept and written once, and the forward computes with it. The
    forward keeps nothing of its own: no second write-back after a flush wrote the lease's
    change, and no warning that its change was dropped when a later write stands."""
    probe, weight, before, new, x = _probe_values_and_input(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torch_to_nnef.tensor.residency"):
        with TensorResidencyPool() as pool, stream_modules(pool, [probe], depth=0):

            def change(finish: Callable[[], None]) -> None:
                with pool.acquire(weight, mode="read_write") as value:
                    value.add_(1.0)
                if then == "flush":
                    pool.flush(weight)
                else:
                    weight.update_values(new)

            out = _forward_paused_while(probe, x, change)
            assert torch.equal(out, x @ (before + 1).t())
            pool.flush()
            assert pool.stats().write_backs == (then == "flush"), "written again"
            assert "leased: 0," in repr(pool)
        assert "streamed forward" not in caplog.text
    assert probe.weight is weight
    assert torch.equal(weight.reload(), new if then == "update_values" else before + 1)


@pytest.mark.timeout(30)
def test_a_streamed_forward_ending_under_a_read_write_lease_of_its_pool_keeps_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``read_write`` lease of the pool, entered on the weight a streamed forward holds,
    changes it, then a write of the tensor comes, and the forward (which never writes its
    weight) ends while the lease is still held: the change under way is the lease's alone,
    dropped with the lease's warning as it ends; none says the forward's was."""
    probe, weight, before, new, x = _probe_values_and_input(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torch_to_nnef.tensor.residency"):
        with TensorResidencyPool() as pool, stream_modules(pool, [probe], depth=0):

            def change(finish: Callable[[], None]) -> None:
                with pool.acquire(weight, mode="read_write") as value:
                    value.add_(1.0)
                    weight.update_values(new)
                    finish()

            out = _forward_paused_while(probe, x, change)
            assert torch.equal(out, x @ (before + 1).t())
            assert "leased: 0," in repr(pool)
        assert "the lease's change is dropped" in caplog.text
        assert "streamed forward" not in caplog.text
    assert probe.weight is weight
    assert torch.equal(weight.reload(), new)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["nothing", "update_values"])
def test_a_streamed_forwards_change_after_another_leases_is_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    """A ``read_write`` lease of the pool changes the weight a streamed forward holds, then
    the forward changes it in place too: both changes are kept, the forward's on top of the
    lease's; with a write between them, the forward's change is dropped with a warning
    (made on an older value) and the later write stands."""
    probe, weight, before, new, x = _probe_values_and_input(tmp_path)
    probe.add_in_place = 1.0
    with caplog.at_level(logging.WARNING, logger="torch_to_nnef.tensor.residency"):
        with TensorResidencyPool() as pool, stream_modules(pool, [probe], depth=0):

            def change(finish: Callable[[], None]) -> None:
                with pool.acquire(weight, mode="read_write") as value:
                    value.add_(1.0)
                if then == "update_values":
                    weight.update_values(new)

            out = _forward_paused_while(probe, x, change)
            assert torch.allclose(out, x @ (before + 2).t(), atol=1e-4)
            assert "leased: 0," in repr(pool)
        dropped = "the forward's change is dropped, the later write stands" in caplog.text
        assert dropped == (then == "update_values")
    assert probe.weight is weight
    assert torch.allclose(weight.reload(), new if then == "update_values" else before + 2)


def test_a_forward_after_a_write_reads_the_new_value_while_another_runs_on_the_old(
    tmp_path: Path,
) -> None:
    """Two forwards in one module, a write between their reads: the later one computes with
    the written value, the earlier one finishes with one of the two, and the module gets its
    tensor back."""
    probe, weight = offloaded_probe(tmp_path)
    old = weight.reload()
    new = torch.randn(WIDTH, WIDTH)
    x = torch.randn(2, WIDTH)
    go_on = threading.Event()
    probe.entered, probe.go_on = threading.Event(), go_on
    results: dict[str, torch.Tensor] = {}
    with TensorResidencyPool() as pool, stream_modules(pool, [probe], depth=0):
        first = threading.Thread(target=lambda: results.setdefault("first", probe(x)))
        first.start()
        assert probe.entered.wait(10)
        probe.entered = probe.go_on = None  # the second forward runs straight through
        weight.update_values(new)
        results["second"] = probe(x)
        go_on.set()
        first.join(10)
        assert not first.is_alive()
        assert "leased: 0," in repr(pool)
    assert torch.equal(results["second"], x @ new.t())
    assert any(torch.equal(results["first"], x @ w.t()) for w in (old, new))
    assert probe.weight is weight


@pytest.mark.parametrize("write", ["half", "update_values", "in_place"])
def test_a_write_between_forwards_reaches_the_modules_begun_ahead(
    tmp_path: Path, write: str
) -> None:
    """Past its last module, a forward begins leases on the next forward's first modules: a
    write made before the next forward (a dtype change, ``update_values``, an in-place op) is
    what that forward reads."""
    dense, model = offloaded_blocks(tmp_path, 6)
    x = torch.randn(3, WIDTH)
    with (
        TensorResidencyPool(max_cached_bytes=2 * LAYER_BYTES) as pool,
        stream_modules(pool, list(model.blocks), depth=2),
    ):
        assert torch.equal(model(x), dense(x))  # the first two blocks are begun again
        if write == "half":
            model.half()
            dense.half()
            x = x.half()
        elif write == "update_values":
            weight = torch.full((WIDTH, WIDTH), 0.01)
            model.blocks[0].weight.update_values(weight)
            dense.blocks[0].weight.data.copy_(weight)
        else:
            with torch.no_grad():
                for module in (model, dense):
                    module.blocks[1].weight.mul_(0.5)
        assert torch.equal(model(x), dense(x)), "a forward read a value from before a write"


@pytest.mark.parametrize(("layer", "depth"), [(0, 1), (0, 2), (1, 2)])
def test_a_change_through_a_view_between_forwards_is_no_write_for_the_modules_begun_ahead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layer: int, depth: int
) -> None:
    """Past its last module, a forward begins leases on the next forward's first modules. An
    in-place op on a view of one of their values in the scope, before the next forward, is
    no write: that forward computes with the file's value, as any other read would (it
    computed with the changed one, which only the forward after it loaded again), and the
    pool says why once."""
    dense, model = offloaded_blocks(tmp_path, 3)
    x = torch.randn(3, WIDTH)
    expected = dense(x)
    with (
        caplog.at_level(logging.WARNING, logger="torch_to_nnef.tensor.residency"),
        TensorResidencyPool() as pool,
        stream_modules(pool, list(model.blocks), depth=depth),
        pool.scope(),
    ):
        assert torch.equal(model(x), expected)
        model.blocks[layer].weight[0].mul_(5)
        assert torch.equal(model(x), expected), "a forward computed with a view's change"
        assert torch.equal(model(x), expected)
    assert sum("changed in place outside a read_write lease" in m for m in caplog.messages) == 1
    assert torch.equal(model.blocks[layer].weight.reload(), dense.blocks[layer].weight)


def test_a_parameter_replaced_by_its_owner_is_left_alone(tmp_path: Path) -> None:
    probe, weight = offloaded_probe(tmp_path)
    x = torch.randn(2, WIDTH)
    with TensorResidencyPool() as pool, stream_modules(pool, [probe]):
        probe(x)
        assert probe.weight is weight
        replacement = torch.nn.Parameter(torch.ones(WIDTH, WIDTH), requires_grad=False)
        probe.weight = replacement
        assert torch.equal(probe(x), x @ replacement.t())
        assert probe.weight is replacement


def test_closing_the_stream_gives_back_what_an_interrupted_forward_held(tmp_path: Path) -> None:
    """Ctrl-C inside a streamed module skips its hooks (torch runs them on ``Exception``
    only): the stream's close still gives the module its tensor back, ends the leases and
    leaves the scope it opened; the pool then closes."""
    probe, weight = offloaded_probe(tmp_path)
    probe.interrupt = True
    pool = TensorResidencyPool(max_cached_bytes=0)
    stream = stream_modules(pool, [probe])
    with pytest.raises(KeyboardInterrupt):
        probe(torch.randn(2, WIDTH))
    assert type(probe.weight) is torch.Tensor  # bound when the interrupt landed
    assert active_tensor_residency() is not None  # the scope the stream opened for it
    assert "leased: 1," in repr(pool)
    stream.close()
    assert probe.weight is weight
    assert "leased: 0," in repr(pool)
    assert active_tensor_residency() is None
    pool.close()
    assert pool.closed


def test_the_next_forward_ends_what_forwards_interrupted_inside_a_module_held(
    tmp_path: Path,
) -> None:
    """Ctrl-C inside a streamed module, again and again, as in a notebook: the next forward
    of the thread gives back what each interrupted one still held (torch skipped its
    post-hook), keeping its change in place, instead of holding it until the stream closes
    (a lease more, and its value out of the budget, per interrupt)."""
    probe, weight = offloaded_probe(tmp_path)
    before = weight.reload()
    x = torch.randn(2, WIDTH)
    probe.add_in_place = 1.0
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [probe]):
        probe.interrupt = True
        inputs = []  # what the interrupted calls' frames held
        for _ in range(3):
            given = torch.randn(2, WIDTH)
            inputs.append(weakref.ref(given))
            with pytest.raises(KeyboardInterrupt):
                probe(given)
            del given
            assert "leased: 1," in repr(pool)  # the last one's, until the next forward
            assert active_tensor_residency() is not None  # the scope it opened
            assert type(probe.weight) is torch.Tensor  # still bound
        probe.interrupt = False
        probe.add_in_place = 0.0
        expected = before + 1 + 1 + 1  # (in that order, as the forwards added)
        assert torch.equal(probe(x), x @ expected.t())  # each interrupted change was kept
        assert "leased: 0," in repr(pool)
        assert active_tensor_residency() is None
        assert probe.weight is weight
        gc.collect()
        assert [ref() for ref in inputs] == [None] * 3  # no frame of theirs is kept
    assert torch.equal(weight.reload(), expected)


@pytest.mark.parametrize("depth", [0, 1])
def test_a_forward_after_one_interrupted_in_a_middle_layer_holds_what_a_whole_one_does(
    tmp_path: Path, depth: int
) -> None:
    dense, model = offloaded_blocks(tmp_path, count=4)
    x = torch.randn(2, WIDTH)
    middle = model.blocks[2]

    def interrupt(module: torch.nn.Module, args: object) -> None:
        raise KeyboardInterrupt

    with TensorResidencyPool(max_cached_bytes=LAYER_BYTES) as pool:
        with stream_modules(pool, list(model.blocks), depth=depth):
            assert torch.allclose(model(x), dense(x), atol=1e-6)
            settle(pool)
            whole = leased(pool)  # what it read ahead for the next forward
            handle = middle.register_forward_pre_hook(interrupt)  # once the stream's bound it
            for _ in range(3):
                with pytest.raises(KeyboardInterrupt):
                    model(x)
            handle.remove()
            assert torch.allclose(model(x), dense(x), atol=1e-6)
            settle(pool)
            assert leased(pool) == whole
            assert pool.resident_bytes <= 2 * LAYER_BYTES  # a layer read ahead, and the budget
            assert active_tensor_residency() is None
        assert all(isinstance(p, OffloadedTensor) for p in model.parameters())
        assert "leased: 0," in repr(pool)


def test_a_forward_interrupted_in_another_context_is_ended_by_the_next_one(
    tmp_path: Path,
) -> None:
    """A forward interrupted inside a module in a context of its own (an asyncio task's, a
    notebook cell's), then the thread's next forward in another: that one ends it although
    it cannot leave the scope set in the other context (it once kept the entry for good:
    the pool's close then kept what the stream read ahead, and refused, saying values were
    leased)."""
    dense, model = offloaded_blocks(tmp_path, count=2)
    x = torch.randn(2, WIDTH)

    def interrupt(module: torch.nn.Module, args: object) -> None:
        raise KeyboardInterrupt

    def interrupted() -> None:
        handle = model.blocks[1].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        handle.remove()

    pool = TensorResidencyPool(max_cached_bytes=LAYER_BYTES)
    stream = stream_modules(pool, list(model.blocks), depth=1)
    contextvars.copy_context().run(interrupted)
    assert torch.allclose(model(x), dense(x), atol=1e-6)
    assert active_tensor_residency() is None
    pool.close()
    assert pool.closed and leased(pool) == 0
    stream.close()
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())


class _TwoPools(NamedTuple):
    """Two probes, each streamed through a pool of its own, and pool A's scope left set by
    a forward of probe A interrupted inside it."""

    probe_a: Probe
    probe_b: Probe
    pool_a: TensorResidencyPool
    pool_b: TensorResidencyPool
    x: torch.Tensor
    expected_b: torch.Tensor  # probe B's output
    before: contextvars.Context  # a copy of the context made before the interrupt


@contextlib.contextmanager
def probe_a_interrupted(tmp_path: Path) -> Iterator[_TwoPools]:
    probe_a, weight_a = offloaded_probe(tmp_path / "a")
    probe_b, weight_b = offloaded_probe(tmp_path / "b")
    x = torch.randn(2, WIDTH)
    expected = x @ weight_b.reload().t()
    with (
        TensorResidencyPool() as pool_a,
        TensorResidencyPool() as pool_b,
        stream_modules(pool_a, [probe_a]),
        stream_modules(pool_b, [probe_b]),
    ):
        before = contextvars.copy_context()
        probe_a.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            probe_a(x)
        probe_a.interrupt = False
        assert active_tensor_residency() == (pool_a, None)  # left set
        yield _TwoPools(probe_a, probe_b, pool_a, pool_b, x, expected, before)
        assert leased(pool_a) == 0
        assert probe_a.weight is weight_a
    assert torch.equal(probe_b(x), expected)  # both closed: through the tensors


def _assert_b_is_pool_bs(two: _TwoPools) -> None:
    """Probe B's forward is right, bound by its own stream and served by pool B alone, and
    leaves no scope."""
    assert torch.equal(two.probe_b(two.x), two.expected_b)
    assert two.probe_b.seen == [torch.Tensor]  # bound by its own stream
    assert two.pool_b.stats().misses == 1
    assert two.pool_a.stats().misses == 1  # probe A's load only
    assert active_tensor_residency() is None


def test_a_model_streamed_through_another_pool_after_an_interrupted_forward_is_that_pools(
    tmp_path: Path,
) -> None:
    """A forward interrupted inside a module streamed through pool A leaves pool A's scope
    set; a model streamed through pool B, run next in the thread, ends that call and is
    served by pool B (its stream took the leftover scope for a forward of pool A's: pool A
    served B's weights, and B's stream bound nothing, until A's next forward)."""
    with probe_a_interrupted(tmp_path) as two:
        _assert_b_is_pool_bs(two)


def test_a_scope_entered_after_an_interrupted_forward_stays_the_users_until_it_ends(
    tmp_path: Path,
) -> None:
    """A forward interrupted inside a module streamed through pool A, then a user's
    ``with pool_a.scope():`` around forwards of that model and of one streamed through pool
    B: inside it, both are pool A's, and its exit leaves no scope for good (the stream's
    cleanup once reset its stale scope under the user's, undoing the user's; the block's exit
    then brought the stale one back, which nothing left any more: B was served by pool A,
    and failed once pool A closed)."""
    with probe_a_interrupted(tmp_path) as two:
        with two.pool_a.scope():
            two.probe_a(two.x)
            assert torch.equal(two.probe_b(two.x), two.expected_b)
            assert active_tensor_residency() == (two.pool_a, None)
        assert two.pool_b.stats().loads == 0  # B ran in pool A's scope, as asked
        assert torch.equal(two.probe_b(two.x), two.expected_b)  # the stale scope left
        assert two.pool_b.stats().loads == 1
        assert active_tensor_residency() is None


@pytest.mark.parametrize("context", ["copied", "asyncio"])
def test_a_forward_in_another_context_after_an_interrupted_one_strands_no_scope(
    tmp_path: Path, context: str
) -> None:
    """A forward interrupted inside a module streamed through pool A in the main context,
    then one through pool B in another context of the thread (a copy of the main one, where
    the stale scope cannot be reset): back in the main context, B's next forward leaves that
    scope and is pool B's (the entry was dropped in the other context, and the scope stayed
    set in the main one for good)."""
    with probe_a_interrupted(tmp_path) as two:
        if context == "copied":
            contextvars.copy_context().run(two.probe_b, two.x)
        else:

            async def forward() -> torch.Tensor:
                return two.probe_b(two.x)

            anyio.run(forward)
        assert leased(two.pool_a) == 0  # the interrupted call ended there
        assert active_tensor_residency() is not None  # its scope, left set here
        loads = two.pool_b.stats().loads
        assert torch.equal(two.probe_b(two.x), two.expected_b)
        assert two.pool_b.stats().loads == loads + 1
        assert active_tensor_residency() is None


@pytest.mark.parametrize("closed", ["stream", "pool"])
def test_closing_inside_a_users_scope_after_an_interrupted_forward_strands_no_scope(
    tmp_path: Path, closed: str
) -> None:
    """Pool A's stream (and pool A) closed inside a user's ``with pool_b.scope():``, after a
    forward interrupted inside a module of pool A's stream: the close cannot leave pool A's
    scope under the user's, and it is left as the user's exits (it stayed on the closed
    stream, which nothing found any more: pool A's scope came back for good, and once pool
    A closed, every forward of the thread failed)."""
    with probe_a_interrupted(tmp_path) as two:
        with two.pool_b.scope():
            if closed == "pool":
                two.pool_a.close()  # (ends its streams' calls of this thread, then closes)
            else:
                _stream_of(two.pool_a).close()
            assert active_tensor_residency() == (two.pool_b, None)
        assert active_tensor_residency() is None
        assert torch.equal(two.probe_b(two.x), two.expected_b)
        assert two.pool_b.stats().loads == 1


def _close_a_from_another_thread(two: _TwoPools, closed: str) -> None:
    """Close pool A's stream (and pool A, with ``closed == "pool"``) from another thread."""

    def close() -> None:
        _stream_of(two.pool_a).close()
        if closed == "pool":
            two.pool_a.close()

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert leased(two.pool_a) == 0  # the close ended the interrupted call's lease
    # The main thread's, left set (looked at as it is: `active_tensor_residency()` leaves
    # a stream's scope that a closed pool left over).
    assert ACTIVE_RESIDENCY.get() == (two.pool_a, None)


@pytest.mark.parametrize("closed", ["stream", "pool"])
def test_a_close_from_another_thread_after_an_interrupted_forward_strands_no_scope(
    tmp_path: Path, closed: str
) -> None:
    """Pool A's stream (or it and pool A) closed from another thread, after a forward
    interrupted inside a module of that stream in the main thread: the close cannot leave
    the scope the forward opened there, and a forward through pool B, next in the main
    thread, ends that call and is pool B's. (The closed stream was no longer its pool's,
    where B's pre-hook looked: B was served by pool A, and once pool A closed, every later
    forward of the thread failed. And the close let go of the call's frame, whose identity
    a new frame took, so that the call looked as if it still ran.)"""
    with probe_a_interrupted(tmp_path) as two:
        _close_a_from_another_thread(two, closed)
        _assert_b_is_pool_bs(two)


def test_an_op_after_a_close_from_another_thread_reads_through_the_tensor(
    tmp_path: Path,
) -> None:
    """Pool A and its stream closed from another thread, after a forward interrupted inside
    a module of that stream in the main thread: an op there on one of its tensors leaves the
    scope pool A's stream left over, and reads the tensor (it went to the closed pool, and
    every op of the thread on offloaded tensors failed)."""
    with probe_a_interrupted(tmp_path) as two:
        _close_a_from_another_thread(two, "pool")
        weight = two.probe_a.weight
        assert isinstance(weight, OffloadedTensor)  # the stream's close gave it back
        expected = two.x @ weight.reload().t()  # (no scope left: read from the file)
        assert active_tensor_residency() is None
        assert torch.equal(two.probe_a(two.x), expected)


def test_a_copy_of_the_context_made_after_an_interrupted_forward_reads_once_its_pool_closed(
    tmp_path: Path,
) -> None:
    """A copy of the context made after a forward interrupted inside a streamed module (an
    asyncio task's, say) carries the scope the stream opened, which only the original can
    reset. Once the stream and the pool closed, ops in the copy read the tensors (they went to
    the closed pool, and failed, for the copy's life)."""
    with probe_a_interrupted(tmp_path) as two:
        copied = contextvars.copy_context()
        _stream_of(two.pool_a).close()
        two.pool_a.close()
        assert active_tensor_residency() is None  # left here by the close
        assert copied.run(ACTIVE_RESIDENCY.get) == (two.pool_a, None)
        expected = two.x @ two.probe_a.weight.reload().t()
        assert torch.equal(copied.run(two.probe_a, two.x), expected)
        assert copied.run(ACTIVE_RESIDENCY.get) is None


def test_a_call_ended_in_a_copied_context_after_its_pool_closed_waits_to_be_left_here(
    tmp_path: Path,
) -> None:
    """Pool A and its stream closed from another thread after a forward interrupted inside
    it; an op in a copy of the context (an asyncio task's) ends the call, whose scope the
    copy cannot reset: it waits to be left in the main context, which the next op there does.
    (That op replaced the scope by none, and the waiting scope stayed in the thread's list
    for good, keeping the closed pool alive, one more per such event.)"""
    with probe_a_interrupted(tmp_path) as two:
        _close_a_from_another_thread(two, "pool")
        weight = two.probe_a.weight
        assert isinstance(weight, OffloadedTensor)
        expected = contextvars.copy_context().run(weight.reload)  # (ends the call there)
        assert len(PENDING.scopes) == 1  # its scope, set in the main context
        assert ACTIVE_RESIDENCY.get() == (two.pool_a, None)
        assert torch.equal(weight + 0, expected)
        assert not PENDING.scopes
        assert ACTIVE_RESIDENCY.get() is None


def _drop_a_stream_after_an_interrupt(pool: TensorResidencyPool, directory: Path) -> None:
    """A probe streamed through ``pool``, interrupted inside its forward, then dropped with
    its stream and collected in another thread (which cannot leave the scope it opened)."""

    def interrupted() -> weakref.ref[ModuleStream]:
        probe, _ = offloaded_probe(directory)
        stream = stream_modules(pool, [probe])
        probe.interrupt = True
        with contextlib.suppress(KeyboardInterrupt):
            probe(torch.randn(2, WIDTH))
        return weakref.ref(stream)

    stream = interrupted()
    collector = threading.Thread(target=gc.collect)
    collector.start()
    collector.join(10)
    assert stream() is None


def test_a_stream_collected_in_another_thread_after_an_interrupted_forward_strands_no_scope(
    tmp_path: Path,
) -> None:
    """A stream dropped with its model after a forward interrupted inside it, collected in
    another thread (which cannot leave the scope the forward opened), then its pool closed:
    ops of the interrupted thread on other offloaded tensors read them (the scope was left
    over on the closed pool, with no stream to end its call, and every op failed)."""
    other, other_weight = offloaded_probe(tmp_path / "other")
    expected = other_weight.reload()
    x = torch.randn(2, WIDTH)
    pool = TensorResidencyPool()
    _drop_a_stream_after_an_interrupt(pool, tmp_path / "streamed")
    settle(pool)
    pool.close()
    assert ACTIVE_RESIDENCY.get() == (pool, None)  # left set: the stream is gone
    assert torch.equal(other(x), x @ expected.t())
    assert active_tensor_residency() is None


@pytest.mark.parametrize("cut_in", ["this thread", "a thread that ended"])
def test_a_forward_in_another_pools_scope_sees_the_change_of_an_interrupted_call(
    tmp_path: Path, cut_in: str
) -> None:
    """A forward that changed its weight in place is cut inside the streamed module: in this
    thread (then another thread's forward gives the module its tensor back), or in a thread
    that then ended. The next forward of this thread runs in a user's scope of another pool:
    the stream's pre-hook ends the cut call first, its change kept, so that the forward and
    the reads of the tensor there see it. (The other pool served the file's value: the change
    stayed with the cut call; and, for a dead thread's, the module stayed bound to the first
    pool's changed value, which its forward used.)"""
    probe, weight = offloaded_probe(tmp_path)
    dense = weight.reload()
    x = torch.randn(2, WIDTH)
    with (
        TensorResidencyPool() as pool,
        TensorResidencyPool() as other,
        stream_modules(pool, [probe], depth=0),
    ):
        if cut_in == "this thread":
            probe.add_in_place, probe.interrupt = 0.25, True
            with pytest.raises(KeyboardInterrupt):
                probe(x)
            probe.add_in_place, probe.interrupt = 0.0, False
            forward = threading.Thread(target=probe, args=(x,))
            forward.start()
            forward.join(10)
            assert probe.weight is weight  # given back by that forward's exit
        else:
            _cut_in_a_thread_that_ends(probe, x, 0.25)
        with other.scope():
            assert torch.allclose(probe(x), x @ (dense + 0.25).t(), atol=1e-5)
            assert torch.allclose(weight + 0, dense + 0.25)
        assert probe.weight is weight and leased(pool) == 0
    assert torch.allclose(weight.reload(), dense + 0.25)


def test_a_stream_collected_in_another_thread_leaves_no_scope_on_its_open_pool(
    tmp_path: Path,
) -> None:
    """A stream dropped with its model after a forward interrupted inside it, collected in
    another thread (which cannot leave the scope that forward opened), its pool still open:
    the thread's next forward through another pool's stream is that pool's (the scope stayed,
    with no stream to end it: every such forward was served by the first pool)."""
    probe_b, weight_b = offloaded_probe(tmp_path / "b")
    x = torch.randn(2, WIDTH)
    expected = x @ weight_b.reload().t()
    with TensorResidencyPool() as pool_a, TensorResidencyPool() as pool_b:
        _drop_a_stream_after_an_interrupt(pool_a, tmp_path / "a")
        assert ACTIVE_RESIDENCY.get() == (pool_a, None)  # left set: the stream is gone
        with stream_modules(pool_b, [probe_b]):
            for _ in range(2):
                assert torch.equal(probe_b(x), expected)
                assert probe_b.seen[-1] is torch.Tensor  # bound by its own stream
            assert pool_b.stats().misses == 1
        assert active_tensor_residency() is None
        assert pool_a.stats().misses == 1  # the interrupted forward's load only


def _close_under_a_forward(
    probe: Probe, stream: ModuleStream, reached: threading.Event, go_on: threading.Event
) -> list[type[BaseException]]:
    """Run a forward of ``probe`` in another thread, close ``stream`` once the forward
    ``reached`` a point, then let it go on; the types of what the forward raised."""
    raised: list[BaseException] = []

    def forward() -> None:
        try:
            probe(torch.randn(2, WIDTH))
        except BaseException as error:
            raised.append(error)

    worker = threading.Thread(target=forward)
    worker.start()
    assert reached.wait(10)
    stream.close()
    go_on.set()
    worker.join(10)
    assert not worker.is_alive()
    return [type(error) for error in raised]


class _Failing(Probe):
    """A probe whose forward, once let go on, raises an error of the user's (with ``fail``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        if self.fail:
            raise ValueError("the user's own error")
        return output


def test_a_forward_failing_after_its_stream_closed_under_it_raises_its_own_error(
    tmp_path: Path,
) -> None:
    """A stream closed while a forward of another thread is inside a module, with a hook of
    the user's registered after the stream's: the forward then fails with the user's error
    (torch runs the hooks of a failing forward from the module's live table of hooks; the
    stream's hook removed itself there, and torch raised RuntimeError instead). The hook the
    close left goes at the module's next call."""
    probe = _Failing()
    offload_module(probe, tmp_path)
    probe.entered, probe.go_on = threading.Event(), threading.Event()
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe])
    probe.register_forward_hook(lambda module, args, output: None)
    assert _close_under_a_forward(probe, stream, probe.entered, probe.go_on) == [ValueError]
    assert len(probe._forward_hooks) == 2  # the user's, and the stream's for now
    probe.entered = probe.go_on = None
    with pytest.raises(ValueError, match="own error"):
        probe(torch.randn(2, WIDTH))
    assert len(probe._forward_hooks) == 2  # (not while an error is handled)
    probe.fail = False
    probe(torch.randn(2, WIDTH))
    assert len(probe._forward_hooks) == 1
    pool.close()


def test_a_close_while_a_failing_forward_runs_its_hooks_leaves_it_its_error(
    tmp_path: Path,
) -> None:
    """A forward of another thread fails with the user's error, and torch runs the module's
    hooks from its live table; the stream closes while a hook of the user's, after the
    stream's, runs: the close leaves the stream's post-hook, which goes at the module's next
    call (it removed it from the table torch was walking, which raised RuntimeError in place
    of the user's error)."""
    probe = _Failing()
    offload_module(probe, tmp_path)
    in_hook, go_on = threading.Event(), threading.Event()

    def blocking(module: torch.nn.Module, args: object, output: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            in_hook.set()
            assert go_on.wait(10)

    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe])
    probe.register_forward_hook(blocking, always_call=True)
    probe.register_forward_hook(lambda module, args, output: None)  # (the walk goes on)
    assert _close_under_a_forward(probe, stream, in_hook, go_on) == [ValueError]
    assert len(probe._forward_hooks) == 3  # the stream's, for now
    probe.fail = False
    probe(torch.randn(2, WIDTH))
    assert len(probe._forward_hooks) == 2
    pool.close()


def test_a_users_scope_of_a_closed_pool_still_refuses(tmp_path: Path) -> None:
    """A user's ``with pool.scope():`` whose pool another thread closed is no scope left
    over: ops on offloaded tensors inside it still say the pool is closed."""
    _probe, weight = offloaded_probe(tmp_path)
    pool = TensorResidencyPool()
    with pool.scope():
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join(10)
        with pytest.raises(T2NErrorMisuse, match="closed"):
            weight.reload()
        assert active_tensor_residency() == (pool, None)
    assert active_tensor_residency() is None


def _stream_of(pool: TensorResidencyPool) -> ModuleStream:
    (stream,) = list(pool._streams)
    return stream


def test_forwards_interrupted_in_contexts_that_ended_keep_none_of_them_alive(
    tmp_path: Path,
) -> None:
    """Forwards interrupted inside a streamed module, each in a context that then ended (an
    ``asyncio.run`` per request, say): the thread's next forward ends each call, and keeps
    nothing of its context (its scope stays set there, and nowhere else), where each kept
    one entry, and through its token the whole context, for the stream's life."""
    probe, weight = offloaded_probe(tmp_path)
    x = torch.randn(2, WIDTH)
    payload_var: contextvars.ContextVar[torch.Tensor] = contextvars.ContextVar("payload")
    payloads = []

    def request() -> None:
        payload = torch.zeros(1024)
        payloads.append(weakref.ref(payload))
        payload_var.set(payload)
        probe.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            probe(x)
        probe.interrupt = False

    with TensorResidencyPool() as pool, stream_modules(pool, [probe]):
        for _ in range(5):
            contextvars.copy_context().run(request)
            probe(x)  # ends the interrupted call
            assert leased(pool) == 0
            assert active_tensor_residency() is None
        assert not PENDING.scopes
        gc.collect()
        assert [ref() for ref in payloads] == [None] * 5
    assert probe.weight is weight


def test_a_waiting_scope_outlives_a_look_from_an_older_context(tmp_path: Path) -> None:
    """A stream's scope waiting under a user's ``with pool_a.scope():`` (a forward in it
    ended the interrupted call), then a forward through pool B in a context copied before
    the interrupt, where that scope is not: the scope still waits, and the user's exit
    leaves it (the look from the older context forgot it, and it came back at the exit for
    good)."""
    with probe_a_interrupted(tmp_path) as two:
        with two.pool_a.scope():
            two.probe_a(two.x)
            assert len(PENDING.scopes) == 1
            assert torch.equal(two.before.run(two.probe_b, two.x), two.expected_b)
            assert len(PENDING.scopes) == 1
        assert active_tensor_residency() is None
        assert not PENDING.scopes


def test_closing_a_pool_leaves_a_scope_a_copied_context_could_not(tmp_path: Path) -> None:
    """A stream's scope that waits because a copy of its context could not reset it: the
    pool's close, in the context that set it, leaves it (the closed pool's scope stayed, and
    every op on an offloaded tensor there failed, saying the pool is closed)."""
    probe, weight = offloaded_probe(tmp_path)
    x = torch.randn(2, WIDTH)
    dense = weight.reload()
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe])
    probe.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        probe(x)
    probe.interrupt = False

    def in_a_copy() -> None:
        with pool.scope():
            probe(x)

    contextvars.copy_context().run(in_a_copy)
    assert active_tensor_residency() == (pool, None)
    assert len(PENDING.scopes) == 1
    pool.close()
    assert active_tensor_residency() is None
    assert not PENDING.scopes
    stream.close()
    assert torch.equal(weight.reload(), dense)  # (it raised: the closed pool's scope)
    assert torch.equal(probe(x), x @ dense.t())


def test_leaving_waiting_scopes_survives_a_handler_that_leaves_them_too(
    tmp_path: Path,
) -> None:
    """Leaving the waiting scopes while a signal handler, run as the scope's reset ends,
    leaves them too (a handler that closes a stream): the outer pass finds its entry gone,
    and the user's block exit it runs in raises nothing (it raised ValueError)."""

    handled: list[bool] = []

    class _LeftByAHandlerToo(StreamScope):
        def leave_scope(self) -> Literal["left", "covered", "elsewhere"]:
            outcome = super().leave_scope()
            if not handled:  # the handler runs once, as the reset's hold ends
                handled.append(True)
                leave_pending()  # as the handler's close would
            return outcome

    with TensorResidencyPool() as pool:
        scope = _LeftByAHandlerToo()
        scope.set_scope((pool, None))
        PENDING.scopes.append(scope)
        assert leave_pending()
        assert handled == [True]
        assert not PENDING.scopes
        assert active_tensor_residency() is None


class _Refining(torch.nn.Module):
    """A streamed module whose forward calls itself once, and treats a KeyboardInterrupt in
    that inner call as "stop refining": it catches it and returns normally."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH), requires_grad=False)
        self.interrupt_inner = False

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        if inner:
            if self.interrupt_inner:
                raise KeyboardInterrupt
            return x + self.weight.sum()
        with contextlib.suppress(KeyboardInterrupt):
            x = self(x, inner=True)
        return x @ self.weight.t()


@pytest.mark.parametrize("interrupt_inner", [False, True])
def test_a_module_that_calls_itself_leaves_nothing_held_when_its_outer_call_returns(
    tmp_path: Path, interrupt_inner: bool
) -> None:
    """The inner call's post-hook is skipped when a Ctrl-C cuts it (torch runs it on errors
    only); the outer call's post-hook then ends the outer call's entry, and the inner one's
    (it once ended the inner one's only, the last on the stack: the outer lease and the scope
    stayed held after the forward returned)."""
    module = _Refining()
    offload_module(module, tmp_path)
    weight = module.weight
    assert isinstance(weight, OffloadedTensor)
    dense = weight.reload()
    x = torch.randn(2, WIDTH)
    expected = (x if interrupt_inner else x + dense.sum()) @ dense.t()
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [module]):
        module.interrupt_inner = interrupt_inner
        for _ in range(3):
            assert torch.allclose(module(x), expected, atol=1e-5)
            assert leased(pool) == 0
            assert active_tensor_residency() is None
            assert module.weight is weight
        settle(pool)  # (the release tells the pool it is over budget, without waiting)
        assert pool.resident_bytes == 0
    assert torch.equal(weight.reload(), dense)


class _Nested(NamedTuple):
    """A probe inside an outer module, offloaded, and their weights as they were."""

    inner: Probe
    outer: torch.nn.Module
    dense_outer: torch.Tensor
    dense_inner: torch.Tensor


def nested_probe(tmp_path: Path, outer_class: Callable[[Probe], torch.nn.Module]) -> _Nested:
    inner = Probe()
    outer = outer_class(inner)
    dense_outer, dense_inner = outer.weight.detach().clone(), inner.weight.detach().clone()
    offload_module(outer, tmp_path)
    return _Nested(inner, outer, dense_outer, dense_inner)


class _Outer(torch.nn.Module):
    """A streamed module that calls another streamed module inside its forward, and records
    whether its own weight was still bound (a plain tensor) once the inner one returned."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH), requires_grad=False)
        self.inner = inner
        self.bound_after_inner: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x @ self.weight.t())
        self.bound_after_inner.append(type(self.weight) is torch.Tensor)
        return y @ self.weight.t()


def test_a_module_streamed_inside_another_leaves_the_outer_call_what_it_holds(
    tmp_path: Path,
) -> None:
    """The inner module's pre-hook finds the outer call's entry: that call is running (its
    frame is on the stack), not interrupted, so its values stay bound and leased; after an
    interrupt inside the inner module, the next forward ends both calls."""
    inner, outer, expected_outer, expected_inner = nested_probe(tmp_path, _Outer)
    x = torch.randn(2, WIDTH)
    expected = (x @ expected_outer.t() @ expected_inner.t()) @ expected_outer.t()
    with TensorResidencyPool() as pool, stream_modules(pool, [outer, inner], depth=0):
        assert torch.allclose(outer(x), expected, atol=1e-5)
        assert outer.bound_after_inner == [True]
        inner.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            outer(x)
        assert "leased: 2," in repr(pool)  # both calls', until the next forward
        inner.interrupt = False
        assert torch.allclose(outer(x), expected, atol=1e-5)
        assert outer.bound_after_inner == [True, True]
        assert "leased: 0," in repr(pool)
        assert active_tensor_residency() is None
    assert isinstance(outer.weight, OffloadedTensor) and isinstance(inner.weight, OffloadedTensor)


class _Catching(torch.nn.Module):
    """A streamed module that calls another streamed module inside its forward, and treats a
    KeyboardInterrupt in that call as "skip it": it catches it and returns normally."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH), requires_grad=False)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        with contextlib.suppress(KeyboardInterrupt):
            y = self.inner(y)
        return y


def test_a_module_that_catches_the_interrupt_of_one_inside_it_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    """A Ctrl-C cuts a streamed module called inside another streamed module, which catches
    it and returns: as the outer call ends, the inner call's entry ends too (its lease, its
    binding, until the thread's next streamed forward)."""
    inner, outer, dense_outer, dense_inner = nested_probe(tmp_path, _Catching)
    inner_weight = inner.weight
    x = torch.randn(2, WIDTH)
    with TensorResidencyPool() as pool, stream_modules(pool, [outer, inner], depth=0):
        assert torch.allclose(outer(x), x @ dense_outer.t() @ dense_inner.t(), atol=1e-5)
        inner.interrupt = True
        for _ in range(2):
            assert torch.allclose(outer(x), x @ dense_outer.t(), atol=1e-5)
            assert leased(pool) == 0
            assert inner.weight is inner_weight
            assert active_tensor_residency() is None
        inner.interrupt = False
        assert torch.allclose(outer(x), x @ dense_outer.t() @ dense_inner.t(), atol=1e-5)
        assert inner.seen == [torch.Tensor] * 4  # bound each time it ran
    assert isinstance(outer.weight, OffloadedTensor) and inner.weight is inner_weight


def test_a_module_streamed_through_another_pool_inside_a_streamed_one_is_the_outer_pools(
    tmp_path: Path,
) -> None:
    """A module of pool B's stream run inside one of pool A's: the forward is in pool A's
    scope, and the outer call is not over, so pool A serves both (B's stream, seeing that
    scope, ends nothing of A's)."""
    inner, outer, expected_outer, expected_inner = nested_probe(tmp_path, _Outer)
    inner_weight = inner.weight
    x = torch.randn(2, WIDTH)
    expected = (x @ expected_outer.t() @ expected_inner.t()) @ expected_outer.t()
    with (
        TensorResidencyPool() as pool_a,
        TensorResidencyPool() as pool_b,
        stream_modules(pool_a, [outer]),
        stream_modules(pool_b, [inner]),
    ):
        for _ in range(2):
            assert torch.allclose(outer(x), expected, atol=1e-5)
        assert outer.bound_after_inner == [True, True]
        assert pool_b.stats().loads == 0
        assert pool_a.stats().loads == 2  # the outer weight, and the inner one in its scope
        assert leased(pool_a) == leased(pool_b) == 0
        assert active_tensor_residency() is None
    assert inner.weight is inner_weight


def test_a_stream_not_kept_streams_while_its_pool_is_open_then_goes_with_its_hooks(
    tmp_path: Path,
) -> None:
    """``stream_modules(pool, layers)`` without keeping the stream: the model holds it (and
    its pool) while the pool is open; once the pool closed, it goes with its hooks, and the
    model runs without the pool. (Its hooks once stayed, and every forward then failed
    with an error saying to close a stream no one could reach.)"""
    probe, weight = offloaded_probe(tmp_path)
    x = torch.randn(2, WIDTH)
    expected = x @ weight.reload().t()
    pool = TensorResidencyPool(max_cached_bytes=0)
    stream_modules(pool, [probe])
    gc.collect()
    assert torch.equal(probe(x), expected)
    assert pool.stats().misses == 1  # served by the pool: the stream is alive
    pool.close()
    assert not probe._forward_pre_hooks and not probe._forward_hooks
    assert torch.equal(probe(x), expected)
    assert pool.stats().misses == 1


def test_a_kept_stream_over_a_closed_pool_says_to_close_it(tmp_path: Path) -> None:
    """A stream its caller keeps stays in force once its pool closed: a forward then says to
    close it (running through the tensors would silently bypass the pool)."""
    probe, _weight = offloaded_probe(tmp_path)
    x = torch.randn(2, WIDTH)
    with TensorResidencyPool() as pool:
        stream = stream_modules(pool, [probe])
    gc.collect()
    with pytest.raises(
        T2NErrorMisuse, match=r"through a TensorResidencyPool that is closed: close"
    ):
        probe(x)
    stream.close()
    assert probe(x).shape == (2, WIDTH)


def test_closing_the_pool_in_the_thread_of_an_interrupted_forward_keeps_its_change(
    tmp_path: Path,
) -> None:
    """The usual shape of a Ctrl-C: a streamed forward interrupted inside ``with pool``, its
    stream left open. Leaving the block closes the pool: the forward's leases end, its
    in-place change is written back, its module gets its tensor back and the thread leaves
    the scope the stream opened."""
    probe, weight = offloaded_probe(tmp_path)
    before = weight.reload()
    probe.add_in_place, probe.interrupt = 1.0, True
    with pytest.raises(KeyboardInterrupt), TensorResidencyPool(max_cached_bytes=0) as pool:
        stream_modules(pool, [probe])
        probe(torch.randn(2, WIDTH))
    assert pool.closed and "leased: 0," in repr(pool)
    assert probe.weight is weight
    assert active_tensor_residency() is None
    assert torch.equal(weight.reload(), before + 1)  # on disk, read outside any pool


def test_leaving_async_with_pool_after_an_interrupted_forward_on_the_loop_keeps_its_change(
    tmp_path: Path,
) -> None:
    """The same with ``async with pool`` and a forward run on the loop thread itself."""
    probe, weight = offloaded_probe(tmp_path)
    before = weight.reload()
    probe.add_in_place, probe.interrupt = 1.0, True

    async def serve() -> TensorResidencyPool:
        async with TensorResidencyPool(max_cached_bytes=0) as pool:
            stream_modules(pool, [probe])
            with pytest.raises(KeyboardInterrupt):
                probe(torch.randn(2, WIDTH))
            assert "leased: 1," in repr(pool)
        return pool

    pool = anyio.run(serve)
    assert pool.closed and "leased: 0," in repr(pool)
    assert probe.weight is weight
    assert torch.equal(weight.reload(), before + 1)


def test_a_forward_interrupted_in_another_thread_holds_its_leases_until_its_stream_closes(
    tmp_path: Path,
) -> None:
    """Another thread's forward may still be running: closing the pool leaves its leases to
    it, and says to close its stream."""
    probe, weight = offloaded_probe(tmp_path)
    probe.interrupt = True
    pool = TensorResidencyPool(max_cached_bytes=0)
    stream = stream_modules(pool, [probe])
    interrupted: list[bool] = []
    finished, leave = threading.Event(), threading.Event()

    def forward() -> None:  # the thread lives on (a thread that ends drops what it held)
        try:
            probe(torch.randn(2, WIDTH))
        except KeyboardInterrupt:
            interrupted.append(True)
        finished.set()
        assert leave.wait(10)

    thread = threading.Thread(target=forward)
    thread.start()
    try:
        assert finished.wait(10) and interrupted == [True]
        with pytest.raises(T2NErrorMisuse, match=r"interrupted in another thread .* is closed"):
            pool.close()
        assert not pool.closed
        stream.close()
        assert probe.weight is weight
        pool.close()
        assert pool.closed
    finally:
        leave.set()
        thread.join(10)


class _Gate(torch.nn.Module):
    """A module (no tensors of its own) that the first forward through it waits inside."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.leave = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inside.is_set():
            self.inside.set()
            assert self.leave.wait(10)
        return x


@pytest.mark.parametrize("held_by", ["a forward inside a module", "a plain lease"])
def test_a_refused_close_leaves_a_forward_between_two_modules_what_it_began_ahead(
    tmp_path: Path, held_by: str
) -> None:
    """A close refused because something is leased (another forward inside a module, or a
    plain lease) leaves intact a forward that was between two modules as the close looked at
    the threads (nothing held: it looked idle), then went on into the next module. Seeing a
    forward inside, the close gives back nothing the streams began ahead; seeing none, it
    does, and the forward takes again what the close dropped. It failed: "this lease was
    dropped before it was entered"."""
    dense, model = offloaded_blocks(tmp_path, count=4)
    gate = _Gate()
    x = torch.randn(2, WIDTH)
    expected = torch.nn.Sequential(dense.blocks[0], torch.nn.Identity(), *dense.blocks[1:])(x)
    layers = torch.nn.Sequential(model.blocks[0], gate, *model.blocks[1:])
    other = OffloadedTensor.from_original_tensor(torch.ones(4), "other", offload_dir=tmp_path)
    pool = TensorResidencyPool(max_cached_bytes=2 * LAYER_BYTES, max_workers=2)
    stream = stream_modules(pool, list(layers), depth=2)
    outputs: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    refusals: list[BaseException] = []
    left = Breakpoint(ModuleStream._after.__code__, "return")
    entering = Breakpoint(
        ModuleStream._before.__code__,
        "line",
        line=line_of(ModuleStream._before, "lease.__enter__()"),
    )
    releasing = Breakpoint(
        ModuleStream._release_next_forward.__code__,
        "line",
        line=line_of(ModuleStream._release_next_forward, "for leases in next_forward"),
    )

    def forward(name: str) -> None:
        try:
            outputs[name] = layers(x)
        except BaseException as error:
            errors.append(error)

    def close() -> None:
        try:
            pool.close()
        except T2NErrorMisuse as error:
            refusals.append(error)

    threads: list[threading.Thread] = []
    lease = pool.acquire(other)
    try:
        with breakpoints_in_new_threads(left, entering, releasing):
            if held_by == "a plain lease":
                lease.__enter__()
                gate.inside.set()  # forwards pass through the gate
            else:
                threads.append(threading.Thread(target=forward, args=("inside",)))
                threads[-1].start()  # waits in the gate, holding what its modules began
                assert gate.inside.wait(10)
            left.armed.set()  # the next forward pauses as it leaves its first module
            threads.append(threading.Thread(target=forward, args=("between",)))
            threads[-1].start()
            assert left.paused.wait(10)
            releasing.armed.set()
            closer = threading.Thread(target=close)
            closer.start()
            deadline = time.monotonic() + 10
            while not releasing.paused.is_set() and closer.is_alive():
                assert time.monotonic() < deadline
                time.sleep(0.001)
            entering.armed.set()  # that forward goes on to its next module's leases
            left.go()
            assert entering.paused.wait(10)
            releasing.go()  # (a close that saw no forward inside drops what it began)
            closer.join(10)
            entering.go()
            gate.leave.set()
            for thread in threads:
                thread.join(10)
        assert len(refusals) == 1 and "leased" in str(refusals[0])
        assert errors == []
        for name in outputs:
            assert torch.allclose(outputs[name], expected, atol=1e-6)
        assert len(outputs) == len(threads)
    finally:
        gate.leave.set()
        lease.__exit__(None, None, None)
        stream.close()
        pool.close()
    assert pool.closed


def test_a_pool_whose_async_exit_a_forward_outlived_closes_once_the_forward_ended(
    tmp_path: Path,
) -> None:
    """``async with pool`` left with an error while another thread's forward holds leases:
    the close is refused and logged, and the pool stays open. The forward ends as the exit
    logs it (a slow log handler) and its stream begins the next forward's leases; once no
    loop serves the pool, ``close()`` gives those back as a served close does. (It refused
    them for good: only closing the stream let the pool close.)"""
    _dense, model = offloaded_blocks(tmp_path, count=3)
    x = torch.randn(2, WIDTH)
    paused, resume, ended = threading.Event(), threading.Event(), threading.Event()

    def pause(module: torch.nn.Module, args: object) -> None:
        if not ended.is_set():
            paused.set()
            assert resume.wait(10)

    class ForwardEndsAsTheRefusalIsLogged(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "stays open" in record.getMessage():
                resume.set()
                assert ended.wait(10)

    def forward() -> None:
        with torch.no_grad():
            model(x)
        ended.set()

    threads: list[threading.Thread] = []

    async def serve(pool: TensorResidencyPool) -> None:
        async with pool:
            stream_modules(pool, model.blocks, depth=1)
            await anyio.to_thread.run_sync(forward)  # every value resident: hits from now on
            ended.clear()
            model.blocks[1].register_forward_pre_hook(pause)
            threads.append(threading.Thread(target=forward))
            threads[0].start()
            await anyio.to_thread.run_sync(paused.wait, 10)
            raise RuntimeError("the request failed")

    logger = logging.getLogger("torch_to_nnef.tensor.residency")
    handler = ForwardEndsAsTheRefusalIsLogged()
    logger.addHandler(handler)
    pool = TensorResidencyPool()
    try:
        with pytest.raises(RuntimeError, match="the request failed"):
            anyio.run(serve, pool)
    finally:
        logger.removeHandler(handler)
        resume.set()
        for thread in threads:
            thread.join(10)
    assert ended.is_set() and not pool.closed
    assert "leased: 2," in repr(pool)  # the next forward's first module, begun ahead
    pool.close()
    assert pool.closed and "leased: 0," in repr(pool)


def test_a_thread_that_ends_after_an_interrupted_forward_leaves_its_leases_to_the_stream(
    tmp_path: Path,
) -> None:
    """A thread ends after a forward interrupted inside a streamed module: the stream ends
    what that forward held at its next forward (the leases, and the module's places)."""
    probe, weight = offloaded_probe(tmp_path)
    expected = weight.reload()
    probe.interrupt = True
    x = torch.randn(2, WIDTH)
    interrupted: list[bool] = []

    def forward() -> None:
        try:
            probe(x)
        except KeyboardInterrupt:
            interrupted.append(True)

    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [probe]):
        thread = threading.Thread(target=forward)
        thread.start()
        thread.join(10)
        assert interrupted == [True]
        del thread
        gc.collect()
        assert "leased: 1," in repr(pool)  # the stream's, until its next forward
        probe.interrupt = False
        assert torch.equal(probe(x), x @ expected.t())  # the next forward binds afresh
        assert probe.weight is weight
        settle(pool)
        assert "leased: 0," in repr(pool)
    assert pool.closed


def _cut_in_a_thread_that_ends(probe: Probe, x: torch.Tensor, add: float) -> None:
    """A forward of ``probe`` in a new thread changes its weight in place (``add``), is cut by
    a Ctrl-C inside the module, and the thread ends (its state collected)."""

    def cut() -> None:
        probe.add_in_place, probe.interrupt = add, True
        try:
            with contextlib.suppress(KeyboardInterrupt):
                probe(x)
        finally:
            probe.add_in_place, probe.interrupt = 0.0, False

    worker = threading.Thread(target=cut)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    del worker
    gc.collect()


@pytest.mark.parametrize("then", ["close", "forward"])
def test_a_thread_that_ends_inside_a_streamed_module_loses_none_of_its_change(
    tmp_path: Path, then: str
) -> None:
    """A forward in a worker thread changes its weight in place, then a Ctrl-C (or
    ``sys.exit``: torch runs post-hooks on ``Exception`` only) cuts it inside the module, and
    the thread ends. What that forward held goes to the stream, which ends it as a close
    would: at the stream's close, or at the next forward through it (the leases ended as
    their thread's state was collected, the change dropped, and the module stayed bound to
    the pool's value until the stream closed)."""
    probe, weight = offloaded_probe(tmp_path)
    dense = weight.reload()
    x = torch.randn(2, WIDTH)
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe], depth=0)

    _cut_in_a_thread_that_ends(probe, x, 0.5)
    if then == "forward":
        assert torch.allclose(probe(x), x @ (dense + 0.5).t(), atol=1e-5)
        assert probe.weight is weight and leased(pool) == 0
    stream.close()
    pool.close()
    assert torch.allclose(weight.reload(), dense + 0.5)


class _CutOuter(_Outer):
    """An outer module whose forward a Ctrl-C may cut before it calls the inner one."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__(inner)
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.interrupt:
            raise KeyboardInterrupt
        return super().forward(x)


def test_a_module_inside_one_a_dead_thread_was_cut_in_is_its_own_streams_again(
    tmp_path: Path,
) -> None:
    """An outer module streamed through pool A holds an inner one streamed through pool C. A
    forward of the outer one, cut inside it in a thread that then ended, left the inner
    module's place bound to pool A's value; the inner module's own stream, which could not
    bind it, ends that call first, so that a change its forward makes in place is its pool's
    (it went into pool A's value, and every read of the tensor gave the older value until
    the outer module ran again)."""
    inner, outer, _, dense_inner = nested_probe(tmp_path, _CutOuter)
    inner_weight = inner.weight
    x = torch.randn(2, WIDTH)
    with (
        TensorResidencyPool() as pool_a,
        TensorResidencyPool() as pool_c,
        stream_modules(pool_a, [outer], depth=0),
        stream_modules(pool_c, [inner], depth=0),
    ):
        outer(x)

        def cut() -> None:
            with contextlib.suppress(KeyboardInterrupt):
                outer(x)

        outer.interrupt = True
        worker = threading.Thread(target=cut)
        worker.start()
        worker.join(10)
        del worker
        gc.collect()
        outer.interrupt = False
        inner.add_in_place = 0.25
        inner(x)
        inner.add_in_place = 0.0
        assert inner.weight is inner_weight
        assert torch.allclose(inner_weight.reload(), dense_inner + 0.25)
        assert leased(pool_a) == 0 and leased(pool_c) == 0
    assert torch.allclose(inner_weight.reload(), dense_inner + 0.25)


def test_a_forked_child_streams_its_own_model_while_the_parent_holds_a_dead_threads_call(
    tmp_path: Path,
) -> None:
    """A forward cut inside a streamed module in a thread that then ended leaves its call to
    the stream; a child forked then streams a model of its own through a pool of its own (its
    pre-hook ended the parent's call first, through the parent's pool, which refused in the
    child: every forward there failed). The parent keeps the call's change."""
    probe, weight = offloaded_probe(tmp_path / "parent")
    other, other_weight = offloaded_probe(tmp_path / "child")
    dense = weight.reload()
    x = torch.randn(2, WIDTH)
    expected = x @ other_weight.reload().t()
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe], depth=0)
    _cut_in_a_thread_that_ends(probe, x, 0.5)

    def child() -> str:
        with TensorResidencyPool() as own, stream_modules(own, [other]):
            right = torch.equal(other(x), expected)
        return f"streamed, right: {right}"

    assert in_forked_child(child) == "streamed, right: True"
    stream.close()
    pool.close()
    assert torch.allclose(weight.reload(), dense + 0.5)


def test_a_closed_stream_keeps_nothing_of_a_thread_that_ends_after_its_close(
    tmp_path: Path,
) -> None:
    """A forward cut inside a streamed module in a thread that lives on; the stream and the
    pool close (keeping its change); then the thread ends: the closed stream takes nothing of
    it (it kept the thread's entry, and its scope's value, for the stream's life)."""
    probe, weight = offloaded_probe(tmp_path)
    dense = weight.reload()
    x = torch.randn(2, WIDTH)
    pool = TensorResidencyPool()
    stream = stream_modules(pool, [probe], depth=0)
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        probe.add_in_place, probe.interrupt = 0.5, True
        with pytest.raises(KeyboardInterrupt):
            executor.submit(probe, x).result(timeout=10)
        probe.add_in_place, probe.interrupt = 0.0, False
        stream.close()
        pool.close()
    gc.collect()
    assert not stream._orphans
    assert torch.allclose(weight.reload(), dense + 0.5)


def test_a_stream_dropped_with_its_model_after_an_interrupted_forward_lets_everything_go(
    tmp_path: Path,
) -> None:
    """Ctrl-C inside a streamed module, then the stream and the model dropped without close:
    the thread leaves the scope the stream opened, the leases end, and the pool closes."""
    probe, weight = offloaded_probe(tmp_path)
    expected = weight.reload()
    probe.interrupt = True
    pool = TensorResidencyPool(max_cached_bytes=0)
    stream = stream_modules(pool, [probe])
    with pytest.raises(KeyboardInterrupt):
        probe(torch.randn(2, WIDTH))
    assert active_tensor_residency() is not None
    del stream, probe
    gc.collect()
    assert active_tensor_residency() is None
    pool.close()
    assert pool.closed
    assert torch.equal(weight.reload(), expected)  # read outside any pool


def test_a_script_interrupted_in_a_streamed_forward_keeps_the_changes_made_before(
    tmp_path: Path,
) -> None:
    """The usual end of a Ctrl-C: a script streaming a model, never closing its pool, dies of
    the KeyboardInterrupt raised inside a module. What the modules that ran changed in place
    reaches the files at exit; the module that did not run keeps its values."""
    import subprocess
    import sys

    script = f"""
import os, shutil, signal, torch, weakref
from torch import nn
from torch_to_nnef.tensor.checkpoint import offload_module
from torch_to_nnef.tensor.residency import TensorResidencyPool, stream_modules
directory = {str(tmp_path)!r}
model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])
offload_module(model, directory)
weights = [module.weight for module in model]
def save():  # after the pool's exit work, before the tensors' files are removed
    for i, weight in enumerate(weights):
        shutil.copy(weight.offload_path, os.path.join(directory, f"saved{{i}}.bin"))
class Anchor: pass
anchor = Anchor()  # finalizers pending at exit run after the pool's exit work, newest first
weakref.finalize(anchor, save)
pool = TensorResidencyPool()
stream = stream_modules(pool, list(model))
def change(module, args):
    module.weight.fill_(7.0)
    if module is model[2]:
        signal.raise_signal(signal.SIGINT)
for module in model:
    module.register_forward_pre_hook(change)
with pool.scope(), torch.no_grad():
    model(torch.ones(1, 8))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50
    )
    assert "KeyboardInterrupt" in result.stderr, result.stderr
    saved = [
        next(iter(storage.read_payload(storage.read_layout(tmp_path / f"saved{i}.bin")).values()))
        for i in range(4)
    ]
    assert all(torch.equal(value, torch.full((8, 8), 7.0)) for value in saved[:3])
    assert not torch.equal(saved[3], torch.full((8, 8), 7.0)), "the last module never ran"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_streamed_forward_is_told_and_can_close_the_stream(
    tmp_path: Path,
) -> None:
    """A fork while another thread runs a streamed module (its place holds a plain value):
    in the child, the forward says to create a new pool, and closing the stream gives the
    module its tensor back, so that the child runs it without the pool."""
    probe, weight = offloaded_probe(tmp_path)
    expected = weight.reload()
    x = torch.randn(2, WIDTH)
    entered, go_on = threading.Event(), threading.Event()
    probe.entered, probe.go_on = entered, go_on
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, [probe]) as stream:
        forward = threading.Thread(target=probe, args=(x,))
        forward.start()
        assert entered.wait(10)
        assert type(probe.weight) is torch.Tensor  # bound for the forward under way

        def child() -> str:
            probe.entered = probe.go_on = None
            outcomes = []
            try:
                probe(x)
                outcomes.append("ran")
            except T2NErrorMisuse as error:
                outcomes.append("forked" if "forked" in str(error) else str(error))
            stream.close()
            outcomes.append(f"tensor back: {probe.weight is weight}")
            outcomes.append(f"right: {torch.equal(probe(x), x @ expected.t())}")
            return ", ".join(outcomes)

        try:
            assert in_forked_child(child) == "forked, tensor back: True, right: True"
        finally:
            go_on.set()
            forward.join(10)
    assert probe.weight is weight
    assert probe.seen == [torch.Tensor]  # the parent's forward ran on the plain value


def test_nested_streamed_modules_and_a_trace_read_the_right_values(tmp_path: Path) -> None:
    """A module listed inside another listed one: the inner one's return gives the places
    their tensors back, and the outer one goes on through them; a trace records the
    tensors' expansion, not their values."""
    dense, model = offloaded_blocks(tmp_path, count=3)
    x = torch.randn(2, WIDTH)
    with TensorResidencyPool() as pool, stream_modules(pool, [model, model.blocks[1]]):
        assert torch.allclose(model(x), dense(x), atol=1e-6)
        traced = torch.jit.trace(model, x, check_trace=False)
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())
    assert "t2n::opaque_tensor_expand" in str(traced.inlined_graph)


def test_concurrent_streamed_forwards_while_the_weights_are_rewritten(tmp_path: Path) -> None:
    """Three threads run forwards through streamed layers while a fourth rewrites every
    layer's weight, again and again: each forward computes with values that were written,
    nothing is left leased or bound, and the last writes stand."""
    width, versions = 16, 12
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(3))
    for layer in layers:
        torch.nn.init.constant_(layer.weight, 1.0)
    offload_module(layers, tmp_path)
    weights = [layer.weight for layer in layers]
    x = torch.full((1, width), 1.0 / width)
    # With constant weights c1, c2, c3 (each a written version), every output is
    # width**2 * c1 * c2 * c3.
    possible = {
        float(width**2 * a * b * c)
        for a in range(1, versions + 1)
        for b in range(1, versions + 1)
        for c in range(1, versions + 1)
    }
    errors: list[BaseException] = []
    outputs: list[float] = []

    def forwards() -> None:
        try:
            for _ in range(40):
                y = x
                for layer in layers:
                    y = layer(y)
                outputs.extend(y.flatten().tolist())
        except BaseException as error:  # reported below
            errors.append(error)

    def writes() -> None:
        try:
            for version in range(2, versions + 1):
                for weight in weights:
                    weight.update_values(torch.full((width, width), float(version)))
        except BaseException as error:
            errors.append(error)

    with TensorResidencyPool(max_cached_bytes=2 * width * width * 4) as pool:
        with stream_modules(pool, layers, depth=1):
            threads = [threading.Thread(target=forwards) for _ in range(3)]
            threads.append(threading.Thread(target=writes))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors
        assert "leased: 0," in repr(pool)
    assert len(outputs) == 3 * 40 * width
    assert set(outputs) <= possible, sorted(set(outputs) - possible)[:5]
    assert all(layer.weight is weight for layer, weight in zip(layers, weights, strict=True))
    for weight in weights:
        assert torch.equal(weight.reload(), torch.full((width, width), float(versions)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_a_streamed_norm_in_training_mode_keeps_its_running_statistics(
    tmp_path: Path, norm: str
) -> None:
    """A batch norm's kernel updates its running mean and variance in place without torch's
    version counter moving: the stream takes them as changed in training mode (written back,
    as a forward's in-place changes are). A tracking instance norm copies them in (the
    counter moves): kept as any in-place change."""
    torch.manual_seed(0)
    if norm == "batch":
        layer: torch.nn.Module = torch.nn.BatchNorm1d(4)
        x = torch.randn(8, 4)
    else:
        layer = torch.nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        x = torch.randn(3, 4, 5)
    dense = torch.nn.Sequential(torch.nn.Linear(x.shape[-1], x.shape[-1]), layer)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    with TensorResidencyPool(max_cached_bytes=0) as pool, stream_modules(pool, list(model)):
        for _ in range(3):
            assert torch.allclose(model(x), dense(x))
        model.eval(), dense.eval()
        assert torch.equal(model(x), dense(x))
    assert pool.stats().write_backs >= 2  # the running mean and variance, once closed
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(model[1], name).reload(), getattr(dense[1], name)), name


def test_a_forward_in_another_pools_scope_takes_nothing_from_this_stream(tmp_path: Path) -> None:
    """One model streamed through two pools: a forward in one pool's scope is that pool's
    alone, so the other pool (its stream, its close) never holds anything of it."""
    dense, model = offloaded_blocks(tmp_path, count=4)
    x = torch.randn(2, WIDTH)
    inside, leave = threading.Event(), threading.Event()

    def pause(module: torch.nn.Module, args: object) -> None:
        inside.set()
        assert leave.wait(10)

    first, second = TensorResidencyPool(), TensorResidencyPool()
    with second, stream_modules(second, model.blocks):
        stream = stream_modules(first, model.blocks)
        handle = model.blocks[2].register_forward_pre_hook(pause)
        outcome: list[object] = []

        def forward() -> None:
            with second.scope(), torch.no_grad():
                outcome.append(model(x))

        thread = threading.Thread(target=forward)
        thread.start()
        try:
            assert inside.wait(10)
            assert first.stats().loads == 0 and first.resident_bytes == 0
            assert "leased: 0," in repr(first)
            stream.close()
            first.close()  # nothing of the other pool's forward is leased here
        finally:
            leave.set()
            thread.join(10)
            handle.remove()
        assert torch.allclose(outcome[0], dense(x), atol=1e-6)  # type: ignore[arg-type]
        assert second.stats().loads > 0
    assert first.closed and second.closed


def test_closing_a_stream_under_a_running_forward_fails_it_clearly(tmp_path: Path) -> None:
    """The stream closes while another thread's forward is between beginning its leases and
    entering them: that forward fails with a clear error (kept, as a future keeps it), and
    nothing it began stays leased."""
    model = _close_stream_in_a_forward(
        tmp_path, TensorResidencyLease.__enter__.__code__, "call", depth=2, count=4
    )
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())


def test_a_lease_begun_after_the_stream_closed_under_a_forward_is_dropped(
    tmp_path: Path,
) -> None:
    """The stream closes while another thread's forward is between beginning its module's
    first lease and its second: the close takes the module's begun leases, the forward then
    begins the second, and drops it itself as it fails."""
    _close_stream_in_a_forward(
        tmp_path, TensorResidencyLease._begin.__code__, "return", depth=0, count=2
    )


def test_a_lease_the_stream_closes_as_it_begins_is_given_back(
    tmp_path: Path,
) -> None:
    """The stream closes while another thread's forward is beginning a lease on a value not
    resident, before its read started: the forward fails saying so, and nothing stays
    leased (the read started after the close was granted to the lease, held while the
    forward's error lived)."""
    _close_stream_in_a_forward(
        tmp_path,
        TensorResidencyLease._fast.__code__,
        "return",
        depth=0,
        count=2,
        caller=TensorResidencyLease._begin.__code__,
    )


def _close_stream_in_a_forward(
    tmp_path: Path,
    code: CodeType,
    on: str,
    *,
    depth: int,
    count: int,
    line: int | None = None,
    caller: CodeType | None = None,
) -> Blocks:
    """Close a stream while another thread's forward through it is paused at ``code``
    (``on`` its call or return); check that the forward failed saying so, that nothing stays
    leased, and that the pool closes."""
    _dense, model = offloaded_blocks(tmp_path, count=count)
    pool = TensorResidencyPool()
    stream = stream_modules(pool, model.blocks, depth=depth)
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            with torch.no_grad():
                model(torch.randn(2, WIDTH))
        except BaseException as error:  # kept alive, with its traceback
            errors.append(error)

    with paused_in_new_threads(code, on=on, caller=caller, line=line) as point:
        point.armed.set()
        thread = threading.Thread(target=forward)
        thread.start()
        assert point.paused.wait(10)
        stream.close()
        point.go()
        thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], T2NErrorMisuse)
    assert "closed while this forward ran in another thread" in str(errors[0])
    assert "leased: 0," in repr(pool)
    pool.close()
    assert pool.closed
    return model


def test_a_forward_binding_its_values_as_the_stream_closes_leaves_the_tensors(
    tmp_path: Path,
) -> None:
    """The stream closes while another thread's forward is about to bind its values in place
    of the module's tensors: the forward fails saying so, and the module holds its offloaded
    tensors again (the values were bound where the close no longer looked, and stayed)."""
    code = ModuleStream._bind.__code__
    line = line_of(ModuleStream._bind, "with self._lock")
    model = _close_stream_in_a_forward(tmp_path, code, "line", depth=0, count=2, line=line)
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())


def test_closing_a_stream_as_its_forward_leaves_the_scope_raises_nothing(
    tmp_path: Path,
) -> None:
    """A close, in its own thread, ends what a forward inside a module holds while that
    forward's thread leaves the scope the stream opened for it: the close returns (it reset a
    scope another thread had just left: a TypeError; it now leaves a scope only where that
    scope is the innermost, which it is not in the closing thread)."""
    dense, model = offloaded_blocks(tmp_path, count=2)
    x = torch.randn(2, WIDTH)
    pool = TensorResidencyPool()
    stream = stream_modules(pool, model.blocks)
    inside, leave = threading.Event(), threading.Event()
    outcome: list[object] = []

    def pause(module: torch.nn.Module, args: object) -> None:
        inside.set()
        assert leave.wait(10)

    def forward() -> None:
        with torch.no_grad():
            outcome.append(model(x))
        outcome.append(active_tensor_residency())

    def close() -> None:
        try:
            stream.close()
        except BaseException as error:
            outcome.append(error)

    handle = model.blocks[0].register_forward_pre_hook(pause)
    forwarding = threading.Thread(target=forward)
    forwarding.start()  # before the breakpoint: only the close pauses
    code = StreamScope.leave_scope.__code__
    line = line_of(StreamScope.leave_scope, "ACTIVE_RESIDENCY.get() is not self.value")
    try:
        assert inside.wait(10)
        with paused_in_new_threads(code, on="line", line=line) as point:
            point.armed.set()
            closing = threading.Thread(target=close)
            closing.start()
            assert point.paused.wait(10)
            leave.set()
            forwarding.join(10)
            point.go()
            closing.join(10)
    finally:
        leave.set()
        handle.remove()
        pool.close()
    with torch.no_grad():
        expected = dense(x)
    assert len(outcome) == 2, outcome
    assert torch.allclose(outcome[0], expected, atol=1e-6)  # type: ignore[arg-type]
    assert outcome[1] is None


def test_a_forward_the_stream_closed_under_leaves_the_scope_it_opened(tmp_path: Path) -> None:
    """A forward outside any scope is inside a module when another thread closes the stream:
    it ends through its tensors, and its thread leaves the scope the stream opened for it
    (it stayed in it, and once the pool closed every forward there failed)."""
    dense, model = offloaded_blocks(tmp_path, count=3)
    x = torch.randn(2, WIDTH)
    pool = TensorResidencyPool()
    stream = stream_modules(pool, model.blocks)
    inside, leave, closed = threading.Event(), threading.Event(), threading.Event()
    outcome: list[object] = []

    def pause(module: torch.nn.Module, args: object) -> None:
        inside.set()
        assert leave.wait(10)

    handle = model.blocks[1].register_forward_pre_hook(pause)  # after the stream's

    def forwards() -> None:
        with torch.no_grad():
            outcome.append(model(x))
            outcome.append(active_tensor_residency())
            assert closed.wait(10)
            outcome.append(model(x))  # no stream, no pool: read from the files

    thread = threading.Thread(target=forwards)
    thread.start()
    try:
        assert inside.wait(10)
        stream.close()
        handle.remove()
        leave.set()
        while len(outcome) < 2 and thread.is_alive():
            thread.join(0.05)
        pool.close()
        closed.set()
    finally:
        leave.set()
        closed.set()
        thread.join(10)
    with torch.no_grad():
        expected = dense(x)
    assert len(outcome) == 3, outcome
    assert torch.allclose(outcome[0], expected, atol=1e-6)  # type: ignore[arg-type]
    assert outcome[1] is None
    assert torch.allclose(outcome[2], expected, atol=1e-6)  # type: ignore[arg-type]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.blocks)


def test_an_eviction_refused_for_a_streams_next_forward_names_the_stream(tmp_path: Path) -> None:
    """After a forward, the stream holds the first layer for the next one: its eviction is
    refused with advice that names the stream (the caller holds no lease), and works once
    the stream is closed."""
    model = offload_module(torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))))
    weight = model[0].weight
    assert isinstance(weight, OffloadedTensor)
    with TensorResidencyPool() as pool, torch.no_grad():
        with stream_modules(pool, list(model), depth=1):
            model(torch.ones(1, 8))
            with pytest.raises(T2NErrorMisuse, match="stream_modules stream holds the first"):
                pool.evict(weight)
        pool.evict(weight)
        assert not pool.is_resident(weight)


def test_one_stream_per_request_over_the_same_modules_of_a_pool(tmp_path: Path) -> None:
    """Two requests, each inside the `with` block of a stream of its own over the same
    modules of one pool. The second's forward is amid a pre-hook as the first closes its
    stream: it goes on (each stream's hooks took every forward for its own: the first
    stream's hook, which the second forward ran first, failed it with 'the stream was closed
    while this forward ran in another thread')."""
    model = offload_module(torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))))
    x = torch.ones(1, 8)
    with torch.no_grad():
        expected = model(x)
    results: dict[str, torch.Tensor | BaseException] = {}
    ran, close = threading.Event(), threading.Event()

    def request(name: str) -> None:
        try:
            with torch.no_grad(), stream_modules(pool, list(model)), pool.scope():
                results[name] = model(x)
                ran.set()
                if name == "first":
                    assert close.wait(10)
        except BaseException as error:
            results[name] = error

    line = line_of(ModuleStream._before, "with self._lock:  # a close from now on finds")
    with (
        TensorResidencyPool() as pool,
        paused_in_new_threads(ModuleStream._before.__code__, on="line", line=line) as point,
    ):
        first = threading.Thread(target=request, args=("first",))
        first.start()
        assert ran.wait(10)
        point.armed.set()
        second = threading.Thread(target=request, args=("second",))
        second.start()
        assert point.paused.wait(10)
        close.set()
        first.join(10)  # its stream closed
        point.go()
        second.join(10)
        assert not first.is_alive() and not second.is_alive()
        for name in ("first", "second"):
            result = results[name]
            assert isinstance(result, torch.Tensor), result
            assert torch.equal(result, expected)
        check_invariants(pool)
