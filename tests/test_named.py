"""NamedTensor and apply_name_to_tensor_in_module."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from contract import IGNORE_TRACE_DEPRECATION, LazyTensor, OpaqueContract
from torch import nn

from torch_to_nnef.exceptions import T2NErrorMisuse
from torch_to_nnef.tensor.named import NamedTensor, apply_name_to_tensor_in_module
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.opaque import OpaqueTensorRef


class TestNamedContract(OpaqueContract):
    atol = 0.0
    rtol = 0.0

    def make(self, dense: torch.Tensor) -> torch.Tensor:
        return NamedTensor(dense, "contract.weight")


class TinyLM(nn.Module):
    """A transformer-shaped toy: token embedding tied to the LM head, a norm with a buffer."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.register_buffer("scale", torch.tensor(0.5))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.embed(ids)) * self.scale)


def _dense(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(11))


# -- NamedTensor ------------------------------------------------------------------------------
def test_named_tensor_shares_storage_with_its_source() -> None:
    source = _dense(3, 4)
    named = NamedTensor(source, "w")
    assert named.nnef_name == "w"
    assert named.data_ptr() == source.data_ptr()
    named[0, 0] = 42.0
    assert source[0, 0] == 42.0
    assert not named.requires_grad


def test_named_tensor_ops_return_plain_tensors_but_in_place_ops_return_itself() -> None:
    named = NamedTensor(_dense(3, 4), "w")
    for result in (named + 1, named.sum(), named.view(-1), named.T, named[1], torch.cat([named])):
        assert type(result) is torch.Tensor
    assert named.add_(1) is named
    assert named.contiguous() is named


def test_clone_detach_and_to_keep_the_name() -> None:
    source = _dense(3, 4)
    named = NamedTensor(source, "layer.weight")
    clone = named.clone()
    assert type(clone) is NamedTensor and clone.nnef_name == "layer.weight"
    assert clone.data_ptr() != source.data_ptr()
    torch.testing.assert_close(clone.as_subclass(torch.Tensor), source)
    for converted in (
        torch.clone(named),
        named.detach(),
        named.to(torch.float64),
        named.to("cpu", torch.float16),
        named.cpu(),
    ):
        assert type(converted) is NamedTensor
        assert converted.nnef_name == "layer.weight"
    assert named.to(torch.float32) is named
    assert named.to(torch.float64).dtype == torch.float64


def test_to_inside_a_forward_keeps_gradients_flowing() -> None:
    weight = nn.Parameter(NamedTensor(_dense(3, 4), "w"), requires_grad=True)
    weight.to(torch.float64).sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, torch.ones(3, 4))


def test_data_is_the_named_tensor_and_assignment_keeps_the_name() -> None:
    named = NamedTensor(_dense(3, 4), "w")
    assert named.data is named
    named.data = torch.zeros(3, 4, dtype=torch.float16)
    assert type(named) is NamedTensor
    assert named.nnef_name == "w"
    assert named.dtype == torch.float16
    assert named.abs().sum() == 0


def test_parameter_of_a_named_tensor_keeps_type_and_name() -> None:
    named = NamedTensor(_dense(3, 4), "w")
    frozen = nn.Parameter(named, requires_grad=False)
    assert type(frozen) is NamedTensor and isinstance(frozen, nn.Parameter)
    assert frozen.nnef_name == "w" and not frozen.requires_grad
    assert not isinstance(named, nn.Parameter)  # the source is left as it was

    trainable = nn.Parameter(named, requires_grad=True)
    assert trainable.requires_grad and trainable.nnef_name == "w"
    (trainable * 2).sum().backward()
    assert trainable.grad is not None
    torch.testing.assert_close(trainable.grad, torch.full((3, 4), 2.0))


def test_repr_names_the_tensor() -> None:
    text = repr(NamedTensor(_dense(3, 4), "encoder.0.weight"))
    assert text == (
        "NamedTensor(nnef_name='encoder.0.weight', shape=(3, 4), dtype=torch.float32, device=cpu)"
    )
    trainable = nn.Parameter(NamedTensor(_dense(2), "b"))
    assert repr(trainable).endswith("requires_grad=True)")


def test_deepcopy_keeps_the_name_and_copies_the_values() -> None:
    named = NamedTensor(_dense(3, 4), "w")
    copied = copy.deepcopy(named)
    assert type(copied) is NamedTensor and copied.nnef_name == "w"
    assert copied.data_ptr() != named.data_ptr()
    torch.testing.assert_close(copied.as_subclass(torch.Tensor), named.as_subclass(torch.Tensor))


def test_save_and_load_keep_the_name(tmp_path: Path) -> None:
    named = NamedTensor(_dense(3, 4), "w")
    torch.save(named, tmp_path / "named.pt")
    loaded = torch.load(tmp_path / "named.pt", weights_only=False)
    assert type(loaded) is NamedTensor and loaded.nnef_name == "w"
    torch.testing.assert_close(loaded.as_subclass(torch.Tensor), named.as_subclass(torch.Tensor))


def test_named_tensor_refuses_opaque_tensors_and_bad_names() -> None:
    with pytest.raises(T2NErrorMisuse, match=r"got LazyTensor"):
        NamedTensor(LazyTensor(_dense(2)), "w")
    with pytest.raises(T2NErrorMisuse, match=r"nnef_name must be a non-empty str, got ''"):
        NamedTensor(_dense(2), "")
    with pytest.raises(T2NErrorMisuse, match=r"got list"):
        NamedTensor([1.0, 2.0], "w")  # type: ignore[arg-type]


def test_assigning_an_opaque_tensor_to_data_is_refused_and_keeps_the_values(
    tmp_path: Path,
) -> None:
    """``.data =`` an opaque tensor would share a shell without storage (torch crashes on the
    next op); it is refused as the constructor refuses one, and the values stay."""
    named = NamedTensor(_dense(2, 3), "w")
    before = named.clone()
    offloaded = OffloadedTensor.from_original_tensor(_dense(2, 3) * 2, "o", tmp_path)
    for opaque in (offloaded, LazyTensor(_dense(2, 3))):
        with pytest.raises(T2NErrorMisuse, match=rf"got {type(opaque).__name__}.*reload\(\)"):
            named.data = opaque
    assert torch.equal(named.sum(), before.sum()) and named.nnef_name == "w"
    named.data = offloaded.reload()  # as the message says
    assert torch.equal(named, _dense(2, 3) * 2)


# -- apply_name_to_tensor_in_module -----------------------------------------------------------
def test_every_parameter_and_buffer_is_named_by_its_path() -> None:
    model = TinyLM()
    apply_name_to_tensor_in_module(model)
    for name, tensor in model.named_parameters():
        assert type(tensor) is NamedTensor and tensor.nnef_name == name
        assert isinstance(tensor, nn.Parameter)
    for name, tensor in model.named_buffers():
        assert type(tensor) is NamedTensor and tensor.nnef_name == name
        assert not isinstance(tensor, nn.Parameter)
    assert "scale" in dict(model.named_buffers())


def test_tied_weights_share_one_named_tensor_named_by_the_first_path() -> None:
    model = TinyLM()
    apply_name_to_tensor_in_module(model)
    assert model.embed.weight is model.lm_head.weight
    assert model.embed.weight.nnef_name == "embed.weight"
    assert len(list(model.parameters())) == len(set(map(id, model.parameters())))


def test_naming_keeps_values_grad_flags_and_outputs() -> None:
    """Naming changes no value, flag, output or gradient (compared with an unnamed copy).

    Mutation caught: doubling the gradient through ``linear``/``embedding`` on named tensors
    (``result + (result - result.detach())``: same values) failed this test.
    """
    model = TinyLM()
    model.block[0].bias.requires_grad_(False)
    reference = copy.deepcopy(model)  # unnamed: its gradients are the oracle
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(ids)
    storage = model.embed.weight.data_ptr()
    apply_name_to_tensor_in_module(model)
    assert model.embed.weight.data_ptr() == storage
    assert model.embed.weight.requires_grad
    assert not model.block[0].bias.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected)
    model(ids).sum().backward()
    reference(ids).sum().backward()
    for (name, named), (_, plain) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        if plain.grad is None:
            assert named.grad is None, name
        else:
            assert named.grad is not None, name
            torch.testing.assert_close(named.grad, plain.grad)
    assert model.embed.weight.grad is not None


def test_opaque_tensors_and_references_are_skipped() -> None:
    model = TinyLM()
    lazy = nn.Parameter(LazyTensor(_dense(8, 8)), requires_grad=False)
    model.block[0].weight = lazy
    ref = nn.Parameter(
        OpaqueTensorRef(torch.empty(8, device="meta"), LazyTensor(_dense(8))), requires_grad=False
    )
    model.block[0].bias = ref
    apply_name_to_tensor_in_module(model)
    assert model.block[0].weight is lazy
    assert model.block[0].bias is ref
    assert type(model.embed.weight) is NamedTensor


def test_naming_twice_keeps_the_same_named_tensors() -> None:
    model = TinyLM()
    apply_name_to_tensor_in_module(model)
    before = dict(model.named_parameters(remove_duplicate=False))
    apply_name_to_tensor_in_module(model)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[name] is tensor for name, tensor in before.items())


def test_named_model_survives_dtype_conversion_and_deepcopy() -> None:
    model = TinyLM()
    apply_name_to_tensor_in_module(model)
    twin = copy.deepcopy(model)
    assert twin.embed.weight is twin.lm_head.weight
    assert type(twin.embed.weight) is NamedTensor and twin.embed.weight.nnef_name == "embed.weight"
    twin.half()
    assert twin.embed.weight.dtype == torch.float16
    assert type(twin.embed.weight) is NamedTensor and twin.embed.weight.nnef_name == "embed.weight"
    assert twin.embed.weight is twin.lm_head.weight
    assert model.embed.weight.dtype == torch.float32


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="needs torch.compile")
def test_compiled_named_model_computes_the_values_and_gradients_of_the_unnamed_one() -> None:
    """AOT autograd (aot_eager, inductor) failed with a ``TypeError`` from inside torch on the
    first call of a graph taking a named parameter or buffer as input; each operation on a
    NamedTensor now runs outside the compiled graph, with the values of an unnamed model."""
    model = TinyLM()
    reference = copy.deepcopy(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    apply_name_to_tensor_in_module(model)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        first, second = compiled(ids), compiled(ids)
        first.sum().backward()
    finally:
        torch._dynamo.reset()
    expected = reference(ids)
    expected.sum().backward()
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    for (name, named), (_, plain) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert type(named) is NamedTensor and named.grad is not None, name
        torch.testing.assert_close(named.grad, plain.grad)


@pytest.mark.timeout(120)
def test_importing_the_package_leaves_dynamo_out_until_a_tensor_is_named() -> None:
    """Dynamo takes longer to import than torch itself: a process that never names a tensor
    never imports it."""
    code = (
        "import sys, torch, torch_to_nnef.tensor, torch_to_nnef.tensor.residency; "
        "from torch_to_nnef.tensor.named import NamedTensor; "
        "assert 'torch._dynamo' not in sys.modules, 'imported with the package'; "
        "NamedTensor(torch.zeros(2), 'w'); "
        "assert 'torch._dynamo' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)


def _compiled_in_a_fresh_process(prepare: str, compile_call: str) -> list[str]:
    """Run ``prepare``, then ``compile_call`` (a ``fullgraph=True`` compile and call), in a
    fresh interpreter; the lines it printed, the last one the compile's outcome: the error's
    type and message, or ``compiled``."""
    code = (
        f"{prepare}\n"
        "try:\n"
        f"    {compile_call}\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, str(error).replace(chr(10), ' '))\n"
        "else:\n"
        "    print('compiled')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100
    )
    return done.stdout.splitlines() or [done.stderr]


def _says_why_it_is_refused(outcome: str) -> None:
    assert outcome.startswith("Unsupported"), outcome
    assert "compile a model whose tensors are not named" in outcome, outcome
    assert "marked as skipped" not in outcome, outcome


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="needs torch.compile")
def test_full_graph_compile_of_a_named_model_says_why_in_a_fresh_process() -> None:
    """The function that dynamo skips exists before the first compile traces an operation
    on a NamedTensor (made later, the call making it would be what ``fullgraph`` refuses)."""
    printed = _compiled_in_a_fresh_process(
        "import torch\n"
        "from torch_to_nnef.tensor.named import apply_name_to_tensor_in_module\n"
        "model = torch.nn.Linear(4, 2)\n"
        "apply_name_to_tensor_in_module(model)",
        "torch.compile(model, backend='eager', fullgraph=True)(torch.ones(3, 4))",
    )
    _says_why_it_is_refused(printed[-1])


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="needs torch.compile")
def test_full_graph_compile_of_a_loaded_named_tensor_says_why_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    """``torch.load`` builds a saved NamedTensor without its constructor: the function that
    dynamo skips is made as it loads all the same, before a compile traces an operation on
    the tensor (made then, the call making it would be what ``fullgraph`` refuses)."""
    path = tmp_path / "named.pt"
    torch.save({"w": NamedTensor(torch.ones(4), "w")}, path)
    printed = _compiled_in_a_fresh_process(
        "import torch\n"
        "from torch_to_nnef.tensor import named\n"
        "with torch.serialization.safe_globals([named.NamedTensor]):\n"
        f"    w = torch.load({str(path)!r})['w']\n"
        "assert type(w) is named.NamedTensor and w.nnef_name == 'w'\n"
        "print('made as it loaded:', named._eager_apply is not None)",
        "torch.compile(lambda x: x * w, backend='eager', fullgraph=True)(torch.ones(4))",
    )
    assert printed[0] == "made as it loaded: True", printed
    _says_why_it_is_refused(printed[-1])


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="needs torch.export")
def test_strictly_exported_named_model_keeps_its_operations_in_the_graph() -> None:
    """torch.export traces with dynamo too; unlike torch.compile it keeps the operations on
    NamedTensors in its graph (it has no graph breaks to fall back on)."""
    model = nn.Linear(4, 2)
    x = _dense(3, 4)
    expected = model(x)
    apply_name_to_tensor_in_module(model)
    try:
        exported = torch.export.export(model, (x,), strict=True)
    finally:
        torch._dynamo.reset()
    assert "aten.linear" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), expected)


@pytest.mark.filterwarnings(IGNORE_TRACE_DEPRECATION)
def test_named_model_can_be_traced() -> None:
    model = TinyLM().eval()
    ids = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        expected = model(ids)
        apply_name_to_tensor_in_module(model)
        traced = torch.jit.trace(model, (ids,))
        torch.testing.assert_close(traced(ids), expected)


def test_a_saved_named_tensor_loads_once_declared_safe(tmp_path: Path) -> None:
    """As the module documents: torch.load's default (weights_only=True) refuses the class of
    a saved NamedTensor until it is declared safe; plain tensors saved instead load as they
    are."""
    model = nn.Linear(3, 2)
    apply_name_to_tensor_in_module(model)
    state = model.state_dict()
    path = tmp_path / "named.pt"
    torch.save(state, path)
    with pytest.raises(pickle.UnpicklingError, match="NamedTensor"):
        torch.load(path)
    with torch.serialization.safe_globals([NamedTensor]):
        loaded = torch.load(path)
    assert type(loaded["weight"]) is NamedTensor
    assert loaded["weight"].nnef_name == "weight"
    assert torch.equal(loaded["weight"], model.weight)

    plain = tmp_path / "plain.pt"
    torch.save({k: v.as_subclass(torch.Tensor) for k, v in state.items()}, plain)
    loaded = torch.load(plain)
    assert type(loaded["bias"]) is torch.Tensor
    assert torch.equal(loaded["bias"], model.bias)
