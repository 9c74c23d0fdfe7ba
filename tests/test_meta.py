"""A model built on the meta device becomes real stage by stage, each stage on its own device."""


import pytest
import torch
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.LayerNorm(64),
                         nn.Linear(64, 4)).double()


def test_a_model_built_on_meta_trains_like_the_plain_module_with_an_optimizer_made_before():
    torch.manual_seed(0)
    plain = build()
    cost = la.profile(plain, torch.randn(4, 16, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # made on the meta model
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    with la.Pipeline(model, la.partition(cost, 3, chunks=4), chunks=4) as pipe:
        assert not [name for name, t in model.state_dict().items() if t.is_meta]
        model.load_state_dict(plain.state_dict())
        losses, plain_losses = [], []
        for _ in range(3):
            x = torch.randn(12, 16, dtype=torch.float64)
            for net, opt, kept in ((pipe, optimizer, losses), (plain, plain_optimizer, plain_losses)):
                loss = net(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                kept.append(loss.item())
        assert_pipelined(pipe, stages=3)
    assert losses[0] != losses[-1]  # the optimizer made on meta moved the real weights
    torch.testing.assert_close(losses, plain_losses, rtol=1e-12, atol=0)
    torch.testing.assert_close(list(model.parameters()), list(plain.parameters()), rtol=1e-12, atol=1e-14)


def test_each_module_is_initialised_by_its_reset_parameters():
    torch.manual_seed(0)
    cost = la.profile(build(), torch.randn(4, 16, dtype=torch.float64), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = build()
    la.Pipeline(model, la.partition(cost, 2), chunks=2).close()
    norm = model[4]
    assert torch.equal(norm.weight, torch.ones(64, dtype=torch.float64))  # LayerNorm's own reset
    first = model[0].weight
    assert first.abs().max() <= 1 / 16**0.5 and first.std() > 0  # Linear's kaiming-uniform bound


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.w


def test_a_meta_module_without_reset_parameters_is_named():
    real = nn.Sequential(nn.Linear(16, 16), Scale())
    cost = la.profile(real, torch.randn(4, 16), repeats=1, warmup=0, progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Scale())
    with pytest.raises(TypeError, match=r"1 \(Scale\) has parameters or buffers on the meta device but no reset_par"):
        la.Pipeline(model, la.partition(cost, 2), chunks=2)
