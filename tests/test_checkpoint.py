"""offload_module and load_offloaded_checkpoint on a small model with a tied weight."""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from torch_to_nnef.exceptions import T2NErrorCheckpoint, T2NErrorMisuse, T2NErrorStorage
from torch_to_nnef.tensor.checkpoint import (
    SAFETENSORS_INDEX_NAME,
    describe_checkpoint,
    load_offloaded_checkpoint,
    offload_module,
)
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.quant import (
    QTensorTractScaleOnly,
    fp_to_tract_q4_0_with_min_max_calibration,
)

VOCAB, WIDTH = 48, 32


class Net(nn.Module):
    """Embedding, Conv1d, Linear and LayerNorm layers; the head is tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        hidden = self.conv(hidden.transpose(1, 2)).transpose(1, 2)
        hidden = torch.relu(self.proj(hidden)) * self.scale
        return self.head(self.norm(hidden))


IDS = torch.tensor([[1, 4, 9, 16, 25], [0, 2, 3, 5, 7]])


@pytest.fixture
def dense() -> Net:
    torch.manual_seed(0)
    # Without gradients, as offloaded parameters are: PyTorch may pick other kernels (with
    # other roundings) for parameters that require gradients.
    model = Net().eval().requires_grad_(False)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def output(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        result: torch.Tensor = model(IDS)
    return result


def state_without_ties(model: Net) -> dict[str, torch.Tensor]:
    """The state dict as checkpoints store it: a tied tensor under its first name only."""
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    del state["head.weight"]
    return state


def write_sharded(state: dict[str, torch.Tensor], directory: Path, shards: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: state[key] for key in keys[index::shards]}
        safetensors.torch.save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index_path = directory / SAFETENSORS_INDEX_NAME
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index_path


def write_index(directory: Path, weight_map: dict[str, str]) -> Path:
    path = directory / SAFETENSORS_INDEX_NAME
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


def meta_model() -> Net:
    """``Net`` with its weights on the meta device; its non-persistent buffer stays real."""
    with torch.device("meta"):
        model = Net()
    model.scratch = torch.zeros(2)
    return model


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


# ---------------------------------------------------------------------------------------------
# offload_module
# ---------------------------------------------------------------------------------------------
def test_offload_module_matches_the_dense_model(dense: Net, tmp_path: Path) -> None:
    expected = output(dense)
    model = offload_module(copy.deepcopy(dense), tmp_path)
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(isinstance(t, OffloadedTensor) for t in tensors)
    assert all(isinstance(p, nn.Parameter) and not p.requires_grad for p in model.parameters())
    assert model.head.weight is model.embed.weight  # still tied
    assert model.head.weight._name == "embed.weight"
    # One file per distinct tensor (the tied weight is stored once).
    distinct = {id(t) for t in tensors}
    assert len(list(tmp_path.iterdir())) == len(distinct)
    assert torch.equal(output(model), expected)


@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (nn.Module.half, torch.float16),
        (nn.Module.bfloat16, torch.bfloat16),
        (nn.Module.double, torch.float64),
        (nn.Module.float, torch.float32),
        (nn.Module.cpu, torch.float32),
        (functools.partial(nn.Module.type, dst_type=torch.float16), torch.float16),
        (nn.Module.share_memory, torch.float32),
    ],
    ids=["half", "bfloat16", "double", "float", "cpu", "type", "share_memory"],
)
def test_a_models_conversion_keeps_its_offloaded_buffers_offloaded(
    dense: Net, tmp_path: Path, convert: Any, dtype: torch.dtype
) -> None:
    """``model.half()``, ``.cpu()``, ...: torch replaces each buffer by what the conversion
    returns, a loaded copy of an offloaded one; each stays offloaded, the same tensor,
    converted in place, as a parameter (and as under ``model.to(dtype)``). Out of a
    conversion, ``t.half()`` still returns a loaded copy."""
    model = offload_module(copy.deepcopy(dense), tmp_path)
    buffers = dict(model.named_buffers())
    tensors = model.state_dict(keep_vars=True)
    versions = {name: t.payload_version for name, t in tensors.items()}
    convert(model)
    assert all(model.get_buffer(name) is buffer for name, buffer in buffers.items())
    if convert is nn.Module.share_memory:  # nothing to share: nothing loaded or written
        assert all(t.payload_version is versions[name] for name, t in tensors.items())
    assert model.scale.dtype == dtype
    assert torch.equal(model.scale.reload(), dense.scale.to(dtype))
    assert model.proj.weight.dtype == dtype and isinstance(model.proj.weight, OffloadedTensor)
    copied = model.scale.half()
    assert type(copied) is torch.Tensor and model.scale.dtype == dtype


class _KeepsAMasterCopy(nn.Module):
    """Takes a float64 copy of its buffer as a conversion begins, as on any tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.linspace(0.5, 1.5, 64))
        self.master: torch.Tensor | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self.master = self.inv.double()
        return super()._apply(fn, recurse)


def test_a_buffer_conversion_made_by_user_code_in_a_models_conversion_is_a_copy(
    tmp_path: Path,
) -> None:
    """Only the conversion's own call converts an offloaded buffer in place: a module's code
    that runs amid its parent's conversion and calls ``buf.double()`` gets a copy."""
    model = nn.Sequential(_KeepsAMasterCopy())
    offload_module(model, tmp_path)
    inner = model[0]
    model.half()
    assert isinstance(inner.inv, OffloadedTensor) and inner.inv.dtype == torch.float16
    assert inner.master is not None and type(inner.master) is torch.Tensor
    assert inner.master.dtype == torch.float64
    assert torch.equal(inner.master, torch.linspace(0.5, 1.5, 64).double())


def test_a_models_move_to_the_meta_device_says_what_it_did_before_the_refusal(
    dense: Net, tmp_path: Path
) -> None:
    """``model.to("meta")`` is refused at its first offloaded tensor; the tensors kept in
    memory that torch moved before it are lost, and the error says so."""
    model = offload_module(copy.deepcopy(dense), tmp_path, min_bytes=256)
    with pytest.raises(
        T2NErrorMisuse,
        match=r"cannot target the meta device.*Net\.to\(\) "
        r"stopped here.*those kept in memory that it reached before",
    ):
        model.to("meta")
    with pytest.raises(T2NErrorMisuse, match=r"cannot target the meta device: .*'cuda:0'$"):
        model.proj.weight.to("meta")  # out of a module's conversion: nothing more to say


def test_offload_module_options(dense: Net, tmp_path: Path) -> None:
    model = offload_module(copy.deepcopy(dense), tmp_path, include_buffers=False, min_bytes=256)
    assert isinstance(model.embed.weight, OffloadedTensor)  # 48 x 32 x 4 bytes
    assert isinstance(model.proj.weight, OffloadedTensor)  # 32 x 32 x 4 bytes
    assert not isinstance(model.proj.bias, OffloadedTensor)  # 128 bytes: kept resident
    assert not isinstance(model.scale, OffloadedTensor)  # buffers excluded
    assert type(model.proj.bias) is nn.Parameter  # resident parameters are untouched
    assert torch.equal(output(model), output(dense))
    again = offload_module(model, tmp_path)  # offloaded tensors are left as they are
    assert isinstance(again.scale, OffloadedTensor)
    with pytest.raises(T2NErrorMisuse, match="cannot be negative"):
        offload_module(model, tmp_path, min_bytes=-1)


def test_offload_module_reads_min_bytes_as_a_size(dense: Net, tmp_path: Path) -> None:
    """``min_bytes`` takes a size in words; a malformed one names the option and the forms."""
    model = offload_module(copy.deepcopy(dense), tmp_path, include_buffers=False, min_bytes="256B")
    assert isinstance(model.proj.weight, OffloadedTensor)  # 4096 bytes
    assert not isinstance(model.proj.bias, OffloadedTensor)  # 128 bytes: kept resident
    with pytest.raises(T2NErrorMisuse, match=r"min_bytes=.*'1k'.*'512MiB'"):
        offload_module(copy.deepcopy(dense), tmp_path, min_bytes="1k")


def test_offload_module_keeps_quantized_weights_quantized(dense: Net, tmp_path: Path) -> None:
    model = copy.deepcopy(dense)
    model.proj.weight = nn.Parameter(
        fp_to_tract_q4_0_with_min_max_calibration(model.proj.weight.detach()),
        requires_grad=False,
    )
    expected = output(model)
    offload_module(model, tmp_path)
    assert isinstance(model.proj.weight, OffloadedTensor)
    assert model.proj.weight.offloaded_tensor_type is QTensorTractScaleOnly
    assert torch.equal(output(model), expected)


def test_offload_module_refuses_meta_tensors(tmp_path: Path) -> None:
    with pytest.raises(T2NErrorMisuse, match="meta tensor"):
        offload_module(meta_model(), tmp_path)


def test_offloaded_model_files_go_away_with_the_model(dense: Net, tmp_path: Path) -> None:
    model = offload_module(copy.deepcopy(dense), tmp_path)
    assert any(tmp_path.iterdir())
    del model
    gc.collect()
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# load_offloaded_checkpoint
# ---------------------------------------------------------------------------------------------
def test_sharded_checkpoint_matches_the_dense_model(dense: Net, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    write_sharded(state_without_ties(dense), checkpoint)
    before = digests(checkpoint)
    model = load_offloaded_checkpoint(meta_model(), checkpoint)
    assert model.head.weight is model.embed.weight
    assert isinstance(model.embed.weight, OffloadedTensor)
    assert model.embed.weight._name == "embed.weight"
    assert not model.embed.weight.owns_payload
    assert isinstance(model.scale, OffloadedTensor)
    assert torch.equal(model.scratch, torch.zeros(2))  # non-persistent: left as it was
    assert torch.equal(output(model), output(dense))
    del model
    gc.collect()
    assert digests(checkpoint) == before


def test_single_file_checkpoint_by_file_and_by_directory(dense: Net, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(state_without_ties(dense), str(path))
    by_file = load_offloaded_checkpoint(meta_model(), path)
    by_directory = load_offloaded_checkpoint(meta_model(), tmp_path)
    assert torch.equal(output(by_file), output(dense))
    assert torch.equal(output(by_directory), output(dense))


def test_a_checkpoint_and_an_offload_directory_named_by_relative_paths_outlive_a_chdir(
    dense: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook's ``%cd`` after binding: every kind of checkpoint, named relative to the
    working directory of the binding, is read from the directory that was meant, and a copy
    on write lands in the offload directory named then."""
    state = state_without_ties(dense)
    (tmp_path / "single").mkdir()
    safetensors.torch.save_file(state, str(tmp_path / "single" / "model.safetensors"))
    write_sharded(state, tmp_path / "sharded")
    monkeypatch.chdir(tmp_path)
    models = [
        load_offloaded_checkpoint(meta_model(), Path("single") / "model.safetensors"),
        load_offloaded_checkpoint(meta_model(), "single"),
        load_offloaded_checkpoint(meta_model(), "sharded"),
    ]
    alone = OffloadedTensor.from_safetensors(
        "single/model.safetensors", "proj.weight", offload_dir="copies"
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for model in models:
        assert torch.equal(output(model), output(dense))
    assert torch.equal(alone.reload(), dense.proj.weight)
    alone.add_(1.0)  # a copy on write, in the offload directory named before the change
    assert alone.offload_path.parent == tmp_path / "copies"
    assert alone.offload_dir == tmp_path / "copies"
    assert not (tmp_path / "elsewhere" / "copies").exists()
    assert torch.equal(alone.reload(), dense.proj.weight + 1.0)


@pytest.mark.timeout(60)
def test_a_directory_holding_a_single_file_and_an_index_reads_the_single_file(
    dense: Net, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As transformers' from_pretrained: model.safetensors before model.safetensors.index.json
    (save_pretrained leaves one behind when a save changes the layout), with a warning naming
    the file not read; an index whose shards are gone is called stale. (The index was read
    first: values other than from_pretrained's, or its missing shards refused.)"""
    state = state_without_ties(dense)
    index = write_sharded({key: torch.zeros_like(value) for key, value in state.items()}, tmp_path)
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    for read in (load_offloaded_checkpoint(meta_model(), tmp_path), by_describe(tmp_path)):
        assert torch.equal(output(read), output(dense))
    assert "holds both model.safetensors and model.safetensors.index.json" in caplog.text
    assert "not the sharded checkpoint of the index (2 shard file(s), all there" in caplog.text
    assert "pass the index itself" in caplog.text
    by_index = load_offloaded_checkpoint(meta_model(), index)  # the index given itself
    assert not any(p.reload().any() for p in by_index.parameters())

    for shard in tmp_path.glob("model-*-of-*.safetensors"):
        shard.unlink()
    caplog.clear()
    assert torch.equal(output(load_offloaded_checkpoint(meta_model(), tmp_path)), output(dense))
    assert "left from an earlier sharded save (2 of its 2 shard file(s) are missing" in caplog.text


def by_describe(directory: Path) -> nn.Module:
    """The model bound to the file describe_checkpoint says the directory's checkpoint is."""
    return load_offloaded_checkpoint(meta_model(), describe_checkpoint(directory).source)


def test_a_directory_with_one_index_of_another_name(dense: Net, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    index = write_sharded(state_without_ties(dense), checkpoint)
    index.rename(checkpoint / "consolidated.safetensors.index.json")
    model = load_offloaded_checkpoint(meta_model(), checkpoint)
    assert torch.equal(output(model), output(dense))
    (checkpoint / "other.index.json").write_text("{}")  # two: which one is meant is unclear
    with pytest.raises(T2NErrorCheckpoint, match=r"holds 2 indexes \(consolidated"):
        load_offloaded_checkpoint(meta_model(), checkpoint)


def test_checkpoint_by_index_path_and_target_device(dense: Net, tmp_path: Path) -> None:
    index = write_sharded(state_without_ties(dense), tmp_path / "ckpt", shards=3)
    model = load_offloaded_checkpoint(meta_model(), index, device="cuda:0")
    assert all(p.device == torch.device("cuda:0") for p in model.parameters())
    model.to("cpu")
    assert torch.equal(output(model), output(dense))


def test_writes_copy_on_write_and_leave_the_checkpoint(dense: Net, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    write_sharded(state_without_ties(dense), checkpoint)
    before = digests(checkpoint)
    offload_dir = tmp_path / "offload"
    model = load_offloaded_checkpoint(meta_model(), checkpoint, offload_dir=offload_dir)
    model.proj.weight.mul_(2)
    with torch.no_grad():
        dense.proj.weight.mul_(2)
    assert torch.equal(output(model), output(dense))
    assert digests(checkpoint) == before
    assert [p.name for p in offload_dir.iterdir()] == [model.proj.weight.offload_path.name]


def test_mismatches_are_all_listed_and_the_model_is_unchanged(dense: Net, tmp_path: Path) -> None:
    state = state_without_ties(dense)
    del state["conv.bias"]
    state["proj.weight"] = state["proj.weight"][:, :8].contiguous()
    state["norm.bias"] = state["norm.bias"].double()
    state["extra.weight"] = torch.zeros(3)
    write_sharded(state, tmp_path / "ckpt")
    model = meta_model()
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(model, tmp_path / "ckpt")
    message = str(caught.value)
    assert "1 missing key(s): 'conv.bias'" in message
    assert "1 unexpected key(s): 'extra.weight'" in message
    assert re.search(r"'proj\.weight': checkpoint shape \(32, 8\).*model shape \(32, 32\)", message)
    assert re.search(r"'norm\.bias': .*dtype torch\.float64.*dtype torch\.float32", message)
    assert all(t.is_meta for t in model.parameters())  # nothing was bound

    # Without strict, missing and unexpected keys are fine; mismatches are not.
    with pytest.raises(T2NErrorCheckpoint, match="mismatch") as caught:
        load_offloaded_checkpoint(model, tmp_path / "ckpt", strict=False)
    assert "missing" not in str(caught.value)


def test_non_strict_binding_of_the_common_keys(dense: Net, tmp_path: Path) -> None:
    state = state_without_ties(dense)
    state["extra.weight"] = torch.zeros(3)
    write_sharded(state, tmp_path / "ckpt")
    model = load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt", strict=False)
    assert isinstance(model.conv.weight, OffloadedTensor)
    assert torch.equal(model.conv.weight.reload(), dense.conv.weight.detach())


def test_a_checkpoint_of_a_model_holding_this_one_or_held_by_it_is_bound(
    dense: Net, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys that are the model's names with one dotted segment more (a causal LM's checkpoint
    for its base model, a multimodal one for its text model) or less (the reverse) are bound,
    as transformers' from_pretrained binds them."""
    state = state_without_ties(dense)
    expected = output(dense)
    write_sharded({f"model.{k}": v for k, v in state.items()}, tmp_path / "larger")
    with caplog.at_level(logging.INFO, "torch_to_nnef.tensor.checkpoint"):
        model = load_offloaded_checkpoint(meta_model(), tmp_path / "larger", strict=True)
    assert torch.equal(output(model), expected)
    assert model.head.weight is model.embed.weight
    assert "8 key(s) bound under names with one dotted segment less, such as 'model." in caplog.text

    inner = {k: v for k, v in state.items() if k.startswith("conv.")}
    outer_keys = {f"conv.text.{k.partition('.')[2]}": v for k, v in inner.items()}
    write_sharded({**state, **outer_keys}, tmp_path / "multimodal")  # both: direct keys win
    model = load_offloaded_checkpoint(meta_model(), tmp_path / "multimodal", strict=False)
    assert torch.equal(output(model), expected)
    middle = {k: v for k, v in state.items() if not k.startswith("conv.")} | outer_keys
    write_sharded(middle, tmp_path / "middle")  # a segment inserted inside the names
    model = load_offloaded_checkpoint(meta_model(), tmp_path / "middle", strict=True)
    assert torch.equal(output(model), expected)

    write_sharded(state, tmp_path / "smaller")
    outer = nn.Module()
    outer.model = meta_model()
    load_offloaded_checkpoint(outer, tmp_path / "smaller", strict=True)
    assert torch.equal(output(outer.model), expected)

    # A renaming that accounts for few of the names without a key is not applied.
    partly = {k: v for k, v in state.items() if not k.startswith(("conv.", "proj."))}
    partly["renamed.conv.bias"] = state["conv.bias"]
    write_sharded(partly, tmp_path / "partly")
    with pytest.raises(T2NErrorCheckpoint, match=r"'conv.bias' \(absent from the checkpoint\)"):
        load_offloaded_checkpoint(meta_model(), tmp_path / "partly", strict=False)


def test_a_renaming_never_binds_a_key_taken_nor_picks_among_equal_ones(tmp_path: Path) -> None:
    """A key a tensor has under its own name is not also another's under the renaming (the
    other is missing); two renamings that fit as well are ambiguous: none is applied."""

    class Wrapped(nn.Module):  # a model holding a base model, and its own final norm
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))
            self.norm = nn.LayerNorm(WIDTH)

    dense = Wrapped()
    inner = {f"0.{k}": v for k, v in dense.model[0].state_dict().items()}
    write_sharded(
        {**inner, "norm.weight": dense.norm.weight.detach(), "norm.bias": dense.norm.bias.detach()},
        tmp_path / "base",
    )
    with torch.device("meta"):
        model = Wrapped()
    with pytest.raises(T2NErrorCheckpoint, match=r"2 missing key\(s\): 'model.1.weight'"):
        load_offloaded_checkpoint(model, tmp_path / "base", strict=True)

    twin = nn.Linear(WIDTH, WIDTH)
    state = {
        f"{prefix}.{k}": v.detach().clone()
        for prefix in ("ema", "online")
        for k, v in twin.state_dict().items()
    }
    write_sharded(state, tmp_path / "two")
    with torch.device("meta"):
        single = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(T2NErrorCheckpoint, match="meta device") as caught:
        load_offloaded_checkpoint(single, tmp_path / "two", strict=False)
    assert "several renamings (one dotted segment 'ema', 'online' more or less)" in str(
        caught.value
    )


def test_no_tensor_stays_on_the_meta_device_silently(dense: Net, tmp_path: Path) -> None:
    state = state_without_ties(dense)
    del state["conv.bias"]
    write_sharded(state, tmp_path / "ckpt")
    model = meta_model()
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(model, tmp_path / "ckpt", strict=False)
    message = str(caught.value)
    assert "1 tensor(s) would stay on the meta device" in message
    assert "'conv.bias' (absent from the checkpoint)" in message
    assert all(t.is_meta for t in model.parameters())  # nothing was bound

    # An untied head: the checkpoint holds its value under the embedding's name only.
    untied = meta_model()
    untied.head.weight = nn.Parameter(torch.empty(VOCAB, WIDTH, device="meta"))
    write_sharded(state_without_ties(dense), tmp_path / "full")
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(untied, tmp_path / "full", strict=False)
    message = str(caught.value)
    assert "'head.weight' (likely a weight tied to 'embed.weight'" in message
    assert "tie weights before binding" in message

    # A non-persistent buffer built on the meta device holds no value any checkpoint gives.
    with torch.device("meta"):
        all_meta = Net()
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(all_meta, tmp_path / "full")
    message = str(caught.value)
    assert "'scratch' (non-persistent buffer, never saved in checkpoints)" in message
    assert "accelerate.init_empty_weights()" in message


def test_a_missing_layer_weight_is_not_taken_for_a_tied_one(tmp_path: Path) -> None:
    dense = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    state = {key: value.detach().clone() for key, value in dense.state_dict().items()}
    del state["2.weight"]  # a truncated checkpoint: the last layer's weight is not there
    write_sharded(state, tmp_path / "ckpt")
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(model, tmp_path / "ckpt", strict=False)
    message = str(caught.value)
    assert "'2.weight' (absent from the checkpoint)" in message
    assert "tied" not in message


def test_swapped_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(T2NErrorMisuse, match=r"checkpoint first and the model second"):
        load_offloaded_checkpoint(tmp_path, meta_model())  # type: ignore[arg-type]
    with pytest.raises(T2NErrorMisuse, match=r"binds an nn.Module, got str"):
        load_offloaded_checkpoint("model", tmp_path)  # type: ignore[type-var]
    with pytest.raises(
        T2NErrorMisuse,
        match=r"load_offloaded_checkpoint\(\): checkpoint must be the path of a checkpoint "
        r"file, index or directory \(a str or os.PathLike\), got int",
    ):
        load_offloaded_checkpoint(meta_model(), 3)  # type: ignore[arg-type]


def refused_then_converted(given: Path) -> Net:
    """Load ``given``, refused as pickle; run the shell command the error gives (with this
    interpreter as ``python``); load what it says to bind, as a user following the advice."""
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(meta_model(), given)
    message = str(caught.value)
    assert "is a pickle checkpoint (torch.save), not safetensors" in message
    assert "t2n_load_checkpoint_and_dispatch" in message
    advice = re.search(r"Convert it once: (python -c .*) \(then bind '(.*?)'\); or load", message)
    assert advice is not None, message
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(
        ["bash", "-c", advice.group(1)], check=True, timeout=120, env={**os.environ, "PATH": path}
    )
    return load_offloaded_checkpoint(meta_model(), Path(advice.group(2)))


@pytest.mark.timeout(300)
def test_a_pickle_checkpoint_is_refused_with_a_conversion_that_works(
    dense: Net, tmp_path: Path
) -> None:
    """The conversion runs in a shell whatever the path holds, and never writes over a file:
    a model.safetensors already there (its own values) stays, the conversion going beside
    it under the pickle file's name."""
    state = state_without_ties(dense)
    odd = tmp_path / """it's "odd" $HOME"""
    single = odd / "single"
    single.mkdir(parents=True)
    torch.save(state, single / "pytorch_model.bin")
    for given in (single / "pytorch_model.bin", single):
        with pytest.raises(T2NErrorCheckpoint, match="pickle checkpoint"):
            load_offloaded_checkpoint(meta_model(), given)
    assert torch.equal(output(refused_then_converted(single)), output(dense))
    assert (single / "model.safetensors").is_file()

    other = odd / "other"
    other.mkdir()
    safetensors.torch.save_file({"x": torch.ones(2)}, str(other / "model.safetensors"))
    before = digests(other)
    torch.save(state, other / "pytorch_model.bin")
    assert torch.equal(output(refused_then_converted(other / "pytorch_model.bin")), output(dense))
    assert digests(other)["model.safetensors"] == before["model.safetensors"]

    # Sharded, shards in folders with dots: every shard converted beside it, a new index.
    sharded = odd / "sharded"
    keys = sorted(state)
    weight_map = {}
    for number, part in enumerate((keys[::2], keys[1::2])):
        name = f"v1.{number}/shard"
        (sharded / name).parent.mkdir(parents=True)
        torch.save({key: state[key] for key in part}, sharded / name)
        weight_map.update(dict.fromkeys(part, name))
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = refused_then_converted(sharded)
    assert torch.equal(output(model), output(dense))
    assert all(isinstance(p, OffloadedTensor) for p in model.parameters())


def test_a_safetensors_header_length_that_looks_like_pickle_is_read_in_place(
    dense: Net, tmp_path: Path
) -> None:
    # The first byte of the length is 0x80 (pickle's PROTO opcode), the second 0x02.
    state = state_without_ties(dense)
    header: dict[str, object] = {}
    offset = 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        header[key] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    length = 0x280
    assert len(raw) <= length
    path = tmp_path / "model.safetensors"
    with path.open("wb") as file:
        file.write(length.to_bytes(8, "little") + raw.ljust(length, b" "))
        for value in state.values():
            file.write(value.contiguous().numpy().tobytes())
    model = load_offloaded_checkpoint(meta_model(), path)
    assert not model.proj.weight.owns_payload
    assert torch.equal(output(model), output(dense))


def test_a_whole_model_dtype_mismatch_is_one_line_and_dtype_casts(
    dense: Net, tmp_path: Path
) -> None:
    state = {key: value.to(torch.bfloat16) for key, value in state_without_ties(dense).items()}
    write_sharded(state, tmp_path / "ckpt")
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt")
    message = str(caught.value)
    assert "all 8 tensors: checkpoint dtype torch.bfloat16, model dtype torch.float32" in message
    assert "'proj.weight'" not in message
    assert "pass dtype=torch.bfloat16" in message

    # In the checkpoint's dtype: read in place.
    in_place = load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt", dtype=torch.bfloat16)
    assert in_place.proj.weight.dtype == torch.bfloat16
    assert not in_place.proj.weight.owns_payload
    # Cast on load: the model's dtype, each value written once.
    offload_dir = tmp_path / "offload"
    cast = load_offloaded_checkpoint(
        meta_model(), tmp_path / "ckpt", dtype=torch.float32, offload_dir=offload_dir
    )
    assert cast.proj.weight.dtype == torch.float32 and cast.proj.weight.owns_payload
    expected = state["proj.weight"].float()
    assert torch.equal(cast.proj.weight.reload(), expected)
    assert len(list(offload_dir.iterdir())) == 8
    with pytest.raises(T2NErrorMisuse, match=r"dtype must be a torch\.dtype"):
        load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt", dtype="bf16")  # type: ignore[arg-type]


def test_missing_tied_key_names_all_its_names(dense: Net, tmp_path: Path) -> None:
    state = state_without_ties(dense)
    del state["embed.weight"]
    write_sharded(state, tmp_path / "ckpt")
    with pytest.raises(T2NErrorCheckpoint, match=r"'embed\.weight' \(tied with 'head\.weight'\)"):
        load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt")


def test_tied_weight_found_under_its_second_name(dense: Net, tmp_path: Path) -> None:
    state = state_without_ties(dense)
    state["head.weight"] = state.pop("embed.weight")
    write_sharded(state, tmp_path / "ckpt")
    model = load_offloaded_checkpoint(meta_model(), tmp_path / "ckpt")
    assert model.head.weight is model.embed.weight
    assert torch.equal(output(model), output(dense))


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "C:\\x.safetensors"],
)
def test_index_paths_must_stay_inside_the_checkpoint(shard: str, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    safetensors.torch.save_file(
        {"proj.bias": torch.zeros(WIDTH)}, str(tmp_path / "outside.safetensors")
    )
    write_index(directory, {"proj.bias": shard})
    with pytest.raises(T2NErrorCheckpoint, match="outside its directory"):
        load_offloaded_checkpoint(meta_model(), directory, strict=False)


def test_index_symlink_leading_outside_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    outside = tmp_path / "outside.safetensors"
    safetensors.torch.save_file({"proj.bias": torch.zeros(WIDTH)}, str(outside))
    (directory / "link.safetensors").symlink_to(outside)
    write_index(directory, {"proj.bias": "link.safetensors"})
    with pytest.raises(T2NErrorCheckpoint, match="outside its directory"):
        load_offloaded_checkpoint(meta_model(), directory, strict=False)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("which", ["file", "shard", "index"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking(
    dense: Net, tmp_path: Path, which: str
) -> None:
    """A FIFO nobody writes to, as the checkpoint file, as a shard its index names or as the
    index itself, is refused at once (files are opened without blocking, and must be regular
    ones) rather than waited on forever; the model stays on the meta device."""
    directory = tmp_path / "ckpt"
    index = write_sharded(state_without_ties(dense), directory)
    if which == "file":
        target = directory / "model.safetensors"
        os.mkfifo(target)
        expected: type[Exception] = T2NErrorStorage
    elif which == "shard":
        target = directory / json.loads(index.read_text())["weight_map"]["proj.weight"]
        target.unlink()
        os.mkfifo(target)
        expected = T2NErrorStorage
    else:
        target = index
        target.unlink()
        os.mkfifo(target)
        expected = T2NErrorCheckpoint
    model = meta_model()
    with pytest.raises(expected, match=rf"'{re.escape(str(target))}' is not a regular file"):
        load_offloaded_checkpoint(model, target if which != "shard" else directory)
    assert model.proj.weight.is_meta


def test_invalid_checkpoints(dense: Net, tmp_path: Path) -> None:
    with pytest.raises(T2NErrorCheckpoint, match="does not exist"):
        load_offloaded_checkpoint(meta_model(), tmp_path / "absent.safetensors")
    with pytest.raises(T2NErrorCheckpoint, match="neither"):
        load_offloaded_checkpoint(meta_model(), tmp_path)
    (tmp_path / SAFETENSORS_INDEX_NAME).write_text("{not json")
    with pytest.raises(T2NErrorCheckpoint, match="not valid JSON"):
        load_offloaded_checkpoint(meta_model(), tmp_path)
    (tmp_path / SAFETENSORS_INDEX_NAME).write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(T2NErrorCheckpoint, match="weight_map"):
        load_offloaded_checkpoint(meta_model(), tmp_path)
    safetensors.torch.save_file({"proj.bias": torch.zeros(WIDTH)}, str(tmp_path / "s.safetensors"))
    write_index(tmp_path, {"proj.bias": "s.safetensors", "proj.weight": "s.safetensors"})
    with pytest.raises(T2NErrorCheckpoint, match=r"'proj\.weight' \(in 's\.safetensors'\)"):
        load_offloaded_checkpoint(meta_model(), tmp_path)
