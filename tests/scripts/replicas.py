"""Fit TinyClassifier (or GPT-2, --model gpt2) with a given layout; write rank 0's synced losses as JSON.

python replicas.py --out losses.json --devices 4 --stages 2 --batch-size 16   # 2 replicas x 2 stages
python replicas.py --out losses.json --devices 1 --plain --batch-size 32      # plain Lightning
"""

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torchmetrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_models import TinyClassifier, loader  # noqa: E402

import lightning_antichain as la  # noqa: E402


class Synced(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        self.train_acc(logits.argmax(-1), y)  # torchmetrics syncs its state across replicas itself
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss


VOCAB = 40


class SyncedGPT(L.LightningModule):
    """GPT-2 captured by torch.export: every replica must capture the same operation names."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                         use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.net = transformers.GPT2LMHeadModel(config)
        self.example_input_array = self.batch(8)[:-1]
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)

    @staticmethod
    def batch(n, generator=None):
        tokens = torch.randint(0, VOCAB, (n, 10), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def forward(self, tokens):
        return self.net(input_ids=tokens).logits

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        logits = self(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        self.train_acc(logits.argmax(-1).reshape(-1), target.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss


class ShardedData(L.LightningDataModule):
    """Each replica takes every world_size-th sample in order, so the replicas' batches together are
    the single-process batch (Lightning's own DistributedSampler would shuffle training data)."""

    def __init__(self, batch_size, model="tiny"):
        super().__init__()
        self.batch_size, self.model = batch_size, model

    def train_dataloader(self):
        if self.model == "gpt2":
            dataset = torch.utils.data.TensorDataset(*SyncedGPT.batch(160, torch.Generator().manual_seed(3)))
        else:
            dataset = loader(160).dataset
        sampler = None
        if self.trainer.world_size > 1:
            sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class Record(L.Callback):
    """Written from inside the fit by global rank 0, since with spawn that is a child process."""

    def __init__(self, out):
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero:
            accuracy = trainer.callback_metrics["train_acc"].item()
            ran = getattr(trainer.strategy, "tasks_run", {})
            tasks = [[stage, thread, count] for (stage, thread), count in ran.items()]
            Path(self.out).write_text(json.dumps(
                {"losses": self.losses, "world_size": trainer.world_size, "train_acc": accuracy, "tasks": tasks}
            ))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--start-method", default="popen")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--model", choices=["tiny", "gpt2"], default="tiny")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
    args = parser.parse_args()
    torch.manual_seed(0)
    strategy = (
        "auto"
        if args.plain
        else la.AntichainPipelineStrategy(
            chunks=4, pipeline_parallel_size=args.stages, start_method=args.start_method, profile_cache=False
        )
    )
    record = Record(args.out)
    callbacks = [record]
    if args.ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=5))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=10,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[record],
        use_distributed_sampler=False,
    )
    module = SyncedGPT() if args.model == "gpt2" else Synced()
    trainer.fit(module, datamodule=ShardedData(args.batch_size, args.model))


if __name__ == "__main__":
    main()
