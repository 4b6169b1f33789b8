"""Retention policies: pure objects that decide what a pool keeps and what it evicts.

A policy knows keys and sizes, never tensors, files or loops. The actor tells it when a value
becomes resident, when it becomes evictable (no lease, no pin, no waiter) or held again, when it
is used and when it leaves; the policy answers which values to retain and which to evict. Every
call is O(1) amortised, except :meth:`RetentionPolicy.victims`, which is O(k) in the number of
values it returns.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Collection

__all__ = [
    "FixedPolicy",
    "LRUPolicy",
    "ResidencyStrategy",
    "RetentionPolicy",
    "ScheduledPolicy",
    "make_policy",
]


class ResidencyStrategy(enum.Enum):
    """How a :class:`TensorResidencyPool` chooses which values stay resident.

    - ``LRU``: keep every value that fits the budget; evict the least recently used
      unleased, unpinned value when room is needed. Supports manual pins.
    - ``FIXED``: admit the first values that fit the budget (first fit, in completion order)
      and keep them for the pool's lifetime; later values are delivered to their callers and
      dropped once no lease holds them. Rejects manual pins.
    - ``SCHEDULED``: follow a cyclic access order (declared with
      :meth:`TensorResidencyPool.declare_schedule`, by :func:`stream_modules`, or learnt
      from the first pass) and evict the value whose next use is farthest away, the value
      just loaded included, so a pass bigger than the budget keeps a stable subset instead
      of missing on every access as LRU does. Before it knows the order it behaves as LRU.
      Supports manual pins.
    """

    LRU = "lru"
    FIXED = "fixed"
    SCHEDULED = "scheduled"


class RetentionPolicy:
    """Base of the retention policies.

    ``budget`` is the soft limit in bytes (``None``: unbounded). Values that are *held* (leased,
    pinned or awaited) are never victims; the actor reports holds with :meth:`hold` and
    :meth:`release`.
    """

    strategy: ResidencyStrategy
    allows_pins: bool = True
    follows_hits: bool = False
    """Whether :meth:`access` hears of every consumer's hit, those served without the actor
    included (other threads queue them; the next transition replays them in order)."""
    remembers_keys: bool = False
    """Whether keys outlive their values here (a schedule): the actor then tells
    :meth:`forget_keys` of the tensors collected, whose ids new tensors may be given."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self._doomed: OrderedDict[int, int] = OrderedDict()

    # -- notifications -------------------------------------------------------------------------
    def admit(self, key: int, nbytes: int) -> bool:
        """A value of ``nbytes`` became resident: return whether it is retained for reuse.

        A value that is not retained stays only while something holds it.
        """
        return self._fits(nbytes)

    def _fits(self, nbytes: int) -> bool:
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
        """The value was used (a request, a lease ending)."""
        if key in self._evictable:
            self._evictable.move_to_end(key)

    def access(self, key: int) -> None:
        """A consumer asked for the value (resolve or acquire; not a prefetch). Hits served
        without the actor come here only where :attr:`follows_hits` is set."""

    def forget(self, key: int, nbytes: int, retained: bool) -> None:
        """The value left the pool."""
        self.hold(key)

    def forget_keys(self, keys: Collection[int]) -> None:
        """The tensors of ``keys`` (none resident) were collected: forget what is remembered
        of them (:attr:`remembers_keys`)."""

    # -- decisions -----------------------------------------------------------------------------
    def victims(self, excess: int) -> list[int]:
        """Keys to evict now: every unretained evictable value, then enough retained ones to
        free ``excess`` bytes (``excess <= 0``: none)."""
        if excess <= 0 and not self._doomed:
            return []
        chosen = list(self._doomed)
        freed = sum(self._doomed.values())
        self._doomed.clear()
        while freed < excess:
            picked = self._pop_victim()
            if picked is None:
                break
            chosen.append(picked[0])
            freed += picked[1]
        return chosen

    def _pop_victim(self) -> tuple[int, int] | None:
        """Remove and return the next retained value to evict, as ``(key, nbytes)``."""
        if not self._evictable:
            return None
        return self._evictable.popitem(last=False)

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
        if key not in self._admitted:
            if not self._fits(self.admitted_bytes + nbytes):
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


class _Fenwick:
    """Counts over positions ``0..n-1`` with O(log n) update, prefix sum and k-th search."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.total = 0
        self._tree = [0] * (size + 1)
        self._top = 1 << max(size.bit_length() - 1, 0)

    def add(self, index: int, delta: int) -> None:
        self.total += delta
        i = index + 1
        while i <= self.size:
            self._tree[i] += delta
            i += i & -i

    def prefix(self, index: int) -> int:
        """Sum over positions ``0..index``."""
        total, i = 0, index + 1
        while i > 0:
            total += self._tree[i]
            i -= i & -i
        return total

    def kth(self, k: int) -> int:
        """The smallest position whose prefix sum reaches ``k`` (1-based)."""
        position, step = 0, self._top
        while step:
            nxt = position + step
            if nxt <= self.size and self._tree[nxt] < k:
                position = nxt
                k -= self._tree[nxt]
            step >>= 1
        return position


class ScheduledPolicy(RetentionPolicy):
    """Farthest-next-use retention over a cyclic schedule (see
    :attr:`ResidencyStrategy.SCHEDULED`).

    With every key used once per pass, the evictable value used farthest in the future is the
    one whose position lies just behind the consumer's (cyclically): a predecessor search in a
    Fenwick tree over schedule positions, O(log n). Keys outside the schedule go first, in LRU
    order, which a new schedule keeps for the keys it leaves out: every evictable key, in the
    schedule or not, carries the time of its last use.
    """

    strategy = ResidencyStrategy.SCHEDULED
    follows_hits = True  # the consumer's position moves on every use
    remembers_keys = True  # the schedule names values that left

    def __init__(self, budget: int | None) -> None:
        super().__init__(budget)
        self._position: dict[int, int] = {}
        self._order: list[int] = []
        self._tree = _Fenwick(0)
        self._scheduled: dict[int, int] = {}  # evictable scheduled keys -> nbytes
        self._cursor = -1
        self._learning: list[int] = []
        self._learnt: set[int] = set()
        self._used: dict[int, int] = {}  # evictable key -> when last used (see declare)
        self._clock = itertools.count()

    # -- the schedule ----------------------------------------------------------------------------
    @property
    def schedule_known(self) -> bool:
        return bool(self._order)

    def declare(self, keys: list[int]) -> None:
        """Use ``keys`` (one pass, in order; repeats ignored) as the cyclic schedule."""
        order = list(dict.fromkeys(keys))
        evictable = {**self._evictable, **self._scheduled}
        used = self._used
        evictable = dict(sorted(evictable.items(), key=lambda item: used.get(item[0], -1)))
        self._used = {}
        self._evictable = OrderedDict()
        self._scheduled = {}
        self._order = order
        self._position = {key: i for i, key in enumerate(order)}
        self._tree = _Fenwick(len(order))
        self._cursor = -1
        self._learning = []
        self._learnt = set()
        for key, nbytes in evictable.items():
            self._insert(key, nbytes)

    def forget_keys(self, keys: Collection[int]) -> None:
        """Leave ``keys`` out of the schedule (and of the pass being learnt); the consumer
        stays after the last key kept at or before its position. A schedule left empty is
        learnt again."""
        if self._learning:
            self._learning = [key for key in self._learning if key not in keys]
            self._learnt.difference_update(keys)
        if not any(key in self._position for key in keys):
            return
        passed = self._order[: self._cursor + 1]
        self._cursor = sum(key not in keys for key in passed) - 1
        self._order = [key for key in self._order if key not in keys]
        self._position = {key: i for i, key in enumerate(self._order)}
        self._tree = _Fenwick(len(self._order))
        for key in self._scheduled:  # (resident: not among the keys collected)
            self._tree.add(self._position[key], 1)

    def access(self, key: int) -> None:
        position = self._position.get(key)
        if position is not None:
            self._cursor = position
            return
        if self._order:
            return
        if key in self._learnt:
            if key == self._learning[-1]:
                return  # a use again of the value just used (two ops on one weight)
            # The first pass is over: it is the schedule.
            self.declare(self._learning)
            self._cursor = self._position[key]
            return
        self._learnt.add(key)
        self._learning.append(key)

    # -- evictable set ---------------------------------------------------------------------------
    def _insert(self, key: int, nbytes: int) -> None:
        self._used[key] = next(self._clock)
        position = self._position.get(key)
        if position is None:
            self._evictable[key] = nbytes
        elif key not in self._scheduled:
            self._scheduled[key] = nbytes
            self._tree.add(position, 1)

    def release(self, key: int, nbytes: int, retained: bool) -> None:
        if retained:
            self._insert(key, nbytes)
        else:
            self._doomed[key] = nbytes

    def touch(self, key: int) -> None:
        super().touch(key)
        if key in self._used:
            self._used[key] = next(self._clock)

    def hold(self, key: int) -> None:
        super().hold(key)
        self._used.pop(key, None)
        if self._scheduled.pop(key, None) is not None:
            self._tree.add(self._position[key], -1)

    def _pop_victim(self) -> tuple[int, int] | None:
        picked = super()._pop_victim()  # keys outside the schedule go first
        if picked is None and self._scheduled:
            key = self._farthest()
            self._tree.add(self._position[key], -1)
            picked = key, self._scheduled.pop(key)
        if picked is not None:
            self._used.pop(picked[0], None)
        return picked

    def _farthest(self) -> int:
        tree = self._tree
        behind = tree.prefix(self._cursor) if self._cursor >= 0 else 0
        return self._order[tree.kth(behind if behind else tree.total)]

    def evictable_bytes(self) -> int:
        return super().evictable_bytes() + sum(self._scheduled.values())


def make_policy(strategy: ResidencyStrategy, budget: int | None) -> RetentionPolicy:
    """Return a fresh policy implementing ``strategy`` under ``budget`` bytes."""
    if strategy is ResidencyStrategy.LRU:
        return LRUPolicy(budget)
    if strategy is ResidencyStrategy.SCHEDULED:
        return ScheduledPolicy(budget)
    return FixedPolicy(budget)
