"""One options object: checked once, the same defaults everywhere, and the old recompute name kept working."""

import json

import pytest
import torch
from models import LongSkip

import lightning_antichain as la
from lightning_antichain.runtime.options import PipelineOptions


def test_options_are_checked_when_made_and_when_changed():
    with pytest.raises(ValueError, match="a whole number of at least 1"):
        PipelineOptions(chunks=0)
    with pytest.raises(ValueError, match="recompute must be one of"):
        PipelineOptions().replace(recompute="sometimes")
    with pytest.raises(ValueError, match="balance lists how many operations"):
        PipelineOptions(balance=[2, 0])
    with pytest.raises(TypeError, match=r"unknown pipeline option\(s\) \['chunk'\]"):
        PipelineOptions().replace(chunk=4)
    assert PipelineOptions(balance=[2, 3], leaf_modules=["a"]) == PipelineOptions(balance=(2, 3), leaf_modules=("a",))


def test_the_strategy_hands_its_options_to_the_pipeline():
    strategy = la.AntichainPipelineStrategy(chunks=4, recompute="always", batch_dim={"x": 1}, leaf_modules=["body"])
    assert strategy.options == PipelineOptions(chunks=4, recompute="always", batch_dim={"x": 1}, leaf_modules=("body",))


def test_the_old_name_checkpoint_still_sets_recompute_with_a_warning():
    with pytest.warns(DeprecationWarning, match="checkpoint= is now recompute="):
        strategy = la.AntichainPipelineStrategy(checkpoint="always")
    assert strategy.options.recompute == "always"
    model = LongSkip()
    cost = la.profile(model, torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    with pytest.warns(DeprecationWarning):
        plan = la.partition(cost, 2, chunks=2, checkpoint="except_last")
    assert plan.recompute == "except_last"
    with pytest.warns(DeprecationWarning), la.Pipeline(model, plan, checkpoint="always") as pipe:
        assert pipe.recompute == "always"
    saved = json.loads(plan.to_json())
    saved["checkpoint"] = saved.pop("recompute")  # a plan saved before the rename
    assert la.Plan.from_dict(saved).recompute == "except_last"
