"""A model built without memory trains through the real Trainer, never whole in one place."""

import lightning as L
import pytest
import torch
from lit_models import loader, trainer
from live_bytes import LiveBytes
from pipelined import assert_pipelined
from torch import nn

import lightning_antichain as la
from lightning_antichain.runtime import captures

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

    def placing(stages):  # the counter's peak up to the moment the stages are placed
        peaks.append(live.peak["cpu"])
        place(stages)

    monkeypatch.setattr(captures, "place_stages", placing)
    model = Deep()
    steps = 6
    strategy = la.AntichainPipelineStrategy(chunks=4, use_profile_cache=False, empty_init=True)
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
    strategy = la.AntichainPipelineStrategy(chunks=4, use_profile_cache=False)
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
