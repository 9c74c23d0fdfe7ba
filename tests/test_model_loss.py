"""A loss the pipelined module computes itself is joined into exactly the whole batch's loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la


class WithLoss(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x, y):
        logits = self.b(torch.tanh(self.a(x)))
        return F.cross_entropy(logits, y, reduction=self.reduction, ignore_index=-100)


def run(model: nn.Module, *call, chunks: int = 4) -> tuple[torch.Tensor, list[torch.Tensor], la.Pipeline]:
    plan = la.plan(model, call, ["cpu", "cpu"], chunks=chunks, use_profile_cache=False, calibrate=False,
                   progress=False)
    pipe = la.Pipeline(model, plan)
    loss = pipe(*call)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss, grads, pipe


@pytest.mark.parametrize("reduction, sizes", [("mean", 8), ("mean", 10), ("sum", 10)])
def test_a_mean_or_a_sum_over_samples_joins_exactly_with_its_gradients(reduction, sizes):
    """10 samples in 4 micro-batches: 3, 3, 2, 2, so a plain average of the means would be off."""
    model = WithLoss(reduction).double()
    x, y = torch.randn(sizes, 16, dtype=torch.float64), torch.randint(0, 5, (sizes,))
    loss, grads, pipe = run(model, x, y)
    with pipe:
        assert_pipelined(pipe)
        expected = model(x, y)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(grads, [p.grad for p in model.parameters()], rtol=1e-10, atol=1e-14)


def test_a_mean_over_tokens_with_uneven_padding_is_refused_with_the_values_seen():
    model = WithLoss("mean").double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 5, (8,))
    y[:3] = -100  # the first micro-batches count fewer items
    with pytest.raises(la.MicroBatchError, match=r"neither as a mean over samples nor as a sum: .* on micro-batches "
                                                 r"of 2 and 2 samples"):
        run(model, x, y)


transformers = pytest.importorskip("transformers")


def test_a_hugging_face_loss_is_divided_by_the_whole_batchs_token_count_and_summed():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (8, 12))
    labels = ids.clone()
    labels[0, 6:], labels[3, 2:], labels[5, 9:] = -100, -100, -100
    plan = la.plan(model, {"input_ids": ids, "labels": labels}, ["cpu", "cpu"], chunks=4, use_profile_cache=False,
                   calibrate=False, progress=False)
    with la.Pipeline(model, plan) as pipe:
        out = pipe(input_ids=ids, labels=labels)
        out.loss.backward()
        assert_pipelined(pipe)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = model(input_ids=ids, labels=labels)
        expected.loss.backward()
        # Hugging Face computes its loss in float32, whatever the model's dtype
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-12, atol=0)
        torch.testing.assert_close(grads, [p.grad for p in model.parameters()], rtol=1e-5, atol=1e-9)
