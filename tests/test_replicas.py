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
    _, plain, plain_acc = losses(tmp_path, "plain", "--devices", "1", "--plain", "--batch-size", "32")
    torch.testing.assert_close(replicated, plain, rtol=1e-5, atol=0)  # train_loss logged with sync_dist=True
    assert replicated_acc == plain_acc  # a torchmetrics accuracy over both replicas' samples
    if start_method == "spawn":  # one pipeline of the same stages too (by default: the in-process Trainer tests)
        _, single, single_acc = losses(tmp_path, "single", "--devices", "2", "--batch-size", "32")
        torch.testing.assert_close(single, plain, rtol=1e-5, atol=0)
        assert single_acc == plain_acc


@pytest.mark.slow  # 47 s; the popen replicas test stays in the default suite
def test_replicas_of_a_gpt_captured_by_export_agree_on_the_plan_and_match_plain(tmp_path):
    """Rank 0 plans; the other replica captures GPT-2 itself and must get the same operation names."""
    gpt = ("--model", "gpt2")
    world, replicated, _ = losses(tmp_path, "replicas", "--devices", "4", "--stages", "2", "--batch-size", "8", *gpt)
    assert world == 2 and len(replicated) == 10
    _, plain, _ = losses(tmp_path, "plain", "--devices", "1", "--plain", "--batch-size", "16", *gpt)
    torch.testing.assert_close(replicated, plain, rtol=1e-5, atol=0)


@pytest.mark.slow  # 35 s
def test_replicas_accumulating_gradients_over_batches_match_plain(tmp_path):
    """With accumulate_grad_batches=2 the stages' DDP pauses in the first batch of each pair and
    reduces in the second's backward (reducing in both would give the same values: this checks that
    a paused reducer leaves nothing waiting); the losses stay plain Lightning's."""
    world, replicated, _ = losses(tmp_path, "replicas", "--devices", "4", "--stages", "2", "--batch-size", "16",
                                  "--accumulate", "2")
    _, plain, _ = losses(tmp_path, "plain", "--devices", "1", "--plain", "--batch-size", "32", "--accumulate", "2")
    assert world == 2 and len(replicated) == len(plain) > 10
    torch.testing.assert_close(replicated, plain, rtol=1e-5, atol=0)


def in_process_overlap(rank: int, port: int, results) -> None:
    import os

    import torch.distributed as dist
    from test_stage_replicas import Wide
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import lightning_antichain as la
    from lightning_antichain.in_process.stage_reduction import StageReduction
    from lightning_antichain.plans.plan import Plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Wide().double()
        x = torch.randn(8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        cost = la.profile(model, x[:2], repeats=1, warmup=0, progress=False, runtime_overhead=False)
        box = [la.partition(cost, 2, chunks=4, devices=["cpu:0", "cpu:1"]).to_dict()]
        dist.broadcast_object_list(box)  # one cut for both replicas, as the strategy does
        plan = Plan.from_dict(box[0])
        events: list[tuple[str, int]] = []
        with la.Pipeline(model, plan, chunks=4) as pipe:
            groups = [dist.new_group(), dist.new_group()]
            pipe.reduction = StageReduction([stage.parameters() for stage in pipe.stages], groups)
            for k, ddp in enumerate(pipe.reduction._ddp):
                ddp.register_comm_hook(groups[k], lambda group, bucket, k=k: (
                    events.append(("reduce", k)), allreduce_hook(group, bucket))[1])
            for k, stage in enumerate(pipe.stages):
                first = stage.parameters()[0]  # the stage's first layer: its last gradient in a backward
                first.register_post_accumulate_grad_hook(lambda p, k=k: events.append(("first layer", k)))
            for _ in range(2):  # DDP makes its buckets again after its first step
                events.clear()
                for p in model.parameters():
                    p.grad = None
                pipe(x).square().sum().backward()
            results.put((rank, events, [p.grad.numpy().copy() for p in model.parameters()]))  # by value
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}", None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 26 s; the replicas' Trainer test above keeps DDP per stage in the default suite
def test_in_process_replicas_reduce_each_stage_during_its_last_backward_and_average_the_gradients():
    """Each stage's DDP sends its buckets during the stage's last micro-batch's backward, the first
    before that backward reaches the stage's first layer (the reduction overlaps the backward; one
    after the step would follow every gradient), once per step; and both replicas end with the
    gradients' mean."""
    import queue

    from test_process_stages import started, stop
    from test_stage_replicas import Wide

    processes, results = started(in_process_overlap, 2)
    try:
        reports = sorted(results.get(timeout=180) for _ in range(2))
    except queue.Empty:
        pytest.fail("a replica process gave no result within 180 s")
    finally:
        stop(processes)
    for _, events, _ in reports:
        assert isinstance(events, list), events
        for k in (0, 1):
            firsts = [i for i, e in enumerate(events) if e == ("first layer", k)]
            reductions = [i for i, e in enumerate(events) if e == ("reduce", k)]
            assert len(firsts) == 4, events  # one gradient per micro-batch
            assert len(reductions) >= 2, events  # several buckets, in the last micro-batch's backward only
            assert firsts[-2] < reductions[0] < firsts[-1] < reductions[-1], events
    torch.manual_seed(0)
    model = Wide().double()
    xs = [torch.randn(8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for x in xs:
        model(x).square().sum().backward()
    for (_, _, grads) in reports:
        for grad, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(torch.from_numpy(grad), p.grad / 2, rtol=1e-10, atol=1e-10)
