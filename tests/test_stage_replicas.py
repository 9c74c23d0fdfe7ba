"""Replicas of a pipeline whose stages are processes: 4 real processes (gloo) as a (dp=2, pp=2)
DeviceMesh, each stage kept in step over "dp" by torch's DDP or FSDP2, under torch's 1F1B over
"pp". Each replica runs its half of the batch; the gradients are the plain module's on the whole
batch, in float64, and FSDP2 leaves each rank 1/dp of its stage's parameters."""

from __future__ import annotations

import os
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_process_stages import BALANCES, CHUNKS, batch, build, loss_fn, reports_of, started, stop

pytestmark = pytest.mark.processes


def replica_process(rank: int, port: int, how: str, results: mp.Queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        model = build()
        x, y = batch()
        half = len(x) // 2
        xs, ys = x[dp * half:(dp + 1) * half], y[dp * half:(dp + 1) * half]
        graph = capture_call(model, (xs[:half // CHUNKS],), {})
        cost = la.profile(model, xs[:half // CHUNKS], op_graph=graph, repeats=1, warmup=0, progress=False,
                          runtime_overhead=False)
        plan = la.plan_from_balance(cost, BALANCES[2], chunks=CHUNKS)
        full_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        pipeline = ProcessPipeline(graph, plan, process_schedule("1f1b"), pp, 2, torch.device("cpu"),
                                   group=mesh["pp"].get_group(), replication=(how, mesh["dp"]))
        targets = ys.chunk(CHUNKS)
        calls = [((m,), {}) for m in xs.chunk(CHUNKS)] if pipeline.holds_first else None
        # each replica back-propagates twice its half's sum: the replicas' mean is the whole batch's sum
        pipeline.run("step", calls, lambda out, m: 2 * loss_fn(out, targets[m]), CHUNKS, train=True)
        mine = {id(p) for p in pipeline.parameters()}
        grads, local_bytes = {}, {}
        for name, param in model.named_parameters():
            if id(param) not in mine:
                continue
            grad = param.grad
            local = param.to_local() if hasattr(param, "to_local") else param
            local_bytes[name] = local.numel() * local.element_size()
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().numpy()
        results.put((rank, dp, pp, grads, local_bytes, full_bytes))
    except Exception as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}", None, None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 25 s each; tests/test_process_habits.py trains DDP replicas through the Trainer by default
@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_each_stage_replicated_over_dp_by_torch_trains_as_the_plain_module(how):
    reports = reports_of(*started(replica_process, 4, how), 180, "a replica process")
    model = build()
    x, y = batch()
    loss_fn(model(x), y).backward()
    plain = dict(model.named_parameters())
    for pp in (0, 1):
        held = [r for r in reports if r[2] == pp]
        assert len(held) == 2 and set(held[0][3]) == set(held[1][3]) and held[0][3]
    assert set().union(*(r[3] for r in reports)) == set(plain)
    for rank, dp, pp, grads, local_bytes, full_bytes in reports:
        for name, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), plain[name].grad, rtol=1e-12, atol=1e-13,
                                       msg=f"{how}: rank {rank} (dp {dp}, pp {pp}) {name}")
            shards = 2 if how == "fsdp" else 1  # FSDP2 keeps 1/dp of each parameter on each replica
            assert local_bytes[name] * shards == full_bytes[name], (how, rank, name)


class Wide(torch.nn.Module):
    """Four layers of 2 MB each in float64: torch's DDP puts them in buckets of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))

    def forward(self, x):
        return self.layers(x)


def overlap_process(rank: int, port: int, results: mp.Queue) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
        torch.manual_seed(0)
        model = Wide().double()
        x = torch.randn(8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        graph = capture_call(model, (x[:2],), {})
        cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
        plan = la.partition(cost, 1, chunks=4)  # one stage: each replica a pipeline of one process
        pipeline = ProcessPipeline(graph, plan, process_schedule("1f1b"), 0, 1, torch.device("cpu"),
                                   group=mesh["pp"].get_group(), replication=("ddp", mesh["dp"]))
        events: list[str] = []

        def reduce_bucket(state, bucket):
            events.append("reduce")
            return allreduce_hook(mesh["dp"].get_group(), bucket)

        pipeline.modules[0].register_comm_hook(None, reduce_bucket)
        model.layers[0].weight.register_post_accumulate_grad_hook(lambda p: events.append("first layer"))
        calls = [((m,), {}) for m in x.chunk(4)]
        for _ in range(2):  # DDP's first step is its own (its buckets are made again after it)
            events.clear()
            pipeline.run("step", calls, lambda out, m: out.square().sum(), 4, train=True)
        results.put((rank, events))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def test_the_replicas_reduce_gradients_during_the_last_backward_not_after_it():
    """In a step after the first (DDP makes its buckets again after its first), DDP's buckets go out
    in the last micro-batch's backward only, the first before that backward reaches the first
    layer: the reduction overlaps the backward (one after the step would come after every
    gradient), once per step, not once per micro-batch."""
    processes, results = started(overlap_process, 2)
    try:
        reports = [results.get(timeout=180) for _ in range(2)]
    except queue.Empty:
        pytest.fail("a replica process gave no result within 180 s")
    finally:
        stop(processes)
    for _, events in reports:
        assert isinstance(events, list), events
        assert events.count("first layer") == 4  # one gradient per micro-batch
        reductions = [i for i, e in enumerate(events) if e == "reduce"]
        last_gradient = max(i for i, e in enumerate(events) if e == "first layer")
        assert len(reductions) >= 2, events  # several buckets, in the last micro-batch's backward only
        earlier = [i for i, e in enumerate(events) if e == "first layer"][:-1]
        assert max(earlier) < reductions[0] < last_gradient < reductions[-1], events
