"""CPU stages compute with their share of the cores, and planning profiles with that same count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_antichain as la
from lightning_antichain.measure.cpu_threads import cpu_cores, stage_threads
from lightning_antichain.planner import planning
from lightning_antichain.plans.options import PipelineOptions


class Recorder(nn.Module):
    """A layer (kept whole by capture) that notes the intra-op threads of each call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return torch.relu(self.linear(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Recorder(8) for _ in range(4)))


def test_the_cores_are_shared_among_the_cpu_stages():
    assert stage_threads(["cpu"]) == cpu_cores()
    assert stage_threads(["cpu", "cpu"]) == max(1, cpu_cores() // 2)
    assert stage_threads(["cpu"] * (cpu_cores() + 1)) == 1
    assert stage_threads(["cpu", "cpu"], requested=3) == 3
    assert stage_threads(["meta"]) is None  # no stage computes on the CPU


@pytest.mark.parametrize("requested", [None, 1, 2])
def test_stage_workers_and_planning_compute_with_the_stages_thread_count(tmp_path, requested):
    model = _model()
    x = torch.randn(8, 8)
    caller = torch.get_num_threads()
    expected = stage_threads(["cpu", "cpu"], requested)
    plan = planning.plan_model(model, (x[:2],), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                               progress=False, leaf_modules=(Recorder,), cpu_threads=requested,
                               rebalance_rounds=0).plan
    seen = {n for layer in model for n in layer.seen}
    assert seen == {expected}  # profiled and calibrated with the stages' count
    assert torch.get_num_threads() == caller  # the caller's own count is left as it was
    for layer in model:
        layer.seen.clear()
    with la.Pipeline(model, plan, leaf_modules=(Recorder,), cpu_threads=requested) as pipe:
        pipe(x).sum().backward()
    assert {n for layer in model for n in layer.seen} == {expected}
    assert torch.get_num_threads() == caller


def test_a_thread_count_that_is_not_a_positive_whole_number_is_refused():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="cpu_threads is the intra-op threads of each CPU stage"):
            PipelineOptions(cpu_threads=bad)
    with pytest.raises(ValueError, match="cpu_threads"):
        la.AntichainPipelineStrategy(cpu_threads=0)
    assert la.AntichainPipelineStrategy(cpu_threads=2, rebalance_rounds=1).options.cpu_threads == 2
