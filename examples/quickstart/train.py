"""Fine-tune a Hugging Face causal LM from its checkpoint directory, pipelined over 4 GPUs."""

import argparse
import os

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, Dataset

import lightning_antichain as la


class CausalLM(L.LightningModule):
    def __init__(self, model_dir: str, lr: float = 1e-5):
        super().__init__()
        self.model_dir, self.lr = model_dir, lr
        self.net = None  # built in configure_model(), on meta: no device ever holds the whole model

    def configure_model(self):
        if self.net is None:  # Lightning may call it more than once
            config = transformers.AutoConfig.from_pretrained(self.model_dir, use_cache=False)  # no KV cache to capture
            self.net = transformers.AutoModelForCausalLM.from_config(config)  # on meta (empty_init=True below)
            la.load_checkpoint(self.net, self.model_dir)  # each stage reads its own tensors, on its own device

    def training_step(self, batch, batch_idx):
        loss = self.net(**batch).loss  # the model's own loss from labels=, joined exactly over micro-batches
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TokenBlocks(Dataset):
    """A text file, tokenized by the model's own tokenizer, cut into blocks of ``length`` tokens."""

    def __init__(self, model_dir: str, text_file: str, length: int):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        with open(text_file, encoding="utf-8") as text:
            ids = tokenizer(text.read(), return_tensors="pt").input_ids[0]
        self.blocks = ids[: len(ids) // length * length].view(-1, length)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True, help="config.json, tokenizer and (sharded) safetensors")
    parser.add_argument("--text-file", required=True)
    parser.add_argument("--length", type=int, default=1024, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=16, help="a multiple of --chunks")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 4)),
                        help="one pipeline stage per device (default: torchrun's processes per node, else 4)")
    parser.add_argument("--precision", default="bf16-mixed",
                        help="bf16 compute over float32 weights and AdamW state; bf16-true halves them (see README)")
    parser.add_argument("--log-dir", default="logs", help="each step's loss goes to LOG_DIR/.../metrics.csv")
    args = parser.parse_args()

    strategy = la.AntichainPipelineStrategy(
        schedule="1f1b",  # one process per device, each running its stage under torch's 1F1B schedule
        chunks=args.chunks,  # more micro-batches: a smaller bubble, smaller kernels
        empty_init=True,  # configure_model() builds on meta; each stage is made real on its own device
        module="net",  # pipeline the Hugging Face model; training_step runs once per micro-batch around it
    )
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                        strategy=strategy, max_steps=args.max_steps, log_every_n_steps=1,
                        logger=L.pytorch.loggers.CSVLogger(args.log_dir, name="quickstart"))
    data = TokenBlocks(args.model_dir, args.text_file, args.length)
    trainer.fit(CausalLM(args.model_dir, args.lr), DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                                              drop_last=True))


if __name__ == "__main__":
    main()
