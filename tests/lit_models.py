"""LightningModules and data for the strategy tests: real Trainer, real data loaders."""

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(L.LightningModule):
    """No BatchNorm, no dropout: pipelined training must match plain training step for step."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
        )
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.val_acc(self(x).argmax(-1), y)
        self.log("val_loss", loss)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x).argmax(-1), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def loader(samples: int = 160, batch_size: int = 16, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=gen)
    y = (x[:, :4] + 0.3 * torch.randn(samples, 4, generator=gen)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    return L.Trainer(**{**defaults, **kwargs})


def first_of_two_epochs(strategy, devices: int, path) -> tuple[TinyClassifier, TinyClassifier]:
    """Two epochs of plain training on 80 samples, and the first of them under ``strategy`` on
    ``devices``, saved at ``path``: the reference run and the model the checkpoint came from."""
    torch.manual_seed(0)
    uninterrupted = TinyClassifier()
    trainer(devices=1, max_epochs=2).fit(uninterrupted, loader(80))
    torch.manual_seed(0)
    first = TinyClassifier()
    t = trainer(devices=devices, strategy=strategy, max_epochs=1)
    t.fit(first, loader(80))
    t.save_checkpoint(path)
    return uninterrupted, first
