"""What each rank keeps saved for backward during a training step, stages as processes; JSON per rank.

torchrun --nproc-per-node 2 held_for_backward.py --out DIR --schedule 1f1b

An MLP of 8 blocks in 2 stages, batches of 64 in 8 micro-batches, 4 steps. A callback counts, from
the start of each training batch to its end, the bytes autograd saves for backward on this rank
(:class:`~lightning_antichain.measure.saved_tensors.HeldMemory`, by storage, peak per step). The
model's state and the batch are left out: the batch is Lightning's, held for the whole step under
any schedule, and each micro-batch is a view of it.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_antichain as la
from lightning_antichain.measure.saved_tensors import HeldMemory, state_storages, storage_of


class Blocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SavedForBackward(L.Callback):
    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.held = HeldMemory(excluded=state_storages(module) | {storage_of(t)[0] for t in batch})
        self.saving = self.held.saving()
        self.saving.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.saving.__exit__(None, None, None)
        self.peaks.append(self.held.peak_bytes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    counted = SavedForBackward()
    strategy = la.AntichainPipelineStrategy(schedule=args.schedule, chunks=8, profile_cache=False, calibrate=False,
                                            balance=[9, 8])  # 4 blocks a stage
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[counted])
    trainer.fit(Blocks(), DataLoader(TensorDataset(x, y), batch_size=64))
    (Path(args.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps({"peaks": counted.peaks}))


if __name__ == "__main__":
    main()
