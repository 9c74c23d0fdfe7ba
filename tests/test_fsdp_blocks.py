"""FSDP2 gathers a stage's parameters a block at a time, in real gloo processes.

Replicas of a pipeline whose stages are processes, sharded by FSDP2 over ``dp`` with each decoder
layer a unit of its own (:mod:`lightning_antichain.stages.block_units`), as dp=2 x pp=2 and
dp=4 x pp=1 meshes under 1F1B. Every rank counts, at every operation of a training step (forward
and backward of every micro-batch), the parameter bytes alive on it: its shards, plus the
parameters gathered then. Regathered per micro-batch, that peak is the shards, the parameters
outside the blocks (gathered by the stage for the step) and at most two blocks (the one running
and the one prefetched), never the whole stage; gathered once per step, it is the whole stage.
The gradients and AdamW's moments after two steps, with a validation pass after each, equal the
plain module's, in float64.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_block_units import VOCAB, Decoder
from test_process_stages import reports_of, started

pytestmark = [pytest.mark.processes, pytest.mark.slow]

CHUNKS, BATCH, LENGTH, LAYERS, WIDTH = 4, 16, 6, 8, 16


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen), torch.randint(0, VOCAB, (BATCH, LENGTH),
                                                                                    generator=gen)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def live_parameter_bytes(modules: list[torch.nn.Module], shard_bytes: int) -> int:
    """This rank's shards, plus every parameter the modules hold gathered now (a plain tensor where
    FSDP2 keeps a ``DTensor`` shard between uses), each storage once."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for module in modules:
        for sub in module.modules():
            for param in sub._parameters.values():
                if isinstance(param, torch.Tensor) and not isinstance(param, DTensor):
                    storage = param.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return shard_bytes + sum(storages.values())


def fsdp_process(rank: int, port: int, dp: int, regather: str, results: mp.Queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_pipeline import ProcessPipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    pp = 4 // dp
    try:
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        replica, position = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        torch.manual_seed(0)
        model = Decoder(LAYERS, WIDTH).double()
        originals = dict(model.named_parameters())
        x, y = batch()
        share = BATCH // dp
        xs, ys = x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]
        graph = capture_call(model, (xs[:share // CHUNKS],), {})
        cost = la.profile(model, xs[:share // CHUNKS], op_graph=graph, repeats=1, warmup=0, progress=False,
                          runtime_overhead=False)
        count = cost.number_of_nodes()
        balance = [count] if pp == 1 else [count // 2, count - count // 2]
        plan = la.plan_from_balance(cost, balance, chunks=CHUNKS)
        pipeline = ProcessPipeline(graph, plan, process_schedule("1f1b"), position, pp, torch.device("cpu"),
                                   group=mesh["pp"].get_group(), replication=("fsdp", mesh["dp"]), regather=regather)
        stage = pipeline.stages[0].stage
        params = {n: pipeline.replaced[id(p)] for n, p in originals.items() if id(p) in pipeline.replaced}
        in_blocks = {id(p) for unit in stage.block_units for p in unit.module.parameters()}
        block_bytes = [sum(p.numel() * p.element_size() for p in unit.module.parameters())
                       for unit in stage.block_units]
        full_bytes = sum(p.numel() * p.element_size() for p in params.values())  # DTensors: their whole size
        outside = sum(p.numel() * p.element_size() for p in params.values() if id(p) not in in_blocks)
        shard_bytes = sum(p.to_local().numel() * p.element_size() for p in params.values())
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.01)
        peaks = []

        class Peak(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                peaks.append(live_parameter_bytes(pipeline.modules, shard_bytes))
                return func(*args, **(kwargs or {}))

        targets = ys.chunk(CHUNKS)
        calls = [((m,), {}) for m in xs.chunk(CHUNKS)] if pipeline.holds_first else None
        for _ in range(2):
            optimizer.zero_grad()
            with Peak():  # each replica back-propagates dp times its share: the replicas' mean is the batch's
                pipeline.run("step", calls, lambda out, m: dp * loss_fn(out, targets[m]), CHUNKS, train=True)
            grads = {n: p.grad.full_tensor().numpy() for n, p in params.items()}
            optimizer.step()
            with torch.inference_mode():  # a validation pass between steps, as Lightning's loop runs one
                pipeline.run("eval", calls, lambda out, m: loss_fn(out, targets[m]), CHUNKS, train=False)
            assert all(isinstance(p, DTensor) for p in pipeline.parameters()), "gathered after an evaluation"

        def whole(value: torch.Tensor) -> torch.Tensor:
            return value.full_tensor() if isinstance(value, DTensor) else value

        moments = {n: tuple(whole(optimizer.state[p][k]).numpy() for k in ("exp_avg", "exp_avg_sq"))
                   for n, p in params.items()}
        results.put((rank, max(peaks), shard_bytes, outside, block_bytes, full_bytes, grads, moments))
    except Exception as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}", None, None, None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def plain_run() -> tuple[dict, dict]:
    """The plain module's gradients in the second step and AdamW's moments after it."""
    torch.manual_seed(0)
    model = Decoder(LAYERS, WIDTH).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch()
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    moments = {n: (optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
               for n, p in model.named_parameters()}
    return grads, copy.deepcopy(moments)


@pytest.mark.parametrize(("dp", "regather"), [(2, "micro_batch"), (4, "micro_batch"), (2, "step")])
def test_fsdp_gathers_a_block_at_a_time_and_trains_as_the_plain_module(dp, regather):
    reports = reports_of(*started(fsdp_process, 4, dp, regather), 240, "an FSDP process")
    grads, moments = plain_run()
    seen = set()
    for rank, peak, shards, outside, blocks, whole, rank_grads, rank_moments in reports:
        assert len(blocks) >= 4, f"rank {rank}: its stage should hold four decoder layers at least, got {blocks}"
        assert shards * dp == whole, (rank, shards, whole)
        print(f"dp={dp} {regather}: rank {rank} peak {peak} B alive = shards {shards} + {peak - shards} gathered; "
              f"outside blocks {outside}, largest block {max(blocks)}, whole stage {whole}")
        if regather == "micro_batch":
            bound = shards + outside + 2 * max(blocks)
            assert peak <= bound < whole + shards, (
                f"rank {rank}: {peak} parameter bytes alive at once; its shards, the parameters outside blocks "
                f"and two blocks are {bound}, the whole stage {whole}")
        else:
            assert peak >= shards + whole - min(blocks), (rank, peak, whole)  # the stage gathered whole
        for name, grad in rank_grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), grads[name], rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank} {name}")
            for ours, theirs in zip(rank_moments[name], moments[name]):
                torch.testing.assert_close(torch.from_numpy(ours), theirs, rtol=1e-10, atol=1e-14,
                                           msg=f"rank {rank} {name}: AdamW moments")
            seen.add(name)
    assert seen == set(grads)
