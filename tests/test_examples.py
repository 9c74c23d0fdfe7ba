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
