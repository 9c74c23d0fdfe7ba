"""The profile cache where it cannot be written, and with several processes writing it at once."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest
import torch
from lit_models import TinyClassifier, loader, trainer
from torch import nn

import lightning_antichain as la
from lightning_antichain.planner import cache as profile_cache


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(profile_cache, "_warned", set())


def _fit(cache) -> None:
    strategy = la.AntichainPipelineStrategy(chunks=2, profile_cache=str(cache), calibrate=False)
    trainer(strategy=strategy, devices=2, max_steps=2).fit(TinyClassifier(), loader())


def test_an_unwritable_cache_falls_back_to_a_temporary_directory_with_one_warning(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(blocked / "cache")
        _fit(blocked / "cache")
    said = [str(w.message) for w in caught if "profile cache" in str(w.message)]
    assert len(said) == 1, said
    fallback = tmp_path / "tmp" / f"lightning-antichain-{profile_cache._user()}"
    assert f"using {fallback} instead" in said[0] and "LIGHTNING_ANTICHAIN_CACHE" in said[0]
    assert list(fallback.glob("*.json")), "the profile was cached in the fallback directory"
    assert capsys.readouterr().err.count("profiling TinyClassifier: ") == 1  # the second fit read it


def test_with_no_writable_directory_at_all_planning_runs_without_a_cache(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked / "tmp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(blocked / "cache")
    said = [str(w.message) for w in caught if "profile cache" in str(w.message)]
    assert len(said) == 1 and "profiling without a cache" in said[0]


_WRITER = textwrap.dedent("""
    import sys, warnings
    from pathlib import Path
    from lightning_antichain.planner import profile_store
    from lightning_antichain.planner.cost_graph import load_cost_graph
    directory, source, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    graph = load_cost_graph(source)
    errors = damaged = 0
    for _ in range(rounds):
        try:
            profile_store.store_profile(directory, "shared-key", graph)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                read = profile_store.load_profile(directory, "shared-key")
            damaged += read is None or bool(caught)
        except Exception as exc:
            errors += 1
            print(type(exc).__name__, exc, file=sys.stderr)
    print(errors, damaged)
""")


@pytest.mark.slow  # 23 s of racing processes
def test_processes_writing_one_entry_at_once_never_fail_or_read_half_a_file(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    source = tmp_path / "cost.json"
    la.save_cost_graph(la.profile(model, torch.randn(2, 8), repeats=1, warmup=0, progress=False), source)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "cache"), str(source), "150"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [w.communicate(timeout=300) for w in writers]
    for (out, err), writer in zip(results, writers):
        assert writer.returncode == 0, err
        errors, damaged = map(int, out.split())
        assert (errors, damaged) == (0, 0), err
    entry = tmp_path / "cache" / "profile-shared-key.json"
    assert list((tmp_path / "cache").iterdir()) == [entry], "no temporary file left"
    json.loads(entry.read_text())
