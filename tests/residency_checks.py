"""Invariants of DESIGN §3, checked on the pool's loop thread after an operation."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool
from torch_to_nnef.tensor.residency._actor import Actor
from torch_to_nnef.tensor.residency._policy import FixedPolicy
from torch_to_nnef.tensor.residency._runtime import Operation
from torch_to_nnef.tensor.residency._state import Job


def _check(pool: TensorResidencyPool) -> None:
    actor = pool._actor
    actor.sync()
    resident = [e for e in actor.entries.values() if e.value is not None]
    assert actor.resident_bytes == sum(e.nbytes for e in resident)
    # Published (handed out without the actor): resident values not on their way out.
    assert set(actor.published) <= {e.key for e in resident if not e.evicting}
    for key, slot in actor.published.items():
        assert slot.open and slot.entry is actor.entries[key] and slot is slot.entry.slot
    assert actor.evicting_bytes == sum(e.nbytes for e in resident if e.evicting)
    in_use = [e for e in resident if not e.pinned and (e.tracked or e.waiters)]
    assert actor.in_use_bytes == sum(e.nbytes for e in in_use)
    assert actor.loading_bytes == sum(e.nbytes for e in actor.entries.values() if e.load)
    assert actor.pins == sum(e.pinned for e in actor.entries.values())
    # Spare buffers fill only what resident values and loads leave of the budget plus the
    # peak in use, so the pool never holds more than that.
    assert actor.spares.nbytes <= actor.spare_room()
    if pool.max_cached_bytes is not None and actor.spares.nbytes:
        assert (
            actor.resident_bytes + actor.loading_bytes + actor.spares.nbytes
            <= pool.max_cached_bytes + actor.active_peak
        )
    for entry in actor.entries.values():
        assert entry.waiters >= 0
        assert entry.slot is None or entry.slot.leases >= 0
        assert entry.value is not None or entry.load is not None, (
            "an entry with nothing to wait for"
        )
        if entry.slot is not None and entry.slot.leases and entry.slot.tracked:
            assert entry.held
        # An entry holds its tensor weakly only while its value is clean and idle, and the
        # step after a tensor's collection removes its entry (this check runs after one).
        slot = entry.slot
        busy = (
            entry.value is None
            or entry.load is not None
            or entry.write is not None
            or entry.evicting
            or entry.dirty
            or entry.held
            or (slot is not None and (slot.dirty or slot.changing or slot.writing))
        )
        if busy:
            assert entry.strong is not None, "a busy entry holds its tensor weakly"
        assert entry.alive is not None, "the entry of a collected tensor stayed"
        assert entry.strong is None or entry.strong is entry.alive
    # A value on its way out is held by nothing, and no victim again: evicting it frees nothing.
    assert not any(e.held for e in resident if e.evicting), "an evicting value is held"
    budget = pool.max_cached_bytes
    unheld = [e for e in resident if not e.held and not e.evicting]
    if not isinstance(actor.policy, FixedPolicy):
        # The eviction order holds exactly the values an eviction would free.
        assert actor.policy.evictable_bytes() == sum(e.nbytes for e in unheld if e.retained)
    if budget is not None:
        # Values leased without the actor count as cached until it needs their room.
        assert all(e.retained or e.slot.leases for e in unheld), (
            "an unretained value outlived its holders"
        )
        kept = sum(e.nbytes for e in unheld)
        if isinstance(actor.policy, FixedPolicy):
            assert actor.policy.admitted_bytes <= budget
        else:
            # The budget bounds cached values: not those in use (leased or awaited), nor those
            # whose write-back runs (on their way out).
            cached = actor.resident_bytes - actor.evicting_bytes - actor.in_use_bytes
            assert cached <= budget or kept == 0, (
                f"{kept} unheld bytes stay while {cached} cached > budget {budget}"
            )


def check_invariants(pool: TensorResidencyPool) -> None:
    """Assert the invariants, on the pool's loop thread when it runs on another one."""
    runtime = pool._runtime
    runtime.catch_up()
    if not runtime.running or runtime.on_loop_thread():
        _check(pool)
        return
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            _check(pool)
            done.set_result(None)
        except BaseException as error:
            done.set_exception(error)

    runtime.post(run)
    done.result(timeout=10)


class _Settle(Operation):
    """Wait until no disk job runs (write-backs that evictions started end asynchronously);
    ``waited``: whether it found one."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.waited = False

    def step(self) -> Job | None:
        self.actor.sync()  # as every request: leases ended before it start their write-backs
        job = next((job for job in self.actor.jobs if not job.done), None)
        self.waited = self.waited or job is not None
        return job


def settle(pool: TensorResidencyPool) -> None:
    """Wait, from a thread other than the pool's loop thread, until no disk job runs. The
    end of a job it waited for may leave an eviction to run once it is answered (and its
    write-back to start then): it is settled once a look finds no job running."""
    while pool._runtime.running:
        settling = _Settle(pool._actor)
        pool._runtime.call(settling)
        if not settling.waited:
            return


def on_disk(tensor: OffloadedTensor) -> torch.Tensor:
    """The values in the tensor's payload file, read without any pool's unsaved value."""
    layout = storage.read_layout(tensor.offload_path)
    return next(iter(storage.read_payload(layout).values()))


def io_threads_since(before: set[threading.Thread]) -> list[threading.Thread]:
    """The pools' I/O worker threads alive now that were not in ``before``."""
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before and thread.name.startswith("t2n-residency-io")
    ]


def _structured(record: logging.LogRecord) -> bool:
    """An application's logging filter that adds the record as JSON (and raises on arguments
    JSON cannot take, as an exception)."""
    record.structured = json.dumps({"message": record.msg, "args": record.args})
    return True


@contextmanager
def reports_that_raise(on: bool = True) -> Iterator[None]:
    """The pool's records go through an application's filter that raises on arguments JSON
    cannot take: the warning of a failed write-back (its error) raises in the transition
    that reports it, which the job's recovery then ends (``Job._abort``). ``on`` false:
    nothing is added."""
    logger = logging.getLogger("torch_to_nnef.tensor.residency")
    if on:
        logger.addFilter(_structured)
    try:
        yield
    finally:
        logger.removeFilter(_structured)
