"""What a model built on meta holds when its stages are made real: buffers made in ``__init__``
keep their values, loaded values win over every reset, partial loads work, and no tensor is ever
used unfilled."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.weights.materialize import own_state

VOCAB, BLOCK, WIDTH, HEADS = 48, 16, 32, 4


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary positions; the mask and the rotary table are buffers
    computed in ``__init__``, non-persistent (in no checkpoint), with no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        half = WIDTH // HEADS // 2
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(half) / half)), persistent=False)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, c = x.size()
        assert t <= BLOCK, f"a sequence of {t} is longer than the block of {BLOCK}"
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        angles = torch.arange(t, device=x.device, dtype=x.dtype)[:, None] * self.inv_freq.to(x.dtype)
        cos, sin = angles.cos(), angles.sin()

        def rotate(u):
            one, two = u.chunk(2, dim=-1)
            return torch.cat([one * cos - two * sin, one * sin + two * cos], dim=-1)

        scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(c // HEADS)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


class Decoder(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([RotaryAttention() for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(WIDTH) for _ in range(layers)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block, norm in zip(self.blocks, self.norms):
            x = x + block(norm(x))
        return self.head(x)


class DecoderLM(L.LightningModule):
    def __init__(self, build_on: str = "default", checkpoint=None) -> None:
        super().__init__()
        self.build_on, self.checkpoint = build_on, checkpoint
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] | None = None

    def configure_model(self) -> None:
        if self.net is None:
            if self.build_on == "meta":
                with torch.device("meta"):
                    self.net = Decoder()
            else:
                self.net = Decoder()
            if self.checkpoint is not None:
                la.load_checkpoint(self.net, self.checkpoint)

    def forward(self, ids):
        return self.net(ids)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = nn.functional.cross_entropy(self(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.initial is None:
            self.initial = {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tokens() -> DataLoader:
    ids = torch.randint(0, VOCAB, (24, 12), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=8)


def plain_losses(initial: dict[str, torch.Tensor], steps: int) -> list[float]:
    model = DecoderLM()
    model.configure_model()
    model.net.double().load_state_dict(initial)
    trainer(devices=1, precision="64-true", max_steps=steps).fit(model, tokens())
    return model.losses


def test_buffers_made_in_init_keep_their_values_and_a_model_only_export_captures_trains_like_plain():
    model = DecoderLM()
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=3)
    fit.fit(model, tokens())
    assert strategy.plan.frontend == "export"  # the assert on t and arange(t) are not fx's
    assert_pipelined(fit)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the Trainer's 64-true builds it
    try:
        real = Decoder()
    finally:
        torch.set_default_dtype(default)
    for (key, buffer), (_, expected) in zip(model.net.named_buffers(), real.named_buffers()):
        assert torch.equal(buffer, expected), key
    torch.testing.assert_close(model.losses, plain_losses(model.initial, 3), rtol=1e-6, atol=0)


def test_buffers_on_meta_that_nothing_can_fill_are_named_with_the_ways_out():
    model = DecoderLM(build_on="meta")  # torch.device("meta"): the buffers lose their values
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False)
    with pytest.raises(la.UninitializedTensorError,
                       match=r"RotaryAttention\) has parameters or buffers on the meta device \(.*inv_freq, .*mask\)"
                             r".*param_init_fn=.*la.load_checkpoint.*la.init_empty_weights"):
        trainer(strategy=strategy, devices=2, precision="64-true", max_steps=1).fit(model, tokens())


def test_param_init_fn_fills_what_has_no_reset_parameters_once_per_module():
    seen: list[str] = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        if isinstance(module, RotaryAttention):
            half = WIDTH // HEADS // 2
            module.inv_freq.copy_(1.0 / (10000 ** (torch.arange(half) / half)))
            module.mask.copy_(torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()

    model = DecoderLM(build_on="meta")
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, param_init_fn=init)
    trainer(strategy=strategy, devices=2, precision="64-true", max_steps=3).fit(model, tokens())
    assert sorted(seen) == sorted(type(m).__name__ for m in model.net.modules() if own_state(m))
    assert torch.equal(model.net.blocks[0].mask, torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))
    torch.testing.assert_close(model.losses, plain_losses(model.initial, 3), rtol=1e-6, atol=0)


class Partial(nn.Module):
    """Fills half of its weight and none of its integer buffer: an incomplete reset."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 16))
        self.register_buffer("index", torch.empty(4, dtype=torch.long))

    def reset_parameters(self) -> None:
        self.weight[:2].normal_()

    def forward(self, x):
        return x + self.weight.sum(0) + self.index.sum()


def plan_for(model_builder, example: torch.Tensor, stages: int = 2) -> la.Plan:
    cost = la.profile(model_builder(), example, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    return la.partition(cost, stages, chunks=2)


def test_a_reset_that_fills_a_tensor_in_part_or_not_at_all_is_refused_by_name():
    build = lambda: nn.Sequential(nn.Linear(16, 16), Partial(), nn.Linear(16, 4))  # noqa: E731
    plan = plan_for(build, torch.randn(4, 16))
    with torch.device("meta"):
        model = build()
    with pytest.raises(la.UninitializedTensorError, match=r"1.weight, 1.index \(Partial\) on cpu were not filled by "
                                                          r"reset_parameters\(\)"):
        la.Pipeline(model, plan, chunks=2)


POISON = 123456


def test_no_parameter_or_buffer_keeps_the_memory_it_was_given(monkeypatch):
    """Memory is poisoned as it is handed out; after the stages are real, no tensor holds the
    poison anywhere: each was written by an initialisation or a checkpoint."""
    empty_like = torch.empty_like

    def poisoned(tensor, *args, **kwargs):
        out = empty_like(tensor, *args, **kwargs)
        if not out.is_meta:
            out.fill_(True if out.dtype == torch.bool else POISON)
        return out

    transformers = pytest.importorskip("transformers")
    builds = {
        "decoder": (Decoder, torch.randint(0, VOCAB, (4, 12))),
        "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False)), torch.randint(0, 64, (4, 12))),
    }
    for name, (build, example) in builds.items():
        with la.init_empty_weights():
            model = build()
        plan = la.partition(la.profile(model, example, repeats=1, warmup=0, progress=False, runtime_overhead=False),
                            2, chunks=2)  # from the model on meta: its capture (SDPA's strides) is the one that runs
        state = model.state_dict()
        half = dict(list(state.items())[: len(state) // 2])  # a partial checkpoint: the rest by initialisation
        la.load_state_dict(model, {k: torch.full_like(v, 0.5, device="cpu") for k, v in half.items()}, strict=False)
        monkeypatch.setattr(torch, "empty_like", poisoned)
        with la.Pipeline(model, plan, chunks=2) as pipe, torch.no_grad():
            pipe(example)  # an exported plan places its stages on the first call
        monkeypatch.setattr(torch, "empty_like", empty_like)
        for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            assert not tensor.is_meta, (name, key)
            if tensor.dtype != torch.bool:
                assert not (tensor == POISON).any(), f"{name}: {key} was never written"
            if key in half:
                assert (tensor == 0.5).all(), f"{name}: {key} lost its loaded value"


class Block(nn.Module):
    """A parent whose ``reset_parameters()`` resets its children too, and whose own parameter the
    graph reads directly."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(16))
        self.inner = nn.Linear(16, 16)
        self.outer = nn.Linear(16, 16)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)
        self.inner.reset_parameters()
        self.outer.reset_parameters()

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x))) * self.scale


def build_blocks() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), Block(), nn.Tanh(), Block(), nn.Linear(16, 4)).double()


@pytest.mark.parametrize("stages", [2, 3])
def test_a_parent_reset_never_overwrites_loaded_children_and_partial_loads_work(stages):
    torch.manual_seed(0)
    reference = build_blocks()
    plan = plan_for(build_blocks, torch.randn(4, 16, dtype=torch.float64), stages)
    children = {k: v for k, v in reference.state_dict().items() if ".inner." in k or ".outer." in k or k[0] in "04"}
    with la.init_empty_weights():
        model = build_blocks()
    keys = la.load_state_dict(model, children, strict=False)
    assert keys.missing_keys == ["1.scale", "3.scale"] and not keys.unexpected_keys
    with la.Pipeline(model, plan, chunks=2) as pipe:
        for key, value in children.items():
            assert torch.equal(model.state_dict()[key], value), f"{key} was overwritten by its parent's reset"
        assert torch.equal(model[1].scale, torch.ones(16, dtype=torch.float64))  # the parent's own, from its reset
        x = torch.randn(6, 16, dtype=torch.float64)
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-12, atol=0)


def test_resuming_a_model_with_non_persistent_buffers_built_on_meta_continues_as_plain_lightning_does(tmp_path):
    """The checkpoint holds the parameters and optimizer state, not the mask and rotary tables:
    those keep the values ``__init__`` gave them."""
    def run(steps: int, initial=None, ckpt_path=None) -> DecoderLM:
        model = DecoderLM()
        if initial is None:
            strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True)
            fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=steps)
        else:
            model.configure_model()
            model.net.double().load_state_dict(initial)
            fit = trainer(devices=1, precision="64-true", max_steps=steps)
        fit.fit(model, tokens(), ckpt_path=ckpt_path)
        if ckpt_path is None:
            fit.save_checkpoint(tmp_path / f"{'plain' if initial is not None else 'pipelined'}.ckpt")
        return model

    first = run(3)
    saved = torch.load(tmp_path / "pipelined.ckpt", weights_only=True)
    assert not any("mask" in k or "inv_freq" in k for k in saved["state_dict"])
    resumed = run(6, ckpt_path=tmp_path / "pipelined.ckpt")
    plain_first = run(3, first.initial)
    plain_resumed = run(6, first.initial, tmp_path / "plain.ckpt")
    torch.testing.assert_close(first.losses + resumed.losses, plain_first.losses + plain_resumed.losses, rtol=1e-6,
                               atol=0)


class ViTClassifier(L.LightningModule):
    """torchvision's ViT (export captures it: fx cannot) built on meta and loaded from a file."""

    def __init__(self, checkpoint=None) -> None:
        super().__init__()
        self.checkpoint, self.net = checkpoint, None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = vit()
            if self.checkpoint is not None:
                la.load_checkpoint(self.net, self.checkpoint)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def vit() -> nn.Module:
    import torchvision

    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                                mlp_dim=64, num_classes=10)


def test_torchvision_vit_built_on_meta_and_loaded_trains_like_plain(tmp_path):
    torch.manual_seed(0)
    state = {k: v.double() for k, v in vit().state_dict().items()}
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}  # the head starts at zero otherwise
    torch.save(state, tmp_path / "vit.pt")
    images = DataLoader(TensorDataset(torch.randn(24, 3, 32, 32), torch.randint(0, 10, (24,))), batch_size=8)
    model = ViTClassifier(tmp_path / "vit.pt")
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, empty_init=True, module="net")
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=3)
    fit.fit(model, images)
    assert strategy.plan.frontend == "export"
    assert_pipelined(fit)
    plain = ViTClassifier()
    plain.configure_model()
    plain.net.double().load_state_dict(state)
    trainer(devices=1, precision="64-true", max_steps=3).fit(plain, images)
    torch.testing.assert_close(model.losses, plain.losses, rtol=1e-6, atol=0)
