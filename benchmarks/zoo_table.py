"""The "works with" table: every zoo model captured, planned over 3 stages and checked in float64.

Runs the same parity check as ``tests/test_zoo.py`` (4 micro-batches, eval mode) and prints a
Markdown table with the frontend that captured each model, its operations, the capture time and
the largest output and gradient errors.

    python benchmarks/zoo_table.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_zoo import zoo_parity  # noqa: E402
from zoo import ZOO  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    setup = "CPU, float64, 3 stages x 4 micro-batches"
    print(f"Command: `python benchmarks/zoo_table.py`; torch {torch.__version__}, {setup}")
    print()
    print("| model | library | captured by | ops | capture + plan + check s | output error | gradient error |")
    print("|---|---|---|---|---|---|---|")
    passed = 0
    for name, entry in ZOO.items():
        started = time.perf_counter()
        try:
            graph, _, out_error, grad_error = zoo_parity(name)
        except Exception as exc:  # a row that says what failed, rather than no table
            print(f"| {name} | {entry.library} | failed: {type(exc).__name__} | | | | |")
            continue
        ok = out_error <= 1e-9 and grad_error <= 1e-9
        passed += ok
        print(f"| {name} | {entry.library} | {graph.frontend} | {len(graph)} | {time.perf_counter() - started:.1f} | "
              f"{out_error:.0e} | {grad_error:.0e} |")
    print()
    print(f"{passed} of {len(ZOO)} pipelined with float64 parity (errors relative, limit 1e-9)")


if __name__ == "__main__":
    main()
