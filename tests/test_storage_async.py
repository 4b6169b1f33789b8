"""The async reader and writer: round trips, buffer reuse, concurrency, cancellation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from breakpoints import paused_in_new_threads

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.storage import _io as storage_io
from torch_to_nnef.tensor.storage._format import DTYPE_BY_CODE

ALL_DTYPES = sorted(set(DTYPE_BY_CODE.values()), key=str)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 4).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(
        actual.contiguous().reshape(-1).view(torch.uint8),
        expected.contiguous().reshape(-1).view(torch.uint8),
    )


class SlowExecutor(concurrent.futures.ThreadPoolExecutor):
    """A real thread pool whose data transfers (calls given a memoryview) take ``delay`` more.

    It counts those transfers, in total and in flight; other calls (open, seek, close) run
    at their normal speed.
    """

    def __init__(self, delay: float, max_workers: int = 2) -> None:
        super().__init__(max_workers=max_workers)
        self.delay = delay
        self.in_flight = 0
        self.calls = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        bound = fn.args if isinstance(fn, functools.partial) else ()
        if not any(isinstance(arg, memoryview) for arg in (*bound, *args)):
            return super().submit(fn, *args, **kwargs)

        def slow() -> Any:
            with self._lock:
                self.in_flight += 1
                self.calls += 1
            try:
                time.sleep(self.delay)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.in_flight -= 1

        return super().submit(slow)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
async def test_async_round_trip_of_every_dtype_and_shape(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    tensors = {
        "scalar": make_tensor(dtype, ()),
        "empty": make_tensor(dtype, (0, 4)),
        "matrix": make_tensor(dtype, (33, 17), seed=1),
        "transposed": make_tensor(dtype, (8, 5), seed=2).t(),
    }
    path = tmp_path / "p.safetensors"
    written = await storage.awrite_payload(path, tensors, {"k": "v"}, chunk_bytes=100)
    layout = storage.read_layout(path)
    assert layout == written and layout.metadata == {"k": "v"}

    loaded = await storage.aread_payload(layout, chunk_bytes=64)
    for name, tensor in tensors.items():
        assert_same(loaded[name], tensor)
    synced = storage.read_payload(layout)
    for name in tensors:
        assert_same(synced[name], loaded[name])


@pytest.mark.asyncio
async def test_async_and_sync_files_are_identical(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(300, 200), "b": torch.randn(200).half(), "i": torch.arange(7)}
    await storage.awrite_payload(tmp_path / "a.safetensors", tensors, {"m": "1"}, chunk_bytes=4096)
    storage.write_payload(tmp_path / "s.safetensors", tensors, {"m": "1"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()


@pytest.mark.asyncio
async def test_async_read_into_out_buffers_and_selected_names(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(1000), "b": torch.randn(10, 10), "c": torch.arange(5)}
    layout = storage.write_payload(tmp_path / "p.safetensors", tensors)
    out = storage.allocate(layout, ["c", "a"])
    pointers = {name: t.data_ptr() for name, t in out.items()}

    loaded = await storage.aread_payload(layout, out=out, names=["c", "a"], chunk_bytes=512)

    assert list(loaded) == ["c", "a"]
    for name in ("a", "c"):
        assert loaded[name] is out[name] and loaded[name].data_ptr() == pointers[name]
        assert torch.equal(loaded[name], tensors[name])


@pytest.mark.asyncio
async def test_async_errors_match_the_sync_reader(tmp_path: Path) -> None:
    layout = storage.write_payload(tmp_path / "p.safetensors", {"a": torch.randn(4)})
    with pytest.raises(T2NErrorMisuse, match="out\\['a'\\] must be"):
        await storage.aread_payload(layout, out={"a": torch.empty(5)})
    with pytest.raises(T2NErrorStorage, match="has no entry 'x'"):
        await storage.aread_payload(layout, names=["x"])
    for chunk_bytes in (0, 1.5, "4096"):
        with pytest.raises(T2NErrorMisuse, match="chunk_bytes must be a positive int"):
            await storage.aread_payload(layout, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match="chunk_bytes must be a positive int"):
        await storage.awrite_payload(layout.path, {"a": torch.randn(4)}, chunk_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match="reads a PayloadLayout, got str"):
        await storage.aread_payload(str(layout.path))  # type: ignore[arg-type]

    storage.write_payload(layout.path, {"a": torch.randn(8)})
    with pytest.raises(T2NErrorStorage, match="replaced or modified"):
        await storage.aread_payload(layout)
    layout.path.unlink()
    with pytest.raises(T2NErrorStorage, match=f"cannot open payload file '{layout.path}'"):
        await storage.aread_payload(layout)


@pytest.mark.asyncio
async def test_async_short_read_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\0" * 100)
    layout = storage.PayloadLayout(
        path, {"w": storage.EntrySpec("w", torch.float32, (10,), 80, 40)}, {}, file_size=100
    )
    with pytest.raises(T2NErrorStorage, match=r"ended at byte 100 .*truncated file"):
        await storage.aread_payload(layout)


@pytest.mark.asyncio
async def test_async_write_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "p.safetensors"
    with pytest.raises(T2NErrorStorage, match=f"cannot write payload file '{missing}'") as info:
        await storage.awrite_payload(missing, {"w": torch.zeros(2)})
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(T2NErrorMisuse, match="reserved"):
        await storage.awrite_payload(tmp_path / "p.safetensors", {"__metadata__": torch.zeros(1)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_async_write_replaces_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    destination = tmp_path / "w.safetensors"
    destination.symlink_to(victim)
    await storage.awrite_payload(destination, {"w": torch.ones(3)})
    assert victim.read_bytes() == b"keep" and not destination.is_symlink()


class CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that counts the calls it runs and the most it ran at once."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers)
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        def counted() -> Any:
            with self._lock:
                self.calls += 1
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            try:
                time.sleep(0.001)  # widen the window in which calls could overlap
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1

        return super().submit(counted)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_concurrent_reads_share_a_bounded_executor(tmp_path: Path) -> None:
    """Eight concurrent reads run every file call in the executor given, two at a time at most.

    Mutation caught: ``aread_payload`` ignoring its ``executor`` (running on the loop's
    default one) failed this test: the counting executor ran no call.
    """
    payloads = {
        i: storage.write_payload(
            tmp_path / f"p{i}.safetensors", {"w": torch.full((5000,), float(i))}
        )
        for i in range(8)
    }
    with CountingExecutor(max_workers=2) as executor:
        results = await asyncio.gather(
            *(
                storage.aread_payload(layout, executor=executor, chunk_bytes=4096)
                for layout in payloads.values()
            )
        )
    for i, loaded in enumerate(results):
        assert torch.equal(loaded["w"], torch.full((5000,), float(i)))
    # Per file: an open, five chunks of 4096 bytes (20000 bytes of data), a close.
    assert executor.calls >= 8 * 7
    assert executor.most_at_once == 2


def test_async_round_trip_under_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    tensors = {"w": torch.randn(64, 64), "i": torch.arange(3, dtype=torch.int8)}

    async def main() -> dict[str, torch.Tensor]:
        layout = await storage.awrite_payload(tmp_path / "u.safetensors", tensors, chunk_bytes=1000)
        return await storage.aread_payload(layout, chunk_bytes=1000)

    loaded = uvloop.run(main())
    assert torch.equal(loaded["w"], tensors["w"]) and torch.equal(loaded["i"], tensors["i"])


# ---------------------------------------------------------------------------------------------
# Cancellation: when the await ends, no worker thread touches the buffers any more
# ---------------------------------------------------------------------------------------------
CHUNK = 64 * 1024
N_CHUNKS = 16


@pytest.fixture
def big_layout(tmp_path: Path) -> storage.PayloadLayout:
    return storage.write_payload(
        tmp_path / "big.safetensors", {"w": torch.ones(N_CHUNKS * CHUNK // 4)}
    )


async def _cancel_with(how: str, coroutine: Any, delay: float) -> None:
    if how == "anyio-scope":
        with anyio.move_on_after(delay) as scope:
            await coroutine
        assert scope.cancelled_caught
    elif how == "wait_for":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(coroutine, delay)
    else:
        task = asyncio.ensure_future(coroutine)
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["anyio-scope", "wait_for", "task-cancel"])
async def test_cancelled_read_returns_between_chunks_with_no_worker_writing(
    big_layout: storage.PayloadLayout, how: str
) -> None:
    out = {"w": torch.zeros(N_CHUNKS * CHUNK // 4)}
    with SlowExecutor(delay=0.05) as executor:
        await _cancel_with(
            how,
            storage.aread_payload(big_layout, out=out, chunk_bytes=CHUNK, executor=executor),
            delay=0.18,
        )
        assert executor.in_flight == 0
        snapshot = out["w"].clone()
        await asyncio.sleep(0.2)
        assert torch.equal(out["w"], snapshot)  # nothing writes into the buffer any more
        filled = int(snapshot.count_nonzero()) * 4
        assert 0 < filled < N_CHUNKS * CHUNK  # stopped part way, after whole chunks
        assert filled % CHUNK == 0
        assert executor.calls < N_CHUNKS


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["anyio-scope", "wait_for", "task-cancel"])
async def test_cancelled_write_leaves_the_old_payload_and_no_temporary_file(
    big_layout: storage.PayloadLayout, how: str
) -> None:
    with SlowExecutor(delay=0.05) as executor:
        await _cancel_with(
            how,
            storage.awrite_payload(
                big_layout.path,
                {"w": torch.full((N_CHUNKS * CHUNK // 4,), 2.0)},
                chunk_bytes=CHUNK,
                executor=executor,
            ),
            delay=0.18,
        )
        assert executor.in_flight == 0
    assert [p.name for p in big_layout.path.parent.iterdir()] == [big_layout.path.name]
    loaded = storage.read_payload(storage.read_layout(big_layout.path))
    assert torch.equal(loaded["w"], torch.ones(N_CHUNKS * CHUNK // 4))


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_reader_survives_a_cancellation_of_another_reader(
    big_layout: storage.PayloadLayout,
) -> None:
    with SlowExecutor(delay=0.01, max_workers=2) as executor:
        survivor = asyncio.ensure_future(
            storage.aread_payload(big_layout, chunk_bytes=CHUNK, executor=executor)
        )
        victim = asyncio.ensure_future(
            storage.aread_payload(big_layout, chunk_bytes=CHUNK, executor=executor)
        )
        await asyncio.sleep(0.03)
        victim.cancel()
        loaded = await survivor
        with pytest.raises(asyncio.CancelledError):
            await victim
    assert torch.equal(loaded["w"], torch.ones(N_CHUNKS * CHUNK // 4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_file_written_in_place_during_a_read_is_refused(tmp_path: Path, face: str) -> None:
    """Another program rewrites the payload in place while it is read (not replacing it, as
    writers of payloads do): the read raises instead of returning half old, half new."""
    layout = storage.write_payload(tmp_path / "p.safetensors", {"a": torch.zeros(1 << 16)})
    start = layout.entries["a"].start

    def rewrite_in_place() -> None:
        fd = os.open(layout.path, os.O_WRONLY)
        try:
            os.pwrite(fd, torch.ones(16).numpy().tobytes(), start)
        finally:
            os.close(fd)
        stat = os.stat(layout.path)
        os.utime(layout.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))

    executor = concurrent.futures.ThreadPoolExecutor(1)
    outcome: list[BaseException | dict[str, torch.Tensor]] = []

    def read() -> None:
        try:
            if face == "sync":
                outcome.append(storage.read_payload(layout))
            else:
                outcome.append(asyncio.run(storage.aread_payload(layout, executor=executor)))
        except BaseException as error:
            outcome.append(error)

    code = storage_io.check_unchanged_after_read.__code__
    with paused_in_new_threads(code, on="call") as check:
        check.armed.set()
        thread = threading.Thread(target=read)
        thread.start()
        assert check.paused.wait(10)  # the data is read, the check is about to run
        rewrite_in_place()
        check.go()
        thread.join(10)
    executor.shutdown()
    assert len(outcome) == 1 and isinstance(outcome[0], T2NErrorStorage), outcome
    assert "modified in place while it was read" in str(outcome[0])
