"""Balance when the plan runs: the measured bottleneck over its bound, before and after the loop.

For each model and micro-batch size, plans 2 CPU stages with ``la.plan`` (the strategy's path)
from a cleared cache, ``--runs`` times. Calibration measures each split's stages in the runtime;
the loop (``planner/rebalance.py``) cuts again on those times. Per run it prints the measured
bottleneck over the measured lower bound (the sum of the measured stage times over 2) for the
profile's split (round 0) and for the split the loop kept, then the median and the worst per row.

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import ZOO  # noqa: E402

import lightning_antichain as la  # noqa: E402

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


def one_run(name: str, micro: int) -> tuple[float, float, int, float]:
    """Measured balance of the profile's split and of the kept one, the rounds, and seconds taken."""
    torch.manual_seed(0)
    model = MODELS[name]()
    with tempfile.TemporaryDirectory() as cache:
        started = time.perf_counter()
        plan = la.plan(model, batch_of(name, micro * CHUNKS), ["cpu", "cpu"], chunks=CHUNKS, profile_cache=cache,
                       progress=False)
        took = time.perf_counter() - started
    first = plan.rounds[0]
    return ratio(first, "measured"), plan.bottleneck_s / plan.lower_bound_s, len(plan.rounds), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"Command: python benchmarks/balance_cpu.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, 2 CPU stages, {CHUNKS} micro-batches")
    print()
    print("| model | micro-batch | measured / bound before (per run) | after (per run) | rounds | median after | "
          "worst after | s per plan |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for micro in args.micro_batches:
            runs = [one_run(name, micro) for _ in range(args.runs)]
            before = ", ".join(f"{r[0]:.3f}" for r in runs)
            after = ", ".join(f"{r[1]:.3f}" for r in runs)
            rounds = ", ".join(str(r[2]) for r in runs)
            print(f"| {name} | {micro} | {before} | {after} | {rounds} | {statistics.median(r[1] for r in runs):.3f} "
                  f"| {max(r[1] for r in runs):.3f} | {statistics.median(r[3] for r in runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
