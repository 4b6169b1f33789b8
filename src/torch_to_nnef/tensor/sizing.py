"""Sizes for choosing a pool's budget: what a model offloads, and byte counts written as text.

:func:`module_footprint` reports how many bytes of a model are offloaded and how large its
largest layer is (the values a pool counts against ``max_cached_bytes``); :func:`parse_bytes`
reads a budget such as ``"1.5GB"`` or ``"512MiB"``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.offload import OffloadedTensor

__all__ = ["ModuleFootprint", "module_footprint", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(size: int | str) -> int:
    """Return the number of bytes ``size`` stands for.

    Args:
        size: a count of bytes, or a number followed by a unit: ``B``, ``KB``, ``MB``,
            ``GB``, ``TB`` (powers of 1000) or ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of
            1024), in any case, with or without a space: ``"1.5GB"``, ``"512 MiB"``.

    Returns:
        the size in bytes, rounded down to a whole byte.

    Raises:
        T2NErrorMisuse: ``size`` is negative, not an int or a str, or a str in another form.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise T2NErrorMisuse(
            f"a size must be an int (bytes) or a str such as '1.5GB' or '512MiB', "
            f"got {type(size).__name__}"
        )
    if isinstance(size, int):
        if size < 0:
            raise T2NErrorMisuse(f"a size cannot be negative, got {size}")
        return size
    match = _SIZE.match(size)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        raise T2NErrorMisuse(
            f"cannot read {size!r} as a size: write a number of bytes, or a number and a unit "
            "among B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), "
            "such as '1.5GB' or '512MiB'"
        )
    whole, _, fraction = match[1].partition(".")
    scale = _UNITS[unit]
    # Exact arithmetic: "1.1GB" is 1_100_000_000 bytes, not what a float makes of it.
    parts = int(whole or 0) * scale
    if fraction:
        parts += int(fraction) * scale // 10 ** len(fraction)
    return parts


class ModuleFootprint(NamedTuple):
    """What :func:`module_footprint` reports about a model."""

    offloaded_bytes: int
    """Bytes of every offloaded tensor's payload, each counted once (tied weights share one).
    A quantized value holds more once loaded (Q4_0: its codes one per byte, about twice its
    payload), and a pool counts what values hold."""
    resident_bytes: int
    """Bytes of the parameters and buffers that are not offloaded (always in memory)."""
    largest_layer: str
    """Dotted name of the module holding the most offloaded bytes directly (``""``: the
    model itself, or no offloaded tensor at all)."""
    largest_layer_bytes: int
    """Offloaded bytes held directly by that module: what one layer of a streamed forward
    keeps leased while it runs."""
    layers: int
    """Number of modules holding offloaded tensors directly (what ``stream_modules`` streams
    one by one)."""


def module_footprint(module: torch.nn.Module) -> ModuleFootprint:
    """Measure what ``module`` offloads, to choose a pool's ``max_cached_bytes``.

    The bytes of an offloaded tensor are its payload's (what the pool counts against its
    budget: a quantized tensor counts its codes and scales, not its dequantized value).

    Args:
        module: a model, usually after :func:`~torch_to_nnef.tensor.offload_module` or
            :func:`~torch_to_nnef.tensor.load_offloaded_checkpoint`.

    Returns:
        the offloaded and resident bytes, the largest layer and the number of layers.

    Raises:
        T2NErrorMisuse: ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise T2NErrorMisuse(
            f"module_footprint measures a torch.nn.Module, got {type(module).__name__}"
        )
    seen: set[int] = set()
    offloaded = resident = 0
    largest, largest_bytes, layers = "", 0, 0
    for name, child in module.named_modules():
        direct = 0
        tensors = [*child.parameters(recurse=False), *child.buffers(recurse=False)]
        for tensor in tensors:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if isinstance(tensor, OffloadedTensor):
                direct += tensor.payload_nbytes
            else:
                resident += tensor.numel() * tensor.element_size()
        if direct:
            layers += 1
            offloaded += direct
            if direct > largest_bytes:
                largest, largest_bytes = name, direct
    return ModuleFootprint(offloaded, resident, largest, largest_bytes, layers)
