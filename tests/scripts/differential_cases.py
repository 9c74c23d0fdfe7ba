"""The rows of the differential check: small models, each with a Lightning habit or a structure that
once went wrong, trained by plain Lightning and by the strategy (tests/scripts/differential.py).

Each row is a :class:`Case`: a float64 LightningModule, its data (training, validation and
prediction loaders), the strategy options it needs, and callbacks. A bug found becomes a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.demos.lstm import LightningLSTM, SequenceSampler, SimpleLSTM
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


@dataclasses.dataclass
class Case:
    """One row: how to build the module, its loaders, the strategy options and callbacks it needs."""

    module: Callable[[], L.LightningModule]
    data: Callable[[], tuple[DataLoader, DataLoader | None, DataLoader | None]]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: Callable[[], list[L.Callback]] = list
    max_epochs: int = 2


class Vectors(Dataset):
    """``count`` float64 samples of ``width`` features with a class label of 4, as dicts with a
    per-sample name (a ``list[str]`` per batch) where ``names``."""

    def __init__(self, count: int, width: int = 8, seed: int = 0, names: bool = False, shape: tuple = ()) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, *shape, width, generator=gen, dtype=torch.float64)
        self.y = (self.x.reshape(count, -1)[:, :4] + 0.3 * torch.randn(count, 4, generator=gen,
                                                                         dtype=torch.float64)).argmax(1)
        self.names = names

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.names:
            return {"x": self.x[i], "y": self.y[i], "name": "abcdefghij"[: 1 + i % 7]}
        return self.x[i], self.y[i]


def vector_data(width: int = 8, names: bool = False, shape: tuple = ()) -> Callable[[], tuple]:
    def loaders() -> tuple[DataLoader, DataLoader, DataLoader]:
        return (DataLoader(Vectors(48, width, 0, names, shape), batch_size=16),
                DataLoader(Vectors(16, width, 1, names, shape), batch_size=8),
                DataLoader(Vectors(16, width, 2, names, shape), batch_size=8))
    return loaders


class Classifier(L.LightningModule):
    """The steps every row shares: cross-entropy of ``self(x)``, logged; softmax predictions."""

    def batch_of(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return (batch["x"], batch["y"]) if isinstance(batch, dict) else batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.batch_of(batch)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.batch_of(batch)
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(self.batch_of(batch)[0]).softmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


# ---- custom autograd Functions (issue 71, case 1) ------------------------------------------------

class ReverseGradient(torch.autograd.Function):
    """A gradient-reversal layer (domain-adversarial training): the identity forward, ``-grad`` back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class StraightThroughRound(torch.autograd.Function):
    """Rounding with a straight-through gradient (quantisation-aware training)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class SurrogateSign(torch.autograd.Function):
    """A sign with a surrogate gradient (spiking networks, binarised weights): a hand-written backward
    that reads what forward saved and its non-tensor arguments, and is not the forward's derivative."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: torch.Tensor, scale: float, surrogate: str) -> torch.Tensor:
        ctx.save_for_backward(x, gain)
        ctx.scale, ctx.surrogate = scale, surrogate
        return scale * torch.sign(x * gain)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gain = ctx.saved_tensors
        slope = 1 - torch.tanh(x * gain) ** 2 if ctx.surrogate == "tanh" else torch.ones_like(x)
        inner = ctx.scale * slope * grad
        return inner * gain, (inner * x).sum(0), None, None


class FunctionCalls(Classifier):
    """``function`` applied between two layers of a small MLP, with cuts before, after and around it."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.function == "reverse":
            h = ReverseGradient.apply(h * self.gain)
        elif self.function == "round":
            h = StraightThroughRound.apply(h * self.gain)
        else:
            h = SurrogateSign.apply(h, self.gain, 0.5, "tanh")
        return self.c(torch.tanh(self.b(h)))


# ---- parameters used twice, at both ends (issue 71, case 4) --------------------------------------

class TiedEnds(Classifier):
    """One parameter and one layer each used at the start and at the end of ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = self.w0 = nn.Parameter(torch.linspace(-1, 1, 8))
        self.l1 = self.l0 = nn.Linear(8, 8)
        self.mid = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l0(x * self.w0))
        h = self.mid(h)
        return self.head(torch.tanh(self.l1(h) * self.w1))


# ---- modules that hold weak references to their parameters (issue 71, case 5) --------------------

class GruTagger(Classifier):
    """A bidirectional, batch-first GRU tagging each position; its tuple output crosses a cut."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gru = nn.GRU(8, 8, batch_first=True, bidirectional=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(torch.tanh(self.inp(x)))
        return self.out(h).mean(1)


class DemoLanguageModel(LightningLSTM):
    """Lightning's own demo LSTM language model (``lightning.pytorch.demos``), at a tiny size and
    without dropout; its training step carries the hidden state from batch to batch."""

    def __init__(self) -> None:
        super().__init__(vocab_size=32)
        self.model = SimpleLSTM(vocab_size=32, ninp=8, nhid=8, nlayers=2, dropout=0.0)

    def prepare_data(self) -> None:  # WikiText-2 is downloaded; these tests generate their text
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens(), batch_sampler=SequenceSampler(self.tokens(), batch_size=8))

    def tokens(self) -> Dataset:
        gen = torch.Generator().manual_seed(0)
        text = torch.randint(0, 32, (8 * 6 * 10 + 1,), generator=gen)
        return TensorDataset(text[:-1].view(-1, 10), text[1:].view(-1, 10))


def demo_data() -> tuple[DataLoader, None, None]:
    return DemoLanguageModel().train_dataloader(), None, None


# ---- nested and non-tensor values at cuts, buffers -----------------------------------------------

class NestedValues(Classifier):
    """Dicts, tuples and a Python int crossing the cuts; a buffer read in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = {"left": torch.tanh(self.a(x)), "right": (torch.tanh(self.b(x)), x.shape[-1])}
        left = torch.tanh(self.c(parts["left"] + self.shift))
        right, width = parts["right"]
        return self.d(torch.cat([left, right * (width / 8)], -1))


# ---- Lightning habits that read other stages' parameters (issue 71, case 6) ----------------------

class Mlp(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class WeightNorms(Mlp):
    """Logs the norm of every weight after each optimizer step, as many projects do."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        total = torch.stack([p.detach().norm() for p in self.parameters()]).norm()
        self.log("weight_norm", total)


class L2Penalty(Mlp):
    """An L2 penalty over ``self.parameters()`` added to the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-3 * sum((p**2).sum() for p in self.parameters())


class UnfreezeBackbone(BaseFinetuning):
    """Lightning's fine-tuning callback: the backbone frozen, unfrozen at the second epoch."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05)


class FineTuned(Mlp):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


class FrozenNormed(Classifier):
    """A backbone with BatchNorm that Lightning's fine-tuning callback freezes for the whole fit."""

    def __init__(self, tracking: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, track_running_stats=tracking), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)


class FreezeBackbone(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        pass


# ---- values a step computes from its batch (issue 71, case 2) ------------------------------------

class NormalisedLoss(Mlp):
    """A loss normalised inside the step by per-sample weights from a per-sample list of strings."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        per_sample = nn.functional.cross_entropy(self(batch["x"]), batch["y"], reduction="none")
        w = torch.tensor([float(len(n)) for n in batch["name"]], dtype=per_sample.dtype)
        loss = (w * per_sample).sum() / w.sum()
        self.log("train_loss", loss)
        return loss


class CountedPredictions(Mlp):
    """A prediction returning the batch's size beside the probabilities."""

    def predict_step(self, batch: Any, batch_idx: int) -> dict:
        x, _ = self.batch_of(batch)
        return {"p": self(x).softmax(-1), "n": torch.tensor(len(x))}


class FailsOnRank(L.Callback):
    """Raises a user's error on one rank, outside the step, at the third training batch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == 3:
            raise ValueError(f"the user's callback failed on rank {self.rank}")


CASES: dict[str, Case] = {
    "reverse": Case(lambda: FunctionCalls("reverse"), vector_data()),
    "round": Case(lambda: FunctionCalls("round"), vector_data()),
    "saved": Case(lambda: FunctionCalls("saved"), vector_data()),
    "tied": Case(TiedEnds, vector_data()),
    "gru": Case(GruTagger, vector_data(shape=(5,))),
    "demo_lstm": Case(DemoLanguageModel, demo_data, options={"module": "model", "batch_dim": {"hidden": 1}}),
    "nested": Case(NestedValues, vector_data()),
    "weight_norms": Case(WeightNorms, vector_data()),
    "l2": Case(L2Penalty, vector_data()),
    "finetuning": Case(FineTuned, vector_data(), callbacks=lambda: [UnfreezeBackbone()]),
    "frozen_bn": Case(FrozenNormed, vector_data(), callbacks=lambda: [FreezeBackbone()]),
    "untracked_bn": Case(lambda: FrozenNormed(tracking=False), vector_data(), callbacks=lambda: [FreezeBackbone()]),
    "callback_fails_on_0": Case(Mlp, vector_data(), callbacks=lambda: [FailsOnRank(0)]),
    "callback_fails_on_1": Case(Mlp, vector_data(), callbacks=lambda: [FailsOnRank(1)]),
    "normalised_loss": Case(NormalisedLoss, vector_data(names=True)),
    "counted_predictions": Case(CountedPredictions, vector_data()),
}
