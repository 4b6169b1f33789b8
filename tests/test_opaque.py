"""OpaqueTensor, OpaqueTensorRef and tracing through the expansion op."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from contract import IGNORE_TRACE_DEPRECATION, LazyTensor, OpaqueContract, final_value
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse, T2NErrorNotImplemented, T2NErrorStorage
from torch_to_nnef.tensor.opaque import (
    IR_OPAQUE_NAME,
    OpaqueTensor,
    OpaqueTensorRef,
    SupportsOffloadState,
    _trace_token,
    offload_state_class,
    opaque_to_final_tensor,
    set_opaque_tensor_in_params_as_ref,
)

pytestmark = pytest.mark.filterwarnings(IGNORE_TRACE_DEPRECATION)


class TestLazyContract(OpaqueContract):
    def make(self, dense: torch.Tensor) -> torch.Tensor:
        return LazyTensor(dense)


class TestNestedLazyContract(OpaqueContract):
    """An opaque tensor expanding to another opaque tensor (an offloaded QTensor's shape)."""

    def make(self, dense: torch.Tensor) -> torch.Tensor:
        return LazyTensor(LazyTensor(dense))


class TwoTiedLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _dense(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3))


def test_metadata_queries_do_not_expand() -> None:
    lazy = LazyTensor(_dense(3, 4))
    assert lazy.shape == (3, 4)
    assert lazy.size(1) == 4
    assert lazy.numel() == 12
    assert lazy.dim() == 2
    assert lazy.dtype == torch.float32
    assert lazy.device == torch.device("cpu")
    assert lazy.is_floating_point()
    assert lazy.expansions == 0
    _ = lazy + 0
    assert lazy.expansions == 1


def test_opaque_to_final_tensor_expands_nested_opaque_tensors() -> None:
    dense = _dense(3, 4)
    nested = LazyTensor(LazyTensor(dense))
    assert isinstance(nested.to_base_tensor(), LazyTensor)
    assert opaque_to_final_tensor(nested) is dense


def test_opaque_to_final_tensor_returns_plain_tensors_unchanged() -> None:
    dense = _dense(2, 2)
    assert opaque_to_final_tensor(dense) is dense


def test_opaque_tensor_cannot_require_grad() -> None:
    lazy = LazyTensor(_dense(2, 2))
    with pytest.raises(T2NErrorMisuse, match=r"cannot require gradients"):
        lazy.requires_grad_(True)
    with pytest.raises(T2NErrorMisuse, match=r"requires_grad=False"):
        nn.Parameter(lazy)
    assert lazy.requires_grad_(False) is lazy
    assert lazy.detach() is lazy


def test_opaque_data_is_the_tensor_and_cannot_be_assigned() -> None:
    lazy = LazyTensor(_dense(2, 2))
    assert lazy.data is lazy
    with pytest.raises(T2NErrorNotImplemented, match=r"ModTensorUpdater"):
        lazy.data = torch.zeros(2, 2)


def test_opaque_without_expansion_raises_not_implemented() -> None:
    class Shell(OpaqueTensor):
        @staticmethod
        def __new__(cls) -> Shell:
            shell: Shell = OpaqueTensor._make_shell(cls, (2,), torch.float32, "cpu")
            return shell

    with pytest.raises(T2NErrorNotImplemented, match=r"Shell must implement _to_base_tensor"):
        _ = Shell() + 1


# -- tracing ----------------------------------------------------------------------------------
def test_trace_of_linear_with_opaque_weight_records_the_expansion_op() -> None:
    dense = _dense(6, 8)
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(LazyTensor(dense), requires_grad=False)
    set_opaque_tensor_in_params_as_ref(linear)
    assert isinstance(linear.weight, OpaqueTensorRef)
    assert isinstance(linear.weight, nn.Parameter)
    assert linear.weight.device == torch.device("cpu")
    assert linear.weight.shape == (6, 8)

    x = _dense(3, 8)
    with torch.no_grad():
        traced = torch.jit.trace(linear, (x,))
        expected = F.linear(x, dense, linear.bias)
        graph = str(traced.graph)
        assert IR_OPAQUE_NAME in graph
        assert "aten::linear" in graph
        torch.testing.assert_close(traced(x), expected)
        other = _dense(5, 8) * 2
        torch.testing.assert_close(traced(other), F.linear(other, dense, linear.bias))


def test_trace_expands_nested_opaque_tensors_once_per_use() -> None:
    dense = _dense(6, 8)
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(LazyTensor(LazyTensor(dense)), requires_grad=False)
    set_opaque_tensor_in_params_as_ref(linear)
    x = _dense(2, 8)
    with torch.no_grad():
        traced = torch.jit.trace(linear, (x,))
        assert str(traced.graph).count(IR_OPAQUE_NAME) == 1
        torch.testing.assert_close(traced(x), F.linear(x, dense, linear.bias))


def test_tied_opaque_params_share_one_reference_and_one_expansion_token() -> None:
    model = TwoTiedLinears()
    dense = model.first.weight.detach().clone()
    x = _dense(4, 8)
    with torch.no_grad():
        expected = model(x)
    model.first.weight = nn.Parameter(LazyTensor(dense), requires_grad=False)
    model.second.weight = model.first.weight
    bias = model.first.bias

    set_opaque_tensor_in_params_as_ref(model)
    assert isinstance(model.first.weight, OpaqueTensorRef)
    assert model.first.weight is model.second.weight
    assert model.first.bias is bias  # plain parameters are left alone

    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        graph = str(traced.inlined_graph)
        arguments = re.findall(rf"{IR_OPAQUE_NAME}\((%[\w.]+)\)", graph)
        constants = dict(re.findall(r"(%[\w.]+) : int = prim::Constant\[value=(\d+)\]", graph))
        assert len(arguments) == 2  # one expansion per use: first and second
        assert len({constants[argument] for argument in arguments}) == 1
        torch.testing.assert_close(traced(x), expected)


def _capturing_backend(graphs: list[str]) -> Callable[..., Any]:
    """A ``torch.compile`` backend that runs each graph as it is, keeping its code in ``graphs``."""

    def capture(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph.code)
        return graph.forward

    return capture


@pytest.mark.timeout(60)
def test_torch_compile_records_the_expansion_op() -> None:
    dense = _dense(6, 8)
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(LazyTensor(dense), requires_grad=False)
    graphs: list[str] = []
    capture = _capturing_backend(graphs)
    x = _dense(3, 8)
    try:
        with torch.no_grad():
            result = torch.compile(linear, backend=capture)(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(result, F.linear(x, dense, linear.bias))
    assert any("torch.ops.t2n.opaque_tensor_expand_named" in code for code in graphs)


@pytest.mark.timeout(120)
def test_torch_compile_of_a_model_with_several_opaque_weights_computes_each() -> None:
    """Each weight's expansion runs in a frame resumed after a graph break: its token changes
    from call to call of that frame, which dynamo would make a symbol (and fail to name the
    tensor with) if it were an integer."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)]
    dense = [layer.weight.detach().clone() for layer in layers]
    model = nn.Sequential(layers[0], nn.ReLU(), layers[1], layers[2])
    for layer, weight in zip(layers, dense, strict=True):
        layer.weight = nn.Parameter(LazyTensor(weight), requires_grad=False)
    graphs: list[str] = []
    capture = _capturing_backend(graphs)
    x = _dense(3, 8)
    hidden = F.relu(F.linear(x, dense[0], layers[0].bias))
    expected = F.linear(F.linear(hidden, dense[1], layers[1].bias), dense[2], layers[2].bias)
    try:
        with torch.no_grad():
            compiled = torch.compile(model, backend=capture)
            first, second = compiled(x), compiled(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert sum(code.count("torch.ops.t2n.opaque_tensor_expand_named") for code in graphs) >= 3


_COMPILE_IN_A_FRESH_PROCESS = """
import sys, tempfile, torch
from torch_to_nnef.tensor import OffloadedTensor
out_features, in_features = int(sys.argv[1]), int(sys.argv[2])
linear = torch.nn.Linear(in_features, out_features)
weight = linear.weight.detach().clone()
offloaded = OffloadedTensor.from_original_tensor(weight, "w", offload_dir=tempfile.mkdtemp())
linear.weight = torch.nn.Parameter(offloaded, requires_grad=False)
x = torch.randn(2, in_features)
with torch.no_grad():
    out = torch.compile(linear)(x)
torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, linear.bias))
print("computed")
"""


@pytest.mark.timeout(300)
def test_inductors_cache_never_serves_a_graph_compiled_for_another_processs_tensor(
    tmp_path: Path,
) -> None:
    """Inductor caches compiled graphs on disk, keyed by their code. Two processes whose first
    opaque weights (the same token number) differ in shape compile the same code: the second
    must not be served the first one's graph (it asserted the first one's shape)."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for shape in (("8", "8"), ("16", "32")):
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE_IN_A_FRESH_PROCESS, *shape],
            capture_output=True,
            text=True,
            env=environment,
            timeout=240,
            check=False,
        )
        assert done.stdout.strip() == "computed", done.stderr[-2000:]


def test_set_refs_twice_leaves_references_in_place() -> None:
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(LazyTensor(_dense(6, 8)), requires_grad=False)
    set_opaque_tensor_in_params_as_ref(linear)
    ref = linear.weight
    set_opaque_tensor_in_params_as_ref(linear)
    assert linear.weight is ref


def test_traced_module_keeps_working_after_its_source_model_is_gone() -> None:
    dense = _dense(6, 8)
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(LazyTensor(dense), requires_grad=False)
    bias = linear.bias.detach().clone()
    set_opaque_tensor_in_params_as_ref(linear)
    x = _dense(3, 8)
    with torch.no_grad():
        traced = torch.jit.trace(linear, (x,))
    del linear
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), F.linear(x, dense, bias))


def test_expansion_op_with_an_unknown_token_says_what_to_do() -> None:
    with pytest.raises(T2NErrorMisuse, match=r"no longer exists: keep the traced module"):
        torch.ops.t2n.opaque_tensor_expand(10**15)


def test_trace_tokens_are_distinct_even_for_copied_attributes() -> None:
    first, second = LazyTensor(_dense(2, 2)), LazyTensor(_dense(2, 2))
    token = _trace_token(first)
    assert _trace_token(first) == token
    second.__dict__.update(first.__dict__)  # what a shallow copy of the shell would carry
    assert _trace_token(second) != token
    assert _trace_token(first) == token


# -- OpaqueTensorRef ---------------------------------------------------------------------------
def test_reference_reports_the_opaque_tensor() -> None:
    lazy = LazyTensor(_dense(3, 4))
    lazy.nnef_name = "layer.weight"  # type: ignore[attr-defined]
    ref = OpaqueTensorRef(torch.empty(3, 4, device="meta"), lazy)
    assert ref.opaque_tensor is lazy
    assert ref.shape == (3, 4)
    assert ref.dtype == torch.float32
    assert ref.device == torch.device("cpu")
    assert ref.nnef_name == "layer.weight"
    assert ref.data is ref
    assert ref.detach() is ref
    assert "OpaqueTensorRef" in repr(ref) and "LazyTensor" in repr(ref)


def test_reference_ops_compute_with_the_expanded_value() -> None:
    dense = _dense(3, 4)
    ref = OpaqueTensorRef(torch.empty(3, 4, device="meta"), LazyTensor(dense))
    result = ref * 2
    assert type(result) is torch.Tensor
    torch.testing.assert_close(result, dense * 2)
    torch.testing.assert_close(final_value(ref + 0), dense)


def test_reference_to_returns_the_converted_value_and_leaves_the_reference() -> None:
    dense = _dense(3, 4)
    lazy = LazyTensor(dense)
    ref = OpaqueTensorRef(torch.empty(3, 4, device="meta"), lazy)
    converted = ref.to(torch.float64)
    assert converted.dtype == torch.float64
    torch.testing.assert_close(final_value(converted), dense.double())
    assert ref.opaque_tensor is lazy
    assert ref.dtype == torch.float32


def test_reference_data_cannot_be_assigned() -> None:
    ref = OpaqueTensorRef(torch.empty(2, device="meta"), LazyTensor(_dense(2)))
    with pytest.raises(T2NErrorNotImplemented, match=r"OpaqueTensorRef"):
        ref.data = torch.zeros(2)


# -- SupportsOffloadState registry ------------------------------------------------------------
def test_offload_state_classes_register_under_their_tag() -> None:
    class Registered(SupportsOffloadState):
        OFFLOAD_STATE_TAG = "tests.opaque.Registered"

    assert offload_state_class("tests.opaque.Registered") is Registered

    class Defaulted(SupportsOffloadState):
        pass

    assert f"{__name__}.{Defaulted.__qualname__}" == Defaulted.OFFLOAD_STATE_TAG
    assert offload_state_class(Defaulted.OFFLOAD_STATE_TAG) is Defaulted


def test_duplicate_OFFLOAD_STATE_TAG_raises() -> None:
    class Original(SupportsOffloadState):
        OFFLOAD_STATE_TAG = "tests.opaque.Duplicate"

    with pytest.raises(T2NErrorMisuse, match=r"'tests.opaque.Duplicate' is already registered"):

        class Impostor(SupportsOffloadState):
            OFFLOAD_STATE_TAG = "tests.opaque.Duplicate"

    assert offload_state_class("tests.opaque.Duplicate") is Original


def test_unknown_OFFLOAD_STATE_TAG_raises_storage_error() -> None:
    with pytest.raises(T2NErrorStorage, match=r"unknown offload class tag 'tests.nowhere'"):
        offload_state_class("tests.nowhere")
