"""Long planning work shows one progress bar per phase on a terminal, and one line per phase in a log."""

from __future__ import annotations

import sys

import torch
from torch import nn

import lightning_antichain as la


def model() -> nn.Module:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.Tanh())])


def test_a_log_keeps_one_line_per_phase(capsys):
    la.profile(model(), torch.randn(4, 32), repeats=2, warmup=1, progress=True, runtime_overhead=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("lightning-antichain: captured Sequential with fx: 13 operations in ")
    assert lines[1].startswith("profiling Sequential: 39/39 op runs in ")  # 13 nodes (the input too), 3 runs each


def test_a_terminal_gets_a_bar_with_the_time_left(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    la.profile(model(), torch.randn(4, 32), repeats=2, warmup=1, progress=True, runtime_overhead=False)
    err = capsys.readouterr().err
    assert "\r" in err and "profiling Sequential" in err
    assert "39/39" in err and "<" in err  # tqdm's elapsed<remaining
