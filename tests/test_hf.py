"""Hugging Face models bound to their checkpoints: upstream's loading names, on small models."""

from __future__ import annotations

import itertools
import json
import logging
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import safetensors.torch  # noqa: E402
from interrupts import signalled  # noqa: E402

from torch_to_nnef.exceptions import (  # noqa: E402
    T2NErrorCheckpoint,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
)
from torch_to_nnef.tensor import (  # noqa: E402
    OffloadedTensor,
    ResidencyStrategy,
    TensorResidencyPool,
    load_offloaded_checkpoint,
)
from torch_to_nnef.tensor import hf as hf_module  # noqa: E402
from torch_to_nnef.tensor.hf import (  # noqa: E402
    ctx_maybe_load_from_disk_as_offloaded,
    load_state_dict,
    maybe_load_offload_tensor,
    safe_load_file,
    set_module_tensor_to_device,
    t2n_load_checkpoint_and_dispatch,
)
from torch_to_nnef.tensor.updater import ModTensorUpdater  # noqa: E402

PROMPT = torch.tensor([[3, 17, 42, 7, 99]])
NEW_TOKENS = 8

FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}  # Qwen2: attention biases


def small_config(family: str, tied: bool) -> object:
    return getattr(transformers, FAMILIES[family])(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=tied,
    )


CASES = [(family, tied) for family in FAMILIES for tied in (False, True)]


class Saved:
    """A dense model, its sharded safetensors checkpoint and its greedy tokens."""

    def __init__(self, family: str, tied: bool, directory: Path) -> None:
        torch.manual_seed(0)
        self.config = small_config(family, tied)
        self.dense = transformers.AutoModelForCausalLM.from_config(self.config).eval()
        self.path = directory / f"{family}-{'tied' if tied else 'untied'}"
        self.dense.save_pretrained(self.path, max_shard_size="100KB")
        self.tokens = generate(self.dense)

    def skeleton(self) -> nn.Module:
        with accelerate.init_empty_weights():
            model: nn.Module = transformers.AutoModelForCausalLM.from_config(self.config)
        return model.eval()


def generate(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        tokens: torch.Tensor = model.generate(  # type: ignore[operator]
            PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return tokens


def generate_in_pool(model: nn.Module, budget: int) -> torch.Tensor:
    with (
        TensorResidencyPool(max_cached_bytes=budget, strategy=ResidencyStrategy.SCHEDULED) as pool,
        pool.scope(),
    ):
        return generate(model)


# The tests of this module share a module fixture: with workers (pytest-xdist), they run
# on one, which builds it once.
pytestmark = pytest.mark.xdist_group("test_hf")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Saved]:
    directory = tmp_path_factory.mktemp("hf")
    return {case: Saved(*case, directory) for case in CASES}


def tensors_of(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model``, under each of its names (tied ones too)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def offloaded_share(model: nn.Module) -> tuple[int, int]:
    tensors = list(model.parameters())
    return sum(isinstance(t, OffloadedTensor) for t in tensors), len(tensors)


def test_importing_the_package_imports_neither_transformers_nor_accelerate() -> None:
    code = (
        "import sys, torch_to_nnef.tensor, torch_to_nnef.tensor.offload as o; "
        "assert not {'transformers', 'accelerate', 'torch_to_nnef.tensor.hf'} & set(sys.modules); "
        "o.t2n_load_checkpoint_and_dispatch; assert 'torch_to_nnef.tensor.hf' in sys.modules; "
        "assert 'transformers' not in sys.modules"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_upstream_names_are_reachable_from_offload() -> None:
    from torch_to_nnef.tensor import offload

    for name in hf_module.__all__:
        assert getattr(offload, name) is getattr(hf_module, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        offload.nothing_here  # noqa: B018


@pytest.mark.parametrize(("family", "tied"), CASES)
def test_sharded_checkpoint_bound_in_place_generates_the_dense_tokens(
    saved: dict[tuple[str, bool], Saved], family: str, tied: bool, tmp_path: Path
) -> None:
    case = saved[(family, tied)]
    assert len(list(case.path.glob("*.safetensors"))) > 1  # sharded
    assert len(set(case.tokens[0, PROMPT.shape[1] :].tolist())) > 1  # not a degenerate run
    model = case.skeleton()
    t2n_load_checkpoint_and_dispatch(model, case.path, "t2n_offload_disk", tmp_path / "off")
    offloaded, total = offloaded_share(model)
    assert offloaded == total
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head is embed) is tied
    assert not embed.owns_payload  # read in place
    assert not (tmp_path / "off").exists()  # nothing copied
    rotary = model.model.rotary_emb.inv_freq
    assert not isinstance(rotary, OffloadedTensor) and not rotary.is_meta
    assert torch.equal(generate_in_pool(model, budget=64 << 10), case.tokens)

    # load_offloaded_checkpoint binds the same skeleton once its weights are tied.
    again = case.skeleton()
    again.tie_weights()
    load_offloaded_checkpoint(again, case.path, strict=False)
    assert torch.equal(generate_in_pool(again, budget=64 << 10), case.tokens)


def test_an_untied_skeleton_is_refused_naming_the_tied_head(
    saved: dict[tuple[str, bool], Saved],
) -> None:
    case = saved[("qwen2", True)]
    model = case.skeleton()
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied at build
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(model, case.path, strict=False)
    message = str(caught.value)
    assert "'lm_head.weight' (likely a weight tied to 'model.embed_tokens.weight'" in message
    assert "model.tie_weights()" in message
    assert model.model.embed_tokens.weight.is_meta  # nothing was bound

    # Built on the meta device, the rotary buffers hold no value: refused, with the fix.
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(case.config)
    on_meta.tie_weights()
    with pytest.raises(T2NErrorCheckpoint) as caught:
        load_offloaded_checkpoint(on_meta, case.path, strict=False)
    assert "rotary_emb.inv_freq' (non-persistent buffer" in str(caught.value)
    assert "init_empty_weights()" in str(caught.value)


def test_device_maps(saved: dict[tuple[str, bool], Saved], tmp_path: Path) -> None:
    case = saved[("llama", True)]
    # t2n_auto: accelerate's map; with room for the model it keeps everything in memory.
    auto = case.skeleton()
    t2n_load_checkpoint_and_dispatch(auto, case.path, "t2n_auto", tmp_path)
    assert offloaded_share(auto)[0] == 0
    assert not any(t.is_meta for t in auto.parameters())
    assert torch.equal(generate(auto), case.tokens)

    # A dict: the embedding (and the head tied to it) in memory, the rest offloaded.
    mixed = case.skeleton()
    device_map = {"model.embed_tokens": "cpu", "": "disk"}
    t2n_load_checkpoint_and_dispatch(mixed, case.path, device_map, tmp_path)
    assert not isinstance(mixed.model.embed_tokens.weight, OffloadedTensor)
    assert mixed.lm_head.weight is mixed.model.embed_tokens.weight
    assert isinstance(mixed.model.layers[0].mlp.up_proj.weight, OffloadedTensor)
    assert torch.equal(generate_in_pool(mixed, budget=64 << 10), case.tokens)

    # A dict that places some tensors nowhere is refused before anything is bound.
    partial = case.skeleton()
    with pytest.raises(
        T2NErrorMisuse,
        match=r"no device for 2 tensor\(s\): 'model.embed_tokens.weight', 'model.norm.weight'",
    ):
        t2n_load_checkpoint_and_dispatch(partial, case.path, {"model.layers": "disk"}, tmp_path)
    assert all(t.is_meta for t in partial.parameters())

    # None: everything read into memory.
    dense = case.skeleton()
    t2n_load_checkpoint_and_dispatch(dense, case.path, None, tmp_path)
    assert offloaded_share(dense)[0] == 0
    assert torch.equal(generate(dense), case.tokens)

    with pytest.raises(T2NErrorMisuse, match="device_map must be 't2n_offload_disk'"):
        t2n_load_checkpoint_and_dispatch(case.skeleton(), case.path, "disk_everything", None)
    with pytest.raises(T2NErrorMisuse, match="weight_converters must be transformers' weight"):
        t2n_load_checkpoint_and_dispatch(
            case.skeleton(), case.path, "t2n_offload_disk", None, weight_converters=[object()]
        )
    with pytest.raises(T2NErrorNotImplemented, match="does not apply quantizers"):
        t2n_load_checkpoint_and_dispatch(
            case.skeleton(), case.path, "t2n_offload_disk", None, hf_quantizer=object()
        )
    with pytest.raises(T2NErrorMisuse, match="checkpoint first and the model second"):
        t2n_load_checkpoint_and_dispatch(case.path, case.skeleton(), "t2n_offload_disk", None)  # type: ignore[arg-type]


def test_a_map_placing_tied_weights_apart_is_refused_before_anything_is_bound(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """Tied weights are one tensor: a map placing their names apart by modules of their own
    is refused naming both and the fix; the same placement spelled twice is not, and a name
    only the catch-all "" places follows the one placed by its own module, whichever name
    comes first."""
    tied = saved[("qwen2", True)]
    for device_map in (
        {"model.embed_tokens": "cpu", "lm_head": "disk", "": "disk"},
        {"lm_head": "cpu", "model": "disk", "": "disk"},
        {"model": "cpu", "lm_head.weight": "disk"},
    ):
        model = tied.skeleton()
        with pytest.raises(T2NErrorMisuse) as caught:
            t2n_load_checkpoint_and_dispatch(model, tied.path, device_map, tmp_path)
        message = str(caught.value)
        assert "tied weights '" in message and "but tied weights are one tensor" in message
        assert "'model.embed_tokens.weight' on '" in message
        assert "'lm_head.weight' on '" in message
        assert "'disk'" in message and "'cpu'" in message
        assert all(t.is_meta for t in model.parameters())  # nothing was bound
        # The fix it names is the entry of the map that placed the second name, changed.
        fix = re.search(r"e\.g\. '([^']+)': '([^']+)'", message)
        assert fix is not None, message
        repaired = {**device_map, fix[1]: fix[2]}
        model = tied.skeleton()
        t2n_load_checkpoint_and_dispatch(model, tied.path, repaired, tmp_path)
        assert model.lm_head.weight is model.model.embed_tokens.weight

    for device_map, offloaded in (
        ({"model.embed_tokens": "disk", "lm_head": "disk", "": "cpu"}, True),
        ({"model.embed_tokens": "disk", "lm_head": "disk_cpu", "": "cpu"}, True),  # one place
        ({"model.embed_tokens": torch.device("cpu"), "lm_head": "cpu", "": "disk"}, False),
        ({"model.embed_tokens": "cpu", "": "disk"}, False),  # the head follows its embedding
        ({"lm_head": "cpu", "": "disk"}, False),  # the embedding follows its head
        ({"model.embed_tokens": "disk", "": "cpu"}, True),
        ({"model": "cpu", "lm_head": "cpu:0"}, False),  # one CPU, two spellings
        ({"model": torch.device("cpu", 0), "lm_head": "cpu", "": "disk"}, False),
    ):
        model = tied.skeleton()
        t2n_load_checkpoint_and_dispatch(model, tied.path, device_map, tmp_path)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert isinstance(model.lm_head.weight, OffloadedTensor) is offloaded, device_map
        assert torch.equal(generate_in_pool(model, budget=64 << 10), tied.tokens)

    # Untied, the embedding and the head go where the map says.
    untied = saved[("qwen2", False)]
    model = untied.skeleton()
    device_map = {"model.embed_tokens": "cpu", "lm_head": "disk", "": "disk"}
    t2n_load_checkpoint_and_dispatch(model, untied.path, device_map, tmp_path)
    assert not isinstance(model.model.embed_tokens.weight, OffloadedTensor)
    assert isinstance(model.lm_head.weight, OffloadedTensor)


def test_strict_refuses_what_the_model_lacks(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    case = saved[("llama", False)]
    checkpoint = tmp_path / "model.safetensors"
    state = {key: value.clone() for key, value in case.dense.state_dict().items()}
    state["extra.weight"] = torch.zeros(2)
    safetensors.torch.save_file(state, str(checkpoint))
    with pytest.raises(T2NErrorCheckpoint, match=r"1 unexpected key\(s\): 'extra.weight'"):
        t2n_load_checkpoint_and_dispatch(
            case.skeleton(), checkpoint, "t2n_offload_disk", None, strict=True
        )
    model = case.skeleton()
    t2n_load_checkpoint_and_dispatch(model, checkpoint, "t2n_offload_disk", None)
    assert torch.equal(generate_in_pool(model, budget=1 << 20), case.tokens)


def test_a_pickle_checkpoint_is_read_without_running_code(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    case = saved[("qwen2", False)]
    torch.save(case.dense.state_dict(), tmp_path / "pytorch_model.bin")
    offload_dir = tmp_path / "offload"
    model = case.skeleton()
    t2n_load_checkpoint_and_dispatch(model, tmp_path, "t2n_offload_disk", offload_dir)
    assert offloaded_share(model)[0] == offloaded_share(model)[1]
    assert model.lm_head.weight.owns_payload  # written once into offload_dir
    assert torch.equal(generate_in_pool(model, budget=1 << 20), case.tokens)

    class Payload:
        def __reduce__(self) -> tuple[object, ...]:
            return (print, ("pickled code ran",))

    torch.save({"weight": Payload()}, tmp_path / "evil.bin")
    with pytest.raises(T2NErrorCheckpoint, match=r"cannot be read with torch.load\(weights_only"):
        t2n_load_checkpoint_and_dispatch(
            case.skeleton(), tmp_path / "evil.bin", "t2n_offload_disk", None
        )


@pytest.mark.timeout(60)
def test_a_ctrl_c_anywhere_in_the_loading_context_leaves_nothing_patched(tmp_path: Path) -> None:
    """A Ctrl-C at each point of the context's code in turn, its KeyboardInterrupt kept (as
    an interactive session keeps the last one): ``from_pretrained``, ``load_file`` and
    ``torch.load`` are their own again. (As a generator, the context once left them patched
    from a Ctrl-C landing in its ``__enter__`` once the generator had patched them.)

    Not checked: the one point where Python runs a pending handler before any code of
    ``__exit__`` (its entry), which no code of ``__exit__`` can guard."""
    originals = [
        (transformers.PreTrainedModel, "from_pretrained"),
        (safetensors.torch, "load_file"),
        (torch, "load"),
    ]
    before = [owner.__dict__[name] for owner, name in originals]

    def enter_and_leave() -> None:
        with ctx_maybe_load_from_disk_as_offloaded(tmp_path):
            pass

    fired = []
    for n in itertools.count(1):
        signal_at, kept = signalled(n, hf_module.__file__, enter_and_leave)
        assert (kept is not None) == signal_at.fired
        if not signal_at.fired:
            break
        fired.append(signal_at.where)
        if not signal_at.exit_entry:
            after = [owner.__dict__[name] for owner, name in originals]
            assert after == before, f"a Ctrl-C at {signal_at.where} left a patch"
        for (owner, name), original in zip(originals, before, strict=True):  # next round
            setattr(owner, name, original)
        del kept
    assert "c_return _Patched.__enter__" in fired and "c_return _Patched._restore" in fired


def test_from_pretrained_inside_the_context_yields_offloaded_tensors(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    case = saved[("qwen2", True)]
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        model = transformers.AutoModelForCausalLM.from_pretrained(case.path)
        shard = next(case.path.glob("*.safetensors"))
        tensors = safetensors.torch.load_file(shard)
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    assert all(isinstance(t, OffloadedTensor) and not t.owns_payload for t in tensors.values())
    assert offloaded_share(model)[0] == offloaded_share(model)[1]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training
    assert torch.equal(generate_in_pool(model, budget=64 << 10), case.tokens)
    # Outside the context, loading is unchanged.
    plain = transformers.AutoModelForCausalLM.from_pretrained(case.path)
    assert offloaded_share(plain)[0] == 0
    # Where the model came from is recorded as from_pretrained records it, by its class too.
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        direct = type(plain).from_pretrained(case.path)
    assert model.name_or_path == direct.name_or_path == plain.name_or_path == str(case.path)
    assert direct.config.name_or_path == plain.config.name_or_path
    with (
        ctx_maybe_load_from_disk_as_offloaded(tmp_path),
        pytest.raises(T2NErrorNotImplemented, match="device_map"),
    ):
        transformers.AutoModelForCausalLM.from_pretrained(case.path, device_map="auto")


def test_from_pretrained_inside_the_context_keeps_the_float32_modules(tmp_path: Path) -> None:
    """As from_pretrained: under float16, T5 keeps its feed-forward output ("wo", its
    _keep_in_fp32_modules) in float32, where float16 overflows on large activations."""
    config = transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16,
        vocab_size=100, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    dense = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # activations finite in float32 only, as in real T5 checkpoints
        for block in [*dense.encoder.block, *dense.decoder.block]:
            block.layer[-1].DenseReluDense.wo.weight.mul_(1e5)
    dense.save_pretrained(tmp_path / "t5")
    plain = transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path / "t5", dtype=torch.float16
    ).eval()
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        model = transformers.T5ForConditionalGeneration.from_pretrained(
            tmp_path / "t5", dtype=torch.float16
        )
    dtypes = {name: p.dtype for name, p in plain.named_parameters()}
    assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
    assert {torch.float16, torch.float32} == set(dtypes.values())
    with torch.no_grad():
        expected = plain.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), expected)


def test_from_pretrained_inside_the_context_takes_the_class_config_and_its_options(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """As from_pretrained: the class's configuration class reads the checkpoint's (a Mistral
    checkpoint in a Llama model), config= may be a path, and configuration attributes given
    as options are set, false ones too; other options are refused unless off."""
    config = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    expected = generate(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "mistral").eval())
    for given in ({}, {"config": str(tmp_path / "mistral")}):
        with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
            model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "mistral", **given)
        assert isinstance(model.config, transformers.LlamaConfig)
        assert torch.equal(generate(model), expected)

    tied = saved[("qwen2", True)]
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tied.path, use_cache=False, trust_remote_code=False
        )
        assert model.config.use_cache is False
        model = transformers.AutoModelForCausalLM.from_pretrained(tied.path, config=tied.config)
        assert torch.equal(generate(model), tied.tokens)
        model = transformers.Qwen2ForCausalLM.from_pretrained(tied.path, use_cache=False)
        assert model.config.use_cache is False
        assert torch.equal(generate(model), tied.tokens)
        with pytest.raises(T2NErrorNotImplemented, match="revision"):
            transformers.Qwen2ForCausalLM.from_pretrained(tied.path, revision="main")
        with pytest.raises(T2NErrorMisuse, match="config= must be"):
            transformers.Qwen2ForCausalLM.from_pretrained(tied.path, config=3)
        # Untied by request, the checkpoint lacks the head: said so, without advising a tie.
        with pytest.raises(T2NErrorCheckpoint) as caught:
            transformers.Qwen2ForCausalLM.from_pretrained(tied.path, tie_word_embeddings=False)
    message = str(caught.value)
    assert "'lm_head.weight' (absent from the checkpoint, and the model ties it to no" in message
    assert "a base model's checkpoint holds no head" in message
    assert "model.tie_weights()" not in message


def test_the_context_accepts_the_loading_options_it_applies_itself(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """use_safetensors=True and weights_only=True say what the context does: accepted, as are
    weights_only=True for torch.load; use_safetensors=True refuses a pickle checkpoint, as
    from_pretrained does."""
    case = saved[("qwen2", True)]
    offload_dir = tmp_path / "offload"
    with ctx_maybe_load_from_disk_as_offloaded(offload_dir):
        for options in (
            {"use_safetensors": True, "weights_only": True},
            {"use_safetensors": None},
        ):
            model = transformers.AutoModelForCausalLM.from_pretrained(case.path, **options)
            assert offloaded_share(model)[0] == offloaded_share(model)[1]
            assert not model.model.embed_tokens.weight.owns_payload  # read in place
            assert torch.equal(generate_in_pool(model, budget=64 << 10), case.tokens)
        with pytest.raises(T2NErrorNotImplemented, match=r"got weights_only='yes'\. Leave"):
            transformers.AutoModelForCausalLM.from_pretrained(case.path, weights_only="yes")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(case.dense.state_dict(), pickled / "pytorch_model.bin")
    case.config.save_pretrained(pickled)
    with ctx_maybe_load_from_disk_as_offloaded(offload_dir):
        with pytest.raises(T2NErrorCheckpoint) as caught:
            transformers.AutoModelForCausalLM.from_pretrained(pickled, use_safetensors=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(pickled, weights_only=True)
        tensor = torch.load(pickled / "pytorch_model.bin", weights_only=True)
    message = str(caught.value)
    assert "is a pickle checkpoint ('pytorch_model.bin'), not safetensors" in message
    assert "leave use_safetensors unset" in message
    assert torch.equal(generate_in_pool(model, budget=64 << 10), case.tokens)
    assert all(isinstance(value, OffloadedTensor) for value in tensor.values())


def test_torch_load_inside_the_context_offloads_what_it_reads(tmp_path: Path) -> None:
    """As upstream's: a tensor, or a dict's tensors, come back offloaded (read with
    weights_only=True); files of the offload directory and weights_only=False calls are
    torch.load's own."""
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    values = {"a": torch.arange(6.0).reshape(2, 3), "step": 3}
    torch.save(values, tmp_path / "dict.pt")
    torch.save(torch.ones(4), tmp_path / "tensor.pt")
    torch.save(torch.zeros(2), offload_dir / "inside.pt")
    original = torch.load
    with ctx_maybe_load_from_disk_as_offloaded(offload_dir):
        loaded = torch.load(tmp_path / "dict.pt")
        tensor = torch.load(tmp_path / "tensor.pt", map_location="cpu")
        inside = torch.load(offload_dir / "inside.pt")
        unsafe = torch.load(tmp_path / "tensor.pt", weights_only=False)
        with_pickle = torch.load(tmp_path / "tensor.pt", "cpu", pickle)  # torch's own
        shapes = torch.load(tmp_path / "dict.pt", map_location="meta")
    assert torch.load is original
    assert type(with_pickle) is torch.Tensor
    assert shapes["a"].device.type == "meta" and shapes["a"].shape == (2, 3)
    assert isinstance(loaded["a"], OffloadedTensor) and loaded["step"] == 3
    assert torch.equal(loaded["a"].reload(), values["a"])
    assert loaded["a"].offload_path.parent == offload_dir
    assert isinstance(tensor, OffloadedTensor) and torch.equal(tensor.reload(), torch.ones(4))
    assert type(inside) is torch.Tensor and type(unsafe) is torch.Tensor
    # Nothing in the file runs: a pickle of an object is refused as torch refuses it.
    torch.save({"a": torch.ones(1), "object": Path("x")}, tmp_path / "object.pt")
    with (
        ctx_maybe_load_from_disk_as_offloaded(offload_dir),
        pytest.raises(pickle.UnpicklingError, match=r"Weights only load failed"),
    ):
        torch.load(tmp_path / "object.pt")


def test_dispatch_casts_entries_to_the_model_dtype_as_upstream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An fp16 checkpoint into an fp32 model (and the reverse) is cast on load, as upstream's
    and nn.Module.load_state_dict do, with a warning naming the cost and the way around it."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    for model_dtype, stored in ((torch.float32, torch.float16), (torch.float16, torch.float32)):
        directory = tmp_path / f"{stored}".replace("torch.", "")
        directory.mkdir()
        state = {key: value.to(stored) for key, value in reference.state_dict().items()}
        safetensors.torch.save_file(state, directory / "model.safetensors")
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(model_dtype)
        caplog.clear()
        t2n_load_checkpoint_and_dispatch(
            model, directory / "model.safetensors", "t2n_offload_disk", directory / "offload"
        )
        assert {p.dtype for p in model.parameters()} == {model_dtype}
        assert all(isinstance(p, OffloadedTensor) for p in model.parameters())
        for key, value in state.items():
            assert torch.equal(model.state_dict()[key].reload(), value.to(model_dtype))
        assert f"4 tensor(s) stored in {stored} are cast to {model_dtype}" in caplog.text
        assert f"pass dtype={stored}" in caplog.text
    # An integer entry is bound in its own dtype only: the error says what can fix it.
    counted = nn.Linear(4, 3)
    counted.register_buffer("steps", torch.zeros(1, dtype=torch.int64))
    state = {**counted.state_dict(), "steps": torch.tensor([3], dtype=torch.int32)}
    safetensors.torch.save_file(state, tmp_path / "counted.safetensors")
    with pytest.raises(T2NErrorCheckpoint, match="integer and boolean entries") as refused:
        t2n_load_checkpoint_and_dispatch(
            counted, tmp_path / "counted.safetensors", "t2n_offload_disk", tmp_path / "off"
        )
    assert "pass dtype=" not in str(refused.value)


def test_a_base_model_and_its_causal_lm_bind_each_others_checkpoints(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """As from_pretrained does: a base model from a causal LM's checkpoint (keys under
    ``model.``), a causal LM from its base model's checkpoint, both in the context too."""
    case = saved[("qwen2", True)]
    with torch.no_grad():
        hidden = case.dense.model(PROMPT).last_hidden_state
    with accelerate.init_empty_weights():
        base = transformers.AutoModel.from_config(case.config).eval()
    t2n_load_checkpoint_and_dispatch(base, case.path, "t2n_offload_disk", tmp_path)
    with torch.no_grad():
        assert torch.equal(base(PROMPT).last_hidden_state, hidden)
    base_path = tmp_path / "base"
    case.dense.model.save_pretrained(base_path)  # keys without the "model." prefix
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        causal = transformers.AutoModelForCausalLM.from_pretrained(base_path).eval()
        from_causal = transformers.AutoModel.from_pretrained(case.path).eval()
    assert offloaded_share(causal)[0] == offloaded_share(causal)[1]
    assert torch.equal(generate(causal), case.tokens)  # the head is tied to the embedding
    with torch.no_grad():
        assert torch.equal(from_causal(PROMPT).last_hidden_state, hidden)


def test_building_blocks(saved: dict[tuple[str, bool], Saved], tmp_path: Path) -> None:
    case = saved[("llama", False)]
    shard = sorted(case.path.glob("*.safetensors"))[0]
    in_memory = safe_load_file(shard)
    offloaded = safe_load_file(shard, device="disk_cpu", apply_offload=True)
    assert in_memory.keys() == offloaded.keys()
    for key, value in in_memory.items():
        assert type(value) is torch.Tensor
        assert torch.equal(offloaded[key].reload(), value)
    by_map = load_state_dict(
        shard, device_map={"model.layers.0": "disk", "": "cpu"}, apply_offload=True
    )
    for key, value in by_map.items():
        assert isinstance(value, OffloadedTensor) == key.startswith("model.layers.0.")

    plain = torch.ones(3)
    assert maybe_load_offload_tensor(plain, "cpu", "x", tmp_path) is plain
    moved = maybe_load_offload_tensor(plain, "disk_cpu", "x", tmp_path)
    assert isinstance(moved, OffloadedTensor) and torch.equal(moved.reload(), plain)

    model = case.skeleton()
    updater = ModTensorUpdater(model, add_buffers=True)
    value = case.dense.model.norm.weight.detach().double()
    held = set_module_tensor_to_device(updater, "model.norm.weight", "disk", value, None, tmp_path)
    assert isinstance(held, OffloadedTensor) and held.dtype == torch.float32
    assert model.model.norm.weight is held
    with pytest.raises(T2NErrorMisuse, match="of shape"):
        set_module_tensor_to_device(updater, "model.norm.weight", "cpu", torch.ones(2))


@pytest.mark.parametrize("tied", [False, True])
def test_saving_a_bound_model_asks_for_its_values_then_round_trips(
    saved: dict[tuple[str, bool], Saved], tied: bool, tmp_path: Path
) -> None:
    """An offloaded tensor has no memory of its own: a serializer asking for its address (to
    find shared storages, then to read its bytes) gets an error naming the fix, instead of
    the address of a copy freed at once (storages taken for shared, or freed bytes written).
    Given the values, save_pretrained writes a model that generates the same tokens."""
    case = saved[("qwen2", tied)]
    model = case.skeleton()
    t2n_load_checkpoint_and_dispatch(model, case.path, "t2n_offload_disk", tmp_path / "off")
    with pytest.raises(T2NErrorNotImplemented, match="no memory of its own"):
        model.save_pretrained(tmp_path / "direct")
    with pytest.raises(T2NErrorNotImplemented, match="no memory of its own"):
        safetensors.torch.save_file(
            {k: v for k, v in model.state_dict().items()}, str(tmp_path / "file.safetensors")
        )
    values = {
        name: value.reload() if isinstance(value, OffloadedTensor) else value
        for name, value in model.state_dict().items()
    }
    model.save_pretrained(tmp_path / "saved", state_dict=values)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(generate(again), case.tokens)


def test_devices_and_dtypes_that_cannot_be_used_are_refused_before_anything_is_bound(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """A device map naming no device, CUDA on a machine without it, or the meta device (where
    tensors would stay without values) is refused whole: the model keeps its skeleton. The
    building blocks refuse the same devices, and dtypes that are none."""
    case = saved[("llama", False)]
    refused = {"gpu0": "is not a device", "disk_gpu0": "is not a device", "meta": "meta device"}
    if not torch.cuda.is_available():
        refused["cuda:0"] = "CUDA is not available"
    for device, message in refused.items():
        model = case.skeleton()
        device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "lm_head": device}
        with pytest.raises(T2NErrorMisuse, match=message):
            t2n_load_checkpoint_and_dispatch(model, case.path, {**device_map, "": "disk"}, None)
        assert all(t.is_meta for t in model.parameters()), device

    shard = sorted(case.path.glob("*.safetensors"))[0]
    with pytest.raises(T2NErrorMisuse, match="'gpu0' is not a device"):
        safe_load_file(shard, device="gpu0")
    with pytest.raises(T2NErrorMisuse, match="'gpu0' is not a device"):
        load_state_dict(shard, device_map={"": "gpu0"})
    updater = ModTensorUpdater(case.skeleton(), add_buffers=True)
    name = "model.norm.weight"
    with pytest.raises(T2NErrorMisuse, match="'gpu0' is not a device"):
        set_module_tensor_to_device(updater, name, "gpu0", torch.zeros(64))
    with pytest.raises(T2NErrorMisuse, match="'floaty' is not a torch dtype"):
        set_module_tensor_to_device(updater, name, "cpu", torch.zeros(64), dtype="floaty")
    with pytest.raises(T2NErrorMisuse, match="on the meta device"):
        set_module_tensor_to_device(updater, name, "cpu", torch.zeros(64, device="meta"))


def test_devices_of_backends_this_torch_lacks_are_refused_before_anything_is_bound(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """A backend torch was built without (mps, xpu here) is refused as CUDA without CUDA is:
    before anything is bound, offloaded ("disk_mps": its values are only moved on load) or
    not, instead of torch's own error halfway through the binding or at the first forward."""
    case = saved[("llama", False)]
    unusable = [
        kind
        for kind in ("mps", "xpu")
        if not (
            (kind == "mps" and torch.backends.mps.is_available())
            or (kind == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available())
        )
    ]
    if not unusable:
        pytest.skip("every backend tried is usable here")
    for kind in unusable:
        for device in (kind, f"disk_{kind}"):
            model = case.skeleton()
            device_map = {"model.layers.1": device, "": "cpu"}
            with pytest.raises(T2NErrorMisuse, match=f"cannot place tensors on {kind}"):
                t2n_load_checkpoint_and_dispatch(model, case.path, device_map, tmp_path)
            assert all(t.is_meta for t in model.parameters()), device
            shard = sorted(case.path.glob("*.safetensors"))[0]
            with pytest.raises(T2NErrorMisuse, match=f"cannot place tensors on {kind}"):
                safe_load_file(shard, device=device, apply_offload=True)
        with pytest.raises(T2NErrorMisuse, match=f"cannot place tensors on {kind}"):
            maybe_load_offload_tensor(torch.ones(2), f"disk_{kind}", "x", tmp_path)


def test_a_cast_that_cannot_be_written_leaves_the_model_unchanged(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """Entries cast on load are written to offload_dir; when it cannot take them (a file),
    the model keeps its skeleton, tensors placed in memory before the failure included."""
    case = saved[("llama", False)]
    path = tmp_path / "bf16"
    case.dense.to(torch.bfloat16).save_pretrained(path)
    case.dense.float()
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    model = case.skeleton().float()
    device_map = {"model.embed_tokens": "cpu", "": "disk"}
    with pytest.raises(OSError, match="not a directory"):
        t2n_load_checkpoint_and_dispatch(model, path, device_map, not_a_directory)
    assert all(t.is_meta for t in model.parameters())
    model.tie_weights()
    with pytest.raises(OSError, match="not a directory"):
        load_offloaded_checkpoint(model, path, dtype=torch.float32, offload_dir=not_a_directory)
    assert all(t.is_meta for t in model.parameters())


def test_a_skeleton_with_weights_frees_each_before_the_next_is_read(
    saved: dict[tuple[str, bool], Saved],
) -> None:
    """A model built with its weights (not on the meta device) bound in memory: each tensor
    replaced is freed before the next value is read, so that loading takes one model's memory
    (plus a tensor), not two. Observed at each read of a value into memory."""
    import gc
    import weakref

    from torch_to_nnef.tensor.checkpoint import BindingPlan

    case = saved[("llama", False)]
    model = transformers.AutoModelForCausalLM.from_config(case.config).eval()
    old = [weakref.ref(t) for t in model.parameters()]
    alive_at_reads: list[int] = []

    def observe(frame: object, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is BindingPlan.resident.__code__:  # type: ignore[attr-defined]
            alive_at_reads.append(sum(ref() is not None for ref in old))

    gc.disable()  # (the count needs no cycle collection: nothing refers to a replaced tensor)
    sys.setprofile(observe)
    try:
        t2n_load_checkpoint_and_dispatch(model, case.path, {"": "cpu"}, None, strict=True)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert len(alive_at_reads) == len(old)
    # At the k-th read, the k tensors replaced before it are gone.
    assert alive_at_reads == [len(old) - k for k in range(len(old))]
    assert torch.equal(generate(model), case.tokens)


def read_then_cut_short(directory: Path, reads: int) -> Callable[[Any, str, Any], None]:
    """A profile function that, as the ``reads``-th value is about to be read into memory,
    cuts every shard of ``directory`` short (as another process rewriting the checkpoint
    would): that read and those after it fail."""
    from torch_to_nnef.tensor.checkpoint import BindingPlan

    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is BindingPlan.resident.__code__:
            count[0] += 1
            if count[0] == reads:
                for shard in directory.glob("*.safetensors"):
                    os.truncate(shard, 8)

    return profile


def test_a_read_failing_midway_leaves_the_skeleton_as_it_was(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """Tensors read into memory as they are bound, the checkpoint cut short after the fourth:
    the fifth read fails, and the four tensors bound before it are put back (the very
    skeleton tensors; the head untied again, as it was built); no note is added (nothing
    was freed)."""
    case = saved[("llama", True)]
    path = tmp_path / "checkpoint"
    shutil.copytree(case.path, path)
    model = case.skeleton()
    before = tensors_of(model)
    sys.setprofile(read_then_cut_short(path, reads=5))
    try:
        with pytest.raises(T2NErrorStorage) as failed:
            t2n_load_checkpoint_and_dispatch(model, path, {"": "cpu"}, tmp_path / "offload")
    finally:
        sys.setprofile(None)
    assert all(t is old for (_, t), (_, old) in zip(tensors_of(model), before, strict=True))
    assert not getattr(failed.value, "__notes__", None)
    assert list((tmp_path / "offload").glob("*")) == []


def test_a_read_failing_midway_tells_the_tensors_freed_from_a_skeleton_with_weights(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """A model built with its weights, read into memory: each of its tensors is freed as
    its value replaces it (one model's memory), so a failure cannot put those back. They
    keep the checkpoint's values, the others are put back, and a note on the exception
    says so."""
    case = saved[("llama", False)]
    path = tmp_path / "checkpoint"
    shutil.copytree(case.path, path)
    model = transformers.AutoModelForCausalLM.from_config(case.config).eval()
    before = tensors_of(model)
    sys.setprofile(read_then_cut_short(path, reads=5))
    try:
        with pytest.raises(T2NErrorStorage) as failed:
            t2n_load_checkpoint_and_dispatch(model, path, {"": "cpu"}, None)
    finally:
        sys.setprofile(None)
    kept = [t is old for (_, t), (_, old) in zip(tensors_of(model), before, strict=True)]
    assert kept == [False] * 4 + [True] * (len(before) - 4)
    dense = dict(case.dense.named_parameters())
    for name, t in tensors_of(model)[:4]:
        assert torch.equal(t, dense[name]), name
    assert failed.value.__notes__ == [
        "4 tensor(s) of the model, which held their values in memory, were freed as the "
        "checkpoint's values read into memory replaced them, so that loading takes one "
        "model's memory: they keep the checkpoint's values; the model's other tensors were "
        "put back. Load again to bind them all"
    ]


def test_the_auto_map_is_computed_on_the_tied_model(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """accelerate's infer_auto_device_map warns, and sizes the tied head apart from its
    embedding, when the model is not tied yet: the skeleton is tied before it is called."""
    case = saved[("qwen2", True)]
    model = case.skeleton()
    with caplog.at_level("WARNING"):
        t2n_load_checkpoint_and_dispatch(model, case.path, "t2n_auto", tmp_path)
    assert not [r for r in caplog.records if "not tied" in r.getMessage()]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(generate(model), case.tokens)


def test_the_file_readers_refuse_what_is_no_path() -> None:
    for given in (None, 3, 1.5):
        received = type(given).__name__
        with pytest.raises(
            T2NErrorMisuse,
            match=rf"safe_load_file\(\): filename must be the checkpoint file's path \(a str "
            rf"or os.PathLike\), got {received}",
        ):
            safe_load_file(given)  # type: ignore[arg-type]
        with pytest.raises(
            T2NErrorMisuse,
            match=rf"load_state_dict\(\): checkpoint_file must be the checkpoint file's path "
            rf"\(a str or os.PathLike\), got {received}",
        ):
            load_state_dict(given)  # type: ignore[arg-type]


def test_load_state_dict_refuses_a_device_map_that_is_no_dict(
    saved: dict[tuple[str, bool], Saved],
) -> None:
    shard = sorted(saved[("llama", False)].path.glob("*.safetensors"))[0]
    for device_map in ("disk", "t2n_offload_disk", ["disk"]):
        with pytest.raises(T2NErrorMisuse, match="device_map must be a dict"):
            load_state_dict(shard, device_map=device_map, apply_offload=True)  # type: ignore[arg-type]


def test_from_pretrained_inside_the_context_takes_the_path_by_keyword(
    saved: dict[tuple[str, bool], Saved], tmp_path: Path
) -> None:
    """transformers' own parameter name, as some callers pass it."""
    case = saved[("qwen2", True)]
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path):
        model = transformers.Qwen2ForCausalLM.from_pretrained(
            pretrained_model_name_or_path=case.path
        )
    assert isinstance(model.lm_head.weight, OffloadedTensor)
    assert torch.equal(generate(model), case.tokens)


@pytest.mark.parametrize(("family", "tied"), [("llama", False), ("qwen2", True)])
@pytest.mark.timeout(120)
def test_decoding_reads_the_embedding_rows_and_the_head_whole(
    family: str, tied: bool, tmp_path: Path
) -> None:
    """With a table large enough to be mapped (2048 x 64 float32), streamed generation reads
    the rows each token looks up: an untied embedding is never loaded by the pool; a tied
    one is read whole for ``lm_head``, ahead of it. Tokens are the dense model's."""
    from torch_to_nnef.tensor import stream_modules

    torch.manual_seed(0)
    config = small_config(family, tied)
    config.vocab_size = 2048  # type: ignore[attr-defined]
    dense = transformers.AutoModelForCausalLM.from_config(config).eval()
    dense.save_pretrained(tmp_path / "model")
    expected = generate(dense)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    t2n_load_checkpoint_and_dispatch(model, tmp_path / "model", "t2n_offload_disk", tmp_path)
    inner = model.model
    table = inner.embed_tokens.weight
    modules = [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]
    offloaded = {id(t): t for t in model.parameters()}.values()  # the tied table once
    with (
        TensorResidencyPool(max_cached_bytes=1 << 30) as pool,  # all of it, once loaded
        stream_modules(pool, modules, depth=2) as stream,
        pool.scope(),
    ):
        assert stream.groups[0] == []
        assert any(t is table for t in stream.groups[-1]) is tied
        assert torch.equal(generate(model), expected)
        assert pool.is_resident(table) is tied
        assert all(pool.is_resident(t) for t in offloaded if t is not table)
        assert pool.stats().loads == len(offloaded) - (not tied)  # each once, retained


# ---------------------------------------------------------------------------------------------
# Checkpoints whose keys transformers converts on load (transformers 5's conversion mappings)
# ---------------------------------------------------------------------------------------------
def converted_config(kind: str) -> object:
    """A tiny configuration of an architecture whose checkpoints transformers 5 converts."""
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    language = {**small, "vocab_size": 128, "max_position_embeddings": 64}
    experts = {**language, "intermediate_size": 48, "num_key_value_heads": 2}
    experts["num_experts_per_tok"] = 2
    configs = {
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**language, intermediate_size=64),
        "vit": lambda: transformers.ViTConfig(
            **small, intermediate_size=48, image_size=16, patch_size=8, num_labels=3
        ),
        "mixtral": lambda: transformers.MixtralConfig(**experts, num_local_experts=3),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **experts, num_experts=3, moe_intermediate_size=16, shared_expert_intermediate_size=24
        ),
    }
    return configs[kind]()


def converted_auto_class(kind: str) -> type:
    if kind == "vit":
        return transformers.AutoModelForImageClassification  # type: ignore[no-any-return]
    return transformers.AutoModelForCausalLM  # type: ignore[no-any-return]


def converted_input(kind: str) -> dict[str, torch.Tensor]:
    if kind == "vit":
        return {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        }
    return {"input_ids": PROMPT}


def save_converted(kind: str, directory: Path, **options: object) -> None:
    """A model of ``kind`` with random weights, saved as transformers saves it: by default in
    the checkpoint layout of its architecture (``save_original_format=True``)."""
    torch.manual_seed(0)
    dense = converted_auto_class(kind).from_config(converted_config(kind))
    dense.save_pretrained(directory, **options)


def assert_as_from_pretrained(kind: str, model: nn.Module, directory: Path) -> None:
    """Every tensor of ``model``, and its output, are those of ``from_pretrained``'s model."""
    plain = converted_auto_class(kind).from_pretrained(directory).eval()
    expected = plain.state_dict()
    values = model.state_dict()
    assert values.keys() == expected.keys()
    for name, value in values.items():
        value = value.reload() if isinstance(value, OffloadedTensor) else value
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name]), name
    with torch.no_grad():
        inputs = converted_input(kind)
        assert torch.equal(model.eval()(**inputs).logits, plain(**inputs).logits)


@pytest.mark.parametrize("kind", ["gpt_neox", "vit"])
@pytest.mark.timeout(60)
def test_checkpoint_keys_transformers_renames_are_bound_in_place(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers 5 renames checkpoint keys on load (GPT-NeoX's ``embed_out`` is its
    ``lm_head``, ViT's ``encoder.layer.N.attention.attention.query`` its
    ``layers.N.attention.q_proj``); bound offloaded, in place, they give from_pretrained's
    values. (They were refused as "absent from the checkpoint".)"""
    caplog.set_level(logging.INFO, logger=hf_module.__name__)
    save_converted(kind, tmp_path / "model")
    stored = safetensors.torch.load_file(tmp_path / "model" / "model.safetensors")
    renamed = {"gpt_neox": "embed_out.weight", "vit": "vit.encoder.layer.0.output.dense.weight"}
    assert renamed[kind] in stored  # the layout that transformers renames
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        loaded = converted_auto_class(kind).from_pretrained(tmp_path / "model")
    assert all(isinstance(p, OffloadedTensor) and not p.owns_payload for p in loaded.parameters())
    assert_as_from_pretrained(kind, loaded, tmp_path / "model")
    assert "renamed as transformers renames them" in caplog.text

    config = converted_config(kind)
    with accelerate.init_empty_weights():
        skeleton = converted_auto_class(kind).from_config(config)
    t2n_load_checkpoint_and_dispatch(skeleton, tmp_path / "model", "t2n_offload_disk", None)
    assert_as_from_pretrained(kind, skeleton, tmp_path / "model")
    # The transforms used are recorded as from_pretrained records them (save_pretrained
    # reverts them).
    assert skeleton._weight_conversions and all(t.was_used() for t in skeleton._weight_conversions)

    # weight_converters: transformers' transforms to apply, none for [].
    from transformers.conversion_mapping import get_model_conversion_mapping

    with accelerate.init_empty_weights():
        given = converted_auto_class(kind).from_config(config)
    mapping = get_model_conversion_mapping(given)
    t2n_load_checkpoint_and_dispatch(
        given, tmp_path / "model", None, None, weight_converters=mapping
    )
    assert not any(t.was_used() for t in mapping)  # a copy was used: the caller's are intact
    assert_as_from_pretrained(kind, given, tmp_path / "model")
    with accelerate.init_empty_weights():
        unconverted = converted_auto_class(kind).from_config(config)
    with pytest.raises(T2NErrorCheckpoint, match="absent from the checkpoint"):
        t2n_load_checkpoint_and_dispatch(
            unconverted, tmp_path / "model", "t2n_offload_disk", None, weight_converters=[]
        )


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.timeout(60)
def test_experts_transformers_stacks_on_load_are_refused_before_anything_is_bound(
    kind: str, tmp_path: Path
) -> None:
    """Mixtral's and Qwen2-MoE's checkpoints hold one tensor per expert, which transformers
    5 stacks into one parameter on load: an offloaded tensor reads one entry as it is stored,
    so the load is refused before anything is bound, naming the architecture, the tensors,
    the keys and the fix; saved in the model's own layout as the message says, the
    checkpoint is bound in place and gives from_pretrained's values."""
    save_converted(kind, tmp_path / "original")
    experts = {"mixtral": "block_sparse_moe.experts.0.w1", "qwen2_moe": "mlp.experts.0.gate_proj"}
    stored = safetensors.torch.load_file(tmp_path / "original" / "model.safetensors")
    assert f"model.layers.0.{experts[kind]}.weight" in stored
    with accelerate.init_empty_weights():
        skeleton = converted_auto_class(kind).from_config(converted_config(kind))
    expected = (
        rf"stores 4 tensor\(s\) of \w+ForCausalLM \(model type '{kind}'\) in another layout.*"
        rf"MergeModulelist\(dim=0\), Concatenate\(dim=1\).*"
        rf"'model.layers.0.mlp.experts.gate_up_proj' from 6 key\(s\): "
        rf"'model.layers.0.{experts[kind]}.weight'.*nothing was bound.*"
        r"save_original_format=False"
    )
    for strict in (False, True):
        with pytest.raises(T2NErrorNotImplemented, match=expected):
            t2n_load_checkpoint_and_dispatch(
                skeleton, tmp_path / "original", "t2n_offload_disk", None, strict=strict
            )
    assert all(p.is_meta for p in skeleton.parameters())
    with (
        ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"),
        pytest.raises(T2NErrorNotImplemented, match=expected),
    ):
        converted_auto_class(kind).from_pretrained(tmp_path / "original")

    # The fix: transformers saves the model's own layout, each stacked tensor one entry.
    dense = converted_auto_class(kind).from_pretrained(tmp_path / "original")
    dense.save_pretrained(tmp_path / "merged", save_original_format=False)
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        merged = converted_auto_class(kind).from_pretrained(tmp_path / "merged")
    experts_tensor = merged.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(experts_tensor, OffloadedTensor) and not experts_tensor.owns_payload
    assert_as_from_pretrained(kind, merged, tmp_path / "merged")
    assert_as_from_pretrained(kind, merged, tmp_path / "original")


# ---------------------------------------------------------------------------------------------
# Which checkpoint of a directory is read: the one from_pretrained reads
# ---------------------------------------------------------------------------------------------
def save_llama(directory: Path, seed: int, **options: object) -> nn.Module:
    torch.manual_seed(seed)
    dense = transformers.AutoModelForCausalLM.from_config(small_config("llama", False)).eval()
    dense.save_pretrained(directory, **options)
    return dense


def assert_values_of(model: nn.Module, dense: nn.Module) -> None:
    expected = dense.state_dict()
    for name, value in model.state_dict().items():
        value = value.reload() if isinstance(value, OffloadedTensor) else value
        assert torch.equal(value, expected[name]), name


@pytest.mark.timeout(60)
def test_an_index_left_by_an_unsharded_save_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_pretrained, unsharded over a sharded save, deletes the shards and leaves their
    index: the directory's checkpoint is model.safetensors, as from_pretrained reads it (the
    stale index was read first, and its missing shards refused)."""
    directory = tmp_path / "model"
    save_llama(directory, seed=0, max_shard_size="100KB")
    current = save_llama(directory, seed=1)
    assert (directory / "model.safetensors.index.json").is_file()
    assert not list(directory.glob("model-*-of-*.safetensors"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert_values_of(plain, current)

    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert_values_of(loaded, current)
    assert loaded.lm_head.weight.offload_path.name == "model.safetensors"
    warned = [r.getMessage() for r in caplog.records if "holds both" in r.getMessage()]
    assert len(warned) == 1, warned  # once, however often the directory's checkpoint is read
    assert "left from an earlier sharded save" in warned[0]
    assert "are missing, such as 'model-00001-of-" in warned[0]

    with accelerate.init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(small_config("llama", False))
    t2n_load_checkpoint_and_dispatch(skeleton, directory, "t2n_offload_disk", None)
    assert_values_of(skeleton, current)


@pytest.mark.timeout(60)
def test_a_single_file_left_by_a_sharded_save_is_read_as_from_pretrained_reads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_pretrained, sharded over an unsharded save, leaves the earlier model.safetensors,
    which from_pretrained reads: so does the directory's binding (it read the index, giving
    other values than from_pretrained's), with a warning naming the way out; the index given
    itself, or named by the configuration (transformers_weights), is read."""
    directory = tmp_path / "model"
    earlier = save_llama(directory, seed=0)
    current = save_llama(directory, seed=1, max_shard_size="100KB")
    assert (directory / "model.safetensors").is_file()
    assert (directory / "model.safetensors.index.json").is_file()
    assert_values_of(transformers.AutoModelForCausalLM.from_pretrained(directory), earlier)

    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert_values_of(loaded, earlier)
    warned = [r.getMessage() for r in caplog.records if "holds both" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "written after model.safetensors" in warned[0]
    assert "delete model.safetensors" in warned[0] and "pass the index itself" in warned[0]

    with accelerate.init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(small_config("llama", False))
    index = directory / "model.safetensors.index.json"
    t2n_load_checkpoint_and_dispatch(skeleton, index, "t2n_offload_disk", None)
    assert_values_of(skeleton, current)

    config = json.loads((directory / "config.json").read_text())
    config["transformers_weights"] = "model.safetensors.index.json"
    (directory / "config.json").write_text(json.dumps(config))
    assert_values_of(transformers.AutoModelForCausalLM.from_pretrained(directory), current)
    with ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"):
        named = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert_values_of(named, current)
    config["transformers_weights"] = "../elsewhere.safetensors"
    (directory / "config.json").write_text(json.dumps(config))
    with (
        ctx_maybe_load_from_disk_as_offloaded(tmp_path / "offload"),
        pytest.raises(T2NErrorCheckpoint, match="transformers_weights"),
    ):
        transformers.AutoModelForCausalLM.from_pretrained(directory)
