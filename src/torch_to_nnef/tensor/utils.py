"""Iterate over the parameters and buffers of a module by their full dotted names.

PyTorch lists a tensor that several modules share (tied weights) under its first name only.
These helpers make that choice explicit: with ``remove_duplicate=False`` a shared tensor is
listed once per name it is reachable by, which is what code replacing tensors needs to see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
from torch import nn

__all__ = [
    "can_require_grad",
    "get_named_buffers",
    "get_named_parameters",
    "get_named_parameters_and_buffers",
]

_Members = Callable[[nn.Module], Iterable[tuple[str, torch.Tensor | None]]]


def _parameters_of(module: nn.Module) -> Iterable[tuple[str, torch.Tensor | None]]:
    return module._parameters.items()


def _buffers_of(module: nn.Module) -> Iterable[tuple[str, torch.Tensor | None]]:
    return module._buffers.items()


def _iter_members(
    module: nn.Module, members_of: tuple[_Members, ...], remove_duplicate: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    modules = list(module.named_modules(remove_duplicate=remove_duplicate))
    for members in members_of:
        for prefix, submodule in modules:
            for local_name, tensor in members(submodule):
                if tensor is None:
                    continue
                if remove_duplicate:
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                yield (f"{prefix}.{local_name}" if prefix else local_name), tensor


def get_named_parameters(
    mod: nn.Module, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield ``(full dotted name, parameter)`` for every parameter of ``mod``.

    Args:
        mod: the module to walk, with all its submodules.
        remove_duplicate: when true (the default) a tensor reachable by several names is
            yielded once, under the first name in module registration order; when false it
            is yielded once per name (tied weights appear under every name).
    """
    # `_parameters` only holds parameters.
    return cast(
        Iterator[tuple[str, nn.Parameter]],
        _iter_members(mod, (_parameters_of,), remove_duplicate),
    )


def get_named_buffers(
    mod: nn.Module, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(full dotted name, buffer)`` for every registered buffer of ``mod``.

    Args:
        mod: the module to walk, with all its submodules.
        remove_duplicate: as for :func:`get_named_parameters`.
    """
    return _iter_members(mod, (_buffers_of,), remove_duplicate)


def get_named_parameters_and_buffers(
    mod: nn.Module, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(full dotted name, tensor)`` for every parameter and buffer of ``mod``.

    Every parameter comes first, then every buffer, each in module registration order (the
    order of ``mod.named_parameters()`` followed by ``mod.named_buffers()``).

    Args:
        mod: the module to walk, with all its submodules.
        remove_duplicate: when true a tensor is yielded once, under its first name (a
            parameter name when it is both a parameter of one module and a buffer of
            another); when false it is yielded once per name.
    """
    return _iter_members(mod, (_parameters_of, _buffers_of), remove_duplicate)


def can_require_grad(tensor: torch.Tensor) -> bool:
    """Whether ``requires_grad=True`` can be set on ``tensor``.

    True for floating point and complex tensors, unless the tensor's class declares
    ``t2n_supports_grad = False``, as opaque tensors (quantized, offloaded) and references to
    them do: their values are produced on demand and carry no autograd history.
    """
    if not getattr(type(tensor), "t2n_supports_grad", True):
        return False
    return tensor.is_floating_point() or tensor.is_complex()
