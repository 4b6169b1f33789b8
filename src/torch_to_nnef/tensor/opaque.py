"""Opaque tensors: tensors whose real value is produced on demand.

An :class:`OpaqueTensor` is a storage-less shell that reports the shape, dtype and device of
the value it stands for. Any torch operation on it first expands it with
:meth:`OpaqueTensor.to_base_tensor` and runs on the expanded value, returning a plain
``torch.Tensor``. Quantized tensors (decompress on use) and offloaded tensors (load on use) are
opaque tensors.

:class:`SupportsOffloadState` lets an opaque tensor describe itself as a few plain tensors plus
JSON-able attributes, so that the storage layer can write it to disk and rebuild it without
pickling anything.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch.overrides import get_default_nowrap_functions

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorNotImplemented, T2NErrorStorage

__all__ = [
    "OpaqueTensor",
    "OpaqueTensorRef",
    "SupportsOffloadState",
    "offload_state_class",
    "opaque_to_final_tensor",
    "set_opaque_tensor_in_params_as_ref",
]

LOGGER = logging.getLogger(__name__)

IR_OPAQUE_NAME = "t2n::opaque_tensor_expand"

_S = TypeVar("_S", bound="SupportsOffloadState")

# ---------------------------------------------------------------------------------------------
# Expansion through a custom op, so that a trace records where an opaque value is produced.
# The op is registered once at import. A trace records an integer token, never reused, that
# names one live opaque tensor; the registry holds the tensors weakly.
# ---------------------------------------------------------------------------------------------
_TRACED_OPAQUE: weakref.WeakValueDictionary[int, OpaqueTensor] = weakref.WeakValueDictionary()
_TRACE_TOKENS = itertools.count(1)


def _trace_token(tensor: OpaqueTensor) -> int:
    """Return the token under which ``tensor`` is registered for traces (registering it)."""
    token: int | None = tensor.__dict__.get("_t2n_trace_token")
    # A copied tensor inherits its original's token: give it its own.
    if token is None or _TRACED_OPAQUE.get(token) is not tensor:
        token = next(_TRACE_TOKENS)
        tensor.__dict__["_t2n_trace_token"] = token
        _TRACED_OPAQUE[token] = tensor
    return token


def _traced_tensor(token: int) -> OpaqueTensor:
    tensor = _TRACED_OPAQUE.get(token)
    if tensor is None:
        raise T2NErrorMisuse(
            f"a trace expands opaque tensor #{token}, which no longer exists: keep the traced "
            "module's source model (which holds its opaque parameters) alive while the trace runs"
        )
    return tensor


@torch.library.custom_op(IR_OPAQUE_NAME, mutates_args=())  # type: ignore[misc]
def _opaque_tensor_expand(token: int) -> torch.Tensor:
    value: torch.Tensor = _traced_tensor(token)
    while isinstance(value, OpaqueTensor):
        value = value._to_base_tensor()
    # The op's result must not alias any state the opaque tensor keeps.
    return value.clone()


@_opaque_tensor_expand.register_fake  # type: ignore[misc]
def _opaque_tensor_expand_fake(token: int) -> torch.Tensor:
    shell = _traced_tensor(token)
    return torch.empty(tuple(shell.shape), dtype=shell.dtype, device=shell.device)


def _is_tracing() -> bool:
    return torch._C._get_tracing_state() is not None or bool(torch.compiler.is_compiling())


# Functions that only read the shell's metadata (shape, dtype, device, ...): they run on the
# shell itself and never expand the value.
_METADATA_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.requires_grad_,
        torch.Tensor.__format__,
        # nn.Module._apply asks it for every tensor on model.to(...): metadata only.
        torch._has_compatible_shallow_copy_type,
    }
)
_NOWRAP_FUNCTIONS = get_default_nowrap_functions()


def _is_passthrough(func: Callable[..., Any]) -> bool:
    if func in _METADATA_FUNCTIONS or func in _NOWRAP_FUNCTIONS:
        return True
    name = getattr(func, "__name__", "")
    return name in ("__get__", "__set__", "__delete__")


def _expand(value: Any) -> Any:
    if isinstance(value, OpaqueTensor):
        return opaque_to_final_tensor(value)
    if isinstance(value, OpaqueTensorRef):
        return opaque_to_final_tensor(value.opaque_tensor)
    if type(value) in (list, tuple):
        return type(value)(_expand(v) for v in value)
    return value


def _expand_all(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(_expand(a) for a in args), {k: _expand(v) for k, v in kwargs.items()}


def _call_expanded(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """Run ``func`` as a plain torch function: on the shells for metadata queries, on the
    expanded values otherwise (so the result is a plain tensor)."""
    with torch._C.DisableTorchFunctionSubclass():
        if _is_passthrough(func):
            return func(*args, **kwargs)
        args, kwargs = _expand_all(args, kwargs)
        return func(*args, **kwargs)


class OpaqueTensor(torch.Tensor):
    """A tensor whose value is produced on demand by :meth:`to_base_tensor`.

    Subclasses build a storage-less shell with :meth:`_make_shell` (shape, dtype and the device
    the value lives on) and implement :meth:`_to_base_tensor`. Every torch operation on an
    opaque tensor runs on the expanded value and returns a plain ``torch.Tensor``; metadata
    queries (``shape``, ``dtype``, ``device``, ``numel()``) answer from the shell without
    expanding.

    ``detach()`` and ``requires_grad_()`` return the tensor itself, so that
    ``nn.Parameter(opaque, requires_grad=False)`` keeps the opaque type. ``data`` returns the
    tensor itself to keep access to its special attributes.
    """

    @staticmethod
    def _make_shell(
        cls: type[OpaqueTensor],
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> Any:
        """Create a storage-less instance of ``cls`` reporting ``shape``, ``dtype``, ``device``."""
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=torch.device(device), requires_grad=False
        )

    # -- value -------------------------------------------------------------------------------
    def _to_base_tensor(self) -> torch.Tensor:
        """Produce the expanded value (implemented by subclasses)."""
        raise T2NErrorNotImplemented(
            f"{type(self).__name__} must implement _to_base_tensor() to be used as a tensor"
        )

    def to_base_tensor(self) -> torch.Tensor:
        """Return the expanded value as a plain tensor (or as a nested opaque tensor).

        While ``torch.jit.trace`` or ``torch.compile`` runs, the expansion goes through the
        registered custom op ``t2n::opaque_tensor_expand`` so that the trace records it.
        """
        if _is_tracing():
            result: torch.Tensor = torch.ops.t2n.opaque_tensor_expand(_trace_token(self))
            return result
        return self._to_base_tensor()

    # -- behaviour shared by every opaque tensor ---------------------------------------------
    @property  # type: ignore[override]
    def data(self) -> OpaqueTensor:
        """The tensor itself, so that its special attributes stay reachable."""
        return self

    @data.setter
    def data(self, new_data: torch.Tensor) -> None:
        raise T2NErrorNotImplemented(
            f"{type(self).__name__} does not support assigning .data; "
            "replace the parameter with ModTensorUpdater instead"
        )

    def detach(self) -> OpaqueTensor:  # type: ignore[override]
        """Return the tensor itself (opaque tensors carry no autograd history)."""
        return self

    def requires_grad_(self, requires_grad: bool = True) -> OpaqueTensor:  # type: ignore[override]
        """Accept ``requires_grad_(False)`` and return the tensor itself.

        Args:
            requires_grad: must be ``False``: opaque tensors cannot require gradients.

        Raises:
            T2NErrorMisuse: ``requires_grad`` is true.
        """
        if requires_grad:
            raise T2NErrorMisuse(
                f"{type(self).__name__} cannot require gradients; "
                "wrap it with nn.Parameter(tensor, requires_grad=False)"
            )
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        shape = tuple(self.shape)
        return f"{type(self).__name__}(shape={shape}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return _call_expanded(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        args, kwargs = _expand_all(args, kwargs or {})
        return func(*args, **kwargs)


class OpaqueTensorRef(torch.Tensor):
    """A meta tensor standing for an :class:`OpaqueTensor` while a model is traced.

    ``torch.jit.trace`` cannot carry arbitrary tensor subclasses as parameters; a reference
    can. Operations on it expand the referenced opaque tensor through the registered custom
    op ``t2n::opaque_tensor_expand``, so the trace records where the opaque value is used.

    Args:
        meta_tensor: a tensor with the shape and dtype of the opaque value; the reference
            is built on the meta device from it (any device is accepted).
        opaque_tensor: the opaque tensor the reference stands for.
    """

    opaque_tensor: OpaqueTensor
    meta_tensor: torch.Tensor

    @staticmethod
    def __new__(cls, meta_tensor: torch.Tensor, opaque_tensor: OpaqueTensor) -> OpaqueTensorRef:
        ref: OpaqueTensorRef = torch.Tensor._make_subclass(cls, meta_tensor.to("meta"), False)
        ref.meta_tensor = meta_tensor
        ref.opaque_tensor = opaque_tensor
        return ref

    def __init__(self, meta_tensor: torch.Tensor, opaque_tensor: OpaqueTensor) -> None:
        super().__init__()

    @property  # type: ignore[override,misc]
    def device(self) -> torch.device:  # type: ignore[override]
        """The device of the referenced opaque tensor."""
        return self.opaque_tensor.device

    @property
    def nnef_name(self) -> str | None:
        """The ``nnef_name`` of the referenced tensor, when it has one."""
        return getattr(self.opaque_tensor, "nnef_name", None)

    @property  # type: ignore[override]
    def data(self) -> OpaqueTensorRef:
        """The reference itself."""
        return self

    @data.setter
    def data(self, new_data: torch.Tensor) -> None:
        raise T2NErrorNotImplemented("OpaqueTensorRef does not support assigning .data")

    def detach(self) -> OpaqueTensorRef:  # type: ignore[override]
        """Return the reference itself."""
        return self

    def requires_grad_(self, requires_grad: bool = True) -> OpaqueTensorRef:  # type: ignore[override]
        """Return the reference itself; ``requires_grad`` is ignored (references have no grad)."""
        return self

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """Move or cast the referenced opaque tensor with its own ``to()``.

        Returns this reference when nothing changes, a new reference when the conversion
        gives another opaque tensor, and the converted value itself when it is a plain tensor.
        This reference is never modified.
        """
        moved = self.opaque_tensor.to(*args, **kwargs)
        if moved is self.opaque_tensor:
            return self
        if isinstance(moved, OpaqueTensor):
            meta = torch.empty(tuple(moved.shape), dtype=moved.dtype, device="meta")
            return OpaqueTensorRef(meta, moved)
        return moved

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"OpaqueTensorRef({self.opaque_tensor!r})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        return _call_expanded(func, args, kwargs or {})


def opaque_to_final_tensor(rtensor: torch.Tensor) -> torch.Tensor:
    """Expand nested opaque tensors down to a plain tensor.

    An offloaded QTensor is loaded, then decompressed: the final floating-point value.

    Args:
        rtensor: any tensor; a plain tensor is returned as it is.

    Returns:
        the value once no opaque layer is left.
    """
    while isinstance(rtensor, OpaqueTensor):
        rtensor = rtensor.to_base_tensor()
    return rtensor


def set_opaque_tensor_in_params_as_ref(model: torch.nn.Module) -> None:
    """Replace every opaque parameter of ``model`` by an :class:`OpaqueTensorRef`.

    Call it just before ``torch.jit.trace``: the trace then records each use of an opaque
    parameter as a call to ``t2n::opaque_tensor_expand``, and the traced module computes with
    the expanded values. Tied parameters (one tensor held by several modules) share one
    reference. Parameters that are not opaque, or are references already, are left as they are.
    """
    from torch_to_nnef.tensor.updater import ModTensorUpdater

    updater = ModTensorUpdater(model)
    for _, tensor in list(updater.iter_tensors()):
        if isinstance(tensor, OpaqueTensor):
            meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
            updater.update_by_ref(tensor, OpaqueTensorRef(meta, tensor))


# ---------------------------------------------------------------------------------------------
# Offload state: describe an opaque tensor as plain tensors plus JSON-able attributes.
# ---------------------------------------------------------------------------------------------
_OFFLOAD_STATE_CLASSES: dict[str, type[SupportsOffloadState]] = {}


class SupportsOffloadState:
    """Mixin by which an opaque tensor describes itself for storage.

    A subclass implements :meth:`offload_state` (a few plain tensors plus JSON-able attributes)
    and :meth:`from_offload_state` (the inverse). Each class is registered under its
    ``offload_tag`` (by default ``"module.QualName"``), which the storage layer writes next to
    the tensors; two classes cannot claim the same tag.
    """

    offload_tag: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("offload_tag") or f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(tag, str):
            raise T2NErrorMisuse(f"offload_tag of {cls.__qualname__} must be a str, got {tag!r}")
        other = _OFFLOAD_STATE_CLASSES.get(tag)
        if other is not None and other is not cls:
            raise T2NErrorMisuse(
                f"offload tag {tag!r} is already registered by {other.__module__}."
                f"{other.__qualname__}; give {cls.__qualname__} a distinct `offload_tag`"
            )
        cls.offload_tag = tag
        _OFFLOAD_STATE_CLASSES[tag] = cls

    def offload_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Return ``(tensors, attributes)`` describing this value; attributes are JSON-able.

        Raises:
            T2NErrorNotImplemented: the subclass does not implement it.
        """
        raise T2NErrorNotImplemented(f"{type(self).__name__} must implement offload_state()")

    @classmethod
    def from_offload_state(
        cls: type[_S], tensors: dict[str, torch.Tensor], attributes: dict[str, Any]
    ) -> _S:
        """Rebuild a value from what :meth:`offload_state` returned.

        Args:
            tensors: the tensors of the offload state, by name.
            attributes: the JSON-able attributes of the offload state.

        Raises:
            T2NErrorNotImplemented: the subclass does not implement it.
        """
        raise T2NErrorNotImplemented(f"{cls.__name__} must implement from_offload_state()")


def offload_state_class(tag: str) -> type[SupportsOffloadState]:
    """Return the class registered under ``tag``; raise :class:`T2NErrorStorage` if unknown."""
    try:
        return _OFFLOAD_STATE_CLASSES[tag]
    except KeyError:
        raise T2NErrorStorage(
            f"unknown offload class tag {tag!r}: import the module defining it before loading"
        ) from None
