"""Every 2-stage cut of a transformer gives the plain module's output and gradients (float64).

No plan may change a result. The nanoGPT block's ``q, k, v = qkv(x).split(c, dim=2)`` puts a
tuple on the boundary at some cuts (issue: it was passed on undetached, so the next stage's
backward ran through the previous stage's graph); the long residual stream crosses every cut.
"""

from __future__ import annotations

import torch
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
        assert (output - expected).abs().max().item() <= 1e-12 * expected.abs().max().item(), f"cut after {first}"
        for n, p in model.named_parameters():
            floor = max(reference[n].abs().max().item(), 1e-6 * scale)
            error = (p.grad - reference[n]).abs().max().item() / floor
            assert error <= 1e-9, f"cut after {first} ops ({boundary}): {n} off by {error:.1e}"
    assert tuple_cuts >= 2  # the split's tuple crossed the boundary, once per block
