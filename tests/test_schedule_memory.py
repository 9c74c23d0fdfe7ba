"""What a schedule keeps in memory, as the planner charges it: under 1F1B stage k holds at most
K - k micro-batches' activations, and the DP checks each stage's memory limit as the stage it is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from launch import script_command
from models import SequentialCNN

import lightning_antichain as la
from lightning_antichain.planner.cost_model import InfeasiblePlanError


@pytest.fixture(scope="module")
def cost():
    torch.manual_seed(0)
    return la.profile(SequentialCNN(), torch.randn(4, 3, 16, 16), repeats=1, warmup=0, progress=False)


def held_bytes(plan: la.Plan, stage: la.Stage) -> int:
    trainable = stage.param_bytes - stage.frozen_bytes
    state = int(trainable * (2 + plan.optimizer_multiplier)) + stage.frozen_bytes + stage.buffer_bytes
    return stage.memory_bytes - state - stage.joined_output_bytes - stage.loss_workspace_bytes


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_under_1f1b_stage_k_holds_k_minus_k_micro_batches(cost, recompute):
    for schedule, held in (("gpipe", [8, 8, 8]), ("1f1b", [3, 2, 1])):
        plan = la.partition(cost, 3, chunks=8, schedule=schedule, recompute=recompute)
        assert plan.schedule == schedule
        for stage, n in zip(plan.stages, held):
            kept = (stage.kept_input_bytes * (n - 1) + stage.activation_bytes if recompute != "never" and n > 1
                    else stage.activation_bytes * n)
            assert held_bytes(plan, stage) == pytest.approx(kept, abs=2)


def test_a_limit_gpipe_cannot_meet_is_met_under_1f1b_stage_by_stage(cost):
    free = la.partition(cost, 3, chunks=8)
    limit = max(s.memory_bytes for s in free.stages) * 0.5
    with pytest.raises(InfeasiblePlanError):
        la.partition(cost, 3, chunks=8, memory_gb=limit / 1e9)
    fits = la.partition(cost, 3, chunks=8, memory_gb=limit / 1e9, schedule="1f1b")
    assert all(s.memory_bytes <= limit for s in fits.stages)


def test_the_predicted_step_follows_the_schedule(cost):
    gpipe = la.partition(cost, 3, chunks=8)
    one_f_one_b = la.partition(cost, 3, chunks=8, schedule="1f1b")
    assert one_f_one_b.predicted_step_s == pytest.approx(one_f_one_b.predict_step())
    assert {t.task for t in one_f_one_b.timeline()} == {t.task for t in gpipe.timeline()}
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        la.partition(cost, 3, chunks=8, schedule="pipedream")


def test_la_plan_plans_for_the_schedule_and_does_not_run_it_in_process():
    """The one planning path takes schedule= like every option; a 1F1B plan is not calibrated,
    since calibration runs the in-process runtime, which runs GPipe."""
    torch.manual_seed(0)
    model = SequentialCNN()
    x = torch.randn(16, 3, 16, 16)
    plan = la.plan(model, x, ["cpu"] * 3, chunks=8, schedule="1f1b", use_profile_cache=False, progress=False)
    assert plan.schedule == "1f1b" and plan.calibration is None
    stages = plan.stages
    assert stages[0].memory_bytes - stages[0].param_bytes * 4 - stages[0].buffer_bytes == stages[0].activation_bytes * 3
    with pytest.raises(ValueError, match="schedule must be one of"):
        la.plan(model, x, ["cpu"] * 3, chunks=8, schedule="zb-h3")


def test_the_first_stage_holds_the_joined_output_and_its_gradient_where_one_process_takes_the_loss(cost):
    """In process (GPipe) the micro-batches' outputs are joined on the first stage's device and the
    whole batch's gradient comes back there: 2 x chunks x one micro-batch's output, on stage 0
    alone, and the loss's workspace (two more) meets all the stage keeps; under 1F1B each
    micro-batch's loss is taken on the last stage and nothing is joined."""
    output = sum(cost.nodes[v]["output_bytes"] for v in cost.graph["outputs"])
    assert output > 0
    joined = la.partition(cost, 3, chunks=8, schedule="gpipe")
    apart = la.partition(cost, 3, chunks=8, schedule="1f1b")
    assert [s.joined_output_bytes for s in joined.stages] == [2 * 8 * output, 0, 0]
    assert [s.loss_workspace_bytes for s in joined.stages] == [2 * 8 * output, 0, 0]
    assert [(s.joined_output_bytes, s.loss_workspace_bytes) for s in apart.stages] == [(0, 0)] * 3
    first = joined.stages[0]
    state = int((first.param_bytes - first.frozen_bytes) * (2 + joined.optimizer_multiplier)) + first.buffer_bytes
    assert first.memory_bytes == state + first.frozen_bytes + 8 * first.activation_bytes + 4 * 8 * output


@pytest.mark.parametrize("recompute", ["except_last", "always"])
def test_the_loss_workspace_meets_what_the_stage_keeps_at_the_loss_backward(cost, recompute):
    """The loss's backward runs before any stage's: ``except_last`` then keeps its last micro-batch
    whole, so the workspace adds in full; ``always`` keeps only inputs then, so the workspace adds
    only as far as it rises above the stage's later peak at a recomputation."""
    output = sum(cost.nodes[v]["output_bytes"] for v in cost.graph["outputs"])
    first = la.partition(cost, 3, chunks=8, schedule="gpipe", recompute=recompute).stages[0]
    peak_at_recompute = 7 * first.kept_input_bytes + first.activation_bytes
    at_loss = (8 * first.kept_input_bytes if recompute == "always" else peak_at_recompute) + 2 * 8 * output
    assert first.loss_workspace_bytes == max(0, at_loss - peak_at_recompute)
    state = int((first.param_bytes - first.frozen_bytes) * (2 + 2.0)) + first.buffer_bytes + first.frozen_bytes
    assert first.memory_bytes == state + max(peak_at_recompute, at_loss) + 2 * 8 * output


@pytest.mark.processes
def test_under_1f1b_stage_0_of_2_ranks_keeps_2_of_8_micro_batches_saved_for_backward_through_the_trainer(tmp_path):
    """Counted by autograd's saved-tensor hooks on each rank from the second step on (the first also
    plans): 1F1B keeps 2 of the 8 micro-batches in flight on the first of 2 ranks, 1 on the last,
    where GPipe keeps all 8 on both. The batch is left out of the count: it is Lightning's, held for
    the step under any schedule, and each micro-batch is a view of it, whose storage counted whole
    made 1F1B's 0.25 read 0.40."""
    script = Path(__file__).resolve().parent / "scripts" / "held_for_backward.py"
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        out = tmp_path / schedule
        out.mkdir()
        result = subprocess.run(script_command(script, ["--out", str(out), "--schedule", schedule], 2),
                                capture_output=True, text=True, timeout=300, cwd=out)
        assert result.returncode == 0, result.stderr[-3000:]
        peaks[schedule] = [json.loads((out / f"rank{r}.json").read_text())["peaks"][1:] for r in (0, 1)]
    for rank, kept in ((0, 2), (1, 1)):
        assert len(set(peaks["1f1b"][rank])) == 1 and len(set(peaks["gpipe"][rank])) == 1  # every step alike
        ratio = peaks["1f1b"][rank][0] / peaks["gpipe"][rank][0]
        assert ratio == pytest.approx(kept / 8, abs=0.02), (rank, peaks)
