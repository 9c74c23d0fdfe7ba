"""Caches that ``forward`` builds on its first call from the batch's shape or device are kept.

Positional tables, causal masks and rotary caches are written this way all over public code
(``if self.pe is None: self.pe = table(...)``, ``if self.mask is None or self.mask.size(0) != t``).
The pipeline keeps them as the model's state and checks them on every call: a call of another
length, or a cache the user replaced, captures again from the module's present state, so a
pipelined call does what a plain one does, state included. Taken through the documented path
(``la.profile`` -> ``la.partition`` -> ``la.Pipeline``), in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from zoo import FirstCallCaches

import lightning_antichain as la
from lightning_antichain.capture import UntraceableModelError, capture_call

VOCAB, WIDTH = 32, 16


def _pipeline(model: nn.Module, example: torch.Tensor, frontend: str | None = None) -> la.Pipeline:
    """The documented path; with ``frontend``, the profile takes that frontend's capture, and the
    Pipeline captures again with the frontend the plan names."""
    graph = None if frontend is None else capture_call(model, (example,), {}, frontends=(frontend,))
    cost = la.profile(model, example, op_graph=graph, repeats=1, warmup=0, progress=False)
    return la.Pipeline(model, la.partition(cost, 3, chunks=4), chunks=4)


def _step(pipe: la.Pipeline, model: nn.Module, plain: nn.Module, tokens: torch.Tensor) -> None:
    """One pipelined and one plain call with backward: outputs, gradients and caches must agree."""
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
    output, expected = pipe(tokens), plain(tokens)
    weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(tokens.size(1)))
    (output * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(output, expected, rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    for name in ("pe", "mask"):
        ours, theirs = getattr(model, name), getattr(plain, name)
        assert (ours is None) == (theirs is None), name
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("frontend", ["export", "concrete"])
def test_caches_built_on_the_first_call_pipeline_and_follow_each_length(frontend):
    torch.manual_seed(0)
    model = FirstCallCaches().double().eval()
    plain = copy.deepcopy(model)
    with _pipeline(model, torch.randint(0, VOCAB, (2, 8)), frontend) as pipe:
        for length in (8, 12, 8, 5, 12, 8):  # each length after another: the mask is rebuilt, as plain
            _step(pipe, model, plain, torch.randint(0, VOCAB, (8, length)))
        assert pipe.graph.frontend == frontend
        assert model.pe.shape == (16, WIDTH)  # built once, never again


def test_the_cache_is_state_of_the_model_not_rebuilt_by_the_graph():
    """Captured once the cache exists, the graph reads it rather than building it on every call."""
    torch.manual_seed(0)
    model = FirstCallCaches().double().eval()
    graph = capture_call(model, (torch.randint(0, VOCAB, (2, 8)),), {}, frontends=("export",))
    targets = {str(n.target) for n in graph.nodes}
    assert not any("triu" in t or "sin" in t for t in targets), sorted(targets)
    assert set(graph.cache.after) == {"pe", "mask"}
    assert graph.cache.after["mask"] is model.mask and model.mask.shape == (8, 8)


def test_a_cache_the_user_replaces_is_read_as_replaced():
    """Not a silent stale cache: a new table of the same shape (other values) reaches the next call."""
    torch.manual_seed(0)
    model = FirstCallCaches().double().eval()
    plain = copy.deepcopy(model)
    with _pipeline(model, torch.randint(0, VOCAB, (2, 8))) as pipe:
        _step(pipe, model, plain, torch.randint(0, VOCAB, (8, 8)))
        table = torch.randn(16, WIDTH)
        model.pe, plain.pe = table, table.clone()
        _step(pipe, model, plain, torch.randint(0, VOCAB, (8, 8)))
        model.pe = plain.pe = None  # reset by the user: built again on the next call
        _step(pipe, model, plain, torch.randint(0, VOCAB, (8, 8)))


class FromTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.center = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.center is None:
            self.center = x.detach().mean(0)  # the first batch's values: not a cache of its shape
        return self.linear(x - self.center)


class FromAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.scaled = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled is None:
            self.scaled = self.weight * 2  # stale after the first step, in a plain call too
        return x @ self.scaled


@pytest.mark.parametrize("model", [FromTheBatch, FromAParameter])
def test_a_first_call_value_of_the_batch_or_of_parameters_is_refused(model):
    module = model().double()
    with pytest.raises(UntraceableModelError) as info:
        capture_call(module, (torch.randn(4, 8, dtype=torch.float64),), {}, frontends=("export", "concrete"))
    name = "self.center" if model is FromTheBatch else "self.scaled"
    assert f"export: forward changes {name}, and that changes what the next call does" in str(info.value)
    assert "give the attribute its final value before training" in str(info.value)
