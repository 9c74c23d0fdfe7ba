"""Calls that change between steps, through the real Trainer: an optional tensor given and left
out, a micro-batch size the graph was not captured at, and arguments micro-batching cannot split.
Each either trains exactly like plain Lightning or stops with an error that says what to do."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lit_models import trainer
from pipelined import assert_pipelined
from test_modes import GPT2Module, _tokens
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.capture.isolation import training_flags_set


class OptionalBias(L.LightningModule):
    """``forward(x, bias=None)``; the steps give ``bias`` on the steps listed in ``given``."""

    def __init__(self, given: set[int], frontend_hint: str = "fx") -> None:
        super().__init__()
        self.given = given
        self.frontend_hint = frontend_hint
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.losses: list[float] = []

    def forward(self, x, bias=None):
        if self.frontend_hint == "export":
            assert x.shape[-1] <= 64  # fx cannot trace this: the graph comes from torch.export
        h = torch.tanh(self.a(x))
        if bias is not None:
            h = h + bias
        return self.c(torch.tanh(self.b(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        bias = torch.full((x.shape[0], 32), 0.5, dtype=x.dtype) if batch_idx in self.given else None
        loss = F.cross_entropy(self(x, bias), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(n: int = 64) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (n,), generator=gen)), batch_size=16)


def _strategy(**kwargs) -> la.AntichainPipelineStrategy:
    return la.AntichainPipelineStrategy(**{"chunks": 2, "profile_cache": False, "calibrate": False, **kwargs})


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("given", [{0, 1}, {2, 3}, {0, 2}])
def test_an_optional_tensor_given_on_some_steps_trains_like_plain(frontend, given):
    runs = []
    for strategy, devices in ((_strategy(), 2), ("auto", 1)):
        torch.manual_seed(0)
        model = OptionalBias(given, frontend).double()
        t = trainer(strategy=strategy, devices=devices, max_steps=4)
        t.fit(model, _data())
        runs.append(model.losses)
        if devices == 2:
            assert t.strategy.plan.frontend == frontend
            assert_pipelined(t)
    assert len(runs[0]) == 4
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-9, atol=0)


class ValidatedGPT2(GPT2Module):
    def validation_step(self, batch, batch_idx):
        tokens, target = batch
        with torch.no_grad(), training_flags_set(self, False):
            plain = self._loss(type(self).forward(self, tokens), target)
        self.checks.append((self._loss(self(tokens), target).item(), plain.item()))


@pytest.mark.parametrize("train_batch, chunks, val_batch", [(8, 8, 16), (1, 1, 4)])
def test_an_exported_gpt2_captured_at_one_sample_runs_at_other_sizes(train_batch, chunks, val_batch):
    torch.manual_seed(0)
    model = ValidatedGPT2(dropout=0.0).double()
    t = trainer(strategy=_strategy(chunks=chunks), devices=2, max_steps=2, num_sanity_val_steps=0,
                limit_val_batches=1, val_check_interval=2)
    tokens, val = _tokens(), _tokens(16, seed=4)
    train = DataLoader(tokens.dataset, batch_size=train_batch)
    t.fit(model, train, DataLoader(val.dataset, batch_size=val_batch))
    assert t.strategy.plan.frontend == "export" and t.strategy.plan.micro_batch_size == 1
    assert len(model.checks) == 1
    pipelined, reference = model.checks[0]
    assert pipelined == pytest.approx(reference, rel=1e-9)
    assert_pipelined(t)


class PerSampleLengths(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, lengths: list[int]):
        return self.c(torch.tanh(self.a(x)) * torch.tensor(lengths, dtype=x.dtype).unsqueeze(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x, list(range(x.shape[0]))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_per_sample_list_argument_is_refused_saying_to_pass_a_tensor():
    with pytest.raises(la.BatchDependenceError, match=r"lengths, a list of 16 plain values .*torch.tensor.lengths"):
        trainer(strategy=_strategy(), devices=2, max_steps=1).fit(PerSampleLengths(), _data())


class LogsInForward(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        out = self.c(torch.tanh(self.a(x)))
        self.log("output_norm", out.norm())
        return out

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_self_log_inside_forward_is_refused_saying_where_to_log():
    with pytest.raises(la.UntraceableModelError, match=r"forward calls self\.log at .*test_call_changes\.py") as info:
        trainer(strategy=_strategy(), devices=2, max_steps=1).fit(LogsInForward(), _data())
    assert "training_step" in str(info.value) and "leaf_modules" not in str(info.value).split("Each frontend")[0]
