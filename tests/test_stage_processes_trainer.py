"""Stages as processes through the real Trainer: Lightning's launcher starts one process per device
(gloo), and a float64 fit under every schedule equals plain Lightning step for step: the losses
training_step returns, what it logs, a torchmetrics accuracy, the validation loss, and every
parameter at the end, taken from the process that trained it. The model's first activation is read
by its last layer, so a skip crosses every cut between."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import processes_of, script_command

pytestmark = pytest.mark.processes  # the script in real processes (an options check aside)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "stage_processes.py"


def f64(values) -> torch.Tensor:
    """Reported values (JSON lists of Python floats) as float64, which they were computed in."""
    return torch.tensor(values, dtype=torch.float64)


def fit(out: Path, *args: str) -> list[dict]:
    """Run the script, its processes started together (tests/launch.py); each rank's report, by rank."""
    out.mkdir(parents=True)
    result = subprocess.run(script_command(SCRIPT, ["--out", str(out), *args], processes_of(args)),
                            capture_output=True, text=True, timeout=600, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(r.read_text()) for r in sorted(out.glob("rank*.json"))]
    for rank, report in enumerate(reports):
        predictions = out / f"predictions{rank}.json"
        if predictions.exists():
            report["predictions"] = json.loads(predictions.read_text())
    return reports


_PLAIN: dict[tuple[str, ...], dict] = {}


@pytest.fixture(scope="module")
def plain_with(tmp_path_factory):
    """Plain Lightning's report for the same settings, run once per module and settings."""
    def run(*args: str) -> dict:
        if args not in _PLAIN:
            (_PLAIN[args],) = fit(tmp_path_factory.mktemp("plain") / "out", "--plain", *args)
        return _PLAIN[args]
    return run


@pytest.fixture(scope="module")
def plain(plain_with) -> dict:
    return plain_with()


SLOW = pytest.mark.slow  # the 2-process 1F1B run stays in the default suite


CLIP = ("--clip", "0.3")  # clipping by norm takes the norm over every process's gradients
PREDICT = ("--predict",)  # predictions come back from the last stage, in order, to every rank


@pytest.mark.parametrize("devices, schedule, extra", [
    (2, "1f1b", (*CLIP, *PREDICT)),
    pytest.param(2, "gpipe", (), marks=SLOW),
    pytest.param(2, "interleaved-1f1b", (), marks=SLOW),
    pytest.param(2, "zb-h1", CLIP, marks=SLOW),
    pytest.param(2, "zbv", (), marks=SLOW),
    pytest.param(4, "1f1b", (), marks=SLOW),
    pytest.param(4, "gpipe", CLIP, marks=SLOW),
    pytest.param(4, "zb-h1", (), marks=SLOW),
    pytest.param(4, "zbv", PREDICT, marks=SLOW),
    pytest.param(2, "1f1b", ("--chunks", "auto"), marks=SLOW),  # the mean loss is the same for any count
    pytest.param(2, "1f1b", ("--compile",), marks=SLOW, id="2-1f1b-compiled"),  # compile_stages per process
])
def test_a_fit_with_one_process_per_stage_equals_plain_lightning(tmp_path, plain_with, devices, schedule, extra):
    plain = plain_with(*extra)
    ranks = fit(tmp_path / "out", "--devices", str(devices), "--schedule", schedule, *extra)
    assert len(ranks) == devices and all(r["world_size"] == devices for r in ranks)
    pids = {r["pid"] for r in ranks}
    assert len(pids) == devices and os.getpid() not in pids  # a process per device, none of them this one
    trained = [set(r["trained"]) for r in ranks]
    assert set().union(*trained) == set(plain["parameters"])  # every parameter trained by some process ...
    assert sum(len(t) for t in trained) == len(plain["parameters"])  # ... and by that one only
    for report, mine in zip(ranks, trained):
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        assert report["logged"] == pytest.approx(plain["logged"], rel=1e-6)  # every rank logs the step's value
        assert report["train_acc"] == plain["train_acc"]  # a metric updated per micro-batch, on every rank
        assert report["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
        for name in mine:
            ours, theirs = f64(report["parameters"][name]), f64(plain["parameters"][name])
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-12)
    calibration = [r["plan"]["calibration"] for r in ranks]  # timed in the first steps, on every rank alike
    assert all(c == calibration[0] for c in calibration) and calibration[0]["runtime"] == "processes"
    assert calibration[0]["steps"] == 3 and calibration[0]["schedule"] == schedule
    assert calibration[0]["measured_step_s"] > 0 and ranks[0]["plan"]["predicted_step_s"] > 0
    if "--compile" in extra:
        assert all(r["compiled_graphs"] > 0 for r in ranks)
    # every stage process keeps freed memory, as stages in one process and planning's profile do
    # (that it then reuses freed blocks: tests/test_op_clock.py); plain Lightning leaves malloc alone
    assert all(r["memory_kept"] for r in ranks) and not plain["memory_kept"]
    if "--predict" in extra:
        expected = f64(plain["predictions"])
        for rank in range(devices):
            torch.testing.assert_close(f64(ranks[rank]["predictions"]), expected, rtol=1e-6, atol=1e-12)


REPLICAS = ("--adam", *CLIP)  # AdamW: FSDP2 shards its moments too


# slow (34 s each): the default suite trains a (dp=2, pp=2) layout as plain Lightning in
# tests/test_process_habits.py, on replicas' unequal shares; FSDP2 also in the layout chain
@pytest.mark.parametrize("how", [pytest.param("ddp", marks=SLOW), pytest.param("fsdp", marks=SLOW)])
def test_replicas_of_a_pipeline_of_processes_train_as_plain_lightning_on_the_global_batch(tmp_path, plain_with, how):
    """4 processes, 2 per pipeline: a (dp=2, pp=2) mesh, each stage kept in step over "dp" by torch
    (DDP, or FSDP2 sharding it), each replica running half of every batch of 32. On every rank the
    step's loss, what it logs, the metric, the validation loss and the predictions are the whole
    batch's, and every parameter equals plain Lightning's, with clipping by the norm of all of the
    gradients. FSDP2 leaves each rank half of its stage's parameters and of AdamW's moments,
    counted in bytes."""
    plain = plain_with("--batch-size", "32", *REPLICAS, *PREDICT)
    ranks = fit(tmp_path / "out", "--devices", "4", "--stages", "2", "--schedule", "1f1b", "--replication", how,
                "--batch-size", "32", *REPLICAS, *PREDICT)
    assert [r["mesh"] for r in ranks] == [{"dims": ["dp", "pp"], "ranks": [[0, 2], [1, 3]]}] * 4
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(f64(report["logged"]), f64(plain["logged"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(f64(report["predictions"]), f64(plain["predictions"]), rtol=1e-6, atol=1e-12)
        assert report["train_acc"] == pytest.approx(plain["train_acc"], rel=1e-6)  # synced over the replicas
        assert report["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
        for name in report["trained"]:
            torch.testing.assert_close(f64(report["parameters"][name]), f64(plain["parameters"][name]),
                                       rtol=1e-6, atol=1e-12)
    stages = [set(ranks[0]["trained"]), set(ranks[2]["trained"])]
    assert set(ranks[1]["trained"]) == stages[0] and set(ranks[3]["trained"]) == stages[1]
    assert stages[0].isdisjoint(stages[1]) and stages[0] | stages[1] == set(plain["parameters"])
    for report in ranks:
        held, whole = report["optimizer_bytes"]
        if how == "ddp":
            assert report["bytes"] == {} and held == whole > 0
            continue
        assert set(report["bytes"]) == set(report["trained"])
        for local, full in report["bytes"].values():
            assert local == full // 2
        assert held == whole // 2 > 0


@pytest.mark.slow  # the search itself is tested in test_layouts.py and through the plan command
def test_stages_and_schedule_chosen_by_the_planner_train_as_plain_lightning(tmp_path, plain_with):
    """pipeline_parallel_size="auto", schedule="auto" on 4 processes: rank 0 weighs every layout on the first batch,
    every rank runs the one it chose (its mesh made then), and the fit equals plain Lightning."""
    plain = plain_with("--batch-size", "32")
    ranks = fit(tmp_path / "out", "--devices", "4", "--stages", "auto", "--schedule", "auto", "--batch-size", "32")
    layouts = [r["plan"]["layout"] for r in ranks]
    assert all(layout == layouts[0] for layout in layouts) and layouts[0]["dp"] * layouts[0]["pp"] == 4
    assert len({(row["dp"], row["pp"]) for row in ranks[0]["plan"]["layouts"]}) == 3
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(f64(report["logged"]), f64(plain["logged"]), rtol=1e-6, atol=0)
        for name in report["trained"]:
            torch.testing.assert_close(f64(report["parameters"][name]), f64(plain["parameters"][name]),
                                       rtol=1e-6, atol=1e-12)
    assert set().union(*(r["trained"] for r in ranks)) == set(plain["parameters"])


@SLOW  # 26 s; which layouts are timed and how the rows tell it: test_layouts.py
def test_layouts_timed_on_the_ranks_before_training_leave_the_fit_as_plain_lightning_s(tmp_path, plain_with):
    """layout_trials=2: the ranks build the two layouts predicted fastest on the first batch (the
    sanity check's) and time their training steps, optimizer included, in turns; every rank trains
    the one measured faster (the plan's rows say both times), and the fit still equals plain
    Lightning: the trial steps' gradients, optimizer state, parameter updates and metric updates
    were put back."""
    # the epoch's accuracy counts every update; the sanity check's validation batch comes first and plans
    settings = ("--batch-size", "32", "--adam", "--max-epochs", "1", "--sanity-steps", "2")
    ranks = fit(tmp_path / "out", "--devices", "2", "--stages", "auto", "--schedule", "1f1b", "--layout-trials", "2",
                *settings)
    rows = ranks[0]["plan"]["layouts"]
    timed = [row for row in rows if "measured_step_s" in row]
    assert len(timed) == 2 and {(row["dp"], row["pp"]) for row in timed} <= {(1, 2), (2, 1)}
    (chosen,) = [row for row in rows if "lost" not in row]
    assert chosen in timed and all(chosen["measured_step_s"] <= row["measured_step_s"] for row in timed)
    assert all(r["plan"]["layout"] == ranks[0]["plan"]["layout"] for r in ranks)
    plain = plain_with(*settings)
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(f64(report["logged"]), f64(plain["logged"]), rtol=1e-6, atol=0)
        assert report["train_acc"] == pytest.approx(plain["train_acc"], rel=1e-9)
        assert report["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
        for name in report["trained"]:
            torch.testing.assert_close(f64(report["parameters"][name]), f64(plain["parameters"][name]),
                                       rtol=1e-6, atol=1e-12)


def losses_after(reports: list[dict]) -> torch.Tensor:
    return f64(reports[0]["losses"])


@SLOW  # 49 s; the failing-rank test of the default suite resumes from a checkpoint of stage processes too
def test_a_checkpoint_of_stage_processes_resumes_in_plain_lightning_exactly(tmp_path, plain):
    """Each rank writes its own stages' weights and optimizer state as torch.distributed.checkpoint
    shards, under the plain module's names; the one-line consolidation gives plain Lightning a file
    it resumes from exactly, equal to plain training's checkpoint."""
    ckpt = tmp_path / "stages.ckpt"
    (first, second) = fit(tmp_path / "a", "--devices", "2", "--schedule", "1f1b", "--max-epochs", "1", "--save",
                          str(ckpt))
    assert ckpt.is_dir()
    writers = shard_writers(ckpt)
    for rank, report in enumerate((first, second)):
        for name in report["trained"]:
            assert writers[f"state_dict.{name}"] == rank  # from the process that trained it, and only there
    one_file = tmp_path / "consolidated.ckpt"
    done = subprocess.run([sys.executable, "-m", "lightning_antichain", "consolidate", str(ckpt), "--output",
                           str(one_file)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = fit(tmp_path / "b", "--plain", "--max-epochs", "2", "--resume", str(one_file))
    steps = len(plain["losses"]) // 2
    torch.testing.assert_close(losses_after(resumed), f64(plain["losses"][steps:]), rtol=1e-6, atol=0)
    reference = tmp_path / "plain.ckpt"
    fit(tmp_path / "c", "--plain", "--max-epochs", "1", "--save", str(reference))
    ours, theirs = (torch.load(p, weights_only=False) for p in (one_file, reference))
    torch.testing.assert_close(ours["state_dict"], theirs["state_dict"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(ours["optimizer_states"], theirs["optimizer_states"], rtol=1e-6, atol=1e-12)
    # the same shards, one of them cut short: every rank names the directory and the file before reading
    shard = ckpt / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "d"
    out.mkdir()
    args = ["--out", str(out), "--devices", "2", "--schedule", "1f1b", "--max-epochs", "2", "--resume", str(ckpt)]
    damaged = subprocess.run(script_command(SCRIPT, args, 2), capture_output=True, text=True, timeout=300, cwd=out)
    assert damaged.returncode != 0
    for rank in (0, 1):
        assert (f"[rank{rank}]: lightning_antichain.weights.sharded_checkpoint.DamagedCheckpointError: the checkpoint "
                f"{ckpt} is damaged: the shard __1_0.distcp is cut short") in damaged.stderr, damaged.stderr[-3000:]


def shard_writers(directory: Path) -> dict[str, int]:
    """Which rank wrote each tensor of a torch.distributed.checkpoint directory (its file ``__R_0.distcp``)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(directory).read_metadata().storage_data
    return {index.fqn: int(info.relative_path.split("_")[2]) for index, info in storage.items()}


def consolidated(directory: Path) -> Path:
    """The checkpoint at ``directory`` as one file, by the documented command (run in this process)."""
    from lightning_antichain.cli import main

    output = directory.with_suffix(".consolidated")
    assert main(["consolidate", str(directory), "--output", str(output)]) == 0
    return output


@pytest.mark.slow  # five fits, 4 and 2 processes among them
def test_a_checkpoint_moves_between_schedules_process_counts_runtimes_and_plain_lightning(tmp_path):
    """4 processes (1F1B) -> 2 processes (GPipe) -> the in-process runtime -> plain -> 4 processes,
    one epoch each, with AdamW's state: the losses are an uninterrupted plain run's."""
    whole = fit(tmp_path / "whole", "--plain", "--max-epochs", "5", "--adam")
    legs = [("--devices", "4", "--schedule", "1f1b"), ("--devices", "2", "--schedule", "gpipe"),
            ("--devices", "2", "--schedule", "none"), ("--plain",), ("--devices", "4", "--schedule", "1f1b")]
    got, previous = [], None
    for epoch, leg in enumerate(legs, start=1):
        ckpt = tmp_path / f"epoch{epoch}.ckpt"
        resume = ("--resume", str(previous)) if previous else ()
        got += fit(tmp_path / f"leg{epoch}", *leg, "--adam", "--max-epochs", str(epoch), "--save", str(ckpt),
                   *resume)[0]["losses"]
        previous = ckpt
    torch.testing.assert_close(f64(got), f64(whole[0]["losses"]), rtol=1e-6, atol=0)


@pytest.mark.slow  # five fits of 4 processes (one plain)
def test_a_checkpoint_moves_between_layouts_of_replicas_and_stages(tmp_path):
    """2 FSDP2 replicas x 2 stages (shards) -> one pipeline of 4 -> 2 DDP replicas x 2 (one file)
    -> plain -> 2 FSDP2 replicas x 2, one epoch each, with AdamW: the losses are an uninterrupted
    plain run's. FSDP2's weights and moments go into the shards as the replicas hold them (each
    replica writes its half, through torch.distributed.checkpoint) under the plain names, and are
    read whole by name and sharded again on loading; the batch is the step's whole batch in every
    layout."""
    from torch.distributed.checkpoint import FileSystemReader

    whole = fit(tmp_path / "whole", "--plain", "--max-epochs", "5", "--adam", "--batch-size", "32")
    replicas = ("--devices", "4", "--stages", "2", "--schedule", "1f1b")
    legs = [(*replicas, "--replication", "fsdp"), ("--devices", "4", "--schedule", "1f1b"), (*replicas, "--one-file"),
            ("--plain",), (*replicas, "--replication", "fsdp")]
    got, previous = [], None
    for epoch, leg in enumerate(legs, start=1):
        ckpt = tmp_path / f"epoch{epoch}.ckpt"
        resume = ("--resume", str(previous)) if previous else ()
        reports = fit(tmp_path / f"leg{epoch}", *leg, "--adam", "--batch-size", "32", "--max-epochs", str(epoch),
                      "--save", str(ckpt), *resume)
        got += reports[0]["losses"]
        previous = ckpt
        if epoch == 1:  # every weight and moment of a stage in two halves, one from each replica
            stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
            halves = {key: len(meta.chunks) for key, meta in stored.items() if key.endswith(("weight", "exp_avg"))}
            assert halves and set(halves.values()) == {2}, halves
    torch.testing.assert_close(f64(got), f64(whole[0]["losses"]), rtol=1e-6, atol=0)


def test_a_balance_given_by_hand_cuts_the_stages_of_one_process_with_virtual_stages(tmp_path, plain):
    """``balance=`` (and ``plan=``) drive the stages as in the in-process runtime: one process alone
    holds two virtual stages of 10 and 14 operations, and trains as plain Lightning; the checkpoint
    carries the plan."""
    ckpt = tmp_path / "one.ckpt"
    (report,) = fit(tmp_path / "out", "--devices", "1", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
                    "--balance", "10,14", "--save", str(ckpt))
    assert report["stage_ops"] == [1 + 10, 14]  # the first stage holds the model's input too
    torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
    saved = torch.load(ckpt / "meta.pt", weights_only=True)
    assert [len(stage["nodes"]) for stage in saved["antichain_pipeline"]["plan"]["stages"]] == [1 + 10, 14]


def test_process_mode_options_are_checked_when_given():
    import lightning_antichain as la

    with pytest.raises(ValueError, match="schedule='bogus' is not one of"):
        la.AntichainPipelineStrategy(schedule="bogus")
    with pytest.raises(ValueError, match="each process holds one device: leave it out"):
        la.AntichainPipelineStrategy(schedule="1f1b", placement=[0, 0])
    with pytest.raises(ValueError, match="replication='zero' is not one of 'ddp', 'fsdp'"):
        la.AntichainPipelineStrategy(schedule="1f1b", pipeline_parallel_size=2, replication="zero")
    with pytest.raises(ValueError, match="virtual_stages=2 is for"):
        la.AntichainPipelineStrategy(virtual_stages=2)
    with pytest.raises(ValueError, match="holds 1 stage"):
        la.AntichainPipelineStrategy(schedule="1f1b", virtual_stages=2)
    strategy = la.AntichainPipelineStrategy(schedule="zb-h1", chunks=8)
    assert strategy.options.schedule == "1f1b" and strategy._runtime.ranks.schedule.virtual_stages == 2


@pytest.mark.parametrize("how, block", [
    ("training_step", 2),
    pytest.param("forward", 4, marks=SLOW),
    pytest.param("backward", 0, marks=SLOW),  # the first block: on rank 0, whose process holds the store
    pytest.param("killed", 4, marks=SLOW),
])
def test_a_failing_stage_process_stops_every_process_and_the_checkpoint_before_resumes(tmp_path, plain, how, block):
    """The fault comes at step 8; a checkpoint was written at step 6, the end of the first epoch
    (Lightning resumes exactly from an epoch's end). Every process ends, the main one with the
    failing rank's error where that rank raised one."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "FAIL_HOW": how, "FAIL_AT": "8", "FAIL_BLOCK": str(block)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--devices", "2", "--schedule", "1f1b",
                             "--every", "6"], capture_output=True, text=True, timeout=60, cwd=out, env=env)
    assert result.returncode != 0 and time.monotonic() - started < 60
    said = ["\n".join(line for line in result.stderr.splitlines() if line.startswith(f"[rank{r}]:")) for r in (0, 1)]
    if how != "killed":  # every rank names the failing rank's error (the store lives in rank 0's process)
        failure = f"injected failure in {how if how == 'training_step' else 'a stage' + chr(39) + 's ' + how}"
        # the rank whose stage holds the fault follows the plan, which follows the profile's timings
        failing = next(r for r in (0, 1) if f"StageProcessError: the process of another stage failed, rank {r}"
                       in said[1 - r])
        assert failure in said[failing] and failure in said[1 - failing]
        assert failing == {"training_step": 1, "backward": 0}.get(how, failing)  # the last stage's, the first's
    assert not _running(str(out))  # no process of this run is left behind
    resumed = fit(tmp_path / "resumed", "--plain", "--resume", str(consolidated(out / "epoch=0-step=6.ckpt")))
    torch.testing.assert_close(losses_after(resumed), f64(plain["losses"][6:]), rtol=1e-6, atol=0)


@pytest.mark.slow  # ~40 s; the quick suite ends a failing rank's run in test_a_failing_stage_process_stops...
@pytest.mark.parametrize("block", [5, 0])  # where the stalled layer is (as planned)
def test_a_stage_stuck_past_the_timeout_ends_the_run_with_the_transfer_it_waited_for(tmp_path, block):
    """A stage stalls for 60 s at step 3 under timeout=4: the rank waiting on it stops within the
    timeout and names the task it was about to run, what that task waits for, and from which rank;
    torchrun then ends the stalled rank. Without the timeout the run would wait 30 minutes."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "FAIL_HOW": "stalled", "STALL_S": "60", "FAIL_AT": "3", "FAIL_BLOCK": str(block)}
    args = ["--out", str(out), "--devices", "2", "--schedule", "1f1b", "--timeout", "4"]
    started = time.monotonic()
    result = subprocess.run(script_command(SCRIPT, args, 2), capture_output=True, text=True, timeout=120, cwd=out,
                            env=env)
    assert result.returncode != 0 and time.monotonic() - started < 55, result.stderr[-3000:]
    said = re.search(r"TransferTimeout: rank (\d) waited 4 s \(timeout=\) for a transfer of its pipeline that did not "
                     r"come, (?:before|after) its [^:]*: it waits for [^.]*(?:from|on) rank (\d)", result.stderr)
    assert said is not None, result.stderr[-3000:]
    assert {said.group(1), said.group(2)} == {"0", "1"}  # the one rank named the other


def _running(marker: str) -> bool:
    """Whether a process whose command line holds ``marker`` still runs."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow  # 20 s each; test_process_habits.py trains uneven batches in the default suite
@pytest.mark.parametrize("samples", [88, 90])
def test_a_shorter_last_batch_trains_as_plain_lightning(tmp_path, plain_with, samples):
    """88 samples: five batches of 16, then one of 8, in four micro-batches of 2 (stages made for
    their shape). 90: the last batch of 10 splits into 3, 3, 2, 2, which run as two runs of one
    size each, the second in GPipe's order (1F1B takes no fewer micro-batches than stages)."""
    ranks = fit(tmp_path / "out", "--devices", "2", "--schedule", "1f1b", "--samples", str(samples))
    reference = plain_with("--samples", str(samples))
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(reference["losses"]), rtol=1e-6, atol=0)


TIED = "net.transformer.wte.weight"  # GPT-2's input embedding, also its output layer's weight


# 34 s each; by default a tie across ranks is found and refused where nothing keeps its copies in step
# (tests/test_process_stages.py), and one process's tie trains in tests/test_pipeline.py
@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=SLOW), pytest.param("none", marks=SLOW),
                                      pytest.param("zbv", marks=SLOW)])
def test_gpt2_with_its_embedding_tied_to_its_output_layer_across_the_first_and_last_rank_equals_plain(
        tmp_path, plain_with, schedule):
    """Each of the two ranks holds a copy of the tied weight (with ZBV both stages that use it are on
    rank 0); the copies end equal, to the bit, and equal plain training's weight. The sizes an
    exported GPT-2 reads once and uses in every layer are read again from the tensors each stage
    receives, since torch's stages send tensors only. In one process (``none``), each of the two
    devices reads its own leaf of the weight, and both gradients reach it."""
    settings = ("--model", "gpt2", *CLIP)  # the tied weight's gradient counts once in the norm
    plain = plain_with(*settings)
    ranks = fit(tmp_path / "out", "--devices", "2", "--schedule", schedule, *settings)
    if schedule == "none":
        (report,) = ranks
        assert report["tied_across_devices"] == 1
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        for name, values in plain["parameters"].items():
            torch.testing.assert_close(f64(report["parameters"][name]), f64(values), rtol=1e-6, atol=1e-12)
        return
    trained = [set(r["trained"]) for r in ranks]
    assert set().union(*trained) == set(plain["parameters"])
    if schedule == "1f1b":
        assert trained[0] & trained[1] == {TIED}
        assert ranks[0]["parameters"][TIED] == ranks[1]["parameters"][TIED]
    else:
        assert not trained[0] & trained[1] and TIED in trained[0]
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        assert report["train_acc"] == plain["train_acc"]
        for name in report["trained"]:
            torch.testing.assert_close(f64(report["parameters"][name]),
                                       f64(plain["parameters"][name]), rtol=1e-6, atol=1e-12)


@SLOW  # 42 s; test_process_stages.py keeps a stage process's batch norm statistics in the default suite
@pytest.mark.parametrize("deferred", [(), ("--deferred-bn", "--recompute", "always")])
def test_batchnorm_normalises_per_micro_batch_as_the_in_process_runtime_does(tmp_path, plain_with, deferred):
    """BatchNorm sees one micro-batch at a time in both runtimes (documented in docs/strategy.md),
    so a step differs from plain training's, and equals the in-process runtime's: losses, and the
    validation loss computed with the running statistics both update per micro-batch, or, with
    ``deferred_batch_norm``, once per step from the whole batch (and once only where the stages
    recompute their forward in backward)."""
    model = ("--model", "batchnorm", *deferred)
    ranks = fit(tmp_path / "processes", "--devices", "2", "--schedule", "1f1b", *model)
    (in_process,) = fit(tmp_path / "threads", "--devices", "2", "--schedule", "none", *model)
    plain = plain_with(*model)
    assert ranks[0]["losses"][1] != pytest.approx(plain["losses"][1], rel=1e-3)  # statistics of 4, not 16 samples
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(in_process["losses"]), rtol=1e-6,
                                   atol=0)
        assert report["val_loss"] == pytest.approx(in_process["val_loss"], rel=1e-6)


@pytest.mark.slow  # 25 s
def test_gradient_accumulation_and_recomputation_under_stage_processes_equal_plain(tmp_path, plain_with):
    plain = plain_with("--accumulate", "2")
    for report in fit(tmp_path / "out", "--devices", "2", "--schedule", "zb-h1", "--accumulate", "2",
                      "--recompute", "always"):
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        assert report["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-6)
        assert report["plan"]["accumulate_grad_batches"] == 2  # its prediction charges the window's adding


@SLOW  # 24 s; in process, models built on meta train in the default suite (test_hf_meta.py, the zoo)
def test_gpt2_built_on_meta_is_made_real_stage_by_stage_each_rank_its_own_and_trains_as_plain(tmp_path, plain_with):
    """Built in configure_model() on the meta device (empty_init) and loaded from the plain model's
    initial weights, as a pretrained checkpoint goes in: each rank makes only its own stages'
    parameters real, trains as plain Lightning does, and the one-file checkpoint holds every
    weight from the rank that holds it (each rank's share written beside it, joined by rank 0 and
    removed)."""
    settings = ("--model", "gpt2", *CLIP)
    plain = plain_with(*settings)
    ckpt = tmp_path / "meta.ckpt"
    ranks = fit(tmp_path / "out", "--devices", "2", "--schedule", "1f1b", "--meta", "--save", str(ckpt), "--one-file",
                *settings)
    real = [set(r["parameters"]) for r in ranks]
    assert real[0] != set(plain["parameters"]) != real[1] and real[0] | real[1] == set(plain["parameters"])
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ckpt.name, "out"])  # no shares left beside it
    for report in ranks:
        torch.testing.assert_close(f64(report["losses"]), f64(plain["losses"]), rtol=1e-6, atol=0)
        for name, values in report["parameters"].items():
            torch.testing.assert_close(f64(values), f64(plain["parameters"][name]), rtol=1e-6,
                                       atol=1e-12)
            torch.testing.assert_close(saved[name].flatten(), f64(values), rtol=0, atol=0)
    assert not any(v.is_meta for v in saved.values())


@SLOW  # three fits of GPT-2
def test_gpt2_on_meta_resumes_from_its_shards_each_rank_reading_its_own_stages(tmp_path, plain_with):
    """A model built on meta resumes from a checkpoint of shards: each rank's stages take their
    weights and optimizer state from the shards when they are made real; two epochs with a
    resume between equal two plain ones."""
    settings = ("--model", "gpt2", "--meta", "--adam")
    plain = plain_with("--model", "gpt2", "--adam")
    ckpt = tmp_path / "meta.ckpt"
    first = fit(tmp_path / "a", "--devices", "2", "--schedule", "1f1b", "--max-epochs", "1", "--save", str(ckpt),
                *settings)
    assert ckpt.is_dir()
    resumed = fit(tmp_path / "b", "--devices", "2", "--schedule", "1f1b", "--max-epochs", "2", "--resume", str(ckpt),
                  *settings)
    torch.testing.assert_close(f64(first[0]["losses"] + resumed[0]["losses"]), f64(plain["losses"]), rtol=1e-6,
                               atol=0)
