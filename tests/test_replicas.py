"""Pipeline replicas in real processes: 2 processes x 2 CPU stages over gloo, against 1 x 2 and plain."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from pipelined import assert_pipelined

pytestmark = pytest.mark.processes  # every test starts the script in real processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "replicas.py"


def losses(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    if "--plain" not in args:  # rank 0's pipeline really ran, on its own workers
        assert_pipelined(Counter({(stage, thread): count for stage, thread, count in data["tasks"]}))
    return data["world_size"], torch.tensor(data["losses"]), data["train_acc"]


# spawn starts the replicas as notebooks do; popen covers the same gradients in the default suite
@pytest.mark.parametrize("start_method", ["popen", pytest.param("spawn", marks=pytest.mark.slow)])
def test_two_replicas_of_two_stages_match_one_pipeline_and_plain_training(tmp_path, start_method):
    world, replicated, replicated_acc = losses(
        tmp_path, "replicas", "--devices", "4", "--stages", "2", "--batch-size", "16", "--start-method", start_method
    )
    assert world == 2 and len(replicated) == 10
    _, single, single_acc = losses(tmp_path, "single", "--devices", "2", "--batch-size", "32")
    _, plain, plain_acc = losses(tmp_path, "plain", "--devices", "1", "--plain", "--batch-size", "32")
    torch.testing.assert_close(single, plain, rtol=1e-5, atol=0)
    torch.testing.assert_close(replicated, plain, rtol=1e-5, atol=0)  # train_loss logged with sync_dist=True
    assert replicated_acc == single_acc == plain_acc  # a torchmetrics accuracy over both replicas' samples


@pytest.mark.slow  # 47 s; the popen replicas test stays in the default suite
def test_replicas_of_a_gpt_captured_by_export_agree_on_the_plan_and_match_plain(tmp_path):
    """Rank 0 plans; the other replica captures GPT-2 itself and must get the same operation names."""
    gpt = ("--model", "gpt2")
    world, replicated, _ = losses(tmp_path, "replicas", "--devices", "4", "--stages", "2", "--batch-size", "8", *gpt)
    assert world == 2 and len(replicated) == 10
    _, plain, _ = losses(tmp_path, "plain", "--devices", "1", "--plain", "--batch-size", "16", *gpt)
    torch.testing.assert_close(replicated, plain, rtol=1e-5, atol=0)
