"""Lightning habits a user brings, run by plain Lightning or the strategy; each rank writes JSON.

python habits.py --out DIR --plain                      # plain Lightning, one device: the reference
python habits.py --out DIR --schedule 1f1b --devices 2  # stages as processes (Lightning's launcher)
python habits.py --out DIR --schedule none --devices 2  # the in-process runtime
python habits.py --out DIR --schedule 1f1b --devices 2 --case manual   # one case that must be refused

The model trains in float64 on dict batches ``{"x", "y", "names"}`` whose ``names`` is a per-sample
``list[str]``, in batches that do not split evenly (70 training samples in batches of 16: the last
holds 6; validation and prediction 21 in batches of 8). The step weighs each sample's loss by the
length of its name, so a list handed whole to a micro-batch fails or trains another model. It logs
a loss, a count with ``reduce_fx="sum"`` and ``sync_dist=True``, a maximum, and a torchmetrics
accuracy ``on_step`` and ``on_epoch`` (to a CSV file); its predictions are dicts of a tensor, an int
and the names. Each rank writes what Lightning saw. ``--case skip`` skips batch 2 (returns ``None``),
``--case manual`` optimizes by hand.
"""

import argparse
import atexit
import csv
import json
import os
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_antichain as la

NAMES = ["ada", "bob", "carmen", "dmitri", "eve", "fatima", "gus", "hiroshi", "ines", "jo"]


class Samples(Dataset):
    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 16, generator=gen, dtype=torch.float64)
        self.y = (self.x[:, :4] + 0.3 * torch.randn(count, 4, generator=gen, dtype=torch.float64)).argmax(1)
        self.loaded: list[int] = []  # every sample this process loads, in order

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        self.loaded.append(i)
        return {"x": self.x[i], "y": self.y[i], "names": NAMES[i % len(NAMES)]}


class Habits(L.LightningModule):
    def __init__(self, case: str = "all") -> None:
        super().__init__()
        self.case = case
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 4)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        if case == "manual":
            self.automatic_optimization = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        return self.out(h)

    def _weighted_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["x"])
        weights = torch.tensor([float(len(n)) for n in batch["names"]], dtype=logits.dtype, device=logits.device)
        losses = nn.functional.cross_entropy(logits, batch["y"], reduction="none")
        return (weights * losses).mean(), logits

    def training_step(self, batch: dict, batch_idx: int):
        if batch_idx == 2 and self.case == "skip":
            return None  # skip this batch, as Lightning allows
        loss, logits = self._weighted_loss(batch)
        if self.case == "manual":
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train_loss", loss)
        self.log("seen", float(len(batch["names"])), reduce_fx="sum", sync_dist=True, on_epoch=True)
        self.log("x_max", batch["x"].max(), reduce_fx="max", on_epoch=True)
        self.train_acc(logits.argmax(-1), batch["y"])
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, logits = self._weighted_loss(batch)
        self.log("val_loss", loss)
        self.val_acc(logits.argmax(-1), batch["y"])
        self.log("val_acc", self.val_acc)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        return {"probabilities": self(batch["x"]).softmax(-1), "batch": batch_idx, "names": batch["names"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float | None] = []
        self.fit_metrics: dict[str, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # {} where the step returned None
        self.losses.append(None if loss is None else loss.item())

    def on_fit_end(self, trainer, module) -> None:
        self.fit_metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--case", default="all")
    parser.add_argument("--stages", type=int, default=None, help="processes per pipeline (the rest: replicas)")
    parser.add_argument("--samples", type=int, default=70, help="training samples")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shuffle", action="store_true", help="shuffle the training data")
    args = parser.parse_args()
    out = Path(args.out)
    # runs last, after the strategy's own handlers: does any process group outlive the script?
    atexit.register(lambda: (out / f"exit{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps({"process_group": torch.distributed.is_initialized()})))
    torch.manual_seed(0)
    schedule = None if args.schedule == "none" else args.schedule
    strategy = "auto" if args.plain else la.AntichainPipelineStrategy(
        schedule=schedule, chunks=args.chunks, profile_cache=False, calibrate=False, rebalance_rounds=0,
        pipeline_parallel_size=args.stages)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if args.plain else args.devices, strategy=strategy, precision="64-true",
        max_epochs=2, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=L.pytorch.loggers.CSVLogger(out, name="logs", version=0),
        log_every_n_steps=1, callbacks=[record])
    module = Habits(args.case)
    L.seed_everything(0)
    training = Samples(args.samples, 0)
    train = DataLoader(training, batch_size=args.batch_size, shuffle=args.shuffle)
    val = DataLoader(Samples(21, 1), batch_size=8)
    trainer.fit(module, train, val)
    predictions = trainer.predict(module, DataLoader(Samples(21, 2), batch_size=8))
    rank = trainer.global_rank
    rows = []
    if rank == 0:
        with open(out / "logs" / "version_0" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    whole = module.state_dict() if args.plain else trainer.strategy.full_state_dict()  # every rank calls it
    params = {n: p.detach() for n, p in module.named_parameters()}
    (out / f"rank{rank}.json").write_text(json.dumps({
        "pid": os.getpid(),
        "losses": record.losses,
        "callback_metrics": record.fit_metrics,
        "csv": rows,
        "predictions": [{"probabilities": p["probabilities"].tolist(), "batch": p["batch"], "names": p["names"]}
                        for p in predictions],
        "parameters": {n: p.flatten().tolist() for n, p in params.items() if not p.is_meta},
        "meta": sorted(n for n, p in params.items() if p.is_meta),
        "held_bytes": sum(p.numel() * p.element_size() for p in params.values() if not p.is_meta),
        "loaded": training.loaded,
        "whole": {n: v.flatten().tolist() for n, v in whole.items() if not v.is_meta} if rank == 0 else None,
    }))


if __name__ == "__main__":
    main()
