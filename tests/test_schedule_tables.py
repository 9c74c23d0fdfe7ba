"""torch's schedules as data: each rank's tasks as torch's own table orders them, which the planner
simulates to predict a step under every schedule of the process runtime."""

from collections import Counter

import pytest

from lightning_antichain.plans.process_schedules import SCHEDULE_NAMES, process_schedule
from lightning_antichain.plans.schedule import held_at_peak, in_flight, step_time, timeline

SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1), ("zb-h1", 2),
          ("zbv", 2)]


@pytest.mark.parametrize("name, virtual", SHAPES)
@pytest.mark.parametrize("ranks, chunks", [(2, 4), (4, 8), (2, 8), (4, 4), (3, 6)])
def test_every_rank_runs_the_work_of_its_own_stages_once_in_an_order_that_finishes(name, virtual, ranks, chunks):
    schedule = process_schedule(name, virtual)
    table = schedule.table(ranks, chunks)
    assert table.workers == ranks and table.stages == ranks * virtual
    for rank, tasks in enumerate(table.order):
        assert {t.stage for t in tasks} == set(schedule.stages_of(rank, ranks))
        work = Counter((t.stage, t.micro_batch, t.phase) for t in tasks)
        assert set(work.values()) == {1}
        for stage in schedule.stages_of(rank, ranks):
            for m in range(chunks):
                halves = {work[stage, m, "backward_input"], work[stage, m, "backward_weight"]}
                assert work[stage, m, "forward"] == 1 and (work[stage, m, "backward"], halves) in ((1, {0}), (0, {1}))
    ran = timeline(table, lambda task: 1.0)  # a deadlock would raise
    assert len(ran) == sum(len(tasks) for tasks in table.order)


def test_predicted_steps_are_the_textbook_bubbles():
    """K ranks, M micro-batches, a forward f and a backward b per rank: GPipe and 1F1B take
    (M + K - 1)(f + b); interleaving v stages per rank shrinks the bubble to (K - 1)(f + b) / v;
    ZB-H1, its backward split in halves, to (K - 1) f (Qi et al., 2024)."""
    ranks, chunks, f, b = 4, 8, 1.0, 2.0

    def step(name: str, virtual: int) -> float:
        stages = ranks * virtual
        return step_time(process_schedule(name, virtual).table(ranks, chunks), [f / virtual] * stages,
                         [b / virtual] * stages)

    busy = chunks * (f + b)
    assert step("gpipe", 1) == step("1f1b", 1) == pytest.approx(busy + (ranks - 1) * (f + b))
    for virtual in (2, 4):
        assert step("interleaved-1f1b", virtual) == pytest.approx(busy + (ranks - 1) * (f + b) / virtual)
    assert step("zb-h1", 1) == pytest.approx(busy + (ranks - 1) * f)
    assert step("zbv", 2) < step("zb-h1", 1) < step("1f1b", 1)


def test_1f1b_holds_k_minus_k_micro_batches_and_gpipe_all():
    assert in_flight(process_schedule("1f1b").table(4, 8)) == [4, 3, 2, 1]
    assert in_flight(process_schedule("gpipe").table(4, 8)) == [8] * 4


def test_every_schedule_the_strategy_takes_has_a_table():
    for name in SCHEDULE_NAMES:
        assert process_schedule(name).table(2, 4).chunks == 4


def test_what_a_rank_keeps_at_its_peak_weighs_each_stage_it_holds():
    """Under 1F1B rank k keeps K - k micro-batches of its stage; under interleaved 1F1B a rank's two
    stages each keep some, weighed by what one micro-batch of each keeps."""
    ranks, chunks = 2, 8
    assert held_at_peak(process_schedule("1f1b").table(ranks, chunks), [10.0, 1.0]) == [20.0, 1.0]
    interleaved = process_schedule("interleaved-1f1b", 2).table(ranks, chunks)
    even = held_at_peak(interleaved, [1.0] * 4)
    light = held_at_peak(interleaved, [1.0, 0.0, 1.0, 1.0])  # stage 1 (rank 1's first) keeps nothing
    assert light[0] == even[0] and light[1] == 1.0 < even[1]  # stage 3 has one micro-batch in flight at most
    assert even == [float(n) for n in in_flight(interleaved)]
