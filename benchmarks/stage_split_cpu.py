"""What a cut's stages take in the runtime against the profile's shares of them (CPU, one thread).

The profile times every operation of the whole model and fits their sum to the whole model's
measured step (``op_time_scale``): the operations keep their shares, the total is the step. A cut's
stages each run as a graph of their own, with their inputs and outputs crossing its boundary, and
may together take more than the whole did. For each model and stage count this plans the cut (4
micro-batches of the benchmarks' batch of 32), then times the same cut's stages one micro-batch at a
time with the in-process calibration (:func:`lightning_antichain.planner.calibration.calibrate`), and
prints the stages' forward and backward as profiled and as timed: the part of a step the stage
layouts' predictions leave out where they weigh profiled stages. The stage counts take turns, each
timed ``--repeats`` times; the medians are printed.

    python benchmarks/stage_split_cpu.py --models gpt,mlp,mobilenetv3,decoder8k --stages 1,2,4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes_cpu import build  # noqa: E402
from report import machine  # noqa: E402


def timed_cut(model: torch.nn.Module, x: torch.Tensor, stages: int) -> tuple[list[float], list[float]]:
    """Each stage's forward + backward seconds of one micro-batch: as profiled, and as the
    in-process calibration times the same cut's stages alone."""
    from lightning_antichain.planner.calibration import calibrate
    from lightning_antichain.planner.public import planned_for_call, planning_call
    from lightning_antichain.plans.options import PipelineOptions

    # profiled afresh each time: a cached profile would carry the machine's speed of another hour
    options = PipelineOptions(chunks=4, calibrate=False, rebalance_rounds=0, progress=False, use_profile_cache=False)
    args, kwargs = planning_call(model, (x,), {}, options)
    planned = planned_for_call(model, args, kwargs, ["cpu"] * stages, options)
    plan = planned.plan
    found = calibrate(model, planned.graph, plan, (x,), {}, steps=3, seconds=3.0, progress=False)
    profiled = [s.forward_s + s.backward_s for s in plan.stages]
    return profiled, [f + b for f, b in zip(found.forward_s, found.backward_s)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,mlp,mobilenetv3,decoder8k")
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as benchmarks/layouts_cpu.py
    counts = [int(n) for n in args.stages.split(",")]
    print(f"Machine: {machine(1)}; 4 micro-batches of 8 samples; median of {args.repeats} interleaved repeats\n")
    print("| model | stages | profiled ms (a micro-batch, all stages) | timed ms | timed / profiled "
          "| each stage, timed / profiled |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model, x, _ = build(name, torch.device("cpu"))
        found: dict[int, list[tuple[list[float], list[float]]]] = {n: [] for n in counts}
        for _ in range(args.repeats):
            for n in counts:
                found[n].append(timed_cut(model, x, n))
        for n in counts:
            profiled = statistics.median(sum(p) for p, _ in found[n])
            timed = statistics.median(sum(t) for _, t in found[n])
            each = [statistics.median(t[k] / p[k] for p, t in found[n]) for k in range(n)]
            print(f"| {name} | {n} | {1e3 * profiled:.1f} | {1e3 * timed:.1f} | {timed / profiled:.2f} "
                  f"| {', '.join(f'{r:.2f}' for r in each)} |", flush=True)


if __name__ == "__main__":
    main()
