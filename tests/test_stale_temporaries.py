"""Temporaries of killed writers are cleaned; those of live writers and of others are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120)]

# A writer that stops in the middle of a payload write until it is killed (or told to end).
_WRITER = """
import sys
from pathlib import Path
from torch_to_nnef.tensor.storage._io import AtomicFile
atomic = AtomicFile(Path(sys.argv[1]) / "t.abc.safetensors")
atomic.create()
atomic.write(memoryview(b"x" * 4096))
print("ready", flush=True)
sys.stdin.read()
atomic.discard()
"""

# A process whose tensors live in a private temporary directory (no offload_dir).
_PRIVATE = """
import sys
import torch
from torch_to_nnef.tensor.offload import OffloadedTensor
t = OffloadedTensor.from_original_tensor(torch.zeros(4), "t")
print(t.offload_path.parent, flush=True)
sys.stdin.read()
"""


def _start(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    process.first_line = process.stdout.readline().strip()  # type: ignore[attr-defined]
    return process


def _kill(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    process.wait(30)


def _temporaries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".tmp")}


def test_the_next_write_removes_a_killed_writers_temporary_only(tmp_path: Path) -> None:
    import torch

    from torch_to_nnef.tensor.storage import write_payload

    killed = _start(_WRITER, str(tmp_path))
    (left,) = _temporaries(tmp_path)
    _kill(killed)
    live = _start(_WRITER, str(tmp_path))
    (kept,) = _temporaries(tmp_path) - {left}
    foreign = tmp_path / ".notes.txt.tmp"  # not named as ours
    foreign.write_text("someone else's")
    try:
        write_payload(tmp_path / "other.safetensors", {"w": torch.ones(3)})
        assert _temporaries(tmp_path) == {kept, foreign.name}, "a killed writer's file stayed"
    finally:
        _end(live)
    assert _temporaries(tmp_path) == {foreign.name}


def test_a_killed_processs_private_directory_is_removed(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    killed = _start(_PRIVATE, env=env)
    killed_dir = Path(killed.first_line)  # type: ignore[attr-defined]
    assert killed_dir.parent == tmp_path and killed_dir.is_dir()
    _kill(killed)
    live = _start(_PRIVATE, env=env)
    other = tmp_path / "t2n_offload_unrelated"  # not named as ours: kept
    other.mkdir()
    try:
        fresh = _start(_PRIVATE, env=env)  # its first tensor cleans the temporary directory
        _end(fresh)
        assert not killed_dir.exists(), "a killed process's private directory stayed"
        assert Path(live.first_line).is_dir()  # type: ignore[attr-defined]
        assert other.is_dir()
    finally:
        _end(live)
