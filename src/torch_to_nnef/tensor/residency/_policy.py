"""Retention policies: pure objects that decide what a pool keeps and what it evicts.

A policy knows keys and sizes, never tensors, files or loops. The actor tells it when a value
becomes resident, when it becomes evictable (no lease, no pin, no waiter) or held again, when it
is used and when it leaves; the policy answers which values to retain and which to evict. Every
call is O(1) amortised, except :meth:`RetentionPolicy.victims`, which is O(k) in the number of
values it returns.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

__all__ = ["FixedPolicy", "LRUPolicy", "ResidencyStrategy", "RetentionPolicy", "make_policy"]


class ResidencyStrategy(enum.Enum):
    """How a :class:`TensorResidencyPool` chooses which values stay resident.

    ``LRU``
        Keep every value that fits the budget; evict the least recently used unleased,
        unpinned value when room is needed. Supports manual pins.
    ``FIXED``
        Admit the first values that fit the budget (first fit, in completion order) and keep
        them for the pool's lifetime; later values are delivered to their callers and dropped
        once no lease holds them. Rejects manual pins.
    """

    LRU = "lru"
    FIXED = "fixed"


class RetentionPolicy:
    """Base of the retention policies.

    ``budget`` is the soft limit in bytes (``None``: unbounded). Values that are *held* (leased,
    pinned or awaited) are never victims; the actor reports holds with :meth:`hold` and
    :meth:`release`.
    """

    strategy: ResidencyStrategy
    allows_pins: bool = True

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self._doomed: OrderedDict[int, int] = OrderedDict()

    # -- notifications -------------------------------------------------------------------------
    def admit(self, key: int, nbytes: int) -> bool:
        """A value of ``nbytes`` became resident: return whether it is retained for reuse.

        A value that is not retained stays only while something holds it.
        """
        return self.budget is None or nbytes <= self.budget

    def release(self, key: int, nbytes: int, retained: bool) -> None:
        """Nothing holds the value any more: it may now be evicted."""
        if retained:
            self._evictable[key] = nbytes
        else:
            self._doomed[key] = nbytes

    def hold(self, key: int) -> None:
        """Something holds the value again (a lease, a pin, a waiter): it is no victim."""
        self._evictable.pop(key, None)
        self._doomed.pop(key, None)

    def touch(self, key: int) -> None:
        """The value was used."""
        if key in self._evictable:
            self._evictable.move_to_end(key)

    def forget(self, key: int, nbytes: int, retained: bool) -> None:
        """The value left the pool."""
        self.hold(key)

    # -- decisions -----------------------------------------------------------------------------
    def victims(self, excess: int) -> list[int]:
        """Keys to evict now: every unretained evictable value, then enough retained ones to
        free ``excess`` bytes (``excess <= 0``: none)."""
        chosen = list(self._doomed)
        freed = sum(self._doomed.values())
        self._doomed.clear()
        while freed < excess and self._evictable:
            key, nbytes = self._evictable.popitem(last=False)
            chosen.append(key)
            freed += nbytes
        return chosen

    def evictable_bytes(self) -> int:
        """Bytes of the retained, evictable values (O(n); for invariant checks in tests)."""
        return sum(self._evictable.values())


class LRUPolicy(RetentionPolicy):
    """Least recently used retention (see :attr:`ResidencyStrategy.LRU`)."""

    strategy = ResidencyStrategy.LRU


class FixedPolicy(RetentionPolicy):
    """First-fit fixed retention (see :attr:`ResidencyStrategy.FIXED`)."""

    strategy = ResidencyStrategy.FIXED
    allows_pins = False

    def __init__(self, budget: int | None) -> None:
        super().__init__(budget)
        self._admitted: dict[int, int] = {}
        self.admitted_bytes = 0

    def admit(self, key: int, nbytes: int) -> bool:
        if key in self._admitted:
            return True
        if self.budget is not None and self.admitted_bytes + nbytes > self.budget:
            return False
        self._admitted[key] = nbytes
        self.admitted_bytes += nbytes
        return True

    def release(self, key: int, nbytes: int, retained: bool) -> None:
        if not retained:
            self._doomed[key] = nbytes

    def forget(self, key: int, nbytes: int, retained: bool) -> None:
        super().forget(key, nbytes, retained)
        if self._admitted.pop(key, None) is not None:
            self.admitted_bytes -= nbytes


def make_policy(strategy: ResidencyStrategy, budget: int | None) -> RetentionPolicy:
    """Return a fresh policy implementing ``strategy`` under ``budget`` bytes."""
    if strategy is ResidencyStrategy.LRU:
        return LRUPolicy(budget)
    return FixedPolicy(budget)
