"""Replace the tensors of a model without breaking the references they share.

A transformer usually ties its token embedding and its LM head: one parameter object is held by
two modules. Assigning a new tensor to one of them (``model.lm_head.weight = ...``) silently
unties them. :class:`ModTensorUpdater` indexes, once, every place of a model that holds each
tensor, and replaces a tensor in all of them at once.

This module knows nothing of the library's tensor subclasses: whether a replacement may require
gradients is asked of :func:`~torch_to_nnef.tensor.utils.can_require_grad`.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from torch_to_nnef.exceptions import T2NErrorInconsistentTensor, T2NErrorMisuse
from torch_to_nnef.tensor.utils import can_require_grad

__all__ = ["ModTensorUpdater", "TensorHoldKind"]


class TensorHoldKind(str, enum.Enum):
    """How a module holds a tensor: as a parameter, a buffer or a plain attribute."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    UNREGISTRED = "unregistred"
    """A plain tensor attribute, neither parameter nor buffer (upstream's spelling)."""
    UNREGISTERED = "unregistred"  # an alias of UNREGISTRED, correctly spelled


@dataclass(eq=False)
class _Slot:
    """One place holding a tensor: ``module.<local_name>`` of a given kind.

    A module registered under several paths gives one slot several names.
    """

    module: nn.Module
    local_name: str
    kind: TensorHoldKind
    names: list[str] = field(default_factory=list)

    def read(self) -> torch.Tensor | None:
        if self.kind is TensorHoldKind.PARAMETER:
            return self.module._parameters.get(self.local_name)
        if self.kind is TensorHoldKind.BUFFER:
            return self.module._buffers.get(self.local_name)
        value = self.module.__dict__.get(self.local_name)
        return value if isinstance(value, torch.Tensor) else None

    def write(self, tensor: torch.Tensor) -> None:
        # Write the module's own dictionaries: `Module.__setattr__` would re-register a
        # parameter assigned to a plain attribute and refuses non-parameters in `_parameters`.
        if self.kind is TensorHoldKind.PARAMETER:
            self.module._parameters[self.local_name] = tensor  # type: ignore[assignment]
        elif self.kind is TensorHoldKind.BUFFER:
            self.module._buffers[self.local_name] = tensor
        else:
            self.module.__dict__[self.local_name] = tensor


@dataclass(eq=False)
class _Entry:
    """A tensor and every slot holding it (keyed by ``id(slot)``, in discovery order)."""

    tensor: torch.Tensor
    slots: dict[int, _Slot] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for slot in self.slots.values() for name in slot.names)


def _held_tensors(module: nn.Module, kind: TensorHoldKind) -> Iterator[tuple[str, torch.Tensor]]:
    if kind is TensorHoldKind.PARAMETER:
        items: Iterable[tuple[str, object]] = module._parameters.items()
    elif kind is TensorHoldKind.BUFFER:
        items = module._buffers.items()
    else:
        items = vars(module).items()
    for local, value in items:
        if isinstance(value, torch.Tensor):
            yield local, value


def _describe(names: Iterable[str]) -> str:
    listed = list(names)
    if len(listed) == 1:
        return repr(listed[0])
    return f"{listed[0]!r} (tied with {', '.join(repr(n) for n in listed[1:])})"


class ModTensorUpdater:
    """Replace parameters, buffers or tensor attributes of a model, keeping shared references.

    The model is indexed once at construction (linear in its number of modules and tensors);
    each update then costs time proportional to the number of places holding the replaced
    tensor. A tensor held by several modules (tied weights) is replaced in all of them by the
    same new object, so the tie survives the update.

    Replacements are written into the modules' own dictionaries. References to the old tensor
    kept elsewhere (an optimizer, a local variable, an attribute the updater does not index)
    still point to the old tensor.

    Update the model through the updater only while it is in use: a tensor reassigned
    directly on a module is unknown to the index.

    Args:
        model: the module whose tensors will be replaced.
        add_parameter_if_unset: when a parameter is replaced by a tensor that is not an
            ``nn.Parameter``, wrap it in one (``requires_grad`` as the replaced parameter for
            plain floating-point tensors, ``False`` for opaque tensors, which keep their type).
            When false, such a replacement raises :class:`T2NErrorMisuse`.
        add_buffers: also index registered buffers (parameters are always indexed).
        add_unregistred_tensor: also index plain tensor attributes of the modules (neither
            parameters nor buffers), including aliases of indexed tensors.
        disable_requires_grad: set ``requires_grad=False`` on every parameter now, and give
            replacements ``requires_grad=False`` (an ``nn.Parameter`` passed as the
            replacement included); :meth:`restore_require_grad` undoes it.
    """

    def __init__(
        self,
        model: nn.Module,
        add_parameter_if_unset: bool = True,
        add_buffers: bool = False,
        add_unregistred_tensor: bool = False,
        disable_requires_grad: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise T2NErrorMisuse(
                f"ModTensorUpdater takes the nn.Module whose tensors it replaces, got "
                f"{type(model).__name__}"
            )
        self._model = model
        self._add_parameter_if_unset = add_parameter_if_unset
        self._disable_requires_grad = disable_requires_grad
        self._entries: dict[int, _Entry] = {}
        self._slots_by_name: dict[str, _Slot] = {}
        self._grad_disabled: list[_Slot] = []
        self._index(model, add_buffers, add_unregistred_tensor)
        if disable_requires_grad:
            self._disable_grads()

    # -- index --------------------------------------------------------------------------------
    def _index(self, model: nn.Module, buffers: bool, unregistered: bool) -> None:
        # Parameters first, then buffers, then plain attributes, each in module order: a
        # tensor's first name is the one `model.named_parameters()` reports.
        modules = list(model.named_modules(remove_duplicate=False))
        kinds = [TensorHoldKind.PARAMETER]
        if buffers:
            kinds.append(TensorHoldKind.BUFFER)
        if unregistered:
            kinds.append(TensorHoldKind.UNREGISTERED)
        slots: dict[tuple[int, str], _Slot] = {}
        for kind in kinds:
            for prefix, module in modules:
                for local, tensor in _held_tensors(module, kind):
                    slot = slots.get((id(module), local))
                    if slot is None:
                        slot = slots[(id(module), local)] = _Slot(module, local, kind)
                        entry = self._entries.get(id(tensor))
                        if entry is None:
                            entry = self._entries[id(tensor)] = _Entry(tensor)
                        entry.slots[id(slot)] = slot
                    name = f"{prefix}.{local}" if prefix else local
                    slot.names.append(name)
                    self._slots_by_name[name] = slot

    def _disable_grads(self) -> None:
        for entry in self._entries.values():
            if not entry.tensor.requires_grad:
                continue
            param_slots = [s for s in entry.slots.values() if s.kind is TensorHoldKind.PARAMETER]
            if param_slots:
                entry.tensor.requires_grad_(False)
                self._grad_disabled.extend(param_slots)

    def _slot(self, name: str) -> _Slot:
        _check_name(name)
        try:
            return self._slots_by_name[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._slots_by_name, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise T2NErrorMisuse(
                f"no indexed tensor is named {name!r}{hint} "
                "(ModTensorUpdater.available_names lists them; buffers and plain tensor "
                "attributes are indexed only with add_buffers / add_unregistred_tensor)"
            ) from None

    def _entry(self, ref: torch.Tensor) -> _Entry:
        entry = self._entries.get(id(ref))
        if entry is None:
            raise T2NErrorMisuse(
                f"the model does not hold this {type(ref).__name__} of shape "
                f"{tuple(ref.shape)} in any indexed place (it was never indexed or was "
                "already replaced); pass the tensor the model currently holds, e.g. "
                "updater.get_by_name(name)"
            )
        return entry

    # -- checks -------------------------------------------------------------------------------
    @staticmethod
    def split_param_name(name: str) -> tuple[str, str]:
        """Split a dotted name into its module path and local name.

        ``"encoder.0.weight"`` gives ``("encoder.0", "weight")``; ``"weight"`` gives
        ``("", "weight")``.

        Args:
            name: a parameter or buffer name, dotted from the root module.
        """
        _check_name(name)
        module_name, _, local_name = name.rpartition(".")
        return module_name, local_name

    def check_same_dtype(self, tensor0: torch.Tensor, tensor1: torch.Tensor) -> None:
        """Raise :class:`T2NErrorInconsistentTensor` if ``tensor0`` and ``tensor1`` differ in
        dtype."""
        _raise_mismatches(["dtype"], tensor0, tensor1)

    def check_same_device(self, tensor0: torch.Tensor, tensor1: torch.Tensor) -> None:
        """Raise :class:`T2NErrorInconsistentTensor` if ``tensor0`` and ``tensor1`` differ in
        device."""
        _raise_mismatches(["device"], tensor0, tensor1)

    def check_same_shape(self, tensor0: torch.Tensor, tensor1: torch.Tensor) -> None:
        """Raise :class:`T2NErrorInconsistentTensor` if ``tensor0`` and ``tensor1`` differ in
        shape."""
        _raise_mismatches(["shape"], tensor0, tensor1)

    def check_consistency(self, tensor0: torch.Tensor, tensor1: torch.Tensor) -> None:
        """Raise :class:`T2NErrorInconsistentTensor` if ``tensor0`` and ``tensor1`` differ in
        device, dtype or shape; the message lists every difference."""
        _raise_mismatches(_CHECKED, tensor0, tensor1)

    def maybe_parameterize(self, ref: torch.Tensor, new_tensor: torch.Tensor) -> torch.Tensor:
        """Return ``new_tensor`` as the model would hold it in place of ``ref``.

        Where ``ref`` is held as a parameter and ``new_tensor`` is not an ``nn.Parameter``,
        and ``add_parameter_if_unset`` is true, the result is ``nn.Parameter(new_tensor)``
        (requiring gradients when ``ref`` did, ``disable_requires_grad`` is false and
        ``new_tensor`` can: plain floating point values, not opaque ones, which keep their
        type). Otherwise ``new_tensor`` itself, unchanged.

        Raises:
            T2NErrorMisuse: the model does not hold ``ref``.
        """
        entry = self._entry(ref)
        return self._parameterized(entry, list(entry.slots.values()), new_tensor)

    def _parameterized(
        self, entry: _Entry, slots: list[_Slot], new_tensor: torch.Tensor
    ) -> torch.Tensor:
        if (
            isinstance(new_tensor, nn.Parameter)
            or not self._add_parameter_if_unset
            or not any(slot.kind is TensorHoldKind.PARAMETER for slot in slots)
        ):
            return new_tensor
        requires_grad = (
            entry.tensor.requires_grad
            and not self._disable_requires_grad
            and can_require_grad(new_tensor)
        )
        return nn.Parameter(new_tensor, requires_grad=requires_grad)

    # -- queries ------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module this updater was built for."""
        return self._model

    @property
    def add_parameter_if_unset(self) -> bool:
        """Whether a parameter replaced by a plain tensor is wrapped in an ``nn.Parameter``."""
        return self._add_parameter_if_unset

    @property
    def id_to_names(self) -> dict[int, frozenset[str]]:
        """Every indexed tensor's ``id()`` mapped to all its names (a snapshot)."""
        return {key: frozenset(entry.names) for key, entry in self._entries.items()}

    @property
    def id_to_kind(self) -> dict[int, TensorHoldKind]:
        """Every indexed tensor's ``id()`` mapped to how it is held (a snapshot).

        A tensor held both as a parameter and otherwise counts as a parameter.
        """
        return {
            key: min((slot.kind for slot in entry.slots.values()), key=_KIND_ORDER.index)
            for key, entry in self._entries.items()
        }

    @property
    def id_to_modules(self) -> dict[int, list[nn.Module]]:
        """Every indexed tensor's ``id()`` mapped to the modules holding it (a snapshot).

        Tied weights list every module they are shared by, e.g. to check that all of them are
        of a kind a quantization supports.
        """
        return {
            key: [slot.module for slot in entry.slots.values()]
            for key, entry in self._entries.items()
        }

    @property
    def name_to_id(self) -> dict[str, int]:
        """Every indexed name mapped to the ``id()`` of the tensor it holds now (a snapshot)."""
        return {name: id(entry.tensor) for entry in self._entries.values() for name in entry.names}

    @property
    def name_to_parent_module(self) -> dict[str, nn.Module]:
        """Every indexed name mapped to the module holding the tensor (a snapshot)."""
        return {name: slot.module for name, slot in self._slots_by_name.items()}

    @property
    def available_names(self) -> list[str]:
        """Every indexed name, tied tensors included once per name, in model order."""
        return list(self._slots_by_name)

    def get_by_name(self, name: str) -> torch.Tensor:
        """Return the tensor the model currently holds under ``name``.

        Raises:
            T2NErrorMisuse: ``name`` is not indexed (the message suggests close names).
        """
        value = self._slot(name).read()
        if value is None:
            raise T2NErrorMisuse(f"{name!r} no longer holds a tensor in the model")
        return value

    def names_of(self, tensor: torch.Tensor) -> tuple[str, ...]:
        """Return every name under which the model holds ``tensor`` (empty if it does not)."""
        entry = self._entries.get(id(tensor))
        return entry.names if entry is not None else ()

    def iter_tensors(self) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Yield ``(names, tensor)`` once per distinct indexed tensor.

        ``names`` lists every name of the tensor, the first one being its first path in module
        registration order (as long as it was not replaced). Do not update the model while
        iterating; iterate over ``list(updater.iter_tensors())`` to do so.
        """
        for entry in self._entries.values():
            yield entry.names, entry.tensor

    # -- updates ------------------------------------------------------------------------------
    def update_by_ref(
        self,
        ref: torch.Tensor,
        new_tensor: torch.Tensor,
        enforce_tensor_consistency: bool = True,
    ) -> torch.Tensor:
        """Replace ``ref`` by ``new_tensor`` everywhere the model holds it.

        Args:
            ref: a tensor the model holds (the very object, e.g. ``model.fc.weight``).
            new_tensor: its replacement; it may be any tensor subclass, opaque tensors
                included. Where ``ref`` was a parameter, a replacement that is not an
                ``nn.Parameter`` is wrapped in one (see :meth:`maybe_parameterize`).
            enforce_tensor_consistency: check that both tensors report the same device, dtype
                and shape.

        Returns:
            The tensor now held by the model (``new_tensor`` or the parameter wrapping it).

        Raises:
            T2NErrorMisuse: the model does not hold ``ref`` (never indexed, or already
                replaced), or a parameter would be replaced by a non-parameter while
                ``add_parameter_if_unset`` is false.
            T2NErrorInconsistentTensor: the tensors differ in device, dtype or shape; the
                message gives both values.
        """
        entry = self._entry(ref)
        if new_tensor is ref:
            return ref
        _check_tensor(new_tensor)
        return self._replace(
            entry, list(entry.slots.values()), new_tensor, enforce_tensor_consistency
        )

    def update_by_name(
        self,
        name: str,
        new_tensor: torch.Tensor,
        tie_replacements: bool = True,
        enforce_tensor_consistency: bool = True,
    ) -> torch.Tensor:
        """Replace the tensor the model holds under ``name``.

        Args:
            name: a dotted name from :attr:`available_names`.
            new_tensor: the replacement (see :meth:`update_by_ref`).
            tie_replacements: when true (the default) every other place holding the same
                tensor gets the replacement too, keeping ties; when false only ``name`` is
                replaced and the tie is broken.
            enforce_tensor_consistency: check device, dtype and shape as in
                :meth:`update_by_ref`.

        Returns:
            The tensor now held under ``name``.

        Raises:
            T2NErrorMisuse: ``name`` is unknown, or was reassigned outside this updater.
            T2NErrorInconsistentTensor: see :meth:`update_by_ref`.
        """
        slot = self._slot(name)
        current = slot.read()
        entry = self._entries.get(id(current)) if current is not None else None
        if entry is None or id(slot) not in entry.slots:
            raise T2NErrorMisuse(
                f"{name!r} was reassigned outside this ModTensorUpdater; build a new "
                "ModTensorUpdater after changing the model directly"
            )
        if new_tensor is entry.tensor:
            return new_tensor
        _check_tensor(new_tensor)
        slots = list(entry.slots.values()) if tie_replacements else [slot]
        return self._replace(entry, slots, new_tensor, enforce_tensor_consistency, first=name)

    def restore_require_grad(self) -> None:
        """Set ``requires_grad=True`` again where ``disable_requires_grad`` removed it.

        This applies to the tensors those parameters hold now, replacements included. Values
        that cannot require gradients (opaque tensors, integer dtypes) are left as they are.
        """
        for slot in self._grad_disabled:
            tensor = slot.read()
            if tensor is not None and not tensor.requires_grad and can_require_grad(tensor):
                tensor.requires_grad_(True)

    # -- internals ----------------------------------------------------------------------------
    def _replace(
        self,
        entry: _Entry,
        slots: list[_Slot],
        new_tensor: torch.Tensor,
        check: bool,
        first: str | None = None,
    ) -> torch.Tensor:
        names = [name for slot in slots for name in slot.names]
        if first is not None:
            names.remove(first)
            names.insert(0, first)
        if check:
            _raise_mismatches(_CHECKED, entry.tensor, new_tensor, names)
        new_tensor = self._parameterized(entry, slots, new_tensor)
        if self._disable_requires_grad and new_tensor.requires_grad and new_tensor.is_leaf:
            new_tensor.requires_grad_(False)  # a Parameter given as it is: as the others
        if not isinstance(new_tensor, nn.Parameter) and any(
            slot.kind is TensorHoldKind.PARAMETER for slot in slots
        ):
            raise T2NErrorMisuse(
                f"{_describe(names)} is a parameter and the replacement is a "
                f"{type(new_tensor).__name__}; pass an nn.Parameter or build "
                "ModTensorUpdater with add_parameter_if_unset=True"
            )
        for slot in slots:
            slot.write(new_tensor)
            del entry.slots[id(slot)]
        if not entry.slots:
            del self._entries[id(entry.tensor)]
        target = self._entries.get(id(new_tensor))
        if target is None:
            target = self._entries[id(new_tensor)] = _Entry(new_tensor)
        target.slots.update((id(slot), slot) for slot in slots)
        return new_tensor

    def __repr__(self) -> str:
        return (
            f"<ModTensorUpdater of {type(self._model).__name__}: {len(self._entries)} tensors "
            f"under {len(self._slots_by_name)} names>"
        )


_CHECKED = ("device", "dtype", "shape")
_KIND_ORDER = list(TensorHoldKind)


def _raise_mismatches(
    what: Iterable[str], old: torch.Tensor, new: torch.Tensor, names: list[str] | None = None
) -> None:
    """Raise :class:`T2NErrorInconsistentTensor` listing each of ``what`` that differs."""
    problems = []
    for attribute in what:
        before, after = getattr(old, attribute), getattr(new, attribute)
        if attribute == "shape":
            before, after = tuple(before), tuple(after)
        if before != after:
            problems.append(f"{attribute} {after} instead of {before}")
    if problems:
        subject = f"cannot replace {_describe(names)}" if names else "the tensors differ"
        raise T2NErrorInconsistentTensor(
            f"{subject}: the new tensor has {'; '.join(problems)}. "
            "Convert it first (e.g. new.to(old.device, old.dtype)), or pass "
            "enforce_tensor_consistency=False to change it on purpose"
        )


def _check_name(name: object) -> None:
    """Refuse a tensor name that is no string."""
    if not isinstance(name, str):
        raise T2NErrorMisuse(
            f"a tensor name must be a dotted str such as 'encoder.0.weight', got "
            f"{type(name).__name__} {name!r}"
        )


def _check_tensor(new_tensor: object) -> None:
    """Refuse a replacement that is no tensor, by name (before anything is replaced)."""
    if not isinstance(new_tensor, torch.Tensor):
        raise T2NErrorMisuse(
            f"a tensor replaces a model's tensor, got {type(new_tensor).__name__}; convert it "
            "first (e.g. torch.as_tensor(array))"
        )
