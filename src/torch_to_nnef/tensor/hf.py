"""Loading Hugging Face checkpoints as offloaded tensors, under upstream torch-to-nnef's names.

Code written for upstream torch-to-nnef loads transformers models with these functions
(also reachable as ``torch_to_nnef.tensor.offload.<name>``):

- :func:`t2n_load_checkpoint_and_dispatch` binds a model skeleton (built under
  ``accelerate.init_empty_weights()``) to a checkpoint, placing each module by a device map:
  :data:`ON_DISK_DEVICE_MAP_KEY` (every tensor offloaded), :data:`AUTO_DEVICE_MAP_KEY`
  (accelerate's map for the memory available) or a dict of module names to devices.
- :func:`ctx_maybe_load_from_disk_as_offloaded` makes ``from_pretrained`` (and
  ``safetensors.torch.load_file``) yield offloaded tensors.
- :func:`safe_load_file`, :func:`load_state_dict`, :func:`set_module_tensor_to_device` and
  :func:`maybe_load_offload_tensor` are the building blocks.

Safetensors checkpoints are read in place: no tensor is copied, the checkpoint is never
modified. Pickle checkpoints (``pytorch_model.bin``) are read only with
``torch.load(weights_only=True)``, which runs no code. transformers and accelerate are imported
only when a function needs them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch
from torch import nn

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import T2NErrorCheckpoint, T2NErrorMisuse, T2NErrorNotImplemented
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.checkpoint import (
    PICKLE_NAME,
    SAFETENSORS_SINGLE_NAME,
    BindingPlan,
    BindingRollback,
    Checkpoint,
    PlannedBinding,
    check_arguments,
    checkpoint_in_directory,
    open_checkpoint,
    plan_binding,
)
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.storage._paths import path_argument
from torch_to_nnef.tensor.updater import ModTensorUpdater

__all__ = [
    "AUTO_DEVICE_MAP_KEY",
    "MODEL_NAME",
    "ON_DISK_DEVICE_MAP_KEY",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_NAME",
    "ctx_maybe_load_from_disk_as_offloaded",
    "load_state_dict",
    "maybe_extract_target_device",
    "maybe_load_offload_tensor",
    "safe_load_file",
    "set_module_tensor_to_device",
    "t2n_load_checkpoint_and_dispatch",
]

LOGGER = logging.getLogger(__name__)

AUTO_DEVICE_MAP_KEY = "t2n_auto"
"""Device map: accelerate's ``infer_auto_device_map``; its ``"disk"`` modules are offloaded."""

ON_DISK_DEVICE_MAP_KEY = "t2n_offload_disk"
"""Device map: every tensor offloaded, read in place from the checkpoint, loaded on the CPU."""

# Upstream's names of the single-file checkpoints of a directory (the same files as
# checkpoint.SAFETENSORS_SINGLE_NAME and checkpoint.PICKLE_NAME).
SAFE_WEIGHTS_NAME = SAFETENSORS_SINGLE_NAME
SAFE_MODEL_NAME = SAFE_WEIGHTS_NAME.removesuffix(".safetensors")
WEIGHTS_NAME = PICKLE_NAME
MODEL_NAME = WEIGHTS_NAME.removesuffix(".bin")

DeviceLike = str | int | torch.device
DeviceMap = Mapping[str, DeviceLike]
PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------------------------------------
# Devices: "disk", "disk_cpu", "disk_cuda:0" mean offloaded, loaded on the part after "disk_"
# ---------------------------------------------------------------------------------------------
def _is_disk(device: DeviceLike) -> bool:
    return isinstance(device, str) and device.startswith("disk")


def maybe_extract_target_device(device: DeviceLike) -> DeviceLike:
    """Where a value is loaded: ``"disk_cuda:0"`` -> ``"cuda:0"``, ``"disk"`` -> ``"cpu"``."""
    if not isinstance(device, str):
        return device
    if device == "disk":
        return "cpu"
    return device.removeprefix("disk_")


def _checked(device: DeviceLike) -> DeviceLike:
    """``device``, once the device it loads values on (after ``disk_``) is known to torch,
    usable here and not the meta device.

    Raises:
        T2NErrorMisuse: it names no device, CUDA without CUDA, the meta device, or a device
            torch cannot place a tensor on here (a backend this build lacks, such as ``"mps"``
            or ``"xpu"``, or a device index beyond those present).
    """
    target = storage.resolve_device(maybe_extract_target_device(device))
    if target.type == "meta":
        raise T2NErrorMisuse(
            f"device {device!r}: tensors placed on the meta device would stay there without "
            "values; place them on 'cpu', 'disk' or a GPU"
        )
    if target.type == "cuda" and not torch.cuda.is_available():
        raise T2NErrorMisuse(
            f"device {device!r}: CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); place the tensors on 'cpu' or 'disk'"
        )
    # An offloaded tensor only moves on load: without this, a CUDA index beyond the devices
    # present would fail mid-binding, or only at the first forward, with torch's own error.
    if target.type == "cuda" and (why := storage.placement_refused(target)) is not None:
        raise T2NErrorMisuse(
            f"device {device!r}: torch cannot place tensors on {target} on this machine "
            f"({why}); place them on 'cpu', 'disk' or a device this machine has"
        )
    return device


def _checked_map(device_map: DeviceMap) -> DeviceMap:
    """``device_map`` once each of its devices is checked (:func:`_checked`), before any
    tensor is placed.

    Raises:
        T2NErrorMisuse: ``device_map`` is not a mapping, or a device of it is refused.
    """
    if not isinstance(device_map, Mapping):
        raise T2NErrorMisuse(
            f"device_map must be a dict of module names ('' for the whole model) to devices, "
            f'such as {{"": "disk"}}; got {device_map!r}'
        )
    for device in device_map.values():
        _checked(device)
    return device_map


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype``, or the torch dtype a name such as ``"float16"`` names.

    Raises:
        T2NErrorMisuse: the name is no torch dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise T2NErrorMisuse(f"{dtype!r} is not a torch dtype (e.g. 'float16', torch.bfloat16)")
    return found


def maybe_load_offload_tensor(
    value: torch.Tensor,
    device: DeviceLike,
    original_tensor_name: str,
    offload_dir: PathLike | None,
) -> torch.Tensor:
    """Offload ``value`` when ``device`` is a disk device (``"disk"``, ``"disk_<device>"``).

    The value is written once into a payload file of ``offload_dir`` (``None``: a private
    temporary directory) and loaded on the device after ``disk_``. Other devices, and values
    that are already offloaded, return ``value`` unchanged.

    Raises:
        T2NErrorMisuse: a disk device loading on a device that is none, not usable here, or
            the meta device.
    """
    if not _is_disk(device) or isinstance(value, OffloadedTensor):
        return value
    _checked(device)
    offloaded = OffloadedTensor.from_original_tensor(value, original_tensor_name, offload_dir)
    return offloaded.to(maybe_extract_target_device(device))


# ---------------------------------------------------------------------------------------------
# Reading checkpoint files
# ---------------------------------------------------------------------------------------------
def safe_load_file(
    filename: PathLike,
    device: DeviceLike = "cpu",
    offload_dir: PathLike | None = None,
    apply_offload: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file by name (as ``safetensors.torch.load_file``).

    Args:
        filename: the file.
        device: where the tensors are loaded; a disk device (``"disk"``, ``"disk_cuda:0"``)
            with ``apply_offload`` gives offloaded tensors reading the file in place (no copy).
        offload_dir: where offloaded tensors copy on write.
        apply_offload: offload the tensors of a disk device; otherwise they are read into
            memory on the device after ``disk_``.

    Raises:
        T2NErrorStorage: the file is missing or not valid safetensors.
        T2NErrorMisuse: ``filename`` is no path, or ``device`` is none, not usable here, or
            the meta device.
    """
    layout = storage.read_layout(
        path_argument(filename, "filename", "the checkpoint file's path", function="safe_load_file")
    )
    target = maybe_extract_target_device(_checked(device))
    if apply_offload and _is_disk(device):
        return {
            key: OffloadedTensor.from_safetensors(
                layout, key, offload_dir=offload_dir, device=target
            )
            for key in layout.entries
        }
    return {key: value.to(target) for key, value in storage.read_payload(layout).items()}


def load_state_dict(
    checkpoint_file: PathLike,
    device_map: DeviceMap | None = None,
    offload_dir: PathLike | None = None,
    apply_offload: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file, placed by ``device_map``.

    Args:
        checkpoint_file: a ``.safetensors`` file, or a pickle file (``pytorch_model.bin``)
            read with ``torch.load(weights_only=True)``.
        device_map: module name (``""`` for all) -> device; a key goes to the device of its
            longest matching module name, the CPU when none matches.
        offload_dir: where offloaded tensors go (written once for a pickle file; copies on
            write for a safetensors file, read in place).
        apply_offload: offload the tensors mapped to disk devices.

    Raises:
        T2NErrorCheckpoint: a pickle file cannot be read as plain tensors.
        T2NErrorStorage: a safetensors file is not valid.
        T2NErrorMisuse: ``checkpoint_file`` is no path, or a device of ``device_map`` is none,
            not usable here, or the meta device.
    """
    device_map = _checked_map(device_map or {"": "cpu"})
    found = open_checkpoint(
        path_argument(
            checkpoint_file,
            "checkpoint_file",
            "the checkpoint file's path",
            function="load_state_dict",
        ),
        allow_pickle=True,
    )
    result: dict[str, torch.Tensor] = {}
    for key in found:
        device = _device_for(key, device_map) or "cpu"
        if key in found.files:
            if apply_offload and _is_disk(device):
                result[key] = OffloadedTensor.from_safetensors(
                    found.layout(key),
                    key,
                    offload_dir=offload_dir,
                    device=maybe_extract_target_device(device),
                )
                continue
            value = storage.read_payload(found.layout(key), names=[key])[key]
        else:
            value = found.loaded[key]
        if apply_offload:
            result[key] = maybe_load_offload_tensor(value, device, key, offload_dir)
        else:
            result[key] = value.to(maybe_extract_target_device(device))
    return result


def _placed(name: str, device_map: DeviceMap) -> tuple[str, DeviceLike] | None:
    """The longest module name of ``device_map`` that ``name`` is inside, and its device;
    ``None`` when there is none."""
    module = name
    while True:
        if module in device_map:
            return module, device_map[module]
        if not module:
            return None
        module = module.rpartition(".")[0]


def _device_for(name: str, device_map: DeviceMap) -> DeviceLike | None:
    """The device of the longest module name of ``device_map`` that ``name`` is inside;
    ``None`` when there is none."""
    placed = _placed(name, device_map)
    return None if placed is None else placed[1]


def _binding_device(names: tuple[str, ...], device_map: DeviceMap) -> DeviceLike | None:
    """Where a tensor goes. Tied weights have several names: one placed by a module of its
    own wins over one the map's catch-all ``""`` places (the embedding placed on ``"cpu"``
    keeps its tied head there, whatever ``""`` says); :func:`_check_tied_together` refuses
    names placed apart by modules of their own."""
    placements = [p for p in (_placed(name, device_map) for name in names) if p is not None]
    explicit = next((device for module, device in placements if module), None)
    if explicit is not None:
        return explicit
    return placements[0][1] if placements else None


def _check_covered(plan: BindingPlan, device_map: DeviceMap) -> None:
    uncovered = [b.names[0] for b in plan.bindings if _binding_device(b.names, device_map) is None]
    if uncovered:
        listed = ", ".join(repr(name) for name in uncovered[:8])
        more = f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else ""
        raise T2NErrorMisuse(
            f"the device map sets no device for {len(uncovered)} tensor(s): {listed}{more}; "
            'add their modules to it ("" names the whole model: {"": "disk"} offloads '
            "what no other entry places)"
        )


def _check_tied_together(plan: BindingPlan, device_map: DeviceMap) -> None:
    """Refuse a map that places the names of one tied tensor apart by modules of their own:
    a tied tensor is one value, bound in one place. (A name only the catch-all ``""``
    places follows the others: see :func:`_binding_device`.)

    Raises:
        T2NErrorMisuse: two names of a tied tensor are placed on different devices (or one
            offloaded, the other not), naming both, their devices and the fix.
    """
    for binding in plan.bindings:
        placed = [(name, _placed(name, device_map)) for name in binding.names]
        explicit = [(name, *p) for name, p in placed if p is not None and p[0]]
        if len(explicit) < 2:
            continue
        (first, _, first_device), *others = explicit
        for name, module, device in others:
            if _placement(device) != _placement(first_device):
                raise T2NErrorMisuse(
                    f"the device map places the tied weights {first!r} on {first_device!r} "
                    f"and {name!r} on {device!r}, but tied weights are one tensor, bound in "
                    f"one place; put them on the same device (e.g. {module!r}: "
                    f"{first_device!r}), or untie them before loading if the checkpoint holds "
                    "both"
                )


def _placement(device: DeviceLike) -> tuple[bool, torch.device]:
    """What a device of a map means (offloaded or not, the device values load on), so that
    two spellings of one placement (``"disk"`` and ``"disk_cpu"``, ``0`` and ``"cuda:0"``,
    ``"cpu"`` and ``"cpu:0"``) compare equal."""
    target = storage.resolve_device(maybe_extract_target_device(device))
    if target.type == "cpu":
        target = torch.device("cpu")  # one CPU, whatever index a spelling gives it
    return _is_disk(device), target


# ---------------------------------------------------------------------------------------------
# Setting one tensor
# ---------------------------------------------------------------------------------------------
def set_module_tensor_to_device(
    mod_updater: ModTensorUpdater,
    tensor_name: str,
    device: DeviceLike,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    offload_dir: PathLike | None = None,
) -> torch.Tensor:
    """Set the parameter or buffer ``tensor_name`` to ``value``, on ``device``; keep ties.

    Args:
        mod_updater: the updater of the model (``ModTensorUpdater(model, add_buffers=True)``).
        tensor_name: the tensor's dotted name.
        device: where the value goes; a disk device offloads it (see
            :func:`maybe_load_offload_tensor`).
        value: the new value; its shape must be the current tensor's.
        dtype: cast the value to this dtype (integer and boolean values are not cast);
            ``None``: to the current tensor's dtype, as ``nn.Module.load_state_dict`` does.
        offload_dir: where an offloaded value is written.

    Returns:
        the tensor the model now holds.

    Raises:
        T2NErrorMisuse: no value (or one on the meta device), an unknown name, a shape that
            differs, or a device or dtype that is none (or not usable here).
    """
    if value is None:
        raise T2NErrorMisuse(f"set_module_tensor_to_device({tensor_name!r}) needs a value")
    if value.is_meta:
        raise T2NErrorMisuse(
            f"set_module_tensor_to_device({tensor_name!r}) was given a value on the meta "
            "device, which has no values to set"
        )
    _checked(device)
    old = mod_updater.get_by_name(tensor_name)
    if old.shape != value.shape:
        raise T2NErrorMisuse(
            f"cannot set {tensor_name!r} of shape {tuple(old.shape)} to a value of shape "
            f"{tuple(value.shape)}; the checkpoint does not match the model's configuration"
        )
    if dtype is None:
        value = value.to(old.dtype)
    elif value.is_floating_point() or value.is_complex():
        value = value.to(_dtype(dtype))
    if _is_disk(device):
        new = maybe_load_offload_tensor(value, device, tensor_name, offload_dir)
    else:
        new = value.to(device)
    return mod_updater.update_by_name(tensor_name, new, enforce_tensor_consistency=False)


# ---------------------------------------------------------------------------------------------
# A whole model
# ---------------------------------------------------------------------------------------------
def t2n_load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: PathLike,
    device_map: str | DeviceMap | None,
    offload_dir: PathLike | None,
    strict: bool = False,
    offload_at_load_state_dict: bool = False,
    weight_converters: Sequence[Any] | None = None,
    hf_quantizer: Any = None,
    *,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Bind a model skeleton to a checkpoint, offloading the modules that the map sends to disk.

    The skeleton is typically built with ``accelerate.init_empty_weights()`` (parameters on
    the meta device, buffers real). Its tied weights are tied first (``model.tie_weights()``
    for transformers models), so that a tied head is bound with its embedding, once. Each
    tensor then goes where ``device_map`` puts its module: offloaded tensors read their
    safetensors entry in place (nothing copied); others are read into memory on their device.
    Non-persistent buffers (a rotary embedding's ``inv_freq``) are left as they are.

    Checkpoint keys are given the model's names as transformers' ``from_pretrained`` gives
    them (transformers 5's weight conversions, see ``weight_converters``): GPT-NeoX's
    ``embed_out`` is bound to its ``lm_head``, still read in place. A conversion that computes
    a tensor from the stored values cannot be read in place, and is refused (see Raises).

    Everything is checked before any tensor is bound. Binding is all or nothing: an error or
    a Ctrl-C (``KeyboardInterrupt``) during the call leaves the model as it was before it,
    every tensor already replaced put back (the very objects; weights the call tied are
    untied again), then the exception is raised; the offloaded tensors made for it go with
    their files once the exception is dropped, and nothing that ``offload_dir`` held before
    is removed. One exception: a model built with its weights (not on the meta device),
    whose tensors are read into memory, frees each of its own as its value replaces it, so
    that loading takes one model's memory, not two; those already replaced then keep the
    checkpoint's values, as a note added to the exception says. A Ctrl-C landing as the call
    returns may find the binding done: the model is then wholly bound.

    Args:
        model: the skeleton.
        checkpoint: a ``.safetensors`` file, an index, a directory holding one of them, or a
            pickle checkpoint (``pytorch_model.bin``, read with ``torch.load(weights_only=True)``,
            its offloaded tensors written once into ``offload_dir``). Of a directory, the
            checkpoint transformers' ``from_pretrained`` reads: ``model.safetensors`` before
            ``model.safetensors.index.json`` (and ``pytorch_model.bin`` before its index),
            with a warning where it holds both.
        device_map: :data:`ON_DISK_DEVICE_MAP_KEY` (``"t2n_offload_disk"``: everything
            offloaded, loaded on the CPU), :data:`AUTO_DEVICE_MAP_KEY` (``"t2n_auto"``:
            accelerate's ``infer_auto_device_map``, its ``"disk"`` modules offloaded), a dict of
            module names (``""`` for the whole model) to devices, where ``"disk"`` and
            ``"disk_<device>"`` mean offloaded (loaded on ``<device>``, the CPU by default);
            or ``None`` (everything read into memory on the CPU).
        offload_dir: where offloaded tensors copy on write; ``None``: a private temporary
            directory.
        strict: refuse checkpoint keys the model lacks (except those the model's
            ``_keys_to_ignore_on_load_unexpected`` patterns match) and model tensors the
            checkpoint lacks.
        offload_at_load_state_dict: accepted for compatibility; tensors are always bound as
            they are read.
        weight_converters: transformers' weight transforms (``WeightRenaming``,
            ``WeightConverter``) that give checkpoint keys the model's names, as
            ``from_pretrained`` applies them; ``None``: those transformers registers for the
            model's architecture (``get_model_conversion_mapping(model)``, transformers 5;
            none before), such as GPT-NeoX's ``embed_out`` -> ``lm_head`` or ViT's
            ``encoder.layer`` -> ``layers``; ``[]``: none. Renamed entries are read in place.
            A conversion that makes a tensor's value from the checkpoint's values (Mixtral's
            and Qwen2-MoE's experts stacked into one tensor, a fused projection split, a
            transposition) is refused, before anything is bound (see Raises).
        hf_quantizer: not supported (must be ``None``).
        dtype: the dtype of the floating-point tensors (see
            :func:`~torch_to_nnef.tensor.checkpoint.load_offloaded_checkpoint`); ``None``: each
            tensor's own in the model: an entry stored in another floating-point dtype is
            cast on load (as ``nn.Module.load_state_dict`` does), its cast value written once
            into ``offload_dir`` (a warning says how many; pass the checkpoint's dtype to read
            them in place).

    Returns:
        ``model``.

    Raises:
        T2NErrorMisuse: the arguments are swapped or of the wrong type, or the device map is
            an unknown string, does not cover a tensor, places names of a tied tensor on
            different devices by modules of their own, or names a device that is none, not
            usable here, or the meta device (checked before any tensor is bound).
        T2NErrorNotImplemented: a quantizer was given; or the checkpoint stores tensors of the
            model in a layout that transformers converts with operations on their values
            (the message names the architecture, the model's tensors and the checkpoint keys
            they are made of, and how to save the checkpoint in the model's own layout,
            ``save_pretrained(..., save_original_format=False)``, whose entries are read in
            place).
        T2NErrorCheckpoint: the checkpoint does not fit the model (see
            :func:`~torch_to_nnef.tensor.checkpoint.load_offloaded_checkpoint`); in particular a
            tensor would stay on the meta device.
    """
    check_arguments("t2n_load_checkpoint_and_dispatch", model, checkpoint, dtype)
    del offload_at_load_state_dict  # tensors are bound in place as they are planned
    if hf_quantizer is not None:
        raise T2NErrorNotImplemented(
            "t2n_load_checkpoint_and_dispatch does not apply quantizers; load the quantized "
            "checkpoint with transformers, or quantize after loading"
        )
    transforms = _weight_transforms(model, weight_converters)
    # All or nothing from here: on error or Ctrl-C the model gets back its tensors (untied
    # again) and has no _weight_conversions of this call.
    with BindingRollback(model, attributes=("_weight_conversions",)) as rollback:
        tie = getattr(model, "tie_weights", None)
        if callable(tie):  # first: accelerate's map ("t2n_auto") places tied weights together
            tie()
        placement = _resolve_device_map(model, device_map)
        found = open_checkpoint(Path(checkpoint), allow_pickle=True)
        if transforms:
            found = _converted(model, found, transforms)
        ignored = [
            re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", ()) or ()
        ]
        plan = plan_binding(
            model,
            found,
            strict=strict,
            dtype=dtype,
            ignored=lambda key: any(pattern.search(key) for pattern in ignored),
            cast_to_model=True,
        )
        _check_covered(plan, placement)
        if isinstance(device_map, Mapping):  # accelerate's map ("t2n_auto") keeps ties together
            _check_tied_together(plan, placement)
        _bind(plan, placement, offload_dir, rollback)
        if transforms and _is_pretrained(model):
            # As from_pretrained records them: save_pretrained reverts the transforms used.
            model._weight_conversions = [t for t in transforms if t.was_used()]  # type: ignore[assignment]
    if plan.unexpected:
        LOGGER.warning(
            "%d tensor(s) of checkpoint %s are not used by %s: %s",
            len(plan.unexpected),
            checkpoint,
            type(model).__name__,
            ", ".join(plan.unexpected[:12]),
        )
    return model


# ---------------------------------------------------------------------------------------------
# transformers' weight conversions: checkpoint keys renamed to the model's names
# ---------------------------------------------------------------------------------------------
def _is_pretrained(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (never importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _weight_transforms(model: nn.Module, given: Sequence[Any] | None) -> list[Any]:
    """The weight transforms to apply to the checkpoint's keys: a copy of ``given``, or those
    transformers registers for ``model`` (transformers 5; none before, nor for a model that
    is not a transformers model).

    Raises:
        T2NErrorMisuse: ``given`` holds something else than transformers' weight transforms.
        T2NErrorNotImplemented: ``given`` is not empty, and this transformers has no weight
            transforms.
    """
    if given is not None:
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise T2NErrorMisuse(
                "weight_converters must be a list of transformers' weight transforms "
                f"(WeightRenaming, WeightConverter), or None; got {type(given).__name__}"
            )
        if not given:
            return []
        try:
            from transformers.core_model_loading import WeightTransform
        except ImportError as exc:
            raise T2NErrorNotImplemented(
                "weight_converters are transformers' weight transforms (transformers 5); "
                "this transformers has none: leave weight_converters unset"
            ) from exc
        wrong = [t for t in given if not isinstance(t, WeightTransform)]
        if wrong:
            raise T2NErrorMisuse(
                "weight_converters must be transformers' weight transforms (WeightRenaming, "
                "WeightConverter, such as get_model_conversion_mapping(model) returns); got "
                f"{type(wrong[0]).__name__}"
            )
        return copy.deepcopy(list(given))  # matching records state in them: the caller's stay
    if not _is_pretrained(model):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: checkpoints hold the model's names
        return []
    return list(get_model_conversion_mapping(cast(Any, model)))


def _converted(model: nn.Module, found: Checkpoint, transforms: list[Any]) -> Checkpoint:
    """``found`` with its keys under the names transformers' ``from_pretrained`` gives them
    through ``transforms``: a key is renamed where the name it gets is one of the model's
    tensors. A key the model has under its own name keeps it, and is never another tensor's.

    Raises:
        T2NErrorNotImplemented: a tensor of the model is made from checkpoint values by a
            conversion (experts stacked, a projection split, a transposition): an offloaded
            tensor reads one entry as it is stored.
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    order: Callable[[str], Any] | None = None  # as from_pretrained sorts: renamings keep state
    with contextlib.suppress(ImportError):
        from transformers.core_model_loading import dot_natural_key as order
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = dict.fromkeys(model.state_dict(), True)  # (transformers reads it with .get)
    prefix = getattr(model, "base_model_prefix", None) or None
    renamed: dict[str, str] = {}
    made: dict[str, tuple[Any, list[str]]] = {}
    for key in sorted(found, key=order):
        name, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if name not in names and key in names:  # a renaming that loses a name of the model
            name, pattern = rename_source_key(key, [], [], prefix, names)
        if name not in names:
            continue  # not the model's: unexpected, unless the plan binds it otherwise
        if pattern is not None:
            made.setdefault(name, (by_pattern[pattern], []))[1].append(key)
        elif name != key:
            renamed[key] = name
    own = {key for key in found if key in names and key not in renamed}
    made = {name: conversion for name, conversion in made.items() if name not in own}
    if made:
        raise _conversion_refused(model, found, made)
    claimed: set[str] = set()
    kept: dict[str, str] = {}
    for key, name in renamed.items():
        if name not in own and name not in claimed:
            claimed.add(name)
            kept[key] = name
    if kept:
        first = next(iter(kept.items()))
        LOGGER.info(
            "checkpoint '%s': %d key(s) renamed as transformers renames them for %s, such as "
            "%r -> %r",
            found.source,
            len(kept),
            type(model).__name__,
            *first,
        )
    return found.renamed(kept)


def _conversion_refused(
    model: nn.Module, found: Checkpoint, made: dict[str, tuple[Any, list[str]]]
) -> T2NErrorNotImplemented:
    """The error refusing the conversions of ``made`` (model tensor -> converter, the keys it
    is made of)."""
    config = getattr(model, "config", None)
    kind = type(model).__name__
    model_type = getattr(config, "model_type", None)
    architecture = f"{kind} (model type {model_type!r})" if model_type else kind
    operations = sorted(
        {", ".join(repr(op) for op in getattr(c, "operations", ())) for c, _ in made.values()}
    )
    examples = [
        f"{name!r} from {len(keys)} key(s): {', '.join(repr(k) for k in keys[:3])}"
        + (f", ... ({len(keys) - 3} more)" if len(keys) > 3 else "")
        for name, (_, keys) in list(made.items())[:3]
    ]
    more = f"; and {len(made) - 3} more tensor(s)" if len(made) > 3 else ""
    return T2NErrorNotImplemented(
        f"checkpoint '{found.source}' stores {len(made)} tensor(s) of {architecture} in "
        f"another layout, which transformers converts on load with operations on their values "
        f"({'; '.join(operations)}): {'; '.join(examples)}{more}. An offloaded tensor reads one "
        "checkpoint entry as it is stored, so these tensors cannot be offloaded; nothing was "
        "bound. To fix: save the checkpoint once in the model's own layout, where each of "
        "these tensors is one entry, read in place then: model.save_pretrained(new_directory, "
        "save_original_format=False) on the model transformers' from_pretrained loads (with "
        "device_map='auto' and an offload_folder for a model bigger than memory), then load "
        "new_directory; or load this checkpoint densely, with from_pretrained outside "
        "ctx_maybe_load_from_disk_as_offloaded"
    )


def _resolve_device_map(model: nn.Module, device_map: str | DeviceMap | None) -> DeviceMap:
    if device_map is None:
        return {"": "cpu"}
    if device_map == ON_DISK_DEVICE_MAP_KEY:
        return {"": "disk_cpu"}
    if device_map == AUTO_DEVICE_MAP_KEY:
        import accelerate  # optional dependency

        no_split = getattr(model, "_no_split_modules", None)
        auto: DeviceMap = accelerate.infer_auto_device_map(
            model, no_split_module_classes=list(no_split) if no_split else None
        )
        return auto
    if isinstance(device_map, Mapping):
        return _checked_map(device_map)
    raise T2NErrorMisuse(
        f"device_map must be {ON_DISK_DEVICE_MAP_KEY!r}, {AUTO_DEVICE_MAP_KEY!r}, a dict of "
        f"module names to devices or None; got {device_map!r}"
    )


def _bind(
    plan: BindingPlan,
    placement: DeviceMap,
    offload_dir: PathLike | None,
    rollback: BindingRollback,
) -> None:
    """Make the offloaded values, then bind every tensor: one that cannot be made (a cast
    value that cannot be written to ``offload_dir``) fails before any is bound. A value read
    into memory is read as it is bound, so that the tensor it replaces (a skeleton built
    with its weights, on the CPU or a GPU) is freed before the next is read: ``rollback``
    lets it go (see :meth:`BindingPlan.bind_each`)."""
    devices = []
    for binding in plan.bindings:
        device = _binding_device(binding.names, placement)
        assert device is not None  # _check_covered
        devices.append(device)
    offloaded = {
        index: plan.offloaded(
            binding, device=maybe_extract_target_device(device), offload_dir=offload_dir
        )
        for index, (binding, device) in enumerate(zip(plan.bindings, devices, strict=True))
        if _is_disk(device)
    }

    def value_of(index: int, binding: PlannedBinding) -> torch.Tensor:
        value = offloaded.pop(index, None)
        return plan.resident(binding, devices[index]) if value is None else value

    plan.bind_each(value_of, rollback)


# ---------------------------------------------------------------------------------------------
# from_pretrained
# ---------------------------------------------------------------------------------------------
def ctx_maybe_load_from_disk_as_offloaded(
    offload_dir: PathLike | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Within this context, ``from_pretrained`` and ``safetensors.torch.load_file`` offload.

    - ``PreTrainedModel.from_pretrained(path)`` (and ``AutoModel*.from_pretrained``) builds the
      model under ``accelerate.init_empty_weights()`` and binds it with
      :func:`t2n_load_checkpoint_and_dispatch` (:data:`ON_DISK_DEVICE_MAP_KEY`): its
      parameters are offloaded tensors reading the checkpoint in place. ``config`` (an
      object or a path), ``dtype`` (or ``torch_dtype``; the checkpoint's by default),
      ``attn_implementation``, ``strict`` and options that are configuration attributes are
      honoured, and the modules transformers keeps in float32 stay so; so are
      ``use_safetensors=True`` (a pickle checkpoint is then refused) and ``weights_only=True``,
      which the context does itself; other options of ``from_pretrained`` (quantization, device
      maps, remote code) are refused unless off. The checkpoint read is the one
      ``from_pretrained`` reads: the file the configuration's ``transformers_weights`` names,
      else ``model.safetensors`` before ``model.safetensors.index.json`` (a directory holding
      both is read so, with a warning: see
      :func:`~torch_to_nnef.tensor.checkpoint.load_offloaded_checkpoint`). Its keys are renamed
      as transformers 5 renames them for the model's architecture; a checkpoint whose tensors
      transformers converts by value (stacked experts) is refused, see
      :func:`t2n_load_checkpoint_and_dispatch`.
    - ``safetensors.torch.load_file(file, device)`` returns offloaded tensors reading the file
      in place, loaded on ``device`` (and so does peft's loading of adapters).
    - ``torch.load(file)`` reads the file with ``weights_only=True`` (no code runs) and
      returns its tensors offloaded: a tensor, or the tensors of a dict (other values as
      they are), each written once into ``offload_dir`` and loaded on the device it was
      read to (meta tensors stay as they are). A call passing ``weights_only=False`` or a
      ``pickle_module``, and files inside ``offload_dir``, are left to ``torch.load``.

    Not thread-safe: the functions are patched in their modules for the duration of the
    context.

    Args:
        offload_dir: where offloaded tensors copy on write; ``None`` leaves loading unchanged
            (the context does nothing).
    """
    if offload_dir is None:
        return contextlib.nullcontext()
    import safetensors.torch  # optional dependency
    import transformers

    def load_file(filename: PathLike, device: DeviceLike = "cpu") -> dict[str, torch.Tensor]:
        if not isinstance(device, str):
            device = str(torch.device("cuda", device) if isinstance(device, int) else device)
        disk = device if _is_disk(device) else f"disk_{device}"
        return safe_load_file(filename, device=disk, offload_dir=offload_dir, apply_offload=True)

    def from_pretrained(
        cls: type[Any], pretrained_model_name_or_path: PathLike, *args: Any, **kwargs: Any
    ) -> Any:  # transformers' parameter name, which callers may pass by keyword
        return _from_pretrained_offloaded(
            cls, pretrained_model_name_or_path, offload_dir, args, kwargs
        )

    torch_load = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        pickle_module = args[1] if len(args) > 1 else kwargs.get("pickle_module")
        unsafe = kwargs.get("weights_only") is False or pickle_module is not None
        if unsafe or _inside(f, offload_dir):
            return torch_load(f, *args, **kwargs)  # torch's own, as it would load it
        kwargs["weights_only"] = True
        return _offloaded_values(torch_load(f, *args, **kwargs), offload_dir)

    base = transformers.PreTrainedModel
    patches = [
        (safetensors.torch, "load_file", load_file),
        (base, "from_pretrained", classmethod(from_pretrained)),
        (torch, "load", load),
    ]
    peft_loading = sys.modules.get("peft.utils.save_and_load")  # bound its own name at import
    if peft_loading is not None and "safe_load_file" in peft_loading.__dict__:
        patches.append((peft_loading, "safe_load_file", load_file))
    return _Patched(patches)


class _Patched:
    """A ``with`` block for which attributes are replaced (owner, name, replacement).

    Written as a class, not a generator: a Ctrl-C landing in a generator context manager's
    ``__enter__`` once its generator patched would leave the patches in place for good, its
    ``__exit__`` never run. ``__enter__`` undoes patches that an interrupt cut short, and
    ``__exit__`` puts every original back with Ctrl-C held (main thread).
    """

    def __init__(self, patches: list[tuple[Any, str, Any]]) -> None:
        self._patches = patches
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        if self._saved:
            raise T2NErrorMisuse("ctx_maybe_load_from_disk_as_offloaded() is entered once")
        self._saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in self._patches]
        try:
            for owner, name, replacement in self._patches:
                setattr(owner, name, replacement)
        except BaseException:
            self._restore()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            with InterruptHold() as hold:
                hold.start()
                self._restore()
        except KeyboardInterrupt:  # (landed before the hold was in force, perhaps)
            self._restore()
            raise

    def _restore(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def _inside(f: Any, directory: PathLike) -> bool:
    """Whether ``f`` is the path of a file inside ``directory`` (``False`` for a file object)."""
    if not isinstance(f, (str, os.PathLike)):
        return False
    return Path(f).resolve().is_relative_to(Path(directory).resolve())


def _offloaded_values(loaded: Any, offload_dir: PathLike) -> Any:
    """What ``torch.load`` read, its tensors offloaded into ``offload_dir`` (a tensor, or the
    tensors of a dict), each loaded on the device it was read to."""

    def offloaded(value: Any, name: str) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, OffloadedTensor):
            return value
        if value.device.type == "meta":
            return value  # read for its shape (map_location="meta"): nothing to offload
        return maybe_load_offload_tensor(value, f"disk_{value.device}", name, offload_dir)

    if isinstance(loaded, torch.Tensor):
        return offloaded(loaded, "tensor")
    if isinstance(loaded, dict):
        kind = collections.OrderedDict if isinstance(loaded, collections.OrderedDict) else dict
        return kind((key, offloaded(value, str(key))) for key, value in loaded.items())
    return loaded


# Options of from_pretrained taken here; any other is a configuration attribute (set on the
# configuration, as from_pretrained does), or refused unless it is off (False, None, 0).
_HONOURED = {
    "config",
    "dtype",
    "torch_dtype",
    "strict",
    "attn_implementation",
    "local_files_only",
    "low_cpu_mem_usage",
    "_from_auto",  # transformers' own, from AutoModel*.from_pretrained
    "_from_pipeline",
}
# Options of from_pretrained that the context's own reading fixes: accepted with the value it
# reads by (safetensors entries read in place, a pickle checkpoint read with
# torch.load(weights_only=True)), or off; refused with any other value.
_AGREEING = {"use_safetensors": True, "weights_only": True}


def _from_pretrained_offloaded(
    cls: type[Any],
    name: PathLike,
    offload_dir: PathLike,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    import accelerate  # optional dependency
    import transformers

    directory = Path(name)
    if not args and not directory.is_dir():
        raise T2NErrorMisuse(
            f"from_pretrained inside ctx_maybe_load_from_disk_as_offloaded reads a local "
            f"checkpoint directory; '{name}' is not one (download it first, e.g. with "
            "huggingface_hub.snapshot_download)"
        )
    config = _pretrained_config(cls, directory, kwargs.get("config")) if not args else None
    others = {key: value for key, value in kwargs.items() if key not in _HONOURED}
    overrides = {
        key: value for key, value in others.items() if key not in _AGREEING and hasattr(config, key)
    }
    refused = sorted(
        key if key not in _AGREEING else f"{key}={value!r}"
        for key, value in others.items()
        if key not in overrides and value and not (key in _AGREEING and value == _AGREEING[key])
    )
    if args or refused:
        raise T2NErrorNotImplemented(
            f"from_pretrained inside ctx_maybe_load_from_disk_as_offloaded takes config=, "
            f"dtype=, attn_implementation=, strict=, use_safetensors=True, weights_only=True "
            f"and configuration attributes only; got "
            f"{', '.join(refused) or 'positional arguments'}. Leave the context to use the others"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    assert config is not None  # (positional arguments were refused)
    # The file or index from_pretrained reads, chosen once (its warnings given once).
    checkpoint = checkpoint_in_directory(directory, getattr(config, "transformers_weights", None))
    if kwargs.get("use_safetensors"):
        _check_safetensors(checkpoint)
    config.name_or_path = str(name)  # as from_pretrained records it (the model copies it)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    # "auto" (and nothing): the checkpoint's own, so that its tensors are read in place.
    dtype = _checkpoint_dtype(checkpoint) if dtype in (None, "auto") else _dtype(dtype)
    options: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    if kwargs.get("attn_implementation") is not None:
        options["attn_implementation"] = kwargs["attn_implementation"]
    with accelerate.init_empty_weights():
        model = cls._from_config(config, **options)
    if dtype is not None:
        _keep_in_float32(model, dtype)
    t2n_load_checkpoint_and_dispatch(  # each tensor in its skeleton's dtype, as from_pretrained
        model,
        checkpoint,
        ON_DISK_DEVICE_MAP_KEY,
        offload_dir,
        strict=bool(kwargs.get("strict", False)),
    )
    if model.can_generate() and (directory / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.eval()
    return model


def _check_safetensors(checkpoint: Path) -> None:
    """Refuse the checkpoint of a directory when it is a pickle one, as ``from_pretrained``
    refuses it under ``use_safetensors=True``.

    Raises:
        T2NErrorCheckpoint: ``checkpoint`` is a pickle checkpoint.
    """
    found = open_checkpoint(checkpoint, allow_pickle=True)
    if found.loaded:
        raise T2NErrorCheckpoint(
            f"from_pretrained(use_safetensors=True) inside ctx_maybe_load_from_disk_as_offloaded: "
            f"the checkpoint of '{checkpoint.parent}' is a pickle checkpoint "
            f"('{found.source.name}'), not "
            "safetensors; convert it to safetensors, or leave use_safetensors unset to read it "
            "with torch.load(weights_only=True)"
        )


def _pretrained_config(cls: type[Any], directory: Path, given: Any) -> Any:
    """The configuration ``from_pretrained`` builds ``cls`` with: a copy of ``given``, or
    ``cls``'s configuration class read from ``given`` (a path) or the checkpoint."""
    import transformers

    if isinstance(given, transformers.PretrainedConfig):
        return copy.deepcopy(given)
    if given is not None and not isinstance(given, (str, os.PathLike)):
        raise T2NErrorMisuse(
            f"config= must be a transformers configuration or the path of one; got "
            f"{type(given).__name__}"
        )
    config_class = getattr(cls, "config_class", None) or transformers.AutoConfig
    return config_class.from_pretrained(directory if given is None else given)


def _keep_in_float32(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the skeleton's tensors that transformers keeps in float32 under ``dtype`` (the
    model's ``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under
    float16 and bfloat16) that dtype, as ``from_pretrained`` does: T5's feed-forward output
    overflows in float16. A tensor under several names is kept whole (ties stay)."""
    plan = getattr(model, "_get_dtype_plan", None)
    patterns: list[str] = []
    if callable(plan):
        patterns = [key for key, kept in plan(dtype).items() if kept == torch.float32]
    else:  # transformers before the plan: the same two rules
        if dtype == torch.float16:
            patterns += getattr(model, "_keep_in_fp32_modules", None) or ()
        if dtype in (torch.float16, torch.bfloat16):
            patterns += getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    if not patterns:
        return
    # transformers' matching: a pattern anywhere in the tensor's name, "*" any text.
    kept = re.compile("|".join(f"(?:{pattern.replace('*', '.*')})" for pattern in patterns))
    updater = ModTensorUpdater(model, add_buffers=True)
    for names, tensor in list(updater.iter_tensors()):
        narrower = tensor.is_floating_point() and tensor.dtype != torch.float32
        if narrower and any(kept.search(name) for name in names):
            updater.update_by_ref(
                tensor, tensor.to(torch.float32), enforce_tensor_consistency=False
            )


def _checkpoint_dtype(checkpoint: Path) -> torch.dtype | None:
    """The floating-point dtype most of the checkpoint's bytes are stored in."""
    found = open_checkpoint(checkpoint, allow_pickle=True)
    weights: dict[torch.dtype, int] = {}
    for key in found:
        shape, dtype = found.describe(key)
        if dtype.is_floating_point:
            weights[dtype] = weights.get(dtype, 0) + int(torch.Size(shape).numel())
    return max(weights, key=lambda d: weights[d]) if weights else None
