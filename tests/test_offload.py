"""OffloadedTensor: payload files, loads, writes, ownership, and its place among torch tensors."""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import gc
import hashlib
import itertools
import multiprocessing
import os
import re
import signal
import stat as stat_module
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from breakpoints import line_of, paused_in_new_threads
from contract import OpaqueContract
from forking import in_forked_child, in_forked_child_while_held, put_values
from interrupts import in_finalizer, interrupted
from quant_reference import reference_q4_0_value
from residency_checks import on_disk
from stress.children import context as forkserver_context
from torch import nn

from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef.exceptions import (
    T2NErrorCheckpoint,
    T2NErrorInconsistentTensor,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
    T2NErrorValueMismatch,
)
from torch_to_nnef.tensor import opaque, storage
from torch_to_nnef.tensor.checkpoint import offload_module
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.opaque import opaque_to_final_tensor
from torch_to_nnef.tensor.quant import (
    QTensorTractScaleOnly,
    fp_to_tract_q4_0_with_min_max_calibration,
)
from torch_to_nnef.tensor.residency import TensorResidencyPool


def seeded(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic values of any dtype (bool and integers included)."""
    generator = torch.Generator().manual_seed(len(shape) * 31 + sum(shape))
    values = torch.randn(shape, generator=generator) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return values.to(dtype)


def files_in(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def weight() -> torch.Tensor:
    return seeded(6, 8)


@pytest.fixture
def offloaded(weight: torch.Tensor, tmp_path: Path) -> OffloadedTensor:
    return OffloadedTensor.from_original_tensor(weight, "layers.0.weight", tmp_path)


class TestOffloadedContract(OpaqueContract):
    atol = 0.0
    rtol = 0.0

    @pytest.fixture
    def make_subject(self, tmp_path: Path) -> object:
        return lambda dense: OffloadedTensor.from_original_tensor(dense, "w", tmp_path)


class TestOffloadedQTensorContract(OpaqueContract):
    """An offloaded Q4_0 tensor behaves as the QTensor it stands for."""

    atol = 1e-6
    to_dtypes = ((torch.float64, 1e-6), (torch.float16, 1e-2))

    @pytest.fixture
    def make_subject(self, tmp_path: Path) -> object:
        def make(dense: torch.Tensor) -> torch.Tensor:
            quantized = fp_to_tract_q4_0_with_min_max_calibration(dense)
            quantized.specific_machine = "x86_64"
            return OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)

        return make

    def reference(self, subject: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Q4_0 computed element by element, independently of the library (a planted
        ``(code - 7) * scale`` dequantization fails this class)."""
        return reference_q4_0_value(dense, through_f16=False)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4), (2, 0, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_of_every_dtype_and_shape(dtype: torch.dtype, tmp_path: Path) -> None:
    for shape in SHAPES:
        value = sample(shape, dtype)
        offloaded = OffloadedTensor.from_original_tensor(value, f"t{len(shape)}", tmp_path)
        assert (offloaded.shape, offloaded.dtype, offloaded.device) == (
            value.shape,
            dtype,
            torch.device("cpu"),
        )
        assert offloaded.numel() == value.numel()
        assert not offloaded.is_meta
        reloaded = offloaded.reload()
        assert type(reloaded) is torch.Tensor
        assert reloaded.dtype == dtype
        assert torch.equal(reloaded, value), shape


def test_non_contiguous_values_round_trip(tmp_path: Path) -> None:
    value = seeded(5, 7).t()[1:, ::2]
    offloaded = OffloadedTensor.from_original_tensor(value, "strided", tmp_path)
    assert torch.equal(offloaded.reload(), value)


def test_payload_is_a_safetensors_file(offloaded: OffloadedTensor, weight: torch.Tensor) -> None:
    with safetensors.safe_open(str(offloaded.offload_path), framework="pt") as handle:
        (key,) = list(handle.keys())
        assert torch.equal(handle.get_tensor(key), weight)
    assert offloaded.offload_path.parent == offloaded.offload_dir
    assert offloaded.owns_payload


def test_reload_inside_a_residency_scope_goes_through_the_pool(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    x = seeded(3, 8, seed=7)
    with TensorResidencyPool(max_cached_bytes=1 << 20) as pool, pool.scope():
        first = F.linear(x, offloaded)
        second = F.linear(x, offloaded)
        assert pool.is_resident(offloaded)
        assert torch.equal(offloaded.reload(), weight)
        assert pool.stats().loads == 1
    assert torch.equal(first, F.linear(x, weight)) and torch.equal(second, first)


def test_reload_on_another_device_keeps_the_target(offloaded: OffloadedTensor) -> None:
    offloaded.to("cuda:0")  # no data moves: only the target changes
    assert offloaded.device == torch.device("cuda:0")
    value = offloaded.reload("cpu")
    assert value.device == torch.device("cpu")
    assert offloaded.device == torch.device("cuda:0")
    assert offloaded.target_device == torch.device("cuda:0")
    placeholder = offloaded.reload("meta")  # shape and dtype, nothing read (as upstream)
    assert placeholder.device.type == "meta" and placeholder.shape == offloaded.shape
    assert offloaded.device == torch.device("cuda:0")
    with pytest.raises(T2NErrorMisuse, match="meta device"):
        offloaded.to("meta")  # a target must be loadable


def test_values_on_another_device_than_the_target(weight: torch.Tensor, tmp_path: Path) -> None:
    offloaded = OffloadedTensor(weight, "cuda:1", tmp_path, "w", torch.Tensor)
    assert offloaded.device == torch.device("cuda:1")
    assert torch.equal(offloaded.reload("cpu"), weight)


# ---------------------------------------------------------------------------------------------
# Writes
# ---------------------------------------------------------------------------------------------
def test_update_values_replaces_the_payload(offloaded: OffloadedTensor) -> None:
    path = offloaded.offload_path
    new = seeded(6, 8, seed=1)
    offloaded.update_values(new)
    assert torch.equal(offloaded.reload(), new)
    assert offloaded.offload_path == path
    assert files_in(path.parent) == {path.name}  # no temporary file left behind


def test_update_values_strict_shape_names_both_shapes(offloaded: OffloadedTensor) -> None:
    before = offloaded.reload()
    with pytest.raises(
        T2NErrorValueMismatch, match=re.escape("(6, 9)") + ".*" + re.escape("(6, 8)")
    ):
        offloaded.update_values(torch.zeros(6, 9))
    assert torch.equal(offloaded.reload(), before)


def test_update_values_strict_dtype_names_both_dtypes(offloaded: OffloadedTensor) -> None:
    with pytest.raises(T2NErrorValueMismatch, match=r"torch\.float16.*torch\.float32"):
        offloaded.update_values(torch.zeros(6, 8, dtype=torch.float16))
    # Upstream's check is an assertion: its handlers keep catching, and so do ours.
    for handled in (AssertionError, T2NErrorMisuse):
        with pytest.raises(handled):
            offloaded.update_values(torch.zeros(6, 8, dtype=torch.float16))


def test_update_values_can_change_shape_and_dtype(offloaded: OffloadedTensor) -> None:
    new = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    offloaded.update_values(new, strict_shape=False, strict_dtype=False)
    assert offloaded.shape == (3, 4)
    assert offloaded.dtype == torch.int16
    assert offloaded.element_size() == 2
    assert offloaded.storage_key == (("tensor", torch.int16, (3, 4)),)
    assert torch.equal(offloaded.reload(), new)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_value_is_refused_as_misuse_and_the_payload_stays(
    offloaded: OffloadedTensor, tmp_path: Path, layout: torch.layout
) -> None:
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=layout)
    before = offloaded.reload()
    writes: list[Callable[[], object]] = [
        lambda: offloaded.update_values(nested),
        lambda: offloaded.update_values(nested, strict_shape=False, strict_dtype=False),
        lambda: offloaded.set_(nested),
        lambda: setattr(offloaded, "data", nested),
        lambda: OffloadedTensor.from_original_tensor(nested, "nested", tmp_path),
    ]
    for write in writes:
        with pytest.raises(T2NErrorMisuse, match="nested tensor"):
            write()
    assert offloaded.shape == before.shape
    assert torch.equal(offloaded.reload(), before)
    with pytest.raises(T2NErrorMisuse, match="nested tensor"):
        storage.write_payload(tmp_path / "p.safetensors", {"n": nested})
    assert not (tmp_path / "p.safetensors").exists()


def test_a_sparse_value_is_refused_naming_the_tensor(
    offloaded: OffloadedTensor, tmp_path: Path
) -> None:
    sparse = torch.zeros(offloaded.shape).to_sparse()
    before = offloaded.reload()
    for write in (
        lambda: offloaded.update_values(sparse),
        lambda: OffloadedTensor.from_original_tensor(sparse, "sparse_weight", tmp_path),
    ):
        with pytest.raises(T2NErrorMisuse, match=r"'(layers.0.weight|sparse_weight)' has layout"):
            write()
    assert torch.equal(offloaded.reload(), before)


def test_update_values_from_another_offloaded_tensor(
    offloaded: OffloadedTensor, tmp_path: Path
) -> None:
    source = OffloadedTensor.from_original_tensor(seeded(6, 8, seed=3), "source", tmp_path)
    offloaded.update_values(source)
    assert torch.equal(offloaded.reload(), source.reload())
    offloaded.update_values(offloaded)  # itself: nothing to do
    assert torch.equal(offloaded.reload(), source.reload())


def test_set_routes_to_update_values(offloaded: OffloadedTensor) -> None:
    new = seeded(2, 24, seed=4)
    assert offloaded.set_(new) is offloaded
    assert offloaded.shape == (2, 24)
    assert torch.equal(offloaded.reload(), new)
    # A new dtype too, as upstream's set_ (quantizers rewrite weights in place this way).
    assert offloaded.set_(new.double()) is offloaded
    assert offloaded.dtype == torch.float64
    assert torch.equal(offloaded.reload(), new.double())
    with pytest.raises(T2NErrorMisuse, match="only takes a source tensor"):
        offloaded.set_(new, 0, (2, 24))
    with pytest.raises(T2NErrorMisuse, match="only takes a source tensor"):
        offloaded.set_([1, 2])  # type: ignore[arg-type]


def test_data_setter_routes_to_update_values(offloaded: OffloadedTensor, tmp_path: Path) -> None:
    assert offloaded.data is offloaded
    new = seeded(6, 8, seed=5).half()
    offloaded.data = new
    assert offloaded.dtype == torch.float16
    assert torch.equal(offloaded.reload(), new)
    offloaded.data = offloaded  # what nn.Module._apply does after an in-place .to()
    assert torch.equal(offloaded.reload(), new)
    # The device of the new data becomes the target (here another offloaded tensor's).
    elsewhere = OffloadedTensor(seeded(3, 3, seed=6), "cuda:0", tmp_path, "elsewhere")
    offloaded.data = elsewhere
    assert (offloaded.shape, offloaded.device) == ((3, 3), torch.device("cuda:0"))
    assert torch.equal(offloaded.reload("cpu"), seeded(3, 3, seed=6))
    with pytest.raises(T2NErrorMisuse, match="meta device"):
        offloaded.data = torch.empty(3, 3, device="meta")


def test_to_dtype_rewrites_the_payload(offloaded: OffloadedTensor, weight: torch.Tensor) -> None:
    assert offloaded.to(torch.float16) is offloaded
    assert offloaded.dtype == torch.float16
    with safetensors.safe_open(str(offloaded.offload_path), framework="pt") as handle:
        assert handle.get_tensor("tensor").dtype == torch.float16
    assert torch.equal(offloaded.reload(), weight.half())


def test_to_device_and_dtype_in_one_call(offloaded: OffloadedTensor, weight: torch.Tensor) -> None:
    assert offloaded.to("cuda:0", torch.float64) is offloaded
    assert (offloaded.device, offloaded.dtype) == (torch.device("cuda:0"), torch.float64)
    assert torch.equal(offloaded.reload("cpu"), weight.double())
    offloaded.to(device="cpu")
    assert offloaded.device == torch.device("cpu")


def test_to_with_copy_leaves_the_tensor_alone(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    copied = offloaded.to("cuda:0", torch.float16, copy=True)
    assert isinstance(copied, OffloadedTensor) and copied is not offloaded
    assert (copied.device, copied.dtype) == (torch.device("cuda:0"), torch.float16)
    assert torch.equal(copied.reload("cpu"), weight.half())
    assert (offloaded.device, offloaded.dtype) == (torch.device("cpu"), torch.float32)
    same = offloaded.to("cpu", copy=True)
    assert same is not offloaded and same.offload_path != offloaded.offload_path
    same.add_(1)  # an independent copy
    assert torch.equal(offloaded.reload(), weight)
    for positional in ((torch.float16, False, True), ("cpu", torch.float16, False, True)):
        half = offloaded.to(*positional)  # copy given by position, as torch.Tensor.to takes it
        assert half is not offloaded and half.dtype == torch.float16
    assert offloaded.dtype == torch.float32


def test_to_refuses_what_it_cannot_do(offloaded: OffloadedTensor) -> None:
    with pytest.raises(T2NErrorNotImplemented, match="memory_format"):
        offloaded.to(memory_format=torch.channels_last)
    with pytest.raises(T2NErrorMisuse, match=r"arguments of torch\.Tensor\.to"):
        offloaded.to("not a device")


def test_in_place_operations_write_back(offloaded: OffloadedTensor, weight: torch.Tensor) -> None:
    assert offloaded.mul_(2) is offloaded
    assert torch.equal(offloaded.reload(), weight * 2)
    offloaded[0] = 0
    expected = weight * 2
    expected[0] = 0
    assert torch.equal(offloaded.reload(), expected)
    handle = offloaded
    handle += 1
    assert handle is offloaded
    assert torch.equal(offloaded.reload(), expected + 1)
    with torch.no_grad():
        nn.init.zeros_(offloaded)
    assert torch.count_nonzero(offloaded.reload()) == 0


def test_an_out_argument_is_a_write(offloaded: OffloadedTensor, weight: torch.Tensor) -> None:
    """``out=t`` writes ``t`` as an in-place op does, outside a scope and in one (where the
    pool writes it back); a result of another shape is refused as ``update_values`` does."""
    assert torch.cumsum(offloaded, 0, out=offloaded) is offloaded
    assert torch.equal(offloaded.reload(), torch.cumsum(weight, 0))
    with TensorResidencyPool() as pool:
        with pool.scope():
            assert torch.mul(torch.ones_like(weight), 3, out=offloaded) is offloaded
            assert torch.equal(offloaded * 1, torch.full_like(weight, 3.0))
        assert torch.equal(offloaded.reload(), torch.full_like(weight, 3.0))
    assert torch.equal(on_disk(offloaded), torch.full_like(weight, 3.0))
    with pytest.warns(UserWarning, match="resized"), pytest.raises(T2NErrorMisuse, match="shape"):
        torch.add(torch.ones(3), 1, out=offloaded)
    assert torch.equal(offloaded.reload(), torch.full_like(weight, 3.0))


def test_ops_made_afresh_for_each_call_are_not_kept(
    offloaded: OffloadedTensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A function that hands itself to __torch_function__ (as torch's own do), made anew for
    # each call with what it closes over: the decisions cached per function forget old ones,
    # so neither they nor what they hold pile up (their bound lowered, to reach it quickly).
    monkeypatch.setattr(opaque, "_PER_FUNCTION_LIMIT", 64)

    class Held:
        pass

    def make_op(held: Held) -> Callable[[torch.Tensor], torch.Tensor]:
        def op(x: torch.Tensor) -> torch.Tensor:
            if torch.overrides.has_torch_function((x,)):
                return torch.overrides.handle_torch_function(op, (x,), x)  # type: ignore[no-any-return]
            assert held is not None
            return x * 2

        return op

    expected = offloaded.reload() * 2
    first = Held()
    gone = weakref.ref(first)
    assert torch.equal(make_op(first)(offloaded), expected)
    del first
    for _ in range(200):
        assert torch.equal(make_op(Held())(offloaded), expected)
    gc.collect()
    assert gone() is None, "what the first function held is still kept"


ATEN_WRITES: dict[str, tuple[Callable[[OffloadedTensor], Any], Callable[[torch.Tensor], Any]]] = {
    "add_": (lambda t: torch.ops.aten.add_.Scalar(t, 1.0), lambda w: w + 1.0),
    "add_packet": (lambda t: torch.ops.aten.add_(t, 1.0), lambda w: w + 1.0),
    "fill_": (lambda t: torch.ops.aten.fill_.Scalar(t, 5.0), lambda w: torch.full_like(w, 5.0)),
    "copy_": (lambda t: torch.ops.aten.copy_(t, torch.ones(6, 8)), lambda w: torch.ones(6, 8)),
    "add.out": (
        lambda t: torch.ops.aten.add.out(torch.ones(6, 8), 2.0, out=t),
        lambda w: torch.full_like(w, 3.0),
    ),
    "Tensor.set_": (lambda t: torch.Tensor.set_(t, torch.zeros(3)), lambda w: torch.zeros(3)),
    # Decomposed by torch before dispatch: seen whole only at __torch_function__.
    "fill_diagonal_": (
        lambda t: torch.ops.aten.fill_diagonal_.default(t, 7.0),
        lambda w: w.clone().fill_diagonal_(7.0),
    ),
    # A source requiring gradients: the tensor records no history.
    "add_grad": (
        lambda t: torch.ops.aten.add_.Tensor(t, torch.ones(6, 8, requires_grad=True)),
        lambda w: w + 1.0,
    ),
}


@pytest.mark.parametrize("scoped", [False, True])
@pytest.mark.parametrize("write", sorted(ATEN_WRITES))
def test_an_aten_op_writing_the_tensor_is_a_write(
    offloaded: OffloadedTensor, weight: torch.Tensor, write: str, scoped: bool
) -> None:
    """An aten op that writes the tensor (``torch.ops.aten.add_.Scalar``, an ``out``
    variant), or ``torch.Tensor.set_`` (torch's binding of it skips ``__torch_function__``),
    writes it as ``t.add_()`` and ``t.set_()`` do: outside a scope, and in one under the
    pool's ``read_write`` lease (written back), never changing the pool's value behind it."""
    op, expected_of = ATEN_WRITES[write]
    expected = expected_of(weight)
    with TensorResidencyPool() as pool:
        with pool.scope() if scoped else contextlib.nullcontext():
            assert op(offloaded) is offloaded
        assert offloaded.grad_fn is None and not offloaded.requires_grad
        with pool.scope():
            assert torch.equal(offloaded * 1, expected)
            assert not (offloaded * 1).requires_grad
        assert torch.equal(offloaded.reload(), expected)
    assert torch.equal(on_disk(offloaded), expected)
    assert tuple(offloaded.shape) == tuple(expected.shape)


def _indices() -> torch.Tensor:
    return torch.empty(6, 8, dtype=torch.long)


SEQUENCE_OUTS: dict[
    str, tuple[Callable[[torch.Tensor, Any], Any], Callable[[torch.Tensor], Any]]
] = {
    "max": (lambda x, t: torch.max(x, 0, out=(t, _indices())), lambda x: x.max(0).values),
    "max_list": (lambda x, t: torch.max(x, 0, out=[t, _indices()]), lambda x: x.max(0).values),
    "sort": (lambda x, t: torch.sort(x[0], out=(t, _indices())), lambda x: x[0].sort().values),
    "frexp": (
        lambda x, t: torch.frexp(x[0], out=(t, torch.empty(6, 8, dtype=torch.int32))),
        lambda x: torch.frexp(x[0]).mantissa,
    ),
}


@pytest.mark.parametrize("scoped", [False, True])
@pytest.mark.parametrize("op", sorted(SEQUENCE_OUTS))
def test_a_tensor_in_a_tuple_out_argument_is_written(
    offloaded: OffloadedTensor, op: str, scoped: bool
) -> None:
    """``out=(t, indices)`` (``torch.max``, ``torch.sort``, ``torch.frexp``; a list too)
    writes ``t`` as ``out=t`` does: outside a scope, and in one under the pool's
    ``read_write`` lease (written back); the result holds ``t`` itself."""
    run, expected_of = SEQUENCE_OUTS[op]
    x = seeded(3, 6, 8, seed=1)
    expected = expected_of(x)
    with TensorResidencyPool() as pool:
        with pool.scope() if scoped else contextlib.nullcontext():
            assert run(x, offloaded)[0] is offloaded
        with pool.scope():
            assert torch.equal(offloaded * 1, expected)
        pool.flush()
        assert torch.equal(on_disk(offloaded), expected)
    assert torch.equal(offloaded.reload(), expected)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("scoped", [False, True])
def test_one_tensor_in_two_out_places_ends_as_a_plain_one(
    offloaded: OffloadedTensor, scoped: bool
) -> None:
    """``out=(t, t)``: both outputs go to one value, in the op's order, as for a plain tensor
    (each place changing a copy of its own, the first written last)."""
    x = seeded(3, 6, 8, seed=2)
    plain = torch.empty(6, 8)
    torch.aminmax(x, dim=0, out=(plain, plain))
    with TensorResidencyPool() as pool:
        with pool.scope() if scoped else contextlib.nullcontext():
            torch.aminmax(x, dim=0, out=(offloaded, offloaded))
        pool.flush()
        assert torch.equal(on_disk(offloaded), plain)
    assert torch.equal(offloaded.reload(), plain)


def test_an_in_place_op_with_a_source_requiring_gradients_keeps_no_history(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    """In a scope, the pool's value is changed under a lease: it never joins the source's
    graph, which later reads of it would carry."""
    source = torch.ones(6, 8, requires_grad=True)
    with TensorResidencyPool() as pool, pool.scope():
        offloaded.add_(source)
        value = pool.resolve(offloaded)
        assert value.grad_fn is None and not value.requires_grad
        assert not (offloaded * 1).requires_grad
    assert torch.equal(offloaded.reload(), weight + 1.0)


def test_an_in_place_op_under_a_trace_is_refused(tmp_path: Path) -> None:
    """A trace replays no write to a file: the write is refused by name, not left to fail
    deep inside (sizes are tensors under a trace)."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1.0)
            return x + self.seen

    model = offload_module(Counter(), tmp_path, min_bytes=0)
    assert isinstance(model.seen, OffloadedTensor)
    with pytest.raises(T2NErrorNotImplemented, match="'add_' writes the offloaded tensor"):
        torch.jit.trace(model, torch.ones(2))
    assert torch.equal(model.seen.reload(), torch.zeros(2))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", ["read", "mapped", "quantized"])
def test_function_transforms_over_an_offloaded_tensor_load_it_as_a_constant(
    kind: str, quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    """``torch.func.grad``, ``jvp`` and ``vjp`` of a function using an offloaded tensor, out
    of any pool: the value is loaded as a constant of the transform (buffers made inside the
    transform were its wrappers, with no memory to read into: a bare RuntimeError)."""
    value = {
        "read": seeded(6, 8),
        "mapped": seeded(256, 256),  # 256 KiB: mapped
        "quantized": quantized,
    }[kind]
    offloaded = OffloadedTensor.from_original_tensor(value, "w", tmp_path)
    dense = opaque_to_final_tensor(value)
    x = seeded(dense.shape[1], seed=3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (offloaded @ x).sum()

    expected = dense.sum(0)
    close = functools.partial(torch.allclose, rtol=1e-4, atol=1e-4)  # (sums in other orders)
    assert close(torch.func.grad(f)(x), expected)
    assert close(torch.func.jvp(f, (x,), (x,))[1], expected @ x)
    assert close(torch.func.vjp(f, x)[1](torch.tensor(1.0))[0], expected)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("in_scope", [False, True], ids=["direct", "in_scope"])
@pytest.mark.parametrize("write", ["copy_", "update_values", "add_", "out"])
def test_a_write_inside_a_function_transform_is_refused(
    write: str, in_scope: bool, offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    """A transform's function writing a tensor it captured: refused by name, as torch
    refuses it for any tensor, and the value is unchanged (a bare RuntimeError came from
    deep in the write, the transform's value having no memory to write from; in a pool's
    scope, where a lease takes the write, ``out=`` was even kept and written back)."""
    x = torch.ones_like(weight)

    def f(x: torch.Tensor) -> torch.Tensor:
        if write == "copy_":
            offloaded.copy_(x.detach())
        elif write == "update_values":
            offloaded.update_values(x.detach())
        elif write == "add_":
            offloaded.add_(1.0)
        else:
            torch.add(x.detach(), 1.0, out=offloaded)
        return (x * 2.0).sum()

    refused = pytest.raises(T2NErrorMisuse, match=r"'layers\.0\.weight' was written inside a ")
    with (
        TensorResidencyPool() as pool,
        pool.scope() if in_scope else contextlib.nullcontext(),
        refused,
    ):
        torch.func.grad(f)(x)
    assert torch.equal(offloaded.reload(), weight)


def test_a_functional_op_with_inplace_true_is_a_write(
    offloaded: OffloadedTensor,
    weight: torch.Tensor,
    quantized: QTensorTractScaleOnly,
    tmp_path: Path,
) -> None:
    """``F.relu(t, inplace=True)`` writes ``t`` as ``t.relu_()`` does: outside a scope, and
    in one (under a lease: written back, seen after an eviction); refused on a quantized
    payload, as every in-place op is."""
    assert F.relu(offloaded, inplace=True) is offloaded
    assert torch.equal(offloaded.reload(), F.relu(weight))
    with TensorResidencyPool() as pool:
        with pool.scope():
            F.leaky_relu(offloaded, 0.5, inplace=True)
            F.hardtanh(offloaded, -0.25, 0.25, inplace=True)
        pool.evict(offloaded)
        assert torch.equal(pool.resolve(offloaded), F.relu(weight).clamp(-0.25, 0.25))
    assert torch.equal(on_disk(offloaded), F.relu(weight).clamp(-0.25, 0.25))
    q = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    with pytest.raises(T2NErrorNotImplemented, match="would decompress"):
        F.relu(q, inplace=True)
    assert F.relu(offloaded, inplace=False) is not offloaded  # a read


@pytest.mark.parametrize("scoped", [False, True])
def test_nn_init_functions_given_the_tensor_by_keyword_write_it(
    weight: torch.Tensor, tmp_path: Path, scoped: bool
) -> None:
    """``nn.init.constant_``, ``uniform_``, ``kaiming_uniform_``... hand torch the tensor as a
    keyword (``tensor=``): they write it as ``t.fill_()`` does, in a scope and outside one."""
    offloaded = OffloadedTensor.from_original_tensor(weight, "w", tmp_path)
    with TensorResidencyPool() as pool, pool.scope() if scoped else contextlib.nullcontext():
        assert nn.init.constant_(offloaded, 0.5) is offloaded
        torch.manual_seed(0)
        nn.init.kaiming_uniform_(offloaded, a=1.0)
    torch.manual_seed(0)
    expected = nn.init.kaiming_uniform_(torch.empty_like(weight), a=1.0)
    assert torch.equal(offloaded.reload(), expected)
    assert torch.equal(on_disk(offloaded), expected)


def test_what_gradients_and_multi_tensor_writes_would_lose_is_refused(
    offloaded: OffloadedTensor,
) -> None:
    """Setting ``requires_grad`` refuses as ``requires_grad_(True)`` does (a training loop
    got no gradient, without a word); a multi-tensor in-place op (``torch._foreach_mul_``,
    optimizers' ``foreach``) on a list holding offloaded tensors refuses instead of changing
    loaded copies."""
    with pytest.raises(T2NErrorMisuse, match="cannot require gradients"):
        offloaded.requires_grad = True
    offloaded.requires_grad = False
    assert offloaded.requires_grad is False
    before = offloaded.reload()
    with pytest.raises(T2NErrorNotImplemented, match="multi-tensor op"):
        torch._foreach_mul_([offloaded], 2.0)
    with pytest.raises(T2NErrorNotImplemented, match="multi-tensor op"):
        torch.ops.aten._foreach_mul_.Scalar([offloaded], 2.0)
    assert torch.equal(offloaded.reload(), before)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
@pytest.mark.parametrize("scoped", [False, True])
def test_a_fused_optimizer_step_on_offloaded_parameters_is_refused(
    tmp_path: Path, optimizer: type[torch.optim.Optimizer], scoped: bool
) -> None:
    """A fused optimizer step (``fused=True``: ``torch._fused_adamw_``, ``_fused_sgd_``...)
    writes its list of parameters in one kernel, as a foreach op does: it refuses, naming
    ``fused=False``, and leaves the parameters as they were, in a scope and outside one."""
    model = offload_module(nn.Linear(8, 8), tmp_path)
    before = {name: p.reload() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    step = optimizer(list(model.parameters()), lr=0.1, fused=True)
    refused = pytest.raises(T2NErrorNotImplemented, match=r"multi-tensor op.*fused=False")
    with (
        TensorResidencyPool() as pool,
        pool.scope() if scoped else contextlib.nullcontext(),
        refused,
    ):
        step.step()
    for name, p in model.named_parameters():
        assert torch.equal(p.reload(), before[name]), name
        assert torch.equal(on_disk(p), before[name]), name


@pytest.mark.parametrize("scoped", [False, True])
@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_a_norm_in_training_mode_writes_its_offloaded_running_statistics(
    tmp_path: Path, scoped: bool, norm: str
) -> None:
    """A batch norm's (or a tracking instance norm's) kernel updates the running mean and
    variance in place, unseen by torch's version counter: they are written as in-place ops
    write, and match the dense model's."""
    torch.manual_seed(0)
    if norm == "batch":
        dense: nn.Module = nn.BatchNorm1d(4)
        x = torch.randn(8, 4)
    else:
        dense = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        x = torch.randn(3, 4, 5)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    assert isinstance(model.running_mean, OffloadedTensor)
    with TensorResidencyPool() as pool, pool.scope() if scoped else contextlib.nullcontext():
        for _ in range(3):
            assert torch.allclose(model(x), dense(x))
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(model, name).reload(), getattr(dense, name)), name
    model.eval(), dense.eval()
    assert torch.equal(model(x), dense(x))


_TORCH_NORMS = {
    "torch.batch_norm": lambda x, m, v: torch.batch_norm(
        x, None, None, m, v, True, 0.1, 1e-5, False
    ),
    "torch.native_batch_norm": lambda x, m, v: torch.native_batch_norm(
        x, None, None, m, v, True, 0.1, 1e-5
    ),
    "aten.native_batch_norm": lambda x, m, v: torch.ops.aten.native_batch_norm.default(
        x, None, None, m, v, training=True, momentum=0.1, eps=1e-5
    ),
    "torch.instance_norm": lambda x, m, v: torch.instance_norm(
        x.unsqueeze(-1).expand(8, 4, 3), None, None, m, v, True, 0.1, 1e-5, False
    ),
}


@pytest.mark.parametrize("scoped", [False, True])
@pytest.mark.parametrize("norm", list(_TORCH_NORMS))
def test_torch_own_norms_write_their_offloaded_running_statistics(
    tmp_path: Path, scoped: bool, norm: str
) -> None:
    """torch's batch and instance norms called directly (``torch.batch_norm``, the aten op)
    update the running mean and variance as ``F.batch_norm`` does, though their schemas do not
    mark them as written: the offloaded ones get the change (it was made on a copy, and lost)."""
    torch.manual_seed(0)
    x, mean, var = torch.randn(8, 4), torch.randn(4), torch.rand(4) + 0.5
    dense_mean, dense_var = mean.clone(), var.clone()
    _TORCH_NORMS[norm](x, dense_mean, dense_var)
    assert not torch.equal(dense_mean, mean)
    offloaded_mean = OffloadedTensor.from_original_tensor(mean, "mean", tmp_path)
    offloaded_var = OffloadedTensor.from_original_tensor(var, "var", tmp_path)
    with TensorResidencyPool() as pool, pool.scope() if scoped else contextlib.nullcontext():
        _TORCH_NORMS[norm](x, offloaded_mean, offloaded_var)
    assert torch.allclose(offloaded_mean.reload(), dense_mean)
    assert torch.allclose(offloaded_var.reload(), dense_var)
    assert torch.allclose(on_disk(offloaded_mean), dense_mean)


def test_copy_broadcasts_and_casts(offloaded: OffloadedTensor) -> None:
    offloaded.copy_(torch.arange(8, dtype=torch.int64))
    assert torch.equal(offloaded.reload(), torch.arange(8.0).expand(6, 8))


def test_load_state_dict_writes_offloaded_parameters(tmp_path: Path) -> None:
    linear = nn.Linear(8, 6)
    linear.weight = nn.Parameter(
        OffloadedTensor.from_original_tensor(linear.weight, "weight", tmp_path),
        requires_grad=False,
    )
    source = nn.Linear(8, 6)
    linear.load_state_dict(source.state_dict())
    assert isinstance(linear.weight, OffloadedTensor)
    assert torch.equal(linear.weight.reload(), source.weight.detach())


def test_concurrent_writer_and_readers_see_whole_values(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    """Readers retry when a write replaces the file under them; they never see a mix."""
    other = -weight
    errors: list[BaseException] = []
    seen: list[bool] = []
    stop = threading.Event()

    def write() -> None:
        try:
            for index in range(40):
                offloaded.update_values(other if index % 2 == 0 else weight)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            stop.set()

    def read() -> None:
        try:
            while not stop.is_set():
                value = offloaded.reload()
                seen.append(torch.equal(value, weight) or torch.equal(value, other))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert seen and all(seen)


def _sigint_at_call(n: int) -> Callable[[FrameType, str, Any], None]:
    """A trace function sending SIGINT to this process on entry to the ``n``-th function of
    the package the thread calls: its handler runs there, as a Ctrl-C's handler would.

    Only the package's functions count: one landing inside the standard library (between
    ``logging``'s lock acquire and its ``try``, say) would leave a lock of the process held
    for the tests after this one, whatever the package does. Finalizers a collection runs
    meanwhile (an earlier test's tensors') do not count either (see ``in_finalizer``)."""
    calls = 0

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event != "call" or "torch_to_nnef" not in frame.f_code.co_filename:
            return
        if in_finalizer(frame):
            return
        calls += 1
        if calls == n:
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)

    return trace


def test_the_interrupt_traces_skip_every_frame_a_collection_runs(tmp_path: Path) -> None:
    """A collection frees an earlier tensor amid a traced call: every frame of the package
    it runs (the gc callback, the payload file's removal and the descriptor it closes) is a
    finalizer's, where an injected interrupt would be lost; a plain read's are not."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(8), "t", tmp_path)
    t.reload()  # its descriptor is kept: the removal closes it
    seen: list[tuple[str, bool]] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and "torch_to_nnef" in frame.f_code.co_filename:
            seen.append((frame.f_code.co_name, in_finalizer(frame)))

    cycle: list[Any] = [t]
    cycle.append(cycle)
    del t, cycle
    assert interrupted(trace, gc.collect) is False
    assert {"_remove_file", "_retire_locked"} <= {name for name, _ in seen}
    assert all(inside for _, inside in seen), [name for name, inside in seen if not inside]
    seen.clear()
    u = OffloadedTensor.from_original_tensor(torch.zeros(8), "u", tmp_path)
    interrupted(trace, u.reload)
    assert seen and not any(inside for _, inside in seen)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def _other_float(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.float64 if value.dtype == torch.float32 else torch.float32)


# A direct write: the value it writes (from the current one), and the write itself.
_DIRECT_WRITES: dict[
    str,
    tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[OffloadedTensor, torch.Tensor], Any]],
] = {
    "update_values": (lambda value: value + 1, lambda t, new: t.update_values(new)),
    "setitem": (
        lambda value: torch.cat([value[:3], value[3:] + 1]),
        lambda t, new: t.__setitem__(slice(3, None), new[3:]),
    ),
    "add_": (lambda value: value + 1, lambda t, new: t.add_(1)),
    "to(dtype)": (_other_float, lambda t, new: t.to(new.dtype)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", sorted(_DIRECT_WRITES))
def test_ctrl_c_at_any_call_of_a_direct_write_leaves_a_readable_tensor(
    tmp_path: Path, write: str
) -> None:
    """A SIGINT (Ctrl-C) landing on entry to any function a direct write calls, the rename of
    the new payload and the tensor's switch to it included: the ``KeyboardInterrupt`` reaches
    the caller, the tensor reads the value on disk (the old one, or the new one when the
    file was replaced), a pool that had it cached serves that value, and no temporary file
    is left."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    t = OffloadedTensor.from_original_tensor(torch.zeros(8), "t", tmp_path)
    payload = t.offload_path
    replaced = quiet = 0
    with TensorResidencyPool() as pool:
        for n in itertools.count(1):
            before = t.reload()
            assert _same(pool.resolve(t), before)  # cached
            value_of, run = _DIRECT_WRITES[write]
            new = value_of(before)
            was_interrupted = interrupted(_sigint_at_call(n), functools.partial(run, t, new))
            disk = on_disk(t)
            assert _same(disk, before) or _same(disk, new), f"interrupt at call {n}"
            assert _same(t.reload(), disk), f"interrupt at call {n}"
            assert t.dtype == disk.dtype, f"interrupt at call {n}"
            assert _same(pool.resolve(t), disk), f"interrupt at call {n}"
            assert files_in(tmp_path) == {payload.name}, f"interrupt at call {n}"
            # A write may take a call less or more on a busy machine (a lock free at once, a
            # finalizer run in between): past its end only once three in a row ran whole.
            quiet = 0 if was_interrupted else quiet + 1
            if quiet == 3:
                break
            replaced += was_interrupted and _same(disk, new)
    assert n > 10  # the interrupts reached the write's code
    assert replaced  # some came after the rename: held, then raised once the tensor switched
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_ctrl_c_is_held_gets_ctrl_c_back() -> None:
    """Another thread forks while the main thread is inside a direct write's held step (the
    rename, then the switch): in the child, where that step does not run, Ctrl-C raises
    KeyboardInterrupt again (it was recorded for a raise that never came)."""

    def child() -> str:
        try:
            signal.raise_signal(signal.SIGINT)
            sum(range(10))  # a pending interrupt is raised here at the latest
        except KeyboardInterrupt:
            return "interrupted"
        return "swallowed"

    reports: list[str] = []
    with InterruptHold() as hold:
        hold.start()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        forker = threading.Thread(target=lambda: reports.append(in_forked_child(child)))
        forker.start()
        forker.join(60)
    assert reports == ["interrupted"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_direct_write_whose_directory_cannot_be_forced_to_disk_leaves_the_tensor_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new payload file is renamed into place, then forcing the directory entry to disk
    fails (an I/O error): the write raises ``T2NErrorStorage`` saying the new content is in
    place, and the tensor reads that content, as does a pool that had the old value."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(8), "t", tmp_path)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat_module.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    with TensorResidencyPool() as pool:
        assert _same(pool.resolve(t), torch.zeros(8))
        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(T2NErrorStorage, match="new content is in place"):
            t.copy_(torch.ones(8))
        monkeypatch.undo()
        assert _same(on_disk(t), torch.ones(8))
        assert _same(t.reload(), torch.ones(8))
        assert _same(pool.resolve(t), torch.ones(8))


# ---------------------------------------------------------------------------------------------
# Torch operations and modules
# ---------------------------------------------------------------------------------------------
def test_linear_of_an_offloaded_weight_equals_the_dense_one(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    x = seeded(3, 8, seed=7)
    result = F.linear(x, offloaded)
    assert type(result) is torch.Tensor
    assert torch.equal(result, F.linear(x, weight))


def test_parameter_in_linear_conv_and_embedding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    modules = {
        "linear": (nn.Linear(8, 4), seeded(2, 8)),
        "conv": (nn.Conv2d(3, 4, 3), seeded(1, 3, 6, 6)),
        "embedding": (nn.Embedding(10, 4), torch.tensor([[1, 5, 9]])),
    }
    for name, (module, x) in modules.items():
        with torch.no_grad():
            expected = module(x)
        offloaded = OffloadedTensor.from_original_tensor(module.weight, name, tmp_path)
        module.weight = nn.Parameter(offloaded, requires_grad=False)
        assert module.weight is offloaded
        assert isinstance(module.weight, nn.Parameter)
        with torch.no_grad():
            result = module(x)
        assert type(result) is torch.Tensor
        assert torch.equal(result, expected), name


def test_module_to_retargets_and_casts_in_place(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied
    offload_module(model, tmp_path)
    weight = model[0].weight
    model.to("cuda:0")  # every tensor is offloaded: only targets change
    assert model[0].weight is weight and model[1].weight is weight
    assert weight.device == torch.device("cuda:0")
    model.to("cpu", torch.float64)
    assert model[0].weight is weight and weight.dtype == torch.float64
    model.half()  # assigns .data: written back in float16
    assert model[1].weight is weight and weight.dtype == torch.float16
    x = torch.randn(2, 4, dtype=torch.float16)
    assert model(x).dtype == torch.float16


class _Scaled(nn.Module):
    """A module holding a buffer only: a conversion reaches it before the next module's
    parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))


@pytest.mark.timeout(60)
def test_module_conversion_swapping_parameters_is_refused_before_anything_offloaded_changes(
    tmp_path: Path,
) -> None:
    """Under torch's switch ``set_swap_module_params_on_conversion(True)``, torch swaps each
    converted parameter in with ``torch.utils.swap_tensors``, which refuses an offloaded
    tensor (it has weak references): ``model.to(dtype)`` raised torch's ``RuntimeError`` with
    the buffer and the first weight already cast. It is refused before any offloaded tensor
    changes; a tensor's own ``to()`` is no module conversion, and with the switch off the
    module's conversion works."""
    model = nn.Sequential(_Scaled(), nn.Linear(4, 4), nn.Linear(4, 4))
    values = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    offload_module(model, tmp_path)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    direct = OffloadedTensor.from_original_tensor(seeded(2, 3), "direct", tmp_path)
    refusal = r"'1\.weight', 4 in all.*set_swap_module_params_on_conversion\(False\)"
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for convert in (lambda m: m.to(torch.float16), nn.Module.half, nn.Module.float):
            with pytest.raises(T2NErrorNotImplemented, match=refusal):
                convert(model)
        assert direct.to(torch.float16) is direct
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert direct.dtype == torch.float16
    for name, tensor in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        assert tensor is tensors[name], name
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor.reload(), values[name]), name
    model.to(torch.float16)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor.reload(), values[name].half()), name


def test_len_and_metadata_do_not_load(offloaded: OffloadedTensor) -> None:
    offloaded.offload_path.unlink()  # any load would now fail
    assert len(offloaded) == 6
    assert offloaded.size() == (6, 8)
    assert offloaded.dim() == 2
    assert offloaded.numel() == 48
    assert offloaded.is_floating_point()
    with pytest.raises(T2NErrorStorage):
        offloaded.reload()


def test_repr_and_hash(offloaded: OffloadedTensor, tmp_path: Path) -> None:
    """The repr names the tensor; the hash is by identity (mutation caught: hashing by name
    and shape failed this test)."""
    text = repr(offloaded)
    assert offloaded.name == "layers.0.weight"
    for part in ("OffloadedTensor", "layers.0.weight", "(6, 8)", "torch.float32", "cpu"):
        assert part in text
    assert str(offloaded.offload_path) in text
    other = OffloadedTensor.from_original_tensor(torch.zeros(6, 8), "layers.0.weight", tmp_path)
    assert other.offload_path != offloaded.offload_path
    table = {offloaded: "a", other: "b"}
    assert table[offloaded] == "a" and table[other] == "b"
    assert len({offloaded, other, offloaded}) == 2
    # By identity: two tensors with the same name and values hash apart, and a tensor's hash
    # survives a change of its payload (a hash of the name, values or file would not).
    assert hash(offloaded) != hash(other)
    before = hash(offloaded)
    offloaded.update_values(torch.ones(6, 8))
    assert hash(offloaded) == before and table[offloaded] == "a"


def test_deepcopy_keeps_models_offloaded(
    weight: torch.Tensor, checkpoint: Path, tmp_path: Path
) -> None:
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    model[0].weight = nn.Parameter(
        OffloadedTensor.from_original_tensor(weight, "0.weight", tmp_path), requires_grad=False
    )
    model.register_buffer("pointing", OffloadedTensor.from_safetensors(checkpoint, "a.weight"))
    duplicate = copy.deepcopy(model)
    copied, original = duplicate[0].weight, model[0].weight
    assert isinstance(copied, OffloadedTensor) and isinstance(copied, nn.Parameter)
    assert copied.offload_path != original.offload_path
    assert copied.offload_path.parent == original.offload_path.parent
    assert torch.equal(copied.reload(), weight)
    copied.mul_(0)
    assert torch.equal(original.reload(), weight)
    assert duplicate.pointing.offload_path == model.pointing.offload_path  # same checkpoint
    assert not duplicate.pointing.owns_payload


def test_pickling_writes_the_latest_value_as_a_plain_tensor(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    import pickle

    offloaded.add_(1.0)  # a direct write: pickles see it, as reload() does
    restored = pickle.loads(pickle.dumps(offloaded))
    assert type(restored) is torch.Tensor
    assert torch.equal(restored, weight + 1.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_process_started_with_an_offloaded_tensor_as_argument_gets_its_value(
    method: str, tmp_path: Path
) -> None:
    # The value is shared with the child by a descriptor that the starting process passes
    # once pickling has ended: it must still be alive then.
    weight = seeded(3, 4)
    offloaded = OffloadedTensor.from_original_tensor(weight, "w", offload_dir=tmp_path)
    parameter = nn.Parameter(
        OffloadedTensor.from_original_tensor(-weight, "p", offload_dir=tmp_path),
        requires_grad=False,
    )
    # (The forkserver through the shared helper: the first start in this process sets what
    # the server preloads for every later test that uses one.)
    context = (
        forkserver_context() if method == "forkserver" else multiprocessing.get_context(method)
    )
    for sent, expected in [(offloaded, weight), (parameter, -weight)]:
        received = context.Queue()
        child = context.Process(target=put_values, args=(sent, received))
        child.start()
        try:
            values = received.get(timeout=60)
        finally:
            child.join(timeout=30)
        assert child.exitcode == 0
        assert values == expected.tolist()


def test_torch_save_of_a_model_with_offloaded_weights_writes_a_whole_checkpoint(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    model = torch.nn.Linear(weight.shape[1], weight.shape[0])
    bias = model.bias.detach().clone()
    offloaded = OffloadedTensor.from_original_tensor(weight, "w", offload_dir=tmp_path)
    model.weight = torch.nn.Parameter(offloaded, requires_grad=False)
    path = tmp_path / "model.pt"
    torch.save({"earlier": torch.ones(3)}, path)  # replaced by a whole file, never torn
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert not isinstance(loaded["weight"], OffloadedTensor)
    assert torch.equal(loaded["weight"], weight) and torch.equal(loaded["bias"], bias)
    assert torch.equal(offloaded.reload(), weight)  # the payload is untouched
    torch.save(model, path)  # a parameter comes back as a parameter
    again = torch.load(path, weights_only=False)
    assert isinstance(again.weight, torch.nn.Parameter) and not again.weight.requires_grad
    assert [name for name, _ in again.named_parameters()] == ["weight", "bias"]
    assert torch.equal(again.weight, weight)


def test_a_shallow_copy_is_a_copy_owning_its_own_payload(offloaded: OffloadedTensor) -> None:
    import copy

    copied = copy.copy(offloaded)
    assert isinstance(copied, OffloadedTensor)
    assert copied.offload_path != offloaded.offload_path
    copied.mul_(0)
    assert not torch.equal(offloaded.reload(), copied.reload())


def test_force_gc_collect_collects_after_each_loading_op(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    collections: list[str] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(phase)

    eager = OffloadedTensor(weight, "cpu", tmp_path, "eager", torch.Tensor, force_gc_collect=True)
    lazy = OffloadedTensor(weight, "cpu", tmp_path, "lazy", torch.Tensor)
    gc.disable()
    gc.callbacks.append(on_gc)
    try:
        _ = lazy + 1
        _ = lazy.shape
        assert collections == []
        _ = eager + 1
        assert len(collections) == 1
        _ = eager.shape  # metadata only: no load, no collection
        assert len(collections) == 1
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()


# ---------------------------------------------------------------------------------------------
# Construction, adoption and ownership of files
# ---------------------------------------------------------------------------------------------
def test_adopting_an_existing_payload_file(weight: torch.Tensor, tmp_path: Path) -> None:
    path = storage.payload_path(tmp_path, "adopted", "sid0")
    storage.write_payload(path, {"tensor": weight})
    wrong = torch.empty(2, 2, device="meta")
    with pytest.raises(T2NErrorInconsistentTensor, match=re.escape("(2, 2)")):
        OffloadedTensor(wrong, "cpu", tmp_path, "adopted", torch.Tensor, storage_id="sid0")
    gc.collect()
    assert path.exists()  # a refused adoption takes nothing
    announced = torch.empty(6, 8, device="meta")
    adopted = OffloadedTensor(
        announced, "cpu", tmp_path, "adopted", torch.Tensor, storage_id="sid0"
    )
    assert adopted.offload_path == path and adopted.shape == (6, 8)
    assert torch.equal(adopted.reload(), weight)
    # A second owner would remove the file under the first one when it goes.
    with pytest.raises(T2NErrorMisuse, match="is read by the live OffloadedTensor"):
        OffloadedTensor(None, "cpu", tmp_path, "adopted", torch.Tensor, storage_id="sid0")
    gc.collect()
    assert torch.equal(adopted.reload(), weight)
    with pytest.raises(T2NErrorMisuse, match="storage_id"):
        OffloadedTensor(None, "cpu", tmp_path, "adopted", torch.Tensor)
    with pytest.raises(T2NErrorStorage, match="No such file"):
        OffloadedTensor(None, "cpu", tmp_path, "absent", torch.Tensor, storage_id="sid0")
    created = OffloadedTensor.from_original_tensor(weight, "made", tmp_path)
    with pytest.raises(T2NErrorMisuse, match="is read by the live OffloadedTensor 'made'"):
        OffloadedTensor(None, "cpu", tmp_path, "made", torch.Tensor, storage_id=created.storage_id)
    # A checkpoint a tensor reads in place, under another name (a link) too, is not adopted:
    # the adopter would remove it.
    checkpoint = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": weight}, str(checkpoint))
    reader = OffloadedTensor.from_safetensors(checkpoint, "w")
    os.link(checkpoint, storage.payload_path(tmp_path, "linked", "sid1"))
    with pytest.raises(T2NErrorMisuse, match="is read by the live OffloadedTensor 'w'"):
        OffloadedTensor(None, "cpu", tmp_path, "linked", torch.Tensor, storage_id="sid1")
    gc.collect()
    assert torch.equal(reader.reload(), weight)
    del adopted
    gc.collect()
    assert not path.exists()  # adopted files are owned


def test_a_direct_write_from_a_finalizer_amid_a_write_of_the_same_tensor_is_refused(
    tmp_path: Path,
) -> None:
    """A finalizer that writes ``t``, run by a garbage collection landing while its thread
    writes ``t`` (inside the write's critical section): one of the two writes would be lost
    under the other; the finalizer's is refused, and the one it interrupted stands."""
    t = OffloadedTensor.from_original_tensor(torch.zeros(4), "t", tmp_path)
    outcome: list[BaseException | None] = []
    writing = OffloadedTensor._write_encoded.__code__

    def finalizer() -> None:
        try:
            t.add_(1.0)
            outcome.append(None)
        except T2NErrorMisuse as error:
            outcome.append(error)

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is writing and not outcome:
            sys.settrace(None)
            finalizer()  # as a collection landing there runs it

    sys.settrace(trace)
    try:
        t.add_(1.0)
    finally:
        sys.settrace(None)
    assert len(outcome) == 1 and "amid its own write" in str(outcome[0])
    assert torch.equal(t.reload(), torch.ones(4))
    t.add_(1.0)  # outside the write, it is made
    assert torch.equal(t.reload(), torch.full((4,), 2.0))


def test_a_file_given_the_inode_of_a_removed_payload_can_be_adopted(tmp_path: Path) -> None:
    """A live tensor's payload file removed from outside frees its inode, which the system
    may give the next file at once: that file is no read of the live tensor's, and a tensor
    adopts it."""
    live = OffloadedTensor.from_original_tensor(torch.zeros(4), "live", tmp_path)
    freed = os.stat(live.offload_path).st_ino
    os.remove(live.offload_path)
    path = storage.payload_path(tmp_path, "new", "sid0")
    storage.write_payload(path, {"tensor": torch.ones(4)})
    if os.stat(path).st_ino != freed:
        pytest.skip("this file system gave the new file another inode")
    adopted = OffloadedTensor(None, "cpu", tmp_path, "new", torch.Tensor, storage_id="sid0")
    assert torch.equal(adopted.reload(), torch.ones(4))
    del live


def test_a_new_payload_never_replaces_an_existing_file(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    first = OffloadedTensor(weight, "cpu", tmp_path, "w", torch.Tensor, storage_id="same")
    with pytest.raises(T2NErrorMisuse, match="already exists"):
        OffloadedTensor(weight * 2, "cpu", tmp_path, "w", torch.Tensor, storage_id="same")
    assert torch.equal(first.reload(), weight)


def test_inconsistent_constructor_arguments(weight: torch.Tensor, tmp_path: Path) -> None:
    with pytest.raises(T2NErrorMisuse, match="QTensorTractScaleOnly"):
        OffloadedTensor(weight, "cpu", tmp_path, "w", QTensorTractScaleOnly)
    with pytest.raises(T2NErrorMisuse, match="meta tensor"):
        OffloadedTensor.from_original_tensor(torch.empty(2, device="meta"), "m", tmp_path)
    with pytest.raises(T2NErrorMisuse, match="name must be a str"):
        OffloadedTensor(weight, "cpu", tmp_path, 3, torch.Tensor)  # type: ignore[arg-type]


def test_deleting_removes_only_owned_files(weight: torch.Tensor, tmp_path: Path) -> None:
    first = OffloadedTensor.from_original_tensor(weight, "first", tmp_path)
    second = OffloadedTensor.from_original_tensor(weight, "second", tmp_path)
    checkpoint = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": weight}, str(checkpoint))
    before = digest(checkpoint)
    pointing = OffloadedTensor.from_safetensors(checkpoint, "w", offload_dir=tmp_path)
    first_path, second_path = first.offload_path, second.offload_path
    del first
    gc.collect()
    assert not first_path.exists()
    assert second_path.exists() and checkpoint.exists()
    del pointing
    gc.collect()
    assert digest(checkpoint) == before
    assert files_in(tmp_path) == {second_path.name, checkpoint.name}
    assert torch.equal(second.reload(), weight)


def test_private_directory_lives_as_long_as_its_tensors(weight: torch.Tensor) -> None:
    first = OffloadedTensor.from_original_tensor(weight, "a")
    second = OffloadedTensor.from_original_tensor(weight, "b")
    directory = first.offload_path.parent
    assert second.offload_path.parent == directory
    del first
    gc.collect()
    assert directory.exists()
    assert torch.equal(second.reload(), weight)
    del second
    gc.collect()
    assert not directory.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_forked_childs_writes_leave_its_parents_values_and_files_alone(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    """Writes in a forked child (a direct write, a pool's write-back, a dtype change) go to
    files of its own, as its memory is its own: the parent's tensors keep their values and
    their files, byte for byte."""
    from torch_to_nnef.tensor import TensorResidencyPool

    tensors = [
        OffloadedTensor.from_original_tensor(weight, "owned", tmp_path),
        OffloadedTensor.from_original_tensor(weight, "private"),  # the private directory
        OffloadedTensor.from_original_tensor(weight, "pooled", tmp_path),
        OffloadedTensor.from_original_tensor(weight, "cast", tmp_path),
    ]
    files = {t.offload_path: t.offload_path.read_bytes() for t in tensors}

    def child() -> str:
        owned, private, pooled, cast = tensors
        owned.add_(1.0)
        private[0] = 5.0
        with TensorResidencyPool() as pool, pool.acquire(pooled, mode="read_write") as value:
            value.mul_(2.0)
        cast.data = cast.to(torch.float16)
        changed = weight.clone()
        changed[0] = 5.0
        return repr(
            [
                bool(torch.equal(owned.reload(), weight + 1.0)),
                bool(torch.equal(private.reload(), changed)),
                bool(torch.equal(pooled.reload(), weight * 2.0)),
                cast.reload().dtype == torch.float16,
                all(t.offload_path not in files for t in tensors),
            ]
        )

    assert in_forked_child(child) == "[True, True, True, True, True]"
    for tensor in tensors:
        assert torch.equal(tensor.reload(), weight)
    assert {path: path.read_bytes() for path in files} == files


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_forked_childs_read_after_its_parent_wrote_says_so(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    """The parent writes a tensor after the fork: its file is replaced, and the child, whose
    copy of the tensor still names the file as it was, is told why it cannot read it."""
    tensor = OffloadedTensor.from_original_tensor(weight, "w", tmp_path)
    before = tensor.offload_path.stat().st_ino
    writer = threading.Timer(0.3, tensor.add_, (1.0,))

    def child() -> str:
        deadline = time.monotonic() + 20
        while tensor.offload_path.stat().st_ino == before and time.monotonic() < deadline:
            time.sleep(0.01)
        tensor.reload()
        return "read"

    writer.start()
    try:
        report = in_forked_child(child)
    finally:
        writer.join()
    assert "'w' cannot be read: the process this one was forked from wrote or freed it" in report
    assert torch.equal(tensor.reload(), weight + 1.0)


_SWITCH = next(
    const
    for const in OffloadedTensor._write_encoded.__code__.co_consts
    if getattr(const, "co_name", None) == "switch"
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", ["as the switch begins", "amid the switch"])
def test_a_child_forked_after_a_writes_rename_reads_the_value_written(
    weight: torch.Tensor, tmp_path: Path, cut: str
) -> None:
    """The fork lands once a write renamed its new file into place, as the tensor's switch
    to it (of shape and dtype too) begins or amid it: in the child, the tensor reads the new
    file, the value written before the fork, and writes of its own go to a file of its own.
    (The child read the replaced file: its reads failed, saying the parent wrote after the
    fork.)"""
    tensor = OffloadedTensor.from_original_tensor(weight, "w", tmp_path)
    new = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    text = "storage.forget_file(path)" if cut == "as the switch begins" else "self.offloaded_"
    line = line_of(OffloadedTensor._write_encoded, text)
    point = paused_in_new_threads(_SWITCH, "line", line=line)

    def child() -> str:
        value = tensor.reload()
        tensor.add_(1.0)
        return f"{value.tolist()} {tuple(tensor.shape)} {tensor.dtype} {tensor.reload().sum()}"

    with point as switch:
        switch.armed.set()
        writer = threading.Thread(
            target=tensor.update_values,
            args=(new,),
            kwargs={"strict_shape": False, "strict_dtype": False},
        )
        writer.start()
        assert switch.paused.wait(30), "the write never reached its switch"
        report = in_forked_child(child)
        switch.go()
        writer.join(30)
    assert report == f"{new.tolist()} (3, 4) torch.float64 {(new + 1.0).sum()}"
    assert torch.equal(tensor.reload(), new)  # the child's write went elsewhere


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_forked_childs_write_outlives_its_parents_private_directory(weight: torch.Tensor) -> None:
    """A child writing a tensor of the parent's private directory writes in a private
    directory of its own: the parent removing its directory (its last tensor gone) leaves
    the child's value, which the child's own removal then takes. (The child once wrote in
    the parent's directory, and lost its value as the parent removed it.)"""
    tensors = [OffloadedTensor.from_original_tensor(weight, "private")]
    parent_directory = tensors[0].offload_path.parent

    def drop() -> None:
        tensors.clear()
        gc.collect()

    def child() -> str:
        tensor = tensors[0]
        tensor.add_(1.0)
        directory = tensor.offload_path.parent
        deadline = time.monotonic() + 20
        while parent_directory.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        read = bool(torch.equal(tensor.reload(), weight + 1.0))
        del tensor
        drop()
        return repr([directory != parent_directory, read, directory.exists()])

    dropper = threading.Timer(0.3, drop)
    dropper.start()
    try:
        report = in_forked_child(child)
    finally:
        dropper.join()
    assert not parent_directory.exists()
    assert report == "[True, True, False]"


def _write_in_child(tensors: list[OffloadedTensor], report: Any) -> None:
    for tensor in tensors:
        tensor.add_(1.0)  # a file of the child's own
    report.put([str(tensor.offload_path) for tensor in tensors])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.timeout(60)
def test_a_multiprocessing_childs_files_go_at_its_exit(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    """A forked multiprocessing worker leaves with ``os._exit``, which skips ``atexit``: the
    files its writes made (in a directory given, and in a private directory of its own) are
    removed at its exit all the same, and its parent's stay."""
    tensors = [
        OffloadedTensor.from_original_tensor(weight, "owned", tmp_path),
        OffloadedTensor.from_original_tensor(weight, "private"),  # the private directory
    ]
    parents = [t.offload_path for t in tensors]
    context = multiprocessing.get_context("fork")
    report = context.SimpleQueue()
    child = context.Process(target=_write_in_child, args=(tensors, report))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    written = [Path(path) for path in report.get()]
    assert not set(written) & set(parents)
    assert not any(path.exists() for path in written), "the child's files outlived it"
    assert not written[1].parent.exists(), "the child's private directory outlived it"
    assert all(path.exists() for path in parents)
    assert all(torch.equal(t.reload(), weight) for t in tensors)


_CHILD_LEAVING_A_POOL_OPEN = """
import multiprocessing, os, sys
import torch
from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool

def child(directory, private):
    torch.set_num_threads(1)
    tensor = OffloadedTensor.from_original_tensor(
        torch.zeros(1024), "x", offload_dir=None if private else directory
    )
    pool = TensorResidencyPool(None)
    with pool.scope():
        tensor.add_(1.0)  # changed in the pool, left open: written back at exit
    child.kept = (tensor, pool)
    print(tensor.offload_path.parent, flush=True)

if __name__ == "__main__":
    method, directory = sys.argv[1:]
    for private in (False, True):
        process = multiprocessing.get_context(method).Process(
            target=child, args=(directory, private)
        )
        process.start()
        process.join(60)
        assert process.exitcode == 0, process.exitcode
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_multiprocessing_child_leaving_a_pool_open_exits_cleanly_and_leaves_no_file(
    tmp_path: Path, method: str
) -> None:
    """A spawned child runs the pools' exit work at its exit (``atexit``), then removes its
    files: its pool writes back before its files go, and reports no failed write-back (a
    removal run first, by multiprocessing's exit functions, made it report one). A
    ``forkserver`` child, which leaves with ``os._exit``, removes them all the same."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    script = tmp_path / "leaves_a_pool_open.py"
    script.write_text(_CHILD_LEAVING_A_POOL_OPEN)
    directory = tmp_path / "offload"
    result = subprocess.run(
        [sys.executable, "-W", "ignore::ResourceWarning", str(script), method, str(directory)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert "failed" not in result.stderr and "could not" not in result.stderr, result.stderr
    parents = [Path(line) for line in result.stdout.split()]
    assert len(parents) == 2 and parents[0] == directory
    assert not any(directory.iterdir()), "a child's file outlived it"
    assert not parents[1].exists(), "a child's private directory outlived it"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_removes_its_parents_files(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    """A forked child (a data-loading worker, say) that drops its copies of the tensors
    leaves their files and private directory to the process that created them."""
    tensors = [
        OffloadedTensor.from_original_tensor(weight, "owned", tmp_path),
        OffloadedTensor.from_original_tensor(weight, "private"),  # the private directory
    ]
    paths = [t.offload_path for t in tensors]

    def child() -> str:
        read = [bool(torch.equal(t.reload(), weight)) for t in tensors]
        tensors.clear()
        gc.collect()  # the child's copies are gone
        return repr(read)

    assert in_forked_child(child) == "[True, True]"
    assert all(path.exists() for path in paths), "the child removed its parent's files"
    assert all(torch.equal(t.reload(), weight) for t in tensors)
    directory = paths[1].parent
    tensors.clear()
    gc.collect()
    assert not paths[0].exists() and not directory.exists()  # the parent's removal stands


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_modules_locks_offloads_and_loads(
    weight: torch.Tensor, tmp_path: Path
) -> None:
    """Another thread of the parent (a pool's worker, a thread creating a tensor) may hold a
    module's lock at the fork: the child, which has no such thread, finds it free."""
    from torch_to_nnef.tensor.offload import _protocol, _tensor
    from torch_to_nnef.tensor.storage import _folios, _io

    locks = [
        _tensor._PRIVATE_DIR_LOCK,
        _protocol._loads_outside_lock,
        _io._CLEANED_LOCK,
        _folios.SLOW_REGIONS._lock,
    ]

    def child() -> str:
        for private in (None, tmp_path / "child"):  # the private directory, then a new one
            t = OffloadedTensor.from_original_tensor(weight, "in_child", private)
            if not torch.equal(t.reload(), weight):  # counted as a load outside any pool
                return "wrong value"
        region = ((0, 0, 0, 0), 0, 1 << 21)
        return repr(_folios.SLOW_REGIONS.first_slow(region, 1, 1 << 40))

    assert in_forked_child_while_held(locks, child) == "True"
    assert not any(lock.locked() for lock in locks), "the parent's locks were released"


# ---------------------------------------------------------------------------------------------
# Tensors pointing into a checkpoint
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint" / "model.safetensors"
    path.parent.mkdir()
    tensors = {"a.weight": seeded(4, 4, seed=10), "b.bias": seeded(4, seed=11).double()}
    safetensors.torch.save_file(tensors, str(path))
    return path


def test_from_safetensors_reads_in_place(checkpoint: Path, tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    pointing = OffloadedTensor.from_safetensors(checkpoint, "b.bias", offload_dir=offload_dir)
    assert (pointing.shape, pointing.dtype) == ((4,), torch.float64)
    assert pointing.offload_path == checkpoint.resolve()
    assert not pointing.owns_payload
    assert "key='b.bias'" in repr(pointing)
    assert torch.equal(pointing.reload(), seeded(4, seed=11).double())
    assert not offload_dir.exists()  # nothing copied


def test_a_read_of_a_rewritten_checkpoint_says_to_bind_again(checkpoint: Path) -> None:
    pointing = OffloadedTensor.from_safetensors(checkpoint, "b.bias")
    safetensors.torch.save_file({"b.bias": torch.zeros(4, dtype=torch.float64)}, str(checkpoint))
    with pytest.raises(T2NErrorStorage, match=r"'b\.bias' cannot be read: the checkpoint file "):
        pointing.reload()


def test_a_read_of_a_deleted_file_says_what_went_and_what_to_do(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A bound checkpoint moved away, and an owned payload file deleted by hand: the error
    names the tensor and what is gone, as for a rewritten one."""
    pointing = OffloadedTensor.from_safetensors(checkpoint, "b.bias")
    checkpoint.rename(tmp_path / "moved.safetensors")
    with pytest.raises(
        T2NErrorStorage,
        match=r"'b\.bias' cannot be read: the checkpoint file "
        r"it is bound to is gone .* bind the model to the checkpoint where it is now",
    ):
        pointing.reload()
    owned = OffloadedTensor.from_original_tensor(
        torch.ones(4), "w", offload_dir=tmp_path / "offload"
    )
    owned.offload_path.unlink()
    with pytest.raises(T2NErrorStorage, match=r"'w' cannot be read: its payload file was deleted"):
        owned.reload()


def test_writing_copies_on_write(checkpoint: Path, tmp_path: Path) -> None:
    before = digest(checkpoint)
    offload_dir = tmp_path / "offload"
    pointing = OffloadedTensor.from_safetensors(
        checkpoint, "a.weight", offload_dir=offload_dir, name="a.weight"
    )
    pointing.add_(1)
    assert digest(checkpoint) == before
    assert pointing.owns_payload
    assert pointing.offload_path.parent == offload_dir.resolve()
    assert torch.equal(pointing.reload(), seeded(4, 4, seed=10) + 1)
    copy = pointing.offload_path
    del pointing
    gc.collect()
    assert not copy.exists() and checkpoint.exists()


def test_from_safetensors_errors(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(T2NErrorCheckpoint, match=r"no tensor 'c'.*'a\.weight', 'b\.bias'"):
        OffloadedTensor.from_safetensors(checkpoint, "c")
    with pytest.raises(T2NErrorStorage, match="No such file"):
        OffloadedTensor.from_safetensors(tmp_path / "absent.safetensors", "a")
    layout = storage.read_layout(checkpoint)
    shared = {key: OffloadedTensor.from_safetensors(layout, key) for key in layout.entries}
    assert {key: tuple(t.shape) for key, t in shared.items()} == {
        "a.weight": (4, 4),
        "b.bias": (4,),
    }


# ---------------------------------------------------------------------------------------------
# Offloaded QTensor
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def quantized() -> QTensorTractScaleOnly:
    return fp_to_tract_q4_0_with_min_max_calibration(seeded(8, 64, seed=20))


def test_offloaded_qtensor_reloads_as_a_qtensor(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    offloaded = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    assert offloaded.offloaded_tensor_type is QTensorTractScaleOnly
    assert (offloaded.shape, offloaded.dtype) == (quantized.shape, quantized.dtype)
    assert "offloaded_tensor_type=QTensorTractScaleOnly" in repr(offloaded)
    reloaded = offloaded.reload()
    assert type(reloaded) is QTensorTractScaleOnly
    assert torch.equal(reloaded.decompress(), quantized.decompress())
    assert torch.equal(opaque_to_final_tensor(offloaded), quantized.decompress())
    x = seeded(3, 64, seed=21)
    assert torch.equal(F.linear(x, offloaded), F.linear(x, quantized.decompress()))


def test_write_in_file_from_the_offloaded_form_is_identical(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    offloaded = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path / "offload")
    resident = quantized.write_in_file(tmp_path / "resident", "layer.weight")
    from_disk = offloaded.reload().write_in_file(tmp_path / "offloaded", "layer.weight")
    assert resident.read_bytes() == from_disk.read_bytes()


def test_offloaded_qtensor_cast_and_in_place_rules(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    offloaded = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    offloaded.to(torch.float16)
    reloaded = offloaded.reload()
    assert type(reloaded) is QTensorTractScaleOnly and reloaded.dtype == torch.float16
    with pytest.raises(T2NErrorNotImplemented, match="would decompress"):
        offloaded.mul_(2)
    with pytest.raises(T2NErrorNotImplemented, match="would decompress"):
        offloaded.copy_(torch.zeros(8, 64))
    with pytest.raises(T2NErrorNotImplemented, match="would decompress"):
        torch.ops.aten.mul_.Scalar(offloaded, 2)
    with pytest.raises(T2NErrorNotImplemented, match="would decompress"):
        torch.max(torch.zeros(2, 8, 64), 0, out=(offloaded, torch.empty(8, 64, dtype=torch.long)))
    with pytest.raises(T2NErrorMisuse, match="floating dtypes only"):
        offloaded.to(torch.int8)
    assert offloaded.dtype == torch.float16


def test_assigning_a_plain_data_to_an_offloaded_qtensor_is_refused_not_decompressed(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    model = nn.Linear(64, 8)
    model.weight = nn.Parameter(quantized, requires_grad=False)
    offload_module(model, tmp_path)
    offloaded = model.weight
    assert isinstance(offloaded, OffloadedTensor)
    with pytest.raises(T2NErrorNotImplemented, match=r"would decompress it.*model\.to\(dtype\)"):
        model.half()  # assigns .data a dequantized float16 copy
    with pytest.raises(T2NErrorNotImplemented, match="would decompress it"):
        offloaded.data = torch.zeros(8, 64)
    assert offloaded.offloaded_tensor_type is QTensorTractScaleOnly
    assert offloaded.dtype == torch.float32
    model.to(torch.float16)  # the cast that keeps it quantized
    reloaded = offloaded.reload()
    assert type(reloaded) is QTensorTractScaleOnly and reloaded.dtype == torch.float16
    offloaded.data = quantized  # an opaque value is taken
    assert type(offloaded.reload()) is QTensorTractScaleOnly
    assert offloaded.dtype == torch.float32


def test_a_conversion_assigning_data_refuses_before_converting_any_offloaded_tensor(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    """``model.half()`` on a model whose quantized weight comes after plain offloaded ones is
    refused at the first offloaded tensor it reaches: none is converted. (The plain ones
    before the quantized one were float16 already, the model half converted.)"""
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(64, 8))
    model[1].weight = nn.Parameter(quantized, requires_grad=False)
    offload_module(model, tmp_path)
    before = {name: p.reload() for name, p in model.named_parameters()}
    with pytest.raises(T2NErrorNotImplemented, match=r"'1\.weight' would decompress it") as info:
        model.half()
    assert "No offloaded tensor was converted" in str(info.value)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert torch.equal(p.reload(), before[name]), name
    model[0].half()  # a module without quantized weights converts
    assert model[0].weight.dtype == torch.float16
    assert torch.equal(model[0].weight.reload(), before["0.weight"].half())


# ---------------------------------------------------------------------------------------------
# What the residency pool relies on
# ---------------------------------------------------------------------------------------------
def test_storage_key_and_payload_nbytes(
    offloaded: OffloadedTensor, checkpoint: Path, quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    assert offloaded.payload_nbytes == 6 * 8 * 4
    assert offloaded.storage_key == (("tensor", torch.float32, (6, 8)),)
    pointing = OffloadedTensor.from_safetensors(checkpoint, "a.weight")
    assert pointing.storage_key == (("tensor", torch.float32, (4, 4)),)  # by logical name
    assert pointing.payload_nbytes == 64  # the entry, not the whole checkpoint
    q = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    assert q.storage_key == (("scale", torch.float16, (16,)), ("u8_blob", torch.uint8, (256,)))
    assert q.payload_nbytes == 16 * 2 + 256


@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
def test_loads_read_into_given_buffers(
    offloaded: OffloadedTensor, weight: torch.Tensor, checkpoint: Path, tmp_path: Path
) -> None:
    value = offloaded._reload_unmanaged(torch.device("cpu"))
    assert torch.equal(value, weight)
    buffers = offloaded._host_buffers(value)
    assert buffers is not None and buffers["tensor"] is value
    # A tensor with the same storage key loads into those buffers (here: from a checkpoint).
    same_key = OffloadedTensor.from_original_tensor(seeded(6, 8, seed=30), "other", tmp_path)
    assert same_key.storage_key == offloaded.storage_key
    reused = same_key._reload_unmanaged(torch.device("cpu"), out=buffers)
    assert reused is value
    assert torch.equal(value, seeded(6, 8, seed=30))
    pointing = OffloadedTensor.from_safetensors(checkpoint, "a.weight")
    target = torch.empty(4, 4)
    assert pointing._reload_unmanaged(torch.device("cpu"), out={"tensor": target}) is target
    assert torch.equal(target, seeded(4, 4, seed=10))
    with pytest.raises(T2NErrorMisuse, match="not entries of this payload"):
        pointing._reload_unmanaged(torch.device("cpu"), out={"a.weight": target})


def test_an_opaque_payload_has_no_reusable_host_buffers(
    quantized: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    offloaded = OffloadedTensor.from_original_tensor(quantized, "q", tmp_path)
    value = offloaded._reload_unmanaged(torch.device("cpu"))
    assert type(value) is QTensorTractScaleOnly
    assert torch.equal(value.decompress(), quantized.decompress())
    assert offloaded._host_buffers(value) is None


@pytest.mark.usefixtures("buffered_reads")  # counts buffer reuse
def test_host_buffers_only_for_whole_cpu_buffers(offloaded: OffloadedTensor) -> None:
    value = offloaded._reload_unmanaged()
    assert offloaded._host_buffers(value) == {"tensor": value}
    assert offloaded._host_buffers(value.t()) is None
    assert offloaded._host_buffers(value.double()) is None
    larger = torch.empty(7, 8)
    assert offloaded._host_buffers(larger[:6]) is None  # a view of a larger buffer


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_concurrent_async_writes_and_loads(
    offloaded: OffloadedTensor, weight: torch.Tensor
) -> None:
    import anyio

    values = [weight + index for index in range(6)]
    loaded: list[torch.Tensor] = []

    async def load_many() -> None:
        for _ in range(10):
            loaded.append(await anyio.to_thread.run_sync(offloaded._reload_unmanaged))

    async with anyio.create_task_group() as group:
        for value in values:  # writers and readers in worker threads, as the pool runs them
            group.start_soon(anyio.to_thread.run_sync, offloaded.update_values, value)
        group.start_soon(load_many)
    final = offloaded._reload_unmanaged()
    assert any(torch.equal(final, value) for value in values)
    candidates = [weight, *values]
    assert all(any(torch.equal(seen, value) for value in candidates) for seen in loaded)
