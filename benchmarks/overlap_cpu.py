"""How much CPU stages slow each other in the real runtime, against the profile's probe and the calibration.

The profile estimates ``parallel_capacity`` with a probe: two threads each running the whole
model's forward and backward, against one. Planning then calibrates it on a few steps of the plan
(:mod:`lightning_antichain.planner.calibration`). This script measures the same quantity in the runtime,
on other steps than the calibration's. For each chunk count it runs the planned 2-stage pipeline (tasks overlap), then
the same micro-batches one at a time (no overlap), and reads each task's start and end from
``Pipeline.last_step.timed``. With ``O`` the time both stages were busy, ``B`` the summed task time
overlapped and ``A`` the summed task time alone, the work done during ``O`` is ``A - (B - 2 O)``,
so the runtime's capacity is ``(A - B + 2 O) / O`` (2.0: no slowdown at all).

    python benchmarks/overlap_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

import lightning_antichain as la

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, publish, section  # noqa: E402

START, END = "<!-- overlap-cpu:start -->", "<!-- overlap-cpu:end -->"


def both_busy(timed: list[list[la.plans.schedule.Timed]]) -> float:
    """Seconds during which both stages ran a task."""
    total = 0.0
    for a in timed[0]:
        for b in timed[1]:
            total += max(0.0, min(a.end, b.end) - max(a.start, b.start))
    return total


def task_seconds(timed: list[list[la.plans.schedule.Timed]]) -> float:
    return sum(t.end - t.start for stage in timed for t in stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="*", default=[16, 8, 4, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10)
    x = torch.randn(args.batch_size, 3, 32, 32)
    lines = [
        "| chunks | micro-batch | probe capacity (profile) | calibrated capacity (plan) | runtime capacity "
        "| task time overlapped / alone | both stages busy | profiled work ms | calibrated work ms | tasks alone ms "
        "| predicted step ms (no optimizer) | measured | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for chunks in args.chunks:
        micro = args.batch_size // chunks
        plan = la.plan(model, x, ["cpu", "cpu"], chunks=chunks, progress=False)
        steps, overlapped, alone, both = [], [], [], []
        with la.Pipeline(model, plan, chunks=chunks) as pipe, la.Pipeline(model, plan, chunks=1) as single:
            for step in range(args.steps + 1):  # pipelined and one-at-a-time steps interleaved
                started = time.perf_counter()
                pipe(x).square().mean().backward()
                elapsed = time.perf_counter() - started
                one_by_one = 0.0
                for m in range(chunks):
                    single(x[m * micro:(m + 1) * micro]).square().mean().backward()
                    one_by_one += task_seconds(single.last_step.timed)
                if step:
                    steps.append(elapsed)
                    overlapped.append(task_seconds(pipe.last_step.timed))
                    alone.append(one_by_one)
                    both.append(both_busy(pipe.last_step.timed))
        model.zero_grad(set_to_none=True)
        o, b, a = statistics.median(both), statistics.median(overlapped), statistics.median(alone)
        runtime_capacity = (a - b + 2 * o) / o if o > 0 else float("nan")
        predicted = plan.predicted_step_s - plan.optimizer_step_s
        measured = statistics.median(steps)
        found = plan.calibration or {}
        probe = found.get("profiled_parallel_capacity", plan.parallel_capacity)
        profiled = sum(found.get("profiled_compute_s", [st.compute_s for st in plan.stages]))
        lines.append(
            f"| {chunks} | {micro} | {probe:.2f} | {plan.parallel_capacity:.2f} | {runtime_capacity:.2f} "
            f"| {b / a:.2f} | {o / measured:.0%} | {chunks * profiled * 1e3:.0f} "
            f"| {chunks * plan.total_compute_s * 1e3:.0f} | {a * 1e3:.0f} "
            f"| {predicted * 1e3:.0f} | {measured * 1e3:.0f} | {predicted / measured:.2f} |"
        )
        print(lines[-1], file=sys.stderr)
    text = section(START, END, [
        f"Machine: {machine(1)}; {args.model}, batch {args.batch_size}, 2 CPU stages, medians of {args.steps} "
        "steps, pipelined and one-at-a-time runs interleaved.",
        "",
        *lines,
    ])
    publish(text, START, END, "## How much CPU stages slow each other", write=not args.no_write)


if __name__ == "__main__":
    main()
