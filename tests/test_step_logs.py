"""What a step run once per micro-batch logs: one value per name, weighted by samples, and
torchmetrics objects by their state, which moves between processes by value."""

import lightning as L
import pytest
import torch
import torchmetrics

from lightning_antichain.processes.micro_batch_steps import MicroBatchSteps
from lightning_antichain.processes.step_logs import (
    MetricLogged,
    StepLogs,
    metric_states,
    set_metric_states,
    unsynced,
)


class Logging(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("count", float(len(x)))
        self.acc(logits.argmax(-1), y)
        self.log("acc", self.acc, on_step=False, on_epoch=True)
        return loss


def test_a_name_logged_per_micro_batch_becomes_its_sample_weighted_mean():
    module = Logging()
    logs = StepLogs()
    for samples, value in [(3, 1.0), (1, 5.0)]:
        with logs.recording(module, samples):
            module.log("loss", torch.tensor(value, dtype=torch.float64), prog_bar=True, batch_size=99)
    ((name, (mean, dtype), options),) = logs.merged()
    assert name == "loss" and mean == pytest.approx((3 * 1.0 + 1 * 5.0) / 4) and dtype == "float64"
    assert options == {"prog_bar": True}  # the whole batch's size is given when it is logged
    assert "log" not in vars(module)  # the method is back


def test_the_step_runs_once_per_micro_batch_with_the_module_answering_and_logs_recorded():
    module = Logging()
    steps = MicroBatchSteps(module, "Logging.forward")
    module.forward = steps.forward
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    args, kwargs = steps.call_of("training_step", (x, y), (0,))
    assert args[0] is x and kwargs == {}
    logs = StepLogs()
    output = torch.randn(4, 2, requires_grad=True)
    loss = steps.result_of("training_step", (x, y), (0,), output, logs, 4)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(output, y))
    merged = {name: value for name, value, _ in logs.merged()}
    assert merged["acc"] == MetricLogged("acc") and merged["count"][0] == 4.0
    with pytest.raises(RuntimeError, match="outside training_step"):
        module(x)


def test_a_step_that_never_calls_the_module_is_a_clear_error():
    class Skipping(Logging):
        def training_step(self, batch, batch_idx):
            return batch[0].sum()

    module = Skipping()
    steps = MicroBatchSteps(module, "Skipping.forward")
    with pytest.raises(RuntimeError, match="never called Skipping.forward"):
        steps.call_of("training_step", (torch.randn(2, 3), torch.zeros(2)), (0,))


def test_metric_states_move_by_value_and_compute_alike_without_syncing():
    source, target = Logging(), Logging()
    preds, labels = torch.tensor([0, 1, 1, 1]), torch.tensor([0, 1, 0, 1])
    source.acc.update(preds, labels)
    unsynced(target)
    set_metric_states(target, metric_states(source))
    assert target.acc.compute() == source.acc.compute() == 0.75
    assert target.acc._update_count == 1 and not target.acc.sync_on_compute


def test_values_logged_per_micro_batch_reduce_by_their_reduce_fx():
    from lightning_antichain.processes.step_logs import averaged_logs, reduced

    assert reduced([1.0, 5.0], [3, 1], "mean") == pytest.approx(2.0)
    assert reduced([1.0, 5.0], [3, 1], "sum") == 6.0 and reduced([1.0, 5.0], [3, 1], torch.sum) == 6.0
    assert reduced([1.0, 5.0], [3, 1], "max") == 5.0 and reduced([1.0, 5.0], [3, 1], torch.min) == 1.0
    module = Logging()
    logs = StepLogs()
    for samples, value in [(3, 1.0), (1, 5.0)]:
        with logs.recording(module, samples):
            module.log("seen", float(samples), reduce_fx="sum")
            module.log("peak", torch.tensor(value), reduce_fx="max")
    merged = {name: value for name, value, _ in logs.merged()}
    assert merged == {"seen": (4.0, None), "peak": (5.0, "float32")}  # a Python number stays one
    shares = averaged_logs([logs.merged(), logs.merged()], [4, 4])
    assert {name: value for name, value, _ in shares} == {"seen": (8.0, None), "peak": (5.0, "float32")}


def test_a_metrics_value_for_the_step_is_the_whole_batchs():
    """Lightning logs a metric on_step as its value for the batch: with the step run per
    micro-batch, that is a copy's, updated by every micro-batch's call, not the last call's."""
    from lightning_antichain.processes.step_logs import StepValues, set_step_values

    module, other = Logging(), Logging()
    values = StepValues()
    preds, labels = torch.tensor([0, 1, 1, 1]), torch.tensor([0, 1, 0, 0])
    for _step in range(2):  # the copy starts again each step
        with values.watching(module):
            for part in (slice(0, 2), slice(2, 4)):
                module.acc(preds[part], labels[part])
        assert module.acc._forward_cache == 0.0  # the last micro-batch's own value
        assert "forward" not in vars(module.acc)
        found = values.values()
        assert found["acc"].item() == 0.5  # the whole batch's
        set_step_values(other, found)
        assert other.acc._forward_cache.item() == 0.5
    assert module.acc.compute().item() == 0.5 and module.acc._update_count == 4  # the epoch's state as before
