"""Reproduce the seed paper's Table 1 on this machine: partition time and quality for ten models.

For each model: profile once (time reported apart), then for 4 and 8 stages solve with the
antichain DP (median of repeats) and with the three baselines, all scored by the same cost model.
Quality is the predicted bottleneck over the lower bound max(total/K, largest op): 1.00 is perfect.

    python benchmarks/partition_table.py                 # all ten models, writes docs/benchmark-runs.md
    python benchmarks/partition_table.py --models resnet18 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

import lightning_antichain as la

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import command, machine, publish  # noqa: E402

# model name, constructor kwargs, input side (32 unless the model needs more), the seed's times in s
MODELS = [
    ("vgg16", {}, 32, (0.01, 0.03)),
    ("resnet18", {}, 32, (0.07, 0.21)),
    ("resnet50", {}, 32, (0.38, 1.17)),
    ("resnet101", {}, 32, (1.20, 3.69)),
    ("alexnet", {}, 63, (0.02, 0.01)),  # 63x63 is AlexNet's smallest valid input
    ("resnext50_32x4d", {}, 32, (0.41, 1.17)),
    ("resnext101_32x8d", {}, 32, (1.21, 3.58)),
    ("inception_v3", {"aux_logits": False, "init_weights": False}, 75, (3.07, 4.12)),  # smallest valid
    ("densenet121", {}, 32, (1.29, 3.73)),
    ("squeezenet1_0", {}, 32, (0.06, 0.20)),
]
BASELINES = ("uniform", "parameters", "blocks")
START, END = "<!-- partition-table:start -->", "<!-- partition-table:end -->"


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    micro_batch = args.batch_size // args.chunks
    for name, kwargs, side, seed_times in MODELS:
        if args.models and name not in args.models:
            continue
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10, **kwargs)
        cost = la.profile(model, torch.randn(micro_batch, 3, side, side), progress=args.progress, name=name)
        for stages, seed_s in zip((4, 8), seed_times):
            solves, plan = [], None
            for _ in range(args.repeats):
                plan = la.partition(cost, stages, chunks=args.chunks, bandwidth_gbps=args.bandwidth)
                solves.append(plan.solve_s)
            baselines = {
                m: la.partition(cost, stages, chunks=args.chunks, bandwidth_gbps=args.bandwidth, method=m)
                for m in BASELINES
            }
            row = {
                "model": name,
                "input": f"3x{side}x{side}",
                "stages": stages,
                "ops": plan.num_nodes,
                "states": plan.num_states,
                "compressed": bool(plan.compression),
                "profile_s": cost.graph["profile_s"],
                "solve_s": statistics.median(solves),
                "seed_solve_s": seed_s,
                "ours": plan.bound_ratio,
                **{m: p.bound_ratio for m, p in baselines.items()},
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


COMPRESSED_MARK = "\\*"


def table(rows: list[dict]) -> str:
    head = (
        "| model | input | K | ops | states | profile s | solve s (median) | seed's s "
        "| ours / LB | uniform / LB | parameters / LB | blocks / LB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['model']} | {r['input']} | {r['stages']} | {r['ops']} "
        f"| {r['states']}{COMPRESSED_MARK if r['compressed'] else ''} "
        f"| {r['profile_s']:.1f} | {r['solve_s']:.3f} | {r['seed_solve_s']:.2f} | **{r['ours']:.3f}** "
        f"| {r['uniform']:.3f} | {r['parameters']:.3f} | {r['blocks']:.3f} |\n"
        for r in rows
    )
    return head + body


def checks(rows: list[dict]) -> list[str]:
    results = []
    slow = [r for r in rows if r["solve_s"] >= 1.0]
    results.append(f"solve time under 1 s in every cell: {'yes' if not slow else 'NO: ' + str(slow)}")
    worse = [(r["model"], r["stages"], m) for r in rows for m in BASELINES if r["ours"] > r[m] * (1 + 1e-9)]
    results.append(f"ours never worse than a baseline: {'yes' if not worse else 'NO: ' + str(worse)}")
    loose = [(r["model"], round(r["ours"], 3)) for r in rows if r["stages"] == 4 and r["ours"] > 1.10]
    results.append(f"ours within 1.10 x lower bound at K=4: {'yes' if not loose else 'NO: ' + str(loose)}")
    worst = max((r["ours"] for r in rows if r["stages"] == 4), default=float("nan"))
    results.append(
        f"worst ours / LB at K=4: {worst:.3f}; at K=8: "
        f"{max((r['ours'] for r in rows if r['stages'] == 8), default=float('nan')):.3f}"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", help="subset of model names")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, default=None, help="GB/s between stages (default: free)")
    parser.add_argument("--repeats", type=int, default=3, help="solves per cell; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while profiling")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = run(args)
    text = (
        f"{START}\n"
        f"Command: `{command()}`  \n"
        f"Machine: {machine(torch.get_num_threads())} for profiling  \n"
        f"Batch {args.batch_size} in {args.chunks} micro-batches (costs profiled per micro-batch of "
        f"{args.batch_size // args.chunks}), bandwidth "
        f"{'free (CPU stages share memory)' if args.bandwidth is None else f'{args.bandwidth} GB/s'}, "
        f"whole run {time.perf_counter() - started:.0f} s.\n\n"
        + table(rows)
        + "\n\\* states after the automatic compression of parallel branches (docs/method.md).\n\n"
        + "\n".join(f"- {c}" for c in checks(rows))
        + f"\n{END}"
    )
    publish(text, START, END, "## Partitioning: the seed's Table 1", write=not args.no_write)


if __name__ == "__main__":
    main()
