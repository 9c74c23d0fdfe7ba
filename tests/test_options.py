"""One options object: checked once, the same defaults everywhere, an option the runtime would ignore refused by
name, and old names kept working."""

import json
import re

import pytest
import torch
from models import LongSkip

import lightning_antichain as la
from lightning_antichain.plans.options import PipelineOptions


def test_options_are_checked_when_made_and_when_changed():
    with pytest.raises(ValueError, match="a whole number of at least 1"):
        PipelineOptions(chunks=0)
    with pytest.raises(ValueError, match="recompute must be one of"):
        PipelineOptions().replace(recompute="sometimes")
    with pytest.raises(ValueError, match="balance lists how many operations"):
        PipelineOptions(balance=[2, 0])
    with pytest.raises(ValueError, match="accumulate_grad_batches must be a whole number of at least 1"):
        PipelineOptions(accumulate_grad_batches=0)
    with pytest.raises(TypeError, match=r"unknown pipeline option\(s\) \['chunk'\]"):
        PipelineOptions().replace(chunk=4)
    assert PipelineOptions(balance=[2, 3], leaf_modules=["a"]) == PipelineOptions(balance=(2, 3), leaf_modules=("a",))


def test_the_strategy_hands_its_options_to_the_pipeline():
    strategy = la.AntichainPipelineStrategy(chunks=4, recompute="always", batch_dim={"x": 1}, leaf_modules=["body"])
    assert strategy.options == PipelineOptions(chunks=4, recompute="always", batch_dim={"x": 1}, leaf_modules=("body",))


@pytest.mark.parametrize(("given", "refused"), [
    ({"replication": "fsdp"}, "replication='fsdp' keeps the stages of processes in step"),
    ({"virtual_stages": 2}, "virtual_stages=2 is for schedule="),
    ({"internode_gbps": 25.0}, "internode_gbps=25.0 is the link between stages as processes"),
    ({"schedule": "1f1b", "placement": [0, 0]}, "placement=.* each process holds one device"),
    ({"schedule": "1f1b", "log_stage_times": True}, "log_stage_times=True logs the stage times of the in-process"),
    ({"schedule": "1f1b", "rebalance_rounds": 2}, "rebalance_rounds=2 cuts again"),
    ({"schedule": "1f1b", "recompute": "except_last"}, "recompute='except_last' is the in-process runtime's"),
])
def test_an_option_the_chosen_runtime_would_ignore_is_refused_by_name(given, refused):
    with pytest.raises(ValueError, match=refused):
        la.AntichainPipelineStrategy(**given)


def test_each_option_the_planner_takes_reaches_it_from_the_strategy():
    strategy = la.AntichainPipelineStrategy(method="uniform", profile_cache=False, rebalance_rounds=1)
    assert (strategy.options.method, strategy.options.use_profile_cache, strategy.options.rebalance_rounds) == (
        "uniform", False, 1)
    strategy = la.AntichainPipelineStrategy(profile_cache="/tmp/profiles")
    assert strategy.options.use_profile_cache and str(strategy.options.profile_cache) == "/tmp/profiles"
    with pytest.raises(ValueError, match="method must be one of"):
        la.AntichainPipelineStrategy(method="greedy")


def test_an_option_given_as_what_the_runtime_does_anyway_is_taken():
    strategy = la.AntichainPipelineStrategy(schedule="1f1b", rebalance_rounds=0, log_stage_times=False)
    assert strategy.options.schedule == "1f1b"


def test_the_names_an_earlier_build_took_are_refused_not_guessed():
    """``stages=``, ``use_profile_cache=`` and ``checkpoint=`` were renamed before any release
    (CHANGELOG): a clear error names them, with nothing silently mapped."""
    for old in ({"stages": 2}, {"use_profile_cache": False}, {"checkpoint": "always"}):
        with pytest.raises(TypeError, match=next(iter(old))):
            la.AntichainPipelineStrategy(**old)
    model = LongSkip()
    cost = la.profile(model, torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    with pytest.raises(TypeError, match="checkpoint"):
        la.partition(cost, 2, chunks=2, checkpoint="except_last")
    plan = la.partition(cost, 2, chunks=2, recompute="except_last")
    with pytest.raises(TypeError, match="unknown pipeline option.*checkpoint"):
        la.Pipeline(model, plan, checkpoint="always")
    saved = json.loads(plan.to_json())
    saved["checkpoint"] = saved.pop("recompute")  # a plan file saved before the rename still loads
    assert la.Plan.from_dict(saved).recompute == "except_last"


def test_every_argument_of_the_strategy_has_one_row_in_the_options_table():
    import inspect
    import re
    from pathlib import Path

    names = [n for n in inspect.signature(la.AntichainPipelineStrategy.__init__).parameters if n != "self"]
    doc = (Path(__file__).parents[1] / "docs" / "strategy.md").read_text()
    table = doc[doc.index("## Options"):doc.index("## Semantics")]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(rows) == sorted(names)


@pytest.mark.parametrize(("given", "named"), [
    ({"start_method": "thread"}, "start_method='thread' is not one of"),
    ({"timeout": -1}, "timeout is how long a rank waits"),
    ({"schedule": "zbv", "virtual_stages": 3}, "virtual_stages=3"),
    ({"schedule": "1f2b"}, "schedule='1f2b' is not one of"),
    ({"schedule": "1f1b", "replication": "zero"}, "replication='zero' is not one of"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be"),
    ({"placement": [0, -1]}, "placement must list"),
    ({"plan": "p.json", "balance": [1, 1]}, "either plan= or balance="),
])
def test_each_bad_argument_is_refused_when_the_strategy_is_made_naming_it(given, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        la.AntichainPipelineStrategy(**given)
