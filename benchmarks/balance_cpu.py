"""Balance when the plan runs: the measured bottleneck over its bound, before and after the loop.

For each model and micro-batch size, plans 2 CPU stages with ``la.plan`` (the strategy's path)
from a cleared cache, ``--runs`` times. Calibration measures each split's stages in the runtime;
the loop (``planner/rebalance.py``) cuts again on those times. Per run it prints the measured
bottleneck over the measured lower bound (the sum of the measured stage times over 2) for the
profile's split (round 0) and for the split the loop kept, then the median and the worst per row.

Then, through the real Trainer (2 CPU devices, Adam, ``--trainer-steps`` steps of which the first is
not timed), it trains each row's profile split and kept split (from the last run) with ``balance=``,
and the kept split again with every stage on all the cores (``cpu_threads``) instead of its share:
interleaved, ``--runs`` repeats, median step. It prints samples/s and the change.

    python benchmarks/balance_cpu.py                    # every row, 3 runs each
    python benchmarks/balance_cpu.py --models resnet18 --micro-batches 8 --runs 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import command  # noqa: E402
from trainer_cpu import StepTimer  # noqa: E402
from zoo import ZOO  # noqa: E402

import lightning_antichain as la  # noqa: E402
from lightning_antichain.measure.cpu_threads import cpu_cores, stage_threads  # noqa: E402

MODELS = {
    "resnet18": lambda: ZOO["resnet18"].build(),
    "resnet50": lambda: __import__("torchvision").models.resnet50(num_classes=10),
    "densenet121": lambda: ZOO["densenet121"].build(),
    "nanogpt": lambda: ZOO["nanogpt"].build(),
    "unet": lambda: ZOO["unet"].build(),
}
CHUNKS = 4


def batch_of(name: str, size: int) -> object:
    if name in ("resnet18", "resnet50", "densenet121"):
        return torch.randn(size, 3, 32, 32)
    if name == "unet":
        return torch.randn(size, 3, 64, 64)
    return torch.randint(0, 64, (size, 32))


def ratio(row: dict, kind: str) -> float:
    return row[f"{kind}_bottleneck_s"] / row[f"{kind}_lower_bound_s"]


class Trained(L.LightningModule):
    """Any of the models, trained on the mean square of its output (what the loss is does not
    change how long a step of the pipeline takes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        return out.float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def trainer_step_s(name: str, micro: int, balance: list[int], steps: int, cache: str,
                   cpu_threads: int | None = None) -> float:
    """Median seconds of a training step (after the first) of ``name`` split by ``balance``."""
    torch.manual_seed(0)
    module = Trained(MODELS[name]())
    data = DataLoader(TensorDataset(torch.cat([batch_of(name, micro * CHUNKS) for _ in range(steps)])),
                      batch_size=micro * CHUNKS)
    timer = StepTimer()
    strategy = la.AntichainPipelineStrategy(chunks=CHUNKS, balance=balance, calibrate=False, profile_cache=cache,
                                            cpu_threads=cpu_threads)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(module, data)
    return statistics.median(timer.times[1:])


def one_run(name: str, micro: int) -> tuple[float, float, int, float, list[int], list[int]]:
    """Measured balance of the profile's split and of the kept one, the rounds, seconds taken, and
    both splits."""
    torch.manual_seed(0)
    model = MODELS[name]()
    with tempfile.TemporaryDirectory() as cache:
        started = time.perf_counter()
        plan = la.plan(model, batch_of(name, micro * CHUNKS), ["cpu", "cpu"], chunks=CHUNKS, profile_cache=cache,
                       progress=False)
        took = time.perf_counter() - started
    first = plan.rounds[0]
    return (ratio(first, "measured"), plan.bottleneck_s / plan.lower_bound_s, len(plan.rounds), took,
            list(first["balance"]), list(plan.balance))


def trainer_table(splits: dict, runs: int, steps: int) -> None:
    print()
    print(f"Through the Trainer: samples/s, median of {runs} interleaved repeats of {steps - 1} timed steps; "
          f"the kept split also with {cpu_cores()} threads per stage instead of its share of the cores")
    print()
    print("| model | micro-batch | profile's split | kept split | samples/s profile's | samples/s kept | change | "
          f"kept, {cpu_cores()} threads per stage | change |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, micro), (first, kept) in splits.items():
        variants = {"first": (first, None), "kept": (kept, None), "all cores": (kept, cpu_cores())}
        if first == kept:
            variants.pop("first")
        times: dict[str, list[float]] = {v: [] for v in variants}
        with tempfile.TemporaryDirectory() as cache:  # profiled once per model: the splits are given
            for _ in range(runs):
                for variant, (balance, threads) in variants.items():
                    times[variant].append(trainer_step_s(name, micro, balance, steps, cache, threads))
        rate = {v: micro * CHUNKS / statistics.median(t) for v, t in times.items()}
        before = rate.get("first", rate["kept"])
        print(f"| {name} | {micro} | {first} | {'same' if first == kept else kept} | {before:.1f} | {rate['kept']:.1f} "
              f"| x{rate['kept'] / before:.3f} | {rate['all cores']:.1f} | x{rate['all cores'] / rate['kept']:.3f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=6, help="steps per fit (0: no Trainer table)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"Command: {command()}")
    print(f"torch {torch.__version__}, {cpu_cores()} cores, 2 CPU stages with {stage_threads(['cpu', 'cpu'])} "
          f"intra-op thread(s) each, {CHUNKS} micro-batches")
    print()
    print("| model | micro-batch | measured / bound before (per run) | after (per run) | rounds | median after | "
          "worst after | s per plan |")
    print("|---|---|---|---|---|---|---|---|")
    splits = {}
    for name in args.models:
        for micro in args.micro_batches:
            runs = [one_run(name, micro) for _ in range(args.runs)]
            splits[name, micro] = runs[-1][4:]
            before = ", ".join(f"{r[0]:.3f}" for r in runs)
            after = ", ".join(f"{r[1]:.3f}" for r in runs)
            rounds = ", ".join(str(r[2]) for r in runs)
            print(f"| {name} | {micro} | {before} | {after} | {rounds} | {statistics.median(r[1] for r in runs):.3f} "
                  f"| {max(r[1] for r in runs):.3f} | {statistics.median(r[3] for r in runs):.0f} |", flush=True)
    if args.trainer_steps:
        trainer_table(splits, args.runs, args.trainer_steps)


if __name__ == "__main__":
    main()

