"""What a backward costs when it adds into gradients already there, against one into empty gradients (CPU).

A pipeline's stage runs one backward per micro-batch: the first writes each parameter's ``.grad``,
every later one adds into it, a pass over the stage's parameters that a backward into empty
gradients does not make. The profile times backwards into empty gradients. This times both, one
after the other, on the layouts' benchmark models at one micro-batch of 8 samples, with freed memory
kept as the runtime keeps it (without it, the empty gradients' fresh pages cost more than the add),
and prints the difference per byte of parameters, against what the planner charges for it: its
rate (:func:`~lightning_antichain.planner.overhead.measure_accumulation_rate`, measured here in
the same run) times the model's trainable bytes.

    python benchmarks/grad_accumulation_cpu.py --models mlp,mobilenetv3,decoder8k
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes_cpu import build, loss_of  # noqa: E402
from report import machine  # noqa: E402


def backwards(name: str, samples: int, repeats: int) -> tuple[float, float, int]:
    """Median seconds of a backward into empty gradients and of one adding into them, interleaved;
    and the model's parameter bytes."""
    model, x, y = build(name, torch.device("cpu"))
    loss_fn = loss_of(name)
    xs, ys = x[:samples], y[:samples]
    empty, adding = [], []
    for _ in range(repeats + 2):  # the first two warm up
        model.zero_grad(set_to_none=True)
        for found in (empty, adding):
            loss = loss_fn(model(xs), ys)
            start = time.perf_counter()
            loss.backward()
            found.append(time.perf_counter() - start)
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return statistics.median(empty[2:]), statistics.median(adding[2:]), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,mobilenetv3,decoder8k")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    from lightning_antichain.cpu_allocator import keep_freed_memory

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as benchmarks/layouts_cpu.py
    keep_freed_memory()
    from lightning_antichain.planner.overhead import measure_accumulation_rate

    rate = measure_accumulation_rate(torch.device("cpu"))
    print(f"Machine: {machine(1)}; {args.samples} samples; median of {args.repeats} interleaved pairs; the "
          f"planner's rate {rate * 1e9:.2f} ns a byte\n")
    print("| model | parameters MB | backward into empty gradients ms | adding into them ms | difference ms "
          "| ns a parameter byte | the planner's charge ms | difference / charge |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        empty, adding, size = backwards(name, args.samples, args.repeats)
        charge = rate * size
        print(f"| {name} | {size / 1e6:.1f} | {1e3 * empty:.1f} | {1e3 * adding:.1f} | {1e3 * (adding - empty):+.1f} "
              f"| {(adding - empty) / size * 1e9:.2f} | {1e3 * charge:.1f} | {(adding - empty) / charge:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
