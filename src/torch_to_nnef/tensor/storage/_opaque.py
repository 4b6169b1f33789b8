"""Opaque payloads: the offload state of a :class:`SupportsOffloadState` value, without pickle.

An offload state is a dict (see :class:`~torch_to_nnef.tensor.opaque.SupportsOffloadState`).
Its tensors become the entries of the payload file; everything else becomes JSON in the
metadata: the class tag under ``"t2n.class"`` and the other values under ``"t2n.attributes"``.

- A tensor at the top level of the state is the entry named by its key. A tensor deeper
  down (in a list, tuple or dict) is the entry named by its dotted path (``"parts.0"``) and
  is written in the JSON as ``{"tensor": "<entry>"}``.
- ``None``, booleans, numbers, strings and lists are JSON as they are; a tuple is
  ``{"tuple": [...]}``, a dict ``{"dict": {...}}``, a ``torch.dtype`` ``{"dtype": "float16"}``,
  a ``torch.device`` ``{"device": "cuda:0"}``, a ``torch.Size`` ``{"size": [...]}``.
- An object that implements ``SupportsOffloadState`` itself (a quantization scheme) nests as
  ``{"state": {"tag": ..., "value": {...}}}``, its own state encoded by the same rules; it is
  rebuilt by its registered class.

Decoding looks the class up by its tag and calls its ``from_offload_state``: no code is ever
loaded from a file, an unknown tag or an unknown JSON form is an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_to_nnef.exceptions import T2NError, T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.opaque import (
    OFFLOAD_STATE_KEY,
    OpaqueTensor,
    OpaqueTensorRef,
    SupportsOffloadState,
    offload_state_class,
)

__all__ = [
    "decode_offload_state",
    "decode_opaque",
    "encode_opaque",
    "is_opaque_payload",
    "value_nbytes",
]

CLASS_KEY = "t2n.class"
ATTRIBUTES_KEY = "t2n.attributes"

_SUPPORTED = (
    "tensors, None, bool, int, float, str, torch.dtype, torch.device, torch.Size, objects "
    "implementing SupportsOffloadState, and lists, tuples and str-keyed dicts of them"
)
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------
def _encode_value(value: Any, path: str, tensors: dict[str, torch.Tensor], kind: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, path, tensors, kind)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode_value(v, f"{path}.{i}", tensors, kind) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        return {"dict": _encode_mapping(value, f"{path}.", tensors, kind)}
    if isinstance(value, SupportsOffloadState):
        tag, state = _state_of(value)
        return {"state": {"tag": tag, "value": _encode_mapping(state, f"{path}.", tensors, kind)}}
    raise T2NErrorMisuse(
        f"{kind}.to_offload_state() holds a {type(value).__name__} at {path!r}, which cannot be "
        f"stored without pickle; an offload state holds {_SUPPORTED}"
    )


def _encode_tensor(
    value: torch.Tensor, path: str, tensors: dict[str, torch.Tensor], kind: str
) -> dict[str, str]:
    if isinstance(value, (OpaqueTensor, OpaqueTensorRef)) or value.device.type == "meta":
        raise T2NErrorMisuse(
            f"{kind}.to_offload_state() holds a {type(value).__name__} on {value.device} at "
            f"{path!r}; an offload state holds plain tensors with values (expand opaque ones "
            "with opaque_to_final_tensor)"
        )
    if path in tensors:
        raise T2NErrorMisuse(
            f"{kind}.to_offload_state() names two tensors {path!r} (a key with a dot clashes "
            "with a nested path); rename one of them"
        )
    plain = value.detach()
    tensors[path] = plain if type(plain) is torch.Tensor else plain.as_subclass(torch.Tensor)
    return {"tensor": path}


def _encode_mapping(
    mapping: Mapping[Any, Any], prefix: str, tensors: dict[str, torch.Tensor], kind: str
) -> dict[str, Any]:
    encoded: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise T2NErrorMisuse(
                f"{kind}.to_offload_state() has a key {key!r} of type {type(key).__name__} "
                f"under {prefix.rstrip('.') or 'the state'!r}; offload state keys are str"
            )
        encoded[key] = _encode_value(value, f"{prefix}{key}", tensors, kind)
    return encoded


def _state_of(value: SupportsOffloadState) -> tuple[str, dict[str, Any]]:
    """The tag and the state of ``value``, without the tag entry."""
    kind = type(value).__name__
    tag = type(value).OFFLOAD_STATE_TAG
    state = value.to_offload_state()
    if not isinstance(state, dict):
        raise T2NErrorMisuse(
            f"{kind}.to_offload_state() must return a dict, got {type(state).__name__}"
        )
    if state.get(OFFLOAD_STATE_KEY, tag) != tag:
        raise T2NErrorMisuse(
            f"{kind}.to_offload_state() is tagged {state[OFFLOAD_STATE_KEY]!r} but {kind} is "
            f"registered as {tag!r}; put type(self).OFFLOAD_STATE_TAG under OFFLOAD_STATE_KEY"
        )
    return tag, {key: v for key, v in state.items() if key != OFFLOAD_STATE_KEY}


def encode_opaque(value: SupportsOffloadState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Describe ``value`` as the tensors and metadata of a payload file.

    Args:
        value: an opaque tensor implementing :class:`SupportsOffloadState`.

    Returns:
        ``(tensors, metadata)`` ready for :func:`write_payload`: the tensors of
        ``value.to_offload_state()`` by entry name, and
        ``{"t2n.class": tag, "t2n.attributes": json}``.

    Raises:
        T2NErrorMisuse: ``value`` does not support offload state, or its state is not a dict,
            names another class's tag, or holds values that cannot be stored without pickle
            (the message names the key).
    """
    if not isinstance(value, SupportsOffloadState):
        raise T2NErrorMisuse(
            f"{type(value).__name__} does not implement SupportsOffloadState and cannot be "
            "stored as an opaque payload"
        )
    kind = type(value).__name__
    tag, top = _state_of(value)
    tensors: dict[str, torch.Tensor] = {}
    attributes: dict[str, Any] = {}
    for key, encoded in _encode_mapping(top, "", tensors, kind).items():
        if not (isinstance(encoded, dict) and encoded.get("tensor") == key):
            attributes[key] = encoded  # top-level tensors are entries named by their key
    try:
        document = json.dumps(attributes, sort_keys=True, allow_nan=False)
    except ValueError as exc:
        raise T2NErrorMisuse(
            f"the attributes of {kind}.to_offload_state() must be JSON-able: {exc}"
        ) from exc
    return tensors, {CLASS_KEY: tag, ATTRIBUTES_KEY: document}


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
def _decode_value(value: Any, tensors: Mapping[str, torch.Tensor], used: set[str]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode_value(v, tensors, used) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((form, body),) = value.items()
        if form == "tensor" and isinstance(body, str) and body in tensors:
            used.add(body)
            return tensors[body]
        if form == "tuple" and isinstance(body, list):
            return tuple(_decode_value(v, tensors, used) for v in body)
        if form == "dict" and isinstance(body, dict):
            return {k: _decode_value(v, tensors, used) for k, v in body.items()}
        if form == "dtype" and body in _DTYPES:
            return _DTYPES[body]
        if form == "device" and isinstance(body, str):
            try:
                return torch.device(body)
            except RuntimeError:
                pass
        if form == "size" and isinstance(body, list) and all(type(d) is int for d in body):
            return torch.Size(body)
        if form == "state" and isinstance(body, dict) and set(body) == {"tag", "value"}:
            tag, nested = body["tag"], body["value"]
            if isinstance(tag, str) and isinstance(nested, dict):
                state = {k: _decode_value(v, tensors, used) for k, v in nested.items()}
                return _rebuild(offload_state_class(tag), {**state, OFFLOAD_STATE_KEY: tag}, None)
    text = json.dumps(value)
    raise T2NErrorStorage(
        f"an offload state holds {text[:80]!r}, which is no known encoded value (a missing "
        "tensor entry, an unknown dtype or a malformed tuple, dict, device or size)"
    )


def decode_offload_state(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[type[SupportsOffloadState], dict[str, Any]]:
    """Rebuild the offload state a payload's tensors and metadata describe, and its class.

    Args:
        tensors: the payload's tensors by entry name (e.g. from :func:`read_payload`).
        metadata: the payload's metadata, holding ``t2n.class`` and ``t2n.attributes``.

    Returns:
        ``(cls, state)``: the registered class and the state, tagged under
        ``OFFLOAD_STATE_KEY``, ready for ``cls.from_offload_state(state)``.

    Raises:
        T2NErrorStorage: the metadata lacks the class tag or the attributes, the attributes
            are not a JSON object or hold unknown forms, the tag is unknown, or an entry is
            both a top-level tensor and an attribute.
    """
    tag = metadata.get(CLASS_KEY)
    document = metadata.get(ATTRIBUTES_KEY)
    if tag is None or document is None:
        raise T2NErrorStorage(
            f"payload metadata lacks {CLASS_KEY!r} or {ATTRIBUTES_KEY!r} (found keys "
            f"{sorted(metadata)}); it does not describe an opaque tensor"
        )
    try:
        attributes: Any = json.loads(document)
    except (ValueError, RecursionError) as exc:
        raise T2NErrorStorage(
            f"the {ATTRIBUTES_KEY!r} of a {tag!r} payload are not valid JSON: {exc}"
        ) from exc
    if not isinstance(attributes, dict):
        raise T2NErrorStorage(
            f"the {ATTRIBUTES_KEY!r} of a {tag!r} payload must be a JSON object, "
            f"got {type(attributes).__name__}"
        )
    cls = offload_state_class(tag)
    used: set[str] = set()
    try:
        state = {key: _decode_value(v, tensors, used) for key, v in attributes.items()}
    except RecursionError as exc:
        raise T2NErrorStorage(f"the attributes of a {tag!r} payload nest too deeply") from exc
    for name, tensor in tensors.items():
        if name in used:
            continue
        if name in state or name == OFFLOAD_STATE_KEY:
            raise T2NErrorStorage(
                f"entry {name!r} of a {tag!r} payload is also one of its attributes"
            )
        state[name] = tensor
    state[OFFLOAD_STATE_KEY] = tag
    return cls, state


def _rebuild(cls: type[SupportsOffloadState], state: dict[str, Any], target_device: Any) -> Any:
    """``cls.from_offload_state(state, target_device)``, any failure a ``T2NError``."""
    try:
        return cls.from_offload_state(state, target_device=target_device)
    except T2NError:
        raise
    except Exception as exc:
        raise T2NErrorStorage(
            f"{cls.__name__}.from_offload_state() could not rebuild a "
            f"{state[OFFLOAD_STATE_KEY]!r} payload: {type(exc).__name__}: {exc}"
        ) from exc


def is_opaque_payload(metadata: Mapping[str, str]) -> bool:
    """Whether a payload's ``metadata`` describes an opaque value (written by
    :func:`encode_opaque`)."""
    return CLASS_KEY in metadata


def decode_opaque(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    target_device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rebuild the opaque value described by a payload's tensors and metadata.

    Args:
        tensors: the payload's tensors (e.g. from :func:`read_payload`).
        metadata: the payload's metadata, holding ``t2n.class`` and ``t2n.attributes``.
        target_device: passed to ``from_offload_state``: where to place the value (``None``:
            where ``tensors`` are).

    Returns:
        the value built by ``cls.from_offload_state(state, target_device=...)``.

    Raises:
        T2NErrorStorage: as :func:`decode_offload_state`; or the class does not build a
            tensor from the state, or fails with an error that is not a ``T2NError`` (an
            assertion or a missing key in a class written for upstream torch-to-nnef).
    """
    cls, state = decode_offload_state(tensors, metadata)
    tag = state[OFFLOAD_STATE_KEY]
    value = _rebuild(cls, state, target_device)
    if not isinstance(value, torch.Tensor):
        raise T2NErrorStorage(
            f"{tag}.from_offload_state() built a {type(value).__name__}, not a tensor"
        )
    return value


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
_SPARSE_PARTS: dict[torch.layout, tuple[Callable[[torch.Tensor], torch.Tensor], ...]] = {
    torch.sparse_coo: (torch.Tensor._indices, torch.Tensor._values),
    torch.sparse_csr: (torch.Tensor.crow_indices, torch.Tensor.col_indices, torch.Tensor.values),
    torch.sparse_bsr: (torch.Tensor.crow_indices, torch.Tensor.col_indices, torch.Tensor.values),
    torch.sparse_csc: (torch.Tensor.ccol_indices, torch.Tensor.row_indices, torch.Tensor.values),
    torch.sparse_bsc: (torch.Tensor.ccol_indices, torch.Tensor.row_indices, torch.Tensor.values),
}
"""The tensors a sparse tensor of each layout holds its indices and values in."""


def value_nbytes(value: torch.Tensor) -> int:
    """Bytes of memory a loaded value holds: a plain tensor's own, and for an opaque value
    (a ``QTensor``) those of the tensors it keeps in its attributes, nested objects (its
    scheme) included, each storage once. A value in memory may take more than its payload
    file: Q4_0 codes are packed two per byte in the file and held one per byte. A sparse
    tensor among them holds its indices and values; another tensor without a storage of its
    own (an MKL-DNN tensor) counts its elements.

    Args:
        value: a loaded value (what ``OffloadedTensor.reload`` returns).
    """
    if type(value) is torch.Tensor or not isinstance(value, OpaqueTensor):
        return value.numel() * value.element_size()
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    pending: list[Any] = list(vars(value).values())
    # The parts of sparse tensors, new tensor objects: kept alive until the end, so that no
    # other object takes the identity ``seen`` holds of one.
    parts: list[torch.Tensor] = []
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if type(item) is not torch.Tensor:
                pending.append(item.__dict__)
            elif item.layout in _SPARSE_PARTS:
                found = [part(item) for part in _SPARSE_PARTS[item.layout]]
                parts.extend(found)
                pending.extend(found)
            elif item.layout == torch.strided:
                held = item.untyped_storage()
                storages[(str(item.device), held.data_ptr())] = held.nbytes()
            else:  # no storage to read (an MKL-DNN tensor): its elements
                storages[("", id(item))] = item.numel() * item.element_size()
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            pending.extend(vars(item).values())
    return sum(storages.values())
