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
import os
import secrets
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import torch
from torch.overrides import get_default_nowrap_functions

from torch_to_nnef.exceptions import (
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
    T2NErrorTorchJitTraceFailed,
)
from torch_to_nnef.tensor.updater import ModTensorUpdater
from torch_to_nnef.tensor.utils import get_named_parameters

__all__ = [
    "COMPILED_OPAQUE_NAME",
    "OFFLOAD_STATE_KEY",
    "OpaqueTensor",
    "OpaqueTensorRef",
    "SupportsOffloadState",
    "find_opaque_ref_by_py_id",
    "offload_state_class",
    "opaque_to_final_tensor",
    "resolve_offload_state",
    "set_opaque_tensor_in_params_as_ref",
]

LOGGER = logging.getLogger(__name__)

IR_OPAQUE_NAME = "t2n::opaque_tensor_expand"

_S = TypeVar("_S", bound="SupportsOffloadState")

# ---------------------------------------------------------------------------------------------
# In-place operations, seen from __torch_function__
# ---------------------------------------------------------------------------------------------
_INPLACE_OPERATORS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)
# Trailing-underscore methods that do not write the tensor's values.
_NOT_VALUE_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "retain_grad_"})


_PER_FUNCTION_LIMIT = 4096
"""The most decisions a cache of :func:`_remember` keeps."""


def _remember(cache: dict[Any, bool], func: Any, decision: bool) -> bool:
    """Cache ``decision`` for the torch function ``func``. The cache is a plain dict (its
    lookups run on every op) that empties itself at :data:`_PER_FUNCTION_LIMIT` entries: a
    caller handing ``__torch_function__`` a new callable each time (a lambda made per call)
    does not grow it, and what those callables hold, for good."""
    if len(cache) >= _PER_FUNCTION_LIMIT:
        cache.clear()
    cache[func] = decision
    return decision


_WRITES_FIRST_ARGUMENT: dict[Any, bool] = {}
# Private in-place ops that write a list of tensors: foreach and fused optimizer kernels.
_MULTI_TENSOR_PREFIXES = ("_foreach_", "_fused_")


def _writes_first_argument(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes the values of its first argument (``add_``, ``__setitem__``,
    the multi-tensor ``_foreach_mul_`` and ``_fused_adamw_``)."""
    try:
        return _WRITES_FIRST_ARGUMENT[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return False
    name = getattr(func, "__name__", "")
    writes = name in _INPLACE_OPERATORS or (
        name.endswith("_")
        and (not name.startswith("_") or name.startswith(_MULTI_TENSOR_PREFIXES))
        and name not in _NOT_VALUE_WRITES
    )
    return _remember(_WRITES_FIRST_ARGUMENT, func, writes)


def _in_place_refusal(operation: Any, written: type) -> T2NErrorNotImplemented:
    """The error of an in-place ``operation`` writing an opaque tensor of type ``written``."""
    return T2NErrorNotImplemented(
        f"in-place {getattr(operation, '__name__', operation)} on {written.__name__} "
        "would change a decompressed copy, and the change would be lost; change what the "
        "value keeps (a QTensor's u8_blob or qscheme.scale), or make a new value (e.g. "
        "quantize the changed weight again) and store it (update_values())"
    )


def _holds_opaque(value: Any) -> bool:
    """Whether ``value`` is an opaque tensor, or a list or tuple holding one."""
    if type(value) in (list, tuple):
        return any(isinstance(item, OpaqueTensor) for item in value)
    return isinstance(value, OpaqueTensor)


_MUTABLE_ATEN_OPS: dict[Any, bool] = {}
_ATEN_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _goes_to_dispatch(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``func`` runs down to ``__torch_dispatch__`` with the opaque tensors as they
    are, where the schema of the aten op it calls names the arguments it writes: an op given
    a list or tuple ``out=`` holding an opaque tensor (``torch.max(x, 0, out=(t, i))``), and
    an aten op that writes an argument, called as such (``torch.ops.aten.add_.Scalar``)."""
    out = kwargs.get("out")
    if type(out) in (list, tuple) and _holds_opaque(out):
        return True
    if not isinstance(func, _ATEN_OPS):
        return False
    try:
        return _MUTABLE_ATEN_OPS[func]
    except KeyError:
        pass
    if isinstance(func, torch._ops.OpOverload):
        mutable = bool(func._schema.is_mutable)
    else:
        mutable = any(getattr(func, name)._schema.is_mutable for name in func.overloads())
    _MUTABLE_ATEN_OPS[func] = mutable
    return mutable


def _places_written(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> list[int | str]:
    """Where the opaque tensors that the aten op ``func`` writes are (argument positions, or
    keywords): the arguments its schema marks as written (``Tensor(a!) self`` of ``add_``,
    the ``out`` arguments of ``max.dim_max``), holding an opaque tensor alone or in a list.

    An op reaches ``__torch_dispatch__`` without ``__torch_function__`` when called through
    ``torch.ops.aten``, or through a binding of torch that skips it (``torch.Tensor.set_``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    if schema.name.split("::")[-1] in _NOT_VALUE_WRITES:
        return []
    places: list[int | str] = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        place: int | str = position if position < len(args) else argument.name
        value = args[place] if isinstance(place, int) else kwargs.get(place)
        if _holds_opaque(value):
            places.append(place)
    return places


def _overload(func: Callable[..., Any]) -> Callable[..., Any]:
    """The overload an aten op packet with a single one stands for (``fill_diagonal_``);
    ``func`` itself otherwise (torch picks among several when it is called)."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        names = func.overloads()
        if len(names) == 1:
            return getattr(func, names[0])  # type: ignore[no-any-return]
    return func


def _write_places(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    places: list[int | str],
) -> Any:
    """Run the aten op ``func`` writing the opaque tensors at ``places``, as the type of the
    first of them writes (or refuses)."""
    first = args[places[0]] if isinstance(places[0], int) else kwargs[places[0]]
    if type(first) in (list, tuple):
        first = next(item for item in first if isinstance(item, OpaqueTensor))
    return type(first)._write_at_dispatch(func, args, kwargs, places)


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


COMPILED_OPAQUE_NAME = "t2n::opaque_tensor_expand_named"
"""The custom op that records an expansion in ``torch.compile`` graphs: the token of
:data:`IR_OPAQUE_NAME` as a string, and a tag of the process. Compiling turns an integer
argument that changes between calls of the same code (each weight's expansion, in a frame
resumed after a graph break) into a symbol, which cannot name a tensor; a string stays a
constant that guards the compiled code. Inductor's on-disk cache keys compiled graphs by their
code: the tag keeps it from serving a graph compiled in another process, where the same number
named another tensor."""


def _new_process_tag() -> None:
    global _PROCESS_TAG
    _PROCESS_TAG = f"{os.getpid():x}-{secrets.token_hex(8)}"


_PROCESS_TAG = ""
_new_process_tag()
if hasattr(os, "register_at_fork"):  # a forked child counts on from where its parent was
    os.register_at_fork(after_in_child=_new_process_tag)


@torch.library.custom_op(COMPILED_OPAQUE_NAME, mutates_args=())  # type: ignore[misc]
def _opaque_tensor_expand_named(process: str, token: str) -> torch.Tensor:
    value: torch.Tensor = _opaque_tensor_expand(int(token))
    return value


@_opaque_tensor_expand_named.register_fake  # type: ignore[misc]
def _opaque_tensor_expand_named_fake(process: str, token: str) -> torch.Tensor:
    shell: torch.Tensor = _opaque_tensor_expand_fake(int(token))
    return shell


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


# Properties whose value is a view of the tensor's value, not metadata: read on the value, as
# methods are (``t.T`` as ``t.t()``), so that the view is one of that value (a change through
# it moves the value's version counter, which a pool serving the value watches).
_VALUE_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH"})


def _is_passthrough(func: Callable[..., Any]) -> bool:
    if func in _METADATA_FUNCTIONS or func in _NOWRAP_FUNCTIONS:
        return True
    name = getattr(func, "__name__", "")
    if name == "__get__":
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return prop not in _VALUE_VIEW_PROPERTIES
    return name in ("__set__", "__delete__")


def _expand(value: Any) -> Any:
    if isinstance(value, OpaqueTensor):
        return opaque_to_final_tensor(value)
    if isinstance(value, OpaqueTensorRef):
        return opaque_to_final_tensor(value.opaque_tensor)
    if type(value) in (list, tuple):
        return type(value)(_expand(v) for v in value)
    return value


def _expanded(args: tuple[Any, ...]) -> list[Any]:
    """The positional arguments ``args`` expanded: plain tensors, the most common ones, skip
    the call (this runs on every op)."""
    return [a if type(a) is torch.Tensor else _expand(a) for a in args]


def _expand_all(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(_expanded(args)), {k: _expand(v) for k, v in kwargs.items()} if kwargs else {}


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


def _runs_expanded(func: Callable[..., Any]) -> bool:
    """Whether :meth:`OpaqueTensor.__torch_function__` runs ``func``, given no keyword
    arguments and writing no argument of its own, on the expanded values of its arguments
    (:func:`_call_on_values`): no metadata query, no aten op called as such (which may go down
    to ``__torch_dispatch__``)."""
    return not isinstance(func, _ATEN_OPS) and not _is_passthrough(func)


def _call_on_values(func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """:func:`_call_expanded` of a ``func`` that :func:`_runs_expanded`, given positional
    arguments alone."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*_expanded(args))


class OpaqueTensor(torch.Tensor):
    """A tensor whose value is produced on demand by :meth:`to_base_tensor`.

    Subclasses build a storage-less shell with :meth:`_make_shell` (shape, dtype and the device
    the value lives on) and implement :meth:`_to_base_tensor`. Every torch operation on an
    opaque tensor runs on the expanded value and returns a plain ``torch.Tensor``; metadata
    queries (``shape``, ``dtype``, ``device``, ``numel()``) answer from the shell without
    expanding. An operation that would write the tensor in place (``mul_``, ``t[i] = v``,
    ``out=t``, ``out=(t, indices)``, ``torch.ops.aten.add_.Scalar(t, 1)``) raises
    :class:`T2NErrorNotImplemented`: it would change an expanded copy, and the change would be
    lost.

    ``detach()`` and ``requires_grad_()`` return the tensor itself, so that
    ``nn.Parameter(opaque, requires_grad=False)`` keeps the opaque type. ``data`` returns the
    tensor itself to keep access to its special attributes.

    A subclass written for upstream torch-to-nnef, whose ``__new__`` calls
    ``super().__new__(cls, fp_tensor)``, gets a shell reporting the shape, dtype and device of
    ``fp_tensor`` (which is not kept: the subclass keeps what it needs in ``__init__``).
    """

    t2n_supports_grad: ClassVar[bool] = False
    """Opaque values carry no autograd history (see ``utils.can_require_grad``)."""

    nnef_name: str | None
    """The tensor's name in the model, once given (by ``set_opaque_tensor_in_params_as_ref``
    or, for a ``QTensor``, at creation: ``None``)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Build a storage-less shell with the shape, dtype and device of ``elem``."""
        if not isinstance(elem, torch.Tensor):
            raise T2NErrorMisuse(
                f"{cls.__name__}(elem, ...) takes the tensor whose shape, dtype and device it "
                f"reports, got {type(elem).__name__}"
            )
        return OpaqueTensor._make_shell(cls, elem.shape, elem.dtype, elem.device)

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

        While ``torch.jit.trace`` runs, the expansion goes through the registered custom op
        ``t2n::opaque_tensor_expand`` (an integer token) so that the trace records it; while
        ``torch.compile`` runs, through ``t2n::opaque_tensor_expand_named`` (the same token
        as a string, which compiled code guards on, and a tag of the process).
        """
        if torch._C._get_tracing_state() is not None:
            result: torch.Tensor = torch.ops.t2n.opaque_tensor_expand(_trace_token(self))
            return result
        if torch.compiler.is_compiling():
            token = str(_trace_token(self))
            named: torch.Tensor = torch.ops.t2n.opaque_tensor_expand_named(_PROCESS_TAG, token)
            return named
        return self._to_base_tensor()

    def to_trace_tensor(self, device: str | torch.device | None) -> torch.Tensor:
        """Return what a trace should compute with in place of this tensor.

        With ``device="meta"`` and a floating point dtype, a meta tensor of this tensor's shape
        and dtype: nothing is read nor decompressed, which suits operations that only
        propagate shapes (``linear``, ``matmul``, views). Integer values (codebooks, indices)
        are expanded even then, since a trace may read them. Any other ``device`` (``None``,
        ``"cpu"``, ...) gives the expanded value, as :meth:`to_base_tensor` does.
        """
        if (
            device is not None
            and torch.device(device).type == "meta"
            and self.dtype.is_floating_point
        ):
            return torch.empty(tuple(self.shape), dtype=self.dtype, device="meta")
        return self.to_base_tensor()

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

    # -- no memory of its own ----------------------------------------------------------------
    # Each expansion makes a new value: an address or a storage would be that of a copy
    # freed at once, read afterwards by whoever asked (a serializer such as safetensors) or
    # taken for a storage two tensors share.
    def data_ptr(self) -> NoReturn:
        """Refused: the tensor has no memory of its own (use its value).

        Raises:
            T2NErrorNotImplemented: always, naming what to use instead.
        """
        raise self._no_memory("data_ptr()")

    def untyped_storage(self) -> NoReturn:
        """Refused, as :meth:`data_ptr`.

        Raises:
            T2NErrorNotImplemented: always.
        """
        raise self._no_memory("untyped_storage()")

    def storage(self) -> NoReturn:
        """Refused, as :meth:`data_ptr`.

        Raises:
            T2NErrorNotImplemented: always.
        """
        raise self._no_memory("storage()")

    def _no_memory(self, what: str) -> T2NErrorNotImplemented:
        return T2NErrorNotImplemented(
            f"{type(self).__name__} has no memory of its own for {what}: its value is made "
            "anew at each use. Use the value (opaque_to_final_tensor(t)); to save it, save "
            "what it keeps (for a QTensor, write_in_file() or its offload state)"
        )

    def requires_grad_(self, mode: bool = False) -> OpaqueTensor:  # type: ignore[override]
        """Accept ``requires_grad_(False)`` and return the tensor itself.

        Args:
            mode: must be ``False`` (the default): opaque tensors cannot require gradients.

        Raises:
            T2NErrorMisuse: ``mode`` is true (upstream torch-to-nnef ignores it silently; a
                training loop would then get no gradient without notice).
        """
        if mode:
            raise T2NErrorMisuse(
                f"{type(self).__name__} cannot require gradients; "
                "wrap it with nn.Parameter(tensor, requires_grad=False)"
            )
        return self

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        """``False``: opaque tensors cannot require gradients; setting it true is refused, as
        :meth:`requires_grad_` refuses it (torch's own setter accepted it, and a training
        loop then got no gradient without notice)."""
        return bool(torch._C.TensorBase.requires_grad.__get__(self))  # type: ignore[attr-defined]

    @requires_grad.setter
    def requires_grad(self, mode: bool) -> None:
        self.requires_grad_(mode)

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
        kwargs = kwargs or {}
        written = args[0] if args and _writes_first_argument(func) else kwargs.get("out")
        if isinstance(written, OpaqueTensor):
            raise _in_place_refusal(func, type(written))
        if _goes_to_dispatch(func, kwargs):
            # An aten op called as such, whose schema names what it writes, is written
            # here: one that torch decomposes before dispatch (fill_diagonal_) never
            # reaches it whole.
            places = _places_written(_overload(func), args, kwargs)
            if places:
                return _write_places(_overload(func), args, kwargs, places)
            # The shells record no history: autograd, above dispatch, would give them some.
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _call_expanded(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        written = _places_written(func, args, kwargs)
        if written:
            return _write_places(func, args, kwargs, written)
        args, kwargs = _expand_all(args, kwargs)
        return func(*args, **kwargs)

    @classmethod
    def _write_at_dispatch(
        cls,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        places: list[int | str],
    ) -> Any:
        """Run the aten op ``func``, which writes the opaque tensors at ``places``.

        Refused here: it would change expanded copies (or a value a pool serves to others),
        and the change would be lost. Subclasses whose value can be written override it.

        Raises:
            T2NErrorNotImplemented: always.
        """
        raise _in_place_refusal(func, cls)


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
    t2n_supports_grad: ClassVar[bool] = False

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
        """Return the reference itself; ``requires_grad`` is ignored (references have no grad).

        ``nn.Parameter(ref)`` calls it while wrapping the reference.
        """
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

    Each opaque tensor gets the ``nnef_name`` of its path (its first one when tied), which its
    reference reports.
    """
    updater = ModTensorUpdater(model)
    for names, tensor in list(updater.iter_tensors()):
        if isinstance(tensor, OpaqueTensor):
            tensor.nnef_name = names[0]
            meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
            updater.update_by_ref(tensor, OpaqueTensorRef(meta, tensor))


def find_opaque_ref_by_py_id(module: torch.nn.Module, py_id: int) -> OpaqueTensorRef:
    """Return the parameter of ``module`` that references the opaque tensor ``id(...) == py_id``.

    After :func:`set_opaque_tensor_in_params_as_ref`, a parameter is an
    :class:`OpaqueTensorRef`; this finds it back from the Python id of the opaque tensor it
    stands for (tied parameters are the same reference).

    Args:
        module: the module whose parameters are searched.
        py_id: ``id()`` of the opaque tensor the reference stands for.

    Raises:
        T2NErrorTorchJitTraceFailed: no parameter of ``module`` references that tensor.
    """
    for _, param in get_named_parameters(module):
        if isinstance(param, OpaqueTensorRef) and id(param.opaque_tensor) == py_id:
            return param
    raise T2NErrorTorchJitTraceFailed(
        f"no parameter of this {type(module).__name__} references the opaque tensor with "
        f"id {py_id}; call set_opaque_tensor_in_params_as_ref(module) first, and keep the "
        "opaque tensor alive"
    )


# ---------------------------------------------------------------------------------------------
# Offload state: describe an opaque tensor as a dict of tensors and plain values.
# ---------------------------------------------------------------------------------------------
OFFLOAD_STATE_KEY = "__t2n_offload_state__"
"""The key of an offload state naming the class that rebuilds it (its ``OFFLOAD_STATE_TAG``)."""

_OFFLOAD_STATE_CLASSES: dict[str, type[SupportsOffloadState]] = {}


class SupportsOffloadState:
    """Mixin by which an opaque tensor (or an object in its state) describes itself for
    storage, without pickle.

    A subclass implements:

    - :meth:`to_offload_state`: a dict whose :data:`OFFLOAD_STATE_KEY` entry is the class's
      ``OFFLOAD_STATE_TAG`` and whose other values are tensors, ``None``, booleans, numbers,
      strings, ``torch.dtype``, ``torch.device``, ``torch.Size``, objects implementing
      ``SupportsOffloadState`` themselves (a quantization scheme), or lists, tuples and
      str-keyed dicts of them;
    - :meth:`from_offload_state` (the inverse);
    - optionally :meth:`write_offload_state_in_file`, which writes an inference engine's file
      straight from a state.

    The storage layer writes the tensors of a state as the entries of a payload file and the
    rest as JSON; reading it back never runs code from the file. Each class is registered under
    its ``OFFLOAD_STATE_TAG`` (by default ``"module.QualName"``; a subclass that does not
    declare one gets its own default tag); two classes cannot claim the same tag.
    """

    OFFLOAD_STATE_TAG: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("OFFLOAD_STATE_TAG") or f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(tag, str):
            raise T2NErrorMisuse(
                f"OFFLOAD_STATE_TAG of {cls.__qualname__} must be a str, got {tag!r}"
            )
        other = _OFFLOAD_STATE_CLASSES.get(tag)
        # A class defined again under the same name (a reloaded module) replaces the former one.
        if other is not None and (other.__module__, other.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise T2NErrorMisuse(
                f"offload state tag {tag!r} is already registered by {other.__module__}."
                f"{other.__qualname__}; give {cls.__qualname__} a distinct OFFLOAD_STATE_TAG"
            )
        cls.OFFLOAD_STATE_TAG = tag
        _OFFLOAD_STATE_CLASSES[tag] = cls

    @classmethod
    def is_offload_state(cls, state: Any) -> bool:
        """Whether ``state`` is an offload state of this class (its tag under the state key)."""
        return isinstance(state, dict) and state.get(OFFLOAD_STATE_KEY) == cls.OFFLOAD_STATE_TAG

    def to_offload_state(self) -> dict[str, Any]:
        """Return the offload state describing this value (see the class documentation).

        Raises:
            T2NErrorNotImplemented: the subclass does not implement it.
        """
        raise T2NErrorNotImplemented(f"{type(self).__name__} must implement to_offload_state()")

    @classmethod
    def from_offload_state(
        cls: type[_S], state: dict[str, Any], target_device: torch.device | str | None = None
    ) -> _S:
        """Rebuild a value from what :meth:`to_offload_state` returned.

        Args:
            state: the offload state (its tensors are where the storage layer read them).
            target_device: where to place the value; ``None`` leaves it where the state's
                tensors are.

        Raises:
            T2NErrorNotImplemented: the subclass does not implement it.
        """
        raise T2NErrorNotImplemented(f"{cls.__name__} must implement from_offload_state()")

    @classmethod
    def write_offload_state_in_file(
        cls,
        state: dict[str, Any],
        dirpath: str | os.PathLike[str],
        label: str,
        inference_target: Any = None,
    ) -> Path | None:
        """Write the inference engine's file of the value ``state`` describes.

        Lets an offloaded value be exported without being rebuilt in memory.

        Args:
            state: an offload state of this class.
            dirpath: the model folder.
            label: the tensor's label in the engine's graph; it names the file.
            inference_target: the engine (version) to write for; ``None``: the latest.

        Raises:
            T2NErrorNotImplemented: the class has no file format of its own.
        """
        raise T2NErrorNotImplemented(
            f"{cls.__name__} has no inference engine file format; only classes such as "
            "QTensorTractScaleOnly implement write_offload_state_in_file()"
        )


def resolve_offload_state(state: Any) -> type[SupportsOffloadState] | None:
    """Return the class registered for the tag of ``state``, or ``None``.

    ``None`` when ``state`` is not a dict holding a registered tag under
    :data:`OFFLOAD_STATE_KEY`.
    """
    if not isinstance(state, dict):
        return None
    tag = state.get(OFFLOAD_STATE_KEY)
    return _OFFLOAD_STATE_CLASSES.get(tag) if isinstance(tag, str) else None


def offload_state_class(tag: str) -> type[SupportsOffloadState]:
    """Return the class registered under ``tag``; raise :class:`T2NErrorStorage` if unknown."""
    try:
        return _OFFLOAD_STATE_CLASSES[tag]
    except KeyError:
        raise T2NErrorStorage(
            f"unknown offload class tag {tag!r}: import the module defining it before loading"
        ) from None
