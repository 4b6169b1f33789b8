"""Every script of ``examples/`` runs (small sizes) and reports what it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Lines (regular expressions) each example prints once its own checks have passed.
EXPECTED = {
    "hf_generate.py": [
        r"^saved a [\d.]+ MB model in \d+ safetensors shards$",
        r"^bound the skeleton to the shards in place: nothing copied$",
        r"^generated 6 tokens with a [\d.]+ MB budget: [\d.]+ s/token",
        r"^served 3 concurrent requests from async code through one pool$",
        r"^every output equals the dense model's: OK$",
    ],
    "async_serving.py": [
        r"^served 8 concurrent requests twice \(leases, then pool\.scope\)",
        r"^pool: \d+ loads for 192 tensor accesses",
        r"^every output equals the dense model's: OK$",
    ],
    "stream_layers.py": [
        r"^48 offloaded tensors, [\d.]+ MB, streamed through a [\d.]+ MB pool",
        # A cyclic stream bigger than the budget defeats LRU; the others keep about a third.
        # With read-ahead, whether a block read ahead stays until it is used depends on the
        # timing of the run, so SCHEDULED is seen anywhere from 30 to 45 %.
        r"^\s+LRU: .* [0-4]\.\d% of accesses served from memory",
        r"^\s+FIXED: .* 3\d\.\d% of accesses served from memory",
        r"^SCHEDULED: .* (3\d|4[0-5])\.\d% of accesses served from memory",
        r"^every forward equals the dense model's: OK$",
    ],
    "quantize_and_offload.py": [
        r"^4 weights quantized to Q4_0 and offloaded: .* \(7\.\dx\)$",
        r"^outputs from disk equal the in-memory quantized model",
        r"^wrote 4 tract files: 0\.0\.weight\.dat",
        r"^tract ran '0\.0\.weight' from its \.dat file and agrees with torch$",
        r"^OK$",
    ],
    "checkpoint_in_place.py": [
        r"^saved a sharded checkpoint: model-00001-of-00002\.safetensors, "
        r"model-00002-of-00002\.safetensors, model\.safetensors\.index\.json$",
        r"^bound 18 tensors of a meta-device model to the shards in place",
        r"^outputs equal the original model's, run directly and streamed through a pool",
        r"nothing was copied: OK$",
    ],
}


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_checks_itself(name: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick"],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=tmp_path,  # examples must not depend on the working directory
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    for pattern in EXPECTED[name]:
        assert re.search(pattern, done.stdout, re.MULTILINE), (
            f"{name}: no line matches {pattern!r} in:\n{done.stdout}"
        )
    assert list(tmp_path.iterdir()) == [], f"{name} left files in its working directory"
