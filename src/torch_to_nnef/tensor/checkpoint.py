"""Offload whole models: write their tensors to payload files, or bind them to a checkpoint.

- :func:`offload_module` turns every parameter and buffer of a model into an
  :class:`~torch_to_nnef.tensor.offload.OffloadedTensor` backed by a payload file it owns.
- :func:`load_offloaded_checkpoint` binds the tensors of a model (typically built on the meta
  device, so that no memory is spent on its weights) to the tensors of a ``.safetensors``
  checkpoint, single-file or sharded, read in place without copying.

Both keep tied weights tied: a tensor reachable under several names becomes one offloaded
tensor, named after its first PyTorch path.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NErrorCheckpoint, T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.sizing import parse_bytes
from torch_to_nnef.tensor.storage._paths import path_argument
from torch_to_nnef.tensor.updater import ModTensorUpdater

__all__ = [
    "SAFETENSORS_INDEX_NAME",
    "CheckpointDescription",
    "describe_checkpoint",
    "load_offloaded_checkpoint",
    "offload_module",
]

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
"""Name of the index of a sharded checkpoint (``{"weight_map": {key: shard file}}``)."""

SAFETENSORS_SINGLE_NAME = "model.safetensors"
"""Name of a single-file checkpoint inside a checkpoint directory."""

PICKLE_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
"""Names of pickle checkpoints (``torch.save``), read only where pickle is allowed."""

LOGGER = logging.getLogger(__name__)

_M = TypeVar("_M", bound=nn.Module)


# ---------------------------------------------------------------------------------------------
# offload_module
# ---------------------------------------------------------------------------------------------
def offload_module(
    model: _M,
    offload_dir: str | os.PathLike[str] | None = None,
    *,
    include_buffers: bool = True,
    min_bytes: int | str = 0,
) -> _M:
    """Replace the parameters (and buffers) of ``model`` by offloaded tensors, in place.

    Each distinct tensor is written to its own payload file and replaced, everywhere the
    model holds it, by one :class:`OffloadedTensor` named after its first PyTorch path; tied
    weights stay tied. Parameters become ``nn.Parameter(offloaded, requires_grad=False)``.
    Tensors that are already offloaded are left as they are; quantized tensors with an
    offload state (``QTensor``) are offloaded as such.

    Args:
        model: the module to offload.
        offload_dir: where the payload files go; ``None`` for a private temporary directory.
        include_buffers: offload registered buffers too.
        min_bytes: keep tensors smaller than this many bytes resident (biases, norms); a
            count of bytes or a size such as ``"64KiB"`` (see
            :func:`~torch_to_nnef.tensor.sizing.parse_bytes`).

    Returns:
        ``model`` itself.

    Raises:
        T2NErrorMisuse: a tensor is on the meta device (use :func:`load_offloaded_checkpoint`),
            or ``min_bytes`` is negative or not a size.
        T2NErrorNotImplemented: an opaque tensor has no offload state.
        T2NErrorStorage: a payload file cannot be written. Tensors offloaded before the
            failure stay offloaded.
    """
    try:
        min_bytes = parse_bytes(min_bytes)
    except T2NErrorMisuse as exc:
        raise T2NErrorMisuse(f"offload_module(min_bytes=...): {exc}") from None
    updater = ModTensorUpdater(model, add_buffers=include_buffers)
    for names, tensor in list(updater.iter_tensors()):
        if isinstance(tensor, OffloadedTensor):
            continue
        if tensor.numel() * tensor.element_size() < min_bytes:
            continue
        tied = f" (tied with {', '.join(names[1:])})" if len(names) > 1 else ""
        offloaded = OffloadedTensor.from_original_tensor(
            tensor, names[0], offload_dir, suffix_log_msg=tied
        )
        updater.update_by_ref(tensor, offloaded)
    return model


# ---------------------------------------------------------------------------------------------
# load_offloaded_checkpoint
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """The tensors of a checkpoint: where each key lives, and the layout of each file.

    Keys of ``.safetensors`` files are read in place through their layouts; keys of pickle
    checkpoints (``pytorch_model.bin``, opened only where allowed) were read with
    ``torch.load(weights_only=True)`` and are held in ``loaded``.
    """

    source: Path
    files: Mapping[str, Path]  # safetensors key -> file
    layouts: Mapping[Path, storage.PayloadLayout]
    loaded: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Keys given other names (see renamed): the name -> the key its entry is stored under.
    stored: Mapping[str, str] = field(default_factory=dict)

    def __contains__(self, key: object) -> bool:
        return key in self.files or key in self.loaded

    def __iter__(self) -> Iterator[str]:
        """Every key, safetensors keys first."""
        yield from self.files
        yield from (key for key in self.loaded if key not in self.files)

    def describe(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of ``key``."""
        if key in self.files:
            spec = self.layouts[self.files[key]].entries[self.entry(key)]
            return spec.shape, spec.dtype
        value = self.loaded[key]
        return tuple(value.shape), value.dtype

    def layout(self, key: str) -> storage.PayloadLayout:
        return self.layouts[self.files[key]]

    def entry(self, key: str) -> str:
        """The name ``key``'s entry has in its file: ``key`` itself unless it was renamed."""
        return self.stored.get(key, key)

    def renamed(self, names: Mapping[str, str]) -> Checkpoint:
        """This checkpoint with some keys under other names (``names``: key -> its new name;
        the others keep theirs). The entries are unchanged: each is read in place under the
        key it is stored under.

        Raises:
            T2NErrorMisuse: two keys would have one name.
        """
        new = [names.get(key, key) for key in self]
        if len(set(new)) != len(new):
            twice = sorted({name for name in new if new.count(name) > 1})
            raise T2NErrorMisuse(f"renaming gives several checkpoint keys one name: {twice}")
        files = {names.get(key, key): path for key, path in self.files.items()}
        loaded = {names.get(key, key): value for key, value in self.loaded.items()}
        stored = {names.get(key, key): self.entry(key) for key in self}
        stored = {name: key for name, key in stored.items() if name != key}
        return Checkpoint(self.source, files, self.layouts, loaded, stored)

    def label(self, key: str) -> str:
        """``key`` quoted, and the key it is stored under when it was renamed."""
        entry = self.entry(key)
        return repr(key) if entry == key else f"{key!r} (checkpoint key {entry!r})"


@dataclass(frozen=True)
class PlannedBinding:
    """One distinct model tensor (all its names) and the checkpoint key that gives its value."""

    tensor: torch.Tensor
    names: tuple[str, ...]
    key: str
    dtype: torch.dtype  # the dtype the model gets (the checkpoint's, unless cast on load)


@dataclass(frozen=True)
class BindingPlan:
    """What binding a model to a checkpoint will do, checked before anything is bound."""

    checkpoint: Checkpoint
    updater: ModTensorUpdater
    bindings: list[PlannedBinding]
    unexpected: list[str]

    def offloaded(
        self,
        binding: PlannedBinding,
        *,
        device: torch.device | str | int,
        offload_dir: str | os.PathLike[str] | None,
    ) -> OffloadedTensor:
        """The offloaded tensor for ``binding``: the checkpoint entry read in place.

        An entry cast on load (``dtype`` differs) or read from a pickle checkpoint has no
        in-place form: its value is written once into a payload file of ``offload_dir``.
        """
        found, key = self.checkpoint, binding.key
        if key in found.files:
            offloaded = OffloadedTensor.from_safetensors(
                found.layout(key),
                found.entry(key),
                offload_dir=offload_dir,
                device=device,
                name=binding.names[0],
            )
            if offloaded.dtype != binding.dtype:
                offloaded.to(binding.dtype)
            return offloaded
        value = found.loaded[key].to(binding.dtype)
        return OffloadedTensor.from_original_tensor(value, binding.names[0], offload_dir).to(device)

    def bind_each(
        self,
        value_of: Callable[[int, PlannedBinding], torch.Tensor],
        rollback: BindingRollback,
    ) -> None:
        """Bind each planned tensor, in order, to ``value_of(index, binding)``; the plan's
        bindings are used up. ``rollback`` (entered on the model before) keeps each tensor
        replaced, to put it back if the binding does not end, but one holding memory that a
        value read into memory replaces: it lets go of that one, so that a model built with
        its weights frees each before the next value is made (loading takes one model's
        memory, not two)."""
        pending = self.bindings[::-1]
        self.bindings.clear()
        index = 0
        while pending:
            binding = pending.pop()
            value = value_of(index, binding)
            self.updater.update_by_ref(binding.tensor, value, enforce_tensor_consistency=False)
            if _holds_memory(binding.tensor) and not isinstance(value, OffloadedTensor):
                rollback.let_go(binding.tensor)
            del binding, value
            index += 1

    def resident(self, binding: PlannedBinding, device: torch.device | str | int) -> torch.Tensor:
        """The value of ``binding`` read into memory on ``device``."""
        found, key = self.checkpoint, binding.key
        if key in found.files:
            entry = found.entry(key)
            value = storage.read_payload(found.layout(key), names=[entry])[entry]
        else:
            value = found.loaded[key]
        return value.to(device=device, dtype=binding.dtype)


def _holds_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds its values in memory (neither on the meta device nor
    offloaded)."""
    return not tensor.is_meta and not isinstance(tensor, OffloadedTensor)


_LET_GO = object()
"""What a place of :class:`BindingRollback` holds once its tensor was let go."""

_NO_ATTRIBUTE = object()


class BindingRollback:
    """A ``with`` block binding a model all or nothing: when its body raises (an error, or
    Ctrl-C's ``KeyboardInterrupt``), every parameter and buffer of the model's modules is
    put back as it was when the rollback was made (each by the very tensor object it was,
    ties included; entries the body added are removed), so are the model's attributes named
    in ``attributes`` (removed where the model had none), and the exception goes on.

    The tensors replaced are kept alive until the block ends, and with them whatever they
    own (an offloaded tensor's payload file). :meth:`let_go` gives one up, to free its
    memory as it is replaced: its places keep what they hold then, and a note added to the
    exception says how many were given up. The putting back runs with Ctrl-C held; a
    ``KeyboardInterrupt`` landing before the hold takes effect puts everything back again
    and is raised instead.
    """

    def __init__(self, model: nn.Module, attributes: Collection[str] = ()) -> None:
        self._model = model
        # One cell per tensor, shared by all its places: letting it go is one store.
        self._cells: dict[int, list[Any]] = {}
        self._places: list[tuple[dict[str, Any], str, list[Any]]] = []
        self._keys: list[tuple[dict[str, Any], frozenset[str]]] = []
        for module in model.modules():
            for live in (module._parameters, module._buffers):
                self._keys.append((live, frozenset(live)))
                for key, tensor in live.items():
                    cell = self._cells.setdefault(id(tensor), [tensor])
                    self._places.append((live, key, cell))
        self._attributes = {name: model.__dict__.get(name, _NO_ATTRIBUTE) for name in attributes}

    def __enter__(self) -> BindingRollback:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self._forget()
            return
        try:
            with InterruptHold() as hold:
                hold.start()
                self._restore()
        except KeyboardInterrupt as late:  # (landed before the hold was in force)
            self._restore()
            self._note(late)
            self._forget()
            raise
        self._note(exc)
        self._forget()

    def let_go(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` no longer: should the block fail, its places keep what they
        hold then."""
        cell = self._cells.pop(id(tensor), None)
        if cell is not None:
            cell[0] = _LET_GO

    def _restore(self) -> None:
        for live, key, cell in self._places:
            if cell[0] is not _LET_GO:
                live[key] = cell[0]
        for live, keys in self._keys:
            for key in [key for key in live if key not in keys]:
                del live[key]
        for name, value in self._attributes.items():
            if value is _NO_ATTRIBUTE:
                self._model.__dict__.pop(name, None)
            else:
                self._model.__dict__[name] = value

    def _note(self, exc: BaseException) -> None:
        kept = {id(cell) for _, _, cell in self._places if cell[0] is _LET_GO}
        if kept:
            exc.add_note(
                f"{len(kept)} tensor(s) of the model, which held their values in memory, "
                "were freed as the checkpoint's values read into memory replaced them, so "
                "that loading takes one model's memory: they keep the checkpoint's values; "
                "the model's other tensors were put back. Load again to bind them all"
            )

    def _forget(self) -> None:
        self._cells.clear()
        self._places.clear()


def load_offloaded_checkpoint(
    model: _M,
    checkpoint: str | os.PathLike[str],
    *,
    device: torch.device | str | int = "cpu",
    strict: bool = True,
    offload_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> _M:
    """Bind every parameter and buffer of ``model`` to a tensor of a safetensors checkpoint.

    The model is typically built on the meta device (``with torch.device("meta"):
    model = Net()``) so that its weights take no memory. Each of its tensors is replaced by
    an :class:`OffloadedTensor` reading its checkpoint entry in place (no copy is made; the
    checkpoint is never modified: writes copy on write into ``offload_dir``). A tensor
    reachable under several names (tied weights) is bound once, from the first of its names
    the checkpoint holds. Non-persistent buffers (absent from state dicts) are bound when the
    checkpoint holds them and left untouched otherwise.

    No tensor is left on the meta device silently: one that the checkpoint does not give
    a value (an untied weight, a non-persistent buffer built on the meta device) is refused,
    even with ``strict=False``. Everything is checked before anything is bound.

    Binding is all or nothing: an error or a Ctrl-C (``KeyboardInterrupt``) during the call
    leaves the model as it was before it, every tensor already replaced put back (the very
    objects, ties included), then the exception is raised; the offloaded tensors made for
    it go with their files once the exception is dropped, and nothing that ``offload_dir``
    held before is removed. A Ctrl-C landing as the call returns may find the binding done:
    the model is then wholly bound.

    Args:
        model: the module to bind.
        checkpoint: a ``.safetensors`` file, a sharded checkpoint's index
            (``model.safetensors.index.json``, mapping keys to shard files in its directory
            under ``"weight_map"``), or a directory holding either: where it holds both, the
            single file is read, as transformers' ``from_pretrained`` reads it, with a
            warning (see :func:`checkpoint_in_directory`).
        device: the target device of the offloaded tensors.
        strict: refuse model tensors missing from the checkpoint and checkpoint tensors the
            model does not have (as ``nn.Module.load_state_dict``). Shape and dtype mismatches
            are refused in any case.
        offload_dir: where copies on write go; ``None`` for a private temporary directory.
        dtype: the dtype of the bound floating-point tensors; ``None``: the model's, which
            must then be the checkpoint's. An entry stored in another dtype is cast on load:
            its cast value is written once into ``offload_dir`` (an entry is read in place
            only in its own dtype). Integer and boolean entries keep their dtype.

    Returns:
        ``model`` itself.

    Raises:
        T2NErrorMisuse: the arguments are not a module and a checkpoint path (swapped, for
            instance).
        T2NErrorCheckpoint: the checkpoint cannot be found, is a pickle checkpoint
            (``pytorch_model.bin``: the message says how to convert it), or its index is
            invalid (not JSON, no ``weight_map``, a shard path outside the checkpoint
            directory, a key absent from its shard); or it does not fit the model: the
            message lists every missing key, unexpected key, shape mismatch and tensor left
            on the meta device at once, and summarises dtype mismatches.
        T2NErrorStorage: a checkpoint file is not a valid safetensors file.
    """
    check_arguments("load_offloaded_checkpoint", model, checkpoint, dtype)
    plan = plan_binding(model, open_checkpoint(Path(checkpoint)), strict=strict, dtype=dtype)
    # Every tensor is made before any is bound: one that cannot be (a cast value that cannot
    # be written to offload_dir) leaves the model unchanged.
    offloaded = [
        plan.offloaded(binding, device=device, offload_dir=offload_dir) for binding in plan.bindings
    ]
    with BindingRollback(model) as rollback:
        plan.bind_each(lambda index, binding: offloaded[index], rollback)
    return model


@dataclass(frozen=True)
class CheckpointDescription:
    """What a checkpoint holds, from its headers (see :func:`describe_checkpoint`).

    Attributes:
        source: the file or index found.
        kind: ``"safetensors"`` (read in place) or ``"pickle"`` (``torch.save``).
        tensors: how many tensors it holds.
        nbytes: their total size in bytes.
        by_dtype: tensor count and bytes per dtype name.
        largest: the key and size in bytes of its largest tensor (``("", 0)`` when empty).
    """

    source: Path
    kind: str
    tensors: int
    nbytes: int
    by_dtype: Mapping[str, tuple[int, int]]
    largest: tuple[str, int]


def describe_checkpoint(checkpoint: str | os.PathLike[str]) -> CheckpointDescription:
    """Describe a checkpoint (file, index or directory), reading only its headers.

    A pickle checkpoint is read with ``torch.load(weights_only=True, mmap=True)``.

    Args:
        checkpoint: a checkpoint file, a sharded checkpoint's index, or a directory holding one.

    Raises:
        T2NErrorCheckpoint: see :func:`load_offloaded_checkpoint`.
        T2NErrorStorage: a file is not a valid safetensors file.
    """
    found = open_checkpoint(Path(checkpoint), allow_pickle=True)
    by_dtype: dict[str, tuple[int, int]] = {}
    largest = ("", 0)
    for key in found:
        shape, dtype = found.describe(key)
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        count, total = by_dtype.get(str(dtype), (0, 0))
        by_dtype[str(dtype)] = (count + 1, total + nbytes)
        if nbytes > largest[1]:
            largest = (key, nbytes)
    return CheckpointDescription(
        found.source,
        "pickle" if found.loaded else "safetensors",
        sum(count for count, _ in by_dtype.values()),
        sum(total for _, total in by_dtype.values()),
        by_dtype,
        largest,
    )


def check_arguments(function: str, model: object, checkpoint: object, dtype: object) -> None:
    """Refuse arguments that are not ``(module, path, dtype or None)``, naming the fix."""
    if not isinstance(model, nn.Module):
        if isinstance(checkpoint, nn.Module):
            raise T2NErrorMisuse(
                f"{function}() got the checkpoint first and the model second; call "
                f"{function}(model, checkpoint, ...)"
            )
        raise T2NErrorMisuse(
            f"{function}() binds an nn.Module, got {type(model).__name__}; call "
            f"{function}(model, checkpoint, ...)"
        )
    path_argument(
        checkpoint,
        "checkpoint",
        "the path of a checkpoint file, index or directory",
        function=function,
    )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise T2NErrorMisuse(
            f"dtype must be a torch.dtype or None, got {dtype!r}; e.g. dtype=torch.bfloat16"
        )


def plan_binding(
    model: nn.Module,
    found: Checkpoint,
    *,
    strict: bool,
    dtype: torch.dtype | None,
    ignored: Callable[[str], bool] = lambda key: False,
    cast_to_model: bool = False,
) -> BindingPlan:
    """Match the tensors of ``model`` with the keys of ``found``; raise on any misfit.

    ``ignored`` tells the checkpoint keys that are not unexpected when the model lacks them.
    ``cast_to_model`` (with ``dtype=None``): a floating-point entry stored in another
    floating-point dtype than its model tensor's is cast to the latter on load, as
    ``nn.Module.load_state_dict`` does, instead of being refused.

    Raises:
        T2NErrorCheckpoint: see :func:`load_offloaded_checkpoint`.
    """
    updater = ModTensorUpdater(model, add_buffers=True)
    transient = _non_persistent_buffer_names(model)
    tensors = list(updater.iter_tensors())
    renaming, tied = _Renaming.between(tensors, found, transient, ignored)
    report = _Misfits(tied_renamings=tied)
    bindings: list[PlannedBinding] = []
    known: set[str] = set()
    unbound: list[tuple[tuple[str, ...], torch.Tensor]] = []
    renamed: list[tuple[str, str]] = []
    # A key some tensor has under its own name is never another's under a renaming.
    taken = {name for names, _ in tensors for name in names if name in found}
    for names, tensor in tensors:
        known.update(names)
        key = next((name for name in names if name in found), None)
        if key is None and renaming is not None:
            key = next(
                (k for k in map(renaming.key_for, names) if k in found and k not in taken), None
            )
            if key is not None:
                taken.add(key)
                known.add(key)
                renamed.append((key, names[0]))
        if key is None:
            if not all(name in transient for name in names):
                report.missing.append(_tied_names(names))
            unbound.append((names, tensor))
            continue
        shape, stored = found.describe(key)
        wanted = _bound_dtype(
            stored, tensor.dtype, tensor.dtype if cast_to_model and dtype is None else dtype
        )
        if shape != tuple(tensor.shape):
            report.shapes.append(
                f"{found.label(key)}: checkpoint shape {shape} dtype {stored}, model shape "
                f"{tuple(tensor.shape)} dtype {tensor.dtype}"
            )
        elif wanted is None:
            report.dtypes.setdefault((stored, tensor.dtype), []).append(key)
        else:
            bindings.append(PlannedBinding(tensor, names, key, wanted))
    report.compared = len(bindings) + len(report.shapes) + report.dtype_count
    report.on_meta = _left_on_meta(unbound, bindings, transient, _declares_untied(model))
    unexpected = sorted(key for key in found if key not in known and not ignored(key))
    if renamed:
        LOGGER.info(
            "checkpoint '%s': %d key(s) bound under names with one dotted segment %s, "
            "such as %r bound to %r",
            found.source,
            len(renamed),
            "less" if renaming is not None and renaming.in_checkpoint else "more",
            *renamed[0],
        )
    if report.failed(strict, unexpected):
        raise T2NErrorCheckpoint(report.message(found.source, unexpected, strict=strict))
    _note_casts(found, bindings)
    return BindingPlan(found, updater, bindings, unexpected)


def _note_casts(found: Checkpoint, bindings: list[PlannedBinding]) -> None:
    """Warn of the entries bound in another dtype than they are stored in: an offloaded
    one is read, cast and written once into the offload directory instead of being read
    in place."""
    casts: dict[tuple[torch.dtype, torch.dtype], int] = {}
    for binding in bindings:
        stored = found.describe(binding.key)[1]
        if stored != binding.dtype:
            casts[(stored, binding.dtype)] = casts.get((stored, binding.dtype), 0) + 1
    for (stored, bound), count in casts.items():
        LOGGER.warning(
            "checkpoint '%s': %d tensor(s) stored in %s are cast to %s on load (an offloaded "
            "one is written once to the offload directory); pass dtype=%s to read them in place",
            found.source,
            count,
            stored,
            bound,
            stored,
        )


def _bound_dtype(
    stored: torch.dtype, model: torch.dtype, requested: torch.dtype | None
) -> torch.dtype | None:
    """The dtype a tensor is bound with; ``None`` when the dtypes do not fit."""
    if requested is None or not (stored.is_floating_point and requested.is_floating_point):
        return stored if stored == model else None
    return requested


def _declares_untied(model: nn.Module) -> bool:
    """Whether ``model`` says its head is not tied to its embedding (a transformers model's
    ``tie_word_embeddings=False``)."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        config = text()
    return getattr(config, "tie_word_embeddings", None) is False


def _left_on_meta(
    unbound: list[tuple[tuple[str, ...], torch.Tensor]],
    bindings: list[PlannedBinding],
    transient: set[str],
    untied: bool,
) -> list[str]:
    """Describe each unbound meta tensor, with the likely cause. ``untied``: the model says
    it ties no weights, so none is missing for want of a tie."""
    by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
    for binding in bindings:
        by_shape.setdefault((tuple(binding.tensor.shape), binding.tensor.dtype), []).append(
            binding.names[0]
        )
    described = []
    for names, tensor in unbound:
        if not tensor.is_meta:
            continue
        # Tied weights are matrices (an embedding and a head) of a shape no other tensor has;
        # one of many of a shape (a layer's weight among its siblings') is just missing.
        twins = by_shape.get((tuple(tensor.shape), tensor.dtype), [])
        twin = twins[0] if tensor.dim() >= 2 and len(twins) == 1 else None
        if all(name in transient for name in names):
            cause = _TRANSIENT
        elif twin is not None and untied:
            cause = f"{_ABSENT}, and the model ties it to no weight: {_UNTIED}"
        elif twin is not None:
            cause = f"{_TIED} {twin!r}, whose value the checkpoint holds"
        else:
            cause = _ABSENT
        described.append(f"{_tied_names(names)} ({cause})")
    return described


_TRANSIENT = "non-persistent buffer, never saved in checkpoints"
_TIED = "likely a weight tied to"
_ABSENT = "absent from the checkpoint"
_UNTIED = "config.tie_word_embeddings=False"


@dataclass
class _Misfits:
    """Everything that keeps a checkpoint from fitting a model, for one message."""

    missing: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    dtypes: dict[tuple[torch.dtype, torch.dtype], list[str]] = field(default_factory=dict)
    on_meta: list[str] = field(default_factory=list)
    compared: int = 0
    # Segments of renamings that fit the names without a key equally well (none applied).
    tied_renamings: list[str] = field(default_factory=list)

    @property
    def dtype_count(self) -> int:
        return sum(len(keys) for keys in self.dtypes.values())

    def failed(self, strict: bool, unexpected: list[str]) -> bool:
        return bool(
            self.shapes or self.dtypes or self.on_meta or (strict and (self.missing or unexpected))
        )

    def message(self, source: Path, unexpected: list[str], *, strict: bool) -> str:
        parts = [f"checkpoint '{source}' does not fit the model:"]
        hints = []
        if self.shapes:
            parts.append(f"{len(self.shapes)} shape mismatch(es): {_listed(self.shapes)}.")
            hints.append("build the model with the checkpoint's configuration")
        if self.dtypes:
            groups = [self._dtype_group(pair, keys) for pair, keys in self.dtypes.items()]
            parts.append(f"dtype mismatch: {'; '.join(groups)}.")
            floating = [pair for pair in self.dtypes if all(d.is_floating_point for d in pair)]
            if floating:
                hints.append(
                    f"pass dtype={floating[0][0]} to bind the floating-point tensors in the "
                    "checkpoint's dtype (read in place), or dtype=<the model's dtype> to cast "
                    "them on load (each cast tensor is written once to offload_dir)"
                )
            if len(floating) < len(self.dtypes):
                hints.append(
                    "integer and boolean entries are bound in their own dtype only (dtype= "
                    "does not cast them): give the model's tensor the checkpoint's dtype, or "
                    "convert the checkpoint's entry"
                )
        if strict and self.missing:
            parts.append(f"{len(self.missing)} missing key(s): {_listed(self.missing)}.")
        if strict and unexpected:
            listed = _listed([repr(key) for key in unexpected])
            parts.append(f"{len(unexpected)} unexpected key(s): {listed}.")
        if strict and (self.missing or unexpected):
            hints.append("pass strict=False to bind the keys both have")
        if self.on_meta:
            parts.append(
                f"{len(self.on_meta)} tensor(s) would stay on the meta device, holding no "
                f"values (a forward would fail or compute garbage): {_listed(self.on_meta)}."
            )
            if any(_TIED in item for item in self.on_meta):
                hints.append(
                    "tie weights before binding (model.tie_weights() for transformers models, "
                    "or assign the same nn.Parameter to both modules)"
                )
            if any(_TRANSIENT in item for item in self.on_meta):
                hints.append(
                    "build the model with accelerate.init_empty_weights(), which keeps buffers "
                    "real, rather than torch.device('meta'), or give those buffers real values "
                    "before binding"
                )
            if self.tied_renamings:
                segments = ", ".join(repr(segment) for segment in self.tied_renamings)
                hints.append(
                    f"the checkpoint's keys fit the model's names under several renamings "
                    f"(one dotted segment {segments} more or less), so none is applied: bind "
                    "the checkpoint to the module that matches, or give it the model's names"
                )
            elif any(_ABSENT in item for item in self.on_meta):
                hints.append("check that the checkpoint belongs to this model")
            if any(_UNTIED in item for item in self.on_meta):
                hints.append(
                    "a base model's checkpoint holds no head: bind it to the base model, or, "
                    "if the head is the embedding, build the model with tie_word_embeddings=True"
                )
        return " ".join(parts) + " To fix: " + "; ".join(hints) + "."

    def _dtype_group(self, pair: tuple[torch.dtype, torch.dtype], keys: list[str]) -> str:
        stored, model = pair
        if len(keys) == 1:
            who = repr(keys[0])
        elif len(keys) == self.compared:
            who = f"all {len(keys)} tensors"
        else:
            who = f"{len(keys)} of {self.compared} tensors ({_listed([repr(k) for k in keys], 3)})"
        return f"{who}: checkpoint dtype {stored}, model dtype {model}"


_LISTED = 12


def _listed(items: list[str], limit: int = _LISTED) -> str:
    """``items`` joined, the first ``limit`` of them and how many more."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"


@dataclass(frozen=True)
class _Renaming:
    """The checkpoint's keys are the model's names with one dotted segment more, or one less,
    at one position: a model and one inside it (a ``...ForCausalLM`` holds its base model as
    ``model``), or a multimodal checkpoint holding a text model under
    ``model.language_model``. Transformers' ``from_pretrained`` and upstream torch-to-nnef
    bind such checkpoints; so does :func:`plan_binding`, for the names it finds no key for."""

    position: int
    segment: str
    in_checkpoint: bool  # the keys have the segment, the names do not

    @classmethod
    def between(
        cls,
        tensors: list[tuple[tuple[str, ...], torch.Tensor]],
        found: Checkpoint,
        transient: set[str],
        ignored: Callable[[str], bool],
    ) -> tuple[_Renaming | None, list[str]]:
        """The renaming that accounts for the most names without a key, when it accounts
        for at least half of them (``None`` otherwise); and, when several account for as
        many (none is applied), their segments."""
        names = {name for group, _ in tensors for name in group}
        absent = {
            name
            for group, _ in tensors
            if not any(name in found for name in group)
            for name in group
            if name not in transient
        }
        unexpected = {key for key in found if key not in names and not ignored(key)}
        if not absent or not unexpected:
            return None, []
        counts: dict[_Renaming, int] = {}
        for pool, other, in_checkpoint in ((absent, unexpected, False), (unexpected, absent, True)):
            for name in pool:
                parts = name.split(".")
                for position, segment in enumerate(parts[:-1]):
                    if ".".join(parts[:position] + parts[position + 1 :]) in other:
                        rule = cls(position, segment, in_checkpoint)
                        counts[rule] = counts.get(rule, 0) + 1
        if not counts:
            return None, []
        ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
        rule, count = ranked[0]
        if 2 * count < len(absent):
            return None, []
        if len(ranked) > 1 and ranked[1][1] == count:
            return None, sorted({r.segment for r, c in ranked if c == count})
        return rule, []

    def key_for(self, name: str) -> str:
        """The checkpoint key of the model's ``name`` under this renaming."""
        parts = name.split(".")
        if self.in_checkpoint:
            parts.insert(self.position, self.segment)
        elif len(parts) > self.position + 1 and parts[self.position] == self.segment:
            del parts[self.position]
        return ".".join(parts)


def _tied_names(names: tuple[str, ...]) -> str:
    if len(names) == 1:
        return repr(names[0])
    return f"{names[0]!r} (tied with {', '.join(repr(n) for n in names[1:])})"


def _non_persistent_buffer_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local in module._non_persistent_buffers_set:
            names.add(f"{prefix}.{local}" if prefix else local)
    return names


def open_checkpoint(path: Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Find the checkpoint files and read their layouts.

    Args:
        path: a checkpoint file, an index, or a directory holding them (the file or index
            :func:`checkpoint_in_directory` chooses is read).
        allow_pickle: read pickle checkpoints (``pytorch_model.bin``) with
            ``torch.load(weights_only=True)``; refuse them otherwise.
    """
    if path.is_dir():
        return open_checkpoint(checkpoint_in_directory(path), allow_pickle=allow_pickle)
    if not path.exists():
        raise T2NErrorCheckpoint(f"checkpoint '{path}' does not exist")
    if path.name.endswith(".json"):
        return _open_index(path, allow_pickle)
    if _is_pickle(path):
        return Checkpoint(path, {}, {}, _load_pickle(path, allow_pickle))
    layout = storage.read_layout(path)
    return Checkpoint(path, {key: layout.path for key in layout.entries}, {layout.path: layout})


def checkpoint_in_directory(directory: Path, named: str | None = None) -> Path:
    """The checkpoint of ``directory`` that transformers' ``from_pretrained`` reads.

    ``named``: the file a model's configuration names (``config.transformers_weights``), a
    ``.safetensors`` file or index inside ``directory``, read whatever else it holds.

    A single file comes before the index of a sharded checkpoint, safetensors before pickle:
    ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json``; then an index of another name
    (``consolidated.safetensors.index.json``) when it is the only one.

    ``save_pretrained`` leaves both a single file and an index behind when a save replaces
    one layout by the other: an unsharded save keeps the earlier index (its shards deleted),
    a sharded save keeps the earlier ``model.safetensors``. The single file is read then, as
    ``from_pretrained`` reads it, with a warning that names the file left over: an index whose
    shards are missing is stale; an index whose shards are all there is a sharded checkpoint
    that ``from_pretrained`` does not read either (delete ``model.safetensors`` if the shards
    are the current checkpoint, or pass the index itself).

    Raises:
        T2NErrorCheckpoint: ``directory`` holds none of them, or several indexes of other
            names; or ``named`` is no safetensors file or index inside ``directory``.
    """
    if named is not None:
        inside = _shard_path(directory.resolve(), named)
        if inside is None or not named.endswith((".safetensors", ".safetensors.index.json")):
            raise T2NErrorCheckpoint(
                f"the configuration of '{directory}' names the checkpoint {named!r} "
                "(transformers_weights), which must be a .safetensors file or a "
                ".safetensors.index.json inside the directory, as from_pretrained requires"
            )
        return inside
    pairs = ((SAFETENSORS_SINGLE_NAME, SAFETENSORS_INDEX_NAME), (PICKLE_NAME, PICKLE_INDEX_NAME))
    for single_name, index_name in pairs:
        single, index = directory / single_name, directory / index_name
        if single.is_file():
            if index.is_file():
                LOGGER.warning("%s", _both_layouts(single, index))
            return single
        if index.is_file():
            return index
    # An index of another name (consolidated.safetensors.index.json), when it is alone.
    indexes = sorted(p for p in directory.glob("*.index.json") if p.is_file())
    if len(indexes) == 1:
        return indexes[0]
    found = f": it holds {len(indexes)} indexes ({', '.join(p.name for p in indexes)})"
    raise T2NErrorCheckpoint(
        f"checkpoint directory '{directory}' holds neither {SAFETENSORS_SINGLE_NAME} nor "
        f"{SAFETENSORS_INDEX_NAME} nor a single *.index.json{found if indexes else ''}; pass "
        "the .safetensors file or the index itself"
    )


def _both_layouts(single: Path, index: Path) -> str:
    """What a directory holding both ``single`` and ``index`` means, for a warning."""
    read = (
        f"checkpoint directory '{single.parent}' holds both {single.name} and {index.name}: "
        f"{single.name} is read, as transformers' from_pretrained reads it"
    )
    try:
        shards = set(_read_weight_map(index).values())
    except T2NErrorCheckpoint as exc:
        return f"{read} ({exc})"
    directory = single.parent.resolve()
    paths = {shard: _shard_path(directory, shard) for shard in shards}
    missing = sorted(shard for shard, path in paths.items() if path is None or not path.is_file())
    if missing:
        return (
            f"{read}; the index is left from an earlier sharded save ({len(missing)} of its "
            f"{len(shards)} shard file(s) are missing, such as '{missing[0]}'): delete it"
        )
    newer = index.stat().st_mtime > single.stat().st_mtime
    return (
        f"{read}, not the sharded checkpoint of the index ({len(shards)} shard file(s), all "
        f"there{', written after ' + single.name if newer else ''}). A sharded save_pretrained "
        f"leaves an earlier {single.name} behind: if the shards are the current checkpoint, "
        f"delete {single.name} (from_pretrained reads it too), or pass the index itself"
    )


def _is_pickle(path: Path) -> bool:
    """Whether ``path`` starts like a ``torch.save`` file (a zip archive or a raw pickle).

    A safetensors file starts with its header's length (8 bytes) and the header's ``{``; its
    first byte may be that of a pickle, so it is recognised first.
    """
    try:
        with storage.open_regular_file(path) as file:
            head = file.read(9)
    except OSError:
        return False  # storage.read_layout reports it (a FIFO too: nothing blocks)
    if head[8:9] == b"{":
        return False
    return head.startswith(_ZIP_MAGIC) or (head[:1] == _PICKLE_MAGIC and head[1:2] in _PROTOCOLS)


def _conversion(path: Path, index: Path | None) -> str:
    """A shell command converting the pickle checkpoint ``path`` (or every shard of ``index``)
    to safetensors beside it, and what to bind then. It writes no file that exists: the
    single file's conversion goes under the first name :func:`open_checkpoint` looks for
    when it is free (``model.safetensors``), each shard's under the shard's name."""
    save = (
        "st.save_file({k: v.contiguous().clone() for k, v in torch.load(%s, "
        'weights_only=True).items()}, %s, metadata={"format": "pt"})'
    )
    if index is None:
        free = path.with_name(SAFETENSORS_SINGLE_NAME)
        target = free if path.name == PICKLE_NAME and not free.exists() else path
        destination = target.with_suffix(".safetensors")
        checked = (
            "import os, torch, safetensors.torch as st; "
            f"d = {json.dumps(str(destination))}; "
            'assert not os.path.exists(d), d + " exists: move it away first"; '
        )
        code = checked + save % (json.dumps(str(path)), "d")
        then = destination if destination.name != SAFETENSORS_SINGLE_NAME else path.parent
    else:
        code = (
            "import json, torch, safetensors.torch as st; from pathlib import Path; "
            f"i = Path({json.dumps(str(index))}); m = json.loads(i.read_text()); "
            'new = {s: str(Path(s).with_suffix(".safetensors")) '
            'for s in set(m["weight_map"].values())}; '
            "taken = [n for n in set(new.values()) if (i.parent / n).exists()]; "
            'assert len(set(new.values())) == len(new) and not taken, f"{taken} exist"; '
            "[" + save % ("i.parent / s", "i.parent / n") + " for s, n in new.items()]; "
            'm["weight_map"] = {k: new[s] for k, s in m["weight_map"].items()}; '
            f"(i.parent / {json.dumps(SAFETENSORS_INDEX_NAME)}).write_text(json.dumps(m))"
        )
        then = index.parent
    return f"python -c {shlex.quote(code)} (then bind '{then}')"


_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # PROTO opcode, then the protocol number
_PROTOCOLS = {bytes([number]) for number in range(2, 6)}


def _load_pickle(path: Path, allow: bool, index: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the pickle checkpoint ``path`` (a shard of ``index``), read without
    running its code."""
    if not allow:
        raise T2NErrorCheckpoint(
            f"'{path}' is a pickle checkpoint (torch.save), not safetensors: it cannot be "
            f"read in place. Convert it once: {_conversion(path, index)}; or load it with "
            "torch_to_nnef.tensor.hf.t2n_load_checkpoint_and_dispatch(model, checkpoint, "
            "'t2n_offload_disk', offload_dir), which reads it with torch.load(weights_only=True) "
            "and writes each tensor once into offload_dir"
        )
    try:
        with storage.open_regular_file(path) as file:
            zipped = file.read(4) == _ZIP_MAGIC
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as exc:  # unpickling refused or failed: the file is not plain tensors
        raise T2NErrorCheckpoint(
            f"pickle checkpoint '{path}' cannot be read with torch.load(weights_only=True): "
            f"{exc}; only files of plain tensors are read (no code runs), convert it to "
            "safetensors where it was made"
        ) from exc
    if not isinstance(state, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()
    ):
        raise T2NErrorCheckpoint(
            f"pickle checkpoint '{path}' does not hold a state dict (str -> tensor) but a "
            f"{type(state).__name__}; save model.state_dict()"
        )
    return state


def _open_index(index: Path, allow_pickle: bool) -> Checkpoint:
    weight_map = _read_weight_map(index)
    directory = index.parent.resolve()
    files: dict[str, Path] = {}
    escaping: dict[str, str] = {}
    for key, shard in weight_map.items():
        resolved = _shard_path(directory, shard)
        if resolved is None:
            escaping[key] = shard
        else:
            files[key] = resolved
    if escaping:
        listed = ", ".join(f"{key!r} -> {shard!r}" for key, shard in sorted(escaping.items()))
        raise T2NErrorCheckpoint(
            f"index '{index}' maps keys to files outside its directory '{directory}' ({listed}); "
            "shard names must be relative paths inside the checkpoint directory"
        )
    layouts: dict[Path, storage.PayloadLayout] = {}
    loaded: dict[str, torch.Tensor] = {}
    held: dict[Path, Collection[str]] = {}
    for path in sorted(set(files.values())):
        if _is_pickle(path):
            tensors = _load_pickle(path, allow_pickle, index)
            loaded.update(tensors)
            held[path] = tensors.keys()
        else:
            layouts[path] = storage.read_layout(path)
            held[path] = layouts[path].entries.keys()
    absent = sorted(key for key, path in files.items() if key not in held[path])
    if absent:
        listed = ", ".join(f"{key!r} (in '{files[key].name}')" for key in absent)
        raise T2NErrorCheckpoint(
            f"index '{index}' lists keys that their shard does not hold: {listed}; the index "
            "and the shards do not belong together"
        )
    in_place = {key: path for key, path in files.items() if path in layouts}
    return Checkpoint(index, in_place, layouts, loaded)


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        with storage.open_regular_file(index) as file:
            document: Any = json.loads(file.read().decode("utf-8"))
    except OSError as exc:
        raise T2NErrorCheckpoint(f"cannot read checkpoint index '{index}': {exc}") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise T2NErrorCheckpoint(f"checkpoint index '{index}' is not valid JSON: {exc}") from exc
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(shard, str) for key, shard in weight_map.items()
    ):
        raise T2NErrorCheckpoint(
            f"checkpoint index '{index}' must be a JSON object whose \"weight_map\" maps "
            "tensor keys to shard file names"
        )
    return weight_map


def _shard_path(directory: Path, shard: str) -> Path | None:
    """The shard file ``shard`` inside ``directory``; ``None`` if it would lie elsewhere."""
    if not shard or "\x00" in shard:
        return None
    for flavour in (PurePosixPath(shard), PureWindowsPath(shard)):
        if flavour.is_absolute() or flavour.drive or flavour.root or ".." in flavour.parts:
            return None
    resolved = (directory / shard).resolve()
    if not resolved.is_relative_to(directory):
        return None  # a symbolic link leading out of the checkpoint directory
    return resolved
