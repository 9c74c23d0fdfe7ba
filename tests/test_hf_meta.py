"""A pretrained model bigger than one device, as people bring it: Hugging Face decoders built on
meta in ``configure_model()``, loaded from their checkpoints or initialised as Hugging Face would,
trained through the real Trainer on 2 CPU devices against plain Lightning in float64."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
from lit_models import trainer
from pipelined import assert_pipelined
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, STEPS = 64, 12, 3
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**DECODER, "sliding_window": None}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                   use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)),
}


def build(name: str) -> nn.Module:
    config_name, model_name, config = CONFIGS[name]
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


@functools.cache
def reference_state(name: str) -> dict[str, torch.Tensor]:
    """The 'pretrained' weights: a real build in float64, from a fixed seed."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return {k: v.clone() for k, v in build(name).double().state_dict().items()}


def data() -> DataLoader:
    ids = torch.randint(0, VOCAB, (24, LENGTH), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=8)


class CausalLM(L.LightningModule):
    """Fine-tunes a Hugging Face decoder: built in ``configure_model()`` (on meta under the
    strategy's ``empty_init``), then loaded from ``checkpoint`` if one is given."""

    def __init__(self, name: str, checkpoint: Path | None = None, build_on: str = "default") -> None:
        super().__init__()
        self.name, self.checkpoint, self.build_on = name, checkpoint, build_on
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        if self.build_on == "meta":  # the user's own torch.device("meta"): buffers on meta too
            with torch.device("meta"):
                self.net = build(self.name)
        else:
            self.net = build(self.name)
        if self.checkpoint is not None:
            la.load_checkpoint(self.net, self.checkpoint)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.initial is None:  # the weights the first step started from
            self.initial = {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def plain_losses(name: str, state: dict[str, torch.Tensor]) -> list[float]:
    model = CausalLM(name)
    model.configure_model()
    model.net.double().load_state_dict(state)
    trainer(devices=1, precision="64-true", max_steps=STEPS).fit(model, data())
    return model.losses


def pipelined(model: CausalLM, **options) -> L.Trainer:
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, **options)
    fit = trainer(strategy=strategy, devices=2, precision="64-true", max_steps=STEPS)
    fit.fit(model, data())
    return fit


def save(name: str, directory: Path, form: str) -> Path:
    """The reference weights as a user finds them: a ``torch.save`` file, one safetensors file, or
    Hugging Face's sharded safetensors directory with its index."""
    state = reference_state(name)
    if form == "pt":
        torch.save(state, directory / "weights.pt")
        return directory / "weights.pt"
    model = build(name).double()
    model.load_state_dict(state)
    shard = "2KB" if form == "sharded" else "1GB"
    model.save_pretrained(directory, max_shard_size=shard)
    if form == "sharded":
        assert (directory / "model.safetensors.index.json").exists() and len(list(directory.glob("*.safetensors"))) > 2
        return directory
    return directory / "model.safetensors"


LOADS = [("llama", "sharded"), ("mistral", "safetensors"), ("gpt2", "pt"), ("gpt2", "sharded")]
SLOW_LOADS = [(m, f) for m in CONFIGS for f in ("pt", "safetensors", "sharded") if (m, f) not in LOADS]


@pytest.mark.parametrize("name, form", [*LOADS, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_LOADS)])
def test_a_hugging_face_decoder_built_on_meta_and_loaded_from_its_checkpoint_trains_like_plain(tmp_path, name, form):
    model = CausalLM(name, save(name, tmp_path, form))
    fit = pipelined(model, empty_init=True)
    assert_pipelined(fit)
    assert model.initial is not None
    for key, value in reference_state(name).items():  # every tensor came from the file, none from a reset
        assert torch.equal(model.initial[key], value), key
    if name == "gpt2":
        assert model.net.lm_head.weight is model.net.transformer.wte.weight  # still tied
    torch.testing.assert_close(model.losses, plain_losses(name, reference_state(name)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["llama", pytest.param("mistral", marks=pytest.mark.slow), "gpt2"])
def test_a_hugging_face_decoder_built_bare_on_meta_is_initialised_as_hugging_face_does(name):
    model = CausalLM(name)
    pipelined(model, empty_init=True)
    assert model.initial is not None
    torch.manual_seed(0)
    real = build(name).double()  # post_init's initialisation
    for key, value in real.state_dict().items():
        got = model.initial[key]
        if value.std() == 0 or value.numel() == 1:  # norms' ones, zero biases: exactly
            assert torch.equal(got, value), key
        else:  # random: the same distribution
            assert abs(got.std() / value.std() - 1) < 0.15, (key, got.std(), value.std())
            assert abs(got.mean()) < 4 * value.std() / value.numel() ** 0.5, key
    for (key, buffer), (_, expected) in zip(model.net.named_buffers(), real.named_buffers()):
        assert torch.equal(buffer.to(expected.dtype), expected), key  # rotary tables made in __init__, not re-drawn
    torch.testing.assert_close(model.losses, plain_losses(name, model.initial), rtol=1e-6, atol=0)


def test_hugging_face_buffers_on_meta_are_made_again_by_its_own_initialisation(tmp_path):
    """Built under the user's own ``torch.device("meta")``, the rotary ``inv_freq`` has no values and
    is in no checkpoint; Hugging Face's ``_init_weights`` computes it again."""
    model = CausalLM("llama", save("llama", tmp_path, "safetensors"), build_on="meta")
    pipelined(model)
    real = build("llama")
    assert torch.equal(model.net.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq.double())
    torch.testing.assert_close(model.losses, plain_losses("llama", reference_state("llama")), rtol=1e-6, atol=0)


def padded_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels with padding set to -100, unevenly: micro-batches hold different counts of tokens."""
    labels = ids.clone()
    lengths = torch.randint(3, LENGTH + 1, (ids.shape[0],), generator=torch.Generator().manual_seed(1))
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    return labels


class OwnLossLM(CausalLM):
    """Trains on the loss the Hugging Face model computes from ``labels=``, as its users do."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.net(input_ids=ids, labels=padded_labels(ids)).loss
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_hugging_face_decoder_trains_on_the_loss_it_computes_from_padded_labels_like_plain(tmp_path, name):
    model = OwnLossLM(name, save(name, tmp_path, "safetensors"))
    fit = pipelined(model, empty_init=True, module="net")
    assert_pipelined(fit)
    plain = OwnLossLM(name)
    plain.configure_model()
    plain.net.double().load_state_dict(reference_state(name))
    trainer(devices=1, precision="64-true", max_steps=STEPS).fit(plain, data())
    # Hugging Face computes the loss in float32 whatever the model's dtype: its rounding, not float64's
    torch.testing.assert_close(model.losses, plain.losses, rtol=1e-6, atol=0)


class WrappedLossLM(CausalLM):
    """Returns the Hugging Face loss from its own forward: a mean over tokens the pipeline cannot
    join exactly across micro-batches of different token counts."""

    def forward(self, ids, labels):
        return self.net(input_ids=ids, labels=labels).loss

    def training_step(self, batch, batch_idx):
        return self(batch[0], padded_labels(batch[0]))


def test_a_token_mean_loss_the_pipeline_cannot_join_exactly_is_refused_with_the_way_out():
    with pytest.raises(la.MicroBatchError, match=r"neither as a mean over samples nor as a sum.*module='net'"):
        pipelined(WrappedLossLM("llama"), empty_init=True)


peft = pytest.importorskip("peft")


class LoraLM(CausalLM):
    """LoRA adapters (peft) on a decoder built on meta, its base loaded from a checkpoint."""

    def configure_model(self) -> None:
        if self.net is None:
            super().configure_model()
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            self.net = peft.get_peft_model(self.net, config)

    def forward(self, ids):
        return self.net(input_ids=ids).logits


def test_lora_adapters_on_a_decoder_built_on_meta_train_like_plain_and_the_frozen_base_costs_no_gradients(tmp_path):
    model = LoraLM("llama", save("llama", tmp_path, "sharded"))
    fit = pipelined(model, empty_init=True)
    assert_pipelined(fit)
    def base(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in state.items()
                if "lora_" not in k}

    reference = reference_state("llama")
    assert set(base(model.initial)) == set(reference)
    for key, value in reference.items():  # loaded, and frozen through training
        assert torch.equal(base(model.initial)[key], value), key
        assert torch.equal(base(model.net.state_dict())[key], value), key
    adapters = {k: v for k, v in model.initial.items() if "lora_" in k}
    assert adapters and all(not v.any() for k, v in adapters.items() if "lora_B" in k)  # B starts at zero, as peft's
    assert all(v.std() > 0 for k, v in adapters.items() if "lora_A" in k)
    # the plan charges gradients and optimizer state (AdamW: 2) only to the adapters
    plan = fit.strategy.plan
    frozen = sum(v.numel() * v.element_size() for v in reference.values())
    assert sum(stage.frozen_bytes for stage in plan.stages) == frozen
    for stage in plan.stages:
        trainable = stage.param_bytes - stage.frozen_bytes
        held = stage.activation_bytes * plan.chunks
        assert stage.memory_bytes == (trainable * 4 + stage.frozen_bytes + stage.buffer_bytes + held
                                      + stage.joined_output_bytes + stage.loss_workspace_bytes)

    plain = LoraLM("llama")
    plain.configure_model()
    plain.net.double().load_state_dict(model.initial)
    trainer(devices=1, precision="64-true", max_steps=STEPS).fit(plain, data())
    torch.testing.assert_close(model.losses, plain.losses, rtol=1e-6, atol=0)
    for (key, value), (_, expected) in zip(model.net.state_dict().items(), plain.net.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-9, msg=key)
