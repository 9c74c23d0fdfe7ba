"""The layouts the strategy times before it trains, each one's predicted step against the step its
ranks measured: the Trainer, the strategy and its plan only (CPU processes).

With ``pipeline_parallel_size="auto"`` and ``layout_trials=N``, the ranks build the N layouts the
planner predicts fastest on the first batch, time their training steps (the schedule's forward and
backward, the replicas' reduction, AdamW's step) in turns, and train the quickest. The plan's rows
keep each layout's prediction and, for the timed ones, the median step measured on its slowest
rank. This prints those rows after a short fit launched by Lightning (``devices=N`` CPU processes
over gloo): the timed layouts, the chosen one marked, and how many more the planner weighed.
``--fits`` runs the fit again (fresh processes, the profile cache off, so each plans from the
machine as it is then) and prints each timed layout's median over the fits.

    python benchmarks/strategy_layouts.py --model gpt --devices 2 --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_models import build, loss_of  # noqa: E402
from harness import Table, heading  # noqa: E402

import lightning_antichain as la  # noqa: E402


class Trained(L.LightningModule):
    """One of the benchmarks' models with its loss and AdamW, as a user's LightningModule."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.net, x, y = build(name, torch.device("cpu"))
        self.loss = loss_of(name)
        self.data = TensorDataset(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, index: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(args: argparse.Namespace) -> None:
    """One fit, in this process and the ones Lightning starts; rank 0 writes the plan's rows."""
    torch.set_num_threads(1)
    module = Trained(args.model)
    strategy = la.AntichainPipelineStrategy(pipeline_parallel_size="auto", schedule=args.schedule,
                                            layout_trials=args.trials, profile_cache=False)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    x, y = module.data.tensors
    repeated = TensorDataset(x.repeat(args.steps * args.devices, *[1] * (x.dim() - 1)),
                             y.repeat(args.steps * args.devices, *[1] * (y.dim() - 1)))
    trainer.fit(module, DataLoader(repeated, batch_size=len(x)))
    if trainer.global_rank == 0:
        rows = [dict(row) for row in trainer.strategy.plan.layouts]
        Path(args.rows).write_text(json.dumps(rows))


def label(row: dict) -> str:
    virtual = f" (v={row['virtual_stages']})" if row.get("virtual_stages", 1) > 1 else ""
    return f"dp={row['dp']} x pp={row['pp']}, {row['schedule']}{virtual}, {row.get('chunks')} micro-batches"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt", help="one of the benchmarks' models (benchmarks/benchmark_models.py)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--schedule", default="auto", help="the strategy's schedule= (auto: each one weighed)")
    parser.add_argument("--trials", type=int, default=3, help="layout_trials=: the layouts timed before training")
    parser.add_argument("--steps", type=int, default=2, help="training steps after the trials")
    parser.add_argument("--fits", type=int, default=1, help="fits in fresh processes; medians over them")
    parser.add_argument("--rows", help=argparse.SUPPRESS)  # set for the fit's own processes
    args = parser.parse_args()
    if args.rows:
        fit(args)
        return
    fits: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as folder:
        for n in range(args.fits):
            rows = Path(folder) / f"rows{n}.json"
            command = [sys.executable, __file__, *sys.argv[1:], "--rows", str(rows)]
            done = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise SystemExit(f"fit {n + 1} failed:\n{done.stderr[-4000:]}")
            fits.append(json.loads(rows.read_text()))
            print(f"fit {n + 1} of {args.fits} done", file=sys.stderr, flush=True)
    print(heading(f"{args.devices} CPU processes (gloo, launched by Lightning), {args.model}, batch 32, AdamW, "
                  f"schedule={args.schedule!r}, layout_trials={args.trials}; medians over {args.fits} fit(s), "
                  "each trial itself the median of its turns", threads=1))
    table = Table(("layout", "predicted ms", "measured ms", "measured / predicted", "chosen in",
                   "verdict in the first fit"))
    others = []
    for row in fits[0]:
        same = [r for rows in fits for r in rows if label(r) == label(row)]
        measured = [r["measured_step_s"] for r in same if "measured_step_s" in r]
        predicted = statistics.median(r["predicted_step_s"] for r in same)
        if not measured:
            others.append(predicted)
            continue
        chosen = sum("lost" not in r for r in same)
        table.add(label(row), f"{1e3 * predicted:.1f}", f"{1e3 * statistics.median(measured):.1f}",
                  f"{statistics.median(measured) / predicted:.2f}", f"{chosen} of {len(fits)}",
                  row.get("lost", "chosen").replace("|", "/"))
    if others:
        print(f"\n{len(others)} more layouts weighed and not timed (the quickest of them predicted "
              f"{1e3 * min(others):.1f} ms)")

if __name__ == "__main__":
    main()
