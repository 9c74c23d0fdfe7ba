"""Memory-aware planning: a model too big for one device is split within the limit and trains."""

import lightning as L
import pytest
import torch
from lit_models import loader, trainer
from torch import nn

import lightning_antichain as la
from lightning_antichain.planner.optimizer_memory import optimizer_multiplier, optimizer_state_bytes


class Wide(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 512), *[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(5)], nn.Linear(512, 4)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_model_over_one_device_limit_is_split_within_it_and_state_sizes_match():
    limit_gb = 0.012
    model = Wide()
    params = nbytes(model.parameters())
    assert params * 4 > limit_gb * 1e9  # parameters + gradients + Adam's two moments exceed one device
    cost = la.profile(model, torch.randn(4, 16), repeats=1, warmup=0, progress=False)
    with pytest.raises(la.InfeasiblePlanError, match="GB"):
        la.partition(cost, 1, chunks=4, memory_gb=limit_gb)

    torch.manual_seed(0)
    strategy = la.AntichainPipelineStrategy(chunks=4, memory_gb=limit_gb, profile_cache=False)
    t = trainer(devices=3, strategy=strategy, max_steps=3)
    t.fit(model, loader(64))
    plan = strategy.plan
    assert plan.optimizer_multiplier == 2.0  # read from the configured Adam
    optimizer = t.optimizers[0]
    stages = la.Pipeline(model, plan, chunks=4).stages  # the same split, rebuilt after the fit's teardown
    for spec, stage in zip(plan.stages, stages):
        assert spec.memory_bytes <= limit_gb * 1e9
        stage_params = stage.parameters()
        assert nbytes(stage_params) == spec.param_bytes
        assert nbytes(p.grad for p in stage_params) == spec.param_bytes
        assert optimizer_state_bytes(optimizer, stage_params) == 2 * spec.param_bytes
    assert sum(s.param_bytes for s in plan.stages) == params


def test_optimizer_multiplier_is_read_from_the_optimizer():
    params = [nn.Parameter(torch.zeros(3))]
    assert optimizer_multiplier([torch.optim.SGD(params, lr=0.1)]) == 0
    assert optimizer_multiplier([torch.optim.SGD(params, lr=0.1, momentum=0.9)]) == 1
    assert optimizer_multiplier([torch.optim.AdamW(params)]) == 2
    assert optimizer_multiplier([torch.optim.Adam(params, amsgrad=True)]) == 3
    assert optimizer_multiplier([torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params)]) == 2
