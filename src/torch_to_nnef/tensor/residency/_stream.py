"""Prefetch-ahead streaming of a model's layers through a residency pool."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import ACTIVE_RESIDENCY, PoolSource
from torch_to_nnef.tensor.opaque import _is_tracing
from torch_to_nnef.tensor.residency._handles import Uncopyable, end_lease
from torch_to_nnef.tensor.residency._scope import (
    PENDING,
    OpenedScope,
    StreamScope,
    active_tensor_residency,
    leave_or_wait,
    leave_pending,
    opener_of,
)

if TYPE_CHECKING:
    from torch_to_nnef.tensor.offload import OffloadedTensor
    from torch_to_nnef.tensor.residency._handles import TensorResidencyLease
    from torch_to_nnef.tensor.residency._pool import TDevice, TensorResidencyPool
    from torch_to_nnef.tensor.residency._state import Slot

__all__ = ["ModuleStream", "stream_modules"]

LOGGER = logging.getLogger("torch_to_nnef.tensor.residency")


def _offloaded_tensors(
    module: torch.nn.Module, device: torch.device | None
) -> list[OffloadedTensor]:
    """The offloaded parameters and buffers of ``module`` that its forward reads whole.

    The table of an embedding (``nn.Embedding`` without ``max_norm``) is left out where a
    lookup reads only the rows it gathers (``_reads_rows_on_demand``, for ``device`` or the
    table's target device), unless another module holds it too (a tied output layer).
    """
    tables: set[int] = set()
    whole: set[int] = set()
    for submodule in module.modules():
        for table in (submodule._parameters, submodule._buffers):
            for name, tensor in table.items():
                looked_up = (
                    isinstance(submodule, torch.nn.Embedding)
                    and submodule.max_norm is None
                    and name == "weight"
                )
                (tables if looked_up else whole).add(id(tensor))
    found: dict[int, OffloadedTensor] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if not isinstance(tensor, PoolSource):
            continue
        key = id(tensor)
        looked_up = key in tables and key not in whole
        if looked_up and tensor._reads_rows_on_demand(device or tensor.target_device):
            continue
        found.setdefault(key, cast("OffloadedTensor", tensor))
    return list(found.values())


_Place = tuple[dict[str, Any], str, "OffloadedTensor"]
"""Where a module holds an offloaded tensor: ``table[name]`` is the tensor, ``table`` the
``_parameters`` or ``_buffers`` of the module or of one of its submodules."""

_Bound = tuple[_Place, torch.Tensor, torch.Tensor]
"""A place holding a value in place of its tensor: the place, the alias it holds, the value."""

_Changed = tuple["OffloadedTensor", torch.Tensor]
"""A tensor whose place's alias got a new ``.data`` while bound, and that alias."""


_Watched = tuple["OffloadedTensor", "Slot", int | None]
"""A value bound for a forward (the slot of the lease that holds it: ``slot.value``), with
its version then (``Tensor._version``; ``None``: taken as changed, see ``_bind``)."""


_BatchNorm = torch.nn.modules.batchnorm._BatchNorm


def _running_stats(modules: Sequence[torch.nn.Module]) -> dict[int, _BatchNorm]:
    """The batch norms among ``modules`` by the id of their offloaded running mean and
    variance (which a forward in training mode updates in place)."""
    found: dict[int, _BatchNorm] = {}
    for module in modules:
        for norm in module.modules():
            if isinstance(norm, _BatchNorm):
                for name in ("running_mean", "running_var"):
                    buffer = norm._buffers.get(name)
                    if isinstance(buffer, PoolSource):
                        found[id(buffer)] = norm
    return found


def _alias(value: torch.Tensor) -> torch.Tensor:
    """What a place holds for the pool's ``value``: the same memory and version counter
    (changes in place are the value's), its own tensor object, so that assigning ``.data``
    there (``model.half()`` on a module inside a forward that Ctrl-C left bound) replaces
    that alias only, never the pool's value under its tensor."""
    return value.view_as(value) if value.requires_grad else value.detach()


def _give_back(
    bound: dict[tuple[int, str], _Bound], keys: Iterable[tuple[int, str]]
) -> list[_Changed]:
    """Give the places of ``keys`` their tensors back, each forgotten once undone (under the
    stream's lock); return the tensors whose alias got a new ``.data`` meanwhile, with it."""
    changed: list[_Changed] = []
    for key in keys:
        found = bound.get(key)
        if found is None:
            continue
        (table, name, tensor), alias, value = found
        if table.get(name) is alias:
            table[name] = tensor
            if (
                alias.dtype is not value.dtype
                or alias.data_ptr() != value.data_ptr()
                or alias.shape != value.shape
            ):
                changed.append((tensor, alias))
        del bound[key]
    return changed


def _carry_over(changed: list[_Changed]) -> None:
    """Assign each alias's new ``.data`` to its tensor, as the place's owner did (a write)."""
    for tensor, alias in changed:
        tensor.data = alias.detach()


def _places(module: torch.nn.Module, tensors: list[OffloadedTensor]) -> list[_Place]:
    wanted = {id(tensor): tensor for tensor in tensors}
    tables: list[dict[str, Any]] = [
        table
        for submodule in module.modules()
        for table in (submodule._parameters, submodule._buffers)
    ]
    return [
        (table, name, wanted[id(tensor)])
        for table in tables
        for name, tensor in table.items()
        if id(tensor) in wanted
    ]


class _Held(StreamScope):
    """What a forward holds while one module runs: the leases it entered, the values bound
    for it that it may change in place, the residency scope it opened (if any: the
    :class:`StreamScope` it is), and the identity of the frame of the module's call (see
    :func:`_module_call`), which the stream holds (``ModuleStream._calls``) while this
    lasts."""

    __slots__ = ("call", "leases", "serial", "watched")

    def __init__(self, serial: int) -> None:
        self.value = self.token = self.mark = None  # (StreamScope's, without a call)
        self.serial = serial  # its place in the order its thread's entries were made in
        self.call: int | None = None  # set once the frame is held
        self.leases: list[TensorResidencyLease] = []
        self.watched: list[_Watched] = []


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _module_call() -> FrameType | None:
    """The frame of the module call whose pre-hook calls this (``Module._call_impl``, which
    runs the hooks and the forward), looked for a few frames up; ``None`` where torch calls
    hooks another way. It is on its thread's stack exactly while that module runs: once it
    is not, the forward ended, if without its post-hook (Ctrl-C: torch runs it on
    ``Exception`` only). Held by the stream while the forward's entry lasts, it cannot be
    freed and its identity given to another frame meanwhile (held by the thread's state,
    which its thread keeps, it would keep the module, and with it the stream, from ever
    being collected)."""
    for depth in _CALL_DEPTHS:
        try:
            frame = sys._getframe(depth)
        except ValueError:  # the stack is not that deep
            return None
        if frame.f_code is _CALL_IMPL:
            return frame
    return None


def _hook_tables_walked_elsewhere() -> set[int]:
    """The identities of the forward-hook tables (``module._forward_hooks``) of the modules
    whose call (``Module._call_impl``) runs in another thread, which may be walking one."""
    tables: set[int] = set()
    me = threading.get_ident()
    for ident, top in sys._current_frames().items():
        frame: FrameType | None = top
        while ident != me and frame is not None:
            if frame.f_code is _CALL_IMPL:
                hooks = getattr(frame.f_locals.get("self"), "_forward_hooks", None)
                if hooks is not None:
                    tables.add(id(hooks))
            frame = frame.f_back
    return tables


_CALL_DEPTHS = (4, 3, 5, 6)
"""Where :func:`_module_call` looks for the module call, counted from itself (it, then
``ModuleStream._before``, its ``_Hook``): torch 2.13 calls hooks from a closure of
``Module._call_impl`` (depth 3), which is at 4; from the post-hook (``_leave`` under
``_after``) it is at 5. Each look makes one frame object only."""


def _frames_running() -> set[int]:
    """The identities of the frames on the calling thread's stack."""
    running: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    return running


class _ThreadState:
    """What one thread's forwards hold through a stream (the stream keeps it only weakly:
    when the thread ends, its begun leases are dropped)."""

    __slots__ = ("__weakref__", "begun", "held", "last", "made")

    def __init__(self) -> None:
        self.held: dict[int, list[_Held]] = {}
        self.begun: dict[int, list[TensorResidencyLease]] = {}
        self.last = -1  # the module this thread entered last
        self.made = 0  # how many entries its forwards made (the serial of the last one)


def _cancel_begun(begun: dict[int, list[TensorResidencyLease]], keep: Iterable[int]) -> None:
    """Drop the begun leases of the modules not in ``keep`` (from any thread: a close may
    drop those of a forward running in another)."""
    kept = set(keep)
    for index in [i for i in list(begun) if i not in kept]:
        for lease in begun.pop(index, ()):
            lease._cancel()


def _forget_thread(
    begun: dict[int, list[TensorResidencyLease]],
    held: dict[int, list[_Held]],
    stream: weakref.ref[ModuleStream],
) -> None:
    """A thread's state was collected: its thread ended, or the stream was dropped (with its
    modules) without close. The leases it began are dropped, the frames of its module calls
    let go, and, collected in that forward's own context, it leaves the scope the stream
    opened for it. What a forward interrupted inside a module still held goes to the stream,
    when it lives and is open, which ends it as its close would, at the next forward of any
    stream, its close or its pool's (:meth:`ModuleStream._end_orphans`: the change it made in
    place is kept, the module's places get their tensors back); otherwise its leases end as
    they are collected."""
    _cancel_begun(begun, ())
    alive = stream()
    for index, stack in held.items():
        for entry in reversed(stack):
            if alive is not None:
                alive._calls.pop(entry.call, None)
                if alive._handles:  # (a close ended what it held, and gave its places back)
                    alive._orphans.append((index, entry))  # (no lock: a finalizer runs this)
                    _ORPHANED.add(stream)
            entry.leave_scope()


_ORPHANED: set[weakref.ref[ModuleStream]] = set()
"""The streams holding what threads that ended inside their modules held: any stream's next
forward ends it (a module of another stream may sit inside one of theirs, bound to their
pool's value, where its own stream cannot bind it). A plain set of weak references: every
pre-hook looks at it."""


def _forget_orphans_in_child() -> None:
    """After ``fork``, in the child: what threads of the parent left to its streams is the
    parent's to end (their pools' threads run there only); a stream of the child's own ends
    none of it."""
    for reference in list(_ORPHANED):
        orphaned = reference()
        if orphaned is not None:
            orphaned._orphans.clear()
    _ORPHANED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_orphans_in_child)


class _Hook:
    """A stream's hook on one of its modules: it calls ``method(index, *args)``.

    It holds the stream while the stream's pool is open, and weakly once it closed
    (:meth:`ModuleStream._let_go`): a stream whose caller did not keep it (the usual
    ``stream_modules(pool, layers)`` inside ``with pool:``) streams while the pool is open,
    then goes and takes its hooks off, so that the model runs without the pool.

    A copy of the module (``copy.deepcopy``, or a model pickled by ``torch.save`` and loaded
    again) is not streamed: its hook does nothing, and the copy computes on its own tensors."""

    __slots__ = ("held", "index", "method")

    def __init__(self, method: Callable[..., None] | None, index: int) -> None:
        self.held = method
        self.method = None if method is None else weakref.WeakMethod(method)
        self.index = index

    def __call__(self, *args: Any) -> None:
        method = self.held
        if method is None and self.method is not None:
            method = self.method()
        if method is not None:
            method(self.index, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return _Hook(None, self.index)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (None, self.index))


def _take_hooks_off(handles: list[Any]) -> None:
    """A stream went: its hooks leave its modules (removing a handle twice does nothing)."""
    for handle in handles:
        handle.remove()


_IN_BLOCK: contextvars.ContextVar[weakref.ref[ModuleStream] | None] = contextvars.ContextVar(
    "t2n_stream_block", default=None
)
"""The stream whose ``with`` block the context runs in (the innermost): a forward there, over
its modules, is that stream's alone, whatever other streams of its pool hook them. Weakly: a
block a Ctrl-C left without its exit keeps no stream alive."""


class ModuleStream(Uncopyable):
    """Hooks that stream ``modules`` through ``pool`` (see :func:`stream_modules`).

    A context manager: leaving it (or :meth:`close`) removes the hooks and releases the
    leases held for the next forward.

    Args:
        pool: the pool that serves the values.
        modules: the layers, in the order the forward runs them.
        depth: how many modules ahead to prefetch (0: none).
        device: where values are delivered (default: each tensor's target device).

    Raises:
        T2NErrorMisuse: ``depth`` is not an int >= 0, or the pool is closed.

    Attributes:
        pool: the pool given at creation.
        depth: the prefetch depth given at creation.
        device: the delivery device given at creation.
        groups: the offloaded parameters and buffers of each module, in module order; an
            embedding's table whose lookups read only their rows is not among them (it is
            never read whole for a lookup, so not read ahead).
    """

    _why_not_copied = (
        "it owns the hooks on its modules and the leases of their next forward: pass the "
        "stream itself"
    )

    def __init__(
        self,
        pool: TensorResidencyPool,
        modules: Sequence[torch.nn.Module],
        depth: int = 1,
        device: TDevice | None = None,
    ) -> None:
        if not callable(getattr(pool, "declare_schedule", None)):  # (no import of the pool)
            raise T2NErrorMisuse(
                "stream_modules(pool, modules) streams through a TensorResidencyPool, given "
                f"first; got {type(pool).__name__}"
            )
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise T2NErrorMisuse(f"depth must be an int >= 0, got {depth!r}")
        self.pool = pool
        self.depth = depth
        # Resolved here, in the caller's thread: the hooks run in the thread of each forward,
        # whose current CUDA device may be another.
        self.device = None if device is None else storage.resolve_device(device)
        self.groups = [_offloaded_tensors(m, self.device) for m in modules]
        self._running_stats = _running_stats(modules)
        self._places = [_places(m, g) for m, g in zip(modules, self.groups, strict=True)]
        # The places that hold a value in place of their tensor now: the alias of the value
        # they hold, and the value.
        self._bound: dict[tuple[int, str], _Bound] = {}
        self._local = threading.local()
        self._lock = fork_safe_lock()  # a forked child's forward says it was forked
        # The state of each thread that ran a forward, while the thread lives.
        self._threads: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        # Leases begun past the last module on the next forward's first modules, taken by the
        # thread that runs it (any thread), once no thread is beginning them (``_filling``).
        self._next_forward: dict[int, list[TensorResidencyLease]] = {}
        self._filling: set[int] = set()
        self._handles: list[Any] = []  # empty once closed
        # Post-hooks by module: a close leaves those of modules a forward is inside until it
        # leaves them, so that the forward leaves the scope the stream opened for it.
        self._post_handles: dict[int, Any] = {}
        self._lingering: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        self._hooks: list[_Hook] = []  # to let go of the stream once the pool closed
        # The frames of the module calls that forwards hold something for, by identity (see
        # _module_call): a call whose frame left its thread's stack is over.
        self._calls: dict[int | None, FrameType] = {}
        # What forwards of threads that ended inside a module held (see _forget_thread).
        self._orphans: collections.deque[tuple[int, _Held]] = collections.deque()
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet(modules)
        self._blocks: list[contextvars.Token[weakref.ref[ModuleStream] | None]] = []
        pool.declare_schedule(t for group in self.groups for t in group)
        pool._streams.add(self)
        # Every hook registered, to take off when the stream goes (see ``_Hook``).
        registered: list[Any] = []
        weakref.finalize(self, _take_hooks_off, registered)
        try:
            # Ctrl-C is raised once every hook is registered and its handle recorded, to be
            # removed: a hook registered by a stream never returned would stay on its module.
            with InterruptHold() as hold:
                hold.start()
                for index, module in enumerate(modules):
                    before, after = _Hook(self._before, index), _Hook(self._after, index)
                    self._hooks += (before, after)
                    pre = module.register_forward_pre_hook(before)
                    registered.append(pre)
                    self._handles.append(pre)
                    post = module.register_forward_hook(after, always_call=True)
                    registered.append(post)
                    self._handles.append(post)
                    self._post_handles[index] = post
        except BaseException:
            _take_hooks_off(registered)
            self._handles.clear()
            raise

    # -- hooks -------------------------------------------------------------------------------
    def _state(self) -> _ThreadState:
        """This thread's held leases (a stack per module) and begun leases (by module).

        When the thread ends, the leases it began and never entered are dropped.
        """
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
            with self._lock:
                self._threads.add(state)
            weakref.finalize(state, _forget_thread, state.begun, state.held, weakref.ref(self))
        return state

    def _begin(
        self, index: int, begun: dict[int, list[TensorResidencyLease]]
    ) -> list[TensorResidencyLease]:
        """Start leasing module ``index``'s tensors, so they are loaded and held in time.
        Returns the list they are in (which a close from another thread may take out of
        ``begun`` while they are begun: the forward then drops them itself)."""
        leases = begun.get(index)
        if leases is not None:
            return leases
        with self._lock:  # taken in one step: whatever interrupts, they are in one place
            if self._next_forward.get(index) and index not in self._filling:
                leases = begun[index] = self._next_forward.pop(index)  # past the last module
                return leases
        # Where the forward's end, or the stream's close, finds them before any is begun.
        leases = begun[index] = []
        try:
            self._begin_leases(index, leases)
        except BaseException:
            begun.pop(index, None)
            for lease in leases:
                lease._cancel()  # (idempotent)
            raise
        return leases

    def _begin_leases(self, index: int, leases: list[TensorResidencyLease]) -> None:
        """Begin leases on module ``index``'s tensors into ``leases``, a list the caller keeps
        where they are found whatever interrupts it, and drops on an error."""
        for tensor in self.groups[index]:
            lease = self.pool.acquire(tensor, self.device)
            leases.append(lease)
            if not lease._begin():  # on the loop thread: a plain prefetch instead
                self.pool.prefetch(tensor, self.device)

    def _begin_next_forward(self, index: int) -> None:
        """Begin leases on module ``index`` for the next forward, unless they are begun."""
        leases: list[TensorResidencyLease] = []
        try:
            with self._lock:
                if index in self._next_forward:
                    return
                # Claimed (no other thread begins them too), and where a close finds them.
                self._next_forward[index] = leases
                self._filling.add(index)
            self._begin_leases(index, leases)
            with self._lock:
                self._filling.discard(index)
                if self._handles:
                    return
        except BaseException:
            # Whatever it was cut at (a Ctrl-C right after the claim once left it claimed,
            # and filling, for good: no later forward read that module ahead), a claim of
            # its own goes.
            with self._lock:
                if self._next_forward.get(index) is leases:
                    del self._next_forward[index]
                    self._filling.discard(index)
            for lease in leases:
                lease._cancel()
            raise
        for lease in leases:  # the stream closed meanwhile
            lease._cancel()

    def _before(self, index: int, module: torch.nn.Module, args: Any) -> None:
        """Module ``index``'s forward pre-hook: its leases, those ahead, its values bound."""
        pool = self.pool
        scope = active_tensor_residency()  # (a closed pool's scope left over is left)
        if PENDING.scopes and leave_pending():
            scope = active_tensor_residency()
        if _ORPHANED:  # (first: a forward in another pool's scope reads their changes)
            for reference in list(_ORPHANED):
                orphaned = reference()
                if orphaned is None:
                    _ORPHANED.discard(reference)
                elif orphaned._handles:
                    orphaned._end_orphans()
        if scope is not None and scope[0] is not pool:
            # A forward in another pool's scope is that pool's (its own stream's), unless a
            # call of that pool's stream that is over left the scope set (a Ctrl-C inside
            # its module): that call ends here, as at its own stream's next forward. This
            # stream's own calls that are over end too: the change one made in place is the
            # tensor's latest write, which the other pool serves.
            streams = list(getattr(scope[0], "_streams", ()))  # (a pool's, always)
            opener = opener_of(scope)  # closed meanwhile, perhaps: no longer listed
            if opener is not None and opener not in streams:
                streams.append(opener)
            streams.append(self)
            if not any([other._end_calls_over() for other in streams]):  # (each stream's)
                return
            scope = ACTIVE_RESIDENCY.get()
            if scope is not None and scope[0] is not pool:
                return
        in_block = _IN_BLOCK.get()
        block = None if in_block is None else in_block()
        if (
            block is not None
            and block is not self
            and block.pool is pool
            and block._handles
            and module in block._modules
        ):
            return  # inside another open stream's `with` block, over its module: its forward
        if pool.closed:
            raise T2NErrorMisuse(
                "this module is streamed (stream_modules) through a TensorResidencyPool "
                "that is closed: close the stream (leave its `with` block) to run the "
                "model without the pool, or stream it through a new pool"
            )
        if not self._handles:
            return  # the stream closed as this forward began: it reads through the tensors
        state = self._state()
        held, begun = state.held, state.begun
        if any(held.values()) and self._end_interrupted_calls(state):
            scope = ACTIVE_RESIDENCY.get()  # (the one an interrupted forward opened is left)
        if index <= state.last and not any(held.values()):
            # A new forward in this thread: the last one stopped before its end (an early
            # exit); drop what it began for modules this one does not start with.
            _cancel_begun(begun, keep=range(index, index + self.depth + 1))
        state.last = index
        # Recorded before it holds anything: whatever interrupts this forward, the leases
        # it entered and the scope it opened are where the stream's close finds them.
        call = _module_call()
        state.made += 1
        entry = _Held(state.made)
        stack = held.setdefault(index, [])
        stack.append(entry)
        slots: dict[int, Slot] = {}
        closed: T2NErrorMisuse | None = None
        mine: list[list[TensorResidencyLease]] = []  # what this forward began
        try:
            if call is not None:  # (recorded, then held: see the except clause)
                entry.call = id(call)
                self._calls[entry.call] = call
            if scope is None:  # a forward outside `pool.scope()`
                entry.set_scope(OpenedScope.of(self, self.device))
            # Queue this module's loads, then those ahead, before waiting for any: a late
            # value does not delay the reads behind it.
            mine.append(self._begin(index, begun))
            count = len(self.groups)
            for step in range(1, min(self.depth, count - 1) + 1):
                ahead = index + step
                if ahead < count:
                    mine.append(self._begin(ahead, begun))
                else:
                    self._begin_next_forward(ahead - count)
            # The begun leases stay in ``begun`` until all are entered: whatever stops
            # this (a failed load, Ctrl-C while waiting), the rest are dropped below.
            for lease in begun.get(index, ()):
                try:
                    lease.__enter__()
                except T2NErrorMisuse:
                    # Dropped meanwhile by a close of the pool that was then refused (a lease
                    # held elsewhere): taken again, only what it read ahead is lost. (A
                    # closing pool's check raises as it would.)
                    if not lease._dropped() or not self._handles:
                        raise
                    lease = self.pool.acquire(cast("OffloadedTensor", lease._source), self.device)
                    lease.__enter__()
                entry.leases.append(lease)
                if lease.slot is not None:  # (else a close ended it: nothing is bound)
                    slots[id(lease._source)] = lease.slot
            begun.pop(index, None)
            # Its ops run on the values themselves where the tensors would serve the same
            # (a trace records the tensors, not their values).
            same = scope is None or (scope[0] is pool and scope[1] == self.device)
            if same and not _is_tracing():
                entry.watched = self._bind(index, slots)
            with self._lock:  # a close from now on finds what this forward holds
                if not self._handles:
                    closed = self._closed_under_forward()
            if closed is not None:
                raise closed
        except BaseException as error:
            # Whole: a second Ctrl-C is raised once all is given back (cut midway, the entry
            # would stay, and with it what it holds, until the stream's close).
            with InterruptHold() as hold:
                hold.start()
                self._unbind(index)
                for lease in entry.leases:
                    lease.__exit__(None, None, None)
                # The forward is failing: nothing it began ahead will run (and its traceback
                # would keep what it began alive), whether or not a close took it from
                # `begun`.
                _cancel_begun(begun, keep=())
                for leases in mine:
                    for lease in leases:
                        lease._cancel()  # (nothing for those entered)
                leave_or_wait(entry)
                with contextlib.suppress(ValueError):  # a close from another thread took it
                    stack.remove(entry)
                self._calls.pop(entry.call, None)
            if closed is None and not self._handles and isinstance(error, Exception):
                raise self._closed_under_forward() from error  # e.g. a lease it dropped
            raise

    def _closed_under_forward(self) -> T2NErrorMisuse:
        return T2NErrorMisuse(
            "the stream (stream_modules) was closed while this forward ran in another thread: "
            "close a stream once the forwards through it have ended (each stream of a pool "
            "over the same modules serves a forward that runs outside all their `with` "
            "blocks: run it inside its own stream's block, or share one stream)"
        )

    def _after(self, index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Module ``index``'s forward hook (also on errors)."""
        try:
            self._leave(index)
        finally:
            # Closed: it stayed for a forward inside the module. Not while an error is
            # handled: torch runs the hooks of a module whose forward failed from its live
            # table of hooks, and a removal there makes it raise RuntimeError in place of the
            # forward's error. The hook then goes at its module's next call (or with the
            # stream).
            if not self._handles and sys.exc_info()[1] is None:
                self._drop_post_hook(index)

    def _leave(self, index: int) -> None:
        """A forward leaves module ``index``: its leases end, its changes kept."""
        scope = ACTIVE_RESIDENCY.get()
        if scope is not None and scope[0] is not self.pool:
            return  # another pool's forward (see the pre-hook)
        state = self._state()
        held, begun = state.held, state.begun
        if sys.exc_info()[1] is not None:
            # The forward is failing: drop what was begun for modules that will not run.
            for leases in begun.values():
                for lease in leases:
                    lease._cancel()
            begun.clear()
        stack = held.get(index)
        if not stack:
            return  # the pre-hook failed, or the stream was closed: nothing is held
        # It leaves the stack once its leases ended, and the frame of its call is let go
        # last, so that a call cut anywhere in here stays where the thread's next forward
        # (or a close) finds it. Whole: a Ctrl-C is raised once it is done (one in
        # _keep_changes, which may wait for a lease, would give the values back unkept).
        ended, cut = stack[-1], []
        call = _module_call() if len(stack) > 1 else None
        if call is not None:
            # The module runs inside itself: a call of it that a Ctrl-C cut, and this call
            # caught, left its entry above this call's own, which its frame tells.
            for position, entry in enumerate(stack):
                if entry.call == id(call):
                    ended, cut = entry, stack[position + 1 :]
                    break
        with InterruptHold() as hold:
            hold.start()
            for entry in reversed(cut):
                self._end_entry(stack, entry, mine=True)
            try:
                self._unbind(index)
                self._keep_changes(ended.watched)
            finally:
                ended.watched = []
                for lease in ended.leases:
                    lease.__exit__(None, None, None)  # (idempotent: a close may end it too)
                if ended.token is not None:  # (the first module's, at most)
                    leave_or_wait(ended)
                with contextlib.suppress(ValueError):  # a close from another thread took it
                    stack.remove(ended)
                self._calls.pop(ended.call, None)
            if state.made != ended.serial and any(
                entry.serial > ended.serial for entries in held.values() for entry in entries
            ):
                # A module listed inside this one was cut by a Ctrl-C that this call caught:
                # its call, made after this one, is over as this one ends.
                self._end_interrupted_calls(state)

    def _drop_post_hook(self, index: int, walked: set[int] | None = None) -> None:
        """Remove module ``index``'s post-hook, which a close left for the forwards inside
        the module, once none is, nor any call of it in another thread: torch runs the hooks
        of a failing forward from the module's live table of hooks, where a removal makes it
        raise ``RuntimeError`` in place of the forward's error (the hook then goes at the
        module's next call, or with the stream). ``walked``: the tables such calls may walk,
        looked up once by a caller dropping several (see :func:`_hook_tables_walked_elsewhere`)."""
        with self._lock:
            if any(state.held.get(index) for state in list(self._lingering)):
                return
            handle = self._post_handles.get(index)
            if handle is None:
                return
            if walked is None:
                walked = _hook_tables_walked_elsewhere()
            if id(handle.hooks_dict_ref()) in walked:
                return
            del self._post_handles[index]
        handle.remove()

    # -- values bound in place of their tensors ------------------------------------------------
    def _bind(self, index: int, slots: dict[int, Slot]) -> list[_Watched]:
        """Put the plain values that module ``index``'s leases hold (their ``slots``, by
        tensor) where the module holds their tensors, so that its ops run on plain tensors
        rather than through the tensors' dispatch. Return the values the forward may change
        in place, with their versions.

        A place another forward bound to a different value (a write came between their reads)
        gets its tensor back: both forwards read through the tensor, which serves the latest
        value. A place its owner set to something else meanwhile is left alone."""
        watched: dict[int, _Watched] = {}
        with self._lock:  # the dict close() swaps, read under its lock
            bound = self._bound
            if not self._handles:  # closed: its tensors serve this forward
                return []
            for place in self._places[index]:
                table, name, tensor = place
                slot = slots.get(id(tensor))
                value = None if slot is None else slot.value
                if type(value) is not torch.Tensor or value.is_inference():
                    continue  # an opaque value: the tensor serves its ops
                assert slot is not None
                key = (id(table), name)
                current = table.get(name)
                # Each change is recorded before it is made and forgotten after it is undone:
                # an interrupt in between leaves nothing bound that the stream cannot undo.
                if current is tensor:
                    alias = _alias(value)
                    bound[key] = (place, alias, value)
                    table[name] = alias
                elif key not in bound or bound[key][1] is not current:
                    continue  # replaced by its owner: no longer the stream's to bind
                elif bound[key][2] is not value:
                    table[name] = tensor
                    del bound[key]
                # Running statistics a batch norm in training mode updates in its kernel,
                # unseen by torch's version counter: taken as changed.
                norm = self._running_stats.get(id(tensor))
                changed = norm is not None and norm.training and norm.track_running_stats
                watched[id(tensor)] = (tensor, slot, None if changed else value._version)
        return list(watched.values())

    def _unbind(self, index: int) -> None:
        """Give module ``index``'s places their tensors back (a forward leaving it: another
        one still inside reads through the tensors from now on)."""
        with self._lock:
            keys = [(id(table), name) for table, name, _tensor in self._places[index]]
            changed = _give_back(self._bound, keys)
        _carry_over(changed)

    def _keep_changes(self, watched: list[_Watched]) -> None:
        """Keep what the forward changed in place in the values bound for it, as a
        ``read_write`` lease keeps its change: the value becomes dirty, and is written back.
        A change that a ``read_write`` lease of the pool made meanwhile on the same value is
        that lease's, never the forward's (see ``Actor.changed_under_read_lease``)."""
        actor = self.pool._actor
        for tensor, slot, version in watched:
            if not actor.changed_under_read_lease(slot, version):
                continue
            lease = self.pool.acquire(tensor, self.device, mode="read_write")
            current = lease.__enter__()
            kept = current is slot.value
            if not kept:
                LOGGER.warning(
                    "%r was written while a streamed forward changed its older value in "
                    "place: the forward's change is dropped, the later write stands",
                    tensor.name,
                )
            end_lease(self.pool, lease, kept)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and drop leases begun for modules that did not run (idempotent).

        A forward that Ctrl-C interrupted inside a module (torch runs the hooks that end its
        leases on errors only) has its leases ended, its modules given their tensors back,
        and, closed from its thread, the residency scope the stream opened for it reset.
        Closing the pool from that thread does the same for that forward, and so does the
        thread's next forward through the stream.
        """
        # A Ctrl-C is raised once the close is done: each step takes what it ends out of the
        # stream first, so a close cut midway would leave hooks or leases no later close finds.
        with InterruptHold() as hold:
            hold.start()
            self._close()

    def _close(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, []
            self._lingering = self._threads
            threads = list(self._threads)
            self._threads = weakref.WeakSet()
            posts = {id(handle) for handle in self._post_handles.values()}
        for handle in handles:
            if id(handle) not in posts:
                handle.remove()
        with self._lock:  # a forward interrupted where its module's hook could not run
            bound, self._bound = self._bound, {}
            changed = _give_back(bound, list(bound))
        for state in threads:
            _cancel_begun(state.begun, keep=())
            self._end_held(state)
        self._end_orphans()
        # The frames of the calls whose entries stay (another thread's, inside a module or
        # cut there by a Ctrl-C) stay held: their thread tells by them when the call is over.
        self._release_next_forward()
        self.pool._streams.discard(self)
        # A forward of another thread inside a module leaves the scope the stream opened for
        # it in its own thread only: that module's post-hook stays until it has.
        walked = _hook_tables_walked_elsewhere() if self._post_handles else set()
        for index in list(self._post_handles):
            self._drop_post_hook(index, walked)
        _carry_over(changed)  # last: a failed write leaves the stream closed all the same

    def _end_interrupted_forward(self) -> None:
        """Give back what a forward of the calling thread, interrupted inside modules, still
        holds: its modules get their tensors back, its leases end (keeping its changes), and
        it leaves the scope the stream opened for it. The pool calls this as the thread closes
        it: that forward cannot be running, as its thread is here. So do forwards of threads
        that ended inside a module."""
        self._end_orphans()
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None or not any(state.held.values()):
            return
        with InterruptHold() as hold:  # (as in close)
            hold.start()
            for index, stack in state.held.items():
                if stack:
                    self._unbind(index)  # another forward inside it reads through the tensors
            _cancel_begun(state.begun, keep=())
            self._end_held(state)

    def _end_held(self, state: _ThreadState) -> None:
        """End the leases that a forward of ``state``'s thread interrupted where its modules'
        hooks could not run (Ctrl-C: torch runs them on errors only) still holds, keeping its
        changes, and reset the scope the stream opened for it, from its own thread only (a
        context variable belongs to its context): the calling thread's entries leave, their
        scope left or waiting (see ``_scope.leave_or_wait``); another thread's stay until that
        thread leaves their scope as it ends."""
        mine = state is getattr(self._local, "state", None)
        for stack in list(state.held.values()):
            for held in reversed(list(stack)):  # (the innermost first)
                self._end_entry(stack, held, mine)
        if mine and PENDING.scopes:
            leave_pending()

    def _end_entry(self, stack: list[_Held], held: _Held, mine: bool = False) -> None:
        """End what ``held`` holds (see :meth:`_end_held`) and take it off ``stack``. ``mine``:
        an entry of the calling thread, whose scope is left or waits (see
        ``_scope.leave_or_wait``); otherwise it stays on ``stack`` unless its scope is left."""
        try:
            self._end_holdings(held)
        finally:
            if mine:
                leave_or_wait(held)
            if mine or held.leave_scope() == "left":
                with contextlib.suppress(ValueError):  # its own hook took it already
                    stack.remove(held)
                self._calls.pop(held.call, None)

    def _end_holdings(self, held: _Held) -> None:
        """Keep what ``held``'s forward changed in place, and end its leases (both taken out
        of it first: what a close cut midway ended, a later one does not end again)."""
        watched, held.watched = held.watched, []
        leases, held.leases = held.leases, []
        try:
            self._keep_changes(watched)
        finally:
            for lease in leases:
                lease.__exit__(None, None, None)

    def _end_orphans(self) -> None:
        """End what forwards of threads that ended inside a module held (see
        :func:`_forget_thread`), as a close would: the changes they made in place are kept,
        their leases end, and their modules get their tensors back where no forward is
        inside. Each runs whole (Ctrl-C is raised as it ends): taken out, it is ended."""
        orphans = self._orphans
        while orphans:
            with InterruptHold() as hold:
                hold.start()
                try:
                    index, entry = orphans.popleft()
                except IndexError:  # (another thread took the last one)
                    break
                if self.pool.closed:  # (its close ended the leases: nothing is left to keep)
                    entry.watched = []
                try:
                    self._end_holdings(entry)
                finally:
                    with self._lock:
                        inside = any(state.held.get(index) for state in self._threads)
                    if not inside:
                        self._unbind(index)
        reference = weakref.ref(self)
        _ORPHANED.discard(reference)
        if orphans:  # handed over meanwhile (the finalizer appends, then lists the stream)
            _ORPHANED.add(reference)

    def _end_interrupted_calls(self, state: _ThreadState) -> bool:
        """At a forward's pre-hook: end what module calls of this thread that are over still
        hold, so that each Ctrl-C inside a module leaves nothing held past the next forward.
        A call is over once its frame left the stack (see :func:`_module_call`); one inside
        which this forward runs (a module listed inside another) is not. Its module gets its
        tensors back (unless this thread is inside it still), its change is kept and its
        leases end, as the stream's close would, and it leaves the scope it opened, or waits
        to (see ``_scope.leave_or_wait``). Return whether one was over."""
        running = _frames_running()
        ended = False
        with InterruptHold() as hold:  # (as in close)
            hold.start()
            for index, stack in list(state.held.items()):
                over = [h for h in stack if h.call is not None and h.call not in running]
                if not over:
                    continue
                ended = True
                if len(over) == len(stack):
                    self._unbind(index)  # another forward inside it reads through the tensors
                for held in reversed(over):  # (the innermost first)
                    self._end_entry(stack, held, mine=True)
        return ended

    def _end_calls_over(self) -> bool:
        """:meth:`_end_interrupted_calls` for the calling thread, from another stream's
        pre-hook; whether a call was over."""
        state: _ThreadState | None = getattr(self._local, "state", None)
        return state is not None and any(state.held.values()) and self._end_interrupted_calls(state)

    def _holds_scope(self, scope: tuple[Any, Any]) -> bool:
        """Whether a call of the calling thread that set ``scope`` is on record (running, or
        cut where its frame cannot tell)."""
        state: _ThreadState | None = getattr(self._local, "state", None)
        return state is not None and any(
            entry.value is scope for stack in state.held.values() for entry in stack
        )

    def _forward_inside(self) -> bool:
        """Whether a forward of some thread is inside one of the modules (from its pre-hook
        on: it holds, or is taking, that module's leases)."""
        with self._lock:
            return any(any(state.held.values()) for state in self._threads)

    def _release_next_forward(self) -> None:
        """Drop the leases begun for forwards not running now: the next forward's first
        modules, and those an early-stopped forward began (the pool does before it closes)."""
        with self._lock:
            next_forward, self._next_forward = self._next_forward, {}
            self._filling.clear()
            idle = [state for state in self._threads if not any(state.held.values())]
        for leases in next_forward.values():
            for lease in leases:
                lease._cancel()
        for state in idle:
            _cancel_begun(state.begun, keep=())

    def _let_go(self) -> None:
        """Its pool closed: its hooks stop holding it (see ``_Hook``)."""
        for hook in self._hooks:
            hook.held = None

    def __enter__(self) -> ModuleStream:
        # Whole, or left: a block a Ctrl-C kept from being entered is never left either,
        # and its stream would stay open.
        try:
            with InterruptHold() as hold:
                hold.start()
                self._blocks.append(_IN_BLOCK.set(weakref.ref(self)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        finally:
            if self._blocks:
                with contextlib.suppress(ValueError):  # (left in another context)
                    _IN_BLOCK.reset(self._blocks.pop())


def stream_modules(
    pool: TensorResidencyPool,
    modules: Iterable[torch.nn.Module],
    depth: int = 1,
    device: TDevice | None = None,
) -> ModuleStream:
    """Stream ``modules`` (in execution order) through ``pool``, prefetching ahead.

    When module ``i`` starts (a forward pre-hook), its offloaded parameters and buffers are
    leased and leases on those of modules ``i+1 .. i+depth`` begin: they load in the
    background and stay held until their module has run, whatever the strategy. Leases end
    when their module returns, even on error.

    Past the last module, leases begin on the next forward's first ``depth`` modules: they
    are read while the last modules compute, so that the next forward (in any thread) starts
    without waiting, and stay held until it runs them; a write made meanwhile
    (``model.half()``, ``update_values``) is what that forward reads, and an in-place op on
    a view of such a value, no write, is not (the pool loads the value again). Between
    forwards the pool thus holds them on top of its budget (``pool.evict`` refuses them);
    closing the stream or the pool releases them.

    While a module runs, the places where it (or a submodule) holds its offloaded tensors
    hold the plain values its leases hold instead (an alias of each: a ``.data`` assigned
    there, as ``model.half()`` does after Ctrl-C left a module bound, is assigned to the
    tensor as the place gets it back), and get their tensors back when it returns:
    its operations run on plain tensors, without an offloaded tensor's dispatch on each
    (about 9 µs). What a forward changes in place in such a value is kept as a ``read_write``
    lease keeps it, seen by the value's version counter (what a ``read_write`` lease of the
    pool changes in that value meanwhile is that lease's): a change through ``.data``
    (``self.weight.data.mul_(2)``), whose alias counts its own versions, is not seen, and is
    lost when the value is evicted; change the parameter itself under ``torch.no_grad()``
    (or run that model in ``pool.scope()`` alone, which keeps it). Opaque values
    (``QTensor``), a place its owner set to another tensor, forwards inside the same pool's
    scope on another device and traces (``torch.jit.trace``, ``torch.compile``) read through
    the tensors as before; so do concurrent forwards in one module once a write came between
    their reads.

    The access order is declared to the pool, so ``ResidencyStrategy.SCHEDULED`` knows it from
    the first pass. A forward outside a ``pool.scope()`` is served by the pool too; a forward
    inside another pool's scope is that pool's alone (the stream takes nothing for it), so one
    model may be streamed through several pools (a scope that pool's stream left set, a
    Ctrl-C having cut one of its modules, ends as this stream's module is entered). Works
    for sync forwards, forwards in ``anyio.to_thread.run_sync`` workers and several
    concurrent forwards. Close the stream once the forwards through it have ended: one
    running in another thread as it closes either fails with ``T2NErrorMisuse`` or ends
    reading through its tensors; either way it holds nothing once it ended, and its thread
    leaves the scope the stream opened for it. A forward inside a stream's ``with`` block
    (in its context: its thread or task, and the ``anyio.to_thread`` workers they start) is
    that stream's alone over its modules, so that one stream per request over the same
    modules of one pool works; a forward outside every such block is served by each open
    stream of its pool over its modules, and the close of any of them fails it.
    A stream its caller does not keep (``stream_modules(pool, layers)`` inside ``with pool:``)
    is held by the model while the pool is open, and goes with its hooks once the pool
    closed; a stream kept past its pool's close makes forwards fail with ``T2NErrorMisuse``
    until it is closed.

    Args:
        pool: the pool that serves the values.
        modules: the layers, in the order the forward runs them (transformer blocks, stages).
        depth: how many modules ahead to prefetch (0: none).
        device: where values are delivered (default: each tensor's target device).

    Returns:
        a :class:`ModuleStream`; close it (or leave its ``with`` block) to remove the hooks.

    Raises:
        T2NErrorMisuse: ``pool`` is not a pool, ``modules`` is not an iterable of modules
            (a single layer, say) or lists one twice, ``depth`` is not an int >= 0, or the
            pool is closed.
    """
    return ModuleStream(pool, _module_list(modules), depth, device)


def _module_list(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """``modules`` as a list, or an error that says how to pass the layers."""
    listed: list[Any] | None = None
    if not isinstance(modules, torch.nn.Module) or hasattr(type(modules), "__iter__"):
        with contextlib.suppress(TypeError):  # not iterable
            listed = list(modules)
    if listed is None or not all(isinstance(m, torch.nn.Module) for m in listed):
        got = type(modules).__name__
        if listed is not None:
            got = f"a {got} holding {sorted({type(m).__name__ for m in listed})}"
        else:
            got = f"a single {got}"
        raise T2NErrorMisuse(
            "stream_modules streams the layers of a model, in the order the forward runs "
            f"them (list(model), model.layers); got {got}: to stream one module, pass "
            "[module]"
        )
    first: dict[int, int] = {}
    for position, module in enumerate(listed):
        # Both of its places would hook each of its calls, with one frame for two entries.
        earlier = first.setdefault(id(module), position)
        if earlier != position:
            raise T2NErrorMisuse(
                f"stream_modules got the same {type(module).__name__} twice (at {earlier} "
                f"and {position}): list each module once, in the order of its first call "
                "(a module called more than once in a forward is streamed at each call)"
            )
    return listed
