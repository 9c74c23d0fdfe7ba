"""Attributes assigned in ``forward`` behave as they do without the pipeline, or are refused clearly.

The models follow patterns users write: the PyTorch tutorial's cached ``self.src_mask``, a stash of
activations for inspection, a counter, a one-time initialisation from the first batch (ActNorm),
and an auxiliary loss kept on ``self``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.capture import AssignmentError, UntraceableModelError, capture_call

VOCAB, WIDTH = 30, 16


class TutorialTransformer(nn.Module):
    """The PyTorch tutorial's language model (batch first): the causal mask is built on the first
    call and cached on ``self``; the last hidden state is kept for inspection.

    ``nn.TransformerEncoder`` compares the mask with a causal one, which only concrete capture can
    follow; ``attention_only`` uses ``nn.MultiheadAttention`` alone, which torch.export captures.
    """

    def __init__(self, mask_as_buffer: bool = False, attention_only: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        if attention_only:
            self.encoder = SelfAttention()
        else:
            layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        if mask_as_buffer:
            self.register_buffer("src_mask", None)
        else:
            self.src_mask = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1)
        if self.src_mask is None or self.src_mask.size(0) != length:
            self.src_mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=self.head.weight.dtype)
        hidden = self.encoder(self.embed(tokens), mask=self.src_mask)
        self.last_hidden = hidden.detach()
        return self.head(hidden)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.attention(x, x, x, attn_mask=mask, need_weights=False)[0]


def _pipelined(model, example, frontend, stages=2, chunks=3):
    graph = capture_call(model, (example,), {}, frontends=(frontend,))
    cost = la.profile(model, example, op_graph=graph, repeats=1, warmup=0, progress=False)
    return la.Pipeline(model, la.partition(cost, stages, chunks=chunks), chunks=chunks, graph=graph), graph


# torch.export refuses a buffer registered as None and filled in forward (tested below)
@pytest.mark.parametrize(("frontend", "mask_as_buffer"), [("export", False), ("concrete", False), ("concrete", True)])
def test_a_cached_mask_and_a_stash_end_as_without_the_pipeline(frontend, mask_as_buffer):
    torch.manual_seed(0)
    plain = TutorialTransformer(mask_as_buffer, attention_only=frontend == "export").double()
    piped = TutorialTransformer(mask_as_buffer, attention_only=frontend == "export").double()
    piped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, VOCAB, (7, 6))
    pipe, graph = _pipelined(piped, tokens[:3], frontend)
    # the cache is settled once, as the first plain call would; the stash is assigned after every call
    assert [a.path for a in graph.assignments] == ["last_hidden"]
    for step in range(2):
        batch = tokens.roll(step, 0)  # 7 samples in 3 micro-batches: 3, 2, 2
        expected, output = plain(batch), pipe(batch)
        torch.testing.assert_close(output, expected, rtol=1e-12, atol=0)
        expected.pow(2).sum().backward()
        output.pow(2).sum().backward()
        torch.testing.assert_close(piped.last_hidden, plain.last_hidden, rtol=1e-12, atol=0)
        assert not piped.last_hidden.requires_grad
        torch.testing.assert_close(piped.src_mask, plain.src_mask, rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters()):
        assert (q.grad - p.grad).abs().max() <= 1e-9 * p.grad.abs().max(), name
    assert list(piped.state_dict()) == list(plain.state_dict())
    pipe.close()


def test_export_refuses_a_buffer_registered_as_none_and_the_chain_moves_on():
    model = TutorialTransformer(mask_as_buffer=True, attention_only=True).double()
    graph = capture_call(model, (torch.randint(0, VOCAB, (2, 6)),), {})
    assert graph.frontend == "concrete"
    assert any(r.startswith("export:") and "src_mask, a buffer registered as None" in r for r in graph.refused)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.calls = 0
        self.initialized = False
        self.register_buffer("shift", torch.zeros(8))


class Counting(Base):
    def forward(self, x):
        self.calls = self.calls + 1
        return self.b(torch.relu(self.a(x))) * self.calls


class ActNorm(Base):
    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.shift.copy_(-x.mean(0))
            self.initialized = True
        return self.b(torch.relu(self.a(x + self.shift)))


@pytest.mark.parametrize("model", [Counting, ActNorm])
def test_state_that_changes_what_the_next_call_does_is_refused(model):
    with pytest.raises(UntraceableModelError) as info:
        capture_call(model().double(), (torch.randn(4, 8, dtype=torch.float64),), {})
    message = str(info.value)
    changed = "self.calls" if model is Counting else "self.initialized"
    for frontend in ("export", "concrete"):
        assert f"{frontend}: forward changes {changed}, and that changes what the next call does" in message
    assert "outside forward" in message


class AuxLoss(Base):
    def forward(self, x):
        hidden = torch.relu(self.a(x))
        self.aux_loss = hidden.pow(2).mean()
        return self.b(hidden)


class BatchStatistic(Base):
    def forward(self, x):
        self.mean = x.mean().detach()
        return self.b(torch.relu(self.a(x)))


def test_an_attribute_that_needs_gradients_is_refused_when_training():
    torch.manual_seed(0)
    model = AuxLoss().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe, _ = _pipelined(model, x[:2], "export", chunks=1)
    with pytest.raises(AssignmentError, match="self.aux_loss a tensor that needs gradients.*return it from forward"):
        pipe(x)
    with torch.no_grad():  # nothing to carry back: the attribute gets the whole batch's value
        pipe(x)
        torch.testing.assert_close(model.aux_loss, torch.relu(model.a(x)).pow(2).mean(), rtol=1e-12, atol=0)
    pipe.close()


def test_a_batch_statistic_is_kept_whole_or_refused():
    torch.manual_seed(0)
    model = BatchStatistic().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    graph = capture_call(model, (x[:2],), {})  # fx traces it, but an fx graph cannot store the attribute
    assert graph.frontend == "export" and graph.refused[0].startswith("fx: forward assigns mean")
    pipe, _ = _pipelined(model, x[:2], "concrete", chunks=1)
    pipe(x)
    torch.testing.assert_close(model.mean, x.mean(), rtol=1e-12, atol=0)
    pipe.close()
    pipe, _ = _pipelined(model, x[:2], "concrete", chunks=3)
    with pytest.raises(AssignmentError, match=r"self.mean a value computed from the batch, but not one row per sample"):
        pipe(x)
    pipe.close()


class TutorialModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TutorialTransformer()
        self.example_input_array = torch.randint(0, VOCAB, (8, 6))
        self.losses: list[float] = []

    def forward(self, tokens):
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        out = self(tokens)
        loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(devices: int) -> TutorialModule:
    torch.manual_seed(0)
    model = TutorialModule()
    tokens = torch.randint(0, VOCAB, (80, 7), generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    strategy = "auto" if devices == 1 else la.AntichainPipelineStrategy(chunks=4, profile_cache=False)
    t = trainer(strategy=strategy, devices=devices, max_steps=10)
    t.fit(model, loader)
    if devices > 1:
        assert_pipelined(t)
    return model


@pytest.mark.slow  # 14 s; the Trainer parity tests of the default suite cover the path
def test_the_tutorial_model_trains_through_the_trainer_like_plain_lightning():
    plain, piped = _fit(1), _fit(2)
    assert len(plain.losses) == 10
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(piped.net.src_mask, plain.net.src_mask, rtol=0, atol=0)
    torch.testing.assert_close(piped.net.last_hidden, plain.net.last_hidden, rtol=1e-4, atol=1e-5)
