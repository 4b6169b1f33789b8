"""Quantized tensors that the tract inference engine reads natively.

:class:`QTensorTractScaleOnly` is tract's Q4_0: 4-bit codes in groups of 32 sharing a float16
scale. It dequantizes exactly as tract does on the machine it targets, writes itself as a tract
``.dat`` file, and describes itself for offloading (:class:`SupportsOffloadState`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from torch_to_nnef.exceptions import (
    T2NErrorImpossibleQuantization,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
)
from torch_to_nnef.tensor.opaque import OFFLOAD_STATE_KEY, SupportsOffloadState
from torch_to_nnef.tensor.quant._dat import (
    Q40_GROUP_SIZE,
    Q40Layout,
    label_path,
    q40_dat_bytes,
    write_dat_file,
)
from torch_to_nnef.tensor.quant.base import (
    QScalePerGroupF16,
    QScheme,
    QTensor,
    U8Compressor,
    plain_float,
    qscale_per_group_f16_min_max_calibration,
)

__all__ = [
    "Q40Layout",
    "QTensorTract",
    "QTensorTractScaleOnly",
    "fp_to_tract_q4_0_with_min_max_calibration",
]

_T = TypeVar("_T", bound="QTensorTractScaleOnly")

Q40_N_BITS = 4
_MIN_RANK, _MAX_RANK = 2, 4
_STATE_FORMAT = 1
_STATE_PACKING = "nibble_pairs"
_FLOAT_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def check_q40_shape(shape: torch.Size | tuple[int, ...]) -> None:
    """Check that a weight of ``shape`` can be stored as tract Q4_0.

    Raises:
        T2NErrorImpossibleQuantization: the rank is not 2 to 4, the tensor is empty, or the
            trailing volume (product of the dims after the first) is not divisible by 32.
    """
    shape = tuple(int(d) for d in shape)
    rule = (
        f"tract Q4_0 stores {_MIN_RANK}-D to {_MAX_RANK}-D weights whose trailing volume "
        f"(product of the dims after the first) is a multiple of {Q40_GROUP_SIZE}"
    )
    if not _MIN_RANK <= len(shape) <= _MAX_RANK:
        raise T2NErrorImpossibleQuantization(
            f"{rule}; got a {len(shape)}-D tensor of shape {shape}: keep it in floating point"
        )
    trailing = 1
    for dim in shape[1:]:
        trailing *= dim
    if 0 in shape or trailing % Q40_GROUP_SIZE != 0:
        raise T2NErrorImpossibleQuantization(
            f"{rule}; got shape {shape} (trailing volume {trailing}): keep it in floating point"
        )


def _check_q40_scheme(qscheme: QScheme) -> QScalePerGroupF16:
    if (
        not isinstance(qscheme, QScalePerGroupF16)
        or qscheme.n_bits != Q40_N_BITS
        or qscheme.group_size != Q40_GROUP_SIZE
    ):
        raise T2NErrorImpossibleQuantization(
            f"tract Q4_0 needs a QScalePerGroupF16 with n_bits={Q40_N_BITS} and "
            f"group_size={Q40_GROUP_SIZE}, got {qscheme!r}; calibrate with "
            "fp_to_tract_q4_0_with_min_max_calibration"
        )
    return qscheme


def _check_machine(specific_machine: Any) -> str | None:
    if specific_machine is not None and not isinstance(specific_machine, str):
        raise T2NErrorMisuse(
            "specific_machine must be None (this host) or a platform.machine() name such as "
            f"'arm64', 'aarch64' or 'x86_64', got {specific_machine!r}"
        )
    return specific_machine


def dequantizes_through_f16(machine: str) -> bool:
    """Whether tract dequantizes Q4_0 in float16 on ``machine`` (ARM: ``arm64``, ``aarch64``)."""
    name = machine.lower()
    return name.startswith(("arm", "aarch64"))


class QTensorTract(QTensor):
    """Base class of the QTensors that tract reads natively (see :class:`QTensorTractScaleOnly`)."""

    @property
    def decompressed_shape(self) -> torch.Size:
        """The shape of the codes once every compressor is undone (of
        :meth:`decompress_to_u8`)."""
        if not self.u8_compressors:
            return self.u8_blob.shape
        return self.decompress_to_u8().shape


class QTensorTractScaleOnly(QTensorTract, SupportsOffloadState):
    """tract's Q4_0: 4-bit codes, groups of 32 values sharing a float16 scale.

    Accepts 2-D to 4-D weights whose trailing volume (product of the dims after the first) is
    a multiple of 32, so that no group straddles two output channels.

    :meth:`decompress` reproduces tract's arithmetic: on ARM machines tract dequantizes in
    float16 (then the value is cast to ``dequant_to_dtype``), elsewhere directly in
    ``dequant_to_dtype``. The machine is ``specific_machine`` when given (a
    ``platform.machine()`` name), else this host.

    Args:
        fp_tensor: the floating point weight to quantize (not kept).
        qscheme: a :class:`QScalePerGroupF16` with ``n_bits=4`` and ``group_size=32``.
        dequant_to_dtype: floating dtype of the dequantized value.
        u8_compressors: transforms applied to the codes held in memory.
        specific_machine: the machine whose dequantization to reproduce (``None``: this host).

    Raises:
        T2NErrorImpossibleQuantization: the shape or the scheme does not fit Q4_0.
        T2NErrorMisuse: an argument is not of the expected kind.
    """

    qscheme: QScalePerGroupF16  # type: ignore[assignment]
    specific_machine: str | None

    OFFLOAD_STATE_TAG: ClassVar[str] = "torch_to_nnef.QTensorTractScaleOnly"
    _CARRIED_ATTRIBUTES: ClassVar[tuple[str, ...]] = ("nnef_name", "specific_machine")

    def __init__(
        self,
        fp_tensor: torch.Tensor,
        qscheme: QScheme,
        dequant_to_dtype: torch.dtype = torch.float32,
        u8_compressors: Iterable[U8Compressor] | None = None,
        *,
        specific_machine: str | None = None,
    ) -> None:
        check_q40_shape(self.shape)
        _check_q40_scheme(qscheme)
        self.specific_machine = _check_machine(specific_machine)
        super().__init__(fp_tensor, qscheme, dequant_to_dtype, u8_compressors)

    @classmethod
    def _from_parts(
        cls: type[_T],
        *,
        u8_blob: torch.Tensor,
        qscheme: QScheme,
        shape: torch.Size | tuple[int, ...],
        dequant_to_dtype: torch.dtype,
        u8_compressors: list[U8Compressor],
        **attributes: Any,
    ) -> _T:
        check_q40_shape(shape)
        _check_q40_scheme(qscheme)
        _check_machine(attributes.get("specific_machine"))
        new: _T = super()._from_parts(
            u8_blob=u8_blob,
            qscheme=qscheme,
            shape=shape,
            dequant_to_dtype=dequant_to_dtype,
            u8_compressors=u8_compressors,
            **attributes,
        )
        return new

    # -- value -------------------------------------------------------------------------------
    def decompress(self) -> torch.Tensor:
        """Return the dequantized value, computed as tract computes it on the target machine."""
        machine = self.specific_machine or platform.machine()
        with torch.no_grad():
            codes = self.decompress_to_u8()
            if dequantizes_through_f16(machine):
                return self.qscheme.dequantize(codes, torch.float16).to(self.dequant_to_dtype)
            return self.qscheme.dequantize(codes, self.dequant_to_dtype)

    # -- tract file --------------------------------------------------------------------------
    def write_in_file(
        self,
        dirpath: str | os.PathLike[str],
        label: str,
        inference_target: Any = None,
        *,
        layout: Q40Layout | None = None,
    ) -> Path:
        """Write ``<dirpath>/<label>.dat``, the tract Q4_0 tensor file, and return its path.

        An NNEF graph reads it with ``variable<scalar>(label = '<label>', shape = [...])``.
        Writing the same label again with identical bytes does nothing. The file is written
        atomically (a temporary file renamed into place).

        Args:
            dirpath: the model folder (created if missing).
            label: the variable label; ``/`` separates sub-folders.
            inference_target: the tract version to write for, which chooses the nibble
                order: a version string (``"0.21.11"``) or an object with a ``version``
                attribute (an upstream ``TractNNEF``); ``None``: the current layout.
            layout: the nibble order itself, instead of ``inference_target``
                (``Q40Layout.CURRENT`` for tract >= 0.21.11, ``Q40Layout.LEGACY`` before).

        Raises:
            T2NErrorMisuse: the label escapes ``dirpath``, ``inference_target`` or ``layout``
                is not of a supported kind or they disagree, or the file exists with
                different content.
            T2NErrorStorage: the file could not be written.
        """
        return _write_q40(
            dirpath, label, self.decompress_to_u8(), self.qscheme.scale, inference_target, layout
        )

    # -- offload state -----------------------------------------------------------------------
    def to_offload_state(self) -> dict[str, Any]:
        """Describe this tensor as two uint8/float16 tensors plus plain attributes.

        ``u8_blob`` holds two 4-bit codes per byte (code ``2i`` in the low nibble of byte
        ``i``, code ``2i + 1`` in its high nibble), half the size of the in-memory codes;
        ``scale`` holds the float16 scale of each group. Both stay on this tensor's device.
        The other entries are JSON values (``shape``, ``dequant_to_dtype`` as a dtype name,
        ``nnef_name``, ``specific_machine``, and the format's constants).

        Raises:
            T2NErrorNotImplemented: the tensor has u8 compressors, which are not serializable.
            T2NErrorMisuse: what it keeps was changed into what the state cannot hold: codes
                outside 0..15, or a scale that is not one float16 value per group (see
                :meth:`_checked_parts`).
        """
        if self.u8_compressors:
            raise T2NErrorNotImplemented(
                f"{type(self).__name__} with u8 compressors {self.u8_compressors} cannot be "
                "offloaded: compressors are not serializable; build it without compressors"
            )
        codes, scale = self._checked_parts()
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "u8_blob": codes[0::2] | (codes[1::2] << 4),
            "scale": scale,
            "format": _STATE_FORMAT,
            "shape": [int(d) for d in self.shape],
            "group_size": self.qscheme.group_size,
            "n_bits": self.qscheme.n_bits,
            "u8_packing": _STATE_PACKING,
            "scale_dtype": "float16",
            "dequant_to_dtype": str(self.dequant_to_dtype).removeprefix("torch."),
            "specific_machine": self.specific_machine,
            "nnef_name": self.nnef_name,
        }

    def _checked_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and the scale, flat, once checked to be what the offload state holds as
        they are (a payload written from anything else would read back as other values, or
        not at all): uint8 codes in 0..15, one per element, and one float16 scale per group
        of :data:`Q40_GROUP_SIZE` elements."""
        name = f"{type(self).__name__} {self.nnef_name or ''}".rstrip()
        codes = self.decompress_to_u8().reshape(-1)
        if codes.dtype != torch.uint8 or codes.numel() != self.numel():
            raise T2NErrorMisuse(
                f"{name}: its codes must be {self.numel()} uint8 values (one per element of "
                f"shape {tuple(self.shape)}), got {codes.numel()} {codes.dtype}; keep u8_blob "
                "as quantization made it, or quantize again"
            )
        if codes.numel() and int(codes.max()) > 15:
            raise T2NErrorMisuse(
                f"{name}: its 4-bit codes must lie in 0..15 (Q4_0 stores two per byte), got "
                f"{int(codes.max())}; clamp them (u8_blob.clamp_(0, 15)) or quantize again"
            )
        scale = self.qscheme.scale.reshape(-1)
        groups = self.numel() // Q40_GROUP_SIZE
        if scale.dtype != torch.float16 or scale.numel() != groups:
            raise T2NErrorMisuse(
                f"{name}: its scale must be {groups} float16 values (one per group of "
                f"{Q40_GROUP_SIZE}), got {scale.numel()} {scale.dtype}; assign it as float16 "
                "(qscheme.scale = scale.half())"
            )
        if not bool(torch.isfinite(scale).all()):
            raise T2NErrorMisuse(
                f"{name}: its scale must hold finite float16 values, got an inf or a nan (a "
                "value above 65504 does not fit float16); quantize again"
            )
        return codes, scale

    @classmethod
    def from_offload_state(
        cls: type[_T], state: dict[str, Any], target_device: torch.device | str | None = None
    ) -> _T:
        """Rebuild the tensor described by :meth:`to_offload_state`.

        Args:
            state: the offload state.
            target_device: where the rebuilt tensor lives; ``None``: where the state's
                tensors are.

        Raises:
            T2NErrorStorage: the state is not one of this class, or its tensors or attributes
                are missing, of the wrong kind, or inconsistent with each other.
        """
        try:
            parts = _read_state(cls, state)
            blob, scale = parts.pop("u8_blob"), parts.pop("scale")
            rebuilt = cls._from_parts(
                u8_blob=_unpack_nibbles(blob, parts["shape"]),
                qscheme=QScalePerGroupF16(Q40_GROUP_SIZE, scale, Q40_N_BITS),
                u8_compressors=[],
                **parts,
            )
        except (T2NErrorMisuse, T2NErrorImpossibleQuantization) as exc:
            raise T2NErrorStorage(f"invalid {cls.__name__} offload state: {exc}") from exc
        if target_device is None:
            return rebuilt
        moved: _T = rebuilt.to(device=target_device)  # type: ignore[assignment]
        return moved

    @classmethod
    def write_offload_state_in_file(
        cls,
        state: dict[str, Any],
        dirpath: str | os.PathLike[str],
        label: str,
        inference_target: Any = None,
    ) -> Path:
        """Write the tract ``.dat`` file of the tensor ``state`` describes, without rebuilding
        it, and return its path; the rules are those of :meth:`write_in_file`.

        Args:
            state: an offload state of this class (from :meth:`to_offload_state`).
            dirpath: the model folder (created if missing).
            label: the variable label; ``/`` separates sub-folders.
            inference_target: the tract version to write for (a version string or an object
                with a ``version`` attribute); ``None``: the current layout.

        Raises:
            T2NErrorStorage: ``state`` is not a valid offload state of this class, or the file
                could not be written.
            T2NErrorMisuse: as for :meth:`write_in_file`.
        """
        # Checked as a load checks it (a shape or scales tract cannot read are refused).
        return cls.from_offload_state(state).write_in_file(dirpath, label, inference_target)


def _unpack_nibbles(blob: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([blob & 0x0F, blob >> 4], dim=1).reshape(shape)


def _layout_for(inference_target: Any, layout: Q40Layout | None) -> Q40Layout:
    """The nibble order to write, from a tract version (or ``TractNNEF``) and/or a layout."""
    if layout is not None and not isinstance(layout, Q40Layout):
        raise T2NErrorMisuse(
            f"layout must be a Q40Layout (CURRENT or LEGACY), got {layout!r}; "
            "Q40Layout.for_tract_version('0.21.11') picks one from a tract version"
        )
    if inference_target is None:
        return layout or Q40Layout.CURRENT
    version = getattr(inference_target, "version", inference_target)
    to_str = getattr(version, "to_str", None)
    if callable(to_str):
        version = to_str()
    if not isinstance(version, str):
        raise T2NErrorMisuse(
            "inference_target must be a tract version such as '0.21.11' or an object with a "
            f"version attribute (upstream's TractNNEF), got {inference_target!r}"
        )
    chosen = Q40Layout.for_tract_version(version)
    if layout is not None and layout is not chosen:
        raise T2NErrorMisuse(
            f"tract {version} reads {chosen}, but layout={layout} was given; pass only one"
        )
    return chosen


def _write_q40(
    dirpath: str | os.PathLike[str],
    label: str,
    codes: torch.Tensor,
    scale: torch.Tensor,
    inference_target: Any,
    layout: Q40Layout | None,
) -> Path:
    chosen = _layout_for(inference_target, layout)
    path = label_path(dirpath, label)
    header, blocks = q40_dat_bytes(codes, scale, chosen)
    return write_dat_file(path, header, blocks)


def _read_state(cls: type[QTensorTractScaleOnly], state: Any) -> dict[str, Any]:
    """Validate an offload state; return the keyword arguments of ``_from_parts`` plus parts."""

    def fail(reason: str) -> T2NErrorStorage:
        return T2NErrorStorage(f"invalid {cls.__name__} offload state: {reason}")

    if not cls.is_offload_state(state):
        tag = state.get(OFFLOAD_STATE_KEY) if isinstance(state, dict) else None
        raise fail(
            f"expected a dict tagged {cls.OFFLOAD_STATE_TAG!r} under {OFFLOAD_STATE_KEY!r}, "
            f"got {type(state).__name__} tagged {tag!r}"
        )
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    attributes = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    if set(tensors) != {"u8_blob", "scale"}:
        raise fail(f"expected tensors 'u8_blob' and 'scale', got {sorted(tensors)}")
    expected = {
        "format": _STATE_FORMAT,
        "group_size": Q40_GROUP_SIZE,
        "n_bits": Q40_N_BITS,
        "u8_packing": _STATE_PACKING,
        "scale_dtype": "float16",
    }
    for key, value in expected.items():
        if attributes.get(key) != value:
            raise fail(f"attribute {key!r} must be {value!r}, got {attributes.get(key)!r}")
    shape = attributes.get("shape")
    if isinstance(shape, (tuple, torch.Size)):
        shape = list(shape)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise fail(f"attribute 'shape' must be a list of non-negative ints, got {shape!r}")
    try:  # before any use of the shape: torch cannot describe every list of ints
        check_q40_shape(tuple(shape))
    except T2NErrorImpossibleQuantization as exc:
        raise fail(str(exc)) from exc
    dtype = _FLOAT_DTYPES.get(str(attributes.get("dequant_to_dtype")).removeprefix("torch."))
    if dtype is None:
        raise fail(
            f"attribute 'dequant_to_dtype' must be one of {sorted(_FLOAT_DTYPES)}, "
            f"got {attributes.get('dequant_to_dtype')!r}"
        )
    nnef_name = attributes.get("nnef_name")
    if nnef_name is not None and not isinstance(nnef_name, str):
        raise fail(f"attribute 'nnef_name' must be a str or null, got {nnef_name!r}")
    blob, scale = tensors["u8_blob"], tensors["scale"]
    volume = 1
    for dim in shape:
        volume *= dim
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() * 2 != volume:
        raise fail(
            f"'u8_blob' must be a 1-D uint8 tensor of {volume // 2} bytes for shape {shape}, "
            f"got {blob.dtype} of shape {tuple(blob.shape)}"
        )
    if scale.dtype != torch.float16 or scale.numel() * Q40_GROUP_SIZE != volume:
        raise fail(
            f"'scale' must hold {volume // Q40_GROUP_SIZE} float16 values for shape {shape}, "
            f"got {scale.dtype} of shape {tuple(scale.shape)}"
        )
    if blob.device != scale.device:
        raise fail(f"'u8_blob' is on {blob.device} but 'scale' on {scale.device}")
    return {
        "u8_blob": blob,
        "scale": scale,
        "shape": tuple(shape),
        "dequant_to_dtype": dtype,
        "specific_machine": attributes.get("specific_machine"),
        "nnef_name": nnef_name,
    }


def fp_to_tract_q4_0_with_min_max_calibration(
    fp_tensor: torch.Tensor, percentile: float = 1.0
) -> QTensorTractScaleOnly:
    """Quantize a weight to tract's Q4_0 with min-max calibrated scales.

    The result dequantizes to the dtype of ``fp_tensor`` and lives on its device.

    Args:
        fp_tensor: a 2-D to 4-D floating point weight (an ``nn.Parameter`` is fine) whose
            trailing volume (product of the dims after the first) is a multiple of 32.
        percentile: in ``(0, 1]``, see :func:`qscale_per_group_f16_min_max_calibration`.

    Raises:
        T2NErrorImpossibleQuantization: the shape does not fit Q4_0 (the message gives it), or
            the values cannot be calibrated.
        T2NErrorMisuse: ``fp_tensor`` is not floating point or ``percentile`` is out of range.
    """
    values = plain_float(fp_tensor)
    check_q40_shape(values.shape)
    qscheme = qscale_per_group_f16_min_max_calibration(
        values, n_bits=Q40_N_BITS, group_size=Q40_GROUP_SIZE, percentile=percentile
    )
    return QTensorTractScaleOnly(values, qscheme, dequant_to_dtype=values.dtype)
