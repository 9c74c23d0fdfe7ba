"""The "works with" table: every zoo model through both user paths, checked in float64.

For each model of ``tests/zoo.py`` it runs the two checks the tests make:
- ``la.Pipeline``: ``la.profile`` -> ``la.partition`` (3 stages) -> ``la.Pipeline`` (4 micro-batches),
  output and every gradient against the plain module (``tests/test_zoo.py``);
- ``Trainer``: the model in a LightningModule, trained 3 steps with ``AntichainPipelineStrategy``
  on 2 CPU devices against plain Lightning, per-step losses (``tests/test_zoo_trainer.py``).
It prints a Markdown table per model, then "N of N" per path, then the README's summary by library.

    python benchmarks/zoo_table.py
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_zoo import zoo_parity  # noqa: E402
from test_zoo_trainer import CHUNKS, _losses  # noqa: E402
from zoo import ZOO  # noqa: E402

import lightning_antichain as la  # noqa: E402

LIMIT_PIPELINE, LIMIT_TRAINER = 1e-9, 1e-6


def pipeline_path(name: str) -> tuple[bool, str, str]:
    """Whether the documented path matches, the frontend, and the row's cells."""
    try:
        graph, _, out_error, grad_error = zoo_parity(name)
    except Exception as exc:  # a row that says what failed, rather than no table
        return False, "failed", f"failed: {type(exc).__name__}"
    ok = out_error <= LIMIT_PIPELINE and grad_error <= LIMIT_PIPELINE
    return ok, graph.frontend, f"{graph.frontend}, {len(graph)} ops, errors {out_error:.0e} / {grad_error:.0e}"


def trainer_path(name: str) -> tuple[bool, str, str]:
    """Whether the Trainer's pipelined losses match plain Lightning's, the frontend, and the cell."""
    try:
        plain, _ = _losses(name, "auto")
        strategy = la.AntichainPipelineStrategy(chunks=CHUNKS, module="net", profile_cache=False, calibrate=False)
        losses, fit = _losses(name, strategy)
    except Exception as exc:
        return False, "failed", f"failed: {type(exc).__name__}"
    error = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, plain))
    ok = len(losses) == len(plain) and error <= LIMIT_TRAINER
    return ok, fit.strategy.plan.frontend, f"{fit.strategy.plan.frontend}, loss error {error:.0e}"


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"Command: `python benchmarks/zoo_table.py`; torch {torch.__version__}, CPU, float64")
    print()
    print("| model | library | la.Pipeline (3 stages x 4 micro-batches) | Trainer (2 devices) | s |")
    print("|---|---|---|---|---|")
    passed = {"pipeline": 0, "trainer": 0}
    by_library: dict[str, list[tuple[str, str, bool]]] = defaultdict(list)
    for name, entry in ZOO.items():
        started = time.perf_counter()
        ok_pipeline, frontend, pipeline_cell = pipeline_path(name)
        ok_trainer, _, trainer_cell = trainer_path(name)
        passed["pipeline"] += ok_pipeline
        passed["trainer"] += ok_trainer
        by_library[entry.library].append((name, frontend, ok_pipeline and ok_trainer))
        print(f"| {name} | {entry.library} | {pipeline_cell} | {trainer_cell} | {time.perf_counter() - started:.0f} |",
              flush=True)
    print()
    print(f"la.Pipeline: {passed['pipeline']} of {len(ZOO)} with float64 parity (relative error limit "
          f"{LIMIT_PIPELINE:.0e}); Trainer: {passed['trainer']} of {len(ZOO)} with float64 losses equal to plain "
          f"Lightning (rtol {LIMIT_TRAINER:.0e})")
    print()
    print("| library | models (frontend) | both paths |")
    print("|---|---|---|")
    for library, rows in by_library.items():
        models = ", ".join(f"{name} ({frontend})" for name, frontend, _ in rows)
        print(f"| {library} | {models} | {sum(ok for *_, ok in rows)} of {len(rows)} |")


if __name__ == "__main__":
    main()
