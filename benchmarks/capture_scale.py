"""Capture, profile and plan a 24-layer GPT at GPT-2-small width: how long each takes, and how big it gets.

ATen-level capture gives thousands of operations; the planner must still solve in under 2 s. Prints
one row per stage count with the number of operations and states and the solve time (median of
repeats), plus the capture and profile times.

    python benchmarks/capture_scale.py [--layers 24] [--width 768] [--seq 64] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import NanoGPT  # noqa: E402

import lightning_antichain as la  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size profiled")
    parser.add_argument("--repeats", type=int, default=3, help="solves per stage count (median reported)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = NanoGPT(vocab=50257, width=args.width, heads=args.heads, layers=args.layers, block_size=args.seq)
    example = torch.randint(0, 50257, (args.batch, args.seq))
    started = time.perf_counter()
    graph = la.trace(model, example)
    capture_s = time.perf_counter() - started
    cost = la.profile(model, example, op_graph=graph, warmup=1, repeats=3, name=f"GPT {args.layers}x{args.width}")
    print(f"model: nanoGPT-style, {args.layers} layers, width {args.width}, sequence {args.seq}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"captured by {graph.frontend} in {capture_s:.1f} s: {len(graph)} operations; "
          f"profiled in {cost.graph['profile_s']:.1f} s")
    print("| stages | operations | states | solve s (median) | bottleneck / lower bound |")
    print("|---|---|---|---|---|")
    for stages in (2, 4, 8):
        times, plan = [], None
        for _ in range(args.repeats):
            plan = la.partition(cost, stages, chunks=8)
            times.append(plan.solve_s)
        assert plan is not None
        solve = statistics.median(times)
        print(f"| {stages} | {plan.num_nodes} | {plan.num_states} | {solve:.3f} | {plan.bound_ratio:.3f} |")
    print()
    print(plan.table())


if __name__ == "__main__":
    main()
