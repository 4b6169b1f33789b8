"""Quantized tensors: schemes, calibration, QTensor behaviour and tract Q4_0 semantics."""

from __future__ import annotations

import copy
import json
import pickle
import platform
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from contract import OpaqueContract
from quant_reference import reference_dequantize, reference_q4_0, reference_q4_0_value
from torch import nn

from torch_to_nnef.exceptions import (
    T2NErrorImpossibleQuantization,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
)
from torch_to_nnef.tensor import TensorResidencyPool, offload_module, storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.opaque import OpaqueTensor, SupportsOffloadState, offload_state_class
from torch_to_nnef.tensor.quant import (
    QScalePerGroupF16,
    QScheme,
    QTensor,
    QTensorTract,
    QTensorTractScaleOnly,
    U8Compressor,
    fp_to_tract_q4_0_with_min_max_calibration,
    qscale_per_group_f16_min_max_calibration,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class TestQTensorContract(OpaqueContract):
    """The opaque-tensor contract for tract's x86 dequantization, against Q4_0 computed element
    by element (``quant_reference``), not against the tensor's own ``decompress()``.

    Mutation caught: dequantizing ``(code - 7) * scale`` instead of ``(code - 8) * scale`` in
    ``QScalePerGroupF16.dequantize`` failed this class and the two below.
    """

    machine = "x86_64"
    through_f16 = False

    def make(self, dense: torch.Tensor) -> torch.Tensor:
        q = fp_to_tract_q4_0_with_min_max_calibration(dense)
        q.specific_machine = self.machine
        return q

    def reference(self, subject: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return reference_q4_0_value(dense, through_f16=self.through_f16)


class TestQTensorArmContract(TestQTensorContract):
    """The same contract with tract's ARM (float16) dequantization."""

    machine = "aarch64"
    through_f16 = True


# -- independent references --------------------------------------------------------------------
def exactly_representable(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A weight whose every group is (code - 8) * scale with code 0 present in each group."""
    gen = torch.Generator().manual_seed(seed)
    n_groups = torch.Size(shape).numel() // 32
    codes = torch.randint(0, 16, (n_groups, 32), generator=gen)
    codes[:, 5] = 0  # the value of largest magnitude, 8 * |scale|, is in every group
    scales = -(torch.rand(n_groups, 1, generator=gen) + 0.01).half().float()
    return ((codes.float() - 8.0) * scales).reshape(shape)


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(64, 96, generator=torch.Generator().manual_seed(3))


# -- calibration and round trip ----------------------------------------------------------------
def test_calibration_matches_the_reference_q4_0(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    ref_codes, ref_scales = reference_q4_0(weight)

    assert torch.equal(q.decompress_to_u8(), ref_codes)
    assert torch.equal(q.qscheme.scale.reshape(-1), ref_scales)
    machine_free = QTensorTractScaleOnly._from_parts(
        u8_blob=q.u8_blob,
        qscheme=q.qscheme,
        shape=q.shape,
        dequant_to_dtype=torch.float32,
        u8_compressors=[],
        specific_machine="x86_64",
    )
    assert torch.equal(
        machine_free.decompress(), reference_dequantize(ref_codes, ref_scales, torch.float32)
    )


def assert_nearest_grid_point(weight: torch.Tensor, q: QTensor, group_size: int) -> None:
    """Each value dequantizes to the nearest of the 2**n_bits values its group can take."""
    qscheme = q.qscheme
    assert isinstance(qscheme, QScalePerGroupF16)
    scales = qscheme.scale.float()  # (n_groups, 1)
    offset = 2 ** (qscheme.n_bits - 1)
    grid = (torch.arange(2.0**qscheme.n_bits) - offset) * scales
    groups = weight.float().reshape(-1, group_size, 1)
    nearest = (groups - grid.unsqueeze(1)).abs().min(dim=2).values
    error = (q.decompress().float() - weight.float()).abs().reshape(-1, group_size)
    assert torch.allclose(error, nearest, atol=1e-6)
    in_range = weight.float().reshape(-1, group_size).abs() <= (offset - 1) * scales.abs()
    half_step = (scales.abs() / 2).expand_as(error)
    assert bool((error[in_range] <= half_step[in_range] + 1e-6).all())


def test_each_value_dequantizes_to_the_nearest_point_of_its_group(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.specific_machine = "x86_64"
    assert_nearest_grid_point(weight, q, group_size=32)


def test_value_of_largest_magnitude_maps_to_code_zero_exactly() -> None:
    group = torch.linspace(-3.0, 5.0, 32).reshape(1, 32)
    qscheme = qscale_per_group_f16_min_max_calibration(group, n_bits=4, group_size=32)
    assert float(qscheme.scale) == pytest.approx(-5.0 / 8, rel=1e-3)
    codes = qscheme.quantize_as_u8(group)
    assert int(codes[0, -1]) == 0
    assert float(qscheme.dequantize(codes, torch.float32)[0, -1]) == float(
        qscheme.scale.float() * -8
    )


@pytest.mark.parametrize("shape", [(64, 32), (8, 4, 32), (4, 2, 4, 8), (16, 3, 1, 32)])
def test_exactly_representable_weight_round_trips_exactly(shape: tuple[int, ...]) -> None:
    weight = exactly_representable(shape)
    for machine in ("x86_64", "arm64"):
        q = fp_to_tract_q4_0_with_min_max_calibration(weight)
        q.specific_machine = machine
        if machine == "x86_64":
            assert torch.equal(q.decompress(), weight)
        else:  # float16 products may round; they equal the float16 rounding of the weight
            assert torch.equal(q.decompress(), weight.half().float())


def test_zero_group_quantizes_to_zero() -> None:
    weight = torch.zeros(2, 32)
    weight[1] = torch.arange(32.0)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    assert float(q.qscheme.scale[0]) == 0.0
    assert torch.equal(q.decompress()[0], torch.zeros(32))


def test_percentile_clips_outliers_with_the_quantile_of_magnitudes() -> None:
    weight = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    weight[:, 0] = 100.0
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32, percentile=0.9)
    expected = (torch.quantile(weight.abs(), 0.9, dim=1) / -8).half()
    assert torch.equal(qscheme.scale.reshape(-1), expected)
    full = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    assert bool((qscheme.scale.abs() < full.scale.abs()).all())


@pytest.mark.parametrize("percentile", [0.0, -0.5, 1.5])
def test_percentile_out_of_range_is_misuse(percentile: float) -> None:
    with pytest.raises(T2NErrorMisuse, match="percentile must be in"):
        qscale_per_group_f16_min_max_calibration(torch.ones(32), 4, 32, percentile=percentile)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dequantizes_to_the_dtype_of_the_weight(dtype: torch.dtype) -> None:
    weight = torch.randn(8, 64).to(dtype)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.specific_machine = "x86_64"
    assert q.dtype == dtype
    codes, scales = q.decompress_to_u8(), q.qscheme.scale.reshape(-1)
    # the exact value rounded once to the dtype (no rounding of the scale to it first)
    assert torch.equal(q.decompress(), reference_dequantize(codes, scales, dtype))


def test_parameter_and_requires_grad_weight_are_accepted() -> None:
    param = nn.Parameter(torch.randn(8, 32))
    q = fp_to_tract_q4_0_with_min_max_calibration(param)
    assert type(q) is QTensorTractScaleOnly
    assert not q.requires_grad
    assert not q.u8_blob.requires_grad


# -- ARM vs x86 dequantization -------------------------------------------------------------------
def test_arm_dequantizes_through_float16_and_x86_directly(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    codes, scales = q.decompress_to_u8(), q.qscheme.scale.reshape(-1)
    through_f16 = reference_dequantize(codes, scales, torch.float16).float()
    direct = reference_dequantize(codes, scales, torch.float32)
    assert not torch.equal(through_f16, direct), "the two paths must be distinguishable here"

    for arm in ("arm64", "aarch64", "armv7l"):
        q.specific_machine = arm
        assert torch.equal(q.decompress(), through_f16), arm
    for other in ("x86_64", "AMD64", "i686"):
        q.specific_machine = other
        assert torch.equal(q.decompress(), direct), other


@pytest.mark.parametrize(("host", "through_f16"), [("aarch64", True), ("x86_64", False)])
def test_host_machine_is_used_when_none_is_given(
    weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch, host: str, through_f16: bool
) -> None:
    """With no ``specific_machine``, the value follows ``platform.machine()`` (patched to an
    ARM and an x86 host).

    Mutation caught: ``decompress`` using ``"x86_64"`` instead of the host's name failed the
    ``aarch64`` case.
    """
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    assert q.specific_machine is None
    codes, scales = q.decompress_to_u8(), q.qscheme.scale.reshape(-1)
    expected = (
        reference_dequantize(codes, scales, torch.float16).float()
        if through_f16
        else reference_dequantize(codes, scales, torch.float32)
    )
    monkeypatch.setattr(platform, "machine", lambda: host)
    assert torch.equal(q.decompress(), expected)


def test_specific_machine_must_be_a_string() -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(torch.ones(2, 32), 4, 32)
    with pytest.raises(T2NErrorMisuse, match="specific_machine must be None"):
        QTensorTractScaleOnly(torch.ones(2, 32), qscheme, specific_machine=64)  # type: ignore[arg-type]


def test_constructor_accepts_specific_machine_keyword() -> None:
    weight = torch.randn(2, 32)
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    q = QTensorTractScaleOnly(
        weight, qscheme, dequant_to_dtype=torch.float16, specific_machine="arm64"
    )
    assert q.specific_machine == "arm64"
    assert q.dtype == torch.float16


# -- impossible quantizations -------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [(64,), (64, 31), (3, 5, 7), (2, 2, 2, 2, 32), (0, 32), (8, 0)],
    ids=["1d", "trailing-31", "trailing-35", "5d", "empty-rows", "empty-cols"],
)
def test_impossible_q4_0_shapes_raise_with_the_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(T2NErrorImpossibleQuantization, match=re.escape(str(shape))):
        fp_to_tract_q4_0_with_min_max_calibration(torch.ones(shape))


def test_q4_0_constructor_rejects_shapes_before_quantizing() -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(torch.ones(64), 4, 32)
    with pytest.raises(T2NErrorImpossibleQuantization, match=re.escape("(64,)")):
        QTensorTractScaleOnly(torch.ones(64), qscheme)


def test_q4_0_needs_a_4_bit_scheme_with_groups_of_32() -> None:
    weight = torch.randn(4, 64)
    for qscheme in (
        qscale_per_group_f16_min_max_calibration(weight, n_bits=8, group_size=32),
        qscale_per_group_f16_min_max_calibration(weight, n_bits=4, group_size=64),
    ):
        with pytest.raises(T2NErrorImpossibleQuantization, match="n_bits=4 and group_size=32"):
            QTensorTractScaleOnly(weight, qscheme)


def test_incomplete_groups_raise_with_the_shape() -> None:
    with pytest.raises(T2NErrorImpossibleQuantization, match=re.escape("(3, 7)")):
        qscale_per_group_f16_min_max_calibration(torch.ones(3, 7), n_bits=4, group_size=32)


def test_scheme_that_does_not_fit_the_tensor_raises() -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(torch.ones(2, 32), 4, 32)
    with pytest.raises(T2NErrorImpossibleQuantization, match=re.escape("(4, 32)")):
        QTensor(torch.ones(4, 32), qscheme)


def test_non_finite_values_raise() -> None:
    weight = torch.ones(2, 32)
    weight[1, 3] = float("nan")
    with pytest.raises(T2NErrorImpossibleQuantization, match="NaN or infinite"):
        fp_to_tract_q4_0_with_min_max_calibration(weight)


def test_scale_overflowing_float16_raises() -> None:
    with pytest.raises(T2NErrorImpossibleQuantization, match="too large for float16"):
        fp_to_tract_q4_0_with_min_max_calibration(torch.full((2, 32), 1e6))


def test_integer_tensors_are_misuse() -> None:
    with pytest.raises(T2NErrorMisuse, match="only floating point tensors"):
        fp_to_tract_q4_0_with_min_max_calibration(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_size": 0, "scale": torch.ones(1), "n_bits": 4}, "group_size must be"),
        ({"group_size": 32, "scale": torch.ones(1), "n_bits": 9}, "n_bits must be"),
        ({"group_size": 32, "scale": torch.ones(1, dtype=torch.int8), "n_bits": 4}, "scale must"),
        ({"group_size": 32, "scale": torch.tensor([1e9]), "n_bits": 4}, "finite float16"),
    ],
)
def test_invalid_scheme_arguments_are_misuse(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(T2NErrorMisuse, match=message):
        QScalePerGroupF16(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q: q.qscheme.dequantize("codes", torch.float32), "takes the uint8 code tensor"),
        (lambda q: q.qscheme.dequantize(q.decompress_to_u8(), "float32"), "floating target"),
        (lambda q: q.qscheme.clone_with_scale_factor("2"), "a number or a tensor, got str"),
        (lambda q: q.qscheme.clone_with_scale_factor(True), "a number or a tensor, got bool"),
        (
            lambda q: QTensorTractScaleOnly(q.decompress(), q.qscheme, u8_compressors=5),
            "an iterable of U8Compressor instances (a list), got int",
        ),
        (
            lambda q: QTensorTractScaleOnly(
                q.decompress(), q.qscheme, u8_compressors=NibblePacker()
            ),
            "an iterable of U8Compressor instances (a list), got NibblePacker",
        ),
    ],
)
def test_bad_arguments_to_a_scheme_or_tensor_are_misuse(call: object, message: str) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(2, 32))
    with pytest.raises(T2NErrorMisuse, match=re.escape(message)):
        call(q)  # type: ignore[operator]


# -- QScheme / QScalePerGroupF16 ----------------------------------------------------------------
def test_scheme_is_a_value_object() -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(torch.randn(4, 32), 4, 32)
    before = qscheme.scale.clone()
    halved = qscheme.clone_with_scale_factor(2.0)
    assert torch.equal(qscheme.scale, before)
    assert torch.equal(halved.scale, (before.float() / 2).half())
    assert (halved.group_size, halved.n_bits) == (32, 4)
    assert qscheme.to_device("cpu") is qscheme
    moved = qscheme.to_device("meta")
    assert moved is not qscheme and moved.scale.is_meta and not qscheme.scale.is_meta


def test_base_scheme_methods_are_not_implemented() -> None:
    with pytest.raises(T2NErrorNotImplemented, match="quantize_as_u8"):
        QScheme().quantize_as_u8(torch.ones(3))
    with pytest.raises(T2NErrorNotImplemented, match="dequantize"):
        QScheme().dequantize(torch.ones(3, dtype=torch.uint8), torch.float32)


def test_general_n_bits_scheme_round_trips() -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    for n_bits in (2, 3, 8):
        qscheme = qscale_per_group_f16_min_max_calibration(weight, n_bits, group_size=16)
        q = QTensor(weight, qscheme)
        assert int(q.decompress_to_u8().max()) < 2**n_bits
        assert_nearest_grid_point(weight, q, group_size=16)


# -- QTensor behaviour ---------------------------------------------------------------------------
def test_qtensor_is_an_opaque_tensor_with_offload_state() -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(8, 32))
    assert isinstance(q, QTensorTract)
    assert isinstance(q, QTensor)
    assert isinstance(q, OpaqueTensor)
    assert isinstance(q, SupportsOffloadState)
    assert type(type(q)) is type(torch.Tensor)
    assert offload_state_class(QTensorTractScaleOnly.OFFLOAD_STATE_TAG) is QTensorTractScaleOnly


def test_metadata_without_expansion(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    assert q.shape == weight.shape
    assert q.numel() == weight.numel()
    assert q.dim() == 2
    assert q.dtype == torch.float32
    assert q.device == torch.device("cpu")
    assert q.is_floating_point()
    assert q.u8_blob.dtype == torch.uint8


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t + 1,
        lambda t: t * t,
        lambda t: t.sum(),
        lambda t: t[0],
        lambda t: t.T,
        lambda t: torch.matmul(t, torch.ones(96, 2)),
        lambda t: F.relu(t),
        lambda t: t.reshape(-1),
        lambda t: t.float(),
    ],
    ids=["add", "mul", "sum", "index", "transpose", "matmul", "relu", "reshape", "float"],
)
def test_ops_return_plain_tensors(weight: torch.Tensor, op: object) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    result = op(q)  # type: ignore[operator]
    assert type(result) is torch.Tensor
    assert torch.equal(result, op(q.decompress()))  # type: ignore[operator]


def test_linear_forward_equals_forward_with_decompressed_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 64)
    q = fp_to_tract_q4_0_with_min_max_calibration(linear.weight)
    linear.weight = nn.Parameter(q, requires_grad=False)
    assert type(linear.weight) is QTensorTractScaleOnly
    x = torch.randn(5, 96)
    expected = F.linear(x, q.decompress(), linear.bias)
    out = linear(x)
    assert type(out) is torch.Tensor
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("conv", "x_shape"),
    [(nn.Conv1d(4, 16, kernel_size=8), (2, 4, 20)), (nn.Conv2d(2, 8, kernel_size=4), (2, 2, 9, 9))],
    ids=["conv1d", "conv2d"],
)
def test_conv_forward_equals_forward_with_decompressed_weight(
    conv: nn.Module, x_shape: tuple[int, ...]
) -> None:
    weight = conv.weight
    assert isinstance(weight, torch.Tensor)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    conv.weight = nn.Parameter(q, requires_grad=False)
    x = torch.randn(x_shape)
    reference = type(conv)(conv.in_channels, conv.out_channels, conv.kernel_size)  # type: ignore[operator]
    with torch.no_grad():
        reference.weight.copy_(q.decompress())
        reference.bias.copy_(conv.bias)
    assert torch.equal(conv(x), reference(x))


def test_to_dtype_changes_dequantization_dtype_only(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.nnef_name = "layer.weight"
    half = q.to(torch.float16)
    assert type(half) is QTensorTractScaleOnly
    assert half.dtype == torch.float16 and q.dtype == torch.float32
    assert half.u8_blob.data_ptr() == q.u8_blob.data_ptr()  # codes shared, not re-quantized
    assert half.nnef_name == "layer.weight"
    assert torch.equal(half.decompress(), q.qscheme.dequantize(q.u8_blob, torch.float16))
    assert q.to(torch.float32) is q
    assert q.to(dtype=torch.float64).dtype == torch.float64
    assert q.to(torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(T2NErrorMisuse, match=r"decompress\(\)\.to\(torch.int32\)"):
        q.to(torch.int32)
    with pytest.raises(T2NErrorMisuse, match=r"arguments of torch\.Tensor\.to"):
        q.to(object())


def test_to_device_moves_codes_and_scales(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.specific_machine = "arm64"
    assert q.to("cpu") is q
    assert q.to_device("cpu") is q
    on_meta = q.to("meta")
    assert type(on_meta) is QTensorTractScaleOnly
    assert on_meta.device.type == "meta"
    assert on_meta.u8_blob.is_meta and on_meta.qscheme.scale.is_meta
    assert on_meta.specific_machine == "arm64"
    assert not q.u8_blob.is_meta and not q.qscheme.scale.is_meta
    both = q.to("meta", torch.float16)
    assert both.device.type == "meta" and both.dtype == torch.float16
    assert q.to_device("meta").device.type == "meta"


def test_to_with_copy_returns_an_independent_tensor(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    copied = q.to("cpu", copy=True)
    assert copied is not q
    assert copied.u8_blob.data_ptr() != q.u8_blob.data_ptr()
    assert torch.equal(copied.decompress(), q.decompress())


@CUDA
def test_to_cuda_and_back() -> None:
    weight = torch.randn(32, 64)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    on_gpu = q.to("cuda")
    assert on_gpu.device == torch.device("cuda", torch.cuda.current_device())
    assert on_gpu.u8_blob.is_cuda and on_gpu.qscheme.scale.is_cuda
    assert on_gpu.to("cuda:0" if torch.cuda.current_device() == 0 else "cuda") is on_gpu
    assert torch.equal(on_gpu.decompress().cpu(), q.decompress())
    back = on_gpu.to("cpu")
    assert torch.equal(back.u8_blob, q.u8_blob)
    quantized_on_gpu = fp_to_tract_q4_0_with_min_max_calibration(weight.cuda())
    assert torch.equal(quantized_on_gpu.decompress_to_u8().cpu(), q.decompress_to_u8())


def test_clone_and_deepcopy_keep_the_type_and_own_their_codes(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.nnef_name = "w"
    for other in (q.clone(), copy.deepcopy(q), copy.copy(q)):
        assert type(other) is QTensorTractScaleOnly
        assert other.nnef_name == "w"
        assert other.u8_blob.data_ptr() != q.u8_blob.data_ptr()
        assert torch.equal(other.decompress(), q.decompress())


def test_deepcopy_of_a_module_keeps_quantized_weights() -> None:
    linear = nn.Linear(32, 8)
    linear.weight = nn.Parameter(
        fp_to_tract_q4_0_with_min_max_calibration(linear.weight), requires_grad=False
    )
    twin = copy.deepcopy(linear)
    assert type(twin.weight) is QTensorTractScaleOnly
    x = torch.randn(2, 32)
    assert torch.equal(twin(x), linear(x))


def test_a_saved_state_dict_keeps_quantized_weights_quantized(tmp_path: Path) -> None:
    linear = nn.Linear(32, 8)
    q = fp_to_tract_q4_0_with_min_max_calibration(linear.weight)
    q.nnef_name = "w"
    linear.weight = nn.Parameter(q, requires_grad=False)
    offloaded = OffloadedTensor.from_original_tensor(q, "w", offload_dir=tmp_path)
    torch.save({"state": linear.state_dict(), "offloaded": offloaded}, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for value in (loaded["state"]["weight"], loaded["offloaded"]):
        assert type(value) is QTensorTractScaleOnly
        assert value.nnef_name == "w"
        assert torch.equal(value.u8_blob, q.u8_blob)
        assert torch.equal(value.decompress(), q.decompress())
    with pytest.raises(pickle.UnpicklingError):  # a class torch.load does not know of
        torch.load(tmp_path / "m.pt", weights_only=True)


def test_module_to_same_device_keeps_the_parameter() -> None:
    linear = nn.Linear(32, 8)
    q = fp_to_tract_q4_0_with_min_max_calibration(linear.weight)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.to("cpu")
    assert linear.weight is q


def test_data_assignment_other_than_itself_is_refused(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    assert q.data is q
    q.data = q
    with pytest.raises(T2NErrorNotImplemented, match="ModTensorUpdater"):
        q.data = torch.zeros_like(weight)


def test_repr_names_type_shape_dtype_and_scheme(weight: torch.Tensor) -> None:
    text = repr(fp_to_tract_q4_0_with_min_max_calibration(weight))
    assert text.startswith("QTensorTractScaleOnly(shape=(64, 96), dtype=torch.float32")
    assert "QScalePerGroupF16(group_size=32, n_bits=4, n_groups=192" in text


def test_plain_qtensor_has_no_file_format(tmp_path: object, weight: torch.Tensor) -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    q = QTensor(weight, qscheme, dequant_to_dtype=torch.float16)
    assert type(q) is QTensor and q.dtype == torch.float16
    with pytest.raises(T2NErrorNotImplemented, match="no file format"):
        q.write_in_file(str(tmp_path), "w")


def test_qtensor_rejects_bad_arguments(weight: torch.Tensor) -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    with pytest.raises(T2NErrorMisuse, match="dequant_to_dtype must be a floating"):
        QTensor(weight, qscheme, dequant_to_dtype=torch.int8)
    with pytest.raises(T2NErrorMisuse, match="qscheme must be a QScheme"):
        QTensor(weight, "q4")  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match=r"plain floating point torch\.Tensor"):
        QTensor([1.0] * 32, qscheme)  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match="U8Compressor instances"):
        QTensor(weight, qscheme, u8_compressors=[object()])  # type: ignore[list-item]


def test_opaque_input_is_expanded_by_calibration(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    again = fp_to_tract_q4_0_with_min_max_calibration(q)
    assert type(again) is QTensorTractScaleOnly
    assert torch.equal(again.decompress(), q.decompress())


# -- U8 compressors -------------------------------------------------------------------------------
class NibblePacker(U8Compressor):
    """Two 4-bit codes per byte (a compressor written for the test)."""

    def compress(self, u8_tensor: torch.Tensor) -> torch.Tensor:
        flat = u8_tensor.reshape(-1)
        return flat[0::2] | (flat[1::2] << 4)

    def decompress(self, u8_tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([u8_tensor & 0x0F, u8_tensor >> 4], dim=1).reshape(-1)


class Broken(U8Compressor):
    def compress(self, u8_tensor: torch.Tensor) -> torch.Tensor:
        return u8_tensor.float()


def test_compressors_shrink_the_blob_and_are_undone(weight: torch.Tensor) -> None:
    plain = fp_to_tract_q4_0_with_min_max_calibration(weight)
    packed = QTensorTractScaleOnly(weight, plain.qscheme, u8_compressors=[NibblePacker()])
    assert packed.u8_blob.numel() == weight.numel() // 2
    assert torch.equal(packed.decompress_to_u8().reshape(weight.shape), plain.decompress_to_u8())
    assert torch.equal(packed.decompress().reshape(weight.shape), plain.decompress())
    assert type(packed.to(torch.float16)) is QTensorTractScaleOnly


def test_identity_compressor_is_the_default_behaviour(weight: torch.Tensor) -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    assert torch.equal(
        QTensor(weight, qscheme, u8_compressors=[U8Compressor()]).u8_blob,
        QTensor(weight, qscheme).u8_blob,
    )


def test_compressor_returning_non_uint8_is_misuse(weight: torch.Tensor) -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    with pytest.raises(T2NErrorMisuse, match=r"Broken.compress\(\) must return a torch.uint8"):
        QTensor(weight, qscheme, u8_compressors=[Broken()])


# -- offload state --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 32), (8, 4, 32), (4, 2, 4, 8)])
def test_offload_state_round_trips_exactly(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    q.specific_machine = "arm64"
    q.nnef_name = "block.0.weight"

    state = q.to_offload_state()
    assert QTensorTractScaleOnly.is_offload_state(state)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    attributes = {k: v for k, v in state.items() if k not in tensors}
    attributes = json.loads(json.dumps(attributes))  # JSON-able, as storage writes it
    assert set(tensors) == {"u8_blob", "scale"}
    assert tensors["u8_blob"].dtype == torch.uint8
    assert tensors["u8_blob"].numel() == weight.numel() // 2  # two codes per byte
    assert tensors["scale"].dtype == torch.float16

    rebuilt = QTensorTractScaleOnly.from_offload_state(
        {**attributes, **{k: v.clone() for k, v in tensors.items()}}
    )
    assert type(rebuilt) is QTensorTractScaleOnly
    assert rebuilt.shape == q.shape and rebuilt.dtype == dtype
    assert rebuilt.specific_machine == "arm64" and rebuilt.nnef_name == "block.0.weight"
    assert torch.equal(rebuilt.decompress_to_u8(), q.decompress_to_u8())
    assert torch.equal(rebuilt.qscheme.scale, q.qscheme.scale)
    assert torch.equal(rebuilt.decompress(), q.decompress())


def test_offload_state_is_rebuilt_through_its_registered_class(weight: torch.Tensor) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    state = q.to_offload_state()
    cls = offload_state_class(q.OFFLOAD_STATE_TAG)
    rebuilt = cls.from_offload_state(state)
    assert isinstance(rebuilt, QTensorTractScaleOnly)
    assert torch.equal(rebuilt.decompress(), q.decompress())


def test_offload_state_with_compressors_is_refused(weight: torch.Tensor) -> None:
    qscheme = qscale_per_group_f16_min_max_calibration(weight, 4, 32)
    q = QTensorTractScaleOnly(weight, qscheme, u8_compressors=[NibblePacker()])
    with pytest.raises(T2NErrorNotImplemented, match="compressors are not serializable"):
        q.to_offload_state()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda s: s.pop("scale"), "expected tensors 'u8_blob' and 'scale'"),
        (lambda s: s.update(n_bits=8), "'n_bits' must be 4"),
        (lambda s: s.update(shape=[64, 64]), "'u8_blob' must be a 1-D uint8"),
        (lambda s: s.update(shape="64x32"), "'shape' must be a list"),
        (lambda s: s.update(dequant_to_dtype="int8"), "'dequant_to_dtype' must be one of"),
        (lambda s: s.update(specific_machine=3), "specific_machine must be None"),
        (lambda s: s.update(shape=[2048]), "2-D to 4-D"),
        (lambda s: s.update(scale=s["scale"].float()), "'scale' must hold 64 float16"),
        (lambda s: s["scale"].__setitem__(3, float("inf")), "finite float16"),
        (lambda s: s.update(shape=[128, 16]), "trailing volume 16"),
        (
            lambda s: s.update(shape=[0, 2**70], u8_blob=s["u8_blob"][:0], scale=s["scale"][:0]),
            "trailing volume 1180591620717411303424",
        ),
        (lambda s: s.update(u8_packing="none"), "'u8_packing' must be 'nibble_pairs'"),
        (lambda s: s.pop("__t2n_offload_state__"), "expected a dict tagged"),
    ],
)
def test_invalid_offload_state_raises_storage_error(
    tamper: object, message: str, tmp_path: Path
) -> None:
    """Loading the state, or writing tract's file from it, refuses it alike: a file tract
    cannot read is never written."""
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64, 32))
    state = q.to_offload_state()
    tamper(state)  # type: ignore[operator]
    with pytest.raises(T2NErrorStorage, match=re.escape(message)):
        QTensorTractScaleOnly.from_offload_state(state)
    with pytest.raises(T2NErrorStorage, match=re.escape(message)):
        QTensorTractScaleOnly.write_offload_state_in_file(state, tmp_path, "w")
    assert not list(tmp_path.iterdir())


def _codes_past_4_bits(q: QTensorTractScaleOnly) -> None:
    q.u8_blob[0] = 16


def _scale_of_float32(q: QTensorTractScaleOnly) -> None:
    q.qscheme.scale = q.qscheme.scale.float() * 2


def _scale_past_float16(q: QTensorTractScaleOnly) -> None:
    q.qscheme.scale[0] = float("inf")


CHANGES_NO_STATE_HOLDS = pytest.mark.parametrize(
    ("change", "message"),
    [
        (_codes_past_4_bits, "codes must lie in 0..15"),
        (_scale_of_float32, "scale must be 64 float16 values"),
        (_scale_past_float16, "scale must hold finite float16 values"),
    ],
    ids=["codes", "float32-scale", "inf-scale"],
)


@CHANGES_NO_STATE_HOLDS
def test_a_value_no_offload_state_holds_is_refused_before_its_file_is_replaced(
    change: Any, message: str, tmp_path: Path
) -> None:
    """A quantized value changed into what its offload state cannot hold as it is (which
    would read back as other values, or not at all) is refused where it is written."""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    t = OffloadedTensor.from_original_tensor(
        fp_to_tract_q4_0_with_min_max_calibration(weight), "q", tmp_path
    )
    before = t.reload().decompress()
    changed = fp_to_tract_q4_0_with_min_max_calibration(weight)
    change(changed)
    with pytest.raises(T2NErrorMisuse, match=re.escape(message)):
        changed.to_offload_state()
    with pytest.raises(T2NErrorMisuse, match=re.escape(message)):
        t.update_values(changed)
    with pytest.raises(T2NErrorMisuse, match=re.escape(message)):
        OffloadedTensor.from_original_tensor(changed, "other", tmp_path)
    assert torch.equal(t.reload().decompress(), before)


@CHANGES_NO_STATE_HOLDS
@pytest.mark.timeout(60)
def test_a_lease_change_no_offload_state_holds_is_not_written_back(
    change: Any, message: str, tmp_path: Path
) -> None:
    """Changed under a ``read_write`` lease, such a value is not written back: the flush
    says why, the file keeps the earlier value, and a write of a value it holds replaces
    the change."""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    t = OffloadedTensor.from_original_tensor(
        fp_to_tract_q4_0_with_min_max_calibration(weight), "q", tmp_path
    )
    written = t.offload_path.read_bytes()
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            change(value)
        with pytest.raises(T2NErrorStorage, match=re.escape(message)) as info:
            pool.flush()
        assert isinstance(info.value.__cause__, T2NErrorMisuse)
        assert t.offload_path.read_bytes() == written
        mended = fp_to_tract_q4_0_with_min_max_calibration(weight * 2)
        t.update_values(mended)
        pool.flush()
        assert torch.equal(pool.resolve(t).decompress(), mended.decompress())
    assert torch.equal(t.reload().decompress(), mended.decompress())


def _mend(q: QTensorTractScaleOnly) -> None:
    """Undo each change of ``CHANGES_NO_STATE_HOLDS`` as its error says."""
    q.u8_blob.clamp_(0, 15)
    q.qscheme.scale = torch.nan_to_num(q.qscheme.scale, posinf=1.0).half()


@CHANGES_NO_STATE_HOLDS
@pytest.mark.timeout(60)
def test_a_lease_change_no_offload_state_holds_is_read_and_mended_as_its_error_says(
    change: Any, message: str, tmp_path: Path
) -> None:
    """Such a change stays the latest value until it is mended: reads outside the pool get a
    copy of it, and a new ``read_write`` lease (which shelters a copy first) mends it as the
    flush's error says; the flush then writes it. (The copies went through the offload state,
    which refused it: reads, and the lease that would mend it, raised.)"""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    t = OffloadedTensor.from_original_tensor(
        fp_to_tract_q4_0_with_min_max_calibration(weight), "q", tmp_path
    )
    with TensorResidencyPool() as pool:
        with pool.acquire(t, mode="read_write") as value:
            change(value)
            changed = value.decompress()
        with pytest.raises(T2NErrorStorage, match=r"fix the cause .* and flush again"):
            pool.flush()
        read = t.reload()
        assert read.qscheme.scale.data_ptr() != value.qscheme.scale.data_ptr()
        torch.testing.assert_close(read.decompress(), changed, rtol=0, atol=0, equal_nan=True)
        with pool.acquire(t, mode="read_write") as value:
            _mend(value)
            mended = value.decompress()
        pool.flush()
    assert torch.equal(t.reload().decompress(), mended)


@CUDA
def test_offload_state_round_trips_on_cuda() -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(16, 64, device="cuda"))
    state = q.to_offload_state()
    assert state["u8_blob"].is_cuda
    rebuilt = QTensorTractScaleOnly.from_offload_state(state)
    assert rebuilt.device == q.device
    assert torch.equal(rebuilt.decompress(), q.decompress())


@pytest.mark.timeout(60)
def test_a_pool_counts_what_quantized_values_hold_in_memory(tmp_path: Path) -> None:
    """A Q4_0 value holds its codes one per byte, twice its file: the pool counts what it
    holds (it counted the file, and kept twice its budget of values)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(6))).eval()
    for layer in model:
        layer.weight = nn.Parameter(
            fp_to_tract_q4_0_with_min_max_calibration(layer.weight.detach()),
            requires_grad=False,
        )
    offload_module(model, tmp_path)
    weights = [layer.weight for layer in model]
    held = storage.value_nbytes(weights[0].reload())
    assert held > 1.8 * weights[0].payload_nbytes
    budget = 3 * held
    x = torch.randn(2, 256)
    with TensorResidencyPool(max_cached_bytes=budget) as pool, pool.scope(), torch.no_grad():
        for _ in range(2):
            model(x)
        resident = [w for w in weights if pool.is_resident(w)]
        assert pool.resident_bytes == len(resident) * held <= budget
        assert len(resident) == 3


@pytest.mark.timeout(60)
def test_in_place_ops_on_a_quantized_value_are_refused(tmp_path: Path) -> None:
    """An op runs on a decompressed copy of a QTensor: in place, its change was lost without
    a word (under a pool's read_write lease too, whose write-back then wrote the old value).
    It is refused; changing the codes under the lease is written back."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q = fp_to_tract_q4_0_with_min_max_calibration(weight)
    before = q.decompress().clone()
    for change in (
        lambda t: t.mul_(0.5),
        lambda t: t.__setitem__(0, 1.0),
        lambda t: torch.add(torch.ones(8, 64), 1.0, out=t),
        lambda t: torch.ops.aten.add_.Scalar(t, 1.0),
        lambda t: torch.Tensor.set_(t, torch.zeros(8, 64)),
        lambda t: torch.max(torch.randn(3, 8, 64), 0, out=(t, torch.empty(8, 64).long())),
        lambda t: torch.sort(torch.randn(8, 64), out=[t, torch.empty(8, 64).long()]),
        lambda t: torch.ops.aten.fill_diagonal_.default(t, 1.0),  # decomposed before dispatch
    ):
        with pytest.raises(T2NErrorNotImplemented, match="change a decompressed copy"):
            change(q)
    assert torch.equal(q.decompress(), before)
    assert torch.equal(q * 2, before * 2)  # out of place, as before
    offloaded = OffloadedTensor.from_original_tensor(q, "w", tmp_path)
    with TensorResidencyPool() as pool:
        with pool.acquire(offloaded, mode="read_write") as value:
            with pytest.raises(T2NErrorNotImplemented, match="change a decompressed copy"):
                value.mul_(0.5)
            value.u8_blob[0].fill_(0)  # what the value keeps: changed, and written back
        pool.flush()
    reloaded = offloaded.reload()
    assert torch.equal(reloaded.u8_blob[0], torch.zeros_like(reloaded.u8_blob[0]))
    assert torch.equal(reloaded.u8_blob[1:], q.u8_blob[1:])


def test_a_quantized_value_has_no_memory_to_hand_out(tmp_path: Path) -> None:
    """Its address or storage would be those of a decompressed copy freed at once: a
    serializer (safetensors) wrote garbage, or took two values for one shared storage."""
    import safetensors.torch

    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(8, 64))
    for ask in (q.data_ptr, q.untyped_storage, q.storage):
        with pytest.raises(T2NErrorNotImplemented, match="no memory of its own"):
            ask()
    with pytest.raises(T2NErrorNotImplemented, match="no memory of its own"):
        safetensors.torch.save_file({"a": q}, str(tmp_path / "w.safetensors"))


def test_values_that_no_code_stands_for_are_refused_with_a_given_scheme() -> None:
    """As calibration refuses them: NaN and infinities have no code (NaN became an arbitrary
    one); and a meta tensor has no values at all."""
    weight = torch.randn(2, 32)
    scheme = QScalePerGroupF16(32, torch.ones(2), 4)
    for value in (float("nan"), float("inf")):
        bad = weight.clone()
        bad[1, 3] = value
        with pytest.raises(T2NErrorImpossibleQuantization, match="NaN or infinite"):
            QTensorTractScaleOnly(bad, scheme)
    with pytest.raises(T2NErrorMisuse, match="meta tensor holds no values to quantize"):
        fp_to_tract_q4_0_with_min_max_calibration(torch.empty(8, 64, device="meta"))


def test_write_in_file_takes_the_longest_names_and_names_bad_places(tmp_path: Path) -> None:
    q = fp_to_tract_q4_0_with_min_max_calibration(torch.randn(8, 64))
    longest = "w" * (255 - len(".dat"))  # the longest name a file system takes
    assert q.write_in_file(tmp_path, longest).name == longest + ".dat"
    with pytest.raises(T2NErrorStorage, match="cannot write"):
        q.write_in_file(tmp_path, longest + "w")
    with pytest.raises(T2NErrorMisuse, match="dirpath must be the model folder's path"):
        q.write_in_file(None, "w")  # type: ignore[arg-type]
    (tmp_path / "folder.dat").mkdir()
    with pytest.raises(T2NErrorMisuse, match="exists and is not a file"):
        q.write_in_file(tmp_path, "folder")
    with pytest.raises(T2NErrorMisuse, match="meta tensor holds no values to write"):
        q.to("meta").write_in_file(tmp_path, "meta")
