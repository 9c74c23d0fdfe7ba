"""Checkpoints as torch.distributed.checkpoint shards, read back by name: the format alone, and the
in-process runtime saving and resuming through it. Shards written by several processes are tested
in test_stage_processes_trainer.py."""

import re
from pathlib import Path

import pytest
import torch
from lit_models import TinyClassifier, first_of_two_epochs, loader, trainer
from torch import nn

import lightning_antichain as la
from lightning_antichain.cli import main as command
from lightning_antichain.weights.materialize import materialize
from lightning_antichain.weights.sharded_checkpoint import (
    DamagedCheckpointError,
    ShardedCheckpoint,
    is_sharded_checkpoint,
    save_sharded,
)


def test_a_lightning_checkpoint_comes_back_whole_from_its_shards_and_per_parameter(tmp_path):
    momentum = {3: {"exp_avg": torch.randn(4), "step": torch.tensor(7.0)}, 11: {"exp_avg": torch.randn(2, 2),
                                                                                "step": torch.tensor(7.0)}}
    checkpoint = {
        "state_dict": {"net.0.weight": torch.randn(3, 2), "net.0.bias": torch.randn(3)},
        "optimizer_states": [{"state": momentum, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                                   "params": [3, 11]}]}],
        "epoch": 2, "global_step": 12, "callbacks": {"ModelCheckpoint": {"best": None}},
    }
    path = tmp_path / "ckpt"
    save_sharded(checkpoint, path)
    assert is_sharded_checkpoint(path) and not is_sharded_checkpoint(tmp_path)
    shards = ShardedCheckpoint(path)
    whole = shards.whole()
    assert whole.keys() == checkpoint.keys() and whole["epoch"] == 2
    torch.testing.assert_close(whole["state_dict"], checkpoint["state_dict"], rtol=0, atol=0)
    torch.testing.assert_close(whole["optimizer_states"], checkpoint["optimizer_states"], rtol=0, atol=0)
    assert list(whole["optimizer_states"][0]["state"]) == [3, 11]  # indices, as torch's optimizers key them
    only = shards.optimizer_states().read(0, {11})
    assert list(only["state"]) == [11] and only["param_groups"] == checkpoint["optimizer_states"][0]["param_groups"]


def test_the_in_process_runtime_saves_shards_and_resumes_from_them_on_other_devices(tmp_path):
    steps = 5  # one epoch: 80 samples in batches of 16
    path = tmp_path / "four.ckpt"
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, save_distributed_checkpoint=True)
    uninterrupted, first = first_of_two_epochs(strategy, 4, path)
    assert is_sharded_checkpoint(path)

    resumed = TinyClassifier()
    torch.manual_seed(0)
    trainer(devices=2, strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False),
            max_epochs=2).fit(resumed, loader(80), ckpt_path=path)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses[steps:]), rtol=1e-5,
                               atol=0)

    one_file = tmp_path / "one.ckpt"
    assert command(["consolidate", str(path), "--output", str(one_file)]) == 0
    plain = TinyClassifier.load_from_checkpoint(one_file)  # plain Lightning, no strategy
    for (name, ours), theirs in zip(first.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


def test_shards_load_by_name_into_a_model_on_meta_when_its_tensors_are_made_real(tmp_path):
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    path = tmp_path / "shards"
    save_sharded({"state_dict": saved.state_dict()}, path)
    with la.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    la.load_checkpoint(model, path)
    assert all(p.is_meta for p in model.parameters())  # nothing read yet
    materialize([model[2]], torch.device("cpu"))  # one stage's layer
    torch.testing.assert_close(model[2].weight, saved[2].weight, rtol=0, atol=0)
    assert model[0].weight.is_meta


def test_consolidating_a_file_or_nothing_says_what_to_give(tmp_path, capsys):
    (tmp_path / "a.ckpt").write_bytes(b"")
    assert command(["consolidate", str(tmp_path / "a.ckpt")]) == 2
    assert "is a checkpoint file, which plain Lightning loads as it is" in capsys.readouterr().err
    assert command(["consolidate", str(tmp_path / "b.ckpt")]) == 2
    assert f"there is no checkpoint at {tmp_path / 'b.ckpt'}" in capsys.readouterr().err


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGES = {
    "a shard cut short": (lambda d: _cut(next(d.glob("*.distcp"))), "the shard __0_0.distcp is cut short: it holds"),
    "the index removed": (lambda d: (d / ".metadata").unlink(), ".metadata is missing: the save did not finish"),
    "the index garbled": (lambda d: (d / ".metadata").write_bytes(b"not a pickle"),
                          "its index .metadata cannot be read"),
    "meta.pt removed": (lambda d: (d / "meta.pt").unlink(), "meta.pt is missing"),
    "meta.pt cut short": (lambda d: _cut(d / "meta.pt"), "meta.pt is cut short"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_named_with_its_file_and_the_fix_before_anything_is_read(tmp_path, capsys, damage):
    """Resuming through the Trainer and consolidating by the command both check a directory of
    shards first: the error names the directory, the file and what is wrong, in one line from the
    command (it printed a 30-frame traceback, or IsADirectoryError, or a CheckpointException
    naming ranks)."""
    path = tmp_path / "epoch=0-step=5.ckpt"
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, save_distributed_checkpoint=True)
    first_of_two_epochs(strategy, 2, path)
    breaks, says = DAMAGES[damage]
    breaks(path)
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"the checkpoint {path} is damaged: ") + ".*"
                       + re.escape(says)) as raised:
        trainer(devices=2, strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False),
                max_epochs=2).fit(TinyClassifier(), loader(80), ckpt_path=path)
    assert "Resume from another checkpoint" in str(raised.value)
    capsys.readouterr()  # what the fits printed
    assert command(["consolidate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightning-antichain: error: the checkpoint {path} is damaged") and says in err
    assert err.count("\n") == 1  # one line, no traceback
    assert not path.with_suffix(".ckpt.consolidated").exists()


def test_a_checkpoint_file_cut_short_is_named_before_lightning_reads_it(tmp_path):
    path = tmp_path / "one.ckpt"
    strategy = la.AntichainPipelineStrategy(chunks=4, profile_cache=False, save_distributed_checkpoint=False)
    first_of_two_epochs(strategy, 2, path)
    _cut(path)
    with pytest.raises(DamagedCheckpointError, match=f"the checkpoint {re.escape(str(path))} is damaged: one.ckpt is "
                                                     "cut short"):
        trainer(devices=2, strategy=la.AntichainPipelineStrategy(chunks=4, profile_cache=False),
                max_epochs=2).fit(TinyClassifier(), loader(80), ckpt_path=path)
