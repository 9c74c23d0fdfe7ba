"""Accuracy on real data: scikit-learn's handwritten digits, pipelined over two CPU devices."""

import lightning as L
import pytest
import torch
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la

datasets = pytest.importorskip("sklearn.datasets")


def digits_loaders():
    data = datasets.load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    train = DataLoader(
        TensorDataset(x[:cut], y[:cut]), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    test = DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=128)
    return train, test


class DigitsCNN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        import torchmetrics

        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.accuracy(self(x).argmax(-1), y)
        self.log("test_acc", self.accuracy)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def accuracy(strategy, devices):
    torch.manual_seed(0)
    model = DigitsCNN()
    train, test = digits_loaders()
    t = trainer(strategy=strategy, devices=devices, max_epochs=12)
    t.fit(model, train)
    if devices > 1:
        assert_pipelined(t)
    return t.test(model, test, verbose=False)[0]["test_acc"]


def test_pipelined_digits_reach_95_percent_like_single_device():
    single = accuracy("auto", 1)
    piped = accuracy(la.AntichainPipelineStrategy(chunks=4, profile_cache=False), 2)
    assert piped >= 0.95
    assert abs(piped - single) <= 0.01
