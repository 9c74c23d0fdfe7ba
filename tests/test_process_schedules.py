"""The process runtime's schedules as data: torch's class for each name, and which stages each
rank holds (round robin, or a V for ZBV)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from lightning_antichain.plans.process_schedules import SCHEDULE_NAMES, process_schedule


def test_each_name_runs_with_torchs_class():
    assert process_schedule("1f1b").runs_with is Schedule1F1B and not process_schedule("1f1b").takes_a_list
    assert process_schedule("interleaved-1f1b").runs_with is ScheduleInterleaved1F1B
    assert process_schedule("ZBV").runs_with is ScheduleZBVZeroBubble and process_schedule("zbv").takes_a_list
    assert process_schedule("interleaved_1f1b", 3).virtual_stages == 3


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_stage_is_held_by_exactly_one_rank(name, ranks):
    schedule = process_schedule(name)
    held = [s for rank in range(ranks) for s in schedule.stages_of(rank, ranks)]
    assert sorted(held) == list(range(schedule.num_stages(ranks)))
    assert all(schedule.rank_of(s, ranks) == r for r in range(ranks) for s in schedule.stages_of(r, ranks))


def test_interleaved_stages_go_round_robin_and_zbv_stages_in_a_v():
    interleaved = process_schedule("interleaved-1f1b", 3)
    assert [interleaved.stages_of(r, 2) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    zbv = process_schedule("zbv")
    assert [zbv.stages_of(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_what_a_schedule_cannot_run_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="not one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv"):
        process_schedule("pipedream")
    with pytest.raises(ValueError, match="holds 1 stage.*use interleaved-1f1b or zb-h1"):
        process_schedule("1f1b", 2)
    with pytest.raises(ValueError, match="holds 2 stage"):
        process_schedule("zbv", 3)
    with pytest.raises(ValueError, match="at least 1"):
        process_schedule("interleaved-1f1b", 0)


@pytest.mark.parametrize("name,virtual", [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                          ("zb-h1", 2), ("zb-h1", 3), ("zbv", 2)])
def test_the_counts_a_schedule_takes_are_the_counts_torchs_constructor_takes(name, virtual):
    """Where :meth:`takes` says yes, torch's own class takes the count (its tables are the
    planner's); where it says no, torch refuses it, except ZBV with fewer micro-batches than
    stages, which torch takes (it plans a longer batch and drops the extra micro-batches' actions)
    and the process runtime runs in GPipe's order instead."""
    from lightning_antichain.plans.process_schedules import _StagePlace

    schedule = process_schedule(name, virtual)
    for ranks in range(1, 5):
        for chunks in range(1, 13):
            stages = [_StagePlace(i, schedule.num_stages(ranks), ranks) for i in schedule.stages_of(0, ranks)]
            try:
                schedule.runs_with(stages if schedule.takes_a_list else stages[0], chunks, loss_fn=lambda o, t: o)
                accepted = True
            except ValueError:
                accepted = False
            if schedule.takes(chunks, ranks):
                assert accepted, (ranks, chunks)
                assert len(schedule.table(ranks, chunks).order) == ranks
            elif name != "zbv":
                assert not accepted, (ranks, chunks)


def test_zbv_evaluates_by_forwards_that_only_wait_on_stages_run_before_them():
    from torch.distributed.pipelining.schedules import _ComputationType

    schedule = process_schedule("zbv")
    assert schedule.runs_by_table and not process_schedule("1f1b").runs_by_table

    class Runner:  # what evaluate_forward_only reads of torch's runner
        stage_index_to_group_rank = {s: schedule.rank_of(s, 2) for s in range(4)}

    runner = Runner()
    schedule.evaluate_forward_only(runner, 2, 3)
    computed = {rank: [(a.stage_index, a.microbatch_index) for a in actions
                       if a.computation_type == _ComputationType.FORWARD]
                for rank, actions in runner.pipeline_order_with_comms.items()}
    assert computed == {0: [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2)],
                        1: [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]}


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo process group of this process alone (torch's stages need one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("train", [True, False], ids=["step", "eval"])
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])
def test_pre_split_micro_batches_run_alike_through_step_and_through_the_path_for_older_torch(group_of_one, schedule,
                                                                                             train):
    """torch 2.13 takes no pre-split micro-batches in ``step`` or ``eval``; the path used there (its
    ``_step_microbatches``) gives the float64 losses and gradients of ``step(arg_mbs=...)`` and of
    the plain modules, for one stage per rank and for two virtual stages; forward only (``eval``,
    a runner of its own as the process runtime makes), the losses and no gradient."""
    import copy
    import inspect

    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from lightning_antichain.plans.process_schedules import run_pre_split
    from lightning_antichain.torch_private import step_micro_batches

    torch.manual_seed(0)
    chosen = process_schedule(schedule, 2 if schedule == "interleaved-1f1b" else None)
    pieces = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double() for _ in range(chosen.num_stages(1))]
    xs = [(torch.randn(3, 6, dtype=torch.float64),) for _ in range(2)]
    targets = [torch.randn(3, 6, dtype=torch.float64) for _ in range(2)]

    def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().sum()

    plain = copy.deepcopy(pieces)
    plain_losses = [loss_of(nn.Sequential(*plain)(x), t) for (x,), t in zip(xs, targets, strict=True)]
    sum(plain_losses).backward()

    def run(through) -> tuple[list[float], list[torch.Tensor]]:
        modules = copy.deepcopy(pieces)
        stages = [PipelineStage(m, i, len(modules), torch.device("cpu")) for i, m in enumerate(modules)]
        losses = []

        def loss_fn(out, target):
            losses.append(loss_of(out, target))  # the first is torch's shape inference on its own values
            return losses[-1]

        runner = chosen.runs_with(stages if chosen.takes_a_list else stages[0], n_microbatches=2, loss_fn=loss_fn,
                                    scale_grads=False)
        if not train and chosen.runs_by_table:
            chosen.evaluate_forward_only(runner, 1, 2)  # as the process runtime's runners for evaluation
        through(runner, xs, targets, train)
        return [loss.item() for loss in losses[-2:]], [p.grad for m in modules for p in m.parameters()]

    expected = [p.grad for m in plain for p in m.parameters()] if train else [None] * len(plain) * 2
    ways = [step_micro_batches] + ([run_pre_split] if "arg_mbs" in inspect.signature(
        chosen.runs_with.step).parameters else [])
    for through in ways:
        losses, grads = run(through)
        assert losses == pytest.approx([loss.item() for loss in plain_losses], rel=1e-12)
        for g, h in zip(grads, expected, strict=True):
            if h is None:
                assert g is None
            else:
                torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


def test_counts_a_schedule_does_not_take_run_in_gpipes_order_on_its_placement():
    """1F1B and ZBV need one micro-batch per stage at least, the interleaved ones whole rounds;
    GPipe's order runs any count on any placement: each rank's forwards in stage order, then its
    backwards in reverse, so no task waits on one its rank runs later."""
    from torch.distributed.pipelining.schedules import _ComputationType

    assert process_schedule("1f1b").takes(2, 2) and not process_schedule("1f1b").takes(1, 2)
    assert process_schedule("zbv").takes(4, 2) and not process_schedule("zbv").takes(3, 2)
    assert process_schedule("interleaved-1f1b").takes(4, 2) and not process_schedule("interleaved-1f1b").takes(5, 2)
    assert process_schedule("gpipe").takes(1, 4)
    order = process_schedule("zbv").fill_drain_order(2, 2)
    tasks = {rank: [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index, a.microbatch_index)
                    for a in actions] for rank, actions in order.items()}
    assert tasks[0] == [("F", 0, 0), ("F", 0, 1), ("F", 3, 0), ("F", 3, 1),
                        ("B", 3, 1), ("B", 3, 0), ("B", 0, 1), ("B", 0, 0)]
    assert tasks[1] == [("F", 1, 0), ("F", 1, 1), ("F", 2, 0), ("F", 2, 1),
                        ("B", 2, 1), ("B", 2, 0), ("B", 1, 1), ("B", 1, 0)]
