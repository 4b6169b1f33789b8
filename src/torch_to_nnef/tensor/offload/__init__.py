"""Offloaded tensors: tensors whose payload lives in a file and is loaded on use.

An :class:`OffloadedTensor` is a storage-less shell that reports the shape, dtype and target
device of a value kept on disk, in one payload file of :mod:`torch_to_nnef.tensor.storage`.
Any torch operation on it loads the value (through the active residency pool inside
``pool.scope()``, straight from disk otherwise), computes, and returns a plain ``torch.Tensor``.
It can stand for a plain tensor or for an opaque value that describes itself with
:class:`~torch_to_nnef.tensor.opaque.SupportsOffloadState` (a quantized ``QTensor``), and it
can point into an existing ``.safetensors`` checkpoint without copying it.

Ownership of files:

- a payload written by an ``OffloadedTensor`` (:meth:`OffloadedTensor.from_original_tensor`,
  updates, copies on write) belongs to it and is removed when the tensor is garbage collected
  (or at interpreter exit);
- a checkpoint it points into (:meth:`OffloadedTensor.from_safetensors`) is never written nor
  removed: the first write copies the new value into the tensor's offload directory;
- without an offload directory, payloads go to a private temporary directory, removed once no
  tensor uses it anymore.

Writes are atomic (a crash leaves the old or the new payload) and serialised per tensor;
reads need no lock: a reader that finds the file replaced under it retries with the new
layout.

The contract a residency pool relies on, ``PoolSource``, lives in ``_protocol.py``, below both
the tensor and the pool.
"""

from typing import Any

from torch_to_nnef.tensor.offload._tensor import OffloadedTensor

__all__ = ["OffloadedTensor"]


def __getattr__(name: str) -> Any:
    """Upstream torch-to-nnef's loading helpers, from :mod:`torch_to_nnef.tensor.hf` on demand."""
    if not name.startswith("_"):  # never import hf for the probes of the import machinery
        from torch_to_nnef.tensor import hf  # imported on use: hf imports this package

        if name in hf.__all__:
            return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
