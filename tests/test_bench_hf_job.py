"""Pieces of the generation benchmark (``benchmarks/_hf_job.py``, ``bench_hf.py``) whose
mistakes would make its figures wrong without failing it: the page-cache state warm runs
start from, and the bound on the pool's memory."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


# The tests of this module share a module fixture: with workers (pytest-xdist), they run
# on one, which builds it once.
pytestmark = pytest.mark.xdist_group("test_bench_hf_job")


@pytest.fixture(scope="module")
def modules() -> Iterator[tuple[object, object]]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _hf_job
        import bench_hf

        yield _hf_job, bench_hf
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def tiny_checkpoint(tmp_path: Path, modules: tuple[object, object]) -> Path:
    """The checkpoint of the job's tiny Llama-style model, built in this test's directory."""
    job = modules[0]
    path: Path = job.checkpoint(job.TINY, tmp_path / "cache", log=lambda *_: None)  # type: ignore[attr-defined]
    return path


def cached(path: Path) -> bool:
    """Whether every page of ``path`` is in the page cache (a read that may not wait)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(path.stat().st_size)
        try:
            return os.preadv(fd, [buffer], 0, os.RWF_NOWAIT) == len(buffer)
        except BlockingIOError:
            return False
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv's RWF_NOWAIT")
def test_warm_runs_start_with_the_checkpoint_read_once(
    tmp_path: Path, modules: tuple[object, object]
) -> None:
    job = modules[0]
    files = [tmp_path / "a.safetensors", tmp_path / "sub" / "b.safetensors"]
    files[1].parent.mkdir()
    for index, file in enumerate(files):
        file.write_bytes(os.urandom((4 << 20) + index * 4096))
        os.sync()
    job.drop_page_cache(tmp_path)  # type: ignore[attr-defined]
    try:
        if cached(files[0]):
            pytest.skip("this file system keeps the pages (or ignores RWF_NOWAIT)")
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            pytest.skip("this file system has no RWF_NOWAIT reads")
        raise
    job.reset_page_cache(tmp_path)  # type: ignore[attr-defined]
    assert all(cached(file) for file in files)


@pytest.mark.timeout(30)
def test_the_memory_bound_counts_the_modules_leased_at_once(
    modules: tuple[object, object],
) -> None:
    job, bench = modules
    spec = job.ModelSpec(hidden=64, intermediate=160, layers=4, heads=4, vocab=512)  # type: ignore[attr-defined]
    layer = 4 * (4 * 64 * 64 + 3 * 64 * 160)
    table = 4 * 512 * 64
    leased = bench.leased_at_once  # type: ignore[attr-defined]
    assert leased(spec, 1) == 2 * layer  # the module that computes and the next
    assert leased(spec, 2) == 3 * layer  # and the two next
    assert leased(spec, 0) == layer
    big_head = job.ModelSpec(hidden=64, intermediate=160, layers=4, heads=4, vocab=8192)  # type: ignore[attr-defined]
    head = 4 * 8192 * 64
    # Cyclic: lm_head computes while the next forward's embedding and first layer are read.
    assert leased(big_head, 2) == 2 * head + layer
    assert head > 2 * layer and table < layer
    assert leased(big_head, 2) > bench.leased_at_once(big_head, 1)  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
def test_the_pool_of_the_job_pins_the_small_tensors(
    tmp_path: Path, modules: tuple[object, object], tiny_checkpoint: Path
) -> None:
    import torch

    from torch_to_nnef.tensor import OffloadedTensor

    job, path = modules[0], tiny_checkpoint
    model = job.load("pool", path, 1 << 20, tmp_path / "offload")  # type: ignore[attr-defined]
    dense = job.load("dense", path, 0, tmp_path / "unused")  # type: ignore[attr-defined]
    ids = torch.arange(1, 9).unsqueeze(0)
    tensors = [t for t in model.parameters() if isinstance(t, OffloadedTensor)]
    small = [t for t in tensors if t.payload_nbytes < job.PINNED_BELOW]  # type: ignore[attr-defined]
    large = [t for t in tensors if t.payload_nbytes >= job.PINNED_BELOW]  # type: ignore[attr-defined]
    assert small and large  # norms and layers; the embedding and the head
    with job._pool_for(model, 1 << 20, 2) as pool:  # type: ignore[attr-defined]
        assert all(pool.is_pinned(t) for t in small)
        assert not any(pool.is_pinned(t) for t in large)
        tokens = job.generate(model, ids, 3)  # type: ignore[attr-defined]
    assert torch.equal(tokens, job.generate(dense, ids, 3))  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
def test_the_mode_runner_runs_each_mode_in_a_child_and_reports_its_failures(
    tmp_path: Path, modules: tuple[object, object], tiny_checkpoint: Path
) -> None:
    job, path = modules[0], tiny_checkpoint
    dense = job.load("dense", path, 0, tmp_path / "unused")  # type: ignore[attr-defined]
    ids = job.prompt(dense.config.vocab_size)  # type: ignore[attr-defined]
    expected = job.generate(dense, ids, 4).tolist()  # type: ignore[attr-defined]
    with job.ModeRunner() as runner:  # type: ignore[attr-defined]
        pool = runner.run("pool", path, budget=1 << 20, tokens=4, progress=False)
        assert pool["mode"] == "pool" and pool["tokens"] == expected
        assert pool["bytes_read_per_token"] > 0  # the pool of the child read the weights
        with pytest.raises(RuntimeError, match=r"^pool failed \(exit 1\)"):
            runner.run("pool", tmp_path / "missing", budget=1 << 20, tokens=1, progress=False)
        with pytest.raises(RuntimeError, match=r"^dense failed \(ran past its 0.01 s\)"):
            runner.run("dense", path, budget=0, tokens=1, progress=False, timeout=0.01)
        again = runner.run("accelerate", path, budget=1 << 20, tokens=4, progress=False)
        assert again["tokens"] == expected  # the runner serves on after its children failed
