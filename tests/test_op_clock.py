"""Operations timed inside their stage's passes (measure/op_clock.py): what is timed, not how long.

A timed assertion would pass or fail with the machine's load; these check that the clocked stages
compute exactly what the plain ones do, that every operation is accounted for in the phase it
runs in, that the times of a pass fit inside the pass, and that calibration keeps them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torchvision
from models import InceptionBlock

import lightning_antichain as la
from lightning_antichain.capture import capture_call
from lightning_antichain.measure.op_clock import OpClock
from lightning_antichain.planner import calibration, planning


def _resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=5).double()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_clocked_stages_compute_what_plain_ones_do_and_time_every_operation_in_its_phase(frontend):
    model = _resnet()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    graph = capture_call(model, (x[:2],), {}, frontends=(frontend,))
    plan = la.partition(la.profile(model, x[:2], repeats=1, warmup=0, progress=False, op_graph=graph), 2, chunks=1)
    plain_out = model(x)
    plain_out.square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with la.Pipeline(model, plan, chunks=1, graph=graph) as pipe:
        pipe(x)  # the stages exist after a first call
        model.zero_grad()
        clocks = [OpClock() for _ in pipe.stages]
        for stage, clock in zip(pipe.stages, clocks):
            stage.clock = clock
        out = pipe(x)
        out.square().sum().backward()
        record = pipe.last_step
    torch.testing.assert_close(out, plain_out, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], rtol=1e-9, atol=1e-12, msg=name)
    for stage, clock, tasks in zip(plan.stages, clocks, record.timed):
        computed = {n.name for n in pipe.stages[stage.index].module.graph.nodes
                    if n.op in ("call_function", "call_method", "call_module")}
        assert set(clock.forward_s) == computed
        durations = {t.task.phase: t.end - t.start for t in tasks}
        assert 0 < sum(clock.forward_s.values()) <= durations["forward"]
        clock.backward_ended(record.started_at + next(t.end for t in tasks if t.task.phase == "backward"))
        assert clock.backward_s and set(clock.backward_s) <= computed
        assert all(v >= 0 for v in clock.backward_s.values())
        assert sum(clock.backward_s.values()) <= durations["backward"]
        # every convolution has a backward of its own: its autograd node is hooked, not another's
        convolutions = {n for n in computed if "conv" in n}
        assert convolutions and convolutions <= set(clock.backward_s)


def test_operations_that_need_no_gradient_take_no_backward_time():
    class Indexed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            picked = x.detach().argmax(dim=1, keepdim=True).double()  # no gradient flows here
            return self.b(torch.relu(self.a(x))) * picked

    model = Indexed().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    plan = la.partition(la.profile(model, x, repeats=1, warmup=0, progress=False), 1, chunks=1)
    with la.Pipeline(model, plan, chunks=1) as pipe:
        pipe(x)
        clock = pipe.stages[0].clock = OpClock()
        pipe(x).sum().backward()
        end = pipe.last_step.started_at + pipe.last_step.timed[0][-1].end
    clock.backward_ended(end)
    untouched = {n for n in clock.forward_s if "argmax" in n or "detach" in n}
    assert untouched and not untouched & set(clock.backward_s)
    assert {n for n in clock.backward_s if n.startswith(("a", "b"))}


def test_a_calibration_times_every_operation_of_the_plan_and_keeps_the_times_in_its_cache(tmp_path):
    model = InceptionBlock()
    micro = torch.randn(2, 6, 8, 8)
    planned = planning.plan_model(model, (micro,), {}, ["cpu", "cpu"], chunks=4, profile_cache=tmp_path,
                                  progress=False, rebalance_rounds=0)
    plan = planned.plan
    timed = plan.calibration["operations"]
    inputs = {n.name for n in planned.graph.graph_module.graph.nodes if n.op == "placeholder"}
    assert inputs and set(timed) == {n for s in plan.stages for n in s.nodes} - inputs
    assert all(f >= 0 and b >= 0 for f, b in timed.values()) and sum(f for f, _ in timed.values()) > 0
    (cached,) = tmp_path.glob("calibration-*.json")
    read = calibration.load(tmp_path, cached.stem.removeprefix("calibration-"), plan.num_stages)
    assert read is not None and read.operations == {k: tuple(v) for k, v in timed.items()}


@pytest.mark.slow  # 28 s: two fresh interpreters
def test_freed_cpu_memory_is_kept_for_reuse_by_worker_threads():
    """Worker threads that allocate and free activations fault them in again every step unless
    malloc keeps what was freed: counted in page faults, which do not depend on the machine's load."""
    script = textwrap.dedent("""
        import resource, sys, threading
        import torch
        from lightning_antichain.cpu_allocator import keep_freed_memory
        if sys.argv[1] == "kept":
            assert keep_freed_memory()
        def steps():
            for i in range(30):
                held = [torch.ones(1 << 18 + (i + k) % 5) for k in range(8)]  # 1-16 MiB each
                del held
        for _ in range(3):  # the first rounds may fault their memory in once
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            worker = threading.Thread(target=steps)
            worker.start()
            worker.join()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    faults = {}
    for mode in ("kept", "default"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
        faults[mode] = int(done.stdout.split()[-1])
    assert faults["kept"] * 5 < faults["default"], faults
