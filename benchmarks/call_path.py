"""Which of the package's modules one pipelined call enters, how often, and how often it crosses folders.

A call of a ``Pipeline`` should read split -> run -> join: the split and the join decided once
per capture specialisation, no probing passes after the first call of a shape. This traces the
steady state (a later call of a shape already seen, forward and backward) with ``sys.setprofile``
and counts, per module of the package, the Python calls made into it, and the times the call
moves from one folder of the package to another (a call from ``in_process/`` into ``batches/``
and back counts two). The caller's thread only: the stages' work on the worker threads is the
engine's, whatever the call. No timing: the counts are the same on every machine.

    python benchmarks/call_path.py            # a CNN, a model with a dict output, a Transformer layer
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lightning_antichain as la

PACKAGE = Path(la.__file__).resolve().parent


def models() -> dict[str, tuple[nn.Module, Any]]:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            h = torch.relu(self.a(x))
            return {"logits": self.b(h), "hidden": h}

    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return {"cnn": (cnn, torch.randn(16, 3, 8, 8)), "dict_output": (DictOut(), torch.randn(16, 16)),
            "transformer_layer": (layer, torch.randn(16, 6, 32))}


def traced_call(pipe: la.Pipeline, batch: Any) -> tuple[Counter[str], int]:
    """Python calls into each package module during one forward and backward, and folder crossings."""
    entered: Counter[str] = Counter()
    path: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        file = Path(frame.f_code.co_filename)
        if PACKAGE in file.parents:
            name = str(file.relative_to(PACKAGE).with_suffix(""))
            entered[name] += 1
            folder = name.split("/")[0] if "/" in name else "."
            if not path or path[-1] != folder:
                path.append(folder)

    sys.setprofile(profiler)
    try:
        out = pipe(batch)
        loss = sum(v.float().sum() for v in (out.values() if isinstance(out, dict) else [out]))
        loss.backward()
    finally:
        sys.setprofile(None)
    return entered, len(path) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    print(f"{'model':<18} {'modules':>7} {'calls':>6} {'most entered':<40} {'folder crossings':>16}")
    for name, (model, batch) in models().items():
        plan = la.plan(model, batch, devices=["cpu", "cpu"], chunks=args.chunks, progress=False, calibrate=False,
                       use_profile_cache=False)
        with la.Pipeline(model, plan) as pipe:
            for _ in range(2):  # the first call of a shape captures and probes
                out = pipe(batch)
                sum(v.float().sum() for v in (out.values() if isinstance(out, dict) else [out])).backward()
            entered, crossings = traced_call(pipe, batch)
        top = ", ".join(f"{m} {n}" for m, n in entered.most_common(2))
        print(f"{name:<18} {len(entered):>7} {sum(entered.values()):>6} {top:<40} {crossings:>16}")
        for module, count in sorted(entered.items()):
            print(f"    {module:<36} {count:>5}")


if __name__ == "__main__":
    main()
