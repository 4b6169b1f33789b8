"""The tract Q4_0 ``.dat`` writer, checked byte by byte and by tract itself."""

from __future__ import annotations

import math
import struct
import threading
from pathlib import Path

import pytest
import torch

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.quant import (
    Q40Layout,
    QScalePerGroupF16,
    QTensorTractScaleOnly,
    fp_to_tract_q4_0_with_min_max_calibration,
)

tract = pytest.importorskip("tract")

SHAPES = [(64, 32), (8, 4, 32), (4, 2, 4, 8), (16, 3, 1, 32), (24, 96)]


def q4_0_from_codes(codes: torch.Tensor, scales: list[float]) -> QTensorTractScaleOnly:
    """A Q4_0 tensor with exactly these codes and scales."""
    qscheme = QScalePerGroupF16(32, torch.tensor(scales), 4)
    return QTensorTractScaleOnly._from_parts(
        u8_blob=codes.to(torch.uint8),
        qscheme=qscheme,
        shape=codes.shape,
        dequant_to_dtype=torch.float32,
        u8_compressors=[],
    )


def write_matmul_graph(model_dir: Path, label: str, shape: tuple[int, ...], batch: int) -> None:
    """graph.nnef computing ``input @ reshape(variable, [rows, trailing]).T``."""
    rows, trailing = shape[0], math.prod(shape[1:])
    (model_dir / "graph.nnef").write_text(
        "version 1.0;\n"
        "graph q40_matmul(input) -> (output) {\n"
        f"  input = external<scalar>(shape = [{batch}, {trailing}]);\n"
        f"  w = variable<scalar>(label = '{label}', shape = {list(shape)});\n"
        f"  w2d = reshape(w, shape = [{rows}, {trailing}]);\n"
        "  output = matmul(input, w2d, transposeA = false, transposeB = true);\n"
        "}\n"
    )


def run_tract(model_dir: Path, x: torch.Tensor) -> torch.Tensor:
    runnable = tract.nnef().load(model_dir).into_runnable()
    (output,) = runnable.run([x.numpy()])
    return torch.from_numpy(output.to_numpy())


# -- tract reads what we write ------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", [Q40Layout.CURRENT, Q40Layout.LEGACY])
def test_tract_matmul_equals_torch_with_decompressed_weight(
    tmp_path: Path, shape: tuple[int, ...], layout: Q40Layout
) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=gen)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.specific_machine = "x86_64"  # tract's float32 arithmetic on this test machine
    path = q.write_in_file(tmp_path, "layer.weight", layout=layout)
    assert path == tmp_path / "layer.weight.dat"
    write_matmul_graph(tmp_path, "layer.weight", shape, batch=3)

    x = torch.randn(3, math.prod(shape[1:]), generator=gen)
    expected = x @ q.decompress().reshape(shape[0], -1).T
    got = run_tract(tmp_path, x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(60)
def test_tract_reads_every_code_of_every_block(tmp_path: Path) -> None:
    """One-hot inputs read the dequantized weight back column by column through tract."""
    codes = torch.arange(4 * 64).reshape(4, 64) % 16
    codes = codes[:, torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    q = q4_0_from_codes(codes, [-0.5, 0.25, -1.0, 2.0, 0.125, -0.75, 1.5, -3.0])
    q.write_in_file(tmp_path, "w")
    write_matmul_graph(tmp_path, "w", (4, 64), batch=64)
    got = run_tract(tmp_path, torch.eye(64))  # row j: column j of the weight
    assert torch.equal(got.T, q.decompress())


@pytest.mark.timeout(60)
def test_labels_with_folders_are_read_by_tract(tmp_path: Path) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(8, 32))
    path = q.write_in_file(tmp_path, "encoder/layer0/weight")
    assert path == tmp_path / "encoder" / "layer0" / "weight.dat"
    write_matmul_graph(tmp_path, "encoder/layer0/weight", (8, 32), batch=2)
    x = torch.randn(2, 32)
    torch.testing.assert_close(run_tract(tmp_path, x), x @ q.decompress().T)


# -- bytes on disk --------------------------------------------------------------------------------
def codes_and_scales() -> tuple[torch.Tensor, list[float]]:
    codes = torch.tensor([[j % 16 for j in range(32)], [15 - (j * 7) % 16 for j in range(32)]])
    return codes, [-0.5, 1.25]


def expected_block(codes_row: list[int], scale: float, layout: Q40Layout) -> bytes:
    """One block written out by hand: f16 scale, then 16 bytes of nibble pairs."""
    pairs = []
    for j in range(16):
        if layout is Q40Layout.CURRENT:
            low, high = codes_row[j], codes_row[j + 16]
        else:
            low, high = codes_row[2 * j], codes_row[2 * j + 1]
        pairs.append(low | (high << 4))
    return struct.pack("<e", scale) + bytes(pairs)


@pytest.mark.parametrize("layout", [Q40Layout.CURRENT, Q40Layout.LEGACY])
def test_file_bytes_match_hand_computed_layout(tmp_path: Path, layout: Q40Layout) -> None:
    codes, scales = codes_and_scales()
    path = q4_0_from_codes(codes, scales).write_in_file(tmp_path, "w", layout=layout)
    data = path.read_bytes()

    header = data[:128]
    assert header[0:2] == b"\x4e\xef"
    assert (header[2], header[3]) == (1, 0)
    data_length, rank = struct.unpack_from("<II", header, 4)
    assert (data_length, rank) == (2 * 18, 2)
    assert struct.unpack_from("<8I", header, 12) == (2, 32, 0, 0, 0, 0, 0, 0)
    assert struct.unpack_from("<I", header, 44) == (0xFFFFFFFF,)
    item_type = b"\x40\x30" if layout is Q40Layout.CURRENT else b"\x40\x20"
    assert header[48:50] == item_type
    assert header[50:52] == b"R" + b"T"  # u16 'T' << 8 | 'R', little-endian
    assert header[52:] == bytes(76)

    rows = codes.tolist()
    assert data[128:] == b"".join(expected_block(rows[g], scales[g], layout) for g in range(2))


def test_hand_computed_legacy_block_for_known_codes(tmp_path: Path) -> None:
    codes = torch.tensor([list(range(16)) * 2])
    path = q4_0_from_codes(codes, [1.0]).write_in_file(tmp_path, "w", layout=Q40Layout.LEGACY)
    # codes 0,1 | 2,3 | ... | 14,15, twice: low nibble = even code, high nibble = odd code
    assert path.read_bytes()[128:] == bytes.fromhex("003c" + "10 32 54 76 98 ba dc fe" * 2)


def test_hand_computed_current_block_for_known_codes(tmp_path: Path) -> None:
    codes = torch.tensor([list(range(16)) + [15 - j for j in range(16)]])
    path = q4_0_from_codes(codes, [-2.0]).write_in_file(tmp_path, "w")
    # byte j: code j (low nibble) and code j + 16 = 15 - j (high nibble)
    assert path.read_bytes()[128:] == bytes.fromhex(
        "00c0" + "f0 e1 d2 c3 b4 a5 96 87 78 69 5a 4b 3c 2d 1e 0f"
    )


def test_layout_follows_tract_version() -> None:
    assert Q40Layout.for_tract_version("0.21.11") is Q40Layout.CURRENT
    assert Q40Layout.for_tract_version("0.23.9") is Q40Layout.CURRENT
    assert Q40Layout.for_tract_version("1.0") is Q40Layout.CURRENT
    assert Q40Layout.for_tract_version("0.21.10") is Q40Layout.LEGACY
    assert Q40Layout.for_tract_version("v0.20.22") is Q40Layout.LEGACY
    assert Q40Layout.for_tract_version(tract.version()) is Q40Layout.CURRENT
    with pytest.raises(T2NErrorMisuse, match="tract version must look like"):
        Q40Layout.for_tract_version("latest")


def test_layout_must_be_a_q40layout(tmp_path: Path) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(2, 32))
    with pytest.raises(T2NErrorMisuse, match="layout must be a Q40Layout"):
        q.write_in_file(tmp_path, "w", layout="legacy")  # type: ignore[arg-type]


# -- rewrites and atomicity -----------------------------------------------------------------------
def test_rewriting_identical_bytes_is_a_no_op(tmp_path: Path) -> None:
    weight = torch.randn(16, 64)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    path = q.write_in_file(tmp_path, "w")
    before = path.stat()
    again = fp_to_tract_q4_0_with_min_max_calibration(weight.clone())
    assert again.write_in_file(tmp_path, "w") == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.dat"]


def test_rewriting_different_bytes_raises_and_keeps_the_file(tmp_path: Path) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(16, 64))
    path = q.write_in_file(tmp_path, "w")
    original = path.read_bytes()
    other = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(16, 64))
    with pytest.raises(T2NErrorMisuse, match=rf"{path}.*already holds different data"):
        other.write_in_file(tmp_path, "w")
    with pytest.raises(T2NErrorMisuse, match="already holds different data"):
        q.write_in_file(tmp_path, "w", layout=Q40Layout.LEGACY)
    assert path.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.dat"]


def _race(folder: Path, label: str, tensors: list[QTensorTractScaleOnly]) -> list[Exception]:
    """Write every tensor under ``label`` from its own thread, all at once; return the errors."""
    barrier = threading.Barrier(len(tensors))
    errors: list[Exception] = []

    def write(q: QTensorTractScaleOnly) -> None:
        barrier.wait(timeout=10)
        try:
            q.write_in_file(folder, label)
        except T2NErrorMisuse as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(q,)) for q in tensors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
        assert not thread.is_alive()
    return errors


@pytest.mark.timeout(30)
def test_concurrent_identical_writers_all_succeed(tmp_path: Path) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 64))
    assert _race(tmp_path, "w", [q] * 4) == []
    assert (tmp_path / "w.dat").read_bytes() == _dat_bytes(q, tmp_path / "probe")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["w.dat"]


@pytest.mark.timeout(30)
def test_concurrent_different_writers_one_wins(tmp_path: Path) -> None:
    tensors = [fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 64)) for _ in range(4)]
    errors = _race(tmp_path, "w", tensors)
    assert len(errors) == len(tensors) - 1
    written = (tmp_path / "w.dat").read_bytes()
    assert sum(_dat_bytes(q, tmp_path / "probe") == written for q in tensors) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["w.dat"]


def _dat_bytes(q: QTensorTractScaleOnly, folder: Path) -> bytes:
    folder.mkdir(exist_ok=True)
    path = q.write_in_file(folder, f"t{id(q)}")
    return path.read_bytes()


@pytest.mark.parametrize(
    "label", ["", "../escape", "/abs/path", "a//b", "a/./b", "a/", "a\\b", "nul\0byte"]
)
def test_labels_that_leave_the_folder_are_refused(tmp_path: Path, label: str) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(2, 32))
    with pytest.raises(T2NErrorMisuse, match="is not a relative path inside the model folder"):
        q.write_in_file(tmp_path / "model", label)
    assert not (tmp_path / "escape.dat").exists()
