"""chunks="auto" and what the predicted step is made of, checked without timing anything."""

import json

import pytest
import torch
from lit_models import TinyClassifier, loader, trainer
from models import SequentialCNN
from test_cli import run_main
from torch import nn

import lightning_antichain as la
from lightning_antichain.batches.batch_dims import first_micro_batch
from lightning_antichain.planner import overhead, planning


def test_auto_picks_the_count_whose_own_plan_predicts_the_shortest_step(tmp_path):
    model = SequentialCNN()
    batch = torch.randn(16, 3, 16, 16)
    # the counts are weighed on their profiles' splits; the loop then moves only the chosen one's
    auto = planning.plan_model(model, (batch,), {}, ["cpu", "cpu"], chunks="auto", profile_cache=tmp_path,
                               progress=False, rebalance_rounds=0).plan
    rows = auto.candidates
    assert [r["chunks"] for r in rows] == planning.chunk_candidates(16, 2) == [1, 2, 4, 8, 16]
    assert auto.batch_size == 16
    for row in rows:  # each row is the plan of that count on its own micro-batch (profiles from the cache)
        micro = first_micro_batch(model, (batch,), {}, row["chunks"], 0)
        alone = planning.plan_model(model, *micro, ["cpu", "cpu"], chunks=row["chunks"], profile_cache=tmp_path,
                                    progress=False, rebalance_rounds=0)
        assert alone.cached_from is not None
        assert alone.plan.micro_batch_size == row["micro_batch_size"] == -(-16 // row["chunks"])
        assert alone.plan.predicted_step_s == pytest.approx(row["predicted_step_s"])
    best = min(rows, key=lambda r: r["predicted_step_s"])
    assert auto.chunks == best["chunks"] and auto.predicted_step_s == pytest.approx(best["predicted_step_s"])
    assert f"chunks=auto for batches of 16: chose {auto.chunks}" in auto.table()
    assert la.Plan.from_dict(json.loads(auto.to_json())).candidates == rows


def test_auto_keeps_to_the_memory_limit_under_the_recompute_mode(tmp_path):
    model = SequentialCNN()
    batch = torch.randn(16, 3, 16, 16)
    free = planning.plan_model(model, (batch,), {}, ["cpu", "cpu"], chunks="auto", recompute="always",
                               profile_cache=tmp_path, progress=False).plan
    peaks = sorted({r["peak_memory_bytes"] for r in free.candidates})
    assert len(peaks) > 1  # with recomputation, fewer samples per micro-batch hold less
    limit = (peaks[0] + peaks[1]) / 2
    capped = planning.plan_model(model, (batch,), {}, ["cpu", "cpu"], chunks="auto", recompute="always",
                                 memory_gb=limit / 1e9, profile_cache=tmp_path, progress=False).plan
    assert all(s.memory_bytes <= limit for s in capped.stages)
    fitting = [r for r in capped.candidates if r["fits"]]
    assert fitting and len(fitting) < len(capped.candidates)
    assert capped.chunks == min(fitting, key=lambda r: r["predicted_step_s"])["chunks"]
    with pytest.raises(la.InfeasiblePlanError, match="no micro-batch count from 1 to 16 fits"):
        planning.plan_model(model, (batch,), {}, ["cpu", "cpu"], chunks="auto", memory_gb=1e-6,
                            profile_cache=tmp_path, progress=False)


def test_the_strategy_with_auto_trains_runs_and_checkpoints_the_count_it_chose(tmp_path):
    model = TinyClassifier()
    strategy = la.AntichainPipelineStrategy(chunks="auto", profile_cache=str(tmp_path / "cache"))
    fit = trainer(devices=2, strategy=strategy, max_epochs=1, limit_train_batches=3, limit_val_batches=0)
    fit.fit(model, loader(batch_size=16))
    plan = strategy.plan
    assert plan.batch_size == 16 and [r["chunks"] for r in plan.candidates] == [1, 2, 4, 8, 16]
    assert plan.chunks == min((r for r in plan.candidates if r["fits"]), key=lambda r: r["predicted_step_s"])["chunks"]
    assert strategy.pipeline is None  # closed at teardown; the plan stays
    fit.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["antichain_pipeline"]
    assert saved["chunks"] == plan.chunks and saved["requested_chunks"] == "auto"
    assert saved["plan"]["candidates"] == plan.candidates
    with pytest.raises(ValueError, match='or "auto" to let the planner choose'):
        la.AntichainPipelineStrategy(chunks="many")


def test_the_pipeline_runs_as_many_micro_batches_as_its_plan_by_default():
    model = SequentialCNN()
    cost = la.profile(model, torch.randn(2, 3, 16, 16), repeats=1, warmup=0, progress=False)
    with la.Pipeline(model, la.partition(cost, 2, chunks=3)) as pipe:
        assert pipe.chunks == 3
        pipe(torch.randn(6, 3, 16, 16)).sum().backward()
        assert [len(tasks) for tasks in pipe.last_step.ran] == [6, 6]
    with pytest.raises(ValueError, match="a whole number of at least 1.*got 0"):
        la.Pipeline(model, la.partition(cost, 2), chunks=0)


@pytest.mark.slow  # 22 s; auto is tested through the library in the default suite
def test_the_cli_plans_with_auto_and_refuses_it_with_a_saved_profile(tmp_path):
    result = run_main("plan", "torchvision.models.resnet18", "--stages", "2", "--input-shape", "3,32,32",
                      "--batch-size", "8", "--chunks", "auto", "--quiet", "--profile-cache", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "chunks=auto for batches of 8: chose" in result.stdout
    refused = run_main("plan", "torchvision.models.resnet18", "--stages", "2", "--chunks", "auto",
                       "--load-profile", str(tmp_path / "x.json"))
    assert refused.returncode == 2 and "cannot plan from --load-profile" in refused.stderr


def test_the_runtime_overhead_is_measured_once_and_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead, "_measured", {})
    found = overhead.runtime_overhead("cpu", tmp_path)
    assert found.task_s >= 0 and found.step_s >= 0
    (cached,) = tmp_path.glob("overhead-*.json")
    assert overhead.RuntimeOverhead(**json.loads(cached.read_text())) == found
    monkeypatch.setattr(overhead, "_measured", {})
    cached.write_text('{"task_s": -1}')
    again = overhead.runtime_overhead("cpu", tmp_path)
    assert again.task_s >= 0 and json.loads(cached.read_text())["task_s"] == again.task_s


def test_timing_the_optimizer_step_leaves_the_model_and_its_optimizer_alone():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    grads = [p.grad.clone() for p in model.parameters()]
    assert overhead.optimizer_step_s([optimizer]) > 0
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for key, value in optimizer.state[model[0].weight].items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    budgeted = overhead.optimizer_step_s([optimizer], budget_bytes=1)  # the first parameter only, scaled
    assert budgeted > 0


class _SeenGradients(torch.optim.SGD):
    """A real SGD that keeps the gradients it stepped with (per step, in parameter order)."""

    seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        _SeenGradients.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def test_the_optimizer_is_timed_on_the_gradients_of_a_backward_of_the_example(tmp_path):
    """On CPU an optimizer's speed depends on its gradients' values, so planning steps copies with
    the gradients a backward of the example gives, and leaves the model's own gradients alone."""
    torch.manual_seed(0)
    model = SequentialCNN()
    micro = torch.randn(2, 3, 16, 16)
    expected = copy_of_gradients(model, micro)
    optimizer = _SeenGradients(model.parameters(), lr=0.1)
    _SeenGradients.seen.clear()
    plan = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=2, optimizers=[optimizer],
                               profile_cache=tmp_path, progress=False, calibrate=False).plan
    assert plan.optimizer_step_s > 0 and _SeenGradients.seen
    for step in _SeenGradients.seen:
        for seen, want in zip(step, expected, strict=True):
            torch.testing.assert_close(seen, want)
    assert all(p.grad is None for p in model.parameters())


def copy_of_gradients(model, x):
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_stages_in_processes_weigh_only_counts_that_split_the_batch_evenly():
    assert planning.chunk_candidates(24, 2) == [1, 2, 4, 8, 16]
    assert planning.chunk_candidates(24, 2, even=True) == [2, 4, 8]  # torch's schedules: one per stage at least
