"""Tensors for models bigger than memory: offloaded, quantized and named tensors.

The public names of ``torch_to_nnef.tensor``; the modules below hold the details
(``offload``, ``checkpoint``, ``quant``, ``named``, ``opaque``, ``updater``, ``utils``,
``residency``, ``sizing``, ``storage``, and ``hf`` for Hugging Face models).
"""

# Tensor subclasses
# Offloading whole modules and checkpoints
from torch_to_nnef.tensor.checkpoint import load_offloaded_checkpoint as load_offloaded_checkpoint
from torch_to_nnef.tensor.checkpoint import offload_module as offload_module
from torch_to_nnef.tensor.named import NamedTensor as NamedTensor
from torch_to_nnef.tensor.named import (
    apply_name_to_tensor_in_module as apply_name_to_tensor_in_module,
)
from torch_to_nnef.tensor.offload import OffloadedTensor as OffloadedTensor
from torch_to_nnef.tensor.opaque import OpaqueTensorRef as OpaqueTensorRef
from torch_to_nnef.tensor.opaque import (
    set_opaque_tensor_in_params_as_ref as set_opaque_tensor_in_params_as_ref,
)
from torch_to_nnef.tensor.quant import QScalePerGroupF16 as QScalePerGroupF16
from torch_to_nnef.tensor.quant import QTensor as QTensor
from torch_to_nnef.tensor.quant import QTensorTractScaleOnly as QTensorTractScaleOnly

# The residency pool
from torch_to_nnef.tensor.residency import ResidencyStrategy as ResidencyStrategy
from torch_to_nnef.tensor.residency import TensorPrefetch as TensorPrefetch
from torch_to_nnef.tensor.residency import TensorResidencyLease as TensorResidencyLease
from torch_to_nnef.tensor.residency import TensorResidencyPool as TensorResidencyPool
from torch_to_nnef.tensor.residency import active_tensor_residency as active_tensor_residency
from torch_to_nnef.tensor.residency import stream_modules as stream_modules

__all__ = [
    # tensor subclasses
    "NamedTensor",
    "OffloadedTensor",
    "OpaqueTensorRef",
    "QScalePerGroupF16",
    "QTensor",
    "QTensorTractScaleOnly",
    "apply_name_to_tensor_in_module",
    "set_opaque_tensor_in_params_as_ref",
    # offloading modules and checkpoints
    "load_offloaded_checkpoint",
    "offload_module",
    # the residency pool
    "ResidencyStrategy",
    "TensorPrefetch",
    "TensorResidencyLease",
    "TensorResidencyPool",
    "active_tensor_residency",
    "stream_modules",
]
