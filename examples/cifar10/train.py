"""Train a torchvision classifier on CIFAR-10, pipelined over the Trainer's devices.

    python examples/cifar10/train.py fit --config examples/cifar10/config.yaml

CIFAR-10 is read from ``--data.data_dir`` (``--data.download true`` fetches it where the network
allows). When it is not there, the script says so loudly and trains on a synthetic CIFAR-shaped
data set instead (class-dependent colour patterns plus noise): the pipeline, logging and
checkpointing all run, but the accuracy is not a CIFAR-10 result.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torchmetrics
import torchvision
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

import lightning_antichain  # noqa: F401  (registers strategy="antichain_pipeline")

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class SyntheticCIFAR(Dataset):
    """CIFAR-shaped images whose class is learnable: a per-class colour pattern plus noise."""

    def __init__(self, size: int, num_classes: int = 10, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, 3, 8, 8, generator=gen)
        self.labels = torch.randint(num_classes, (size,), generator=gen)
        self.noise_seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.noise_seed * 1_000_003 + index)
        label = int(self.labels[index])
        pattern = nn.functional.interpolate(self.patterns[label : label + 1], size=32, mode="bilinear")[0]
        return pattern + 1.5 * torch.randn(3, 32, 32, generator=gen), label


class CIFAR10Data(L.LightningDataModule):
    """CIFAR-10 from ``data_dir``, or an announced synthetic stand-in when it is missing."""

    def __init__(
        self,
        data_dir: str = "data/cifar10",
        batch_size: int = 64,
        num_workers: int = 0,
        download: bool = False,
        synthetic_size: int = 5000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        normalize = torchvision.transforms.Normalize(MEAN, STD)
        train_tf = torchvision.transforms.Compose(
            [
                torchvision.transforms.RandomCrop(32, padding=4),
                torchvision.transforms.RandomHorizontalFlip(),
                torchvision.transforms.ToTensor(),
                normalize,
            ]
        )
        test_tf = torchvision.transforms.Compose([torchvision.transforms.ToTensor(), normalize])
        root, download = self.hparams.data_dir, self.hparams.download
        try:
            self.train_set = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf, download=download)
            self.val_set = torchvision.datasets.CIFAR10(root, train=False, transform=test_tf, download=download)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted."
            warnings.warn(
                f"CIFAR-10 is not in {root!r} ({exc}). Training on a SYNTHETIC CIFAR-shaped data set of "
                f"{self.hparams.synthetic_size} images instead; its accuracy is not a CIFAR-10 result. "
                "Put CIFAR-10 there (or pass --data.download true) for real training.",
                stacklevel=1,
            )
            full = SyntheticCIFAR(self.hparams.synthetic_size)
            val = max(self.hparams.synthetic_size // 10, 1)
            self.train_set, self.val_set = random_split(
                full, [len(full) - val, val], generator=torch.Generator().manual_seed(0)
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


class Classifier(L.LightningModule):
    """Any ``torchvision.models`` classifier by name, trained with SGD and a cosine schedule."""

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        arch_kwargs: dict | None = None,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **(arch_kwargs or {}))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits.argmax(-1), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits.argmax(-1), y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(int(steps), 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    LightningCLI(Classifier, CIFAR10Data, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
