"""Invariants of DESIGN §3, checked on the pool's loop thread after an operation."""

from __future__ import annotations

import concurrent.futures

from torch_to_nnef.tensor.residency import TensorResidencyPool
from torch_to_nnef.tensor.residency._policy import FixedPolicy


def _check(pool: TensorResidencyPool) -> None:
    actor = pool._actor
    actor.drain()
    resident = [e for e in actor.entries.values() if e.value is not None]
    assert actor.resident_bytes == sum(e.nbytes for e in resident)
    assert set(actor.published) == {e.key for e in resident}
    assert actor.leased_entries == sum(1 for e in resident if e.leases)
    assert actor.evicting_bytes == sum(e.nbytes for e in resident if e.evicting)
    in_use = [e for e in resident if not e.pinned and (e.leases or e.waiters)]
    assert actor.in_use_bytes == sum(e.nbytes for e in in_use)
    assert actor.loading_bytes == sum(e.nbytes for e in actor.entries.values() if e.load)
    # Spare buffers fill only what resident values and loads leave of the budget plus the
    # peak in use, so the pool never holds more than that.
    assert actor.spares.nbytes <= actor._spare_room()
    if pool.max_cached_bytes is not None and actor.spares.nbytes:
        assert (
            actor.resident_bytes + actor.loading_bytes + actor.spares.nbytes
            <= pool.max_cached_bytes + actor.active_peak
        )
    for entry in actor.entries.values():
        assert entry.leases >= 0 and entry.waiters >= 0
        assert entry.value is not None or entry.load is not None, (
            "an entry with nothing to wait for"
        )
    budget = pool.max_cached_bytes
    unheld = [e for e in resident if not e.held and not e.evicting]
    if budget is not None:
        assert all(e.retained for e in unheld), "an unretained value outlived its holders"
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
    host = pool._host
    if not host.running or host.on_loop_thread():
        _check(pool)
        return
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            _check(pool)
            done.set_result(None)
        except BaseException as error:
            done.set_exception(error)

    host.call(run)
    done.result(timeout=10)
