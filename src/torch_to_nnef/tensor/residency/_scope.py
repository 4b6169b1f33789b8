"""The residency scope: which pool serves ``OffloadedTensor`` reloads in this context.

The context variable lives with the tensor's protocol (``tensor/offload/_protocol.py``), below
both the tensor and the pool; this module gives it its public name here, and keeps the scopes
streams set for their forwards (:class:`StreamScope`): a stream's forward cut by a Ctrl-C
leaves its scope set, and whatever ends that forward later may find a scope entered since
covering it. Such a scope waits (:data:`PENDING`) and is left as soon as it is the innermost
again: at the next pre-hook of any stream in the thread, or as the scope covering it exits.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from typing import Any, Literal

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.tensor.offload._protocol import ACTIVE_RESIDENCY, active_tensor_residency

__all__ = [
    "PENDING",
    "OpenedScope",
    "StreamScope",
    "active_tensor_residency",
    "leave_left_over",
    "leave_or_wait",
    "leave_pending",
    "opener_of",
]

Outcome = Literal["left", "covered", "elsewhere"]

_MARK: contextvars.ContextVar[object] = contextvars.ContextVar("t2n_stream_mark", default=None)
"""A new object each time a stream sets a scope, in the context where it does (a copy of the
context carries it): a stream's scope that is not the innermost is covered in its context,
or a copy of it, while the mark is still its own; otherwise it was set in another context,
and stays set there."""


class OpenedScope(tuple):  # type: ignore[type-arg]  # (a pair, as any scope's value)
    """The value of a scope a stream set: the pair ``(pool, device)`` of any scope, which
    also knows the stream (:func:`opener_of`). A thread that finds it left over by a call a
    Ctrl-C cut asks that stream to end the call, whether or not the stream is still its
    pool's (a close from another thread leaves the scope set in the thread that opened it).
    The reference is weak: a stream dropped with its model goes, and leaves its scopes as
    it goes."""

    opener: weakref.ref[Any]

    @classmethod
    def of(cls, stream: Any, device: Any) -> OpenedScope:
        """The value of a scope ``stream`` sets for its pool and ``device``."""
        opened = cls((stream.pool, device))
        opened.opener = weakref.ref(stream)
        return opened


def opener_of(scope: tuple[Any, Any]) -> Any:
    """The stream that set ``scope`` (a scope's value), if a stream did and it lives."""
    opener = getattr(scope, "opener", None)
    return None if opener is None else opener()


class StreamScope:
    """A scope a stream set: its value, its token, the context's mark then (no value and no
    token where the stream set none: a scope was active already)."""

    __slots__ = ("mark", "token", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.token: contextvars.Token[Any] | None = None
        self.mark: object = None

    def set_scope(self, value: OpenedScope) -> None:
        """Set ``value`` as the scope (a Ctrl-C right after the set: not the token, but the
        set is undone)."""
        self.value, self.mark = value, object()
        _MARK.set(self.mark)  # (its token is not kept: the mark is never reset)
        try:
            self.token = ACTIVE_RESIDENCY.set(value)
        except BaseException:
            ACTIVE_RESIDENCY.set(None)
            raise

    def leave_scope(self) -> Outcome:
        """Reset the scope, only where its value is the innermost, from its own context. A
        reset restores the value before it: under a scope entered since (a user's ``with
        pool.scope():``) it would undo that one, whose exit would then bring this one back;
        and a context variable belongs to its context. Returns ``"left"`` (or none was set),
        ``"covered"`` (not the innermost in its context, or a copy of it: to be left later,
        see :func:`leave_or_wait`) or ``"elsewhere"`` (set in another context, or thread)."""
        token = self.token
        if token is None:
            return "left"
        if ACTIVE_RESIDENCY.get() is not self.value:
            return "covered" if _MARK.get() is self.mark else "elsewhere"
        # A Ctrl-C is raised once the token is cleared: one just after the reset would keep
        # it, and with it the entry (and its module's post-hook) for a scope already left.
        with InterruptHold() as hold:
            hold.start()
            try:
                ACTIVE_RESIDENCY.reset(token)
            except ValueError:  # a copy of its context: its own context leaves it
                return "covered"
            except RuntimeError:  # reset once already
                pass
            self.token = None
        return "left"


class _Pending(threading.local):
    """Per thread, the stream scopes whose forward ended while they were covered."""

    def __init__(self) -> None:
        self.scopes: list[StreamScope] = []


PENDING = _Pending()


def leave_or_wait(scope: StreamScope) -> None:
    """Leave ``scope``, set for a forward of the calling thread that ends, or have it wait
    in :data:`PENDING` where it is covered; one set in another context stays set there
    (nothing here can reset it)."""
    outcome = scope.leave_scope()
    if outcome == "covered":
        PENDING.scopes.append(scope)
    elif outcome == "elsewhere":
        scope.token = None


def leave_pending() -> bool:
    """Leave the calling thread's waiting scopes that are the innermost again (the innermost
    first); return whether one was left. The others wait on, those of other contexts too:
    each waits because its own context, live then, covered it (or a copy of it could not
    reset it), and an asyncio task of the thread may be inside that cover now."""
    pending = PENDING.scopes
    left = False
    for scope in reversed(list(pending)):
        if scope.leave_scope() == "left":
            with contextlib.suppress(ValueError):  # (a handler run meanwhile took it)
                pending.remove(scope)
            left = True
    return left


def leave_left_over(scope: tuple[Any, Any], closed: bool) -> bool:
    """Whether ``scope``, a stream's and the innermost in this context, is left over, its
    pool ``closed`` or its stream gone, for a call that is not running here: it is left
    then. A call that a Ctrl-C cut ends as at that stream's next forward, and a scope waiting
    to be left in this context (its call ended in a copy of it) is left. A scope with no call
    of this thread under it (the stream was collected, or this context is a copy of the one
    it was set in) is replaced by none: a stream sets its scope only where none is active."""
    stream = opener_of(scope)
    if stream is not None:  # (none: it went, collected in another thread; nothing runs)
        if not closed:
            return False
        stream._end_calls_over()
        if ACTIVE_RESIDENCY.get() is not scope:
            return True
        if stream._holds_scope(scope):
            return False  # its call runs: the pool closed under it, as it says
    # Its call ended, in a copy of this context perhaps, where it waits to be left here.
    if PENDING.scopes and leave_pending() and ACTIVE_RESIDENCY.get() is not scope:
        return True
    ACTIVE_RESIDENCY.set(None)
    return True
