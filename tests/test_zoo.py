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
from zoo import DECODER, ZOO

import lightning_antichain as la
from lightning_antichain.capture import capture_call

RESULTS: dict[str, str] = {}


def _floating(value):
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _double(value):
    return pytree.tree_map(lambda a: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a, value)


def zoo_parity(name: str, stages: int = 3, chunks: int = 4, batch: int = 8):
    """Pipeline a zoo model against the plain module; returns (graph, plan, output error, gradient error)."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.model()
    args, kwargs = _double(entry.batch(batch))
    example_args, example_kwargs = _double(entry.batch(batch // chunks))
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


def zoo_params() -> list:
    """Every zoo entry, those marked slow under ``-m slow``."""
    return [pytest.param(n, marks=[pytest.mark.slow] if ZOO[n].slow else []) for n in sorted(ZOO)]


@pytest.mark.parametrize("name", zoo_params())
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
    assert len(ZOO) >= 30


def test_a_mixture_of_experts_routed_by_a_loop_over_its_tokens_is_refused_saying_what_to_change():
    """Hugging Face's "eager" experts loop over the tokens each expert was routed: shapes that depend
    on the batch's values. The zoo's Mixtral runs its experts with "batched_mm" instead, as the
    message says; with "eager", profiling falls back to the children and says why."""
    import transformers

    entry = ZOO["hf_mixtral"]
    config = transformers.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                                        experts_implementation="eager")
    model = transformers.MixtralForCausalLM(config).eval()
    _, kwargs = entry.batch(2)
    with pytest.raises(la.UntraceableModelError) as info:
        capture_call(model, (), kwargs)
    message = str(info.value)
    assert "has Python control flow on its input's values at" in message and "modeling_mixtral.py" in message
    assert 'build it with experts_implementation="batched_mm"' in message
    with pytest.warns(UserWarning, match="profiled at its 3 top-level children instead"):
        cost = la.profile(model, kwargs, repeats=1, warmup=0, progress=False)
    with pytest.raises(la.InfeasiblePlanError, match="holds only MixtralForCausalLM's top-level children"):
        la.partition(cost, 3, chunks=4)


def test_a_similarity_of_every_sample_with_every_other_is_refused_saying_to_compute_it_outside():
    """CLIP's logits compare each text with each image of the batch, which no micro-batch holds. The
    zoo pipelines the per-sample embeddings (``ContrastiveEmbeddings``), as the message says."""
    import transformers

    torch.manual_seed(0)
    model = ZOO["hf_clip"].build().model.double().eval()  # the CLIP model inside the zoo's wrapper
    args, kwargs = _double(ZOO["hf_clip"].batch(8))
    _, example = _double(ZOO["hf_clip"].batch(2))
    assert isinstance(model, transformers.CLIPModel)
    cost = la.profile(model, example, repeats=1, warmup=0, progress=False)
    with la.Pipeline(model, la.partition(cost, 2, chunks=4), chunks=4) as pipe:
        with pytest.raises(la.MicroBatchError, match=r"grows in dims \[0, 1\].*Compute it outside the pipelined"):
            pipe(*args, **kwargs)


def _captured(name: str) -> list[tuple]:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.model()
    args, kwargs = _double(entry.batch(2))
    graph = capture_call(model, args, kwargs)
    return [(n.name, n.kind, n.target, n.inputs) for n in graph.nodes]


@pytest.mark.slow  # 54 s: every zoo model captured twice
@pytest.mark.parametrize("slow", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])
def test_every_zoo_model_captures_to_the_same_graph_and_names_twice_in_any_order(slow):
    """A plan names operations: a capture made later, after others (the Pipeline's, another
    process's), must name them as the one the plan was made from did. The slow entries under
    ``-m slow``."""
    names = sorted(name for name, entry in ZOO.items() if entry.slow == slow)
    first = {name: _captured(name) for name in names}
    again = {name: _captured(name) for name in reversed(names)}
    for name in names:
        assert again[name] == first[name], name


def test_the_pipeline_runs_the_capture_its_plan_was_profiled_from_while_the_model_is_unchanged(tmp_path):
    """No graph carried by hand: ``la.Pipeline`` reuses the profile's capture through the plan, and
    captures afresh once the module has changed (another dtype) or for a plan loaded from a file."""
    from lightning_antichain.capture.carried import carried

    torch.manual_seed(0)
    model = ZOO["lstm_lm"].model()
    args, _ = ZOO["lstm_lm"].batch(8)
    cost = la.profile(model, ZOO["lstm_lm"].batch(2)[0], repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 2, chunks=4)
    profiled = carried(plan, model)
    assert profiled is not None and profiled.module is model
    with la.Pipeline(model, plan, chunks=4) as pipe:
        pipe(*args)
        assert pipe.graph is profiled
    plan.save(tmp_path / "plan.json")
    with la.Pipeline(model, la.Plan.load(tmp_path / "plan.json"), chunks=4) as pipe:
        pipe(*args)
        assert pipe.graph is not profiled and [n.name for n in pipe.graph.nodes] == [n.name for n in profiled.nodes]
    model.float()
    assert carried(plan, model) is None
    with la.Pipeline(model, plan, chunks=4) as pipe:
        pipe(*args)
        assert pipe.graph is not profiled
