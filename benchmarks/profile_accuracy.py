"""How well the per-op profile adds up to a measured whole-model training step.

For each model and micro-batch size: profile, then time the plain module's forward + backward on
the same micro-batch (median of repeats after warm-up, gradients set to None between steps as
Lightning does), and print the ratio sum(profiled op times) / measured. 1.00 is a perfect total.

    python benchmarks/profile_accuracy.py
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
from harness import command, machine, publish  # noqa: E402

START, END = "<!-- profile-accuracy:start -->", "<!-- profile-accuracy:end -->"


def measured_step(model: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        model(x).sum().backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "resnet50", "vgg16", "densenet121"])
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "| model | micro-batch | per-op sum ms | measured fwd+bwd ms | per-op sum / measured "
        "| profile (scaled) / measured |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.models:
        for micro_batch in args.micro_batches:
            torch.manual_seed(0)
            model = getattr(torchvision.models, name)(num_classes=10)
            x = torch.randn(micro_batch, 3, 32, 32)
            cost = la.profile(model, x, progress=False)
            profiled = la.partition(cost, 1, chunks=1).total_compute_s  # the profile's forward + backward
            raw = profiled / cost.graph.get("op_time_scale", 1.0)
            real = measured_step(model, x, warmup=2, repeats=args.repeats)
            row = (name, micro_batch, f"{1e3 * raw:.1f}", f"{1e3 * real:.1f}", f"{raw / real:.2f}",
                   f"{profiled / real:.2f}")
            lines.append("| " + " | ".join(map(str, row)) + " |")
            print(lines[-1], file=sys.stderr)
    text = (
        f"{START}\nCommand: `{command()}`  \n"
        f"Machine: {machine(torch.get_num_threads())}, 3x32x32 inputs, "
        f"median of {args.repeats} steps.\n\n" + "\n".join(lines) + f"\n{END}"
    )
    publish(text, START, END, "## Profile accuracy", write=not args.no_write)


if __name__ == "__main__":
    main()
