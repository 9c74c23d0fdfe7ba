"""The capture chain: which frontend takes what, what it specialises, and that nothing goes stale silently."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from pipelined import assert_pipelined
from torch import nn
from zoo import NanoGPT, TransformerLM

import lightning_antichain as la
from lightning_antichain.capture import SpecializationError, capture, capture_call


def _gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_parity(model, graph, plan, args, chunks, rel=1e-9):
    """Pipeline ``model`` on ``args`` and compare output and gradients with the plain module (float64)."""
    model.zero_grad(set_to_none=True)
    expected = model(*args)
    weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()
    reference = _gradients(model)
    scale = max(g.abs().max().item() for g in reference.values())
    model.zero_grad(set_to_none=True)
    pipe = la.Pipeline(model, plan, chunks=chunks, graph=graph)
    output = pipe(*args)
    (output * weights).sum().backward()
    assert_pipelined(pipe)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=0)
    for n, g in reference.items():
        floor = max(g.abs().max().item(), 1e-6 * scale)
        assert (model.get_parameter(n).grad - g).abs().max().item() / floor <= rel, n
    return pipe


def _planned(model, example, stages=2, chunks=4):
    graph = capture(model, example)
    cost = la.profile(model, example, op_graph=graph, repeats=1, warmup=0, progress=False)
    return graph, la.partition(cost, stages, chunks=chunks)


@pytest.mark.parametrize("kind", ["export", "concrete"])
def test_uneven_and_single_sample_micro_batches_are_captured_again_and_match(kind):
    """7 samples in 4 micro-batches are 2, 2, 2, 1. export proves its graph for every batch size, so
    one graph serves all four; concrete capture fixes every shape, so the micro-batch of 1 runs a
    graph captured again for it, with the same operations as the plan."""
    torch.manual_seed(0)
    if kind == "export":
        model = NanoGPT(vocab=32, width=16, heads=2, layers=2, block_size=8).double().eval()
        args = (torch.randint(0, 32, (7, 8)),)
    else:
        model = TransformerLM(vocab=20, width=16, dropout=0.0).double().eval()
        args = (torch.randint(0, 20, (7, 5)), torch.randint(0, 20, (7, 4)))
    graph, plan = _planned(model, tuple(a[:2] for a in args))
    assert graph.frontend == kind
    pipe = _check_parity(model, graph, plan, args, chunks=4)
    assert len(pipe._run.variants) == (0 if kind == "export" else 1)
    pipe.close()


class Switch(nn.Module):
    """A branch on a buffer's value: export has no values, so concrete capture guards it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.register_buffer("shift", torch.tensor(True))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.shift:
            h = h + 1
        return self.c(torch.tanh(self.b(h)))


def test_a_stale_specialisation_raises_instead_of_changing_the_result():
    torch.manual_seed(0)
    model = Switch().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    graph, plan = _planned(model, x[:2])
    assert graph.frontend == "concrete"
    pipe = _check_parity(model, graph, plan, (x,), chunks=4)
    model.shift.fill_(False)
    with pytest.raises(SpecializationError, match="test_capture.py"):
        pipe(x)
    pipe.close()


class BatchBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # depends on the batch: no fixed graph is right
            h = -h
        return self.b(h)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = BatchBranch()
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        return self.head(torch.relu(self.block(torch.tanh(self.stem(x)))))


def test_a_branch_on_the_batch_is_refused_with_file_and_line():
    with pytest.raises(la.UntraceableModelError) as info:
        capture(BatchBranch(), torch.randn(2, 4))
    message = str(info.value)
    assert "control flow on its input's values" in message
    assert "test_capture.py" in message and "h.sum() > 0" in message
    assert "leaf_modules=" in message and "module=" in message


def test_the_same_branch_inside_a_block_is_kept_whole_and_pipelines():
    torch.manual_seed(0)
    model = Outer().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    graph, plan = _planned(model, x[:2], stages=3)
    assert graph.frontend == "leaves" and graph.note == "kept whole: block"
    assert "block" in [n.name for n in graph.nodes]
    _check_parity(model, graph, plan, (x,), chunks=4).close()


class Counting(nn.Module):
    """Buffer updates in forward: BatchNorm statistics and a counter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        b, _ = x.shape
        self.calls += 1
        self.last_mask = torch.ones(b, 1, dtype=x.dtype)  # an attribute set in forward
        return self.b(torch.relu(self.norm(self.a(x)))) + torch.arange(b, dtype=x.dtype).unsqueeze(1) * 0


@pytest.mark.parametrize("frontend", ["export", "concrete"])
def test_buffer_updates_land_in_the_users_buffers(frontend):
    torch.manual_seed(0)
    plain, piped = Counting().double(), Counting().double()
    piped.load_state_dict(plain.state_dict())
    x = torch.randn(6, 4, dtype=torch.float64)
    graph = capture_call(piped, (x,), {}, frontends=(frontend,))
    assert piped.calls.item() == 0 and "last_mask" not in vars(piped)  # capture itself leaves no trace
    cost = la.profile(piped, x, op_graph=graph, repeats=1, warmup=0, progress=False)
    pipe = la.Pipeline(piped, la.partition(cost, 2, chunks=1), chunks=1, graph=graph)
    for _ in range(3):
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=0)
    for name, buffer in plain.state_dict().items():
        torch.testing.assert_close(piped.state_dict()[name], buffer, rtol=1e-12, atol=0, msg=name)
    assert piped.calls.item() == 3
    pipe.close()


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


@dataclasses.dataclass
class Features:
    hidden: torch.Tensor
    gate: torch.Tensor
    depth: int


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.r = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return Pair(torch.tanh(self.l(x)), torch.sigmoid(self.r(x)))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(6, 6)

    def forward(self, pair):
        return {"features": Features(self.mix(pair.left), pair.right, 2), "skip": [pair.left, None]}


class Nested(nn.Module):
    """Submodules hand each other a named tuple, then a dict holding a dataclass and a list."""

    def __init__(self):
        super().__init__()
        self.split, self.gate, self.head = Split(), Gate(), nn.Linear(6, 3)

    def forward(self, x):
        out = self.gate(self.split(x))
        f = out["features"]
        return self.head(f.hidden * f.gate * f.depth + out["skip"][0])


torch.fx.wrap("len")  # keep fx from special-casing anything here


def test_every_cut_carries_named_tuples_dicts_and_dataclasses():
    torch.manual_seed(0)
    model = Nested().double()
    leaves = [Split, Gate]
    graph = capture(model, torch.randn(2, 6, dtype=torch.float64), leaf_modules=leaves)
    x = torch.randn(6, 6, dtype=torch.float64)
    cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    operations = sum(1 for n in graph.nodes if n.kind != "placeholder")
    for first in range(1, operations):
        plan = la.plan_from_balance(cost, [first, operations - first], chunks=3)
        _check_parity(model, graph, plan, (x,), chunks=3).close()
