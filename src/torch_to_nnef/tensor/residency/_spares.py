"""Spare host buffers: memory of evicted values, reused for the next load of the same shape.

Reading into fresh memory costs a page fault per page; reading into memory that was already
touched does not. When a value leaves the pool, its host buffers become *candidates*: the pool
keeps their storages and a weak reference to the value. A candidate is handed out for a new
load only once the value is gone and no other tensor (a view, a copy kept by the user) shares
those storages, so a value still referenced anywhere is never overwritten.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["SpareBuffers"]

StorageKey = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def _use_count(storage: torch.UntypedStorage) -> int:
    return int(torch._C._storage_Use_Count(storage._cdata))


@dataclass(eq=False)
class _Spare:
    key: Hashable
    nbytes: int
    value: weakref.ref[torch.Tensor]
    storages: dict[str, torch.UntypedStorage]
    buffers: dict[str, torch.Tensor]  # new tensors on those storages, handed out for a load

    def free(self) -> bool:
        """Whether nothing but this candidate uses the buffers any more: each storage is
        referenced by its own object here and by the tensor here, nothing else."""
        return self.value() is None and all(_use_count(s) == 2 for s in self.storages.values())


class SpareBuffers:
    """Candidates for reuse, grouped by storage key, bounded by their owner (oldest out)."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, deque[_Spare]] = {}
        self._all: OrderedDict[int, _Spare] = OrderedDict()
        self.nbytes = 0

    def offer(
        self,
        key: StorageKey,
        nbytes: int,
        value: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        room: int,
    ) -> None:
        """Keep ``buffers`` (backing ``value``) as a candidate for a load with ``key``, then
        drop the oldest candidates beyond ``room`` bytes."""
        spare = _Spare(
            key,
            nbytes,
            weakref.ref(value),
            {n: b.untyped_storage() for n, b in buffers.items()},
            {n: b.detach() for n, b in buffers.items()},
        )
        self._by_key.setdefault(key, deque()).append(spare)
        self._all[id(spare)] = spare
        self.nbytes += nbytes
        self.shrink(room)

    def shrink(self, room: int) -> None:
        """Drop the oldest candidates until they hold at most ``room`` bytes."""
        while self.nbytes > room and self._all:
            self._drop(next(iter(self._all.values())))

    def take(self, key: StorageKey) -> dict[str, torch.Tensor] | None:
        """Host tensors to read a payload with ``key`` into, or ``None`` when none is free."""
        candidates = self._by_key.get(key)
        if not candidates:
            return None
        for spare in list(candidates):
            if spare.free():
                self._drop(spare)
                return spare.buffers
        return None

    def _drop(self, spare: _Spare) -> None:
        del self._all[id(spare)]
        candidates = self._by_key[spare.key]
        candidates.remove(spare)
        if not candidates:
            del self._by_key[spare.key]
        self.nbytes -= spare.nbytes

    def clear(self) -> None:
        self._by_key.clear()
        self._all.clear()
        self.nbytes = 0
