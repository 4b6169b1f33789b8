"""The residency scope: which pool serves ``OffloadedTensor`` reloads in this context.

Kept free of heavy imports so that ``tensor.offload`` can consult it without an import cycle.
The value is a contextvar, so it follows ``anyio.to_thread.run_sync`` workers (which copy the
caller's context) and stays private to each asyncio task.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch_to_nnef.tensor.residency._pool import TensorResidencyPool

__all__ = ["active_tensor_residency"]

_ACTIVE_RESIDENCY: ContextVar[tuple[TensorResidencyPool, torch.device | None] | None] = ContextVar(
    "t2n_active_residency", default=None
)


def active_tensor_residency() -> tuple[TensorResidencyPool, torch.device | None] | None:
    """Return ``(pool, device)`` of the residency scope active in this context, or ``None``.

    ``device`` is the device given to :meth:`TensorResidencyPool.scope` (``None`` means each
    tensor's own target device).
    """
    return _ACTIVE_RESIDENCY.get()
