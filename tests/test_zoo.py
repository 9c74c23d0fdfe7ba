"""The model zoo: real architectures captured, planned over 3 stages and pipelined with 4 micro-batches.

Each model runs in eval mode (dropout off, BatchNorm on running statistics, so micro-batching
cannot change the maths) in float64, and its output and every parameter gradient must match the
plain module within 1e-9 relative. Relative to what: a gradient that is zero in exact arithmetic
(BERT's attention key biases: adding a constant to every key does not change a softmax) is pure
round-off in both runs, so each parameter's error is measured against the larger of its own
largest reference gradient and 1e-6 of the model's largest one. A tiny gradient may then differ
by at most 1e-15 of the largest: far below a real error, which is the size of the gradient itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from pipelined import assert_pipelined
from zoo import ZOO

import lightning_antichain as la
from lightning_antichain.capture import capture_call

RESULTS: dict[str, str] = {}


def _floating(value):
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _double(args):
    return tuple(a.double() if a.is_floating_point() else a for a in args)


def zoo_parity(name: str, stages: int = 3, chunks: int = 4, batch: int = 8):
    """Pipeline a zoo model against the plain module; returns (graph, plan, output error, gradient error)."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build().double().eval()
    args, kwargs = entry.batch(batch)
    example_args, example_kwargs = entry.batch(batch // chunks)
    args, example_args = _double(args), _double(example_args)
    # the documented path (docs/runtime.md): profile, partition, Pipeline, no graph carried by hand
    cost = la.profile(model, example_kwargs or example_args, repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, stages, chunks=chunks)
    expected = model(*args, **kwargs)
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in _floating(expected)]
    sum((t * w).sum() for t, w in zip(_floating(expected), weights)).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with la.Pipeline(model, plan, chunks=chunks) as pipe:
        output = pipe(*args, **kwargs)
        graph = pipe.graph
        sum((t * w).sum() for t, w in zip(_floating(output), weights)).backward()
        assert {stage for stage, _ in assert_pipelined(pipe, stages=plan.num_stages)} == set(range(plan.num_stages))
    out_error = max(_relative(a, b.detach()) for a, b in zip(_floating(output), _floating(expected)))
    scale = max(g.abs().max().item() for g in reference.values())
    grad_error = 0.0
    for n, p in model.named_parameters():
        if n in reference:
            assert p.grad is not None, f"{name}: no gradient for {n}"
            floor = max(reference[n].abs().max().item(), 1e-6 * scale)
            grad_error = max(grad_error, (p.grad - reference[n]).abs().max().item() / floor)
    return graph, plan, out_error, grad_error


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_pipelines_with_float64_parity(name):
    RESULTS[name] = "failed"
    graph, plan, out_error, grad_error = zoo_parity(name)
    assert plan.num_stages == 3
    assert out_error <= 1e-9, f"{name}: output differs by {out_error:.2e}"
    assert grad_error <= 1e-9, f"{name}: a gradient differs by {grad_error:.2e}"
    RESULTS[name] = graph.frontend


def test_zoo_covers_the_libraries_people_train_with():
    libraries = {entry.library for entry in ZOO.values()}
    assert {"torchvision", "timm", "transformers", "torch.nn", "nanoGPT-style"} <= libraries
    assert len(ZOO) >= 15


def _captured(name: str) -> list[tuple]:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build().double().eval()
    args, kwargs = entry.batch(2)
    graph = capture_call(model, _double(args), kwargs)
    return [(n.name, n.kind, n.target, n.inputs) for n in graph.nodes]


def test_every_zoo_model_captures_to_the_same_graph_and_names_twice_in_any_order():
    """A plan names operations: a capture made later, after others (the Pipeline's, another
    process's), must name them as the one the plan was made from did."""
    names = sorted(ZOO)
    first = {name: _captured(name) for name in names}
    again = {name: _captured(name) for name in reversed(names)}
    for name in names:
        assert again[name] == first[name], name
