"""Outputs flattened over samples and tokens (``output.view(-1, vocab)``, as language-model training
loops return them for ``cross_entropy``) are joined on dim 0; flattened in another order, refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la

VOCAB = 40


class DemoTransformer(LightningTransformer):
    """Lightning's own demo, small, without dropout (random streams differ per micro-batch), on
    generated tokens instead of WikiText-2."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def prepare_data(self) -> None:  # the demo downloads WikiText-2 here
        pass


def tokens() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (24, 10), generator=gen)
    return DataLoader(TensorDataset(ids, ids.roll(-1, 1)), batch_size=8)


@pytest.mark.slow  # 12 s; transformers train through the Trainer in tests/test_zoo_trainer.py
def test_lightnings_demo_transformer_trains_through_the_strategy_like_plain_lightning():
    torch.manual_seed(0)
    model = DemoTransformer()
    plain = DemoTransformer()
    plain.load_state_dict(model.state_dict())
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=3)
    fit.fit(model, tokens())
    assert_pipelined(fit)
    trainer(devices=1, precision="64-true", max_steps=3).fit(plain, tokens())
    torch.testing.assert_close(model.losses, plain.losses, rtol=1e-6, atol=0)


class Flattened(nn.Module):
    """Token logits flattened over (samples, tokens), or over (tokens, samples)."""

    def __init__(self, order: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.order = order
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.head(self.drop(torch.tanh(self.mix(self.embed(ids)))))
        return h.reshape(-1, VOCAB) if self.order == "samples" else h.transpose(0, 1).reshape(-1, VOCAB)


def pipeline(order: str, dropout: float = 0.0, **options) -> tuple[la.Pipeline, nn.Module, torch.Tensor]:
    model = Flattened(order, dropout).double()
    ids = torch.randint(0, VOCAB, (8, 5))
    plan = la.partition(la.profile(model, ids, repeats=1, warmup=0, progress=False, runtime_overhead=False), 2,
                        chunks=4)
    return la.Pipeline(model, plan, chunks=4, **options), model, ids


def test_an_output_flattened_sample_by_sample_joins_exactly_with_its_gradients():
    pipe, model, ids = pipeline("samples")
    with pipe:
        out = pipe(ids)
        assert out.shape == (40, VOCAB)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = model(ids)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(grads, [p.grad for p in model.parameters()], rtol=1e-10, atol=1e-12)


def test_the_order_check_holds_with_dropout_drawing_in_training():
    """The check runs the micro-batch twice under one seed, so dropout's draws do not look like
    a change of order."""
    pipe, model, ids = pipeline("samples", dropout=0.3, check_batch=False)
    with pipe:
        assert pipe(ids).shape == (40, VOCAB)
        model.eval()
        torch.testing.assert_close(pipe(ids), model(ids), rtol=1e-12, atol=0)


@pytest.mark.parametrize("check_batch", [True, False])
def test_an_output_flattened_token_by_token_is_refused_with_what_was_seen(check_batch):
    """Caught by the batch check before the first step, or by the join's own order check without it."""
    pipe, _, ids = pipeline("tokens", check_batch=check_batch)
    with pipe, pytest.raises(la.MicroBatchError, match=r"holds 5 rows per sample on dim 0, but not sample by sample.*"
                                                       r"transpose\(0, 1\).reshape"):
        pipe(ids)


def test_an_output_with_no_per_sample_dim_names_what_it_saw():
    class Summed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))).sum(0, keepdim=True).expand(3, 4)

    model = Summed()
    x = torch.randn(8, 16)
    plan = la.partition(la.profile(model, x, repeats=1, warmup=0, progress=False, runtime_overhead=False), 2, chunks=4)
    with la.Pipeline(model, plan, chunks=4, check_batch=False) as pipe, pytest.raises(
            la.MicroBatchError, match=r"shapes \[\(3, 4\), \(3, 4\), \(3, 4\), \(3, 4\)\] for micro-batches of "
                                      r"\[2, 2, 2, 2\] samples, the same whatever the micro-batch holds"):
        pipe(x)
