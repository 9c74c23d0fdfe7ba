"""Faults in a real fit: a killed process resumes as plain Lightning does; errors and NaNs behave."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import lightning as L
import pytest
import torch
from lit_models import TinyClassifier, loader, trainer
from models import FAIL, fuse
from torch import nn

import lightning_antichain as la

SCRIPT = Path(__file__).resolve().parent / "scripts" / "kill_resume.py"
torch.fx.wrap("fuse")  # fx wraps by name in the calling module's globals, so here too


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}


def run(tmp_path, name, *args):
    out = tmp_path / f"{name}.jsonl"
    for extra in args:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "--ckpt-dir", str(tmp_path / name), "--out", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode in (0, -9), result.stderr[-2000:]  # -9: killed on purpose
    return losses(out)


@pytest.mark.slow  # 45-49 s; checkpoints resuming in the default suite: test_strategy's and the failing stage process's
def test_killed_run_resumes_like_plain_lightning(tmp_path):
    # 4 steps per epoch, a checkpoint at each epoch end, SIGKILL at step 6, resume from step 4.
    uninterrupted = run(tmp_path, "plain_full", [])
    plain = run(tmp_path, "plain", ["--kill-at", "6"], ["--resume"])
    piped = run(
        tmp_path,
        "piped",
        ["--pipeline", "--devices", "2", "--kill-at", "6"],
        ["--pipeline", "--devices", "2", "--resume"],
    )
    assert sorted(piped) == sorted(plain) == list(range(12))
    for step in range(12):
        assert piped[step] == pytest.approx(plain[step], rel=1e-5), step
        assert plain[step] == pytest.approx(uninterrupted[step], rel=1e-5), step  # plain resume matches here


class Exploding(TinyClassifier):
    def forward(self, x):
        for layer in list(self.net)[:6]:
            x = layer(x)
        return self.net[6](fuse(x))


class ArmAt(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        FAIL["forward"] = trainer.global_step == 2


def _stage_threads():
    return {th for th in threading.enumerate() if th.name.startswith("antichain-stage")}


def test_a_stage_raising_ends_the_fit_with_that_exception():
    earlier = _stage_threads()  # pipelines of earlier tests, not yet collected, may still hold theirs
    try:
        t = trainer(
            devices=3,
            strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False),
            max_steps=5,
            callbacks=[ArmAt()],
        )
        with pytest.raises(RuntimeError, match="fuse blew") as info:
            t.fit(Exploding(), loader())
    finally:
        FAIL["forward"] = False
    assert "pipeline stage" in "".join(getattr(info.value, "__notes__", []))
    assert not _stage_threads() - earlier  # this fit left no thread behind


class NaNAtStep(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 3:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss


def test_a_nan_loss_behaves_as_without_the_strategy():
    runs = []
    for strategy, devices in [("auto", 1), (la.AntichainPipelineStrategy(chunks=4, profile_cache=False), 2)]:
        torch.manual_seed(0)
        model = NaNAtStep()
        trainer(devices=devices, strategy=strategy, max_steps=6).fit(model, loader())
        runs.append(torch.tensor(model.losses))
    assert runs[0][:3].isfinite().all() and runs[0][3:].isnan().all()
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0, equal_nan=True)


DIFFERENTIAL = Path(__file__).resolve().parent / "scripts" / "differential.py"


@pytest.mark.processes
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_callback_failing_on_one_rank_ends_every_rank_with_that_error_last(tmp_path, rank):
    """A user's callback raises on one rank, outside the step, under schedule= with Lightning's
    launcher: the failing rank leaves its error for the others, which end with one line naming it,
    and the output ends with the user's error, not another rank's lost connection and C++ frames."""
    result = subprocess.run([sys.executable, str(DIFFERENTIAL), "--out", str(tmp_path / "out"), "--runtime", "1f1b",
                             "--cases", f"callback_fails_on_{rank}"], capture_output=True, text=True, timeout=180,
                            cwd=tmp_path)
    assert result.returncode != 0
    error = f"ValueError: the user's callback failed on rank {rank}"
    lines = result.stderr.strip().splitlines()
    assert error in lines[-1], result.stderr[-3000:]  # the last thing printed names it
    for r in (0, 1):
        said = [line for line in lines if line.startswith(f"[rank{r}]:")]
        assert said and error in said[-1], (r, said[-3:])  # each rank's last words
    assert "frame #" not in result.stderr and "Connection closed by peer" not in result.stderr
