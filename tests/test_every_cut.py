"""Every 2-stage cut of a transformer gives the plain module's output and gradients (float64).

No plan may change a result. The nanoGPT block's ``q, k, v = qkv(x).split(c, dim=2)`` puts a
tuple on the boundary at some cuts (issue: it was passed on undetached, so the next stage's
backward ran through the previous stage's graph); the long residual stream crosses every cut.
"""

from __future__ import annotations

import torch
from pipelined import assert_pipelined
from zoo import NanoGPT

import lightning_antichain as la
from lightning_antichain.capture import capture


def test_every_two_stage_cut_of_a_gpt_matches_the_plain_module():
    torch.manual_seed(0)
    model = NanoGPT(vocab=32, width=16, heads=2, layers=2, block_size=8).double().eval()
    tokens = torch.randint(0, 32, (6, 8))
    graph = capture(model, tokens[:2])
    assert graph.frontend == "export"
    cost = la.profile(model, tokens[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    expected = model(tokens)
    weights = torch.randn(expected.shape, dtype=expected.dtype, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    scale = max(g.abs().max().item() for g in reference.values())
    operations = sum(1 for n in graph.nodes if n.kind != "placeholder")
    tuple_cuts = 0
    for first in range(1, operations):
        plan = la.plan_from_balance(cost, [first, operations - first], chunks=3)
        boundary = plan.stages[0].outputs
        tuple_cuts += any(graph[name].target.startswith("aten::split") for name in boundary)
        model.zero_grad(set_to_none=True)
        with la.Pipeline(model, plan, chunks=3, graph=graph) as pipe:
            output = pipe(tokens)
            (output * weights).sum().backward()
            assert_pipelined(pipe)
        assert (output - expected).abs().max().item() <= 1e-12 * expected.abs().max().item(), f"cut after {first}"
        for n, p in model.named_parameters():
            floor = max(reference[n].abs().max().item(), 1e-6 * scale)
            error = (p.grad - reference[n]).abs().max().item() / floor
            assert error <= 1e-9, f"cut after {first} ops ({boundary}): {n} off by {error:.1e}"
    assert tuple_cuts >= 2  # the split's tuple crossed the boundary, once per block


class AliasedInPlace(torch.nn.Module):
    """timm's BatchNormAct: an in-place activation behind ``nn.Identity`` / dropout, which return
    their input as is. A cut before them hands the next stage a gradient leaf that the activation
    would change in place, unless the stage copies it first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.drop, self.same = torch.nn.Dropout(0.5), torch.nn.Identity()
        self.act = torch.nn.SiLU(inplace=True)

    def forward(self, x):
        h = self.act(self.same(self.drop(self.a(x))))
        return self.b(torch.relu_(h[:, :6]) + 1)


def test_every_cut_before_an_in_place_op_behind_an_alias_matches_the_plain_module():
    torch.manual_seed(0)
    model = AliasedInPlace().double().eval()
    x = torch.randn(6, 6, dtype=torch.float64)
    graph = capture(model, x[:2])
    assert graph.frontend == "fx"
    cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False)
    expected = model(x)
    expected.sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    operations = sum(1 for n in graph.nodes if n.kind != "placeholder")
    for first in range(1, operations):
        plan = la.plan_from_balance(cost, [first, operations - first], chunks=3)
        model.zero_grad(set_to_none=True)
        with la.Pipeline(model, plan, chunks=3, graph=graph) as pipe:
            output = pipe(x)
            output.sum().backward()
            assert_pipelined(pipe)
        torch.testing.assert_close(output, expected, rtol=1e-12, atol=0, msg=f"cut after {first}")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, reference[n], rtol=1e-12, atol=1e-15, msg=f"cut after {first}: {n}")
