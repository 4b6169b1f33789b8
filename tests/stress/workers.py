"""Code run in child processes by the crash and disk-full tests.

The tests fork children from a ``forkserver`` that imported torch and the library once, and
run this file in them with ``runpy.run_path(WORKERS_FILE, init_globals={"T2N_JOB": job,
"T2N_ARGS": args})``; the job function named by ``T2N_JOB`` runs with ``**T2N_ARGS``.

Payload files are adopted by name and storage id, which makes the child their owner: a child
that ends normally leaves through ``os._exit`` so that no finalizer removes them, and the parent
inspects them afterwards.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch
from residency_checks import settle

from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.residency import TensorResidencyPool

WORKERS_FILE = Path(__file__)

# Slots of the shared progress array of the crash writer.
STARTED, DURABLE, PHASE = 0, 1, 2
MUTATING, FLUSHING = 0, 1


def adopt(offload_dir: str, name: str, storage_id: str) -> OffloadedTensor:
    """The tensor owning the payload file that ``offload_dir``, ``name`` and ``storage_id`` name."""
    return OffloadedTensor(None, "cpu", offload_dir, name, torch.Tensor, storage_id=storage_id)


def crash_writer(
    offload_dir: str,
    specs: list[tuple[str, str]],
    budget: int,
    face: str,
    progress: Any,
    ready: Any,
    error_file: str,
) -> None:
    """Add 1 to every payload, generation after generation, through a pool, until killed.

    Each generation leases every tensor ``read_write`` (the small ``budget`` makes the pool
    write dirty values back as it evicts them), then flushes; every third generation closes
    the pool instead (close writes back too) and opens a new one. ``face`` is ``"sync"``
    (``with pool``, a private loop thread) or ``"async"`` (``async with pool`` in this
    process's event loop). ``progress[STARTED]`` counts the generations begun,
    ``progress[DURABLE]`` those whose flush or close returned, ``progress[PHASE]`` says whether
    the flush or close is running.
    """
    try:
        tensors = [adopt(offload_dir, name, storage_id) for name, storage_id in specs]
        if face == "sync":
            _crash_writer_sync(tensors, budget, progress, ready)
        else:
            anyio.run(_crash_writer_async, tensors, budget, progress, ready)
    except BaseException:
        Path(error_file).write_text(traceback.format_exc())
        os._exit(1)


def _crash_writer_sync(
    tensors: list[OffloadedTensor], budget: int, progress: Any, ready: Any
) -> None:
    generation = 0
    while True:
        with TensorResidencyPool(max_cached_bytes=budget, max_workers=2) as pool:
            ready.set()
            while True:
                generation += 1
                progress[PHASE] = MUTATING
                progress[STARTED] = generation
                for tensor in tensors:
                    with pool.acquire(tensor, mode="read_write") as value:
                        value.add_(1.0)
                progress[PHASE] = FLUSHING
                if generation % 3 == 0:
                    break  # closing the pool writes back
                pool.flush()
                progress[DURABLE] = generation
        progress[DURABLE] = generation


async def _crash_writer_async(
    tensors: list[OffloadedTensor], budget: int, progress: Any, ready: Any
) -> None:
    generation = 0
    while True:
        async with TensorResidencyPool(max_cached_bytes=budget, max_workers=2) as pool:
            ready.set()
            while True:
                generation += 1
                progress[PHASE] = MUTATING
                progress[STARTED] = generation
                for tensor in tensors:
                    async with pool.acquire(tensor, mode="read_write") as value:
                        value.add_(1.0)
                progress[PHASE] = FLUSHING
                if generation % 3 == 0:
                    break
                await pool.aflush()
                progress[DURABLE] = generation
        progress[DURABLE] = generation


def _error_facts(error: BaseException) -> dict[str, Any]:
    chain = []
    cause: BaseException | None = error
    while cause is not None:
        chain.append(type(cause).__name__)
        cause = cause.__cause__
    errnos = []
    cause = error
    while cause is not None:
        if isinstance(cause, OSError):
            errnos.append(cause.errno)
        cause = cause.__cause__
    return {
        "type": type(error).__name__,
        "message": str(error),
        "chain": chain,
        "efbig": errno.EFBIG in errnos,
    }


def _attempt(step: Any) -> dict[str, Any]:
    try:
        step()
    except Exception as error:
        return _error_facts(error)
    return {"type": None}


def _temporary_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def _file_values(tensor: OffloadedTensor) -> torch.Tensor:
    """What the payload file holds (a read outside any pool sees the pool's unsaved value)."""
    return next(iter(storage.read_payload(storage.read_layout(tensor.offload_path)).values()))


def disk_full(offload_dir: str, specs: list[tuple[str, str]], size_limit: int, reply: Any) -> None:
    """Write back under a file size limit (EFBIG), then again once the limit is lifted.

    Sends the parent a dict of observations, one per step, and leaves with ``os._exit``.
    """
    facts: dict[str, Any] = {}
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        first, second, third = (adopt(offload_dir, n, s) for n, s in specs)
        nbytes = first.payload_nbytes
        original = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = [t._reload_unmanaged() for t in (first, second, third)]
        pool = TensorResidencyPool(max_cached_bytes=nbytes)  # room for one value
        with pool:
            with pool.acquire(first, mode="read_write") as value:
                value.add_(1.0)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size_limit, original[1]))
            facts["flush"] = _attempt(pool.flush)
            facts["resident_after_flush"] = pool.is_resident(first)
            facts["kept_after_flush"] = torch.equal(pool.resolve(first), old[0] + 1)
            facts["disk_after_flush"] = torch.equal(_file_values(first), old[0])
            facts["temps_after_flush"] = _temporary_files(offload_dir)
            facts["evict"] = _attempt(lambda: pool.evict(first))
            facts["resident_after_evict"] = pool.is_resident(first)
            facts["close"] = _attempt(pool.close)
            facts["closed_after_failed_close"] = pool.closed
            # Pressure: a second dirty value pushes the first one out; both write-backs fail.
            with pool.acquire(second, mode="read_write") as value:
                value.add_(2.0)
            with pool.acquire(third) as value:
                facts["third_readable"] = torch.equal(value, old[2])
            settle(pool)  # the pushed-out value is resident again once its write-back failed
            facts["pressure_resident"] = [pool.is_resident(first), pool.is_resident(second)]
            facts["pressure_kept"] = [
                torch.equal(pool.resolve(first), old[0] + 1),
                torch.equal(pool.resolve(second), old[1] + 2),
            ]
            facts["direct_update"] = _attempt(lambda: third.update_values(old[2] + 3))
            facts["disk_under_limit"] = [
                torch.equal(_file_values(t), o)
                for t, o in zip((first, second, third), old, strict=True)
            ]
            facts["temps_under_limit"] = _temporary_files(offload_dir)
            stats = pool.stats()
            # Space is back: the same flush succeeds and nothing was lost.
            resource.setrlimit(resource.RLIMIT_FSIZE, original)
            facts["flush_again"] = _attempt(pool.flush)
            facts["write_backs"] = pool.stats().write_backs - stats.write_backs
        facts["closed"] = pool.closed
        facts["disk_final"] = [
            torch.equal(first._reload_unmanaged(), old[0] + 1),
            torch.equal(second._reload_unmanaged(), old[1] + 2),
            torch.equal(third._reload_unmanaged(), old[2]),
        ]
        facts["layouts_valid"] = all(
            storage.read_layout(t.offload_path).nbytes == nbytes for t in (first, second, third)
        )
        facts["temps_final"] = _temporary_files(offload_dir)
    except BaseException:
        facts["worker_error"] = traceback.format_exc()
    reply.send(facts)
    reply.close()
    os._exit(0)


def tensor_writer(offload_dir: str, name: str, storage_id: str, elements: int, ready: Any) -> None:
    """Adopt a tensor's payload file and rewrite it with ``update_values`` over and over,
    alternating ``arange(elements)`` and its negation, until killed."""
    tensor = adopt(offload_dir, name, storage_id)
    old = torch.arange(elements, dtype=torch.float32)
    new = -old
    ready.set()
    while True:
        tensor.update_values(new)
        tensor.update_values(old)


def payload_writer(path: str, ready: Any) -> None:
    """Write the payload file ``path`` over and over, alternating two values, until killed:
    ``storage.write_payload`` alone, no tensor or pool."""
    values = [torch.full((4 << 20,), 1.0), torch.full((4 << 20,), 2.0)]
    storage.write_payload(path, {"w": values[0]})
    ready.set()
    generation = 1
    while True:
        storage.write_payload(path, {"w": values[generation % 2], "n": torch.tensor(generation)})
        generation += 1


def _main(namespace: dict[str, Any]) -> None:
    job = namespace.get("T2N_JOB")
    if job is None:
        return
    jobs: dict[str, Callable[..., None]] = {
        "crash_writer": crash_writer,
        "disk_full": disk_full,
        "payload_writer": payload_writer,
        "tensor_writer": tensor_writer,
    }
    jobs[job](**namespace["T2N_ARGS"])


_main(globals())
