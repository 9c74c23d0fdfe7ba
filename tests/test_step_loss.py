"""Stages as processes compute the training step's loss on the last stage: the planner times it
from the step itself and charges it to the output it reads, so that the cut gives that stage less."""

import lightning as L
import torch
import torchmetrics
from torch import nn

from lightning_antichain.planner.planning import plan_model
from lightning_antichain.processes.micro_batch_steps import MicroBatchSteps
from lightning_antichain.processes.step_logs import metric_states, metrics_kept
from lightning_antichain.processes.step_loss import step_loss


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 4)
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.acc(logits.argmax(-1), y)
        self.log("acc", self.acc)
        return {"loss": nn.functional.cross_entropy(logits, y)}


def test_the_step_s_loss_of_an_output_is_on_the_batch_s_first_samples_as_many_as_it_holds():
    module = Classifier()
    steps = MicroBatchSteps(module, "Classifier.forward")
    module.forward = steps.forward
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    loss = step_loss(steps, "training_step", (x, y), (0,))
    before = metric_states(module)
    with metrics_kept(module):
        for samples in (5, 3, 2, 1):  # 5 split as the pipeline splits it: 1, 2 (3 + 2) or 3 chunks (2 + 2 + 1)
            output = torch.randn(samples, 4, requires_grad=True)
            assert torch.equal(loss(output), nn.functional.cross_entropy(output, y[:samples]))
        assert metric_states(module)["acc"]["_update_count"] == 4  # the step ran, metrics and all
        assert loss(torch.randn(4, 4, requires_grad=True)) is None  # no split of 5 starts with 4
    assert metric_states(module)["acc"]["_update_count"] == before["acc"]["_update_count"] == 0
    assert "log" not in vars(module)  # what it logged was dropped, and the method is back
    assert step_loss(steps, "training_step", (x, y), (0,))(torch.randn(5, 4)) is None  # nothing to differentiate


class Skipping(Classifier):
    def training_step(self, batch, batch_idx):
        return None if batch_idx else super().training_step(batch, batch_idx)


def test_a_step_that_skips_or_fails_gives_no_loss_to_charge():
    module = Skipping()
    steps = MicroBatchSteps(module, "Skipping.forward")
    module.forward = steps.forward
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    assert step_loss(steps, "training_step", (x, y), (1,))(torch.randn(4, 4, requires_grad=True)) is None
    assert step_loss(steps, "training_step", (x, y[:1]), (0,))(torch.randn(4, 4, requires_grad=True)) is None


def test_a_loss_given_to_planning_is_charged_to_the_output_and_the_cut_gives_the_last_stage_less(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)), nn.Linear(256, 64))
    x, y = torch.randn(16, 256), torch.randint(0, 64, (16,))

    def heavy(output):  # a loss with work of its own: several of the model's layers' worth
        total = nn.functional.cross_entropy(output, y[: len(output)])
        for _ in range(30):
            total = total + nn.functional.cross_entropy(output @ torch.ones(64, 64) / 64, y[: len(output)])
        return total

    settings = dict(chunks=2, calibrate=False, rebalance_rounds=0, profile_cache=tmp_path, progress=False)
    without = plan_model(model, (x[:8],), {}, ["cpu", "cpu"], **settings)
    given = plan_model(model, (x[:8],), {}, ["cpu", "cpu"], loss=heavy, **settings)  # the same profile, cached
    out = max(given.cost.nodes, key=lambda v: given.cost.nodes[v].get("order", 0))
    added = given.cost.nodes[out]["forward_s"] - without.cost.nodes[out]["forward_s"]
    assert added > 0 and given.cost.nodes[out]["backward_s"] > without.cost.nodes[out]["backward_s"]
    assert sum(s.compute_s for s in given.plan.stages) > sum(s.compute_s for s in without.plan.stages) + added
    assert given.plan.balance[-1] < without.plan.balance[-1]  # the last stage, computing the loss, holds less
