"""The demo (`benchmarks/demo.py`, `make demo`) on a tiny model; the `t2n-residency` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from torch_to_nnef.cli import main

ROOT = Path(__file__).resolve().parents[1]
MAIN_HEADERS = [
    "mode",
    "s/token",
    "vs accelerate",
    "MB read/token",
    "peak RSS growth MiB (with loading)",
    "in generate MiB",
    "in generate / budget",
]


def table(output: str, first_header: str) -> list[list[str]]:
    """The rows of the table whose header starts with ``first_header``, split on 2+ spaces."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    rows = [lines[start].split("  ")]
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append([cell.strip() for cell in line.split("  ") if cell.strip()])
    rows[0] = [cell.strip() for cell in rows[0] if cell.strip()]
    return rows


@pytest.mark.timeout(400)
def test_the_demo_generates_the_dense_tokens_every_way(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "demo.py"),
            "--tiny",
            "--cache",
            str(tmp_path),
            "--tokens",
            "5",
            "--requests",
            "2",
            "--request-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    header, *rows = table(done.stdout, "mode ")
    assert header == MAIN_HEADERS
    assert [row[0] for row in rows] == ["dense", "accelerate", "pool"]
    assert rows[1][2] == "1.00x"  # accelerate against itself
    for row in rows:
        assert float(row[1]) > 0 and float(row[4]) >= 0 and float(row[5]) >= 0
    assert "tokens: every way produced the dense model's tokens" in done.stdout
    header, *rows = table(done.stdout, "requests ")
    assert header == ["requests", "requests/s", "MB read"]
    assert [row[0] for row in rows] == ["one at a time", "2 at once"]
    assert "The pool generated at " in done.stdout
    assert "2 concurrent requests ran at " in done.stdout
    assert "100%" in done.stderr or "token" in done.stderr  # the progress bars
    assert len(list(tmp_path.iterdir())) == 1  # the model, built once into the cache


def test_inspect_describes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = {"big": torch.zeros(64, 64), "small": torch.zeros(3, dtype=torch.float16)}
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors: safetensors" in out
    assert "torch.float32: 1 tensor(s), 16.38 kB" in out
    assert "torch.float16: 1 tensor(s), 6 B" in out
    assert "total: 2 tensor(s), 16.39 kB" in out
    assert "largest tensor: 'big', 16.38 kB" in out

    torch.save(tensors, tmp_path / "weights.bin")
    assert main(["inspect", str(tmp_path / "weights.bin")]) == 0
    assert "weights.bin: pickle" in capsys.readouterr().out


def test_usage_errors_help_and_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("t2n-residency: error: ") and "does not exist" in err
    assert main(["inspect", "--help"]) == 0
    assert "without reading its tensors" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("t2n-residency ")
