"""ModTensorUpdater: replacing tensors of a model without breaking tied references."""

from __future__ import annotations

import time

import pytest
import torch
from contract import LazyTensor
from torch import nn

from torch_to_nnef.exceptions import T2NErrorInconsistentTensor, T2NErrorMisuse
from torch_to_nnef.tensor.named import NamedTensor
from torch_to_nnef.tensor.updater import ModTensorUpdater


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)
        self.register_buffer("mask", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x))) * self.mask


class TinyTransformer(nn.Module):
    """Token embedding tied to the LM head, as in most decoder-only transformers."""

    def __init__(self, vocab: int = 32, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


IDS = torch.tensor([[3, 1, 4, 1, 5]])


def _dense(*shape: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _forward(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        output: torch.Tensor = model(IDS)
    return output


# -- tied weights -------------------------------------------------------------------------------
def test_index_lists_tied_weights_under_every_name() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    names = updater.available_names
    assert names[0] == "embed_tokens.weight"
    assert "lm_head.weight" in names
    assert len(names) == len(set(names)) == len(list(model.named_parameters())) + 1
    assert updater.names_of(model.lm_head.weight) == ("embed_tokens.weight", "lm_head.weight")
    assert updater.get_by_name("lm_head.weight") is model.embed_tokens.weight
    assert "mask" not in " ".join(names)  # buffers only with add_buffers


@pytest.mark.parametrize("name", ["embed_tokens.weight", "lm_head.weight"])
def test_update_by_name_keeps_the_embedding_and_lm_head_tied(name: str) -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    new_value = _dense(32, 8, seed=99)
    installed = updater.update_by_name(name, new_value)
    assert model.embed_tokens.weight is installed
    assert model.lm_head.weight is installed
    assert isinstance(installed, nn.Parameter)
    assert installed.data_ptr() == new_value.data_ptr()
    assert len(list(model.parameters())) == len(list(model.named_parameters()))

    expected = TinyTransformer()
    expected.load_state_dict(model.state_dict())
    torch.testing.assert_close(_forward(model), _forward(expected))
    torch.testing.assert_close(model.lm_head(torch.eye(8)), new_value.T)


def test_update_by_ref_keeps_the_tie_and_follows_later_updates() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    first = updater.update_by_ref(model.lm_head.weight, _dense(32, 8, seed=1))
    assert model.embed_tokens.weight is first is model.lm_head.weight
    second = updater.update_by_ref(first, _dense(32, 8, seed=2))
    assert model.embed_tokens.weight is second is model.lm_head.weight
    assert updater.names_of(second) == ("embed_tokens.weight", "lm_head.weight")
    assert updater.names_of(first) == ()


def test_tie_replacements_false_unties_only_that_name() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    embedding = model.embed_tokens.weight
    head = updater.update_by_name("lm_head.weight", _dense(32, 8), tie_replacements=False)
    assert model.lm_head.weight is head
    assert model.embed_tokens.weight is embedding
    assert updater.names_of(embedding) == ("embed_tokens.weight",)
    assert updater.names_of(head) == ("lm_head.weight",)


def test_replacing_with_a_tensor_the_model_holds_ties_them() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    shared = model.layers[0].attn.weight
    updater.update_by_ref(model.layers[1].attn.weight, shared)
    assert model.layers[1].attn.weight is shared
    assert updater.names_of(shared) == ("layers.0.attn.weight", "layers.1.attn.weight")


def test_a_module_registered_twice_is_reachable_by_both_names() -> None:
    model = nn.Module()
    shared = nn.Linear(4, 4)
    model.left = shared
    model.right = shared
    updater = ModTensorUpdater(model)
    assert updater.names_of(shared.weight) == ("left.weight", "right.weight")
    installed = updater.update_by_name("right.weight", _dense(4, 4))
    assert model.left.weight is installed is model.right.weight


# -- consistency ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("replacement", "message"),
    [
        (
            torch.zeros(32, 8, dtype=torch.float16),
            r"dtype torch.float16 instead of torch.float32",
        ),
        (torch.zeros(32, 9), r"shape \(32, 9\) instead of \(32, 8\)"),
        (torch.zeros(32, 8, device="meta"), r"device meta instead of cpu"),
        (
            torch.zeros(4, dtype=torch.float64, device="meta"),
            r"device meta instead of cpu; dtype torch.float64 instead of torch.float32; "
            r"shape \(4,\) instead of \(32, 8\)",
        ),
    ],
    ids=["dtype", "shape", "device", "all"],
)
def test_inconsistent_replacement_raises_with_both_values(
    replacement: torch.Tensor, message: str
) -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    before = model.lm_head.weight
    with pytest.raises(T2NErrorInconsistentTensor, match=message) as raised:
        updater.update_by_name("lm_head.weight", replacement)
    assert "'lm_head.weight' (tied with 'embed_tokens.weight')" in str(raised.value)
    assert "enforce_tensor_consistency=False" in str(raised.value)
    assert model.lm_head.weight is before is model.embed_tokens.weight


def test_consistency_check_can_be_disabled() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    wider = updater.update_by_ref(
        model.layers[0].mlp.bias,
        torch.zeros(9, dtype=torch.float64),
        enforce_tensor_consistency=False,
    )
    assert model.layers[0].mlp.bias is wider
    assert wider.dtype == torch.float64 and wider.shape == (9,)


# -- opaque and named replacements ------------------------------------------------------------
def test_opaque_replacement_becomes_a_frozen_parameter_of_the_same_type() -> None:
    model = TinyTransformer()
    expected = _forward(model)
    updater = ModTensorUpdater(model)
    dense = model.lm_head.weight.detach().clone()
    installed = updater.update_by_ref(model.lm_head.weight, LazyTensor(dense))
    assert type(installed) is LazyTensor
    assert isinstance(installed, nn.Parameter)
    assert not installed.requires_grad
    assert model.embed_tokens.weight is installed is model.lm_head.weight
    torch.testing.assert_close(_forward(model), expected)


def test_named_replacement_keeps_requires_grad() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    weight = model.layers[0].attn.weight
    installed = updater.update_by_ref(weight, NamedTensor(weight, "layers.0.attn.weight"))
    assert type(installed) is NamedTensor and installed.requires_grad
    assert installed.nnef_name == "layers.0.attn.weight"


def test_plain_replacement_inherits_requires_grad() -> None:
    model = TinyTransformer()
    model.layers[1].mlp.weight.requires_grad_(False)
    updater = ModTensorUpdater(model)
    trainable = updater.update_by_name("layers.0.mlp.weight", _dense(8, 8))
    frozen = updater.update_by_name("layers.1.mlp.weight", _dense(8, 8))
    assert trainable.requires_grad and trainable.is_leaf
    assert not frozen.requires_grad


def test_parameter_replacement_is_installed_as_given() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model, add_parameter_if_unset=False)
    param = nn.Parameter(_dense(8, 8), requires_grad=False)
    assert updater.update_by_name("layers.0.attn.weight", param) is param
    with pytest.raises(T2NErrorMisuse, match=r"is a parameter and the replacement is a Tensor"):
        updater.update_by_name("layers.0.mlp.weight", _dense(8, 8))


# -- buffers and plain attributes -------------------------------------------------------------
def test_buffers_are_indexed_on_request_and_stay_buffers() -> None:
    model = TinyTransformer()
    assert "layers.0.mask" not in ModTensorUpdater(model).available_names
    updater = ModTensorUpdater(model, add_buffers=True)
    installed = updater.update_by_name("layers.0.mask", torch.zeros(8))
    assert type(installed) is torch.Tensor
    assert dict(model.named_buffers())["layers.0.mask"] is installed
    assert "layers.0.mask" not in dict(model.named_parameters())
    assert updater.available_names.index("layers.1.mask") > updater.available_names.index(
        "lm_head.weight"
    )


def test_plain_tensor_attributes_and_aliases_are_updated_on_request() -> None:
    model = nn.Linear(4, 4)
    model.cache = torch.zeros(4)
    model.weight_alias = model.weight
    assert "cache" not in ModTensorUpdater(model).available_names
    updater = ModTensorUpdater(model, add_unregistred_tensor=True)
    cache = updater.update_by_name("cache", torch.ones(4))
    assert model.cache is cache and "cache" not in dict(model.named_buffers())
    weight = updater.update_by_name("weight", _dense(4, 4))
    assert model.weight is weight and model.weight_alias is weight
    assert updater.names_of(weight) == ("weight", "weight_alias")


# -- requires_grad management --------------------------------------------------------------------
def test_disable_and_restore_requires_grad() -> None:
    model = TinyTransformer()
    model.layers[0].attn.bias.requires_grad_(False)
    updater = ModTensorUpdater(model, disable_requires_grad=True)
    assert not any(p.requires_grad for p in model.parameters())
    replaced = updater.update_by_name("layers.1.attn.weight", _dense(8, 8))
    assert not replaced.requires_grad
    opaque = updater.update_by_name("layers.1.mlp.weight", LazyTensor(_dense(8, 8)))
    given = nn.Parameter(_dense(8, 8))  # a parameter requiring gradients, given as it is
    assert updater.update_by_name("layers.0.attn.weight", given) is given
    assert not given.requires_grad

    updater.restore_require_grad()
    assert model.embed_tokens.weight.requires_grad and given.requires_grad
    assert model.layers[1].attn.weight is replaced and replaced.requires_grad
    assert not model.layers[0].attn.bias.requires_grad  # was frozen before
    assert model.layers[1].mlp.weight is opaque and not opaque.requires_grad


# -- misuse -------------------------------------------------------------------------------------
def test_stale_reference_raises() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    old = model.layers[0].attn.weight
    updater.update_by_ref(old, _dense(8, 8))
    with pytest.raises(T2NErrorMisuse, match=r"does not hold this Parameter of shape \(8, 8\)"):
        updater.update_by_ref(old, _dense(8, 8))


def test_unknown_name_raises_with_suggestions() -> None:
    updater = ModTensorUpdater(TinyTransformer())
    with pytest.raises(T2NErrorMisuse, match=r"'lm_head.weigth'; did you mean 'lm_head.weight'"):
        updater.update_by_name("lm_head.weigth", _dense(32, 8))
    with pytest.raises(T2NErrorMisuse, match=r"no indexed tensor is named 'nowhere'"):
        updater.get_by_name("nowhere")


def test_name_reassigned_behind_the_updater_raises() -> None:
    model = TinyTransformer()
    updater = ModTensorUpdater(model)
    model.layers[0].attn.weight = nn.Parameter(_dense(8, 8))
    with pytest.raises(T2NErrorMisuse, match=r"reassigned outside this ModTensorUpdater"):
        updater.update_by_name("layers.0.attn.weight", _dense(8, 8))


def test_repr_summarises_the_index() -> None:
    updater = ModTensorUpdater(TinyTransformer(depth=1))
    assert repr(updater) == "<ModTensorUpdater of TinyTransformer: 5 tensors under 6 names>"
    assert isinstance(updater.model, TinyTransformer)


# -- cost -------------------------------------------------------------------------------------
def _time_full_update(depth: int) -> float:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(depth)))
    best = float("inf")
    for _ in range(3):
        # The thread's CPU time: the other processes of a loaded machine do not count.
        start = time.thread_time()
        updater = ModTensorUpdater(model)
        for _names, tensor in list(updater.iter_tensors()):
            updater.update_by_ref(tensor, tensor.detach())
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.timeout(60)
def test_indexing_and_updating_every_tensor_is_linear_in_model_size() -> None:
    small, large = _time_full_update(250), _time_full_update(2000)
    # 8x the tensors: linear work is ~8x; quadratic work would be ~64x.
    assert large < small * 24, (small, large)


def test_a_replacement_that_is_no_tensor_is_refused_by_name() -> None:
    model = nn.Linear(2, 2)
    updater = ModTensorUpdater(model)
    for wrong in (None, 3, "w", [1.0, 2.0]):
        with pytest.raises(T2NErrorMisuse, match="a tensor replaces a model's tensor, got"):
            updater.update_by_ref(model.weight, wrong)  # type: ignore[arg-type]
        with pytest.raises(T2NErrorMisuse, match="a tensor replaces a model's tensor, got"):
            updater.update_by_name("weight", wrong)  # type: ignore[arg-type]
    assert isinstance(model.weight, nn.Parameter)
