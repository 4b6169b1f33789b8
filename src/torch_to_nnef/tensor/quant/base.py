"""Quantized tensors: a uint8 code blob plus the scheme that turns codes back into floats.

:class:`QScheme` is the contract of a quantization scheme (float -> codes -> float).
:class:`QScalePerGroupF16` is the scheme tract uses for Q4_0: contiguous groups of values share
one float16 scale. :class:`U8Compressor` is an optional transform applied to the code blob while
it is held in memory. :class:`QTensor` ties them together as an :class:`OpaqueTensor`: it
reports the shape and floating dtype of the value it stands for, and any torch operation on it
runs on the dequantized value.
"""

from __future__ import annotations

import copy
import os
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
from torch_to_nnef.tensor.opaque import (
    OFFLOAD_STATE_KEY,
    OpaqueTensor,
    SupportsOffloadState,
    opaque_to_final_tensor,
)

__all__ = [
    "QScalePerGroupF16",
    "QScheme",
    "QTensor",
    "U8Compressor",
    "qscale_per_group_f16_min_max_calibration",
]

_Q = TypeVar("_Q", bound="QTensor")


def _canonical_device(device: torch.device | str | int) -> torch.device:
    """Return ``device`` with its index filled in (``cuda`` becomes ``cuda:<current>``)."""
    device = torch.device(device)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    return torch.empty(0, device=device).device


def _move_tensor_attributes(obj: Any, device: torch.device) -> Any:
    """Return a shallow copy of ``obj`` whose tensor attributes live on ``device``.

    ``obj`` itself is left untouched: schemes and compressors may be shared by several
    quantized tensors.
    """
    tensors = {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}
    if all(v.device == device for v in tensors.values()):
        return obj
    moved = copy.copy(obj)
    for key, value in tensors.items():
        setattr(moved, key, value.to(device))
    return moved


class QScheme:
    """A quantization scheme: how floats become uint8 codes and codes become floats again.

    Subclasses implement :meth:`quantize_as_u8` and :meth:`dequantize` (and
    :meth:`quantize_as_torch` when PyTorch has a quantized dtype for the scheme). A scheme is a
    value object: methods never mutate it, so one scheme can be shared by several tensors.
    """

    def quantize_as_torch(self, fp_tensor: torch.Tensor) -> torch.Tensor:
        """Return ``fp_tensor`` as a natively quantized PyTorch tensor (``torch.qint8``...).

        Raises:
            T2NErrorNotImplemented: PyTorch has no quantized dtype for this scheme (the base
                class and :class:`QScalePerGroupF16`); use :meth:`quantize_as_u8`.
        """
        raise T2NErrorNotImplemented(
            f"{type(self).__name__} has no native PyTorch quantized form; use quantize_as_u8() "
            "and a QTensor"
        )

    def quantize_as_u8(self, fp_tensor: torch.Tensor) -> torch.Tensor:
        """Return the uint8 codes of ``fp_tensor`` (same shape, dtype ``torch.uint8``).

        Raises:
            T2NErrorNotImplemented: the scheme does not implement quantization.
        """
        raise T2NErrorNotImplemented(f"{type(self).__name__} does not implement quantize_as_u8()")

    def dequantize(self, u8_tensor: torch.Tensor, target_dtype: torch.dtype) -> torch.Tensor:
        """Return the floating values that the uint8 codes ``u8_tensor`` stand for.

        Args:
            u8_tensor: codes produced by :meth:`quantize_as_u8`.
            target_dtype: floating dtype of the result (and of the arithmetic).

        Raises:
            T2NErrorNotImplemented: the scheme does not implement dequantization.
        """
        raise T2NErrorNotImplemented(f"{type(self).__name__} does not implement dequantize()")

    def to_device(self, new_device: torch.device | str) -> QScheme:
        """Return this scheme with its tensors (scales, ...) on ``new_device``.

        The scheme itself is not modified; when every tensor already lives on ``new_device``
        the scheme is returned as is.
        """
        moved: QScheme = _move_tensor_attributes(self, _canonical_device(new_device))
        return moved


class QScalePerGroupF16(QScheme, SupportsOffloadState):
    """Symmetric quantization with one float16 scale per group of ``group_size`` values.

    The tensor is read in row-major order and cut into consecutive groups. With
    ``offset = 2 ** (n_bits - 1)``, a value ``x`` of a group with scale ``d`` is stored as the
    code ``clamp(floor(x / d + offset + 0.5), 0, 2 ** n_bits - 1)`` and read back as
    ``(code - offset) * d``.

    Scales follow tract's (and GGML's) convention: a calibrated scale is the group's value of
    largest magnitude divided by ``-offset``, so it is negative when that value is positive
    and the value itself maps to code 0, exactly. A zero scale encodes an all-zero group.

    Args:
        group_size: number of consecutive values sharing a scale (positive).
        scale: one scale per group, any shape with that many elements; stored as float16 with
            shape ``(n_groups, 1)``.
        n_bits: bits per code, from 1 to 8 (4 for tract's Q4_0).

    Raises:
        T2NErrorMisuse: ``group_size`` or ``n_bits`` is out of range, or ``scale`` is not a
            floating tensor of finite values.
    """

    def __init__(self, group_size: int, scale: torch.Tensor, n_bits: int) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise T2NErrorMisuse(f"group_size must be a positive int, got {group_size!r}")
        if isinstance(n_bits, bool) or not isinstance(n_bits, int) or not 1 <= n_bits <= 8:
            raise T2NErrorMisuse(f"n_bits must be an int from 1 to 8, got {n_bits!r}")
        if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
            raise T2NErrorMisuse(
                f"scale must be a floating point torch.Tensor, got {type(scale).__name__}"
                + (f" of dtype {scale.dtype}" if isinstance(scale, torch.Tensor) else "")
            )
        scale = scale.detach().to(torch.float16).reshape(-1, 1)
        if scale.device.type != "meta" and not bool(torch.isfinite(scale).all()):
            raise T2NErrorMisuse(
                "scale must hold finite float16 values; a calibration produced an overflow "
                "(|value| / 2**(n_bits-1) above 65504?)"
            )
        self.group_size: int = group_size
        self.n_bits: int = n_bits
        self.scale: torch.Tensor = scale

    @property
    def n_groups(self) -> int:
        """Number of groups (and of scales) this scheme describes."""
        return int(self.scale.shape[0])

    @property
    def offset(self) -> int:
        """The code that stands for zero: ``2 ** (n_bits - 1)``."""
        return 1 << (self.n_bits - 1)

    @staticmethod
    def reshape_tensor_per_group(fp_tensor: torch.Tensor, group_size: int) -> torch.Tensor:
        """Return ``fp_tensor`` as a ``(n_groups, group_size)`` tensor (a view when possible).

        Raises:
            T2NErrorImpossibleQuantization: the volume of ``fp_tensor`` is not a multiple of
                ``group_size``.
        """
        if fp_tensor.numel() % group_size != 0:
            raise T2NErrorImpossibleQuantization(
                f"a tensor of shape {tuple(fp_tensor.shape)} ({fp_tensor.numel()} values) "
                f"cannot be cut into groups of {group_size}; incomplete groups are not supported"
            )
        return fp_tensor.reshape(-1, group_size)

    def _check_volume(self, shape: torch.Size, what: str) -> None:
        volume = shape.numel()
        if volume != self.n_groups * self.group_size:
            raise T2NErrorImpossibleQuantization(
                f"{what} of shape {tuple(shape)} holds {volume} values but this "
                f"{type(self).__name__} describes {self.n_groups} groups of {self.group_size} "
                f"({self.n_groups * self.group_size} values); calibrate the scheme on this tensor"
            )

    def quantize_as_u8(self, fp_tensor: torch.Tensor) -> torch.Tensor:
        """Return the codes of ``fp_tensor`` as a ``torch.uint8`` tensor of the same shape.

        The arithmetic runs in float32 on the device of ``fp_tensor`` (the scales are moved
        there), using the float16 scales exactly as stored.

        Raises:
            T2NErrorImpossibleQuantization: ``fp_tensor`` does not hold ``n_groups *
                group_size`` values.
            T2NErrorMisuse: ``fp_tensor`` is not a floating point tensor.
        """
        if not fp_tensor.is_floating_point():
            raise T2NErrorMisuse(
                f"only floating point tensors can be quantized, got dtype {fp_tensor.dtype}"
            )
        self._check_volume(fp_tensor.shape, "tensor")
        groups = self.reshape_tensor_per_group(fp_tensor.detach(), self.group_size)
        groups = groups.to(torch.float32)
        if not bool(torch.isfinite(groups).all()):  # no code stands for them
            raise T2NErrorImpossibleQuantization(
                f"tensor of shape {tuple(fp_tensor.shape)} holds NaN or infinite values; "
                "they cannot be quantized"
            )
        scale = self.scale.to(device=groups.device, dtype=torch.float32)
        safe_scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        ratio = torch.where(scale == 0, torch.zeros_like(groups), groups / safe_scale)
        codes = torch.floor(ratio + (self.offset + 0.5)).clamp_(0, (1 << self.n_bits) - 1)
        return codes.to(torch.uint8).reshape(fp_tensor.shape)

    def dequantize(self, u8_tensor: torch.Tensor, target_dtype: torch.dtype) -> torch.Tensor:
        """Return ``(code - offset) * scale`` as a ``target_dtype`` tensor.

        Each value is computed exactly, then rounded once to ``target_dtype`` (so a float16
        result equals float16 arithmetic, and bfloat16 loses nothing to a rounded scale). The
        result has the shape of ``u8_tensor`` and lives on its device.

        Raises:
            T2NErrorImpossibleQuantization: ``u8_tensor`` does not hold ``n_groups *
                group_size`` codes.
            T2NErrorMisuse: ``target_dtype`` is not a floating dtype.
        """
        if not isinstance(u8_tensor, torch.Tensor):
            raise T2NErrorMisuse(
                f"dequantize takes the uint8 code tensor, got {type(u8_tensor).__name__}"
            )
        if not isinstance(target_dtype, torch.dtype) or not target_dtype.is_floating_point:
            raise T2NErrorMisuse(
                f"dequantize needs a floating target dtype (torch.float32), got {target_dtype!r}"
            )
        self._check_volume(u8_tensor.shape, "code tensor")
        groups = self.reshape_tensor_per_group(u8_tensor, self.group_size).to(torch.float32)
        scale = self.scale.to(device=groups.device, dtype=torch.float32)
        # A code (at most 8 bits) times a float16 scale (11 significant bits) is exact in
        # float32: the only rounding is the final cast.
        values = (groups - self.offset) * scale
        return values.reshape(u8_tensor.shape).to(target_dtype)

    def clone_with_scale_factor(self, scale_factor: float | torch.Tensor) -> QScalePerGroupF16:
        """Return a new scheme whose scales are this scheme's scales divided by ``scale_factor``.

        ``scale_factor`` is a number or a tensor broadcastable to ``(n_groups, 1)``. The result
        is rounded to float16 again; this scheme is not modified.

        Raises:
            T2NErrorMisuse: ``scale_factor`` is not a number or a tensor, or the scales it
                gives are not finite (a factor of 0).
        """
        if isinstance(scale_factor, bool) or not isinstance(
            scale_factor, (int, float, torch.Tensor)
        ):
            raise T2NErrorMisuse(
                "clone_with_scale_factor takes a number or a tensor, got "
                f"{type(scale_factor).__name__}"
            )
        return type(self)(
            group_size=self.group_size,
            scale=(self.scale.to(torch.float32) / scale_factor).to(torch.float16),
            n_bits=self.n_bits,
        )

    def to_device(self, new_device: torch.device | str) -> QScalePerGroupF16:
        """Return this scheme with its scales on ``new_device`` (this scheme is unchanged)."""
        moved: QScalePerGroupF16 = _move_tensor_attributes(self, _canonical_device(new_device))
        return moved

    # -- offload state (a scheme nested in a tensor's state) ---------------------------------
    OFFLOAD_STATE_TAG: ClassVar[str] = "torch_to_nnef.QScalePerGroupF16"

    def to_offload_state(self) -> dict[str, Any]:
        """Describe this scheme: its group size, bits and float16 scales.

        An offload state of a quantized tensor may hold the scheme itself (as upstream
        torch-to-nnef's states do): the storage layer stores it through this state.
        """
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "group_size": self.group_size,
            "n_bits": self.n_bits,
            "scale": self.scale,
        }

    @classmethod
    def from_offload_state(
        cls, state: dict[str, Any], target_device: torch.device | str | None = None
    ) -> QScalePerGroupF16:
        """Rebuild the scheme :meth:`to_offload_state` described, its scales on
        ``target_device`` (``None``: where the state's scale is).

        Args:
            state: the offload state.
            target_device: where the scales are placed.

        Raises:
            T2NErrorStorage: the state is not one of this class or its values are invalid.
        """
        if not cls.is_offload_state(state) or not isinstance(state.get("scale"), torch.Tensor):
            raise T2NErrorStorage(
                f"invalid {cls.__name__} offload state: expected a dict tagged "
                f"{cls.OFFLOAD_STATE_TAG!r} holding a 'scale' tensor"
            )
        try:
            scheme = cls(state.get("group_size"), state["scale"], state.get("n_bits"))  # type: ignore[arg-type]
        except T2NErrorMisuse as exc:
            raise T2NErrorStorage(f"invalid {cls.__name__} offload state: {exc}") from exc
        return scheme if target_device is None else scheme.to_device(target_device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(group_size={self.group_size}, n_bits={self.n_bits}, "
            f"n_groups={self.n_groups}, device={self.scale.device})"
        )


class U8Compressor:
    """A reversible transform of a QTensor's uint8 code blob while it is held in memory.

    A QTensor applies its compressors in order after quantization and undoes them in reverse
    order before dequantization. Both directions take and return ``torch.uint8`` tensors; the
    compressed blob may have any shape. This base class is the identity (no compression);
    subclasses override :meth:`compress` and :meth:`decompress` (bit packing, entropy coding...).
    """

    def compress(self, u8_tensor: torch.Tensor) -> torch.Tensor:
        """Return the compressed form of the codes ``u8_tensor`` (dtype ``torch.uint8``)."""
        return u8_tensor

    def decompress(self, u8_tensor: torch.Tensor) -> torch.Tensor:
        """Return the codes that :meth:`compress` turned into ``u8_tensor``."""
        return u8_tensor

    def to_device(self, new_device: torch.device | str) -> U8Compressor:
        """Return this compressor with its tensors on ``new_device`` (itself is unchanged)."""
        moved: U8Compressor = _move_tensor_attributes(self, _canonical_device(new_device))
        return moved

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check_compressed(blob: Any, compressor: U8Compressor, direction: str) -> torch.Tensor:
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
        got = blob.dtype if isinstance(blob, torch.Tensor) else type(blob).__name__
        raise T2NErrorMisuse(
            f"{type(compressor).__name__}.{direction}() must return a torch.uint8 tensor, got {got}"
        )
    return blob


def _rebuild_qtensor(cls: type[_Q], parts: dict[str, Any]) -> _Q:
    """Unpickle a :class:`QTensor` (see ``QTensor.__reduce_ex__``)."""
    return cls._from_parts(**parts)


class QTensor(OpaqueTensor):
    """A tensor stored as uint8 codes plus a :class:`QScheme`, dequantized on use.

    The tensor reports the shape of ``fp_tensor``, the dtype ``dequant_to_dtype`` and the
    device the codes live on. Torch operations run on :meth:`decompress` and return plain
    tensors; ``to()`` with a floating dtype or a device returns a QTensor.

    Args:
        fp_tensor: the floating point value to quantize (not kept).
        qscheme: the scheme, calibrated for ``fp_tensor``; its tensors are moved to the device
            of ``fp_tensor``.
        dequant_to_dtype: floating dtype of the dequantized value.
        u8_compressors: transforms applied, in order, to the codes held in memory.

    Raises:
        T2NErrorMisuse: ``fp_tensor``, ``qscheme``, ``dequant_to_dtype`` or a compressor is
            not of the expected kind.
        T2NErrorImpossibleQuantization: ``qscheme`` does not fit ``fp_tensor``.
    """

    u8_blob: torch.Tensor
    qscheme: QScheme  # type: ignore[assignment]  # shadows torch.Tensor.qscheme()
    dequant_to_dtype: torch.dtype
    u8_compressors: list[U8Compressor]
    nnef_name: str | None

    #: Attributes besides the blob, scheme, dtype and compressors that a derived tensor
    #: (``to()``, ``clone()``) inherits; ``None`` when not given. Subclasses extend it.
    _CARRIED_ATTRIBUTES: ClassVar[tuple[str, ...]] = ("nnef_name",)

    @staticmethod
    def __new__(  # type: ignore[misc]
        cls: type[_Q],
        fp_tensor: torch.Tensor,
        qscheme: QScheme,
        dequant_to_dtype: torch.dtype = torch.float32,
        u8_compressors: Iterable[U8Compressor] | None = None,
        **subclass_kwargs: Any,
    ) -> _Q:
        if not isinstance(fp_tensor, torch.Tensor) or isinstance(fp_tensor, OpaqueTensor):
            raise T2NErrorMisuse(
                f"{cls.__name__} quantizes a plain floating point torch.Tensor, got "
                f"{type(fp_tensor).__name__}; expand opaque tensors with opaque_to_final_tensor"
            )
        _check_dequant_dtype(cls, dequant_to_dtype)
        shell: _Q = OpaqueTensor._make_shell(
            cls, fp_tensor.shape, dequant_to_dtype, fp_tensor.device
        )
        return shell

    def __init__(
        self,
        fp_tensor: torch.Tensor,
        qscheme: QScheme,
        dequant_to_dtype: torch.dtype = torch.float32,
        u8_compressors: Iterable[U8Compressor] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(qscheme, QScheme):
            raise T2NErrorMisuse(f"qscheme must be a QScheme, got {type(qscheme).__name__}")
        if isinstance(u8_compressors, U8Compressor) or not isinstance(
            u8_compressors, (Iterable, type(None))
        ):
            raise T2NErrorMisuse(
                "u8_compressors must be an iterable of U8Compressor instances (a list), got "
                f"{type(u8_compressors).__name__}"
            )
        compressors = list(u8_compressors or ())
        for compressor in compressors:
            if not isinstance(compressor, U8Compressor):
                raise T2NErrorMisuse(
                    f"u8_compressors must hold U8Compressor instances, got "
                    f"{type(compressor).__name__}"
                )
        qscheme = qscheme.to_device(fp_tensor.device)
        with torch.no_grad():
            blob = qscheme.quantize_as_u8(fp_tensor)
            for compressor in compressors:
                blob = _check_compressed(compressor.compress(blob), compressor, "compress")
        self.u8_blob = blob
        self.qscheme = qscheme
        self.dequant_to_dtype = dequant_to_dtype
        self.u8_compressors = compressors
        self.nnef_name = None

    # -- building from parts -----------------------------------------------------------------
    @classmethod
    def _from_parts(
        cls: type[_Q],
        *,
        u8_blob: torch.Tensor,
        qscheme: QScheme,
        shape: torch.Size | tuple[int, ...],
        dequant_to_dtype: torch.dtype,
        u8_compressors: list[U8Compressor],
        **attributes: Any,
    ) -> _Q:
        """Build a tensor from already-quantized parts, without quantizing anything.

        ``attributes`` sets the names of ``_CARRIED_ATTRIBUTES`` (the others default to None).
        """
        _check_dequant_dtype(cls, dequant_to_dtype)
        new: _Q = OpaqueTensor._make_shell(cls, shape, dequant_to_dtype, u8_blob.device)
        new.u8_blob = u8_blob
        new.qscheme = qscheme
        new.dequant_to_dtype = dequant_to_dtype
        new.u8_compressors = u8_compressors
        for name in cls._CARRIED_ATTRIBUTES:
            setattr(new, name, attributes.pop(name, None))
        if attributes:
            raise T2NErrorMisuse(
                f"{cls.__name__} has no attribute(s) {sorted(attributes)} to carry; "
                f"known: {list(cls._CARRIED_ATTRIBUTES)}"
            )
        return new

    def _derive(
        self: _Q,
        *,
        u8_blob: torch.Tensor,
        qscheme: QScheme,
        dequant_to_dtype: torch.dtype,
        u8_compressors: list[U8Compressor],
    ) -> _Q:
        carried = {name: getattr(self, name) for name in self._CARRIED_ATTRIBUTES}
        return type(self)._from_parts(
            u8_blob=u8_blob,
            qscheme=qscheme,
            shape=self.shape,
            dequant_to_dtype=dequant_to_dtype,
            u8_compressors=u8_compressors,
            **carried,
        )

    # -- value -------------------------------------------------------------------------------
    def decompress_to_u8(self) -> torch.Tensor:
        """Return the uint8 codes (the blob with every compressor undone, last one first)."""
        blob = self.u8_blob
        for compressor in reversed(self.u8_compressors):
            blob = _check_compressed(compressor.decompress(blob), compressor, "decompress")
        return blob

    def decompress(self) -> torch.Tensor:
        """Return the dequantized value: a plain tensor of dtype ``dequant_to_dtype``."""
        with torch.no_grad():
            return self.qscheme.dequantize(self.decompress_to_u8(), self.dequant_to_dtype)

    def _to_base_tensor(self) -> torch.Tensor:
        return self.decompress()

    # -- moves and copies --------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> QTensor:  # type: ignore[override]
        """Return this tensor with another dequantization dtype and/or on another device.

        Accepts the arguments of ``torch.Tensor.to`` (a dtype, a device, both, or another
        tensor; ``non_blocking`` and ``copy`` keywords). A floating dtype changes the dtype
        the codes dequantize to (codes and scales are shared, not re-quantized); a device
        moves codes, scales and compressors. Without change, returns ``self`` (a new tensor
        sharing nothing when ``copy=True``).

        Raises:
            T2NErrorMisuse: the arguments are not those of ``torch.Tensor.to``, or the dtype
                is not floating (call ``decompress().to(dtype)`` for a plain tensor).
        """
        copy_requested = bool(kwargs.pop("copy", False))
        try:
            # torch's own parser of Tensor.to arguments, the one nn.Module.to relies on.
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError) as exc:
            raise T2NErrorMisuse(
                f"{type(self).__name__}.to() takes the arguments of torch.Tensor.to: {exc}"
            ) from exc
        if dtype is not None and not dtype.is_floating_point:
            raise T2NErrorMisuse(
                f"{type(self).__name__} dequantizes to floating dtypes only, got {dtype}; "
                f"use .decompress().to({dtype}) for a plain tensor"
            )
        new_dtype = dtype or self.dequant_to_dtype
        new_device = _canonical_device(device) if device is not None else self.device
        if new_dtype == self.dequant_to_dtype and new_device == self.device and not copy_requested:
            return self
        blob = self.u8_blob.to(new_device, non_blocking=non_blocking, copy=copy_requested)
        return self._derive(
            u8_blob=blob,
            qscheme=self.qscheme.to_device(new_device),
            dequant_to_dtype=new_dtype,
            u8_compressors=[c.to_device(new_device) for c in self.u8_compressors],
        )

    def to_device(self, new_device: torch.device | str) -> QTensor:
        """Return this tensor with codes, scales and compressors on ``new_device``.

        A tensor's device is fixed at creation, so this returns a new QTensor (or ``self``
        when already there); the dequantization dtype is kept.
        """
        return self.to(device=new_device)

    def clone(self: _Q, *, memory_format: torch.memory_format | None = None) -> _Q:  # type: ignore[override]
        """Return an independent copy (codes copied; scheme and compressors shared, immutable).

        Args:
            memory_format: accepted for compatibility with ``torch.Tensor.clone`` and ignored:
                the codes keep their layout.
        """
        return self._derive(
            u8_blob=self.u8_blob.clone(),
            qscheme=self.qscheme,
            dequant_to_dtype=self.dequant_to_dtype,
            u8_compressors=list(self.u8_compressors),
        )

    def __copy__(self: _Q) -> _Q:
        """A copy, as :meth:`__deepcopy__` makes (not a dequantized tensor)."""
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, ``pickle``) as its parts (codes, scheme, compressors,
        carried attributes), from which its class rebuilds it: a quantized value stays
        quantized. ``torch.load`` needs ``weights_only=False`` for it, as for any class it
        does not know."""
        parts = {
            "u8_blob": self.u8_blob,
            "qscheme": self.qscheme,
            "shape": tuple(self.shape),
            "dequant_to_dtype": self.dequant_to_dtype,
            "u8_compressors": list(self.u8_compressors),
        }
        parts.update((name, getattr(self, name)) for name in self._CARRIED_ATTRIBUTES)
        return (_rebuild_qtensor, (type(self), parts))

    def __deepcopy__(self: _Q, memo: dict[int, Any]) -> _Q:
        if id(self) in memo:
            existing: _Q = memo[id(self)]
            return existing
        new = self._derive(
            u8_blob=self.u8_blob.clone(),
            qscheme=copy.deepcopy(self.qscheme, memo),
            dequant_to_dtype=self.dequant_to_dtype,
            u8_compressors=copy.deepcopy(self.u8_compressors, memo),
        )
        memo[id(self)] = new
        return new

    @property  # type: ignore[override]
    def data(self) -> QTensor:
        """The tensor itself, so that its special attributes stay reachable."""
        return self

    @data.setter
    def data(self, new_data: torch.Tensor) -> None:
        if new_data is self:
            return
        raise T2NErrorNotImplemented(
            f"{type(self).__name__} does not support assigning .data; "
            "replace the parameter with ModTensorUpdater instead"
        )

    # -- export ------------------------------------------------------------------------------
    def write_in_file(self, dirpath: str | os.PathLike[str], label: str) -> Path:
        """Write this tensor in the file format of an inference engine; return the path.

        Args:
            dirpath: the model folder to write into.
            label: the tensor's label in the engine's graph; it names the file.

        Raises:
            T2NErrorNotImplemented: always for this base class; engine-specific subclasses
                (such as ``QTensorTractScaleOnly``) implement it.
        """
        raise T2NErrorNotImplemented(
            f"{type(self).__name__} has no file format of its own; quantize with a tract "
            "scheme (fp_to_tract_q4_0_with_min_max_calibration) to write a tract .dat file"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, qscheme={self.qscheme!r})"
        )


def _check_dequant_dtype(cls: type[QTensor], dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise T2NErrorMisuse(
            f"{cls.__name__} dequant_to_dtype must be a floating torch.dtype, got {dtype!r}"
        )


# ---------------------------------------------------------------------------------------------
# Min-max calibration: choose per-group scales from the values of a floating point tensor.
# ---------------------------------------------------------------------------------------------
def plain_float(fp_tensor: torch.Tensor) -> torch.Tensor:
    """Return ``fp_tensor`` as a plain floating point tensor (opaque tensors expanded)."""
    if not isinstance(fp_tensor, torch.Tensor):
        raise T2NErrorMisuse(f"expected a floating point torch.Tensor, got {type(fp_tensor)}")
    if isinstance(fp_tensor, OpaqueTensor):
        fp_tensor = opaque_to_final_tensor(fp_tensor)
    if not fp_tensor.is_floating_point():
        raise T2NErrorMisuse(
            f"only floating point tensors can be quantized, got dtype {fp_tensor.dtype}"
        )
    if fp_tensor.is_meta:
        raise T2NErrorMisuse(
            "a meta tensor holds no values to quantize; load its values first (e.g. bind "
            "the model to its checkpoint)"
        )
    return fp_tensor.detach()


def _group_magnitude(abs_groups: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per-row ``percentile`` quantile of ``abs_groups`` (linear interpolation, like
    ``torch.quantile``, without its input size limit)."""
    ordered = abs_groups.sort(dim=1).values
    position = percentile * (ordered.shape[1] - 1)
    low = int(position)
    high = min(low + 1, ordered.shape[1] - 1)
    fraction = position - low
    return ordered[:, low] + fraction * (ordered[:, high] - ordered[:, low])


def qscale_per_group_f16_min_max_calibration(
    fp_tensor: torch.Tensor,
    n_bits: int,
    group_size: int,
    percentile: float = 1.0,
) -> QScalePerGroupF16:
    """Calibrate a :class:`QScalePerGroupF16` for ``fp_tensor`` from each group's extremes.

    The tensor is read in row-major order and cut into groups of ``group_size`` values. Each
    group's scale is its value of largest magnitude divided by ``-2 ** (n_bits - 1)`` (tract's
    and GGML's convention: that value is then represented exactly). With ``percentile < 1``
    the magnitude is the group's ``percentile`` quantile of absolute values instead (clipping
    outliers), keeping the sign of the largest value. Scales are float16, on the device of
    ``fp_tensor``.

    Args:
        fp_tensor: floating point values (opaque tensors are expanded first).
        n_bits: bits per code, from 1 to 8.
        group_size: values per group; must divide the volume of ``fp_tensor``.
        percentile: in ``(0, 1]``; 1 is the plain maximum.

    Raises:
        T2NErrorImpossibleQuantization: the volume is not a multiple of ``group_size``, the
            tensor holds NaN or infinite values, or a scale overflows float16.
        T2NErrorMisuse: an argument is out of range or ``fp_tensor`` is not floating point.
    """
    if not isinstance(percentile, (int, float)) or not 0.0 < percentile <= 1.0:
        raise T2NErrorMisuse(f"percentile must be in (0, 1], got {percentile!r}")
    if isinstance(n_bits, bool) or not isinstance(n_bits, int) or not 1 <= n_bits <= 8:
        raise T2NErrorMisuse(f"n_bits must be an int from 1 to 8, got {n_bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise T2NErrorMisuse(f"group_size must be a positive int, got {group_size!r}")
    values = plain_float(fp_tensor)
    shape = tuple(values.shape)
    if values.numel() == 0 or values.numel() % group_size != 0:
        raise T2NErrorImpossibleQuantization(
            f"tensor of shape {shape} has {values.numel()} values, not a positive multiple of "
            f"the group size {group_size}; incomplete groups cannot be quantized"
        )
    with torch.no_grad():
        groups = values.reshape(-1, group_size).to(torch.float32)
        if not bool(torch.isfinite(groups).all()):
            raise T2NErrorImpossibleQuantization(
                f"tensor of shape {shape} holds NaN or infinite values; they cannot be quantized"
            )
        magnitudes = groups.abs()
        largest = groups.gather(1, magnitudes.argmax(dim=1, keepdim=True)).squeeze(1)
        if percentile == 1.0:
            extreme = largest
        else:
            sign = torch.where(largest < 0, -1.0, 1.0)
            extreme = sign * _group_magnitude(magnitudes, float(percentile))
        scale = (extreme / -float(1 << (n_bits - 1))).to(torch.float16)
        if not bool(torch.isfinite(scale).all()):
            raise T2NErrorImpossibleQuantization(
                f"tensor of shape {shape} holds values too large for float16 scales "
                f"(max |x| = {float(magnitudes.max())}); rescale the tensor first"
            )
    return QScalePerGroupF16(group_size=group_size, scale=scale, n_bits=n_bits)
