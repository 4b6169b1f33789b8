"""A hypothesis state machine comparing the pool with a small model of its documented semantics."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from residency_checks import check_invariants, on_disk, settle

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import ResidencyStrategy, TensorResidencyPool

SIZES = [256, 256, 512, 512, 768, 256, 2048]  # float32 elements; the last one is oversized
BUDGET = 1536 * 4


class _Model:
    """The documented semantics, for LRU and FIXED, with every load completing at once."""

    def __init__(self, strategy: ResidencyStrategy) -> None:
        self.strategy = strategy
        self.order: OrderedDict[int, None] = OrderedDict()  # resident keys, LRU first
        self.retained: dict[int, bool] = {}
        self.admitted = 0
        self.leases = [0] * len(SIZES)
        self.pinned: set[int] = set()
        self.memory = [0.0] * len(SIZES)
        self.disk = [0.0] * len(SIZES)
        self.dirty: set[int] = set()
        # The value as of the last whole change: noted when the last of the read_write
        # leases changing it at once ends.
        self.noted = [0.0] * len(SIZES)
        self.hits = self.misses = self.loads = self.evictions = self.write_backs = 0

    @staticmethod
    def nbytes(i: int) -> int:
        return SIZES[i] * 4

    def held(self, i: int) -> bool:
        return self.leases[i] > 0 or i in self.pinned

    def access(self, i: int, count: bool) -> None:
        if i in self.order:
            if count:
                self.hits += 1
            self.order.move_to_end(i)
            return
        if count:
            self.misses += 1
        self.loads += 1
        self.order[i] = None
        self.memory[i] = self.disk[i]
        if self.strategy is ResidencyStrategy.FIXED:
            fits = self.admitted + self.nbytes(i) <= BUDGET
            self.retained[i] = fits
            self.admitted += self.nbytes(i) if fits else 0
        else:
            self.retained[i] = self.nbytes(i) <= BUDGET

    def remove(self, i: int) -> None:
        if i in self.dirty:
            self.disk[i] = self.memory[i]
            self.dirty.discard(i)
            self.write_backs += 1
        del self.order[i]
        if self.strategy is ResidencyStrategy.FIXED and self.retained[i]:
            self.admitted -= self.nbytes(i)
        del self.retained[i]
        self.evictions += 1

    def enforce(self, granted: int | None = None) -> None:
        """Evict down to the budget. ``granted``: a value just loaded for a lease, which
        counts toward the budget at its grant (it is not evicted), until the pool's next
        step counts its lease as holding it."""
        for i in [k for k in self.order if not self.held(k) and not self.retained[k]]:
            self.remove(i)
        if self.strategy is ResidencyStrategy.FIXED:
            return
        # In-use values (leased, not pinned) are outside the budget.
        total = sum(
            self.nbytes(k)
            for k in self.order
            if k == granted or not (self.leases[k] and k not in self.pinned)
        )
        for i in list(self.order):
            if total <= BUDGET:
                break
            if not self.held(i):
                total -= self.nbytes(i)
                self.remove(i)

    def release(self, i: int, read_write: bool, delta: float, last_writer: bool) -> None:
        self.leases[i] -= 1
        if read_write:
            self.memory[i] += delta
            self.dirty.add(i)
            if last_writer:
                self.noted[i] = self.memory[i]
        if i in self.order:
            self.order.move_to_end(i)
        self.enforce()


class PoolMachine(RuleBasedStateMachine):
    strategy = ResidencyStrategy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="t2n-stateful-"))
        self.tensors = [
            OffloadedTensor.from_original_tensor(
                torch.zeros(n), f"t{i}", offload_dir=self.directory
            )
            for i, n in enumerate(SIZES)
        ]
        self.pool = TensorResidencyPool(max_cached_bytes=BUDGET, strategy=self.strategy)
        self.pool.__enter__()
        self.model = _Model(self.strategy)
        self.open_leases: list[tuple[int, Any, torch.Tensor, bool]] = []

    def teardown(self) -> None:
        for _, lease, _, _ in self.open_leases:
            lease.__exit__(None, None, None)
        self.pool.close()
        for i, t in enumerate(self.tensors):  # close wrote every dirty value back
            expected = self.model.memory[i] if i in self.model.order else self.model.disk[i]
            assert float(on_disk(t)[0]) == expected
        shutil.rmtree(self.directory, ignore_errors=True)

    def settle(self) -> None:
        """Wait for write-backs that evictions started (they end asynchronously)."""
        settle(self.pool)

    # -- rules -------------------------------------------------------------------------------
    @rule(i=st.integers(0, len(SIZES) - 1))
    def resolve(self, i: int) -> None:
        value = self.pool.resolve(self.tensors[i])
        self.model.access(i, count=True)
        assert float(value[0]) == self.model.memory[i]
        self.model.enforce()

    @rule(i=st.integers(0, len(SIZES) - 1), read_write=st.booleans())
    def acquire(self, i: int, read_write: bool) -> None:
        lease = self.pool.acquire(self.tensors[i], mode="read_write" if read_write else "read")
        value = lease.__enter__()
        missed = i not in self.model.order
        self.model.access(i, count=True)
        self.model.leases[i] += 1
        assert float(value[0]) == self.model.memory[i]
        self.open_leases.append((i, lease, value, read_write))
        self.model.enforce(granted=i if missed and self.model.retained[i] else None)

    @precondition(lambda self: self.open_leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.open_leases) - 1))
        i, lease, value, read_write = self.open_leases.pop(index)
        if read_write:
            value.add_(1.0)
        lease.__exit__(None, None, None)
        writers = [j for j, _, _, rw in self.open_leases if rw and j == i]
        self.model.release(i, read_write, 1.0, last_writer=not writers)

    @rule(i=st.integers(0, len(SIZES) - 1))
    def prefetch(self, i: int) -> None:
        value = self.pool.prefetch(self.tensors[i]).wait()
        self.model.access(i, count=False)
        assert float(value[0]) == self.model.memory[i]
        self.model.enforce()

    @rule(i=st.integers(0, len(SIZES) - 1))
    def pin(self, i: int) -> None:
        if self.strategy is ResidencyStrategy.FIXED:
            with pytest.raises(T2NErrorMisuse):
                self.pool.pin(self.tensors[i])
            return
        self.pool.pin(self.tensors[i]).wait()
        self.model.access(i, count=False)
        self.model.pinned.add(i)
        self.model.enforce()

    @precondition(lambda self: self.strategy is ResidencyStrategy.LRU)
    @rule(i=st.integers(0, len(SIZES) - 1))
    def unpin(self, i: int) -> None:
        self.pool.unpin(self.tensors[i])
        if i in self.model.pinned:
            self.model.pinned.discard(i)
            self.model.order.move_to_end(i)
            self.model.enforce()

    @rule(i=st.integers(0, len(SIZES) - 1))
    def evict(self, i: int) -> None:
        if self.model.held(i):
            with pytest.raises(T2NErrorMisuse, match="cannot evict"):
                self.pool.evict(self.tensors[i])
            return
        self.pool.evict(self.tensors[i])
        if i in self.model.order:
            self.model.remove(i)

    @rule()
    def flush(self) -> None:
        self.pool.flush()
        writing = {i for i, _, _, read_write in self.open_leases if read_write}
        for i in self.model.dirty & writing:
            # A read_write lease's change is not whole: the change before it is written.
            self.model.disk[i] = self.model.noted[i]
        for i in list(self.model.dirty - writing):
            self.model.disk[i] = self.model.memory[i]
            self.model.write_backs += 1
            self.model.dirty.discard(i)

    # -- comparison --------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self) -> None:
        self.settle()
        check_invariants(self.pool)
        resident = [self.pool.is_resident(t) for t in self.tensors]
        assert resident == [i in self.model.order for i in range(len(SIZES))]
        assert self.pool.resident_bytes == sum(self.model.nbytes(i) for i in self.model.order)
        stats = self.pool.stats()
        model = self.model
        assert (stats.hits, stats.misses, stats.loads, stats.evictions, stats.write_backs) == (
            model.hits,
            model.misses,
            model.loads,
            model.evictions,
            model.write_backs,
        )
        for i, t in enumerate(self.tensors):
            assert float(on_disk(t)[0]) == model.disk[i]


class FixedPoolMachine(PoolMachine):
    strategy = ResidencyStrategy.FIXED


_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PoolMachine.TestCase.settings = _SETTINGS
FixedPoolMachine.TestCase.settings = _SETTINGS
TestLRUPoolMachine = pytest.mark.timeout(240)(PoolMachine.TestCase)
TestFixedPoolMachine = pytest.mark.timeout(240)(FixedPoolMachine.TestCase)
