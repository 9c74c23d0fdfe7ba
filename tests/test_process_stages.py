"""The split's stages run under torch.distributed.pipelining, one real process per stage (gloo):
a skip tensor crossing two cuts is passed through the stage between, and every gradient equals the
plain module's in float64, under GPipe and 1F1B."""

from __future__ import annotations

import contextlib
import os
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import free_port, process_context
from torch import nn

STAGES, CHUNKS = 3, 4


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.c(torch.tanh(self.b(h))))
        return self.d(g + h)  # h is made in stage 0 and read in stage 2


def build() -> nn.Module:
    torch.manual_seed(0)
    return Skip().double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, dtype=torch.float64, generator=gen), torch.randn(8, 4, dtype=torch.float64, generator=gen)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().sum()


class Failing(nn.Module):
    """A stage whose forward raises, as a user's code can."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *values):
        raise RuntimeError("the user's forward failed on this stage")


class Killed(nn.Module):
    """A stage whose process dies in forward, as one killed or out of memory does: no exception."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *values):
        os._exit(9)


def stage_process(rank: int, port: int, schedule: str, results: mp.Queue, failing: int | None = None,
                  how: str = "raises") -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.processes.process_stages import FlatStage
    from lightning_antichain.stages.split import split_stages

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    try:
        model = build()
        x, y = batch()
        graph = capture_call(model, (x[:2],), {})
        cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
        plan = la.plan_from_balance(cost, [3, 3, 3], chunks=CHUNKS)  # x a tanh | b tanh c | tanh add d
        stages = split_stages(graph, plan, [torch.device("cpu")] * STAGES)
        module = FlatStage(stages[rank])
        wrapper = {"raises": Failing, "killed": Killed}[how]
        stage = PipelineStage(wrapper(module) if rank == failing else module, rank, STAGES, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        run = kind(stage, CHUNKS, loss_fn=loss_fn, scale_grads=False)
        if rank == 0:
            run.step(x)
        elif rank == STAGES - 1:
            run.step(target=y)
        else:
            run.step()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}  # by value
        results.put((rank, os.getpid(), [(s.inputs, s.outputs) for s in stages], grads))
    except Exception as exc:
        results.put((rank, os.getpid(), None, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def stop(processes: list) -> list[int]:
    """Wait up to 30 s for each process to end, kill the ones still running; their indices."""
    late = []
    for i, process in enumerate(processes):
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            late.append(i)
    return late


def reports_of(processes: list, results: mp.Queue, timeout: float, what: str) -> list:
    """One report from each process (a report ``(rank, "error", message, ...)`` fails the test),
    every process stopped after, each having exited cleanly."""
    reports = []
    try:
        for _ in processes:
            report = results.get(timeout=timeout)
            assert report[1] != "error", report[2]
            reports.append(report)
    except queue.Empty:
        pytest.fail(f"{what} gave no result within {timeout:.0f} s")
    finally:
        stop(processes)
    assert all(p.exitcode == 0 for p in processes)
    return reports


def started(target, count: int, *args) -> tuple[list, mp.Queue]:
    """``count`` processes, each running ``target(rank, port, *args, results)``, meeting on one free
    port; and the queue they report to."""
    context = process_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=target, args=(r, port, *args, results)) for r in range(count)]
    for process in processes:
        process.start()
    return processes, results


@pytest.mark.processes
@pytest.mark.slow  # every schedule runs in the default suite, over 2 processes (below)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_in_processes_pass_a_skip_through_and_match_plain_gradients(schedule):
    context = process_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=stage_process, args=(r, port, schedule, results)) for r in range(STAGES)]
    for process in processes:
        process.start()
    got: dict[str, torch.Tensor] = {}
    pids, io = set(), None
    try:
        for _ in processes:
            _, pid, io, grads = results.get(timeout=120)
            pids.add(pid)
            got.update({n: torch.from_numpy(g) for n, g in grads.items()})
    except queue.Empty:
        pytest.fail("a stage process gave no result within 120 s")
    finally:
        stop(processes)
    assert all(p.exitcode == 0 for p in processes)
    assert len(pids) == STAGES and os.getpid() not in pids  # one process per stage, none of them this one
    assert io == [(("x",), ("tanh",)), (("tanh",), ("tanh", "c")), (("tanh", "c"), ("d",))]  # h passes through 1
    model = build()
    x, y = batch()
    loss_fn(model(x), y).backward()
    assert set(got) == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-12, atol=1e-13, msg=name)


def run_with_a_failing_rank(how: str) -> tuple[list, dict[int, str]]:
    """Three stage processes under 1F1B whose rank 1 fails as ``how`` says; the processes (ended)
    and the errors the others reported. Fails the test if any was still running 30 s later."""
    context = process_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=stage_process, args=(r, port, "1f1b", results, 1, how))
                 for r in range(STAGES)]
    for process in processes:
        process.start()
    errors = {}
    for _ in range(STAGES if how == "raises" else STAGES - 1):  # a dead rank reports nothing
        rank, _, _, error = results.get(timeout=120)
        errors[rank] = error
    late = stop(processes)
    if late:
        pytest.fail(f"stage processes {late} were still waiting 30 s after rank 1 failed")
    return processes, errors


@pytest.mark.processes
def test_a_stage_that_raises_stops_every_stage_process_within_seconds():
    """Rank 1 raises in its forward: rank 0 and rank 2, waiting on it, fail too instead of hanging."""
    processes, errors = run_with_a_failing_rank("raises")
    assert "the user's forward failed on this stage" in errors[1]
    assert all(isinstance(errors[r], str) for r in range(STAGES)), errors  # none finished a step
    assert all(p.exitcode != 0 for p in processes)


@pytest.mark.processes
@pytest.mark.slow  # 22 s; a raising stage process (above) and a failing Trainer rank stay in the default suite
def test_a_stage_process_that_dies_stops_every_other_stage_process_within_seconds():
    """Rank 1 dies without a word (os._exit): ranks 0 and 2 fail on the closed connection, none hangs."""
    processes, errors = run_with_a_failing_rank("killed")
    assert set(errors) == {0, 2} and all(isinstance(e, str) for e in errors.values()), errors
    assert processes[1].exitcode == 9 and all(p.exitcode != 0 for p in processes)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h1", 2), ("zbv", 2)]
BALANCES = {2: [4, 5], 4: [2, 2, 2, 3]}  # x a tanh b | tanh c tanh add d; x a | tanh b | tanh c | tanh add d


def every_schedule_process(rank: int, port: int, results: mp.Queue) -> None:
    """Rank ``rank`` of 2 runs one step of every schedule, each on a fresh model, and reports the
    gradients it holds: its own stages' parameters only."""
    from torch.distributed.pipelining import schedules as torch_schedules

    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.measure.action_clock import ActionClock
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_stages import rank_stages, schedule_runner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch_wait = torch_schedules._wait_batch_p2p
    try:
        for name, virtual in SCHEDULES:
            schedule = process_schedule(name, virtual)
            model = build()
            x, y = batch()
            graph = capture_call(model, (x[:2],), {})
            cost = la.profile(model, x[:2], op_graph=graph, repeats=1, warmup=0, progress=False,
                              runtime_overhead=False)
            plan = la.plan_from_balance(cost, BALANCES[schedule.num_stages(2)], chunks=CHUNKS)
            stages = rank_stages(graph, plan, schedule, rank, 2, torch.device("cpu"))
            run = schedule_runner(schedule, stages, CHUNKS, loss_fn)
            holds_first = 0 in schedule.stages_of(rank, 2)
            holds_last = schedule.num_stages(2) - 1 in schedule.stages_of(rank, 2)
            losses: list[torch.Tensor] = []
            clock = ActionClock(torch.device("cpu"))  # times the step; what it runs stays as it was
            with clock.timing(stages):
                if holds_first and holds_last:
                    run.step(x, target=y, losses=losses)
                elif holds_first:
                    run.step(x)
                elif holds_last:
                    run.step(target=y, losses=losses)
                else:
                    run.step()
            left_behind = [n for s in stages for n in vars(s) if n.endswith("_one_chunk")]
            left_behind += [] if torch_schedules._wait_batch_p2p is torch_wait else ["_wait_batch_p2p"]
            grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
            results.put((rank, f"{name}/{virtual}", [s.stage_index for s in stages], grads,
                         [float(v) for v in losses], (clock.steps, [1.0]), left_behind, plan.to_dict()))
    except Exception as exc:
        results.put((rank, "error", None, f"{name}/{virtual}: {type(exc).__name__}: {exc}", None, None, None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def every_schedule_run() -> dict[str, dict]:
    """One step of every schedule over 2 real processes: per schedule, what each rank reported."""
    processes, results = started(every_schedule_process, 2)
    reports: dict[str, dict] = {}
    try:
        for _ in range(2 * len(SCHEDULES)):
            rank, name, stages, grads, step_losses, clock, left_behind, plan = results.get(timeout=180)
            assert name != "error", grads
            reports.setdefault(name, {})[rank] = dict(stages=stages, grads=grads, losses=step_losses, clock=clock,
                                                      left_behind=left_behind, plan=plan)
    except queue.Empty:
        pytest.fail("a stage process gave no result within 180 s")
    finally:
        stop(processes)
    assert all(p.exitcode == 0 for p in processes)
    return reports


@pytest.mark.processes
def test_every_schedule_runs_the_plan_in_two_processes_with_plain_gradients(every_schedule_run):
    """GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV from torch, on the split's stages: each rank holds
    the stages its schedule gives it (round robin, or a V for ZBV), a skip tensor passes through
    the stages between, and the gradients over both ranks are the plain module's, in float64 (with
    the actions timed: the clock changes nothing)."""
    got: dict[str, dict[str, torch.Tensor]] = {}
    held: dict[tuple[str, int], list[int]] = {}
    losses: dict[str, list[float]] = {}
    for name, ranks in every_schedule_run.items():
        for rank, report in ranks.items():
            held[name, rank] = report["stages"]
            assert not set(report["grads"]) & set(got.get(name, {})), f"{name}: a parameter has gradients on both ranks"
            got.setdefault(name, {}).update({n: torch.from_numpy(g) for n, g in report["grads"].items()})
            if report["losses"]:
                losses[name] = report["losses"]
    assert held["interleaved-1f1b/2", 0] == [0, 2] and held["interleaved-1f1b/2", 1] == [1, 3]
    assert held["zbv/2", 0] == [0, 3] and held["zbv/2", 1] == [1, 2]
    model = build()
    x, y = batch()
    loss_fn(model(x), y).backward()
    with torch.no_grad():
        micro_losses = [loss_fn(model(xm), ym).item() for xm, ym in zip(x.chunk(CHUNKS), y.chunk(CHUNKS))]
    for name, _ in SCHEDULES:
        for virtual in (1, 2):
            key = f"{name}/{virtual}"
            if key not in got:
                continue
            assert set(got[key]) == {n for n, _ in model.named_parameters()}, key
            for pname, param in model.named_parameters():
                torch.testing.assert_close(got[key][pname], param.grad, rtol=1e-12, atol=1e-13, msg=f"{key} {pname}")
            assert losses[key] == pytest.approx(micro_losses, rel=1e-12), key


def test_a_parameter_tied_across_two_ranks_is_found_and_refused_where_nothing_keeps_its_copies_in_step():
    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.plans.process_schedules import process_schedule
    from lightning_antichain.processes.process_stages import holders, rank_flat_stages, split_for_ranks

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(torch.tanh(self.mid(self.embed(tokens))))

    model, tokens = Tied(), torch.randint(0, 10, (4, 3))
    graph = capture_call(model, (tokens,), {})
    cost = la.profile(model, tokens, op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    plan = la.plan_from_balance(cost, [2, len(cost) - 2], chunks=2)  # embed | the rest, head included
    schedule = process_schedule("1f1b")
    found = holders(split_for_ranks(graph, plan, schedule, 2, torch.device("cpu")), schedule, 2)
    assert found[id(model.embed.weight)] == (0, 1) and found[id(model.mid.weight)] == (1,)
    with pytest.raises(ValueError, match=r"used by stages on ranks \(0, 1\) \(tied weights\)"):
        rank_flat_stages(graph, plan, schedule, 0, 2, torch.device("cpu"))


def test_a_stage_that_recomputes_keeps_only_its_inputs_for_backward_and_gives_the_same_gradients():
    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.measure.saved_tensors import HeldMemory, state_storages
    from lightning_antichain.processes.process_stages import FlatStage
    from lightning_antichain.stages.split import split_stages

    model = build()
    x, _ = batch()
    graph = capture_call(model, (x,), {})
    cost = la.profile(model, x, op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    plan = la.plan_from_balance(cost, [9], chunks=1)
    (stage,) = split_stages(graph, plan, [torch.device("cpu")])
    results = []
    for recompute in (False, True):
        model.zero_grad()
        held = HeldMemory(excluded=state_storages(model))
        inputs = x.clone().requires_grad_()
        with held.saving():
            out = FlatStage(stage, recompute)(inputs)
        out.square().sum().backward()
        results.append((held.peak_bytes, [p.grad.clone() for p in model.parameters()], inputs.grad))
    (kept, grads, input_grad), (kept_recomputing, grads_recomputing, input_grad_recomputing) = results
    assert kept_recomputing <= x.numel() * x.element_size() < kept  # its input alone
    for a, b in zip(grads, grads_recomputing):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(input_grad, input_grad_recomputing, rtol=0, atol=0)


@pytest.mark.parametrize(("deferred", "frontend"), [(False, "fx"), (True, "fx"), (False, "export")])
def test_a_recomputed_stage_updates_batchnorm_statistics_once(deferred, frontend):
    """The forward that a recomputing stage runs again in backward normalises as the first did, but
    leaves the running statistics (and, with deferral, the moments) alone: after a step they equal
    a stage that did not recompute, and the count of batches tracked goes up by one. Also where the
    graph updates the statistics itself, whatever the module's momentum (an exported graph: it was
    updated twice)."""
    import lightning_antichain as la
    from lightning_antichain.capture import capture_call
    from lightning_antichain.processes.process_stages import FlatStage
    from lightning_antichain.stages.batchnorm import deferred_batch_norm
    from lightning_antichain.stages.split import split_stages

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(12, 8, dtype=torch.float64)
    graph = capture_call(model, (x,), {}, frontends=(frontend,))
    assert graph.frontend == frontend
    cost = la.profile(model, x, op_graph=graph, repeats=1, warmup=0, progress=False, runtime_overhead=False)
    (stage,) = split_stages(graph, la.plan_from_balance(cost, [cost.number_of_nodes()], chunks=1),
                            [torch.device("cpu")])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    after = []
    for recompute in (False, True):
        model.load_state_dict(initial)
        with deferred_batch_norm(model.modules()) if deferred else contextlib.nullcontext():
            FlatStage(stage, recompute)(x.clone().requires_grad_()).square().sum().backward()
        after.append({k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.")})
    plain, recomputed = after
    assert plain["1.num_batches_tracked"].item() == recomputed["1.num_batches_tracked"].item() == 1
    for key in ("1.running_mean", "1.running_var"):
        assert not torch.equal(plain[key], initial[key])
        torch.testing.assert_close(recomputed[key], plain[key], rtol=0, atol=0, msg=key)


def test_the_recomputation_block_can_be_entered_again():
    """A zero-bubble schedule computes a stage's input gradient and its weights' gradient apart,
    and a checkpointed stage recomputes its forward for each: the same block enters twice."""
    from lightning_antichain.stages.batchnorm import recomputing

    norm = nn.BatchNorm1d(4)
    block = recomputing([norm])
    for _ in range(2):
        with block:
            assert norm.momentum == 0.0
            norm(torch.randn(8, 4))
        assert norm.momentum == 0.1 and norm.num_batches_tracked.item() == 0


@pytest.mark.processes
def test_the_action_clock_times_every_task_a_rank_runs_and_the_plan_predicts_from_them(every_schedule_run):
    """Each rank's clock times each of its stages' phases as torch's schedule runs them (a split
    backward in its two halves under the zero-bubble schedules), and leaves torch's stages and its
    wait helper as it found them. The plan calibrated from every rank's costs keeps its cut, takes
    the measured halves, and predicts a step between the busiest rank's work and all ranks' work
    run one after another."""
    from lightning_antichain.planner.process_calibration import from_records
    from lightning_antichain.plans.plan import Plan
    from lightning_antichain.plans.process_schedules import process_schedule

    for name, virtual in SCHEDULES:
        key = f"{name}/{virtual}"
        ranks = every_schedule_run[key]
        schedule = process_schedule(name, virtual)
        table = schedule.table(2, CHUNKS)
        split = name.startswith("zb")
        for report in ranks.values():
            assert report["left_behind"] == [], key
            (costs,), _ = report["clock"]
            phases = ("forward", "backward_input", "backward_weight") if split else ("forward", "backward")
            assert set(costs) == {(phase, k) for k in report["stages"] for phase in phases}, key
            assert all(cost > 0 for cost in costs.values()), key
        plan = Plan.from_dict(ranks[0]["plan"])
        calibrated = from_records(plan, table, [ranks[r]["clock"] for r in (0, 1)])
        assert [s.nodes for s in calibrated.stages] == [s.nodes for s in plan.stages]
        assert calibrated.calibration["runtime"] == "processes" and calibrated.measured_together
        assert all((s.backward_input_s is not None) == split for s in calibrated.stages), key
        merged = {k: v for r in (0, 1) for k, v in ranks[r]["clock"][0][0].items()}
        work = [sum(merged[t.phase, t.stage] for t in tasks) for tasks in table.order]
        extra = calibrated.step_overhead_s + calibrated.optimizer_step_s
        assert max(work) <= calibrated.predicted_step_s - extra + 1e-9 <= sum(work) + 1e-9, key
