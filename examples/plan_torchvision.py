"""Plan a pipeline for a torchvision classifier and compare the split with the baselines.

    python examples/plan_torchvision.py --model resnet50 --stages 4 --chunks 4

Prints the antichain plan as a table, the baselines' predicted bottlenecks, and saves the plan and
the cost graph as JSON next to this script (plan again with ``--load-profile`` to skip profiling).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torchvision

import lightning_antichain as la


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision.models classifier")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--load-profile", type=Path, help="a cost graph saved by an earlier run")
    args = parser.parse_args()

    out = Path(__file__).resolve().parent
    if args.load_profile:
        cost = la.load_cost_graph(args.load_profile)
    else:
        model = getattr(torchvision.models, args.model)(num_classes=10)
        micro_batch = torch.randn(args.batch_size // args.chunks, 3, args.image_size, args.image_size)
        cost = la.profile(model, micro_batch, device=args.device, name=args.model)
        la.save_cost_graph(cost, out / f"{args.model}.cost.json")

    plan = la.partition(cost, args.stages, chunks=args.chunks)
    print(plan.table())
    for method in ("uniform", "parameters", "blocks"):
        baseline = la.partition(cost, args.stages, chunks=args.chunks, method=method)
        ms = 1e3 * baseline.bottleneck_s
        print(f"{method:>10}: bottleneck {ms:.2f} ms (x{baseline.bound_ratio:.3f} the bound)")
    plan.save(out / f"{args.model}.plan.json")


if __name__ == "__main__":
    main()
