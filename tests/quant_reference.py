"""tract's Q4_0 computed element by element, independently of the library's quantization code.

The oracles of the quantized-tensor tests: codes and scales from the definition of GGML Q4_0,
and dequantization as tract performs it on x86 (directly in the target dtype) and on ARM
(through float16).
"""

from __future__ import annotations

import torch


def reference_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML Q4_0 written element by element over groups: (codes, float16 scales)."""
    rows = weight.detach().double().reshape(-1, 32).tolist()
    codes, scales = [], []
    for row in rows:
        extreme = max(row, key=abs)
        scale = torch.tensor(extreme / -8.0).half()
        d = float(scale)
        scales.append(d)
        for value in row:
            code = 8 if d == 0 else int(torch.floor(torch.tensor(value / d + 8.5)))
            codes.append(min(max(code, 0), 15))
    return (
        torch.tensor(codes, dtype=torch.uint8).reshape(weight.shape),
        torch.tensor(scales, dtype=torch.float16),
    )


def reference_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(code - 8) * scale with every product rounded once to ``dtype``."""
    per_value_scale = scales.double().repeat_interleave(32).reshape(codes.shape)
    return ((codes.double() - 8.0) * per_value_scale).to(dtype)


def reference_q4_0_value(weight: torch.Tensor, *, through_f16: bool) -> torch.Tensor:
    """The value tract computes for ``weight`` quantized to Q4_0, in the weight's dtype: on
    ARM (``through_f16``) dequantized in float16 then cast, elsewhere directly."""
    codes, scales = reference_q4_0(weight)
    if through_f16:
        return reference_dequantize(codes, scales, torch.float16).to(weight.dtype)
    return reference_dequantize(codes, scales, weight.dtype)
