"""Code written for upstream torch-to-nnef runs here unchanged: its keywords, its exception
bases, its offload-state protocol, its ModTensorUpdater scenario.

Every call below is spelled as upstream's documentation and tests spell it (keywords by name,
``except ValueError``), and checks what happens here, on real files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors import safe_open
from torch import nn

from torch_to_nnef.exceptions import (
    T2NError,
    T2NErrorImpossibleQuantization,
    T2NErrorInconsistentTensor,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
    T2NErrorTorchJitTraceFailed,
)
from torch_to_nnef.tensor import OffloadedTensor, TensorResidencyPool
from torch_to_nnef.tensor.named import NamedTensor, get_or_add_named_tensor
from torch_to_nnef.tensor.opaque import (
    OFFLOAD_STATE_KEY,
    OpaqueTensor,
    OpaqueTensorRef,
    SupportsOffloadState,
    find_opaque_ref_by_py_id,
    resolve_offload_state,
    set_opaque_tensor_in_params_as_ref,
)
from torch_to_nnef.tensor.quant import Q40Layout, QScalePerGroupF16, QScheme, QTensor
from torch_to_nnef.tensor.quant.base import qscale_per_group_f16_min_max_calibration
from torch_to_nnef.tensor.quant.qtract import (
    QTensorTractScaleOnly,
    fp_to_tract_q4_0_with_min_max_calibration,
)
from torch_to_nnef.tensor.updater import ModTensorUpdater, TensorHoldKind
from torch_to_nnef.tensor.utils import get_named_buffers, get_named_parameters


# -- the scenario of upstream's ModTensorUpdater tests ---------------------------------------------
class ConvEmbed(nn.Module):
    """An embedding whose weight is tied to the output projection, around a conv stack."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(
            nn.Conv1d(3, 10, 3),
            nn.ReLU(),
            nn.BatchNorm1d(10),
            nn.Conv1d(10, 3, 1),
        )
        self.last_lin_proj = nn.Linear(3, 5)
        self.embedding = nn.Embedding(5, 3)
        self.last_lin_proj.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).permute(0, 2, 1)
        x = self.seq(x).permute(0, 2, 1)
        out: torch.Tensor = self.last_lin_proj(x)
        return out


SAMPLE = torch.tensor([[1, 3, 4, 0, 1, 2]])
NEW_WEIGHT = torch.arange(15.0).reshape(5, 3)


def tied_model() -> ConvEmbed:
    model = ConvEmbed()
    model(SAMPLE)
    assert model.last_lin_proj.weight is model.embedding.weight
    return model


def test_update_by_ref_with_upstream_keywords_keeps_the_tie() -> None:
    model = tied_model()
    updater = ModTensorUpdater(model)
    updater.update_by_ref(ref=model.embedding.weight, new_tensor=NEW_WEIGHT.clone())
    assert model.last_lin_proj.weight is model.embedding.weight
    assert torch.equal(model.last_lin_proj.weight, NEW_WEIGHT)
    assert isinstance(model.embedding.weight, nn.Parameter)
    model(SAMPLE)


def test_update_by_name_ties_or_unties_as_asked() -> None:
    model = tied_model()
    ModTensorUpdater(model).update_by_name(name="embedding.weight", new_tensor=NEW_WEIGHT.clone())
    assert model.last_lin_proj.weight is model.embedding.weight
    assert torch.equal(model.last_lin_proj.weight, NEW_WEIGHT)

    model = tied_model()
    before = model.last_lin_proj.weight.detach().clone()
    ModTensorUpdater(model).update_by_name(
        name="embedding.weight", new_tensor=NEW_WEIGHT.clone(), tie_replacements=False
    )
    assert model.last_lin_proj.weight is not model.embedding.weight
    assert torch.equal(model.last_lin_proj.weight, before)
    assert torch.equal(model.embedding.weight, NEW_WEIGHT)


@pytest.mark.parametrize(
    ("replacement", "named"),
    [
        (torch.arange(10.0).reshape(5, 2), "shape"),
        (NEW_WEIGHT.half(), "dtype"),
        (NEW_WEIGHT.to("meta"), "device"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_inconsistent_replacements_raise_value_errors(
    replacement: torch.Tensor, named: str
) -> None:
    model = tied_model()
    updater = ModTensorUpdater(model)
    with pytest.raises(T2NErrorInconsistentTensor, match=named):
        updater.update_by_name(name="embedding.weight", new_tensor=replacement)
    try:
        updater.update_by_name(name="embedding.weight", new_tensor=replacement)
    except ValueError as exc:  # upstream-style handling
        assert isinstance(exc, T2NError)
    else:
        pytest.fail("an inconsistent replacement was accepted")
    assert model.last_lin_proj.weight is model.embedding.weight


def test_consistency_can_be_waived_on_purpose() -> None:
    model = tied_model()
    updater = ModTensorUpdater(model)
    held = updater.update_by_name(
        name="embedding.weight",
        new_tensor=NEW_WEIGHT.to("meta"),
        enforce_tensor_consistency=False,
    )
    assert held.device.type == "meta"
    assert model.last_lin_proj.weight is model.embedding.weight is held


def test_a_plain_tensor_for_a_parameter_is_a_value_error_without_add_parameter_if_unset() -> None:
    model = tied_model()
    updater = ModTensorUpdater(model, add_parameter_if_unset=False)
    with pytest.raises(ValueError, match="add_parameter_if_unset"):
        updater.update_by_name(name="embedding.weight", new_tensor=NEW_WEIGHT.clone())
    assert model.last_lin_proj.weight is model.embedding.weight
    updater.update_by_name(name="embedding.weight", new_tensor=nn.Parameter(NEW_WEIGHT.clone()))
    assert torch.equal(model.last_lin_proj.weight, NEW_WEIGHT)
    assert model.last_lin_proj.weight is model.embedding.weight


# -- ModTensorUpdater members upstream users call --------------------------------------------------
def test_checks_split_and_parameterize() -> None:
    model = tied_model()
    updater = ModTensorUpdater(model, add_buffers=True)
    weight = model.embedding.weight
    assert ModTensorUpdater.split_param_name("seq.0.weight") == ("seq.0", "weight")
    assert updater.split_param_name("weight") == ("", "weight")

    updater.check_consistency(weight, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="dtype"):
        updater.check_same_dtype(weight, weight.double())
    with pytest.raises(ValueError, match="device"):
        updater.check_same_device(weight, weight.to("meta"))
    with pytest.raises(ValueError, match="shape"):
        updater.check_same_shape(weight, weight[:2])
    with pytest.raises(T2NErrorInconsistentTensor, match=r"dtype .*; shape"):
        updater.check_consistency(weight, torch.zeros(2, dtype=torch.float64))

    wrapped = updater.maybe_parameterize(ref=weight, new_tensor=NEW_WEIGHT)
    assert isinstance(wrapped, nn.Parameter) and wrapped.requires_grad
    running_mean = model.seq[2].running_mean
    assert updater.maybe_parameterize(running_mean, torch.zeros(10)) is not running_mean
    assert type(updater.maybe_parameterize(running_mean, torch.zeros(10))) is torch.Tensor

    assert updater.id_to_kind[id(weight)] is TensorHoldKind.PARAMETER
    assert updater.id_to_kind[id(running_mean)] == "buffer"  # a str enum, as upstream
    assert updater.id_to_names[id(weight)] == {"embedding.weight", "last_lin_proj.weight"}
    assert updater.name_to_parent_module["seq.2.running_mean"] is model.seq[2]
    assert updater.add_parameter_if_unset
    assert TensorHoldKind.UNREGISTRED is TensorHoldKind.UNREGISTERED


def test_named_parameter_helpers_take_upstream_keywords() -> None:
    model = tied_model()
    names = [name for name, _ in get_named_parameters(mod=model, remove_duplicate=False)]
    assert "embedding.weight" in names and "last_lin_proj.weight" in names
    buffers = dict(get_named_buffers(mod=model))
    assert set(buffers) == {"seq.2.running_mean", "seq.2.running_var", "seq.2.num_batches_tracked"}


# -- exception bases -------------------------------------------------------------------------------
def test_exception_classes_keep_upstream_builtin_bases() -> None:
    assert issubclass(T2NErrorMisuse, ValueError)
    assert issubclass(T2NErrorInconsistentTensor, ValueError)
    assert issubclass(T2NErrorNotImplemented, NotImplementedError)
    assert issubclass(T2NErrorImpossibleQuantization, NotImplementedError)
    assert issubclass(T2NErrorTorchJitTraceFailed, RuntimeError)
    assert issubclass(T2NErrorStorage, OSError)
    for cls in (T2NErrorMisuse, T2NErrorImpossibleQuantization, T2NErrorStorage):
        assert issubclass(cls, T2NError)


def test_upstream_style_handlers_catch_real_failures(tmp_path: Path) -> None:
    try:
        fp_to_tract_q4_0_with_min_max_calibration(torch.randn(64))
    except NotImplementedError as exc:  # upstream raises T2NErrorImpossibleQuantization
        assert "2-D to 4-D" in str(exc)
    else:
        pytest.fail("a 1-D weight was quantized to Q4_0")

    try:
        ModTensorUpdater(tied_model()).get_by_name("embeding.weight")
    except ValueError as exc:
        assert "did you mean 'embedding.weight'" in str(exc)
    else:
        pytest.fail("an unknown name was accepted")

    offloaded = OffloadedTensor.from_original_tensor(torch.ones(4), "w", offload_dir=tmp_path)
    offloaded.offload_path.write_bytes(b"\x00" * 3)  # torn by something outside the library
    with pytest.raises(OSError, match="payload file"):
        offloaded.reload()


# -- keywords of quantized and opaque tensors ------------------------------------------------------
@pytest.fixture
def q_weight() -> QTensorTractScaleOnly:
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    return fp_to_tract_q4_0_with_min_max_calibration(weight)


class TractTarget:
    """Stands for upstream's ``TractNNEF``: an object with a ``version`` (``to_str()``)."""

    class Version:
        def __init__(self, text: str) -> None:
            self.text = text

        def to_str(self) -> str:
            return self.text

    def __init__(self, version: str) -> None:
        self.version = self.Version(version)


def item_type(path: Path) -> bytes:
    return path.read_bytes()[48:50]


def test_write_in_file_takes_inference_target(
    q_weight: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    current = q_weight.write_in_file(tmp_path / "a", "w", inference_target=None)
    assert item_type(current) == b"\x40\x30"
    legacy = q_weight.write_in_file(tmp_path / "b", "w", inference_target=TractTarget("0.21.10"))
    assert item_type(legacy) == b"\x40\x20"
    again = q_weight.write_in_file(tmp_path / "c", "w", "0.21.11")  # positional, as upstream
    assert again.read_bytes() == current.read_bytes()
    with pytest.raises(ValueError, match="pass only one"):
        q_weight.write_in_file(tmp_path / "d", "w", "0.21.10", layout=Q40Layout.CURRENT)
    with pytest.raises(ValueError, match="inference_target must be a tract version"):
        q_weight.write_in_file(tmp_path / "d", "w", inference_target=21)


def test_requires_grad_takes_mode(q_weight: QTensorTractScaleOnly) -> None:
    assert q_weight.requires_grad_() is q_weight
    assert q_weight.requires_grad_(mode=False) is q_weight
    with pytest.raises(ValueError, match="cannot require gradients"):
        q_weight.requires_grad_(mode=True)
    param = nn.Parameter(q_weight, requires_grad=False)
    assert isinstance(param, QTensorTractScaleOnly)


def test_quantize_as_torch_and_groups(q_weight: QTensorTractScaleOnly) -> None:
    scheme = q_weight.qscheme
    with pytest.raises(NotImplementedError, match="quantize_as_u8"):
        scheme.quantize_as_torch(torch.randn(8, 64))
    with pytest.raises(T2NErrorNotImplemented):
        QScheme().quantize_as_torch(torch.randn(4))
    values = torch.arange(12.0).reshape(3, 4)
    groups = QScalePerGroupF16.reshape_tensor_per_group(values, 6)
    assert groups.shape == (2, 6) and torch.equal(groups.reshape(3, 4), values)
    with pytest.raises(NotImplementedError, match="groups of 5"):
        QScalePerGroupF16.reshape_tensor_per_group(values, 5)
    calibrated = qscale_per_group_f16_min_max_calibration(values, n_bits=4, group_size=6)
    assert calibrated.scale.shape == (2, 1)


def test_to_trace_tensor_reads_nothing_on_meta(q_weight: QTensorTractScaleOnly) -> None:
    placeholder = q_weight.to_trace_tensor("meta")
    assert placeholder.device.type == "meta" and placeholder.shape == q_weight.shape
    assert placeholder.dtype == q_weight.dtype
    assert torch.equal(q_weight.to_trace_tensor("cpu"), q_weight.decompress())
    assert torch.equal(q_weight.to_trace_tensor(None), q_weight.decompress())


def test_upstream_instance_attributes(q_weight: QTensorTractScaleOnly, tmp_path: Path) -> None:
    assert q_weight.decompressed_shape == q_weight.decompress_to_u8().shape
    offloaded = OffloadedTensor.from_original_tensor(torch.ones(3, 4), "t", offload_dir=tmp_path)
    shell = offloaded.elem
    assert shell.is_meta and shell.shape == (3, 4) and shell.dtype == torch.float32


# -- named tensors and references ------------------------------------------------------------------
def test_get_or_add_named_tensor_shares_tied_weights() -> None:
    model = tied_model()
    seen: dict[int, NamedTensor] = {}
    first = get_or_add_named_tensor(
        seen, model.embedding, "weight", "embedding.weight", model.embedding.weight
    )
    second = get_or_add_named_tensor(
        seen, model.last_lin_proj, "weight", "last_lin_proj.weight", model.last_lin_proj.weight
    )
    assert second is first and first.nnef_name == "embedding.weight"
    bias = get_or_add_named_tensor(
        seen, model.last_lin_proj, "bias", "last_lin_proj.bias", model.last_lin_proj.bias
    )
    assert bias.nnef_name == "last_lin_proj.bias" and len(seen) == 2
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        get_or_add_named_tensor(seen, model, "missing", "missing", NEW_WEIGHT)


def test_find_opaque_ref_by_py_id(q_weight: QTensorTractScaleOnly) -> None:
    model = nn.Linear(64, 8, bias=False)
    model.weight = nn.Parameter(q_weight, requires_grad=False)
    set_opaque_tensor_in_params_as_ref(model)
    ref = find_opaque_ref_by_py_id(model, id(q_weight))
    assert isinstance(ref, OpaqueTensorRef) and ref.opaque_tensor is q_weight
    assert ref.nnef_name == "weight"  # named after its path, as upstream does
    with pytest.raises(RuntimeError, match="set_opaque_tensor_in_params_as_ref"):
        find_opaque_ref_by_py_id(model, id(model))


# -- the offload-state protocol, upstream style ----------------------------------------------------
class ScaledCodes(OpaqueTensor, SupportsOffloadState):
    """An opaque tensor written as upstream documents its subclasses: ``__new__`` through
    ``super().__new__(cls, fp_tensor)``, state as one dict with the tag under the key."""

    OFFLOAD_STATE_TAG = "tests.upstream_compat.scaled_codes.v1"

    @staticmethod
    def __new__(cls, fp_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(cls, fp_tensor, *args, **kwargs)

    def __init__(self, fp_tensor: torch.Tensor, parts: int = 2) -> None:
        super().__init__()
        self.scale = float(fp_tensor.abs().max()) / 127 or 1.0
        codes = torch.round(fp_tensor / self.scale).to(torch.int8)
        self.chunks = list(codes.reshape(-1).chunk(parts))
        self.meta = {"origin": "tests", "sizes": tuple(len(c) for c in self.chunks)}

    def _to_base_tensor(self) -> torch.Tensor:
        codes = torch.cat(self.chunks).reshape(self.shape)
        return codes.to(self.dtype) * self.scale

    def to_offload_state(self) -> dict[str, Any]:
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "shape": tuple(self.shape),
            "dtype": self.dtype,
            "scale": self.scale,
            "chunks": self.chunks,
            "meta": self.meta,
        }

    @classmethod
    def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> ScaledCodes:
        assert cls.is_offload_state(state), state
        device = target_device or state["chunks"][0].device
        placeholder = torch.empty(state["shape"], dtype=state["dtype"], device=device)
        value = cls.__new__(cls, placeholder)
        value.scale = state["scale"]
        value.chunks = [chunk.to(device) for chunk in state["chunks"]]
        value.meta = state["meta"]
        return value


@pytest.mark.timeout(60)
def test_an_upstream_style_subclass_round_trips_through_payload_files(tmp_path: Path) -> None:
    source = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    value = ScaledCodes(source, parts=3)
    state = value.to_offload_state()
    assert ScaledCodes.is_offload_state(state)
    assert resolve_offload_state(state) is ScaledCodes
    assert resolve_offload_state({"plain": 1}) is None

    offloaded = OffloadedTensor.from_original_tensor(value, "layer.codes", offload_dir=tmp_path)
    assert offloaded.shape == value.shape and offloaded.dtype == value.dtype
    # The file is data: safetensors reads it; the tensors are entries, the rest JSON.
    with safe_open(str(offloaded.offload_path), framework="pt") as payload:
        assert sorted(payload.keys()) == ["chunks.0", "chunks.1", "chunks.2"]
        metadata = payload.metadata()
    assert metadata["t2n.class"] == ScaledCodes.OFFLOAD_STATE_TAG
    attributes = json.loads(metadata["t2n.attributes"])
    assert attributes["dtype"] == {"dtype": "float32"}
    assert attributes["shape"] == {"tuple": [6, 10]}

    del value
    reloaded = offloaded.reload()
    assert type(reloaded) is ScaledCodes
    assert reloaded.meta == {"origin": "tests", "sizes": (20, 20, 20)}
    expected = (torch.round(source / reloaded.scale) * reloaded.scale).float()
    assert torch.allclose(reloaded.to_base_tensor(), expected)
    assert torch.allclose(offloaded * 1, expected)  # an op on the offloaded tensor
    with TensorResidencyPool(max_cached_bytes=1 << 20) as pool:
        resolved = pool.resolve(offloaded)
        assert type(resolved) is ScaledCodes
        assert torch.allclose(resolved.to_base_tensor(), expected)

    with pytest.raises(NotImplementedError, match="write_offload_state_in_file"):
        offloaded.write_qtensor_in_file(tmp_path / "model", "codes")


def test_a_state_holding_an_object_is_refused_without_pickle(tmp_path: Path) -> None:
    class Unstorable(ScaledCodes):
        def to_offload_state(self) -> dict[str, Any]:
            return {**super().to_offload_state(), "scheme": object()}

    value = Unstorable(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"holds a object at 'scheme'.*without pickle"):
        OffloadedTensor.from_original_tensor(value, "w", offload_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_upstream_style_rebuild_is_a_storage_error(tmp_path: Path) -> None:
    class Fragile(ScaledCodes):
        OFFLOAD_STATE_TAG = "tests.upstream_compat.fragile.v1"

        @classmethod
        def from_offload_state(cls, state: dict[str, Any], target_device: Any = None) -> Fragile:
            raise KeyError("scale_v2")

    offloaded = OffloadedTensor.from_original_tensor(
        Fragile(torch.randn(4, 4)), "w", offload_dir=tmp_path
    )
    with pytest.raises(T2NErrorStorage, match="KeyError: 'scale_v2'"):
        offloaded.reload()


def test_write_qtensor_in_file_writes_tract_files_from_disk(
    q_weight: QTensorTractScaleOnly, tmp_path: Path
) -> None:
    expected = q_weight.write_in_file(tmp_path / "direct", "layer.weight")
    offloaded = OffloadedTensor.from_original_tensor(q_weight, "q", offload_dir=tmp_path / "off")
    assert offloaded.write_qtensor_in_file(tmp_path / "model", "layer.weight") is True
    written = tmp_path / "model" / "layer.weight.dat"
    assert written.read_bytes() == expected.read_bytes()
    legacy = offloaded.write_qtensor_in_file(tmp_path / "old", "w", inference_target="0.20.0")
    assert legacy is True and item_type(tmp_path / "old" / "w.dat") == b"\x40\x20"

    state = q_weight.to_offload_state()
    path = QTensorTractScaleOnly.write_offload_state_in_file(state, tmp_path / "state", "w")
    assert path.read_bytes() == expected.read_bytes()

    plain = OffloadedTensor.from_original_tensor(torch.ones(4), "p", offload_dir=tmp_path)
    assert plain.write_qtensor_in_file(tmp_path / "model", "p") is False
    assert not (tmp_path / "model" / "p.dat").exists()


def test_from_offload_state_places_the_value_on_target_device(
    q_weight: QTensorTractScaleOnly,
) -> None:
    state = q_weight.to_offload_state()
    rebuilt = QTensorTractScaleOnly.from_offload_state(state, target_device="meta")
    assert rebuilt.device.type == "meta" and rebuilt.shape == q_weight.shape
    same = QTensorTractScaleOnly.from_offload_state(state)
    assert torch.equal(same.decompress(), q_weight.decompress())


# -- imports ---------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "module",
    [
        "torch_to_nnef.tensor.updater",
        "torch_to_nnef.tensor.opaque",
        "torch_to_nnef.tensor.named",
        "torch_to_nnef.tensor.quant.qtract",
    ],
)
def test_each_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(30)
def test_a_storage_error_inside_an_async_read_is_reported_once(tmp_path: Path) -> None:
    """T2NErrorStorage is an OSError: the read's OSError handler must not wrap it again."""
    from torch_to_nnef.tensor import storage

    path = tmp_path / "w.safetensors"
    layout = storage.write_payload(path, {"w": torch.arange(1024.0)})
    with path.open("r+b") as handle:
        handle.truncate(layout.file_size - 16)

    async def read() -> None:
        await storage.aread_payload(layout)

    with pytest.raises(OSError) as caught:
        anyio.run(read)
    assert isinstance(caught.value, T2NErrorStorage)
    assert str(caught.value).count(str(path)) == 1, str(caught.value)


class StatefulQTensor(QTensor, SupportsOffloadState):
    """A QTensor subclass whose state holds its scheme object, as upstream's states do."""

    OFFLOAD_STATE_TAG = "tests.upstream_compat.stateful_qtensor.v1"

    def to_offload_state(self) -> dict[str, Any]:
        return {
            OFFLOAD_STATE_KEY: self.OFFLOAD_STATE_TAG,
            "shape": tuple(self.shape),
            "u8_blob": self.u8_blob,
            "qscheme": self.qscheme,
            "u8_compressors": list(self.u8_compressors),
            "dequant_to_dtype": self.dequant_to_dtype,
            "nnef_name": self.nnef_name,
        }

    @classmethod
    def from_offload_state(
        cls, state: dict[str, Any], target_device: Any = None
    ) -> StatefulQTensor:
        assert cls.is_offload_state(state)
        placeholder = torch.zeros(state["shape"], dtype=state["dequant_to_dtype"])
        value = cls(placeholder, state["qscheme"], dequant_to_dtype=state["dequant_to_dtype"])
        value.u8_blob = state["u8_blob"]
        value.nnef_name = state["nnef_name"]
        return value


def test_a_state_holding_its_scheme_object_round_trips(tmp_path: Path) -> None:
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    scheme = qscale_per_group_f16_min_max_calibration(weight, n_bits=4, group_size=32)
    value = StatefulQTensor(weight, scheme, dequant_to_dtype=torch.float32)
    value.nnef_name = "block.w"

    offloaded = OffloadedTensor.from_original_tensor(value, "block.w", offload_dir=tmp_path)
    with safe_open(str(offloaded.offload_path), framework="pt") as payload:
        assert sorted(payload.keys()) == ["qscheme.scale", "u8_blob"]
        attributes = json.loads(payload.metadata()["t2n.attributes"])
    assert attributes["qscheme"]["state"]["tag"] == QScalePerGroupF16.OFFLOAD_STATE_TAG

    reloaded = offloaded.reload()
    assert type(reloaded) is StatefulQTensor and reloaded.nnef_name == "block.w"
    assert isinstance(reloaded.qscheme, QScalePerGroupF16)
    assert torch.equal(reloaded.qscheme.scale, scheme.scale)
    assert torch.equal(reloaded.decompress(), value.decompress())

    # A forged nested scheme is refused as a storage error, never trusted.
    from torch_to_nnef.tensor import storage

    layout = storage.read_layout(offloaded.offload_path)
    tensors = storage.read_payload(layout)
    for forged, message in [
        ({"group_size": 32, "n_bits": 9}, "n_bits must be an int from 1 to 8"),
        ({"group_size": "32", "n_bits": 4}, "group_size must be a positive int"),
    ]:
        attributes["qscheme"]["state"]["value"].update(forged)
        metadata = {**layout.metadata, "t2n.attributes": json.dumps(attributes)}
        with pytest.raises(T2NErrorStorage, match=message):
            storage.decode_opaque(tensors, metadata)
    attributes["qscheme"]["state"]["tag"] = "no.such.scheme"
    metadata = {**layout.metadata, "t2n.attributes": json.dumps(attributes)}
    with pytest.raises(T2NErrorStorage, match=r"unknown offload class tag 'no\.such\.scheme'"):
        storage.decode_opaque(tensors, metadata)


# -- upstream's documented quantization walk, over offloaded weights -------------------------
class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16, bias=False)
        self.tied = nn.Linear(64, 16, bias=False)
        self.tied.weight = self.head.weight  # shared by two Linear layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(ids))
        out: torch.Tensor = self.head(x) + self.tied(x)
        return out


def quantize_linears_as_upstream_does(model: nn.Module) -> dict[int, torch.Tensor]:
    """The walk upstream documents for writing a quantization: one updater, tied weights
    quantized once, an offloaded weight replaced by an offloaded QTensor."""
    done: dict[int, torch.Tensor] = {}
    updater = ModTensorUpdater(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or id(module.weight) in done:
                continue
            holders = updater.id_to_modules[id(module.weight)]
            if not all(isinstance(m, nn.Linear) for m in holders):
                continue
            original = module.weight
            values = (
                original.to_base_tensor() if isinstance(original, OffloadedTensor) else original
            )
            try:
                q_weight: torch.Tensor = fp_to_tract_q4_0_with_min_max_calibration(values)
            except T2NErrorImpossibleQuantization:
                continue
            q_weight.nnef_name = f"{name}.weight"
            if isinstance(original, OffloadedTensor):
                q_weight = OffloadedTensor.from_original_tensor(
                    q_weight, f"{original._name}.q40", offload_dir=original.offload_dir
                )
            q_weight = updater.update_by_ref(module.weight, q_weight)
            done[id(q_weight)] = q_weight
    return done


def test_upstream_quantization_walk_over_offloaded_tied_weights(tmp_path: Path) -> None:
    from torch_to_nnef.tensor import offload_module

    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.tensor([[1, 5, 7, 2]])
    expected = model(ids)
    offload_module(model, tmp_path / "offload")

    quantized = quantize_linears_as_upstream_does(model)
    assert len(quantized) == 2  # proj, and head/tied once
    assert model.head.weight is model.tied.weight
    assert isinstance(model.head.weight, OffloadedTensor)
    assert isinstance(model.head.weight.reload(), QTensorTractScaleOnly)
    assert model.head.weight.reload().nnef_name == "head.weight"
    assert not isinstance(model.embed.weight.reload(), QTensorTractScaleOnly)
    assert updater_names(model) == {"embed.weight", "proj.weight", "proj.bias", "head.weight"}
    with torch.no_grad():
        got = model(ids)
    torch.testing.assert_close(got, expected, rtol=0.2, atol=0.2)  # 4-bit weights

    assert model.proj.weight.write_qtensor_in_file(tmp_path / "model", "proj.weight")
    assert (tmp_path / "model" / "proj.weight.dat").stat().st_size == 128 + 64 * 2 * 18


def updater_names(model: nn.Module) -> set[str]:
    return {names[0] for names, _ in ModTensorUpdater(model).iter_tensors()}
