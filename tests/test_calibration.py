"""Calibration from the runtime: what it infers, what it leaves alone, and how the plan uses it."""

import copy
import json
import re
from dataclasses import replace

import pytest
import torch
from models import LongSkip, SequentialCNN
from torch import nn

import lightning_antichain as la
from lightning_antichain.planner import calibration, planning
from lightning_antichain.planner.contention import runtime_capacity
from lightning_antichain.planner.progress import Progress
from lightning_antichain.plans import schedule
from lightning_antichain.plans.schedule import Task, gpipe


def _timed_by_stage(timed, stages):
    by_stage = [[] for _ in range(stages)]
    for t in timed:
        by_stage[t.task.stage].append(t)
    return by_stage


@pytest.mark.parametrize(("stages", "chunks", "capacity", "cores"),
                         [(2, 4, 1.6, 2), (2, 8, 1.15, 2), (3, 6, 1.7, 3), (3, 6, 1.4, 2), (4, 5, 1.9, 16)])
def test_the_capacity_read_from_a_timeline_is_the_capacity_it_was_simulated_with(stages, chunks, capacity, cores):
    forward = [1.0 + 0.3 * k for k in range(stages)]
    backward = [2.0 - 0.2 * k for k in range(stages)]
    work = {t: (forward if t.phase == "forward" else backward)[t.stage]
            for tasks in gpipe(stages, chunks).order for t in tasks}
    extra = capacity - 1
    curve = [1 + extra * (min(n, cores) - 1) for n in range(1, stages + 1)]
    timed = schedule.timeline(gpipe(stages, chunks), work.__getitem__, capacity=curve, shared=[True] * stages)
    found = runtime_capacity(_timed_by_stage(timed, stages), work, [True] * stages, cores)
    assert found == pytest.approx(capacity)


def test_stages_that_never_overlap_say_nothing_about_capacity():
    timed = schedule.timeline(gpipe(2, 1), schedule.stage_durations([1.0, 1.0], [1.0, 1.0]))
    work = {t.task: 1.0 for t in timed}
    assert runtime_capacity(_timed_by_stage(timed, 2), work, [True, True], 2) is None


class _Stateful(nn.Module):
    """BatchNorm statistics and dropout's random draws: things a few training steps change, and
    calibration must put back."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                                  nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x):
        return self.body(x)


def test_calibrating_leaves_the_module_its_gradients_and_the_random_stream_as_they_were(tmp_path):
    torch.manual_seed(0)
    model = _Stateful().double()
    x = torch.randn(8, 12, dtype=torch.float64)
    model(x).sum().backward()
    state = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    planned = planning.plan_model(model, (x[:2],), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                                  progress=False)
    assert planned.plan.calibration is not None  # it ran
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_calibrated_plan_predicts_from_the_measured_stage_times_and_is_read_back_from_the_cache(tmp_path):
    model = LongSkip()
    micro = torch.randn(4, 12)
    planned = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                                  progress=False, rebalance_rounds=0)
    plan = planned.plan
    found = plan.calibration
    assert found is not None and len(list(tmp_path.glob("calibration-*.json"))) == 1
    for stage, f, b in zip(plan.stages, found["forward_s"], found["backward_s"]):
        assert stage.forward_s == pytest.approx(max(0.0, f - plan.task_overhead_s))
        # the micro-batches run alone add into the gradients of the runs before them
        adding = plan.prediction.accumulation_s(stage)
        assert stage.backward_s == pytest.approx(max(0.0, b - plan.task_overhead_s - adding))
    assert found["profiled_compute_s"] == [s.compute_s for s in
                                           planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=4,
                                                               profile_cache=tmp_path, progress=False,
                                                               calibrate=False, rebalance_rounds=0).plan.stages]
    if found["parallel_capacity"] is not None:
        assert plan.parallel_capacity == found["parallel_capacity"]
    assert plan.predicted_step_s == pytest.approx(plan.predict_step())
    assert 3 <= found["steps"] <= 15 and f"calibrated on {found['steps']} steps of this plan" in plan.table()
    assert la.Plan.from_dict(json.loads(plan.to_json())).calibration == json.loads(json.dumps(found))
    again = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                                progress=False, rebalance_rounds=0).plan
    assert again.predicted_step_s == plan.predicted_step_s  # read back, not measured again
    (cached,) = tmp_path.glob("calibration-*.json")
    assert found["read_from"] is None and again.calibration == {**found, "read_from": str(cached)}


def test_calibration_is_only_for_plans_whose_stages_share_the_cpu(tmp_path):
    model = SequentialCNN()
    micro = torch.randn(2, 3, 16, 16)
    one = planning.plan_model(model, (micro,), {}, ["cpu"], chunks=4, profile_cache=tmp_path, progress=False)
    assert one.plan.calibration is None
    off = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                              progress=False, calibrate=False)
    assert off.plan.calibration is None and not list(tmp_path.glob("calibration-*.json"))


@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_a_recomputed_micro_batch_is_charged_its_forward_again_in_backward(recompute):
    model = SequentialCNN()
    cost = la.profile(model, torch.randn(2, 3, 16, 16), repeats=1, warmup=0, progress=False)
    cost.graph["parallel_capacity"] = None  # stages at full speed: a task's span is its duration
    plain = {t.task: t.end - t.start for t in la.partition(cost, 2, chunks=4).timeline()}
    plan = la.partition(cost, 2, chunks=4, recompute=recompute)
    recomputing = {t.task: t.end - t.start for t in plan.timeline()}
    last = 3 if recompute == "except_last" else 4
    for m in range(4):
        for k, stage in enumerate(plan.stages):
            again = stage.forward_s if m < last else 0.0
            assert recomputing[Task("backward", k, m)] == pytest.approx(plain[Task("backward", k, m)] + again)
            assert recomputing[Task("forward", k, m)] == pytest.approx(plain[Task("forward", k, m)])


def test_a_damaged_cached_calibration_is_measured_again(tmp_path):
    model = LongSkip()
    micro = torch.randn(4, 12)
    planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=2, profile_cache=tmp_path, progress=False,
                        rebalance_rounds=0)
    (cached,) = tmp_path.glob("calibration-*.json")
    key = cached.stem.removeprefix("calibration-")
    for damage in ('{"forward_s": [1.0], "backward_s": [1.0]}', "not json", '{"forward_s": [-1, 1]}'):
        cached.write_text(damage)
        with pytest.warns(UserWarning, match=f"ignoring the cached calibration {re.escape(str(cached))}"):
            plan = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=2, profile_cache=tmp_path,
                                       progress=False, rebalance_rounds=0).plan
        assert plan.calibration is not None and len(plan.calibration["forward_s"]) == 2
        assert calibration.load(tmp_path, key, 2) is not None  # rewritten whole


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_calibrated_accelerator_plan_predicts_the_pipelined_step_it_measured(device):
    """On accelerators the stage times come from the device's clock, and the plan predicts the
    measured pipelined step: what the stage times leave unexplained is charged per step, and stage
    times that explain more are scaled to it; CPU plans keep the runtime overhead measured for
    the machine. (Planning only: nothing runs on the device.)"""
    model = SequentialCNN()
    cost = la.profile(model, torch.randn(4, 3, 16, 16), "cpu", repeats=1, warmup=0, progress=False)
    cost.graph.update(task_overhead_s=1e-4, step_overhead_s=2e-3, accumulate_s_per_byte=0.0)
    plan = la.partition(cost, stages=2, chunks=4, devices=[device, device])
    forward, backward = (0.010, 0.020), (0.015, 0.030)
    explained = replace(plan, stages=[replace(s, forward_s=f - 1e-4 - s.transfer_s / 2,
                                              backward_s=b - 1e-4 - s.transfer_s / 2)
                                      for s, f, b in zip(plan.stages, forward, backward)],
                        step_overhead_s=0.0, optimizer_step_s=0.0).predict_step()
    found = calibration.Calibration(forward, backward, None, explained + 0.005, explained, steps=3)
    calibrated = calibration.calibrated(plan, found)
    if device == "cpu":
        assert calibrated.step_overhead_s == plan.step_overhead_s
    else:
        assert calibrated.step_overhead_s == pytest.approx(0.005)
        assert calibrated.predict_step() == pytest.approx(found.pipelined_step_s + plan.optimizer_step_s)
        # the micro-batches alone took longer than pipelined (a host launching behind a device it
        # waits on): the stage times are scaled to the pipelined step, their ratios kept
        quicker = calibration.calibrated(plan, replace(found, pipelined_step_s=explained / 2))
        assert quicker.predict_step() == pytest.approx(explained / 2 + plan.optimizer_step_s, rel=2e-3)
        assert quicker.step_overhead_s >= 0.0
        ratios = [s.compute_s / calibrated.stages[0].compute_s for s in calibrated.stages]
        assert [s.compute_s / quicker.stages[0].compute_s for s in quicker.stages] == pytest.approx(ratios)
        assert quicker.stages[0].compute_s < 0.6 * calibrated.stages[0].compute_s


def test_on_accelerators_the_pipelined_steps_are_timed_back_to_back_once_they_stop_getting_quicker():
    """A training loop on an H200 (ResNet-50, 8 micro-batches): its steps, ms. The warm-up runs until
    a step is no quicker than 0.97x the quickest before it; the next ones are timed, and replace
    the pipelined steps of the rounds, whose micro-batches run alone stay."""
    loop = iter([469, 149, 139, 120, 119, 129, 115, 116, 110, 125, 115, 110, 111])
    rounds = [(0.5, [{"alone": float(r)}], [[]]) for r in range(3)]
    reporter = Progress(3, enabled=False, label="calibrating", unit="steps")
    timed = calibration._with_steps_back_to_back(rounds, lambda: (next(loop) / 1e3, [["step"]]), 3, reporter)
    assert [elapsed for elapsed, _, _ in timed] == pytest.approx([0.129, 0.115, 0.116])
    assert [alone for _, alone, _ in timed] == [alone for _, alone, _ in rounds]
    assert all(steps == [["step"]] for _, _, steps in timed)


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", None), ("zb-h1", 2)])
def test_action_costs_averaged_over_a_step_come_back_as_the_timeline_s_mean_task(name, virtual):
    """A rank times each action as the mean over a step's micro-batches, whose backwards but the
    first added into the stage's gradients: the calibrated stage times take that out, so the plan's
    timeline, which adds it back to all but the first, gives each kind of task its measured mean."""
    from lightning_antichain.planner.process_calibration import _timed_as
    from lightning_antichain.plans.process_schedules import process_schedule

    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    cost.graph.update(task_overhead_s=1e-4, accumulate_s_per_byte=5e-8)
    table = process_schedule(name, virtual).table(2, 4)
    plan = la.partition(cost, table.stages, chunks=4)
    assert sum(plan.prediction.accumulation_s(s) > 0 for s in plan.stages) >= 2
    phases = {t.phase for tasks in table.order for t in tasks}
    costs = {(phase, k): 0.01 * (1 + k) + 0.001 * i for k in range(plan.num_stages)
             for i, phase in enumerate(sorted(phases))}
    calibrated = _timed_as(plan, costs, {})
    duration = calibrated.prediction.durations(table)
    for (phase, k), measured in costs.items():
        tasks = [t for order in table.order for t in order if t.phase == phase and t.stage == k]
        assert sum(duration(t) for t in tasks) / len(tasks) == pytest.approx(measured), (phase, k)
