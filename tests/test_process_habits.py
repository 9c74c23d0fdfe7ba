"""Lightning habits under stages as processes equal plain Lightning, or are refused on every rank.

tests/scripts/habits.py trains in float64 on dict batches with a per-sample ``list[str]``, in
batches that do not split into equal micro-batches (the last training batch holds 6 samples for 4
micro-batches; evaluation batches of 5), logging with ``reduce_fx`` sum and max and
``sync_dist=True``, a torchmetrics accuracy ``on_step`` (to a CSV file), and predicting dicts of a
tensor, an int and the names. Every rank must see what plain Lightning on one device sees: the
step losses, the logged values (the CSV file rank 0 writes, column by column), the predictions;
each rank holds only its own stages' parameters (the others on meta, counted in bytes), and the
strategy gives the whole trained model on demand.
"""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch import processes_of, script_command

pytestmark = pytest.mark.processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "habits.py"


def run(out: Path, *args: str, launcher: str = "torchrun") -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the script, its processes started together (tests/launch.py) unless ``launcher="lightning"``;
    how it ended, and each rank's report."""
    out.mkdir(parents=True)
    processes = processes_of(args, devices=2) if launcher == "torchrun" else 1
    result = subprocess.run(script_command(SCRIPT, ["--out", str(out), *args], processes), capture_output=True,
                            text=True, timeout=300, cwd=out)
    return result, [json.loads(r.read_text()) for r in sorted(out.glob("rank*.json"))]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    result, (report,) = run(tmp_path_factory.mktemp("plain") / "out", "--plain")
    assert result.returncode == 0, result.stderr[-3000:]
    return report


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_same_values(ours: dict, theirs: dict, where: str) -> None:
    assert ours.keys() == theirs.keys(), where
    for key, value in theirs.items():
        if value in ("", None):
            assert ours[key] in ("", None), (where, key)
        else:
            assert float(ours[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-12), (where, key)


def assert_as_plain(ranks: list[dict], plain: dict) -> None:
    """What every rank saw, and what rank 0 logged and gives as the whole model, equal plain Lightning's."""
    for rank, report in enumerate(ranks):
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        assert_same_values(report["callback_metrics"], plain["callback_metrics"], f"rank {rank}")
        assert len(report["predictions"]) == len(plain["predictions"])
        for ours, theirs in zip(report["predictions"], plain["predictions"]):
            assert ours["batch"] == theirs["batch"] and ours["names"] == theirs["names"]  # joined, not per micro-batch
            torch.testing.assert_close(f64(ours["probabilities"]), f64(theirs["probabilities"]), rtol=1e-6, atol=1e-12)
    logged = ranks[0]["csv"]  # what the logger of rank 0 wrote: every step's row, every column
    assert len(logged) == len(plain["csv"]) and "train_acc_step" in logged[0]
    for row, (ours, theirs) in enumerate(zip(logged, plain["csv"])):
        assert_same_values(ours, theirs, f"csv row {row}")
    whole = ranks[0]["whole"]  # the strategy's full_state_dict() on rank 0: every trained tensor
    assert whole.keys() == plain["parameters"].keys()
    for name, values in plain["parameters"].items():
        torch.testing.assert_close(torch.tensor(whole[name]), torch.tensor(values), rtol=1e-6, atol=1e-12)


# the in-process runtime ("none", 13 s) keeps these habits in its own tests of the default suite
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zbv", marks=pytest.mark.slow),
                                      pytest.param("none", marks=pytest.mark.slow)])
def test_every_habit_behaves_as_plain_lightning_on_every_rank(tmp_path, plain, schedule):
    result, ranks = run(tmp_path / "out", "--schedule", schedule, "--devices", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(ranks) == (1 if schedule == "none" else 2)
    assert_as_plain(ranks, plain)
    if schedule == "none":
        return
    plain_bytes = sum(len(v) * 8 for v in plain["parameters"].values())
    held = [set(r["parameters"]) for r in ranks]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(plain["parameters"])
    assert set(ranks[0]["meta"]) == held[1] and set(ranks[1]["meta"]) == held[0]  # the others' on meta
    for report, names in zip(ranks, held):
        assert report["held_bytes"] == sum(len(plain["parameters"][n]) * 8 for n in names) < plain_bytes
        for name in names:  # what a rank holds is the trained value
            torch.testing.assert_close(torch.tensor(report["parameters"][name]),
                                       torch.tensor(plain["parameters"][name]), rtol=1e-6, atol=1e-12)
    assert sum(r["held_bytes"] for r in ranks) == plain_bytes


@pytest.mark.parametrize("case, says", [
    ("manual", "RuntimeError: manual optimization (automatic_optimization = False)"),  # refused at setup
    # at the batch it skips; 17 s, the same stop on every rank as the manual case, raised mid-fit
    pytest.param("skip", "RuntimeError: training_step returned None to skip this batch", marks=pytest.mark.slow),
])
def test_a_habit_processes_cannot_follow_stops_every_rank_with_what_to_do(tmp_path, case, says):
    """Manual optimization runs the backward in the step, which torch's schedule runs; Lightning
    skips no batch in a run of several processes. Every rank raises the same error, which says
    what to do (the in-process runtime does both as plain Lightning): none waits on another."""
    started = time.monotonic()
    result, _ = run(tmp_path / "out", "--schedule", "1f1b", "--case", case, launcher="lightning")
    assert result.returncode != 0 and time.monotonic() - started < 120
    for rank in (0, 1):
        assert f"[rank{rank}]: {says}" in result.stderr, result.stderr[-3000:]
    assert "leave out schedule=" in result.stderr.lower()


REPLICAS = ("--samples", "79", "--batch-size", "40", "--shuffle")  # shares of 20 and 19 in the second batch


@pytest.mark.slow  # ~35 s of 4 processes (the quick suite is near its 15 minutes); CI runs it with the slow tests
def test_each_replica_loads_only_its_share_and_the_layout_trains_as_plain_lightning(tmp_path):
    """4 processes, 2 replicas of a pipeline of 2 (1F1B): a shuffled loader's batches of 40 (the
    order plain Lightning draws, drawn by rank 0) are cut in two shares, and each replica's
    processes load their share only, so 79 samples an epoch cost each process 40 or 39 loads,
    not 79. The second batch's shares (20 and 19) split into micro-batches of unequal sizes, which
    both replicas run in as many runs. Every habit equals plain Lightning on the whole batch."""
    result, (plain,) = run(tmp_path / "plain", "--plain", *REPLICAS)
    assert result.returncode == 0, result.stderr[-3000:]
    result, ranks = run(tmp_path / "out", "--schedule", "1f1b", "--devices", "4", "--stages", "2", *REPLICAS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_as_plain(ranks, plain)
    # gloo's groups are gone before the interpreter finalizes (held transfers freed then abort a rank)
    exits = [json.loads((tmp_path / "out" / f"exit{rank}.json").read_text()) for rank in range(4)]
    assert exits == [{"process_group": False}] * 4
    epochs = [plain["loaded"][:79], plain["loaded"][79:]]
    batches = [epoch[i:i + 40] for epoch in epochs for i in range(0, 79, 40)]
    for replica, mine in ((0, (0, 2)), (1, (1, 3))):  # rank = position x 2 + replica
        share = [index for batch in batches for index in torch.tensor_split(torch.tensor(batch), 2)[replica].tolist()]
        for rank in mine:
            assert ranks[rank]["loaded"] == share, (rank, replica)
    assert [len(r["loaded"]) for r in ranks] == [80, 78, 80, 78] and len(plain["loaded"]) == 158
