"""Attention under a causal mask that the graph builds from shapes runs as causal attention
(capture/causal_attention.py), computing the same function; other masks keep their mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture.causal_attention import CausalWhenProven, is_causal_mask


def gpt2(dropout: float) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                     attn_pdrop=dropout, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


class WindowAttention(nn.Module):
    """Self-attention under a sliding-window mask made from positions: from shapes, not causal."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.qkv = nn.Linear(8, 24, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        positions = torch.arange(x.shape[1], device=x.device)
        mask = positions[:, None] >= positions[None, :]
        if self.window is not None:
            mask = mask & (positions[:, None] - positions[None, :] < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


class PaddedAttention(WindowAttention):
    """The mask comes from the batch (padding), so from values: it must stay a mask."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :]).transpose(1, 2).flatten(2)


def attention_calls(graph: la.OpGraph) -> list:
    return [n.target for n in graph.graph_module.graph.nodes if "attention" in str(n.target)]


def test_a_traced_hugging_face_decoder_calls_causal_attention_and_computes_what_the_module_does():
    model = Logits(gpt2(dropout=0.0))
    ids = torch.randint(0, 64, (6, 12))
    plain = copy.deepcopy(model)
    graph = la.trace(model, ids)
    calls = attention_calls(graph)
    assert len(calls) == 2 and all(isinstance(c, CausalWhenProven) for c in calls)
    plan = la.plan_from_balance(la.profile(model, ids[:3], "cpu", op_graph=graph, repeats=1, warmup=0,
                                           progress=False), [len(graph) // 2, len(graph) - len(graph) // 2],
                                chunks=2)
    with la.Pipeline(model, plan, chunks=2, graph=graph) as pipe:
        out = pipe(ids)
        out.square().sum().backward()
    expected = plain(ids)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    assert all(list(c._proven.values()) == [True] for c in calls)


@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_attention_dropout_is_drawn_again_alike_when_recomputed(recompute):
    """The causal call still draws its dropout from the micro-batch's own generator, so a recomputed
    forward draws the masks its output saw: the gradients equal those without recomputation."""
    ids = torch.randint(0, 64, (4, 12))
    grads = {}
    for mode in ("never", recompute):
        model = Logits(gpt2(dropout=0.3))
        graph = la.trace(model, ids)
        assert all(isinstance(c, CausalWhenProven) for c in attention_calls(graph))
        cost = la.profile(model, ids[:2], "cpu", op_graph=graph, repeats=1, warmup=0, progress=False)
        plan = la.plan_from_balance(cost, [len(graph) // 2, len(graph) - len(graph) // 2], chunks=2)
        torch.manual_seed(1)
        with la.Pipeline(model, plan, chunks=2, graph=graph, recompute=mode) as pipe:
            pipe(ids).square().sum().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    torch.testing.assert_close(grads[recompute], grads["never"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
def test_a_mask_made_from_positions_is_checked_before_it_is_dropped(window):
    torch.manual_seed(0)
    model = WindowAttention(window)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    graph = la.trace(model, x)
    (call,) = attention_calls(graph)
    assert isinstance(call, CausalWhenProven)
    torch.testing.assert_close(graph.graph_module(x), model(x), rtol=1e-12, atol=1e-12)
    assert list(call._proven.values()) == [window is None]


def test_a_mask_that_comes_from_the_batch_stays_a_mask():
    torch.manual_seed(0)
    model = PaddedAttention(None)
    x, keep = torch.randn(2, 7, 8, dtype=torch.float64), torch.ones(2, 7, dtype=torch.bool)
    keep[0, 5:] = False
    graph = la.trace(model, (x, keep))
    (call,) = attention_calls(graph)
    assert not isinstance(call, CausalWhenProven)


def test_which_masks_are_causal():
    keep = torch.ones(4, 6, dtype=torch.bool).tril()
    assert is_causal_mask(keep, 4, 6) and is_causal_mask(keep.expand(2, 3, 4, 6), 4, 6)
    assert not is_causal_mask(keep.triu(), 4, 6) and not is_causal_mask(torch.ones(4, 6, dtype=torch.bool), 4, 6)
    additive = torch.zeros(4, 6).masked_fill(~keep, float("-inf"))
    assert is_causal_mask(additive, 4, 6)
    assert not is_causal_mask(torch.zeros(4, 6).masked_fill(~keep, torch.finfo(torch.float32).min), 4, 6)
    assert not is_causal_mask(keep[:, :5], 4, 6)


def test_the_causal_call_draws_the_dropout_the_masked_call_draws():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    call = CausalWhenProven(F.scaled_dot_product_attention)
    torch.manual_seed(3)
    got = call(q, k, v, attn_mask=mask, dropout_p=0.4)
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
