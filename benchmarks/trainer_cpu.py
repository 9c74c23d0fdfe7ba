"""The real Trainer on CPU: plain training on 1 device against the pipeline strategy on 2, per chunk count.

For each model and global batch, every variant trains the same LightningModule (Adam, cross-entropy)
on generated data: plain (``devices=1``) and ``AntichainPipelineStrategy(chunks=M)`` on
``devices=2`` for each M, and ``chunks="auto"``. Variants are interleaved: each repeat builds a
fresh Trainer per variant in turn and times its steps with a callback (batch start to batch end:
forward, backward, optimizer step, logging); a variant's step time is the median over repeats of
each repeat's median step. Planning does not count. Profiles are cached in ``--cache`` across
runs; calibrations are cleared before each repeat, so every repeat plans from its own, measured
just before its fits, and a row's prediction is a median over independent calibrations as its
measurement is over independent fits. Every process uses one intra-op thread per worker, so 2
devices means 2 cores.

Each row reports samples/s, the speed-up over plain, the plan's predicted step over the measured
one (median over repeats of each repeat's ratio), the spread of the repeats (slowest over
fastest repeat, for the row and for plain: the noise a ratio must be read against), and
efficiency: the speed-up over the best the machine allows, min(GPipe bound K*M/(M+K-1), the
machine's parallel capacity). That capacity is measured in the same run: two worker threads
each training their own copy of ResNet-18 (batch 64) against one thread training both in turn.

    python benchmarks/trainer_cpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_antichain import AntichainPipelineStrategy
from lightning_antichain.cpu_allocator import keep_freed_memory
from lightning_antichain.in_process.worker import WorkerPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import BENCHMARK_CACHE, fresh_calibrations, machine, publish, section  # noqa: E402
from zoo import NanoGPT  # noqa: E402

START, END = "<!-- trainer-cpu:start -->", "<!-- trainer-cpu:end -->"
GPT_CONFIG = {"vocab": 256, "width": 128, "heads": 4, "layers": 4, "block_size": 64}


class Classifier(L.LightningModule):
    """Cross-entropy over the last dim of the model's output (classes, or a language model's vocabulary)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class StepTimer(L.Callback):
    """Seconds from each training batch's start to its end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self._start)


def make_model(name: str) -> nn.Module:
    if name == "gpt":
        return NanoGPT(**GPT_CONFIG)
    return getattr(torchvision.models, name)(num_classes=10)


def make_data(name: str, batch: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    if name == "gpt":
        seq = GPT_CONFIG["block_size"]
        data = TensorDataset(torch.randint(0, GPT_CONFIG["vocab"], (n, seq), generator=g),
                             torch.randint(0, GPT_CONFIG["vocab"], (n, seq), generator=g))
    else:
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch)


def run_variant(name: str, batch: int, chunks: int | str | None, steps: int,
                cache: Path) -> tuple[float, float | None, int]:
    """Median step seconds after the first step, the plan's predicted step, and the chunks it ran."""
    torch.manual_seed(0)
    module = Classifier(make_model(name))
    timer = StepTimer()
    if chunks is None:
        options: dict = {"accelerator": "cpu", "devices": 1}
    else:
        strategy = AntichainPipelineStrategy(chunks=chunks, profile_cache=str(cache))
        options = {"accelerator": "cpu", "devices": 2, "strategy": strategy}
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], **options)
    trainer.fit(module, make_data(name, batch, steps))
    step = statistics.median(timer.times[1:])
    if chunks is None:
        return step, None, 1
    plan = trainer.strategy.plan
    return step, plan.predicted_step_s, plan.chunks


def machine_capacity(repeats: int = 5) -> float:
    """Two threads each training their own ResNet-18 (batch 64) against one thread training both."""
    keep_freed_memory()
    models = [torchvision.models.resnet18(num_classes=10) for _ in range(2)]
    xs = [torch.randn(64, 3, 32, 32) for _ in range(2)]

    def train(i: int) -> Callable[[], None]:
        return lambda: models[i](xs[i]).sum().backward()

    one, two = WorkerPool(1), WorkerPool(2)
    alone, together = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        one.run([lambda: (train(0)(), train(1)())], lambda: None)
        t_one = time.perf_counter() - start
        start = time.perf_counter()
        two.run([train(0), train(1)], lambda: None)
        t_two = time.perf_counter() - start
        if i:
            alone.append(t_one)
            together.append(t_two)
    one.shutdown()
    two.shutdown()
    return statistics.median(alone) / statistics.median(together)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=["resnet18:64", "resnet18:256", "resnet50:64", "resnet50:256",
                                                       "gpt:64"], help="model:batch pairs")
    parser.add_argument("--chunks", nargs="*", default=["1", "2", "4", "8", "16", "auto"])
    parser.add_argument("--steps", type=int, default=4, help="steps per fit (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmark-runs.md")
    parser.add_argument("--cache", type=Path, default=BENCHMARK_CACHE, help="profile cache (calibrations are cleared)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    capacity = machine_capacity()
    print(f"machine capacity (2 workers vs 1): {capacity:.2f}x", file=sys.stderr)
    chunk_options: list[int | str] = [c if c == "auto" else int(c) for c in args.chunks]
    rows = []
    for case in args.cases:
        name, batch = case.split(":")[0], int(case.split(":")[1])
        variants: list[int | str | None] = [None, *chunk_options]
        times: dict[object, list[float]] = {v: [] for v in variants}
        predicted: dict[object, list[float]] = {v: [] for v in variants}
        ran: dict[object, list[int]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            cache = fresh_calibrations(args.cache)
            for v in variants:
                step, pred, m = run_variant(name, batch, v, args.steps, cache)
                times[v].append(step)
                ran[v].append(m)
                if pred is not None:
                    predicted[v].append(pred)
                print(f"{name} batch {batch} chunks {v} ({m}): {1e3 * step:.0f} ms (predicted "
                      f"{'-' if pred is None else f'{1e3 * pred:.0f}'})", file=sys.stderr, flush=True)
        plain = statistics.median(times[None])
        for v in chunk_options:
            step = statistics.median(times[v])
            m = statistics.mode(ran[v])  # auto may choose another count in another repeat
            bound = 2 * m / (m + 1)
            rows.append({
                "model": name, "batch": batch, "chunks": v, "ran_chunks": m, "chosen": ran[v], "plain_ms": 1e3 * plain,
                "step_ms": 1e3 * step, "samples_s": batch / step, "vs_plain": plain / step,
                "predicted_ms": 1e3 * statistics.median(predicted[v]),
                "ratio": statistics.median(p / t for p, t in zip(predicted[v], times[v])),
                "ratios": [p / t for p, t in zip(predicted[v], times[v])],
                "spread": max(times[v]) / min(times[v]), "plain_spread": max(times[None]) / min(times[None]),
                "bound": bound, "efficiency": (plain / step) / min(bound, capacity),
            })
    if args.json:
        Path(args.json).write_text(json.dumps({"capacity": capacity, "rows": rows}, indent=1))
    lines = [
        "| model | batch | chunks | samples/s | vs plain | predicted / measured step | spread of repeats "
        "(pipeline, plain) | min(GPipe bound, capacity) | efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunks = f"auto ({', '.join(map(str, r['chosen']))})" if r["chunks"] == "auto" else str(r["chunks"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {chunks} | {r['samples_s']:.1f} | {r['vs_plain']:.2f}x | "
            f"{r['ratio']:.2f} | {r['spread']:.2f}, {r['plain_spread']:.2f} | {min(r['bound'], capacity):.2f} | "
            f"{r['efficiency']:.2f} |"
        )
    checks = []
    for case in args.cases:
        name, batch = case.split(":")[0], int(case.split(":")[1])
        mine = [r for r in rows if r["model"] == name and r["batch"] == batch]
        fixed = [r for r in mine if r["chunks"] != "auto"]
        auto = [r for r in mine if r["chunks"] == "auto"]
        if fixed and auto:
            best = min(fixed, key=lambda r: r["step_ms"])
            checks.append(f"- {name}, batch {batch}: auto ({', '.join(map(str, auto[0]['chosen']))}) takes "
                          f"{auto[0]['step_ms'] / best['step_ms']:.3f}x the step of the best fixed count "
                          f"({best['chunks']})")
    ratios = [r["ratio"] for r in rows]
    text = section(START, END, [
        f"Machine: {machine(1)} per worker. Plain: `devices=1`; pipeline: `devices=2`, Adam, "
        f"{args.steps - 1} timed steps per fit, median of {args.repeats} interleaved fits, each repeat "
        f"calibrating afresh; whole run {time.perf_counter() - started:.0f} s. GPT: nanoGPT-style, "
        f"{GPT_CONFIG}, sequence {GPT_CONFIG['block_size']}. Spread: slowest over fastest repeat.",
        "",
        f"The machine's parallel capacity (two workers each training a ResNet-18 against one doing both): "
        f"**{capacity:.2f}x**.",
        "",
        *lines,
        "",
        f"- predicted / measured step: {min(ratios):.2f} to {max(ratios):.2f}",
        *checks,
    ])
    publish(text, START, END, "## The Trainer on CPU: pipeline against plain, per chunk count", write=not args.no_write)


if __name__ == "__main__":
    main()
