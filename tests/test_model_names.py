"""AdaptedModel lists its parameters once (named_params) and again after any parameter or
module is registered: trainable, personal and communicated names stay right when requires_grad
changes and when a tuner is injected after they were first asked for."""

import torch
from torch import nn

from fedadapt.adapters.model import AdaptedModel


def test_names_follow_requires_grad_and_parameters_added_later():
    model = AdaptedModel(head=nn.Linear(4, 2), backbone=None)
    assert model.trainable_names() == ["head.weight", "head.bias"]
    model.head.bias.requires_grad_(False)
    assert model.trainable_names() == ["head.weight"]  # read afresh, no relisting needed
    model.head.extra = nn.Parameter(torch.zeros(3))  # registered after the first listing
    model.head.bias.requires_grad_(True)
    assert model.trainable_names() == ["head.weight", "head.bias", "head.extra"]
    model.adapter = nn.Linear(2, 2)  # a module added later, as peft's inject adds layers
    assert "adapter.weight" in model.trainable_names()
    assert set(model.tensors(["adapter.bias"])) == {"adapter.bias"}
    assert [n for n, _ in model.named_params()] == [n for n, _ in model.named_parameters()]
