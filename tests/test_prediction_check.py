"""A calibrated plan is checked against the first training steps, and a stale calibration is named."""

import json
import re
import warnings
from dataclasses import replace

import pytest
import torch
from lit_models import TinyClassifier, loader, trainer
from models import LongSkip

import lightning_antichain as la
from lightning_antichain.planner import planning
from lightning_antichain.planner.prediction_check import PredictionCheck, span_s
from lightning_antichain.plans.schedule import Timed


def _plan(tmp_path, span_s=0.1):
    """A calibrated plan, as if its calibration had measured a pipelined span of ``span_s``."""
    plan = planning.plan_model(LongSkip(), (torch.randn(4, 12),), {}, ["cpu", "cpu"], chunks=4,
                               profile_cache=tmp_path, progress=False).plan
    return replace(plan, calibration={**plan.calibration, "pipelined_span_s": span_s})


def _step(plan, span_s):
    """A step whose tasks fall as ``plan`` predicts them, stretched to last ``span_s``."""
    timed = plan.timeline()
    return _by_stage(timed, plan.num_stages, scale=span_s / max(t.end for t in timed))


def _by_stage(timed, stages, scale=1.0, pause=0.0):
    """``timed`` as a run would record it: per stage, times scaled, backward tasks after a pause."""
    out = [[] for _ in range(stages)]
    for t in timed:
        shift = pause if t.task.phase == "backward" else 0.0
        out[t.task.stage].append(Timed(t.task, scale * t.start + shift, scale * t.end + shift))
    return out


def test_the_span_leaves_out_the_pause_between_forward_and_backward(tmp_path):
    timed = _plan(tmp_path).timeline()
    assert span_s(_by_stage(timed, 2, pause=0.5)) == pytest.approx(max(t.end for t in timed))
    assert span_s(_by_stage(timed, 2, scale=2.0)) == pytest.approx(2 * max(t.end for t in timed))
    assert span_s([[], []]) == 0.0


@pytest.mark.parametrize(("span_s", "scale", "warned"), [
    (0.1, 1.0, False), (0.1, 1.1, False), (0.1, 0.9, False), (0.1, 1.3, True), (0.1, 0.6, True),
    (0.004, 1.4, False),  # 1.6 ms: under the floor
])
def test_steps_beyond_the_tolerance_are_reported_once_after_the_warm_up_step(tmp_path, span_s, scale, warned):
    plan = _plan(tmp_path, span_s)
    check = PredictionCheck(plan)
    step = _step(plan, scale * span_s)
    first = _step(plan, 50 * span_s)  # the warm-up step is not counted
    said = [check.observe(s) for s in (first, step, step, step, step, step)]
    assert said[:3] == [None, None, None]
    assert [s for s in said if s] == ([said[3]] if warned else [])
    if warned:
        assert f"({scale:.2f}x)" in said[3] and "calibrated moments ago" in said[3]


def test_a_plan_loaded_from_a_file_says_to_plan_again(tmp_path):
    plan = _plan(tmp_path)
    check = PredictionCheck(plan, plan_file="plan.json", steps=1)
    check.observe(_step(plan, 0.2))
    assert "loaded from plan.json" in check.observe(_step(plan, 0.2))


def test_the_trainer_names_a_stale_cached_calibration_and_how_to_measure_it_again(tmp_path):
    def fit():
        torch.manual_seed(0)
        strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=str(tmp_path), rebalance_rounds=0)  # one split
        t = trainer(strategy=strategy, devices=2, max_steps=6, limit_val_batches=0)
        t.fit(TinyClassifier(), loader())
        return t.strategy.plan

    assert fit().calibration["read_from"] is None  # measured now
    (cached,) = tmp_path.glob("calibration-*.json")
    data = json.loads(cached.read_text())
    data.update({key: [10 * t for t in data[key]] for key in ("forward_s", "backward_s")},
                pipelined_span_s=10 * data["pipelined_span_s"], pipelined_step_s=10 * data["pipelined_step_s"])
    cached.write_text(json.dumps(data))  # as if calibrated while the machine ran ten times slower
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fit()
    said = [str(w.message) for w in caught if "pipelined forward and backward" in str(w.message)]
    assert plan.calibration["read_from"] == str(cached) and f"(cached: {cached})" in plan.table()
    assert len(said) == 1, said
    assert re.search(rf"faster than the [\d.]+ ms .* read from {re.escape(str(cached))}.* delete that file", said[0])

