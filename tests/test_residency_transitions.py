"""The end of a disk job, applied by the actor: whatever the value a load brings or the
failure of a write-back, every waiter is answered and the pool's state stays whole.

Values come from users' classes (``SupportsOffloadState``): one holding a sparse tensor,
one built under ``torch.inference_mode()``, one whose ``__torch_function__`` refuses the ops
it does not list. A failed write-back's warning meets an application's logging filter that
raises on it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import torch
from residency_checks import check_invariants, on_disk, reports_that_raise
from test_residency import faces, open_pool

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.opaque import OFFLOAD_STATE_KEY, OpaqueTensor, SupportsOffloadState
from torch_to_nnef.tensor.residency import TensorResidencyPool
from torch_to_nnef.tensor.residency._state import Job

pytestmark = [pytest.mark.timeout(60)]


class SparseWeight(OpaqueTensor, SupportsOffloadState):
    """A mostly zero matrix kept as a sparse COO tensor, expanded on use."""

    OFFLOAD_STATE_TAG = "tests.test_residency_transitions.SparseWeight"
    sparse: torch.Tensor

    @staticmethod
    def __new__(cls, sparse: torch.Tensor) -> SparseWeight:
        shell: SparseWeight = OpaqueTensor._make_shell(cls, sparse.shape, sparse.dtype, "cpu")
        shell.sparse = sparse
        return shell

    def __init__(self, sparse: torch.Tensor) -> None:
        super().__init__()

    def _to_base_tensor(self) -> torch.Tensor:
        return self.sparse.to_dense()

    def to_offload_state(self) -> dict[str, Any]:
        sparse = self.sparse.coalesce()
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "indices": sparse.indices(),
            "values": sparse.values(),
            "size": sparse.shape,
        }

    @classmethod
    def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> SparseWeight:
        sparse = torch.sparse_coo_tensor(
            state["indices"], state["values"], state["size"], check_invariants=True
        )
        return cls(sparse.coalesce())


class Scaled(OpaqueTensor, SupportsOffloadState):
    """int8 codes times a scale, decoded under ``torch.inference_mode()``: its values are
    inference tensors."""

    OFFLOAD_STATE_TAG = "tests.test_residency_transitions.Scaled"
    codes: torch.Tensor
    scale: float

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: float) -> Scaled:
        shell: Scaled = OpaqueTensor._make_shell(cls, codes.shape, torch.float32, "cpu")
        shell.codes, shell.scale = codes, scale
        return shell

    def __init__(self, codes: torch.Tensor, scale: float) -> None:
        super().__init__()

    def _to_base_tensor(self) -> torch.Tensor:
        return self.codes.float() * self.scale

    def to_offload_state(self) -> dict[str, Any]:
        return {OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG, "codes": self.codes, "scale": self.scale}

    @classmethod
    @torch.inference_mode()
    def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> Scaled:
        return cls(state["codes"].clone(), state["scale"])


class Strict(torch.Tensor, SupportsOffloadState):
    """A tensor subclass that serves the ops it lists and refuses any other."""

    OFFLOAD_STATE_TAG = "tests.test_residency_transitions.Strict"
    refused: ClassVar[set[Callable[..., Any]]] = {torch.Tensor.numel}

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in cls.refused:
            raise NotImplementedError(f"Strict does not support {func.__name__}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def to_offload_state(self) -> dict[str, Any]:
        return {OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG, "data": self.as_subclass(torch.Tensor)}

    @classmethod
    def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> Strict:
        return state["data"].as_subclass(cls)  # type: ignore[no-any-return]


def _offloaded(value: torch.Tensor, directory: Path, name: str = "w") -> OffloadedTensor:
    return OffloadedTensor.from_original_tensor(value, name, offload_dir=directory)


def _assert_nothing_left(pool: TensorResidencyPool) -> None:
    actor = pool._actor
    check_invariants(pool)
    assert actor.entries == {} and actor.published == {}
    assert actor.jobs == set() and actor.loading_bytes == actor.resident_bytes == 0


# ---------------------------------------------------------------------------------------------
# Loads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        torch.Tensor.to_sparse,
        torch.Tensor.to_sparse_csr,
        lambda dense: dense.to_sparse_bsc((2, 2)),
        torch.Tensor.to_mkldnn,
    ],
    ids=["coo", "csr", "bsc", "mkldnn"],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_value_nbytes_counts_tensors_without_storage(make: Callable[..., torch.Tensor]) -> None:
    dense = torch.zeros(8, 8)
    dense[1, 2], dense[5, 6] = 3.0, 4.0
    held = make(dense)
    value = SparseWeight(held)  # (an opaque value: its attributes are counted)
    if held.layout == torch.sparse_coo:
        parts = [held._indices(), held._values()]
    elif held.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [held.crow_indices(), held.col_indices(), held.values()]
    elif held.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [held.ccol_indices(), held.row_indices(), held.values()]
    else:
        parts = []
    expected = sum(part.untyped_storage().nbytes() for part in parts) or 8 * 8 * 4
    assert storage.value_nbytes(value) == expected


@faces
@pytest.mark.asyncio
async def test_an_opaque_value_holding_a_sparse_tensor_is_served(
    tmp_path: Path, face_name: str
) -> None:
    dense = torch.zeros(64, 64)
    dense[3, 4], dense[40, 50] = 1.0, 2.0
    t = _offloaded(SparseWeight(dense.to_sparse()), tmp_path)
    async with open_pool(face_name) as face:
        value = await face.resolve(t)
        assert isinstance(value, SparseWeight) and torch.equal(value.to_base_tensor(), dense)
        assert face.pool.resident_bytes == storage.value_nbytes(value) == 2 * (2 * 8 + 4)
        async with face.acquire(t) as leased:
            assert leased is value


async def _every_waiter_fails(face: Any, t: OffloadedTensor, match: str) -> list[T2NErrorStorage]:
    """Four requests for ``t`` at once, two ``resolve`` and two leases: each fails with a
    ``T2NErrorStorage`` matching ``match`` that names the tensor; their errors."""
    errors: list[T2NErrorStorage] = []

    async def waiter(lease: bool) -> None:
        with pytest.raises(T2NErrorStorage, match=match) as info:
            if lease:
                async with face.acquire(t):
                    pass
            else:
                await face.resolve(t)
        errors.append(info.value)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(waiter, i % 2 == 1)
    assert len(errors) == 4 and "'w'" in str(errors[0])
    return errors


@faces
@pytest.mark.asyncio
async def test_a_value_decoded_as_an_inference_tensor_is_refused_as_a_failed_load(
    tmp_path: Path, face_name: str
) -> None:
    t = _offloaded(Scaled(torch.ones(4, 4, dtype=torch.int8), 0.5), tmp_path)
    decoded = t.reload()  # outside a pool, as its class decodes it: an inference tensor
    with pytest.raises(RuntimeError, match="version counter"):
        _ = decoded._version
    async with open_pool(face_name) as face:
        await _every_waiter_fails(face, t, "inference tensor")
        assert face.pool.stats().load_errors >= 1
        _assert_nothing_left(face.pool)


@faces
@pytest.mark.asyncio
async def test_a_load_whose_end_cannot_be_applied_answers_every_waiter(
    tmp_path: Path, face_name: str
) -> None:
    """The value's own class refuses what the pool asks of it as the load ends: every waiter
    gets the error, chaining the class's, and the pool is as if the load had failed."""
    t = _offloaded(torch.ones(4, 4).as_subclass(Strict), tmp_path)
    other = _offloaded(torch.zeros(4), tmp_path, "other")
    async with open_pool(face_name) as face:
        errors = await _every_waiter_fails(face, t, "could not apply its end")
        cause = errors[0].__cause__
        assert isinstance(cause, NotImplementedError) and "numel" in str(cause)
        _assert_nothing_left(face.pool)
        stats = face.pool.stats()  # counted as failed loads only
        assert stats.load_errors >= 1
        assert stats.loads == stats.bytes_read == stats.evictions == 0
        assert torch.equal(await face.resolve(other), torch.zeros(4))  # the pool goes on
        Strict.refused = set()
        try:  # the next request loads again
            assert torch.equal(await face.resolve(t), torch.ones(4, 4))
        finally:
            Strict.refused = {torch.Tensor.numel}


@pytest.mark.asyncio
async def test_a_load_waited_for_on_the_loop_thread_whose_end_cannot_be_applied(
    tmp_path: Path,
) -> None:
    """A sync ``resolve`` on the pool's own loop applies the load's end inline: it raises the
    same error, and the pool closes."""
    t = _offloaded(torch.ones(4, 4).as_subclass(Strict), tmp_path)
    pool = TensorResidencyPool()
    async with pool:
        with pytest.raises(T2NErrorStorage, match="could not apply its end"):
            pool.resolve(t)
        _assert_nothing_left(pool)
    assert pool.closed


# ---------------------------------------------------------------------------------------------
# Write-backs
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def structured_logs() -> Iterator[None]:
    with reports_that_raise():
        yield


@pytest.mark.usefixtures("structured_logs")
def test_a_failed_write_back_whose_end_cannot_be_applied_stays_dirty(tmp_path: Path) -> None:
    """The warning of a failed write-back raises in the application's logging filter: the
    flush still raises the write-back's error, and the changed value stays resident and
    dirty for the next flush, which writes it."""
    failing = tmp_path / "failing"
    t = _offloaded(torch.zeros(16), failing)
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            value.add_(1)
        os.rename(failing, tmp_path / "moved")  # the write-back fails with ENOENT
        for call in (pool.flush, pool.close):
            with pytest.raises(T2NErrorStorage, match="1 write-back") as info:
                call()
            assert isinstance(info.value.__cause__, T2NErrorStorage)
        assert pool.is_resident(t) and not pool.closed
        assert pool._actor.entries[id(t)].dirty and pool._actor.jobs == set()
        assert torch.equal(pool.resolve(t), torch.ones(16))
        check_invariants(pool)
        os.rename(tmp_path / "moved", failing)
        pool.flush()
        check_invariants(pool)
    assert pool.closed
    assert torch.equal(on_disk(t), torch.ones(16))


def test_a_job_resumes_every_waiter_when_one_of_them_raises() -> None:
    """Each callback of a job resumes a waiter: one that raises (a Ctrl-C raised as a
    resumed request returned) does not keep the others waiting; its error comes after."""
    job = Job("load", lambda: None, (), lambda _job: None)
    resumed: list[int] = []

    def waiter(number: int, error: BaseException | None = None) -> Callable[[], None]:
        def resume() -> None:
            resumed.append(number)
            if error is not None:
                raise error

        return resume

    job.add_callback(waiter(0, KeyboardInterrupt()))
    job.add_callback(waiter(1))
    job.add_callback(waiter(2, RuntimeError("second")))
    job.add_callback(waiter(3))
    with pytest.raises(KeyboardInterrupt):
        job.finish(None, None)
    assert resumed == [0, 1, 2, 3]
    assert job.done
    job.add_callback(waiter(4))  # an ended job runs a new callback at once
    assert resumed == [0, 1, 2, 3, 4]


@faces
@pytest.mark.asyncio
async def test_a_failed_write_back_superseded_by_another_pools_change_loses_nothing(
    tmp_path: Path, face_name: str
) -> None:
    """A pool's write-back fails (its directory is gone) while another pool, used from a
    thread, reads the change and changes the value in turn, then fails to write it too. Every
    read (both pools, ``reload``) sees the latest change; the first pool's flush writes
    nothing (its change is superseded) and its failed value does not keep it from serving
    the later one; once the directory is back, the other pool's close writes the latest
    change, and nothing else reaches the file."""
    failing, moved = tmp_path / "failing", tmp_path / "moved"
    t = _offloaded(torch.zeros(16), failing)
    other = TensorResidencyPool()
    try:
        async with open_pool(face_name) as face:
            async with face.acquire(t, mode="read_write") as value:
                value.fill_(1.0)
            os.rename(failing, moved)  # write-backs fail with ENOENT
            with pytest.raises(T2NErrorStorage, match="write-back"):
                await face.flush()
            assert face.pool.is_resident(t)

            def change() -> float:
                with other.acquire(t, mode="read_write") as changed:
                    seen = float(changed[0])
                    changed.add_(1.0)
                with pytest.raises(T2NErrorStorage, match="write-back"):
                    other.flush()
                return seen

            assert await anyio.to_thread.run_sync(change) == 1.0  # the first pool's change
            latest = torch.full((16,), 2.0)
            assert torch.equal(await face.resolve(t), latest)
            assert torch.equal(await anyio.to_thread.run_sync(other.resolve, t), latest)
            assert torch.equal(t.reload(), latest)
            await face.flush()  # superseded: nothing to write, nothing fails
            check_invariants(face.pool)
            check_invariants(other)
            os.rename(moved, failing)
            await anyio.to_thread.run_sync(other.close)
        assert torch.equal(on_disk(t), latest)
        assert torch.equal(t.reload(), latest)
        assert sorted(os.listdir(failing)) == [t.offload_path.name]
    finally:
        if moved.exists():
            os.rename(moved, failing)
        other.close()
