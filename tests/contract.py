"""The behaviour every tensor subclass of the library shares, as one reusable test suite.

A test module runs the suite for its subclass by subclassing :class:`OpaqueContract` and
saying how to build an instance standing for a dense value::

    from contract import OpaqueContract

    class TestQTensorContract(OpaqueContract):
        atol = 0.1                        # quantization error allowed against the dense value

        def make(self, dense: torch.Tensor) -> torch.Tensor:
            return fp_to_tract_q4_0_with_min_max_calibration(dense)

When building an instance needs pytest fixtures (a temporary directory, a pool), override the
``make_subject`` fixture instead of ``make``::

    class TestOffloadedContract(OpaqueContract):
        @pytest.fixture
        def make_subject(self, tmp_path):
            return lambda dense: OffloadedTensor.from_original_tensor(dense, "w", tmp_path)

Values are compared with :meth:`OpaqueContract.reference` (by default the dense value itself)
within ``atol``/``rtol``. The default shapes suit tract's Q4_0 (trailing volumes divisible by 32).

This module also defines :class:`LazyTensor`, the smallest possible opaque tensor (it expands to
a dense tensor it keeps in memory), used to test the opaque machinery on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_to_nnef.tensor.opaque import (
    IR_OPAQUE_NAME,
    OpaqueTensor,
    opaque_to_final_tensor,
    set_opaque_tensor_in_params_as_ref,
)

Factory = Callable[[torch.Tensor], torch.Tensor]

#: torch >= 2.9 deprecates `torch.jit.trace`, which the opaque references exist for.
IGNORE_TRACE_DEPRECATION = "ignore:`torch.jit.trace.*deprecated:DeprecationWarning"


class LazyTensor(OpaqueTensor):
    """An opaque tensor that expands to a dense tensor held in memory."""

    dense: torch.Tensor

    @staticmethod
    def __new__(cls, dense: torch.Tensor) -> LazyTensor:
        shell: LazyTensor = OpaqueTensor._make_shell(cls, dense.shape, dense.dtype, dense.device)
        shell.dense = dense
        return shell

    def __init__(self, dense: torch.Tensor) -> None:
        super().__init__()
        self.expansions = 0

    def _to_base_tensor(self) -> torch.Tensor:
        self.expansions += 1
        return self.dense


def final_value(tensor: torch.Tensor) -> torch.Tensor:
    """The value a tensor stands for, as a plain ``torch.Tensor``."""
    value = opaque_to_final_tensor(tensor)
    if type(value) is not torch.Tensor:
        value = value.as_subclass(torch.Tensor)
    return value


def _seeded(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape) * 7919 + len(shape))
    return torch.randn(*shape, generator=generator).to(dtype)


class OpaqueContract:
    """The contract suite; subclass it as ``Test<Something>Contract`` and implement ``make``."""

    #: Tolerances of value comparisons against :meth:`reference`.
    atol: float = 1e-6
    rtol: float = 1e-5
    #: Weight shapes used by the suite: a matrix, a Linear weight and a Conv2d weight.
    matrix_shape: tuple[int, ...] = (4, 32)
    linear_shape: tuple[int, int] = (6, 64)
    conv_shape: tuple[int, int, int, int] = (4, 8, 2, 2)
    #: Dtypes ``.to(dtype)`` is checked with, with the tolerance added for each.
    to_dtypes: tuple[tuple[torch.dtype, float], ...] = ((torch.float64, 0.0), (torch.float16, 1e-2))

    def make(self, dense: torch.Tensor) -> torch.Tensor:
        """Return an instance of the subclass under test standing for ``dense``."""
        raise NotImplementedError(f"{type(self).__name__} must implement make(dense)")

    def reference(self, subject: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The value ``subject`` is expected to equal (within tolerance); ``dense`` by default."""
        return dense

    @pytest.fixture
    def make_subject(self) -> Factory:
        return self.make

    # -- helpers ------------------------------------------------------------------------------
    def _build(self, make_subject: Factory, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        dense = _seeded(*shape)
        subject = make_subject(dense)
        return subject, self.reference(subject, dense)

    def _assert_close(
        self, actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0
    ) -> None:
        torch.testing.assert_close(
            actual.float(), expected.float(), atol=self.atol + atol, rtol=self.rtol
        )

    # -- the contract -------------------------------------------------------------------------
    def test_reports_the_metadata_of_its_dense_value(self, make_subject: Factory) -> None:
        dense = _seeded(*self.matrix_shape)
        subject = make_subject(dense)
        assert isinstance(subject, torch.Tensor)
        assert subject.shape == dense.shape
        assert subject.dtype == dense.dtype
        assert subject.device == dense.device
        assert subject.numel() == dense.numel()
        assert subject.dim() == dense.dim()

    def test_expands_to_its_value(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        value = final_value(subject)
        assert type(value) is torch.Tensor
        self._assert_close(value, expected)

    @pytest.mark.parametrize(
        "operation",
        [
            pytest.param(lambda t: t + 1, id="add"),
            pytest.param(lambda t: t * 2, id="mul"),
            pytest.param(lambda t: t.sum(dim=0), id="sum"),
            pytest.param(lambda t: t.reshape(-1), id="reshape"),
            pytest.param(lambda t: t[1:3], id="slice"),
            pytest.param(lambda t: t.t(), id="transpose"),
            pytest.param(lambda t: torch.cat([t, t]), id="cat"),
            pytest.param(lambda t: torch.relu(t), id="relu"),
            pytest.param(lambda t: t @ torch.ones(t.shape[-1], 3), id="matmul"),
        ],
    )
    def test_torch_ops_return_plain_tensors(
        self, make_subject: Factory, operation: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        result = operation(subject)
        assert type(result) is torch.Tensor
        self._assert_close(result, operation(expected))

    def test_parameter_without_grad_keeps_the_type(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        param = nn.Parameter(subject, requires_grad=False)
        assert type(param) is type(subject)
        assert isinstance(param, nn.Parameter)
        assert not param.requires_grad
        module = nn.Module()
        module.register_parameter("weight", param)
        assert dict(module.named_parameters()) == {"weight": param}
        self._assert_close(final_value(module.weight), expected)

    def test_linear_forward_matches_the_dense_forward(self, make_subject: Factory) -> None:
        out_features, in_features = self.linear_shape
        subject, expected = self._build(make_subject, *self.linear_shape)
        linear = nn.Linear(in_features, out_features)
        linear.weight = nn.Parameter(subject, requires_grad=False)
        x = _seeded(5, in_features)
        with torch.no_grad():
            result = linear(x)
        assert type(result) is torch.Tensor
        self._assert_close(result, F.linear(x, expected, linear.bias), atol=1e-5)

    def test_conv2d_forward_matches_the_dense_forward(self, make_subject: Factory) -> None:
        out_channels, in_channels, kh, kw = self.conv_shape
        subject, expected = self._build(make_subject, *self.conv_shape)
        conv = nn.Conv2d(in_channels, out_channels, (kh, kw))
        conv.weight = nn.Parameter(subject, requires_grad=False)
        x = _seeded(2, in_channels, 6, 6)
        with torch.no_grad():
            result = conv(x)
        assert type(result) is torch.Tensor
        self._assert_close(result, F.conv2d(x, expected, conv.bias), atol=1e-5)

    def test_to_dtype_gives_the_dense_value_in_that_dtype(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        for dtype, tolerance in self.to_dtypes:
            converted = subject.to(dtype)
            assert converted.dtype == dtype
            assert converted.shape == subject.shape
            value = final_value(converted)
            assert value.dtype == dtype
            self._assert_close(value, expected.to(dtype), atol=tolerance)

    def test_to_cpu_gives_the_dense_value_on_cpu(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        moved = subject.to("cpu")
        assert moved.device == torch.device("cpu")
        self._assert_close(final_value(moved), expected.cpu())

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_to_cuda_gives_the_dense_value_on_cuda(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.matrix_shape)
        moved = subject.to("cuda")
        assert moved.device.type == "cuda"
        value = final_value(moved)
        assert value.device.type == "cuda"
        self._assert_close(value.cpu(), expected.cpu())

    def test_repr_names_the_class_and_the_shape(self, make_subject: Factory) -> None:
        subject, _ = self._build(make_subject, *self.matrix_shape)
        text = repr(subject)
        assert type(subject).__name__ in text
        assert str(tuple(self.matrix_shape)) in text

    def test_state_dict_keeps_the_type(self, make_subject: Factory) -> None:
        subject, expected = self._build(make_subject, *self.linear_shape)
        linear = nn.Linear(self.linear_shape[1], self.linear_shape[0])
        linear.weight = nn.Parameter(subject, requires_grad=False)
        state: dict[str, Any] = linear.state_dict()
        assert type(state["weight"]) is type(subject)
        self._assert_close(final_value(state["weight"]), expected)

    @pytest.mark.filterwarnings(IGNORE_TRACE_DEPRECATION)
    def test_jit_trace_computes_with_the_value(self, make_subject: Factory) -> None:
        out_features, in_features = self.linear_shape
        subject, expected = self._build(make_subject, *self.linear_shape)
        linear = nn.Linear(in_features, out_features)
        linear.weight = nn.Parameter(subject, requires_grad=False)
        set_opaque_tensor_in_params_as_ref(linear)
        x = _seeded(3, in_features)
        with torch.no_grad():
            traced = torch.jit.trace(linear, (x,))
            result = traced(x)
        if isinstance(subject, OpaqueTensor):
            assert IR_OPAQUE_NAME in str(traced.graph)
        self._assert_close(result, F.linear(x, expected, linear.bias), atol=1e-5)
