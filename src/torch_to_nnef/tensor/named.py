"""Tensors that carry the name they will have in an exported graph.

A :class:`NamedTensor` is an ordinary tensor (same storage, same values) with an
``nnef_name`` attribute. :func:`apply_name_to_tensor_in_module` gives every parameter and
buffer of a model the name of its PyTorch path, so that code looking at a tensor in the middle
of a forward pass can tell which weight it is.

A saved ``NamedTensor`` (``torch.save(model.state_dict(), path)`` after naming) pickles as its
class: ``torch.load``, whose default is ``weights_only=True``, refuses its class until it is
declared safe, as for any tensor subclass. Declare it once before loading
(``torch.serialization.add_safe_globals([NamedTensor])``), or save plain tensors
(``{k: v.as_subclass(torch.Tensor) for k, v in state.items()}``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import get_default_nowrap_functions

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.opaque import OpaqueTensor, OpaqueTensorRef
from torch_to_nnef.tensor.updater import ModTensorUpdater

__all__ = ["NamedTensor", "apply_name_to_tensor_in_module", "get_or_add_named_tensor"]

LOGGER = logging.getLogger(__name__)

_NOWRAP_FUNCTIONS = get_default_nowrap_functions()

# Operations whose result is the same value in another place or form: the result keeps the name.
_NAME_KEEPING_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.clone,
        torch.clone,
        torch.Tensor.detach,
        torch.detach,
        torch.Tensor.to,
        torch.Tensor.cpu,
        torch.Tensor.cuda,
    }
)


def _strip_names(result: Any, inputs: tuple[Any, ...]) -> Any:
    """Turn new NamedTensor results into plain tensors; inputs returned as-is stay named."""
    if isinstance(result, NamedTensor):
        if any(result is arg for arg in inputs):
            return result
        return result.as_subclass(torch.Tensor)
    if type(result) in (list, tuple):
        return type(result)(_strip_names(item, inputs) for item in result)
    return result


def _check_owns_storage(value: Any) -> None:
    """Refuse what a NamedTensor cannot share the storage of: no tensor, or an opaque one (an
    offloaded or quantized tensor has no plain storage; sharing its shell crashes torch)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, (OpaqueTensor, OpaqueTensorRef)):
        raise T2NErrorMisuse(
            "NamedTensor wraps a tensor that owns its storage; got "
            f"{type(value).__name__}. Opaque tensors cannot be named this way (use the "
            "values: reload() for an offloaded tensor, decompress() for a quantized one)"
        )


class NamedTensor(torch.Tensor):
    """A tensor carrying ``nnef_name``, the name it is known by in the model.

    It shares the storage of the tensor it is built from: no copy is made and writes through
    either are visible in both. Torch operations on it return plain ``torch.Tensor`` values
    (a sum of two weights has no name), except:

    - ``clone()``, ``detach()``, ``to()``, ``cpu()`` and ``cuda()`` return a
      :class:`NamedTensor` with the same name (the same value, elsewhere or in another dtype);
    - in-place operations return the tensor itself, as for any tensor.

    ``data`` returns the tensor itself so that its name stays reachable through
    ``param.data``; assigning ``data`` replaces the values in place and keeps the name (this is
    what ``module.half()`` or ``module.to(dtype)`` do). ``nn.Parameter(named, requires_grad=...)``
    returns a :class:`NamedTensor` that is a parameter.

    Under ``torch.compile``, each operation on a NamedTensor runs outside the compiled graph (a
    graph break), with the same values as without compiling: torch's AOT autograd cannot take
    a NamedTensor as a graph input. ``fullgraph=True`` is therefore refused; compile a model
    whose tensors are not named. ``torch.export`` keeps the operations in its graph.

    Args:
        fp_tensor: the tensor to name; it must own storage (an opaque tensor cannot be named
            this way).
        nnef_name: the name, usually the dotted PyTorch path (``"encoder.0.weight"``).

    Raises:
        T2NErrorMisuse: ``fp_tensor`` is not a tensor with storage, or ``nnef_name`` is not a
            non-empty string.
    """

    nnef_name: str

    @staticmethod
    def __new__(cls, fp_tensor: torch.Tensor, nnef_name: str) -> NamedTensor:
        _check_owns_storage(fp_tensor)
        if not isinstance(nnef_name, str) or not nnef_name:
            raise T2NErrorMisuse(f"nnef_name must be a non-empty str, got {nnef_name!r}")
        named: NamedTensor = torch.Tensor._make_subclass(cls, fp_tensor, False)
        if _eager_apply is None:
            _make_eager_apply()
        return named

    def __init__(self, fp_tensor: torch.Tensor, nnef_name: str) -> None:
        super().__init__()
        self.nnef_name = nnef_name

    def __setstate__(self, state: Any) -> None:
        """Restore a NamedTensor that unpickling built (``torch.load``, ``pickle``): as the
        constructor does, make the function that compiled graphs skip first (unpickling
        builds the tensor without the constructor)."""
        if _eager_apply is None:
            _make_eager_apply()
        torch._utils._set_obj_state(self, state)

    def _renamed(self, value: torch.Tensor) -> NamedTensor:
        """View ``value`` (a plain tensor) as a NamedTensor with this tensor's name.

        Unlike the constructor, this keeps ``value``'s autograd history, so that
        ``weight.to(dtype)`` inside a forward pass still propagates gradients to ``weight``.
        """
        named = value.as_subclass(NamedTensor)
        named.nnef_name = self.nnef_name
        return named

    # -- data ---------------------------------------------------------------------------------
    @property  # type: ignore[override]
    def data(self) -> NamedTensor:
        """The tensor itself, so that ``param.data.nnef_name`` works."""
        return self

    @data.setter
    def data(self, new_data: torch.Tensor) -> None:
        """Replace the values (and possibly dtype or device) in place, keeping the name.

        Raises:
            T2NErrorMisuse: ``new_data`` is not a tensor that owns its storage (an opaque
                tensor: write its values instead, ``new_data.reload()`` for an offloaded one).
        """
        _check_owns_storage(new_data)
        torch._C.TensorBase.data.__set__(self, new_data)  # type: ignore[attr-defined]

    # -- copies -------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> NamedTensor:
        if id(self) in memo:
            copied: NamedTensor = memo[id(self)]
            return copied
        with torch.no_grad():
            values = self.as_subclass(torch.Tensor).clone()
        copied = NamedTensor(values, self.nnef_name)
        copied.requires_grad_(self.requires_grad)
        memo[id(self)] = copied
        extra = {k: v for k, v in self.__dict__.items() if k != "nnef_name"}
        copied.__dict__.update(copy.deepcopy(extra, memo))
        return copied

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        shape = tuple(self.shape)
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"NamedTensor(nnef_name={self.nnef_name!r}, shape={shape}, dtype={self.dtype}, "
            f"device={self.device}{grad})"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():
            return _apply_outside_compiled_graph(func, args, kwargs)
        return _apply(func, args, kwargs)


def _apply(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Run ``func`` on the tensors as plain tensors, naming its result as NamedTensor says."""
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
        if func in _NOWRAP_FUNCTIONS:
            return result
        if func in _NAME_KEEPING_FUNCTIONS and args and isinstance(args[0], NamedTensor):
            if result is args[0]:
                return result
            return args[0]._renamed(result)
        return _strip_names(result, args)


def _apply_outside_compiled_graph(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """:func:`_apply`, as a graph break of ``torch.compile``: run eagerly, so that no
    operation of a compiled graph is ever given a NamedTensor.

    AOT autograd (the inductor and aot_eager backends) runs the first call of each compiled
    graph under a dispatch mode that checks custom operators. On torch 2.13 that mode refuses
    any input whose type is not a plain tensor (for a parameter: whose ``data`` is not),
    leaving it to the ``__torch_dispatch__`` of its class, which a NamedTensor has not: the
    call fails with a ``TypeError`` from inside torch (pytorch/pytorch#193932). A named buffer
    is such an input, and so is a named parameter, its ``data`` being itself.
    """
    return (_eager_apply or _make_eager_apply())(func, args, kwargs)


def _make_eager_apply() -> Callable[..., Any]:
    """Make :data:`_eager_apply`, once: as the first NamedTensor is built, before any
    compiled graph can trace an operation on one (made while dynamo traces, the call that
    makes it would be one more graph break, and under ``fullgraph=True`` the error would
    name it instead of the reason below)."""
    global _eager_apply
    if _eager_apply is None:
        _eager_apply = torch.compiler.disable(
            _apply,
            reason="operations on a NamedTensor run outside compiled graphs; for one whole "
            "graph (fullgraph=True), compile a model whose tensors are not named "
            "(named.as_subclass(torch.Tensor) is a plain tensor sharing the values)",
        )
    return _eager_apply


_eager_apply: Callable[..., Any] | None = None
""":func:`_apply` as ``torch.compiler.disable`` makes it: dynamo skips it. Made by the first
NamedTensor, not at import: ``torch.compiler.disable`` imports dynamo, which takes longer
than importing torch, in every process that imports the package, names or not."""


def get_or_add_named_tensor(
    ids_to_ntensor: dict[int, NamedTensor],
    ref_mod: torch.nn.Module,
    attr_name: str,
    full_name: str,
    data: torch.Tensor,
) -> NamedTensor:
    """Return the :class:`NamedTensor` of the tensor ``ref_mod.<attr_name>``, making it once.

    ``ids_to_ntensor`` maps the ``id()`` of tensors already named to their
    :class:`NamedTensor`: a tensor met again under another path (a tied weight) gets the one
    made the first time, named after its first path. Otherwise ``NamedTensor(data,
    full_name)`` is made and recorded.

    Args:
        ids_to_ntensor: the record of tensors named so far, updated in place.
        ref_mod: the module holding the tensor.
        attr_name: the tensor's attribute name on ``ref_mod``.
        full_name: the tensor's dotted path, its name when it is met first.
        data: the values of the NamedTensor to make (usually the tensor itself).

    Raises:
        T2NErrorMisuse: ``ref_mod`` has no attribute ``attr_name``.
    """
    try:
        held = getattr(ref_mod, attr_name)
    except AttributeError:
        raise T2NErrorMisuse(
            f"{type(ref_mod).__name__} has no attribute {attr_name!r} to name {full_name!r}"
        ) from None
    named = ids_to_ntensor.get(id(held))
    if named is None:
        named = ids_to_ntensor[id(held)] = NamedTensor(data, nnef_name=full_name)
    else:
        LOGGER.debug("shared tensor %r is named %r", full_name, named.nnef_name)
    return named


def apply_name_to_tensor_in_module(model: torch.nn.Module) -> None:
    """Turn every parameter and buffer of ``model`` into a :class:`NamedTensor`.

    Each tensor is named after its dotted PyTorch path (``"layers.0.attn.q.weight"``). A
    tensor reachable by several paths (tied weights, such as a transformer's token embedding
    and LM head) becomes one :class:`NamedTensor`, named after its first path in module
    registration order, and stays shared by every module that held it. Parameters stay
    parameters (with the same ``requires_grad``), buffers stay buffers, values and storage are
    unchanged.

    Tensors that already are :class:`NamedTensor` keep their name; opaque tensors
    (:class:`~torch_to_nnef.tensor.opaque.OpaqueTensor` and references to them) are left as
    they are.
    """
    updater = ModTensorUpdater(model, add_buffers=True)
    for names, tensor in list(updater.iter_tensors()):
        if isinstance(tensor, (OpaqueTensor, OpaqueTensorRef, NamedTensor)):
            continue
        if len(names) > 1:
            LOGGER.debug("shared tensor %s is named %r", names, names[0])
        updater.update_by_ref(tensor, NamedTensor(tensor, names[0]))
