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
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_models import build, loss_of  # noqa: E402
from harness import Table, heading, interleaved, medians  # noqa: E402


def backwards(name: str, samples: int, repeats: int) -> tuple[float, float, int]:
    """Median seconds of a backward into empty gradients and of one adding into them, taking turns;
    and the model's trainable parameter bytes."""
    model, x, y = build(name, torch.device("cpu"))
    loss_fn = loss_of(name)
    xs, ys = x[:samples], y[:samples]

    def backward(into_empty: bool) -> float:
        if into_empty:
            model.zero_grad(set_to_none=True)
        loss = loss_fn(model(xs), ys)
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    # the empty way runs first in each round, so the adding way finds its gradients there
    found = medians(interleaved({"empty": partial(backward, True), "adding": partial(backward, False)}, repeats,
                                warmup=2))
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return found["empty"], found["adding"], size


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
    print(heading(f"{args.samples} samples; median of {args.repeats} interleaved pairs; the planner's rate "
                  f"{rate * 1e9:.2f} ns a byte"))
    table = Table(("model", "parameters MB", "backward into empty gradients ms", "adding into them ms",
                   "difference ms", "ns a parameter byte", "the planner's charge ms", "difference / charge"))
    for name in args.models.split(","):
        empty, adding, size = backwards(name, args.samples, args.repeats)
        charge = rate * size
        extra = adding - empty
        table.add(name, f"{size / 1e6:.1f}", f"{1e3 * empty:.1f}", f"{1e3 * adding:.1f}", f"{1e3 * extra:+.1f}",
                  f"{extra / size * 1e9:.2f}", f"{1e3 * charge:.1f}", f"{extra / charge:.2f}")


if __name__ == "__main__":
    main()
