"""Opaque payloads: a :class:`SupportsOffloadState` value as tensors plus string metadata.

The metadata holds the class tag under ``"t2n.class"`` and the JSON attributes under
``"t2n.attributes"``; decoding looks the class up by its tag and calls its
``from_offload_state``. No code is ever loaded from a file: an unknown tag is an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.opaque import SupportsOffloadState, offload_state_class

__all__ = ["decode_opaque", "encode_opaque", "is_opaque_payload"]

CLASS_KEY = "t2n.class"
ATTRIBUTES_KEY = "t2n.attributes"


def encode_opaque(value: SupportsOffloadState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Describe ``value`` as the tensors and metadata of a payload file.

    Args:
        value: an opaque tensor implementing :class:`SupportsOffloadState`.

    Returns:
        ``(tensors, metadata)`` ready for :func:`write_payload`: the tensors of
        ``value.offload_state()`` and ``{"t2n.class": tag, "t2n.attributes": json}``.

    Raises:
        T2NErrorMisuse: ``value`` does not support offload state, or its state is not a dict
            of str to tensors plus JSON-able attributes.
    """
    if not isinstance(value, SupportsOffloadState):
        raise T2NErrorMisuse(
            f"{type(value).__name__} does not implement SupportsOffloadState and cannot be "
            "stored as an opaque payload"
        )
    tensors, attributes = value.offload_state()
    kind = type(value).__name__
    if not isinstance(tensors, dict) or not all(
        isinstance(key, str) and isinstance(tensor, torch.Tensor) for key, tensor in tensors.items()
    ):
        raise T2NErrorMisuse(f"{kind}.offload_state() must return a dict of str to tensors first")
    if not isinstance(attributes, dict):
        raise T2NErrorMisuse(
            f"{kind}.offload_state() must return a dict of attributes second, "
            f"got {type(attributes).__name__}"
        )
    try:
        encoded = json.dumps(attributes, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise T2NErrorMisuse(
            f"the attributes of {kind}.offload_state() must be JSON-able: {exc}"
        ) from exc
    return dict(tensors), {CLASS_KEY: value.offload_tag, ATTRIBUTES_KEY: encoded}


def is_opaque_payload(metadata: Mapping[str, str]) -> bool:
    """Whether a payload's ``metadata`` describes an opaque value (written by
    :func:`encode_opaque`)."""
    return CLASS_KEY in metadata


def decode_opaque(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> torch.Tensor:
    """Rebuild the opaque value described by a payload's tensors and metadata.

    Args:
        tensors: the payload's tensors (e.g. from :func:`read_payload`).
        metadata: the payload's metadata, holding ``t2n.class`` and ``t2n.attributes``.

    Returns:
        the value built by ``offload_state_class(tag).from_offload_state(tensors, attributes)``.

    Raises:
        T2NErrorStorage: the metadata lacks the class tag or the attributes, the attributes
            are not a JSON object, the tag is unknown, or the class does not build a tensor.
    """
    tag = metadata.get(CLASS_KEY)
    encoded = metadata.get(ATTRIBUTES_KEY)
    if tag is None or encoded is None:
        raise T2NErrorStorage(
            f"payload metadata lacks {CLASS_KEY!r} or {ATTRIBUTES_KEY!r} (found keys "
            f"{sorted(metadata)}); it does not describe an opaque tensor"
        )
    try:
        attributes: Any = json.loads(encoded)
    except (ValueError, RecursionError) as exc:
        raise T2NErrorStorage(
            f"the {ATTRIBUTES_KEY!r} of a {tag!r} payload are not valid JSON: {exc}"
        ) from exc
    if not isinstance(attributes, dict):
        raise T2NErrorStorage(
            f"the {ATTRIBUTES_KEY!r} of a {tag!r} payload must be a JSON object, "
            f"got {type(attributes).__name__}"
        )
    value = offload_state_class(tag).from_offload_state(dict(tensors), attributes)
    if not isinstance(value, torch.Tensor):
        raise T2NErrorStorage(
            f"{tag}.from_offload_state() built a {type(value).__name__}, not a tensor"
        )
    return value
