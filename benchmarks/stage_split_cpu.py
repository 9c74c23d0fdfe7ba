"""What a cut's stages take in the runtime against the profile's shares of them (CPU, one thread).

The profile times every operation of the whole model and fits their sum to the whole model's
measured step (``op_time_scale``): the operations keep their shares, the total is the step. A cut's
stages each run as a graph of their own, with their inputs and outputs crossing its boundary, and
may together take more than the whole did. For each model and stage count this plans the model as
the strategy does (``la.plan``: 4 micro-batches of the benchmarks' batch of 32, profiled afresh,
calibrated, no rebalancing), and prints the stages' forward and backward as profiled and as the
calibration timed them, one micro-batch at a time: the part of a step the stage layouts'
predictions leave out where they weigh profiled stages. The stage counts take turns, each planned
``--repeats`` times; the medians are printed.

    python benchmarks/stage_split_cpu.py --models gpt,mlp,mobilenetv3,decoder8k --stages 2,4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_models import build  # noqa: E402
from harness import Table, heading, interleaved  # noqa: E402

import lightning_antichain as la  # noqa: E402


def profiled_and_timed(model: torch.nn.Module, x: torch.Tensor, stages: int) -> tuple[list[float], list[float]]:
    """Each stage's forward + backward seconds of one micro-batch, as profiled and as calibrated."""
    # profiled afresh each time: a cached profile would carry the machine's speed of another hour
    plan = la.plan(model, x, ["cpu"] * stages, chunks=4, rebalance_rounds=0, progress=False,
                   use_profile_cache=False, profile_cache=None)
    record = plan.calibration
    if record is None:
        raise SystemExit(f"la.plan did not calibrate the plan of {stages} stage(s): it is what this compares")
    timed = [f + b for f, b in zip(record["forward_s"], record["backward_s"])]
    return list(record["profiled_compute_s"]), timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,mlp,mobilenetv3,decoder8k")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as benchmarks/layouts_cpu.py
    counts = [int(n) for n in args.stages.split(",")]
    if min(counts) < 2:
        parser.error("--stages: two or more (the strategy calibrates only stages that share the CPU; "
                     "benchmarks/profile_accuracy.py compares a whole model's profile with its measured step)")
    print(heading(f"4 micro-batches of 8 samples; median of {args.repeats} interleaved repeats"))
    table = Table(("model", "stages", "profiled ms (a micro-batch, all stages)", "timed ms", "timed / profiled",
                   "each stage, timed / profiled"))
    for name in args.models.split(","):
        model, x, _ = build(name, torch.device("cpu"))
        found = interleaved({n: partial(profiled_and_timed, model, x, n) for n in counts}, args.repeats, warmup=0)
        for n in counts:
            profiled = statistics.median(sum(p) for p, _ in found[n])
            timed = statistics.median(sum(t) for _, t in found[n])
            each = [statistics.median(t[k] / p[k] for p, t in found[n]) for k in range(n)]
            table.add(name, n, f"{1e3 * profiled:.1f}", f"{1e3 * timed:.1f}", f"{timed / profiled:.2f}",
                      ", ".join(f"{r:.2f}" for r in each))


if __name__ == "__main__":
    main()
