"""The benchmarks' one harness: every script is a case the runner knows, and a case run through it
prints its command, its machine and a table of measured ratios."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from harness import CASES, HELPERS, Table, interleaved  # noqa: E402


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS.parent)


def _has_main(path: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body)


def test_every_benchmark_script_is_a_case_and_every_case_a_script():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - set(HELPERS)
    cases = [c.script for c in CASES]
    assert sorted(cases) == sorted(scripts), "a script under benchmarks/ is not a case, or a case lost its script"
    assert len({c.name for c in CASES}) == len(CASES)
    assert all(_has_main(BENCHMARKS / s) for s in scripts)
    assert {c.needs for c in CASES} <= {"cpu", "ranks", "gpu"}


def test_a_case_knows_the_package_internals_its_script_reads():
    by_name = {c.name: c for c in CASES}
    assert by_name["stage-split"].internals() == []  # la.plan only
    assert "lightning_antichain.processes.process_pipeline" in by_name["layouts"].internals()


def test_the_runner_lists_every_case_and_refuses_an_unknown_name():
    listed = _run("--list", timeout=120)
    assert listed.returncode == 0, listed.stderr
    for found in CASES:
        assert f"| {found.name} | {found.needs} |" in listed.stdout
    unknown = _run("no-such-benchmark", timeout=120)
    assert unknown.returncode != 0
    assert "no benchmark 'no-such-benchmark'" in unknown.stderr and "--list" in unknown.stderr


def test_ways_take_turns_and_warm_up_rounds_are_dropped():
    order: list[str] = []

    def way(name: str):
        def measured() -> float:
            order.append(name)
            return float(len(order))
        return measured

    readings = interleaved({"a": way("a"), "b": way("b")}, repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert readings == {"a": [3.0, 5.0], "b": [4.0, 6.0]}


def test_a_table_refuses_a_row_of_the_wrong_width(capsys):
    table = Table(("model", "ratio"))
    table.add("mlp", "1.00")
    with pytest.raises(ValueError, match="2 columns"):
        table.add("mlp")
    assert table.markdown().splitlines()[-1] == "| mlp | 1.00 |"
    assert "| mlp | 1.00 |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in CASES if c.quick is not None])
def test_a_quick_run_through_the_runner_prints_its_command_machine_and_measured_ratios(name):
    done = _run(name, "--quick")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    script = next(c.script for c in CASES if c.name == name)
    assert f"Command: `python benchmarks/{script} " in done.stdout
    assert "Machine: " in done.stdout
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = lines[first:next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))]
    header, rows = _cells(table[0]), [_cells(line) for line in table[2:]]
    assert rows, done.stdout
    ratio = next(i for i, column in enumerate(header) if " / " in column)
    for row in rows:
        assert float(row[ratio]) > 0


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]
