"""The benchmarks' one harness: every benchmark as a case that says what it compares, the ways it
compares taking turns, and the table it prints.

``python benchmarks/run.py --list`` lists the cases; ``python benchmarks/run.py NAME [ARGS]`` runs
one. A case's ways take turns round after round (:func:`interleaved`) so that a machine getting
busier or quieter weighs on each alike, and each prints the machine it ran on (:func:`heading`)
and its rows as they come (:class:`Table`), so that a long run shows where it is; those that keep
a table in docs/benchmark-runs.md write it there (:func:`publish`).
"""

from __future__ import annotations

import ast
import os
import platform
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")

BENCHMARKS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    """One benchmark: its script under benchmarks/, what it measures against what, and what it needs."""

    name: str
    script: str
    compares: str
    needs: str = "cpu"
    """``cpu``: one process on this machine; ``ranks``: gloo processes on this machine; ``gpu``: a GPU."""
    quick: tuple[str, ...] | None = None
    """Arguments of a small run that still prints the whole table (the harness's tests run it)."""

    @property
    def path(self) -> Path:
        return BENCHMARKS / self.script

    def internals(self) -> list[str]:
        """The package's modules the script imports beyond its public API (``lightning_antichain``'s
        own names): what it measures inside the package, or what it still has to move to the API."""
        found = set()
        for node in ast.walk(ast.parse(self.path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found |= {n for n in names if n.startswith("lightning_antichain.")}
        return sorted(found)


CASES: tuple[Case, ...] = (
    Case("pipeline", "pipeline_cpu.py", "a CNN in 2 pipeline stages against plain training, steps a second"),
    Case("trainer", "trainer_cpu.py", "the Trainer with the strategy on 2 devices against plain training on 1, "
         "per chunk count"),
    Case("replicas", "replicas_cpu.py", "plain, 1 replica x 2 stages and 2 replicas x 1 stage at one global batch"),
    Case("balance", "balance_cpu.py", "the measured bottleneck over its bound, before and after rebalancing"),
    Case("memory", "memory_cpu.py", "each stage's memory as planned against as measured"),
    Case("optimizer", "optimizer_cpu.py", "the optimizer's step as planned against as measured in a training loop"),
    Case("overlap", "overlap_cpu.py", "how CPU stages slow each other: measured against the profile's probe"),
    Case("profile-accuracy", "profile_accuracy.py", "the per-operation profile's sum against a measured step"),
    Case("stage-split", "stage_split_cpu.py", "a cut's stages as calibrated against the profile's shares of them "
         "(la.plan)", quick=("--models", "gpt", "--stages", "2", "--repeats", "1")),
    Case("grad-accumulation", "grad_accumulation_cpu.py", "a backward adding into gradients against one into "
         "empty gradients, and the planner's charge for it", quick=("--models", "mlp", "--repeats", "2")),
    Case("partition", "partition_table.py", "the seed paper's Table 1: the DP's time and cut against the paper's"),
    Case("zoo", "zoo_table.py", "every zoo model through both user paths, checked in float64"),
    Case("capture-scale", "capture_scale.py", "capture, profile and plan of a GPT-2-small-width model: time and size"),
    Case("call-path", "call_path.py", "the package's modules one pipelined call enters, and how often"),
    Case("processes", "processes_cpu.py", "torch's schedules on stages as processes against the in-process runtime, "
         "the plain module and the planner's predictions", needs="ranks",
         quick=("--ranks", "2", "--chunks", "2", "--repeats", "1", "--models", "gpt")),
    Case("layouts", "layouts_cpu.py", "every layout of replicas x stages measured against its prediction, the "
         "chosen one marked", needs="ranks"),
    Case("strategy-layouts", "strategy_layouts.py", "the layouts the strategy times before training "
         "(pipeline_parallel_size='auto', layout_trials=): predicted against measured, through the Trainer",
         needs="ranks", quick=("--model", "gpt", "--devices", "2", "--trials", "2")),
    Case("step-loss", "step_loss_cpu.py", "the loss charged to the last stage against the cut that leaves it out",
         needs="ranks"),
    Case("held-after-step", "held_after_step.py", "what autograd holds after each schedule's step (nothing)",
         needs="ranks"),
    Case("one-file-save", "one_file_save.py", "one checkpoint file by gather_object against DCP shards joined on "
         "rank 0: time and rank 0's memory", needs="ranks"),
    Case("large-model", "large_model.py", "models bigger than a device planned from meta and trained in stages, "
         "each stage's bytes against a quarter of the whole"),
    Case("plan-targets", "plan_targets.py", "published configs planned for named GPU clusters against arithmetic "
         "and published runs"),
    Case("gpu", "gpu.py", "on one GPU: overhead against the plain module, profile accuracy, memory, shared stages",
         needs="gpu"),
    Case("gpu-breakdown", "gpu_breakdown.py", "where benchmarks/gpu.py's misses come from", needs="gpu"),
    Case("fit-efficiencies", "fit_efficiencies.py", "the target cost model's operations predicted against timed on "
         "the GPU at hand", needs="gpu"),
)
"""Every benchmark; ``tests/test_benchmark_harness.py`` checks that each script under benchmarks/
with a ``main`` is one of them."""

HELPERS = ("benchmark_models.py", "harness.py", "ranks.py", "run.py")
"""The files under benchmarks/ that are not cases: what the cases share."""


RUNS_MD = BENCHMARKS.parent / "docs" / "benchmark-runs.md"
"""Where the benchmarks write their runs; docs/benchmarks.md summarises them."""
BENCHMARK_CACHE = Path.home() / ".cache" / "lightning-antichain-benchmarks"
"""The benchmarks' own profile cache: profiles are kept between runs, calibrations are not."""


def fresh_calibrations(cache: Path) -> Path:
    """``cache`` without its cached calibrations, so that the next plans calibrate on the machine as
    it is now (a calibration cached in a quieter or busier spell would be compared with steps
    measured in this one)."""
    for entry in cache.glob("calibration-*.json"):
        entry.unlink(missing_ok=True)
    return cache


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(threads: int | None = None) -> str:
    """The CPU, its cores and torch's version (and ``threads``, the intra-op threads a process)."""
    import torch

    text = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"
    return text if threads is None else f"{text}, {threads} thread(s)"


def write_section(text: str, start: str, end: str, heading: str) -> None:
    """Replace the text between the ``start`` and ``end`` markers, or append it under ``heading``."""
    old = RUNS_MD.read_text() if RUNS_MD.exists() else "# Benchmark runs\n"
    if start in old:
        new = old[: old.index(start)] + text + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip("\n") + f"\n\n{heading}\n\n" + text + "\n"
    RUNS_MD.write_text(new)


def command() -> str:
    """The command that runs this benchmark as it ran now, its script's path from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(BENCHMARKS.parent) if script.is_relative_to(BENCHMARKS.parent) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def section(start: str, end: str, lines: list[str]) -> str:
    """A docs section between its markers: the command that made it, then ``lines``."""
    return "\n".join([start, f"Command: `{command()}`  ", *lines, end])


def publish(text: str, start: str, end: str, heading: str, write: bool) -> None:
    """Print a section and, where ``write``, put it into docs/benchmark-runs.md (see :func:`write_section`)."""
    print(text)
    if write:
        write_section(text, start, end, heading)


def case(name: str) -> Case:
    """The case called ``name``, or an error that lists them."""
    for found in CASES:
        if found.name == name:
            return found
    raise SystemExit(f"no benchmark {name!r}: choose from {', '.join(c.name for c in CASES)} "
                     "(python benchmarks/run.py --list)")


def interleaved(ways: Mapping[K, Callable[[], T]], repeats: int, warmup: int = 1) -> dict[K, list[T]]:
    """Each way's readings (what it returns: seconds, or a record of several), the ways taking
    turns round after round; the first ``warmup`` rounds are run and dropped."""
    readings: dict[K, list[T]] = {name: [] for name in ways}
    for round_ in range(warmup + repeats):
        for name, way in ways.items():
            value = way()
            if round_ >= warmup:
                readings[name].append(value)
    return readings


def medians(readings: Mapping[K, list[float]]) -> dict[K, float]:
    return {name: statistics.median(values) for name, values in readings.items()}


def heading(what: str, threads: int | None = None) -> str:
    """The lines above a table: the command that made it, the machine it ran on (with ``threads``
    intra-op threads a process; this one's where not given), and ``what``."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    return f"Command: `{command()}`  \nMachine: {machine(threads)}; {what}\n"


@dataclass
class Table:
    """A markdown table printed a row at a time, as each is measured."""

    columns: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        print(self._line(self.columns), flush=True)
        print(self._line(("---",) * len(self.columns)), flush=True)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.columns)} columns")
        row = tuple(str(c) for c in cells)
        self.rows.append(row)
        print(self._line(row), flush=True)

    def markdown(self) -> str:
        return "\n".join(self._line(r) for r in (self.columns, ("---",) * len(self.columns), *self.rows))

    @staticmethod
    def _line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(cells) + " |"
