"""Quantize a model's linear weights to tract's Q4_0, offload them, run it, write tract files.

1. every ``nn.Linear`` weight becomes a ``QTensorTractScaleOnly`` (4-bit codes, one float16
   scale per 32 values): about 7x smaller than float32;
2. each quantized weight is offloaded with ``OffloadedTensor.from_original_tensor``: its file
   holds the codes and scales, and it reloads as the quantized tensor;
3. the model runs from disk, directly and through a residency pool, and matches the model
   quantized in memory exactly (and the float model closely);
4. each weight is written as a tract ``.dat`` file (``write_in_file``); when the ``tract``
   package is installed, tract runs one layer from its file and agrees with torch.

Run ``python examples/quantize_and_offload.py`` (``--quick`` for a smaller model).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from torch import nn

from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool
from torch_to_nnef.tensor.quant import (
    QTensorTractScaleOnly,
    fp_to_tract_q4_0_with_min_max_calibration,
)


def build_model(layers: int, width: int) -> nn.Sequential:
    """``Linear + GELU`` layers with seeded random weights (width a multiple of 32)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))
    )


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize(model: nn.Module) -> None:
    """Replace every linear weight by its Q4_0 quantization, in place."""
    for _, linear in linears(model):
        q_weight = fp_to_tract_q4_0_with_min_max_calibration(linear.weight)
        linear.weight = nn.Parameter(q_weight, requires_grad=False)


def offload(model: nn.Module, offload_dir: Path) -> None:
    """Replace every quantized weight by an offloaded tensor reading it from ``offload_dir``."""
    for name, linear in linears(model):
        offloaded = OffloadedTensor.from_original_tensor(
            linear.weight, f"{name}.weight", offload_dir
        )
        linear.weight = nn.Parameter(offloaded, requires_grad=False)


def check_with_tract(model_dir: Path, label: str, q_weight: QTensorTractScaleOnly) -> str:
    """Run ``x @ W.T`` in tract from the ``.dat`` file and compare with torch."""
    try:
        import tract
    except ImportError:
        return "tract is not installed: the .dat files were not checked by tract"
    rows, columns = q_weight.shape
    (model_dir / "graph.nnef").write_text(
        "version 1.0;\n"
        "graph layer(input) -> (output) {\n"
        f"  input = external<scalar>(shape = [2, {columns}]);\n"
        f"  w = variable<scalar>(label = '{label}', shape = [{rows}, {columns}]);\n"
        "  output = matmul(input, w, transposeA = false, transposeB = true);\n"
        "}\n"
    )
    x = torch.randn(2, columns)
    runnable = tract.nnef().load(str(model_dir)).into_runnable()
    (output,) = runnable.run([x.numpy()])
    got = torch.from_numpy(output.to_numpy())
    torch.testing.assert_close(got, x @ q_weight.decompress().T, rtol=1e-4, atol=1e-4)
    return f"tract ran {label!r} from its .dat file and agrees with torch"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="linear layers (default 8)")
    parser.add_argument("--width", type=int, help="model width, a multiple of 32 (default 1024)")
    parser.add_argument("--quick", action="store_true", help="a 4 x 128 model")
    args = parser.parse_args(argv)
    layers = args.layers or (4 if args.quick else 8)
    width = args.width or (128 if args.quick else 1024)

    dense = build_model(layers, width)
    quantized = build_model(layers, width)
    model = build_model(layers, width)
    quantize(quantized)
    quantize(model)
    x = torch.randn(4, width)
    with torch.no_grad():
        expected = quantized(x)
        reference = dense(x)
    float_bytes = sum(m.weight.numel() * 4 for _, m in linears(dense))

    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        work_dir = Path(work)
        offload(model, work_dir / "offload")
        weights = [linear.weight for _, linear in linears(model)]
        assert all(isinstance(w, OffloadedTensor) for w in weights)
        stored = sum(w.payload_nbytes for w in weights)
        print(
            f"{len(weights)} weights quantized to Q4_0 and offloaded: {stored / 1e6:.2f} MB "
            f"on disk for {float_bytes / 1e6:.2f} MB of float32 ({float_bytes / stored:.1f}x)"
        )
        reloaded = weights[0].reload()
        assert isinstance(reloaded, QTensorTractScaleOnly), "it reloads still quantized"

        # Run from disk: each op reloads its weight; then through a pool holding a third.
        direct = model(x)
        pool = TensorResidencyPool(max_cached_bytes=stored // 3)
        with pool, pool.scope():
            pooled = model(x)
            stats = pool.stats()
        assert torch.equal(direct, expected) and torch.equal(pooled, expected)
        error = (direct - reference).abs().max().item() / reference.abs().max().item()
        assert error < 0.1, f"Q4_0 strayed from the float model by {error:.1%}"
        print(
            f"outputs from disk equal the in-memory quantized model; relative error against "
            f"float32: {error:.2%}; the pool read {stats.bytes_read / 1e6:.2f} MB of codes"
        )

        tract_dir = work_dir / "tract_model"
        for (name, _), weight in zip(linears(model), weights, strict=True):
            q_weight = weight.reload()
            assert isinstance(q_weight, QTensorTractScaleOnly)
            path = q_weight.write_in_file(tract_dir, f"{name}.weight")
            blocks = math.prod(q_weight.shape) // 32
            assert path.stat().st_size == 128 + 18 * blocks  # header + 18 bytes per block
        files = sorted(p.name for p in tract_dir.glob("*.dat"))
        print(f"wrote {len(files)} tract files: {', '.join(files[:3])}{', ...' * (len(files) > 3)}")
        first_name = linears(model)[0][0]
        first = weights[0].reload()
        assert isinstance(first, QTensorTractScaleOnly)
        print(check_with_tract(tract_dir, f"{first_name}.weight", first))
    print("OK")


if __name__ == "__main__":
    main()
