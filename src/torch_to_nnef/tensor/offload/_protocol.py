"""What a residency pool needs from an offloaded tensor, and the active residency scope.

This module sits below both :mod:`torch_to_nnef.tensor.offload` and
:mod:`torch_to_nnef.tensor.residency`: the tensor implements :class:`PoolSource`, the pool
manages any :class:`PoolSource`, and the tensor finds the pool serving its reloads through
:data:`ACTIVE_RESIDENCY` without importing the pool. Imports point down only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import Protocol

import torch

from torch_to_nnef._forksafe import fork_safe_lock

__all__ = [
    "ACTIVE_RESIDENCY",
    "HitState",
    "PoolSource",
    "ScopePool",
    "active_tensor_residency",
    "count_load_outside_scopes",
    "loads_outside_scopes",
]


class HitState:
    """What a pool checks of a tensor on every hit: its target device and its latest write.

    The tensor keeps one for life, and the pool's record of a resident value refers to it,
    so that a hit reads this small object instead of the tensor itself (whose attributes live
    in its instance dictionary: with thousands of tensors, each read of one misses the
    processor's caches). Fields are replaced whole, never changed in place, so any thread
    reads a consistent value without a lock.

    - ``device``: the tensor's target device.
    - ``latest``: the latest write of the value (a token), who made it (a pool, or ``None``
      for a direct write), and the latest write made by another (see :meth:`version_for`).
    """

    __slots__ = ("device", "latest")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.latest: tuple[object, object, object] = (object(), None, object())

    def version_for(self, owner: object) -> object:
        """The version of the value as the pool ``owner`` sees it (compare by identity): the
        latest write that ``owner`` did not make, a direct write or another pool's change.
        The changes ``owner`` made itself are in its value already, written back or not; a
        value it read at another version is stale."""
        token, by, before = self.latest
        return before if by is owner else token

    def last_write(self) -> object:
        """The latest write of the value, whoever made it (compare by identity)."""
        return self.latest[0]

    def count_write(self, owner: object, token: object | None = None) -> None:
        """A new write of the value, by the pool ``owner`` (``None``: a direct write), whose
        token is ``token`` (a new one when ``None``); the caller serializes writes."""
        latest, by, before = self.latest
        token = object() if token is None else token
        self.latest = (token, owner, before if by is owner else latest)


class PoolSource:
    """The contract between a residency pool and the tensors it manages.

    A mixin without state: :class:`~torch_to_nnef.tensor.offload.OffloadedTensor` implements
    it. The pool reads these members and calls these methods, nothing else.

    - ``_hit_state``: its :class:`HitState`, the same object for the tensor's life. Its
      ``version_for(owner)`` is the version of the value as the pool ``owner`` sees it, an
      object replaced by every write that ``owner`` did not make (a direct write, another
      pool's change; compared by identity): a value ``owner`` read at an older one is stale.
    - ``_reload_unmanaged(device, out, mapped=None)``: read the payload (into ``out`` host
      buffers when given; into new ones, not mapping the file, with ``mapped=False``) and
      bring it to ``device``; blocking, run on the pool's I/O workers. It reads the
      latest write: a pool's unsaved change (a copy), else the file, without waiting for
      announced write-backs (one writes only the unsaved change, and may be queued behind the
      load of another pool's worker that reads it).
    - ``_host_buffers(value)``: the host buffers backing a value read into host buffers that
      a later load of the same :attr:`storage_key` may reuse, or ``None``.
    - ``_note_unsaved(owner, value, version, alone)``: a pool changed the value it read at
      ``version`` (a ``read_write`` lease ends); unless another write came since (then it
      returns ``False``), it is the latest write of the tensor until written back or
      superseded, and reads outside the pool, other pools included, see it. ``alone()`` is
      asked first, under the lock ``_shelter_unsaved`` takes: ``False`` (another lease was
      entered on the value since the pool decided to note) notes nothing and returns
      ``None``.
    - ``_shelter_unsaved(owner, value)``: a ``read_write`` lease is entered on ``value``;
      when it is the tensor's unsaved latest write, reads outside the pool keep seeing it
      as it was (a copy) while the lease changes it.
    - ``_announce_write()``: a write-back was chosen; copies (``copy.deepcopy``) of the
      tensor from now on wait until it ends, by ``_write_back(value, owner)`` (write
      ``value`` unless a later write superseded it, blocking, on a worker; returns its
      version as ``owner`` sees it, or ``None``; the announcement ends whatever happens) or
      by ``_end_write()`` when it never started.
    - ``_map_written(version, owner)``: the CPU value mapping the file while it holds the
      write-back of ``version`` by ``owner`` and nothing since, for a payload a CPU load
      maps; else ``None`` (blocking, on a worker).
    - ``_reads_rows_on_demand(device)``: whether an embedding lookup in the tensor, its value
      wanted on ``device``, reads only the rows it gathers, without a load (a module stream
      then leaves the table out of what it reads ahead).
    """

    __slots__ = ()

    # Those of the tensor (declared only: the tensor class provides them): a lease's change
    # keeps them.
    shape: torch.Size
    dtype: torch.dtype
    _hit_state: HitState

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def target_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def payload_nbytes(self) -> int:
        raise NotImplementedError

    @property
    def storage_key(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        raise NotImplementedError

    def _reload_unmanaged(
        self,
        device: torch.device | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        mapped: bool | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def _host_buffers(self, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError

    def _reads_rows_on_demand(self, device: torch.device) -> bool:
        raise NotImplementedError

    def _note_unsaved(
        self, owner: object, value: torch.Tensor, version: object, alone: Callable[[], bool]
    ) -> bool | None:
        raise NotImplementedError

    def _shelter_unsaved(self, owner: object, value: torch.Tensor) -> None:
        raise NotImplementedError

    def _announce_write(self) -> None:
        raise NotImplementedError

    def _end_write(self) -> None:
        raise NotImplementedError

    def _write_back(self, value: torch.Tensor, owner: object) -> object | None:
        raise NotImplementedError

    def _map_written(self, version: object, owner: object) -> torch.Tensor | None:
        raise NotImplementedError

    def _write_unsaved(self, owner: object) -> None:
        raise NotImplementedError


class ScopePool(Protocol):
    """What a tensor needs from the pool of the active residency scope."""

    def _scope_resolve(self, source: PoolSource, device: torch.device | None) -> torch.Tensor:
        """The value of ``source`` for a read (on ``device``, else its target device)."""

    def _scope_held(self, source: PoolSource, device: torch.device) -> torch.Tensor | None:
        """The value of ``source`` on ``device`` when the pool holds it or is loading it (for
        a read of a few of its rows), else ``None``: the pool loads nothing for it."""

    def _scope_lease(self, source: PoolSource, device: torch.device | None) -> _LeaseLike:
        """A ``read_write`` lease on ``source``'s value, for an in-place op."""

    def _scope_aliased(
        self, sources: Sequence[PoolSource], results: tuple[torch.Tensor, ...]
    ) -> None:
        """An op given ``sources`` returned ``results``: a view among them, or the value of a
        source itself, may alias that value (a change through it is no write)."""

    def _scope_left_over(self, scope: tuple[ScopePool, torch.device | None]) -> bool:
        """Whether ``scope``, the innermost in this context, is one a stream of this pool set
        and no running call of this thread holds, left over once the pool closed or the
        stream went (a Ctrl-C cut the call): it is left then."""


class _LeaseLike(Protocol):
    def __enter__(self) -> torch.Tensor: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


ACTIVE_RESIDENCY: ContextVar[tuple[ScopePool, torch.device | None] | None] = ContextVar(
    "t2n_active_residency", default=None
)
"""The pool serving reloads in this context and its device (see ``TensorResidencyPool.scope``).

A contextvar: it follows ``anyio.to_thread.run_sync`` workers (which copy the caller's
context) and stays private to each asyncio task.
"""


_loads_outside = 0
_loads_outside_lock = fork_safe_lock()


def count_load_outside_scopes() -> None:
    """Record that an offloaded tensor was loaded with no pool serving it (any thread)."""
    global _loads_outside
    with _loads_outside_lock:
        _loads_outside += 1


def loads_outside_scopes() -> int:
    """How many offloaded tensors were loaded with no pool serving them, in this process: a
    pool that served nothing while this grew was left out of the model's forwards."""
    return _loads_outside


def active_tensor_residency() -> tuple[ScopePool, torch.device | None] | None:
    """Return ``(pool, device)`` of the residency scope active in this context, or ``None``.

    ``device`` is the device given to :meth:`TensorResidencyPool.scope` (``None`` means each
    tensor's own target device). A scope a stream opened for a call that a Ctrl-C cut, left
    over once its pool closed or the stream went, is left here first: the scope under it is
    the active one.
    """
    scope = ACTIVE_RESIDENCY.get()
    # (A stream's scope is a pair of a subclass; its pool tells whether it is left over.)
    while scope is not None and type(scope) is not tuple and scope[0]._scope_left_over(scope):
        scope = ACTIVE_RESIDENCY.get()
    return scope
