"""Replica scaling on this machine: plain, 1 replica x 2 stages, 2 replicas x 1 stage; same global batch.

Each configuration is a real Lightning fit in fresh processes (replicas launched as Lightning's DDP
launches them, gradients averaged over gloo), one intra-op thread per process. The step time is the
median over the steps after warm-up, measured on rank 0 between batch start and batch end.

    python benchmarks/replicas_cpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

START, END = "<!-- replicas-cpu:start -->", "<!-- replicas-cpu:end -->"
CONFIGS = [
    ("plain, 1 process", ["--devices", "1", "--plain", "--chunks", "1"]),
    ("1 replica x 2 stages", ["--devices", "2", "--stages", "2", "--chunks", "8"]),
    ("2 replicas x 1 stage", ["--devices", "2", "--stages", "1", "--chunks", "1"]),
]


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pipeline_cpu import make_cnn

    import lightning_antichain as la

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class CNN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_cnn(32, 8)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.net(x)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001
            self.times.append(time.perf_counter() - self.start)

        def on_train_end(self, trainer, module):  # noqa: ANN001
            if trainer.is_global_zero:
                Path(args.out).write_text(json.dumps({"times": self.times, "world": trainer.world_size}))

    replicas = 1 if args.plain else args.devices // args.stages
    per_replica = args.batch_size // replicas
    data = torch.utils.data.TensorDataset(
        torch.randn(args.batch_size * args.steps, 3, 32, 32), torch.randint(0, 10, (args.batch_size * args.steps,))
    )
    strategy = "auto" if args.plain else la.AntichainPipelineStrategy(chunks=args.chunks,
                                                                      pipeline_parallel_size=args.stages)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Timer()],
    )
    trainer.fit(CNN(), torch.utils.data.DataLoader(data, batch_size=per_replica))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import machine, publish, section

    rows, plain = [], None
    for name, flags in CONFIGS:
        out = Path(f"/tmp/replicas_cpu_{len(rows)}.json")
        command = [
            sys.executable,
            __file__,
            "--child",
            "--out",
            str(out),
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            *flags,
        ]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
        times = json.loads(out.read_text())["times"][args.warmup :]
        step = statistics.median(times)
        plain = plain or step
        rows.append(f"| {name} | {1e3 * step:.0f} | {args.batch_size / step:.1f} | {plain / step:.2f}x |")
        print(rows[-1], file=sys.stderr)
    text = section(
        START,
        END,
        [
            f"Machine: {machine(1)} per process; CNN of 9 3x3 convolutions (width 32) on 32x32 images, global "
            f"batch {args.batch_size}, median of {args.steps - args.warmup} steps after {args.warmup} warm-up.",
            "",
            "| layout | step ms | samples/s | vs plain |",
            "|---|---|---|---|",
            *rows,
        ],
    )
    publish(text, START, END, "## Replica scaling on CPU", write=not args.no_write)


if __name__ == "__main__":
    main()
