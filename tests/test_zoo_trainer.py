"""The zoo through the second user path: the real Trainer with the strategy on 2 CPU devices.

Every zoo model is wrapped in a LightningModule as a user would write one (``self.net``, a loss
on what it returns) and trained a few steps in float64, pipelined with ``module="net"`` and
plain, from the same initial weights; the per-step losses must agree within rtol 1e-6. The model
keeps the mode its entry runs in (eval: dropout off, BatchNorm on running statistics; GoogLeNet in
training mode with BatchNorm in eval mode), since micro-batches change batch statistics.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.utils._pytree as pytree
from lit_models import trainer
from pipelined import assert_pipelined
from torch.utils.data import DataLoader, Dataset
from zoo import ZOO, modes_set

import lightning_antichain as la

RESULTS: dict[str, str] = {}
STEPS, BATCH, CHUNKS = 3, 8, 4


class Samples(Dataset):
    """The samples of one zoo batch, each an ``(args, kwargs)`` pair the default collate joins back."""

    def __init__(self, call: tuple[tuple, dict]) -> None:
        self.call = call
        self.size = len(next(t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor)))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[tuple, dict]:
        return pytree.tree_map(lambda t: t[i], self.call)


class ZooModule(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.entry = ZOO[name]
        self.net = modes_set(self.entry.build(), self.entry.train)
        self.losses: list[float] = []

    def train(self, mode: bool = True) -> ZooModule:
        super().train(mode)
        modes_set(self.net, self.entry.train)  # the entry's mode, whatever the loop asks for
        return self

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)

    def training_step(self, batch: tuple[tuple, dict], batch_idx: int) -> torch.Tensor:
        args, kwargs = batch
        outputs = [t for t in pytree.tree_leaves(self(*args, **kwargs))
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        loss = sum((t - 1).square().mean() for t in outputs)  # away from 0: some heads start at zero
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class MetaZooModule(ZooModule):
    """The same model built in ``configure_model()`` on meta (the strategy's ``empty_init``) and
    loaded from the plain model's initial weights, as a pretrained checkpoint goes in."""

    def __init__(self, name: str, initial: dict[str, torch.Tensor]) -> None:
        L.LightningModule.__init__(self)
        self.entry, self.initial, self.net = ZOO[name], initial, None
        self.losses = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = modes_set(self.entry.build(), self.entry.train)
            la.load_state_dict(self.net, self.initial)


def _losses(name: str, strategy, meta: bool = False) -> tuple[list[float], L.Trainer]:
    torch.manual_seed(0)
    model = ZooModule(name)
    if meta:
        model = MetaZooModule(name, {k: v.double() if v.is_floating_point() else v
                                     for k, v in model.net.state_dict().items()})
    torch.manual_seed(1)
    data = DataLoader(Samples(ZOO[name].batch(BATCH * STEPS)), batch_size=BATCH)
    devices = 1 if strategy == "auto" else 2
    fit = trainer(strategy=strategy, devices=devices, precision="64-true", max_steps=STEPS)
    fit.fit(model, data)
    return model.losses, fit


@functools.cache
def _plain_losses(name: str) -> tuple[float, ...]:
    return tuple(_losses(name, "auto")[0])


#: the longest through the Trainer, under -m slow (the default suite keeps each capture path, decoders,
#: encoders and an encoder-decoder through it); every model's capture and gradients stay in the default
#: suite (test_zoo.py)
SLOW_THROUGH_THE_TRAINER = {"densenet121", "googlenet_train", "hf_albert", "hf_clip", "hf_mistral", "hf_mixtral",
                            "hf_phi", "hf_qwen2", "hf_t5", "hf_vit", "hf_wav2vec2", "mobilenet_v3_small",
                            "timm_convnext", "timm_regnet", "timm_swin"}  # (BERT and two ViTs stay)


def _marks(name: str) -> list:
    return [pytest.mark.slow] if ZOO[name].slow or name in SLOW_THROUGH_THE_TRAINER else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(ZOO)])
def test_zoo_model_trains_through_the_trainer_like_plain_lightning(name):
    RESULTS[name] = "failed"
    plain = list(_plain_losses(name))
    assert len(plain) == STEPS and plain[-1] != plain[0]  # it trains: the comparison is not of constants
    strategy = la.AntichainPipelineStrategy(chunks=CHUNKS, module="net", profile_cache=False, calibrate=False)
    losses, fit = _losses(name, strategy)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-6, atol=0)
    assert fit.strategy.plan.num_stages == 2
    assert {stage for stage, _ in assert_pipelined(fit)} == {0, 1}
    RESULTS[name] = fit.strategy.plan.frontend


META_BY_DEFAULT = {"hf_llama", "hf_gpt2", "hf_bart"}  # a decoder, a tied head, an encoder-decoder
HUGGING_FACE = [pytest.param(n, marks=[] if n in META_BY_DEFAULT else [pytest.mark.slow])
                for n in sorted(ZOO) if ZOO[n].library == "transformers"]


@pytest.mark.parametrize("name", HUGGING_FACE)
def test_zoo_hugging_face_model_built_on_meta_and_loaded_trains_like_plain_lightning(name):
    plain = list(_plain_losses(name))
    strategy = la.AntichainPipelineStrategy(chunks=CHUNKS, module="net", profile_cache=False, calibrate=False,
                                            empty_init=True)
    losses, fit = _losses(name, strategy, meta=True)
    assert not any(t.is_meta for t in fit.lightning_module.net.state_dict().values())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-6, atol=0)
    assert {stage for stage, _ in assert_pipelined(fit)} == {0, 1}

