"""The CIFAR-10 example runs as a user runs it: LightningCLI, YAML config, a real subprocess."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHORT_RUN = [
    "--trainer.max_steps",
    "6",
    "--trainer.val_check_interval",
    "3",
    "--trainer.limit_val_batches",
    "2",
    "--data.synthetic_size",
    "400",
    "--data.batch_size",
    "16",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.mark.parametrize(
    "strategy",
    [[], pytest.param(["--trainer.strategy", "antichain_pipeline"], marks=pytest.mark.slow)],  # the same run
    ids=["yaml-class-path", "registered-name"],
)
def test_cifar10_example_trains_from_yaml(tmp_path, strategy):
    command = [
        sys.executable,
        str(ROOT / "examples/cifar10/train.py"),
        "fit",
        "--config",
        str(ROOT / "examples/cifar10/config.yaml"),
        "--data.data_dir",
        str(tmp_path / "no-cifar-here"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        *SHORT_RUN,
        *strategy,
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "SYNTHETIC CIFAR-shaped data set" in output  # announced, not silent
    assert "plan for Classifier: 2 stages" in output
    if strategy:  # the registered name with its defaults: chunks="auto", weighed on the first batch
        assert "chunks=auto for batches of 16: chose" in output
    metrics = list((tmp_path / "runs").rglob("metrics.csv"))
    assert metrics and "val_acc" in metrics[0].read_text()
    assert list((tmp_path / "runs").rglob("*.ckpt"))


@pytest.mark.slow  # the same path runs in-process in tests/test_hf_meta.py
def test_llm_finetune_example_builds_on_meta_loads_shards_and_trains_lora_from_yaml(tmp_path):
    command = [
        sys.executable, str(ROOT / "examples/llm_finetune/train.py"), "fit",
        "--config", str(ROOT / "examples/llm_finetune/config.yaml"),
        "--model.checkpoint", str(tmp_path / "stand-in"),
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "writing a STAND-IN" in output and "source of Python's argparse" in output  # announced, not silent
    assert (tmp_path / "stand-in" / "model.safetensors.index.json").exists()
    assert "plan for PeftModel: 2 stages" in output
    metrics = list((tmp_path / "runs").rglob("metrics.csv"))
    assert metrics and "val_loss" in metrics[0].read_text()
    assert list((tmp_path / "runs").rglob("last.ckpt"))


def _metrics(run: Path) -> list[dict[str, str]]:
    import csv

    (found,) = list(run.rglob("metrics.csv"))
    with open(found) as f:
        return list(csv.DictReader(f))


def _assert_same_metrics(ours: list[dict[str, str]], theirs: list[dict[str, str]], rtol: float) -> None:
    assert len(ours) == len(theirs) and ours and ours[0].keys() == theirs[0].keys()
    for row, (a, b) in enumerate(zip(ours, theirs)):
        for key, value in b.items():
            if value == "":
                assert a[key] == "", (row, key)
            else:
                assert float(a[key]) == pytest.approx(float(value), rel=rtol, abs=1e-12), (row, key, a[key], value)


def _example_run(tmp_path: Path, name: str, schedule: str | None, *args: str) -> list[dict[str, str]]:
    run = tmp_path / (schedule or "in-process")
    command = [sys.executable, str(ROOT / f"examples/{name}/train.py"), "fit",
               "--config", str(ROOT / f"examples/{name}/config.yaml"),
               "--trainer.logger.init_args.save_dir", str(run / "runs"), "--trainer.log_every_n_steps", "1",
               "--trainer.enable_progress_bar", "false", *args,
               *(("--trainer.strategy.init_args.schedule", schedule) if schedule else ())]
    run.mkdir()
    result = subprocess.run(command, cwd=run, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return _metrics(run / "runs")


CIFAR_UNEVEN = ("--data.data_dir", "no-cifar-here", "--data.synthetic_size", "400", "--data.batch_size", "38",
                "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
                "--trainer.precision", "64-true")


@pytest.fixture(scope="module")
def cifar_in_process(tmp_path_factory) -> list[dict[str, str]]:
    return _example_run(tmp_path_factory.mktemp("cifar"), "cifar10", None, *CIFAR_UNEVEN)


@pytest.mark.slow  # 55 s with its reference; test_process_habits.py runs uneven batches under processes by default
@pytest.mark.processes
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_the_cifar10_example_trains_under_stages_as_processes_as_in_process(tmp_path, cifar_in_process, schedule):
    """ResNet-18 on batches of 38 (eight micro-batches of 5, 5, 5, 5, 5, 5, 4, 4; BatchNorm per
    micro-batch in both runtimes), in float64: every logged loss and accuracy, training and
    validation, equals the in-process runtime's."""
    ours = _example_run(tmp_path, "cifar10", schedule, *CIFAR_UNEVEN)
    _assert_same_metrics(ours, cifar_in_process, rtol=1e-9)


LLM_FROZEN = ("--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
              "--model.lr", "0.0")


@pytest.fixture(scope="module")
def llm_in_process(tmp_path_factory) -> tuple[Path, list[dict[str, str]]]:
    where = tmp_path_factory.mktemp("llm")
    checkpoint = where / "stand-in"
    return checkpoint, _example_run(where, "llm_finetune", None, "--model.checkpoint", str(checkpoint), *LLM_FROZEN)


@pytest.mark.slow  # 30 s each; test_hf_meta.py keeps the in-process path in the default suite
@pytest.mark.processes
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_the_llm_example_runs_under_stages_as_processes_as_in_process(tmp_path, llm_in_process, schedule):
    """The Llama built on meta, loaded from sharded safetensors, with LoRA and its own ``labels=``
    loss: the shuffled batches (rank 0 draws the order, as plain Lightning), the loss joined over
    micro-batches by their label tokens, the training and validation losses logged, as in
    process. Hugging Face computes the loss in float32 and AdamW turns rounding into different
    steps, so the weights stay as loaded (``lr=0``): each logged loss then equals to float32's
    rounding."""
    checkpoint, theirs = llm_in_process
    ours = _example_run(tmp_path, "llm_finetune", schedule, "--model.checkpoint", str(checkpoint), *LLM_FROZEN)
    assert any(row["train_loss"] for row in ours) and any(row["val_loss"] for row in ours)
    _assert_same_metrics(ours, theirs, rtol=1e-6)
