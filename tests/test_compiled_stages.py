"""``compile_stages``: each stage's graph runs through ``torch.compile`` and trains exactly as the
plain module does (float64), in the Pipeline and under the Trainer; bad arguments are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from lit_models import TinyClassifier, loader, trainer
from pipelined import assert_pipelined
from torch import nn
from torch._dynamo.utils import counters

import lightning_antichain as la

EAGER_AUTOGRAD = {"backend": "aot_eager"}  # dynamo and AOTAutograd without a C++ build: the tests' speed


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _two_stages(model: nn.Module, samples: int = 8) -> tuple[torch.Tensor, la.Plan]:
    """A float64 batch for ``model`` and its plan over two CPU stages in two micro-batches."""
    x = torch.randn(samples, 8, dtype=torch.float64)
    return x, la.partition(la.profile(model, x[:4], "cpu", progress=False), stages=2, chunks=2, devices=["cpu"] * 2)


def _compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_compiled_stages_train_like_the_plain_module_in_float64(recompute):
    torch.manual_seed(0)
    model = _mlp()
    plain = copy.deepcopy(model)
    x, plan = _two_stages(model)
    before = _compiled_graphs()
    with la.Pipeline(model, plan, chunks=2, recompute=recompute, compile_stages=EAGER_AUTOGRAD) as pipe:
        for _ in range(2):
            pipe(x).square().mean().backward()
        stages = pipe._run.stages
    for _ in range(2):
        plain(x).square().mean().backward()
    assert len(stages) == 2 and all("compiled_module" in vars(stage) for stage in stages)
    assert _compiled_graphs() - before >= 2  # each stage's graph went through dynamo
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_compiled_stages_draw_the_random_numbers_the_eager_stages_draw(recompute):
    """Dropout runs eagerly inside a compiled stage, from the pipeline's own generators: the same
    masks as the uncompiled pipeline, recomputed or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3),
                          nn.Linear(16, 4)).double()
    twin = copy.deepcopy(model)
    x, plan = _two_stages(model)
    for net, compiled in ((model, EAGER_AUTOGRAD), (twin, False)):
        with la.Pipeline(net, plan, chunks=2, recompute=recompute, compile_stages=compiled) as pipe:
            for step in range(2):
                torch.manual_seed(step)
                pipe(x).square().mean().backward()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


def test_a_compiled_stage_takes_micro_batches_of_another_size_like_the_plain_module():
    """Batches of 8 then 7 samples in 2 micro-batches (4 + 4, then 4 + 3): a shape the compiled
    graph's guards do not hold for is compiled again, never run on the graph made for another."""
    torch.manual_seed(0)
    model = _mlp()
    plain = copy.deepcopy(model)
    x, plan = _two_stages(model, samples=15)
    with la.Pipeline(model, plan, chunks=2, compile_stages=EAGER_AUTOGRAD) as pipe:
        for batch in (x[:8], x[8:]):
            pipe(batch).square().mean().backward()
    for batch in (x[:8], x[8:]):
        plain(batch).square().mean().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


def test_a_compiled_stage_compiles_once_for_batches_of_one_size():
    """The check that samples do not depend on each other runs the stages on half batches without
    gradients before the first step: eager, so that it costs no compiles of its own nor turns the
    stages' graphs into ones for any batch size."""
    torch.manual_seed(0)
    model = _mlp()
    x, plan = _two_stages(model)
    before, recompiled = _compiled_graphs(), counters["recompiles"].copy()
    with la.Pipeline(model, plan, chunks=2, compile_stages=EAGER_AUTOGRAD) as pipe:
        assert pipe.check_batch
        for _ in range(3):
            pipe(x).square().mean().backward()
    assert _compiled_graphs() - before == 2
    assert counters["recompiles"] == recompiled


def test_without_compile_stages_nothing_is_compiled():
    torch.manual_seed(0)
    model = _mlp()
    x, plan = _two_stages(model)
    with la.Pipeline(model, plan, chunks=2) as pipe:
        pipe(x).sum().backward()
        assert not any("compiled_module" in vars(stage) for stage in pipe._run.stages)


def test_the_strategy_compiles_its_stages_and_trains_like_plain_lightning():
    losses = []
    for strategy, devices in [("auto", 1), (la.AntichainPipelineStrategy(chunks=4, profile_cache=False,
                                                                          calibrate=False,
                                                                          compile_stages=EAGER_AUTOGRAD), 2)]:
        torch.manual_seed(0)
        model = TinyClassifier()
        t = trainer(strategy=strategy, devices=devices, max_steps=4, limit_val_batches=0)
        before = _compiled_graphs()
        t.fit(model, loader())
        losses.append(torch.tensor(model.losses))
    assert_pipelined(t)
    assert _compiled_graphs() - before >= 2  # both stages ran compiled (the plain run compiles nothing)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize(("value", "message"), [
    ({"modee": "max-autotune"}, "compile_stages got 'modee', which torch.compile does not take"),
    ("yes", "compile_stages is True"),
    ({"mode": "reduce-overhead"}, "replays CUDA graphs"),
    ({"mode": "max-autotune"}, "replays CUDA graphs"),
    ({"options": {"triton.cudagraphs": True}}, "replays CUDA graphs"),
])
def test_compile_arguments_torch_compile_does_not_take_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        la.AntichainPipelineStrategy(compile_stages=value)


def test_stages_replaying_cuda_graphs_are_refused_by_both_runtimes_before_anything_runs():
    """A CUDA graph's outputs and saved activations live in a pool its next replay overwrites,
    and a pipeline keeps several micro-batches of a stage in flight: refused when the options are
    made, so every rank of the process runtime refuses them too, and the modes without CUDA graphs
    are taken."""
    model = _mlp()
    _, plan = _two_stages(model)
    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        la.Pipeline(model, plan, chunks=2, compile_stages={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match="replays CUDA graphs"):
        la.AntichainPipelineStrategy(schedule="1f1b", compile_stages={"mode": "max-autotune"})
    for taken in (True, {"mode": "max-autotune-no-cudagraphs"}, {"options": {"triton.cudagraphs": False}}):
        assert la.AntichainPipelineStrategy(schedule="1f1b", compile_stages=taken).options.compile_stages


@pytest.mark.slow  # inductor builds C++ kernels on the CPU: tens of seconds
def test_stages_compiled_by_inductor_train_like_the_plain_module():
    torch.manual_seed(0)
    model = _mlp()
    plain = copy.deepcopy(model)
    x, plan = _two_stages(model)
    with la.Pipeline(model, plan, chunks=2, compile_stages=True) as pipe:
        pipe(x).square().mean().backward()
    plain(x).square().mean().backward()
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
