"""A hypothesis state machine: several pools share offloaded tensors with direct writes.

The model is each tensor's latest write in program order (its value and dtype). Every read,
whatever its path (``reload``, a pool's ``resolve``, a lease, a prefetch handle, an op in a
scope, another thread, another event loop), must see it; every pool keeps its invariants; once
every pool is closed, each payload file holds it.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from residency_checks import check_invariants, on_disk
from stress.figures import scaled

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import (
    ResidencyStrategy,
    TensorPrefetch,
    TensorResidencyLease,
    TensorResidencyPool,
)

# float32 elements. While mapped reads are on, a value of 128 KiB or more (the last two as
# float32, the last one as float16) is loaded as a mapping of its file; the others are read
# into buffers.
SIZES = [64, 64, 96, 1 << 15, 1 << 16]
SMALL, KIB = 96 * 4, 1024


@dataclass(frozen=True)
class _Config:
    """A pool's settings: budgets small enough that values come and go."""

    strategy: ResidencyStrategy
    budget: int
    workers: int = 1
    uvloop: bool | None = None
    read_ahead: str | None = None

    def __repr__(self) -> str:
        return (
            f"_Config({self.strategy.name}, {self.budget}, workers={self.workers}, "
            f"uvloop={self.uvloop}, read_ahead={self.read_ahead})"
        )


CONFIGS = [
    _Config(ResidencyStrategy.LRU, 2 * SMALL),
    _Config(ResidencyStrategy.LRU, 256 * KIB, workers=2, uvloop=False),
    _Config(ResidencyStrategy.LRU, 2 * SMALL, workers=2, read_ahead="512KiB"),
    _Config(ResidencyStrategy.FIXED, 128 * KIB + SMALL, workers=2),
    _Config(ResidencyStrategy.FIXED, SMALL),
    _Config(ResidencyStrategy.SCHEDULED, 64 * KIB + SMALL, workers=2),
    _Config(ResidencyStrategy.SCHEDULED, 384 * KIB, uvloop=False, read_ahead="auto"),
]
DTYPES = (torch.float32, torch.float16)

# An in-place change: (kind, operand). Results that are not exact in float16 (or too large)
# are not drawn: see _Model.exact.
Op = tuple[str, float]
ops = st.sampled_from(["add", "mul", "fill"]).flatmap(
    lambda kind: st.tuples(
        st.just(kind),
        st.sampled_from(
            {"add": [-3.0, -1.0, 0.5, 1.0, 2.0], "mul": [-1.0, 0.5, 2.0, 3.0]}.get(
                kind, [-2.0, 0.0, 1.5, 7.0]
            )
        ),
    )
)
tensors = st.integers(0, len(SIZES) - 1)
WRITES_IN_PLACE = ["method", "slice", "out"]


def apply(value: torch.Tensor, op: Op) -> None:
    """Apply ``op`` to ``value`` in place (a loaded value, or an offloaded tensor)."""
    kind, operand = op
    if kind == "add":
        value.add_(operand)
    elif kind == "mul":
        value.mul_(operand)
    else:
        value.fill_(operand)


@dataclass
class _Model:
    """The latest write of each tensor, in float64 (every value drawn is exact in float16)."""

    values: list[torch.Tensor]
    dtypes: list[torch.dtype]
    writes: list[int]  # how many writes each tensor had

    def after(self, i: int, op: Op) -> torch.Tensor:
        value = self.values[i].clone()
        apply(value, op)
        return value

    def exact(self, i: int, op: Op) -> bool:
        value = self.after(i, op)
        return bool(value.abs().max() <= 1024) and torch.equal(
            value.to(torch.float16).to(torch.float64), value
        )

    def write(self, i: int, op: Op) -> None:
        self.set(i, self.after(i, op))

    def set(self, i: int, value: torch.Tensor) -> None:
        self.values[i] = value
        self.writes[i] += 1

    def cast(self, i: int, dtype: torch.dtype) -> None:
        self.dtypes[i] = dtype
        self.writes[i] += 1

    def expected(self, i: int) -> torch.Tensor:
        return self.values[i].to(self.dtypes[i])

    def check(self, i: int, seen: torch.Tensor, path: str) -> None:
        assert type(seen) is torch.Tensor, f"{path} of t{i} gave a {type(seen).__name__}"
        expected = self.expected(i)
        assert seen.dtype == expected.dtype, f"{path} of t{i}: dtype {seen.dtype}"
        assert torch.equal(seen.cpu(), expected), (
            f"{path} of t{i} saw {seen[:4].tolist()}, latest write {expected[:4].tolist()}"
        )


def _in_thread(run: Callable[[], None]) -> None:
    """Run ``run`` in a new thread, joined; an error there is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as error:  # raised again in the caller
            errors.append(error)

    thread = threading.Thread(target=target, name="t2n-test-step")
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "a step in another thread did not end"
    if errors:
        raise errors[0]


@dataclass
class _Held:
    """A lease held across steps; a ``read_write`` one makes its change as it ends."""

    p: int
    i: int
    lease: TensorResidencyLease
    value: torch.Tensor
    op: Op | None  # None: a read lease
    writes: int  # the tensor's writes when it was entered


class SharedPoolsMachine(RuleBasedStateMachine):
    """Two or three pools (strategies, budgets and workers drawn) and direct writes on a few
    offloaded tensors, in program order on the test's thread, one step at a time in another
    thread or on an event loop of the test. The model is the latest write of each tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="t2n-shared-stateful-"))
        start = [(torch.arange(n, dtype=torch.float64) % 7) - 3 for n in SIZES]
        self.tensors = [
            OffloadedTensor.from_original_tensor(
                value.to(torch.float32), f"t{i}", offload_dir=self.directory
            )
            for i, value in enumerate(start)
        ]
        self.model = _Model(start, [torch.float32] * len(SIZES), [0] * len(SIZES))
        self.configs: list[_Config] = []
        self.pools: list[TensorResidencyPool] = []
        self.pinned: list[set[int]] = []
        self.held: list[_Held] = []
        # Prefetch handles not waited for yet: (pool index, tensor index, handle).
        self.handles: list[tuple[int, int, TensorPrefetch]] = []
        self.mapped_reads = storage.set_mapped_reads(True)
        self.steps = self.closed_at = 0

    @initialize(configs=st.lists(st.sampled_from(CONFIGS), min_size=2, max_size=3))
    def open_pools(self, configs: list[_Config]) -> None:
        self.configs = configs
        self.pools = [self._pool(p) for p in range(len(configs))]
        self.pinned = [set() for _ in configs]

    def _pool(self, p: int) -> TensorResidencyPool:
        config = self.configs[p]
        pool = TensorResidencyPool(
            config.budget,
            config.workers,
            config.strategy,
            use_uvloop=config.uvloop,
            read_ahead=config.read_ahead,
        )
        pool.__enter__()
        return pool

    def _wait_handles(self, p: int | None = None) -> None:
        """Wait for the prefetch handles (of pool ``p``, or all): each serves the latest write."""
        for q, i, handle in [h for h in self.handles if p is None or h[0] == p]:
            self.handles.remove((q, i, handle))
            self.model.check(i, handle.wait(), f"prefetch of pool {q}, waited later")

    def _release(self, held: _Held) -> None:
        """End a held lease. A ``read_write`` lease's change is the latest write, unless
        another write of the tensor came after the lease was entered: that one stands."""
        self.held.remove(held)
        if held.op is not None:
            apply(held.value, held.op)
        held.lease.__exit__(None, None, None)
        if held.op is not None and self.model.writes[held.i] == held.writes:
            self.model.write(held.i, held.op)

    def teardown(self) -> None:
        try:
            self._wait_handles()
            for held in list(self.held):
                self._release(held)
            for pool in self.pools:
                pool.close()
            for i, t in enumerate(self.tensors):  # nothing written was lost
                self.model.check(i, on_disk(t), "the file")
                self.model.check(i, t.reload(), "reload after close")
        finally:
            for held in self.held:
                held.lease.__exit__(None, None, None)
            for pool in self.pools:
                if not pool.closed:
                    pool.close()
            storage.set_mapped_reads(self.mapped_reads)
            shutil.rmtree(self.directory, ignore_errors=True)

    def pool_index(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, len(self.pools) - 1), label="pool")

    def writer_index(self, data: st.DataObject, i: int) -> int | None:
        """A pool that may change ``t{i}`` now: none of its leases held across steps is a
        ``read_write`` one on it (that lease's change is made, whole, as it ends)."""
        busy = {h.p for h in self.held if h.i == i and h.op is not None}
        free = [p for p in range(len(self.pools)) if p not in busy]
        return data.draw(st.sampled_from(free), label="pool") if free else None

    def exact_op(self, data: st.DataObject, i: int) -> Op:
        return data.draw(ops.filter(lambda op: self.model.exact(i, op)), label="op")

    # -- writes through a pool ---------------------------------------------------------------
    @rule(data=st.data(), i=tensors)
    def read_write_lease(self, data: st.DataObject, i: int) -> None:
        p, op = self.writer_index(data, i), self.exact_op(data, i)
        if p is None:
            return
        with self.pools[p].acquire(self.tensors[i], mode="read_write") as value:
            self.model.check(i, value, f"read_write lease of pool {p}")
            apply(value, op)
        self.model.write(i, op)

    def write_in_place(self, i: int, op: Op, how: str) -> None:
        """Write ``t{i}`` itself, in a scope or outside any: an in-place method, an
        assignment to a slice (the rest is kept), or an ``out=`` argument."""
        t = self.tensors[i]
        if how == "method":
            apply(t, op)
            self.model.write(i, op)
            return
        new = self.model.after(i, op)
        if how == "slice":
            t[1:3] = new[1:3].to(self.model.dtypes[i])
            new[:1], new[3:] = self.model.values[i][:1], self.model.values[i][3:]
        else:
            torch.add(new.to(self.model.dtypes[i]), 0.0, out=t)
        self.model.set(i, new)

    @rule(data=st.data(), i=tensors, how=st.sampled_from(WRITES_IN_PLACE))
    def in_place_op_in_a_scope(self, data: st.DataObject, i: int, how: str) -> None:
        p, op = self.writer_index(data, i), self.exact_op(data, i)
        if p is None:
            return
        with self.pools[p].scope():
            self.write_in_place(i, op, how)

    # -- leases held across steps ------------------------------------------------------------
    @precondition(lambda self: len(self.held) < 3)
    @rule(data=st.data(), i=tensors, read_write=st.booleans())
    def enter_a_lease(self, data: st.DataObject, i: int, read_write: bool) -> None:
        p = self.writer_index(data, i) if read_write else self.pool_index(data)
        if p is None:
            return
        op = self.exact_op(data, i) if read_write else None
        lease = self.pools[p].acquire(self.tensors[i], mode="read_write" if read_write else "read")
        value = lease.__enter__()
        self.model.check(i, value, f"{lease.mode} lease of pool {p}, held")
        self.held.append(_Held(p, i, lease, value, op, self.model.writes[i]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def end_a_lease(self, data: st.DataObject) -> None:
        self._release(self.held[data.draw(st.integers(0, len(self.held) - 1))])

    # -- direct writes, outside any pool -----------------------------------------------------
    @rule(data=st.data(), i=tensors, how=st.sampled_from(WRITES_IN_PLACE))
    def in_place_op_outside_any_scope(self, data: st.DataObject, i: int, how: str) -> None:
        self.write_in_place(i, self.exact_op(data, i), how)

    @rule(
        data=st.data(),
        i=tensors,
        how=st.sampled_from(["copy_", "setitem", "update_values", "set_", "data"]),
    )
    def direct_write(self, data: st.DataObject, i: int, how: str) -> None:
        op = self.exact_op(data, i)
        t, new = self.tensors[i], self.model.after(i, op).to(self.model.dtypes[i])
        if how == "copy_":
            t.copy_(new)
        elif how == "setitem":
            t[:] = new
        elif how == "update_values":
            t.update_values(new)
        elif how == "set_":
            t.set_(new)
        else:
            t.data = new
        self.model.write(i, op)

    @rule(
        data=st.data(),
        i=tensors,
        how=st.sampled_from(["to", "to in a scope", "update_values", "data"]),
    )
    def cast(self, data: st.DataObject, i: int, how: str) -> None:
        """A dtype change, float32 to float16 and back: ``t.to(dtype)`` casts the payload in
        place (in a scope too); ``update_values(strict_dtype=False)`` and ``.data =`` (as
        ``model.half()`` does) write a value of the other dtype."""
        t, dtype = self.tensors[i], DTYPES[1 - DTYPES.index(self.model.dtypes[i])]
        if how == "to":
            assert t.to(dtype) is t
        elif how == "to in a scope":
            with self.pools[self.pool_index(data)].scope():
                assert t.to(dtype) is t
        elif how == "update_values":
            t.update_values(self.model.values[i].to(dtype), strict_dtype=False)
        else:
            t.data = self.model.values[i].to(dtype)
        self.model.cast(i, dtype)
        assert t.dtype == dtype

    # -- reads -------------------------------------------------------------------------------
    @rule(data=st.data(), i=tensors)
    def read_lease(self, data: st.DataObject, i: int) -> None:
        p = self.pool_index(data)
        with self.pools[p].acquire(self.tensors[i]) as value:
            self.model.check(i, value, f"read lease of pool {p}")

    @rule(data=st.data(), i=tensors)
    def resolve(self, data: st.DataObject, i: int) -> None:
        p = self.pool_index(data)
        self.model.check(i, self.pools[p].resolve(self.tensors[i]), f"resolve of pool {p}")

    @rule(data=st.data(), changed=tensors)
    def forward_in_a_scope(self, data: st.DataObject, changed: int) -> None:
        """A model's forward: every tensor read in turn, in the same order each time (what a
        pool's read-ahead learns), one of them changed in place on the way."""
        p, op = self.writer_index(data, changed), self.exact_op(data, changed)
        if p is None:
            return
        with self.pools[p].scope():
            for i, t in enumerate(self.tensors):
                self.model.check(i, t * 1, f"forward in pool {p}'s scope")
                if i == changed:
                    apply(t, op)
                    self.model.write(i, op)

    @rule(data=st.data(), i=tensors)
    def read_in_a_scope(self, data: st.DataObject, i: int) -> None:
        p = self.pool_index(data)
        with self.pools[p].scope():
            seen = self.tensors[i] * 1
        self.model.check(i, seen, f"an op in pool {p}'s scope")

    @rule(i=tensors, how=st.sampled_from(["reload", "op", "clone", "deepcopy"]))
    def read_outside_any_pool(self, i: int, how: str) -> None:
        t = self.tensors[i]
        if how == "reload":
            seen = t.reload()
        elif how == "op":
            seen = t * 1
        elif how == "clone":
            seen = t.clone()
        else:
            seen = copy.deepcopy(t).reload()
        self.model.check(i, seen, how)

    @rule(data=st.data(), i=tensors, wait_now=st.booleans())
    def prefetch(self, data: st.DataObject, i: int, wait_now: bool) -> None:
        p = self.pool_index(data)
        handle = self.pools[p].prefetch(self.tensors[i])
        if wait_now:
            self.model.check(i, handle.wait(), f"prefetch of pool {p}")
        else:
            self.handles.append((p, i, handle))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def wait_for_a_prefetch(self, data: st.DataObject) -> None:
        p, i, handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.model.check(i, handle.wait(), f"prefetch of pool {p}, waited later")

    # -- a step from another thread, and from another event loop ------------------------------
    @rule(
        data=st.data(),
        i=tensors,
        what=st.sampled_from(["read_write", "scope", "read", "resolve"]),
    )
    def step_in_another_thread(self, data: st.DataObject, i: int, what: str) -> None:
        writes = what in ("read_write", "scope")
        p = self.writer_index(data, i) if writes else self.pool_index(data)
        if p is None:
            return
        pool, t, op = self.pools[p], self.tensors[i], self.exact_op(data, i)

        def run() -> None:
            if what == "resolve":
                self.model.check(i, pool.resolve(t), f"resolve of pool {p} in a thread")
            elif what == "scope":
                with pool.scope():
                    apply(t, op)
            else:
                with pool.acquire(t, mode=what) as value:  # type: ignore[arg-type]
                    self.model.check(i, value, f"{what} lease of pool {p} in a thread")
                    if what == "read_write":
                        apply(value, op)

        _in_thread(run)
        if writes:
            self.model.write(i, op)

    @rule(
        data=st.data(),
        i=tensors,
        what=st.sampled_from(["read_write", "read", "resolve", "prefetch", "flush", "evict"]),
    )
    def step_on_another_event_loop(self, data: st.DataObject, i: int, what: str) -> None:
        """The async face of a pool running on its own thread, awaited on a loop of the test."""
        p = self.writer_index(data, i) if what == "read_write" else self.pool_index(data)
        if p is None or (what == "evict" and not self.evictable(p, i)):
            return
        pool, t, op = self.pools[p], self.tensors[i], self.exact_op(data, i)

        async def run() -> None:
            if what == "resolve":
                self.model.check(i, await pool.aresolve(t), f"aresolve of pool {p}")
            elif what == "prefetch":
                self.model.check(i, await pool.prefetch(t), f"awaited prefetch of pool {p}")
            elif what == "flush":
                await pool.aflush()
            elif what == "evict":
                await pool.aevict(t)
            else:
                async with pool.acquire(t, mode=what) as value:  # type: ignore[arg-type]
                    self.model.check(i, value, f"async {what} lease of pool {p}")
                    if what == "read_write":
                        apply(value, op)

        asyncio.run(run())
        if what == "read_write":
            self.model.write(i, op)

    # -- residency ---------------------------------------------------------------------------
    def evictable(self, p: int, i: int) -> bool:
        return not any(h.p == p and h.i == i for h in self.held) and i not in self.pinned[p]

    @rule(data=st.data(), i=tensors)
    def evict(self, data: st.DataObject, i: int) -> None:
        p = self.pool_index(data)
        if any(h.p == p and h.i == i for h in self.held):
            return  # (a lease holds the value it was entered on, perhaps not the current one)
        if i in self.pinned[p]:
            with pytest.raises(T2NErrorMisuse, match="cannot evict"):
                self.pools[p].evict(self.tensors[i])
            return
        self.pools[p].evict(self.tensors[i])
        assert not self.pools[p].is_resident(self.tensors[i])

    @rule(data=st.data(), i=tensors)
    def pin(self, data: st.DataObject, i: int) -> None:
        p = self.pool_index(data)
        if self.configs[p].strategy is ResidencyStrategy.FIXED:
            with pytest.raises(T2NErrorMisuse):
                self.pools[p].pin(self.tensors[i])
            return
        self.model.check(i, self.pools[p].pin(self.tensors[i]).wait(), f"pin of pool {p}")
        self.pinned[p].add(i)

    @precondition(lambda self: any(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        p, i = data.draw(st.sampled_from([(p, i) for p, s in enumerate(self.pinned) for i in s]))
        self.pools[p].unpin(self.tensors[i])
        self.pinned[p].discard(i)

    @rule(data=st.data(), i=tensors, what=st.sampled_from(["tensor", "pool", "every pool"]))
    def flush(self, data: st.DataObject, i: int, what: str) -> None:
        if what != "every pool":
            self.pools[self.pool_index(data)].flush(self.tensors[i] if what == "tensor" else None)
            return
        # Once every pool flushed, each file holds its tensor's latest write (a change under
        # a read_write lease is not made yet: the one before it is written).
        for pool in self.pools:
            pool.flush()
        for j, t in enumerate(self.tensors):
            self.model.check(j, on_disk(t), "the file after every pool flushed")

    @rule(data=st.data(), order=st.permutations(range(len(SIZES))))
    def declare_schedule(self, data: st.DataObject, order: list[int]) -> None:
        self.pools[self.pool_index(data)].declare_schedule(self.tensors[i] for i in order)

    @precondition(lambda self: self.steps % 4 == 0)  # a process-wide setting: now and then
    @rule(mapped=st.booleans())
    def switch_mapped_reads(self, mapped: bool) -> None:
        storage.set_mapped_reads(mapped)

    @precondition(lambda self: self.steps >= self.closed_at + 8)  # pools live a while
    @rule(data=st.data())
    def close_and_replace(self, data: st.DataObject) -> None:
        p = self.pool_index(data)
        self._wait_handles(p)
        held = [h for h in self.held if h.p == p]
        if held:
            with pytest.raises(T2NErrorMisuse):
                self.pools[p].close()
            for h in held:
                self._release(h)
        self.pools[p].close()
        assert self.pools[p].closed
        self.pools[p] = self._pool(p)
        self.pinned[p] = set()
        self.closed_at = self.steps

    # -- comparison --------------------------------------------------------------------------
    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @invariant()
    def pools_keep_their_invariants(self) -> None:
        for pool in self.pools:
            check_invariants(pool)
        for i, t in enumerate(self.tensors):
            assert t.dtype == self.model.dtypes[i]


SharedPoolsMachine.TestCase.settings = settings(
    max_examples=scaled(20, 300),
    stateful_step_count=scaled(40, 80),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSharedPools = pytest.mark.timeout(240)(SharedPoolsMachine.TestCase)
