"""Fine-tune a Hugging Face decoder bigger than one device, pipelined over the Trainer's devices.

    python examples/llm_finetune/train.py fit --config examples/llm_finetune/config.yaml

The model is built on the meta device in ``configure_model()`` (the strategy's ``empty_init``), so
no device ever holds all of it, and its pretrained weights go straight from a sharded safetensors
checkpoint into each stage, read lazily (``la.load_checkpoint``). With ``lora_rank`` set, peft's
LoRA adapters train and the base stays frozen. The training step uses the loss the model computes
from ``labels=`` (padding set to -100), which the pipeline joins over micro-batches exactly.

Nothing is downloaded. Where ``--model.checkpoint`` does not exist yet, the script writes a
stand-in "pretrained" checkpoint there first (a Llama of the configured shape from a fixed seed,
saved as Hugging Face saves a large model: shards and an index), and says so. The text is read
from ``--data.text_file``, byte by byte (a 256-token vocabulary, no tokenizer to fetch); without
one, the source of Python's own ``argparse`` module is used, and announced.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset, random_split

import lightning_antichain as la

IGNORE = -100


def llama_config(**overrides: Any) -> Any:
    import transformers

    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, use_cache=False, tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**shape, **overrides})


def write_stand_in_checkpoint(directory: Path, config: Any, shard_size: str = "2MB") -> None:
    """A 'pretrained' checkpoint where none is: the configured Llama from a fixed seed, saved in
    shards with an index, as Hugging Face saves a large model."""
    import transformers

    warnings.warn(f"no checkpoint at {directory}: writing a STAND-IN (random weights from seed 0) there first; "
                  "point --model.checkpoint at real pretrained weights of the same shape to fine-tune those",
                  stacklevel=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=shard_size)


class CausalLMFineTune(L.LightningModule):
    """A Llama-shaped decoder, built on meta and loaded stage by stage from ``checkpoint``."""

    def __init__(self, checkpoint: str = "checkpoints/stand-in-llama", config: dict[str, Any] | None = None,
                 lora_rank: int | None = 8, lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: torch.nn.Module | None = None

    def prepare_data(self) -> None:  # once per node, before configure_model
        path = Path(self.hparams.checkpoint)
        if not path.exists():
            write_stand_in_checkpoint(path, llama_config(**(self.hparams.config or {})))

    def configure_model(self) -> None:
        if self.net is not None:
            return
        import transformers

        self.net = transformers.LlamaForCausalLM(llama_config(**(self.hparams.config or {})))  # on meta (empty_init)
        la.load_checkpoint(self.net, self.hparams.checkpoint)  # each tensor waits for its stage, read there
        if self.hparams.lora_rank:
            import peft

            lora = peft.LoraConfig(r=self.hparams.lora_rank, lora_alpha=2 * self.hparams.lora_rank,
                                   target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            self.net = peft.get_peft_model(self.net, lora)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(**batch).loss  # the pipelined forward: the model's own loss from labels=
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.net(**batch).loss, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


class TextLines(Dataset):
    """Lines of a text file as byte tokens, padded to ``block`` (labels -100 on padding)."""

    def __init__(self, text: str, block: int) -> None:
        self.lines = [line.encode()[:block] for line in text.splitlines() if len(line.strip()) > 8]
        self.block = block

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.tensor(list(self.lines[index]), dtype=torch.long)
        ids = torch.zeros(self.block, dtype=torch.long)
        labels = torch.full((self.block,), IGNORE, dtype=torch.long)
        mask = torch.zeros(self.block, dtype=torch.long)
        ids[: len(tokens)], labels[: len(tokens)], mask[: len(tokens)] = tokens, tokens, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TextData(L.LightningDataModule):
    def __init__(self, text_file: str | None = None, block: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        path = self.hparams.text_file
        if path is None:
            path = argparse.__file__
            print(f"llm_finetune: no --data.text_file given; fine-tuning on the source of Python's argparse ({path})")
        data = TextLines(Path(path).read_text(encoding="utf-8", errors="replace"), self.hparams.block)
        val = max(len(data) // 20, self.hparams.batch_size)
        self.train, self.val = random_split(data, [len(data) - val, val], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.hparams.batch_size, drop_last=True)


def main() -> None:
    LightningCLI(CausalLMFineTune, TextData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
