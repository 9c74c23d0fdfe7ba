"""The README's quick start is a script that runs: the file examples/quickstart/train.py, shown
whole in the README, trained here on a tiny Llama checkpoint directory on 2 CPU processes."""

import csv
import re
import subprocess
from pathlib import Path

import pytest
from launch import script_command

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples/quickstart/train.py"


def quick_start_blocks() -> list[str]:
    """The code blocks of the README's "Quick start" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\w*\n(.*?)```", section, flags=re.S)


def test_the_readme_shows_the_quick_start_script_as_it_is():
    assert SCRIPT.read_text() in quick_start_blocks(), "paste examples/quickstart/train.py into the README again"


def tiny_model_dir(directory: Path, text: str) -> None:
    """A Hugging Face checkpoint directory as one downloads it: config, sharded safetensors, a tokenizer."""
    import tokenizers
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="50KB")
    words = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(text.split()))[:127])}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


@pytest.mark.processes
def test_the_quick_start_trains_a_hugging_face_checkpoint_directory_on_two_cpu_processes(tmp_path):
    import argparse

    text = Path(argparse.__file__).read_text()
    (tmp_path / "text.txt").write_text(text)
    tiny_model_dir(tmp_path / "model", text)
    # as the README's torchrun line: --devices left to torchrun's processes per node
    command = script_command(SCRIPT, ["--model-dir", str(tmp_path / "model"), "--text-file", str(tmp_path / "text.txt"),
                                      "--length", "32", "--batch-size", "4", "--chunks", "2", "--max-steps", "3",
                                      "--accelerator", "cpu", "--precision", "32-true", "--lr", "1e-3"], 2)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "under 1f1b on 2 processes" in output  # the plan, as the README says the first step prints it
    assert "`max_steps=3` reached" in output
    assert list(tmp_path.rglob("*.ckpt"))  # Lightning's own checkpoint, saved by every rank's share
    (logged,) = tmp_path.glob("logs/quickstart/version_*/metrics.csv")  # each step's loss, from rank 0
    losses = [row["train_loss"] for row in csv.DictReader(logged.read_text().splitlines()) if row["train_loss"]]
    assert len(losses) == 3 and all(float(loss) > 0 for loss in losses)


def test_the_quick_starts_yaml_makes_the_strategy_the_script_makes():
    import yaml

    import lightning_antichain as la

    (yaml_block,) = [b for b in quick_start_blocks() if b.startswith("trainer:")]
    strategy = yaml.safe_load(yaml_block)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_antichain.AntichainPipelineStrategy"
    la.AntichainPipelineStrategy(**strategy["init_args"])  # every argument known and valid
    in_script = SCRIPT.read_text().split("la.AntichainPipelineStrategy(", 1)[1].split("\n    )", 1)[0]
    for name, value in strategy["init_args"].items():  # the same arguments as the script's, same values
        assert re.search(rf"\b{name}=", in_script), name
        if name != "chunks":  # the script takes chunks from its command line
            assert f"{name}={value!r}".replace("'", '"') in in_script, name
