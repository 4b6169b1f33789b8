"""Quantized tensors (8 bits or fewer) with schemes PyTorch has no native type for.

A :class:`QTensor` keeps uint8 codes plus a :class:`QScheme` and dequantizes on use.
:class:`QTensorTractScaleOnly` is tract's Q4_0, which writes itself as a tract ``.dat`` file::

    from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

    q_weight = fp_to_tract_q4_0_with_min_max_calibration(linear.weight)
    linear.weight = torch.nn.Parameter(q_weight, requires_grad=False)
    q_weight.write_in_file("model_dir", "linear.weight")
"""

from torch_to_nnef.tensor.quant._dat import Q40Layout as Q40Layout
from torch_to_nnef.tensor.quant.base import QScalePerGroupF16 as QScalePerGroupF16
from torch_to_nnef.tensor.quant.base import QScheme as QScheme
from torch_to_nnef.tensor.quant.base import QTensor as QTensor
from torch_to_nnef.tensor.quant.base import U8Compressor as U8Compressor
from torch_to_nnef.tensor.quant.base import (
    qscale_per_group_f16_min_max_calibration as qscale_per_group_f16_min_max_calibration,
)
from torch_to_nnef.tensor.quant.qtract import QTensorTract as QTensorTract
from torch_to_nnef.tensor.quant.qtract import QTensorTractScaleOnly as QTensorTractScaleOnly
from torch_to_nnef.tensor.quant.qtract import (
    fp_to_tract_q4_0_with_min_max_calibration as fp_to_tract_q4_0_with_min_max_calibration,
)

__all__ = [
    # tensors
    "QTensor",
    "QTensorTract",
    "QTensorTractScaleOnly",
    # schemes and compressors
    "QScheme",
    "QScalePerGroupF16",
    "U8Compressor",
    # calibration
    "fp_to_tract_q4_0_with_min_max_calibration",
    "qscale_per_group_f16_min_max_calibration",
    # tract file format
    "Q40Layout",
]
