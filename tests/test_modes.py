"""The pipelined graph follows the module's train/eval mode, through the real Trainer.

Every validation and test step compares the pipelined loss with the eval-mode loss of the same
weights computed by the module's own forward (float64); every training step checks that the
train-mode behaviour was applied. With and without Lightning's sanity check (whose validation batch
is then the first pipelined call), and with ``validate``, ``fit`` and ``test`` on one Trainer in
several orders.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.capture.isolation import side_effects_undone, training_flags_set


class ModeModel(L.LightningModule):
    """A small classifier whose forward depends on the mode in one of three ways."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "batchnorm":
            self.net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 3),
                                     nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                     nn.Linear(6, 4))
        else:
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.checks: dict[str, list[tuple[float, float]]] = {"train": [], "validate": [], "test": []}

    def forward(self, x):
        if self.kind == "batchnorm":
            assert x.shape[-1] <= 64  # fx cannot trace this: the graph comes from torch.export
            return self.net(x)
        h = torch.tanh(self.a(x))
        if self.kind == "dropout":
            h = F.dropout(h, 0.5, training=self.training)
        elif self.training:  # "branch"
            h = h + 0.25
        return self.c(torch.tanh(self.b(h)))

    def plain(self, x, training: bool):
        """The module's own forward on the same weights, in the given mode, changing nothing."""
        with torch.no_grad(), side_effects_undone(self), training_flags_set(self, training):
            return type(self).forward(self, x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # dropout: the eval-mode loss, which dropout must change; else exactly the train-mode loss.
        # Before the step's forward: restoring buffers after it would change what backward saved.
        reference = F.cross_entropy(self.plain(x, self.kind != "dropout"), y).item()
        loss = F.cross_entropy(self(x), y)
        self.checks["train"].append((loss.item(), reference))
        return loss

    def validation_step(self, batch, batch_idx):
        self._evaluated("validate", batch)

    def test_step(self, batch, batch_idx):
        self._evaluated("test", batch)

    def _evaluated(self, stage: str, batch) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.checks[stage].append((loss.item(), F.cross_entropy(self.plain(x, False), y).item()))
        self.log(f"{stage}_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(kind: str, n: int = 48, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 3, 8, 8) if kind == "batchnorm" else (n, 16)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (n,), generator=gen)), batch_size=12)


def _trainer(sanity: int, chunks: int = 4, recompute: str = "never", **kwargs) -> L.Trainer:
    strategy = la.AntichainPipelineStrategy(chunks=chunks, profile_cache=False, calibrate=False, recompute=recompute)
    return trainer(strategy=strategy, devices=2, max_steps=4, num_sanity_val_steps=sanity, limit_val_batches=2,
                   limit_test_batches=2, val_check_interval=2, **kwargs)


def _check(model: ModeModel, stages: list[str]) -> None:
    for stage in stages:
        if stage == "fit":
            assert len(model.checks["train"]) == 4
            for pipelined, reference in model.checks["train"]:
                if model.kind == "dropout":
                    assert abs(pipelined - reference) > 1e-6, "training ran without dropout"
                else:
                    assert pipelined == pytest.approx(reference, rel=1e-9, abs=1e-12)
        evaluated = "validate" if stage == "fit" else stage
        assert model.checks[evaluated], f"no {evaluated} step ran"
        for pipelined, reference in model.checks[evaluated]:
            assert pipelined == pytest.approx(reference, rel=1e-9, abs=1e-12), evaluated


@pytest.mark.parametrize("sanity", [0, 2])
@pytest.mark.parametrize("order", [("fit", "test", "validate"), ("validate", "fit", "test"),
                                   ("test", "validate", "fit")])
def test_dropout_is_on_in_training_and_off_in_evaluation_in_any_order(sanity, order):
    torch.manual_seed(0)
    model = ModeModel("dropout").double()
    t = _trainer(sanity)
    for stage in order:
        if stage == "fit":
            t.fit(model, _data("dropout"), _data("dropout", seed=1))
        else:
            getattr(t, stage)(model, _data("dropout", seed=2), verbose=False)
    _check(model, list(order))
    assert_pipelined(t)


@pytest.mark.parametrize("sanity", [0, 2])
def test_a_training_branch_runs_in_training_only(sanity):
    torch.manual_seed(0)
    model = ModeModel("branch").double()
    t = _trainer(sanity)
    t.fit(model, _data("branch"), _data("branch", seed=1))
    t.test(model, _data("branch", seed=2), verbose=False)
    _check(model, ["fit", "test"])
    assert_pipelined(t)
    assert t.strategy.plan.frontend == "fx"


@pytest.mark.parametrize(("sanity", "recompute"), [(0, "never"), (2, "never"), (0, "always")])
def test_exported_batchnorm_trains_its_statistics_as_plain_training_does(sanity, recompute):
    """One micro-batch per batch, so the pipeline's batch statistics are plain training's; a forward
    recomputed in backward updates them no second time (the exported graph writes them itself)."""
    torch.manual_seed(0)
    model = ModeModel("batchnorm").double()
    torch.manual_seed(0)
    plain = ModeModel("batchnorm").double()
    plain.load_state_dict(model.state_dict())
    t = _trainer(sanity, chunks=1, recompute=recompute)
    t.fit(model, _data("batchnorm"), _data("batchnorm", seed=1))
    assert t.strategy.plan.frontend == "export"
    trainer(devices=1, max_steps=4, num_sanity_val_steps=sanity, limit_val_batches=2,
            val_check_interval=2).fit(plain, _data("batchnorm"), _data("batchnorm", seed=1))
    _check(model, ["fit"])
    assert_pipelined(t)
    for (name, ours), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12, msg=name)
    assert int(model.net[1].num_batches_tracked) == 4
    t.test(model, _data("batchnorm", seed=2), verbose=False)
    _check(model, ["test"])


class GPT2Module(L.LightningModule):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                         resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        self.net = transformers.GPT2LMHeadModel(config)
        self.losses: list[float] = []
        self.checks: list[tuple[float, float]] = []

    def forward(self, tokens):
        return self.net(input_ids=tokens).logits

    def _loss(self, logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        loss = self._loss(self(tokens), target)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, target = batch
        with torch.no_grad(), training_flags_set(self, False):
            plain = self._loss(type(self).forward(self, tokens), target)
        self.checks.append((self._loss(self(tokens), target).item(), plain.item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _tokens(n: int = 32, seed: int = 3) -> DataLoader:
    tokens = torch.randint(0, 40, (n, 10), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


@pytest.mark.parametrize("sanity", [0, 2])
def test_hugging_face_gpt2_with_dropout_validates_in_eval_mode(sanity):
    torch.manual_seed(0)
    model = GPT2Module(dropout=0.1).double()
    t = _trainer(sanity=sanity, chunks=2)
    t.fit(model, _tokens(), _tokens(16, seed=4))
    assert t.strategy.plan.frontend == "export"
    assert len(model.checks) == sanity + 2 * 2
    for pipelined, reference in model.checks:
        assert pipelined == pytest.approx(reference, rel=1e-9)
    assert_pipelined(t)


def test_hugging_face_gpt2_with_dropout_trains_alike_with_and_without_recomputation():
    """Recomputation draws the dropout masks again exactly: the losses of every step agree."""
    runs = {}
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = GPT2Module(dropout=0.1).double()
        strategy = la.AntichainPipelineStrategy(chunks=2, recompute=checkpoint, profile_cache=False,
                                                calibrate=False)
        t = trainer(strategy=strategy, devices=2, max_steps=4, num_sanity_val_steps=0)
        t.fit(model, _tokens())
        assert_pipelined(t)
        runs[checkpoint] = model.losses
    assert len(runs["never"]) == 4
    torch.testing.assert_close(torch.tensor(runs["always"]), torch.tensor(runs["never"]), rtol=1e-12, atol=0)
    torch.manual_seed(0)
    undropped = GPT2Module(dropout=0.0).double()
    trainer(strategy=la.AntichainPipelineStrategy(chunks=2, profile_cache=False, calibrate=False), devices=2,
            max_steps=4, num_sanity_val_steps=0).fit(undropped, _tokens())
    assert undropped.losses[1:] != runs["never"][1:], "dropout must change training"
