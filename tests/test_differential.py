"""The differential check: a table of small models and Lightning habits, each trained by plain
Lightning, by the in-process runtime and under each of torch's schedules, through the real Trainer
and launcher; every loss, logged value, prediction and final weight must be plain Lightning's
(float64, rtol 1e-6), or the run must stop with the expected clear error on every rank.

The rows are tests/scripts/differential_cases.py's, run by tests/scripts/differential.py: the rows
of one runtime in one launch, one after the other (a row expected to stop runs alone). Each bug
found in a runtime becomes a row. In the default suite: plain, the in-process runtime and 1F1B;
the other schedules and most refusals under ``-m slow``.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from launch import script_command

pytestmark = pytest.mark.processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "differential.py"
SCHEDULES = ("1f1b", "zbv", "gpipe", "interleaved-1f1b", "zb-h1")
QUICK = ("threads", "1f1b")  # in the default suite; the other schedules under -m slow

ANOTHER_RANKS = "holds only its own stages' parameters"


@dataclass(frozen=True)
class Row:
    """A row of the table and, by runtime, the error every rank stops with where it is refused."""

    name: str
    refused: dict[str, str] = field(default_factory=dict)


def refused_as_processes(says: str) -> dict[str, str]:
    return dict.fromkeys(SCHEDULES, says)


REFUSALS_UNDER = ("threads", "1f1b", "zbv")  # a refusal is the runtime's, whatever schedule runs the stages


ROWS = [
    Row("reverse"),  # a gradient-reversal Function: its backward was dropped
    Row("round"),  # a straight-through estimator
    Row("saved"),  # a surrogate gradient from saved tensors and non-tensor arguments
    Row("tied"),  # one parameter and one layer used at both ends: hung under 1F1B
    Row("gru"),  # weak references to parameters: every rank crashed releasing them
    Row("nested"),  # dicts, tuples and an int across cuts; a buffer
    Row("finetuning"),  # Lightning's BaseFinetuning unfreezing layers other ranks hold
    Row("demo_lstm", refused_as_processes("hidden[0] of shape (2, 8, 8), whose batch dim (1) holds 8")),
    Row("weight_norms", refused_as_processes(ANOTHER_RANKS)),
    Row("l2", refused_as_processes(ANOTHER_RANKS)),
    Row("normalised_loss", refused_as_processes("the loss is")),
    Row("counted_predictions", refused_as_processes("what predict_step returns at ['n'] is 2 joined over the "
                                                    "micro-batches but 4 on them together")),
    Row("untracked_bn", {runtime: "BatchNorm1d at backbone.1 has no running statistics"
                         for runtime in ("threads", *SCHEDULES)}),
]
BY_NAME = {row.name: row for row in ROWS}
QUICK_REFUSALS = {("normalised_loss", "1f1b"), ("l2", "1f1b")}


def launched(root: Path, runtime: str, names: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    out = root / runtime / "-".join(names)
    processes = 1 if runtime in ("plain", "threads") else 2
    args = ["--out", str(out), "--runtime", runtime, "--cases", ",".join(names)]
    result = subprocess.run(script_command(SCRIPT, args, processes), capture_output=True, text=True, timeout=600,
                            cwd=root)
    return result, out


class Runs:
    """Each runtime's launch of the rows it trains as plain Lightning, made once when first asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def equal_rows(self, runtime: str) -> list[str]:
        return [row.name for row in ROWS if runtime not in row.refused]

    def reports(self, runtime: str, name: str) -> list[dict]:
        if runtime not in self.done:
            rows = [row.name for row in ROWS] if runtime == "plain" else self.equal_rows(runtime)
            self.done[runtime] = launched(self.root, runtime, rows)
        result, out = self.done[runtime]
        found = [json.loads(p.read_text()) for p in sorted((out / name).glob("rank*.json"))]
        assert found, f"{runtime} wrote nothing for {name}:\n{result.stderr[-4000:]}"
        return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("differential"))


def f64(values) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)


def assert_close(ours, theirs, where: str) -> None:
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-10, equal_nan=True, msg=where)


def assert_as_plain(report: dict, plain: dict, rank: int) -> None:
    assert "error" not in report, report.get("traceback")
    assert_close(f64(report["losses"]), f64(plain["losses"]), f"rank {rank}: losses")
    assert len(report["logged"]) == len(plain["logged"])
    for step, (ours, theirs) in enumerate(zip(report["logged"], plain["logged"])):
        assert ours.keys() == theirs.keys(), f"rank {rank}, step {step}: logged {sorted(ours)} not {sorted(theirs)}"
        for key in theirs:
            assert_close(ours[key], theirs[key], f"rank {rank}, step {step}: {key}")
    assert report["fit_metrics"].keys() == plain["fit_metrics"].keys()
    for key, value in plain["fit_metrics"].items():
        assert_close(report["fit_metrics"][key], value, f"rank {rank}: {key} at the end of fit")
    ours, spec = pytree.tree_flatten(report["predictions"])
    theirs, plain_spec = pytree.tree_flatten(plain["predictions"])
    assert spec == plain_spec, f"rank {rank}: predictions of another structure"
    for a, b in zip(ours, theirs):
        assert_close(a, b, f"rank {rank}: predictions")
    if rank == 0:
        assert report["whole"].keys() == plain["whole"].keys()
        for key, value in plain["whole"].items():
            assert_close(report["whole"][key], value, f"final {key}")


def cases(runtimes: tuple[str, ...]) -> list:
    params = []
    for row in ROWS:
        for runtime in runtimes:
            if runtime in row.refused and runtime not in REFUSALS_UNDER:
                continue
            quick = runtime in QUICK if runtime not in row.refused else (row.name, runtime) in QUICK_REFUSALS
            params.append(pytest.param(row.name, runtime, id=f"{row.name}-{runtime}",
                                       marks=() if quick else pytest.mark.slow))
    return params


@pytest.mark.parametrize(("name", "runtime"), cases(("threads", *SCHEDULES)))
def test_each_row_trains_as_plain_lightning_or_is_refused_on_every_rank(runs, name, runtime):
    row = BY_NAME[name]
    (plain,) = runs.reports("plain", name)
    assert "error" not in plain, plain.get("traceback")
    if runtime not in row.refused:
        reports = runs.reports(runtime, name)
        assert len(reports) == (1 if runtime == "threads" else 2)
        for rank, report in enumerate(reports):
            assert_as_plain(report, plain, rank)
        return
    result, out = launched(runs.root, runtime, [name])
    assert result.returncode != 0
    reports = [json.loads(p.read_text()) for p in sorted((out / name).glob("rank*.json"))]
    assert len(reports) == (1 if runtime == "threads" else 2), result.stderr[-4000:]
    for rank, report in enumerate(reports):
        assert row.refused[runtime] in report.get("error", ""), f"rank {rank}: {report.get('error')}"
