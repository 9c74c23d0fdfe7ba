"""Pipeline throughput on this machine's CPU cores: a CNN in 2 stages against plain training.

Every configuration runs in one process at one intra-op thread per stage worker; measurements are
interleaved round-robin (so a slow spell of the machine hits every variant alike) and the median
of the repeats is reported. Variants, each one full training step (forward + backward) on a batch:

* plain: the plain module on the whole batch;
* micro-batched: the plain module on the same M micro-batches one after another (gradient
  accumulation); micro-batches change per-sample speed on CPU caches, so this is the fair
  denominator for pipeline efficiency;
* pipeline: ``la.Pipeline`` over K stages with M micro-batches, planned as the strategy plans
  (``la.plan``: profile, partition, calibrate on a few steps).

Efficiency is speed-up over micro-batched divided by the GPipe bound K*M/(M+K-1) / balance, where
balance is the plan's bottleneck over the ideal split. Profiles are cached in ``--cache``;
calibrations are measured afresh, each just before its variant is timed.

    python benchmarks/pipeline_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.in_process.worker import WorkerPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCHMARK_CACHE, fresh_calibrations, machine, publish, section  # noqa: E402

START, END = "<!-- pipeline-cpu:start -->", "<!-- pipeline-cpu:end -->"


def make_cnn(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def step_plain(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def step_micro(model: nn.Module, x: torch.Tensor, chunks: int) -> None:
    for part in torch.tensor_split(x, chunks):
        model(part).sum().backward()


def measure(variants: dict[str, Callable[[], None]], warmup: int, repeats: int, zero: Callable[[], None]) -> dict:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + repeats):
        for name, run in variants.items():
            zero()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    parser.add_argument("--cache", type=Path, default=BENCHMARK_CACHE, help="profile cache (calibrations are cleared)")
    args = parser.parse_args()
    cache = fresh_calibrations(args.cache)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_cnn(args.width, args.depth)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    rows = []
    plain_s = None
    worker = WorkerPool(1, name="plain-baseline")
    for chunks in args.chunks:
        plan = la.plan(model, x, ["cpu"] * args.stages, chunks=chunks, progress=False, profile_cache=cache)
        pipe = la.Pipeline(model, plan, chunks=chunks)
        variants = {
            "plain": lambda: step_plain(model, x),
            "micro": lambda c=chunks: step_micro(model, x, c),
            "pipeline": lambda p=pipe: step_plain(p, x),
        }
        if chunks == 1:
            single = la.Pipeline(model, la.plan(model, x, ["cpu"], chunks=1, progress=False, profile_cache=cache),
                                 chunks=1)
            variants["one_stage"] = lambda p=single: step_plain(p, x)
            variants["plain_on_worker"] = lambda: worker.run([lambda: step_plain(model, x)], lambda: None)
        t = measure(variants, args.warmup, args.repeats, zero)
        plain_s = t["plain"]
        k = args.stages
        bound = k * chunks / (chunks + k - 1) / plan.bound_ratio
        speedup_micro = t["micro"] / t["pipeline"]
        rows.append(
            {
                "chunks": chunks,
                "plain_sps": args.batch_size / t["plain"],
                "micro_sps": args.batch_size / t["micro"],
                "pipe_sps": args.batch_size / t["pipeline"],
                "vs_plain": t["plain"] / t["pipeline"],
                "vs_micro": speedup_micro,
                "bound": bound,
                "efficiency": speedup_micro / bound,
                "balance": plan.bound_ratio,
                "predicted_ms": 1e3 * plan.predicted_step_s,
                "measured_ms": 1e3 * t["pipeline"],
                "one_stage_overhead": (t["one_stage"] / t["plain"] - 1) if "one_stage" in t else None,
                "one_stage_vs_worker": (t["one_stage"] / t["plain_on_worker"] - 1) if "one_stage" in t else None,
            }
        )
        print(rows[-1], file=sys.stderr)

    lines = [
        "| chunks | plain samples/s | micro-batched samples/s | pipeline samples/s | vs plain | vs micro-batched "
        "| GPipe bound / balance | efficiency | predicted step ms | measured step ms | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunks']} | {r['plain_sps']:.1f} | {r['micro_sps']:.1f} | {r['pipe_sps']:.1f} | "
            f"{r['vs_plain']:.2f}x | {r['vs_micro']:.2f}x | {r['bound']:.2f} (balance {r['balance']:.3f}) | "
            f"{r['efficiency']:.2f} | {r['predicted_ms']:.0f} | {r['measured_ms']:.0f} | "
            f"{r['predicted_ms'] / r['measured_ms']:.2f} |"
        )
    first = next((r for r in rows if r["one_stage_overhead"] is not None), None)
    text = section(
        START,
        END,
        [
            f"Machine: {machine()}, 1 intra-op thread per worker; CNN of {args.depth + 1} 3x3 convolutions, "
            f"width {args.width}, on "
            f"{args.image_size}x{args.image_size} images, batch {args.batch_size}, {args.stages} stages, "
            f"median of {args.repeats} steps after {args.warmup} warm-up, variants interleaved.",
            "",
            *lines,
            "",
            "1 stage, 1 chunk (the runtime's own overhead): "
            + (
                "n/a"
                if first is None
                else f"{100 * first['one_stage_overhead']:+.1f}% against plain on the main thread, "
                f"{100 * first['one_stage_vs_worker']:+.1f}% against plain run on one long-lived worker thread"
            ),
        ],
    )
    publish(text, START, END, "## Pipeline throughput on CPU", write=not args.no_write)
    worker.shutdown()
    del plain_s


if __name__ == "__main__":
    main()
