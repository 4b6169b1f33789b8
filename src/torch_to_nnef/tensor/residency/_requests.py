"""The pool's requests, as operations of the runtime's driver: one class per operation.

Each ``step`` calls the actor's transition and interprets the job it waited for; each
``abandon`` gives back what the operation holds. Both run on the loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import PoolSource
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._runtime import Operation
from torch_to_nnef.tensor.residency._state import (
    CallerRead,
    Holder,
    Job,
    Ticket,
    as_storage_error,
)

__all__ = ["Acquire", "Close", "Evict", "Flush", "Prefetch", "Resolve", "Transition"]

CALLER_READ_MAX_BYTES = 1 << 20
"""The largest payload a thread's sync request reads itself on a miss (:func:`read_by_caller`);
larger ones go to the I/O workers."""


class Resolve(Operation):
    """Serve a value (a hit), or wait for its load and serve what it read."""

    inline = "resolve"
    consumer = True

    def __init__(self, actor: Actor, source: PoolSource, device: torch.device) -> None:
        self.actor, self.source, self.device = actor, source, device
        self.first = True  # its first step counts it (abandoned or retried after)
        self.read: CallerRead | None = None

    def prepare(self) -> None:
        self.read = read_by_caller(self.actor, self.source, self.device)

    def step(self) -> torch.Tensor | Job:
        loaded = _loaded(self.waited, self.source, self.actor)
        if loaded is not None:
            return loaded  # not retained values are only delivered by the load
        first, self.first = self.first, False
        read, self.read = self.read, None
        result = self.actor.resolve_step(self.source, self.device, first, read)
        self.loading = self.loading or _read_taken(read)
        return result


def _read_taken(read: CallerRead | None) -> bool:
    """Whether the step kept what its caller read as the value: the request waited for that
    read as it would for a load (its stall)."""
    return read is not None and read.taken


def read_by_caller(actor: Actor, source: PoolSource, device: torch.device) -> CallerRead | None:
    """Read ``source``'s value on the calling thread, a thread other than the loop's about to
    request it (a sync ``resolve`` or ``acquire`` whose lock-free hit failed), so that its load
    is no hand-off to an I/O worker and back (the step takes it: ``Actor._start_load``): a
    small payload for the CPU, read as mapped reads say (with them switched off, loads read
    into the buffers of evicted values, which only the actor hands out), that no load of the
    pool reads already. ``None`` when that does not apply or the read failed (the load then
    reads it, and reports the failure)."""
    if (
        device.type != "cpu"
        or source.payload_nbytes > CALLER_READ_MAX_BYTES
        or not storage.mapped_reads()
        or actor.seen_entry(source) is not None  # (a hint: the step decides)
        or actor.closing
    ):
        return None
    token = source._hit_state.last_write()  # what it reads is this write, or a later one
    try:
        # Read as a worker reads, whatever the caller's thread runs under: a value made in
        # its torch.inference_mode() would be an inference tensor, which tracks no version
        # counter (the pool reads it of every value) and refuses in-place changes and
        # autograd outside that mode. (Entered only then: it costs a tenth of the read.)
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                value = source._reload_unmanaged(device, None, None)
        else:
            value = source._reload_unmanaged(device, None, None)
    except Exception:
        return None
    return CallerRead(token, value)


class Prefetch(Resolve):
    """Start (or join) a load, pinning the value with ``pin``; the loaded value."""

    inline = "prefetch"
    consumer = False

    def __init__(self, actor: Actor, source: PoolSource, device: torch.device, pin: bool) -> None:
        super().__init__(actor, source, device)
        self.pin = pin

    def prepare(self) -> None:
        """Nothing: a prefetch reads on the I/O workers, never on its caller's thread."""

    def step(self) -> torch.Tensor | Job:
        loaded = _loaded(self.waited, self.source, self.actor)
        if loaded is not None:
            return loaded
        return self.actor.prefetch_step(self.source, self.device, self.pin)


def _loaded(waited: Job | None, source: PoolSource, actor: Actor) -> torch.Tensor | None:
    """The value of the load the request waited for, unless a write came since what it
    read: the request was made after that write, so it loads again (``None``)."""
    if waited is None or waited.kind != "load":
        return None
    if waited.error is None and waited.version is not source._hit_state.version_for(actor):
        return None
    return waited.result()


class Acquire(Operation, Ticket):
    """Grant a lease to the ticket's holder: the value. While it waits, its reservation keeps
    the value; abandoned, it gives back its reservation or the lease it granted."""

    inline = "acquire"
    consumer = True

    def __init__(
        self, actor: Actor, source: PoolSource, device: torch.device, holder: Holder
    ) -> None:
        Ticket.__init__(self, source, device, holder)
        self.actor = actor

    def prepare(self) -> None:
        self.read = read_by_caller(self.actor, self.source, self.device)

    def step(self) -> torch.Tensor | Job:
        waited = self.waited
        if waited is not None and waited.kind == "load" and waited.error is not None:
            raise as_storage_error(waited.error)
        read = self.read
        result = self.actor.acquire_step(self)
        self.loading = self.loading or _read_taken(read)
        return result

    def abandon(self) -> None:
        super().abandon()
        self.actor.abandon_acquire(self)


class Transition(Operation):
    """A request that never waits (unpin, declare_schedule): one transition."""

    def __init__(self, transition: Callable[[], Any]) -> None:
        self.transition = transition

    def step(self) -> Any:
        return self.transition()


class Evict(Operation):
    """Evict a value, waiting for its load or write-back first."""

    twin = "aevict"
    inline = "evict"

    def __init__(self, actor: Actor, source: PoolSource) -> None:
        self.actor, self.source = actor, source

    def step(self) -> Job | None:
        waited = self.waited
        if waited is not None and waited.kind == "write" and waited.error is not None:
            raise write_error(self.source, waited.error)
        return self.actor.evict_step(self.source)


class Flush(Operation):
    """Write dirty values back (all, or one tensor's) and wait for loads in flight."""

    twin = "aflush"
    inline = "flush"

    def __init__(self, actor: Actor, source: PoolSource | None) -> None:
        self.actor, self.source = actor, source
        self.jobs: list[Job] | None = None

    def step(self) -> Job | None:
        if self.jobs is None:
            self.actor.check_open()
            self.jobs = self.actor.flush_step(self.source)
        return _pending_or_failed(
            self.jobs,
            "",
            ": fix the cause (free space, the offload directory, or the value as the error says) "
            "and flush again",
        )


class Close(Operation):
    """Refuse while values are leased; write every dirty value back; release everything."""

    twin = "aclose"
    inline = "close"

    def __init__(self, actor: Actor, before: Callable[[], None]) -> None:
        self.actor = actor
        self.before = before
        self.began = False
        self.jobs: list[Job] = []

    def step(self) -> Job | None:
        actor = self.actor
        if actor.closed:
            return None
        if not self.began:
            if actor.close_ended is not None:
                return actor.close_ended  # another close is under way: this one ends with it
            self.before()
            actor.begin_close()
            self.began = True
        while True:
            pending = _pending_or_failed(
                self.jobs,
                "closing the pool: ",
                " and the pool stays open: fix the cause and close again",
            )
            if pending is not None:
                return pending
            self.jobs = list(actor.jobs) or actor.flush_step(None)
            if not self.jobs:
                actor.finish_close()
                return None

    def abandon(self) -> None:
        super().abandon()
        if self.began and not self.actor.closed:
            self.began = False
            self.actor.abort_close()


def _pending_or_failed(jobs: list[Job], context: str, remedy: str) -> Job | None:
    """The first of ``jobs`` still running; once all ended, raise if a write-back failed."""
    pending = next((job for job in jobs if not job.done), None)
    if pending is not None:
        return pending
    failed = [job.error for job in jobs if job.kind == "write" and job.error is not None]
    if failed:
        shown = "; ".join(str(error) for error in failed[:_ERRORS_SHOWN])
        more = len(failed) - _ERRORS_SHOWN
        if more > 0:
            shown += f"; and {more} more"
        raise T2NErrorStorage(
            f"{context}{len(failed)} write-back(s) failed ({shown}); the dirty values stay "
            f"resident{remedy}"
        ) from failed[0]
    return None


_ERRORS_SHOWN = 3
"""How many failed write-backs an error of a flush or a close quotes (each names its file)."""


def write_error(source: PoolSource, error: BaseException) -> T2NErrorStorage:
    wrapped = T2NErrorStorage(
        f"writing {source.name!r} back failed; the value stays resident and dirty: {error}"
    )
    wrapped.__cause__ = error
    return wrapped
