"""The residency scope: which pool serves ``OffloadedTensor`` reloads in this context.

The context variable lives with the tensor's protocol (``tensor/offload/_protocol.py``), below
both the tensor and the pool; this module gives it its public name here.
"""

from torch_to_nnef.tensor.offload._protocol import active_tensor_residency

__all__ = ["active_tensor_residency"]
