"""The optimizer's step as planning predicts it, against the step in a training loop, on CPU.

Planning times ``optimizer.step()`` on copies of the parameters (``overhead.optimizer_step_s``).
On CPU the values of the gradients change that time, so the copies get the gradients of one
backward of the example (``planning.timed_optimizer_step_s``); before, they got random ones. For each
model this prints both predictions and the median step measured after real backward passes
(cross-entropy on generated data, Adam, ``zero_grad(set_to_none=True)`` between steps), the three
interleaved over the repeats.

    python benchmarks/optimizer_cpu.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_antichain.planner import planning
from lightning_antichain.planner.overhead import optimizer_step_s

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, publish, section  # noqa: E402
from trainer_cpu import make_data, make_model  # noqa: E402

START, END = "<!-- optimizer-cpu:start -->", "<!-- optimizer-cpu:end -->"


def measured_step_s(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one ``optimizer.step()`` after a real backward, gradients reset to ``None`` first."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "resnet50", "gpt"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = make_model(name)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = next(iter(make_data(name, args.batch, 1)))
        measured_step_s(model, optimizer, x, y)  # the optimizer's state exists from here on
        times: dict[str, list[float]] = {"random": [], "example": [], "measured": []}
        for _ in range(args.repeats):
            optimizer.zero_grad(set_to_none=True)
            times["random"].append(optimizer_step_s([optimizer]))
            times["example"].append(planning.timed_optimizer_step_s(model, (x,), {}, [optimizer]))
            times["measured"].append(measured_step_s(model, optimizer, x, y))
        median = {k: statistics.median(v) for k, v in times.items()}
        rows.append((name, median))
        print(name, {k: f"{1e3 * v:.1f} ms" for k, v in median.items()}, file=sys.stderr)
    lines = [
        "| model | predicted, random gradients (before) ms | predicted, gradients of the example ms | measured ms "
        "| before / measured | now / measured |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in rows:
        lines.append(f"| {name} | {1e3 * m['random']:.1f} | {1e3 * m['example']:.1f} | {1e3 * m['measured']:.1f} | "
                     f"{m['random'] / m['measured']:.2f} | {m['example'] / m['measured']:.2f} |")
    text = section(START, END, [
        f"Machine: {machine(1)}; Adam, batch {args.batch}, medians of {args.repeats} interleaved repeats.",
        "",
        *lines,
    ])
    publish(text, START, END, "## The optimizer step on CPU", write=not args.no_write)


if __name__ == "__main__":
    main()
