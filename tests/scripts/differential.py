"""Train rows of the differential check by plain Lightning or the strategy; each rank writes JSON.

python differential.py --out DIR --runtime plain --cases tied,gru        # plain Lightning, one device
python differential.py --out DIR --runtime threads --cases tied          # the in-process runtime, 2 devices
torchrun --nproc-per-node 2 differential.py --out DIR --runtime 1f1b --cases tied   # stages as processes

Each row (tests/scripts/differential_cases.py) fits for its epochs with validation, then predicts.
Each rank writes DIR/CASE/rank{r}.json: every training step's loss and logged values, the metrics at
the end of fit, the predictions, and the whole trained model (the strategy's ``full_state_dict()``),
or the error the row stopped with. The rows of one launch run one after the other; a row that
raises ends the launch (the next rows are left out), since a failing rank may leave the others'
collectives in any state.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.utils._pytree as pytree
from differential_cases import CASES

import lightning_antichain as la


class Record(L.Callback):
    """What Lightning saw at each training step: the loss the step returned and the logged values."""

    def __init__(self) -> None:
        self.losses: list[float | None] = []
        self.logged: list[dict[str, float]] = []
        self.fit_metrics: dict[str, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(None if loss is None else loss.item())
        self.logged.append({k: v.item() for k, v in trainer.callback_metrics.items()})

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.fit_metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}


def plain_values(tree: Any) -> Any:
    """``tree`` with its tensors as lists, for JSON."""
    return pytree.tree_map(lambda v: v.tolist() if isinstance(v, torch.Tensor) else v, tree)


def strategy_for(runtime: str, options: dict[str, Any]) -> Any:
    if runtime == "plain":
        return "auto"
    settings = dict(chunks=4, profile_cache=False, calibrate=False, rebalance_rounds=0)
    settings.update(options)
    settings.update(json.loads(os.environ.get("DIFFERENTIAL_OPTIONS", "{}")))
    return la.AntichainPipelineStrategy(schedule=None if runtime == "threads" else runtime, **settings)


def run_case(name: str, runtime: str, devices: int, out: Path) -> dict[str, Any]:
    case = CASES[name]
    torch.manual_seed(0)
    module = case.module()
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if runtime == "plain" else devices, strategy=strategy_for(runtime, case.options),
        precision="64-true", max_epochs=case.max_epochs, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, logger=False, deterministic=True,
        callbacks=[record, *case.callbacks()])
    train, val, predict = case.data()
    L.seed_everything(0, verbose=False)
    trainer.fit(module, train, val)
    predictions = trainer.predict(module, predict) if predict is not None else []
    whole = module.state_dict() if runtime == "plain" else trainer.strategy.full_state_dict()
    return {
        "losses": record.losses,
        "logged": record.logged,
        "fit_metrics": record.fit_metrics,
        "predictions": plain_values(predictions),
        "whole": {k: v.tolist() for k, v in whole.items() if isinstance(v, torch.Tensor) and not v.is_meta},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runtime", required=True, help="plain, threads, or a schedule= of the strategy")
    parser.add_argument("--cases", required=True, help="rows, comma-separated")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))  # torchrun's, or Lightning's launcher's
    for name in args.cases.split(","):
        where = Path(args.out) / name
        where.mkdir(parents=True, exist_ok=True)
        try:
            report = run_case(name, args.runtime, args.devices, where)
        except Exception as exc:
            said = "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", ())])  # as a traceback ends
            (where / f"rank{rank}.json").write_text(json.dumps({"error": said, "traceback": traceback.format_exc()}))
            raise
        (where / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
