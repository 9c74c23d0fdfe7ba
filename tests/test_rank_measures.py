"""What the ranks measure together before the layout search weighs stages as CPU processes: each
kind of collective's latency and bandwidth, and the work they get through at once, in real gloo
processes (the cost model that uses them: test_layouts.py)."""

import os

import pytest
import torch
import torch.distributed as dist
from test_process_stages import reports_of, started
from torch import nn

from lightning_antichain.measure.link_speed import KINDS, measured_collectives
from lightning_antichain.planner.contention import capacity_of_two, processes_capacity
from lightning_antichain.planner.shared_cores import dtensor_overhead_s, shared_cores

RANKS = 2


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))


class PlainTensorsOnly(torch.optim.SGD):
    """An optimizer that cannot step DTensors (FSDP2's parameters)."""

    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"]):
            raise RuntimeError("plain tensors only")
        return super().step(closure)


def measuring_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        speeds = measured_collectives(torch.device("cpu"), repeats=2)
        model = conv_net()
        optimizer = torch.optim.AdamW(model.parameters())
        before = {n: b.clone() for n, b in model.named_buffers()}
        cores = shared_cores(model, (torch.randn(4, 3, 16, 16),), {}, [optimizer], shares=[1, 2])
        from_loss = shared_cores(model, (torch.randn(4, 3, 16, 16),), {}, [optimizer],
                                 loss=lambda out: out.logsumexp(1).mean())
        capacity = (cores.model, cores.optimizer, cores.optimizer_at(2), from_loss.model)
        assert [share for share, _ in cores.optimizer_shares] == [2]  # the half, measured apart
        per_tensor = cores.optimizer_tensor_s, dtensor_overhead_s(PlainTensorsOnly(model.parameters(), lr=0.1))
        untouched = all(torch.equal(before[n], b) for n, b in model.named_buffers()) and all(
            p.grad is None for p in model.parameters()) and not optimizer.state

        def fails_on_one_rank() -> None:
            if rank == 1:
                raise RuntimeError("this rank's step fails")

        failed = processes_capacity(fails_on_one_rank)
        results.put((rank, "ok", {k: (v.latency_s, v.gbps) for k, v in speeds.items()}, capacity, untouched,
                     failed, per_tensor))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", repr(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_ranks_measure_each_collective_and_their_capacity_alike_and_a_failing_step_measures_nothing():
    """Every rank gets the same latencies, bandwidths and capacities (the slowest rank's times);
    each capacity, the model's and the optimizer's (on all parameters, and each rank on half of
    them), lies between one rank's work and two; the
    measured steps leave the model's buffers (BatchNorm's running statistics), its gradients and
    the optimizer's state as they were; a step that fails on one rank gives ``None`` on both,
    neither waiting for the other. What a DTensor adds to AdamW's step per parameter tensor
    (FSDP2's shards) is rank 0's, on both, and ``None`` on both for an optimizer that cannot step
    DTensors."""
    processes, results = started(measuring_rank, RANKS)
    reports = sorted(reports_of(processes, results, 120, "measuring on 2 ranks"))
    (_, _, speeds, capacity, untouched, failed, per_tensor), other = reports[0], reports[1]
    assert other[2:] == reports[0][2:]
    assert set(speeds) == set(KINDS)
    assert all(latency >= 0 and gbps > 0 for latency, gbps in speeds.values())
    assert all(c is not None and 1.0 <= c <= 2.0 for c in capacity)  # model, optimizer on all, on half; from a loss
    assert untouched and failed is None
    assert per_tensor[0] is not None and 1e-6 < per_tensor[0] < 0.01  # DTensor's dispatch: about 0.2 ms here
    assert per_tensor[1] is None  # rank 0 could not step DTensors: both ranks hear it, neither waits


def test_the_capacity_of_all_ranks_becomes_the_plans_capacity_of_two_stages_while_there_are_cores():
    assert capacity_of_two(1.9, ranks=4, cores=2) == pytest.approx(1.9)  # two cores: four ranks do what two do
    assert capacity_of_two(3.4, ranks=4, cores=8) == pytest.approx(1.8)  # each rank beyond the first adds 0.8
    assert capacity_of_two(1.0, ranks=1, cores=8) == 1.0
