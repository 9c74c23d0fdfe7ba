"""A model built without memory trains through the real Trainer, never whole in one place."""

import lightning as L
import pytest
import torch
from lit_models import loader, trainer
from live_bytes import LiveBytes
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.in_process import captures
from lightning_antichain.in_process.budget import StageOverBudgetError, state_bytes
from lightning_antichain.weights.materialize import meta_attributes

WIDTH, LAYERS = 256, 8


def build() -> nn.Sequential:
    layers = [nn.Linear(16, WIDTH), nn.Tanh()]
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


class Deep(L.LightningModule):
    """Builds its network in ``configure_model()`` (``how="configure_model"``), in ``__init__`` on
    meta (``"meta"``), or takes it from the caller (``"given"``)."""

    def __init__(self, how: str = "configure_model", net: nn.Module | None = None) -> None:
        super().__init__()
        self.how = how
        self.net = net
        if how == "meta":
            with torch.device("meta"):
                self.net = build().double()
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.initial is None:  # the weights the first step started from
            self.initial = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def plain_losses(initial: dict[str, torch.Tensor], steps: int) -> list[float]:
    net = build().double()
    plain = Deep("given", net)
    plain.load_state_dict(initial)
    trainer(devices=1, precision="64-true", max_steps=steps).fit(plain, loader())
    return plain.losses


def test_a_model_built_in_configure_model_is_never_whole_before_its_stages_and_trains_like_plain(monkeypatch):
    peaks: list[int] = []
    place = captures.place_stages

    def placing(stages, *args):  # the counter's peak up to the moment the stages are placed
        peaks.append(live.peak["cpu"])
        place(stages, *args)

    monkeypatch.setattr(captures, "place_stages", placing)
    model = Deep()
    steps = 6
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=steps)
    with LiveBytes() as live:
        fit.fit(model, loader())
    whole = parameter_bytes(model)
    assert whole == parameter_bytes(build().double())
    assert peaks and peaks[0] < whole / 2, f"{peaks[0]} bytes were live before placement, the model has {whole}"
    assert {stage for stage, _ in assert_pipelined(fit)} == {0, 1}
    assert all(not t.is_meta for t in model.state_dict().values())
    assert model.initial is not None and len(model.losses) == steps
    torch.testing.assert_close(model.losses, plain_losses(model.initial, steps), rtol=1e-6, atol=0)


@pytest.mark.parametrize("how", ["init_module", "meta"])
def test_a_model_built_on_meta_another_way_trains_like_plain(how):
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=4)
    if how == "init_module":
        with fit.init_module(empty_init=True):
            model = Deep("given", build())
    else:
        model = Deep("meta")
    assert all(p.is_meta for p in model.parameters())
    fit.fit(model, loader())
    assert all(not t.is_meta for t in model.state_dict().values())
    torch.testing.assert_close(model.losses, plain_losses(model.initial, 4), rtol=1e-6, atol=0)


def training_bytes(module: nn.Module) -> int:
    """Parameters, gradients and SGD momentum."""
    return 3 * parameter_bytes(module)


def budget_run(memory_gb: float, batches: list[int], measured: "MeasuredStages | None" = None,
               balance: list[int] | None = None) -> L.Trainer:
    torch.manual_seed(0)
    x, y = torch.randn(sum(batches), 16), torch.randint(0, 4, (sum(batches),))
    starts = [sum(batches[:i]) for i in range(len(batches))]
    data = DataLoader(TensorDataset(x, y), batch_sampler=[list(range(s, s + n)) for s, n in zip(starts, batches)])
    model = Deep()
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True, memory_gb=memory_gb,
                                            balance=balance)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=len(batches),
                  callbacks=[measured or MeasuredStages()])
    fit.fit(model, data)
    return fit


class MeasuredStages(L.Callback):
    """Each stage's bytes after each optimizer step, counted as the planner counts them."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pipeline = trainer.strategy.pipeline
        self.steps.append([state_bytes(stage, trainer.optimizers) + kept
                           for stage, kept in zip(pipeline.stages, pipeline.last_activation_bytes)])


def test_each_stage_fits_a_budget_the_whole_model_does_not():
    whole = training_bytes(build().double())
    budget = 0.6 * whole
    fit = budget_run(budget / 1e9, [16, 16])
    assert fit.strategy.plan.num_stages == 2
    for stage in fit.strategy.plan.stages:
        assert stage.memory_limit_bytes == int(budget)
        assert stage.memory_bytes <= budget
    (measured,) = [c for c in fit.callbacks if isinstance(c, MeasuredStages)]
    assert len(measured.steps) == 2
    assert max(max(step) for step in measured.steps) <= budget < whole
    # to the byte; the joined output, beside the first stage on its device, is the batch's
    beside = [s.joined_output_bytes + s.loss_workspace_bytes for s in fit.strategy.plan.stages]
    assert measured.steps[-1] == [s.memory_bytes - b for s, b in zip(fit.strategy.plan.stages, beside)]


def test_a_budget_no_split_meets_is_refused_with_what_to_change():
    budget = 0.2 * training_bytes(build().double())
    with pytest.raises(la.InfeasiblePlanError, match=r"(?s)on stage \d, [\d.e-]+ GB over its limit.*chunks.*"
                                                     r"recompute='always'"):
        budget_run(budget / 1e9, [16])


def test_a_stage_over_its_budget_at_run_time_is_named():
    """A bigger batch than the one planned for (a bucketing sampler): four times the activations."""
    fit = budget_run(1.0, [16])  # a split and its predicted bytes, without a tight budget
    balance = [len(s.nodes) - (s.index == 0) for s in fit.strategy.plan.stages]  # the input is no operation
    predicted = max(s.memory_bytes for s in fit.strategy.plan.stages)
    measured = MeasuredStages()
    with pytest.raises(StageOverBudgetError, match=r"stage \d on cpu held .* GB over its budget of .*"
                                                   r"micro-batches of 4 samples"):
        budget_run(1.02 * predicted / 1e9, [16, 64], measured, balance)  # the same split, a fixed balance
    assert len(measured.steps) == 1  # the planned batch stayed within it


def test_checkpoints_of_a_model_built_on_meta_go_four_stages_to_two_to_plain_to_four(tmp_path):
    """Each run builds the model on meta (or plainly), resumes from the last one's checkpoint
    (weights straight into the stages, optimizer state once they are placed) and continues with the
    losses of a run that never stopped."""
    def pipelined(devices: int, epochs: int) -> L.Trainer:
        return trainer(strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True),
                       devices=devices, precision="64-true", max_epochs=epochs)

    steps = 5  # an epoch: 80 samples in batches of 16
    first = Deep()
    fit = pipelined(4, 1)
    fit.fit(first, loader(80))
    path = tmp_path / "1.ckpt"
    fit.save_checkpoint(path)

    net = build().double()
    uninterrupted = Deep("given", net)
    uninterrupted.load_state_dict(first.initial)
    trainer(devices=1, precision="64-true", max_epochs=4).fit(uninterrupted, loader(80))
    torch.testing.assert_close(first.losses, uninterrupted.losses[:steps], rtol=1e-6, atol=0)

    plain = lambda: Deep("given", build().double())  # noqa: E731
    for run, (devices, make) in enumerate([(2, Deep), (1, plain), (4, Deep)], start=2):  # run = epochs so far
        saved = torch.load(path, weights_only=True)
        model = make()
        fit = pipelined(devices, run) if devices > 1 else trainer(devices=1, precision="64-true", max_epochs=run)
        fit.fit(model, loader(80), ckpt_path=path)
        assert list(model.initial) == list(saved["state_dict"])
        assert all(torch.equal(model.initial[k], v) for k, v in saved["state_dict"].items())  # every tensor loaded
        torch.testing.assert_close(model.losses, uninterrupted.losses[(run - 1) * steps:run * steps], rtol=1e-6,
                                   atol=0)
        path = tmp_path / f"{run}.ckpt"
        fit.save_checkpoint(path)
    final = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(final, {k: v.cpu() for k, v in uninterrupted.state_dict().items()}, rtol=1e-6,
                               atol=1e-9)


def test_several_stages_on_one_device_share_its_budget_and_train_like_plain():
    torch.manual_seed(0)
    model = Deep()
    budget = training_bytes(build().double())  # per device: two stages of half the model each
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True, placement=[0, 0, 1, 1],
                                            memory_gb=budget / 1e9)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=4)
    fit.fit(model, loader())
    plan = fit.strategy.plan
    assert plan.num_stages == 4
    assert [stage.memory_limit_bytes for stage in plan.stages] == [int(budget / 2)] * 4
    assert {stage for stage, _ in assert_pipelined(fit)} == {0, 1, 2, 3}
    torch.testing.assert_close(model.losses, plain_losses(model.initial, 4), rtol=1e-6, atol=0)


def test_a_placement_naming_a_device_the_pipeline_lacks_is_refused():
    strategy = la.AntichainPipelineStrategy(chunks=4, placement=[0, 1, 2])
    with pytest.raises(ValueError, match=r"placement=\[0, 1, 2\] names device 2, but each pipeline has 2 devices"):
        trainer(strategy=strategy, devices=2, max_steps=1).fit(Deep(), loader())


def test_metrics_built_under_empty_init_keep_their_states_and_metrics_built_on_meta_are_refused():
    from lit_models import TinyClassifier

    fit = trainer(strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False), devices=2, max_steps=2,
                  limit_val_batches=2, val_check_interval=2)
    with fit.init_module(empty_init=True):  # parameters on meta, everything else as usual
        model = TinyClassifier()
    assert all(p.is_meta for p in model.parameters())
    assert not meta_attributes(model)
    fit.fit(model, loader(), loader())
    assert 0.0 <= float(fit.callback_metrics["val_acc"]) <= 1.0

    fit = trainer(strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False), devices=2, max_steps=1)
    with torch.device("meta"):
        model = TinyClassifier()
    with pytest.raises(ValueError, match=r"not parameters or buffers \(val_acc\..*create metrics in __init__"):
        fit.fit(model, loader())


class Centered(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)  # each sample's result depends on its batch


class DeepCentered(Deep):
    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(16, WIDTH), Centered(), nn.Tanh(), nn.Linear(WIDTH, 4))


def test_a_model_on_meta_is_checked_for_batch_dependence_once_its_stages_are_real():
    """Planning cannot run the check on meta tensors; the pipeline's first call does."""
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True)
    with pytest.raises(la.BatchDependenceError):
        trainer(strategy=strategy, devices=2, max_steps=1).fit(DeepCentered(), loader())
