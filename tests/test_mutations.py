"""In-place operations: ordered before every later reader of what they change, and safe on inputs.

``h.relu_()`` has no users in the graph, so only an ordering edge keeps a plan from reading ``h`` a
stage before the ReLU. Every 2-stage split the planner may choose (every down-set of the cost graph)
is run here, not only prefixes of the execution order.
"""

from __future__ import annotations

import pytest
import torch
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la
from lightning_antichain.capture import capture
from lightning_antichain.planner.antichain import build_state_space
from lightning_antichain.planner.cost_graph import normalize_cost_graph
from lightning_antichain.planner.cost_model import CostModel, DeviceSpec, evaluate_stages
from lightning_antichain.planner.partition import _make_plan


class ReluInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        h = self.net[0](x)
        h.relu_()
        return self.net[4](self.net[3](self.net[2](h)))


class ViewInPlace(nn.Module):
    """The mutation reaches the reader through a view: ``v`` shares ``h``'s storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        v = h.view(-1, 2, 4)
        h.mul_(2)
        return self.b(v.flatten(1))


class AddToInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        x.add_(1)
        return self.b(torch.relu(self.a(x)))


def _every_two_stage_plan(cost, chunks):
    """Every split the planner may choose: down-sets that keep each ``together`` group whole."""
    graph = normalize_cost_graph(cost)
    space = build_state_space(graph)
    for group in graph.graph.get("together", []):
        space.forbidden = space.forbidden | space.splits(set(group))
    pinned = [v for v in graph.nodes if graph.nodes[v]["pinned"]]
    specs = [DeviceSpec("cpu"), DeviceSpec("cpu")]
    model = CostModel(chunks, float("inf"), 2.0)
    for state in range(len(space)):
        first = space.down_set(state)
        if set(first) <= set(pinned) or len(first) == graph.number_of_nodes() or space.forbidden[state]:
            continue
        rest = [v for v in space.nodes if v not in set(first)]
        stages = evaluate_stages(graph, [first, rest], specs, model)
        yield first, _make_plan(graph, stages, specs, model, "test", 0.0, len(space), [])


@pytest.mark.parametrize("model_class", [ReluInPlace, ViewInPlace])
def test_every_split_the_planner_may_choose_keeps_an_in_place_op_before_its_readers(model_class):
    torch.manual_seed(0)
    model = model_class().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    graph = capture(model, x[:2])
    cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    expected = model(x)
    expected.pow(2).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    splits = 0
    for first, plan in _every_two_stage_plan(cost, chunks=3):
        model.zero_grad(set_to_none=True)
        with la.Pipeline(model, plan, chunks=3, graph=graph) as pipe:
            output = pipe(x)
            output.pow(2).sum().backward()
            assert_pipelined(pipe)
        torch.testing.assert_close(output, expected, rtol=1e-12, atol=0, msg=f"stage 0 = {first}")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, reference[n], rtol=1e-12, atol=0, msg=f"stage 0 = {first}: {n}")
        splits += 1
    assert splits >= 3
    in_place = next(n.name for n in graph.nodes if n.target in ("relu_", "mul_"))
    readers = [n.name for n in graph.nodes if in_place in n.after]
    assert readers, "the in-place op orders nothing"
    for reader in readers:
        assert cost.has_edge(in_place, reader)
    if model_class is ViewInPlace:  # the view is computed where the change happens
        assert cost.graph["together"] == [["mul_", "view"]]


@pytest.mark.parametrize("stages", [1, 2])
def test_an_in_place_change_of_the_input_trains_as_plain(stages):
    torch.manual_seed(0)
    model = AddToInput().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    expected = model(x.clone())
    expected.pow(2).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    graph = capture(model, x[:2].clone())
    cost = la.profile(model, x[:2].clone(), op_graph=graph, repeats=1, warmup=0, progress=False)
    with la.Pipeline(model, la.partition(cost, stages, chunks=2), chunks=2, graph=graph) as pipe:
        output = pipe(x.clone())  # micro-batches are views of one tensor: one may not bump the others' version
        output.pow(2).sum().backward()
        assert_pipelined(pipe, stages=stages)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[n], rtol=1e-12, atol=0, msg=n)
