"""Named parameter and buffer iteration."""

from __future__ import annotations

import torch
from torch import nn

from torch_to_nnef.tensor.utils import (
    get_named_buffers,
    get_named_parameters,
    get_named_parameters_and_buffers,
)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)  # `bias` is registered as None
        self.head.weight = self.embed.weight
        self.shared = nn.Linear(4, 4)
        self.again = self.shared


def test_parameters_match_torch_and_drop_duplicates_by_default() -> None:
    model = Tied()
    ours = list(get_named_parameters(model))
    assert [(n, id(t)) for n, t in ours] == [(n, id(t)) for n, t in model.named_parameters()]
    assert [name for name, _ in ours] == [
        "embed.weight",
        "norm.weight",
        "norm.bias",
        "shared.weight",
        "shared.bias",
    ]
    assert all(isinstance(tensor, nn.Parameter) for _, tensor in ours)


def test_parameters_with_duplicates_list_every_name() -> None:
    model = Tied()
    named = dict(get_named_parameters(model, remove_duplicate=False))
    assert list(named) == [
        "embed.weight",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "shared.weight",
        "shared.bias",
        "again.weight",
        "again.bias",
    ]
    assert named["head.weight"] is named["embed.weight"]
    assert named["again.bias"] is named["shared.bias"]


def test_buffers_with_and_without_duplicates() -> None:
    model = Tied()
    model.other_norm = model.norm
    deduplicated = [name for name, _ in get_named_buffers(model)]
    assert deduplicated == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    every = dict(get_named_buffers(model, remove_duplicate=False))
    assert every["other_norm.running_mean"] is every["norm.running_mean"]
    assert len(every) == 6


def test_parameters_and_buffers_together() -> None:
    model = Tied()
    model.register_buffer("alias", model.embed.weight, persistent=False)
    deduplicated = dict(get_named_parameters_and_buffers(model))
    assert "alias" not in deduplicated  # a parameter first, under its parameter name
    assert list(deduplicated) == [
        *(name for name, _ in model.named_parameters()),
        *(name for name, _ in model.named_buffers() if name != "alias"),
    ]
    every = dict(get_named_parameters_and_buffers(model, remove_duplicate=False))
    assert every["alias"] is every["embed.weight"] is every["head.weight"]
    assert all(isinstance(tensor, torch.Tensor) for tensor in every.values())
