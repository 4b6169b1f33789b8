"""The residency pool: a bounded set of offloaded tensors kept in memory while a model runs.

One actor owns a pool's state on an event loop; every operation has a synchronous face,
usable from any thread, and an async twin. See :class:`TensorResidencyPool`.
"""

from torch_to_nnef.tensor.residency._handles import TensorPrefetch, TensorResidencyLease
from torch_to_nnef.tensor.residency._policy import ResidencyStrategy
from torch_to_nnef.tensor.residency._pool import TensorResidencyPool
from torch_to_nnef.tensor.residency._scope import active_tensor_residency
from torch_to_nnef.tensor.residency._state import PoolStats
from torch_to_nnef.tensor.residency._stream import ModuleStream, stream_modules

__all__ = [
    "ModuleStream",
    "PoolStats",
    "ResidencyStrategy",
    "TensorPrefetch",
    "TensorResidencyLease",
    "TensorResidencyPool",
    "active_tensor_residency",
    "stream_modules",
]
