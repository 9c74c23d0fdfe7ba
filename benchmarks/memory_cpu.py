"""Predicted against measured memory per stage: parameters, gradients and optimizer state.

For each model: profile, plan K stages with Adam's state in the memory model, run one real training
step through the pipeline with Adam, then count the bytes each stage's parameters, gradients and
optimizer-state tensors really occupy. (On CPU there is no allocator peak per device to read; on a
GPU, torch.cuda.max_memory_allocated per device would add the activations.)

    python benchmarks/memory_cpu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torchvision

import lightning_antichain as la
from lightning_antichain.memory import optimizer_state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine, section, write_section  # noqa: E402

START, END = "<!-- memory-cpu:start -->", "<!-- memory-cpu:end -->"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet50", "vgg16", "densenet121"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| model | stage | predicted params MB | measured | predicted grads MB | measured "
        "| predicted Adam state MB | measured | predicted total MB (with activations) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10)
        x = torch.randn(args.batch_size, 3, 32, 32)
        cost = la.profile(model, x[: args.batch_size // args.chunks], progress=False, repeats=1, warmup=0)
        plan = la.partition(cost, args.stages, chunks=args.chunks, optimizer_multiplier=2.0)
        optimizer = torch.optim.Adam(model.parameters())
        with la.Pipeline(model, plan, chunks=args.chunks) as pipe:
            pipe(x).sum().backward()
            optimizer.step()
            for spec, stage in zip(plan.stages, pipe.stages):
                params = stage.parameters()
                measured = (nbytes(params), nbytes(p.grad for p in params), optimizer_state_bytes(optimizer, params))
                predicted = (spec.param_bytes, spec.param_bytes, 2 * spec.param_bytes)
                cells = [f"{p / 1e6:.2f} | {m / 1e6:.2f}" for p, m in zip(predicted, measured)]
                lines.append(f"| {name} | {spec.index} | " + " | ".join(cells) + f" | {spec.memory_bytes / 1e6:.1f} |")
                print(lines[-1], file=sys.stderr)
    text = section(
        START,
        END,
        [
            f"Machine: {machine(1)}; batch {args.batch_size} in {args.chunks} micro-batches, {args.stages} stages, "
            "Adam, one training step.",
            "",
            *lines,
        ],
    )
    print(text)
    if not args.no_write:
        write_section(text, START, END, "## Memory per stage on CPU")


if __name__ == "__main__":
    main()
