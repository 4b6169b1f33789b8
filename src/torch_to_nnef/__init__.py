"""Tensor layer of torch_to_nnef: offloaded, quantized and named tensors, and a residency pool."""

__version__ = "0.1.0"
