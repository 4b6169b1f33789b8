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
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, TypeVar

import torch
from torch import nn

from torch_to_nnef.exceptions import T2NErrorCheckpoint, T2NErrorMisuse
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.updater import ModTensorUpdater

__all__ = ["SAFETENSORS_INDEX_NAME", "load_offloaded_checkpoint", "offload_module"]

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
"""Name of the index of a sharded checkpoint (``{"weight_map": {key: shard file}}``)."""

SAFETENSORS_SINGLE_NAME = "model.safetensors"
"""Name of a single-file checkpoint inside a checkpoint directory."""

_M = TypeVar("_M", bound=nn.Module)


# ---------------------------------------------------------------------------------------------
# offload_module
# ---------------------------------------------------------------------------------------------
def offload_module(
    model: _M,
    offload_dir: str | os.PathLike[str] | None = None,
    *,
    include_buffers: bool = True,
    min_bytes: int = 0,
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
        min_bytes: keep tensors smaller than this many bytes resident (biases, norms).

    Returns:
        ``model`` itself.

    Raises:
        T2NErrorMisuse: a tensor is on the meta device (use :func:`load_offloaded_checkpoint`),
            or ``min_bytes`` is negative.
        T2NErrorNotImplemented: an opaque tensor has no offload state.
        T2NErrorStorage: a payload file cannot be written. Tensors offloaded before the
            failure stay offloaded.
    """
    if min_bytes < 0:
        raise T2NErrorMisuse(f"min_bytes cannot be negative, got {min_bytes}")
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
class _Checkpoint:
    """The tensors of a checkpoint: which file holds each key, and each file's layout."""

    source: Path
    files: Mapping[str, Path]  # key -> file
    layouts: Mapping[Path, storage.PayloadLayout]

    def spec(self, key: str) -> storage.EntrySpec:
        return self.layouts[self.files[key]].entries[key]

    def layout(self, key: str) -> storage.PayloadLayout:
        return self.layouts[self.files[key]]


@dataclass(frozen=True)
class _PlannedBinding:
    tensor: torch.Tensor
    names: tuple[str, ...]
    key: str


def load_offloaded_checkpoint(
    model: _M,
    checkpoint: str | os.PathLike[str],
    *,
    device: torch.device | str | int = "cpu",
    strict: bool = True,
    offload_dir: str | os.PathLike[str] | None = None,
) -> _M:
    """Bind every parameter and buffer of ``model`` to a tensor of a safetensors checkpoint.

    The model is typically built on the meta device (``with torch.device("meta"):
    model = Net()``) so that its weights take no memory. Each of its tensors is replaced by
    an :class:`OffloadedTensor` reading its checkpoint entry in place (no copy is made; the
    checkpoint is never modified: writes copy on write into ``offload_dir``). A tensor
    reachable under several names (tied weights) is bound once, from the first of its names
    the checkpoint holds. Non-persistent buffers (absent from state dicts) are bound when the
    checkpoint holds them and left untouched otherwise.

    Everything is checked before anything is bound: on error the model is unchanged.

    Args:
        model: the module to bind.
        checkpoint: a ``.safetensors`` file, a sharded checkpoint's index
            (``model.safetensors.index.json``, mapping keys to shard files in its directory
            under ``"weight_map"``), or a directory holding either.
        device: the target device of the offloaded tensors.
        strict: refuse model tensors missing from the checkpoint and checkpoint tensors the
            model does not have (as ``nn.Module.load_state_dict``). Shape and dtype mismatches
            are refused in any case.
        offload_dir: where copies on write go; ``None`` for a private temporary directory.

    Returns:
        ``model`` itself.

    Raises:
        T2NErrorCheckpoint: the checkpoint cannot be found or its index is invalid (not JSON,
            no ``weight_map``, a shard path outside the checkpoint directory, a key absent
            from its shard), or it does not fit the model: the message lists every missing
            key, unexpected key and shape or dtype mismatch at once.
        T2NErrorStorage: a checkpoint file is not a valid safetensors file.
    """
    found = _open_checkpoint(Path(checkpoint))
    updater = ModTensorUpdater(model, add_buffers=True)
    transient = _non_persistent_buffer_names(model)
    bindings: list[_PlannedBinding] = []
    missing: list[str] = []
    mismatched: list[str] = []
    known: set[str] = set()
    for names, tensor in updater.iter_tensors():
        known.update(names)
        key = next((name for name in names if name in found.files), None)
        if key is None:
            if not all(name in transient for name in names):
                missing.append(_tied_names(names))
            continue
        spec = found.spec(key)
        if spec.shape != tuple(tensor.shape) or spec.dtype != tensor.dtype:
            mismatched.append(
                f"{key!r}: checkpoint shape {spec.shape} dtype {spec.dtype}, model shape "
                f"{tuple(tensor.shape)} dtype {tensor.dtype}"
            )
            continue
        bindings.append(_PlannedBinding(tensor, names, key))
    unexpected = sorted(key for key in found.files if key not in known)
    if mismatched or (strict and (missing or unexpected)):
        raise T2NErrorCheckpoint(
            _mismatch_message(found.source, missing, unexpected, mismatched, strict=strict)
        )
    for binding in bindings:
        offloaded = OffloadedTensor.from_safetensors(
            found.layout(binding.key),
            binding.key,
            offload_dir=offload_dir,
            device=device,
            name=binding.names[0],
        )
        updater.update_by_ref(binding.tensor, offloaded, enforce_tensor_consistency=False)
    return model


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


def _mismatch_message(
    source: Path,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[str],
    *,
    strict: bool,
) -> str:
    parts = [f"checkpoint '{source}' does not fit the model:"]
    if mismatched:
        parts.append(f"{len(mismatched)} shape/dtype mismatch(es): {'; '.join(mismatched)}.")
    if strict and missing:
        parts.append(f"{len(missing)} missing key(s): {', '.join(missing)}.")
    if strict and unexpected:
        listed = ", ".join(repr(key) for key in unexpected)
        parts.append(f"{len(unexpected)} unexpected key(s): {listed}.")
    hint = "Build the model with the checkpoint's configuration and dtype"
    if strict and (missing or unexpected):
        hint += ", or pass strict=False to bind the keys both have"
    return " ".join(parts) + f" {hint}."


def _open_checkpoint(path: Path) -> _Checkpoint:
    """Find the checkpoint files and read their layouts."""
    if path.is_dir():
        index = path / SAFETENSORS_INDEX_NAME
        if index.is_file():
            return _open_index(index)
        single = path / SAFETENSORS_SINGLE_NAME
        if single.is_file():
            return _open_single(single)
        raise T2NErrorCheckpoint(
            f"checkpoint directory '{path}' holds neither {SAFETENSORS_INDEX_NAME} nor "
            f"{SAFETENSORS_SINGLE_NAME}; pass the .safetensors file or the index itself"
        )
    if not path.exists():
        raise T2NErrorCheckpoint(f"checkpoint '{path}' does not exist")
    if path.name.endswith(".json"):
        return _open_index(path)
    return _open_single(path)


def _open_single(path: Path) -> _Checkpoint:
    layout = storage.read_layout(path)
    return _Checkpoint(path, {key: layout.path for key in layout.entries}, {layout.path: layout})


def _open_index(index: Path) -> _Checkpoint:
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
    layouts = {path: storage.read_layout(path) for path in sorted(set(files.values()))}
    absent = sorted(key for key, path in files.items() if key not in layouts[path].entries)
    if absent:
        listed = ", ".join(f"{key!r} (in '{files[key].name}')" for key in absent)
        raise T2NErrorCheckpoint(
            f"index '{index}' lists keys that their shard does not hold: {listed}; the index "
            "and the shards do not belong together"
        )
    return _Checkpoint(index, files, layouts)


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        document: Any = json.loads(index.read_text(encoding="utf-8"))
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
