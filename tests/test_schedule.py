"""The schedule as data: the engine runs the order it lists, and the prediction simulates it."""

from dataclasses import replace

import pytest
import torch
from models import LongSkip

import lightning_antichain as la
from lightning_antichain.plans import schedule
from lightning_antichain.plans.schedule import Schedule, Task, gpipe, step_time, timeline


def test_gpipe_runs_forwards_in_order_then_backwards_in_reverse_on_every_stage():
    plan = gpipe(3, 4)
    assert plan.stages == 3
    for k in range(3):
        assert plan.micro_batches(k, "forward") == [0, 1, 2, 3]
        assert plan.micro_batches(k, "backward") == [3, 2, 1, 0]
        assert [t.phase for t in plan.order[k]] == ["forward"] * 4 + ["backward"] * 4


@pytest.mark.parametrize(("stages", "chunks"), [(1, 1), (2, 4), (4, 8), (3, 1)])
def test_uniform_stages_take_the_gpipe_makespan(stages, chunks):
    assert step_time(gpipe(stages, chunks), [1.0] * stages, [2.0] * stages) == pytest.approx(
        (chunks + stages - 1) * 3.0)


def test_the_timeline_keeps_every_dependency_and_every_stage_busy_with_one_task_at_a_time():
    forward, backward = [1.0, 3.0, 2.0], [2.0, 5.0, 1.0]
    timed = {t.task: t for t in timeline(gpipe(3, 5), schedule.stage_durations(forward, backward))}
    assert len(timed) == 3 * 5 * 2
    for task, t in timed.items():
        k, m = task.stage, task.micro_batch
        if task.phase == "forward" and k > 0:
            assert t.start >= timed[Task("forward", k - 1, m)].end
        if task.phase == "backward" and k < 2:
            assert t.start >= timed[Task("backward", k + 1, m)].end
        if task.phase == "backward" and k == 2:
            assert t.start >= max(timed[Task("forward", 2, j)].end for j in range(5))
    for k in range(3):
        spans = sorted((t.start, t.end) for task, t in timed.items() if task.stage == k)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_a_schedule_that_waits_on_itself_is_refused():
    order = (  # stage 0 wants a backward before its last forward, which that backward needs
        (Task("forward", 0, 0), Task("backward", 0, 0), Task("forward", 0, 1), Task("backward", 0, 1)),
        (Task("forward", 1, 0), Task("forward", 1, 1), Task("backward", 1, 1), Task("backward", 1, 0)),
    )
    with pytest.raises(ValueError, match="deadlocks"):
        timeline(Schedule("bad", 2, order), lambda task: 1.0)
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        schedule.make_schedule("nope", 2, 2)


def reversed_forwards(stages, chunks):
    """Forwards last micro-batch first, backwards first first: not GPipe, and not queue order."""
    forwards = [tuple(Task("forward", k, m) for m in reversed(range(chunks))) for k in range(stages)]
    backwards = [tuple(Task("backward", k, m) for m in range(chunks)) for k in range(stages)]
    return Schedule("reversed", chunks, tuple(f + b for f, b in zip(forwards, backwards)))


@pytest.mark.parametrize("name", ["gpipe", "reversed"])
def test_the_engine_runs_each_stage_in_the_order_the_schedule_lists(name, monkeypatch):
    monkeypatch.setitem(schedule.SCHEDULES, "reversed", reversed_forwards)
    torch.manual_seed(0)
    model = LongSkip().double()
    x = torch.randn(10, 12, dtype=torch.float64)
    cost = la.profile(model, x[:2], repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 3, chunks=5)
    plan = replace(plan, schedule=name)
    expected = model(x)
    expected.square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with la.Pipeline(model, plan, chunks=5) as pipe:
        output = pipe(x)
        output.square().sum().backward()
        ran = pipe.last_step.ran
        timed = pipe.last_step.timed
    assert ran == [list(tasks) for tasks in schedule.make_schedule(name, 3, 5).order]
    # the measured timeline holds the same tasks, one at a time per stage, each after its input
    assert [[t.task for t in stage] for stage in timed] == ran
    end = {t.task: t.end for stage in timed for t in stage}
    for stage in timed:
        assert all(0 <= t.start <= t.end for t in stage)
        assert all(a.end <= b.start for a, b in zip(stage, stage[1:]))
        for t in stage:
            before = schedule.prerequisites(schedule.make_schedule(name, 3, 5))(t.task)
            assert all(end[u] <= t.start for u in before)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=0)
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=0)


def test_the_plan_predicts_its_step_from_the_schedule_it_names(monkeypatch):
    monkeypatch.setitem(schedule.SCHEDULES, "reversed", reversed_forwards)
    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    # an overhead of its own, since a busy machine can measure the runtime's as zero; the adding
    # into gradients left out (its own test below)
    cost.graph.update(task_overhead_s=2e-4, step_overhead_s=1e-3, accumulate_s_per_byte=0.0)
    plan = la.partition(cost, 3, chunks=4)
    assert plan.parallel_capacity is not None and plan.task_overhead_s == 2e-4
    forward = [s.forward_s + s.transfer_s / 2 + plan.task_overhead_s for s in plan.stages]
    backward = [s.backward_s + s.transfer_s / 2 + plan.task_overhead_s for s in plan.stages]
    simulated = timeline(gpipe(3, 4), schedule.stage_durations(forward, backward), capacity=plan.prediction.capacity(),
                         shared=[True] * 3)
    assert plan.predicted_step_s == pytest.approx(max(t.end for t in simulated) + plan.step_overhead_s)
    assert max(t.end for t in plan.timeline()) + plan.step_overhead_s == pytest.approx(plan.predicted_step_s)
    plan = replace(plan, schedule="reversed")
    assert {t.task for t in plan.timeline()} == {t for tasks in reversed_forwards(3, 4).order for t in tasks}


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2),
                                              ("zb-h1", 2)])
def test_every_weight_gradient_of_a_stage_but_its_first_adds_into_the_stage_s_trainable_gradients(name, virtual):
    """The profile times backwards into empty gradients; in a step, a stage's first backward writes
    its gradients and each later one adds into them: a pass over its trainable parameters, charged
    at the plan's rate to every backward (or weight half) of a stage but the first its rank runs."""
    from lightning_antichain.plans.process_schedules import process_schedule

    model = LongSkip()
    model.stem.requires_grad_(False)  # frozen: no gradient to add into
    cost = la.profile(model, torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    cost.graph["parallel_capacity"] = None  # a task's span is its duration
    runs = process_schedule(name, virtual)
    table = runs.table(2, 4)
    plan = la.partition(cost, table.stages, chunks=4)
    rate = 1e-6
    spans = {}
    for charged in (0.0, rate):
        plan = replace(plan, accumulate_s_per_byte=charged)
        spans[charged] = {t.task: t.end - t.start for t in plan.timeline(table)}
    first = {}
    for tasks in table.order:
        for task in tasks:
            if task.phase in ("backward", "backward_weight"):
                first.setdefault(task.stage, task)
    assert {t.phase for t in first.values()} == ({"backward_weight"} if name.startswith("zb") else {"backward"})
    if name == "gpipe":  # GPipe runs a stage's backwards from the last micro-batch
        assert all(t.micro_batch == 3 for t in first.values())
    trainable = [s.param_bytes - s.frozen_bytes for s in plan.stages]
    assert sum(trainable) == sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for task, span in spans[rate].items():
        adds = task.phase in ("backward", "backward_weight") and first[task.stage] != task
        assert span == pytest.approx(spans[0.0][task] + (rate * trainable[task.stage] if adds else 0.0)), task
    assert "adding into gradients" in plan.table()
    # accumulating over batches: the first adds into the earlier batches' in 3 of 4
    plan = replace(plan, accumulate_grad_batches=4)
    for task in plan.timeline(table):
        before = spans[rate][task.task]
        if first.get(task.task.stage) == task.task:
            assert task.end - task.start == pytest.approx(before + 0.75 * rate * trainable[task.task.stage])
        else:
            assert task.end - task.start == pytest.approx(before)


def test_cpu_stages_running_at_once_share_the_capacity_and_other_stages_do_not():
    durations = schedule.stage_durations([1.0, 1.0], [0.0, 0.0])
    ends = {t.task: t.end for t in timeline(gpipe(2, 2), durations, capacity=[1.0, 1.5], shared=[True, True])}
    # F0 on stage 0 alone; then F1 on stage 0 and F0 on stage 1 together at 0.75 each; then F1 on stage 1 alone
    assert ends[Task("forward", 0, 1)] == pytest.approx(1 + 1 / 0.75)
    assert ends[Task("forward", 1, 1)] == pytest.approx(1 + 1 / 0.75 + 1)
    apart = {t.task: t.end for t in timeline(gpipe(2, 2), durations, capacity=[1.0, 1.5], shared=[True, False])}
    assert apart[Task("forward", 1, 1)] == pytest.approx(3.0)
    assert step_time(gpipe(2, 2), [1.0, 1.0], [0.0, 0.0]) == pytest.approx(3.0)


def test_other_work_on_the_shared_cores_slows_the_cpu_stages_only_while_it_runs():
    durations = schedule.stage_durations([1.0, 1.0], [0.0, 0.0])
    alone = {t.task: t.end for t in timeline(gpipe(2, 1), durations, capacity=[1.0, 1.0], shared=[True, True])}
    assert alone[Task("forward", 0, 0)] == pytest.approx(1.0)
    # one core: a rank's optimizer step from 0.5 to 1.0 halves the first forward's pace meanwhile
    busy = {t.task: t.end for t in timeline(gpipe(2, 1), durations, capacity=[1.0, 1.0], shared=[True, True],
                                            others=[(0.5, 1.0)])}
    assert busy[Task("forward", 0, 0)] == pytest.approx(1.25)
    assert busy[Task("backward", 0, 0)] - busy[Task("forward", 0, 0)] == pytest.approx(alone[Task(
        "backward", 0, 0)] - alone[Task("forward", 0, 0)])  # nothing else runs after it ends
    apart = {t.task: t.end for t in timeline(gpipe(2, 1), durations, capacity=[1.0, 1.0], shared=[False, False],
                                             others=[(0.5, 1.0)])}
    assert apart[Task("forward", 0, 0)] == pytest.approx(1.0)  # an accelerator's stages do not share the cores


def test_a_task_held_after_its_work_delays_what_waits_for_it_and_shares_no_core():
    """A replicated stage's reduction in its last backward: the previous stage's backward of that
    micro-batch waits for it; meanwhile the other stage has the one shared core to itself."""
    durations = schedule.stage_durations([1.0, 1.0], [4.0, 2.0])
    last = Task("backward", 1, 0)  # GPipe runs its backwards in reverse: micro-batch 0's is stage 1's last

    def run(held):
        return {t.task: t for t in timeline(gpipe(2, 2), durations, capacity=[1.0, 1.0], shared=[True, True],
                                            held=held)}

    plain, held = run(None), run({last: 3.0})
    # F0,0 1; F0,1 and F1,0 together to 3; F1,1 to 4; B1,1 to 6; B0,1 and B1,0 together until B1,0's work
    # is done at 10, which then holds its stage to 13 while B0,1 has the core alone: its last 2 s end at 12
    assert plain[last].end == pytest.approx(10.0) and held[last].end == pytest.approx(13.0)
    assert held[Task("backward", 0, 1)].end == pytest.approx(12.0) == plain[Task("backward", 0, 1)].end
    assert held[Task("backward", 0, 0)].start == pytest.approx(13.0)
    assert held[Task("backward", 0, 0)].end == pytest.approx(plain[Task("backward", 0, 0)].end + 1.0)


def test_each_cpu_stage_beyond_the_first_adds_the_profiled_gain_while_there_are_cores():
    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 4, chunks=2)
    plan = replace(plan, parallel_capacity=1.5, cpu_cores=2)
    assert plan.prediction.capacity() == [1.0, 1.5, 1.5, 1.5]
    plan = replace(plan, cpu_cores=8)
    assert plan.prediction.capacity() == [1.0, 1.5, 2.0, 2.5]


def test_one_f_one_b_fills_then_alternates_then_drains():
    order = schedule.one_f_one_b(3, 4).order
    f, b = (lambda m, k: Task("forward", k, m)), (lambda m, k: Task("backward", k, m))
    assert order[0] == (f(0, 0), f(1, 0), f(2, 0), b(0, 0), f(3, 0), b(1, 0), b(2, 0), b(3, 0))
    assert order[2] == tuple(t for m in range(4) for t in (f(m, 2), b(m, 2)))


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_one_f_one_b_holds_at_most_k_minus_i_micro_batches_and_takes_gpipes_makespan(stages, chunks):
    ran = schedule.one_f_one_b(stages, chunks)
    assert schedule.in_flight(ran) == [min(stages - k, chunks) for k in range(stages)]
    assert schedule.in_flight(gpipe(stages, chunks)) == [chunks] * stages
    assert all(sorted(ran.order[k], key=str) == sorted(gpipe(stages, chunks).order[k], key=str)
               for k in range(stages))  # the same tasks, in another order
    # equal stages: 1F1B has GPipe's bubble, (M + K - 1) * (f + b)
    assert step_time(ran, [1.0] * stages, [2.0] * stages) == pytest.approx((chunks + stages - 1) * 3.0)


def test_a_schedule_with_a_loss_per_micro_batch_starts_backward_before_the_batch_is_through():
    ends = {t.task: t.end for t in timeline(schedule.one_f_one_b(2, 4), schedule.stage_durations([1.0] * 2, [1.0] * 2))}
    assert ends[Task("backward", 1, 0)] < ends[Task("forward", 1, 3)]


def test_the_in_process_pipeline_refuses_a_schedule_it_cannot_run():
    cost = la.profile(LongSkip(), torch.randn(2, 12), repeats=1, warmup=0, progress=False)
    plan = la.partition(cost, 2, chunks=4)
    plan = replace(plan, schedule="1f1b")
    with pytest.raises(ValueError, match="one process per stage.*replace\\(plan, schedule='gpipe'\\)"):
        la.Pipeline(LongSkip(), plan, chunks=4)
