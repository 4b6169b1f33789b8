"""Min-max calibration: choose per-group scales from the values of a floating point tensor."""

from __future__ import annotations

import torch

from torch_to_nnef.exceptions import T2NErrorImpossibleQuantization, T2NErrorMisuse
from torch_to_nnef.tensor.opaque import OpaqueTensor, opaque_to_final_tensor
from torch_to_nnef.tensor.quant._dat import Q40_GROUP_SIZE
from torch_to_nnef.tensor.quant.base import QScalePerGroupF16
from torch_to_nnef.tensor.quant.qtract import Q40_N_BITS, QTensorTractScaleOnly, check_q40_shape

__all__ = [
    "fp_to_tract_q4_0_with_min_max_calibration",
    "qscale_per_group_f16_min_max_calibration",
]


def _plain_float(fp_tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(fp_tensor, torch.Tensor):
        raise T2NErrorMisuse(f"expected a floating point torch.Tensor, got {type(fp_tensor)}")
    if isinstance(fp_tensor, OpaqueTensor):
        fp_tensor = opaque_to_final_tensor(fp_tensor)
    if not fp_tensor.is_floating_point():
        raise T2NErrorMisuse(
            f"only floating point tensors can be quantized, got dtype {fp_tensor.dtype}"
        )
    return fp_tensor.detach()


def _group_magnitude(abs_groups: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per-row ``percentile`` quantile of ``abs_groups`` (linear interpolation, like
    ``torch.quantile``, without its input size limit)."""
    ordered = abs_groups.sort(dim=1).values
    position = percentile * (ordered.shape[1] - 1)
    low = int(position)
    high = min(low + 1, ordered.shape[1] - 1)
    fraction = position - low
    return ordered[:, low] + fraction * (ordered[:, high] - ordered[:, low])


def qscale_per_group_f16_min_max_calibration(
    fp_tensor: torch.Tensor,
    n_bits: int,
    group_size: int,
    percentile: float = 1.0,
) -> QScalePerGroupF16:
    """Calibrate a :class:`QScalePerGroupF16` for ``fp_tensor`` from each group's extremes.

    The tensor is read in row-major order and cut into groups of ``group_size`` values. Each
    group's scale is its value of largest magnitude divided by ``-2 ** (n_bits - 1)`` (tract's
    and GGML's convention: that value is then represented exactly). With ``percentile < 1``
    the magnitude is the group's ``percentile`` quantile of absolute values instead (clipping
    outliers), keeping the sign of the largest value. Scales are float16, on the device of
    ``fp_tensor``.

    Args:
        fp_tensor: floating point values (opaque tensors are expanded first).
        n_bits: bits per code, from 1 to 8.
        group_size: values per group; must divide the volume of ``fp_tensor``.
        percentile: in ``(0, 1]``; 1 is the plain maximum.

    Raises:
        T2NErrorImpossibleQuantization: the volume is not a multiple of ``group_size``, the
            tensor holds NaN or infinite values, or a scale overflows float16.
        T2NErrorMisuse: an argument is out of range or ``fp_tensor`` is not floating point.
    """
    if not isinstance(percentile, (int, float)) or not 0.0 < percentile <= 1.0:
        raise T2NErrorMisuse(f"percentile must be in (0, 1], got {percentile!r}")
    if isinstance(n_bits, bool) or not isinstance(n_bits, int) or not 1 <= n_bits <= 8:
        raise T2NErrorMisuse(f"n_bits must be an int from 1 to 8, got {n_bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise T2NErrorMisuse(f"group_size must be a positive int, got {group_size!r}")
    values = _plain_float(fp_tensor)
    shape = tuple(values.shape)
    if values.numel() == 0 or values.numel() % group_size != 0:
        raise T2NErrorImpossibleQuantization(
            f"tensor of shape {shape} has {values.numel()} values, not a positive multiple of "
            f"the group size {group_size}; incomplete groups cannot be quantized"
        )
    with torch.no_grad():
        groups = values.reshape(-1, group_size).to(torch.float32)
        if not bool(torch.isfinite(groups).all()):
            raise T2NErrorImpossibleQuantization(
                f"tensor of shape {shape} holds NaN or infinite values; they cannot be quantized"
            )
        magnitudes = groups.abs()
        largest = groups.gather(1, magnitudes.argmax(dim=1, keepdim=True)).squeeze(1)
        if percentile == 1.0:
            extreme = largest
        else:
            sign = torch.where(largest < 0, -1.0, 1.0)
            extreme = sign * _group_magnitude(magnitudes, float(percentile))
        scale = (extreme / -float(1 << (n_bits - 1))).to(torch.float16)
        if not bool(torch.isfinite(scale).all()):
            raise T2NErrorImpossibleQuantization(
                f"tensor of shape {shape} holds values too large for float16 scales "
                f"(max |x| = {float(magnitudes.max())}); rescale the tensor first"
            )
    return QScalePerGroupF16(group_size=group_size, scale=scale, n_bits=n_bits)


def fp_to_tract_q4_0_with_min_max_calibration(
    fp_tensor: torch.Tensor, percentile: float = 1.0
) -> QTensorTractScaleOnly:
    """Quantize a weight to tract's Q4_0 with min-max calibrated scales.

    The result dequantizes to the dtype of ``fp_tensor`` and lives on its device.

    Args:
        fp_tensor: a 2-D to 4-D floating point weight (an ``nn.Parameter`` is fine) whose
            trailing volume (product of the dims after the first) is a multiple of 32.
        percentile: in ``(0, 1]``, see :func:`qscale_per_group_f16_min_max_calibration`.

    Raises:
        T2NErrorImpossibleQuantization: the shape does not fit Q4_0 (the message gives it), or
            the values cannot be calibrated.
        T2NErrorMisuse: ``fp_tensor`` is not floating point or ``percentile`` is out of range.
    """
    values = _plain_float(fp_tensor)
    check_q40_shape(values.shape)
    qscheme = qscale_per_group_f16_min_max_calibration(
        values, n_bits=Q40_N_BITS, group_size=Q40_GROUP_SIZE, percentile=percentile
    )
    return QTensorTractScaleOnly(values, qscheme, dequant_to_dtype=values.dtype)
