"""Shared by the benchmark scripts: the machine's description and writing a section of docs/benchmark-runs.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path

RUNS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmark-runs.md"
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


def section(start: str, end: str, lines: list[str]) -> str:
    """A docs section between its markers: the command that made it, then ``lines``."""
    import sys

    return "\n".join([start, f"Command: `python {' '.join(sys.argv)}`  ", *lines, end])


def publish(text: str, start: str, end: str, heading: str, write: bool) -> None:
    """Print a section and, where ``write``, put it into docs/benchmark-runs.md (see :func:`write_section`)."""
    print(text)
    if write:
        write_section(text, start, end, heading)
