"""Train TinyClassifier, optionally SIGKILL itself at a step, optionally resume from the last checkpoint.

Losses go to --out as JSON lines {"step": global_step, "loss": value}, written as they happen, so a
killed run leaves what it did.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_models import TinyClassifier, loader  # noqa: E402

import lightning_antichain as la  # noqa: E402


class Record(L.Callback):
    def __init__(self, path, kill_at):
        self.path, self.kill_at = path, kill_at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, as a crash or a preempted node

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "loss": module.losses[-1]}) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False) if args.pipeline else "auto"
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, Record(args.out, args.kill_at)],
    )
    ckpt = os.path.join(args.ckpt_dir, "last.ckpt") if args.resume else None
    trainer.fit(TinyClassifier(), loader(64), ckpt_path=ckpt)


if __name__ == "__main__":
    main()
